"""The model families of tigon_torch.patch beyond test_patch.py's (MoE, OLMo, Granite, GLM-4, GPT-OSS,
SmolLM3, Falcon-H1, Llama 4, the Qwen vision-language models, Phi, Nemotron, Gemma 3 multimodal):
what each patch replaces and what it leaves on Hugging Face's code (on any machine), the patched
model against the unpatched one (loss, every parameter's gradient, the tigon functions each patched
module ran), AutoTigonForCausalLM / apply_tigon_to_model dispatch, and each apply function's signature
against Liger-Kernel's."""

from __future__ import annotations

import collections
import copy
import importlib
import inspect
from dataclasses import dataclass, field

import pytest
import torch

from conftest import DEVICE, assert_rel

import tigon_torch as tt
from tigon_torch import functions, ops, patch

transformers = pytest.importorskip("transformers")

VOCAB = 256
_TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_MROPE = dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])  # 16 / 2 = 2 + 3 + 3
_QWEN_VISION_TOKENS = dict(image_token_id=VOCAB - 1, video_token_id=VOCAB - 2, vision_start_token_id=VOCAB - 3)


@dataclass(frozen=True)
class Case:
    """A tiny random model of one family: config class and kwargs (sub-configs for the multimodal
    ones), model class, whether the batch carries an image."""

    family: str
    config: str
    model: str
    kwargs: dict = field(default_factory=dict)
    image: str | None = None  # "qwen2_vl" / "gemma3": the batch has one image per sample


CASES = {c.family: c for c in [
    Case("mixtral", "MixtralConfig", "MixtralForCausalLM",
         dict(_TEXT, head_dim=16, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True)),
    Case("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
         dict(_TEXT, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, mlp_only_layers=[1],
              output_router_logits=True)),
    Case("olmo2", "Olmo2Config", "Olmo2ForCausalLM", dict(_TEXT)),
    Case("olmo3", "Olmo3Config", "Olmo3ForCausalLM", dict(_TEXT, sliding_window=8)),
    Case("granite", "GraniteConfig", "GraniteForCausalLM",
         dict(_TEXT, embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0)),
    Case("glm4", "Glm4Config", "Glm4ForCausalLM", dict(_TEXT, head_dim=16)),
    Case("gpt_oss", "GptOssConfig", "GptOssForCausalLM",
         dict(_TEXT, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
              output_router_logits=True, rope_parameters=dict(rope_type="default", rope_theta=150000.0))),
    Case("smollm3", "SmolLM3Config", "SmolLM3ForCausalLM", dict(_TEXT)),
    Case("falcon_h1", "FalconH1Config", "FalconH1ForCausalLM",
         dict(_TEXT, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_d_conv=4,
              mamba_n_groups=1, mamba_chunk_size=16, mlp_multipliers=[0.7, 1.3], lm_head_multiplier=0.5,
              embedding_multiplier=2.0, key_multiplier=0.8)),
    Case("llama4", "Llama4TextConfig", "Llama4ForCausalLM",
         dict(_TEXT, intermediate_size=64, head_dim=16, intermediate_size_mlp=128, num_local_experts=4,
              num_experts_per_tok=1, interleave_moe_layer_step=2, use_qk_norm=True)),
    Case("qwen2_vl", "Qwen2VLConfig", "Qwen2VLForConditionalGeneration",
         dict(text_config=dict(_TEXT, rope_parameters=_MROPE),
              vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                                 spatial_merge_size=2, temporal_patch_size=2),
              **_QWEN_VISION_TOKENS), image="qwen2_vl"),
    Case("qwen2_5_vl", "Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration",
         dict(text_config=dict(_TEXT, rope_parameters=_MROPE),
              vision_config=dict(depth=1, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2,
                                 patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                                 fullatt_block_indexes=[0]),
              **_QWEN_VISION_TOKENS)),
    Case("qwen3_vl", "Qwen3VLConfig", "Qwen3VLForConditionalGeneration",
         dict(text_config=dict(_TEXT, head_dim=16, rope_parameters=dict(_MROPE, mrope_interleaved=True)),
              vision_config=dict(depth=1, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2,
                                 patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                                 deepstack_visual_indexes=[0], num_position_embeddings=16),
              **_QWEN_VISION_TOKENS)),
    Case("phi", "PhiConfig", "PhiForCausalLM",
         dict(_TEXT, partial_rotary_factor=0.5, qk_layernorm=True, resid_pdrop=0.0, embd_pdrop=0.0)),
    Case("nemotron", "NemotronConfig", "NemotronForCausalLM", dict(_TEXT, head_dim=16, partial_rotary_factor=0.5)),
    Case("gemma3", "Gemma3Config", "Gemma3ForConditionalGeneration",
         dict(text_config=dict(_TEXT, head_dim=16, query_pre_attn_scalar=16, sliding_window=16),
              vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 image_size=28, patch_size=14),
              mm_tokens_per_image=4, image_token_index=VOCAB - 1, boi_token_index=VOCAB - 2, eoi_token_index=VOCAB - 3),
         image="gemma3"),
]}

FAMILIES = list(CASES)


def _classes(case: Case):
    cfg_cls, model_cls = getattr(transformers, case.config, None), getattr(transformers, case.model, None)
    if cfg_cls is None or model_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {case.config} / {case.model}")
    try:
        importlib.import_module(patch._FAMILIES[case.family].module)
    except ImportError as e:
        pytest.skip(f"transformers {transformers.__version__}: {e}")
    return cfg_cls, model_cls


def build(family: str, dtype=torch.float32, device="cpu", seed=0, experts=None):
    case = CASES[family]
    cfg_cls, model_cls = _classes(case)
    cfg = cfg_cls(**copy.deepcopy(case.kwargs))
    for c in (cfg, getattr(cfg, "text_config", None), getattr(cfg, "vision_config", None)):
        if c is not None:
            c._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(cfg)
    if family == "gemma3":
        with torch.no_grad():  # a projection of zeros (its initialisation) would hide the vision tower
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.1)
    if experts is not None:
        model.set_experts_implementation(experts)
    return model.to(device=device, dtype=dtype)


def pair(family, dtype=torch.float32, device="cpu", experts=None):
    ref = build(family, dtype, device, experts=experts)
    model = build(family, dtype, device, experts=experts)
    model.load_state_dict(ref.state_dict())
    return ref, model


def batch(family, device="cpu", dtype=torch.float32, seed=0):
    """(inputs, labels): 2 x 12 tokens, the first three unlabelled; with an image per sample where the
    case says so."""
    case = CASES[family]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB - 3, (2, 12), generator=g)
    inputs = {}
    if case.image == "qwen2_vl":  # a 2 x 2 patch grid merged into one image token, after vision_start
        ids[:, 1], ids[:, 2] = VOCAB - 3, VOCAB - 1
        inputs["pixel_values"] = torch.randn(8, 3 * 2 * 14 * 14, generator=g).to(device, dtype)
        inputs["image_grid_thw"] = torch.tensor([[1, 2, 2], [1, 2, 2]], device=device)
        params = inspect.signature(getattr(transformers, case.model).forward).parameters
        if "mm_token_type_ids" in params:
            inputs["mm_token_type_ids"] = (ids == VOCAB - 1).int().to(device)
    elif case.image == "gemma3":  # 4 image tokens per sample
        ids = torch.cat([torch.full((2, 4), VOCAB - 1), ids[:, 4:]], dim=1)
        inputs["pixel_values"] = torch.randn(2, 3, 28, 28, generator=g).to(device, dtype)
        inputs["token_type_ids"] = (ids == VOCAB - 1).long().to(device)  # image tokens (transformers 5.0 asks)
    labels = ids.clone()
    labels[:, :3] = -100
    inputs["input_ids"] = ids.to(device)
    return inputs, labels.to(device)


def _mod(family):
    spec = patch._FAMILIES[family]
    return spec, importlib.import_module(spec.module)


def _forwards(model, *funcs):
    """The modules whose forward is one of funcs: bound on the instance, or the class's forward of a
    tigon subclass an instance was given (the text model's norms under transformers' kernel hooks)."""
    return [m for m in model.modules() if ("forward" in m.__dict__ or type(m).__name__.startswith("Tigon"))
            and getattr(m.forward, "__func__", None) in funcs]


_NORM = (patch._rms_norm_forward,)
_LN = (patch._layer_norm_forward,)
_GATED = (patch._gated_mlp_forward, patch._scaled_gated_mlp_forward)
_GATE_UP = (patch._fused_gate_up_mlp_forward,)
_EXPERTS = (patch._routed_experts_forward, patch._bmm_experts_forward)
_RELU2 = (patch._relu2_mlp_forward,)


# What each family's default patch replaces: (RMSNorm, gated MLP, fused gate_up MLP, experts, LayerNorm,
# RoPE, squared-ReLU MLP); anything else stays on Hugging Face's code.
EXPECTED = {
    "mixtral": dict(norm=True, experts=True, rope=True),
    "qwen3_moe": dict(norm=True, gated=True, experts=True, rope=True),
    "olmo2": dict(norm=True, gated=True, rope=True),
    "olmo3": dict(norm=True, gated=True, rope=True),
    "granite": dict(norm=True, gated=True, rope=True),
    "glm4": dict(norm=True, gate_up=True),  # rope=False by default, as in Liger
    "gpt_oss": dict(norm=True, rope=True),  # clamped expert gate: Hugging Face's
    "smollm3": dict(norm=True, gated=True, rope=True),
    "falcon_h1": dict(norm=True, gated=True, rope=True),
    "llama4": dict(norm=True, gated=True, experts=True, rope=True),
    "qwen2_vl": dict(norm=True, gated=True, rope=True),
    "qwen2_5_vl": dict(norm=True, gated=True, rope=True),
    "qwen3_vl": dict(norm=True, rope=True),  # swiglu=False by default, as in Liger
    "phi": dict(ln=True, rope=True),  # GELU MLP (not gated): Hugging Face's
    "nemotron": dict(ln=True, rope=True, relu2=True),
    "gemma3": dict(norm=True, gated=True, ln=True, rope=True),
}


def _check_patched(family, model, switches=None):
    want = dict(EXPECTED[family], **(switches or {}))
    assert bool(_forwards(model, *_NORM)) == want.get("norm", False)
    assert bool(_forwards(model, *_GATED)) == want.get("gated", False)
    assert bool(_forwards(model, *_GATE_UP)) == want.get("gate_up", False)
    assert bool(_forwards(model, *_EXPERTS)) == want.get("experts", False)
    assert bool(_forwards(model, *_LN)) == want.get("ln", False)
    assert bool(_forwards(model, *_RELU2)) == want.get("relu2", False)


def _rope_name(spec):
    """The modeling module's function the family's rope patch replaces (apply_rotary_pos_emb for the
    families without one, whose function must stay Hugging Face's)."""
    return patch.rope_function_name(spec, importlib.import_module(spec.module)) or "apply_rotary_pos_emb"


def _apply(family):
    return getattr(tt, f"apply_tigon_to_{family}", None) or getattr(patch, f"apply_tigon_to_{family}")


# ------------------------------------------------------------------------------------------------
# Structure (any machine)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_instance_patch(family, monkeypatch):
    monkeypatch.setattr(ops, "on_device", lambda t: t.is_cuda)  # CPU tensors: Hugging Face's code
    spec, mod = _mod(family)
    ref, model = pair(family)
    hf_rope = getattr(mod, _rope_name(spec), None)
    _apply(family)(model=model)
    _check_patched(family, model)
    rope = getattr(mod, _rope_name(spec), None)
    assert (rope is not hf_rope) == EXPECTED[family].get("rope", False)
    if spec.rope == "rotate_half":
        assert rope is tt.tigon_rotary_pos_emb
    defaults = dict(spec.params)
    assert "forward" in model.__dict__
    assert model._tigon_flce == defaults["fused_linear_cross_entropy"] and model._tigon_ce == defaults["cross_entropy"]
    assert inspect.signature(model.forward) == inspect.signature(ref.forward)  # Hugging Face's parameters
    assert not any("forward" in m.__dict__ for m in ref.modules())  # another instance is left alone

    # On the CPU every patched forward falls back to Hugging Face's code: identical results.
    inputs, labels = batch(family)
    model.train(), ref.train()
    out, want = model(**inputs, labels=labels), ref(**inputs, labels=labels)
    torch.testing.assert_close(out.loss, want.loss)
    torch.testing.assert_close(out.logits, want.logits)
    assert isinstance(model(**inputs, labels=labels, return_dict=False), tuple)

    tt.unpatch()
    assert getattr(mod, _rope_name(spec), None) is hf_rope
    # Instance forwards Hugging Face installs itself on a first call (transformers 5.0's output
    # recorders on the MoE routers) are in the unpatched model too; nothing else may remain.
    hf_own = {name for name, m in ref.named_modules() if "forward" in m.__dict__}
    assert not [name for name, m in model.named_modules() if "forward" in m.__dict__ and name not in hf_own]


@pytest.mark.parametrize("family", FAMILIES)
def test_class_patch(family, monkeypatch):
    monkeypatch.setattr(ops, "on_device", lambda t: t.is_cuda)
    spec, mod = _mod(family)
    lm_cls = getattr(mod, spec.causal_lm[-1] if family == "gemma3" else spec.causal_lm[0])
    lm_forward = lm_cls.forward
    norm = patch._norm_class(mod, spec)
    names = [n for n in (norm.__name__ if norm else None, spec.mlp, spec.experts) if n]
    classes = {n: getattr(mod, n) for n in names}
    ref = build(family)
    _apply(family)()
    assert lm_cls.forward is not lm_forward
    model = build(family)
    if spec.scope is None:
        on = EXPECTED[family]
        if on.get("norm"):
            assert getattr(mod, spec.norm) is not classes[spec.norm]
            norms = [m for m in model.modules() if isinstance(m, classes[spec.norm])]
            assert norms and all(type(m).__name__ == f"Tigon{spec.norm}" for m in norms)
        if on.get("gated") or on.get("gate_up") or on.get("relu2"):
            assert any(type(m).__name__ == f"Tigon{spec.mlp}" for m in model.modules())
        if on.get("experts"):
            assert any(type(m).__name__ == f"Tigon{spec.experts}" for m in model.modules())
        if on.get("ln"):
            assert any(type(m).__name__.startswith("Tigon") and isinstance(m, torch.nn.LayerNorm)
                       for m in model.modules())
    else:  # the text model patched its own modules when built; the classes are Hugging Face's
        assert all(getattr(mod, n) is classes[n] for n in names)
        _check_patched(family, model)
        _check_vision_untouched(family, model)
    model.load_state_dict(ref.state_dict())  # same parameters
    inputs, labels = batch(family)
    model.train(), ref.train()
    torch.testing.assert_close(model(**inputs, labels=labels).loss, ref(**inputs, labels=labels).loss)
    tt.unpatch()
    assert lm_cls.forward is lm_forward and all(getattr(mod, n) is classes[n] for n in names)
    fresh = build(family)
    assert not any(type(m).__name__.startswith("Tigon") or "forward" in m.__dict__ for m in fresh.modules())


def _vision(model):
    return next((m for n, m in model.named_modules() if n.endswith("visual")), None)


def _check_vision_untouched(family, model):
    vision = _vision(model)
    assert vision is not None
    assert not any("forward" in m.__dict__ or type(m).__name__.startswith("Tigon") for m in vision.modules())
    text = model.model.language_model
    assert _forwards(text, *_NORM)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_vision_tower_untouched(family):
    """Qwen2.5-VL's vision blocks use the text model's RMSNorm class: neither patch touches them."""
    model = build(family)
    _apply(family)(model=model, swiglu=True)
    _check_vision_untouched(family, model)
    assert _forwards(model.model.language_model, *_GATED)
    tt.unpatch()
    _apply(family)(swiglu=True)
    _check_vision_untouched(family, build(family))


def test_llama4_vision_layer_norm():
    """Llama 4's layer_norm switch (Liger's): the vision tower's torch.nn.LayerNorm modules; its text
    model patched as Llama4ForCausalLM's."""
    if getattr(transformers, "Llama4ForConditionalGeneration", None) is None:
        pytest.skip("no Llama4ForConditionalGeneration")
    text = dict(CASES["llama4"].kwargs)
    cfg = transformers.Llama4Config(
        text_config=text, image_token_index=VOCAB - 1, pad_token_id=0,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
                           projector_output_dim=64, pixel_shuffle_ratio=0.5))
    model = transformers.Llama4ForConditionalGeneration(cfg)
    tt_apply = _apply("llama4")
    tt_apply(model=model)
    lns = [m for m in model.vision_model.modules() if type(m) is torch.nn.LayerNorm]
    assert lns and all(m.forward.__func__ is patch._layer_norm_forward for m in lns)
    assert _forwards(model.language_model, *_NORM) and _forwards(model.language_model, *_EXPERTS)
    assert "forward" in model.language_model.__dict__  # Llama4ForCausalLM's loss
    assert "forward" not in model.__dict__  # the multimodal model's own loss: Hugging Face's
    tt.unpatch()
    tt_apply(model=model, layer_norm=False)
    assert not _forwards(model, *_LN)


@pytest.mark.parametrize("family,switches,changed", [
    ("gpt_oss", dict(swiglu=True), {}),  # nothing tigon computes: the experts stay Hugging Face's
    ("qwen3_vl", dict(swiglu=True), dict(gated=True)),
    ("glm4", dict(rope=True), dict(rope=True)),  # GLM-4's interleaved pairs
    ("nemotron", dict(relu_squared=False, rope=False, layer_norm=False), dict(ln=False, rope=False, relu2=False)),
    ("phi", dict(layer_norm=False), dict(ln=False)),
    ("falcon_h1", dict(rms_norm=False, swiglu=False), dict(norm=False, gated=False)),
])
def test_switches(family, switches, changed):
    spec, mod = _mod(family)
    hf_rope = getattr(mod, _rope_name(spec), None)
    model = build(family)
    _apply(family)(model=model, **switches)
    _check_patched(family, model, changed)
    want_rope = dict(EXPECTED[family], **changed).get("rope", False)
    assert (getattr(mod, _rope_name(spec), None) is not hf_rope) == want_rope


def test_nemotron_ignores_unknown_switches_as_liger():
    model = build("nemotron")
    tt_apply = _apply("nemotron")
    tt_apply(model=model, rms_norm=True, swiglu=True)  # Liger's **kwargs: accepted, nothing more patched
    _check_patched("nemotron", model)


def test_errors():
    with pytest.raises(ValueError):
        _apply("mixtral")(cross_entropy=True, fused_linear_cross_entropy=True)
    with pytest.raises(TypeError):
        _apply("mixtral")(geglu=True)
    with pytest.raises(TypeError):
        _apply("phi")(swiglu=True)


# ------------------------------------------------------------------------------------------------
# Dispatch: apply_tigon_to_model, AutoTigonForCausalLM
# ------------------------------------------------------------------------------------------------


def _auto():
    return getattr(tt, "AutoTigonForCausalLM", None) or patch.AutoTigonForCausalLM


def _apply_to_model():
    return getattr(tt, "apply_tigon_to_model", None) or patch.apply_tigon_to_model


@pytest.mark.parametrize("family", FAMILIES)
def test_apply_tigon_to_model_dispatch(family):
    model = build(family)
    _apply_to_model()(model)
    _check_patched(family, model)
    assert "forward" in model.__dict__


def _tiny_gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64,
                                                                n_positions=32))


def test_unsupported_model_type_names_the_supported_ones():
    with pytest.raises(NotImplementedError, match=r"'gpt2'.*supported: .*llama.*mixtral.*qwen3_moe"):
        _apply_to_model()(_tiny_gpt2())
    with pytest.raises(NotImplementedError, match="supported"):
        _auto().from_config(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64))
    tt._apply_tigon("gpt2")  # Liger's _apply_liger_kernel: logged, nothing patched


def test_auto_from_config():
    cfg = transformers.MixtralConfig(**CASES["mixtral"].kwargs)
    model = _auto().from_config(cfg, swiglu=False, fused_mlp=False, geglu=True)  # geglu: not Mixtral's, dropped
    names = {type(m).__name__ for m in model.modules()}
    assert "TigonMixtralRMSNorm" in names and "TigonMixtralExperts" not in names
    assert type(model).forward is not None and hasattr(type(model), "_tigon_flce")
    tt.unpatch()
    assert not any(type(m).__name__.startswith("Tigon") for m in build("mixtral").modules())


def test_auto_from_pretrained(tmp_path, monkeypatch):
    monkeypatch.setattr(ops, "on_device", lambda t: t.is_cuda)
    ref = build("qwen3_moe")
    ref.save_pretrained(tmp_path)
    model = _auto().from_pretrained(str(tmp_path), rope=False, fused_mlp=False)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    mlps = [m for m in model.modules() if type(m).__name__ == "TigonQwen3MoeMLP"]
    assert mlps and all(not m._tigon_fused_mlp for m in mlps)
    assert any(type(m).__name__ == "TigonQwen3MoeExperts" for m in model.modules())
    _, mod = _mod("qwen3_moe")
    assert mod.apply_rotary_pos_emb is not tt.tigon_rotary_pos_emb
    for (name, p), q in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(p, q, msg=name)


def test_model_types_match_liger():
    """Every model type Liger maps that tigon patches goes to the same family."""
    mp = pytest.importorskip("liger_kernel.transformers.monkey_patch")
    liger = mp.MODEL_TYPE_TO_APPLY_LIGER_FN
    ours = patch.MODEL_TYPE_TO_APPLY_FN
    for model_type, fn in ours.items():
        if model_type == "phi":
            assert model_type not in liger
            continue
        assert model_type in liger, model_type
        assert liger[model_type].__name__.removeprefix("apply_liger_kernel_to_") == \
            fn.__name__.removeprefix("apply_tigon_to_"), model_type


# ------------------------------------------------------------------------------------------------
# Signatures against Liger-Kernel 0.8.2's apply_liger_kernel_to_<family>
# ------------------------------------------------------------------------------------------------

R = inspect.Parameter.empty
_STD = [("rope", True), ("cross_entropy", False), ("fused_linear_cross_entropy", True), ("rms_norm", True),
        ("swiglu", True), ("model", None)]


def _std(**changed):
    return [(n, changed.get(n, d)) for n, d in _STD]


# Liger's parameters (written out from Liger-Kernel 0.8.2), then tigon's keyword-only ones, and whether a
# **kwargs ends the signature.
LIGER = {
    "mixtral": (_std(), [("fused_mlp", True), ("fused_add_norm", True)], False),
    "qwen3_moe": (_std(), [("fused_mlp", True), ("fused_add_norm", True)], False),
    "olmo2": (_std(), [("fused_mlp", True)], False),
    "olmo3": (_std(), [("fused_mlp", True)], False),
    "granite": (_std(cross_entropy=True, fused_linear_cross_entropy=False), [("fused_mlp", True)], False),
    "glm4": (_std(rope=False), [("fused_mlp", True)], False),
    "gpt_oss": (_std(swiglu=False), [("fused_mlp", True)], False),
    "smollm3": (_std(), [("fused_mlp", True), ("fused_add_norm", True)], False),
    "falcon_h1": (_std(), [("fused_mlp", True)], False),
    "llama4": (_std() + [("layer_norm", True)], [("fused_mlp", True)], False),
    "qwen2_vl": (_STD[:4] + [("layer_norm", True), ("swiglu", True), ("model", None)], [("fused_mlp", True)], False),
    "qwen2_5_vl": (_std(), [("fused_mlp", True)], False),
    "qwen3_vl": (_std(swiglu=False), [("fused_mlp", True)], False),
    "nemotron": ([("relu_squared", True), ("cross_entropy", False), ("fused_linear_cross_entropy", True),
                  ("model", None)], [("rope", True), ("layer_norm", True)], True),
}
# Phi has no Liger function: tigon's own.
PHI = [("rope", True), ("cross_entropy", False), ("fused_linear_cross_entropy", True), ("layer_norm", True),
       ("model", None)]


def _split(fn):
    ps = list(inspect.signature(fn).parameters.values())
    pos = [(p.name, p.default) for p in ps if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    kw = [(p.name, p.default) for p in ps if p.kind is inspect.Parameter.KEYWORD_ONLY]
    var_kw = bool(ps) and ps[-1].kind is inspect.Parameter.VAR_KEYWORD
    other = [p for p in ps if p.kind not in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY,
                                             inspect.Parameter.VAR_KEYWORD)]
    assert not other, f"{fn.__name__}: unexpected parameters {other}"
    assert [p.kind for p in ps] == sorted((p.kind for p in ps), key=int), f"{fn.__name__}: parameter order"
    return pos, kw, var_kw


def _same(got, want):
    assert [n for n, _ in got] == [n for n, _ in want]
    for (n, g), (_, w) in zip(got, want):
        assert type(g) is type(w) and g == w, f"{n}: {g!r} != {w!r}"


@pytest.mark.parametrize("family", sorted(LIGER))
def test_signature_matches_liger(family):
    liger, extras, var_kw = LIGER[family]
    pos, kw, has_var_kw = _split(_apply(family))
    _same(pos, liger)
    _same(kw, extras)
    assert has_var_kw == var_kw


@pytest.mark.parametrize("family", sorted(LIGER))
def test_signature_matches_installed_liger(family):
    mp = pytest.importorskip("liger_kernel.transformers.monkey_patch")
    live = getattr(mp, f"apply_liger_kernel_to_{family}", None)
    if live is None:
        pytest.fail(f"apply_liger_kernel_to_{family} is not in the installed liger_kernel")
    liger_pos, liger_kw, liger_var_kw = _split(live)
    assert not liger_kw
    pos, _, var_kw = _split(_apply(family))
    _same(pos, liger_pos)
    assert var_kw == liger_var_kw
    from importlib import metadata

    try:
        version = metadata.version("liger-kernel")
    except metadata.PackageNotFoundError:
        version = None
    if version == "0.8.2":
        _same(liger_pos, LIGER[family][0])


def test_phi_signature():
    pos, kw, var_kw = _split(_apply("phi"))
    _same(pos, PHI)
    assert kw == [] and not var_kw
    mp = pytest.importorskip("liger_kernel.transformers.monkey_patch")
    assert not hasattr(mp, "apply_liger_kernel_to_phi")


# ------------------------------------------------------------------------------------------------
# With the operators (GPU, or the CPU reference mode): the patched model against Hugging Face's
# ------------------------------------------------------------------------------------------------

_COUNTED = {
    "rope": functions.TigonRopeFunction,
    "rope_interleaved": functions.TigonInterleavedRopeFunction,
    "rope_mrope": functions.TigonQwen2VLMRopeFunction,
    "gate_up": functions.TigonFusedGateUpMulFunction,
    "relu2": functions.TigonReLUSquaredFunction,
    "gated_mlp": functions.TigonGatedMLPFunction,
    "flce": functions.TigonFusedLinearCrossEntropyFunction,
    "ce": functions.TigonCrossEntropyFP32Function,
}


# The norms and the gated product are counted where their callers reach them (functions.rms_norm,
# add_rms_norm, layer_norm and gated, which take the C++ or the Python autograd functions).
_ROUTED = {
    "rms_norm": [(tt.functional, "_rms_norm"), (tt.modules, "_rms_norm")],
    "add_rms_norm": [(tt.functional, "_add_rms_norm")],
    "layer_norm": [(tt.functional, "_layer_norm"), (tt.modules, "_layer_norm")],
    "gated_mul": [(tt.functional, "_gated"), (tt.modules, "_gated"), (patch, "_gated")],
}


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls of tigon's autograd functions (by every caller)."""
    counts = collections.Counter()
    for name, cls in _COUNTED.items():
        real = cls.apply

        def counted(*args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(cls, "apply", staticmethod(counted))
    for name, places in _ROUTED.items():
        for module, attr in places:
            real = getattr(module, attr)

            def counted(*args, _real=real, _name=name, **kwargs):
                counts[_name] += 1
                return _real(*args, **kwargs)

            monkeypatch.setattr(module, attr, counted)
    return counts


# (family, switches, experts implementation)
RUNS = [(f, {}, None) for f in FAMILIES] + [
    ("mixtral", {}, "eager"),
    ("qwen3_moe", dict(fused_mlp=False), "eager"),
    ("granite", dict(cross_entropy=False, fused_linear_cross_entropy=True), None),  # logits_scaling in the fused loss
    ("gpt_oss", dict(swiglu=True), None),
    ("qwen3_vl", dict(swiglu=True), None),
    ("falcon_h1", dict(cross_entropy=True, fused_linear_cross_entropy=False), None),
    ("glm4", dict(rope=True), None),  # interleaved pairs of a partial rotary slice
]


def _run_id(run):
    family, switches, experts = run
    return "-".join([family] + [f"{k}={v}" for k, v in switches.items()] + ([experts] if experts else []))


def _expected_calls(family, model, switches):
    """The tigon calls one forward of the patched model makes: each patched module runs once."""
    spec = patch._FAMILIES[family]
    fused = switches.get("fused_mlp", True)
    n = collections.Counter()
    n["rms_norm"] = len(_forwards(model, *_NORM))
    # fused_add_norm: a layer's post-attention norm runs inside its add, and so does the norm it is
    # linked to (the next layer's first norm, or the final norm) inside the layer's last add.
    for m in _forwards(model, patch._decoder_forward):
        linked = m.__dict__.get("_tigon_next_norm") is not None
        n["add_rms_norm"] += 1 + linked
        n["rms_norm"] -= 1 + linked
    n["layer_norm"] = len(_forwards(model, *_LN))
    for m in _forwards(model, *_GATED):
        plain = all(getattr(m, p).bias is None for p in ("gate_proj", "up_proj", "down_proj"))
        scaled = m.forward.__func__ is patch._scaled_gated_mlp_forward and float(m.gate_multiplier) != 1.0
        n["gated_mlp" if fused and plain and not scaled and m._tigon_fused_mlp else "gated_mul"] += 1
    n["gate_up"] = len(_forwards(model, *_GATE_UP)) + len(_forwards(model, *_EXPERTS))
    n["relu2"] = len(_forwards(model, *_RELU2))
    loss = "fused_linear_cross_entropy" if switches.get("fused_linear_cross_entropy", dict(
        spec.params).get("fused_linear_cross_entropy")) else "cross_entropy"
    if patch._hf_loss_kind(patch._pre_tigon(type(model).forward)) != "own":  # else Hugging Face's loss runs
        n["flce" if loss == "fused_linear_cross_entropy" else "ce"] = 1
    return n


@pytest.mark.gpu
@pytest.mark.parametrize("run", RUNS, ids=_run_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_patched_model_matches_hf(ext, seed, calls, run, dtype):
    family, switches, experts = run
    ref, model = pair(family, dtype, DEVICE, experts=experts)
    _apply(family)(model=model, **switches)
    inputs, labels = batch(family, DEVICE, dtype)
    ref.train(), model.train()
    want = ref(**inputs, labels=labels)
    calls.clear()
    out = model(**inputs, labels=labels)
    got = dict(calls)

    expected = _expected_calls(family, model, switches)
    fused_loss = expected["flce"] == 1
    assert (out.logits is None) == fused_loss
    for name in ("rms_norm", "add_rms_norm", "layer_norm", "gated_mlp", "gated_mul", "relu2", "flce", "ce"):
        assert got.get(name, 0) == expected[name], f"{name}: {got}"
    if any(m.forward.__func__ is patch._routed_experts_forward for m in _forwards(model, *_EXPERTS)) and \
            experts == "eager":
        assert got.get("gate_up", 0) >= expected["gate_up"], got  # one call per expert hit
    else:
        assert got.get("gate_up", 0) == expected["gate_up"], got
    rope_on = switches.get("rope", dict(patch._FAMILIES[family].params + patch._FAMILIES[family].extras).get("rope"))
    ropes = got.get("rope", 0) + got.get("rope_interleaved", 0) + got.get("rope_mrope", 0)
    assert (ropes > 0) == bool(rope_on and patch._FAMILIES[family].rope), got

    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.loss.float(), want.loss.float(), atol=tol, rtol=tol)
    if getattr(want, "aux_loss", None) is not None:
        torch.testing.assert_close(out.aux_loss, want.aux_loss)
    want.loss.backward()
    out.loss.backward()
    # A gradient zero up to rounding in exact arithmetic (an attention's key bias: softmax does not see
    # it) is compared as zero: below 1e-6 (fp32; bf16: 1e-4) of the largest gradient's norm in both.
    largest = max(float(q.grad.float().norm()) for q in ref.parameters() if q.grad is not None)
    floor = (1e-6 if dtype == torch.float32 else 1e-4) * largest
    checked = 0
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), f"{family}: {name} has a gradient Hugging Face's has not"
            continue
        assert p.grad is not None, f"{family}: no gradient for {name}"
        if float(q.grad.float().norm()) <= floor:
            assert float(p.grad.float().norm()) <= 10 * floor, f"{family} grad {name}: {float(p.grad.norm()):.3e}"
            continue
        assert_rel(p.grad, q.grad, dtype, factor=10.0, what=f"{family} grad {name}")
        checked += 1
    assert checked > 0

    # num_items_in_batch: the sum divided by the count, as Hugging Face's loss does.
    n = torch.tensor(17, device=DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs, labels=labels, num_items_in_batch=n).loss.float(),
                                   ref(**inputs, labels=labels, num_items_in_batch=n).loss.float(), atol=tol, rtol=tol)
        # Inference: the logits as Hugging Face computes them (multipliers, softcap included).
        model.eval(), ref.eval()
        lo, lr = model(**inputs).logits, ref(**inputs).logits
    assert_rel(lo, lr, dtype, factor=10.0, what=f"{family} logits")


@pytest.mark.gpu
def test_shift_labels_and_return_tuple(ext, seed):
    ref, model = pair("mixtral", torch.float32, DEVICE)
    _apply("mixtral")(model=model)
    inputs, labels = batch("mixtral", DEVICE)
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    ref.train(), model.train()
    out = model(**inputs, shift_labels=shift, labels=labels)
    want = ref(**inputs, labels=labels)
    torch.testing.assert_close(out.loss, want.loss, atol=1e-4, rtol=1e-4)
    tup = model(**inputs, labels=labels, return_dict=False)
    assert isinstance(tup, tuple)
    torch.testing.assert_close(tup[0], want.loss, atol=1e-4, rtol=1e-4)

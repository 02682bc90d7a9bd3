"""apply_tigon_to_<family>: what gets replaced (on any machine), and a patched model against the
unpatched one on a CUDA device (loss, gradients, logits, num_items_in_batch, gradient checkpointing)."""

from __future__ import annotations

import importlib

import pytest
import torch

from conftest import DEVICE, assert_rel
from models import FAMILIES, build_model

import tigon_torch as tt
from tigon_torch import ops, patch

pytest.importorskip("transformers")


def _apply_fn(family):
    return getattr(tt, f"apply_tigon_to_{family}")


def _spec(family):
    spec = patch._FAMILIES[family]
    return spec, importlib.import_module(spec.module)


def _ids(vocab, batch=2, seq=12, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(3, vocab, (batch, seq), generator=g).to(device)


# ------------------------------------------------------------------------------------------------
# Structure (any machine): the right classes and forwards are replaced, and unpatch() restores them
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_instance_patch_replaces_forwards(family, monkeypatch):
    monkeypatch.setattr(ops, "on_device", lambda t: t.is_cuda)  # CPU tensors: Hugging Face's code
    spec, mod = _spec(family)
    ref = build_model(family, vocab=256)
    model = build_model(family, vocab=256)
    model.load_state_dict(ref.state_dict())
    original_rope = mod.apply_rotary_pos_emb
    _apply_fn(family)(model=model)

    norms = [m for m in model.modules() if type(m).__name__ == spec.norm]
    mlps = [m for m in model.modules() if type(m).__name__ == spec.mlp]
    assert norms and all(m.forward.__func__ is patch._rms_norm_forward for m in norms)
    assert all(m._tigon_offset == spec.offset and m._tigon_casting == spec.casting for m in norms)
    assert all(m._tigon_in_place == spec.norm_in_place for m in norms)
    want_mlp = patch._fused_gate_up_mlp_forward if spec.fused_gate_up else patch._gated_mlp_forward
    assert mlps and all(m.forward.__func__ is want_mlp for m in mlps)
    assert patch._mlp_kind(mlps[0]) == ("gelu_tanh" if spec.casting == "gemma" else "silu")
    assert mod.apply_rotary_pos_emb is tt.tigon_rotary_pos_emb
    assert "forward" in model.__dict__ and model._tigon_flce and not model._tigon_ce
    assert "forward" not in ref.__dict__  # another instance is left alone
    layers = list(model.model.layers)
    if spec.decoder is not None:  # each layer's residual adds fused with the norm after it
        assert all(m.forward.__func__ is patch._decoder_forward for m in layers)
        nexts = [m._tigon_next_norm() for m in layers]
        assert nexts == [m.input_layernorm for m in layers[1:]] + [model.model.norm]
    else:
        assert not any("_tigon_next_norm" in m.__dict__ or "forward" in m.__dict__ for m in layers)

    # On the CPU every patched forward falls back to Hugging Face's code: identical results.
    ids = _ids(256)
    model.train(), ref.train()
    out, want = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.logits, want.logits)
    torch.testing.assert_close(out.loss, want.loss)
    n = torch.tensor(9)
    torch.testing.assert_close(model(input_ids=ids, labels=ids, num_items_in_batch=n).loss,
                               ref(input_ids=ids, labels=ids, num_items_in_batch=n).loss)
    assert isinstance(model(input_ids=ids, labels=ids, return_dict=False), tuple)

    tt.unpatch()
    assert mod.apply_rotary_pos_emb is original_rope
    assert "forward" not in model.__dict__
    assert all("forward" not in m.__dict__ for m in norms + mlps + layers)
    assert not any("_tigon_next_norm" in m.__dict__ for m in layers)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_class_patch_before_build(family, monkeypatch):
    monkeypatch.setattr(ops, "on_device", lambda t: t.is_cuda)
    spec, mod = _spec(family)
    norm_cls, mlp_cls = getattr(mod, spec.norm), getattr(mod, spec.mlp)
    lm_cls = getattr(mod, spec.causal_lm[0])
    lm_forward = lm_cls.forward
    decoder_cls = getattr(mod, spec.decoder) if spec.decoder else None
    decoder_forward = decoder_cls.forward if decoder_cls else None
    ref = build_model(family, vocab=256)
    _apply_fn(family)()
    assert getattr(mod, spec.norm) is not norm_cls and issubclass(getattr(mod, spec.norm), norm_cls)
    assert issubclass(getattr(mod, spec.mlp), mlp_cls)
    assert lm_cls.forward is not lm_forward
    model = build_model(family, vocab=256)
    assert all(type(m).__name__ == f"Tigon{spec.norm}" for m in model.modules() if isinstance(m, norm_cls))
    assert any(type(m).__name__ == f"Tigon{spec.mlp}" for m in model.modules())
    if decoder_cls is not None:  # the layer's forward, and the text model links the layers it builds
        assert decoder_cls.forward is patch._decoder_forward
        layers = list(model.model.layers)
        assert [m._tigon_next_norm() for m in layers] == [m.input_layernorm for m in layers[1:]] + [model.model.norm]
    model.load_state_dict(ref.state_dict())  # same parameters
    ids = _ids(256)
    torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    tt.unpatch()
    assert getattr(mod, spec.norm) is norm_cls and getattr(mod, spec.mlp) is mlp_cls
    assert lm_cls.forward is lm_forward
    if decoder_cls is not None:
        assert decoder_cls.forward is decoder_forward
        assert not any("_tigon_next_norm" in m.__dict__ for m in build_model(family, vocab=256).model.layers)
    assert not any(type(m).__name__.startswith("Tigon") for m in build_model(family, vocab=256).modules())


def test_switches_and_errors():
    model = build_model("llama", vocab=256)
    tt.apply_tigon_to_llama(rope=False, rms_norm=False, swiglu=True, fused_linear_cross_entropy=False, model=model)
    spec, mod = _spec("llama")
    assert mod.apply_rotary_pos_emb is not tt.tigon_rotary_pos_emb
    assert "forward" not in model.model.norm.__dict__
    assert "forward" in model.model.layers[0].mlp.__dict__
    assert "forward" not in model.__dict__
    with pytest.raises(ValueError):
        tt.apply_tigon_to_llama(cross_entropy=True, fused_linear_cross_entropy=True)
    tt.apply_tigon_to_model(model)  # the family from config.model_type
    assert "forward" in model.__dict__
    with pytest.raises(NotImplementedError):
        tt.apply_tigon_to_model(torch.nn.Linear(2, 2))


# ------------------------------------------------------------------------------------------------
# transformers' kernel hooks (any machine; transformers with a kernels package it uses)
# ------------------------------------------------------------------------------------------------


def _hooks_usable():
    """transformers re-kernelizes its models on mode changes (PreTrainedModel.kernels_mode) with a
    kernels package it uses, and Llama's RMSNorm carries the hook."""
    try:
        from transformers import PreTrainedModel
        from transformers.utils.import_utils import is_kernels_available
    except ImportError:
        return False
    return (is_kernels_available() and hasattr(PreTrainedModel, "kernels_mode")
            and hasattr(patch._class(_spec("llama")[1], "LlamaRMSNorm"), "kernel_layer_name"))


hooks = pytest.mark.skipif(not _hooks_usable(), reason="transformers that does not re-kernelize its models")


def _counting_norm(monkeypatch):
    """tigon's norm entry point replaced by Llama's RMSNorm math that counts its calls, with every
    tensor taken as on the device: whether the patched forward ran, on any machine."""
    calls = [0]

    def rms(x, w, eps, offset, casting, in_place):
        calls[0] += 1
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    monkeypatch.setattr(patch.F, "tigon_rms_norm", rms)
    monkeypatch.setattr(ops, "on_device", lambda t: True)
    return calls


def _saved(tmp_path, family="llama"):
    build_model(family, vocab=256).save_pretrained(tmp_path)
    return tmp_path


@hooks
def test_kernel_hooks_keep_an_instance_patch(tmp_path, monkeypatch):
    """from_pretrained kernelizes the model, and every mode change (train(), eval()) kernelizes it
    again, resetting forwards bound on instances: the patched model's mapping sends the norm hook to
    tigon's layer, so the norms stay tigon's through every re-kernelization."""
    import kernels
    from transformers import AutoModelForCausalLM

    from tigon_torch import kernel_hooks

    path = _saved(tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.use_kernels  # transformers kernelized it
    tt.apply_tigon_to_llama(model=model, rope=False, swiglu=False, fused_linear_cross_entropy=False,
                            fused_add_norm=False)
    norms = [m for m in model.modules() if type(m).__name__ == "LlamaRMSNorm"]
    calls = _counting_norm(monkeypatch)
    ids = _ids(256)
    for step in (model.train, model.eval, model.train):
        step()
        assert all(m.forward.__func__ is patch._rms_norm_forward for m in norms)
        layers = kernels.get_kernelized_layers(model).layers
        assert all(layers[n].repo is kernel_hooks.REPOSITORY for n, m in model.named_modules() if m in norms)
        before = calls[0]
        torch.testing.assert_close(model(input_ids=ids).logits, ref.train(model.training)(input_ids=ids).logits)
        assert calls[0] - before == len(norms)  # every norm ran tigon's forward

    tt.unpatch()
    model.eval()
    assert model.kernel_config is None
    assert all(m.forward.__func__ is type(m).forward for m in norms)
    before = calls[0]
    model(input_ids=ids)
    assert calls[0] == before


@hooks
def test_kernel_hooks_leave_class_patched_norms(tmp_path, monkeypatch):
    """Classes patched before from_pretrained: kernelize (at load and on every mode change) leaves
    tigon's norm subclass alone instead of binding the mapping's RMSNorm over it."""
    from transformers import AutoModelForCausalLM

    path = _saved(tmp_path)
    tt.apply_tigon_to_llama(rope=False, swiglu=False, fused_linear_cross_entropy=False, fused_add_norm=False)
    model = AutoModelForCausalLM.from_pretrained(path)
    norms = [m for m in model.modules() if type(m).__name__ == "TigonLlamaRMSNorm"]
    assert norms and model.use_kernels
    calls = _counting_norm(monkeypatch)
    for step in (model.train, model.eval):
        step()
        assert not any("forward" in m.__dict__ for m in norms)
        before = calls[0]
        model(input_ids=_ids(256))
        assert calls[0] - before == len(norms)


@hooks
def test_kernel_hooks_keep_the_models_mapping(monkeypatch):
    """The patched model's kernel configuration adds the norm hook to the mapping the model had;
    with hub kernels switched off (USE_HUB_KERNELS=NO) transformers kernelizes nothing and the patch
    binds the forwards only."""
    from kernels import Mode
    from transformers import KernelConfig

    from tigon_torch import kernel_hooks

    other = {"SoftmaxTopKRouter": {"cuda": {Mode.INFERENCE: kernel_hooks.REPOSITORY}}}
    model = build_model("llama", vocab=256)
    model.kernel_config = KernelConfig(kernel_mapping=dict(other))
    tt.apply_tigon_to_llama(model=model)
    mapping = model.kernel_config.kernel_mapping
    assert mapping["SoftmaxTopKRouter"] == other["SoftmaxTopKRouter"]
    assert mapping["RMSNorm"]["cuda"][Mode.TRAINING] is kernel_hooks.REPOSITORY
    assert all(r is kernel_hooks.REPOSITORY for r in mapping["RMSNorm"]["cpu"].values())
    tt.unpatch()
    assert model.kernel_config.kernel_mapping == other

    monkeypatch.setenv("USE_HUB_KERNELS", "NO")
    model = build_model("llama", vocab=256)
    tt.apply_tigon_to_llama(model=model)
    assert model.kernel_config is None
    assert model.model.norm.forward.__func__ is patch._rms_norm_forward


@pytest.mark.parametrize("family", [f for f, s in patch._FAMILIES.items() if s.decoder])
def test_decoder_layers_are_the_standard_pre_norm_layer(family):
    """The installed transformers' decoder layer of every family with fused_add_norm is the layer the
    fused forward replaces (else its adds stay Hugging Face's and this fails, naming the family)."""
    spec = patch._FAMILIES[family]
    try:
        mod = importlib.import_module(spec.module)
    except ImportError:
        pytest.skip(f"transformers without {spec.module}")
    found = patch._decoder_classes(spec, mod)
    assert found is not None, f"{spec.decoder} is not the standard pre-norm layer"
    names = found[2].names
    assert "attention_mask" in names and "position_embeddings" in names


def test_decoder_spec_refuses_other_layers():
    """A layer that computes anything else (a scaled residual, an extra norm, the attention given an
    argument under another name) keeps Hugging Face's forward."""

    class Layer(torch.nn.Module):
        def standard(self, hidden_states, attention_mask=None, **kwargs):
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
            hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask, **kwargs)
            hidden_states = residual + hidden_states
            residual = hidden_states
            hidden_states = self.post_attention_layernorm(hidden_states)
            hidden_states = self.mlp(hidden_states)
            hidden_states = residual + hidden_states
            return hidden_states

        def scaled(self, hidden_states, attention_mask=None, **kwargs):
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
            hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask, **kwargs)
            hidden_states = residual + hidden_states * 0.5
            residual = hidden_states
            hidden_states = self.post_attention_layernorm(hidden_states)
            hidden_states = self.mlp(hidden_states)
            hidden_states = residual + hidden_states
            return hidden_states

        def renamed(self, hidden_states, mask=None, **kwargs):
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
            hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=mask, **kwargs)
            hidden_states = residual + hidden_states
            residual = hidden_states
            hidden_states = self.post_attention_layernorm(hidden_states)
            hidden_states = self.mlp(hidden_states)
            hidden_states = residual + hidden_states
            return hidden_states

    spec = patch._decoder_spec(Layer.standard)
    assert spec is not None and spec.names == {"attention_mask"} and dict(spec.defaults) == {"attention_mask": None}
    assert patch._decoder_spec(Layer.scaled) is None
    assert patch._decoder_spec(Layer.renamed) is None


# ------------------------------------------------------------------------------------------------
# On a CUDA device: tigon's kernels in the model
# ------------------------------------------------------------------------------------------------


def _pair(family, dtype, **kw):
    ref = build_model(family, dtype=dtype, device=DEVICE, **kw)
    model = build_model(family, dtype=dtype, device=DEVICE, **kw)
    model.load_state_dict(ref.state_dict())
    return ref, model


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_patched_model_matches_hf(ext, family, dtype):
    ref, model = _pair(family, dtype, vocab=4096, hidden=256, heads=4, kv_heads=2)
    _apply_fn(family)(model=model)
    ids = _ids(4096, batch=3, seq=40, device=DEVICE)
    labels = ids.clone()
    labels[:, :5] = -100
    ref.train(), model.train()
    want = ref(input_ids=ids, labels=labels)
    out = model(input_ids=ids, labels=labels)
    assert out.logits is None  # the fused loss skipped the logits
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.loss, want.loss.float(), atol=tol, rtol=tol)
    want.loss.backward()
    out.loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is None:
            continue
        assert_rel(p.grad, q.grad, dtype, factor=10.0, what=f"{family} grad {name}")

    # num_items_in_batch: the sum divided by the count, as Hugging Face's loss does.
    n = torch.tensor(77, device=DEVICE)
    torch.testing.assert_close(model(input_ids=ids, labels=labels, num_items_in_batch=n).loss,
                               ref(input_ids=ids, labels=labels, num_items_in_batch=n).loss.float(), atol=tol,
                               rtol=tol)
    # Inference: logits as Hugging Face computes them (softcap included).
    model.eval(), ref.eval()
    with torch.no_grad():
        lo, lr = model(input_ids=ids).logits, ref(input_ids=ids).logits
    assert_rel(lo, lr, dtype, factor=10.0, what=f"{family} logits")


@pytest.mark.gpu
@pytest.mark.parametrize("fused_mlp", [True, False])
def test_fused_mlp_switch(ext, monkeypatch, fused_mlp):
    """fused_mlp=True sends every LlamaMLP through tigon_gated_mlp (one call per layer), False keeps the
    projections as modules; both give Hugging Face's loss and gradients."""
    from tigon_torch import functional as TF

    calls = []
    real = TF.tigon_gated_mlp
    monkeypatch.setattr(TF, "tigon_gated_mlp", lambda *a, **k: calls.append(1) or real(*a, **k))
    ref, model = _pair("llama", torch.float32, vocab=4096, hidden=256)
    tt.apply_tigon_to_llama(fused_mlp=fused_mlp, model=model)
    ids = _ids(4096, device=DEVICE)
    ref.train(), model.train()
    out, want = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    assert len(calls) == (model.config.num_hidden_layers if fused_mlp else 0)
    torch.testing.assert_close(out.loss, want.loss, atol=1e-4, rtol=1e-4)
    out.loss.backward()
    want.loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is not None:
            assert_rel(p.grad, q.grad, torch.float32, factor=10.0, what=f"grad {name}")


@pytest.mark.gpu
def test_cross_entropy_switch(ext):
    ref, model = _pair("gemma2", torch.float32, vocab=4096, hidden=256)
    tt.apply_tigon_to_gemma2(cross_entropy=True, fused_linear_cross_entropy=False, model=model)
    ids = _ids(4096, device=DEVICE)
    ref.train(), model.train()
    out, want = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    assert out.logits is not None
    torch.testing.assert_close(out.loss, want.loss, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text", "phi3"])
def test_gradient_checkpointing(ext, family):
    ref, model = _pair(family, torch.float32, vocab=4096, hidden=256)
    _apply_fn(family)(model=model)
    model.gradient_checkpointing_enable()
    ref.train(), model.train()
    ids = _ids(4096, device=DEVICE)
    want = ref(input_ids=ids, labels=ids)
    out = model(input_ids=ids, labels=ids)
    want.loss.backward()
    out.loss.backward()
    torch.testing.assert_close(out.loss, want.loss, atol=1e-4, rtol=1e-4)
    for p, q in zip(model.parameters(), ref.parameters()):
        if q.grad is not None:
            assert_rel(p.grad, q.grad, torch.float32, factor=50.0)


@pytest.mark.gpu
@pytest.mark.cuda_only
def test_autocast_training_step(ext):
    ref, model = _pair("llama", torch.float32, vocab=4096, hidden=256)
    tt.apply_tigon_to_llama(model=model)
    ids = _ids(4096, device=DEVICE)
    ref.train(), model.train()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = ref(input_ids=ids, labels=ids)
        out = model(input_ids=ids, labels=ids)
    want.loss.backward()
    out.loss.backward()
    torch.testing.assert_close(out.loss, want.loss.float(), atol=2e-2, rtol=2e-2)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32
        assert_rel(p.grad, q.grad, torch.bfloat16, factor=5.0)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_norm(ext, monkeypatch, family, dtype):
    """fused_add_norm: every residual add runs inside add + RMSNorm (two per layer: the one inside the
    layer, and the one before the next layer's first norm or the final norm); the loss, every gradient
    and the inference logits are Hugging Face's. Under gradient checkpointing only the add inside the
    layer is fused (a recomputed layer has no next norm to hand its result to)."""
    from tigon_torch import functional

    calls = [0]
    real = functional._add_rms_norm  # the op behind tigon_fused_add_rms_norm, whichever autograd it takes

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(functional, "_add_rms_norm", counted)
    ref, model = _pair(family, dtype, vocab=4096, hidden=256, heads=4, kv_heads=2)
    _apply_fn(family)(model=model)
    layers = model.config.num_hidden_layers
    ids = _ids(4096, batch=2, seq=24, device=DEVICE)
    ref.train(), model.train()
    want = ref(input_ids=ids, labels=ids)
    out = model(input_ids=ids, labels=ids)
    assert calls[0] == 2 * layers
    assert not any("_tigon_prenormed" in m.__dict__ for m in model.modules())  # every hand-off taken
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.loss, want.loss.float(), atol=tol, rtol=tol)
    want.loss.backward()
    out.loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is not None:
            assert_rel(p.grad, q.grad, dtype, factor=10.0, what=f"{family} grad {name}")

    model.eval(), ref.eval()
    calls[0] = 0
    with torch.no_grad():
        lo, lr = model(input_ids=ids).logits, ref(input_ids=ids).logits
    assert calls[0] == 2 * layers
    assert_rel(lo, lr, dtype, factor=10.0, what=f"{family} logits")

    model.zero_grad(), ref.zero_grad()
    model.gradient_checkpointing_enable()
    ref.gradient_checkpointing_enable()
    model.train(), ref.train()
    calls[0] = 0
    out = model(input_ids=ids, labels=ids)
    assert calls[0] == layers
    want = ref(input_ids=ids, labels=ids)
    out.loss.backward()
    want.loss.backward()
    torch.testing.assert_close(out.loss, want.loss.float(), atol=tol, rtol=tol)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is not None:
            assert_rel(p.grad, q.grad, dtype, factor=10.0, what=f"{family} checkpointed grad {name}")


@pytest.mark.gpu
def test_fused_add_norm_mixed_dtypes(ext):
    """Under autocast a bfloat16 attention or MLP output meets a float32 residual stream: the fused add
    + RMSNorm gives Hugging Face's `residual + x` (promoted to float32, exactly) and its norm, with
    gradients in each operand's own dtype."""
    _, model = _pair("llama", torch.float32, vocab=4096, hidden=256, heads=4, kv_heads=2)
    tt.apply_tigon_to_llama(model=model)
    norm = model.model.layers[0].post_attention_layernorm
    torch.manual_seed(0)
    x = torch.randn(2, 8, 256, device=DEVICE).to(torch.bfloat16).requires_grad_(True)
    r = torch.randn(2, 8, 256, device=DEVICE, requires_grad=True)
    normed, total = patch._add_norm(norm, x, r)
    want_total = r + x
    assert total.dtype == normed.dtype == torch.float32
    assert torch.equal(total, want_total)
    var = want_total.pow(2).mean(-1, keepdim=True)
    want = norm.weight * (want_total * torch.rsqrt(var + norm.variance_epsilon))
    torch.testing.assert_close(normed, want, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(normed)
    dx, dr = torch.autograd.grad((normed * g).sum() + total.sum(), (x, r))
    ex, er = torch.autograd.grad((want * g).sum() + want_total.sum(), (x, r))
    assert dx.dtype == torch.bfloat16 and dr.dtype == torch.float32
    torch.testing.assert_close(dr, er, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dx, ex, atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_fused_add_norm_under_outside_checkpointing(ext, reentrant):
    """Layers checkpointed by a wrapper the patch does not know of (torch.utils.checkpoint around each
    layer, as FSDP's and Accelerate's wrappers do): the loss and every gradient are Hugging Face's, and
    no normed tensor is left behind by a recomputed layer."""
    import functools

    from torch.utils.checkpoint import checkpoint

    def wrap(model):
        for layer in model.model.layers:
            inner = layer.forward

            def forward(hidden_states, _inner=inner, **kwargs):
                return checkpoint(functools.partial(_inner, **kwargs), hidden_states, use_reentrant=reentrant)

            layer.forward = forward

    ref, model = _pair("llama", torch.float32, vocab=4096, hidden=256, heads=4, kv_heads=2)
    tt.apply_tigon_to_llama(model=model)
    wrap(ref), wrap(model)
    ref.train(), model.train()
    ids = _ids(4096, batch=2, seq=24, device=DEVICE)
    want = ref(input_ids=ids, labels=ids, use_cache=False)  # a recomputed layer must not grow a cache
    out = model(input_ids=ids, labels=ids, use_cache=False)
    want.loss.backward()
    out.loss.backward()
    torch.testing.assert_close(out.loss, want.loss, atol=1e-4, rtol=1e-4)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is not None:
            assert_rel(p.grad, q.grad, torch.float32, factor=10.0, what=f"grad {name}")
    assert not any("_tigon_prenormed" in m.__dict__ for m in model.modules())

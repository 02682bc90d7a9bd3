"""tigon_torch's Liger-compatible API against Liger-Kernel 0.8.2's: every patch function, module
constructor and forward, functional entry point and autograd function's forward takes Liger's
parameters (names, order, kinds, defaults), then tigon-only ones after them, each with a default.

Liger's signatures are written out below (read from Liger-Kernel 0.8.2's source), so the test needs
neither Liger nor a GPU; where liger_kernel is importable, tigon is also compared with the live
objects, and the written-out data with them when the installed version is 0.8.2."""

from __future__ import annotations

import dataclasses
import importlib
import inspect

import pytest

import tigon_torch as tt

R = inspect.Parameter.empty  # no default
VAR_KW = "**"  # a **kwargs parameter
VAR_POS = "*"  # a *args parameter
KW = inspect.Parameter.KEYWORD_ONLY
POS = inspect.Parameter.POSITIONAL_OR_KEYWORD

LIGER_VERSION = "0.8.2"


def _patch(mlp, layer_norm=False):
    head = [("rope", True), ("cross_entropy", False), ("fused_linear_cross_entropy", True)]
    return head + ([("layer_norm", True)] if layer_norm else []) + [("rms_norm", True), (mlp, True), ("model", None)]


_MP = "liger_kernel.transformers.monkey_patch"
_FN = "liger_kernel.transformers.functional"
_CE_FUNCTION = [("_input", R), ("target", R), ("weight", R), ("ignore_index", -100), ("lse_square_scale", 0.0),
                ("label_smoothing", 0.0), ("reduction", "mean"), ("softcap", None), ("return_z_loss", False),
                ("return_token_accuracy", False), ("return_predicted_tokens", False)]
_LCE_TAIL = [("ce_weight", None), ("ignore_index", -100), ("lse_square_scale", 0.0), ("label_smoothing", 0.0),
             ("reduction", "mean"), ("softcap", None), ("return_z_loss", False), ("accum_dtype", None),
             ("use_token_scaling", False), ("return_token_accuracy", False), ("return_predicted_tokens", False)]
_FLJSD = [("student_input", R), ("student_weight", R), ("teacher_input", R), ("teacher_weight", R),
          ("shift_labels", None), ("jsd_beta", 0.5), ("ignore_index", -100), ("temperature", 1.0),
          ("accum_dtype", None)]

# tigon's name -> (Liger's object, "module:qualified name"; Liger's parameters without self / ctx).
LIGER = {
    # Patch functions (liger_kernel/transformers/monkey_patch.py)
    **{f"apply_tigon_to_{t}": (f"{_MP}:apply_liger_kernel_to_{t}", _patch("swiglu"))
       for t in ("llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen3_moe", "olmo2", "olmo3", "smollm3",
                 "falcon_h1", "qwen2_5_vl")},
    **{f"apply_tigon_to_{t}": (f"{_MP}:apply_liger_kernel_to_{t}", _patch("geglu"))
       for t in ("gemma", "gemma2", "gemma3_text")},
    "apply_tigon_to_gemma3": (f"{_MP}:apply_liger_kernel_to_gemma3", _patch("geglu", layer_norm=True)),
    "apply_tigon_to_glm4": (f"{_MP}:apply_liger_kernel_to_glm4",
                            [("rope", False)] + _patch("swiglu")[1:]),
    **{f"apply_tigon_to_{t}": (f"{_MP}:apply_liger_kernel_to_{t}",
                               _patch("swiglu")[:4] + [("swiglu", False), ("model", None)])
       for t in ("gpt_oss", "qwen3_vl")},  # their MLP patch off by default
    "apply_tigon_to_granite": (f"{_MP}:apply_liger_kernel_to_granite",
                               [("rope", True), ("cross_entropy", True), ("fused_linear_cross_entropy", False),
                                ("rms_norm", True), ("swiglu", True), ("model", None)]),
    "apply_tigon_to_llama4": (f"{_MP}:apply_liger_kernel_to_llama4", _patch("swiglu") + [("layer_norm", True)]),
    "apply_tigon_to_qwen2_vl": (f"{_MP}:apply_liger_kernel_to_qwen2_vl",
                                _patch("swiglu")[:4] + [("layer_norm", True), ("swiglu", True), ("model", None)]),
    "apply_tigon_to_nemotron": (f"{_MP}:apply_liger_kernel_to_nemotron",
                                [("relu_squared", True), ("cross_entropy", False), ("fused_linear_cross_entropy", True),
                                 ("model", None), ("kwargs", VAR_KW)]),
    "_apply_tigon": (f"{_MP}:_apply_liger_kernel", [("model_type", R), ("kwargs", VAR_KW)]),
    "_apply_tigon_to_instance": (f"{_MP}:_apply_liger_kernel_to_instance", [("model", R), ("kwargs", VAR_KW)]),
    # Modules
    "TigonRMSNorm.__init__": ("liger_kernel.transformers.rms_norm:LigerRMSNorm.__init__", [
        ("hidden_size", R), ("eps", 1e-6), ("offset", 0.0), ("casting_mode", "llama"), ("init_fn", "ones"),
        ("in_place", True), ("row_mode", None), ("elementwise_affine", True)]),
    "TigonRMSNorm.forward": ("liger_kernel.transformers.rms_norm:LigerRMSNorm.forward", [("hidden_states", R)]),
    "TigonRMSNormForGemma.__init__": ("liger_kernel.transformers.rms_norm:LigerRMSNormForGemma.__init__", [
        ("hidden_size", R), ("eps", 1e-6), ("offset", 1.0), ("casting_mode", "gemma"), ("init_fn", "zeros"),
        ("in_place", True), ("row_mode", None)]),
    "TigonRMSNormForGemma2.__init__": ("liger_kernel.transformers.rms_norm:LigerRMSNormForGemma2.__init__", [
        ("hidden_size", R), ("eps", 1e-6), ("offset", 1.0), ("casting_mode", "gemma"), ("init_fn", "zeros"),
        ("in_place", False), ("row_mode", None)]),
    "TigonRMSNormForGemma3.__init__": ("liger_kernel.transformers.rms_norm:LigerRMSNormForGemma3.__init__", [
        ("dim", R), ("eps", 1e-6), ("offset", 1.0), ("casting_mode", "gemma"), ("init_fn", "zeros"),
        ("in_place", False)]),
    "TigonLayerNorm.__init__": ("liger_kernel.transformers.layer_norm:LigerLayerNorm.__init__", [
        ("hidden_size", R), ("eps", 1e-6), ("bias", False), ("init_fn", "ones")]),
    "TigonLayerNorm.forward": ("liger_kernel.transformers.layer_norm:LigerLayerNorm.forward", [("hidden_states", R)]),
    "TigonFusedAddRMSNorm.__init__": ("liger_kernel.transformers.fused_add_rms_norm:LigerFusedAddRMSNorm.__init__", [
        ("hidden_size", R), ("eps", 1e-6), ("offset", 0.0), ("casting_mode", "llama"), ("init_fn", "ones"),
        ("in_place", False)]),
    "TigonFusedAddRMSNorm.forward": ("liger_kernel.transformers.fused_add_rms_norm:LigerFusedAddRMSNorm.forward",
                                     [("hidden_states", R), ("residual", R)]),
    "TigonCrossEntropyLoss.__init__": ("liger_kernel.transformers.cross_entropy:LigerCrossEntropyLoss.__init__", [
        ("weight", None), ("ignore_index", -100), ("lse_square_scale", 0.0), ("label_smoothing", 0.0),
        ("reduction", "mean"), ("softcap", None), ("return_z_loss", False), ("return_token_accuracy", False),
        ("return_predicted_tokens", False)]),
    "TigonCrossEntropyLoss.forward": ("liger_kernel.transformers.cross_entropy:LigerCrossEntropyLoss.forward",
                                      [("_input", R), ("target", R)]),
    "TigonFusedLinearCrossEntropyLoss.__init__": (
        "liger_kernel.transformers.fused_linear_cross_entropy:LigerFusedLinearCrossEntropyLoss.__init__", _LCE_TAIL),
    "TigonFusedLinearCrossEntropyLoss.forward": (
        "liger_kernel.transformers.fused_linear_cross_entropy:LigerFusedLinearCrossEntropyLoss.forward",
        [("lin_weight", R), ("_input", R), ("target", R), ("bias", None)]),
    "TigonSwiGLUMLP.__init__": ("liger_kernel.transformers.swiglu:LigerSwiGLUMLP.__init__", [("config", R)]),
    "TigonSwiGLUMLP.forward": ("liger_kernel.transformers.swiglu:LigerSwiGLUMLP.forward", [("x", R)]),
    "TigonPhi3SwiGLUMLP.__init__": ("liger_kernel.transformers.swiglu:LigerPhi3SwiGLUMLP.__init__", [("config", R)]),
    "TigonPhi3SwiGLUMLP.forward": ("liger_kernel.transformers.swiglu:LigerPhi3SwiGLUMLP.forward", [("x", R)]),
    "TigonGEGLUMLP.__init__": ("liger_kernel.transformers.geglu:LigerGEGLUMLP.__init__", [("config", R)]),
    "TigonGEGLUMLP.forward": ("liger_kernel.transformers.geglu:LigerGEGLUMLP.forward", [("x", R)]),
    # Functional (liger_kernel/transformers/functional.py, rope.py)
    "tigon_cross_entropy": (f"{_FN}:liger_cross_entropy", [
        ("input", R), ("target", R), ("weight", None), ("size_average", None), ("ignore_index", -100),
        ("reduce", None), ("reduction", "mean"), ("label_smoothing", 0.0), ("lse_square_scale", 0.0),
        ("softcap", None), ("return_z_loss", False), ("return_token_accuracy", False),
        ("return_predicted_tokens", False)]),
    "tigon_fused_linear_cross_entropy": (f"{_FN}:liger_fused_linear_cross_entropy",
                                         [("input", R), ("weight", R), ("target", R), ("bias", None)] + _LCE_TAIL),
    "tigon_rms_norm": (f"{_FN}:liger_rms_norm", [("X", R), ("W", R), ("eps", R), ("offset", 0.0),
                                                 ("casting_mode", "llama"), ("in_place", True)]),
    "tigon_layer_norm": (f"{_FN}:liger_layer_norm", [("X", R), ("W", R), ("B", R), ("eps", R)]),
    "tigon_fused_add_rms_norm": (f"{_FN}:liger_fused_add_rms_norm", [
        ("X", R), ("R", R), ("W", R), ("eps", R), ("offset", 0.0), ("casting_mode", "llama"), ("in_place", True)]),
    "tigon_rope": (f"{_FN}:liger_rope", [("q", R), ("k", R), ("cos", R), ("sin", R), ("position_ids", None),
                                         ("unsqueeze_dim", 1)]),
    "tigon_rotary_pos_emb": ("liger_kernel.transformers.rope:liger_rotary_pos_emb", [
        ("q", R), ("k", R), ("cos", R), ("sin", R), ("position_ids", None), ("unsqueeze_dim", 1)]),
    "tigon_swiglu": (f"{_FN}:liger_swiglu", [("a", R), ("b", R)]),
    "tigon_geglu": (f"{_FN}:liger_geglu", [("a", R), ("b", R)]),
    # Autograd functions (liger_kernel/ops/*.py), without ctx
    "TigonRMSNormFunction.forward": ("liger_kernel.ops:LigerRMSNormFunction.forward", [
        ("X", R), ("W", R), ("eps", R), ("offset", 0.0), ("casting_mode", "llama"), ("in_place", True),
        ("row_mode", None)]),
    "TigonLayerNormFunction.forward": ("liger_kernel.ops:LigerLayerNormFunction.forward",
                                       [("X", R), ("W", R), ("B", R), ("eps", R)]),
    "TigonFusedAddRMSNormFunction.forward": ("liger_kernel.ops:LigerFusedAddRMSNormFunction.forward", [
        ("X", R), ("R", R), ("W", R), ("eps", R), ("offset", 0.0), ("casting_mode", "llama"), ("in_place", False)]),
    "TigonRopeFunction.forward": ("liger_kernel.ops:LigerRopeFunction.forward", [
        ("q", R), ("k", R), ("cos", R), ("sin", R), ("position_ids", None), ("unsqueeze_dim", 1)]),
    "TigonSiLUMulFunction.forward": ("liger_kernel.ops:LigerSiLUMulFunction.forward", [
        ("a", R), ("b", R), ("gate_multiplier", 1.0), ("down_multiplier", 1.0)]),
    "TigonGELUMulFunction.forward": ("liger_kernel.ops:LigerGELUMulFunction.forward", [("a", R), ("b", R)]),
    "TigonCrossEntropyFunction.forward": ("liger_kernel.ops:LigerCrossEntropyFunction.forward", _CE_FUNCTION),
    "TigonFusedLinearCrossEntropyFunction.forward": (
        "liger_kernel.ops:LigerFusedLinearCrossEntropyFunction.forward",
        [("_input", R), ("weight", R), ("target", R), ("bias", None)] + _LCE_TAIL),
    # Distillation losses (liger_kernel/ops/{jsd,kl_div,tvd,fused_linear_jsd}.py,
    # liger_kernel/transformers/{jsd,kl_div,tvd,fused_linear_jsd,functional}.py)
    "TigonJSDFunction.forward": ("liger_kernel.ops:LigerJSDFunction.forward", [
        ("_input", R), ("target", R), ("shift_labels", None), ("beta", 0.5), ("ignore_index", -100)]),
    "TigonKLDivLossFunction.forward": ("liger_kernel.ops:LigerKLDivLossFunction.forward", [
        ("y_pred", R), ("y_true", R), ("reduction", "batchmean"), ("log_target", False), ("eps", 1e-10)]),
    "TigonTVDLossFunction.forward": ("liger_kernel.ops:LigerTVDLossFunction.forward", [
        ("p", R), ("q", R), ("shift_labels", None), ("reduction", "batchmean"), ("ignore_index", -100)]),
    "TigonFusedLinearJSDFunction.forward": ("liger_kernel.ops:LigerFusedLinearJSDFunction.forward", _FLJSD),
    "TigonJSD.__init__": ("liger_kernel.transformers.jsd:LigerJSD.__init__", [("beta", 0.5), ("ignore_index", -100)]),
    "TigonJSD.forward": ("liger_kernel.transformers.jsd:LigerJSD.forward",
                         [("log_q", R), ("log_p", R), ("shift_labels", None)]),
    "TigonKLDIVLoss.__init__": ("liger_kernel.transformers.kl_div:LigerKLDIVLoss.__init__",
                                [("eps", 1e-10), ("args", VAR_POS), ("kwargs", VAR_KW)]),
    "TigonKLDIVLoss.forward": ("liger_kernel.transformers.kl_div:LigerKLDIVLoss.forward", [("y_pred", R), ("y_true", R)]),
    "TigonTVDLoss.__init__": ("liger_kernel.transformers.tvd:LigerTVDLoss.__init__",
                              [("reduction", "batchmean"), ("ignore_index", -100)]),
    "TigonTVDLoss.forward": ("liger_kernel.transformers.tvd:LigerTVDLoss.forward",
                             [("p", R), ("q", R), ("shift_labels", None)]),
    "TigonFusedLinearJSD.__init__": ("liger_kernel.transformers.fused_linear_jsd:LigerFusedLinearJSD.__init__", [
        ("jsd_beta", 0.5), ("ignore_index", -100), ("temperature", 1.0), ("accum_dtype", None)]),
    "TigonFusedLinearJSD.forward": ("liger_kernel.transformers.fused_linear_jsd:LigerFusedLinearJSD.forward", [
        ("student_input", R), ("student_weight", R), ("teacher_input", R), ("teacher_weight", R),
        ("shift_labels", R)]),
    "tigon_jsd": (f"{_FN}:liger_jsd", [("input", R), ("target", R), ("shift_labels", None), ("beta", 0.5),
                                       ("ignore_index", -100)]),
    "tigon_kl_div": (f"{_FN}:liger_kl_div", [
        ("input", R), ("target", R), ("size_average", True), ("reduce", True), ("reduction", "mean"),
        ("log_target", False), ("eps", 1e-10)]),
    "tigon_tvd": (f"{_FN}:liger_tvd", [("input", R), ("target", R), ("shift_labels", None), ("reduction", "mean"),
                                       ("ignore_index", -100)]),
    "tigon_fused_linear_jsd": (f"{_FN}:liger_fused_linear_jsd", _FLJSD),
}

# tigon-only parameters, after Liger's: (name, default, kind). Keyword-only, except where a positional
# call must reach them (an autograd function's apply takes positional arguments only; tigon_swiglu's
# multipliers are LigerSiLUMulFunction's own).
_FUSED_MLP = [("fused_mlp", True, KW)]
EXTRA = {name: _FUSED_MLP for name in LIGER if name.startswith("apply_tigon_to_")}
# Families whose decoder layer is the standard pre-norm layer: its residual adds fused with the norms.
EXTRA.update({f"apply_tigon_to_{f}": _FUSED_MLP + [("fused_add_norm", True, KW)]
              for f in ("llama", "mistral", "qwen2", "qwen3", "gemma", "mixtral", "qwen3_moe", "smollm3")})
EXTRA.update({
    # Nemotron's attention is Llama's and its norm a LayerNorm: tigon patches both (Liger does not)
    "apply_tigon_to_nemotron": [("rope", True, KW), ("layer_norm", True, KW)],
    "TigonCrossEntropyLoss.__init__": [("in_place", False, KW)],
    "tigon_cross_entropy": [("in_place", False, KW)],
    "TigonCrossEntropyFunction.forward": [("in_place", False, POS)],
    "tigon_swiglu": [("gate_multiplier", 1.0, POS), ("down_multiplier", 1.0, POS)],
})

# Parameters Liger declares without a default that tigon defaults: every call written for Liger passes
# them, so it means the same here.
DEFAULTED = {
    "tigon_rms_norm": {"eps": 1e-6},
    "tigon_layer_norm": {"eps": 1e-5},
    "tigon_fused_add_rms_norm": {"eps": 1e-6},
}

# Where tigon's default is the safe one and Liger's writes over an input: the norms' in_place=True
# writes dX over dY, which is wrong whenever autograd hands dY to another branch too (x + norm(x)).
# The modules and functional calls default to False; the patches pass True where the model's graph
# allows it, and the autograd function keeps Liger's default.
SAFE_DEFAULTS = {name: {"in_place": False} for name in (
    "TigonRMSNorm.__init__", "TigonRMSNormForGemma.__init__", "tigon_rms_norm", "tigon_fused_add_rms_norm")}

# Patch functions for families Liger 0.8.2 has none for: tigon's own signature, written out.
TIGON_ONLY = {
    "apply_tigon_to_phi": [("rope", True, POS), ("cross_entropy", False, POS),
                           ("fused_linear_cross_entropy", True, POS), ("layer_norm", True, POS), ("model", None, POS)],
}

CROSS_ENTROPY_OUTPUT = [("loss", R), ("z_loss", None), ("token_accuracy", None), ("predicted_tokens", None)]


def _resolve(root, dotted: str):
    obj = root
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _params(fn) -> list[inspect.Parameter]:
    ps = list(inspect.signature(fn).parameters.values())
    if ps and ps[0].name in ("self", "ctx"):
        ps = ps[1:]
    return ps


def _as_data(params) -> list[tuple]:
    var = {inspect.Parameter.VAR_KEYWORD: VAR_KW, inspect.Parameter.VAR_POSITIONAL: VAR_POS}
    return [(p.name, var[p.kind]) if p.kind in var else (p.name, p.default) for p in params]


def _same_default(got, want) -> bool:
    if want is R or got is R:
        return got is want
    return type(got) is type(want) and got == want


def _check(name: str, liger: list[tuple]) -> None:
    got = _params(_resolve(tt, name))
    if liger and liger[-1][1] == VAR_KW:  # **kwargs stays last: tigon-only parameters go before it
        assert got and got[-1].kind is inspect.Parameter.VAR_KEYWORD, f"{name}: must end in **{liger[-1][0]}"
        assert got[-1].name == liger[-1][0], f"{name}: **{got[-1].name}, Liger's is **{liger[-1][0]}"
        liger, got = liger[:-1], got[:-1]
    n = len(liger)
    assert [p.name for p in got[:n]] == [p for p, _ in liger], f"{name}: parameters {[p.name for p in got]}"
    for p, (pname, want) in zip(got, liger):
        if want == VAR_KW:
            assert p.kind is inspect.Parameter.VAR_KEYWORD, f"{name}: {pname} must be **{pname}"
            continue
        if want == VAR_POS:
            assert p.kind is inspect.Parameter.VAR_POSITIONAL, f"{name}: {pname} must be *{pname}"
            continue
        assert p.kind is POS, f"{name}: {pname} is {p.kind.description}, Liger's is positional or keyword"
        if want is R and pname in DEFAULTED.get(name, {}):
            want = DEFAULTED[name][pname]
        if pname in SAFE_DEFAULTS.get(name, {}):
            want = SAFE_DEFAULTS[name][pname]
        assert _same_default(p.default, want), f"{name}: {pname} defaults to {p.default!r}, Liger's to {want!r}"
    extra = [(p.name, p.default, p.kind) for p in got[n:]]
    assert extra == EXTRA.get(name, []), f"{name}: tigon-only parameters {extra}"


@pytest.mark.parametrize("name", sorted(LIGER))
def test_signature_matches_liger(name):
    _check(name, LIGER[name][1])


def test_every_patch_function_is_checked():
    patches = {n for n in dir(tt) if n.startswith("apply_tigon_to_")} - {"apply_tigon_to_model"}
    checked = set(LIGER) | set(TIGON_ONLY)
    assert patches <= checked, f"not compared with Liger: {sorted(patches - checked)}"
    from tigon_torch import patch

    for model_type, fn in patch.MODEL_TYPE_TO_APPLY_FN.items():
        assert fn.__name__ in checked and getattr(tt, fn.__name__) is fn, f"{model_type}: {fn.__name__}"


@pytest.mark.parametrize("name", sorted(TIGON_ONLY))
def test_tigon_only_patch_signature(name):
    got = [(p.name, p.default, p.kind) for p in _params(_resolve(tt, name))]
    assert got == TIGON_ONLY[name] + _FUSED_MLP * ("fused_mlp" in {p for p, *_ in got})


def test_cross_entropy_output_fields():
    fields = [(f.name, R if f.default is dataclasses.MISSING else f.default)
              for f in dataclasses.fields(tt.CrossEntropyOutput)]
    assert fields == CROSS_ENTROPY_OUTPUT


# ------------------------------------------------------------------------------------------------
# Against an installed Liger-Kernel
# ------------------------------------------------------------------------------------------------


def _liger_object(path: str):
    pytest.importorskip("liger_kernel")
    module, qualname = path.split(":")
    if module == _MP:
        pytest.importorskip("transformers")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:  # e.g. a Liger without its Triton
        pytest.skip(f"{module} does not import: {e}")
    try:
        return _resolve(mod, qualname)
    except AttributeError:
        pytest.fail(f"{path} is not in the installed liger_kernel")


def _liger_version() -> str | None:
    from importlib import metadata

    for dist in ("liger-kernel", "liger_kernel", "liger-kernel-nightly"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


@pytest.mark.parametrize("name", sorted(LIGER))
def test_signature_matches_installed_liger(name):
    live = _as_data(_params(_liger_object(LIGER[name][0])))
    _check(name, live)
    if _liger_version() == LIGER_VERSION:
        assert live == LIGER[name][1], f"the written-out signature of {LIGER[name][0]} is not Liger {LIGER_VERSION}'s"


def test_cross_entropy_output_matches_installed_liger():
    live = _liger_object(f"{_FN}:CrossEntropyOutput")
    fields = [(f.name, R if f.default is dataclasses.MISSING else f.default) for f in dataclasses.fields(live)]
    assert fields == CROSS_ENTROPY_OUTPUT

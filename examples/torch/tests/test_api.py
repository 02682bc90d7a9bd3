"""The public API on any machine: forward signatures that begin with Liger-Kernel's autograd functions'
parameters (names, order and defaults, written out here; tigon-only parameters follow, defaulted), the package importable without a GPU or
the compiled operators, and the layout helpers."""

from __future__ import annotations

import inspect

import pytest
import torch

import tigon_torch as tt
from tigon_torch import ops

# Liger-Kernel's forward signatures (src/liger_kernel/ops/*.py), without ctx.
LIGER_SIGNATURES = {
    "TigonRMSNormFunction": [("X", None), ("W", None), ("eps", None), ("offset", 0.0), ("casting_mode", "llama"),
                             ("in_place", True), ("row_mode", None)],
    "TigonRopeFunction": [("q", None), ("k", None), ("cos", None), ("sin", None), ("position_ids", None),
                          ("unsqueeze_dim", 1)],
    "TigonSiLUMulFunction": [("a", None), ("b", None), ("gate_multiplier", 1.0), ("down_multiplier", 1.0)],
    "TigonGELUMulFunction": [("a", None), ("b", None)],
    "TigonCrossEntropyFunction": [("_input", None), ("target", None), ("weight", None), ("ignore_index", -100),
                                  ("lse_square_scale", 0.0), ("label_smoothing", 0.0), ("reduction", "mean"),
                                  ("softcap", None), ("return_z_loss", False), ("return_token_accuracy", False),
                                  ("return_predicted_tokens", False)],
    "TigonFusedLinearCrossEntropyFunction": [
        ("_input", None), ("weight", None), ("target", None), ("bias", None), ("ce_weight", None),
        ("ignore_index", -100), ("lse_square_scale", 0.0), ("label_smoothing", 0.0), ("reduction", "mean"),
        ("softcap", None), ("return_z_loss", False), ("accum_dtype", None), ("use_token_scaling", False),
        ("return_token_accuracy", False), ("return_predicted_tokens", False)],
    "TigonLayerNormFunction": [("X", None), ("W", None), ("B", None), ("eps", None)],
    "TigonFusedAddRMSNormFunction": [("X", None), ("R", None), ("W", None), ("eps", None), ("offset", 0.0),
                                     ("casting_mode", "llama"), ("in_place", False)],
}
# tigon-only parameters after Liger's, with their defaults (Liger's behaviour where it has one).
EXTRA = {"TigonCrossEntropyFunction": [("in_place", False)]}
# Parameters Liger declares without a default (None above stands for "no default" for these).
REQUIRED = {
    "TigonRMSNormFunction": {"X", "W", "eps"},
    "TigonRopeFunction": {"q", "k", "cos", "sin"},
    "TigonSiLUMulFunction": {"a", "b"},
    "TigonGELUMulFunction": {"a", "b"},
    "TigonCrossEntropyFunction": {"_input", "target", "weight"},
    "TigonFusedLinearCrossEntropyFunction": {"_input", "weight", "target"},
    "TigonLayerNormFunction": {"X", "W", "B", "eps"},
    "TigonFusedAddRMSNormFunction": {"X", "R", "W", "eps"},
}


@pytest.mark.parametrize("name", list(LIGER_SIGNATURES))
def test_forward_signature_matches_liger(name):
    params = list(inspect.signature(getattr(tt, name).forward).parameters.values())
    assert params[0].name == "ctx"
    got = [(p.name, p.default) for p in params[1:]]
    liger = LIGER_SIGNATURES[name]
    # Liger's parameters first, in its order; tigon-only ones (EXTRA) after them, each with a default,
    # so every call written for Liger means the same here.
    assert [n for n, _ in got] == [n for n, _ in liger] + [n for n, _ in EXTRA.get(name, [])]
    for pname, default in got[len(liger):]:
        assert default == dict(EXTRA[name])[pname], f"{name}.{pname}: default {default!r}"
    for (pname, default), (_, want) in zip(got, liger):
        if pname in REQUIRED[name]:
            assert default is inspect.Parameter.empty, f"{name}.{pname} must have no default"
        else:
            assert default == want, f"{name}.{pname}: default {default!r}, Liger's {want!r}"


def test_rotary_pos_emb_has_hugging_face_signature():
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    hf = [(p.name, p.default) for p in inspect.signature(apply_rotary_pos_emb).parameters.values()]
    ours = [(p.name, p.default) for p in inspect.signature(tt.tigon_rotary_pos_emb).parameters.values()]
    assert ours == hf


def test_casting_modes_and_reductions():
    assert [ops.casting_mode(m) for m in ("llama", "gemma", "none", 0, 1, 2)] == [0, 1, 2, 0, 1, 2]
    with pytest.raises(ValueError):
        ops.casting_mode("fp32")
    assert ops.reduction_code("mean") == 2
    with pytest.raises(ValueError):
        ops.reduction_code("avg")


@pytest.mark.parametrize("make", [
    lambda: torch.randn(2, 5, 8),
    lambda: torch.randn(2, 5, 3, 8).transpose(1, 2),  # [B, H, T, D] view of [B, T, H, D]
    lambda: torch.randn(4, 6, 16)[..., :8],  # strided rows (Phi-3's gate half)
    lambda: torch.randn(8).expand(3, 4, 8),  # row stride 0: must be copied
    lambda: torch.randn(7),
])
def test_row_layouts(make):
    t = make()
    order = ops.row_order(t)
    rows = ops.as_rows(t, order)
    assert rows.dim() == 2 and rows.shape[1] == t.shape[-1]
    assert rows.shape[1] == 1 or rows.stride(1) == 1
    assert rows.shape[0] <= 1 or rows.stride(0) >= rows.shape[1]
    buf, out = ops.empty_rows(t.shape, order, t.dtype, t.device)
    buf.copy_(rows)
    torch.testing.assert_close(out, t)  # same values, element for element
    assert out.shape == t.shape
    torch.testing.assert_close(ops.rows_as(buf, t.shape, order), t)


def test_transposed_view_is_not_copied():
    base = torch.randn(2, 5, 3, 8)
    t = base.transpose(1, 2)
    rows = ops.as_rows(t, ops.row_order(t))
    assert rows.data_ptr() == base.data_ptr()
    gate = torch.randn(4, 6, 16)[..., :8]
    rows = ops.as_rows(gate, ops.row_order(gate))
    assert rows.stride(0) == 16 and rows.data_ptr() == gate.data_ptr()


def test_functions_reject_cpu_tensors_before_loading_anything():
    with pytest.raises(ValueError, match="CUDA"):
        tt.TigonRMSNormFunction.apply(torch.randn(2, 8), None, 1e-6)
    with pytest.raises(NotImplementedError, match="use_token_scaling"):
        tt.TigonFusedLinearCrossEntropyFunction.apply(torch.randn(2, 8), torch.randn(4, 8), torch.zeros(2).long(),
                                                      None, None, -100, 0.0, 0.0, "mean", None, False, None, True)

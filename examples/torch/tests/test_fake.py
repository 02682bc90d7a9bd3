"""The Python side of every function, forward and backward, under FakeTensorMode with fake CUDA
tensors: the operator schemas accept the arguments the functions pass, the fake kernels let
torch.compile trace them, and outputs and gradients have the right shapes, dtypes and layouts.

Runs where the compiled operators are available: on a GPU machine always; on a machine without a
GPU only when TIGON_TORCH_FAKE=1 (the operators then load from an existing build, or are built).
The backward is called through each node's apply(), since the autograd engine needs a real device.
"""

from __future__ import annotations

import os

import pytest
import torch

import tigon_torch as tt

if not torch.cuda.is_available() and os.environ.get("TIGON_TORCH_FAKE") != "1":
    pytest.skip("needs a CUDA GPU, or TIGON_TORCH_FAKE=1 with the operators built", allow_module_level=True)

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

BF = torch.bfloat16


@pytest.fixture(scope="module")
def fake():
    from tigon_torch import ops

    ops.ops()  # load the operators and register their fake kernels before entering the mode
    with FakeTensorMode() as mode:
        yield mode


def _t(*shape, dtype=BF, grad=True):
    return torch.empty(*shape, device="cuda", dtype=dtype).requires_grad_(grad)


def _backward(outs, grads):
    outs = outs if isinstance(outs, tuple) else (outs,)
    node = next(o.grad_fn for o in outs if o is not None and o.grad_fn is not None)
    return node.apply(*grads)


def _like(t):
    return torch.empty_like(t) if t is not None else None


def test_norms(fake):
    x, w, r = _t(8, 64), _t(64), _t(8, 64)
    for args in ((1e-6,), (1e-6, 1.0, "gemma", False)):
        y = tt.TigonRMSNormFunction.apply(x, w, *args)
        dx, dw = _backward(y, (_like(y),))[:2]
        assert dx.shape == x.shape and dw.shape == w.shape and dx.dtype == BF
    xt = _t(2, 5, 4, 64, grad=False).transpose(1, 2).requires_grad_(True)
    y = tt.TigonRMSNormFunction.apply(xt, w, 1e-6)
    assert y.stride() == xt.stride()
    assert _backward(y, (_like(y),))[0].shape == xt.shape
    y = tt.TigonLayerNormFunction.apply(x, w, _t(64), 1e-5)
    dx, dw, db, _ = _backward(y, (_like(y),))
    assert dx.shape == x.shape and dw.shape == db.shape == (64,)
    y, s = tt.TigonFusedAddRMSNormFunction.apply(x, r, w, 1e-6)
    for gs in (_like(s), None):
        dx, dr, dw = _backward((y, s), (_like(y), gs))[:3]
        assert dx.shape == dr.shape == x.shape and dw.shape == w.shape


def test_gated_mlp_and_in_place_cross_entropy(fake):
    x = _t(2, 5, 64)
    wg, wu, wd = _t(96, 64), _t(96, 64), _t(64, 96)
    y = tt.TigonGatedMLPFunction.apply(x, wg, wu, wd, "silu")
    assert y.shape == x.shape and y.dtype == BF
    dx, dwg, dwu, dwd, _ = _backward(y, (_like(y),))
    assert dx.shape == x.shape and dwg.shape == wg.shape and dwu.shape == wu.shape and dwd.shape == wd.shape
    logits, target = _t(6, 1000), torch.zeros(6, dtype=torch.int64, device="cuda")
    out = tt.TigonCrossEntropyFunction.apply(logits, target, None, -100, 0.0, 0.0, "mean", None, False, False,
                                             False, True)
    dl = _backward(out, (_like(out[0]), None, None, None))[0]
    assert dl.shape == logits.shape and dl.dtype == BF


def test_rope_and_gated(fake):
    q = _t(2, 3, 4, 32, grad=False).transpose(1, 2).requires_grad_(True)
    k = _t(2, 3, 2, 32, grad=False).transpose(1, 2).requires_grad_(True)
    cos, sin = _t(1, 3, 32, grad=False), _t(1, 3, 32, grad=False)
    qo, ko = tt.TigonRopeFunction.apply(q, k, cos, sin)
    assert qo.stride() == q.stride() and ko.shape == k.shape
    dq, dk = _backward((qo, ko), (_like(qo), _like(ko)))[:2]
    assert dq.shape == q.shape and dk.shape == k.shape
    assert _backward((qo, ko), (_like(qo), None))[1] is None
    a, b = _t(8, 64), _t(8, 64)
    for c in (tt.TigonSiLUMulFunction.apply(a, b, 0.5, 2.0), tt.TigonGELUMulFunction.apply(a, b),
              tt.TigonGatedMulFunction.apply(a, b, "gelu")):
        da, db = _backward(c, (_like(c),))[:2]
        assert da.shape == db.shape == a.shape
    gu = _t(8, 128)
    c = tt.TigonFusedGateUpMulFunction.apply(gu)
    assert c.shape == (8, 64) and _backward(c, (_like(c),))[0].shape == gu.shape


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_losses(fake, reduction):
    x, head, bias = _t(8, 64), _t(100, 64), _t(100)
    target = torch.zeros(8, device="cuda", dtype=torch.long)
    cw = _t(100, dtype=torch.float32, grad=False)
    logits = _t(8, 100)
    out = tt.TigonCrossEntropyFunction.apply(logits, target, cw, -100, 1e-4, 0.1, reduction, 30.0, True, True, True)
    assert out[0].dtype == BF and out[3].dtype == torch.int64
    assert _backward(out, (_like(out[0]), None, None, None))[0].shape == logits.shape
    out = tt.TigonFusedLinearCrossEntropyFunction.apply(x, head, target, bias, cw, -100, 1e-4, 0.1, reduction, 30.0,
                                                        True, None, False, True, True)
    assert out[0].dtype == torch.float32
    g = _backward(out, (_like(out[0]), None, None, None))
    assert g[0].shape == x.shape and g[1].shape == head.shape and g[3].shape == bias.shape
    assert g[1].dtype == BF

"""tigon.rms_norm, tigon.add_rms_norm, tigon.layer_norm and tigon.gated, the operators whose autograd
is C++ (what eager calls on contiguous CUDA inputs take), against TigonRMSNormFunction,
TigonFusedAddRMSNormFunction, TigonLayerNormFunction and TigonGatedMulFunction: the same kernels behind
both, so the outputs and every gradient agree bit for bit, with and without a weight (and a bias),
with a float32 weight on 16-bit inputs, with an empty input, with gradients that are contiguous,
expanded (the gradient of a sum) or strided, with the sum's gradient or without it, in place and
not; the gated backward writes over a and b exactly when the Python one does. In the CPU reference
mode the C++ autograd runs over the reference operators."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE

import tigon_torch as tt
from tigon_torch import functions as fn
from tigon_torch import ops as _ops

CASES = [
    ((2, 3, 256), torch.bfloat16, torch.bfloat16),
    ((7, 4096), torch.bfloat16, torch.float32),
    ((5, 1, 64), torch.float32, torch.float32),
    ((4, 96), torch.float16, None),
    ((0, 128), torch.bfloat16, torch.bfloat16),
]


def _inputs(seed, shape, dtype, wdtype, n):
    """A generator, n inputs of shape (requiring gradients) and the weight (None without wdtype)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    xs = [torch.randn(shape, generator=g, device=DEVICE).to(dtype).requires_grad_() for _ in range(n)]
    w = None
    if wdtype is not None:
        w = (1 + 0.1 * torch.randn(shape[-1], generator=g, device=DEVICE)).to(wdtype).requires_grad_()
    return g, xs, w


def _dy(g, shape, dtype, grad):
    """An upstream gradient: contiguous, or (grad 'strided') rows 2 x cols apart."""
    dy = torch.randn(shape[:-1] + (2 * shape[-1],), generator=g, device=DEVICE).to(dtype)
    return dy[..., : shape[-1]] if grad == "strided" else dy[..., : shape[-1]].contiguous()


def _same_bits(names, ref, out):
    """ref and out: (tensors..., grad_fn) of the Python and the C++ autograd."""
    # The C++ node names its Function; the Python node is a BackwardCFunction (whose name() torch
    # 2.11 refuses to give).
    assert type(out[-1]).__name__ == "CppFunction" and "CppNode" in out[-1].name()
    assert isinstance(ref[-1], torch.autograd.function.BackwardCFunction)
    for name, a, b in zip(names, ref[:-1], out[:-1]):
        if a is None:
            assert b is None, name
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), name


def _step(cpp, shape, dtype, wdtype, grad, in_place):
    g, (x,), w = _inputs(0, shape, dtype, wdtype, 1)
    if cpp:
        y = _ops.ops().rms_norm(x, w, 1e-6, 0.0, 0, in_place)
    else:
        y = fn.TigonRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", in_place)
    if grad == "sum":  # an expanded gradient (stride 0)
        y.float().sum().backward()
    else:
        y.backward(_dy(g, shape, dtype, grad))
    return y.detach(), x.grad, None if w is None else w.grad, y.grad_fn


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("grad", ["contiguous", "sum", "strided"])
@pytest.mark.parametrize("shape,dtype,wdtype", CASES)
@pytest.mark.gpu
def test_same_bits_as_the_python_function(ext, shape, dtype, wdtype, grad, in_place):
    ref = _step(False, shape, dtype, wdtype, grad, in_place)
    out = _step(True, shape, dtype, wdtype, grad, in_place)
    _same_bits(("y", "dx", "dw"), ref, out)


def _add_step(cpp, shape, dtype, wdtype, grad, in_place):
    """(Y, S) = add + RMSNorm(X, R); the loss reaches Y, and S too unless grad is 'y_only'."""
    g, (x, r), w = _inputs(1, shape, dtype, wdtype, 2)
    if cpp:
        y, s = _ops.ops().add_rms_norm(x, r, w, 1e-6, 0.0, 0, in_place)
    else:
        y, s = fn.TigonFusedAddRMSNormFunction.apply(x, r, w, 1e-6, 0.0, "llama", in_place)
    if grad == "sum":
        (y.float().sum() + 0.5 * s.float().sum()).backward()
    elif grad == "y_only":
        y.backward(_dy(g, shape, dtype, grad))
    else:
        dy = _dy(g, shape, dtype, grad)
        ds = torch.randn(shape, generator=g, device=DEVICE).to(dtype)
        torch.autograd.backward([y, s], [dy, ds])
    return y.detach(), s.detach(), x.grad, r.grad, None if w is None else w.grad, y.grad_fn


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("grad", ["contiguous", "sum", "strided", "y_only"])
@pytest.mark.parametrize("shape,dtype,wdtype", CASES)
@pytest.mark.gpu
def test_add_norm_same_bits_as_the_python_function(ext, shape, dtype, wdtype, grad, in_place):
    ref = _add_step(False, shape, dtype, wdtype, grad, in_place)
    out = _add_step(True, shape, dtype, wdtype, grad, in_place)
    _same_bits(("y", "s", "dx", "dr", "dw"), ref, out)


LN_CASES = [
    ((2, 3, 256), torch.bfloat16, torch.bfloat16, True),
    ((7, 4096), torch.bfloat16, torch.float32, True),
    ((5, 1, 64), torch.float32, torch.float32, False),
    ((4, 96), torch.float16, None, False),
    ((0, 128), torch.bfloat16, torch.bfloat16, True),
]


def _ln_step(cpp, shape, dtype, wdtype, bias, grad):
    g, (x,), w = _inputs(2, shape, dtype, wdtype, 1)
    b = None
    if bias:
        b = (0.1 * torch.randn(shape[-1], generator=g, device=DEVICE)).to(wdtype).requires_grad_()
    if cpp:
        y = _ops.ops().layer_norm(x, w, b, 1e-5)
    else:
        y = fn.TigonLayerNormFunction.apply(x, w, b, 1e-5)
    if grad == "sum":
        y.float().sum().backward()
    else:
        y.backward(_dy(g, shape, dtype, grad))
    return y.detach(), x.grad, None if w is None else w.grad, None if b is None else b.grad, y.grad_fn


@pytest.mark.parametrize("grad", ["contiguous", "sum", "strided"])
@pytest.mark.parametrize("shape,dtype,wdtype,bias", LN_CASES)
@pytest.mark.gpu
def test_layer_norm_same_bits_as_the_python_function(ext, shape, dtype, wdtype, bias, grad):
    ref = _ln_step(False, shape, dtype, wdtype, bias, grad)
    out = _ln_step(True, shape, dtype, wdtype, bias, grad)
    _same_bits(("y", "dx", "dw", "db"), ref, out)


GATED = [("silu", 1.0, 1.0), ("silu", 0.5, 2.0), ("gelu_tanh", 1.0, 1.0), ("gelu", 1.0, 1.0)]


def _gated_step(cpp, shape, dtype, act, gm, dm, computed, grad):
    """c = act(gm a) b dm; a and b leaves, or (computed) projections x Wg^T and x Wu^T of leaves."""
    g = torch.Generator(device=DEVICE).manual_seed(3)
    rows, cols = shape[:-1], shape[-1]
    if computed:
        x = torch.randn(*rows, 64, generator=g, device=DEVICE).to(dtype).requires_grad_()
        wg = (0.1 * torch.randn(cols, 64, generator=g, device=DEVICE)).to(dtype).requires_grad_()
        wu = (0.1 * torch.randn(cols, 64, generator=g, device=DEVICE)).to(dtype).requires_grad_()
        a, b = x @ wg.t(), x @ wu.t()
        leaves = (x, wg, wu)
    else:
        a = torch.randn(shape, generator=g, device=DEVICE).to(dtype).requires_grad_()
        b = torch.randn(shape, generator=g, device=DEVICE).to(dtype).requires_grad_()
        leaves = (a, b)
    va, vb = a._version, b._version
    if cpp:
        c = _ops.ops().gated(a, b, _ops.ACTIVATIONS[act], gm, dm)
    else:
        c = fn.TigonGatedMulFunction.apply(a, b, act, gm, dm)
    node = c.grad_fn
    if grad == "sum":
        c.float().sum().backward()
    else:
        c.backward(_dy(g, shape, dtype, grad))
    over = (a._version > va, b._version > vb)
    return (c.detach(),) + tuple(t.grad for t in leaves) + (over, node)


@pytest.mark.parametrize("computed", [False, True])
@pytest.mark.parametrize("grad", ["contiguous", "sum", "strided"])
@pytest.mark.parametrize("act,gm,dm", GATED)
@pytest.mark.parametrize("shape,dtype", [((2, 3, 256), torch.bfloat16), ((5, 512), torch.float32),
                                         ((4, 96), torch.float16), ((0, 128), torch.bfloat16)])
@pytest.mark.gpu
def test_gated_same_bits_as_the_python_function(ext, shape, dtype, act, gm, dm, grad, computed):
    ref = _gated_step(False, shape, dtype, act, gm, dm, computed, grad)
    out = _gated_step(True, shape, dtype, act, gm, dm, computed, grad)
    assert out[-2] == ref[-2]  # written over a and b (version bumped) exactly when the Python one does
    assert out[-2] == ((computed,) * 2 if shape[0] > 0 else out[-2])
    names = ("c", "dx", "dwg", "dwu") if computed else ("c", "da", "db")
    _same_bits(names, ref[:-2] + ref[-1:], out[:-2] + out[-1:])


@pytest.mark.gpu
def test_gated_over_a_and_b_guards_other_readers(ext):
    """A node that saved a sees its version bumped and raises, instead of reading the gradient the C++
    backward wrote over a; leaves are never written."""
    g = torch.Generator(device=DEVICE).manual_seed(4)
    x = torch.randn(8, 64, generator=g, device=DEVICE, requires_grad=True)
    wg = torch.randn(256, 64, generator=g, device=DEVICE, requires_grad=True)
    wu = torch.randn(256, 64, generator=g, device=DEVICE, requires_grad=True)
    a, b = x @ wg.t(), x @ wu.t()
    loss = (a * a).sum() + _ops.ops().gated(a, b, 0, 1.0, 1.0).sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    a0 = torch.randn(8, 256, generator=g, device=DEVICE, requires_grad=True)
    b0 = torch.randn(8, 256, generator=g, device=DEVICE, requires_grad=True)
    keep = (a0.detach().clone(), b0.detach().clone())
    _ops.ops().gated(a0, b0, 0, 1.0, 1.0).sum().backward()
    assert torch.equal(a0.detach(), keep[0]) and torch.equal(b0.detach(), keep[1])


@pytest.mark.cuda_only
def test_routing_without_autograd_and_other_layouts(ext, monkeypatch):
    x = torch.randn(6, 4, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(512, device="cuda", dtype=torch.bfloat16) + 0.5
    monkeypatch.setattr(fn, "CPP_AUTOGRAD", False)
    ref = tt.tigon_rms_norm(x, w, 1e-6)
    ref_t = tt.tigon_rms_norm(x.transpose(0, 1), w, 1e-6)
    monkeypatch.setattr(fn, "CPP_AUTOGRAD", True)
    with torch.no_grad():
        assert torch.equal(tt.tigon_rms_norm(x, w, 1e-6), ref)
    with torch.inference_mode():
        assert torch.equal(tt.tigon_rms_norm(x, w, 1e-6), ref)
    # A transposed view is not contiguous: it takes TigonRMSNormFunction, which keeps its layout.
    out_t = tt.tigon_rms_norm(x.transpose(0, 1), w, 1e-6)
    assert out_t.stride() == ref_t.stride() and torch.equal(out_t, ref_t)
    # tigon_rms_norm and the module take the C++ operator.
    assert "CppNode" in tt.tigon_rms_norm(x.requires_grad_(), w, 1e-6).grad_fn.name()
    m = tt.TigonRMSNorm(512).to("cuda", torch.bfloat16)
    with torch.no_grad():
        m.weight.copy_(w)
    out = m(x)
    assert "CppNode" in out.grad_fn.name() and torch.equal(out.detach(), ref)
    # add + RMSNorm: the functional call and the module take the C++ operator too.
    r = torch.randn_like(x)
    monkeypatch.setattr(fn, "CPP_AUTOGRAD", False)
    ref_y, ref_s = tt.tigon_fused_add_rms_norm(x.detach(), r, w, 1e-6)
    monkeypatch.setattr(fn, "CPP_AUTOGRAD", True)
    y, s = tt.tigon_fused_add_rms_norm(x, r, w, 1e-6)
    assert "CppNode" in y.grad_fn.name() and torch.equal(y.detach(), ref_y) and torch.equal(s.detach(), ref_s)
    with torch.inference_mode():
        y, s = tt.tigon_fused_add_rms_norm(x.detach(), r, w, 1e-6)
        assert torch.equal(y, ref_y) and torch.equal(s, ref_s)
    # LayerNorm: the functional call and the module.
    b = torch.randn(512, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setattr(fn, "CPP_AUTOGRAD", False)
    ref_ln = tt.tigon_layer_norm(x.detach(), w, b, 1e-5)
    assert "CppNode" not in type(tt.tigon_layer_norm(x, w, b, 1e-5).grad_fn).__name__
    monkeypatch.setattr(fn, "CPP_AUTOGRAD", True)
    out = tt.tigon_layer_norm(x, w, b, 1e-5)
    assert "CppNode" in out.grad_fn.name() and torch.equal(out.detach(), ref_ln)
    ln = tt.TigonLayerNorm(512, eps=1e-5).to("cuda", torch.bfloat16)
    with torch.no_grad():
        ln.weight.copy_(w)
        ln.bias.copy_(b)
    out = ln(x)
    assert "CppNode" in out.grad_fn.name() and torch.equal(out.detach(), ref_ln)
    # The gated product: tigon_swiglu and tigon_geglu; halves of one buffer (not contiguous) take
    # TigonGatedMulFunction.
    a2 = torch.randn(6, 4, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for call in (lambda u, v: tt.tigon_swiglu(u, v, 0.5, 2.0), tt.tigon_geglu):
        monkeypatch.setattr(fn, "CPP_AUTOGRAD", False)
        ref_c = call(x.detach(), r)
        ref_h = call(a2[..., :512].detach(), a2[..., 512:].detach())
        monkeypatch.setattr(fn, "CPP_AUTOGRAD", True)
        c = call(x, r)
        assert "CppNode" in c.grad_fn.name() and torch.equal(c.detach(), ref_c)
        c = call(a2[..., :512], a2[..., 512:])
        assert "CppNode" not in type(c.grad_fn).__name__ and torch.equal(c.detach(), ref_h)


@pytest.mark.cuda_only
def test_bad_calls_raise(ext, monkeypatch):
    monkeypatch.setattr(fn, "CPP_AUTOGRAD", True)
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(TypeError):  # a weight of another 16-bit dtype
        tt.tigon_rms_norm(x, torch.ones(64, device="cuda", dtype=torch.float16), 1e-6)
    with pytest.raises(ValueError):  # a weight of the wrong size
        tt.tigon_rms_norm(x, torch.ones(32, device="cuda", dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError):  # an unknown casting mode
        tt.tigon_rms_norm(x, None, 1e-6, 0.0, "mistral")
    with pytest.raises(ValueError):  # a bias of the wrong size
        tt.tigon_layer_norm(x, torch.ones(64, device="cuda", dtype=torch.bfloat16),
                            torch.zeros(32, device="cuda", dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError):  # an unknown activation
        fn.gated(x, x, "relu")
    with pytest.raises(TypeError):  # a and b of two dtypes (the Python function names them)
        tt.tigon_swiglu(x, x.float())


# Cross-entropy: tigon.cross_entropy_loss (the loss alone) against TigonCrossEntropyFunction and its fp32
# variant. (rows, vocab, dtype); options: class weights, label smoothing, z-loss, softcap.
CE_CASES = [(7, 96, torch.bfloat16), (5, 300, torch.float32), (4, 96, torch.float16), (33, 2048, torch.bfloat16),
            (0, 64, torch.bfloat16)]
CE_OPTIONS = {"plain": {}, "weights+smoothing": {"weights": True, "smoothing": 0.1},
              "z+softcap": {"z": 1e-4, "softcap": 30.0}}


def _ce_step(cpp, rows, vocab, dtype, options, reduction, in_place, upstream, fp32):
    g = torch.Generator(device=DEVICE).manual_seed(5)
    x = (3 * torch.randn(rows, vocab, generator=g, device=DEVICE)).to(dtype).requires_grad_()
    t = torch.randint(0, vocab, (rows,), generator=g, device=DEVICE)
    if rows > 2:
        t[1] = -100
    w = torch.rand(vocab, generator=g, device=DEVICE) + 0.5 if options.get("weights") else None
    z, s, cap = options.get("z", 0.0), options.get("smoothing", 0.0), options.get("softcap")
    v0 = x._version
    if cpp:
        loss = _ops.ops().cross_entropy_loss(x, t, w, -100, z, s, _ops.REDUCTIONS[reduction],
                                             0.0 if cap is None else cap, in_place, fp32, True)
    elif fp32:
        loss = fn.TigonCrossEntropyFP32Function.apply(x, t, w, -100, z, s, reduction, cap)[0]
    else:
        loss = fn.TigonCrossEntropyFunction.apply(x, t, w, -100, z, s, reduction, cap, False, False, False,
                                                  in_place)[0]
    node, bumped = loss.grad_fn, x._version > v0
    if upstream == "one":
        (loss.sum() if reduction == "none" else loss).backward()
    else:  # 2.5, or a gradient per row
        go = torch.randn(rows, generator=g, device=DEVICE) if reduction == "none" else torch.tensor(2.5)
        loss.backward(go.to(device=DEVICE, dtype=loss.dtype))
    return loss.detach(), x.grad, bumped, node


@pytest.mark.parametrize("upstream", ["one", "scaled"])
@pytest.mark.parametrize("in_place,fp32", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", list(CE_OPTIONS))
@pytest.mark.parametrize("rows,vocab,dtype", CE_CASES)
@pytest.mark.gpu
def test_cross_entropy_same_bits_as_the_python_function(ext, rows, vocab, dtype, options, reduction, in_place, fp32,
                                                        upstream):
    args = (rows, vocab, dtype, CE_OPTIONS[options], reduction, in_place, upstream, fp32)
    ref = _ce_step(False, *args)
    out = _ce_step(True, *args)
    assert out[2] == ref[2]  # the logits' version bumped (the gradient written over them) exactly when it is
    assert out[2] == (in_place and dtype != torch.float16 and rows > 0)
    _same_bits(("loss", "dlogits"), ref[:2] + ref[3:], out[:2] + out[3:])


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.gpu
def test_cross_entropy_second_backward(ext, in_place):
    """retain_graph: the gradient the forward wrote is handed out once and the second backward
    recomputes it (the same bits as the Python Function); in place, the second backward raises."""
    grads = []
    for cpp in (False, True):
        g = torch.Generator(device=DEVICE).manual_seed(6)
        x = torch.randn(9, 500, generator=g, device=DEVICE).to(torch.bfloat16).requires_grad_()
        t = torch.randint(0, 500, (9,), generator=g, device=DEVICE)
        if cpp:
            loss = _ops.ops().cross_entropy_loss(x, t, None, -100, 0.0, 0.0, 2, 0.0, in_place, False, True)
        else:
            loss = fn.TigonCrossEntropyFunction.apply(x, t, None, -100, 0.0, 0.0, "mean", None, False, False, False,
                                                      in_place)[0]
        loss.backward(retain_graph=True)
        if in_place:
            # (The CPU reference's scale_rows bumps the gradient's version, which autograd reports first.)
            with pytest.raises(RuntimeError, match="second backward" if DEVICE == "cuda" else "second backward|inplace"):
                loss.backward()
            grads.append(x.grad.clone())
            continue
        first = x.grad.clone()
        loss.backward()
        grads.append((first, x.grad.clone()))
    if in_place:
        assert torch.equal(grads[0], grads[1])
    else:
        assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
        assert torch.equal(grads[1][1], (2 * grads[1][0].float()).to(torch.bfloat16))


@pytest.mark.gpu
def test_cross_entropy_routing(ext, monkeypatch):
    """tigon_cross_entropy, TigonCrossEntropyLoss and the patches' causal-LM loss take the C++ operator when
    they ask for the loss alone on contiguous logits; a return_* flag, non-contiguous logits and
    CPP_AUTOGRAD off take the Python Function, with the same results; bad targets raise
    TargetOutOfRangeError (a ValueError and an AssertionError) before anything is written."""
    from tigon_torch.functional import tigon_causal_lm_loss_from_logits as causal_lm_loss

    g = torch.Generator(device=DEVICE).manual_seed(7)
    x = torch.randn(12, 256, generator=g, device=DEVICE).to(torch.bfloat16)
    t = torch.randint(0, 256, (3, 4), generator=g, device=DEVICE)  # 2-D targets are flattened
    monkeypatch.setattr(fn, "CPP_AUTOGRAD", False)
    ref = tt.tigon_cross_entropy(x, t, label_smoothing=0.05)
    ref_lm = causal_lm_loss(x.view(3, 4, 256), t)
    monkeypatch.setattr(fn, "CPP_AUTOGRAD", True)
    xg = x.clone().requires_grad_()
    out = tt.tigon_cross_entropy(xg, t, label_smoothing=0.05)
    assert "CppNode" in out.grad_fn.name() and torch.equal(out.detach(), ref)
    out = tt.TigonCrossEntropyLoss(label_smoothing=0.05)(xg, t)
    assert "CppNode" in out.grad_fn.name() and torch.equal(out.detach(), ref)
    out = causal_lm_loss(xg.view(3, 4, 256), t)
    assert "CppNode" in out.grad_fn.name() and out.dtype == torch.float32 and torch.equal(out.detach(), ref_lm)
    with torch.no_grad():
        assert torch.equal(tt.tigon_cross_entropy(xg, t, label_smoothing=0.05), ref)
    if DEVICE == "cuda":
        with torch.inference_mode():
            assert torch.equal(tt.tigon_cross_entropy(x, t, label_smoothing=0.05), ref)
    res = tt.tigon_cross_entropy(xg, t, label_smoothing=0.05, return_z_loss=True)
    assert "CppNode" not in type(res.loss.grad_fn).__name__ and torch.equal(res.loss.detach(), ref)
    wide = torch.randn(12, 512, generator=g, device=DEVICE).to(torch.bfloat16)[:, :256].requires_grad_()
    assert "CppNode" not in type(tt.tigon_cross_entropy(wide, t).grad_fn).__name__
    bad = t.clone()
    bad[1, 2] = 256
    before = xg.detach().clone()
    for in_place in (False, True):
        with pytest.raises(tt.TargetOutOfRangeError, match=r"target 256 is out of bounds.*ignore_index \(-100\)"):
            tt.tigon_cross_entropy(xg, bad, in_place=in_place)
        with pytest.raises(AssertionError):
            tt.tigon_cross_entropy(xg, bad, in_place=in_place)
    assert torch.equal(xg.detach(), before) and xg.grad is None
    with pytest.raises(ValueError, match="class weights"):
        tt.tigon_cross_entropy(xg, t, torch.ones(255, device=DEVICE))
    with pytest.raises(ValueError, match="reduction"):
        tt.tigon_cross_entropy(xg, t, reduction="avg")
    monkeypatch.setenv("TIGON_TORCH_CHECK_TARGETS", "0")
    tt.tigon_cross_entropy(xg, torch.where(bad == 256, -100, bad))  # no check, a valid batch


# Linear cross-entropy: tigon.linear_cross_entropy_loss against TigonFusedLinearCrossEntropyFunction.
# (x's shape, vocab, dtype, bias); options as CE_OPTIONS, plus token scaling.
LCE_CASES = [((37, 64), 300, torch.bfloat16, True), ((2, 5, 64), 96, torch.float32, False),
             ((9, 64), 200, torch.float16, True), ((0, 64), 96, torch.bfloat16, True)]
LCE_OPTIONS = dict(CE_OPTIONS, **{"token_scaling": {"token_scaling": True}})


def _lce_step(cpp, shape, vocab, dtype, bias, options, reduction, accum, wants, upstream, autocast):
    g = torch.Generator(device=DEVICE).manual_seed(8)
    pdtype = torch.float32 if autocast else dtype
    x = torch.randn(shape, generator=g, device=DEVICE).to(pdtype).requires_grad_("x" in wants)
    w = (0.2 * torch.randn(vocab, shape[-1], generator=g, device=DEVICE)).to(pdtype).requires_grad_("w" in wants)
    b = (0.1 * torch.randn(vocab, generator=g, device=DEVICE)).to(pdtype).requires_grad_("w" in wants) if bias else None
    t = torch.randint(0, vocab, shape[:-1], generator=g, device=DEVICE).reshape(-1)
    if t.numel() > 2:
        t[1] = -100
    cw = torch.rand(vocab, generator=g, device=DEVICE) + 0.5 if options.get("weights") else None
    z, s, cap = options.get("z", 0.0), options.get("smoothing", 0.0), options.get("softcap")
    ts = options.get("token_scaling", False)
    acc = torch.float32 if accum else None
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        if cpp:
            loss = _ops.ops().linear_cross_entropy_loss(x, w, b, t, cw, -100, z, s, _ops.REDUCTIONS[reduction],
                                                        0.0 if cap is None else cap, accum, ts, 0, True)
        else:
            loss = fn.TigonFusedLinearCrossEntropyFunction.apply(x, w, t, b, cw, -100, z, s, reduction, cap, False,
                                                                 acc, ts)[0]
    node = loss.grad_fn
    if not wants:
        pass
    elif upstream == "retain":  # the graph kept: scaled out of place, then a second backward
        loss.backward(torch.tensor(0.75, device=DEVICE), retain_graph=True)
        loss.backward(torch.tensor(1.5, device=DEVICE))
    elif upstream == "one":
        loss.backward()
    else:
        loss.backward(torch.tensor(2.5, device=DEVICE))
    return (loss.detach(), x.grad, w.grad, None if b is None else b.grad, node)


@pytest.mark.parametrize("upstream", ["one", "scaled", "retain"])
@pytest.mark.parametrize("accum", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("options", list(LCE_OPTIONS))
@pytest.mark.parametrize("shape,vocab,dtype,bias", LCE_CASES)
@pytest.mark.gpu
def test_linear_cross_entropy_same_bits_as_the_python_function(ext, shape, vocab, dtype, bias, options, reduction,
                                                               accum, upstream):
    args = (shape, vocab, dtype, bias, LCE_OPTIONS[options], reduction, accum, "xw", upstream, False)
    ref = _lce_step(False, *args)
    out = _lce_step(True, *args)
    _same_bits(("loss", "dx", "dw", "db"), ref, out)


@pytest.mark.parametrize("wants", ["x", "w", ""])
@pytest.mark.gpu
def test_linear_cross_entropy_partial_gradients(ext, wants):
    """Only the gradients asked for are computed (a frozen head; frozen hidden states; none)."""
    args = ((11, 64), 128, torch.bfloat16, True, {}, "mean", False, wants, "one", False)
    ref = _lce_step(False, *args)
    out = _lce_step(True, *args)
    if not wants:
        assert out[-1] is None and ref[-1] is None and torch.equal(out[0], ref[0])
        return
    _same_bits(("loss", "dx", "dw", "db"), ref, out)


@pytest.mark.cuda_only
def test_linear_cross_entropy_autocast_same_bits(ext):
    """Under CUDA autocast (fp32 parameters, bf16 operands) the operands are cast as the Python Function
    casts them, and the gradients come back in the parameters' dtype."""
    args = ((16, 64), 300, torch.bfloat16, True, {}, "mean", False, "xw", "scaled", True)
    ref = _lce_step(False, *args)
    out = _lce_step(True, *args)
    assert out[1].dtype == torch.float32 and out[2].dtype == torch.float32
    _same_bits(("loss", "dx", "dw", "db"), ref, out)


@pytest.mark.gpu
def test_linear_cross_entropy_routing(ext, monkeypatch):
    """tigon_fused_linear_cross_entropy and TigonFusedLinearCrossEntropyLoss take the C++ operator for the
    loss alone with reduction mean or sum; reduction none, a return_* flag and accum_dtype equal to the
    weight's take the Python Function; bad targets raise TargetOutOfRangeError before any gradient."""
    g = torch.Generator(device=DEVICE).manual_seed(9)
    x = torch.randn(2, 6, 64, generator=g, device=DEVICE).to(torch.bfloat16).requires_grad_()
    w = (0.2 * torch.randn(256, 64, generator=g, device=DEVICE)).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, 256, (2, 6), generator=g, device=DEVICE)
    monkeypatch.setattr(fn, "CPP_AUTOGRAD", False)
    ref = tt.tigon_fused_linear_cross_entropy(x, w, t, reduction="sum")
    assert "CppNode" not in type(ref.grad_fn).__name__
    monkeypatch.setattr(fn, "CPP_AUTOGRAD", True)
    out = tt.tigon_fused_linear_cross_entropy(x, w, t, reduction="sum")
    assert "CppNode" in out.grad_fn.name() and torch.equal(out.detach(), ref.detach())
    out = tt.TigonFusedLinearCrossEntropyLoss(reduction="sum")(w, x, t)
    assert "CppNode" in out.grad_fn.name() and torch.equal(out.detach(), ref.detach())
    for kw in ({"reduction": "none"}, {"return_z_loss": True}, {"accum_dtype": torch.bfloat16}):
        res = tt.tigon_fused_linear_cross_entropy(x, w, t, **kw)
        loss = res.loss if kw.get("return_z_loss") else res
        assert "CppNode" not in type(loss.grad_fn).__name__
    bad = t.clone()
    bad[1, 3] = -5
    with pytest.raises(tt.TargetOutOfRangeError, match=r"target -5 is out of bounds"):
        tt.tigon_fused_linear_cross_entropy(x, w, bad)
    with pytest.raises(TypeError, match="one dtype"):
        tt.tigon_fused_linear_cross_entropy(x, w.detach().float(), t)
    with pytest.raises(ValueError, match="tokens"):
        tt.tigon_fused_linear_cross_entropy(x, w, t[:, :5])
    assert x.grad is None and w.grad is None


@pytest.mark.cuda_only
def test_loss_operators_under_sync_debug_modes(ext, monkeypatch):
    """The C++ losses' target check is reported under CUDA's sync debug mode "warn", as check_targets
    reports it, and skipped under "error" (a step declared synchronisation-free), with nothing else in
    their forward or backward synchronising."""
    monkeypatch.setattr(fn, "CPP_AUTOGRAD", True)
    x = torch.randn(3, 40, device="cuda", requires_grad=True)
    h = torch.randn(3, 16, device="cuda", requires_grad=True)
    w = torch.randn(40, 16, device="cuda", requires_grad=True)
    t = torch.tensor([1, 2, -100], device="cuda")
    calls = (lambda: tt.tigon_cross_entropy(x, t), lambda: tt.tigon_fused_linear_cross_entropy(h, w, t))
    prev = torch.cuda.get_sync_debug_mode()
    try:
        torch.cuda.set_sync_debug_mode("warn")
        for call in calls:
            with pytest.warns(UserWarning, match="synchroniz"):
                loss = call()
            assert "CppNode" in loss.grad_fn.name()
        torch.cuda.set_sync_debug_mode("error")
        for call in calls:
            call().backward()
    finally:
        torch.cuda.set_sync_debug_mode(prev)

"""The distillation losses: TigonJSDFunction / TigonJSD / tigon_jsd, TigonKLDivLossFunction /
TigonKLDIVLoss / tigon_kl_div, TigonTVDLossFunction / TigonTVDLoss / tigon_tvd and
TigonFusedLinearJSDFunction / TigonFusedLinearJSD / tigon_fused_linear_jsd, forward and backward.

Two parts:

- tigon's own cases: every entry point against plain PyTorch formulas (F.kl_div, the generalised
  JSD's definition with beta, the TVD's), fp32 / fp16 / bf16, shift_labels with ignore_index and
  all-ignored batches, beta 0 / 1 / in between, every reduction, upstream gradients other than 1
  (per element under "none"), teachers of another dtype, several chunks of the fused linear JSD,
  the operator's in-place gradient, bad arguments, torch.compile, FakeTensorMode, no host
  synchronisation;
- Liger-Kernel 0.8.2's tests of the four ops (test/transformers/test_jsd.py, test_kl_div.py,
  test_tvd.py, test_fused_linear_jsd.py) ported with their shapes, dtypes, options and (atol, rtol),
  against references written here from the definitions (PyTorch in float64: never tigon, never Liger).
  Liger's tests that compare two Liger entry points with each other compare both with the reference.

In the CPU reference mode (TIGON_TORCH_REFERENCE_OPS=1) cases above CPU_ELEMENT_CAP elements are
skipped unless TIGON_LIGER_FULL=1; on a GPU every case runs.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE, HAS_CUDA, REFERENCE, assert_rel

import tigon_torch as tt

pytestmark = pytest.mark.gpu

DEV = DEVICE
REF = torch.float64  # the references' arithmetic
CPU_ELEMENT_CAP = 70_000_000
BF, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def cap_on_cpu(numel: int) -> None:
    if REFERENCE and numel > CPU_ELEMENT_CAP and os.environ.get("TIGON_LIGER_FULL") != "1":
        pytest.skip(f"{numel} elements: too large for the CPU reference mode (TIGON_LIGER_FULL=1 runs it)")


def close(actual, expected, atol, rtol, what=""):
    """|actual - expected| <= atol + rtol * |expected| element-wise, in float64, same shape."""
    assert actual is not None, f"{what}: got None"
    assert tuple(actual.shape) == tuple(expected.shape), f"{what}: shape {tuple(actual.shape)}, " \
                                                         f"expected {tuple(expected.shape)}"
    torch.testing.assert_close(actual.detach().double(), expected.detach().double(), atol=atol, rtol=rtol,
                               msg=lambda m: f"{what}: {m}")


def assign_ignore_index(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Sets a random number (1 to n // 2 - 1) of random positions to ignore_index, in place (Liger's scheme)."""
    n = labels.shape[0]
    count = int(torch.randint(1, max(2, n // 2), (1,)).item())
    labels[torch.randperm(n)[:count].to(labels.device)] = ignore_index
    return labels


def make_labels(kind, rows, vocab, ignore_index=-100):
    if kind is None:
        return None
    labels = torch.randint(0, vocab, (rows,), device=DEV, dtype=torch.long)
    if kind == "all":
        labels.fill_(ignore_index)
    else:
        assign_ignore_index(labels, ignore_index)
    return labels


def log_probs(rows, vocab, dtype, requires_grad=False):
    x = torch.randn(rows, vocab, device=DEV, dtype=dtype).log_softmax(dim=-1).detach()
    return x.requires_grad_(requires_grad)


# ------------------------------------------------------------------------------------------------
# References (PyTorch, float64)
# ------------------------------------------------------------------------------------------------


def _masked_mean(rows, labels, ignore_index):
    """The sum of the rows' losses over the non-ignored rows, divided by their count (0 when none is)."""
    if labels is None:
        return rows.sum() / rows.shape[0]
    valid = labels != ignore_index
    n = int(valid.sum())
    if n == 0:
        return rows.sum() * 0.0
    return torch.where(valid, rows, torch.zeros_like(rows)).sum() / n


def ref_jsd(log_q, log_p, beta=0.5, labels=None, ignore_index=-100):
    """The generalised JSD, beta KL(P || M) + (1 - beta) KL(Q || M) with M = beta P + (1 - beta) Q, from its
    definition with F.kl_div (beta 0: KL(P || Q); beta 1: KL(Q || P)); the mean over non-ignored rows."""
    lq, lp = log_q.to(REF), log_p.to(REF)
    kl = lambda inp, tgt: F.kl_div(inp, tgt, reduction="none", log_target=True).sum(-1)  # noqa: E731
    if beta == 0.0:
        rows = kl(lq, lp)
    elif beta == 1.0:
        rows = kl(lp, lq)
    else:
        log_m = torch.log(beta * lp.exp() + (1.0 - beta) * lq.exp())
        rows = beta * kl(log_m, lp) + (1.0 - beta) * kl(log_m, lq)
    return _masked_mean(rows, labels, ignore_index)


def ref_kl_div(y_pred, y_true, reduction, log_target):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # reduction "mean" warns that it is not "batchmean"
        return F.kl_div(y_pred.to(REF), y_true.to(REF), reduction=reduction, log_target=log_target)


def ref_tvd(p, q, reduction="batchmean", labels=None, ignore_index=-100):
    tvd = (p.to(REF) - q.to(REF)).abs() / 2.0
    n = p.shape[0]
    if labels is not None:
        valid = labels != ignore_index
        tvd = torch.where(valid[:, None], tvd, torch.zeros_like(tvd))
        n = int(valid.sum())
        if n == 0:
            return tvd if reduction == "none" else tvd.sum() * 0.0
    if reduction == "none":
        return tvd
    if reduction == "sum":
        return tvd.sum()
    if reduction == "mean":
        return tvd.sum() / (n * p.shape[1])
    return tvd.sum() / n


def ref_lm_head_jsd(x, w, xt, wt, beta=0.5, temperature=1.0, labels=None, ignore_index=-100):
    """The unfused heads: the logits in the inputs' dtype (F.linear), upcast, log_softmax(z / T), the JSD."""
    zs = F.linear(x, w).to(REF)
    zt = F.linear(xt, wt).to(REF)
    return ref_jsd(torch.log_softmax(zs / temperature, dim=-1), torch.log_softmax(zt / temperature, dim=-1), beta,
                   labels, ignore_index)


# ------------------------------------------------------------------------------------------------
# tigon's cases
# ------------------------------------------------------------------------------------------------

DTYPES = [FP32, FP16, BF]
ENTRIES = ["function", "module", "functional"]


def _jsd(entry, x, y, labels, beta, ignore_index):
    if entry == "function":
        return tt.TigonJSDFunction.apply(x, y, labels, beta, ignore_index)
    if entry == "module":
        return tt.TigonJSD(beta=beta, ignore_index=ignore_index)(x, y, labels)
    return tt.tigon_jsd(x, y, shift_labels=labels, beta=beta, ignore_index=ignore_index)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("labels_kind", [None, "some", "all"])
@pytest.mark.parametrize("upstream", [1.0, 2.5])
@pytest.mark.parametrize("entry", ENTRIES)
def test_jsd(ext, seed, dtype, beta, labels_kind, upstream, entry):
    rows, vocab, ignore_index = 37, 1000, 7
    x = log_probs(rows, vocab, dtype, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y = log_probs(rows, vocab, dtype)
    labels = make_labels(labels_kind, rows, vocab, ignore_index)
    out = _jsd(entry, x, y, labels, beta, ignore_index)
    ref = ref_jsd(x_ref, y, beta, labels, ignore_index)
    assert out.dtype == dtype and out.shape == ()
    (out * upstream).backward()
    (ref * upstream).backward()
    if labels_kind == "all":
        assert float(out.detach()) == 0.0 and torch.count_nonzero(x.grad) == 0
        return
    assert_rel(out.float(), ref.float(), dtype, what="loss")
    assert_rel(x.grad, x_ref.grad, dtype, what="dx")
    assert x.grad.dtype == dtype


@pytest.mark.parametrize("dtype, teacher_dtype", [(BF, FP32), (FP16, FP32), (FP32, BF), (BF, FP16)])
def test_jsd_teacher_dtype(ext, seed, dtype, teacher_dtype):
    rows, vocab = 19, 515
    x = log_probs(rows, vocab, dtype, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y = log_probs(rows, vocab, teacher_dtype)
    out = tt.tigon_jsd(x, y, beta=0.4)
    ref = ref_jsd(x_ref, y, 0.4)
    out.backward()
    ref.backward()
    assert out.dtype == dtype
    assert_rel(out.float(), ref.float(), dtype, what="loss")
    assert_rel(x.grad, x_ref.grad, dtype, what="dx")


def _kl(entry, x, y, reduction, log_target):
    if entry == "function":
        return tt.TigonKLDivLossFunction.apply(x, y, reduction, log_target)
    if entry == "module":
        return tt.TigonKLDIVLoss(reduction=reduction, log_target=log_target)(x, y)
    return tt.tigon_kl_div(x, y, reduction=reduction, log_target=log_target)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("teacher_dtype", ["same", FP32])
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean", "none"])
@pytest.mark.parametrize("log_target", [False, True])
@pytest.mark.parametrize("upstream", [1.0, 2.5])
@pytest.mark.parametrize("entry", ENTRIES)
def test_kl_div(ext, seed, dtype, teacher_dtype, reduction, log_target, upstream, entry):
    rows, vocab = 29, 777
    tdt = dtype if teacher_dtype == "same" else teacher_dtype
    x = log_probs(rows, vocab, dtype, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y = log_probs(rows, vocab, tdt) if log_target else torch.randn(rows, vocab, device=DEV).softmax(-1).to(tdt)
    out = _kl(entry, x, y, reduction, log_target)
    ref = ref_kl_div(x_ref, y, reduction, log_target)
    assert out.dtype == FP32 and out.shape == ref.shape
    if reduction == "none":
        go = torch.rand(rows, vocab, device=DEV) * upstream
        out.backward(go)
        ref.backward(go.to(REF))
        close(out, ref, 1e-6, 1e-5, "loss elements")
    else:
        (out * upstream).backward()
        (ref * upstream).backward()
        assert_rel(out, ref.float(), FP32, what="loss")
    assert_rel(x.grad, x_ref.grad, dtype, what="dx")


def _tvd(entry, p, q, labels, reduction, ignore_index):
    if entry == "function":
        return tt.TigonTVDLossFunction.apply(p, q, labels, reduction, ignore_index)
    if entry == "module":
        return tt.TigonTVDLoss(reduction=reduction, ignore_index=ignore_index)(p, q, labels)
    return tt.tigon_tvd(p, q, shift_labels=labels, reduction=reduction, ignore_index=ignore_index)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean", "none"])
@pytest.mark.parametrize("labels_kind", [None, "some", "all"])
@pytest.mark.parametrize("upstream", [1.0, 2.5])
@pytest.mark.parametrize("entry", ENTRIES)
def test_tvd(ext, seed, dtype, reduction, labels_kind, upstream, entry):
    rows, vocab, ignore_index = 23, 640, -100
    p = torch.randn(rows, vocab, device=DEV).softmax(-1).to(dtype).requires_grad_(True)
    p_ref = p.detach().clone().requires_grad_(True)
    q = torch.randn(rows, vocab, device=DEV).softmax(-1)  # float32, as in Liger's tests
    labels = make_labels(labels_kind, rows, vocab, ignore_index)
    out = _tvd(entry, p, q, labels, reduction, ignore_index)
    ref = ref_tvd(p_ref, q, reduction, labels, ignore_index)
    assert out.dtype == FP32 and out.shape == ref.shape
    if reduction == "none":
        go = torch.rand(rows, vocab, device=DEV) * upstream
        out.backward(go)
        ref.backward(go.to(REF))
        close(out, ref, 1e-7, 1e-5, "loss elements")
    else:
        (out * upstream).backward()
        if labels_kind == "all":
            assert float(out.detach()) == 0.0 and torch.count_nonzero(p.grad) == 0
            return
        (ref * upstream).backward()
        assert_rel(out, ref.float(), FP32, what="loss")
    if labels_kind == "all":
        assert torch.count_nonzero(p.grad) == 0
        return
    assert_rel(p.grad, p_ref.grad, dtype, what="dp")


class _Heads:
    """A student head [V, H] and a teacher head [V, H_t], drawn once; leaf copies for tigon and the reference."""

    def __init__(self, hidden, teacher_hidden, vocab, dtype, teacher_dtype=None, draw=torch.rand):
        teacher_dtype = teacher_dtype or dtype
        w = draw(vocab, hidden, device=DEV, dtype=dtype)
        self.w, self.w_ref = w.clone().requires_grad_(True), w.clone().requires_grad_(True)
        self.wt = draw(vocab, teacher_hidden, device=DEV, dtype=teacher_dtype)


@pytest.mark.parametrize("dtype, teacher_dtype", [(FP32, FP32), (BF, BF), (BF, FP32)])
@pytest.mark.parametrize("beta, temperature", [(0.5, 1.0), (0.0, 1.0), (1.0, 1.0), (0.2, 2.0)])
@pytest.mark.parametrize("labels_kind", [None, "some", "all"])
@pytest.mark.parametrize("chunk", [None, 16])
@pytest.mark.parametrize("upstream", [1.0, 2.5])
def test_fused_linear_jsd(ext, seed, monkeypatch, dtype, teacher_dtype, beta, temperature, labels_kind, chunk,
                          upstream):
    if chunk is not None:
        monkeypatch.setenv("TIGON_TORCH_JSD_CHUNK", str(chunk))
    rows, hidden, teacher_hidden, vocab, ignore_index = 45, 48, 80, 300, 3
    heads = _Heads(hidden, teacher_hidden, vocab, dtype, teacher_dtype, draw=torch.randn)
    x0 = torch.randn(rows, hidden, device=DEV, dtype=dtype) * 0.2
    x, x_ref = x0.clone().requires_grad_(True), x0.clone().requires_grad_(True)
    xt = torch.randn(rows, teacher_hidden, device=DEV, dtype=teacher_dtype) * 0.2
    labels = make_labels(labels_kind, rows, vocab, ignore_index)
    out = tt.TigonFusedLinearJSDFunction.apply(x, heads.w, xt, heads.wt, labels, beta, ignore_index, temperature)
    ref = ref_lm_head_jsd(x_ref, heads.w_ref, xt, heads.wt, beta, temperature, labels, ignore_index)
    assert out.dtype == FP32 and out.shape == ()
    (out * upstream).backward()
    if labels_kind == "all":
        assert float(out.detach()) == 0.0
        assert torch.count_nonzero(x.grad) == 0 and torch.count_nonzero(heads.w.grad) == 0
        return
    (ref * upstream).backward()
    assert_rel(out, ref.float(), dtype, what="loss")
    assert x.grad.dtype == dtype and heads.w.grad.dtype == dtype
    assert_rel(x.grad, x_ref.grad, dtype, factor=2.0, what="dx")
    assert_rel(heads.w.grad, heads.w_ref.grad, dtype, factor=2.0, what="dW")


@pytest.mark.parametrize("want", ["dx", "dw"])
def test_fused_linear_jsd_one_gradient(ext, seed, want):
    rows, hidden, vocab = 33, 40, 257
    heads = _Heads(hidden, hidden, vocab, FP32, draw=torch.randn)
    x0 = torch.randn(rows, hidden, device=DEV) * 0.3
    x, x_ref = x0.clone(), x0.clone()
    w, w_ref = heads.w, heads.w_ref
    if want == "dx":
        x.requires_grad_(True)
        x_ref.requires_grad_(True)
        w, w_ref = w.detach(), w_ref.detach()
    xt = torch.randn(rows, hidden, device=DEV) * 0.3
    out = tt.TigonFusedLinearJSD(jsd_beta=0.7, temperature=1.5)(x, w, xt, heads.wt, None)
    ref = ref_lm_head_jsd(x_ref, w_ref, xt, heads.wt, 0.7, 1.5)
    out.backward()
    ref.backward()
    assert_rel(out, ref.float(), FP32, what="loss")
    if want == "dx":
        assert_rel(x.grad, x_ref.grad, FP32, what="dx")
    else:
        assert x.grad is None
        assert_rel(heads.w.grad, heads.w_ref.grad, FP32, what="dW")


def test_fused_linear_jsd_no_grad(ext, seed):
    heads = _Heads(32, 24, 100, BF, draw=torch.randn)
    x, xt = torch.randn(10, 32, device=DEV, dtype=BF), torch.randn(10, 24, device=DEV, dtype=BF)
    with torch.no_grad():
        out = tt.tigon_fused_linear_jsd(x, heads.w, xt, heads.wt, jsd_beta=0.5)
    ref = ref_lm_head_jsd(x, heads.w.detach(), xt, heads.wt, 0.5)
    assert_rel(out, ref.float(), BF, what="loss")


def test_empty_batch(ext):
    x = torch.empty(0, 50, device=DEV, requires_grad=True)
    y = torch.empty(0, 50, device=DEV)
    assert float(tt.tigon_jsd(x, y).detach()) == 0.0
    assert float(tt.TigonKLDIVLoss(reduction="sum")(x, y).detach()) == 0.0
    assert float(tt.TigonTVDLoss(reduction="sum")(x, y).detach()) == 0.0


def test_upstream_exactly_one_keeps_gradient(ext, seed):
    """The forward's gradient with an upstream gradient of exactly 1: the scaling pass skips it."""
    x = log_probs(12, 300, BF, requires_grad=True)
    y = log_probs(12, 300, BF)
    tt.tigon_jsd(x, y).backward()
    g1 = x.grad.clone()
    x.grad = None
    (tt.tigon_jsd(x, y) * 1.0).backward(torch.ones((), device=DEV, dtype=BF))
    assert torch.equal(x.grad, g1)


def test_second_backward(ext, seed):
    """One backward per forward where the gradient comes from the forward; the deferred (float16) path
    takes several."""
    x = log_probs(8, 200, BF, requires_grad=True)
    y = log_probs(8, 200, BF)
    loss = tt.tigon_jsd(x, y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()
    x16 = log_probs(8, 200, FP16, requires_grad=True)
    loss = tt.tigon_jsd(x16, y.to(FP16))
    loss.backward(retain_graph=True)
    g1 = x16.grad.clone()
    loss.backward()
    torch.testing.assert_close(x16.grad.float(), 2 * g1.float(), atol=0, rtol=1e-3)


def test_op_in_place_gradient(ext, seed):
    """tigon.divergence with dx the student itself (the fused linear JSD's in-place chunk) writes what it
    writes into a separate buffer."""
    ops = tt.ops.ops()
    z = torch.randn(9, 333, device=DEV, dtype=BF)
    zt = torch.randn(9, 333, device=DEV, dtype=BF)
    labels = torch.tensor([0, -100, 3, 4, -100, 1, 2, 2, 9], device=DEV)
    loss1, loss2 = torch.empty((), device=DEV), torch.empty((), device=DEV)
    dz = torch.empty_like(z)
    args = (0, 2, 2, 3, -100, 0.5, 0.0, 2.0, 1.0)  # JSD, logits / logits, batchmean, T = 2
    ops.divergence(z, zt, labels, None, dz, loss1, None, None, *args)
    z2 = z.clone()
    ops.divergence(z2, zt, labels, None, z2, loss2, None, None, *args)
    assert torch.equal(z2, dz) and torch.equal(loss1, loss2)
    # against the definition: the gradient through log_softmax(z / T)
    zr = z.to(REF).requires_grad_(True)
    ref = ref_jsd(torch.log_softmax(zr / 2.0, -1), torch.log_softmax(zt.to(REF) / 2.0, -1), 0.5, labels)
    ref.backward()
    assert_rel(loss1, ref.float(), BF, what="loss")
    assert_rel(dz, zr.grad.to(BF), BF, what="dz")


@pytest.mark.parametrize("kind", [0, 1, 2])
def test_op_reduction_none_rows_and_elements(ext, seed, kind):
    """tigon.divergence's reduction none: per-row losses and a per-row upstream gradient for the JSD
    family, per-element ones for KL and TVD, and the row sums for every kind."""
    ops = tt.ops.ops()
    rows, vocab = 11, 129
    if kind == 2:
        x = torch.randn(rows, vocab, device=DEV).softmax(-1)
        y = torch.randn(rows, vocab, device=DEV).softmax(-1)
        forms = (1, 1)
    else:
        x, y = log_probs(rows, vocab, FP32), log_probs(rows, vocab, FP32)
        forms = (0, 0)
    labels = torch.randint(0, vocab, (rows,), device=DEV)
    labels[[1, 5]] = -100
    go = torch.rand(rows, device=DEV) if kind == 0 else torch.rand(rows, vocab, device=DEV)
    dx = torch.empty_like(x)
    loss_rows = torch.empty(rows, device=DEV)
    elems = torch.empty(rows, vocab, device=DEV) if kind != 0 else None
    ops.divergence(x, y, labels, go, dx, None, loss_rows, elems, kind, *forms, 0, -100, 0.25, 1e-10, 1.0, 1.0)
    xr = x.to(REF).requires_grad_(True)
    valid = (labels != -100).to(REF)[:, None]
    if kind == 0:
        m = torch.log(0.25 * y.to(REF).exp() + 0.75 * xr.exp())
        el = 0.25 * F.kl_div(m, y.to(REF), reduction="none", log_target=True) + 0.75 * F.kl_div(
            m, xr, reduction="none", log_target=True)
        el = el * valid
        el.sum(-1).backward(go.to(REF))
    else:
        el = (F.kl_div(xr, y.to(REF), reduction="none", log_target=True) if kind == 1
              else (xr - y.to(REF)).abs() / 2) * valid
        el.backward(go.to(REF))
        close(elems, el, 1e-7, 1e-5, "loss_elems")
    close(loss_rows, el.sum(-1), 1e-6, 1e-5, "loss_rows")
    assert_rel(dx, xr.grad, FP32, what="dx")


def test_bad_arguments(ext, seed):
    x = log_probs(4, 50, FP32, requires_grad=True)
    y = log_probs(4, 50, FP32)
    for beta in (-0.1, 1.5):
        with pytest.raises(ValueError, match="beta"):
            tt.tigon_jsd(x, y, beta=beta)
        with pytest.raises(ValueError, match="beta"):
            tt.TigonJSD(beta=beta)
    with pytest.raises(ValueError, match="vocabulary"):
        tt.tigon_jsd(x, log_probs(4, 51, FP32))
    with pytest.raises(ValueError, match="rows"):
        tt.TigonKLDIVLoss()(x, log_probs(5, 50, FP32))
    with pytest.raises(ValueError, match="vocabulary"):
        tt.tigon_tvd(x.exp(), torch.rand(4, 49, device=DEV))
    with pytest.raises(ValueError, match="shift_labels"):
        tt.tigon_jsd(x, y, shift_labels=torch.zeros(5, dtype=torch.long, device=DEV))
    with pytest.raises(ValueError, match="reduction"):
        tt.TigonTVDLoss(reduction="average")
    with pytest.raises(ValueError, match="reduction"):
        tt.tigon_kl_div(x, y, reduction="average")
    with pytest.raises(TypeError):
        tt.tigon_jsd(x.detach().double(), y)
    with pytest.raises(ValueError, match="2-D"):
        tt.tigon_jsd(x.reshape(2, 2, 50), y.reshape(2, 2, 50))
    assert x.grad is None
    heads = _Heads(16, 24, 50, FP32, draw=torch.randn)
    h, ht = torch.randn(4, 16, device=DEV, requires_grad=True), torch.randn(4, 24, device=DEV)
    for t in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            tt.tigon_fused_linear_jsd(h, heads.w, ht, heads.wt, temperature=t)
    with pytest.raises(ValueError, match="temperature"):
        tt.TigonFusedLinearJSD(temperature=0.0)
    with pytest.raises(ValueError, match="beta"):
        tt.tigon_fused_linear_jsd(h, heads.w, ht, heads.wt, jsd_beta=2.0)
    with pytest.raises(ValueError, match="vocabulary"):
        tt.tigon_fused_linear_jsd(h, heads.w, ht, torch.randn(51, 24, device=DEV))
    with pytest.raises(ValueError, match="tokens"):
        tt.tigon_fused_linear_jsd(h, heads.w, ht[:3], heads.wt)
    with pytest.raises(TypeError):
        tt.tigon_fused_linear_jsd(h, heads.w.detach().to(BF), ht, heads.wt)
    assert h.grad is None and heads.w.grad is None


@pytest.mark.cuda_only
def test_operator_checks(ext):
    """tigon's own checks, through the operator: a teacher dtype it does not take, input forms it does not
    compile, tigon's statuses as ValueError."""
    ops = tt.ops.ops()
    x = torch.randn(4, 64, device="cuda").log_softmax(-1)
    loss = torch.empty((), device="cuda")
    with pytest.raises(TypeError, match="teacher"):
        ops.divergence(x.to(BF), x.to(FP16), None, None, None, loss, None, None, 0, 0, 0, 3, -100, 0.5, 0.0, 1.0, 1.0)
    with pytest.raises(NotImplementedError):
        ops.divergence(x, x.exp(), None, None, None, loss, None, None, 0, 0, 1, 3, -100, 0.5, 0.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="beta"):
        ops.divergence(x, x, None, None, None, loss, None, None, 0, 0, 0, 3, -100, 1.5, 0.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="temperature"):
        ops.divergence(x, x, None, None, None, loss, None, None, 0, 2, 2, 3, -100, 0.5, 0.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="teacher_vocab"):
        ops.divergence(x, x[:, :63], None, None, None, loss, None, None, 0, 0, 0, 3, -100, 0.5, 0.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="loss"):
        ops.divergence(x, x, None, None, None, loss, None, None, 1, 0, 0, 0, -100, 0.5, 0.0, 1.0, 1.0)


def test_torch_compile(ext, seed):
    """Each function traced by Dynamo and AOTAutograd (backend aot_eager) gives eager's values and gradients."""
    rows, vocab, hidden = 16, 200, 24
    x0 = log_probs(rows, vocab, FP32)
    y = log_probs(rows, vocab, FP32)
    labels = make_labels("some", rows, vocab)
    heads = _Heads(hidden, hidden, vocab, FP32, draw=torch.randn)
    h0 = torch.randn(rows, hidden, device=DEV) * 0.3
    ht = torch.randn(rows, hidden, device=DEV) * 0.3

    def step(x, h, w):
        return (tt.tigon_jsd(x, y, labels, 0.3) + tt.TigonKLDIVLoss(reduction="batchmean")(x, y.exp())
                + tt.tigon_tvd(x.exp(), y.exp(), labels, "sum") + tt.tigon_fused_linear_jsd(h, w, ht, heads.wt, labels))

    outs = []
    for fn in (step, torch.compile(step, backend="aot_eager", fullgraph=False)):
        x = x0.clone().requires_grad_(True)
        h = h0.clone().requires_grad_(True)
        w = heads.w.detach().clone().requires_grad_(True)
        loss = fn(x, h, w)
        (loss * 1.5).backward()
        outs.append((loss.detach(), x.grad, h.grad, w.grad))
    for a, b, what in zip(outs[0], outs[1], ("loss", "dx", "dh", "dW")):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5, msg=lambda m, what=what: f"{what}: {m}")


@pytest.mark.cuda_only
def test_no_host_sync(ext, seed):
    x = log_probs(16, 300, BF, requires_grad=True)
    y = log_probs(16, 300, BF)
    labels = make_labels("some", 16, 300)
    heads = _Heads(32, 48, 300, BF, draw=torch.randn)
    h = torch.randn(16, 32, device="cuda", dtype=BF, requires_grad=True)
    ht = torch.randn(16, 48, device="cuda", dtype=BF)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = (tt.tigon_jsd(x, y, labels).float() + tt.tigon_kl_div(x, y, reduction="batchmean", log_target=True)
                + tt.tigon_tvd(x.exp(), y.exp(), labels) + tt.tigon_fused_linear_jsd(h, heads.w, ht, heads.wt, labels))
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.skipif(not HAS_CUDA and os.environ.get("TIGON_TORCH_FAKE") != "1",
                    reason="needs a CUDA GPU, or TIGON_TORCH_FAKE=1 with the operators built")
def test_fake_tensors(ext):
    """Forward and backward of every function under FakeTensorMode with fake CUDA tensors: the schema takes
    the arguments, the fake kernel lets it trace, and the outputs and gradients have their shapes and dtypes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(6, 100, device="cuda", dtype=BF, requires_grad=True)
        y = torch.empty(6, 100, device="cuda", dtype=torch.float32)
        labels = torch.zeros(6, device="cuda", dtype=torch.long)
        for out in (tt.TigonJSDFunction.apply(x, y, labels, 0.5, -100),
                    tt.TigonKLDivLossFunction.apply(x, y, "batchmean", False, 1e-10),
                    tt.TigonTVDLossFunction.apply(x, y, labels, "sum", -100)):
            (dx,) = out.grad_fn.apply(torch.ones_like(out))[:1]
            assert dx.shape == x.shape and dx.dtype == BF
        out = tt.TigonKLDivLossFunction.apply(x, y, "none", True, 1e-10)
        assert out.shape == x.shape and out.dtype == torch.float32
        assert out.grad_fn.apply(torch.ones_like(out))[0].shape == x.shape
        h = torch.empty(6, 32, device="cuda", dtype=BF, requires_grad=True)
        w = torch.empty(100, 32, device="cuda", dtype=BF, requires_grad=True)
        ht, wt = torch.empty(6, 48, device="cuda", dtype=BF), torch.empty(100, 48, device="cuda", dtype=BF)
        out = tt.TigonFusedLinearJSDFunction.apply(h, w, ht, wt, labels, 0.5, -100, 2.0)
        assert out.dtype == torch.float32
        g = out.grad_fn.apply(torch.ones_like(out))
        assert g[0].shape == h.shape and g[1].shape == w.shape and g[1].dtype == BF


# ------------------------------------------------------------------------------------------------
# Liger-Kernel 0.8.2's test_jsd.py
# ------------------------------------------------------------------------------------------------

JSD_SHAPES = ("B, T, V", [(2, 1024, 3200), (41, 401, 1271)])
JSD_DTYPES = ("dtype, atol, rtol", [(BF, 1e-7, 5e-2), (FP32, 1e-7, 1e-6), (FP16, 1e-3, 1e-3)])


def _liger_jsd_once(B, T, V, dtype, atol, rtol, beta=0.5, is_last_layer=True, symmetry=False, entry="module"):
    cap_on_cpu(B * T * V)
    inp = torch.randn(B * T, V, device=DEV, dtype=dtype).log_softmax(dim=-1)
    x1 = inp.detach().clone().requires_grad_(True)
    x2 = inp.detach().clone().requires_grad_(True)
    x3 = inp.detach().clone().requires_grad_(True)
    with torch.no_grad():
        target = torch.randn(B * T, V, dtype=dtype, device=DEV).log_softmax(dim=-1)
    output = ref_jsd(x1, target, beta).to(dtype)
    output2 = _jsd(entry, x2, target, None, beta, -100)
    close(output2, output, atol, rtol, "loss")
    if symmetry:
        output3 = _jsd(entry, target, x3, None, beta, -100)
        close(output3, output2, atol, rtol, "loss with the arguments swapped")
    if not is_last_layer:
        output, output2 = output * 2.0, output2 * 2.0
    output.backward()
    output2.backward()
    close(x2.grad, x1.grad, atol, rtol, "dx")


@pytest.mark.parametrize(*JSD_SHAPES)
@pytest.mark.parametrize(*JSD_DTYPES)
def test_liger_jsd_correctness(ext, seed, B, T, V, dtype, atol, rtol):
    _liger_jsd_once(B, T, V, dtype, atol, rtol, symmetry=True)


@pytest.mark.parametrize(*JSD_SHAPES)
@pytest.mark.parametrize(*JSD_DTYPES)
def test_liger_jsd_correctness_not_last(ext, seed, B, T, V, dtype, atol, rtol):
    _liger_jsd_once(B, T, V, dtype, atol, rtol, symmetry=True, is_last_layer=False)


@pytest.mark.parametrize(*JSD_SHAPES)
@pytest.mark.parametrize(*JSD_DTYPES)
@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_liger_jsd_correctness_with_beta(ext, seed, B, T, V, beta, dtype, atol, rtol):
    _liger_jsd_once(B, T, V, dtype, atol, rtol, beta=beta)


def _liger_jsd_labels_once(B, T, V, dtype, atol, rtol, beta, ignore_index, is_last_layer=True, entries=("module",)):
    cap_on_cpu(B * T * V)
    inp = torch.randn(B * T, V, device=DEV, dtype=dtype).log_softmax(dim=-1)
    with torch.no_grad():
        target = torch.randn(B * T, V, dtype=dtype, device=DEV).log_softmax(dim=-1)
    label = assign_ignore_index(torch.randint(0, V, (B * T,), device=DEV, dtype=torch.long), ignore_index)
    x1 = inp.detach().clone().requires_grad_(True)
    output = ref_jsd(x1, target, beta, label, ignore_index).to(dtype)
    if not is_last_layer:
        output = output * 2.0
    output.backward()
    for entry in entries:
        x2 = inp.detach().clone().requires_grad_(True)
        output2 = _jsd(entry, x2, target, label, beta, ignore_index)
        close(output2 * (1.0 if is_last_layer else 2.0), output, atol, rtol, f"{entry}: loss")
        (output2 * (1.0 if is_last_layer else 2.0)).backward()
        close(x2.grad, x1.grad, atol, rtol, f"{entry}: dx")


@pytest.mark.parametrize(*JSD_SHAPES)
@pytest.mark.parametrize(*JSD_DTYPES)
@pytest.mark.parametrize("ignore_index", [2, 42])
def test_liger_jsd_correctness_with_ignore_index(ext, seed, B, T, V, ignore_index, dtype, atol, rtol):
    _liger_jsd_labels_once(B, T, V, dtype, atol, rtol, 0.5, ignore_index)


@pytest.mark.parametrize(*JSD_SHAPES)
@pytest.mark.parametrize(*JSD_DTYPES)
@pytest.mark.parametrize("beta, ignore_index, is_last_layer", [(0.5, 2, False), (0.1, 42, True)])
def test_liger_jsd_correctness_functional(ext, seed, B, T, V, beta, ignore_index, is_last_layer, dtype, atol, rtol):
    _liger_jsd_labels_once(B, T, V, dtype, atol, rtol, beta, ignore_index, is_last_layer,
                           entries=("function", "functional"))


def test_liger_jsd_correctness_with_all_indices_ignored(ext, seed):
    B, T, V, dtype, atol, rtol, ignore_index = 2, 10, 32, BF, 1e-3, 1e-3, -100
    inp = torch.randn(B * T, V, device=DEV, dtype=dtype).log_softmax(dim=-1)
    x1 = inp.detach().clone().requires_grad_(True)
    x2 = inp.detach().clone().requires_grad_(True)
    with torch.no_grad():
        target = torch.randn(B * T, V, dtype=dtype, device=DEV).log_softmax(dim=-1)
    label = torch.full((B * T,), ignore_index, device=DEV, dtype=torch.long)
    output = ref_jsd(x1, target, 0.5, label, ignore_index).to(dtype)
    output2 = tt.TigonJSD(ignore_index=ignore_index)(x2, target, label)
    close(output2, output, atol, rtol, "loss")
    close(output2, torch.zeros_like(output2), atol, rtol, "loss")
    output2.backward()
    close(x2.grad, torch.zeros_like(x2.grad), atol, rtol, "dx")


# ------------------------------------------------------------------------------------------------
# Liger-Kernel 0.8.2's test_kl_div.py
# ------------------------------------------------------------------------------------------------

KL_SHAPES = ("B, T, V", [(1, 4096, 32000), (41, 401, 1271)])
KL_DTYPES = ("dtype, atol, rtol", [(BF, 1e-8, 5e-2), (FP32, 1e-8, 1e-6), (FP16, 1e-3, 1e-3)])


def _liger_kl_once(B, T, V, dtype, atol, rtol, reduction, log_target, is_last_layer=True):
    cap_on_cpu(B * T * V)
    torch.manual_seed(0)
    inp = torch.randn(B * T, V, device=DEV, dtype=dtype).log_softmax(dim=-1)
    x1 = inp.detach().clone().requires_grad_(True)
    x2 = inp.detach().clone().requires_grad_(True)
    with torch.no_grad():
        target = torch.randn(B * T, V, device=DEV).softmax(dim=-1)  # float32 whatever the input's dtype
    output = ref_kl_div(x1, target, reduction, log_target)
    output2 = tt.TigonKLDIVLoss(reduction=reduction, log_target=log_target)(x2, target)
    close(output2, output, atol, rtol, "loss")
    if not is_last_layer:
        output, output2 = output * 2.0, output2 * 2.0
    if reduction == "none":
        return
    output.backward()
    output2.backward()
    close(x2.grad, x1.grad, atol, rtol, "dx")


@pytest.mark.parametrize(*KL_SHAPES)
@pytest.mark.parametrize("log_target", [True, False])
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean", "none"])
@pytest.mark.parametrize(*KL_DTYPES)
def test_liger_kl_div_correctness(ext, B, T, V, log_target, reduction, dtype, atol, rtol):
    _liger_kl_once(B, T, V, dtype, atol, rtol, reduction, log_target)


@pytest.mark.parametrize(*KL_SHAPES)
@pytest.mark.parametrize("log_target", [True, False])
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean", "none"])
@pytest.mark.parametrize(*KL_DTYPES)
def test_liger_kl_div_correctness_not_last(ext, B, T, V, log_target, reduction, dtype, atol, rtol):
    _liger_kl_once(B, T, V, dtype, atol, rtol, reduction, log_target, is_last_layer=False)


# ------------------------------------------------------------------------------------------------
# Liger-Kernel 0.8.2's test_tvd.py
# ------------------------------------------------------------------------------------------------


def _big_gpu() -> bool:
    return HAS_CUDA and not REFERENCE and torch.cuda.get_device_properties(0).total_memory >= 36e9


TVD_SHAPES = ("B, T, V", [
    (1, 4096, 32000),
    (32, 4096, 1024),
    (41, 401, 1271),
    pytest.param(1, 4096, 128256, marks=pytest.mark.skipif(HAS_CUDA and not REFERENCE and not _big_gpu(),
                                                           reason="needs a GPU with at least 36 GB")),
    (3, 423, 32000),
])
TVD_DTYPES = ("dtype, atol, rtol", [(BF, 1e-8, 1e-6), (FP32, 1e-8, 1e-6)])


def _liger_tvd_once(B, T, V, dtype, atol, rtol, reduction, is_last_layer=True, ignore_index=None):
    cap_on_cpu(B * T * V)
    if ignore_index is None:
        torch.manual_seed(0)
    inp = torch.randn(B * T, V, device=DEV, dtype=dtype)
    x1 = inp.detach().clone().requires_grad_(True)
    x2 = inp.detach().clone().requires_grad_(True)
    with torch.no_grad():
        target = torch.randn(B * T, V, device=DEV).softmax(dim=-1)
    label = None
    if ignore_index is not None:
        label = assign_ignore_index(torch.randint(0, V, (B * T,), device=DEV, dtype=torch.long), ignore_index)
    tvd = tt.TigonTVDLoss(reduction=reduction, ignore_index=-100 if ignore_index is None else ignore_index)
    output = tvd(x1, target, label)
    output2 = ref_tvd(x2, target, reduction, label, -100 if ignore_index is None else ignore_index)
    close(output, output2, atol, rtol, "loss")
    if not is_last_layer:
        output, output2 = output * 2.0, output2 * 2.0
    if reduction == "none":
        return
    output.backward()
    output2.backward()
    close(x1.grad, x2.grad, atol, rtol, "dp")


@pytest.mark.parametrize(*TVD_SHAPES)
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean", "none"])
@pytest.mark.parametrize(*TVD_DTYPES)
def test_liger_tvd_correctness(ext, B, T, V, reduction, dtype, atol, rtol):
    _liger_tvd_once(B, T, V, dtype, atol, rtol, reduction)


@pytest.mark.parametrize(*TVD_SHAPES)
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean", "none"])
@pytest.mark.parametrize(*TVD_DTYPES)
def test_liger_tvd_correctness_not_last(ext, B, T, V, reduction, dtype, atol, rtol):
    _liger_tvd_once(B, T, V, dtype, atol, rtol, reduction, is_last_layer=False)


@pytest.mark.parametrize(*TVD_SHAPES)
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean", "none"])
@pytest.mark.parametrize(*TVD_DTYPES)
@pytest.mark.parametrize("ignore_index", [-100, 0, 1])
def test_liger_tvd_correctness_with_ignore_index(ext, seed, B, T, V, reduction, dtype, atol, rtol, ignore_index):
    _liger_tvd_once(B, T, V, dtype, atol, rtol, reduction, ignore_index=ignore_index)


# ------------------------------------------------------------------------------------------------
# Liger-Kernel 0.8.2's test_fused_linear_jsd.py
# ------------------------------------------------------------------------------------------------

FLJSD_SHAPES = ("B, T, H, V", [(8, 128, 1024, 4096), (4, 423, 167, 1423)])
FLJSD_DTYPES = ("scalar, dtype, atol, rtol", [(1.0, BF, 5e-3, 5e-2), (1.0, FP32, 1e-5, 5e-4)])


class _LMHeads:
    """Liger's test heads: the student's [V, H // 2] and the teacher's [V, H] weights from torch.rand, one
    leaf copy of the student's for tigon and one for the reference."""

    def __init__(self, H, V, dtype):
        w = torch.rand(V, H // 2, device=DEV, dtype=dtype)
        self.w, self.w_ref = w.clone().requires_grad_(True), w.clone().requires_grad_(True)
        self.wt = torch.rand(V, H, device=DEV, dtype=dtype)


def _fljsd_case(B, T, H, V, scalar, dtype, atol, rtol, beta, temperature, ignore_index=None, all_ignored=False,
                entry="module", accum_dtype=None, autocast_dtype=None):
    cap_on_cpu(B * T * V)
    heads = _LMHeads(H, V, dtype)
    in_dtype = autocast_dtype or dtype
    x0 = torch.rand(B * T, H // 2, device=DEV, dtype=in_dtype) * scalar
    x1, x2 = x0.detach().clone().requires_grad_(True), x0.detach().clone().requires_grad_(True)
    xt = torch.rand(B * T, H, device=DEV, dtype=in_dtype) * scalar
    label = None
    ii = -100 if ignore_index is None else ignore_index
    if all_ignored:
        label = torch.full((B * T,), ii, device=DEV, dtype=torch.long)
    elif ignore_index is not None:
        label = assign_ignore_index(torch.randint(0, V, (B * T,), device=DEV, dtype=torch.long), ii)
    ctx = torch.autocast(device_type="cuda", dtype=autocast_dtype) if autocast_dtype else _nullcontext()
    with ctx:
        output1 = ref_lm_head_jsd(x1, heads.w_ref, xt, heads.wt, beta, temperature, label, ii)
        if entry == "module":
            output2 = tt.TigonFusedLinearJSD(jsd_beta=beta, ignore_index=ii, temperature=temperature)(
                x2, heads.w, xt, heads.wt, label)
        elif entry == "functional":
            output2 = tt.tigon_fused_linear_jsd(student_input=x2, student_weight=heads.w, teacher_input=xt,
                                                teacher_weight=heads.wt, shift_labels=label, jsd_beta=beta,
                                                ignore_index=ii, temperature=temperature, accum_dtype=accum_dtype)
        else:
            output2 = tt.TigonFusedLinearJSDFunction.apply(x2, heads.w, xt, heads.wt, label, beta, ii, temperature,
                                                           accum_dtype)
        close(output2, output1.float(), atol, rtol, "loss")
        if all_ignored:
            close(output2, torch.zeros_like(output2), atol, rtol, "loss")
            output2.backward()
        else:
            output1.backward()
            output2.backward()
    if all_ignored:
        close(x2.grad, torch.zeros_like(x2.grad), atol, rtol, "dx")
        return
    close(x2.grad, x1.grad, atol, rtol, "dx")
    close(heads.w.grad, heads.w_ref.grad, atol, rtol, "dW")


def _nullcontext():
    import contextlib

    return contextlib.nullcontext()


@pytest.mark.parametrize(*FLJSD_SHAPES)
@pytest.mark.parametrize(*FLJSD_DTYPES)
@pytest.mark.parametrize("temperature, beta", [(1.0, 0.5), (2.0, 0.1), (1.0, 0.0), (1.0, 1.0)])
def test_liger_fused_linear_jsd_correctness(ext, seed, B, T, H, V, scalar, dtype, beta, temperature, atol, rtol):
    _fljsd_case(B, T, H, V, scalar, dtype, atol, rtol, beta, temperature)


@pytest.mark.parametrize(*FLJSD_SHAPES)
@pytest.mark.parametrize(*FLJSD_DTYPES)
@pytest.mark.parametrize("temperature, beta, ignore_index", [(1.0, 0.5, 2), (1.0, 0.0, 2), (2.0, 0.1, 42),
                                                             (1.0, 1.0, 2)])
def test_liger_fused_linear_jsd_correctness_with_ignore_index(ext, seed, B, T, H, V, scalar, dtype, beta,
                                                              ignore_index, temperature, atol, rtol):
    _fljsd_case(B, T, H, V, scalar, dtype, atol, rtol, beta, temperature, ignore_index=ignore_index)


@pytest.mark.parametrize("B, T, H, V", [(2, 2, 8, 8), (9, 7, 41, 41)])
@pytest.mark.parametrize("scalar, dtype, atol, rtol", [(0.5, BF, 5e-3, 5e-2), (0.5, FP32, 1e-5, 5e-4)])
@pytest.mark.parametrize("temperature, beta, ignore_index", [(1.0, 0.5, -100), (2.0, 0.1, 42)])
@pytest.mark.parametrize("accum_dtype", [None, torch.float32])
@pytest.mark.parametrize("entry", ["functional", "function"])
def test_liger_fused_linear_jsd_correctness_functional(ext, seed, B, T, H, V, scalar, dtype, beta, ignore_index,
                                                       temperature, accum_dtype, atol, rtol, entry):
    _fljsd_case(B, T, H, V, scalar, dtype, atol, rtol, beta, temperature, ignore_index=ignore_index, entry=entry,
                accum_dtype=accum_dtype)


@pytest.mark.parametrize(*FLJSD_SHAPES)
@pytest.mark.parametrize(*FLJSD_DTYPES)
@pytest.mark.parametrize("temperature, beta, ignore_index", [(1.0, 0.5, 2), (2.0, 0.1, 42)])
def test_liger_fused_linear_jsd_correctness_all_ignored(ext, seed, B, T, H, V, scalar, dtype, beta, ignore_index,
                                                        temperature, atol, rtol):
    _fljsd_case(B, T, H, V, scalar, dtype, atol, rtol, beta, temperature, ignore_index=ignore_index,
                all_ignored=True)


@pytest.mark.cuda_only
@pytest.mark.parametrize("autocast_dtype, atol, rtol", [(BF, 5e-3, 5e-2), (FP16, 5e-3, 5e-2)])
def test_liger_fused_linear_jsd_amp(ext, seed, autocast_dtype, atol, rtol):
    _fljsd_case(2, 4, 2048, 3200, 1.0, FP32, atol, rtol, 0.5, 1.0, ignore_index=-100, autocast_dtype=autocast_dtype)

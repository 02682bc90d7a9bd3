"""The linear heads skip the rows whose target is ignore_index (functions._kept_rows): with at least
1 / 32 of a call's rows ignored, tigon.linear_cross_entropy, tigon.linear_logprob and
tigon.linear_logprob_bwd receive the other rows alone (an operator spy counts the rows they get),
and every result is that of the unfused head: the losses, z-loss, per-token losses, predicted tokens,
log-probs, entropies and logit sums, and the gradients, whose ignored rows of dx are exactly zero.
Below that share, and where the eager target check does not run (TIGON_TORCH_CHECK_TARGETS=0), every
row runs. Through the C++ loss operator (the loss alone) and the Python Function (return_* flags,
reduction none), the log-prob Function, the fused preference pass and the fused linear JSD."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import DEVICE, assert_rel

import tigon_torch as tt
from tigon_torch import functions as fn

pytestmark = pytest.mark.gpu

_HEADS = {"linear_cross_entropy", "linear_logprob", "linear_logprob_bwd", "divergence"}


class _RowSpy(TorchDispatchMode):
    """Records (operator, rows of its x) for every tigon linear-head operator called under it."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if func.namespace == "tigon" and name in _HEADS:
            self.calls.append((name, args[0].shape[0]))
        return func(*args, **(kwargs or {}))


def _head(seed, rows, hidden, vocab, dtype, ignored, bias=False):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g, device=DEVICE).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g, device=DEVICE) * hidden ** -0.5).to(dtype)
    b = (0.1 * torch.randn(vocab, generator=g, device=DEVICE)).to(dtype) if bias else None
    target = torch.randint(0, vocab, (rows,), generator=g, device=DEVICE)
    target[ignored] = -100
    return x, w, b, target


def _leaves(*ts):
    return [t.clone().requires_grad_(True) if t is not None else None for t in ts]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias", [False, True])
def test_loss_alone_runs_the_kept_rows(ext, dtype, reduction, bias):
    """The C++ operator's path (the loss alone): a prompt of 40 of 96 rows ignored."""
    rows, hidden, vocab = 96, 64, 300
    x, w, b, target = _head(0, rows, hidden, vocab, dtype, slice(0, 40), bias)
    x1, w1, b1 = _leaves(x, w, b)
    x2, w2, b2 = _leaves(x, w, b)
    want = F.cross_entropy(F.linear(x1, w1, b1).float(), target, reduction=reduction)
    with _RowSpy() as spy:
        got = tt.tigon_fused_linear_cross_entropy(x2, w2, target, b2, reduction=reduction)
    assert spy.calls == [("linear_cross_entropy", 56)]
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    want.backward()
    got.backward()
    assert torch.all(x2.grad[:40] == 0), "ignored rows take no gradient"
    assert_rel(x2.grad, x1.grad, dtype, 4.0, "dx")
    assert_rel(w2.grad, w1.grad, dtype, 4.0, "dweight")
    if bias:
        assert_rel(b2.grad, b1.grad, dtype, 4.0, "dbias")


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_python_function_runs_the_kept_rows(ext, reduction):
    """The Python Function (z-loss, token accuracy, predicted tokens; reduction none defers the
    gradients to the backward, which runs the kept rows again): ignored rows scattered in place."""
    rows, hidden, vocab = 80, 48, 257
    ignored = torch.arange(rows, device=DEVICE) % 3 == 0
    x, w, _, target = _head(1, rows, hidden, vocab, torch.float32, ignored)
    x1, w1 = _leaves(x, w)
    x2, w2 = _leaves(x, w)
    logits = F.linear(x1, w1).float()
    z = 1e-3
    lse = torch.logsumexp(logits, -1)
    valid = target != -100
    ce = F.cross_entropy(logits, target, reduction="none")
    want_rows = ce + z * lse * lse * valid
    with _RowSpy() as spy:
        loss, z_loss, acc, pred = tt.TigonFusedLinearCrossEntropyFunction.apply(
            x2, w2, target, None, None, -100, z, 0.0, reduction, None, True, None, False, True, True)
    kept = int(valid.sum())
    assert spy.calls[0] == ("linear_cross_entropy", kept)
    argmax = logits.argmax(-1)
    assert torch.equal(pred, torch.where(valid, argmax, torch.full_like(argmax, -1)))
    if reduction == "none":
        torch.testing.assert_close(loss, want_rows, atol=1e-4, rtol=1e-4)
        assert torch.all(loss[~valid] == 0) and torch.all(z_loss[~valid] == 0)
        g = torch.randn(rows, device=DEVICE)
        want_rows.backward(g)
        loss.backward(g)
        assert spy.calls == [("linear_cross_entropy", kept)]  # the spy saw the forward only
        torch.testing.assert_close(acc, ((argmax == target) & valid).float())
    else:
        torch.testing.assert_close(loss, want_rows.sum() / kept, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(z_loss, (z * lse * lse * valid).sum() / kept, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(acc, ((argmax == target) & valid).sum() / kept)
        want_rows.sum().div(kept).backward()
        loss.backward()
    assert torch.all(x2.grad[~valid] == 0)
    torch.testing.assert_close(x2.grad, x1.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(w2.grad, w1.grad, atol=1e-5, rtol=1e-4)


def test_few_ignored_rows_and_no_check_run_every_row(ext, monkeypatch):
    """1 ignored row in 64 (under 1 / 32): every row runs; so does every call whose target check is
    switched off, whatever its share, with the same results."""
    rows, hidden, vocab = 64, 32, 200
    x, w, _, target = _head(2, rows, hidden, vocab, torch.float32, slice(0, 1))
    with _RowSpy() as spy:
        tt.tigon_fused_linear_cross_entropy(x, w, target)
    assert spy.calls == [("linear_cross_entropy", rows)]
    target[:32] = -100
    x1, w1 = _leaves(x, w)
    with _RowSpy() as spy:
        kept = tt.tigon_fused_linear_cross_entropy(x1, w1, target)
        kept.backward()
    assert spy.calls == [("linear_cross_entropy", 32)]
    monkeypatch.setenv("TIGON_TORCH_CHECK_TARGETS", "0")
    x2, w2 = _leaves(x, w)
    with _RowSpy() as spy:
        every = tt.tigon_fused_linear_cross_entropy(x2, w2, target)
        every.backward()
    assert spy.calls == [("linear_cross_entropy", rows)]
    torch.testing.assert_close(every, kept, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x2.grad, x1.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(w2.grad, w1.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_logprob_runs_the_kept_rows(ext, dtype, bias):
    """TigonFusedLinearLogProbFunction: log-probs, entropies and top-1 of the kept rows, zeros (False)
    for the ignored ones, whose logit sums are x (1^T W) + 1^T b in fp32; the backward runs the kept
    rows."""
    B, T, H, V = 3, 20, 32, 400
    x, w, b, target = _head(3, B * T, H, V, dtype, slice(0, 0), bias)
    target = target.view(B, T)
    target[:, :8] = -100
    x = x.view(B, T, H)
    x1, w1, b1 = _leaves(x, w, b)
    x2, w2, b2 = _leaves(x, w, b)
    logits = F.linear(x1, w1, b1)
    lp = torch.log_softmax(logits.float(), -1)
    valid = target != -100
    want = torch.where(valid, lp.gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1), 0.0)
    with _RowSpy() as spy:
        logp, ent, lsum, top1 = tt.TigonFusedLinearLogProbFunction.apply(x2, w2, target, b2, -100, 1.0, True)
    kept = int(valid.sum())
    assert spy.calls == [("linear_logprob", kept)]
    assert_rel(logp, want, dtype, 4.0, "logp")
    assert torch.all(logp[~valid] == 0) and torch.all(ent[~valid] == 0) and not top1[~valid].any()
    assert torch.equal(top1[valid], (logits.argmax(-1) == target)[valid])
    sums = (x.float() @ w.float().t()).sum(-1) + (b.float().sum() if bias else 0.0)
    torch.testing.assert_close(lsum[~valid], sums[~valid], atol=1e-3 * V ** 0.5, rtol=1e-4)
    torch.testing.assert_close(lsum[valid], logits.float().sum(-1)[valid].detach(), atol=1e-3 * V ** 0.5, rtol=1e-4)
    g = torch.randn(B, T, device=DEVICE)
    with _RowSpy() as spy:
        (logp * g).sum().backward()
    (want * g).sum().backward()
    assert spy.calls == [("linear_logprob_bwd", kept)]
    assert torch.all(x2.grad[~valid] == 0)
    assert_rel(x2.grad, x1.grad, dtype, 4.0, "dx")
    assert_rel(w2.grad, w1.grad, dtype, 4.0, "dweight")
    if bias:
        assert_rel(b2.grad, b1.grad, dtype, 4.0, "dbias")


def test_fused_pairs_run_the_kept_rows(ext, monkeypatch):
    """The fused preference pass (DPO with a reference model, chunks of one pair): each chunk's kept rows
    alone, the same loss, metrics and gradients as with every row (the check switched off)."""
    monkeypatch.setattr("tigon_torch.preference._PAIR_CHUNK_TOKENS", 1)
    B, T, H, V = 2, 24, 32, 300
    g = torch.Generator(device=DEVICE).manual_seed(4)
    x = torch.randn(2 * B, T, H, generator=g, device=DEVICE)
    w = torch.randn(V, H, generator=g, device=DEVICE) * H ** -0.5
    rx = torch.randn(2 * B, T, H, generator=g, device=DEVICE)
    target = torch.randint(0, V, (2 * B, T), generator=g, device=DEVICE)
    target[:, :6] = -100
    target[1, 6:10] = -100

    def run():
        xs, ws = _leaves(x, w)
        mod = tt.TigonFusedLinearDPOLoss(beta=0.1, compute_nll_loss=True)
        with _RowSpy() as spy:
            loss, metrics = mod(ws, xs, target, None, rx, w, None)
            loss.backward()
        return spy.calls, loss, metrics, xs.grad, ws.grad

    calls, loss, metrics, dx, dw = run()
    per_seq = (target != -100).sum(-1).tolist()
    chunks = [per_seq[i] + per_seq[B + i] for i in range(B)]
    assert [c for c in calls if c[0] == "linear_logprob_bwd"] == [("linear_logprob_bwd", n) for n in chunks]
    assert ("linear_logprob", sum(per_seq)) in calls  # the reference model's forward
    monkeypatch.setenv("TIGON_TORCH_CHECK_TARGETS", "0")
    calls0, loss0, metrics0, dx0, dw0 = run()
    assert all(n == 2 * T for op, n in calls0 if op == "linear_logprob_bwd"), calls0
    torch.testing.assert_close(loss, loss0, atol=1e-5, rtol=1e-5)
    for a, e in zip(metrics, metrics0):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(dx, dx0, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(dw, dw0, atol=1e-6, rtol=1e-5)


def test_fused_linear_jsd_runs_the_kept_rows(ext, monkeypatch):
    """TigonFusedLinearJSDFunction with shift_labels: the divergence sees the kept rows alone, with the
    loss and gradients of the run over every row (the check switched off); ignored rows of dx are 0."""
    rows, hidden, teacher_hidden, vocab = 64, 32, 48, 300
    g = torch.Generator(device=DEVICE).manual_seed(5)
    x = torch.randn(rows, hidden, generator=g, device=DEVICE)
    w = torch.randn(vocab, hidden, generator=g, device=DEVICE) * hidden ** -0.5
    xt = torch.randn(rows, teacher_hidden, generator=g, device=DEVICE)
    wt = torch.randn(vocab, teacher_hidden, generator=g, device=DEVICE) * teacher_hidden ** -0.5
    labels = torch.randint(0, vocab, (rows,), generator=g, device=DEVICE)
    labels[:24] = -100

    def run():
        xs, ws = _leaves(x, w)
        with _RowSpy() as spy:
            loss = tt.TigonFusedLinearJSDFunction.apply(xs, ws, xt, wt, labels, 0.3, -100, 1.5)
        loss.backward()
        return sum(n for op, n in spy.calls if op == "divergence"), loss, xs.grad, ws.grad

    n, loss, dx, dw = run()
    assert n == 40
    assert torch.all(dx[:24] == 0)
    monkeypatch.setenv("TIGON_TORCH_CHECK_TARGETS", "0")
    n0, loss0, dx0, dw0 = run()
    assert n0 == rows
    torch.testing.assert_close(loss, loss0, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(dx, dx0, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(dw, dw0, atol=1e-6, rtol=1e-5)

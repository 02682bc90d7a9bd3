"""TigonFusedLinearDPOLoss / TigonFusedLinearDPOFunction against a plain PyTorch reference that materialises
the logits (Liger-Kernel's formulas): every DPO loss type, with and without the reference model, the NLL
term, average_log_prob, ignored tokens and a completion whose targets are all ignored (log-prob 0, no
NaN); the metrics Liger returns; bad input rejected."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE

import tigon_torch as tt
from tigon_torch.preference import DPO_LOSS_TYPES, dpo_loss

pytestmark = pytest.mark.gpu


def ref_seq_logps(x, w, target, bias, ignore_index, average):
    logits = x @ w.t()
    if bias is not None:
        logits = logits + bias
    lp = F.log_softmax(logits.float(), dim=-1)
    mask = target != ignore_index
    tok = lp.gather(-1, torch.where(mask, target, 0).unsqueeze(-1)).squeeze(-1) * mask
    seq = tok.sum(-1)
    if average:
        cnt = mask.sum(-1)
        seq = torch.where(cnt > 0, seq / cnt.clamp_min(1), torch.zeros_like(seq))
    return seq, tok, mask, logits


def reference(x, w, target, bias, ref_x, ref_w, ref_b, ignore_index, beta, nll, use_ref, average, loss_type,
              label_smoothing, alpha):
    n = target.shape[0] // 2
    seq, tok, mask, logits = ref_seq_logps(x, w, target, bias, ignore_index, average)
    rc = rr = None
    if use_ref:
        with torch.no_grad():
            rs = ref_seq_logps(ref_x, ref_w, target, ref_b, ignore_index, average)[0]
        rc, rr = rs[:n], rs[n:]
    pref, cr, rj = dpo_loss(seq[:n], seq[n:], rc, rr, beta, loss_type, label_smoothing)
    nll_loss = -tok[:n].sum() / mask[:n].sum() if nll else torch.zeros((), device=x.device)
    denom = n * target.shape[1] * w.shape[0]
    return alpha * nll_loss + pref, (seq[:n], seq[n:], logits[:n].float().sum() / denom,
                                     logits[n:].float().sum() / denom, nll_loss, cr, rj)


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("use_ref, nll, average, bias", [(True, False, False, False), (False, True, True, True),
                                                         (True, True, False, True)])
def test_dpo(ext, seed, loss_type, dtype, tol, use_ref, nll, average, bias):
    B, T, H, V = 3, 19, 48, 700
    smoothing = 1e-3 if loss_type == "exo_pair" else (0.1 if loss_type == "robust" else 0.0)
    x = torch.randn(2 * B, T, H, device=DEVICE, dtype=dtype)
    w = (torch.randn(V, H, device=DEVICE) * H ** -0.5).to(dtype)
    b = (torch.randn(V, device=DEVICE) * 0.1).to(dtype) if bias else None
    rx = torch.randn(2 * B, T, H, device=DEVICE, dtype=dtype)
    rw = (torch.randn(V, H, device=DEVICE) * H ** -0.5).to(dtype)
    target = torch.randint(0, V, (2 * B, T), device=DEVICE)
    target[:, :4] = -100  # the prompt
    target[1, :] = -100   # a chosen completion with every target ignored
    x1, w1 = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    x2, w2 = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    kw = dict(ignore_index=-100, beta=0.1, nll=nll, use_ref=use_ref, average=average, loss_type=loss_type,
              label_smoothing=smoothing, alpha=1.0)
    want, wm = reference(x1, w1, target, b, rx if use_ref else None, rw, None, **{k: v for k, v in kw.items()})
    mod = tt.TigonFusedLinearDPOLoss(ignore_index=-100, beta=0.1, compute_nll_loss=nll, use_ref_model=use_ref,
                                     average_log_prob=average, loss_type=loss_type, label_smoothing=smoothing)
    got, gm = mod(w2, x2, target, b, rx if use_ref else None, rw if use_ref else None, None)
    assert torch.isfinite(got)
    torch.testing.assert_close(got, want.to(got.dtype), atol=tol, rtol=tol)
    for name, a, e in zip(("chosen_logps", "rejected_logps", "chosen_logits_mean", "rejected_logits_mean", "nll",
                           "chosen_rewards", "rejected_rewards"), gm, wm):
        torch.testing.assert_close(a.float(), e.detach().float(), atol=tol * 10, rtol=tol, msg=name)
    assert gm[0][1] == 0  # the chosen completion with every target ignored: log-prob 0
    assert torch.isfinite(gm[0]).all()
    want.backward()
    got.backward()
    scale_x = x1.grad.float().abs().max().item() + 1e-12
    scale_w = w1.grad.float().abs().max().item() + 1e-12
    torch.testing.assert_close(x2.grad.float() / scale_x, x1.grad.float() / scale_x, atol=tol * 3, rtol=0)
    torch.testing.assert_close(w2.grad.float() / scale_w, w1.grad.float() / scale_w, atol=tol * 3, rtol=0)


def test_function_matches_module(ext, seed):
    x = torch.randn(4, 9, 32, device=DEVICE)
    w = torch.randn(100, 32, device=DEVICE) * 0.2
    t = torch.randint(0, 100, (4, 9), device=DEVICE)
    a = tt.TigonFusedLinearDPOFunction.apply(x, w, t, None, x.clone(), w, None)
    m = tt.TigonFusedLinearDPOLoss()(w, x, t, None, x.clone(), w, None)
    assert torch.equal(a[0], m[0])
    assert torch.allclose(a[0], torch.log(torch.tensor(2.0, device=DEVICE)), atol=1e-6)  # policy == reference


def test_bad_input(ext):
    w = torch.randn(50, 16, device=DEVICE)
    with pytest.raises(ValueError, match="odd"):
        tt.TigonFusedLinearDPOLoss(use_ref_model=False)(w, torch.randn(3, 5, 16, device=DEVICE),
                                                        torch.zeros(3, 5, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match=r"\[2B, T, H\]"):
        tt.TigonFusedLinearDPOLoss(use_ref_model=False)(w, torch.randn(4, 16, device=DEVICE),
                                                        torch.zeros(4, dtype=torch.long, device=DEVICE))
    x = torch.randn(4, 5, 16, device=DEVICE)
    t = torch.zeros(4, 5, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="ref_input"):
        tt.TigonFusedLinearDPOLoss()(w, x, t)
    with pytest.raises(ValueError, match="ref_input"):
        tt.TigonFusedLinearDPOLoss()(w, x, t, None, torch.randn(4, 6, 16, device=DEVICE))
    with pytest.raises(ValueError, match="loss_type"):
        tt.TigonFusedLinearDPOLoss(loss_type="ipo")
    with pytest.raises(ValueError, match="label_smoothing"):
        tt.TigonFusedLinearDPOLoss(loss_type="exo_pair")


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_dpo_against_liger(ext, seed, loss_type):
    """The same call through Liger-Kernel's LigerFusedLinearDPOLoss (when it imports): loss, metrics, grads."""
    lk = pytest.importorskip("liger_kernel.chunked_loss")
    B, T, H, V = 2, 13, 32, 300
    smoothing = 1e-3 if loss_type == "exo_pair" else (0.1 if loss_type == "robust" else 0.0)
    x = torch.randn(2 * B, T, H, device=DEVICE)
    w = torch.randn(V, H, device=DEVICE) * H ** -0.5
    rx = torch.randn(2 * B, T, H, device=DEVICE)
    target = torch.randint(0, V, (2 * B, T), device=DEVICE)
    target[:, :3] = -100
    x1, w1 = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    x2, w2 = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    kw = dict(beta=0.1, compute_nll_loss=True, use_ref_model=True, loss_type=loss_type, label_smoothing=smoothing)
    want, wm = lk.LigerFusedLinearDPOLoss(compiled=False, **kw)(w1, x1, target, None, rx, w, None)
    got, gm = tt.TigonFusedLinearDPOLoss(**kw)(w2, x2, target, None, rx, w, None)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert len(gm) == len(wm)
    for a, e in zip(gm, wm):
        torch.testing.assert_close(a.float(), e.float(), atol=1e-4, rtol=1e-4)
    want.backward()
    got.backward()
    torch.testing.assert_close(x2.grad, x1.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(w2.grad, w1.grad, atol=1e-5, rtol=1e-4)


REF_FREE = [
    ("LigerFusedLinearORPOLoss", "TigonFusedLinearORPOLoss", dict(beta=0.2)),
    ("LigerFusedLinearORPOLoss", "TigonFusedLinearORPOLoss", dict(beta=0.1, compute_nll_loss=False)),
    ("LigerFusedLinearCPOLoss", "TigonFusedLinearCPOLoss", dict(beta=0.1, alpha=0.5, label_smoothing=0.1)),
    ("LigerFusedLinearCPOLoss", "TigonFusedLinearCPOLoss", dict(average_log_prob=True)),
    ("LigerFusedLinearSimPOLoss", "TigonFusedLinearSimPOLoss", dict(beta=2.0, gamma=0.5, label_smoothing=0.05)),
    ("LigerFusedLinearSimPOLoss", "TigonFusedLinearSimPOLoss", dict(compute_nll_loss=False)),
]


@pytest.mark.parametrize("liger_name, tigon_name, kw", REF_FREE)
@pytest.mark.parametrize("bias", [False, True])
def test_reference_free_against_liger(ext, seed, liger_name, tigon_name, kw, bias):
    """ORPO, CPO and SimPO against Liger-Kernel's chunked losses (when they import): loss, every metric,
    gradients of the hidden states, the weight and the bias."""
    lk = pytest.importorskip("liger_kernel.chunked_loss")
    B, T, H, V = 2, 11, 32, 257
    x = torch.randn(2 * B, T, H, device=DEVICE)
    w = torch.randn(V, H, device=DEVICE) * H ** -0.5
    b = torch.randn(V, device=DEVICE) * 0.1 if bias else None
    target = torch.randint(0, V, (2 * B, T), device=DEVICE)
    target[:, :3] = -100
    ins = [(x.clone().requires_grad_(True), w.clone().requires_grad_(True),
            b.clone().requires_grad_(True) if bias else None) for _ in range(2)]
    want, wm = getattr(lk, liger_name)(compiled=False, **kw)(ins[0][1], ins[0][0], target, ins[0][2])
    got, gm = getattr(tt, tigon_name)(**kw)(ins[1][1], ins[1][0], target, ins[1][2])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert len(gm) == len(wm)
    for a, e in zip(gm, wm):
        torch.testing.assert_close(a.float(), e.float(), atol=1e-5, rtol=1e-4)
    want.backward()
    got.backward()
    for k in range(2 + bias):
        torch.testing.assert_close(ins[1][k].grad, ins[0][k].grad, atol=1e-5, rtol=1e-4)


def test_orpo_nll_target(ext, seed):
    """ORPO's nll_target: the NLL term on its own targets (here: the targets with more tokens ignored)."""
    lk = pytest.importorskip("liger_kernel.chunked_loss")
    x = torch.randn(4, 9, 16, device=DEVICE)
    w = torch.randn(60, 16, device=DEVICE) * 0.25
    t = torch.randint(0, 60, (4, 9), device=DEVICE)
    nt = t.clone()
    nt[:, :5] = -100
    want = lk.LigerFusedLinearORPOLoss(compiled=False)(w, x, t, None, nt)
    got = tt.TigonFusedLinearORPOLoss()(w, x, t, None, nt)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got[1][4], want[1][4], atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="nll_target"):
        tt.TigonFusedLinearORPOLoss()(w, x, t, None, nt[:, :4])

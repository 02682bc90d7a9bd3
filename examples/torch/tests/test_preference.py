"""TigonFusedLinearDPOLoss / TigonFusedLinearDPOFunction against a plain PyTorch reference that materialises
the logits (Liger-Kernel's formulas): every DPO loss type, with and without the reference model, the NLL
term, average_log_prob, ignored tokens and a completion whose targets are all ignored (log-prob 0, no
NaN); the metrics Liger returns; bad input rejected. ORPO, CPO, SimPO and KTO (unpaired, with preference
labels and the KL term) against Liger-Kernel's chunked losses, KTO also against the plain reference."""

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


# ------------------------------------------------------------------------------------------------
# KTO (unpaired): TigonFusedLinearKTOLoss / TigonFusedLinearKTOFunction
# ------------------------------------------------------------------------------------------------

KTO_LABELS = [True, False, True, False]


def kto_reference(x, w, target, bias, labels, ref_x, ref_w, ref_b, kl, ignore_index, beta, average):
    """KTO on materialised logits: 1 - sigmoid(beta (r - kl)) for a chosen sequence, 1 - sigmoid(beta (kl - r))
    for a rejected one, averaged over the batch; Liger's six metric sums."""
    seq, _, _, logits = ref_seq_logps(x, w, target, bias, ignore_index, average)
    ratio = seq
    if ref_x is not None:
        with torch.no_grad():
            ref_seq = ref_seq_logps(ref_x, ref_w, target, ref_b, ignore_index, average)[0]
        ratio = seq - ref_seq
    z = ratio - kl if kl is not None else ratio
    losses = torch.where(labels, 1 - torch.sigmoid(beta * z), 1 - torch.sigmoid(-beta * z))
    rewards = beta * ratio
    lg = logits.float().sum((1, 2))
    return losses.mean(), (seq[labels].sum(), seq[~labels].sum(), lg[labels].sum(), lg[~labels].sum(),
                           rewards[labels].sum(), rewards[~labels].sum())


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("use_ref, average, bias, kl", [(True, False, False, 0.3), (False, True, True, None),
                                                        (True, True, True, "per_sequence"), (True, False, True, None)])
def test_kto(ext, seed, dtype, tol, use_ref, average, bias, kl):
    B, T, H, V = len(KTO_LABELS), 13, 32, 300
    labels = torch.tensor(KTO_LABELS, device=DEVICE)
    x = torch.randn(B, T, H, device=DEVICE, dtype=dtype)
    w = (torch.randn(V, H, device=DEVICE) * H ** -0.5).to(dtype)
    b = (torch.randn(V, device=DEVICE) * 0.1).to(dtype) if bias else None
    rx = torch.randn(B, T, H, device=DEVICE, dtype=dtype)
    rw = (torch.randn(V, H, device=DEVICE) * H ** -0.5).to(dtype)
    rb = (torch.randn(V, device=DEVICE) * 0.1).to(dtype) if bias else None
    if kl == "per_sequence":
        kl = torch.rand(B, device=DEVICE)
    elif kl is not None:
        kl = torch.tensor([kl], device=DEVICE)
    target = torch.randint(0, V, (B, T), device=DEVICE)
    target[:, :4] = -100  # the prompt
    target[0, :] = -100   # a chosen completion with every target ignored
    x1, w1 = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    x2, w2 = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    b1, b2 = (b.clone().requires_grad_(True), b.clone().requires_grad_(True)) if bias else (None, None)
    want, wm = kto_reference(x1, w1, target, b1, labels, rx if use_ref else None, rw, rb, kl, -100, 0.2, average)
    mod = tt.TigonFusedLinearKTOLoss(beta=0.2, use_ref_model=use_ref, average_log_prob=average)
    got, gm = mod(x2, w2, target, b2, labels, rx if use_ref else None, rw if use_ref else None,
                  rb if use_ref else None, kl)
    assert torch.isfinite(got) and all(torch.isfinite(m) for m in gm)
    torch.testing.assert_close(got, want.to(got.dtype), atol=tol, rtol=tol)
    assert len(gm) == 6
    for name, a, e in zip(("chosen_logps_sum", "rejected_logps_sum", "chosen_logits_sum", "rejected_logits_sum",
                           "chosen_rewards_sum", "rejected_rewards_sum"), gm, wm):
        torch.testing.assert_close(a.float(), e.detach().float(), atol=tol * 10, rtol=tol, msg=name)
    want.backward()
    got.backward()
    assert x2.grad[0].abs().max() == 0  # the all-ignored completion takes no gradient
    for g2, g1 in ((x2.grad, x1.grad), (w2.grad, w1.grad)) + (((b2.grad, b1.grad),) if bias else ()):
        scale = g1.float().abs().max().item() + 1e-12
        torch.testing.assert_close(g2.float() / scale, g1.float() / scale, atol=tol * 3, rtol=0)


def test_kto_function_matches_module(ext, seed):
    x = torch.randn(4, 9, 32, device=DEVICE)
    w = torch.randn(100, 32, device=DEVICE) * 0.2
    t = torch.randint(0, 100, (4, 9), device=DEVICE)
    labels = torch.tensor([1, 0, 0, 1], device=DEVICE)  # integer labels are read as bool
    a = tt.TigonFusedLinearKTOFunction.apply(x, w, t, labels, None, x.clone(), w, None)
    m = tt.TigonFusedLinearKTOLoss(use_ref_model=True)(x, w, t, None, labels.bool(), x.clone(), w, None)
    assert torch.equal(a[0], m[0])
    assert torch.allclose(a[0], torch.tensor(0.5, device=DEVICE), atol=1e-6)  # policy == reference: 1 - sigmoid(0)
    assert torch.equal(a[1][4], torch.zeros((), device=DEVICE))


def test_kto_bad_input(ext):
    w = torch.randn(50, 16, device=DEVICE)
    x = torch.randn(4, 5, 16, device=DEVICE)
    t = torch.zeros(4, 5, dtype=torch.long, device=DEVICE)
    labels = torch.tensor([True, False, True, True], device=DEVICE)
    kto = tt.TigonFusedLinearKTOLoss()
    with pytest.raises(ValueError, match="preference_labels"):
        kto(x, w, t)
    with pytest.raises(ValueError, match="preference_labels"):
        kto(x, w, t, None, labels[:3])
    with pytest.raises(ValueError, match="preference_labels"):
        kto(x, w, t, None, labels.float())
    with pytest.raises(ValueError, match=r"\[B, T, H\]"):
        kto(x.reshape(20, 16), w, t, None, labels)
    with pytest.raises(ValueError, match=r"\[B, T, H\]"):
        kto(x, w, t[:, :4], None, labels)
    with pytest.raises(ValueError, match="kl"):
        kto(x, w, t, None, labels, kl=torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError, match="ref_input"):
        tt.TigonFusedLinearKTOLoss(use_ref_model=True)(x, w, t, None, labels)
    with pytest.raises(ValueError, match="ref_input"):
        tt.TigonFusedLinearKTOLoss(use_ref_model=True)(x, w, t, None, labels, torch.randn(4, 6, 16, device=DEVICE))
    with pytest.raises(ValueError, match="ref_input"):
        tt.TigonFusedLinearKTOFunction.apply(x, w, t, labels)  # the function's default: use_ref_model=True


KTO_LIGER = [
    dict(beta=0.1, use_ref_model=True, kl=[0.2]),
    dict(beta=0.5, use_ref_model=False, average_log_prob=True),
    dict(beta=0.2, use_ref_model=True, average_log_prob=True, kl=[-0.1]),
    dict(beta=0.1, use_ref_model=True, ignore_index=7),
]


@pytest.mark.parametrize("kw", KTO_LIGER)
@pytest.mark.parametrize("bias", [False, True])
def test_kto_against_liger(ext, seed, kw, bias):
    """The same call through Liger-Kernel's LigerFusedLinearKTOLoss (when it imports): loss, every metric,
    gradients of the hidden states, the weight and the bias."""
    lk = pytest.importorskip("liger_kernel.chunked_loss")
    kw = dict(kw)
    kl = torch.tensor(kw.pop("kl"), device=DEVICE) if "kl" in kw else None
    ignore = kw.get("ignore_index", -100)
    B, T, H, V = 5, 11, 32, 257
    labels = torch.tensor([True, False, False, True, False], device=DEVICE)
    x = torch.randn(B, T, H, device=DEVICE)
    w = torch.randn(V, H, device=DEVICE) * H ** -0.5
    b = torch.randn(V, device=DEVICE) * 0.1 if bias else None
    rx = torch.randn(B, T, H, device=DEVICE)
    rw = torch.randn(V, H, device=DEVICE) * H ** -0.5
    rb = torch.randn(V, device=DEVICE) * 0.1 if bias else None
    target = torch.randint(0, V, (B, T), device=DEVICE)
    target[:, :3] = ignore
    ref = (rx, rw, rb) if kw["use_ref_model"] else (None, None, None)
    ins = [(x.clone().requires_grad_(True), w.clone().requires_grad_(True),
            b.clone().requires_grad_(True) if bias else None) for _ in range(2)]
    want, wm = lk.LigerFusedLinearKTOLoss(compiled=False, **kw)(ins[0][0], ins[0][1], target, ins[0][2], labels,
                                                                 *ref, kl)
    got, gm = tt.TigonFusedLinearKTOLoss(**kw)(ins[1][0], ins[1][1], target, ins[1][2], labels, *ref, kl)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert len(gm) == len(wm)
    for a, e in zip(gm, wm):
        torch.testing.assert_close(a.float(), e.float(), atol=1e-4, rtol=1e-4)
    want.backward()
    got.backward()
    for k in range(2 + bias):
        torch.testing.assert_close(ins[1][k].grad, ins[0][k].grad, atol=1e-5, rtol=1e-4)


def test_kto_function_against_liger(ext, seed):
    """The autograd functions' positional calls (Liger's order: preference_labels before the bias)."""
    pytest.importorskip("liger_kernel.chunked_loss")
    B, T, H, V = 4, 9, 16, 64
    x = torch.randn(B, T, H, device=DEVICE)
    w = torch.randn(V, H, device=DEVICE) * 0.25
    rx, rw = torch.randn(B, T, H, device=DEVICE), torch.randn(V, H, device=DEVICE) * 0.25
    t = torch.randint(0, V, (B, T), device=DEVICE)
    labels = torch.tensor([False, True, True, False], device=DEVICE)
    kl = torch.tensor([0.05], device=DEVICE)
    from liger_kernel.chunked_loss.kto_loss import LigerFusedLinearKTOFunction

    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    args = (t, labels, None, rx, rw, None, kl, -100, 0.3, False)
    e = LigerFusedLinearKTOFunction.apply(x1, w, *args)
    a = tt.TigonFusedLinearKTOFunction.apply(x2, w, *args)
    torch.testing.assert_close(a[0], e[0], atol=1e-5, rtol=1e-4)
    for u, v in zip(a[1], e[1]):
        torch.testing.assert_close(u, v, atol=1e-4, rtol=1e-4)
    e[0].backward()
    a[0].backward()
    torch.testing.assert_close(x2.grad, x1.grad, atol=1e-5, rtol=1e-4)


def _signature(f, drop=("self", "ctx", "cls")):
    import inspect

    return [(p.name, p.default) for p in inspect.signature(f).parameters.values() if p.name not in drop]


def test_kto_signatures_match_liger():
    pytest.importorskip("liger_kernel.chunked_loss")
    from liger_kernel.chunked_loss.kto_loss import LigerFusedLinearKTOFunction, LigerFusedLinearKTOLoss

    assert _signature(tt.TigonFusedLinearKTOFunction.apply) == _signature(LigerFusedLinearKTOFunction.forward)
    assert _signature(tt.TigonFusedLinearKTOLoss.__init__) == _signature(LigerFusedLinearKTOLoss.__init__)
    assert _signature(tt.TigonFusedLinearKTOLoss.forward) == _signature(LigerFusedLinearKTOLoss.forward)


@pytest.mark.parametrize("pair_tokens", [1, 40, 10_000])
@pytest.mark.parametrize("name, kw", [("dpo", dict(beta=0.2, compute_nll_loss=True, use_ref_model=True)),
                                      ("orpo", dict(beta=0.1)),
                                      ("simpo", dict(beta=2.0, gamma=0.5, compute_nll_loss=True))])
def test_fused_pairs_equal_the_two_pass_path(ext, seed, monkeypatch, pair_tokens, name, kw):
    """Training calls go through _FusedPairPreference (chunks of pairs, the gradient taken in the forward
    from kept logits); the same call without a gradient takes the log-prob path. Both give the same loss
    and metrics; the gradients equal those of the unfused reference. pair_tokens sets the chunks: one pair
    each (1), two (40 = 2 pairs of 2 x 10 tokens), all (10000)."""
    from tigon_torch import preference

    monkeypatch.setattr(preference, "_PAIR_CHUNK_TOKENS", pair_tokens)
    B, T, H, V = 3, 10, 32, 300
    x = torch.randn(2 * B, T, H, device=DEVICE)
    w = torch.randn(V, H, device=DEVICE) * H ** -0.5
    b = torch.randn(V, device=DEVICE) * 0.1
    target = torch.randint(0, V, (2 * B, T), device=DEVICE)
    target[:, :2] = -100
    target[1] = -100  # a chosen completion with no target at all
    cls = {"dpo": tt.TigonFusedLinearDPOLoss, "orpo": tt.TigonFusedLinearORPOLoss,
           "simpo": tt.TigonFusedLinearSimPOLoss}[name]
    extra = (torch.randn(2 * B, T, H, device=DEVICE), w) if name == "dpo" else ()
    xs, ws, bs = x.clone().requires_grad_(True), w.clone().requires_grad_(True), b.clone().requires_grad_(True)
    loss, metrics = cls(**kw)(ws, xs, target, bs, *extra)
    with torch.no_grad():
        loss2, metrics2 = cls(**kw)(w, x, target, b, *extra)
    torch.testing.assert_close(loss, loss2, atol=1e-5, rtol=1e-5)
    assert len(metrics) == len(metrics2)
    for a, e in zip(metrics, metrics2):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)
    loss.backward()
    # The gradients against the two-pass path's (TigonFusedLinearLogProbFunction under autograd).
    monkeypatch.setattr(preference, "_fusable", lambda *a: False)
    x3, w3, b3 = x.clone().requires_grad_(True), w.clone().requires_grad_(True), b.clone().requires_grad_(True)
    loss3, _ = cls(**kw)(w3, x3, target, b3, *extra)
    loss3.backward()
    torch.testing.assert_close(loss, loss3, atol=1e-5, rtol=1e-5)
    for got, want in ((xs, x3), (ws, w3), (bs, b3)):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-5, rtol=1e-4)

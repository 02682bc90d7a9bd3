"""TigonFusedLinearGRPOLoss / TigonFusedLinearGRPOFunction against a plain PyTorch reference that materialises
the logits (TRL's GRPO formulas): the loss types, the reference model (its inputs or its log-probs), the
sampling temperature, clipping, padding (masked tokens, a completion and a batch with every token masked:
finite, never NaN); against Liger-Kernel's LigerFusedLinearGRPOLoss: loss, metrics and gradients for every
loss type and option; bad input rejected."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE

import tigon_torch as tt
from tigon_torch.rl import GRPO_LOSS_TYPES

pytestmark = pytest.mark.gpu

B, T, H, V = 4, 12, 32, 257


def token_logps(x, w, bias, ids, temperature):
    """log softmax((x W^T + b) / temperature)[id] on the materialised logits (0 for an id outside [0, V))."""
    logits = x @ w.t()
    if bias is not None:
        logits = logits + bias
    lp = F.log_softmax(logits.float() / temperature, dim=-1)
    valid = (ids >= 0) & (ids < w.shape[0])
    return torch.where(valid, lp.gather(-1, torch.where(valid, ids, 0).unsqueeze(-1)).squeeze(-1), 0.0)


def reference(logp, mask, adv, ref, old, beta, eps_low, eps_high, loss_type, max_len, level, temp_pos=1.0,
              temp_neg=1.05, delta=None):
    """(loss, metrics) of TRL's GRPO from per-token log-probs."""
    mask = mask.float()
    old = logp.detach() if old is None else old
    log_ratio = logp - old
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(1) / mask.sum(1).clamp(min=1)).unsqueeze(1)
    ratio = log_ratio.exp()
    a = adv[:, None]
    if loss_type == "cispo":
        per_token = -ratio.clamp(max=eps_high).detach() * a * logp
        clipped = (ratio > eps_high) & (a > 0)
    elif loss_type == "sapo":
        tau = torch.where(a > 0, temp_pos, temp_neg)
        per_token = -(4 / tau) * torch.sigmoid(tau * (ratio - 1)) * a
        clipped = torch.zeros_like(ratio, dtype=torch.bool)
    else:
        r = ratio.clamp(max=delta) if delta is not None else ratio
        per_token = -torch.minimum(r * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a)
        clipped = ((ratio < 1 - eps_low) & (a < 0)) | ((ratio > 1 + eps_high) & (a > 0))
    metrics = []
    if beta != 0:
        ref = logp.detach() if ref is None else ref
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        per_token = per_token + beta * kl
        metrics.append((kl * mask).sum() / mask.sum().clamp(min=1))
    metrics.append((clipped.expand_as(mask) * mask).sum() / mask.sum().clamp(min=1))
    n = mask.shape[0]
    if loss_type in ("grpo", "sapo"):
        loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
    elif loss_type == "bnpo":
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1)
    elif loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / (n * max_len)
    elif loss_type in ("dapo", "cispo"):
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1)
    elif loss_type == "luspo":
        loss = (per_token * mask.sum(1, keepdim=True)).mean()
    else:
        raise AssertionError(loss_type)
    return loss, metrics


def batch(dtype=torch.float32, bias=False, temperature=1.0, pad_ids=True, level="token"):
    """Policy and reference heads, sampled ids, a completion mask with padding (row 1 fully masked), the
    advantages and old log-probs whose log-ratios (per token, or per sequence for level "sequence") sit
    well inside or well outside the clipping range, so that rounding never moves one across a bound."""
    x = torch.randn(B, T, H, device=DEVICE, dtype=dtype)
    w = (torch.randn(V, H, device=DEVICE) * H ** -0.5).to(dtype)
    b = (torch.randn(V, device=DEVICE) * 0.1).to(dtype) if bias else None
    rx = torch.randn(B, T, H, device=DEVICE, dtype=dtype)
    rw = (torch.randn(V, H, device=DEVICE) * H ** -0.5).to(dtype)
    ids = torch.randint(0, V, (B, T), device=DEVICE)
    mask = torch.ones(B, T, dtype=torch.long, device=DEVICE)
    mask[0, 8:] = 0
    mask[1, :] = 0  # a completion with every token masked
    mask[3, 5:] = 0
    if pad_ids:
        ids[3, 9:] = -100  # padding ids outside the vocabulary, where the mask is 0
        ids[0, 10:] = V
    # Advantages of both signs on the unmasked rows 0 (+), 2 (+) and 3 (-), whatever the draw.
    sign = torch.tensor([1.0, -1.0, 1.0, -1.0] + [1.0] * (B - 4), device=DEVICE)[:B]
    adv = (torch.rand(B, device=DEVICE) + 0.1) * sign
    shape = (B, T) if level == "token" else (B, 1)
    shift = torch.where(torch.rand(shape, device=DEVICE) < 0.5, 0.03, 0.7)
    shift = shift * torch.where(torch.rand(shape, device=DEVICE) < 0.5, -1.0, 1.0)
    # One ratio exp(0.7) on row 0 (above every upper bound, positive advantage) and one exp(-0.7) on
    # row 3 (below the lower bound, negative advantage): the clipping metric is never 0 by chance.
    shift[0, 0] = -0.7
    shift[3, shape[1] // T] = 0.7
    old = (token_logps(x.float(), w.float(), b.float() if bias else None, ids, temperature) + shift).detach()
    return x, w, b, rx, rw, ids, mask, adv, old


CASES = [  # loss_type, beta, importance_sampling_level, reference log-probs given ("logps") or its inputs
    ("grpo", 0.04, "token", "input"), ("bnpo", 0.0, "token", None), ("dr_grpo", 0.1, "token", "logps"),
    ("dapo", 0.04, "token", "input"), ("dapo", 0.0, "sequence", None), ("grpo", 0.1, "sequence", "input"),
    ("cispo", 0.04, "token", "input"), ("sapo", 0.1, "token", "logps"), ("luspo", 0.0, "sequence", None),
    ("luspo", 0.04, "token", "input"),
]


@pytest.mark.parametrize("loss_type, beta, level, ref_mode", CASES)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("bias", [False, True])
def test_grpo(ext, seed, loss_type, beta, level, ref_mode, dtype, tol, bias):
    temperature = 0.7
    x, w, b, rx, rw, ids, mask, adv, old = batch(dtype, bias, temperature, level=level)
    eps_high = 1.3 if loss_type == "cispo" else 0.25
    ins = [(x.clone().requires_grad_(True), w.clone().requires_grad_(True),
            b.clone().requires_grad_(True) if bias else None) for _ in range(2)]
    with torch.no_grad():
        ref_lp = token_logps(rx, rw, None, ids, temperature)
    logp = token_logps(*ins[0][:2], ins[0][2], ids, temperature)
    want, wm = reference(logp, mask, adv, ref_lp if ref_mode else None, old, beta, 0.2, eps_high, loss_type, T,
                         level)
    mod = tt.TigonFusedLinearGRPOLoss(beta=beta, use_ref_model=ref_mode is not None, epsilon_high=eps_high,
                                      loss_type=loss_type, max_completion_length=T, importance_sampling_level=level,
                                      temperature=temperature)
    ref_args = dict(ref_per_token_logps=ref_lp) if ref_mode == "logps" else dict(ref_input=rx, ref_weight=rw)
    got, gm = mod(ins[1][0], ins[1][1], ids, mask, adv, ins[1][2], old_per_token_logps=old,
                  **(ref_args if ref_mode else {}))
    assert torch.isfinite(got) and all(torch.isfinite(m) for m in gm)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert len(gm) == len(wm) == (2 if beta else 1)
    for a, e in zip(gm, wm):
        torch.testing.assert_close(a, e.detach(), atol=tol, rtol=tol)
    if level == "token" and loss_type != "sapo":
        assert gm[-1] > 0  # clipping is active
    want.backward()
    got.backward()
    assert ins[1][0].grad[1].abs().max() == 0  # the fully masked completion takes no gradient
    for k in range(2 + bias):
        g1, g2 = ins[0][k].grad.float(), ins[1][k].grad.float()
        scale = g1.abs().max().item() + 1e-12
        torch.testing.assert_close(g2 / scale, g1 / scale, atol=tol * 3, rtol=0)


@pytest.mark.parametrize("loss_type", GRPO_LOSS_TYPES)
def test_all_masked_batch(ext, seed, loss_type):
    """Every token masked: a finite loss (0) and zero gradients, whatever the loss type."""
    x, w, _, rx, rw, ids, mask, adv, old = batch()
    x.requires_grad_(True)
    w.requires_grad_(True)
    loss, metrics = tt.TigonFusedLinearGRPOLoss(loss_type=loss_type, max_completion_length=T)(
        x, w, ids, torch.zeros_like(mask), adv, None, None, old, rx, rw)
    assert torch.isfinite(loss) and loss == 0
    assert all(m == 0 for m in metrics)
    loss.backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().max() == 0
    assert w.grad.abs().max() == 0


def test_function_matches_module(ext, seed):
    x, w, _, rx, rw, ids, mask, adv, old = batch()
    a = tt.TigonFusedLinearGRPOFunction.apply(x, w, ids, mask, adv, None, None, old, rx, rw, None, 0.1, 0.2, 0.2,
                                              "bnpo")
    m = tt.TigonFusedLinearGRPOLoss(beta=0.1, loss_type="bnpo")(x, w, ids, mask, adv, None, None, old, rx, rw)
    assert torch.equal(a[0], m[0])
    assert all(torch.equal(u, v) for u, v in zip(a[1], m[1]))
    # On-policy, reference == policy: the ratio is 1, the KL 0, the loss -mean(A) over the tokens.
    on = tt.TigonFusedLinearGRPOLoss(loss_type="bnpo")(x, w, ids, mask, adv, None, None, None, x, w)
    want = -(adv[:, None] * mask).sum() / mask.sum()
    torch.testing.assert_close(on[0], want, atol=1e-6, rtol=1e-6)
    assert on[1][0] == 0 and on[1][1] == 0


def test_bad_input(ext):
    x, w, _, rx, rw, ids, mask, adv, old = batch()
    mod = tt.TigonFusedLinearGRPOLoss(use_ref_model=False)
    for kw, match in [(dict(loss_type="ppo"), "loss_type"), (dict(importance_sampling_level="batch"),
                                                              "importance_sampling_level"),
                      (dict(loss_type="cispo", importance_sampling_level="sequence"), "sequence-level"),
                      (dict(loss_type="dr_grpo"), "max_completion_length"),
                      (dict(sapo_temperature_neg=0.0), "sapo_temperature_neg"), (dict(delta=0.0), "delta")]:
        with pytest.raises(ValueError, match=match):
            tt.TigonFusedLinearGRPOLoss(**kw)
    with pytest.raises(ValueError, match="loss_type"):
        tt.TigonFusedLinearGRPOFunction.apply(x, w, ids, mask, adv, None, None, None, rx, rw, None, 0.04, 0.2, 0.2,
                                              "ppo")
    with pytest.raises(ValueError, match=r"\[B, T, H\]"):
        mod(x.reshape(B * T, H), w, ids, mask, adv)
    with pytest.raises(ValueError, match="selected_token_ids"):
        mod(x, w, ids[:, :5], mask, adv)
    with pytest.raises(ValueError, match="attention_mask"):
        mod(x, w, ids, mask[:, :5], adv)
    with pytest.raises(ValueError, match="attention_mask"):
        mod(x, w, ids, None, adv)
    with pytest.raises(ValueError, match="advantages"):
        mod(x, w, ids, mask, adv[:, None].expand(B, T))
    with pytest.raises(ValueError, match="old_per_token_logps"):
        mod(x, w, ids, mask, adv, None, None, old[:, 1:])
    with pytest.raises(ValueError, match="vllm_is_ratio"):
        mod(x, w, ids, mask, adv, vllm_is_ratio=torch.ones(B, 2, device=DEVICE))
    ref = tt.TigonFusedLinearGRPOLoss()
    with pytest.raises(ValueError, match="ref_per_token_logps or ref_input"):
        ref(x, w, ids, mask, adv)
    with pytest.raises(ValueError, match="ref_per_token_logps"):
        ref(x, w, ids, mask, adv, None, old[:1])
    with pytest.raises(ValueError, match="ref_input"):
        ref(x, w, ids, mask, adv, None, None, None, rx[:, :3])
    bad = ids.clone()
    bad[2, 0] = V  # out of range where the mask is 1
    with pytest.raises(ValueError, match="out of bounds"):
        mod(x, w, bad, mask, adv)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        both = ref(x, w, ids, mask, adv, None, old, None, rx, rw)
    assert any("ref_per_token_logps" in str(c.message) for c in caught)
    torch.testing.assert_close(both[0], ref(x, w, ids, mask, adv, None, old)[0])


# ------------------------------------------------------------------------------------------------
# Against Liger-Kernel's LigerFusedLinearGRPOLoss
# ------------------------------------------------------------------------------------------------

LIGER = [dict(loss_type=t, beta=beta) for t in GRPO_LOSS_TYPES for beta in (0.0, 0.04)] + [
    dict(loss_type="grpo", beta=0.1, importance_sampling_level="sequence"),
    dict(loss_type="dapo", beta=0.0, importance_sampling_level="sequence", ref="logps"),
    dict(loss_type="luspo", beta=0.04, importance_sampling_level="sequence"),
    dict(loss_type="bnpo", beta=0.04, ref="logps", vllm="B"),
    dict(loss_type="dapo", beta=0.04, vllm="BT", num_items_in_batch=29),
    dict(loss_type="vespo", beta=0.04, vllm="BT", vespo_k_pos=1.5, vespo_lambda_neg=2.5),
    dict(loss_type="grpo", beta=0.04, delta=1.1, use_bias_correction_kl=True, epsilon_low=0.1, epsilon_high=0.28),
    dict(loss_type="dapo", beta=0.04, use_ref_model=False, old=False),
    dict(loss_type="sapo", beta=0.0, sapo_temperature_pos=0.8, sapo_temperature_neg=1.3),
    dict(loss_type="cispo", beta=0.0, epsilon_high=5.0, temperature=1.0),
]


def _liger_id(kw):
    return "-".join(f"{k}={v}" for k, v in kw.items())


@pytest.mark.parametrize("kw", LIGER, ids=_liger_id)
@pytest.mark.parametrize("bias", [False, True])
def test_against_liger(ext, seed, kw, bias):
    """The same call through Liger-Kernel's LigerFusedLinearGRPOLoss (when it imports): loss, every metric,
    gradients of the hidden states, the weight and the bias."""
    lk = pytest.importorskip("liger_kernel.chunked_loss")
    kw = dict(kw)
    ref_mode, vllm, old_given = kw.pop("ref", "input"), kw.pop("vllm", None), kw.pop("old", True)
    nib = kw.pop("num_items_in_batch", None)
    kw.setdefault("temperature", 0.8)
    kw.setdefault("epsilon_high", 1.3 if kw["loss_type"] == "cispo" else 0.2)
    kw["max_completion_length"] = T
    x, w, b, rx, rw, ids, mask, adv, old = batch(bias=bias, temperature=kw["temperature"], pad_ids=False,
                                                 level=kw.get("importance_sampling_level", "token"))
    rb = torch.randn(V, device=DEVICE) * 0.1 if bias else None
    ratio = None
    if vllm == "B":
        ratio = torch.rand(B, device=DEVICE) + 0.5
    elif vllm == "BT":
        ratio = torch.rand(B, T, device=DEVICE) + 0.5
    ref_lp = token_logps(rx, rw, rb, ids, kw["temperature"]) if ref_mode == "logps" else None
    ref_in = (rx, rw, rb) if ref_mode == "input" else (None, None, None)
    ins = [(x.clone().requires_grad_(True), w.clone().requires_grad_(True),
            b.clone().requires_grad_(True) if bias else None) for _ in range(2)]
    outs = []
    for (xi, wi, bi), cls in ((ins[0], lk.LigerFusedLinearGRPOLoss), (ins[1], tt.TigonFusedLinearGRPOLoss)):
        mod = cls(compiled=False, **kw) if cls is lk.LigerFusedLinearGRPOLoss else cls(**kw)
        outs.append(mod(xi, wi, ids, mask, adv, bi, ref_lp, old if old_given else None, *ref_in, ratio, nib))
    (want, wm), (got, gm) = outs
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert len(gm) == len(wm)
    for a, e in zip(gm, wm):
        torch.testing.assert_close(a.float(), e.float(), atol=1e-5, rtol=1e-4)
    want.backward()
    got.backward()
    for k in range(2 + bias):
        torch.testing.assert_close(ins[1][k].grad, ins[0][k].grad, atol=1e-5, rtol=1e-4)


def test_function_against_liger(ext, seed):
    """The autograd functions' positional calls, Liger's order."""
    pytest.importorskip("liger_kernel.chunked_loss")
    from liger_kernel.chunked_loss.grpo_loss import LigerFusedLinearGRPOFunction

    x, w, b, rx, rw, ids, mask, adv, old = batch(bias=True, temperature=1.2, pad_ids=False)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    rest = (ids, mask, adv, b, None, old, rx, rw, None, 0.05, 0.2, 0.25, "grpo", None, "token", 1.0, 1.05, 1.2,
            False)
    e = LigerFusedLinearGRPOFunction.apply(x1, w, *rest)
    a = tt.TigonFusedLinearGRPOFunction.apply(x2, w, *rest)
    torch.testing.assert_close(a[0], e[0], atol=1e-5, rtol=1e-4)
    assert len(a[1]) == len(e[1]) == 2
    for u, v in zip(a[1], e[1]):
        torch.testing.assert_close(u, v, atol=1e-5, rtol=1e-4)
    e[0].backward()
    a[0].backward()
    torch.testing.assert_close(x2.grad, x1.grad, atol=1e-5, rtol=1e-4)


def _signature(f, drop=("self", "ctx", "cls")):
    import inspect

    return [(p.name, p.default) for p in inspect.signature(f).parameters.values() if p.name not in drop]


def test_signatures_match_liger():
    pytest.importorskip("liger_kernel.chunked_loss")
    from liger_kernel.chunked_loss.grpo_loss import LigerFusedLinearGRPOFunction, LigerFusedLinearGRPOLoss

    assert _signature(tt.TigonFusedLinearGRPOFunction.apply) == _signature(LigerFusedLinearGRPOFunction.forward)
    assert _signature(tt.TigonFusedLinearGRPOLoss.__init__) == _signature(LigerFusedLinearGRPOLoss.__init__)
    assert _signature(tt.TigonFusedLinearGRPOLoss.forward) == _signature(LigerFusedLinearGRPOLoss.forward)

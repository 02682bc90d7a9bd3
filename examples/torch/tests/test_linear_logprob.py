"""TigonFusedLinearLogProbFunction: per-token log p(target) and entropy of the LM head without the logits,
forward and backward against plain PyTorch that materialises them (F.linear, log_softmax, gather), with
a bias, a temperature, ignored tokens, every token ignored, fp32 and bf16; bad input rejected before any
kernel runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE, assert_rel

import tigon_torch as tt

pytestmark = pytest.mark.gpu


def reference(x, w, target, bias=None, ignore_index=-100, temperature=1.0):
    """(logp, entropy) of the unfused head: nn.Linear's x @ W^T (+ b) in the inputs' dtype, upcast to fp32,
    over the temperature; ignored tokens give 0."""
    logits = F.linear(x, w, bias)
    z = logits.float() / temperature
    lp = torch.log_softmax(z, dim=-1)
    valid = target != ignore_index
    t = torch.where(valid, target, torch.zeros_like(target))
    logp = torch.where(valid, lp.gather(-1, t.unsqueeze(-1)).squeeze(-1), torch.zeros_like(lp[..., 0]))
    ent = torch.where(valid, -(lp.exp() * lp).sum(-1), torch.zeros_like(logp))
    lsum = logits.float().sum(-1)  # every token's
    return logp, ent, lsum.detach()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("shape", [(3, 17, 64, 500), (2, 64, 128, 4096)])
def test_forward_backward(ext, seed, dtype, bias, temperature, shape):
    B, T, H, V = shape
    x = torch.randn(B, T, H, device=DEVICE, dtype=dtype)
    w = (torch.randn(V, H, device=DEVICE) * H ** -0.5).to(dtype)
    b = (torch.randn(V, device=DEVICE) * 0.3).to(dtype) if bias else None
    target = torch.randint(0, V, (B, T), device=DEVICE)
    target[:, ::5] = -100
    x1, w1 = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    x2, w2 = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    b1 = b.clone().requires_grad_(True) if bias else None
    b2 = b.clone().requires_grad_(True) if bias else None
    lp_ref, ent_ref, sum_ref = reference(x1, w1, target, b1, temperature=temperature)
    lp, ent, lsum = tt.TigonFusedLinearLogProbFunction.apply(x2, w2, target, b2, -100, temperature)
    assert lp.shape == target.shape and lp.dtype == torch.float32 and ent.shape == target.shape
    factor = 4.0
    assert_rel(lp, lp_ref, dtype, factor, "logp")
    assert_rel(ent, ent_ref, dtype, factor, "entropy")
    # The ignored tokens' logits are never formed (the head skips their rows): their sums are those of
    # the unrounded logits, x (1^T W) + 1^T b in fp32.
    ign = target == -100
    sum_ign = (x.float() @ w.float().t()).sum(-1) + (b.float().sum() if bias else 0.0)
    torch.testing.assert_close(lsum[~ign], sum_ref[~ign], atol=1e-3 * V ** 0.5, rtol=1e-4)
    torch.testing.assert_close(lsum[ign], sum_ign[ign], atol=1e-3 * V ** 0.5, rtol=1e-4)
    assert not lsum.requires_grad
    assert torch.all(lp[:, ::5] == 0) and torch.all(ent[:, ::5] == 0)
    g1 = torch.randn_like(lp_ref)
    g2 = torch.randn_like(ent_ref) * 0.1
    (lp_ref * g1 + ent_ref * g2).sum().backward()
    (lp * g1 + ent * g2).sum().backward()
    assert x2.grad.dtype == dtype and w2.grad.dtype == dtype
    assert_rel(x2.grad, x1.grad, dtype, factor, "dx")
    assert_rel(w2.grad, w1.grad, dtype, factor, "dweight")
    if bias:
        assert_rel(b2.grad, b1.grad, dtype, factor, "dbias")
    assert torch.all(x2.grad[:, ::5] == 0), "ignored tokens take no gradient"


def test_logp_only_and_all_ignored(ext, seed):
    x = torch.randn(8, 32, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(300, 32, device=DEVICE) * 0.2).to(torch.bfloat16).requires_grad_(True)
    target = torch.full((8,), -100, device=DEVICE)
    lp, ent, lsum = tt.TigonFusedLinearLogProbFunction.apply(x, w, target)
    assert torch.all(lp == 0) and torch.all(ent == 0) and torch.all(lsum != 0)
    lp.sum().backward()  # the entropy unused: its gradient is None
    assert torch.all(x.grad == 0) and torch.all(w.grad == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_is_top1(ext, seed, dtype):
    """is_top1: the target is the first argmax of the token's logits (ignored tokens: False); the other
    outputs and the gradients are those of the call without it."""
    N, H, V = 96, 64, 1000
    x = torch.randn(N, H, device=DEVICE, dtype=dtype)
    w = (torch.randn(V, H, device=DEVICE) * H ** -0.5).to(dtype)
    logits = F.linear(x, w).float()
    target = torch.randint(0, V, (N,), device=DEVICE)
    target[::3] = logits.argmax(-1)[::3]  # a third are the argmax
    target[5::7] = -100
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    lp, ent, lsum, top1 = tt.TigonFusedLinearLogProbFunction.apply(xs[0], w, target, None, -100, 1.3, True)
    lp2, ent2, lsum2 = tt.TigonFusedLinearLogProbFunction.apply(xs[1], w, target, None, -100, 1.3)
    assert top1.dtype == torch.bool and top1.shape == target.shape and not top1.requires_grad
    # Rows where the target's logit and the best other column's are within two of the GEMM's roundings
    # may go either way.
    other = logits.scatter(1, target.clamp(min=0)[:, None], -float("inf")).amax(-1)
    tl = logits.gather(1, target.clamp(min=0)[:, None])[:, 0]
    sure = (tl - other).abs() > 2 * (2.0 ** -7 if dtype == torch.bfloat16 else 1e-5) * (1 + tl.abs())
    expect = (target != -100) & (logits.argmax(-1) == target)
    assert torch.equal(top1[sure], expect[sure]) and int(expect.sum()) > 10
    assert not top1[target == -100].any()
    for a, b in ((lp, lp2), (ent, ent2), (lsum, lsum2)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    g = torch.randn_like(lp)
    (lp * g).sum().backward()
    (lp2 * g).sum().backward()
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=0, atol=0)


def test_bad_input(ext):
    x = torch.randn(4, 16, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(50, 16, device=DEVICE, dtype=torch.bfloat16)
    t = torch.zeros(4, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="temperature"):
        tt.TigonFusedLinearLogProbFunction.apply(x, w, t, None, -100, 0.0)
    with pytest.raises(ValueError, match="tokens"):
        tt.TigonFusedLinearLogProbFunction.apply(x, w, t[:3])
    with pytest.raises(ValueError, match="features"):
        tt.TigonFusedLinearLogProbFunction.apply(x, w[:, :8].contiguous(), t)
    with pytest.raises(TypeError, match="dtype"):
        tt.TigonFusedLinearLogProbFunction.apply(x, w.float(), t)
    bad = t.clone()
    bad[2] = 50
    with pytest.raises(tt.TargetOutOfRangeError):
        tt.TigonFusedLinearLogProbFunction.apply(x, w, bad)

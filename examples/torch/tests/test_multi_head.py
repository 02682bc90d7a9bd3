"""TigonFusedLinearMultiHeadCrossEntropyLoss (Medusa's heads in one call) against K unfused heads
(F.linear, the logits upcast to fp32, F.cross_entropy, weighted and summed): loss, each head's loss,
dx, every dW and db, fp32 and bf16, with ignored tokens and a head whose targets are all ignored;
medusa_targets against the shifts Medusa's training code takes; bad input rejected by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE, assert_rel

import tigon_torch as tt

pytestmark = pytest.mark.gpu


def reference(x, weights, biases, targets, head_weights, reduction="mean", ignore_index=-100):
    losses = []
    for k, w in enumerate(weights):
        logits = F.linear(x, w)
        if biases is not None:
            logits = logits + biases[k]
        losses.append(F.cross_entropy(logits.float(), targets[k], ignore_index=ignore_index, reduction=reduction))
    losses = [torch.nan_to_num(v, nan=0.0) for v in losses]  # an all-ignored head: 0 (torch gives NaN)
    total = sum(hw * v for hw, v in zip(head_weights, losses))
    return total, torch.stack([v.detach() for v in losses])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias", [False, True])
def test_heads_against_unfused(ext, seed, dtype, reduction, bias):
    K, B, T, H, V = 4, 2, 24, 32, 301
    labels = torch.randint(0, V, (B, T), device=DEVICE)
    labels[:, :3] = -100
    targets = tt.medusa_targets(labels, K)
    targets[3] = -100  # a head with no target at all
    x = torch.randn(B * T, H, device=DEVICE).to(dtype)
    ws = [(torch.randn(V, H, device=DEVICE) * H ** -0.5).to(dtype) for _ in range(K)]
    bs = [(torch.randn(V, device=DEVICE) * 0.1).to(dtype) for _ in range(K)] if bias else None
    hw = [0.8 ** k for k in range(K)]
    ins = []
    for _ in range(2):
        ins.append((x.clone().requires_grad_(True), [w.clone().requires_grad_(True) for w in ws],
                    [b.clone().requires_grad_(True) for b in bs] if bias else None))
    loss_fn = tt.TigonFusedLinearMultiHeadCrossEntropyLoss(head_weights=hw, reduction=reduction,
                                                           return_head_losses=True)
    got, got_heads = loss_fn(ins[0][1], ins[0][0], targets, ins[0][2])
    want, want_heads = reference(ins[1][0], ins[1][1], ins[1][2], targets, hw, reduction)
    assert got.dtype == torch.float32 and got_heads.shape == (K,)
    assert torch.isfinite(got) and got_heads[3] == 0
    assert_rel(got, want.float(), dtype, what="loss")
    assert_rel(got_heads, want_heads.float(), dtype, what="head losses")
    got.backward()
    want.backward()
    assert_rel(ins[0][0].grad, ins[1][0].grad, dtype, factor=2.0, what="dx")
    for k in range(K):
        if k == 3:
            assert torch.count_nonzero(ins[0][1][k].grad) == 0
            continue
        assert_rel(ins[0][1][k].grad, ins[1][1][k].grad, dtype, what=f"dW[{k}]")
        if bias:
            assert_rel(ins[0][2][k].grad, ins[1][2][k].grad, dtype, what=f"db[{k}]")


def test_heads_upstream_gradient_and_3d_input(ext, seed):
    K, B, T, H, V = 3, 2, 16, 32, 128
    labels = torch.randint(0, V, (B, T), device=DEVICE)
    targets = tt.medusa_targets(labels, K)
    x = torch.randn(B, T, H, device=DEVICE, requires_grad=True)
    ws = [torch.randn(V, H, device=DEVICE, requires_grad=True) for _ in range(K)]
    loss = tt.TigonFusedLinearMultiHeadCrossEntropyLoss()(ws, x, targets)
    (0.5 * loss).backward()
    x2 = x.detach().clone().requires_grad_(True)
    ws2 = [w.detach().clone().requires_grad_(True) for w in ws]
    want, _ = reference(x2.reshape(-1, H), ws2, None, targets, [1.0] * K)
    (0.5 * want).backward()
    assert x.grad.shape == x.shape
    assert_rel(x.grad, x2.grad, torch.float32, what="dx")
    for a, b in zip(ws, ws2):
        assert_rel(a.grad, b.grad, torch.float32, what="dW")


def test_medusa_targets():
    labels = torch.arange(10).reshape(1, 10)
    t = tt.medusa_targets(labels, 3)
    assert t.shape == (3, 10)
    # head k at position i: labels[i + 2 + k], ignore_index past the end (Medusa: labels[..., 2 + k:])
    assert t[0].tolist() == [2, 3, 4, 5, 6, 7, 8, 9, -100, -100]
    assert t[2].tolist() == [4, 5, 6, 7, 8, 9, -100, -100, -100, -100]
    assert tt.medusa_targets(labels, 1, offset=1)[0].tolist() == list(range(1, 10)) + [-100]


def test_heads_bad_input(ext):
    H, V = 8, 16
    x = torch.randn(6, H, device=DEVICE)
    ws = [torch.randn(V, H, device=DEVICE) for _ in range(2)]
    t = torch.zeros(2, 6, dtype=torch.long, device=DEVICE)
    f = tt.TigonFusedLinearMultiHeadCrossEntropyLoss
    with pytest.raises(ValueError, match="targets"):
        f()(ws, x, t[:, :5])
    with pytest.raises(ValueError, match="weight"):
        f()([ws[0], torch.randn(V + 1, H, device=DEVICE)], x, t)
    with pytest.raises(ValueError, match="head_weights"):
        f(head_weights=[1.0])(ws, x, t)
    with pytest.raises(ValueError, match="reduction"):
        f(reduction="none")
    with pytest.raises(ValueError, match="bias"):
        f()(ws, x, t, [torch.zeros(V, device=DEVICE), None])
    bad = t.clone()
    bad[1, 2] = V
    with pytest.raises(tt.TargetOutOfRangeError):
        f()(ws, x, bad)

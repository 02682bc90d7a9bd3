"""The chunked heads compute their gradients in the forward and scale them by the upstream gradient in
the backward, in place when the graph is not kept. A graph kept for another backward (retain_graph,
or two losses over one forward) must see the unscaled gradients each time: the fused linear
cross-entropy, the multi-head loss and DPO give the gradients of `a * loss` then `b * loss` over one
forward, equal to (a + b) times those of the loss alone."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE

import tigon_torch as tt

pytestmark = pytest.mark.gpu


def _cases():
    H, V = 32, 301

    def flce(x, w):
        t = torch.arange(x.shape[0], device=DEVICE) % V
        return tt.tigon_fused_linear_cross_entropy(x, w, t)

    def heads(x, w):
        t = torch.stack([torch.arange(x.shape[0], device=DEVICE) * (k + 1) % V for k in range(2)])
        return tt.TigonFusedLinearMultiHeadCrossEntropyLoss(head_weights=[1.0, 0.5])([w, w * 0.5], x, t)

    def dpo(x, w):
        xs = x.view(4, -1, H)
        t = (torch.arange(xs.shape[0] * xs.shape[1], device=DEVICE) % V).view(4, -1)
        return tt.TigonFusedLinearDPOLoss(use_ref_model=False)(w, xs, t)[0]

    return H, V, {"fused_linear_cross_entropy": flce, "multi_head": heads, "dpo": dpo}


@pytest.mark.parametrize("case", ["fused_linear_cross_entropy", "multi_head", "dpo"])
def test_two_backwards_through_one_forward(ext, seed, case):
    H, V, cases = _cases()
    fn = cases[case]
    x0 = torch.randn(24, H, device=DEVICE)
    w0 = torch.randn(V, H, device=DEVICE) * H ** -0.5
    x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    want_x, want_w = torch.autograd.grad(fn(x, w), (x, w))

    x.grad = w.grad = None
    loss = fn(x, w)
    (0.5 * loss).backward(retain_graph=True)
    (2.0 * loss).backward()
    torch.testing.assert_close(x.grad, 2.5 * want_x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad, 2.5 * want_w, atol=1e-5, rtol=1e-5)

    # One backward, not kept: the same gradients as autograd.grad gave.
    x.grad = w.grad = None
    (3.0 * fn(x, w)).backward()
    torch.testing.assert_close(x.grad, 3.0 * want_x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad, 3.0 * want_w, atol=1e-5, rtol=1e-5)

"""Port of Liger-Kernel 0.8.2's test/transformers/test_fused_linear_cross_entropy.py onto tigon_torch.

Same shapes, dtypes, option combinations and (atol, rtol) per case as Liger's. The reference is the
unfused LM head: nn.Linear, the logits upcast to fp32, the softcap, then liger_helpers.ce_with_z_loss
(PyTorch's cross-entropy with class weights, plus the z-loss over the non-ignored tokens, unweighted).
The tigon side is TigonFusedLinearCrossEntropyLoss (forward(lin_weight, _input, target, bias)),
tigon_fused_linear_cross_entropy and TigonFusedLinearCrossEntropyFunction with Liger's positional
arguments. Liger's functional test compares its two entry points with each other; here both are
compared with the reference. In test_amp the two heads share one bias (Liger's leaves each its own
random one).

The use_token_scaling cases compare with the unfused head whose per-token losses are multiplied by
the detached softmax probability of the target, as Liger's tests do, plus the harder cases (mean,
options, bf16) against the same reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE
from liger_helpers import REF_FLOAT, assert_close, assign_ignore_index, ce_fields, ce_with_z_loss

import tigon_torch as tt

pytestmark = pytest.mark.gpu

SHAPES = [(8, 128, 1024, 4096), (4, 47, 31, 123)]
RED_TOLS = [
    pytest.param("mean", 1.0, torch.bfloat16, 5e-3, 5e-2, id="mean-bf16"),
    pytest.param("mean", 1.0, torch.float32, 1e-5, 5e-4, id="mean-fp32"),
    pytest.param("sum", 1.0, torch.bfloat16, 5e-0, 5e1, id="sum-bf16"),
    pytest.param("sum", 1.0, torch.float32, 1e-3, 5e-2, id="sum-fp32"),
]
OPTION_SETS = [
    pytest.param(False, 0, -100, 0, None, False, None, id="defaults"),
    pytest.param(True, 0.1, 42, 1e-4, 30.0, True, torch.float32, id="all-options"),
]
OPTION_NAMES = "has_ce_weight, label_smoothing, ignore_index, lse_square_scale, softcap, return_z_loss, accum_dtype"


def reference_head(x, weight, bias, target, ce_weight=None, ignore_index=-100, lse_square_scale=0.0,
                   label_smoothing=0.0, reduction="mean", softcap=None):
    """(loss, z_loss) of the unfused head as Liger composes it: x @ W^T in the inputs' dtype, plus the bias
    in that dtype (two roundings, where nn.Linear's fused bias rounds once), the logits upcast (fp32;
    fp64 in the CPU reference mode), softcap, CE."""
    logits = F.linear(x, weight)
    if bias is not None:
        logits = logits + bias
    logits = logits.to(REF_FLOAT)
    if softcap is not None and softcap != 0.0:
        logits = softcap * torch.tanh(logits / softcap)
    return ce_with_z_loss(logits, target, weight=ce_weight, lse_square_scale=lse_square_scale, reduction=reduction,
                          ignore_index=ignore_index, label_smoothing=label_smoothing)


class _Heads:
    """The reference head's and tigon's parameters: one weight (and bias) drawn once, two leaf copies."""

    def __init__(self, H, V, dtype, bias, draw=torch.rand):
        w = draw(V, H, device=DEVICE, dtype=dtype)
        b = draw(V, device=DEVICE, dtype=dtype) if bias else None
        self.w_ref, self.w = w.clone().requires_grad_(True), w.clone().requires_grad_(True)
        self.b_ref = b.clone().requires_grad_(True) if bias else None
        self.b = b.clone().requires_grad_(True) if bias else None


def _inputs(B, T, H, V, dtype, scalar, ignore_index):
    x = torch.randn(B * T, H, device=DEVICE, dtype=dtype) * scalar
    target = torch.randint(0, V, (B * T,), device=DEVICE, dtype=torch.long)
    assign_ignore_index(target, ignore_index)
    return x.detach().clone().requires_grad_(True), x.detach().clone().requires_grad_(True), target


@pytest.mark.parametrize("B, T, H, V", SHAPES)
@pytest.mark.parametrize("reduction, scalar, dtype, atol, rtol", RED_TOLS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(OPTION_NAMES, OPTION_SETS)
def test_correctness(ext, seed, B, T, H, V, scalar, dtype, bias, has_ce_weight, lse_square_scale, label_smoothing,
                     ignore_index, reduction, softcap, return_z_loss, accum_dtype, atol, rtol):
    ce_weight = torch.rand(V, device=DEVICE, dtype=torch.float32) if has_ce_weight else None
    heads = _Heads(H, V, dtype, bias)
    x1, x2, target = _inputs(B, T, H, V, dtype, scalar, ignore_index)
    opts = dict(ce_weight=ce_weight, ignore_index=ignore_index, lse_square_scale=lse_square_scale,
                label_smoothing=label_smoothing, reduction=reduction, softcap=softcap)

    out1, z1 = reference_head(x1, heads.w_ref, heads.b_ref, target, **opts)
    result = tt.TigonFusedLinearCrossEntropyLoss(return_z_loss=return_z_loss, accum_dtype=accum_dtype, **opts)(
        heads.w, x2, target, heads.b)
    if return_z_loss:
        out2, z2, _, _ = ce_fields(result)
        assert_close(z2, z1, atol, rtol, "z_loss")
    else:
        out2 = result
    assert_close(out2, out1, atol, rtol, "loss")

    grad = torch.ones_like(out1)
    out1.backward(gradient=grad)
    out2.backward(gradient=grad)
    assert_close(x2.grad, x1.grad, atol, rtol, "dx")
    assert_close(heads.w.grad, heads.w_ref.grad, atol, rtol, "dW")
    if bias:
        assert_close(heads.b.grad, heads.b_ref.grad, atol, rtol, "dB")


@pytest.mark.parametrize("B, T, H, V", SHAPES)
@pytest.mark.parametrize("reduction, scalar, dtype, atol, rtol", RED_TOLS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(OPTION_NAMES, OPTION_SETS)
def test_correctness_with_forward_only(ext, seed, B, T, H, V, scalar, dtype, bias, has_ce_weight, lse_square_scale,
                                       label_smoothing, ignore_index, reduction, softcap, return_z_loss, accum_dtype,
                                       atol, rtol):
    ce_weight = torch.rand(V, device=DEVICE, dtype=torch.float32) if has_ce_weight else None
    heads = _Heads(H, V, dtype, bias)
    x1, x2, target = _inputs(B, T, H, V, dtype, scalar, ignore_index)
    opts = dict(ce_weight=ce_weight, ignore_index=ignore_index, lse_square_scale=lse_square_scale,
                label_smoothing=label_smoothing, reduction=reduction, softcap=softcap)
    with torch.no_grad():
        out1, z1 = reference_head(x1, heads.w_ref, heads.b_ref, target, **opts)
        result = tt.TigonFusedLinearCrossEntropyLoss(return_z_loss=return_z_loss, accum_dtype=accum_dtype, **opts)(
            heads.w, x2, target, heads.b)
        if return_z_loss:
            out2, z2, _, _ = ce_fields(result)
            assert_close(z2, z1, atol, rtol, "z_loss")
        else:
            out2 = result
        assert_close(out2, out1, atol, rtol, "loss")
    assert not out2.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        out2.backward(gradient=torch.rand_like(out1))


@pytest.mark.parametrize("B, T, H, V", [(2, 2, 8, 8), (9, 7, 41, 41)])
@pytest.mark.parametrize("scalar, dtype, atol, rtol",
                         [(1.0, torch.bfloat16, 5e-3, 5e-2), (1.0, torch.float32, 1e-5, 5e-4)])
@pytest.mark.parametrize("ce_weight", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_correctness_functional(ext, seed, B, T, H, V, scalar, dtype, bias, ce_weight, atol, rtol):
    x = torch.randn(B * T, H, device=DEVICE, dtype=dtype) * scalar
    x0, x1, x2 = (x.detach().clone().requires_grad_(True) for _ in range(3))
    target = torch.randint(0, V, (B * T,), device=DEVICE, dtype=torch.long)
    weight = torch.randn(V, H, device=DEVICE, dtype=dtype)
    bias = torch.randn(V, device=DEVICE, dtype=dtype) if bias else None
    ce_weight = torch.randn(V, device=DEVICE) if ce_weight else None

    y0, z0 = reference_head(x0, weight, bias, target, ce_weight=ce_weight, lse_square_scale=1e-4, label_smoothing=0.1,
                            reduction="mean", softcap=30.0)
    result = tt.tigon_fused_linear_cross_entropy(input=x1, weight=weight, target=target, bias=bias,
                                                 ce_weight=ce_weight, ignore_index=-100, lse_square_scale=1e-4,
                                                 label_smoothing=0.1, reduction="mean", softcap=30.0,
                                                 return_z_loss=True, accum_dtype=torch.float32)
    y1, z1, _, _ = ce_fields(result)
    y2, z2, _, _ = tt.TigonFusedLinearCrossEntropyFunction.apply(
        x2, weight, target, bias, ce_weight, -100, 1e-4, 0.1, "mean", 30.0, True, torch.float32, False, False, False)
    for name, got, want in (("functional loss", y1, y0), ("functional z_loss", z1, z0),
                            ("Function loss", y2, y0), ("Function z_loss", z2, z0)):
        assert_close(got, want, atol, rtol, name)

    grad = torch.randn_like(y0)
    for y in (y0, y1, y2):
        y.backward(grad.clone())
    # The functional call and the Function are one computation: the same gradient, bit for bit (Liger's
    # test asserts this). Against the unfused head the gradient agrees to its rounding: the class weights
    # from randn can sum close to 0, so the mean's 1 / sum scales dlogits up, and each path's bf16
    # roundings of dlogits (before or after the upstream gradient) reach dx as an absolute error of
    # about ulp(|dlogits|) * sqrt(V) * |W|, which the tolerance scales with.
    assert torch.equal(x1.grad, x2.grad), "functional dx != Function dx"
    scale = x0.grad.double().abs().max().item()
    assert_close(x1.grad, x0.grad, atol + rtol * 0.05 * scale, rtol, "functional dx")


@pytest.mark.parametrize("B, T, H, V", SHAPES)
@pytest.mark.parametrize("reduction, scalar, dtype, atol, rtol", RED_TOLS[:2])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("return_token_accuracy", [True, False])
def test_correctness_with_token_accuracy(ext, seed, B, T, H, V, scalar, dtype, bias, return_token_accuracy, reduction,
                                         atol, rtol):
    heads = _Heads(H, V, dtype, bias)
    x1, x2, target = _inputs(B, T, H, V, dtype, scalar, -100)
    out1, _ = reference_head(x1, heads.w_ref, heads.b_ref, target, reduction=reduction)
    result = tt.tigon_fused_linear_cross_entropy(input=x2, weight=heads.w, target=target, bias=heads.b,
                                                 ignore_index=-100, reduction=reduction,
                                                 return_token_accuracy=return_token_accuracy)
    if return_token_accuracy:
        out2, _, accuracy, _ = ce_fields(result)
        with torch.no_grad():
            logits = x2 @ heads.w.t()
            if bias:
                logits = logits + heads.b
            mask = target != -100
            expected = ((logits.argmax(dim=-1) == target) & mask).sum().float() / mask.sum().float()
        assert_close(accuracy, expected, atol, rtol, "token_accuracy")
    else:
        assert isinstance(result, torch.Tensor)
        out2 = result
    assert_close(out2, out1, atol, rtol, "loss")

    grad = torch.ones_like(out1)
    out1.backward(gradient=grad)
    out2.backward(gradient=grad)
    assert_close(x2.grad, x1.grad, atol, rtol, "dx")
    assert_close(heads.w.grad, heads.w_ref.grad, atol, rtol, "dW")
    if bias:
        assert_close(heads.b.grad, heads.b_ref.grad, atol, rtol, "dB")


@pytest.mark.cuda_only
@pytest.mark.parametrize("B, T, H, V", SHAPES)
@pytest.mark.parametrize("bias, cast_dtype, atol, rtol",
                         [(True, torch.bfloat16, 5e-3, 5e-2), (True, torch.float16, 5e-3, 5e-2),
                          (False, torch.bfloat16, 5e-3, 5e-2), (False, torch.float16, 5e-3, 5e-2)])
@pytest.mark.parametrize("accum_dtype", [None, torch.float32])
def test_amp(ext, seed, B, T, H, V, bias, cast_dtype, accum_dtype, atol, rtol):
    """fp32 parameters and inputs under autocast: the head's matmul runs in the autocast dtype, the loss
    and the gradients come back in fp32."""
    heads = _Heads(H, V, torch.float32, bias)
    x = torch.randn(B * T, H, device=DEVICE, dtype=torch.float32)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    target = torch.randint(0, V, (B * T,), device=DEVICE, dtype=torch.long)
    loss_fn = tt.TigonFusedLinearCrossEntropyLoss(reduction="mean", accum_dtype=accum_dtype)
    with torch.autocast(device_type="cuda", dtype=cast_dtype):
        out1, _ = reference_head(x1, heads.w_ref, heads.b_ref, target)
        out2 = loss_fn(heads.w, x2, target, heads.b)
    assert_close(out2, out1, atol, rtol, "loss")
    with torch.autocast(device_type="cuda", dtype=cast_dtype):
        out1.backward()
        out2.backward()
    assert x2.grad.dtype == torch.float32 and heads.w.grad.dtype == torch.float32
    assert_close(x2.grad, x1.grad, atol, rtol, "dx")
    assert_close(heads.w.grad, heads.w_ref.grad, atol, rtol, "dW")


# ------------------------------------------------------------------------------------------------
# use_token_scaling: each token's loss times its (detached) predicted probability of the target
# ------------------------------------------------------------------------------------------------


def _token_scaling(call):
    return call()


def _token_scaled_reference(x, weight, bias, target, reduction):
    logits = F.linear(x, weight, bias)
    ce = F.cross_entropy(logits, target, ignore_index=-100, reduction="none")
    prob = torch.softmax(logits.detach(), dim=-1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    scaled = ce * prob
    return scaled if reduction == "none" else scaled.sum()


def test_correctness_token_scaling(ext, seed):
    B, T, H, V = 2, 4, 8, 16
    x = torch.randn(B * T, H, device=DEVICE, requires_grad=True)
    target = torch.randint(0, V, (B * T,), device=DEVICE, dtype=torch.long)
    weight = torch.randn(V, H, device=DEVICE)
    bias = torch.randn(V, device=DEVICE)
    loss = _token_scaling(lambda: tt.tigon_fused_linear_cross_entropy(
        input=x, weight=weight, target=target, bias=bias, ignore_index=-100, reduction="none", use_token_scaling=True))
    expected = _token_scaled_reference(x, weight, bias, target, "none")
    torch.testing.assert_close(loss, expected, atol=1e-4, rtol=1e-4)
    (g1,) = torch.autograd.grad(loss.sum(), x, retain_graph=True)
    (g2,) = torch.autograd.grad(expected.sum(), x)
    torch.testing.assert_close(g1, g2, atol=1e-4, rtol=1e-4)


def test_correctness_token_scaling_consistency(ext, seed):
    B, T, H, V = 2, 4, 8, 16
    x = torch.randn(B * T, H, device=DEVICE, requires_grad=True)
    target = torch.randint(0, V, (B * T,), device=DEVICE, dtype=torch.long)
    weight = torch.randn(V, H, device=DEVICE)
    bias = torch.randn(V, device=DEVICE)
    loss_f = _token_scaling(lambda: tt.tigon_fused_linear_cross_entropy(
        input=x, weight=weight, target=target, bias=bias, ignore_index=-100, reduction="sum", use_token_scaling=True))
    module = tt.TigonFusedLinearCrossEntropyLoss(ignore_index=-100, reduction="sum", use_token_scaling=True)
    loss_m = module(weight, x, target, bias)
    torch.testing.assert_close(loss_f, loss_m, atol=1e-6, rtol=1e-6)
    (g1,) = torch.autograd.grad(loss_f, x)
    (g2,) = torch.autograd.grad(loss_m, x)
    torch.testing.assert_close(g1, g2, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("api", ["functional", "module"])
def test_correctness_token_scaling_sum(ext, seed, api):
    """Liger's test_correctness_token_scaling_functional and _module: reduction="sum"."""
    B, T, H, V = 2, 4, 8, 16
    x = torch.randn(B * T, H, device=DEVICE)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    target = torch.randint(0, V, (B * T,), device=DEVICE, dtype=torch.long)
    weight = torch.randn(V, H, device=DEVICE)
    bias = torch.randn(V, device=DEVICE)
    if api == "functional":
        y1 = _token_scaling(lambda: tt.tigon_fused_linear_cross_entropy(
            input=x1, weight=weight, target=target, bias=bias, ignore_index=-100, lse_square_scale=0.0,
            label_smoothing=0.0, reduction="sum", softcap=None, return_z_loss=False, accum_dtype=None,
            use_token_scaling=True))
    else:
        module = tt.TigonFusedLinearCrossEntropyLoss(ignore_index=-100, reduction="sum", use_token_scaling=True)
        y1 = _token_scaling(lambda: module(weight, x1, target, bias))
    y2 = _token_scaled_reference(x2, weight, bias, target, "sum")
    torch.testing.assert_close(y1, y2, atol=1e-5, rtol=1e-5)
    y1.backward()
    y2.backward()
    torch.testing.assert_close(x1.grad, x2.grad, atol=1e-5, rtol=1e-5)


def test_token_scaling_with_ignore_index(ext, seed):
    H, V = 8, 1000
    target = torch.tensor([0, 100, -100, 500, -100, 999], device=DEVICE, dtype=torch.long)
    x = torch.randn(6, H, device=DEVICE, requires_grad=True)
    weight = torch.randn(V, H, device=DEVICE)
    bias = torch.randn(V, device=DEVICE)
    loss = _token_scaling(lambda: tt.tigon_fused_linear_cross_entropy(
        input=x, weight=weight, target=target, bias=bias, ignore_index=-100, reduction="sum", use_token_scaling=True))
    assert loss.numel() == 1 and torch.isfinite(loss)
    loss.backward()
    assert x.grad is not None and not torch.isnan(x.grad).any()


def _token_scaled_full(x, weight, bias, target, ce_weight, smoothing, z, cap, reduction, ignore_index):
    """The unfused head's loss with every option and token scaling, in REF_FLOAT: per token the weighted,
    smoothed cross-entropy plus z lse^2, times the detached probability of the target (softcapped
    logits); "mean" divides the cross-entropy part by the non-ignored targets' weight sum and the z part
    by their count."""
    logits = F.linear(x, weight, bias).to(REF_FLOAT)
    if cap is not None:
        logits = cap * torch.tanh(logits / cap)
    w = ce_weight.to(REF_FLOAT) if ce_weight is not None else None
    ce = F.cross_entropy(logits, target, weight=w, reduction="none", label_smoothing=smoothing,
                         ignore_index=ignore_index)
    valid = target != ignore_index
    t = torch.where(valid, target, torch.zeros_like(target))
    lse = torch.logsumexp(logits, -1)
    zl = torch.where(valid, z * lse * lse, torch.zeros_like(lse))
    prob = torch.softmax(logits.detach(), -1).gather(-1, t[:, None])[:, 0] * valid
    ce, zl = ce * prob, zl * prob
    if reduction == "none":
        return ce + zl
    if reduction == "sum":
        return ce.sum() + zl.sum()
    wsum = (w[t] * valid).sum() if w is not None else valid.sum().to(REF_FLOAT)
    return ce.sum() / wsum + zl.sum() / valid.sum().to(REF_FLOAT)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype, atol, rtol", [(torch.float32, 1e-5, 1e-4), (torch.bfloat16, 2e-2, 5e-2)],
                         ids=["fp32", "bf16"])
def test_token_scaling_all_options(ext, seed, reduction, dtype, atol, rtol):
    """Token scaling with class weights, smoothing, z-loss, softcap, a bias and ignored tokens: loss, dx, dW
    and db against the unfused head."""
    N, H, V = 96, 64, 1000
    x = torch.randn(N, H, device=DEVICE, dtype=dtype)
    weight = (torch.randn(V, H, device=DEVICE) / H**0.5 * 4).to(dtype)
    bias = torch.randn(V, device=DEVICE, dtype=dtype)
    target = assign_ignore_index(torch.randint(0, V, (N,), device=DEVICE), -100)
    ce_weight = torch.rand(V, device=DEVICE) + 0.5
    args = dict(ce_weight=ce_weight, label_smoothing=0.1, lse_square_scale=1e-3, softcap=20.0)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    ws = [weight.clone().requires_grad_(True) for _ in range(2)]
    bs = [bias.clone().requires_grad_(True) for _ in range(2)]
    got = tt.tigon_fused_linear_cross_entropy(input=xs[0], weight=ws[0], target=target, bias=bs[0],
                                              reduction=reduction, use_token_scaling=True, **args)
    ref = _token_scaled_full(xs[1], ws[1], bs[1], target, ce_weight, 0.1, 1e-3, 20.0, reduction, -100)
    assert_close(got, ref.float(), atol, rtol, "loss")
    go = torch.rand_like(ref) if reduction == "none" else torch.tensor(0.75, device=DEVICE, dtype=ref.dtype)
    got.backward(go.float())
    ref.backward(go)
    for got_t, ref_t, what in ((xs[0], xs[1], "dx"), (ws[0], ws[1], "dW"), (bs[0], bs[1], "db")):
        assert_close(got_t.grad.float(), ref_t.grad.float(), atol, rtol, what)


# ------------------------------------------------------------------------------------------------
# Structured output, predicted tokens, reduction="none" with a per-token upstream gradient
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("return_z_loss, return_token_accuracy", [(False, False), (True, False), (False, True),
                                                                   (True, True)])
def test_tigon_fused_linear_cross_entropy_structured_output(ext, return_z_loss, return_token_accuracy):
    hidden = torch.tensor([[0.2, -0.1], [1.0, 0.5], [-0.3, 0.7]], device=DEVICE, requires_grad=True)
    weight = torch.tensor([[0.5, -0.4], [-0.2, 0.3], [0.1, 0.6]], device=DEVICE)
    bias = torch.tensor([0.1, -0.2, 0.05], device=DEVICE)
    targets = torch.tensor([0, 1, 2], device=DEVICE)
    logits = hidden.detach() @ weight.t() + bias
    expected_loss = F.cross_entropy(logits, targets)
    expected_accuracy = (logits.argmax(dim=-1) == targets).float().mean()
    plain = not (return_z_loss or return_token_accuracy)

    result = tt.tigon_fused_linear_cross_entropy(input=hidden, weight=weight, target=targets, bias=bias,
                                                 return_z_loss=return_z_loss,
                                                 return_token_accuracy=return_token_accuracy)
    module = tt.TigonFusedLinearCrossEntropyLoss(return_z_loss=return_z_loss,
                                                 return_token_accuracy=return_token_accuracy)
    module_result = module(weight, hidden, targets, bias)
    for r in (result, module_result):
        if plain:
            assert isinstance(r, torch.Tensor)
            torch.testing.assert_close(r, expected_loss, atol=1e-6, rtol=0)
            continue
        loss, z_loss, accuracy, _ = ce_fields(r)
        torch.testing.assert_close(loss, expected_loss, atol=1e-6, rtol=0)
        assert (z_loss is not None) == return_z_loss
        assert (accuracy is not None) == return_token_accuracy
        if return_token_accuracy:
            torch.testing.assert_close(accuracy.float(), expected_accuracy, atol=1e-6, rtol=0)
    loss = result if plain else result.loss
    loss.backward()
    assert hidden.grad is not None


@pytest.mark.parametrize("B, T, H, V", SHAPES)
@pytest.mark.parametrize("reduction, dtype, atol, rtol",
                         [("mean", torch.bfloat16, 5e-3, 5e-2), ("mean", torch.float32, 1e-5, 5e-4)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("ignore_index", [-100, 2])
def test_correctness_with_predicted_tokens(ext, B, T, H, V, reduction, dtype, bias, ignore_index, atol, rtol):
    torch.manual_seed(42)
    weight = torch.randn(V, H, device=DEVICE, dtype=dtype)
    b = torch.randn(V, device=DEVICE, dtype=dtype) if bias else None
    x = torch.randn(B * T, H, device=DEVICE, dtype=dtype, requires_grad=True)
    target = torch.randint(0, V, (B * T,), device=DEVICE, dtype=torch.long)
    target[torch.randperm(B * T)[:B * T // 4].to(DEVICE)] = ignore_index

    result = tt.tigon_fused_linear_cross_entropy(input=x, weight=weight, target=target, bias=b,
                                                 ignore_index=ignore_index, reduction=reduction,
                                                 return_predicted_tokens=True)
    loss, _, _, predicted = ce_fields(result)
    assert predicted.shape == (B * T,) and predicted.dtype == torch.int64
    keep = target != ignore_index
    with torch.no_grad():
        logits = x.float() @ weight.float().t()
        if b is not None:
            logits = logits + b.float()
        # chunked bf16 GEMMs may break ties differently: compare the logit at the prediction with the max
        best = logits[keep].max(dim=-1).values
        at_pred = logits[keep].gather(1, predicted[keep].unsqueeze(1)).squeeze(1)
    assert_close(at_pred, best, atol, rtol, "logit at the predicted token")
    assert torch.all(predicted[~keep] == -1)
    loss.backward()
    assert x.grad is not None


@pytest.mark.parametrize("B, T, H, V", [(2, 16, 32, 64), (1, 32, 64, 128)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype, atol, rtol", [(torch.float32, 1e-4, 1e-4)])
def test_correctness_reduction_none_per_token_grad_output(ext, B, T, H, V, bias, dtype, atol, rtol):
    """reduction="none" folds a per-token upstream gradient into each row before the weight and bias
    gradients are summed: dW = sum_i g_i * (dlogits_i outer x_i)."""
    torch.manual_seed(42)
    BT = B * T
    x = torch.randn(BT, H, device=DEVICE, dtype=dtype) * 0.1
    weight = torch.randn(V, H, device=DEVICE, dtype=dtype) * 0.1
    b = torch.randn(V, device=DEVICE, dtype=dtype) * 0.1 if bias else None
    target = torch.randint(0, V, (BT,), device=DEVICE, dtype=torch.long)
    grad_output = torch.rand(BT, device=DEVICE, dtype=dtype) + 0.5  # not uniform

    def leaves():
        return (x.clone().requires_grad_(True), weight.clone().requires_grad_(True),
                b.clone().requires_grad_(True) if bias else None)

    xr, wr, br = leaves()
    ref_loss = F.cross_entropy(F.linear(xr, wr, br), target, reduction="none")
    ref_loss.backward(grad_output)
    xt, wt, bt = leaves()
    loss, _, _, _ = tt.TigonFusedLinearCrossEntropyFunction.apply(xt, wt, target, bt, None, -100, 0.0, 0.0, "none",
                                                                  None, False, None, False, False, False)
    loss.backward(grad_output)
    assert_close(loss, ref_loss, atol, rtol, "loss")
    assert_close(xt.grad, xr.grad, atol, rtol, "dx")
    assert_close(wt.grad, wr.grad, atol, rtol, "dW")
    if bias:
        assert_close(bt.grad, br.grad, atol, rtol, "dB")

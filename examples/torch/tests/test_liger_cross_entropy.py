"""Port of Liger-Kernel 0.8.2's test/transformers/test_cross_entropy.py onto tigon_torch.

Same shapes, vocabularies, dtypes, option combinations (class weights, ignore_index, label smoothing,
z-loss, softcap, reductions, the returned extras) and (atol, rtol) per case as Liger's. The references
are torch.nn.CrossEntropyLoss and, with z-loss, liger_helpers.ce_with_z_loss (PyTorch's cross-entropy
plus lse_square_scale * lse^2 per token; with "mean" the cross-entropy part over the sum of the
non-ignored targets' weights, the z-loss part over the number of non-ignored tokens), both on the
logits upcast to fp32 (fp64 in the CPU reference mode) and returned in the logits' dtype: Liger's
z-loss reference does so, and PyTorch's own bf16 backward exponentiates log-softmax rounded to bf16,
which costs a few percent on small probabilities, most of Liger's 5% bf16 tolerance.

The tigon side is TigonCrossEntropyLoss, tigon_cross_entropy and TigonCrossEntropyFunction, called as
Liger's counterparts are (a CrossEntropyOutput with .loss, .z_loss, ... when an extra is asked for).
An out-of-range target must raise, naming the value, the vocabulary size and ignore_index. Liger's
test_float32_internal launches its Triton kernel directly; here the same check goes through the
autograd function: bf16 logits give the fp32 result of the same values, rounded once.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import CrossEntropyLoss

from conftest import DEVICE
from liger_helpers import (REF_FLOAT, assert_close, assign_ignore_index, cap_on_cpu, ce_fields, ce_with_z_loss,
                           names_number, torch_ce)

import tigon_torch as tt

pytestmark = pytest.mark.gpu

BIG = [(2, 4096, 32000), (3, 423, 32000)]
DTYPES_6 = [pytest.param(1.0, torch.bfloat16, 1e-8, 5e-2, id="bf16"),
            pytest.param(1.0, torch.float32, 1e-8, 1e-6, id="fp32")]
DTYPES_5 = [pytest.param(1.0, torch.bfloat16, 1e-8, 5e-2, id="bf16"),
            pytest.param(1.0, torch.float32, 1e-8, 1e-5, id="fp32")]


def _logits(B, T, V, dtype, scalar):
    cap_on_cpu(B * T * V)
    x = torch.randn(B * T, V, device=DEVICE, dtype=dtype) * scalar
    return x.detach().clone().requires_grad_(True), x.detach().clone().requires_grad_(True)


def _target(B, T, V, ignore_index=None):
    target = torch.randint(0, V, (B * T,), device=DEVICE, dtype=torch.long)
    if ignore_index is not None:
        assign_ignore_index(target, ignore_index)
    return target


def _check(out_ref, out, x_ref, x, atol, rtol, grad=None):
    """Loss values, then the logits' gradients after backward with grad (ones by default)."""
    assert_close(out, out_ref, atol, rtol, "loss")
    g = torch.ones_like(out_ref) if grad is None else grad
    out_ref.backward(gradient=g)
    out.backward(gradient=g.clone())
    assert_close(x.grad, x_ref.grad, atol, rtol, "dlogits")


def _softcapped(x, softcap):
    """The softcap in REF_FLOAT (fp32: Liger's casting)."""
    return softcap * torch.tanh(x.to(REF_FLOAT) / softcap)


# ------------------------------------------------------------------------------------------------
# Plain, ignore_index, label smoothing, softcap
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("B, T, V", BIG)
@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
@pytest.mark.parametrize("scalar, dtype, atol, rtol", DTYPES_6)
def test_correctness(ext, B, T, V, scalar, dtype, reduction, atol, rtol):
    torch.manual_seed(0)
    x1, x2 = _logits(B, T, V, dtype, scalar)
    target = _target(B, T, V)
    out_ref = torch_ce(x1, target, dtype, reduction=reduction)
    out = tt.TigonCrossEntropyLoss(reduction=reduction)(x2, target)
    _check(out_ref, out, x1, x2, atol, rtol)


@pytest.mark.parametrize("B, T, V, ignore_index", [(2, 4096, 32000, 2), (3, 423, 32000, -123)])
@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
@pytest.mark.parametrize("scalar, dtype, atol, rtol", DTYPES_6)
def test_correctness_with_ignore_index(ext, seed, B, T, V, ignore_index, reduction, scalar, dtype, atol, rtol):
    x1, x2 = _logits(B, T, V, dtype, scalar)
    target = _target(B, T, V, ignore_index)
    out_ref = torch_ce(x1, target, dtype, ignore_index=ignore_index, reduction=reduction)
    out = tt.TigonCrossEntropyLoss(ignore_index=ignore_index, reduction=reduction)(x2, target)
    _check(out_ref, out, x1, x2, atol, rtol)


@pytest.mark.parametrize("B, T, V, label_smoothing", [(2, 4096, 32000, 0.1), (3, 423, 32000, 0.1)])
@pytest.mark.parametrize("scalar, dtype, atol, rtol", DTYPES_6)
def test_correctness_with_label_smoothing_once(ext, seed, B, T, V, label_smoothing, scalar, dtype, atol, rtol):
    x1, x2 = _logits(B, T, V, dtype, scalar)
    target = _target(B, T, V)
    out_ref = torch_ce(x1, target, dtype, label_smoothing=label_smoothing)
    out = tt.TigonCrossEntropyLoss(label_smoothing=label_smoothing)(x2, target)
    _check(out_ref, out, x1, x2, atol, rtol)


@pytest.mark.parametrize("B, T, V, ignore_index, label_smoothing",
                         [(2, 4096, 32000, 1, 0.1), (3, 423, 32000, -300, 0.2)])
@pytest.mark.parametrize("scalar, dtype, atol, rtol", DTYPES_6)
def test_correctness_with_label_smoothing_with_ignore_index_once(ext, seed, B, T, V, ignore_index, label_smoothing,
                                                                 scalar, dtype, atol, rtol):
    x1, x2 = _logits(B, T, V, dtype, scalar)
    target = _target(B, T, V, ignore_index)
    out_ref = torch_ce(x1, target, dtype, ignore_index=ignore_index, label_smoothing=label_smoothing)
    out = tt.TigonCrossEntropyLoss(ignore_index=ignore_index, label_smoothing=label_smoothing)(x2, target)
    _check(out_ref, out, x1, x2, atol, rtol)


@pytest.mark.parametrize("B, T, V, softcap", [(2, 4096, 32000, 30.0), (3, 423, 32000, 30.0)])
@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
@pytest.mark.parametrize("scalar, dtype, atol, rtol", DTYPES_6)
def test_correctness_with_softcap_once(ext, seed, B, T, V, softcap, reduction, scalar, dtype, atol, rtol):
    x1, x2 = _logits(B, T, V, dtype, scalar)
    target = _target(B, T, V)
    out_ref = torch_ce(_softcapped(x1, softcap), target, dtype, reduction=reduction)
    out = tt.TigonCrossEntropyLoss(softcap=softcap, reduction=reduction)(x2, target)
    _check(out_ref, out, x1, x2, atol, rtol)


# ------------------------------------------------------------------------------------------------
# z-loss
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("B, T, V", BIG)
@pytest.mark.parametrize("scalar, dtype, atol, rtol", DTYPES_6)
@pytest.mark.parametrize("return_z_loss", [True, False])
@pytest.mark.parametrize("lse_square_scale", [1e-4, 1e-5])
def test_correctness_with_z_loss_once(ext, B, T, V, scalar, dtype, atol, rtol, lse_square_scale, return_z_loss):
    torch.manual_seed(0)
    x1, x2 = _logits(B, T, V, dtype, scalar)
    target = _target(B, T, V)
    out_ref, z_ref = ce_with_z_loss(x1, target, lse_square_scale=lse_square_scale, dtype=dtype)
    result = tt.TigonCrossEntropyLoss(lse_square_scale=lse_square_scale, return_z_loss=return_z_loss)(x2, target)
    if return_z_loss:
        out, z, _, _ = ce_fields(result)
        assert_close(z, z_ref, atol, rtol, "z_loss")
    else:
        out = result
    assert_close(out, out_ref, atol, rtol, "loss")
    out_ref.backward()
    out.backward()
    assert_close(x2.grad, x1.grad, atol, rtol, "dlogits")


@pytest.mark.parametrize("B, T, V", BIG)
@pytest.mark.parametrize("scalar, dtype, atol, rtol", DTYPES_6)
@pytest.mark.parametrize("return_z_loss, lse_square_scale", [(True, 1e-4), (False, 1e-5)])
@pytest.mark.parametrize("label_smoothing, ignore_index, reduction", [(0.1, 42, "mean"), (0.2, -42, "sum")])
def test_correctness_with_z_loss_with_other_params_once(ext, B, T, V, scalar, dtype, atol, rtol, lse_square_scale,
                                                        return_z_loss, label_smoothing, ignore_index, reduction):
    torch.manual_seed(0)
    x1, x2 = _logits(B, T, V, dtype, scalar)
    target = _target(B, T, V, ignore_index)
    out_ref, z_ref = ce_with_z_loss(x1, target, lse_square_scale=lse_square_scale, reduction=reduction,
                                    ignore_index=ignore_index, label_smoothing=label_smoothing, dtype=dtype)
    result = tt.TigonCrossEntropyLoss(lse_square_scale=lse_square_scale, return_z_loss=return_z_loss,
                                      label_smoothing=label_smoothing, ignore_index=ignore_index,
                                      reduction=reduction)(x2, target)
    if return_z_loss:
        out, z, _, _ = ce_fields(result)
        assert_close(z, z_ref, atol, rtol, "z_loss")
    else:
        out = result
    assert_close(out, out_ref, atol, rtol, "loss")
    out_ref.backward()
    out.backward()
    assert_close(x2.grad, x1.grad, atol, rtol, "dlogits")


# ------------------------------------------------------------------------------------------------
# Class weights
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("B, T, V", BIG)
@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
@pytest.mark.parametrize("scalar, dtype, atol, rtol", DTYPES_6)
def test_correctness_with_weight_once(ext, seed, B, T, V, reduction, scalar, dtype, atol, rtol):
    weight = torch.rand(V, device=DEVICE, dtype=dtype)
    torch.manual_seed(0)
    x1, x2 = _logits(B, T, V, dtype, scalar)
    target = _target(B, T, V)
    out_ref = torch_ce(x1, target, dtype, weight=weight, reduction=reduction)
    out = tt.TigonCrossEntropyLoss(weight=weight, reduction=reduction)(x2, target)
    _check(out_ref, out, x1, x2, atol, rtol)


@pytest.mark.parametrize("B, T, V", BIG)
@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
@pytest.mark.parametrize("ignore_index, lse_square_scale, label_smoothing, softcap",
                         [(-100, 1e-4, 0.1, 30.0), (42, 1e-5, 0.2, 40.0)])
@pytest.mark.parametrize("scalar, dtype, atol, rtol", DTYPES_6)
def test_correctness_with_weight_with_other_params_once(ext, seed, B, T, V, reduction, lse_square_scale,
                                                        ignore_index, label_smoothing, softcap, scalar, dtype,
                                                        atol, rtol):
    weight = torch.rand(V, device=DEVICE, dtype=torch.float32)
    torch.manual_seed(0)
    x1, x2 = _logits(B, T, V, dtype, scalar)
    target = _target(B, T, V, ignore_index)
    out_ref, _ = ce_with_z_loss(_softcapped(x1, softcap), target, weight=weight,
                                lse_square_scale=lse_square_scale, reduction=reduction, ignore_index=ignore_index,
                                label_smoothing=label_smoothing, dtype=dtype)
    out_ref = out_ref.to(dtype)
    out = tt.TigonCrossEntropyLoss(weight=weight, lse_square_scale=lse_square_scale, reduction=reduction,
                                   ignore_index=ignore_index, label_smoothing=label_smoothing,
                                   softcap=softcap)(x2, target)
    _check(out_ref, out, x1, x2, atol, rtol)


# ------------------------------------------------------------------------------------------------
# Not the last layer: an upstream gradient other than 1
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("B, T, V", BIG)
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("scalar, dtype, atol, rtol", DTYPES_6)
def test_correctness_not_last_layer(ext, seed, B, T, V, reduction, scalar, dtype, atol, rtol):
    x1, x2 = _logits(B, T, V, dtype, scalar)
    target = _target(B, T, V)
    out_ref = torch_ce(x1, target, dtype, reduction=reduction)
    out = tt.TigonCrossEntropyLoss(reduction=reduction)(x2, target)
    assert_close(out, out_ref, atol, rtol, "loss")
    grad = torch.rand_like(out_ref)
    (out_ref * 3).backward(gradient=grad)
    (out * 3).backward(gradient=grad)
    assert_close(x2.grad, x1.grad, atol, rtol, "dlogits")


@pytest.mark.parametrize("B, T, V", [(2, 1024, 32000), (3, 423, 32000)])
@pytest.mark.parametrize("ignore_index, lse_square_scale, label_smoothing, softcap",
                         [(-100, 1e-4, 0.1, 30.0), (42, 1e-5, 0.2, 40.0)])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("scalar, dtype, atol, rtol", DTYPES_5)
def test_correctness_not_last_layer_with_other_params(ext, seed, B, T, V, reduction, ignore_index, lse_square_scale,
                                                      label_smoothing, softcap, scalar, dtype, atol, rtol):
    x1, x2 = _logits(B, T, V, dtype, scalar)
    target = _target(B, T, V, ignore_index)
    out_ref, _ = ce_with_z_loss(_softcapped(x1, softcap), target, lse_square_scale=lse_square_scale,
                                reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing)
    out_ref = out_ref.to(dtype)
    out = tt.TigonCrossEntropyLoss(reduction=reduction, ignore_index=ignore_index, lse_square_scale=lse_square_scale,
                                   label_smoothing=label_smoothing, softcap=softcap)(x2, target)
    assert_close(out, out_ref, atol, rtol, "loss")
    grad = torch.rand_like(out_ref)
    (out_ref * 3).backward(gradient=grad)
    (out * 3).backward(gradient=grad)
    assert_close(x2.grad, x1.grad, atol, rtol, "dlogits")


# ------------------------------------------------------------------------------------------------
# Functional entry point and the autograd function
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("B, T, V", [(2, 2, 8), (9, 7, 41)])
@pytest.mark.parametrize("scalar, dtype, atol, rtol", DTYPES_6)
def test_correctness_functional(ext, seed, B, T, V, scalar, dtype, atol, rtol):
    x = torch.randn(B * T, V, device=DEVICE, dtype=dtype) * scalar
    x0, x1, x2 = (x.clone().requires_grad_(True) for _ in range(3))
    target = torch.randint(0, V, (B * T,), device=DEVICE, dtype=torch.long)

    y0, z0 = ce_with_z_loss(_softcapped(x0, 30.0), target, ignore_index=0, lse_square_scale=1e-4,
                            label_smoothing=0.1, reduction="mean", dtype=dtype)
    result = tt.tigon_cross_entropy(x1, target, None, ignore_index=0, lse_square_scale=1e-4, label_smoothing=0.1,
                                    reduction="mean", softcap=30.0, return_z_loss=True)
    y1, z1, _, _ = ce_fields(result)
    y2, z2, _, _ = tt.TigonCrossEntropyFunction.apply(x2, target, None, 0, 1e-4, 0.1, "mean", 30.0, True, False,
                                                      False)
    for name, got, want in (("functional loss", y1, y0), ("functional z_loss", z1, z0),
                            ("Function loss", y2, y0), ("Function z_loss", z2, z0)):
        assert_close(got, want, atol, rtol, name)

    grad = torch.randn_like(y0)
    for y in (y0, y1, y2):
        y.backward(grad.clone())
    assert_close(x1.grad, x0.grad, atol, rtol, "functional dlogits")
    assert_close(x2.grad, x0.grad, atol, rtol, "Function dlogits")


def test_float32_internal(ext, seed):
    """bf16 logits are read into fp32: the loss and gradient of bf16 logits are those of the same values in
    fp32, rounded once to bf16."""
    batch, vocab = 4, 128256
    x = torch.randn(batch, vocab, dtype=torch.bfloat16, device=DEVICE)
    target = torch.randint(0, vocab, (batch,), device=DEVICE)
    results = {}
    for dtype in (torch.bfloat16, torch.float32):
        xi = x.to(dtype).detach().clone().requires_grad_(True)
        loss, _, _, _ = tt.TigonCrossEntropyFunction.apply(xi, target, None, -100, 0.0, 0.0, "none", None, False,
                                                           False, False)
        loss.backward(torch.ones_like(loss))
        results[dtype] = (loss.detach(), xi.grad)
    (l16, g16), (l32, g32) = results[torch.bfloat16], results[torch.float32]
    torch.testing.assert_close(l16.float(), l32.to(torch.bfloat16).float(), atol=0, rtol=1e-2)
    torch.testing.assert_close(g16.float(), g32.to(torch.bfloat16).float(), atol=1e-9, rtol=1e-2)


@pytest.mark.parametrize("B, T, V, ignore_index", [(2, 4096, 32000, 2), (3, 423, 32000, -123)])
def test_correctness_with_out_of_bounds_target_once(ext, B, T, V, ignore_index):
    torch.manual_seed(0)
    cap_on_cpu(B * T * V)
    x = torch.randn(B * T, V, device=DEVICE, dtype=torch.bfloat16)
    x_in = x.clone().requires_grad_(True)
    target = _target(B, T, V, ignore_index)
    count = int(torch.randint(1, B * T // 2, (1,)).item())
    idx = torch.randperm(B * T)[:count].to(DEVICE)
    bad = torch.randint(V, 2 * V, (count,)).to(DEVICE)
    target[idx] = bad
    offending = set(target[(target != ignore_index) & ((target < 0) | (target >= V))].tolist())

    with pytest.raises(Exception) as info:
        tt.TigonCrossEntropyLoss(ignore_index=ignore_index)(x_in, target)
    message = str(info.value)
    assert any(names_number(message, v) for v in offending), (
        f"the message does not name an offending target: {message!r}")
    assert names_number(message, V) and names_number(message, ignore_index), (
        f"the message should name the vocabulary size {V} and ignore_index {ignore_index}: {message!r}")
    assert torch.equal(x_in.detach(), x) and x_in.grad is None, "nothing may be written before the check"


@pytest.mark.parametrize("B, T, V, ignore_index", [(2, 4096, 32000, -100), (3, 423, 32000, 2)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype, scalar, atol, rtol",
                         [(torch.float32, 1.0, 1e-4, 1e-4), (torch.float16, 1.0, 1e-2, 1e-2),
                          (torch.bfloat16, 1.0, 1e-2, 1e-2)])
def test_correctness_with_forward_only(ext, B, T, V, ignore_index, reduction, dtype, scalar, atol, rtol):
    torch.manual_seed(0)
    cap_on_cpu(B * T * V)
    x = torch.randn(B * T, V, device=DEVICE, dtype=dtype) * scalar
    target = _target(B, T, V)
    with torch.no_grad():
        # (Liger's reference leaves ignore_index out: a target equal to it would then be counted)
        out_ref = torch_ce(x, target, dtype, ignore_index=ignore_index, reduction=reduction)
        out = tt.TigonCrossEntropyLoss(ignore_index=ignore_index, reduction=reduction)(x.clone(), target)
        assert_close(out, out_ref, atol, rtol, "loss")
    assert not out.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        out.backward(gradient=torch.ones_like(out))


# ------------------------------------------------------------------------------------------------
# Structured output, predicted tokens, confident predictions
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("return_z_loss, return_token_accuracy, return_predicted_tokens",
                         [(False, False, False), (True, False, False), (False, True, False), (False, False, True),
                          (True, True, False), (True, False, True), (False, True, True), (True, True, True)])
def test_tigon_cross_entropy_structured_output(ext, return_z_loss, return_token_accuracy, return_predicted_tokens):
    logits = torch.tensor([[2.0, 0.5, -1.0], [0.1, 1.5, 0.3], [0.7, -0.2, 0.9]], device=DEVICE, requires_grad=True)
    targets = torch.tensor([0, 1, 2], device=DEVICE)
    original = logits.detach().clone()
    result = tt.tigon_cross_entropy(logits, targets, reduction="mean", return_z_loss=return_z_loss,
                                    return_token_accuracy=return_token_accuracy,
                                    return_predicted_tokens=return_predicted_tokens)
    if not (return_z_loss or return_token_accuracy or return_predicted_tokens):
        assert isinstance(result, torch.Tensor) and result.shape == ()
        result.backward()
        assert logits.grad is not None
        return

    loss, z_loss, accuracy, predicted = ce_fields(result)
    assert loss.shape == ()
    assert (z_loss is not None) == return_z_loss
    if return_z_loss:
        assert isinstance(z_loss, torch.Tensor)
    expected_pred = original.argmax(dim=-1)
    if return_token_accuracy:
        torch.testing.assert_close(accuracy.float(), (expected_pred == targets).float().mean(), atol=1e-6, rtol=0)
    else:
        assert accuracy is None
    if return_predicted_tokens:
        assert predicted.dtype == torch.int64 and predicted.shape == (3,)
        assert torch.equal(predicted, expected_pred)
        if return_token_accuracy:
            torch.testing.assert_close(accuracy.float(), (predicted == targets).float().mean(), atol=1e-6, rtol=0)
    else:
        assert predicted is None
    loss.backward()
    assert logits.grad is not None


@pytest.mark.parametrize("B, T, V", [(2, 128, 512), (3, 47, 31)])
@pytest.mark.parametrize("ignore_index", [-100, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_correctness_with_predicted_tokens(ext, B, T, V, ignore_index, dtype):
    torch.manual_seed(42)
    x = torch.randn(B * T, V, device=DEVICE, dtype=dtype)
    x_in = x.detach().clone().requires_grad_(True)
    target = torch.randint(0, V, (B * T,), device=DEVICE, dtype=torch.long)
    target[torch.randperm(B * T)[:B * T // 4].to(DEVICE)] = ignore_index
    expected = x.float().argmax(dim=-1)

    result = tt.TigonCrossEntropyLoss(ignore_index=ignore_index, return_predicted_tokens=True)(x_in, target)
    loss, _, _, predicted = ce_fields(result)
    assert predicted.shape == (B * T,) and predicted.dtype == torch.int64
    keep = target != ignore_index
    assert torch.equal(predicted[keep], expected[keep])
    assert torch.all(predicted[~keep] == -1)
    loss.backward()
    assert x_in.grad is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_correctness_true_class_grad_confident_predictions(ext, dtype, label_smoothing, reduction):
    """The true class's gradient (softmax - (1 - smoothing)) / N of confident predictions is a small
    difference of large terms: it must be no less accurate than PyTorch's own low-precision backward,
    against an fp32 backward of the same low-precision logits."""
    torch.manual_seed(0)
    B, T, V = 2, 64, 4096
    logits = torch.randn(B * T, V, device=DEVICE, dtype=torch.float32)
    target = torch.randint(0, V, (B * T,), device=DEVICE, dtype=torch.long)
    rows = torch.arange(B * T, device=DEVICE)
    logits[rows, target] = logits.max(dim=-1).values + 10.0
    x = logits.to(dtype)
    x_torch = x.detach().clone().requires_grad_(True)
    x_tigon = x.detach().clone().requires_grad_(True)
    x_ref = x.detach().clone().float().requires_grad_(True)

    CrossEntropyLoss(reduction=reduction, label_smoothing=label_smoothing)(x_torch, target).backward()
    tt.TigonCrossEntropyLoss(reduction=reduction, label_smoothing=label_smoothing)(x_tigon, target).backward()
    CrossEntropyLoss(reduction=reduction, label_smoothing=label_smoothing)(x_ref, target).backward()

    ref = x_ref.grad[rows, target].double()
    torch_err = (x_torch.grad[rows, target].double() - ref).abs().max().item()
    tigon_err = (x_tigon.grad[rows, target].double() - ref).abs().max().item()
    assert tigon_err <= max(4 * torch_err, torch.finfo(dtype).tiny), (
        f"true-class gradient error {tigon_err:.3e} exceeds 4x PyTorch's {torch_err:.3e}")

"""Cases Liger-Kernel users have hit, against PyTorch / Hugging Face references, with Liger's tolerances:

- bf16 / fp16 autocast around the fused linear cross-entropy with fp32 (or other-dtype) LM-head
  weights, also a frozen head (Liger issues #305, #501, #603);
- reduction="none" backward with a per-token upstream gradient, for cross-entropy (in place or not)
  and fused linear cross-entropy (#678, #968);
- gradient accumulation with Hugging Face's num_items_in_batch: micro-batch losses summed and divided
  by the tokens of the whole accumulated batch, as ForCausalLMLoss does (#802);
- batches whose every target is ignore_index: loss 0, gradients 0, no NaN, with any reduction;
- LayerNorm in bf16 on inputs whose mean is far from 0 (x = 100 + randn), against fp64;
- z-loss with class weights and reduction="mean": the cross-entropy part over the sum of the
  non-ignored targets' weights, the z-loss part over the number of non-ignored tokens;
- out-of-range targets (negative, or >= the vocabulary) raise in eager mode, naming the value, the
  vocabulary size and ignore_index, before anything is written.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE
from liger_helpers import assert_close, assign_ignore_index, ce_fields, ce_with_z_loss, names_number

import tigon_torch as tt

pytestmark = pytest.mark.gpu

CE_TOLS = {torch.float32: (1e-8, 1e-6), torch.bfloat16: (1e-8, 5e-2)}  # Liger's cross-entropy tests
FLCE_TOLS = {torch.float32: (1e-5, 5e-4), torch.bfloat16: (5e-3, 5e-2)}  # Liger's FLCE tests, "mean"


# ------------------------------------------------------------------------------------------------
# Autocast around the fused linear cross-entropy
# ------------------------------------------------------------------------------------------------


@pytest.mark.cuda_only
@pytest.mark.parametrize("x_dtype, w_dtype, cast_dtype", [
    (torch.bfloat16, torch.float32, torch.bfloat16),  # bf16 activations, fp32 master weights (#305, #501)
    (torch.float32, torch.float32, torch.bfloat16),
    (torch.float16, torch.float32, torch.float16),
    (torch.float16, torch.bfloat16, torch.float16),  # two half types (#603)
])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("frozen_head", [False, True])
def test_flce_autocast_mixed_dtypes(ext, seed, x_dtype, w_dtype, cast_dtype, bias, frozen_head):
    BT, H, V = 1024, 1024, 4096
    w = torch.rand(V, H, device=DEVICE, dtype=w_dtype) * 0.1
    b = torch.rand(V, device=DEVICE, dtype=w_dtype) if bias else None
    x = torch.randn(BT, H, device=DEVICE, dtype=x_dtype)
    target = assign_ignore_index(torch.randint(0, V, (BT,), device=DEVICE), -100)

    def leaves():
        wl = w.clone().requires_grad_(not frozen_head)
        bl = b.clone().requires_grad_(not frozen_head) if bias else None
        return x.clone().requires_grad_(True), wl, bl

    (x1, w1, b1), (x2, w2, b2) = leaves(), leaves()
    with torch.autocast(device_type="cuda", dtype=cast_dtype):
        ref = F.cross_entropy(F.linear(x1, w1, b1).float(), target)
        out = tt.TigonFusedLinearCrossEntropyLoss()(w2, x2, target, b2)
    assert out.dtype == torch.float32
    atol, rtol = 5e-3, 5e-2  # Liger's test_amp
    assert_close(out, ref, atol, rtol, "loss")
    ref.backward()
    out.backward()
    assert x2.grad.dtype == x_dtype
    assert_close(x2.grad, x1.grad, atol, rtol, "dx")
    if frozen_head:
        assert w2.grad is None
    else:
        assert w2.grad.dtype == w_dtype
        assert_close(w2.grad, w1.grad, atol, rtol, "dW")
        if bias:
            assert_close(b2.grad, b1.grad, atol, rtol, "dB")


def test_flce_weight_cast_by_autocast_accumulates_in_float32():
    """A weight that autocast casts for the GEMMs (bfloat16 under float16, #603) has its gradients
    accumulated in float32, the one dtype besides the GEMMs' own that the operator adds into; a weight
    already in the GEMMs' dtype keeps its own. The operator's check (also the fake kernel's) refuses
    a bfloat16 dW beside float16 inputs."""
    from tigon_torch import ops
    from tigon_torch.functions import _head_grad_dtype

    assert _head_grad_dtype(torch.bfloat16, None, torch.float16) == torch.float32
    assert _head_grad_dtype(torch.bfloat16, None, torch.bfloat16) == torch.bfloat16
    assert _head_grad_dtype(torch.float32, None, torch.bfloat16) == torch.float32
    assert _head_grad_dtype(torch.float16, None, torch.float16) == torch.float32
    checks = ops._fake_checks()
    x = torch.empty(4, 8, dtype=torch.float16)
    w32, w16 = torch.empty(16, 8), torch.empty(16, 8, dtype=torch.bfloat16)
    checks["linear_cross_entropy"](x, None, None, None, None, None, None, w32, None)
    with pytest.raises(TypeError, match="float32 or x's dtype"):
        checks["linear_cross_entropy"](x, None, None, None, None, None, None, w16, None)
    with pytest.raises(TypeError, match="share one dtype"):
        checks["linear_logprob_bwd"](x, None, None, None, None, None, None, None, None, w32,
                                     torch.empty(16, dtype=torch.float16))
    with pytest.raises(TypeError, match="float32 or x's dtype"):
        checks["linear_cross_entropy_heads"](x, [], [], None, None, None, None, None, [w16], [])


# ------------------------------------------------------------------------------------------------
# reduction="none" with a per-token upstream gradient
# ------------------------------------------------------------------------------------------------

CE_OPTIONS = [
    pytest.param({}, id="plain"),
    pytest.param(dict(weight=True, ignore_index=-100, label_smoothing=0.1, lse_square_scale=1e-4, softcap=30.0),
                 id="all-options"),
]


def _per_token_grad(n):
    """rand + 0.5, with a zero for every fourth token."""
    g = torch.rand(n, device=DEVICE) + 0.5
    g[::4] = 0.0
    return g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("options", CE_OPTIONS)
def test_ce_reduction_none_per_token_grad_output(ext, seed, dtype, in_place, options):
    BT, V = 1024, 32000
    options = dict(options)
    weight = torch.rand(V, device=DEVICE) if options.pop("weight", False) else None
    softcap = options.pop("softcap", None)
    ignore_index = options.get("ignore_index", -100)
    x = torch.randn(BT, V, device=DEVICE, dtype=dtype)
    target = torch.randint(0, V, (BT,), device=DEVICE)
    if options:
        assign_ignore_index(target, ignore_index)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)

    logits = softcap * torch.tanh(x1.float() / softcap) if softcap else x1
    ref, _ = ce_with_z_loss(logits, target, weight=weight, reduction="none", dtype=dtype, **options)
    out, _, _, _ = tt.TigonCrossEntropyFunction.apply(
        x2, target, weight, ignore_index, options.get("lse_square_scale", 0.0), options.get("label_smoothing", 0.0),
        "none", softcap, False, False, False, in_place)
    atol, rtol = CE_TOLS[dtype]
    assert_close(out, ref, atol, rtol, "per-token loss")
    grad = _per_token_grad(BT).to(out.dtype)
    ref.backward(grad)
    out.backward(grad.clone())
    assert_close(x2.grad, x1.grad, atol, rtol, "dlogits")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("options", CE_OPTIONS)
def test_flce_reduction_none_per_token_grad_output(ext, seed, dtype, bias, options):
    BT, H, V = 1024, 512, 4096
    options = dict(options)
    ce_weight = torch.rand(V, device=DEVICE) if options.pop("weight", False) else None
    softcap = options.pop("softcap", None)
    ignore_index = options.get("ignore_index", -100)
    x = torch.randn(BT, H, device=DEVICE, dtype=dtype) * 0.1
    w = torch.randn(V, H, device=DEVICE, dtype=dtype) * 0.1
    b = torch.randn(V, device=DEVICE, dtype=dtype) * 0.1 if bias else None
    target = torch.randint(0, V, (BT,), device=DEVICE)
    if options:
        assign_ignore_index(target, ignore_index)

    def leaves():
        return (x.clone().requires_grad_(True), w.clone().requires_grad_(True),
                b.clone().requires_grad_(True) if bias else None)

    (x1, w1, b1), (x2, w2, b2) = leaves(), leaves()
    logits = F.linear(x1, w1, b1).float()
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    ref, _ = ce_with_z_loss(logits, target, weight=ce_weight, reduction="none", **options)
    out, _, _, _ = tt.TigonFusedLinearCrossEntropyFunction.apply(
        x2, w2, target, b2, ce_weight, ignore_index, options.get("lse_square_scale", 0.0),
        options.get("label_smoothing", 0.0), "none", softcap, False, None, False, False, False)
    atol, rtol = (1e-4, 1e-4) if dtype == torch.float32 else FLCE_TOLS[dtype]  # Liger's per-token test (fp32)
    assert_close(out, ref, atol, rtol, "per-token loss")
    grad = _per_token_grad(BT)
    ref.backward(grad)
    out.backward(grad.clone())
    assert_close(x2.grad, x1.grad, atol, rtol, "dx")
    assert_close(w2.grad, w1.grad, atol, rtol, "dW")
    if bias:
        assert_close(b2.grad, b1.grad, atol, rtol, "dB")


# ------------------------------------------------------------------------------------------------
# Gradient accumulation with num_items_in_batch
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("api", ["causal_lm_loss", "flce_sum", "ce_sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_accumulation_num_items_in_batch(ext, seed, api, dtype):
    """Two micro-batches with different numbers of label tokens. Each micro-batch's loss is its summed
    token loss over num_items_in_batch (the label tokens of both), as Hugging Face's ForCausalLMLoss
    computes it; the accumulated gradients then equal those of the mean loss over the whole batch."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    B, T, H, V = 2, 128, 256, 2048
    w = torch.randn(V, H, device=DEVICE, dtype=dtype) * 0.05
    hidden = [torch.randn(B, T, H, device=DEVICE, dtype=dtype) for _ in range(2)]
    labels = [torch.randint(0, V, (B, T), device=DEVICE) for _ in range(2)]
    labels[0][:, :10] = -100  # prompt tokens
    labels[1][0, T // 2:] = -100  # padding
    num_items = sum(int((lab[..., 1:] != -100).sum()) for lab in labels)
    num_items_t = torch.tensor(num_items, device=DEVICE)

    w_ref = w.clone().requires_grad_(True)
    h_ref = [h.clone().requires_grad_(True) for h in hidden]
    total_ref = 0.0
    for h, lab in zip(h_ref, labels):
        loss = ForCausalLMLoss(F.linear(h, w_ref), lab, V, num_items_in_batch=num_items_t)
        loss.backward()
        total_ref = total_ref + loss.detach()

    w2 = w.clone().requires_grad_(True)
    h2 = [h.clone().requires_grad_(True) for h in hidden]
    total = 0.0
    for h, lab in zip(h2, labels):
        shift = F.pad(lab, (0, 1), value=-100)[..., 1:].reshape(-1)
        if api == "causal_lm_loss":
            loss = tt.tigon_causal_lm_loss(hidden_states=h, lm_head_weight=w2, labels=lab,
                                           num_items_in_batch=num_items_t)
        elif api == "flce_sum":
            loss = tt.tigon_fused_linear_cross_entropy(h.reshape(-1, H), w2, shift, reduction="sum") / num_items
        else:
            logits = F.linear(h, w2).reshape(-1, V)
            loss = tt.tigon_cross_entropy(logits.float(), shift, reduction="sum") / num_items
        loss.backward()
        total = total + loss.detach()

    atol, rtol = FLCE_TOLS[dtype]
    assert_close(total, total_ref, atol, rtol, "accumulated loss")
    # the accumulated loss is the mean over the whole batch
    all_logits = torch.cat([F.linear(h.detach(), w).float() for h in hidden]).reshape(-1, V)
    all_shift = torch.cat([F.pad(lab, (0, 1), value=-100)[..., 1:] for lab in labels]).reshape(-1)
    assert_close(total, F.cross_entropy(all_logits, all_shift), atol, rtol, "accumulated vs whole-batch mean")
    assert_close(w2.grad, w_ref.grad, atol, rtol, "accumulated dW")
    for i, (a, r) in enumerate(zip(h2, h_ref)):
        assert_close(a.grad, r.grad, atol, rtol, f"micro-batch {i} dx")


# ------------------------------------------------------------------------------------------------
# Every target ignored
# ------------------------------------------------------------------------------------------------

ALL_IGNORED_OPTIONS = [
    pytest.param({}, id="plain"),
    pytest.param(dict(weight=True, label_smoothing=0.1, lse_square_scale=1e-4, softcap=30.0), id="all-options"),
]


def _assert_zero(t, what):
    assert t is not None, f"{what}: None"
    assert torch.isfinite(t).all(), f"{what}: not finite"
    assert torch.count_nonzero(t) == 0, f"{what}: {torch.count_nonzero(t)} nonzero entries"


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("options", ALL_IGNORED_OPTIONS)
def test_ce_all_ignored(ext, seed, reduction, dtype, options):
    BT, V, ignore_index = 64, 1000, -100
    options = dict(options)
    weight = torch.rand(V, device=DEVICE) if options.pop("weight", False) else None
    x = torch.randn(BT, V, device=DEVICE, dtype=dtype, requires_grad=True)
    target = torch.full((BT,), ignore_index, device=DEVICE, dtype=torch.long)
    result = tt.TigonCrossEntropyLoss(weight=weight, ignore_index=ignore_index, reduction=reduction,
                                      return_z_loss=True, **options)(x, target)
    loss, z_loss, _, _ = ce_fields(result)
    _assert_zero(loss, "loss")
    _assert_zero(z_loss, "z_loss")
    (loss.sum() if reduction == "none" else loss).backward()
    _assert_zero(x.grad, "dlogits")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("options", ALL_IGNORED_OPTIONS)
def test_flce_all_ignored(ext, seed, reduction, dtype, options):
    BT, H, V, ignore_index = 64, 128, 1000, -100
    options = dict(options)
    ce_weight = torch.rand(V, device=DEVICE) if options.pop("weight", False) else None
    x = torch.randn(BT, H, device=DEVICE, dtype=dtype, requires_grad=True)
    w = torch.randn(V, H, device=DEVICE, dtype=dtype, requires_grad=True)
    b = torch.randn(V, device=DEVICE, dtype=dtype, requires_grad=True)
    target = torch.full((BT,), ignore_index, device=DEVICE, dtype=torch.long)
    result = tt.TigonFusedLinearCrossEntropyLoss(ce_weight=ce_weight, ignore_index=ignore_index, reduction=reduction,
                                                 return_z_loss=True, **options)(w, x, target, b)
    loss, z_loss, _, _ = ce_fields(result)
    _assert_zero(loss, "loss")
    _assert_zero(z_loss, "z_loss")
    (loss.sum() if reduction == "none" else loss).backward()
    _assert_zero(x.grad, "dx")
    _assert_zero(w.grad, "dW")
    _assert_zero(b.grad, "dB")


# ------------------------------------------------------------------------------------------------
# LayerNorm bf16 with a large mean
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(8, 512, 1024), (2, 2048, 4096), (3, 7, 256)])
@pytest.mark.parametrize("mean", [100.0, -30.0])
def test_layer_norm_bf16_large_mean(ext, seed, shape, mean):
    """bf16 x = mean + randn: dW = sum over rows of dy * (x - mean_row) * rstd must keep Liger's bf16
    tolerance against the fp64 result on the same bf16 inputs (a variance from E[x^2] - E[x]^2, or dW
    accumulated in bf16, does not)."""
    hidden = shape[-1]
    dtype = torch.bfloat16
    x = (mean + torch.randn(shape, device=DEVICE)).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    b = (0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    dy = torch.randn(shape, device=DEVICE).to(dtype)

    x64, w64, b64 = (t.double().requires_grad_(True) for t in (x, w, b))
    y64 = F.layer_norm(x64, (hidden,), w64, b64, eps=1e-6)
    y64.backward(dy.double())

    x1, w1, b1 = (t.clone().requires_grad_(True) for t in (x, w, b))
    y = tt.TigonLayerNormFunction.apply(x1, w1, b1, 1e-6)
    y.backward(dy)
    atol, rtol = 2e-2, 2e-2  # Liger's bf16 layer-norm tolerance
    assert_close(y, y64, atol, rtol, "y")
    assert_close(x1.grad, x64.grad, atol, rtol, "dx")
    assert_close(w1.grad, w64.grad, atol, rtol, "dW")
    assert_close(b1.grad, b64.grad, atol, rtol, "dB")


# ------------------------------------------------------------------------------------------------
# z-loss with class weights
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_ce_z_loss_with_class_weights_mean(ext, seed, dtype, label_smoothing):
    BT, V, scale = 1024, 32000, 1e-4
    weight = torch.rand(V, device=DEVICE)
    x = torch.randn(BT, V, device=DEVICE, dtype=dtype)
    target = assign_ignore_index(torch.randint(0, V, (BT,), device=DEVICE), -100)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)

    ref, z_ref = ce_with_z_loss(x1, target, weight=weight, lse_square_scale=scale, reduction="mean",
                                label_smoothing=label_smoothing, dtype=dtype)
    result = tt.TigonCrossEntropyLoss(weight=weight, lse_square_scale=scale, label_smoothing=label_smoothing,
                                      reduction="mean", return_z_loss=True)(x2, target)
    out, z, _, _ = ce_fields(result)
    atol, rtol = CE_TOLS[dtype]
    valid = target != -100
    lse = torch.logsumexp(x.float(), -1)
    z_unweighted = scale * (lse[valid] ** 2).sum() / valid.sum()
    assert_close(z.float(), z_unweighted.to(dtype).float(), atol, rtol, "z_loss: mean over tokens, unweighted")
    assert_close(out, ref, atol, rtol, "loss")
    ref.backward()
    out.backward()
    assert_close(x2.grad, x1.grad, atol, rtol, "dlogits")


# ------------------------------------------------------------------------------------------------
# Out-of-range targets
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("api", ["ce", "ce_in_place", "flce"])
@pytest.mark.parametrize("bad", ["negative", "vocab"])
def test_out_of_range_target_raises(ext, seed, api, bad):
    BT, H, V, ignore_index = 64, 32, 1000, -100
    bad_value = -1 if bad == "negative" else V
    target = torch.randint(0, V, (BT,), device=DEVICE)
    target[:5] = ignore_index
    target[17] = bad_value
    if api == "flce":
        x = torch.randn(BT, H, device=DEVICE, dtype=torch.bfloat16)
        w = torch.randn(V, H, device=DEVICE, dtype=torch.bfloat16)
        x_in, w_in = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        call = lambda: tt.TigonFusedLinearCrossEntropyFunction.apply(  # noqa: E731
            x_in, w_in, target, None, None, ignore_index, 0.0, 0.0, "mean", None, False, None, False, False, False)
    else:
        x = torch.randn(BT, V, device=DEVICE, dtype=torch.bfloat16)
        x_in = x.clone().requires_grad_(True)
        call = lambda: tt.TigonCrossEntropyFunction.apply(  # noqa: E731
            x_in, target, None, ignore_index, 0.0, 0.0, "mean", None, False, False, False, api == "ce_in_place")
    with pytest.raises(Exception) as info:
        call()
    message = str(info.value)
    assert names_number(message, bad_value), f"the message does not name the target {bad_value}: {message!r}"
    assert names_number(message, V) and names_number(message, ignore_index), (
        f"the message should name the vocabulary size {V} and ignore_index {ignore_index}: {message!r}")
    assert torch.equal(x_in.detach(), x) and x_in.grad is None, "nothing may be written before the check"

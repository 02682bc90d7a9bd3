"""Functional API: one call per op, over the autograd functions of tigon_torch.functions."""

from __future__ import annotations

import torch

from . import ops as _ops
from .functions import (
    TigonCrossEntropyFP32Function,
    TigonCrossEntropyFunction,
    TigonFusedAddRMSNormFunction,
    TigonFusedGateUpMulFunction,
    TigonFusedLinearCrossEntropyFunction,
    TigonGatedMLPFunction,
    TigonGELUMulFunction,
    TigonLayerNormFunction,
    TigonRMSNormFunction,
    TigonRopeFunction,
    TigonSiLUMulFunction,
)


def _local(weight):
    """A weight sharded as a DTensor (FSDP2, tensor parallel) gathered inside the caller's forward, so
    the gradient flows back through the redistribution."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return weight
    if isinstance(weight, DTensor):
        return weight.full_tensor()
    return weight


def tigon_rms_norm(x, weight, eps=1e-6, offset=0.0, casting_mode="llama", in_place=True):
    return TigonRMSNormFunction.apply(x, _local(weight), eps, offset, casting_mode, in_place, None)


def tigon_layer_norm(x, weight, bias, eps=1e-5):
    return TigonLayerNormFunction.apply(x, _local(weight), _local(bias), eps)


def tigon_fused_add_rms_norm(x, residual, weight, eps=1e-6, offset=0.0, casting_mode="llama", in_place=False):
    """(norm(x + residual), x + residual)."""
    return TigonFusedAddRMSNormFunction.apply(x, residual, _local(weight), eps, offset, casting_mode, in_place)


def tigon_rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    return TigonRopeFunction.apply(q, k, cos, sin, position_ids, unsqueeze_dim)


def tigon_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """Drop-in for Hugging Face's apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1), same signature
    (the patches install it). CUDA tensors go through tigon; anything else through the same math in
    PyTorch."""
    if not _ops.on_device(q):
        return _reference_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
    return TigonRopeFunction.apply(q, k, cos, sin, None, unsqueeze_dim)


def _reference_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rd = cos.shape[-1]

    def rot(x):
        x_rot, x_pass = x[..., :rd], x[..., rd:]
        h = x_rot.shape[-1] // 2
        rotated = torch.cat((-x_rot[..., h:], x_rot[..., :h]), dim=-1)
        return torch.cat(((x_rot * cos) + (rotated * sin), x_pass), dim=-1)

    return rot(q), rot(k)


def tigon_swiglu(a, b, gate_multiplier=1.0, down_multiplier=1.0):
    return TigonSiLUMulFunction.apply(a, b, gate_multiplier, down_multiplier)


def tigon_geglu(a, b):
    return TigonGELUMulFunction.apply(a, b)


def tigon_fused_gate_up(gate_up, activation="silu"):
    return TigonFusedGateUpMulFunction.apply(gate_up, activation)


def tigon_gated_mlp(x, w_gate, w_up, w_down, activation="silu"):
    """act(x @ w_gate.T) * (x @ w_up.T) @ w_down.T, keeping neither the gated product nor any other
    N x I tensor beyond the two projections for the backward (see TigonGatedMLPFunction)."""
    return TigonGatedMLPFunction.apply(x, _local(w_gate), _local(w_up), _local(w_down), activation)


def _plain_linear(m, x) -> bool:
    """m is an nn.Linear without bias whose forward is nothing but x @ weight.T: no hooks, no forward
    replaced on the instance (Accelerate's offload hooks), a plain weight (not a quantised or
    distributed tensor subclass) on x's device. PEFT adapters and FSDP1 wrappers are other types."""
    w = getattr(m, "weight", None)
    return (type(m) is torch.nn.Linear and m.bias is None and not m._forward_hooks and not m._forward_pre_hooks
            and not m._backward_hooks and not getattr(m, "_backward_pre_hooks", None)
            and "forward" not in m.__dict__ and not hasattr(m, "_hf_hook")
            and type(w) in (torch.nn.Parameter, torch.Tensor) and w.device == x.device)


def gated_mlp_fusable(mlp, x) -> bool:
    """Whether the module's gate_proj / up_proj / down_proj can go through tigon_gated_mlp with x: three
    plain bias-free nn.Linear (see _plain_linear), weights of x's dtype, no autocast, no global module
    hooks, x on a CUDA device. Otherwise a caller keeps the module's own projections (and may still fuse
    the activation)."""
    from torch.nn.modules import module as _m

    if not _ops.on_device(x):
        return False
    projs = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(p is not None and _plain_linear(p, x) for p in projs):
        return False
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or any(p.weight.dtype != x.dtype for p in projs):
        return False
    if torch.is_autocast_enabled(x.device.type):
        return False
    return not (_m._global_forward_hooks or _m._global_forward_pre_hooks or _m._global_backward_hooks
                or getattr(_m, "_global_backward_pre_hooks", None))


def tigon_cross_entropy(
    input,
    target,
    weight=None,
    ignore_index=-100,
    lse_square_scale=0.0,
    label_smoothing=0.0,
    reduction="mean",
    softcap=None,
    return_z_loss=False,
    return_token_accuracy=False,
    return_predicted_tokens=False,
    in_place=False,
):
    """The loss, or (loss, z_loss, token_accuracy, predicted_tokens) when any return_* flag is set.
    in_place=True: the gradient is written over input in the forward (see TigonCrossEntropyFunction);
    ignored when grad mode is off."""
    out = TigonCrossEntropyFunction.apply(
        input, target, weight, ignore_index, lse_square_scale, label_smoothing, reduction, softcap,
        return_z_loss, return_token_accuracy, return_predicted_tokens, bool(in_place) and torch.is_grad_enabled())
    if return_z_loss or return_token_accuracy or return_predicted_tokens:
        return out
    return out[0]


def tigon_fused_linear_cross_entropy(
    input,
    weight,
    target,
    bias=None,
    ce_weight=None,
    ignore_index=-100,
    lse_square_scale=0.0,
    label_smoothing=0.0,
    reduction="mean",
    softcap=None,
    return_z_loss=False,
    accum_dtype=None,
    use_token_scaling=False,
    return_token_accuracy=False,
    return_predicted_tokens=False,
):
    """The loss, or (loss, z_loss, token_accuracy, predicted_tokens) when any return_* flag is set."""
    out = TigonFusedLinearCrossEntropyFunction.apply(
        input, _local(weight), target, _local(bias), ce_weight, ignore_index, lse_square_scale, label_smoothing,
        reduction, softcap, return_z_loss, accum_dtype, use_token_scaling, return_token_accuracy,
        return_predicted_tokens)
    if return_z_loss or return_token_accuracy or return_predicted_tokens:
        return out
    return out[0]


def tigon_causal_lm_loss(
    hidden_states,
    lm_head_weight,
    labels=None,
    lm_head_bias=None,
    shift_labels=None,
    num_items_in_batch=None,
    ignore_index=-100,
    final_logit_softcapping=None,
):
    """Hugging Face's causal-LM loss (ForCausalLMLoss: labels shifted left by one, ignore_index -100,
    mean over the non-ignored tokens, or the sum divided by num_items_in_batch when given) computed
    from the last hidden states and the LM head without materialising the logits."""
    if shift_labels is None:
        if labels is None:
            raise ValueError("tigon_causal_lm_loss needs labels or shift_labels")
        labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    target = shift_labels.reshape(-1).to(hidden.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = tigon_fused_linear_cross_entropy(
        hidden, lm_head_weight, target, bias=lm_head_bias, ignore_index=ignore_index, reduction=reduction,
        softcap=final_logit_softcapping)
    if reduction == "sum":
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def tigon_causal_lm_loss_from_logits(logits, labels=None, vocab_size=None, num_items_in_batch=None,
                                     ignore_index=-100, shift_labels=None, **kwargs):
    """ForCausalLMLoss on materialised logits with tigon's cross-entropy (the patches' cross_entropy=True)."""
    if shift_labels is None:
        labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    vocab_size = vocab_size or logits.shape[-1]
    logits = logits.reshape(-1, vocab_size)
    target = shift_labels.reshape(-1).to(logits.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = TigonCrossEntropyFP32Function.apply(logits, target, None, ignore_index, 0.0, 0.0, reduction, None,
                                               False, False, False)[0]
    if reduction == "sum":
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss

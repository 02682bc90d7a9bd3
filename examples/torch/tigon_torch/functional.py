"""Functional API: one call per op, over the autograd functions of tigon_torch.functions. The calls
named after Liger-Kernel's (liger_X -> tigon_X) take Liger's parameters, in its order, with its
defaults, and return what it returns; a tigon-only parameter comes after them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import ops as _ops
from .functions import (
    TigonFusedGateUpMulFunction,
    TigonFusedLinearJSDFunction,
    TigonGatedMLPFunction,
    TigonInterleavedRopeFunction,
    TigonJSDFunction,
    TigonKLDivLossFunction,
    TigonLlama4RopeFunction,
    TigonQwen2VLMRopeFunction,
    TigonReLUSquaredFunction,
    TigonRopeFunction,
    TigonTVDLossFunction,
)
from .functions import add_rms_norm as _add_rms_norm
from .functions import cross_entropy as _cross_entropy
from .functions import gated as _gated
from .functions import layer_norm as _layer_norm
from .functions import linear_cross_entropy as _linear_cross_entropy
from .functions import rms_norm as _rms_norm


def _local(weight):
    """A weight sharded as a DTensor (FSDP2, tensor parallel) gathered inside the caller's forward, so
    the gradient flows back through the redistribution."""
    if weight is None or type(weight) is torch.Tensor or type(weight) is torch.nn.Parameter:
        return weight  # the usual case, before the import below (a per-call cost)
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return weight
    if isinstance(weight, DTensor):
        return weight.full_tensor()
    return weight


@dataclass
class CrossEntropyOutput:
    """What the cross-entropy calls return when a return_* flag is set: Liger's CrossEntropyOutput
    (these fields, in this order). It also unpacks and indexes as the tuple (loss, z_loss,
    token_accuracy, predicted_tokens)."""

    loss: torch.Tensor
    z_loss: torch.Tensor | None = None
    token_accuracy: torch.Tensor | None = None
    predicted_tokens: torch.Tensor | None = None

    def __iter__(self):
        return iter((self.loss, self.z_loss, self.token_accuracy, self.predicted_tokens))

    def __getitem__(self, index):
        return tuple(self)[index]

    def __len__(self):
        return 4


def _loss_result(out, return_z_loss, return_token_accuracy, return_predicted_tokens):
    """Liger's return convention: the loss alone, or a CrossEntropyOutput when any return_* flag is set."""
    loss, z_loss, token_accuracy, predicted_tokens = out
    if not (return_z_loss or return_token_accuracy or return_predicted_tokens):
        return loss
    return CrossEntropyOutput(loss=loss, z_loss=z_loss, token_accuracy=token_accuracy,
                              predicted_tokens=predicted_tokens)


# Liger's liger_rms_norm, liger_layer_norm and liger_fused_add_rms_norm take eps without a default; the
# defaults here (Llama's 1e-6, torch's 1e-5 for LayerNorm) only add calls that Liger rejects.
def tigon_rms_norm(X, W, eps=1e-6, offset=0.0, casting_mode="llama", in_place=False):
    """RMSNorm over the last dimension (TigonRMSNorm's call). in_place=True writes the backward's dX
    over dY, right only when dY is needed nowhere else; the default is False (Liger's is True)."""
    return _rms_norm(X, _local(W), eps, offset, casting_mode, in_place)


def tigon_layer_norm(X, W, B, eps=1e-5):
    return _layer_norm(X, _local(W), _local(B), eps)


def tigon_fused_add_rms_norm(X, R, W, eps=1e-6, offset=0.0, casting_mode="llama", in_place=False):
    """(norm(X + R), X + R). in_place=True writes the backward's dX over dY, right only when dY is
    needed nowhere else; the default is False, as the module's and the autograd function's (Liger's
    functional default is True)."""
    return _add_rms_norm(X, R, _local(W), eps, offset, casting_mode, in_place)


def tigon_rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    return TigonRopeFunction.apply(q, k, cos, sin, position_ids, unsqueeze_dim)


def tigon_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Liger's liger_rotary_pos_emb: a drop-in for Hugging Face's apply_rotary_pos_emb(q, k, cos, sin,
    unsqueeze_dim=1), which the patches install (Hugging Face calls it with q, k, cos, sin; position_ids
    only indexes tables that are not already one row per position, as in TigonRopeFunction). CUDA
    tensors go through tigon; anything else through the same math in PyTorch."""
    if not _ops.on_device(q):
        return _reference_rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim)
    return TigonRopeFunction.apply(q, k, cos, sin, position_ids, unsqueeze_dim)


def tigon_interleaved_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Rotary embedding of interleaved pairs (x[2i], x[2i + 1]) (GPT-J, GLM-4, Llama 4's complex form),
    with tables whose entries repeat per pair (TigonInterleavedRopeFunction); the first cos.shape[-1]
    channels rotate, the rest pass through. CUDA tensors go through tigon; anything else through the
    same math in PyTorch (fp32, one rounding)."""
    if not _ops.on_device(q):
        return _reference_interleaved_rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim)
    return TigonInterleavedRopeFunction.apply(q, k, cos, sin, position_ids, unsqueeze_dim)


def _reference_interleaved_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    seq = q.shape[2] if unsqueeze_dim == 1 else q.shape[1]
    if position_ids is not None and cos.shape[-2] != seq:
        cos, sin = _gather_table(cos, position_ids), _gather_table(sin, position_ids)
    cos = cos.unsqueeze(unsqueeze_dim).float()
    sin = sin.unsqueeze(unsqueeze_dim).float()
    rd = cos.shape[-1]

    def rot(x):
        x_rot, x_pass = x[..., :rd].float(), x[..., rd:]
        rotated = torch.stack((-x_rot[..., 1::2], x_rot[..., 0::2]), dim=-1).flatten(-2)
        return torch.cat(((x_rot * cos + rotated * sin).to(x.dtype), x_pass), dim=-1)

    return rot(q), (rot(k) if k is not None else None)


def tigon_llama4_text_rotary_pos_emb(xq, xk, freqs_cis):
    """Liger's liger_llama4_text_rotary_pos_emb: a drop-in for Llama 4's apply_rotary_emb(xq, xk,
    freqs_cis) (TigonLlama4RopeFunction)."""
    return TigonLlama4RopeFunction.apply(xq, xk, freqs_cis)


def tigon_llama4_vision_rotary_pos_emb(query, key, freqs_ci):
    """Liger's liger_llama4_vision_rotary_pos_emb: Llama 4's vision_apply_rotary_emb(query, key,
    freqs_ci), one frequency row per position broadcast over the batch and the heads. A real freqs_ci
    (a complex buffer cast to a real dtype, its imaginary part lost) and tensors off the GPU are
    multiplied as Hugging Face does, in PyTorch."""
    if not freqs_ci.is_complex() or not _ops.on_device(query):
        q_ = torch.view_as_complex(query.float().reshape(*query.shape[:-1], -1, 2))
        k_ = torch.view_as_complex(key.float().reshape(*key.shape[:-1], -1, 2))
        shape = [d if i == 1 or i == q_.ndim - 1 else 1 for i, d in enumerate(q_.shape)]
        f = freqs_ci.view(*shape).to(q_.device)
        return (torch.view_as_real(q_ * f).flatten(3).type_as(query),
                torch.view_as_real(k_ * f).flatten(3).type_as(key))
    seq, half = query.shape[1], query.shape[-1] // 2
    return TigonLlama4RopeFunction.apply(query, key, freqs_ci.to(query.device).reshape(1, seq, half))


def tigon_qwen2vl_mrope(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """Liger's liger_qwen2vl_mrope: TigonQwen2VLMRopeFunction (M-RoPE, cos / sin [3, batch, seq,
    head_dim])."""
    return TigonQwen2VLMRopeFunction.apply(q, k, cos, sin, mrope_section, unsqueeze_dim)


def tigon_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """Liger's liger_multimodal_rotary_pos_emb: a drop-in for Hugging Face's
    apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section, unsqueeze_dim=1) (Qwen2-VL,
    Qwen2.5-VL). CUDA tensors go through tigon; anything else through the same math in PyTorch."""
    if not _ops.on_device(q):
        return _reference_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section, unsqueeze_dim)
    return TigonQwen2VLMRopeFunction.apply(q, k, cos, sin, mrope_section, unsqueeze_dim)


def _reference_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    if cos.dim() == 3:  # already composed
        return _reference_rotary_pos_emb(q, k, cos, sin, None, unsqueeze_dim)
    sec = list(mrope_section) * 2  # the composed row: column block i from plane i mod 3
    cos = torch.cat([m[i % 3] for i, m in enumerate(cos.split(sec, dim=-1))], dim=-1)
    sin = torch.cat([m[i % 3] for i, m in enumerate(sin.split(sec, dim=-1))], dim=-1)
    return _reference_rotary_pos_emb(q, k, cos, sin, None, unsqueeze_dim)


def _gather_table(t, position_ids):
    """Rows of a [1 or batch, positions, dim] (or [positions, dim]) table at position_ids [batch, seq]."""
    if t.dim() == 2:
        t = t.unsqueeze(0)
    pos = position_ids.reshape(-1, position_ids.shape[-1])
    batch = max(t.shape[0], pos.shape[0])
    t, pos = t.expand(batch, -1, -1), pos.expand(batch, -1)
    return torch.gather(t, 1, pos.unsqueeze(-1).expand(-1, -1, t.shape[-1]))


def _reference_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    seq = q.shape[2] if unsqueeze_dim == 1 else q.shape[1]
    if position_ids is not None and cos.shape[-2] != seq:
        cos, sin = _gather_table(cos, position_ids), _gather_table(sin, position_ids)
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
    return _gated(a, b, "silu", gate_multiplier, down_multiplier)


def tigon_geglu(a, b):
    return _gated(a, b, "gelu_tanh")


def tigon_relu_squared(x):
    """relu(x)^2 (Nemotron's MLP activation), one kernel each way."""
    return TigonReLUSquaredFunction.apply(x)


def tigon_fused_gate_up(gate_up, activation="silu"):
    return TigonFusedGateUpMulFunction.apply(gate_up, activation)


def tigon_gated_mlp(x, w_gate, w_up, w_down, activation="silu"):
    """act(x @ w_gate.T) * (x @ w_up.T) @ w_down.T, keeping neither the gated product nor any other
    N x I tensor beyond the two projections for the backward (see TigonGatedMLPFunction)."""
    return TigonGatedMLPFunction.apply(x, _local(w_gate), _local(w_up), _local(w_down), activation)


def _hookless(m) -> bool:
    """No forward or backward hook on module m, and none of Accelerate's (_hf_hook): what its forward
    would run around the computation is nothing, so a fused op may read its weights directly."""
    return not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                or getattr(m, "_backward_pre_hooks", None) or hasattr(m, "_hf_hook"))


def _no_global_hooks() -> bool:
    """No module hook registered for every module (torch.nn.modules.module's global hooks)."""
    from torch.nn.modules import module as _m

    return not (_m._global_forward_hooks or _m._global_forward_pre_hooks or _m._global_backward_hooks
                or getattr(_m, "_global_backward_pre_hooks", None))


def _plain_linear(m, x) -> bool:
    """m is an nn.Linear without bias whose forward is nothing but x @ weight.T: no hooks, no forward
    replaced on the instance (Accelerate's offload hooks), a plain weight (not a quantised or
    distributed tensor subclass) on x's device. PEFT adapters and FSDP1 wrappers are other types."""
    w = getattr(m, "weight", None)
    return (type(m) is torch.nn.Linear and m.bias is None and _hookless(m) and "forward" not in m.__dict__
            and type(w) in (torch.nn.Parameter, torch.Tensor) and w.device == x.device)


def gated_mlp_fusable(mlp, x) -> bool:
    """Whether the module's gate_proj / up_proj / down_proj can go through tigon_gated_mlp with x: three
    plain bias-free nn.Linear (see _plain_linear), weights of x's dtype, no autocast, no global module
    hooks, x on a CUDA device. Otherwise a caller keeps the module's own projections (and may still fuse
    the activation)."""
    if not _ops.on_device(x):
        return False
    projs = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(p is not None and _plain_linear(p, x) for p in projs):
        return False
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or any(p.weight.dtype != x.dtype for p in projs):
        return False
    if torch.is_autocast_enabled(x.device.type):
        return False
    return _no_global_hooks()


def tigon_cross_entropy(
    input,
    target,
    weight=None,
    size_average=None,
    ignore_index=-100,
    reduce=None,
    reduction="mean",
    label_smoothing=0.0,
    lse_square_scale=0.0,
    softcap=None,
    return_z_loss=False,
    return_token_accuracy=False,
    return_predicted_tokens=False,
    *,
    in_place=False,
):
    """Liger's liger_cross_entropy (torch.nn.functional.cross_entropy's parameter order): the loss, or a
    CrossEntropyOutput when a return_* flag is set.

    size_average and reduce, torch's deprecated reduction switches (placeholders in Liger), are
    honoured as torch honours them: when either is not None, reduction is the one they select
    ("none" when reduce is False, else "mean" or "sum" by size_average), with torch's deprecation
    warning. in_place=True (tigon only): the gradient is written over input in the forward (see
    TigonCrossEntropyFunction); dropped when grad mode is off."""
    if size_average is not None or reduce is not None:
        from torch.nn import _reduction

        reduction = _reduction.legacy_get_string(size_average, reduce)
    out = _cross_entropy(
        input, target, weight, ignore_index, lse_square_scale, label_smoothing, reduction, softcap,
        return_z_loss, return_token_accuracy, return_predicted_tokens, bool(in_place) and torch.is_grad_enabled())
    return _loss_result(out, return_z_loss, return_token_accuracy, return_predicted_tokens)


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
    """Liger's liger_fused_linear_cross_entropy: the loss, or a CrossEntropyOutput when a return_* flag
    is set (see TigonFusedLinearCrossEntropyFunction)."""
    out = _linear_cross_entropy(
        input, _local(weight), target, _local(bias), ce_weight, ignore_index, lse_square_scale, label_smoothing,
        reduction, softcap, return_z_loss, accum_dtype, use_token_scaling, return_token_accuracy,
        return_predicted_tokens)
    return _loss_result(out, return_z_loss, return_token_accuracy, return_predicted_tokens)


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
    loss = _cross_entropy(logits, target, None, ignore_index, 0.0, 0.0, reduction, None, False, False, False,
                          fp32=True)[0]
    if reduction == "sum":
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


# ------------------------------------------------------------------------------------------------
# Distillation losses
# ------------------------------------------------------------------------------------------------


def tigon_jsd(input, target, shift_labels=None, beta: float = 0.5, ignore_index: int = -100):
    """Liger's liger_jsd: the generalised JSD of the student's log-probabilities `input` [BT, V] and the
    teacher's `target` [BT, V] (see TigonJSDFunction); the loss in input's dtype."""
    return TigonJSDFunction.apply(input, target, shift_labels, beta, ignore_index)


def tigon_kl_div(input, target, size_average: bool = True, reduce: bool = True, reduction: str = "mean",
                 log_target: bool = False, eps: float = 1e-10):
    """Liger's liger_kl_div: KL(target || input) as torch.nn.functional.kl_div computes it, with the
    student's log-probabilities `input` [BT, V] (see TigonKLDivLossFunction). The default reduction is
    "mean" here, as in torch and Liger's functional call (the module and the function default to
    "batchmean"). size_average and reduce are placeholders, as in Liger: `reduction` alone selects."""
    return TigonKLDivLossFunction.apply(input, target, reduction, log_target, eps)


def tigon_tvd(input, target, shift_labels=None, reduction: str = "mean", ignore_index: int = -100):
    """Liger's liger_tvd: the total variation distance between the probabilities `input` and `target`
    [BT, V] (see TigonTVDLossFunction); the default reduction is "mean" here, as in Liger's functional
    call (the module and the function default to "batchmean")."""
    return TigonTVDLossFunction.apply(input, target, shift_labels, reduction, ignore_index)


def tigon_fused_linear_jsd(student_input, student_weight, teacher_input, teacher_weight, shift_labels=None,
                           jsd_beta: float = 0.5, ignore_index: int = -100, temperature: float = 1.0,
                           accum_dtype=None):
    """Liger's liger_fused_linear_jsd: the generalised JSD of the student's and the teacher's LM heads
    without their [BT, V] logits (see TigonFusedLinearJSDFunction)."""
    return TigonFusedLinearJSDFunction.apply(student_input, _local(student_weight), teacher_input,
                                             _local(teacher_weight), shift_labels, jsd_beta, ignore_index,
                                             temperature, accum_dtype)


# Liger's chunked_loss.functional: the post-training losses on the fused LM head, each its function's apply
# (the arguments of Liger's function of the same name, positional as Liger's apply takes them).
from .preference import (  # noqa: E402  (after the functional calls above, which they do not use)
    TigonFusedLinearCPOFunction,
    TigonFusedLinearDPOFunction,
    TigonFusedLinearKTOFunction,
    TigonFusedLinearORPOFunction,
    TigonFusedLinearSimPOFunction,
)
from .rl import TigonFusedLinearGRPOFunction  # noqa: E402

tigon_fused_linear_orpo = TigonFusedLinearORPOFunction.apply
tigon_fused_linear_dpo = TigonFusedLinearDPOFunction.apply
tigon_fused_linear_cpo = TigonFusedLinearCPOFunction.apply
tigon_fused_linear_simpo = TigonFusedLinearSimPOFunction.apply
tigon_fused_linear_kto = TigonFusedLinearKTOFunction.apply
tigon_fused_linear_grpo = TigonFusedLinearGRPOFunction.apply

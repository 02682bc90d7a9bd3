"""nn.Module wrappers of the tigon functions, with the parameters (names and shapes) of the Hugging Face
modules they stand in for, so state dicts load unchanged. The modules named after Liger-Kernel's
(LigerX -> TigonX) take Liger's constructor arguments, in its order, with its defaults."""

from __future__ import annotations

import torch
from torch import nn

from . import functional as F
from .functional import _local
from . import ops as _ops
from .functions import gated as _gated
from .functions import layer_norm as _layer_norm
from .functions import rms_norm as _rms_norm
from .functions import (
    TigonJSDFunction,
    TigonKLDivLossFunction,
    TigonFusedLinearMultiHeadCrossEntropyFunction,
    TigonTVDLossFunction,
    _casting,
    _check_beta,
)


def _check_init_fn(init_fn) -> None:
    if init_fn not in ("ones", "zeros"):
        raise ValueError(f"init_fn must be 'ones' or 'zeros', got {init_fn!r}")


class TigonRMSNorm(nn.Module):
    """Liger's LigerRMSNorm: RMSNorm over the last dimension. offset=1.0 with casting_mode="gemma" and
    init_fn="zeros" is Gemma's RMSNorm; the defaults are Llama's. row_mode picks one of two Triton
    kernels of the same math in Liger: accepted and kept, with no effect on the result (tigon picks
    its kernel itself). elementwise_affine=False: no weight. in_place=True writes the backward's dX
    over dY (less memory), which is right only when dY is needed nowhere else: not where the norm's
    input also reaches the loss another way (x + norm(x)). The default is False (Liger's is True);
    the patches pass True where the model's graph allows it."""

    def __init__(self, hidden_size, eps=1e-6, offset=0.0, casting_mode="llama", init_fn="ones", in_place=False,
                 row_mode=None, elementwise_affine=True):
        super().__init__()
        _check_init_fn(init_fn)
        _casting(casting_mode)  # an unknown casting mode raises here, naming the argument
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            init = torch.ones if init_fn == "ones" else torch.zeros
            self.weight = nn.Parameter(init(hidden_size))
        else:
            self.register_parameter("weight", None)
        self.variance_epsilon = eps
        self.offset = offset
        self.casting_mode = casting_mode
        self.in_place = in_place
        self.row_mode = row_mode

    def forward(self, hidden_states):
        # row_mode selects nothing in tigon (see TigonRMSNormFunction).
        return _rms_norm(hidden_states, _local(self.weight), self.variance_epsilon, self.offset, self.casting_mode,
                         self.in_place)

    def extra_repr(self):
        shape = tuple(self.weight.shape) if self.weight is not None else None
        return (f"weight_shape={shape}, eps={self.variance_epsilon}, offset={self.offset}, "
                f"casting_mode={self.casting_mode}, in_place={self.in_place}, row_mode={self.row_mode}")


class TigonRMSNormForGemma(TigonRMSNorm):
    """Liger's LigerRMSNormForGemma: GemmaRMSNorm (offset 1, Gemma casting, zero-initialised weight)."""

    def __init__(self, hidden_size, eps=1e-6, offset=1.0, casting_mode="gemma", init_fn="zeros", in_place=False,
                 row_mode=None):
        super().__init__(hidden_size, eps, offset, casting_mode, init_fn, in_place, row_mode)


class TigonRMSNormForGemma2(TigonRMSNorm):
    """Liger's LigerRMSNormForGemma2: as TigonRMSNormForGemma, out of place (its output feeds a residual
    add, so dY is needed after the norm's backward)."""

    def __init__(self, hidden_size, eps=1e-6, offset=1.0, casting_mode="gemma", init_fn="zeros", in_place=False,
                 row_mode=None):
        super().__init__(hidden_size, eps, offset, casting_mode, init_fn, in_place, row_mode)


class TigonRMSNormForGemma3(TigonRMSNorm):
    """Liger's LigerRMSNormForGemma3: Gemma3RMSNorm, whose first argument is dim (the q / k norms')."""

    def __init__(self, dim, eps=0.000001, offset=1.0, casting_mode="gemma", init_fn="zeros", in_place=False):
        super().__init__(dim, eps, offset, casting_mode, init_fn, in_place)


class TigonLayerNorm(nn.Module):
    """Liger's LigerLayerNorm: LayerNorm over the last dimension, eps 1e-6. As in Liger the module always
    has a trainable bias: zeros when bias=False (the default), drawn from a standard normal when
    bias=True."""

    def __init__(self, hidden_size, eps=1e-6, bias=False, init_fn="ones"):
        super().__init__()
        _check_init_fn(init_fn)
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size) if init_fn == "ones" else torch.zeros(hidden_size))
        self.bias = nn.Parameter(torch.randn(hidden_size) if bias else torch.zeros(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        return _layer_norm(hidden_states, _local(self.weight), _local(self.bias), self.variance_epsilon)

    def extra_repr(self):
        return f"{self.hidden_size}, eps={self.eps}"


class TigonFusedAddRMSNorm(nn.Module):
    """Liger's LigerFusedAddRMSNorm: forward(hidden_states, residual) -> (norm(hidden_states + residual),
    hidden_states + residual)."""

    def __init__(self, hidden_size, eps=1e-6, offset=0.0, casting_mode="llama", init_fn="ones", in_place=False):
        super().__init__()
        _check_init_fn(init_fn)
        _casting(casting_mode)
        self.weight = nn.Parameter(torch.ones(hidden_size) if init_fn == "ones" else torch.zeros(hidden_size))
        self.variance_epsilon = eps
        self.offset = offset
        self.casting_mode = casting_mode
        self.in_place = in_place

    def forward(self, hidden_states, residual):
        return F.tigon_fused_add_rms_norm(hidden_states, residual, self.weight, self.variance_epsilon, self.offset,
                                          self.casting_mode, self.in_place)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, offset={self.offset}, in_place={self.in_place}"


def _check_silu(config) -> None:
    """Liger's check: a SwiGLU module computes silu, so another configured activation raises."""
    act = getattr(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"Activation function {act} not supported: config.hidden_act must be 'silu' or 'swish'")


def _gelu_kind(config) -> str:
    """The GeGLU activation a Gemma config asks for: exact GELU for "gelu", the tanh approximation
    (Gemma's gelu_pytorch_tanh, Liger's only one) otherwise."""
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if act is None or act in ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast"):
        return "gelu_tanh"
    if act == "gelu":
        return "gelu"
    raise ValueError(f"Activation function {act} not supported by TigonGEGLUMLP: the config's hidden_activation "
                     "must be a GELU ('gelu_pytorch_tanh', 'gelu_new', 'gelu_fast' or exact 'gelu')")


class TigonSwiGLUMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)) — LlamaMLP's parameters, SwiGLU through tigon; without
    biases (and hooks, autocast), the whole MLP through tigon_gated_mlp (the gated product recomputed in
    the backward, not kept)."""

    def __init__(self, config):
        super().__init__()
        _check_silu(config)
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        bias = getattr(config, "mlp_bias", False)
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=bias)

    def forward(self, x):
        if F.gated_mlp_fusable(self, x):
            return F.tigon_gated_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight, "silu")
        return self.down_proj(F.tigon_swiglu(self.gate_proj(x), self.up_proj(x)))


class TigonGEGLUMLP(nn.Module):
    """down_proj(gelu(gate_proj(x)) * up_proj(x)) — GemmaMLP's parameters, GeGLU through tigon (the
    whole MLP through tigon_gated_mlp when it can, as TigonSwiGLUMLP). The GELU is the tanh
    approximation, as in Liger, unless the config's hidden_activation is exact "gelu", which is then
    computed exactly (Liger computes the tanh form for it)."""

    def __init__(self, config):
        super().__init__()
        self.act_kind = _gelu_kind(config)
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)

    def forward(self, x):
        if F.gated_mlp_fusable(self, x):
            return F.tigon_gated_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight,
                                     self.act_kind)
        return self.down_proj(_gated(self.gate_proj(x), self.up_proj(x), self.act_kind))


class TigonPhi3SwiGLUMLP(nn.Module):
    """Liger's LigerPhi3SwiGLUMLP: down_proj(silu(gate) * up) over Phi-3's fused gate_up_proj, without
    splitting the projection."""

    def __init__(self, config):
        super().__init__()
        _check_silu(config)
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.tigon_fused_gate_up(self.gate_up_proj(x), "silu"))


TigonPhi3MLP = TigonPhi3SwiGLUMLP  # the earlier name


def _check_loss_args(label_smoothing, reduction, softcap) -> None:
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")


class TigonCrossEntropyLoss(nn.Module):
    """Liger's LigerCrossEntropyLoss: forward(_input, target) returns the loss, or a CrossEntropyOutput
    when a return_* flag is set. in_place (tigon only, keyword): see tigon_cross_entropy."""

    def __init__(self, weight=None, ignore_index=-100, lse_square_scale=0.0, label_smoothing=0.0, reduction="mean",
                 softcap=None, return_z_loss=False, return_token_accuracy=False, return_predicted_tokens=False, *,
                 in_place=False):
        super().__init__()
        _check_loss_args(label_smoothing, reduction, softcap)
        self.weight = weight
        self.ignore_index = ignore_index
        self.lse_square_scale = lse_square_scale
        self.label_smoothing = label_smoothing
        self.reduction = reduction
        self.softcap = softcap
        self.return_z_loss = return_z_loss
        self.return_token_accuracy = return_token_accuracy
        self.return_predicted_tokens = return_predicted_tokens
        self.in_place = in_place

    def forward(self, _input, target):
        return F.tigon_cross_entropy(
            _input, target, self.weight, ignore_index=self.ignore_index, reduction=self.reduction,
            label_smoothing=self.label_smoothing, lse_square_scale=self.lse_square_scale, softcap=self.softcap,
            return_z_loss=self.return_z_loss, return_token_accuracy=self.return_token_accuracy,
            return_predicted_tokens=self.return_predicted_tokens, in_place=self.in_place)


class TigonFusedLinearCrossEntropyLoss(nn.Module):
    """Liger's LigerFusedLinearCrossEntropyLoss: forward(lin_weight, _input, target, bias=None) returns
    the loss of _input @ lin_weight.T + bias against target without materialising the logits, or a
    CrossEntropyOutput when a return_* flag is set."""

    def __init__(self, ce_weight=None, ignore_index=-100, lse_square_scale=0.0, label_smoothing=0.0,
                 reduction="mean", softcap=None, return_z_loss=False, accum_dtype=None, use_token_scaling=False,
                 return_token_accuracy=False, return_predicted_tokens=False):
        super().__init__()
        _check_loss_args(label_smoothing, reduction, softcap)
        self.ce_weight = ce_weight
        self.ignore_index = ignore_index
        self.lse_square_scale = lse_square_scale
        self.label_smoothing = label_smoothing
        self.reduction = reduction
        self.softcap = softcap
        self.return_z_loss = return_z_loss
        self.accum_dtype = accum_dtype
        self.use_token_scaling = use_token_scaling
        self.return_token_accuracy = return_token_accuracy
        self.return_predicted_tokens = return_predicted_tokens

    def forward(self, lin_weight, _input, target, bias=None):
        return F.tigon_fused_linear_cross_entropy(
            _input, lin_weight, target, bias, self.ce_weight, self.ignore_index, self.lse_square_scale,
            self.label_smoothing, self.reduction, self.softcap, self.return_z_loss, self.accum_dtype,
            self.use_token_scaling, self.return_token_accuracy, self.return_predicted_tokens)


class TigonFusedLinearMultiHeadCrossEntropyLoss(nn.Module):
    """Medusa's loss over K LM heads on the same hidden states in one call (no [BT, V] logits):
    forward(lin_weights [K tensors of [V, H]], _input [BT, H] or [B, T, H], targets [K, BT], biases=None)
    returns sum_k head_weights[k] * CE_k (each head's loss reduced over its own non-ignored targets);
    with return_head_losses=True, (loss, head_losses [K]). targets: medusa_targets(labels, K) for
    causal-LM labels. reduction "mean" or "sum"."""

    def __init__(self, head_weights=None, ignore_index=-100, lse_square_scale=0.0, label_smoothing=0.0,
                 reduction="mean", softcap=None, return_head_losses=False):
        super().__init__()
        _check_loss_args(label_smoothing, reduction, softcap)
        if reduction not in ("mean", "sum"):
            raise ValueError(f"tigon_torch: reduction must be 'mean' or 'sum' for several heads, got {reduction!r}")
        self.head_weights = None if head_weights is None else [float(w) for w in head_weights]
        self.ignore_index = ignore_index
        self.lse_square_scale = lse_square_scale
        self.label_smoothing = label_smoothing
        self.reduction = reduction
        self.softcap = softcap
        self.return_head_losses = return_head_losses

    def forward(self, lin_weights, _input, targets, biases=None):
        weights = list(lin_weights)
        if self.head_weights is not None and len(self.head_weights) != len(weights):
            raise ValueError(f"tigon_torch: {len(self.head_weights)} head_weights for {len(weights)} heads")
        bs = list(biases) if biases is not None else []
        loss, head_losses = TigonFusedLinearMultiHeadCrossEntropyFunction.apply(
            _input.reshape(-1, _input.shape[-1]), targets, self.head_weights, self.ignore_index,
            self.lse_square_scale, self.label_smoothing, self.reduction, self.softcap, len(weights), *weights, *bs)
        return (loss, head_losses) if self.return_head_losses else loss


# ------------------------------------------------------------------------------------------------
# Distillation losses
# ------------------------------------------------------------------------------------------------


class TigonJSD(nn.Module):
    """Liger's LigerJSD: the generalised Jensen-Shannon divergence, forward(log_q, log_p, shift_labels=None)
    with the student's log-probabilities log_q [BT, V] and the teacher's log_p [BT, V]; beta 0 is the
    forward KL(P || Q), beta 1 the reverse KL(Q || P). See TigonJSDFunction."""

    def __init__(self, beta: float = 0.5, ignore_index: int = -100):
        super().__init__()
        _check_beta(beta)
        self.beta = beta
        self.ignore_index = ignore_index

    def forward(self, log_q, log_p, shift_labels=None):
        return TigonJSDFunction.apply(log_q, log_p, shift_labels, self.beta, self.ignore_index)

    def extra_repr(self):
        return f"beta={self.beta}, ignore_index={self.ignore_index}"


class TigonKLDIVLoss(nn.KLDivLoss):
    """Liger's LigerKLDIVLoss: torch.nn.KLDivLoss (its arguments after eps: size_average, reduce,
    reduction="mean", log_target=False) over the student's log-probabilities y_pred [BT, V] and the
    teacher's y_true [BT, V], with tigon's kernel; eps clamps a probability target inside the log, as in
    Liger. forward(y_pred, y_true). See TigonKLDivLossFunction."""

    def __init__(self, eps: float = 1e-10, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.eps = eps

    def forward(self, y_pred, y_true):
        return TigonKLDivLossFunction.apply(y_pred, y_true, self.reduction, self.log_target, self.eps)


class TigonTVDLoss(nn.Module):
    """Liger's LigerTVDLoss: the total variation distance, forward(p, q, shift_labels=None) with the
    probabilities p (whose gradient is taken) and q, [BT, V] each. See TigonTVDLossFunction."""

    def __init__(self, reduction="batchmean", ignore_index: int = -100):
        super().__init__()
        _ops.div_reduction_code(reduction)  # an unknown reduction raises here
        self.reduction = reduction
        self.ignore_index = ignore_index

    def forward(self, p, q, shift_labels=None):
        return TigonTVDLossFunction.apply(p, q, shift_labels, self.reduction, self.ignore_index)

    def extra_repr(self):
        return f"reduction={self.reduction!r}, ignore_index={self.ignore_index}"


class TigonFusedLinearJSD(nn.Module):
    """Liger's LigerFusedLinearJSD: the generalised JSD of the student's and the teacher's LM heads,
    forward(student_input [BT, H], student_weight [V, H], teacher_input [BT, H_t], teacher_weight
    [V, H_t], shift_labels [BT] or None), without the [BT, V] logits. See TigonFusedLinearJSDFunction.
    A temperature that is not > 0 raises ValueError (Liger asserts that it is not 0)."""

    def __init__(self, jsd_beta=0.5, ignore_index=-100, temperature=1.0, accum_dtype=None):
        super().__init__()
        _check_beta(jsd_beta)
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.jsd_beta = jsd_beta
        self.temperature = temperature
        self.ignore_index = ignore_index
        self.accum_dtype = accum_dtype

    def forward(self, student_input, student_weight, teacher_input, teacher_weight, shift_labels):
        return F.tigon_fused_linear_jsd(student_input, student_weight, teacher_input, teacher_weight, shift_labels,
                                        self.jsd_beta, self.ignore_index, self.temperature, self.accum_dtype)

    def extra_repr(self):
        return f"jsd_beta={self.jsd_beta}, ignore_index={self.ignore_index}, temperature={self.temperature}"

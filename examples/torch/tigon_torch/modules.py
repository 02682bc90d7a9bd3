"""nn.Module wrappers of the tigon functions, with the parameters (names and shapes) of the Hugging Face
modules they stand in for, so state dicts load unchanged."""

from __future__ import annotations

import torch
from torch import nn

from . import functional as F


class TigonRMSNorm(nn.Module):
    """RMSNorm over the last dimension. offset=1.0 with casting_mode="gemma" and init_fn="zeros" is
    Gemma's RMSNorm; the defaults are Llama's."""

    def __init__(self, hidden_size, eps=1e-6, offset=0.0, casting_mode="llama", init_fn="ones", in_place=True,
                 elementwise_affine=True):
        super().__init__()
        if init_fn not in ("ones", "zeros"):
            raise ValueError(f"init_fn must be 'ones' or 'zeros', got {init_fn!r}")
        if elementwise_affine:
            init = torch.ones if init_fn == "ones" else torch.zeros
            self.weight = nn.Parameter(init(hidden_size))
        else:
            self.register_parameter("weight", None)
        self.variance_epsilon = eps
        self.offset = offset
        self.casting_mode = casting_mode
        self.in_place = in_place

    def forward(self, hidden_states):
        return F.tigon_rms_norm(hidden_states, self.weight, self.variance_epsilon, self.offset, self.casting_mode,
                                self.in_place)

    def extra_repr(self):
        shape = tuple(self.weight.shape) if self.weight is not None else None
        return (f"{shape}, eps={self.variance_epsilon}, offset={self.offset}, casting_mode={self.casting_mode}, "
                f"in_place={self.in_place}")


class TigonLayerNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5, bias=True, init_fn="ones"):
        super().__init__()
        init = torch.ones if init_fn == "ones" else torch.zeros
        self.weight = nn.Parameter(init(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if bias else None
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        return F.tigon_layer_norm(hidden_states, self.weight, self.bias, self.variance_epsilon)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class TigonFusedAddRMSNorm(nn.Module):
    """forward(hidden_states, residual) -> (norm(hidden_states + residual), hidden_states + residual)."""

    def __init__(self, hidden_size, eps=1e-6, offset=0.0, casting_mode="llama", init_fn="ones", in_place=False):
        super().__init__()
        init = torch.ones if init_fn == "ones" else torch.zeros
        self.weight = nn.Parameter(init(hidden_size))
        self.variance_epsilon = eps
        self.offset = offset
        self.casting_mode = casting_mode
        self.in_place = in_place

    def forward(self, hidden_states, residual):
        return F.tigon_fused_add_rms_norm(hidden_states, residual, self.weight, self.variance_epsilon, self.offset,
                                          self.casting_mode, self.in_place)


class TigonSwiGLUMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)) — LlamaMLP's parameters, SwiGLU through tigon; without
    biases (and hooks, autocast), the whole MLP through tigon_gated_mlp (the gated product recomputed in
    the backward, not kept)."""

    def __init__(self, config):
        super().__init__()
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
    """down_proj(gelu_tanh(gate_proj(x)) * up_proj(x)) — GemmaMLP's parameters, GeGLU through tigon (the
    whole MLP through tigon_gated_mlp when it can, as TigonSwiGLUMLP)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)

    def forward(self, x):
        if F.gated_mlp_fusable(self, x):
            return F.tigon_gated_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight,
                                     "gelu_tanh")
        return self.down_proj(F.tigon_geglu(self.gate_proj(x), self.up_proj(x)))


class TigonPhi3MLP(nn.Module):
    """down_proj(silu(gate) * up) over Phi-3's fused gate_up_proj, without splitting the projection."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden_states):
        return self.down_proj(F.tigon_fused_gate_up(self.gate_up_proj(hidden_states), "silu"))


class TigonCrossEntropyLoss(nn.Module):
    def __init__(self, weight=None, ignore_index=-100, lse_square_scale=0.0, label_smoothing=0.0, reduction="mean",
                 softcap=None, return_z_loss=False, return_token_accuracy=False, return_predicted_tokens=False,
                 in_place=False):
        super().__init__()
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
        if softcap is not None and not softcap > 0:
            raise ValueError(f"softcap must be > 0 or None, got {softcap}")
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
        return F.tigon_cross_entropy(_input, target, self.weight, self.ignore_index, self.lse_square_scale,
                                     self.label_smoothing, self.reduction, self.softcap, self.return_z_loss,
                                     self.return_token_accuracy, self.return_predicted_tokens, self.in_place)


class TigonFusedLinearCrossEntropyLoss(nn.Module):
    """forward(lin_weight, _input, target, bias=None): the loss of _input @ lin_weight.T + bias against
    target without materialising the logits (Liger's argument order)."""

    def __init__(self, ce_weight=None, ignore_index=-100, lse_square_scale=0.0, label_smoothing=0.0,
                 reduction="mean", softcap=None, return_z_loss=False, accum_dtype=None, use_token_scaling=False,
                 return_token_accuracy=False, return_predicted_tokens=False):
        super().__init__()
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
        if softcap is not None and not softcap > 0:
            raise ValueError(f"softcap must be > 0 or None, got {softcap}")
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

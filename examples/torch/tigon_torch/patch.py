"""One-line patching of Hugging Face transformers (5.x) models with tigon's kernels.

    from tigon_torch import apply_tigon_to_llama
    apply_tigon_to_llama()                     # before the model is built: patches the classes
    model = AutoModelForCausalLM.from_pretrained(...)

    apply_tigon_to_llama(model=model)          # or an instantiated model, in place

    model = AutoTigonForCausalLM.from_pretrained(path)   # any supported family, by config.model_type
    apply_tigon_to_model(model)                          # any supported family, an instantiated model

Each apply_tigon_to_<family> takes the parameters of Liger-Kernel's apply_liger_kernel_to_<family>, in
its order, with its defaults (most families: rope=True, cross_entropy=False,
fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, model=None; geglu= for the Gemma
families, layer_norm= where Liger has it, other defaults where Liger's differ: Granite, GLM-4,
GPT-OSS, Qwen3-VL, Nemotron), then tigon-only switches, keyword-only: fused_mlp=True where the
family has a gated MLP; rope / layer_norm for Nemotron, whose Liger function has neither. Phi,
which Liger does not patch, takes (rope, cross_entropy, fused_linear_cross_entropy, layer_norm,
model). The per-family table _FAMILIES says what each family's switches replace; docs/models.md
lists it for users.

What each switch replaces:
  rope                        the modeling module's apply_rotary_pos_emb (a module-level function, so
                              this applies to every model of the family, built or not); partial
                              rotary tables rotate their first channels and pass the rest through;
                              GLM-4's interleaved pairs; Llama 4's apply_rotary_emb and
                              vision_apply_rotary_emb (complex pairs)
  rms_norm                    the family's RMSNorm, with the family's casting and offset (Llama
                              casting; Gemma: offset 1, Gemma casting; OLMo 2 / 3, GPT-OSS: offset 0,
                              Gemma casting, as their weight multiplies in fp32)
  swiglu / geglu              the MLP's act(gate) * up (SwiGLU, or GeGLU for the Gemma family; a fused
                              gate_up projection, Phi-3's and GLM-4's, is read in place; Falcon-H1's
                              gate multiplier goes into the kernel), and the routed experts'
                              act(gate) * up (Mixtral, Qwen3-MoE, Llama 4): the router is left alone
  relu_squared                Nemotron's MLP activation, the squared ReLU of up_proj (not gated), one
                              kernel each way (TigonReLUSquaredFunction)
  layer_norm                  torch.nn.LayerNorm modules (Gemma 3's SigLIP tower, Llama 4's vision
                              tower, Phi's every norm) and Nemotron's LayerNorm1P (weight + 1)
  fused_mlp                   with swiglu / geglu, a gate / up / down MLP of plain bias-free nn.Linear
                              modules (no PEFT adapter, no hook, no autocast) runs as one autograd
                              function (TigonGatedMLPFunction) that does not keep the down projection's
                              input, act(gate) * up, for the backward but recomputes it there: N x I
                              values per layer fewer between forward and backward; otherwise the
                              projections run as modules and only the activation is fused
  fused_add_norm              with rms_norm, where the decoder layer is Llama's pre-norm layer (checked
                              in the installed transformers): each residual add runs inside add + RMSNorm
                              with the norm after it (the next layer's first norm, or the final norm:
                              the layer leaves the normed tensor with it); see _decoder_forward
  cross_entropy               the causal-LM loss on materialised logits
  fused_linear_cross_entropy  in training with labels, the causal-LM forward skips the logits and
                              computes the loss from the last hidden states and the LM head
                              (honouring num_items_in_batch, shift_labels, ignore_index, Gemma's final
                              logit softcap, Granite's logits_scaling and Falcon-H1's
                              lm_head_multiplier, and adding the MoE router's auxiliary loss as
                              Hugging Face does); outputs.logits is then None

A module whose Hugging Face code computes something tigon's kernels do not (GPT-OSS's clamped expert
gate, Nemotron's squared ReLU, Phi's plain GELU MLP) stays on Hugging Face's code: its switch is accepted and logs what stays (_Family.keeps).

Class patching (model=None) replaces the modeling module's RMSNorm / MLP / experts classes by
subclasses (same __init__, same parameters, so checkpoints load unchanged) and the causal-LM class's
forward; models built before the call keep their modules, but share the new causal-LM forward and
the RoPE function. For the vision-language families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) only the text
decoder is patched: class patching makes each text model patch its own modules when it is built,
so the vision tower keeps Hugging Face's code even where it shares a class with the text model.
With model=..., that model's modules are patched in place (their forward methods rebound); only the
RoPE function, a module-level function the attention calls, is replaced for the whole family.
Where transformers kernelizes the model (a kernels package it uses is installed), the norms go
through its kernel hooks (kernel_hooks.py): a model patched in place maps the norm hook to tigon's
layer, so model.train() / eval() re-kernelize it to tigon's forward; tigon's subclasses tell
kernelize to leave them alone. Tensors that are not on a CUDA device, and dtype combinations tigon
does not cover, go through the original Hugging Face code. unpatch() undoes every patch made through
this module.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import textwrap
import types
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from . import functional as F
from . import ops as _ops
from .functions import TigonFusedGateUpMulFunction, TigonReLUSquaredFunction, _compiling
from .functions import gated as _gated

logger = logging.getLogger(__name__)

_MISSING = object()
_UNDO: list[tuple[object, str, object]] = []
_ORIGINALS: dict[tuple[str, str], object] = {}


def _set(obj, name: str, value) -> None:
    """setattr that unpatch() can undo (restores the old value, or removes an attribute that was only
    inherited)."""
    old = obj.__dict__.get(name, _MISSING) if hasattr(obj, "__dict__") else _MISSING
    _UNDO.append((obj, name, old))
    setattr(obj, name, value)


def unpatch() -> None:
    """Undoes every patch made by the apply_tigon_to_* functions, newest first."""
    while _UNDO:
        obj, name, old = _UNDO.pop()
        if old is _MISSING:
            try:
                delattr(obj, name)
            except AttributeError:
                pass
        else:
            setattr(obj, name, old)


def _original(mod, name: str, value=_MISSING):
    """The modeling module's attribute (or another value known by that name) as it was before any
    tigon patch."""
    key = (mod.__name__, name)
    if key not in _ORIGINALS:
        _ORIGINALS[key] = getattr(mod, name) if value is _MISSING else value
    return _ORIGINALS[key]


# ------------------------------------------------------------------------------------------------
# Module forwards
# ------------------------------------------------------------------------------------------------

_FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16)


def _rms_supported(x: torch.Tensor, w) -> bool:
    if not _ops.on_device(x) or x.dtype not in _FLOAT_TYPES or x.numel() == 0:
        return False
    return w is None or w.dtype == x.dtype or w.dtype == torch.float32


def _rms_norm_forward(self, hidden_states):
    normed = _prenormed(self, hidden_states)
    if normed is not None:  # the decoder layer before computed it with its residual add
        return normed
    w = self.weight
    if getattr(self, "_tigon_offset", None) is None:  # a module the patch did not choose (kernel hooks)
        return type(self).forward(self, hidden_states)
    if not _rms_supported(hidden_states, w):
        return self._tigon_fallback(hidden_states)
    eps = self.variance_epsilon if hasattr(self, "variance_epsilon") else self.eps
    return F.tigon_rms_norm(hidden_states, w, eps, self._tigon_offset, self._tigon_casting, self._tigon_in_place)


def _activation_kind(act) -> str | None:
    """The tigon activation computing act exactly as Hugging Face does, or None."""
    from transformers import activations as A

    if isinstance(act, (nn.SiLU, getattr(A, "SiLUActivation", nn.SiLU))):
        return "silu"
    tanh_types = tuple(getattr(A, n) for n in ("GELUTanh", "PytorchGELUTanh", "NewGELUActivation",
                                                "FastGELUActivation") if hasattr(A, n))
    if tanh_types and isinstance(act, tanh_types):
        return "gelu_tanh"
    if hasattr(A, "GELUActivation") and type(act) is A.GELUActivation:
        return "gelu"
    if isinstance(act, nn.GELU):
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    return None


def _act(self):
    """The module's activation (act_fn, or activation_fn: Phi-3, GLM-4, Llama 4)."""
    act = getattr(self, "act_fn", None)
    return act if act is not None else getattr(self, "activation_fn", None)


def _mlp_kind(self) -> str | None:
    kind = self.__dict__.get("_tigon_act_kind", _MISSING)
    if kind is _MISSING:
        act = _act(self)
        kind = _activation_kind(act) if act is not None else None
        self.__dict__["_tigon_act_kind"] = kind
    return kind


def _gated_mlp_forward(self, x):
    kind = _mlp_kind(self)
    if kind is None or not _ops.on_device(x):
        return self._tigon_fallback(x)
    if self._tigon_fused_mlp and F.gated_mlp_fusable(self, x):
        return F.tigon_gated_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight, kind)
    a, b = self.gate_proj(x), self.up_proj(x)
    if a.dtype not in _FLOAT_TYPES or a.dtype != b.dtype:
        return self.down_proj(_act(self)(a) * b)
    return self.down_proj(_gated(a, b, kind, 1.0, 1.0))


def _scaled_gated_mlp_forward(self, x):
    """Falcon-H1's MLP: down_proj(up_proj(x) * act(gate_proj(x) * gate_multiplier)) * down_multiplier,
    the gate multiplier inside the gated kernel, the down multiplier where Hugging Face applies it."""
    kind = _mlp_kind(self)
    if kind is None or not _ops.on_device(x):
        return self._tigon_fallback(x)
    gate_multiplier = float(self.gate_multiplier)
    if self._tigon_fused_mlp and gate_multiplier == 1.0 and F.gated_mlp_fusable(self, x):
        y = F.tigon_gated_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight, kind)
        return y * self.down_multiplier
    a, b = self.gate_proj(x), self.up_proj(x)
    if a.dtype not in _FLOAT_TYPES or a.dtype != b.dtype:
        return self.down_proj(b * _act(self)(a * self.gate_multiplier)) * self.down_multiplier
    return self.down_proj(_gated(a, b, kind, gate_multiplier, 1.0)) * self.down_multiplier


def _fused_gate_up_mlp_forward(self, hidden_states):
    kind = _mlp_kind(self)
    if kind is None or not _ops.on_device(hidden_states):
        return self._tigon_fallback(hidden_states)
    gate_up = self.gate_up_proj(hidden_states)
    if gate_up.dtype not in _FLOAT_TYPES:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(up * _act(self)(gate))
    return self.down_proj(TigonFusedGateUpMulFunction.apply(gate_up, kind))


def _relu2_mlp_forward(self, x):
    """Nemotron's MLP, down_proj(relu(up_proj(x))^2), the squared ReLU in one tigon kernel each way
    when the module's activation is transformers' ReLUSquaredActivation."""
    if not _is_relu2(_act(self)) or not _ops.on_device(x):
        return self._tigon_fallback(x)
    up = self.up_proj(x)
    if up.dtype not in _FLOAT_TYPES:
        return self._tigon_fallback(x)
    return self.down_proj(TigonReLUSquaredFunction.apply(up))


def _is_relu2(act) -> bool:
    from transformers import activations as A

    cls = getattr(A, "ReLUSquaredActivation", None)
    return cls is not None and type(act) is cls


def _experts_gate_supported(self, gate_up) -> bool:
    return (_mlp_kind(self) is not None and _ops.on_device(gate_up) and gate_up.dtype in _FLOAT_TYPES
            and getattr(self, "has_gate", True) and getattr(self, "is_concatenated", True))


def _experts_apply_gate(self, gate_up):
    """act(gate) * up of the experts' [tokens, 2 * I] gate_up projection (the first half the gate), the
    step Hugging Face's batched_mm and grouped_mm experts implementations call."""
    if not _experts_gate_supported(self, gate_up):
        return self._tigon_gate_fallback(gate_up)
    return TigonFusedGateUpMulFunction.apply(gate_up, _mlp_kind(self))


def _routed_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Routed experts stored as 3-D weights (gate_up_proj [E, 2 * I, H], down_proj [E, H, I]: Mixtral,
    Qwen3-MoE). With the eager experts implementation, the per-expert loop of Hugging Face's own
    forward with act(gate) * up through tigon; any other implementation (grouped_mm, batched_mm, ...)
    runs Hugging Face's dispatching forward, which calls the patched _apply_gate."""
    impl = getattr(getattr(self, "config", None), "_experts_implementation", None)
    if (impl not in (None, "eager") or getattr(self, "has_bias", False) or getattr(self, "is_transposed", False)
            or not _experts_gate_supported(self, hidden_states)):
        return self._tigon_fallback(hidden_states, top_k_index, top_k_weights)
    final = torch.zeros_like(hidden_states)
    with torch.no_grad():
        mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit:
        e = e[0]
        if e == self.num_experts:  # an expert-parallel sentinel
            continue
        top_k_pos, token_idx = torch.where(mask[e])
        gate_up = nn.functional.linear(hidden_states[token_idx], self.gate_up_proj[e])
        h = nn.functional.linear(self._apply_gate(gate_up), self.down_proj[e])
        h = h * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, h.to(final.dtype))
    return final


def _bmm_experts_forward(self, hidden_states):
    """Llama 4's experts (gate_up_proj [E, H, 2 * I], every expert over its share of the routed rows,
    one batched matmul each way) with act(gate) * up through tigon."""
    kind = _mlp_kind(self)
    if kind is None or not _ops.on_device(hidden_states) or hidden_states.dtype not in _FLOAT_TYPES:
        return self._tigon_fallback(hidden_states)
    x = hidden_states.view(self.gate_up_proj.shape[0], -1, self.hidden_size)
    gate_up = torch.bmm(x, self.gate_up_proj)
    if gate_up.dtype not in _FLOAT_TYPES:
        return self._tigon_fallback(hidden_states)
    out = torch.bmm(TigonFusedGateUpMulFunction.apply(gate_up, kind), self.down_proj)
    return out.view(-1, self.hidden_size)


def _layer_norm_supported(m: nn.LayerNorm, x: torch.Tensor) -> bool:
    if not _ops.on_device(x) or x.dtype not in _FLOAT_TYPES or x.numel() == 0:
        return False
    if len(m.normalized_shape) != 1 or torch.is_autocast_enabled(x.device.type):
        return False  # autocast runs layer_norm in fp32: Hugging Face's code keeps that
    return all(t is None or t.dtype == x.dtype for t in (m.weight, m.bias))


def _layer_norm_forward(self, x):
    """torch.nn.LayerNorm's forward through tigon; _tigon_ln_offset (Nemotron's LayerNorm1P: 1) is
    added to the weight first, as the module itself does."""
    offset = getattr(self, "_tigon_ln_offset", 0.0)
    if not _layer_norm_supported(self, x) or (offset and self.weight is None):
        return self._tigon_fallback(x)
    weight = self.weight + offset if offset else self.weight
    return F.tigon_layer_norm(x, weight, self.bias, self.eps)


def _layer_norm_subclass(base: type = nn.LayerNorm, offset: float = 0.0) -> type:
    def fallback(self, x):
        return base.forward(self, x)

    name = "TigonNNLayerNorm" if base is nn.LayerNorm else f"Tigon{base.__name__}"
    return type(name, (base,), {"forward": _layer_norm_forward, "_tigon_fallback": fallback,
                                "_tigon_ln_offset": offset, "__module__": __name__})


class _TorchNNView(types.ModuleType):
    """torch.nn as one modeling module sees it, with some of its classes replaced (so that patching
    that module's nn.LayerNorm leaves torch.nn itself alone)."""

    def __init__(self, **replaced):
        super().__init__("torch.nn")
        self.__dict__.update(replaced)

    def __getattr__(self, name):
        return getattr(nn, name)


# ------------------------------------------------------------------------------------------------
# RoPE
# ------------------------------------------------------------------------------------------------


def _rope_full_table(original):
    """GPT-OSS's apply_rotary_pos_emb: cos / sin of head_dim / 2, x1 * cos - x2 * sin and
    x2 * cos + x1 * sin over the two halves of each head, which is the rotate_half rotation with the
    table repeated once (both halves of Hugging Face's usual table are equal): tigon's rope on
    [cos, cos] and [sin, sin]."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if not _ops.on_device(q) or 2 * cos.shape[-1] != q.shape[-1]:
            return original(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        return F.tigon_rotary_pos_emb(q, k, torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1),
                                      unsqueeze_dim=unsqueeze_dim)

    return apply_rotary_pos_emb


def _rope_glm(original):
    """GLM-4's apply_rotary_pos_emb: the first half of each table row repeated per pair
    (repeat_interleave), interleaved pairs (x[2i], x[2i + 1]) of the first rotary_dim channels
    rotated, the rest passed through: tigon's interleaved rope on those tables."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        half = cos.shape[-1] // 2
        if not _ops.on_device(q) or half == 0 or 2 * half > q.shape[-1]:
            return original(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        return F.tigon_interleaved_rotary_pos_emb(q, k, cos[..., :half].repeat_interleave(2, dim=-1),
                                                  sin[..., :half].repeat_interleave(2, dim=-1),
                                                  unsqueeze_dim=unsqueeze_dim)

    return apply_rotary_pos_emb


def _rope_complex(original):
    """Llama 4's apply_rotary_emb(xq, xk, freqs_cis): each pair (x[2i], x[2i + 1]) multiplied as a
    complex number by freqs_cis[..., i] in fp32, q and k [batch, seq, heads, head_dim]: tigon's
    interleaved rope on the tables of the real and imaginary parts, each repeated per pair."""

    def apply_rotary_emb(xq, xk, freqs_cis):
        if not _ops.on_device(xq) or not freqs_cis.is_complex() or 2 * freqs_cis.shape[-1] != xq.shape[-1]:
            return original(xq, xk, freqs_cis)
        cos = freqs_cis.real.repeat_interleave(2, dim=-1)
        sin = freqs_cis.imag.repeat_interleave(2, dim=-1)
        return F.tigon_interleaved_rotary_pos_emb(xq, xk, cos, sin, unsqueeze_dim=2)

    return apply_rotary_emb


def _rope_complex_vision(original):
    """Llama 4's vision_apply_rotary_emb(query, key, freqs_ci): the same complex rotation with one
    table row per position (freqs_ci broadcast over the batch and the heads)."""

    def vision_apply_rotary_emb(query, key, freqs_ci):
        seq, half = query.shape[1], query.shape[-1] // 2
        if (not _ops.on_device(query) or not freqs_ci.is_complex() or 2 * half != query.shape[-1]
                or freqs_ci.numel() != seq * half):
            return original(query, key, freqs_ci)
        f = freqs_ci.to(query.device).reshape(1, seq, half)
        return F.tigon_interleaved_rotary_pos_emb(query, key, f.real.repeat_interleave(2, dim=-1),
                                                  f.imag.repeat_interleave(2, dim=-1), unsqueeze_dim=2)

    return vision_apply_rotary_emb


# The module-level functions each rope style replaces (the text model's first), and their
# replacements (given the original).
_ROPES = {
    "rotate_half": (("apply_rotary_pos_emb", lambda original: F.tigon_rotary_pos_emb),),
    "full_table": (("apply_rotary_pos_emb", _rope_full_table),),
    "glm": (("apply_rotary_pos_emb", _rope_glm),),
    # Qwen2-VL / Qwen2.5-VL: transformers 5 composes the M-RoPE table in the rotary embedding and
    # calls apply_rotary_pos_emb; transformers 4 calls apply_multimodal_rotary_pos_emb.
    "mrope": (("apply_rotary_pos_emb", lambda original: F.tigon_rotary_pos_emb),
              ("apply_multimodal_rotary_pos_emb", lambda original: F.tigon_multimodal_rotary_pos_emb)),
    "complex": (("apply_rotary_emb", _rope_complex), ("vision_apply_rotary_emb", _rope_complex_vision)),
}


def rope_function_name(fam, mod=None) -> str | None:
    """The modeling module's text-model function a family's rope patch replaces (None: none); given
    the module, the first of the family's functions it has (transformers 5.0's Qwen2-VL has only
    apply_multimodal_rotary_pos_emb)."""
    if not fam.rope:
        return None
    names = [name for name, _ in _ROPES[fam.rope]]
    return next((n for n in names if mod is None or hasattr(mod, n)), names[0])


# ------------------------------------------------------------------------------------------------
# The causal-LM loss
# ------------------------------------------------------------------------------------------------


class _HeadCapture:
    """While active, the LM head's forward returns an empty [..., 0] tensor and keeps its input, so
    the model's own forward runs up to (and past) the head without computing the logits; whatever it
    does to them afterwards (softcap, scaling) touches no data."""

    def __init__(self, head: nn.Module):
        self.head, self.hidden = head, None

    def _capture(self, x):
        self.hidden = x
        return x.new_empty((*x.shape[:-1], 0))

    def __enter__(self):
        self.head.__dict__["forward"] = self._capture
        return self

    def __exit__(self, *exc):
        self.head.__dict__.pop("forward", None)
        return False


def _logit_transform(model, rule: str):
    """(scale, softcap) that Hugging Face's forward applies to the LM head's output: logits * scale,
    then softcap * tanh(logits / softcap)."""
    if rule == "softcap":
        return None, getattr(model.config, "final_logit_softcapping", None)
    if rule == "granite":  # logits / config.logits_scaling
        return 1.0 / model.config.logits_scaling, None
    if rule == "falcon_h1":  # logits * model.lm_head_multiplier
        return model.model.lm_head_multiplier, None
    return None, None


def _plain_head(head) -> bool:
    return (isinstance(head, nn.Linear) and "forward" not in head.__dict__ and not hasattr(head, "_hf_hook")
            and _ops.on_device(head.weight))


@functools.cache
def _hf_loss_kind(original) -> str:
    """How Hugging Face's forward `original` computes its loss, read from its source: "kwargs",
    self.loss_function(..., **kwargs) (num_items_in_batch, ignore_index and shift_labels honoured);
    "plain", self.loss_function without the keyword arguments (a mean over the valid tokens: what
    transformers 5.0's Qwen3-VL does); "own", any other loss (transformers 5.0's Gemma 3
    multimodal model drops padded positions by the attention mask), which tigon leaves to Hugging
    Face's code."""
    try:
        src = inspect.getsource(original)
    except (OSError, TypeError):
        return "kwargs"
    start = src.find("self.loss_function(")
    if start < 0:
        return "own" if "CrossEntropyLoss" in src else "kwargs"
    depth, i = 0, start + len("self.loss_function")
    for i in range(i, len(src)):
        depth += {"(": 1, ")": -1}.get(src[i], 0)
        if depth == 0:
            break
    return "kwargs" if "**" in src[start:i] else "plain"


def _loss_forward(original, rule: str):
    """The causal-LM forward `original` (Hugging Face's, of any family, text or multimodal) with its loss
    through tigon. In training with labels (and fused_linear_cross_entropy on) `original` runs with
    labels=None while the LM head only passes its input on (_HeadCapture): the loss comes from those
    hidden states and the head's weight (scaled and softcapped as `rule` says Hugging Face's forward
    does), and outputs.logits is None. With cross_entropy on, the logits are computed and the loss
    comes from tigon's cross-entropy. An auxiliary router loss in the outputs (MoE families with
    output_router_logits) is added with the model's router_aux_loss_coef, as Hugging Face adds it.
    Otherwise, for an LM head that is not a plain nn.Linear on a CUDA device, and for a forward
    whose loss is its own (_hf_loss_kind), `original` runs."""
    sig = inspect.signature(original)
    names = list(sig.parameters)

    def forward(self, *args, **kwargs):
        use_flce = self._tigon_flce and self.training
        use_ce = self._tigon_ce
        try:
            bound = sig.bind(self, *args, **kwargs)
        except TypeError:
            return original(self, *args, **kwargs, return_dict=True)
        call = {}
        for name, value in list(bound.arguments.items())[1:]:
            kind = sig.parameters[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                call.update(value)
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                return original(self, *args, **kwargs, return_dict=True)
            else:
                call[name] = value
        labels, shift_labels = call.get("labels"), call.get("shift_labels")
        has_labels = labels is not None or shift_labels is not None
        head = self.get_output_embeddings() if "labels" in names else None
        kind = _hf_loss_kind(original)
        if not (has_labels and (use_flce or use_ce)) or head is None or not _plain_head(head) or kind == "own":
            return original(self, *args, **kwargs, return_dict=True)

        call["labels"] = None
        call["return_dict"] = True
        extra = {k: call[k] for k in ("num_items_in_batch", "ignore_index", "shift_labels") if k in call}
        if kind == "plain":  # Hugging Face's loss takes none of them
            extra, shift_labels = {}, None
            if labels is None:
                return original(self, *args, **kwargs, return_dict=True)
        if use_flce:
            with _HeadCapture(head) as capture:
                out = original(self, **call)
            hidden = capture.hidden
            if hidden is None:
                raise RuntimeError(f"tigon_torch: {type(self).__name__}.forward did not call its LM head")
            scale, softcap = _logit_transform(self, rule)
            bias = head.bias
            if scale is not None:
                hidden = hidden * scale
                bias = bias * scale if bias is not None else None
            loss = F.tigon_causal_lm_loss(
                hidden, head.weight, labels, lm_head_bias=bias, shift_labels=shift_labels,
                num_items_in_batch=extra.get("num_items_in_batch"), ignore_index=extra.get("ignore_index", -100),
                final_logit_softcapping=softcap)
            fields = {k: v for k, v in out.items() if k not in ("loss", "logits")}
        else:
            out = original(self, **call)
            loss = F.tigon_causal_lm_loss_from_logits(out.logits, labels, **extra)
            fields = {k: v for k, v in out.items() if k != "loss"}
        aux = fields.get("aux_loss")
        coef = getattr(self, "router_aux_loss_coef", None)
        if aux is not None and coef is not None:
            loss = loss + coef * aux.to(loss.device)
        return type(out)(loss=loss, **fields)

    forward.__signature__ = sig  # what inspect (Trainer's column filter, generate) reads: Hugging Face's
    forward.__name__ = getattr(original, "__name__", "forward")
    forward.__qualname__ = getattr(original, "__qualname__", "forward")
    forward.__doc__ = original.__doc__
    try:
        from transformers.utils import can_return_tuple
    except ImportError:  # pragma: no cover
        wrapped = forward
    else:
        wrapped = can_return_tuple(forward)
    wrapped._tigon_original = original
    return wrapped


def _pre_tigon(fn):
    """A forward with any tigon loss wrapper removed."""
    while getattr(fn, "_tigon_original", None) is not None:
        fn = fn._tigon_original
    return fn


# ------------------------------------------------------------------------------------------------
# Families
# ------------------------------------------------------------------------------------------------

# Liger's parameters of apply_liger_kernel_to_<family>, in order, with defaults.
_P = (("rope", True), ("cross_entropy", False), ("fused_linear_cross_entropy", True), ("rms_norm", True))
_LIGER_SWIGLU = _P + (("swiglu", True), ("model", None))
_LIGER_GEGLU = _P + (("geglu", True), ("model", None))
_FUSED_MLP = (("fused_mlp", True),)
_FUSED_ADD_NORM = (("fused_add_norm", True),)


def _defaults(params, **changed):
    return tuple((n, changed.get(n, d)) for n, d in params)


@dataclass(frozen=True)
class _Family:
    """What one family's patch replaces.

    module: the modeling module. norm: its RMSNorm class (offset, casting, norm_in_place: whether the
    backward may write dX over dY; not where the norm's output feeds a residual add). mlp: its dense
    gated MLP class (fused_gate_up: one gate_up projection; mlp_multipliers: Falcon-H1's gate / down
    multipliers). experts: its routed-experts class ("routed": Hugging Face's 3-D expert weights with
    the experts-implementation dispatch; "bmm": Llama 4's). rope: how apply_rotary_pos_emb is
    replaced ("rotate_half": tigon_rotary_pos_emb; "full_table": GPT-OSS's half-width tables; "glm":
    GLM-4's interleaved pairs; "complex": Llama 4's apply_rotary_emb), None: left alone. layer_norm: "nn" (torch.nn.LayerNorm modules; the class patch gives the modules named
    in layer_norm_modules a torch.nn whose LayerNorm is tigon's) or a LayerNorm subclass of the module
    (with layer_norm_offset added to its weight). heads: (causal-LM class, logit rule) pairs whose
    loss goes through tigon (_logit_transform). scope: patch only modules inside instances of this
    class (a vision-language model's text model). norm_alias: the norm's name in older transformers
    (Qwen2-VL / 2.5-VL 5.0: Qwen2RMSNorm, imported from Qwen2). params / extras / var_kw: the apply function's
    signature (Liger's parameters, tigon's keyword-only ones, a **kwargs). keeps: (switch or None for
    always, what stays on Hugging Face's code and why), logged when that switch is on. decoder: its
    pre-norm decoder layer class, whose residual adds fused_add_norm fuses with the norms after them
    (the text model class is its name with "DecoderLayer" replaced by "Model")."""

    name: str
    module: str
    norm: str | None
    mlp: str | None
    heads: tuple[tuple[str, str], ...]
    offset: float = 0.0
    casting: str = "llama"
    norm_in_place: bool = True
    fused_gate_up: bool = False
    mlp_multipliers: bool = False
    mlp_kind: str = "gated"
    experts: str | None = None
    experts_kind: str = "routed"
    rope: str | None = "rotate_half"
    layer_norm: str | None = None
    layer_norm_modules: tuple[str, ...] = ()
    layer_norm_offset: float = 0.0
    scope: str | None = None
    norm_alias: str | None = None
    params: tuple[tuple[str, object], ...] = _LIGER_SWIGLU
    extras: tuple[tuple[str, object], ...] = _FUSED_MLP
    var_kw: bool = False
    keeps: tuple[tuple[str | None, str], ...] = ()
    decoder: str | None = None

    @property
    def causal_lm(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.heads)

    @property
    def mlp_switch(self) -> str | None:
        names = [n for n, _ in self.params + self.extras]
        return next((n for n in ("swiglu", "geglu", "relu_squared") if n in names), None)


def _f(name, module, norm, mlp, heads, **kw) -> _Family:
    if isinstance(heads, str):
        heads = ((heads, "plain"),)
    return _Family(name, f"transformers.models.{module}.modeling_{module}", norm, mlp, heads, **kw)


def _pre_norm(decoder: str) -> dict:
    """The fields of a family whose decoder layer is the standard pre-norm layer."""
    return dict(decoder=decoder, extras=_FUSED_MLP + _FUSED_ADD_NORM)


_GEMMA = dict(offset=1.0, casting="gemma", params=_LIGER_GEGLU)
_VISION_KEPT = "the vision tower stays on Hugging Face's code; only the text decoder is patched"

_FAMILIES = {
    "llama": _f("llama", "llama", "LlamaRMSNorm", "LlamaMLP", "LlamaForCausalLM", **_pre_norm("LlamaDecoderLayer")),
    "mistral": _f("mistral", "mistral", "MistralRMSNorm", "MistralMLP", "MistralForCausalLM",
                  **_pre_norm("MistralDecoderLayer")),
    "qwen2": _f("qwen2", "qwen2", "Qwen2RMSNorm", "Qwen2MLP", "Qwen2ForCausalLM", **_pre_norm("Qwen2DecoderLayer")),
    "qwen3": _f("qwen3", "qwen3", "Qwen3RMSNorm", "Qwen3MLP", "Qwen3ForCausalLM", **_pre_norm("Qwen3DecoderLayer")),
    "gemma": _f("gemma", "gemma", "GemmaRMSNorm", "GemmaMLP", "GemmaForCausalLM", **_GEMMA,
                **_pre_norm("GemmaDecoderLayer")),
    # Gemma 2 and 3 add a norm's output to the residual stream, so the norm's dY is also the
    # residual's gradient: their backward must not overwrite it (norm_in_place=False).
    "gemma2": _f("gemma2", "gemma2", "Gemma2RMSNorm", "Gemma2MLP", (("Gemma2ForCausalLM", "softcap"),),
                 norm_in_place=False, **_GEMMA),
    "gemma3_text": _f("gemma3_text", "gemma3", "Gemma3RMSNorm", "Gemma3MLP", (("Gemma3ForCausalLM", "softcap"),),
                      norm_in_place=False, **_GEMMA),
    # Gemma3ForConditionalGeneration applies no final logit softcap: neither does its patched loss.
    "gemma3": _f("gemma3", "gemma3", "Gemma3RMSNorm", "Gemma3MLP",
                 (("Gemma3ForCausalLM", "softcap"), ("Gemma3ForConditionalGeneration", "plain")),
                 norm_in_place=False, offset=1.0, casting="gemma", layer_norm="nn",
                 layer_norm_modules=("transformers.models.siglip.modeling_siglip",),
                 params=_P[:3] + (("layer_norm", True), ("rms_norm", True), ("geglu", True), ("model", None))),
    "phi3": _f("phi3", "phi3", "Phi3RMSNorm", "Phi3MLP", "Phi3ForCausalLM", fused_gate_up=True),
    "mixtral": _f("mixtral", "mixtral", "MixtralRMSNorm", None, "MixtralForCausalLM", experts="MixtralExperts",
                  **_pre_norm("MixtralDecoderLayer")),
    "qwen3_moe": _f("qwen3_moe", "qwen3_moe", "Qwen3MoeRMSNorm", "Qwen3MoeMLP", "Qwen3MoeForCausalLM",
                    experts="Qwen3MoeExperts", **_pre_norm("Qwen3MoeDecoderLayer")),
    # OLMo 2 / 3 multiply by the weight in fp32 ((weight * x).to(dtype)): Gemma casting, offset 0;
    # their norms sit after attention / MLP, before the residual add: out of place.
    "olmo2": _f("olmo2", "olmo2", "Olmo2RMSNorm", "Olmo2MLP", "Olmo2ForCausalLM", casting="gemma",
                norm_in_place=False),
    "olmo3": _f("olmo3", "olmo3", "Olmo3RMSNorm", "Olmo3MLP", "Olmo3ForCausalLM", casting="gemma",
                norm_in_place=False),
    # Granite's embedding, residual and attention multipliers are in modules tigon leaves alone; its
    # logits_scaling divides the logits, so the fused loss scales the hidden states by 1 / scaling.
    "granite": _f("granite", "granite", "GraniteRMSNorm", "GraniteMLP", (("GraniteForCausalLM", "granite"),),
                  params=_defaults(_LIGER_SWIGLU, cross_entropy=True, fused_linear_cross_entropy=False)),
    # GLM-4: interleaved pairs of a partial rotary slice; off by default, as in Liger.
    "glm4": _f("glm4", "glm4", "Glm4RMSNorm", "Glm4MLP", "Glm4ForCausalLM", fused_gate_up=True,
               norm_in_place=False, rope="glm", params=_defaults(_LIGER_SWIGLU, rope=False)),
    "gpt_oss": _f("gpt_oss", "gpt_oss", "GptOssRMSNorm", None, "GptOssForCausalLM", casting="gemma",
                  rope="full_table", params=_defaults(_LIGER_SWIGLU, swiglu=False),
                  keeps=(("swiglu", "GPT-OSS's experts clamp gate and up and compute (up + 1) * gate * "
                                    "sigmoid(alpha * gate) on interleaved columns, not SiLU(gate) * up; "
                                    "they stay Hugging Face's"),)),
    "smollm3": _f("smollm3", "smollm3", "SmolLM3RMSNorm", "SmolLM3MLP", "SmolLM3ForCausalLM",
                  **_pre_norm("SmolLM3DecoderLayer")),
    # Falcon-H1: the MLP's gate multiplier goes into the gated kernel, its down multiplier and the
    # model's lm_head_multiplier stay where Hugging Face applies them (the fused loss scales the
    # hidden states); the Mamba mixer and its gated RMSNorm stay Hugging Face's.
    "falcon_h1": _f("falcon_h1", "falcon_h1", "FalconH1RMSNorm", "FalconH1MLP", (("FalconH1ForCausalLM", "falcon_h1"),),
                    mlp_multipliers=True,
                    keeps=(("rms_norm", "the Mamba mixer's gated norm (FalconH1RMSNormGated) stays Hugging Face's"),)),
    # Llama 4: the text model (its Llama4ForCausalLM also inside Llama4ForConditionalGeneration, whose
    # own loss on the language model's logits stays Hugging Face's).
    "llama4": _f("llama4", "llama4", "Llama4TextRMSNorm", "Llama4TextMLP", "Llama4ForCausalLM",
                 experts="Llama4TextExperts", experts_kind="bmm", rope="complex", layer_norm="nn",
                 layer_norm_modules=("transformers.models.llama4.modeling_llama4",),
                 params=_LIGER_SWIGLU + (("layer_norm", True),),
                 keeps=(("rms_norm", "the weightless L2 norm of q and k (Llama4TextL2Norm) stays Hugging Face's"),
                        ("fused_linear_cross_entropy", "Llama4ForConditionalGeneration's loss, on its language "
                                                       "model's logits, stays Hugging Face's"))),
    "qwen2_vl": _f("qwen2_vl", "qwen2_vl", "Qwen2VLRMSNorm", "Qwen2MLP", "Qwen2VLForConditionalGeneration",
                   scope="Qwen2VLTextModel", rope="mrope", norm_alias="Qwen2RMSNorm",
                   params=_P + (("layer_norm", True), ("swiglu", True), ("model", None)),
                   keeps=(("layer_norm", _VISION_KEPT),)),
    "qwen2_5_vl": _f("qwen2_5_vl", "qwen2_5_vl", "Qwen2_5_VLRMSNorm", "Qwen2MLP",
                     "Qwen2_5_VLForConditionalGeneration", scope="Qwen2_5_VLTextModel", rope="mrope",
                     norm_alias="Qwen2RMSNorm"),
    "qwen3_vl": _f("qwen3_vl", "qwen3_vl", "Qwen3VLTextRMSNorm", "Qwen3VLTextMLP", "Qwen3VLForConditionalGeneration",
                   scope="Qwen3VLTextModel", params=_defaults(_LIGER_SWIGLU, swiglu=False)),
    # Phi (no Liger function): partial rotary (the attention rotates its first rotary_ndims channels
    # itself), torch.nn.LayerNorm with bias everywhere, an LM head with bias.
    "phi": _f("phi", "phi", None, None, "PhiForCausalLM", layer_norm="nn",
              layer_norm_modules=("transformers.models.phi.modeling_phi",),
              params=_P[:3] + (("layer_norm", True), ("model", None)), extras=(),
              keeps=((None, "the MLP (fc1, GELU, fc2: not gated) stays Hugging Face's"),)),
    # Nemotron: Liger's function takes relu_squared (the MLP's squared ReLU, not gated: tigon's
    # relu2 kernels); tigon adds rope (partial rotary) and layer_norm (LayerNorm1P), keyword-only.
    "nemotron": _f("nemotron", "nemotron", None, "NemotronMLP", "NemotronForCausalLM",
                   layer_norm="NemotronLayerNorm1P", layer_norm_offset=1.0, mlp_kind="relu2",
                   params=(("relu_squared", True), ("cross_entropy", False), ("fused_linear_cross_entropy", True),
                           ("model", None)),
                   extras=(("rope", True), ("layer_norm", True)), var_kw=True),
}


# ------------------------------------------------------------------------------------------------
# Patching
# ------------------------------------------------------------------------------------------------


def _import(fam: _Family):
    try:
        return importlib.import_module(fam.module)
    except ImportError as e:
        raise ImportError(f"tigon_torch: the installed transformers has no {fam.module} ({fam.name}): {e}") from e


def _class(mod, name: str | None):
    return _original(mod, name) if name and hasattr(mod, name) else None


def _norm_class(mod, fam: _Family):
    """The family's RMSNorm class in the installed transformers (under its older name where the
    modeling module still uses that one)."""
    return _class(mod, fam.norm) or _class(mod, fam.norm_alias)


def _mlp_forward(fam: _Family):
    if fam.mlp_kind == "relu2":
        return _relu2_mlp_forward
    if fam.fused_gate_up:
        return _fused_gate_up_mlp_forward
    return _scaled_gated_mlp_forward if fam.mlp_multipliers else _gated_mlp_forward


def _patch_norm_instance(m: nn.Module, fam: _Family, original_forward, repo=None) -> None:
    _set(m, "_tigon_offset", fam.offset)
    _set(m, "_tigon_casting", fam.casting)
    _set(m, "_tigon_in_place", fam.norm_in_place)
    _set(m, "_tigon_fallback", types.MethodType(original_forward, m))
    _set(m, "forward", types.MethodType(_rms_norm_forward, m))
    if repo is not None:  # the forward is the kernel hooks' layer: say so as kernelize does
        _set(m, "_kernel_repo", repo)


def _patch_mlp_instance(m: nn.Module, fam: _Family, original_forward, fused_mlp: bool) -> None:
    m.__dict__.pop("_tigon_act_kind", None)
    _set(m, "_tigon_fused_mlp", bool(fused_mlp))
    _set(m, "_tigon_fallback", types.MethodType(original_forward, m))
    _set(m, "forward", types.MethodType(_mlp_forward(fam), m))


def _patch_experts_instance(m: nn.Module, fam: _Family, cls: type) -> None:
    m.__dict__.pop("_tigon_act_kind", None)
    _set(m, "_tigon_fallback", types.MethodType(cls.forward, m))
    if fam.experts_kind == "bmm":
        _set(m, "forward", types.MethodType(_bmm_experts_forward, m))
        return
    _set(m, "_tigon_gate_fallback", types.MethodType(cls._apply_gate, m))
    _set(m, "_apply_gate", types.MethodType(_experts_apply_gate, m))
    _set(m, "forward", types.MethodType(_routed_experts_forward, m))


def _patch_layer_norm_instance(m: nn.Module, cls: type, offset: float) -> None:
    _set(m, "_tigon_ln_offset", offset)
    _set(m, "_tigon_fallback", types.MethodType(cls.forward, m))
    _set(m, "forward", types.MethodType(_layer_norm_forward, m))


@functools.cache
def _norm_subclass(base: type, fam: _Family) -> type:
    def fallback(self, x):
        return base.forward(self, x)

    attrs = {
        "forward": _rms_norm_forward,
        "_tigon_fallback": fallback,
        "_tigon_offset": fam.offset,
        "_tigon_casting": fam.casting,
        "_tigon_in_place": fam.norm_in_place,
        "__module__": __name__,
    }
    if hasattr(base, "kernel_layer_name"):  # transformers' kernel hooks: kernelize leaves tigon's modules alone
        attrs["kernel_condition"] = staticmethod(_not_kernelized)
    return type(f"Tigon{base.__name__}", (base,), attrs)


def _not_kernelized(module) -> bool:
    return False


def _mlp_subclass(base: type, fam: _Family, fused_mlp: bool) -> type:
    def fallback(self, x):
        return base.forward(self, x)

    return type(f"Tigon{base.__name__}", (base,), {"forward": _mlp_forward(fam), "_tigon_fallback": fallback,
                                                   "_tigon_fused_mlp": bool(fused_mlp), "__module__": __name__})


def _experts_subclass(base: type, fam: _Family) -> type:
    def fallback(self, *args, **kwargs):
        return base.forward(self, *args, **kwargs)

    attrs = {"_tigon_fallback": fallback, "__module__": __name__}
    if fam.experts_kind == "bmm":
        attrs["forward"] = _bmm_experts_forward
    else:
        def gate_fallback(self, gate_up):
            return base._apply_gate(self, gate_up)

        attrs.update(forward=_routed_experts_forward, _apply_gate=_experts_apply_gate,
                     _tigon_gate_fallback=gate_fallback)
    return type(f"Tigon{base.__name__}", (base,), attrs)


def _patch_modules(root: nn.Module, fam: _Family, mod, sw: dict, hooks: str | None = None) -> None:
    """Patches, in place, the RMSNorm / MLP / experts / LayerNorm modules under root that sw turns on.
    hooks (the norm class has transformers' kernel hook): "route", the norms' forward is the hook's
    layer (the caller routes the model's kernel mapping to it); "subclass", each norm becomes an
    instance of tigon's subclass, which kernelize leaves alone (no model to route yet)."""
    norm_cls, mlp_cls, experts_cls = _norm_class(mod, fam), _class(mod, fam.mlp), _class(mod, fam.experts)
    ln_cls = nn.LayerNorm if fam.layer_norm == "nn" else _class(mod, fam.layer_norm)
    repo = None
    if hooks == "route":
        from .kernel_hooks import REPOSITORY as repo
    for m in root.modules():
        if sw["rms_norm"] and norm_cls is not None and isinstance(m, norm_cls):
            if hooks == "subclass":
                _UNDO.append((m, "__class__", type(m)))
                m.__class__ = _norm_subclass(norm_cls, fam)
            else:
                _patch_norm_instance(m, fam, norm_cls.forward, repo)
        elif sw["mlp"] and mlp_cls is not None and isinstance(m, mlp_cls):
            _patch_mlp_instance(m, fam, mlp_cls.forward, sw["fused_mlp"])
        elif sw["mlp"] and experts_cls is not None and isinstance(m, experts_cls):
            _patch_experts_instance(m, fam, experts_cls)
        elif sw["layer_norm"] and ln_cls is not None and (type(m) is nn.LayerNorm if fam.layer_norm == "nn"
                                                         else isinstance(m, ln_cls)):
            _patch_layer_norm_instance(m, ln_cls, fam.layer_norm_offset)


def _scoped_init(init, fam: _Family, mod, sw: dict):
    norm_cls = _norm_class(mod, fam)
    hooks = "subclass" if norm_cls is not None and hasattr(norm_cls, "kernel_layer_name") else None

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _patch_modules(self, fam, mod, sw, hooks)

    __init__.__wrapped__ = init
    return __init__


def _patch_classes(fam: _Family, mod, sw: dict) -> None:
    if fam.scope is not None:  # the text model patches its own modules when it is built
        scope = _class(mod, fam.scope)
        if scope is not None and any(sw[k] for k in ("rms_norm", "mlp", "layer_norm")):
            _set(scope, "__init__", _scoped_init(_original(mod, f"{fam.scope}.__init__", scope.__init__), fam, mod,
                                                 sw))
        return
    norm_cls, mlp_cls, experts_cls = _norm_class(mod, fam), _class(mod, fam.mlp), _class(mod, fam.experts)
    if sw["rms_norm"] and norm_cls is not None:
        _set(mod, norm_cls.__name__, _norm_subclass(norm_cls, fam))
    if sw["mlp"] and mlp_cls is not None:
        _set(mod, fam.mlp, _mlp_subclass(mlp_cls, fam, sw["fused_mlp"]))
    if sw["mlp"] and experts_cls is not None:
        _set(mod, fam.experts, _experts_subclass(experts_cls, fam))
    if sw["layer_norm"] and fam.layer_norm == "nn":
        view = _TorchNNView(LayerNorm=_layer_norm_subclass())
        for name in fam.layer_norm_modules:
            _set(importlib.import_module(name), "nn", view)
    elif sw["layer_norm"] and fam.layer_norm is not None:
        ln_cls = _class(mod, fam.layer_norm)
        if ln_cls is not None:
            _set(mod, fam.layer_norm, _layer_norm_subclass(ln_cls, fam.layer_norm_offset))


# ------------------------------------------------------------------------------------------------
# Decoder layers: each residual add fused with the RMSNorm after it
# ------------------------------------------------------------------------------------------------
#
# A pre-norm decoder layer (Llama's and the families that copy it) computes
#     h = x + attn(norm1(x));  out = h + mlp(norm2(h))
# and the next layer (or the model's final norm) starts with norm(out). The patched layer runs
#     (n2, h) = add_rms_norm(attn(n1), x);   (n_next, out) = add_rms_norm(mlp(n2), h)
# so no residual add is a kernel of its own, forward or backward (add + RMSNorm's backward also sums
# the residual stream's gradient). The second add needs the next norm's weight: the text model links
# each layer to the norm after it, and the layer leaves (out, n_next) on that norm, which returns
# n_next when it is called on that very tensor (anything else, or no link, computes the norm as usual).
# The hand-off is skipped under gradient checkpointing (Hugging Face's, or any wrapper's: saved-tensor
# hooks set, or a forward recomputed during a backward; a recomputed layer would leave a normed tensor
# nobody takes) and under torch.compile; the add inside the layer is fused there too. A norm
# with hooks, or whose weight is not a plain tensor (ZeRO-3, FSDP2 before its layer runs), is never
# fused: its own forward runs.

_STANDARD_DECODER = (
    "residual = hidden_states",
    "hidden_states = self.input_layernorm(hidden_states)",
    None,  # hidden_states, _ = self.self_attn(hidden_states=hidden_states, <the layer's arguments>)
    "hidden_states = residual + hidden_states",
    "residual = hidden_states",
    "hidden_states = self.post_attention_layernorm(hidden_states)",
    "hidden_states = self.mlp(hidden_states)",
    "hidden_states = residual + hidden_states",
    "return hidden_states",
)


@dataclass(frozen=True)
class _DecoderSpec:
    """A decoder layer forward's parameters: their defaults (what the layer passes the attention when a
    caller leaves them out) and the names it takes."""

    defaults: tuple[tuple[str, object], ...]
    names: frozenset


@functools.cache
def _decoder_spec(forward) -> _DecoderSpec | None:
    """The spec of a decoder layer's forward when its code is the standard pre-norm layer (the
    statements of _STANDARD_DECODER, the attention given every argument of the layer by name), else
    None: a layer written otherwise keeps Hugging Face's forward."""
    import ast

    fn = inspect.unwrap(forward)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    body = [st for st in tree.body[0].body
            if not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))]  # docstrings
    if len(body) != len(_STANDARD_DECODER):
        return None
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())[1:]  # after self
    if not params or params[0].name != "hidden_states":
        return None
    named = [p for p in params[1:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    var_kw = next((p.name for p in params if p.kind == p.VAR_KEYWORD), None)
    for st, want in zip(body, _STANDARD_DECODER):
        if want is not None:
            if ast.unparse(st) != want:
                return None
            continue
        # hidden_states, _ = self.self_attn(hidden_states=hidden_states, a=a, ..., **kwargs)
        if not (isinstance(st, ast.Assign) and isinstance(st.value, ast.Call)
                and ast.unparse(st.value.func) == "self.self_attn" and not st.value.args
                and ast.unparse(st.targets[0]).startswith("(hidden_states, ")):
            return None
        kws = {}
        for kw in st.value.keywords:
            if not isinstance(kw.value, ast.Name):
                return None
            kws[kw.arg] = kw.value.id
        want_kws = {"hidden_states": "hidden_states", **{p.name: p.name for p in named}}
        if var_kw is not None:
            want_kws[None] = var_kw
        if kws != want_kws:
            return None
    defaults = tuple((p.name, p.default) for p in named if p.default is not inspect.Parameter.empty)
    return _DecoderSpec(defaults, frozenset(p.name for p in named))


def _fusable(norm, x: torch.Tensor) -> bool:
    """Whether norm is a tigon-patched RMSNorm that can run fused with an add on x without its forward:
    no hooks on it (DeepSpeed ZeRO-3 gathers a module's weight in its forward's pre-hook, Accelerate
    moves it in _hf_hook) and a plain weight on x's device (a DTensor is a weight FSDP2 or tensor
    parallelism has not gathered: the layer it belongs to has not run yet)."""
    w = getattr(norm, "weight", None)
    return (getattr(norm, "_tigon_offset", None) is not None and _rms_supported(x, w)
            and (w is None or (type(w) in (nn.Parameter, torch.Tensor) and w.device == x.device
                               and not hasattr(w, "ds_id")))
            and F._hookless(norm) and F._no_global_hooks())


def _add_norm(norm, x: torch.Tensor, residual: torch.Tensor):
    """(norm(x + residual), x + residual) in one tigon call. Operands of different dtypes (autocast: a
    bfloat16 attention or MLP output on a float32 residual stream) are first cast to the promoted dtype,
    exactly, as Hugging Face's `residual + x` promotes them."""
    if x.dtype != residual.dtype:
        dtype = torch.promote_types(x.dtype, residual.dtype)
        x, residual = x.to(dtype), residual.to(dtype)
    eps = norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps
    return F.tigon_fused_add_rms_norm(x, residual, norm.weight, eps, norm._tigon_offset, norm._tigon_casting,
                                      norm._tigon_in_place)


def _prenormed(norm, x: torch.Tensor):
    """The normed tensor the layer before left on norm for x, or None. A normed tensor outside x's
    autograd graph (a layer run under reentrant checkpointing, which returns its output through the
    checkpoint's function) is not taken."""
    if _compiling() or "_tigon_prenormed" not in norm.__dict__:
        return None
    out, normed = norm.__dict__.pop("_tigon_prenormed")
    return normed if out is x and normed.requires_grad == x.requires_grad else None


def _checkpointed() -> bool:
    """Whether this forward may be checkpointed by a wrapper the patch does not know of: saved-tensor
    hooks are set (non-reentrant checkpointing, activation offloading: the recomputation must save what
    the forward saved, so the forward must not depend on anything else), or autograd is running a
    backward pass (a reentrant checkpoint recomputing its forward)."""
    hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    task = getattr(torch._C, "_current_graph_task_id", None)
    return (hooks is not None and hooks(False) is not None) or (task is not None and task() != -1)


def _next_norm(layer, x: torch.Tensor):
    ref = layer.__dict__.get("_tigon_next_norm")
    if ref is None or getattr(layer, "gradient_checkpointing", False) or _compiling() or _checkpointed():
        return None
    norm = ref()
    return norm if norm is not None and _fusable(norm, x) else None


def _decoder_forward(self, hidden_states, *args, **kwargs):
    spec = self._tigon_decoder_spec
    if args or not (_fusable(self.post_attention_layernorm, hidden_states)
                    and _fusable(self.input_layernorm, hidden_states)):
        return self._tigon_layer_fallback(hidden_states, *args, **kwargs)
    if "past_key_values" in kwargs and "cache" in spec.names and "past_key_values" not in spec.names:
        kwargs["cache"] = kwargs.pop("past_key_values")  # the name transformers 5.25 deprecates
    call = {name: value for name, value in spec.defaults if name not in kwargs}
    call.update(kwargs)
    residual = hidden_states
    normed = _prenormed(self.input_layernorm, residual)
    if normed is None:
        normed = self.input_layernorm(residual)
    attn = self.self_attn(hidden_states=normed, **call)[0]
    normed, residual = _add_norm(self.post_attention_layernorm, attn, residual)
    mlp = self.mlp(normed)
    nxt = _next_norm(self, residual)
    if nxt is None:
        return residual + mlp
    normed, out = _add_norm(nxt, mlp, residual)
    nxt.__dict__["_tigon_prenormed"] = (out, normed)
    return out


def _link_decoder_layers(text_model: nn.Module, decoder_cls: type) -> None:
    """Links each decoder layer of text_model to the norm that runs after it (the next layer's
    input_layernorm, the last layer's: the model's final norm)."""
    layers = list(getattr(text_model, "layers", None) or ())
    final = getattr(text_model, "norm", None)
    for i, layer in enumerate(layers):
        if not isinstance(layer, decoder_cls):
            continue
        if i + 1 < len(layers):
            nxt = getattr(layers[i + 1], "input_layernorm", None) if isinstance(layers[i + 1], decoder_cls) else None
        else:
            nxt = final
        if nxt is not None:
            _UNDO.append((layer, "_tigon_next_norm", layer.__dict__.get("_tigon_next_norm", _MISSING)))
            layer.__dict__["_tigon_next_norm"] = weakref.ref(nxt)


def _decoder_classes(fam: _Family, mod):
    """(decoder layer class, text model class, spec) when fam's decoder layer is the standard pre-norm
    layer in the installed transformers, else None."""
    if fam.decoder is None:
        return None
    decoder_cls = _class(mod, fam.decoder)
    model_cls = _class(mod, fam.decoder.replace("DecoderLayer", "Model"))
    if decoder_cls is None or model_cls is None:
        return None
    original = _original(mod, f"{fam.decoder}.forward", decoder_cls.forward)
    spec = _decoder_spec(original)
    if spec is None:
        logger.info("tigon_torch %s: %s is not the standard pre-norm layer in this transformers; its residual "
                    "adds stay Hugging Face's", fam.name, fam.decoder)
        return None
    return decoder_cls, model_cls, spec, original


def _patch_decoders(fam: _Family, mod, model) -> None:
    """The decoder layers' fused adds: the classes (model None: the layer's forward, and the text model's
    __init__ links the layers it builds) or the instances under model."""
    found = _decoder_classes(fam, mod)
    if found is None:
        return
    decoder_cls, model_cls, spec, original = found
    if model is None:
        _set(decoder_cls, "_tigon_decoder_spec", spec)
        _set(decoder_cls, "_tigon_layer_fallback", original)
        _set(decoder_cls, "forward", _decoder_forward)
        init = _original(mod, f"{model_cls.__name__}.__init__", model_cls.__init__)

        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)
            _link_decoder_layers(self, decoder_cls)

        __init__.__wrapped__ = init
        _set(model_cls, "__init__", __init__)
        return
    for m in model.modules():
        if isinstance(m, decoder_cls):
            _set(m, "_tigon_decoder_spec", spec)
            _set(m, "_tigon_layer_fallback", types.MethodType(original, m))
            _set(m, "forward", types.MethodType(_decoder_forward, m))
        elif isinstance(m, model_cls):
            _link_decoder_layers(m, decoder_cls)


# The switches _apply reads, and the one each parameter name sets (swiglu / geglu / relu_squared: the
# MLP; any other name only its own).
_SWITCHES = ("rope", "rms_norm", "mlp", "layer_norm", "fused_mlp", "fused_add_norm", "cross_entropy",
             "fused_linear_cross_entropy")
_SWITCH = {"swiglu": "mlp", "geglu": "mlp", "relu_squared": "mlp"}


def _apply(fam: _Family, sw: dict, model) -> None:
    """Patches fam with the switches sw: rope, rms_norm, mlp (swiglu / geglu), layer_norm, fused_mlp,
    fused_add_norm (with rms_norm), cross_entropy, fused_linear_cross_entropy (missing ones are off)."""
    sw = dict.fromkeys(_SWITCHES, False) | {k: bool(v) for k, v in sw.items()}
    if sw["cross_entropy"] and sw["fused_linear_cross_entropy"]:
        raise ValueError("cross_entropy and fused_linear_cross_entropy cannot both be True")
    mod = _import(fam)
    for switch, why in fam.keeps:
        if switch is None or sw.get(_SWITCH.get(switch, switch)):
            logger.info("tigon_torch %s: %s", fam.name, why)

    if sw["rope"] and fam.rope is not None:
        for name, make in _ROPES[fam.rope]:
            if hasattr(mod, name):
                _set(mod, name, make(_original(mod, name)))

    heads = [(getattr(mod, n), rule) for n, rule in fam.heads if hasattr(mod, n)]
    use_loss = sw["cross_entropy"] or sw["fused_linear_cross_entropy"]
    if model is None:
        if use_loss:
            for cls, rule in heads:
                original = _pre_tigon(_original(mod, f"{cls.__name__}.forward", cls.forward))
                _set(cls, "forward", _loss_forward(original, rule))
                _set(cls, "_tigon_flce", sw["fused_linear_cross_entropy"])
                _set(cls, "_tigon_ce", sw["cross_entropy"])
        _patch_classes(fam, mod, sw)
        if sw["rms_norm"] and sw["fused_add_norm"]:
            _patch_decoders(fam, mod, None)
        return

    scope = _class(mod, fam.scope)
    if scope is None:
        roots = [model]
    else:
        roots = [m for m in model.modules() if isinstance(m, scope)]
    norm_cls = _norm_class(mod, fam)
    hooks = None
    if sw["rms_norm"] and norm_cls is not None and hasattr(norm_cls, "kernel_layer_name"):
        from . import kernel_hooks

        if kernel_hooks.usable(model, norm_cls):
            hooks = "route"
            kernel_hooks.route(model, norm_cls, _set)
    for root in roots:
        _patch_modules(root, fam, mod, sw, hooks)
    if sw["rms_norm"] and sw["fused_add_norm"]:
        _patch_decoders(fam, mod, model)
    if use_loss and heads:
        classes = tuple(cls for cls, _ in heads)
        for m in model.modules():
            if isinstance(m, classes):
                rule = next(r for cls, r in heads if isinstance(m, cls))
                _set(m, "_tigon_flce", sw["fused_linear_cross_entropy"])
                _set(m, "_tigon_ce", sw["cross_entropy"])
                _set(m, "forward", types.MethodType(_loss_forward(_pre_tigon(type(m).forward), rule), m))




def _make(family: str):
    fam = _FAMILIES[family]
    POS, KW = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter(n, POS, default=d) for n, d in fam.params]
    params += [inspect.Parameter(n, KW, default=d) for n, d in fam.extras]
    if fam.var_kw:
        params.append(inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD))
    sig = inspect.Signature(params, return_annotation=None)

    def apply(*args, **kwargs) -> None:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        values = dict(bound.arguments)
        ignored = values.pop("kwargs", {}) if fam.var_kw else {}
        if ignored:
            logger.info("tigon_torch %s: ignoring %s", fam.name, ", ".join(sorted(ignored)))
        model = values.pop("model")
        sw = {_SWITCH.get(k, k): v for k, v in values.items()}
        _apply(fam, sw, model)

    apply.__signature__ = sig
    apply.__name__ = f"apply_tigon_to_{family}"
    apply.__qualname__ = apply.__name__
    apply.__doc__ = _doc(fam)
    return apply


def _doc(fam: _Family) -> str:
    parts = []
    if fam.rope:
        parts.append("RoPE" + {"full_table": " (GPT-OSS's half-width tables)", "glm": " (interleaved pairs)",
                               "complex": " (apply_rotary_emb, complex pairs)"}.get(fam.rope, ""))
    if fam.norm:
        parts.append(f"{fam.norm} (offset {fam.offset}, casting '{fam.casting}')")
    if fam.mlp:
        act = {"geglu": "GeGLU", "relu_squared": "squared ReLU"}.get(fam.mlp_switch, "SwiGLU")
        parts.append(f"{fam.mlp} ({act}, switch {fam.mlp_switch})")
    if fam.experts and fam.mlp_switch:
        parts.append(f"{fam.experts} (each expert's act(gate) * up, switch {fam.mlp_switch})")
    if fam.layer_norm:
        parts.append("torch.nn.LayerNorm modules" if fam.layer_norm == "nn" else fam.layer_norm)
    if fam.decoder:
        parts.append(f"{fam.decoder}'s residual adds, each fused with the RMSNorm after it (switch fused_add_norm)")
    parts.append(f"the loss of {', '.join(fam.causal_lm)}")
    text = f"Patches {fam.module} with tigon's kernels: {'; '.join(parts)}."
    if fam.scope:
        text += f" Only modules inside {fam.scope} are patched: {_VISION_KEPT}."
    for _, why in fam.keeps:
        text += f" Note: {why}."
    signature = ", ".join(f"{n}={d!r}" for n, d in fam.params)
    liger = "Liger-Kernel has no patch for this family" if fam.name == "phi" else (
        f"Liger's apply_liger_kernel_to_{fam.name} parameters, order and defaults")
    text += (f"\n\n({signature}): {liger}. model=None patches the classes (models built afterwards); a model is "
             "patched in place. cross_entropy and fused_linear_cross_entropy are exclusive.")
    if fam.extras:
        text += " Keyword-only (tigon): " + ", ".join(f"{n}={d!r}" for n, d in fam.extras) + "."
    if any(n == "fused_mlp" for n, _ in fam.extras):
        text += (" fused_mlp: the MLP's three projections and its activation as one autograd function that keeps "
                 "only the two input projections for the backward and recomputes the gated product there.")
    return text


apply_tigon_to_llama = _make("llama")
apply_tigon_to_mistral = _make("mistral")
apply_tigon_to_qwen2 = _make("qwen2")
apply_tigon_to_qwen3 = _make("qwen3")
apply_tigon_to_gemma = _make("gemma")
apply_tigon_to_gemma2 = _make("gemma2")
apply_tigon_to_gemma3_text = _make("gemma3_text")
apply_tigon_to_gemma3 = _make("gemma3")
apply_tigon_to_phi3 = _make("phi3")
apply_tigon_to_mixtral = _make("mixtral")
apply_tigon_to_qwen3_moe = _make("qwen3_moe")
apply_tigon_to_olmo2 = _make("olmo2")
apply_tigon_to_olmo3 = _make("olmo3")
apply_tigon_to_granite = _make("granite")
apply_tigon_to_glm4 = _make("glm4")
apply_tigon_to_gpt_oss = _make("gpt_oss")
apply_tigon_to_smollm3 = _make("smollm3")
apply_tigon_to_falcon_h1 = _make("falcon_h1")
apply_tigon_to_llama4 = _make("llama4")
apply_tigon_to_qwen2_vl = _make("qwen2_vl")
apply_tigon_to_qwen2_5_vl = _make("qwen2_5_vl")
apply_tigon_to_qwen3_vl = _make("qwen3_vl")
apply_tigon_to_phi = _make("phi")
apply_tigon_to_nemotron = _make("nemotron")


# config.model_type -> apply function (the model types of transformers' auto classes; a text model's
# own type, e.g. qwen2_vl_text, maps to its family).
MODEL_TYPE_TO_APPLY_FN = {
    "llama": apply_tigon_to_llama,
    "mistral": apply_tigon_to_mistral,
    "qwen2": apply_tigon_to_qwen2,
    "qwen3": apply_tigon_to_qwen3,
    "gemma": apply_tigon_to_gemma,
    "gemma2": apply_tigon_to_gemma2,
    "gemma3_text": apply_tigon_to_gemma3_text,
    "gemma3": apply_tigon_to_gemma3,
    "phi3": apply_tigon_to_phi3,
    "mixtral": apply_tigon_to_mixtral,
    "qwen3_moe": apply_tigon_to_qwen3_moe,
    "olmo2": apply_tigon_to_olmo2,
    "olmo3": apply_tigon_to_olmo3,
    "granite": apply_tigon_to_granite,
    "glm4": apply_tigon_to_glm4,
    "gpt_oss": apply_tigon_to_gpt_oss,
    "smollm3": apply_tigon_to_smollm3,
    "falcon_h1": apply_tigon_to_falcon_h1,
    "llama4": apply_tigon_to_llama4,
    "llama4_text": apply_tigon_to_llama4,
    "qwen2_vl": apply_tigon_to_qwen2_vl,
    "qwen2_vl_text": apply_tigon_to_qwen2_vl,
    "qwen2_5_vl": apply_tigon_to_qwen2_5_vl,
    "qwen2_5_vl_text": apply_tigon_to_qwen2_5_vl,
    "qwen3_vl": apply_tigon_to_qwen3_vl,
    "qwen3_vl_text": apply_tigon_to_qwen3_vl,
    "phi": apply_tigon_to_phi,
    "nemotron": apply_tigon_to_nemotron,
}


def _unsupported(model_type) -> NotImplementedError:
    return NotImplementedError(
        f"tigon_torch has no patch for model_type {model_type!r}; "
        f"supported: {', '.join(sorted(MODEL_TYPE_TO_APPLY_FN))}")


def apply_tigon_to_model(model, **kwargs) -> None:
    """Patches an instantiated model in place, the family read from model.config.model_type. Unlike
    _apply_tigon_to_instance, an unsupported model type raises NotImplementedError (naming the
    supported ones) and a keyword the family's apply function does not take raises TypeError."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    fn = MODEL_TYPE_TO_APPLY_FN.get(model_type)
    if fn is None:
        raise _unsupported(model_type)
    fn(model=model, **kwargs)


def _applicable(fn, kwargs: dict) -> dict:
    params = inspect.signature(fn).parameters
    dropped = sorted(k for k in kwargs if k not in params)
    if dropped:
        logger.info("%s takes no %s; passing the rest", fn.__name__, ", ".join(dropped))
    return {k: v for k, v in kwargs.items() if k in params}


def _apply_tigon(model_type: str, **kwargs) -> None:
    """Liger's _apply_liger_kernel: patches the classes of model_type's family (before the model is
    built) with the keyword arguments its apply function takes; the others are dropped (logged), and a
    model type without a patch patches nothing (logged), as in Liger."""
    fn = MODEL_TYPE_TO_APPLY_FN.get(model_type) if model_type else None
    if fn is None:
        logger.info("tigon_torch has no patch for model_type %r; nothing patched", model_type)
        return
    fn(**_applicable(fn, kwargs))


def _apply_tigon_to_instance(model, **kwargs) -> None:
    """Liger's _apply_liger_kernel_to_instance: patches an instantiated model in place, the family read
    from model.config.model_type, with the keyword arguments its apply function takes (the others
    dropped, logged); a model type without a patch patches nothing (logged), as in Liger."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    fn = MODEL_TYPE_TO_APPLY_FN.get(model_type) if model_type else None
    if fn is None:
        logger.info("tigon_torch has no patch for model_type %r; nothing patched", model_type)
        return
    fn(model=model, **_applicable(fn, kwargs))


def _patch_switch_names() -> frozenset:
    names = set()
    for fn in set(MODEL_TYPE_TO_APPLY_FN.values()):
        names.update(p.name for p in inspect.signature(fn).parameters.values()
                     if p.kind is not inspect.Parameter.VAR_KEYWORD and p.name != "model")
    return frozenset(names)


class AutoTigonForCausalLM:
    """Liger's AutoLigerKernelForCausalLM: transformers' AutoModelForCausalLM with tigon's patch for the
    config's model_type applied (to the classes, before the model is built).

        model = AutoTigonForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16, fused_mlp=False)

    Keywords of the patch functions (rope, rms_norm, swiglu, geglu, layer_norm, cross_entropy,
    fused_linear_cross_entropy, fused_mlp, relu_squared) go to the family's apply function (those it
    does not take are dropped, logged); the others go to transformers. A model type without a patch
    raises NotImplementedError naming the supported ones."""

    @staticmethod
    def _split(kwargs: dict) -> tuple[dict, dict]:
        names = _patch_switch_names()
        return ({k: v for k, v in kwargs.items() if k in names}, {k: v for k, v in kwargs.items() if k not in names})

    @staticmethod
    def _patch(config, tigon_kwargs: dict) -> None:
        model_type = getattr(config, "model_type", None)
        fn = MODEL_TYPE_TO_APPLY_FN.get(model_type)
        if fn is None:
            raise _unsupported(model_type)
        fn(**_applicable(fn, tigon_kwargs))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        from transformers import AutoConfig, AutoModelForCausalLM

        tigon_kwargs, hf_kwargs = cls._split(kwargs)
        config = hf_kwargs.get("config")
        if config is None:
            config_kwargs = {k: v for k, v in hf_kwargs.items()
                             if k in ("revision", "trust_remote_code", "cache_dir", "token", "local_files_only",
                                      "subfolder", "code_revision", "force_download", "proxies")}
            config = AutoConfig.from_pretrained(pretrained_model_name_or_path, **config_kwargs)
        cls._patch(config, tigon_kwargs)
        return AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *model_args, **hf_kwargs)

    @classmethod
    def from_config(cls, config, **kwargs):
        from transformers import AutoModelForCausalLM

        tigon_kwargs, hf_kwargs = cls._split(kwargs)
        cls._patch(config, tigon_kwargs)
        return AutoModelForCausalLM.from_config(config, **hf_kwargs)

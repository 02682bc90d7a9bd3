"""One-line patching of Hugging Face transformers (5.x) models with tigon's kernels.

    from tigon_torch import apply_tigon_to_llama
    apply_tigon_to_llama()                     # before the model is built: patches the classes
    model = AutoModelForCausalLM.from_pretrained(...)

    apply_tigon_to_llama(model=model)          # or an instantiated model, in place

Each apply_tigon_to_<family> takes the parameters of Liger-Kernel's apply_liger_kernel_to_<family>, in
its order, with its defaults: (rope=True, cross_entropy=False, fused_linear_cross_entropy=True,
rms_norm=True, swiglu=True, model=None), geglu= instead of swiglu= for the Gemma families, and
layer_norm=True before rms_norm for Gemma 3; then tigon's fused_mlp=True, keyword-only.

What each switch replaces:
  rope                        the modeling module's apply_rotary_pos_emb (a module-level function, so
                              this applies to every model of the family, built or not)
  rms_norm                    the family's RMSNorm (Llama casting; Gemma: offset 1, Gemma casting)
  swiglu / geglu              the MLP's act(gate) * up (SwiGLU, or GeGLU for the Gemma family; Phi-3's
                              fused gate_up projection is read in place)
  layer_norm                  (Gemma 3) the torch.nn.LayerNorm modules of the SigLIP vision tower
  fused_mlp                   with swiglu / geglu, a gate / up / down MLP of plain bias-free nn.Linear
                              modules (no PEFT adapter, no hook, no autocast) runs as one autograd
                              function (TigonGatedMLPFunction) that does not keep the down projection's
                              input, act(gate) * up, for the backward but recomputes it there: N x I
                              values per layer fewer between forward and backward; otherwise the
                              projections run as modules and only the activation is fused
  cross_entropy               the causal-LM loss on materialised logits
  fused_linear_cross_entropy  in training with labels, the causal-LM forward skips the logits and
                              computes the loss from the last hidden states and the LM head
                              (honouring num_items_in_batch, shift_labels, ignore_index and Gemma's
                              final logit softcap); outputs.logits is then None

Class patching (model=None) replaces the modeling module's RMSNorm / MLP classes by subclasses (same
__init__, same parameters, so checkpoints load unchanged) and the causal-LM class's forward; models
built before the call keep their modules, but share the new causal-LM forward and the RoPE function.
With model=..., that model's modules are patched in place (their forward methods rebound); only the
RoPE function, a module-level function the attention calls, is replaced for the whole family. Tensors that
are not on a CUDA device, and dtype combinations tigon does not cover, go through the original
Hugging Face code. unpatch() undoes every patch made through this module.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import types
from dataclasses import dataclass, field

import torch
from torch import nn

from . import functional as F
from . import ops as _ops
from .functions import TigonFusedGateUpMulFunction, TigonGatedMulFunction

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
    w = self.weight
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


def _mlp_kind(self) -> str | None:
    kind = self.__dict__.get("_tigon_act_kind", _MISSING)
    if kind is _MISSING:
        act = getattr(self, "act_fn", None) or getattr(self, "activation_fn", None)
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
        return self.down_proj(self.act_fn(a) * b)
    return self.down_proj(TigonGatedMulFunction.apply(a, b, kind, 1.0, 1.0))


def _fused_gate_up_mlp_forward(self, hidden_states):
    kind = _mlp_kind(self)
    if kind is None or not _ops.on_device(hidden_states):
        return self._tigon_fallback(hidden_states)
    gate_up = self.gate_up_proj(hidden_states)
    if gate_up.dtype not in _FLOAT_TYPES:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(up * self.activation_fn(gate))
    return self.down_proj(TigonFusedGateUpMulFunction.apply(gate_up, kind))


def _causal_lm_forward(
    self,
    input_ids=None,
    attention_mask=None,
    position_ids=None,
    past_key_values=None,
    inputs_embeds=None,
    labels=None,
    use_cache=None,
    logits_to_keep=0,
    **kwargs,
):
    """The causal-LM forward of Hugging Face 5.x with the loss through tigon: in training with labels
    (and fused_linear_cross_entropy on), the loss comes from the hidden states and the LM head
    without the logits (outputs.logits is None); otherwise the logits are computed as usual and the
    loss, if any, by tigon's cross-entropy (cross_entropy on) or the model's loss function."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    outputs = self.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        **kwargs,
    )
    hidden_states = outputs.last_hidden_state
    slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    kept = hidden_states[:, slice_indices, :]
    softcap = getattr(self.config, "final_logit_softcapping", None)
    shift_labels = kwargs.get("shift_labels")
    has_labels = labels is not None or shift_labels is not None
    loss, logits = None, None
    if has_labels and self.training and self._tigon_flce and _ops.on_device(kept):
        loss = F.tigon_causal_lm_loss(
            kept,
            self.lm_head.weight,
            labels,
            lm_head_bias=self.lm_head.bias,
            shift_labels=shift_labels,
            num_items_in_batch=kwargs.get("num_items_in_batch"),
            ignore_index=kwargs.get("ignore_index", -100),
            final_logit_softcapping=softcap,
        )
    else:
        logits = self.lm_head(kept)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        if has_labels:
            if self._tigon_ce and _ops.on_device(logits):
                extra = {k: kwargs[k] for k in ("num_items_in_batch", "ignore_index", "shift_labels") if k in kwargs}
                loss = F.tigon_causal_lm_loss_from_logits(logits, labels, self.config.vocab_size, **extra)
            else:
                loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
    return CausalLMOutputWithPast(
        loss=loss,
        logits=logits,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )


def _wrap_causal_lm_forward():
    try:
        from transformers.utils import can_return_tuple
    except ImportError:  # pragma: no cover
        return _causal_lm_forward
    return can_return_tuple(_causal_lm_forward)


def _layer_norm_supported(m: nn.LayerNorm, x: torch.Tensor) -> bool:
    if not _ops.on_device(x) or x.dtype not in _FLOAT_TYPES or x.numel() == 0:
        return False
    if len(m.normalized_shape) != 1 or torch.is_autocast_enabled(x.device.type):
        return False  # autocast runs layer_norm in fp32: Hugging Face's code keeps that
    return all(t is None or t.dtype == x.dtype for t in (m.weight, m.bias))


def _layer_norm_forward(self, x):
    if not _layer_norm_supported(self, x):
        return self._tigon_fallback(x)
    return F.tigon_layer_norm(x, self.weight, self.bias, self.eps)


def _layer_norm_subclass() -> type:
    def fallback(self, x):
        return nn.LayerNorm.forward(self, x)

    return type("TigonNNLayerNorm", (nn.LayerNorm,), {"forward": _layer_norm_forward, "_tigon_fallback": fallback,
                                                     "__module__": __name__})


class _TorchNNView(types.ModuleType):
    """torch.nn as one modeling module sees it, with some of its classes replaced (so that patching
    that module's nn.LayerNorm leaves torch.nn itself alone)."""

    def __init__(self, **replaced):
        super().__init__("torch.nn")
        self.__dict__.update(replaced)

    def __getattr__(self, name):
        return getattr(nn, name)


def _multimodal_forward(original):
    """Gemma3ForConditionalGeneration's forward (transformers 5.x) with the loss through tigon, as
    _causal_lm_forward for the text model: in training with labels (fused_linear_cross_entropy on) the
    loss comes from the language model's hidden states and the LM head without the logits
    (outputs.logits is None); with cross_entropy on, from the logits by tigon's cross-entropy;
    otherwise, and for tensors not on a CUDA device, Hugging Face's forward runs."""

    def forward(self, input_ids=None, pixel_values=None, attention_mask=None, position_ids=None,
                past_key_values=None, token_type_ids=None, inputs_embeds=None, labels=None, use_cache=None,
                logits_to_keep=0, **kwargs):
        inputs = dict(input_ids=input_ids, pixel_values=pixel_values, attention_mask=attention_mask,
                      position_ids=position_ids, past_key_values=past_key_values, token_type_ids=token_type_ids,
                      inputs_embeds=inputs_embeds, use_cache=use_cache)
        shift_labels = kwargs.get("shift_labels")
        has_labels = labels is not None or shift_labels is not None
        on_device = _ops.on_device(self.lm_head.weight)
        if has_labels and on_device and self.training and self._tigon_flce:
            outputs = self.model(**inputs, labels=labels, return_dict=True, **kwargs)
            hidden = outputs.last_hidden_state
            slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
            loss = F.tigon_causal_lm_loss(
                hidden[:, slice_indices, :],
                self.lm_head.weight,
                labels,
                lm_head_bias=self.lm_head.bias,
                shift_labels=shift_labels,
                num_items_in_batch=kwargs.get("num_items_in_batch"),
                ignore_index=kwargs.get("ignore_index", -100),
            )  # no final logit softcap: Hugging Face's multimodal forward applies none
            out_cls = importlib.import_module(type(self).__module__).Gemma3CausalLMOutputWithPast
            return out_cls(loss=loss, logits=None, past_key_values=outputs.past_key_values,
                           hidden_states=outputs.hidden_states, attentions=outputs.attentions,
                           image_hidden_states=outputs.image_hidden_states)
        if has_labels and on_device and self._tigon_ce:
            out = original(self, **inputs, labels=None, logits_to_keep=logits_to_keep, return_dict=True, **kwargs)
            extra = {k: kwargs[k] for k in ("num_items_in_batch", "ignore_index", "shift_labels") if k in kwargs}
            loss = F.tigon_causal_lm_loss_from_logits(out.logits, labels, self.config.text_config.vocab_size, **extra)
            return type(out)(loss=loss, **{k: v for k, v in out.items() if k != "loss"})
        return original(self, **inputs, labels=labels, logits_to_keep=logits_to_keep, return_dict=True, **kwargs)

    try:
        from transformers.utils import can_return_tuple
    except ImportError:  # pragma: no cover
        return forward
    return can_return_tuple(forward)


# ------------------------------------------------------------------------------------------------
# Families
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Family:
    name: str
    module: str
    norm: str
    mlp: str
    causal_lm: tuple[str, ...]
    offset: float = 0.0
    casting: str = "llama"
    norm_in_place: bool = True
    fused_gate_up: bool = False
    extra_norm_names: tuple[str, ...] = field(default=())


_FAMILIES = {
    "llama": _Family("llama", "transformers.models.llama.modeling_llama", "LlamaRMSNorm", "LlamaMLP",
                     ("LlamaForCausalLM",)),
    "mistral": _Family("mistral", "transformers.models.mistral.modeling_mistral", "MistralRMSNorm", "MistralMLP",
                       ("MistralForCausalLM",)),
    "qwen2": _Family("qwen2", "transformers.models.qwen2.modeling_qwen2", "Qwen2RMSNorm", "Qwen2MLP",
                     ("Qwen2ForCausalLM",)),
    "qwen3": _Family("qwen3", "transformers.models.qwen3.modeling_qwen3", "Qwen3RMSNorm", "Qwen3MLP",
                     ("Qwen3ForCausalLM",)),
    "gemma": _Family("gemma", "transformers.models.gemma.modeling_gemma", "GemmaRMSNorm", "GemmaMLP",
                     ("GemmaForCausalLM",), offset=1.0, casting="gemma"),
    # Gemma 2 and 3 add a norm's output to the residual stream, so the norm's dY is also the
    # residual's gradient: their backward must not overwrite it (in_place=False).
    "gemma2": _Family("gemma2", "transformers.models.gemma2.modeling_gemma2", "Gemma2RMSNorm", "Gemma2MLP",
                      ("Gemma2ForCausalLM",), offset=1.0, casting="gemma", norm_in_place=False),
    "gemma3_text": _Family("gemma3_text", "transformers.models.gemma3.modeling_gemma3", "Gemma3RMSNorm",
                           "Gemma3MLP", ("Gemma3ForCausalLM",), offset=1.0, casting="gemma",
                           norm_in_place=False),
    "phi3": _Family("phi3", "transformers.models.phi3.modeling_phi3", "Phi3RMSNorm", "Phi3MLP",
                    ("Phi3ForCausalLM",), fused_gate_up=True),
}


def _patch_norm_instance(m: nn.Module, fam: _Family, original_forward) -> None:
    _set(m, "_tigon_offset", fam.offset)
    _set(m, "_tigon_casting", fam.casting)
    _set(m, "_tigon_in_place", fam.norm_in_place)
    _set(m, "_tigon_fallback", types.MethodType(original_forward, m))
    _set(m, "forward", types.MethodType(_rms_norm_forward, m))


def _patch_mlp_instance(m: nn.Module, fam: _Family, original_forward, fused_mlp: bool) -> None:
    fwd = _fused_gate_up_mlp_forward if fam.fused_gate_up else _gated_mlp_forward
    m.__dict__.pop("_tigon_act_kind", None)
    _set(m, "_tigon_fused_mlp", bool(fused_mlp))
    _set(m, "_tigon_fallback", types.MethodType(original_forward, m))
    _set(m, "forward", types.MethodType(fwd, m))


def _norm_subclass(base: type, fam: _Family) -> type:
    def fallback(self, x):
        return base.forward(self, x)

    return type(f"Tigon{base.__name__}", (base,), {
        "forward": _rms_norm_forward,
        "_tigon_fallback": fallback,
        "_tigon_offset": fam.offset,
        "_tigon_casting": fam.casting,
        "_tigon_in_place": fam.norm_in_place,
        "__module__": __name__,
    })


def _mlp_subclass(base: type, fam: _Family, fused_mlp: bool) -> type:
    def fallback(self, x):
        return base.forward(self, x)

    fwd = _fused_gate_up_mlp_forward if fam.fused_gate_up else _gated_mlp_forward
    return type(f"Tigon{base.__name__}", (base,), {"forward": fwd, "_tigon_fallback": fallback,
                                                   "_tigon_fused_mlp": bool(fused_mlp), "__module__": __name__})


def _apply(fam: _Family, rope: bool, rms_norm: bool, swiglu: bool, cross_entropy: bool,
           fused_linear_cross_entropy: bool, fused_mlp: bool, model) -> None:
    if cross_entropy and fused_linear_cross_entropy:
        raise ValueError("cross_entropy and fused_linear_cross_entropy cannot both be True")
    mod = importlib.import_module(fam.module)
    norm_cls = _original(mod, fam.norm)
    mlp_cls = _original(mod, fam.mlp)

    if rope:
        _original(mod, "apply_rotary_pos_emb")
        _set(mod, "apply_rotary_pos_emb", F.tigon_rotary_pos_emb)

    lm_classes = tuple(getattr(mod, n) for n in fam.causal_lm if hasattr(mod, n))
    use_loss = cross_entropy or fused_linear_cross_entropy
    if model is None:
        if use_loss:
            forward = _wrap_causal_lm_forward()
            for cls in lm_classes:
                _set(cls, "forward", forward)
                _set(cls, "_tigon_flce", bool(fused_linear_cross_entropy))
                _set(cls, "_tigon_ce", bool(cross_entropy))
        if rms_norm:
            _set(mod, fam.norm, _norm_subclass(norm_cls, fam))
        if swiglu:
            _set(mod, fam.mlp, _mlp_subclass(mlp_cls, fam, fused_mlp))
        return

    for m in model.modules():
        if rms_norm and isinstance(m, norm_cls):
            _patch_norm_instance(m, fam, norm_cls.forward)
        elif swiglu and isinstance(m, mlp_cls):
            _patch_mlp_instance(m, fam, mlp_cls.forward, fused_mlp)
        elif use_loss and lm_classes and isinstance(m, lm_classes):
            _set(m, "_tigon_flce", bool(fused_linear_cross_entropy))
            _set(m, "_tigon_ce", bool(cross_entropy))
            _set(m, "forward", types.MethodType(_wrap_causal_lm_forward(), m))


def _make(family: str):
    fam = _FAMILIES[family]
    gemma = fam.casting == "gemma"

    # Liger's parameters in Liger's order (the MLP switch is geglu for the Gemma families), then
    # tigon's fused_mlp, keyword-only.
    if gemma:
        def apply(rope: bool = True, cross_entropy: bool = False, fused_linear_cross_entropy: bool = True,
                  rms_norm: bool = True, geglu: bool = True, model=None, *, fused_mlp: bool = True) -> None:
            _apply(fam, rope, rms_norm, geglu, cross_entropy, fused_linear_cross_entropy, fused_mlp, model)
    else:
        def apply(rope: bool = True, cross_entropy: bool = False, fused_linear_cross_entropy: bool = True,
                  rms_norm: bool = True, swiglu: bool = True, model=None, *, fused_mlp: bool = True) -> None:
            _apply(fam, rope, rms_norm, swiglu, cross_entropy, fused_linear_cross_entropy, fused_mlp, model)

    act, switch = ("GeGLU", "geglu") if gemma else ("SwiGLU", "swiglu")
    apply.__name__ = f"apply_tigon_to_{family}"
    apply.__qualname__ = apply.__name__
    apply.__doc__ = (
        f"Patches {fam.module} with tigon's kernels: RoPE, {fam.norm} (offset {fam.offset}, casting "
        f"'{fam.casting}'), {fam.mlp} ({act}, switch {switch}), and the loss of {', '.join(fam.causal_lm)}.\n\n"
        f"Liger's apply_liger_kernel_to_{family} parameters, order and defaults. model=None patches the\n"
        "classes (models built afterwards); a model is patched in place. cross_entropy and\n"
        f"fused_linear_cross_entropy are exclusive. fused_mlp (keyword-only, with {switch}): the MLP's three\n"
        "projections and its activation as one autograd function that keeps only the two input\n"
        "projections for the backward and recomputes the gated product there.")
    return apply


apply_tigon_to_llama = _make("llama")
apply_tigon_to_mistral = _make("mistral")
apply_tigon_to_qwen2 = _make("qwen2")
apply_tigon_to_qwen3 = _make("qwen3")
apply_tigon_to_gemma = _make("gemma")
apply_tigon_to_gemma2 = _make("gemma2")
apply_tigon_to_gemma3_text = _make("gemma3_text")
apply_tigon_to_phi3 = _make("phi3")


def apply_tigon_to_gemma3(rope: bool = True, cross_entropy: bool = False, fused_linear_cross_entropy: bool = True,
                          layer_norm: bool = True, rms_norm: bool = True, geglu: bool = True, model=None, *,
                          fused_mlp: bool = True) -> None:
    """Patches Gemma 3, text and multimodal (Gemma3ForCausalLM and Gemma3ForConditionalGeneration), with
    tigon's kernels; Liger's apply_liger_kernel_to_gemma3 parameters, order and defaults.

    rope, rms_norm, geglu and fused_mlp as apply_tigon_to_gemma3_text (the language model's modules and
    the multimodal projector's RMSNorm); layer_norm: the SigLIP vision tower's torch.nn.LayerNorm
    modules (model=None: those that transformers' SigLIP module builds afterwards; torch.nn itself is
    left alone); cross_entropy / fused_linear_cross_entropy: the loss of both causal-LM classes
    (exclusive)."""
    fam = _FAMILIES["gemma3_text"]
    _apply(fam, rope, rms_norm, geglu, cross_entropy, fused_linear_cross_entropy, fused_mlp, model)
    mod = importlib.import_module(fam.module)
    mm_cls = getattr(mod, "Gemma3ForConditionalGeneration", None)
    use_loss = cross_entropy or fused_linear_cross_entropy
    forward = None
    if use_loss and mm_cls is not None:
        forward = _multimodal_forward(_original(mod, "Gemma3ForConditionalGeneration.forward", mm_cls.forward))
    if model is None:
        if layer_norm:
            siglip = importlib.import_module("transformers.models.siglip.modeling_siglip")
            _set(siglip, "nn", _TorchNNView(LayerNorm=_layer_norm_subclass()))
        if forward is not None:
            _set(mm_cls, "forward", forward)
            _set(mm_cls, "_tigon_flce", bool(fused_linear_cross_entropy))
            _set(mm_cls, "_tigon_ce", bool(cross_entropy))
        return
    if layer_norm:
        for m in model.modules():
            if type(m) is nn.LayerNorm:
                _set(m, "_tigon_fallback", types.MethodType(nn.LayerNorm.forward, m))
                _set(m, "forward", types.MethodType(_layer_norm_forward, m))
    if forward is not None and isinstance(model, mm_cls):
        _set(model, "_tigon_flce", bool(fused_linear_cross_entropy))
        _set(model, "_tigon_ce", bool(cross_entropy))
        _set(model, "forward", types.MethodType(forward, model))


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
}


def apply_tigon_to_model(model, **kwargs) -> None:
    """Patches an instantiated model in place, the family read from model.config.model_type. Unlike
    _apply_tigon_to_instance, an unsupported model type raises NotImplementedError and a keyword the
    family's apply function does not take raises TypeError."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    fn = MODEL_TYPE_TO_APPLY_FN.get(model_type)
    if fn is None:
        raise NotImplementedError(
            f"tigon_torch has no patch for model_type {model_type!r}; supported: {sorted(MODEL_TYPE_TO_APPLY_FN)}")
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

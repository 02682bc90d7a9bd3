"""Autograd functions over tigon's kernels, each with the forward arguments (same order, same defaults)
and the return values of its Liger-Kernel counterpart, so that switching is a change of import:

  TigonRMSNormFunction                  LigerRMSNormFunction
  TigonLayerNormFunction                LigerLayerNormFunction
  TigonFusedAddRMSNormFunction          LigerFusedAddRMSNormFunction
  TigonRopeFunction                     LigerRopeFunction
  TigonSiLUMulFunction                  LigerSiLUMulFunction
  TigonGELUMulFunction                  LigerGELUMulFunction
  TigonCrossEntropyFunction             LigerCrossEntropyFunction
  TigonFusedLinearCrossEntropyFunction  LigerFusedLinearCrossEntropyFunction
  TigonJSDFunction                      LigerJSDFunction
  TigonKLDivLossFunction                LigerKLDivLossFunction
  TigonTVDLossFunction                  LigerTVDLossFunction
  TigonFusedLinearJSDFunction           LigerFusedLinearJSDFunction

plus TigonGatedMulFunction (any of the three activations, exact GELU included),
TigonFusedGateUpMulFunction (the gated activation over a fused gate||up projection, Phi-3's layout)
and TigonGatedMLPFunction (a whole gated MLP that does not keep the down projection's input for the
backward), which have no Liger counterpart of the same signature.

Differences from Liger are listed in docs/torch.md ("Differences from Liger-Kernel"); the ones that
change a result or raise are also noted at each function below. The mean's denominator, the
ignored-token count and the upstream gradient stay on the device; the one host synchronisation is
the losses' eager target check (check_targets below), skipped under CUDA-graph capture and
torch.compile.
"""

from __future__ import annotations

import math
import os
import warnings

import torch
from torch.autograd.function import once_differentiable

from . import ops as _o
from .ops import as_rows, empty_rows, ops, row_order, rows_as, vector


def _check_cuda(*tensors) -> None:
    for t in tensors:
        if t is not None and not _o.on_device(t):
            raise ValueError(f"tigon_torch: expected CUDA tensors, got one on {t.device}")


def _cast(t, dtype):
    """t in dtype, or t itself when it has it. Never return `t.to(t.dtype)` from an autograd function:
    under torch.compile (2.11) an output that aliases a buffer written by an operator that way gets a
    zero gradient (found with the test suite's CPU reference mode)."""
    if t is None or t.dtype == dtype:
        return t
    return t.to(dtype)


def _same_storage(a, b) -> bool:
    """Whether a is b or a view of the same base (as_rows returns a view of its input, or a copy)."""
    return (a._base if a._base is not None else a) is (b._base if b._base is not None else b)


def _compiling() -> bool:
    try:
        return torch.compiler.is_compiling()
    except AttributeError:  # pragma: no cover
        return False


def _saved_grad(t, dtype):
    """A gradient computed in fp32 for an upstream scale that comes later, as it is saved: in dtype,
    except fp16, whose range a sum-reduced weight or bias gradient can exceed before a small scale
    (e.g. 1 / tokens) brings it back (it stays fp32 until _scaled_grad)."""
    return t if dtype == torch.float16 else _cast(t, dtype)


def _graph_kept() -> bool:
    """Whether the running backward keeps its graph (retain_graph / create_graph: saved tensors are
    read again later); True where torch cannot tell."""
    keep = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if keep is None else bool(keep())


def _scaled_grad(t, go, dtype):
    """A saved gradient (_saved_grad) times the upstream scalar go, in dtype. In place when the saved
    gradient belongs to this backward alone (no second [V, H] buffer): on the device through
    scale_rows, which reads go there and leaves the gradient untouched when it is exactly 1 (the usual
    upstream gradient of a loss: one launch, no pass over the gradient, no host synchronisation), the
    product rounded once from fp32; out of place when the graph is kept for another backward
    (retain_graph, create_graph) and while torch.compile traces (which does not mutate a backward
    graph's inputs)."""
    if t is None:
        return None
    if _compiling() or _graph_kept():
        return _cast(t * go.to(t.dtype), dtype)
    if _o.on_device(t) and t.is_contiguous() and t.numel() > 0:
        n = t.shape[-1] if t.dim() > 1 else (1024 if t.numel() % 1024 == 0 else t.numel())
        ops().scale_rows(t.view(-1, n), go.to(torch.float32).reshape(1).contiguous())
        return _cast(t, dtype)
    return _cast(t.mul_(go.to(t.dtype)), dtype)


def _head_grad_dtype(w_dtype, accum_dtype=None, operand_dtype=None):
    """The dtype a chunked head's weight and bias gradients accumulate in, as Liger's accum_dtype has it:
    by default the weight's own (each chunk's GEMM adds into the gradient and rounds once: no fp32
    [V, H] beside it), float32 when asked for. float16 weights accumulate in float32: a sum-reduced
    gradient can exceed float16's range before the upstream scale brings it back. So does a weight
    that autocast casts to another dtype for the GEMMs (operand_dtype: the GEMMs' dtype; a bfloat16
    weight under float16 autocast): the GEMMs add only into float32 or their own dtype."""
    if accum_dtype is not None and accum_dtype not in (torch.float32, w_dtype):
        raise ValueError(f"tigon_torch: accum_dtype must be None, torch.float32 or the weight's dtype ({w_dtype}), "
                         f"got {accum_dtype}")
    if accum_dtype == torch.float32 or w_dtype in (torch.float32, torch.float16):
        return torch.float32
    if operand_dtype is not None and operand_dtype != w_dtype:
        return torch.float32
    return w_dtype


def _casting(mode) -> int:
    """tigon's casting-mode code. Liger's integer code for "none" is -1 (tigon's is 2): both are taken."""
    if type(mode) is str and mode in _o.CASTING_MODES:
        return _o.CASTING_MODES[mode]
    value = getattr(mode, "value", mode)
    if isinstance(value, int) and not isinstance(value, bool) and value == -1:
        return _o.CASTING_MODES["none"]
    return _o.casting_mode(mode)


# ------------------------------------------------------------------------------------------------
# RMSNorm
# ------------------------------------------------------------------------------------------------


class TigonRMSNormFunction(torch.autograd.Function):
    """y = x * rstd * (offset + W), rstd = 1 / sqrt(mean(x^2) + eps), with Hugging Face's casting modes
    ("llama", "gemma", "none"). X: [..., H] with any layout whose last dimension is contiguous (rows
    are read through strides, a transposed view included); W: [H] of X's dtype or float32, or None.

    in_place=True writes dX over dY in the backward (as Liger does): dY must not be needed elsewhere
    (the patches pass False for norms whose output feeds a residual add, Gemma 2 / 3's). row_mode
    selects between two Triton kernels of the same math in Liger; tigon picks its kernel itself, so
    it is accepted and has no effect on the result (equivalent numerics). casting_mode: "llama",
    "gemma", "none", or Liger's integer codes (0, 1, -1).
    """

    @staticmethod
    def forward(ctx, X, W, eps, offset=0.0, casting_mode="llama", in_place=True, row_mode=None):
        _check_cuda(X, W)
        casting = _casting(casting_mode)
        order = row_order(X)
        x2 = as_rows(X, order)
        y2, Y = empty_rows(X.shape, order, X.dtype, X.device)
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=X.device)
        W = vector(W)
        if x2.numel() > 0:
            ops().rms_norm_fwd(x2, W, y2, rstd, float(eps), float(offset), casting)
        ctx.save_for_backward(x2, W, rstd)
        ctx.order, ctx.shape = order, X.shape
        ctx.eps, ctx.offset, ctx.casting, ctx.in_place = float(eps), float(offset), casting, bool(in_place)
        return Y

    @staticmethod
    def backward(ctx, dY):
        x2, W, rstd = ctx.saved_tensors
        dy2 = as_rows(dY, ctx.order)
        if ctx.in_place and not _compiling() and dy2.is_contiguous():
            dx2, dX = dy2, rows_as(dy2, ctx.shape, ctx.order)  # dX over dY
        else:  # out of place (also when dY's rows are strided or torch.compile traces)
            dx2, dX = empty_rows(ctx.shape, ctx.order, x2.dtype, x2.device)
        dW = None
        if W is not None and ctx.needs_input_grad[1]:
            dW = torch.empty_like(W)
        if x2.numel() > 0:
            ops().rms_norm_bwd(dy2, x2, W, rstd, dx2, dW, ctx.eps, ctx.offset, ctx.casting)
        elif dW is not None:
            dW.zero_()
        return dX, dW, None, None, None, None, None


# Eager calls on contiguous CUDA inputs go through the operators whose autograd is C++ (tigon.rms_norm,
# tigon.layer_norm, tigon.add_rms_norm, tigon.gated): the same kernels, bit for bit the results of the
# Python Functions, at a fraction of their host cost (no Python in the forward's or the backward's
# path). Other layouts, tensor subclasses (DTensor) and torch.compile take the Python Functions. The
# test suite switches this off to compare the two.
CPP_AUTOGRAD = True
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _cpp(*tensors) -> bool:
    if not (CPP_AUTOGRAD and _o.on_device(tensors[0])) or _compiling():
        return False
    for t in tensors:  # a loop, not all() over a generator: this runs on every eager call
        if type(t) not in _PLAIN or t.dim() == 0 or not t.is_contiguous():
            return False
    return True


def rms_norm(X, W, eps, offset=0.0, casting_mode="llama", in_place=True):
    """TigonRMSNormFunction's op for tigon_rms_norm and TigonRMSNorm (tigon.rms_norm for eager calls on
    contiguous CUDA inputs)."""
    if _cpp(X):
        return ops().rms_norm(X, W, float(eps), float(offset), _casting(casting_mode), bool(in_place))
    return TigonRMSNormFunction.apply(X, W, eps, offset, casting_mode, in_place, None)


# ------------------------------------------------------------------------------------------------
# LayerNorm
# ------------------------------------------------------------------------------------------------


class TigonLayerNormFunction(torch.autograd.Function):
    """torch.nn.functional.layer_norm over the last dimension: y = (x - mean) * rstd * W + B, statistics
    in fp32 (biased variance from centred values), one rounding to X's dtype. W and B: [H] of X's
    dtype or float32 (the same dtype for both), each optional."""

    @staticmethod
    def forward(ctx, X, W, B, eps):
        _check_cuda(X, W, B)
        order = row_order(X)
        x2 = as_rows(X, order)
        y2, Y = empty_rows(X.shape, order, X.dtype, X.device)
        rows = x2.shape[0]
        mean = torch.empty(rows, dtype=torch.float32, device=X.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=X.device)
        W, B = vector(W), vector(B)
        if x2.numel() > 0:
            ops().layer_norm_fwd(x2, W, B, y2, mean, rstd, float(eps))
        ctx.save_for_backward(x2, W, mean, rstd)
        ctx.has_bias = B is not None
        ctx.bias_meta = (B.shape, B.dtype) if B is not None else None
        ctx.order, ctx.shape = order, X.shape
        return Y

    @staticmethod
    def backward(ctx, dY):
        x2, W, mean, rstd = ctx.saved_tensors
        dy2 = as_rows(dY, ctx.order)
        dx2, dX = empty_rows(ctx.shape, ctx.order, x2.dtype, x2.device)
        dW = torch.empty_like(W) if (W is not None and ctx.needs_input_grad[1]) else None
        dB = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            shape, dtype = ctx.bias_meta
            dB = torch.empty(shape, dtype=dtype, device=x2.device)
        if x2.numel() > 0:
            ops().layer_norm_bwd(dy2, x2, W, mean, rstd, dx2, dW, dB)
        else:
            for g in (dW, dB):
                if g is not None:
                    g.zero_()
        return dX, dW, dB, None


def layer_norm(X, W, B, eps):
    """TigonLayerNormFunction's op for tigon_layer_norm and TigonLayerNorm (tigon.layer_norm for eager
    calls on contiguous CUDA inputs)."""
    if _cpp(X):
        return ops().layer_norm(X, W, B, float(eps))
    return TigonLayerNormFunction.apply(X, W, B, eps)


# ------------------------------------------------------------------------------------------------
# Fused residual add + RMSNorm
# ------------------------------------------------------------------------------------------------


class TigonFusedAddRMSNormFunction(torch.autograd.Function):
    """S = X + R (rounded once to the dtype), Y = RMSNorm(S): returns (Y, S), the pre-norm step
    ``residual = hidden + residual; hidden = norm(residual)`` in one pass. The backward returns one
    tensor for both dX and dR (they are equal); in_place=True writes it over dY."""

    @staticmethod
    def forward(ctx, X, R, W, eps, offset=0.0, casting_mode="llama", in_place=False):
        _check_cuda(X, R, W)
        if X.shape != R.shape:
            raise ValueError(f"tigon_torch: X {tuple(X.shape)} and R {tuple(R.shape)} must have one shape")
        casting = _casting(casting_mode)
        order = row_order(X)
        x2, r2 = as_rows(X, order), as_rows(R, order)
        y2, Y = empty_rows(X.shape, order, X.dtype, X.device)
        s2, S = empty_rows(X.shape, order, X.dtype, X.device)
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=X.device)
        W = vector(W)
        if x2.numel() > 0:
            ops().add_rms_norm_fwd(x2, r2, W, y2, s2, rstd, float(eps), float(offset), casting)
        ctx.save_for_backward(s2, W, rstd)
        ctx.order, ctx.shape = order, X.shape
        ctx.eps, ctx.offset, ctx.casting, ctx.in_place = float(eps), float(offset), casting, bool(in_place)
        return Y, S

    @staticmethod
    def backward(ctx, dY, dS):
        s2, W, rstd = ctx.saved_tensors
        if dY is None:
            dY = torch.zeros(ctx.shape, dtype=s2.dtype, device=s2.device)
        dy2 = as_rows(dY, ctx.order)
        ds2 = as_rows(dS, ctx.order) if dS is not None else None
        if ctx.in_place and not _compiling() and dy2.is_contiguous():
            dx2 = dy2
            dX = rows_as(dx2, ctx.shape, ctx.order)
        else:
            dx2, dX = empty_rows(ctx.shape, ctx.order, s2.dtype, s2.device)
        dW = torch.empty_like(W) if (W is not None and ctx.needs_input_grad[2]) else None
        if s2.numel() > 0:
            ops().add_rms_norm_bwd(dy2, ds2, s2, W, rstd, dx2, dW, ctx.eps, ctx.offset, ctx.casting)
        elif dW is not None:
            dW.zero_()
        return dX, dX, dW, None, None, None, None


def add_rms_norm(X, R, W, eps, offset=0.0, casting_mode="llama", in_place=False):
    """TigonFusedAddRMSNormFunction's op for tigon_fused_add_rms_norm (and so TigonFusedAddRMSNorm and
    the patches' fused_add_norm); tigon.add_rms_norm for eager calls on contiguous CUDA inputs of one
    shape."""
    if _cpp(X, R) and X.shape == R.shape:
        return ops().add_rms_norm(X, R, W, float(eps), float(offset), _casting(casting_mode), bool(in_place))
    return TigonFusedAddRMSNormFunction.apply(X, R, W, eps, offset, casting_mode, in_place)


# ------------------------------------------------------------------------------------------------
# RoPE
# ------------------------------------------------------------------------------------------------


def _bthd(t: torch.Tensor, unsqueeze_dim: int) -> torch.Tensor:
    """q / k as a [batch, seq, heads, head_dim] view."""
    if t.dim() != 4:
        raise ValueError(f"tigon_torch: q and k must be 4-D, got shape {tuple(t.shape)}")
    if unsqueeze_dim == 1:  # [batch, heads, seq, head_dim] (Hugging Face's attention layout)
        t = t.transpose(1, 2)
    elif unsqueeze_dim != 2:  # 2: already [batch, seq, heads, head_dim]
        raise ValueError(f"tigon_torch: unsqueeze_dim must be 1 or 2, got {unsqueeze_dim}")
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t


def _table(t: torch.Tensor, dtype, planes: bool = False) -> torch.Tensor:
    """A cos / sin table as the op takes it: [batch or 1, rows, width], or with planes (M-RoPE)
    [3, batch or 1, rows, width]."""
    if planes:
        if t.dim() != 4 or t.shape[0] != 3:
            raise ValueError(f"tigon_torch: M-RoPE cos / sin must be [3, batch or 1, seq, head_dim], got {tuple(t.shape)}")
    elif t.dim() == 2:
        t = t.unsqueeze(0)
    if not planes and t.dim() != 3:
        raise ValueError(f"tigon_torch: cos / sin must be [batch or 1, seq, dim] or [seq, dim], got {tuple(t.shape)}")
    if t.dtype != dtype and t.dtype != torch.float32:
        t = t.to(dtype)
    return t.contiguous()  # one row per position (a no-op for Hugging Face's tables)


def _rope_call(q, k, cos, sin, position_ids, backward, interleaved, unsqueeze_dim, sections=()):
    """Rotates q (and k when given) out of place; outputs keep their inputs' layouts."""
    q4 = _bthd(q, unsqueeze_dim)
    k4 = _bthd(k, unsqueeze_dim) if k is not None else None
    q_out = torch.empty_like(q)
    k_out = torch.empty_like(k) if k is not None else None
    qo4 = _bthd(q_out, unsqueeze_dim)
    ko4 = _bthd(k_out, unsqueeze_dim) if k_out is not None else None
    if q_out.numel() > 0:
        ops().rope(q4, k4, cos, sin, position_ids, qo4, ko4, backward, interleaved, list(sections))
    return q_out, k_out


def _rope_prepare(q, k, cos, sin, position_ids, unsqueeze_dim, interleaved=False, sections=()):
    _check_cuda(q, k, cos, sin)
    if k is not None and k.dtype != q.dtype:
        raise TypeError(f"tigon_torch: q ({q.dtype}) and k ({k.dtype}) must have one dtype")
    head_dim, width = q.shape[-1], cos.shape[-1]
    if sections:
        if len(sections) != 3 or any(int(x) < 0 for x in sections) or 2 * sum(int(x) for x in sections) != width:
            raise ValueError(f"tigon_torch: mrope_section {list(sections)} must be three sizes >= 0 summing to "
                             f"half the cos / sin width ({width})")
        if cos.shape != sin.shape:
            raise ValueError(f"tigon_torch: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have one shape")
    if interleaved:
        if width % 2 or not 2 <= width <= head_dim:
            raise ValueError(f"tigon_torch: interleaved cos / sin width {width} must be even and in [2, head_dim] "
                             f"(head_dim {head_dim})")
    elif not (2 <= width <= head_dim or (width == head_dim + 1 and head_dim % 2 == 1)):
        raise ValueError(f"tigon_torch: cos / sin width {width} must be in [2, head_dim] (head_dim {head_dim}), "
                         "or head_dim + 1 for an odd head_dim")
    cos = _table(cos, q.dtype, bool(sections))
    sin = _table(sin, q.dtype, bool(sections))
    if sin.dtype != cos.dtype:
        sin = sin.to(cos.dtype)
    seq = q.shape[2] if unsqueeze_dim == 1 else q.shape[1]
    if sections:
        if cos.shape[-2] != seq:
            raise ValueError(f"tigon_torch: M-RoPE cos / sin need one row per position ({seq}), got {cos.shape[-2]}")
        position_ids = None
    elif position_ids is not None and cos.shape[1] != seq:
        batch = q.shape[0]
        position_ids = position_ids.expand(batch, seq) if position_ids.dim() == 2 else position_ids
        position_ids = position_ids.contiguous()
    else:
        position_ids = None  # the tables are already gathered per position (Hugging Face's)
    return cos, sin, position_ids


def _rope_forward(ctx, q, k, cos, sin, position_ids, unsqueeze_dim, interleaved, sections=()):
    sections = tuple(int(x) for x in sections) if sections else ()
    cos, sin, pos = _rope_prepare(q, k, cos, sin, position_ids, unsqueeze_dim, interleaved, sections)
    q_out, k_out = _rope_call(q, k, cos, sin, pos, False, interleaved, unsqueeze_dim, sections)
    ctx.save_for_backward(cos, sin, pos)
    ctx.unsqueeze_dim = unsqueeze_dim
    ctx.interleaved = interleaved
    ctx.sections = sections
    return q_out, k_out


def _rope_backward(ctx, dq, dk):
    """(dq, dk); the other inputs get None (the caller pads to its forward's arity)."""
    cos, sin, pos = ctx.saved_tensors
    u, il, sec = ctx.unsqueeze_dim, ctx.interleaved, ctx.sections
    if dq is None and dk is None:
        return None, None
    if dq is None:
        dk_in, _ = _rope_call(dk, None, cos, sin, pos, True, il, u, sec)
        return None, dk_in
    if dk is None:
        dq_in, _ = _rope_call(dq, None, cos, sin, pos, True, il, u, sec)
        return dq_in, None
    if dk.dtype != dq.dtype:
        dk = dk.to(dq.dtype)
    return _rope_call(dq, dk, cos, sin, pos, True, il, u, sec)


class TigonRopeFunction(torch.autograd.Function):
    """Rotary embedding of q and k with Hugging Face's rotate_half convention. q: [batch, heads_q, seq,
    head_dim], k: [batch, heads_k, seq, head_dim] (unsqueeze_dim=1; with unsqueeze_dim=2 the layout is
    [batch, seq, heads, head_dim]); any strides with a contiguous last dimension. cos / sin: [1 or
    batch, seq, rotary_dim] as Hugging Face's rotary embedding returns them; rotary_dim < head_dim
    rotates the first rotary_dim channels and passes the rest through (Phi-3's partial rotary). An odd
    head_dim D takes the tables Hugging Face builds for it (D + 1 wide, or D wide): as in Liger, the
    pairs (d, d + D // 2) for d < D // 2 are rotated and the last channel passes through.

    position_ids: ignored when cos / sin already have seq rows (as in Liger); when the tables have
    another number of rows they are indexed with position_ids [batch, seq]. Outputs are new tensors
    (q and k are not modified) with the inputs' layouts."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        return _rope_forward(ctx, q, k, cos, sin, position_ids, unsqueeze_dim, False)

    @staticmethod
    def backward(ctx, dq, dk):
        return *_rope_backward(ctx, dq, dk), None, None, None, None


class TigonInterleavedRopeFunction(torch.autograd.Function):
    """Rotary embedding of interleaved pairs (x[2i], x[2i + 1]) (GPT-J, GLM-4, Llama 4's complex
    form): y[2i] = x[2i] cos[2i] - x[2i + 1] sin[2i], y[2i + 1] = x[2i + 1] cos[2i + 1] + x[2i] sin[2i + 1],
    in fp32 with one rounding. cos / sin: [1 or batch, seq, rotary_dim] with rotary_dim even (each
    pair's entries repeated, as GLM-4's repeat_interleave builds them); channels from rotary_dim on pass
    through. Layouts, position_ids and outputs as TigonRopeFunction."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        return _rope_forward(ctx, q, k, cos, sin, position_ids, unsqueeze_dim, True)

    @staticmethod
    def backward(ctx, dq, dk):
        return *_rope_backward(ctx, dq, dk), None, None, None, None


def _llama4_tables(freqs_cis, seq):
    """cos / sin [batch or 1, seq, head_dim] of Llama 4's complex frequencies (freqs_cis [batch or 1,
    seq, head_dim / 2] or [seq, head_dim / 2], complex or as view_as_real's [..., head_dim / 2, 2]):
    each pair's real and imaginary part repeated for its two channels."""
    f = freqs_cis
    if not f.is_complex():
        if f.shape[-1] != 2:
            raise ValueError(f"tigon_torch: freqs_cis must be complex or [..., head_dim / 2, 2], got {tuple(f.shape)}")
        f = torch.view_as_complex(f.float().contiguous())
    if f.dim() != 3:
        if f.numel() % (seq * f.shape[-1]):
            raise ValueError(f"tigon_torch: freqs_cis {tuple(freqs_cis.shape)} does not hold {seq} positions")
        f = f.reshape(-1, seq, f.shape[-1])
    return f.real.repeat_interleave(2, dim=-1), f.imag.repeat_interleave(2, dim=-1)


class TigonLlama4RopeFunction(torch.autograd.Function):
    """Llama 4's complex rotary embedding (Liger's LigerLlama4RopeFunction, Hugging Face's
    apply_rotary_emb): q [batch, seq, heads_q, head_dim], k [batch, seq, heads_k, head_dim], each pair
    (x[2i], x[2i + 1]) multiplied as a complex number by freqs_cis[..., i] in fp32, through tigon's
    interleaved rope; freqs_cis complex [batch or 1, seq, head_dim / 2] (or [seq, head_dim / 2], or
    view_as_real's form). BLOCK_SIZE is accepted for Liger's signature and unused."""

    @staticmethod
    def forward(ctx, q, k, freqs_cis, BLOCK_SIZE=None):
        cos, sin = _llama4_tables(freqs_cis, q.shape[1])
        return _rope_forward(ctx, q, k, cos, sin, None, 2, True)

    @staticmethod
    def backward(ctx, dq, dk):
        return *_rope_backward(ctx, dq, dk), None, None


class TigonQwen2VLMRopeFunction(torch.autograd.Function):
    """Qwen2-VL's multimodal rotary embedding (M-RoPE; Liger's LigerQwen2VLMRopeFunction, Hugging
    Face's apply_multimodal_rotary_pos_emb): q [batch, heads_q, seq, head_dim], k [batch, heads_k, seq,
    head_dim] (unsqueeze_dim=1; 2: [batch, seq, heads, head_dim]); cos / sin [3, batch or 1, seq,
    head_dim], the temporal, height and width tables; mrope_section [t, h, w] with t + h + w =
    head_dim / 2: pair d (channels d and d + head_dim / 2) is rotated by table 0's entries for d < t,
    table 1's for d < t + h, table 2's past that, in one launch that reads each entry from its table
    (the composed table is never built). Tables of shape [batch or 1, seq, head_dim] are taken as
    already composed (transformers 5's Qwen2-VL rotary embedding returns them so) and rotate as
    TigonRopeFunction. Rotate-half convention; outputs are new tensors with the inputs' layouts."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, mrope_section, unsqueeze_dim=1):
        # 3-D tables are already composed (transformers 5's rotary embedding applies the sections).
        sections = mrope_section if cos.dim() == 4 else ()
        return _rope_forward(ctx, q, k, cos, sin, None, unsqueeze_dim, False, sections)

    @staticmethod
    def backward(ctx, dq, dk):
        return *_rope_backward(ctx, dq, dk), None, None, None, None


# ------------------------------------------------------------------------------------------------
# Gated activations
# ------------------------------------------------------------------------------------------------


def _gated_forward(ctx, a, b, act, gate_multiplier, down_multiplier):
    _check_cuda(a, b)
    if a.shape != b.shape:
        raise ValueError(f"tigon_torch: a {tuple(a.shape)} and b {tuple(b.shape)} must have one shape")
    order = row_order(a)
    a2, b2 = as_rows(a, order), as_rows(b, order)
    c2, c = empty_rows(a.shape, order, a.dtype, a.device)
    if a2.numel() > 0:
        ops().gated_fwd(a2, b2, c2, act, float(gate_multiplier), float(down_multiplier))
    ctx.save_for_backward(a, b)
    # The gradients go over a and b (see _gated_backward) when both are computed by the graph (an
    # MLP's projections), not tensors the caller made nor views of them.
    ctx.over = all(t.grad_fn is not None and (t._base is None or t._base.grad_fn is not None)
                   for t in (a, b)) and all(ctx.needs_input_grad[:2])
    ctx.order, ctx.shape, ctx.act = order, a.shape, act
    ctx.gate_multiplier, ctx.down_multiplier = float(gate_multiplier), float(down_multiplier)
    return c


def _overlap(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether the byte ranges x and y span (from their first to their last element) intersect."""
    if x.numel() == 0 or y.numel() == 0 or x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr():
        return False

    def span(t):
        lo = t.data_ptr()
        return lo, lo + (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()

    (x0, x1), (y0, y1) = span(x), span(y)
    return x0 < y1 and y0 < x1


def _gated_backward(ctx, dc):
    """(da, db). As Liger's backward, when a and b are computed by the graph (an MLP's gate and up
    projections; not leaves), da and db are written over them (the kernel reads an element's dc, a
    and b before writing its da and db), so the backward allocates nothing; their version counters
    are bumped, so a node that saved either raises at its backward instead of reading a gradient.
    Fresh buffers for leaves (tensors the caller made), under torch.compile (its functionalisation
    takes no output aliasing an input) and when a and b overlap."""
    a, b = ctx.saved_tensors
    a2, b2 = as_rows(a, ctx.order), as_rows(b, ctx.order)
    dc2 = as_rows(dc, ctx.order)
    if not ctx.over or _compiling() or _overlap(a, b) or _overlap(dc, a) or _overlap(dc, b):
        da2, da = empty_rows(ctx.shape, ctx.order, a.dtype, a.device)
        db2, db = empty_rows(ctx.shape, ctx.order, a.dtype, a.device)
    else:
        da2, db2 = a2, b2
        # a2 is a view of a, or (a layout as_rows cannot flatten) a copy of it, contiguous by rows.
        da = a.detach() if _same_storage(a2, a) else rows_as(a2, ctx.shape, ctx.order)
        db = b.detach() if _same_storage(b2, b) else rows_as(b2, ctx.shape, ctx.order)
    if a2.numel() > 0:
        ops().gated_bwd(dc2, a2, b2, da2, db2, ctx.act, ctx.gate_multiplier, ctx.down_multiplier)
    if da2 is a2:
        torch.autograd.graph.increment_version(a)
        torch.autograd.graph.increment_version(b)
    return da, db


class TigonSiLUMulFunction(torch.autograd.Function):
    """SwiGLU: c = down_multiplier * silu(gate_multiplier * a) * b, all math in fp32, one rounding."""

    @staticmethod
    def forward(ctx, a, b, gate_multiplier: float = 1.0, down_multiplier: float = 1.0):
        return _gated_forward(ctx, a, b, _o.ACTIVATIONS["silu"], gate_multiplier, down_multiplier)

    @staticmethod
    def backward(ctx, dc):
        da, db = _gated_backward(ctx, dc)
        return da, db, None, None


class TigonGELUMulFunction(torch.autograd.Function):
    """GeGLU: c = gelu(a, approximate="tanh") * b (Gemma's gelu_pytorch_tanh), all math in fp32."""

    @staticmethod
    def forward(ctx, a, b):
        return _gated_forward(ctx, a, b, _o.ACTIVATIONS["gelu_tanh"], 1.0, 1.0)

    @staticmethod
    def backward(ctx, dc):
        return _gated_backward(ctx, dc)


class TigonReLUSquaredFunction(torch.autograd.Function):
    """relu(a)^2, Nemotron's MLP activation (transformers' ReLUSquaredActivation), in one pass each way:
    the square rounded once to a's dtype, the gradient dc * 2 relu(a) rounded once, so bf16 / fp16
    results equal relu-then-square's bit for bit. Saves a for the backward."""

    @staticmethod
    def forward(ctx, a):
        _check_cuda(a)
        ctx.save_for_backward(a)
        if a.numel() == 0:
            return torch.empty_like(a)
        order = row_order(a)
        c2, c = empty_rows(a.shape, order, a.dtype, a.device)
        ops().relu2_fwd(as_rows(a, order), c2)
        ctx.order = order
        return c

    @staticmethod
    def backward(ctx, dc):
        (a,) = ctx.saved_tensors
        if a.numel() == 0:
            return torch.empty_like(a)
        da2, da = empty_rows(a.shape, ctx.order, a.dtype, a.device)
        ops().relu2_bwd(as_rows(dc, ctx.order), as_rows(a, ctx.order), da2)
        return da


class TigonGatedMulFunction(torch.autograd.Function):
    """down_multiplier * act(gate_multiplier * a) * b for activation "silu", "gelu_tanh" or "gelu" (exact,
    erf): the general form behind TigonSiLUMulFunction and TigonGELUMulFunction."""

    @staticmethod
    def forward(ctx, a, b, activation="silu", gate_multiplier=1.0, down_multiplier=1.0):
        if activation not in _o.ACTIVATIONS:
            raise ValueError(f"tigon_torch: activation must be one of {sorted(_o.ACTIVATIONS)}, got {activation!r}")
        return _gated_forward(ctx, a, b, _o.ACTIVATIONS[activation], gate_multiplier, down_multiplier)

    @staticmethod
    def backward(ctx, dc):
        da, db = _gated_backward(ctx, dc)
        return da, db, None, None, None


def gated(a, b, activation="silu", gate_multiplier=1.0, down_multiplier=1.0):
    """TigonGatedMulFunction's op for tigon_swiglu, tigon_geglu and the MLP modules (tigon.gated for
    eager calls on contiguous CUDA inputs of one shape)."""
    if activation not in _o.ACTIVATIONS:
        raise ValueError(f"tigon_torch: activation must be one of {sorted(_o.ACTIVATIONS)}, got {activation!r}")
    if _cpp(a, b) and a.shape == b.shape and a.dtype == b.dtype:
        return ops().gated(a, b, _o.ACTIVATIONS[activation], float(gate_multiplier), float(down_multiplier))
    return TigonGatedMulFunction.apply(a, b, activation, gate_multiplier, down_multiplier)


class TigonFusedGateUpMulFunction(torch.autograd.Function):
    """act(gate) * up over one fused projection gate_up [..., 2 * I] whose first half is the gate
    (Phi-3's gate_up_proj): read in place through strides, and the gradient written into one
    [..., 2 * I] tensor, so neither direction splits or concatenates. activation: "silu", "gelu_tanh"
    or "gelu" (exact)."""

    @staticmethod
    def forward(ctx, gate_up, activation="silu"):
        _check_cuda(gate_up)
        if activation not in _o.ACTIVATIONS:
            raise ValueError(f"tigon_torch: activation must be one of {sorted(_o.ACTIVATIONS)}, got {activation!r}")
        n = gate_up.shape[-1]
        if n % 2 != 0:
            raise ValueError(f"tigon_torch: the fused gate||up dimension must be even, got {n}")
        order = row_order(gate_up)
        g2 = as_rows(gate_up, order)
        i = n // 2
        out_shape = list(gate_up.shape[:-1]) + [i]
        c2, c = empty_rows(out_shape, order, gate_up.dtype, gate_up.device)
        act = _o.ACTIVATIONS[activation]
        if c2.numel() > 0:
            ops().gated_fwd(g2[:, :i], g2[:, i:], c2, act, 1.0, 1.0)
        ctx.save_for_backward(g2)
        ctx.order, ctx.shape, ctx.act = order, gate_up.shape, act
        return c

    @staticmethod
    def backward(ctx, dc):
        (g2,) = ctx.saved_tensors
        i = g2.shape[1] // 2
        dc2 = as_rows(dc, ctx.order)
        dg2, dg = empty_rows(ctx.shape, ctx.order, g2.dtype, g2.device)
        if g2.numel() > 0:
            ops().gated_bwd(dc2, g2[:, :i], g2[:, i:], dg2[:, :i], dg2[:, i:], ctx.act, 1.0, 1.0)
        return dg, None


class TigonGatedMLPFunction(torch.autograd.Function):
    """y = act(x @ w_gate.T) * (x @ w_up.T) @ w_down.T: a gated MLP without biases (LlamaMLP, GemmaMLP,
    ...), activation "silu", "gelu_tanh" or "gelu" (exact).

    Saves x, a = x @ w_gate.T and b = x @ w_up.T, but not c = act(a) * b, the down projection's input,
    which an MLP built of nn.Linear modules keeps alive from the forward to the backward (N x I values
    per layer: 7 GiB over 32 LLaMA-3-8B layers at 8192 tokens). The backward recomputes c from a and b
    (one pass of the gated kernel) for the down projection's weight gradient, then reuses that buffer
    and the one of dc for the gated activation's gradients: it allocates no more than the unfused
    backward and never writes over a saved tensor, so a graph kept with retain_graph=True can be run
    backward again. c is bitwise the forward's c (the same kernel on the same a and b).
    """

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, activation="silu"):
        _check_cuda(x, w_gate, w_up, w_down)
        if activation not in _o.ACTIVATIONS:
            raise ValueError(f"tigon_torch: activation must be one of {sorted(_o.ACTIVATIONS)}, got {activation!r}")
        for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
            if w.dim() != 2 or w.dtype != x.dtype:
                raise ValueError(f"tigon_torch: {name} must be a matrix of x's dtype {x.dtype}, got "
                                 f"{tuple(w.shape)} {w.dtype}")
        inter, hidden = w_gate.shape
        if x.shape[-1] != hidden or tuple(w_up.shape) != (inter, hidden) or tuple(w_down.shape) != (hidden, inter):
            raise ValueError(f"tigon_torch: shapes x {tuple(x.shape)}, w_gate {tuple(w_gate.shape)}, w_up "
                             f"{tuple(w_up.shape)}, w_down {tuple(w_down.shape)} do not make a gated MLP")
        act = _o.ACTIVATIONS[activation]
        x2 = x.reshape(-1, hidden)
        a = torch.nn.functional.linear(x2, w_gate)
        b = torch.nn.functional.linear(x2, w_up)
        c = torch.empty_like(a)
        if a.numel() > 0:
            ops().gated_fwd(a, b, c, act, 1.0, 1.0)
        # The output in x's shape as a tensor of its own, not a view made inside the function: callers
        # may modify it in place (Llama 4 adds the routed experts into the shared expert's output).
        y = torch.empty(*x.shape[:-1], hidden, dtype=x.dtype, device=x.device)
        torch.mm(c, w_down.t(), out=y.view(-1, hidden))
        ctx.save_for_backward(x2, w_gate, w_up, w_down, a, b)
        ctx.act, ctx.x_shape = act, x.shape
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x2, w_gate, w_up, w_down, a, b = ctx.saved_tensors
        need_x, need_gate, need_up, need_down = ctx.needs_input_grad[:4]
        dy2 = _cast(dy.reshape(-1, dy.shape[-1]), a.dtype)
        dx = dw_gate = dw_up = dw_down = None
        # c again (into a buffer the gated gradient reuses), for the down projection's weight.
        c = torch.empty_like(a)
        if need_down:
            if a.numel() > 0:
                ops().gated_fwd(a, b, c, ctx.act, 1.0, 1.0)
            dw_down = dy2.t().mm(c)
        if need_x or need_gate or need_up:
            dc = dy2.mm(w_down)
            # da over dc and db over c (the kernel allows both: it reads an element's dc, a, b before
            # writing its da, db); fresh buffers under torch.compile, whose functionalisation does not
            # take an output aliasing an input.
            da, db = (torch.empty_like(a), torch.empty_like(b)) if _compiling() else (dc, c)
            if a.numel() > 0:
                ops().gated_bwd(dc, a, b, da, db, ctx.act, 1.0, 1.0)
            if need_x:
                # Two products, each rounded to the dtype, then their sum: the unfused MLP's dx bit for
                # bit (autograd adds gate_proj's and up_proj's input gradients); one addmm_ would round
                # once and differ by an ulp wherever the two terms cancel.
                dx = da.mm(w_gate)
                dx.add_(db.mm(w_up))
                dx = dx.reshape(ctx.x_shape)
            if need_gate:
                dw_gate = da.t().mm(x2)
            if need_up:
                dw_up = db.t().mm(x2)
        return dx, dw_gate, dw_up, dw_down, None


# ------------------------------------------------------------------------------------------------
# Cross-entropy
# ------------------------------------------------------------------------------------------------


class TargetOutOfRangeError(ValueError, AssertionError):
    """A target that is neither ignore_index nor a class in [0, vocab_size). A ValueError, and an
    AssertionError too, so that code written against Liger-Kernel (which asserts) catches it."""


def count_invalid_targets(target: torch.Tensor, vocab_size: int, ignore_index: int = -100) -> torch.Tensor:
    """The number of targets that are neither ignore_index nor in [0, vocab_size), as a 0-d int64
    tensor on target's device: no host synchronisation, so it can be called inside a CUDA graph or a
    compiled step and read when the trainer next synchronises (its logging step, say)."""
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab_size))
    return bad.sum()


def _flat(t: torch.Tensor) -> torch.Tensor:
    """t as a contiguous 1-D tensor: itself when it is one (no operator call on the per-call path)."""
    return t if t.dim() == 1 and t.is_contiguous() else t.reshape(-1).contiguous()


def _target_check_mode(target: torch.Tensor) -> int:
    """-1 when the eager host check does not run: while torch.compile traces, on fake or meta tensors,
    while the current CUDA stream is being captured into a graph, when CUDA's sync debug mode is
    "error" (a step declared synchronisation-free), and with TIGON_TORCH_CHECK_TARGETS=0. In those
    cases the kernels' own contract holds: no out-of-bounds access, a NaN loss for the row. Otherwise
    the sync debug mode the check runs under (0, or 1 for "warn"; 0 off the GPU). A plain tensor that
    is not a functional wrapper is never fake, so it skips the fake-tensor test."""
    if _compiling() or target.is_meta or os.environ.get("TIGON_TORCH_CHECK_TARGETS") == "0":
        return -1
    if (type(target) is not torch.Tensor or torch._is_functional_tensor(target)) and _is_fake(target):
        return -1
    if not target.is_cuda:
        return 0
    if torch.cuda.is_current_stream_capturing():
        return -1
    mode = torch.cuda.get_sync_debug_mode()
    return -1 if mode == 2 else mode


def _report_sync(stacklevel: int) -> None:
    """The target check's synchronisation reported under CUDA's sync debug mode "warn", as torch reports
    its own synchronising calls; stacklevel counts from the caller of this function."""
    warnings.warn("tigon_torch.check_targets: called a synchronizing CUDA operation", stacklevel=stacklevel)


def check_targets(target: torch.Tensor, vocab_size: int, ignore_index: int = -100) -> int | None:
    """Raises TargetOutOfRangeError, naming the offending value, the vocabulary size and ignore_index,
    when a target is neither ignore_index nor in [0, vocab_size); otherwise returns the number of
    targets that are not ignore_index (None where the check does not run). Eager mode only (see
    _target_check_mode); the cross-entropy functions call it before any kernel runs, so no loss or
    gradient is written for a bad batch. Cost: one min/max/count pass over the targets and one host
    synchronisation, which waits for the device work queued before the loss (reported as a warning
    when CUDA's sync debug mode is "warn", as torch's own synchronising calls are). For int64 or int32
    targets on the GPU that is one operator call (tigon.target_range: one launch whose blocks write
    their (min, max, count) into pinned host memory, then the synchronisation); otherwise a few torch
    operations and a 24-byte copy to the host."""
    if vocab_size < 1:
        return None
    if target.numel() == 0:
        return 0
    mode = _target_check_mode(target)
    if mode < 0:
        return None
    # Ignored targets count as 0, a valid class, so that one (min, max) pair decides.
    if target.dtype in (torch.int64, torch.int32) and _o.on_device(target):
        if mode == 1:
            _report_sync(3)
        lo, hi, count = ops().target_range(_flat(target), int(ignore_index))
    else:
        ignored = target == ignore_index
        t = target.masked_fill(ignored, 0)
        lo, hi, count = torch.stack([*torch.aminmax(t), (~ignored).sum()]).tolist()
    if lo >= 0 and hi < vocab_size:
        return int(count)
    value = lo if lo < 0 else hi
    raise TargetOutOfRangeError(
        f"tigon_torch: target {value} is out of bounds: every target must be ignore_index ({ignore_index}) or a "
        f"class in [0, {vocab_size}) (vocabulary size {vocab_size})")


# A row whose target is ignore_index adds nothing to a linear head's loss or gradients. When at least
# 1 / _SKIP_SHARE of a call's rows are ignored (a masked prompt, say), the linear heads run on the other
# rows alone, gathered into a buffer of their own: their GEMMs over the vocabulary shrink with the
# ignored share, for a gather of those rows of x (H values a row) and a scatter of their dx. Below that
# share every row runs.
_SKIP_SHARE = 32


def _kept_rows(target: torch.Tensor, count, ignore_index: int):
    """The indices (int64 [count], ascending) of target's rows that are not ignore_index when the linear
    heads skip the ignored ones, else None. count: check_targets' count of such rows (None when the
    check did not run: under torch.compile, capture or TIGON_TORCH_CHECK_TARGETS=0 every row runs)."""
    rows = target.numel()
    if count is None or count == 0 or (rows - count) * _SKIP_SHARE < rows:
        return None
    return torch.nonzero_static(target != ignore_index, size=count).reshape(-1)


def _head_sums(w, b):
    """(1^T W, 1^T b) in fp32 (the second None without a bias): what _ignored_logit_sums takes."""
    return w.sum(0, dtype=torch.float32), (b.sum(dtype=torch.float32) if b is not None else None)


def _ignored_logit_sums(x2, head_sums, target, ignore_index: int, ignored: int):
    """(indices, sums): the rows of x2 whose target is ignore_index (ignored of them) and the sum over the
    vocabulary of each one's logits x W^T + b, as x (1^T W) + 1^T b in fp32 (head_sums: _head_sums(W, b)):
    the logit sums of the rows the linear heads skip (_kept_rows), which Liger's preference losses report
    as the logits' means."""
    wsum, bsum = head_sums
    ign = torch.nonzero_static(target == ignore_index, size=ignored).reshape(-1)
    sums = (x2.index_select(0, ign).float() * wsum).sum(-1)  # fp32 under autocast too
    return ign, (sums + bsum if bsum is not None else sums)


def _take(keep, *tensors):
    """The kept rows of each tensor (None stays None), or the tensors themselves when keep is None: the
    gather half of _kept_rows, whose other half is _spread."""
    if keep is None:
        return tensors
    return tuple(t.index_select(0, keep) if t is not None else None for t in tensors)


def _spread(t, keep, rows: int, fill=0):
    """The kept rows' values t [count, ...] at their rows of a [rows, ...] tensor filled with fill."""
    if t is None or keep is None:
        return t
    out = t.new_full((rows, *t.shape[1:]), fill)
    return out.index_copy_(0, keep, t)


def _ce_flags(return_z_loss, return_token_accuracy, return_predicted_tokens):
    for name, v in (
        ("return_z_loss", return_z_loss),
        ("return_token_accuracy", return_token_accuracy),
        ("return_predicted_tokens", return_predicted_tokens),
    ):
        if not isinstance(v, bool):
            raise ValueError(f"tigon_torch: {name} must be True or False, got {v!r}")


def _class_weights(weight, vocab, device):
    if weight is None:
        return None
    if not torch.is_floating_point(weight):
        raise ValueError(f"tigon_torch: class weights must be a floating-point tensor, got {weight.dtype}")
    if weight.dim() != 1 or weight.shape[0] != vocab:
        raise ValueError(f"tigon_torch: class weights must have shape [{vocab}], got {tuple(weight.shape)}")
    return weight.to(device=device, dtype=torch.float32).contiguous()


def _ce_outputs(rows, device, reduction, want_z, want_argmax, z_scale):
    """Output buffers of one cross-entropy call (forward, no gradient)."""
    red = _o.reduction_code(reduction)
    f32 = dict(dtype=torch.float32, device=device)
    loss = torch.empty((), **f32) if red != 0 else None
    loss_rows = torch.empty(rows, **f32) if red == 0 else None
    z_loss = torch.empty((), **f32) if (want_z and red != 0) else None
    lse = torch.empty(rows, **f32) if (want_z and red == 0 and z_scale != 0.0) else None
    argmax = torch.empty(rows, dtype=torch.int64, device=device) if want_argmax else None
    return red, loss, loss_rows, z_loss, lse, argmax


def _ce_extras(target, ignore_index, reduction, out_dtype, z_dtype, loss, loss_rows, z_loss, lse, argmax,
               z_scale, return_z_loss, return_token_accuracy, return_predicted_tokens):
    """The four return values (loss, z_loss, token_accuracy, predicted_tokens), all on the device."""
    loss_out = _cast(loss_rows if reduction == "none" else loss, out_dtype)
    if not (return_z_loss or return_token_accuracy or return_predicted_tokens):
        return loss_out, None, None, None
    valid = target != ignore_index
    z_out = None
    if return_z_loss:
        if reduction == "none":
            z_rows = torch.zeros_like(loss_rows) if lse is None else z_scale * lse * lse * valid
            z_out = _cast(z_rows, z_dtype)
        else:
            z_out = _cast(z_loss, z_dtype)
    acc = None
    if return_token_accuracy:
        correct = ((argmax == target) & valid).to(torch.float32)
        acc = correct if reduction == "none" else correct.sum() / valid.sum().clamp_min(1)
    pred = torch.where(valid, argmax, torch.full_like(argmax, -1)) if return_predicted_tokens else None
    return loss_out, z_out, acc, pred


def _ce_forward(ctx, _input, target, weight, ignore_index, lse_square_scale, label_smoothing, reduction, softcap,
                return_z_loss, return_token_accuracy, return_predicted_tokens, loss_dtype, in_place=False):
    _ce_flags(return_z_loss, return_token_accuracy, return_predicted_tokens)
    _check_cuda(_input, target)
    if _input.dim() != 2:
        raise ValueError(f"tigon_torch: _input must be [BT, V], got shape {tuple(_input.shape)}")
    x2 = as_rows(_input)
    target = _flat(target)
    rows, vocab = x2.shape
    check_targets(target, vocab, int(ignore_index))  # before the kernel, which may write the gradient
    cw = _class_weights(weight, vocab, x2.device)
    z_scale = float(lse_square_scale)
    cap = 0.0 if softcap is None else float(softcap)
    red, loss, loss_rows, z_loss, lse, argmax = _ce_outputs(
        rows, x2.device, reduction, return_z_loss, return_token_accuracy or return_predicted_tokens, z_scale)
    # The gradient (for an upstream gradient of 1) in the forward's pass, scaled by the backward
    # (scale_rows, which skips rows whose upstream gradient is 1): in place over the logits when asked,
    # else into a buffer of its own (the memory the backward would allocate anyway) when the logits
    # need a gradient — one read of the logits instead of two. Neither under torch.compile (its graph
    # keeps the two kernels) nor for float16 (the gradient would be rounded to fp16 before a loss scale
    # reaches it, and its small entries would underflow).
    one_pass = not _compiling() and _input.dtype != torch.float16
    in_place = bool(in_place) and _input.requires_grad and one_pass
    early = not in_place and bool(ctx.needs_input_grad[0]) and one_pass and rows > 0
    grad = torch.empty_like(x2, memory_format=torch.contiguous_format) if early else None
    if rows > 0:
        ops().cross_entropy(x2, target, cw, None, x2 if in_place else grad, loss, loss_rows, z_loss, lse, argmax,
                            int(ignore_index), float(label_smoothing), z_scale, cap, red, 1.0)
        if in_place and _same_storage(x2, _input):
            # The operator wrote the logits' memory without bumping their version counter: bump it,
            # so that a node that saved the logits (a softcap's tanh, say) raises at its backward
            # instead of reading the gradient.
            torch.autograd.graph.increment_version(_input)
    else:
        for t in (loss, loss_rows, z_loss):
            if t is not None:
                t.zero_()
    ctx.in_place, ctx.consumed = in_place, False
    ctx.early = grad
    if in_place:
        # Detached: x2 is a view of _input made here, whose storage this call overwrote.
        ctx.save_for_backward(x2.detach())
    elif _input.requires_grad:
        ctx.save_for_backward(x2, target, cw)
    ctx.args = (int(ignore_index), float(label_smoothing), z_scale, cap, red)
    out = _ce_extras(target, ignore_index, reduction, loss_dtype, loss_dtype, loss, loss_rows, z_loss, lse, argmax,
                     z_scale, return_z_loss, return_token_accuracy, return_predicted_tokens)
    for t in out[2:]:
        if t is not None:
            ctx.mark_non_differentiable(t)
    return out


def _ce_backward(ctx, grad_output):
    nones = (None,) * 10
    if grad_output is None or not ctx.needs_input_grad[0]:
        return (None,) + nones
    if ctx.in_place:
        if ctx.consumed:
            raise RuntimeError(
                "tigon_torch: the in-place cross-entropy's gradient (written over the logits in the forward) "
                "was already scaled by a first backward; a second backward through the same graph "
                "(retain_graph=True) needs in_place=False")
        ctx.consumed = True
        (dx,) = ctx.saved_tensors
        if dx.shape[0] > 0:
            ops().scale_rows(dx, grad_output.to(torch.float32).reshape(-1).contiguous())
        return (dx,) + nones
    x2, target, cw = ctx.saved_tensors
    ignore_index, smoothing, z_scale, cap, red = ctx.args
    go = grad_output.to(torch.float32)
    go = go.reshape(()) if red != 0 else go.reshape(-1).contiguous()
    if ctx.early is not None:
        # The gradient the forward wrote (for an upstream gradient of 1), scaled here; handed out once
        # (autograd may keep it as the logits' .grad), so a second backward recomputes below.
        dx, ctx.early = ctx.early, None
        ops().scale_rows(dx, go)
        return (dx,) + nones
    dx = torch.empty_like(x2, memory_format=torch.contiguous_format)
    if x2.shape[0] > 0:
        ops().cross_entropy(x2, target, cw, go, dx, None, None, None, None, None, ignore_index, smoothing, z_scale,
                            cap, red, 1.0)
    return (dx,) + nones


class TigonCrossEntropyFunction(torch.autograd.Function):
    """Cross-entropy over logits _input [BT, V] and targets [BT] (int64 or int32), with class weights,
    ignore_index, label smoothing, z-loss (lse_square_scale * lse^2 per token, included in the loss),
    a logit softcap and reductions "mean" (over the non-ignored tokens, weighted), "sum", "none".
    Returns (loss, z_loss, token_accuracy, predicted_tokens); the last three are None unless asked for.

    By default _input is never modified. When it needs a gradient, the forward's one pass over the
    logits also writes dlogits for an upstream gradient of 1 into a buffer of its own (the [BT, V]
    the backward would allocate anyway), and the backward multiplies it by the upstream gradient on
    the device, skipping rows whose upstream gradient is exactly 1 (the usual scalar 1 costs one launch
    and no pass; any other value one more pass, and a second rounding to _input's dtype). A second
    backward through the same graph (retain_graph=True), float16 logits and torch.compile take the
    two-pass form: the forward computes the loss alone and the backward dlogits with the upstream
    gradient folded in (one rounding). in_place=True (Liger's behaviour: Liger always
    overwrites its input) writes the gradient over _input in the forward, in the same kernel call as
    the loss, with no [BT, V] allocation (when _input's rows are contiguous; otherwise into a copy);
    the backward multiplies it by the upstream gradient on the device, skipping rows whose upstream
    gradient is exactly 1 (so the usual scalar 1 costs one launch and no pass; any other value one
    more pass, and a second rounding of the gradient to _input's dtype). Then _input holds the
    gradient once the forward returns (for a leaf, .grad shares its storage), its version counter is
    bumped (a node that saved it raises at backward), and one backward per forward is allowed (a
    second raises). in_place is ignored for float16 logits (the gradient would be rounded to fp16
    before a loss scale reaches it) and under torch.compile; pass it only when a backward follows
    (tigon_cross_entropy and TigonCrossEntropyLoss drop it when grad mode is off). loss and z_loss are
    returned in _input's dtype (as Liger), computed in fp32.

    A target that is neither ignore_index nor in [0, V) raises TargetOutOfRangeError in eager mode,
    before any kernel runs (check_targets: one host synchronisation); under CUDA-graph capture and
    torch.compile the check is skipped and that row's loss is NaN (no out-of-bounds access).
    """

    @staticmethod
    def forward(
        ctx,
        _input: torch.Tensor,
        target: torch.Tensor,
        weight,
        ignore_index: int = -100,
        lse_square_scale: float = 0.0,
        label_smoothing: float = 0.0,
        reduction: str = "mean",
        softcap=None,
        return_z_loss: bool = False,
        return_token_accuracy: bool = False,
        return_predicted_tokens: bool = False,
        in_place: bool = False,
    ):
        return _ce_forward(ctx, _input, target, weight, ignore_index, lse_square_scale, label_smoothing, reduction,
                           softcap, return_z_loss, return_token_accuracy, return_predicted_tokens, _input.dtype,
                           in_place)

    @staticmethod
    def backward(ctx, grad_output, grad_output2, grad_output3, grad_output4):
        return _ce_backward(ctx, grad_output) + (None,)


class TigonCrossEntropyFP32Function(torch.autograd.Function):
    """TigonCrossEntropyFunction with the loss returned in fp32 whatever the logits' dtype (Hugging
    Face's causal-LM loss upcasts to fp32; the patches' cross_entropy=True uses this)."""

    @staticmethod
    def forward(ctx, _input, target, weight, ignore_index=-100, lse_square_scale=0.0, label_smoothing=0.0,
                reduction="mean", softcap=None, return_z_loss=False, return_token_accuracy=False,
                return_predicted_tokens=False):
        return _ce_forward(ctx, _input, target, weight, ignore_index, lse_square_scale, label_smoothing, reduction,
                           softcap, return_z_loss, return_token_accuracy, return_predicted_tokens, torch.float32)

    @staticmethod
    def backward(ctx, grad_output, grad_output2, grad_output3, grad_output4):
        return _ce_backward(ctx, grad_output)


_OUT_OF_RANGE = "tigon_torch: target "  # how the C++ target check's message begins


def _checked_loss(op, target, *args):
    """op(*args, check) for the loss operators whose autograd is C++ (tigon.cross_entropy_loss,
    tigon.linear_cross_entropy_loss): check says whether they run the eager target check
    (_target_check_mode), whose out-of-range error becomes TargetOutOfRangeError here."""
    mode = _target_check_mode(target)
    if mode == 1 and target.numel() > 0:
        _report_sync(5)
    try:
        return op(*args, mode >= 0)
    except ValueError as e:
        if str(e).startswith(_OUT_OF_RANGE):
            raise TargetOutOfRangeError(str(e)) from None
        raise


def cross_entropy(_input, target, weight, ignore_index, lse_square_scale, label_smoothing, reduction, softcap,
                  return_z_loss, return_token_accuracy, return_predicted_tokens, in_place=False, fp32=False):
    """TigonCrossEntropyFunction's four return values (fp32=True: TigonCrossEntropyFP32Function's). Eager
    calls that ask for the loss alone on contiguous CUDA logits and targets go through
    tigon.cross_entropy_loss, whose autograd is C++: the same target check, kernels and results, bit
    for bit, with no Python in the forward's or the backward's path."""
    if (return_z_loss is False and return_token_accuracy is False and return_predicted_tokens is False
            and _cpp(_input, target) and (weight is None or type(weight) in _PLAIN)):
        loss = _checked_loss(ops().cross_entropy_loss, target, _input, target, weight, int(ignore_index),
                             float(lse_square_scale), float(label_smoothing), _o.reduction_code(reduction),
                             0.0 if softcap is None else float(softcap), bool(in_place), fp32)
        return loss, None, None, None
    if fp32:
        return TigonCrossEntropyFP32Function.apply(_input, target, weight, ignore_index, lse_square_scale,
                                                   label_smoothing, reduction, softcap, return_z_loss,
                                                   return_token_accuracy, return_predicted_tokens)
    return TigonCrossEntropyFunction.apply(_input, target, weight, ignore_index, lse_square_scale, label_smoothing,
                                           reduction, softcap, return_z_loss, return_token_accuracy,
                                           return_predicted_tokens, in_place)


# ------------------------------------------------------------------------------------------------
# Fused linear cross-entropy
# ------------------------------------------------------------------------------------------------


def _head_operands(x, w, b):
    """An LM head's (x, W, b) in one dtype: cast to the autocast dtype under CUDA autocast (as the unfused
    head's matmul would be), else required to share x's dtype."""
    if torch.is_autocast_enabled("cuda"):
        dt = torch.get_autocast_dtype("cuda")
        x, w = x.to(dt), w.to(dt)
        b = b.to(dt) if b is not None else None
    if w.dtype != x.dtype or (b is not None and b.dtype != x.dtype):
        raise TypeError(
            f"tigon_torch: _input ({x.dtype}), weight ({w.dtype}) and bias must have one dtype "
            "(or run under autocast)")
    return x, w, b


def _lce_chunk() -> int:
    return int(os.environ.get("TIGON_TORCH_LCE_CHUNK", "0"))


class TigonFusedLinearCrossEntropyFunction(torch.autograd.Function):
    """The LM head's loss CE(_input @ weight.T + bias, target) without the [BT, V] logits: tigon's
    chunked linear cross-entropy (one logits chunk of workspace; GEMMs on cuBLASLt with fp32
    accumulation inside each product; dW and dB accumulated across the chunks in accum_dtype, returned
    in the weight's dtype).
    _input: [BT, H]; weight: [V, H]; target: [BT]; bias: [V] or None; ce_weight: class weights [V].
    Returns (loss, z_loss, token_accuracy, predicted_tokens) like Liger; loss is fp32.

    With reduction "mean" / "sum" the gradients are computed in the forward (the loss is the last
    op) and scaled by the upstream gradient in the backward; with "none" the forward computes only
    the loss and the backward runs the op again with the per-token upstream gradient.

    Under autocast (CUDA), _input, weight and bias are cast to the autocast dtype, as the matmul of
    the unfused head would be. accum_dtype, as Liger's: None (the default) accumulates dW and dB in the
    weight's dtype (each chunk's product adds into them and rounds once, no fp32 copy of [V, H]: Liger's
    and PyTorch's memory), torch.float32 in an fp32 buffer cast at the end (one rounding; 4 bytes an
    element more while the head runs); float16 weights, and weights autocast casts to another dtype, always
    accumulate in fp32.
    use_token_scaling=True multiplies each token's loss, z-loss and gradient by its predicted
    probability of the target, exp(logit_t - lse) in fp32 (softcapped logits), held constant. The
    chunk size is tigon's default (about 1 GiB of logits) unless the environment sets
    TIGON_TORCH_LCE_CHUNK (tokens per chunk). Targets are checked as in TigonCrossEntropyFunction
    (eager: TargetOutOfRangeError before any gradient is computed).
    """

    @staticmethod
    def forward(
        ctx,
        _input,
        weight,
        target,
        bias=None,
        ce_weight=None,
        ignore_index=-100,
        lse_square_scale=0.0,
        label_smoothing=0.0,
        reduction="mean",
        softcap=None,
        return_z_loss: bool = False,
        accum_dtype=None,
        use_token_scaling: bool = False,
        return_token_accuracy: bool = False,
        return_predicted_tokens: bool = False,
    ):
        _ce_flags(return_z_loss, return_token_accuracy, return_predicted_tokens)
        _check_cuda(_input, weight, target, bias)
        in_dtype, w_dtype = _input.dtype, weight.dtype
        b_dtype = bias.dtype if bias is not None else None
        x, w, b = _head_operands(_input, weight, bias)
        hidden = x.shape[-1]
        x2 = as_rows(x.reshape(-1, hidden))
        w = w.contiguous()
        b = vector(b)
        target = _flat(target)
        rows, vocab = x2.shape[0], w.shape[0]
        if target.shape[0] != rows:
            raise ValueError(f"tigon_torch: target has {target.shape[0]} tokens, _input {rows}")
        keep = _kept_rows(target, check_targets(target, vocab, int(ignore_index)), int(ignore_index))
        # The rows the op runs on: every row, or the rows whose target is not ignored (_kept_rows).
        xk, tk = _take(keep, x2, target)
        cw = _class_weights(ce_weight, vocab, x2.device)
        z_scale = float(lse_square_scale)
        cap = 0.0 if softcap is None else float(softcap)
        want_dx = ctx.needs_input_grad[0]
        want_dw = ctx.needs_input_grad[1]
        want_db = bias is not None and ctx.needs_input_grad[3]
        needs_grad = want_dx or want_dw or want_db
        defer = reduction == "none" and needs_grad
        red, loss, loss_rows, z_loss, lse, argmax = _ce_outputs(
            tk.shape[0], x2.device, reduction, return_z_loss, return_token_accuracy or return_predicted_tokens,
            z_scale)
        dx = dw = db = None
        gdt = _head_grad_dtype(w_dtype, accum_dtype, w.dtype)  # the parameter's dtype (fp32 masters under autocast)
        if needs_grad and not defer:
            dx = torch.empty_like(xk, memory_format=torch.contiguous_format) if want_dx else None
            dw = torch.empty(w.shape, dtype=gdt, device=w.device) if want_dw else None
            db = torch.empty(vocab, dtype=gdt, device=w.device) if want_db else None
        chunk = _lce_chunk()
        args = (int(ignore_index), float(label_smoothing), z_scale, cap, red, 1.0, bool(use_token_scaling), chunk)
        if rows > 0:
            ops().linear_cross_entropy(xk, w, b, tk, cw, None, dx, dw, db, loss, loss_rows, z_loss, lse, argmax,
                                       *args)
        else:
            for t in (loss, loss_rows, z_loss, dw, db):
                if t is not None:
                    t.zero_()
        loss_rows, lse, argmax, dx = (_spread(t, keep, rows) for t in (loss_rows, lse, argmax, dx))
        ctx.defer = defer
        ctx.dtypes = (in_dtype, w_dtype, b_dtype)
        ctx.shape = _input.shape
        ctx.rows = rows
        if defer:
            ctx.save_for_backward(x2, w, b, target, cw, keep)
            ctx.args = args
            ctx.wants = (want_dx, want_dw, want_db)
            ctx.grad_dtype = gdt
        elif needs_grad:
            ctx.save_for_backward(_saved_grad(dx, in_dtype), _saved_grad(dw, w_dtype), _saved_grad(db, b_dtype))
        out = _ce_extras(target, ignore_index, reduction, torch.float32, in_dtype, loss, loss_rows, z_loss, lse,
                         argmax, z_scale, return_z_loss, return_token_accuracy, return_predicted_tokens)
        for t in out[2:]:
            if t is not None:
                ctx.mark_non_differentiable(t)
        return out

    @staticmethod
    def backward(ctx, grad_output, grad_output2, grad_output3, grad_output4):
        nones = (None,) * 11
        if grad_output is None or not any(ctx.needs_input_grad[i] for i in (0, 1, 3)):
            return (None, None, None, None) + nones
        in_dtype, w_dtype, b_dtype = ctx.dtypes
        if ctx.defer:
            x2, w, b, target, cw, keep = ctx.saved_tensors
            want_dx, want_dw, want_db = ctx.wants
            x2, target, go = _take(keep, x2, target, grad_output.to(torch.float32).reshape(-1))
            go = go.contiguous()
            dx = torch.empty_like(x2, memory_format=torch.contiguous_format) if want_dx else None
            dw = torch.empty(w.shape, dtype=ctx.grad_dtype, device=w.device) if want_dw else None
            db = torch.empty(w.shape[0], dtype=ctx.grad_dtype, device=w.device) if want_db else None
            if x2.shape[0] > 0:
                ops().linear_cross_entropy(x2, w, b, target, cw, go, dx, dw, db, None, None, None, None, None,
                                           *ctx.args)
            else:
                for t in (dw, db):
                    if t is not None:
                        t.zero_()
            dx = _spread(dx, keep, ctx.rows)
            dx, dw, db = _cast(dx, in_dtype), _cast(dw, w_dtype), _cast(db, b_dtype)
        else:
            go = grad_output.reshape(())
            dx, dw, db = (_scaled_grad(t, go, d) for t, d in zip(ctx.saved_tensors, ctx.dtypes))
        if dx is not None:
            dx = dx.view(ctx.shape)
        return (dx, dw, None, db) + nones


def linear_cross_entropy(_input, weight, target, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing,
                         reduction, softcap, return_z_loss, accum_dtype, use_token_scaling, return_token_accuracy,
                         return_predicted_tokens):
    """TigonFusedLinearCrossEntropyFunction's four return values. Eager calls with reduction "mean" or
    "sum" that ask for the loss alone on contiguous CUDA tensors go through
    tigon.linear_cross_entropy_loss, whose autograd is C++: the same target check, kernels and
    results, bit for bit, with no Python in the forward's or the backward's path."""
    if (return_z_loss is False and return_token_accuracy is False and return_predicted_tokens is False
            and (reduction == "mean" or reduction == "sum") and (accum_dtype is None or accum_dtype is torch.float32)
            and _cpp(_input, weight, target) and (bias is None or _cpp(bias))
            and (ce_weight is None or type(ce_weight) in _PLAIN)):
        loss = _checked_loss(ops().linear_cross_entropy_loss, target, _input, weight, bias, target, ce_weight,
                             int(ignore_index), float(lse_square_scale), float(label_smoothing),
                             2 if reduction == "mean" else 1, 0.0 if softcap is None else float(softcap),
                             accum_dtype is not None, bool(use_token_scaling), _lce_chunk())
        return loss, None, None, None
    return TigonFusedLinearCrossEntropyFunction.apply(
        _input, weight, target, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing, reduction, softcap,
        return_z_loss, accum_dtype, use_token_scaling, return_token_accuracy, return_predicted_tokens)


class TigonFusedLinearMultiHeadCrossEntropyFunction(torch.autograd.Function):
    """Several LM heads over the same hidden states (Medusa's extra heads) in one tigon call
    (tigon.linear_cross_entropy_heads): loss = sum_k head_weights[k] * CE(_input @ W_k.T + b_k, targets[k]),
    each CE_k reduced over its own non-ignored targets, without any [BT, V] logits; per chunk of tokens
    every head's logits, loss and gradients in turn, dx summed over the heads.

    apply(_input [BT, H], targets [K, BT], head_weights (K floats or None: all 1), ignore_index,
    lse_square_scale, label_smoothing, reduction ("mean" / "sum"), softcap, K, W_1, ..., W_K, b_1, ..., b_K)
    with each b_k a [V] tensor or None (all None, or all given). Returns (loss, head_losses [K]) in fp32;
    head_losses are each head's unweighted loss and take no gradient. The gradients are computed in
    the forward and scaled by the upstream gradient in the backward, as for the single head, and
    accumulated across the chunks in the weights' dtype (float16: fp32), as the single head's default.
    Under autocast the operands are cast to the autocast dtype. medusa_targets() builds the targets
    from causal-LM labels."""

    @staticmethod
    def forward(ctx, _input, targets, head_weights, ignore_index, lse_square_scale, label_smoothing, reduction,
                softcap, heads, *params):
        heads = int(heads)
        if heads < 1 or len(params) not in (heads, 2 * heads):
            raise ValueError(f"tigon_torch: {heads} heads need {heads} weights (and as many biases or Nones), "
                             f"got {len(params)} tensors")
        weights = list(params[:heads])
        biases = list(params[heads:]) if len(params) == 2 * heads else [None] * heads
        if any(b is not None for b in biases) and any(b is None for b in biases):
            raise ValueError("tigon_torch: give a bias for every head or for none")
        if reduction not in ("mean", "sum"):
            raise ValueError(f"tigon_torch: reduction must be 'mean' or 'sum' for several heads, got {reduction!r}")
        _check_cuda(_input, targets, *weights, *[b for b in biases if b is not None])
        ops_in = [_head_operands(_input, w, b) for w, b in zip(weights, biases)]
        x = ops_in[0][0]
        ws = [w.contiguous() for _, w, _ in ops_in]
        bs = [vector(b) for _, _, b in ops_in] if biases[0] is not None else []
        hidden = x.shape[-1]
        x2 = as_rows(x.reshape(-1, hidden))
        rows = x2.shape[0]
        vocab = ws[0].shape[0]
        for k, w in enumerate(ws):
            if tuple(w.shape) != (vocab, hidden):
                raise ValueError(f"tigon_torch: head {k}'s weight is {tuple(w.shape)}, expected ({vocab}, {hidden})")
        if targets.dim() != 2 or tuple(targets.shape) != (heads, rows):
            raise ValueError(f"tigon_torch: targets must be [heads, tokens] = [{heads}, {rows}], got "
                             f"{tuple(targets.shape)}")
        targets = targets.contiguous()
        check_targets(targets.reshape(-1), vocab, int(ignore_index))
        hw = [1.0] * heads if head_weights is None else [float(v) for v in head_weights]
        if len(hw) != heads or not all(math.isfinite(v) for v in hw):
            raise ValueError(f"tigon_torch: head_weights must be {heads} finite numbers, got {head_weights}")
        want_dx = ctx.needs_input_grad[0]
        want_dw = any(ctx.needs_input_grad[9 + k] for k in range(heads))
        want_db = bool(bs) and any(ctx.needs_input_grad[9 + heads + k] for k in range(heads))
        dev = x2.device
        loss = torch.empty((), dtype=torch.float32, device=dev)
        head_losses = torch.empty(heads, dtype=torch.float32, device=dev)
        dx = torch.empty_like(x2, memory_format=torch.contiguous_format) if want_dx else None
        gdt = _head_grad_dtype(weights[0].dtype, None, ws[0].dtype)  # as the single head's default (accum_dtype None)
        dws = [torch.empty(w.shape, dtype=gdt, device=dev) for w in ws] if want_dw else []
        dbs = [torch.empty(vocab, dtype=gdt, device=dev) for _ in bs] if want_db else []
        cap = 0.0 if softcap is None else float(softcap)
        if rows > 0:
            ops().linear_cross_entropy_heads(x2, ws, bs, targets, None, None, hw, dx, dws, dbs, loss, head_losses,
                                             None, None, int(ignore_index), float(label_smoothing),
                                             float(lse_square_scale), cap, _o.reduction_code(reduction), 1.0,
                                             _lce_chunk())
        else:
            loss.zero_()
            head_losses.zero_()
            for t in dws + dbs:
                t.zero_()
        ctx.heads = heads
        ctx.nparams = len(params)
        ctx.shape = _input.shape
        ctx.save_for_backward(
            _saved_grad(dx, _input.dtype),
            *[_saved_grad(d, w.dtype) for d, w in zip(dws, weights)],
            *[_saved_grad(d, b.dtype) for d, b in zip(dbs, biases)])
        ctx.dtypes = (_input.dtype, [w.dtype for w in weights[:len(dws)]], [b.dtype for b in biases[:len(dbs)]])
        ctx.counts = (want_dx, len(dws), len(dbs))
        ctx.mark_non_differentiable(head_losses)
        return loss, head_losses

    @staticmethod
    def backward(ctx, grad_output, grad_heads):
        heads = ctx.heads
        want_dx, ndw, ndb = ctx.counts
        saved = ctx.saved_tensors
        dx, dws, dbs = saved[0], saved[1:1 + ndw], saved[1 + ndw:1 + ndw + ndb]
        in_dtype, w_dtypes, b_dtypes = ctx.dtypes
        go = grad_output.reshape(()) if grad_output is not None else None

        def scale(t, dtype):
            return _scaled_grad(t, go, dtype) if go is not None else torch.zeros_like(t, dtype=dtype)

        dx = scale(dx, in_dtype).view(ctx.shape) if dx is not None else None
        dw_out = [scale(d, t) for d, t in zip(dws, w_dtypes)] if ndw else [None] * heads
        db_out = [scale(d, t) for d, t in zip(dbs, b_dtypes)] if ndb else [None] * heads
        grads = (*dw_out, *db_out)[: ctx.nparams]
        return (dx, None, None, None, None, None, None, None, None, *grads)


def medusa_targets(labels, heads, ignore_index=-100, offset=2):
    """[heads, B * T] targets of Medusa's heads from causal-LM labels [B, T]: head k at position t predicts
    labels[b, t + offset + k] (offset 2: the first extra head looks one token past the LM head, which
    predicts t + 1), ignore_index where that runs past the sequence."""
    if labels.dim() == 1:
        labels = labels[None]
    B, T = labels.shape
    out = torch.full((heads, B, T), int(ignore_index), dtype=labels.dtype, device=labels.device)
    for k in range(heads):
        s = offset + k
        if s < T:
            out[k, :, : T - s] = labels[:, s:]
    return out.reshape(heads, B * T)


# ------------------------------------------------------------------------------------------------
# Distillation: generalised JSD, KL divergence, TVD, and the fused linear JSD
# ------------------------------------------------------------------------------------------------

_JSD, _KL_DIV, _TVD = (_o.DIVERGENCES[k] for k in ("jsd", "kl_div", "tvd"))
_LOG_PROBS, _PROBS, _LOGITS = (_o.DIV_INPUTS[k] for k in ("log_probs", "probs", "logits"))
_DIV_SUM, _DIV_BATCHMEAN = _o.DIV_REDUCTIONS["sum"], _o.DIV_REDUCTIONS["batchmean"]
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _check_beta(beta) -> float:
    beta = float(beta)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"tigon_torch: beta must be in [0, 1], got {beta}")
    return beta


def _div_pair(student, teacher, what):
    """The student and the teacher as [BT, V] matrices with unit column stride (views when the strides
    allow it). The teacher keeps its dtype when it is the student's or float32, and is cast to float32
    otherwise (the operator takes those two)."""
    _check_cuda(student, teacher)
    if student.dim() != 2 or teacher.dim() != 2:
        raise ValueError(f"tigon_torch: {what} takes 2-D [BT, V] inputs, got shapes {tuple(student.shape)} and "
                         f"{tuple(teacher.shape)}")
    if student.shape[1] != teacher.shape[1]:
        raise ValueError(f"tigon_torch: {what}: the teacher's vocabulary ({teacher.shape[1]}) differs from the "
                         f"student's ({student.shape[1]})")
    if student.shape[0] != teacher.shape[0]:
        raise ValueError(f"tigon_torch: {what}: the student has {student.shape[0]} rows, the teacher "
                         f"{teacher.shape[0]}")
    if student.dtype not in _FLOATS:
        raise TypeError(f"tigon_torch: {what}: the student must be float32, float16 or bfloat16, got {student.dtype}")
    if not torch.is_floating_point(teacher):
        raise TypeError(f"tigon_torch: {what}: the teacher must be a floating-point tensor, got {teacher.dtype}")
    if teacher.dtype != student.dtype and teacher.dtype != torch.float32:
        teacher = teacher.to(torch.float32)
    return as_rows(student), as_rows(teacher)


def _div_labels(shift_labels, rows, what):
    if shift_labels is None:
        return None
    _check_cuda(shift_labels)
    if tuple(shift_labels.shape) != (rows,):
        raise ValueError(f"tigon_torch: {what}: shift_labels must have shape ({rows},), got "
                         f"{tuple(shift_labels.shape)}")
    if shift_labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"tigon_torch: {what}: shift_labels must be int64 or int32, got {shift_labels.dtype}")
    return shift_labels.contiguous()


def _div_forward(ctx, kind, x2, y2, labels, student_input, teacher_input, red, ignore_index, beta, eps):
    """The loss of one divergence call: a 0-d fp32 tensor, or with reduction none the [BT, V] fp32 element
    losses. The student's gradient is computed here with the loss, in the same kernel call, and scaled
    by the upstream gradient in the backward; it waits for the backward instead (one call there with the
    upstream gradient folded in, from the saved inputs) with reduction none (a per-element upstream
    gradient), for a float16 student (its small entries would underflow in fp16 before a loss scale
    reaches them) and under torch.compile."""
    want_grad = ctx.needs_input_grad[0]
    defer = want_grad and (red == 0 or x2.dtype == torch.float16 or _compiling())
    rows, vocab = x2.shape
    f32 = dict(dtype=torch.float32, device=x2.device)
    loss = torch.empty((), **f32) if red != 0 else None
    elems = torch.empty(rows, vocab, **f32) if red == 0 else None
    dx = torch.empty_like(x2, memory_format=torch.contiguous_format) if (want_grad and not defer) else None
    args = (kind, student_input, teacher_input, red, int(ignore_index), float(beta), float(eps), 1.0, 1.0)
    ops().divergence(x2, y2, labels, None, dx, loss, None, elems, *args)
    ctx.defer, ctx.consumed, ctx.args = defer, False, args
    if defer:
        ctx.save_for_backward(x2, y2, labels)
    elif want_grad:
        ctx.save_for_backward(dx)
    return loss if red != 0 else elems


def _div_backward(ctx, grad_output):
    """The student's gradient for an upstream gradient grad_output (0-d, or [BT, V] with reduction none)."""
    if grad_output is None or not ctx.needs_input_grad[0]:
        return None
    if ctx.defer:
        x2, y2, labels = ctx.saved_tensors
        go = grad_output.to(torch.float32)
        go = as_rows(go) if ctx.args[3] == 0 else go.reshape(1).contiguous()
        dx = torch.empty_like(x2, memory_format=torch.contiguous_format)
        ops().divergence(x2, y2, labels, go, dx, None, None, None, *ctx.args)
        return dx
    if ctx.consumed:
        raise RuntimeError(
            "tigon_torch: the divergence's gradient (computed with the loss in the forward) was already scaled "
            "by a first backward; a second backward through the same graph (retain_graph=True) is not "
            "supported")
    ctx.consumed = True
    (dx,) = ctx.saved_tensors
    if dx.shape[0] > 0:
        ops().scale_rows(dx, grad_output.to(torch.float32).reshape(1).contiguous())
    return dx


class TigonJSDFunction(torch.autograd.Function):
    """Liger's LigerJSDFunction: the generalised Jensen-Shannon divergence
    JSD(beta) = beta KL(P || M) + (1 - beta) KL(Q || M), M = beta P + (1 - beta) Q, between the student's
    distribution Q (_input, log-probabilities [BT, V]) and the teacher's P (target, log-probabilities
    [BT, V]); beta 0 is KL(P || Q) (forward KL), beta 1 is KL(Q || P) (reverse KL). The sum over the
    rows whose shift_labels entry is not ignore_index (all rows without shift_labels), divided by their
    count; an all-ignored batch gives 0. Returns the loss in _input's dtype (computed in fp32).

    The gradient with respect to _input is computed with the loss (one kernel call; Liger keeps it from
    the forward too) and scaled by the upstream gradient in the backward on the device, skipping the
    pass when it is exactly 1; no gradient flows to target. For a float16 _input and under
    torch.compile the gradient is computed in the backward instead, with the upstream gradient folded
    in. One backward per forward (retain_graph=True and a second backward raise), except on that path.
    target may have another dtype than _input (float32, or cast to it).
    """

    @staticmethod
    def forward(ctx, _input, target, shift_labels=None, beta=0.5, ignore_index=-100):
        beta = _check_beta(beta)
        x2, y2 = _div_pair(_input, target, "JSD")
        labels = _div_labels(shift_labels, x2.shape[0], "JSD")
        loss = _div_forward(ctx, _JSD, x2, y2, labels, _LOG_PROBS, _LOG_PROBS, _DIV_BATCHMEAN, ignore_index, beta,
                            0.0)
        return _cast(loss, _input.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        return _div_backward(ctx, grad_output), None, None, None, None


class TigonKLDivLossFunction(torch.autograd.Function):
    """Liger's LigerKLDivLossFunction: torch.nn.functional.kl_div(y_pred, y_true, reduction, log_target)
    with y_pred the student's log-probabilities [BT, V] and y_true the teacher's probabilities
    (log_target=False; inside the log they are clamped to eps, as in Liger) or log-probabilities
    (log_target=True). reduction "batchmean" (the default: the sum over BT), "sum", "mean" (the sum over
    BT * V) or "none" (the [BT, V] element losses). Returns float32, as Liger. The gradient is
    -y_true (or -exp(y_true)) over the reduction's denominator times the upstream gradient; it is
    computed and scaled as in TigonJSDFunction (with "none" in the backward, with the per-element
    upstream gradient). y_true may have another dtype than y_pred; no gradient flows to it."""

    @staticmethod
    def forward(ctx, y_pred, y_true, reduction="batchmean", log_target=False, eps=1e-10):
        red = _o.div_reduction_code(reduction)
        x2, y2 = _div_pair(y_pred, y_true, "KL divergence")
        return _div_forward(ctx, _KL_DIV, x2, y2, None, _LOG_PROBS, _LOG_PROBS if log_target else _PROBS, red, -100,
                            0.0, eps)

    @staticmethod
    def backward(ctx, grad_output):
        return _div_backward(ctx, grad_output), None, None, None, None


class TigonTVDLossFunction(torch.autograd.Function):
    """Liger's LigerTVDLossFunction: the total variation distance |p - q| / 2 per element between two
    distributions given as probabilities, p [BT, V] (whose gradient is taken: +1/2 where p > q, else -1/2)
    and q [BT, V]; rows whose shift_labels entry is ignore_index contribute 0. reduction "batchmean" (the
    default: over the non-ignored rows' count), "sum", "mean" (over that count times V) or "none" (the
    [BT, V] element losses, 0 in ignored rows). Returns float32, as Liger; an all-ignored batch gives 0.
    The gradient is computed and scaled as in TigonJSDFunction; none flows to q."""

    @staticmethod
    def forward(ctx, p, q, shift_labels=None, reduction="batchmean", ignore_index=-100):
        red = _o.div_reduction_code(reduction)
        x2, y2 = _div_pair(p, q, "TVD")
        labels = _div_labels(shift_labels, x2.shape[0], "TVD")
        return _div_forward(ctx, _TVD, x2, y2, labels, _PROBS, _PROBS, red, ignore_index, 0.0, 0.0)

    @staticmethod
    def backward(ctx, grad_output):
        return _div_backward(ctx, grad_output), None, None, None, None


def _torch_at_least(major: int, minor: int) -> bool:
    try:
        got = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    except ValueError:  # pragma: no cover
        return False
    return got >= (major, minor)


_ADDMM_OUT_DTYPE = _torch_at_least(2, 8)  # torch.addmm(..., out_dtype=torch.float32) for 16-bit inputs (CUDA)


def _is_fake(t) -> bool:
    try:
        from torch._subclasses.fake_tensor import is_fake
    except ImportError:
        return False
    return is_fake(t)


def _addmm_fp32(acc, a, b) -> None:
    """acc += a @ b, acc float32, a and b of one dtype: accumulated in fp32."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif _is_fake(acc):
        pass  # FakeTensor tracing (torch.compile, torch.export): acc's shape and dtype are already the result's
    elif acc.is_cuda and _ADDMM_OUT_DTYPE:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.add_(torch.mm(a, b).to(torch.float32))


def _jsd_chunk(tokens: int, vocab: int, elem_bytes: int) -> int:
    """Tokens per chunk of the fused linear JSD: TIGON_TORCH_JSD_CHUNK, else about 512 MiB of logits per
    chunk (a multiple of 128 tokens, at least 128), at most all of them."""
    env = os.environ.get("TIGON_TORCH_JSD_CHUNK", "")
    if env not in ("", "0"):
        c = int(env)
        if c < 0:
            raise ValueError(f"TIGON_TORCH_JSD_CHUNK must be >= 0, got {c}")
    else:
        c = max(128, (512 << 20) // max(1, vocab * elem_bytes) // 128 * 128)
    return max(1, min(c, tokens))


class TigonFusedLinearJSDFunction(torch.autograd.Function):
    """Liger's LigerFusedLinearJSDFunction: the generalised JSD (TigonJSDFunction's, with beta jsd_beta)
    between the student's distribution softmax(student_input @ student_weight.T / temperature) and the
    teacher's softmax(teacher_input @ teacher_weight.T / temperature), averaged over the non-ignored
    tokens, without the [BT, V] logits. student_input: [BT, H]; student_weight: [V, H]; teacher_input:
    [BT, H_t]; teacher_weight: [V, H_t] (H_t may differ from H; the vocabularies must match);
    shift_labels: [BT] or None. Returns the fp32 loss, as Liger.

    Tokens go in chunks (about 512 MiB of logits each, or TIGON_TORCH_JSD_CHUNK tokens): per chunk the
    student's and the teacher's logits (torch matmuls in the inputs' dtype), then tigon's divergence
    operator on the two logits chunks with the temperature (loss, and the logits' gradient written over
    the student's chunk), then dx for the chunk (a matmul) and dW accumulated as accum_dtype says (Liger's:
    None, the default, in the weight's dtype, each chunk's matmul adding into it; torch.float32 in an
    fp32 buffer; float16 weights in fp32). Extra memory: two chunks of logits and the gradients (and
    the fp32 accumulator when there is one). The gradients are computed in the forward and scaled by
    the upstream gradient in the backward on the device (skipped when it is exactly 1); one backward
    per forward. dW is returned in the weight's dtype. With shift_labels, in eager mode, the count of
    non-ignored tokens is read on the host (one synchronisation), and when at least 1 / 32 of the tokens
    are ignored the heads run the others alone (_kept_rows). Under CUDA autocast the inputs and weights are
    cast to the autocast dtype first, as the unfused heads' matmuls would be. No gradient flows to
    the teacher.
    """

    @staticmethod
    def forward(ctx, student_input, student_weight, teacher_input, teacher_weight, shift_labels=None, jsd_beta=0.5,
                ignore_index=-100, temperature=1.0, accum_dtype=None):
        import contextlib
        import math

        _check_cuda(student_input, student_weight, teacher_input, teacher_weight, shift_labels)
        beta = _check_beta(jsd_beta)
        temperature = float(temperature)
        if not (temperature > 0.0 and math.isfinite(temperature)):
            raise ValueError(f"tigon_torch: temperature must be finite and > 0, got {temperature}")
        for name, t in (("student_input", student_input), ("student_weight", student_weight),
                        ("teacher_input", teacher_input), ("teacher_weight", teacher_weight)):
            if t.dim() != 2:
                raise ValueError(f"tigon_torch: {name} must be 2-D, got shape {tuple(t.shape)}")
        rows, hidden = student_input.shape
        vocab = student_weight.shape[0]
        if student_weight.shape[1] != hidden:
            raise ValueError(f"tigon_torch: student_weight is {tuple(student_weight.shape)}, student_input has "
                             f"{hidden} columns")
        if teacher_weight.shape[1] != teacher_input.shape[1]:
            raise ValueError(f"tigon_torch: teacher_weight is {tuple(teacher_weight.shape)}, teacher_input has "
                             f"{teacher_input.shape[1]} columns")
        if teacher_weight.shape[0] != vocab:
            raise ValueError(f"tigon_torch: the teacher's vocabulary ({teacher_weight.shape[0]}) differs from the "
                             f"student's ({vocab})")
        if teacher_input.shape[0] != rows:
            raise ValueError(f"tigon_torch: teacher_input has {teacher_input.shape[0]} tokens, student_input {rows}")
        labels = _div_labels(shift_labels, rows, "fused linear JSD")
        in_dtype, w_dtype = student_input.dtype, student_weight.dtype
        x, w, xt, wt = student_input, student_weight, teacher_input, teacher_weight
        autocast = torch.is_autocast_enabled("cuda")
        if autocast:
            dt = torch.get_autocast_dtype("cuda")
            x, w, xt, wt = x.to(dt), w.to(dt), xt.to(dt), wt.to(dt)
        if w.dtype != x.dtype or wt.dtype != xt.dtype:
            raise TypeError(
                f"tigon_torch: student_input ({x.dtype}) and student_weight ({w.dtype}), teacher_input ({xt.dtype}) "
                f"and teacher_weight ({wt.dtype}) must have one dtype each (or run under autocast)")
        if x.dtype not in _FLOATS:
            raise TypeError(f"tigon_torch: the student must be float32, float16 or bfloat16, got {x.dtype}")
        want_dx, want_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        want_grad = want_dx or want_dw
        f32 = dict(dtype=torch.float32, device=x.device)
        all_rows = rows
        # The mean over the non-ignored tokens: their count stays on the device, as the gradient's factor.
        if labels is not None:
            valid = (labels != ignore_index).sum()
            inv = (1.0 / valid.clamp_min(1).to(torch.float32)).reshape(1)
            grad_scale = 1.0
            # In eager mode (the target check's conditions) the count is read on the host (one
            # synchronisation) so that the heads run the non-ignored tokens alone (_kept_rows).
            keep = _kept_rows(labels, int(valid), int(ignore_index)) if _target_check_mode(labels) >= 0 else None
            x, xt, labels = _take(keep, x, xt, labels)
            rows = x.shape[0]
        else:
            inv, grad_scale, keep = None, 1.0 / max(rows, 1), None
        loss_rows = torch.empty(rows, **f32)
        dx = torch.empty(rows, hidden, dtype=x.dtype, device=x.device) if want_dx else None
        gdt = _head_grad_dtype(w_dtype, accum_dtype, w.dtype)
        dw = torch.zeros(vocab, hidden, dtype=gdt, device=x.device) if want_dw else None
        in_place = not _compiling()
        chunk = _jsd_chunk(rows, vocab, x.element_size())
        no_autocast = torch.autocast("cuda", enabled=False) if autocast else contextlib.nullcontext()
        with no_autocast:
            for r0 in range(0, rows, chunk):
                r1 = min(r0 + chunk, rows)
                xs = x[r0:r1]
                zs = torch.mm(xs, w.t())  # the student's logits chunk
                zt = torch.mm(xt[r0:r1], wt.t())  # the teacher's
                if zt.dtype != zs.dtype and zt.dtype != torch.float32:
                    zt = zt.to(torch.float32)
                dz = (zs if in_place else torch.empty_like(zs)) if want_grad else None
                ops().divergence(zs, zt, labels[r0:r1] if labels is not None else None, inv, dz, None,
                                 loss_rows[r0:r1], None, _JSD, _LOGITS, _LOGITS, _DIV_SUM, int(ignore_index), beta,
                                 0.0, temperature, grad_scale)
                if want_dx:
                    dx[r0:r1] = torch.mm(dz, w)
                if want_dw:
                    if dw.dtype == torch.float32:
                        _addmm_fp32(dw, dz.t(), xs)
                    else:  # one GEMM adding into the gradient in its dtype: one rounding per chunk
                        dw.addmm_(dz.t(), xs)
                del zs, zt, dz
        total = loss_rows.sum()
        loss = total * inv.reshape(()) if inv is not None else total * grad_scale
        ctx.consumed, ctx.compiled = False, not in_place
        ctx.save_for_backward(_cast(_spread(dx, keep, all_rows), in_dtype), _cast(dw, w_dtype))
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        nones = (None,) * 7
        dx, dw = ctx.saved_tensors
        if grad_output is None:
            return (None, None) + nones
        go = grad_output.to(torch.float32).reshape(1).contiguous()
        if ctx.compiled:  # traced: out of place (the backward is traced where the forward was)
            dx = dx * go.to(dx.dtype) if dx is not None else None
            dw = dw * go.to(dw.dtype) if dw is not None else None
            return (dx, dw) + nones
        if ctx.consumed:
            raise RuntimeError(
                "tigon_torch: the fused linear JSD's gradients (computed in the forward) were already scaled by a "
                "first backward; a second backward through the same graph (retain_graph=True) is not supported")
        ctx.consumed = True
        for g in (dx, dw):
            if g is not None and g.shape[0] > 0:
                ops().scale_rows(g, go)
        return (dx, dw) + nones


# ------------------------------------------------------------------------------------------------
# Per-token log-probabilities of the LM head (post-training losses)
# ------------------------------------------------------------------------------------------------


class TigonFusedLinearLogProbFunction(torch.autograd.Function):
    """Per-token log p(target) and entropy of the LM head softmax((_input @ weight.T + bias) / temperature),
    without the [tokens, vocab] logits (tigon.linear_logprob, docs/linear_logprob.md).

    forward(_input [..., H], weight [V, H], target [...], bias=None, ignore_index=-100, temperature=1.0,
    is_top1=False) returns (logp, entropy, logit_sum), float32 of target's shape, and with is_top1=True a
    fourth value, bool of target's shape: whether the target is the first column holding the token's largest
    logit (token accuracy; False for ignored tokens). logit_sum (the sum of the token's logits before the
    temperature, for every token) and is_top1 take no gradient. A token whose target is ignore_index gives 0
    in logp and entropy and takes no gradient. The backward takes the gradients of either or both and recomputes the
    logits chunk by chunk: dx in _input's dtype, dweight and dbias accumulated in the weight's dtype (each
    chunk's product adds into them and rounds once; float16 weights: in fp32) and returned in their
    parameters' dtypes. Targets outside [0, V) other than ignore_index raise TargetOutOfRangeError (eager).
    Every sequence-level loss (DPO, ORPO, CPO, SimPO, KTO, GRPO) is a function of these [tokens] values."""

    @staticmethod
    def forward(ctx, _input, weight, target, bias=None, ignore_index=-100, temperature=1.0, is_top1=False):
        _check_cuda(_input, weight, target, bias)
        x, w, b = _head_operands(_input, weight, bias)
        if not float(temperature) > 0.0 or not math.isfinite(float(temperature)):
            raise ValueError(f"tigon_torch: temperature must be finite and > 0, got {temperature}")
        hidden = x.shape[-1]
        x2 = as_rows(x.reshape(-1, hidden))
        w = w.contiguous()
        b = vector(b)
        tshape = target.shape
        target = _flat(target)
        rows, vocab = x2.shape[0], w.shape[0]
        if w.shape[1] != hidden:
            raise ValueError(f"tigon_torch: weight is {tuple(w.shape)}, _input has {hidden} features")
        if target.shape[0] != rows:
            raise ValueError(f"tigon_torch: target has {target.shape[0]} tokens, _input {rows}")
        keep = _kept_rows(target, check_targets(target, vocab, int(ignore_index)), int(ignore_index))
        # The rows the op runs on: every row, or the rows whose target is not ignored (_kept_rows).
        xk, tk = _take(keep, x2, target)
        kept = tk.shape[0]
        logp = torch.empty(kept, dtype=torch.float32, device=x2.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp)
        logit_sum = torch.empty_like(logp)
        top1 = torch.empty(kept, dtype=torch.bool, device=x2.device) if is_top1 else None
        chunk = _lce_chunk()
        if kept > 0:
            ops().linear_logprob(xk, w, b, tk, logp, lse, entropy, logit_sum, None, int(ignore_index),
                                 float(temperature), chunk, None, top1)
        ctx.save_for_backward(x2, w, b, target, lse, entropy, keep)  # lse and entropy: the kept rows'
        if keep is not None:
            logp, entropy, top1 = (_spread(t, keep, rows) for t in (logp, entropy, top1))
            logit_sum = _spread(logit_sum, keep, rows).index_copy_(
                0, *_ignored_logit_sums(x2, _head_sums(w, b), target, ignore_index, rows - kept))
        ctx.args = (int(ignore_index), float(temperature), chunk)
        ctx.dtypes = (_input.dtype, weight.dtype, bias.dtype if bias is not None else None)
        ctx.shape = _input.shape
        logit_sum = logit_sum.reshape(tshape)
        ctx.mark_non_differentiable(logit_sum)
        if top1 is None:
            return logp.reshape(tshape), entropy.reshape(tshape), logit_sum
        top1 = top1.reshape(tshape)
        ctx.mark_non_differentiable(top1)
        return logp.reshape(tshape), entropy.reshape(tshape), logit_sum, top1

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, *_):
        x2, w, b, target, lse, entropy, keep = ctx.saved_tensors
        want_dx, want_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        want_db = b is not None and ctx.needs_input_grad[3]
        if (grad_logp is None and grad_entropy is None) or not (want_dx or want_dw or want_db):
            return None, None, None, None, None, None, None
        in_dtype, w_dtype, b_dtype = ctx.dtypes
        rows = x2.shape[0]
        gl = grad_logp.reshape(-1).to(torch.float32) if grad_logp is not None else None
        ge = grad_entropy.reshape(-1).to(torch.float32) if grad_entropy is not None else None
        x2, target, gl, ge = _take(keep, x2, target, gl, ge)  # the kept rows alone, as the forward ran them
        gl, ge = (g.contiguous() if g is not None else None for g in (gl, ge))
        dx = torch.empty_like(x2, memory_format=torch.contiguous_format) if want_dx else None
        gdt = _head_grad_dtype(w_dtype, None, w.dtype)
        dw = torch.empty(w.shape, dtype=gdt, device=w.device) if want_dw else None
        db = torch.empty(w.shape[0], dtype=gdt, device=w.device) if want_db else None
        if x2.shape[0] > 0:
            ops().linear_logprob_bwd(x2, w, b, target, lse, entropy, gl, ge, dx, dw, db, *ctx.args, False, None)
        else:
            for t in (dw, db):
                if t is not None:
                    t.zero_()
        dx = _cast(_spread(dx, keep, rows), in_dtype).reshape(ctx.shape) if dx is not None else None
        return dx, _cast(dw, w_dtype), None, _cast(db, b_dtype), None, None, None

"""Thin wrappers over the compiled operators (torch.ops.tigon.*) and the layout helpers the autograd
functions share.

The operators take every output as an argument: the wrappers here allocate them with torch (so the
caching allocator serves them), lay inputs out as [rows, cols] matrices with a unit column stride
(views when the strides allow it, a copy otherwise), and return the outputs. Nothing here
synchronises the host.
"""

from __future__ import annotations

import torch

from . import _ext

CASTING_MODES = {"llama": 0, "gemma": 1, "none": 2}
REDUCTIONS = {"none": 0, "sum": 1, "mean": 2}
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "gelu": 2}
# tigon.divergence's codes: the divergence, each side's input form, the reduction.
DIVERGENCES = {"jsd": 0, "kl_div": 1, "tvd": 2}
DIV_INPUTS = {"log_probs": 0, "probs": 1, "logits": 2}
DIV_REDUCTIONS = {"none": 0, "sum": 1, "mean": 2, "batchmean": 3}

_fakes_registered = False


def on_device(t: torch.Tensor) -> bool:
    """Whether tigon's operators take this tensor (they have CUDA implementations only). The test
    suite's reference mode swaps this predicate to run the Python side on the CPU."""
    return t.is_cuda


def _rows(op: str, name: str, t, dtype) -> None:
    """The checks of the C++ rows_of(): a 2-D [rows, cols] tensor of dtype, unit column stride, rows
    at least cols apart."""
    if t.dim() != 2:
        raise ValueError(f"{op}: '{name}' must be 2-D [rows, cols], got {t.dim()}-D")
    if t.dtype != dtype:
        raise TypeError(f"{op}: '{name}' has dtype {t.dtype}, expected {dtype}")
    if t.size(1) > 1 and t.stride(1) != 1:
        raise ValueError(f"{op}: '{name}' must have unit column stride, got stride {t.stride(1)}")
    if t.size(0) > 1 and t.stride(0) < t.size(1):
        raise ValueError(f"{op}: '{name}' has row stride {t.stride(0)} < cols {t.size(1)}")


def _like(op: str, ref_name: str, ref, *named) -> None:
    """Each (name, tensor) of named (None skipped) a [rows, cols] matrix of ref's shape and dtype."""
    _rows(op, ref_name, ref, ref.dtype)
    for name, t in zip(named[::2], named[1::2]):
        if t is None:
            continue
        _rows(op, name, t, ref.dtype)
        if tuple(t.shape) != tuple(ref.shape):
            raise ValueError(f"{op}: '{name}' has shape {tuple(t.shape)}, '{ref_name}' {tuple(ref.shape)}")


def _vector(op: str, name: str, t, ref_name: str, ref) -> None:
    """t (None skipped) a vector of ref's shape and dtype (a norm's dweight / dbias against its weight)."""
    if t is None or ref is None:
        return
    if t.dtype != ref.dtype:
        raise TypeError(f"{op}: '{name}' has dtype {t.dtype}, expected {ref.dtype} (the dtype of '{ref_name}')")
    if tuple(t.shape) != tuple(ref.shape):
        raise ValueError(f"{op}: '{name}' has shape {tuple(t.shape)}, '{ref_name}' {tuple(ref.shape)}")


def _norm_bwd(op: str, lead: str, x, named, w, grads) -> None:
    _like(op, lead, x, *named)
    for name, t in grads:
        _vector(op, name, t, "weight", w)


def _divergence(s, t, labels, go, dx, loss, loss_rows, loss_elems, kind, student_input, teacher_input, red,
                *r) -> None:
    op = "tigon.divergence"
    _like(op, "student", s, "dx", dx)
    if red == 0 and loss is not None:
        raise ValueError(f"{op}: reduction none has no reduced loss: use loss_rows or loss_elems")


def _head_grads(op: str, x, *grads) -> None:
    """A chunked head's weight and bias gradients (None skipped): float32 or x's dtype, one dtype for all
    (the GEMMs add into them)."""
    given = [g for g in grads if g is not None]
    for g in given:
        if g.dtype not in (torch.float32, x.dtype):
            raise TypeError(f"{op}: the weight gradients must be float32 or x's dtype ({x.dtype}), got {g.dtype}")
    if len({g.dtype for g in given}) > 1:
        raise TypeError(f"{op}: the weight gradients must share one dtype")


def _fake_checks():
    """Per operator, the shape and dtype checks its CUDA implementation makes before it launches,
    so that torch.compile and FakeTensorMode reject a bad call when they trace it."""
    return {
        "rms_norm_fwd": lambda x, w, y, rstd, *a: _like("tigon.rms_norm_fwd", "x", x, "y", y),
        "rms_norm_bwd": lambda dy, x, w, rstd, dx, dw, *a: _norm_bwd("tigon.rms_norm_bwd", "x", x,
                                                                     ("dy", dy, "dx", dx), w, [("dweight", dw)]),
        "layer_norm_fwd": lambda x, w, b, y, *a: _like("tigon.layer_norm_fwd", "x", x, "y", y),
        "layer_norm_bwd": lambda dy, x, w, m, r, dx, dw, db: _norm_bwd("tigon.layer_norm_bwd", "x", x,
                                                                       ("dy", dy, "dx", dx), w,
                                                                       [("dweight", dw), ("dbias", db)]),
        "add_rms_norm_fwd": lambda x, res, w, y, s, *a: _like("tigon.add_rms_norm_fwd", "x", x, "residual", res,
                                                             "y", y, "sum", s),
        "add_rms_norm_bwd": lambda dy, ds, s, w, r, dx, dw, *a: _norm_bwd("tigon.add_rms_norm_bwd", "sum", s,
                                                                          ("dsum", ds, "dy", dy, "dx", dx), w,
                                                                          [("dweight", dw)]),
        "gated_fwd": lambda a, b, c, *r: _like("tigon.gated_fwd", "a", a, "b", b, "c", c),
        "gated_bwd": lambda dc, a, b, da, db, *r: _like("tigon.gated_bwd", "a", a, "b", b, "dc", dc, "da", da,
                                                        "db", db),
        "relu2_fwd": lambda a, c: _like("tigon.relu2_fwd", "a", a, "c", c),
        "relu2_bwd": lambda dc, a, da: _like("tigon.relu2_bwd", "a", a, "dc", dc, "da", da),
        "cross_entropy": lambda logits, target, cw, go, dlogits, *r: _like("tigon.cross_entropy", "logits", logits,
                                                                           "dlogits", dlogits),
        "linear_cross_entropy": lambda x, w, b, t, cw, go, dx, dw, db, *r: _head_grads(
            "tigon.linear_cross_entropy", x, dw, db),
        "linear_cross_entropy_heads": lambda x, ws, bs, t, cw, go, hw, dx, dws, dbs, *r: _head_grads(
            "tigon.linear_cross_entropy_heads", x, dws[0] if dws else None, dbs[0] if dbs else None),
        "linear_logprob_bwd": lambda x, w, b, t, lse, ent, gl, ge, dx, dw, db, *r: _head_grads(
            "tigon.linear_logprob_bwd", x, dw, db),
        "divergence": _divergence,
    }


def _register_fakes() -> None:
    """Fake (meta) kernels for torch.compile and FakeTensorMode: every operator but adamw_plan and the
    six with a C++ autograd (rms_norm, layer_norm, add_rms_norm, gated, cross_entropy_loss,
    linear_cross_entropy_loss) writes only into its arguments, so each returns None after the shape
    and dtype checks of its CUDA implementation (_fake_checks) where it has them."""
    global _fakes_registered
    if _fakes_registered:
        return
    names = [
        "rms_norm_fwd",
        "rms_norm_bwd",
        "layer_norm_fwd",
        "layer_norm_bwd",
        "add_rms_norm_fwd",
        "add_rms_norm_bwd",
        "rope",
        "gated_fwd",
        "gated_bwd",
        "relu2_fwd",
        "relu2_bwd",
        "cross_entropy",
        "linear_cross_entropy",
        "linear_cross_entropy_heads",
        "linear_logprob",
        "linear_logprob_bwd",
        "scale_rows",
        "divergence",
        "adamw_step",
        "adamw_grad_norm",
    ]
    checks = _fake_checks()
    for name in names:

        def fake(*args, _check=checks.get(name), **kwargs):
            if _check is not None:
                _check(*args)
            return None

        torch.library.register_fake(f"tigon::{name}", fake)

    def adamw_plan_fake(params, grads, exp_avgs, exp_avg_sqs, masters):
        from .optim import plan_bytes

        return torch.empty(plan_bytes([p.numel() for p in params]), dtype=torch.uint8, device=params[0].device)

    torch.library.register_fake("tigon::adamw_plan", adamw_plan_fake)

    def rms_norm_fake(x, weight, eps, offset, casting, in_place):
        if not x.is_contiguous():
            raise ValueError("tigon.rms_norm: 'x' must be contiguous")
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    torch.library.register_fake("tigon::rms_norm", rms_norm_fake)

    def add_rms_norm_fake(x, residual, weight, eps, offset, casting, in_place):
        if not (x.is_contiguous() and residual.is_contiguous()):
            raise ValueError("tigon.add_rms_norm: 'x' and 'residual' must be contiguous")
        return (torch.empty_like(x, memory_format=torch.contiguous_format),
                torch.empty_like(x, memory_format=torch.contiguous_format))

    torch.library.register_fake("tigon::add_rms_norm", add_rms_norm_fake)

    def layer_norm_fake(x, weight, bias, eps):
        if not x.is_contiguous():
            raise ValueError("tigon.layer_norm: 'x' must be contiguous")
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    torch.library.register_fake("tigon::layer_norm", layer_norm_fake)

    def gated_fake(a, b, act, gate_multiplier, down_multiplier):
        if not (a.is_contiguous() and b.is_contiguous()):
            raise ValueError("tigon.gated: 'a' and 'b' must be contiguous")
        if a.shape != b.shape:
            raise ValueError(f"tigon.gated: a {tuple(a.shape)} and b {tuple(b.shape)} must have one shape")
        return torch.empty_like(a, memory_format=torch.contiguous_format)

    torch.library.register_fake("tigon::gated", gated_fake)

    def cross_entropy_loss_fake(logits, target, weight, ignore_index, z_scale, smoothing, reduction, softcap,
                                in_place, fp32, check):
        if logits.dim() != 2 or not logits.is_contiguous():
            raise ValueError("tigon.cross_entropy_loss: 'logits' must be a contiguous [BT, V]")
        shape = (logits.shape[0],) if reduction == 0 else ()
        return logits.new_empty(shape, dtype=torch.float32 if fp32 else logits.dtype)

    torch.library.register_fake("tigon::cross_entropy_loss", cross_entropy_loss_fake)

    def linear_cross_entropy_loss_fake(x, weight, bias, target, ce_weight, *args):
        if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
            raise ValueError(f"tigon.linear_cross_entropy_loss: x {tuple(x.shape)} and weight {tuple(weight.shape)} "
                             "must be [..., H] and [V, H]")
        return x.new_empty((), dtype=torch.float32)

    torch.library.register_fake("tigon::linear_cross_entropy_loss", linear_cross_entropy_loss_fake)
    _fakes_registered = True


def ops():
    """torch.ops.tigon, building or loading the extension on first use."""
    if not _fakes_registered:
        _ext.load()
        _register_fakes()
    return torch.ops.tigon


def casting_mode(mode) -> int:
    if isinstance(mode, int):
        if mode not in (0, 1, 2):
            raise ValueError(f"casting_mode must be 'llama', 'gemma', 'none' or 0, 1, 2; got {mode}")
        return mode
    if hasattr(mode, "value") and isinstance(mode.value, int):
        return casting_mode(mode.value)
    try:
        return CASTING_MODES[mode]
    except KeyError:
        raise ValueError(f"casting_mode must be one of {sorted(CASTING_MODES)}, got {mode!r}") from None


def reduction_code(reduction: str) -> int:
    try:
        return REDUCTIONS[reduction]
    except KeyError:
        raise ValueError(f"reduction must be one of {sorted(REDUCTIONS)}, got {reduction!r}") from None


def div_reduction_code(reduction: str) -> int:
    try:
        return DIV_REDUCTIONS[reduction]
    except KeyError:
        raise ValueError(f"reduction must be one of {sorted(DIV_REDUCTIONS)}, got {reduction!r}") from None


# ------------------------------------------------------------------------------------------------
# Layouts
# ------------------------------------------------------------------------------------------------


def row_order(t: torch.Tensor) -> list[int]:
    """Leading dimensions by decreasing stride, then the last: the permutation that puts t's rows in
    memory order, so that a transposed view (Gemma 3's and Qwen 3's q / k norms) still flattens to
    [rows, cols] without a copy."""
    n = t.dim()
    if n <= 1 or t.is_contiguous():
        return list(range(n))
    lead = sorted(range(n - 1), key=lambda d: -t.stride(d))
    return lead + [n - 1]


def _inverse(order: list[int]) -> list[int]:
    inv = [0] * len(order)
    for i, d in enumerate(order):
        inv[d] = i
    return inv


def as_rows(t: torch.Tensor, order: list[int] | None = None) -> torch.Tensor:
    """t as a [rows, cols] matrix with unit column stride and a row stride >= cols (a view when t's
    strides allow it, else a copy). Rows follow `order` (see row_order)."""
    if t.is_contiguous() and t.dim() > 0 and (order is None or order == sorted(order)):
        return t.view(-1, t.shape[-1])  # the common case: rows in memory order already
    cols = t.shape[-1] if t.dim() > 0 else 1
    if t.dim() == 0:
        t = t.reshape(1)
    if order is not None and order != list(range(t.dim())):
        t = t.permute(order)
    r = t.reshape(-1, cols)
    if (cols > 1 and r.stride(1) != 1) or (r.shape[0] > 1 and r.stride(0) < cols):
        r = r.contiguous()
    return r


def empty_rows(shape, order: list[int], dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A fresh [rows, cols] matrix and the same memory as a tensor of `shape` whose rows follow `order`
    (so an output keeps its input's layout)."""
    shape = list(shape)
    if not shape:
        buf = torch.empty(1, 1, dtype=dtype, device=device)
        return buf, buf.reshape(())
    if order == sorted(order):  # rows in memory order: both results views of one buffer, as below
        buf = torch.empty(shape, dtype=dtype, device=device)
        return buf.view(-1, shape[-1]), buf.view(shape)
    permuted = [shape[d] for d in order]
    buf = torch.empty(permuted, dtype=dtype, device=device)
    return buf.view(-1, shape[-1]), buf.permute(_inverse(order))


def rows_as(rows: torch.Tensor, shape, order: list[int]) -> torch.Tensor:
    """The inverse of as_rows for a contiguous [rows, cols] matrix."""
    shape = list(shape)
    if not shape:
        return rows.reshape(())
    return rows.view([shape[d] for d in order]).permute(_inverse(order))


def vector(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return t if t.is_contiguous() else t.contiguous()

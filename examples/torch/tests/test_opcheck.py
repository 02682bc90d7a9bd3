"""torch.library.opcheck on every tigon operator: the schema's mutation annotations match what the
kernel writes, the fake (meta) kernel agrees with the real one, autograd registration is consistent,
and each operator goes through AOT dispatch with dynamic shapes. On a CUDA device (the real kernels)
or in the CPU reference mode (TIGON_TORCH_REFERENCE_OPS=1)."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE

from tigon_torch import ops

pytestmark = pytest.mark.gpu

BF = torch.bfloat16
F32 = torch.float32


def _r(*shape, dtype=BF, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


def _e(*shape, dtype=BF):
    return torch.empty(*shape, device=DEVICE, dtype=dtype)


def _targets(n, vocab):
    t = torch.randint(0, vocab, (n,), device=DEVICE)
    t[1] = -100
    return t


def _cases():
    N, H, V = 6, 64, 96
    x, w, dy = _r(N, H), _r(H, scale=0.1) + 1, _r(N, H)
    rstd = _e(N, dtype=F32)
    cases = {
        "rms_norm_fwd": (x, w, _e(N, H), rstd, 1e-6, 0.0, 0),
        "layer_norm_fwd": (x, w, _r(H), _e(N, H), _e(N, dtype=F32), _e(N, dtype=F32), 1e-5),
        "add_rms_norm_fwd": (x, _r(N, H), w, _e(N, H), _e(N, H), _e(N, dtype=F32), 1e-6, 0.0, 0),
        "gated_fwd": (_r(N, H), _r(N, H), _e(N, H), 0, 1.0, 1.0),
        "gated_bwd": (dy, _r(N, H), _r(N, H), _e(N, H), _e(N, H), 1, 1.0, 1.0),
        "relu2_fwd": (_r(N, H), _e(N, H)),
        "relu2_bwd": (dy, _r(N, H), _e(N, H)),
        "scale_rows": (_r(N, H), torch.rand(N, device=DEVICE)),
        "target_range": (_targets(N, V), -100),
    }
    # The backward ops read the statistics their forward wrote.
    ops.ops().rms_norm_fwd(x, w, _e(N, H), rstd, 1e-6, 0.0, 0)
    cases["rms_norm_bwd"] = (dy, x, w, rstd, _e(N, H), torch.empty_like(w), 1e-6, 0.0, 0)
    mean, rstd2 = _e(N, dtype=F32), _e(N, dtype=F32)
    ops.ops().layer_norm_fwd(x, w, None, _e(N, H), mean, rstd2, 1e-5)
    cases["layer_norm_bwd"] = (dy, x, w, mean, rstd2, _e(N, H), torch.empty_like(w), torch.empty_like(w))
    s, rstd3 = _e(N, H), _e(N, dtype=F32)
    ops.ops().add_rms_norm_fwd(x, dy, w, _e(N, H), s, rstd3, 1e-6, 0.0, 0)
    cases["add_rms_norm_bwd"] = (dy, _r(N, H), s, w, rstd3, _e(N, H), torch.empty_like(w), 1e-6, 0.0, 0)
    # The operators with their autograd in C++ (outputs returned; inputs that require a gradient).
    cases["rms_norm"] = (x.clone().requires_grad_(), w.clone().requires_grad_(), 1e-6, 0.0, 0, False)
    cases["add_rms_norm"] = (x.clone().requires_grad_(), _r(N, H).requires_grad_(), w.clone().requires_grad_(),
                             1e-6, 0.0, 0, False)
    cases["layer_norm"] = (x.clone().requires_grad_(), w.clone().requires_grad_(), _r(H).requires_grad_(), 1e-5)
    cases["gated"] = (_r(N, H).requires_grad_(), _r(N, H).requires_grad_(), 0, 0.5, 2.0)
    # RoPE: q [B, T, Hq, D], k [B, T, Hk, D], tables [1, T, D].
    B, T, D = 2, 5, 16
    ang = torch.rand(1, T, D // 2, device=DEVICE).repeat(1, 1, 2)
    q, k = _r(B, T, 4, D), _r(B, T, 2, D)
    cases["rope"] = (q, k, ang.cos().to(BF), ang.sin().to(BF), None, _e(B, T, 4, D), _e(B, T, 2, D), False, False)
    # Losses over [N, V] logits.
    logits, t = _r(N, V), _targets(N, V)
    cases["cross_entropy"] = (logits, t, None, None, _e(N, V), _e((), dtype=F32), _e(N, dtype=F32),
                              _e((), dtype=F32), _e(N, dtype=F32), _e(N, dtype=torch.int64), -100, 0.1, 1e-4,
                              0.0, 2, 1.0)
    # The loss alone with its autograd in C++ (the target check off: it synchronises, see _EAGER_ONLY).
    cases["cross_entropy_loss"] = (_r(N, V).requires_grad_(), t, None, -100, 1e-4, 0.1, 2, 0.0, False, False, False)
    xw, W = _r(N, H), _r(V, H, scale=0.1)
    cases["linear_cross_entropy_loss"] = (xw.clone().requires_grad_(), W.clone().requires_grad_(),
                                          _r(V).requires_grad_(), t, None, -100, 1e-4, 0.1, 2, 0.0, False, False, 4,
                                          False)
    cases["linear_cross_entropy"] = (xw, W, _r(V), t, None, None, _e(N, H), _e(V, H, dtype=F32),
                                     _e(V, dtype=F32), _e((), dtype=F32), _e(N, dtype=F32), _e((), dtype=F32),
                                     _e(N, dtype=F32), _e(N, dtype=torch.int64), -100, 0.0, 0.0, 0.0, 2, 1.0,
                                     False, 4)
    W2 = _r(V, H, scale=0.1)
    cases["linear_cross_entropy_heads"] = (xw, [W, W2], [], torch.stack([t, _targets(N, V)]), None, None,
                                           [1.0, 0.5], _e(N, H), [_e(V, H, dtype=F32), _e(V, H, dtype=F32)], [],
                                           _e((), dtype=F32), _e(2, dtype=F32), _e(2 * N, dtype=F32),
                                           _e((), dtype=F32), -100, 0.0, 0.0, 0.0, 2, 1.0, 4)
    lse, ent = _e(N, dtype=F32), _e(N, dtype=F32)
    cases["linear_logprob"] = (xw, W, None, t, _e(N, dtype=F32), lse, ent, _e(N, dtype=F32),
                               torch.zeros(1, device=DEVICE, dtype=torch.int32), -100, 1.0, 4, None)
    ops.ops().linear_logprob(xw, W, None, t, _e(N, dtype=F32), lse, ent, _e(N, dtype=F32), None, -100, 1.0, 4,
                             None)
    cases["linear_logprob_bwd"] = (xw, W, None, t, lse, ent, torch.randn(N, device=DEVICE), None, _e(N, H),
                                   _e(V, H, dtype=F32), None, -100, 1.0, 4, False, None)
    cases["divergence"] = (_r(N, V), _r(N, V), None, None, _e(N, V), _e((), dtype=F32), None, None, 0, 2, 2, 3,
                           -100, 0.5, 0.0, 1.0, 1.0)
    # The AdamW step over two bf16 tensors (one across a chunk boundary) with fp32 moments and masters.
    ps = [_r(3, 7), _r(40000, scale=0.1)]
    lists = (ps, [_r(*p.shape, scale=0.01) for p in ps], [torch.zeros_like(p, dtype=F32) for p in ps],
             [torch.zeros_like(p, dtype=F32) for p in ps], [p.float() for p in ps])
    plan = ops.ops().adamw_plan(*lists)
    scalar = lambda v: torch.full((), v, dtype=F32, device=DEVICE)  # noqa: E731
    cases["adamw_plan"] = lists
    cases["adamw_step@lr_value"] = lists + (plan, None, 1e-3, scalar(0.0), 0.9, 0.999, 1e-8, 0.01, True, None,
                                            None, None, False, 0)
    cases["adamw_step"] = lists + (plan, scalar(1e-3), 0.0, scalar(0.0), 0.9, 0.999, 1e-8, 0.01, True, scalar(2.0),
                                   scalar(0.5), scalar(0.0), False, 0)
    cases["adamw_grad_norm"] = lists + (plan, 1.0, scalar(0.0), scalar(0.0), None)
    return cases


def test_every_operator_has_a_case(ext):
    names = {n.split("::", 1)[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
             if n.startswith("tigon::")}
    assert names, "no tigon operator registered"
    missing = sorted(names - {n.split("@")[0] for n in _CASE_NAMES})
    assert not missing, f"no opcheck case for {missing}"


_CASE_NAMES = ["rms_norm_fwd", "rms_norm_bwd", "layer_norm_fwd", "layer_norm_bwd", "add_rms_norm_fwd",
               "add_rms_norm_bwd", "rope", "gated_fwd", "gated_bwd", "relu2_fwd", "relu2_bwd", "cross_entropy",
               "linear_cross_entropy", "linear_cross_entropy_heads", "linear_logprob", "linear_logprob_bwd",
               "scale_rows", "target_range", "divergence", "adamw_plan", "adamw_step", "adamw_step@lr_value", "adamw_grad_norm",
               "rms_norm", "add_rms_norm", "layer_norm", "gated", "cross_entropy_loss",
               "linear_cross_entropy_loss"]

# The plan holds its input tensors' addresses, which tracing changes (AOT dispatch runs it on copies):
# not a function of the inputs' values, so not traced (an optimizer step is not compiled).
_UNTRACEABLE = {"adamw_plan"}
# Returns integers read back from the device (the eager target check, which synchronises): it has no
# fake kernel, and nothing calls it under torch.compile or a fake-tensor mode.
_EAGER_ONLY = {"target_range"}


@pytest.mark.parametrize("name", _CASE_NAMES)
def test_opcheck(ext, seed, name):
    """name: the operator, or operator@variant for a second case of it."""
    args = _cases()[name]
    op_name = name.split("@")[0]
    op = getattr(ops.ops(), op_name).default
    if op_name in _EAGER_ONLY:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration"))
    elif op_name in _UNTRACEABLE:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    else:
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("name,args,error,arg", [
    ("rms_norm_fwd", lambda: (_e(4, 64), None, _e(4, 32), None, 1e-6, 0.0, 0), ValueError, "'y'"),
    ("rms_norm_fwd", lambda: (_e(4, 64), None, _e(4, 64, dtype=F32), None, 1e-6, 0.0, 0), TypeError, "'y'"),
    ("gated_fwd", lambda: (_e(4, 64), _e(4, 64), _e(2, 64), 0, 1.0, 1.0), ValueError, "'c'"),
    ("relu2_bwd", lambda: (_e(4, 64), _e(4, 64), _e(4, 64, dtype=F32)), TypeError, "'da'"),
    ("cross_entropy", lambda: (_e(4, 96), torch.zeros(4, dtype=torch.int64, device=DEVICE), None, None,
                               _e(4, 95), None, None, None, None, None, -100, 0.0, 0.0, 0.0, 2, 1.0), ValueError,
     "'dlogits'"),
    ("add_rms_norm_fwd", lambda: (_e(4, 64), _e(4, 64)[:, :32], None, _e(4, 64), _e(4, 64), None, 1e-6, 0.0, 0),
     ValueError, "'residual'"),
])
def test_fake_kernels_check_what_the_operator_checks(ext, name, args, error, arg):
    """Under FakeTensorMode (what torch.compile traces with) an operator's fake kernel rejects the
    shapes and dtypes its CUDA implementation rejects, naming the argument; a good call passes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = getattr(ops.ops(), name).default
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        bad = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args())
        with pytest.raises(error, match=arg):
            op(*bad)
    good = _cases()[name]
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        op(*tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in good))

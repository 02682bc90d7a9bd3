"""Shared pieces of the test_liger_*.py files, which port Liger-Kernel 0.8.2's tests of the eight ops
(test/transformers/test_<op>.py) onto tigon_torch's Liger-compatible entry points: the comparison
helper, the cross-entropy reference with z-loss, the random ignore_index assignment, and the size cap
of the CPU reference mode.

Every reference here is PyTorch itself (or a formula written in the test): never tigon, never Liger.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.nn.functional as F

from conftest import REFERENCE

# The references' arithmetic: fp32 (Liger's references upcast the logits to fp32). In the CPU reference
# mode fp64: PyTorch's CPU kernels sum in an order that loses more than Liger's fp32 tolerances allow
# (a row of 32000 equal label-smoothing terms, say), which CUDA's tree reductions do not.
REF_FLOAT = torch.float64 if REFERENCE else torch.float32

# In the CPU reference mode (TIGON_TORCH_REFERENCE_OPS=1) cases above this many logits / elements are
# skipped (Liger's (2, 4096, 32000) cross-entropy shapes take gigabytes and minutes on a CPU), unless
# TIGON_LIGER_FULL=1. On a GPU every case runs.
CPU_ELEMENT_CAP = 70_000_000


def cap_on_cpu(numel: int) -> None:
    if REFERENCE and numel > CPU_ELEMENT_CAP and os.environ.get("TIGON_LIGER_FULL") != "1":
        pytest.skip(f"{numel} elements: too large for the CPU reference mode (TIGON_LIGER_FULL=1 runs it)")


def assert_close(actual, expected, atol, rtol, what=""):
    """|actual - expected| <= atol + rtol * |expected| element-wise, in float64, with the same shape; NaN or
    inf anywhere in one and not the other fails."""
    assert actual is not None, f"{what}: got None"
    assert tuple(actual.shape) == tuple(expected.shape), (
        f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    torch.testing.assert_close(actual.detach().double(), expected.detach().double(), atol=atol, rtol=rtol,
                               msg=lambda m: f"{what}: {m}")


def assign_ignore_index(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Sets a random number (1 to n // 2 - 1) of random positions of target to ignore_index, in place
    (Liger's tests' scheme)."""
    n = target.shape[0]
    count = int(torch.randint(1, max(2, n // 2), (1,)).item())
    idx = torch.randperm(n)[:count].to(target.device)
    target[idx] = ignore_index
    return target


def ce_with_z_loss(logits, target, weight=None, lse_square_scale=0.0, reduction="mean", ignore_index=-100,
                   label_smoothing=0.0, dtype=torch.float32):
    """(loss, z_loss): PyTorch's cross-entropy (class weights, ignore_index, label smoothing) of the logits
    in REF_FLOAT plus the z-loss lse_square_scale * logsumexp^2 of each non-ignored token. With "mean" the
    cross-entropy part is divided by the sum of the non-ignored targets' weights (PyTorch's rule) and
    the z-loss part by the number of non-ignored tokens, unweighted (Liger's). Both returned in dtype."""
    x = logits.to(REF_FLOAT)
    w = weight.to(REF_FLOAT) if weight is not None else None
    ce = F.cross_entropy(x, target, weight=w, reduction=reduction, label_smoothing=label_smoothing,
                         ignore_index=ignore_index)
    valid = target != ignore_index
    lse = torch.logsumexp(x, dim=-1)
    z = torch.where(valid, lse_square_scale * lse * lse, torch.zeros_like(lse))
    if reduction == "mean":
        z = z.sum() / valid.sum()
    elif reduction == "sum":
        z = z.sum()
    ce, z = ce.to(dtype), z.to(dtype)
    return ce + z, z


def ce_fields(result):
    """(loss, z_loss, token_accuracy, predicted_tokens) of a structured cross-entropy result (Liger's
    CrossEntropyOutput: a dataclass with these four attributes, not a tuple)."""
    assert not isinstance(result, (tuple, list, torch.Tensor)), (
        f"expected a CrossEntropyOutput-like result (attributes loss, z_loss, token_accuracy, "
        f"predicted_tokens), got {type(result).__name__}")
    import tigon_torch

    cls = getattr(tigon_torch.functional, "CrossEntropyOutput", None)
    if cls is not None:
        assert isinstance(result, cls), f"expected tigon_torch.functional.CrossEntropyOutput, got {type(result)}"
    return result.loss, result.z_loss, result.token_accuracy, result.predicted_tokens


def names_number(message: str, value: int) -> bool:
    """Whether message contains the integer value as a whole number ("-1" is not found in "-100")."""
    return re.search(rf"(?<![\d.]){re.escape(str(value))}(?![\d.])", message) is not None


def torch_ce(logits, target, dtype, weight=None, **kwargs):
    """torch.nn.CrossEntropyLoss(**kwargs) of the logits in REF_FLOAT, returned in dtype (the gradient
    reaching low-precision logits is then rounded once)."""
    w = weight.to(REF_FLOAT) if weight is not None else None
    return torch.nn.CrossEntropyLoss(weight=w, **kwargs)(logits.to(REF_FLOAT), target).to(dtype)

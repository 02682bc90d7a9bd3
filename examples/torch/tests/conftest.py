"""Shared fixtures. Tests marked `gpu` need a CUDA device and the compiled operators; without a
device they are skipped (a device whose operators fail to build or load fails them instead).

TIGON_TORCH_REFERENCE_OPS=1 runs the `gpu` tests on the CPU with reference implementations in place
of tigon's kernels (reference_ops.py): a check of the Python side and of the tests themselves, not of
the kernels. Tests marked `cuda_only` (autocast on CUDA, CUDA's sync debug mode) are skipped then."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # models.py
try:
    import tigon_torch  # noqa: F401  (an installed package wins)
except ImportError:
    sys.path.insert(0, str(HERE.parent))

HAS_CUDA = torch.cuda.is_available()
REFERENCE = os.environ.get("TIGON_TORCH_REFERENCE_OPS") == "1"
DEVICE = "cpu" if REFERENCE else "cuda"


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_reference = pytest.mark.skip(reason="CUDA only: not in the CPU reference mode")
    for item in items:
        if REFERENCE:
            if "cuda_only" in item.keywords:
                item.add_marker(skip_reference)
        elif ("gpu" in item.keywords or "cuda_only" in item.keywords) and not HAS_CUDA:
            item.add_marker(skip)


def load_ops() -> str:
    """The compiled operators (a JIT build on first use when not installed); in the reference mode, the
    CPU reference kernels in their place. Also what a spawned worker process calls."""
    import tigon_torch

    how = tigon_torch.load()
    if REFERENCE:
        import reference_ops
        from tigon_torch import ops

        reference_ops.install()
        ops.on_device = lambda t: t.device.type in ("cpu", "cuda")
        how += " (CPU reference kernels)"
    return how


@pytest.fixture(scope="session")
def ext():
    """The compiled operators, loaded once."""
    how = load_ops()
    print(f"tigon_torch operators: {how}")
    return how


@pytest.fixture(autouse=True)
def _unpatch():
    yield
    from tigon_torch import unpatch

    unpatch()


def count_applies(monkeypatch, owner, name: str) -> list[int]:
    """Replaces owner.name (an autograd function class) with one whose apply counts its calls and
    runs the real one; returns the count as a one-item list."""
    n = [0]
    real = getattr(owner, name)

    class Counting:
        @staticmethod
        def apply(*args):
            n[0] += 1
            return real.apply(*args)

    monkeypatch.setattr(owner, name, Counting)
    return n


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.detach().double(), expected.detach().double()
    return float((a - e).norm() / e.norm().clamp_min(1e-30))


# Relative error (Frobenius norm) allowed per dtype for values and gradients.
REL_TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}
# Element-wise tolerances (atol, rtol) per dtype.
ELEM_TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


def assert_rel(actual, expected, dtype, factor=1.0, what=""):
    err = rel_err(actual, expected)
    assert err <= REL_TOL[dtype] * factor, f"{what}: relative error {err:.3e} > {REL_TOL[dtype] * factor:.1e}"


def assert_elem(actual, expected, dtype, factor=1.0):
    atol, rtol = ELEM_TOL[dtype]
    torch.testing.assert_close(actual, expected, atol=atol * factor, rtol=rtol * factor)


@pytest.fixture
def seed():
    s = int(os.environ.get("TIGON_TEST_SEED", "1234"))
    torch.manual_seed(s)
    return s

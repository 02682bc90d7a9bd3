"""What a PyTorch user times: cross-entropy and SwiGLU called as a training step calls them, forward
and backward at default arguments, tigon beside Liger-Kernel and plain PyTorch in one process.

    python bench/compare/autograd.py

Each row: the median of triton.testing.do_bench (an L2 flush before each call), the back-to-back
time (common.back_to_back: 20 steps between two events, median of 5), and the peak memory allocated over what was held before the step
(inputs excluded; outputs, gradients and workspaces included). bf16. Cross-entropy: logits [8192,
128256], `.backward()` on the loss (and on `loss * 0.5`: an upstream gradient other than 1). SwiGLU:
[16384, 14336], a and b made by the graph (`a0 * 1`, `b0 * 1`, the same two kernels for every
implementation), as an MLP's projections make them."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from triton.testing import do_bench

import tigon_torch as tt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import back_to_back  # noqa: E402


def measure(step) -> tuple[float, float, float]:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    ms = do_bench(step, warmup=5, rep=60, return_mode="median")
    b2b = back_to_back(step, 40)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return ms, b2b, (torch.cuda.max_memory_allocated() - base) / 2**20


def cross_entropy_rows(n=8192, v=128256):
    torch.manual_seed(0)
    x0 = torch.randn(n, v, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, v, (n,), device="cuda")
    calls = {"tigon": lambda x: tt.tigon_cross_entropy(x, t),
             "tigon, loss * 0.5": lambda x: tt.tigon_cross_entropy(x, t) * 0.5,
             "tigon in_place=True": lambda x: tt.tigon_cross_entropy(x, t, in_place=True)}
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy
        calls["liger"] = lambda x: liger_cross_entropy(x, t)
        calls["liger, loss * 0.5"] = lambda x: liger_cross_entropy(x, t) * 0.5
    except ImportError:
        print("Liger-Kernel unavailable")
    calls["torch F.cross_entropy(x.float())"] = lambda x: torch.nn.functional.cross_entropy(x.float(), t)
    for name, f in calls.items():
        x = x0.clone().requires_grad_(True)

        def step():
            f(x).backward()
            x.grad = None

        yield f"cross-entropy {n}x{v}: {name}", measure(step)
        del x


def swiglu_rows(m=16384, i=14336):
    a0 = torch.randn(m, i, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b0 = torch.randn(m, i, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dc = torch.randn(m, i, device="cuda", dtype=torch.bfloat16)
    calls = {"tigon": tt.tigon_swiglu}
    try:
        from liger_kernel.ops import LigerSiLUMulFunction
        calls["liger"] = LigerSiLUMulFunction.apply
    except ImportError:
        print("Liger-Kernel unavailable")
    calls["torch silu(a) * b"] = lambda a, b: torch.nn.functional.silu(a) * b
    for name, f in calls.items():

        def step():
            a, b = a0 * 1, b0 * 1
            f(a, b).backward(dc)
            a0.grad = b0.grad = None

        yield f"SwiGLU {m}x{i} (with the two * 1 kernels): {name}", measure(step)


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__)
    for rows in (cross_entropy_rows(), swiglu_rows()):
        for label, (ms, b2b, extra) in rows:
            print(f"{label:70s} do_bench {ms:.4f} ms   back-to-back {b2b:.4f} ms   extra {extra:.0f} MB")


if __name__ == "__main__":
    main()

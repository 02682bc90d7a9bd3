#!/usr/bin/env python3
"""RMSNorm forward, bf16, hidden 4096, llama casting: where a single call's time goes, tigon against
Liger-Kernel on the same tensors.

The per-op table (ops.py) times single calls: a 256 MiB L2 flush, a GPU spin, then CUDA events
around one call. There tigon's RMSNorm forward trails Liger's by about 2% at 16384 rows, while back
to back it is the faster, and Nsight Compute times the two kernels alone level. This script times,
in three regimes (the table's: flush + spin; spin only; 20 calls back to back):

- tigon's operator into preallocated outputs (`raw`) and through its autograd function (`fn`, as
  the table calls it);
- Liger's autograd function (as the table calls it), and its Triton row kernel launched directly
  with its default 8 warps and with 4 and 16 (one row per program in every case);

at 16384 rows (bandwidth) and at 528, 132 and 1 rows (a call's fixed cost: launch, first loads,
drain). Prints a table of median milliseconds.

    PYTHONPATH=examples/torch:.liger/src python bench/compare/single_call.py [--reps 40] [--rows 16384,1]

(--rows narrows the shapes, e.g. for Nsight Compute: `ncu --kernel-name regex:rms_norm
--metrics gpu__time_duration.sum python bench/compare/single_call.py --rows 1 --reps 3` gives each
kernel's own duration, without the launch around it.)

(tigon_torch importable, or preloaded as scripts/stage-torch-ext.sh says; Liger's source or wheel
importable.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.dont_write_bytecode = True
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import back_to_back, probe_liger, probe_tigon  # noqa: E402

D, EPS = 4096, 1e-6
LEAD_CYCLES = 2_000_000  # torch.cuda._sleep: about 1 ms at the H200's clock


def single(call, reps: int, flush) -> float:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        if flush is not None:
            flush.zero_()
        torch.cuda._sleep(LEAD_CYCLES)
        s.record()
        call()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--rows", default="16384,528,132,1", help="comma list of row counts")
    args = ap.parse_args()
    liger, missing, ldesc = probe_liger()
    tt, tdesc = probe_tigon(True)
    print(f"{ldesc} | {tdesc}", flush=True)
    if tt is None or "rms_norm" not in liger:
        print("needs tigon_torch's operators and Liger's RMSNorm:", tdesc, missing.get("rms_norm", ""))
        return 1
    from tigon_torch.ops import ops
    from liger_kernel.ops import rms_norm as lrms

    dev = torch.device("cuda")
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    llama = lrms._str_to_casting_mode["llama"]
    regimes = [("flush+spin (table)", lambda f: single(f, args.reps, flush)),
               ("spin only", lambda f: single(f, args.reps, None)),
               ("back to back", lambda f: back_to_back(f, args.reps))]
    print(f"\n{'rows':>6s} {'implementation':34s}" + "".join(f"{r[0]:>20s}" for r in regimes))
    for n in (int(r) for r in args.rows.split(",")):
        x = torch.randn(n, D, device=dev, generator=g).to(torch.bfloat16)
        w = (1 + 0.1 * torch.randn(D, device=dev, generator=g)).to(torch.bfloat16)
        y = torch.empty_like(x)
        rstd = torch.empty(n, dtype=torch.float32, device=dev)

        def liger_kernel(num_warps):
            def call():
                lrms._rms_norm_forward_kernel[(n,)](y, y.stride(0), x, x.stride(0), w, w.stride(0), rstd,
                                                    rstd.stride(0), D, EPS, 0.0, llama, elementwise_affine=True,
                                                    BLOCK_SIZE=D, num_warps=num_warps)
            return call

        impls = {
            "tigon raw (preallocated outputs)": lambda: ops().rms_norm_fwd(x, w, y, rstd, EPS, 0.0, 0),
            "tigon fn (autograd function)": lambda: tt.tigon_rms_norm(x, w, EPS),
            "liger fn (autograd function)": lambda: liger["rms_norm"].apply(x, w, EPS, 0.0, "llama", False),
            "liger kernel, 8 warps (default)": liger_kernel(8),
            "liger kernel, 4 warps": liger_kernel(4),
            "liger kernel, 16 warps": liger_kernel(16),
        }
        with torch.no_grad():
            for f in impls.values():
                for _ in range(3):
                    f()
            torch.cuda.synchronize()
            for name, f in impls.items():
                cells = [r[1](f) for r in regimes]
                print(f"{n:6d} {name:34s}" + "".join(f"{c:20.4f}" for c in cells), flush=True)
        del x, w, y, rstd
    return 0


if __name__ == "__main__":
    sys.exit(main())

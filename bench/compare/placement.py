"""SwiGLU (or GeGLU) forward, 16384 x 14336 bf16: tigon's operator (raw, into a preallocated output) and
torch.compile's kernel on a, b, c placed at different addresses: carved from one allocation back to
back, with 2 KiB / 64 KiB / 1 MiB between them, with c first, and as three separate allocations.
Each time is the mean of 20 back-to-back calls between CUDA events, after 3 warm-up calls.

    PYTHONPATH=examples/torch python bench/compare/placement.py [--act silu|gelu_tanh]

(with tigon_torch importable: built in place, or preloaded as scripts/stage-torch-ext.sh says).
docs/gated.md ("Where the tensors lie matters") gives what these layouts measured on one H200,
2026-11-30 (with this script's layouts and timing, run from a staged copy).
"""

import argparse

import torch
import torch.nn.functional as F

from tigon_torch.ops import ops

N, I = 16384, 14336
n = N * I
# tigon_torch's activation codes (examples/torch/csrc/gated.cu) and the same activation in PyTorch.
ACTS = {"silu": (0, F.silu), "gelu_tanh": (1, lambda x: F.gelu(x, approximate="tanh"))}


def mean_ms(f, reps=20):
    s = torch.cuda.Event(enable_timing=True)
    e = torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        f()
    s.record()
    for _ in range(reps):
        f()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / reps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--act", choices=sorted(ACTS), default="silu")
    code, act = ACTS[ap.parse_args().act]
    comp = torch.compile(lambda x, y, out: torch.mul(act(x), y, out=out))

    def both(a, b, c):
        return (mean_ms(lambda: ops().gated_fwd(a, b, c, code, 1.0, 1.0)), mean_ms(lambda: comp(a, b, c)))

    g = torch.Generator(device="cuda").manual_seed(0)
    big = torch.randn(3 * n + 8 * 2**20, device="cuda", generator=g).to(torch.bfloat16)
    print(f"{'layout':38s} {'tigon ms':>9s} {'compile ms':>11s}")
    layouts = [("one buffer, back to back", (0, n, 2 * n)),
               ("one buffer, +2 KiB between", (0, n + 1024, 2 * n + 2048)),
               ("one buffer, +64 KiB between", (0, n + 32768, 2 * n + 65536)),
               ("one buffer, +1 MiB between", (0, n + 2**19, 2 * n + 2**20)),
               ("one buffer, c first", (n, 2 * n, 0))]
    for name, offs in layouts:
        a, b, c = (big[o:o + n].view(N, I) for o in offs)
        ta, tc = both(a, b, c)
        print(f"{name:38s} {ta:9.4f} {tc:11.4f}", flush=True)
    del big, a, b, c
    torch.cuda.empty_cache()
    a = torch.randn(N, I, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(N, I, device="cuda", generator=g).to(torch.bfloat16)
    c = torch.empty(N, I, device="cuda", dtype=torch.bfloat16)
    ta, tc = both(a, b, c)
    print(f"{'separate allocations':38s} {ta:9.4f} {tc:11.4f}")


if __name__ == "__main__":
    main()

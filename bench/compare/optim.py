"""The optimizer step side by side: torch.optim.AdamW(fused=True) against tigon_torch.optim.AdamW over
LLaMA-3-8B's parameter list (the embeddings, the LM head, the final norm and `--layers` decoder layers;
bf16 parameters and gradients), without and with the global gradient-norm clip (torch's
clip_grad_norm_ then its step; tigon's clip_grad_norm_(optimizer=) whose factor the step applies).

Per row: the median of CUDA-event timings of single steps (after warm-up), the useful bytes per element
(parameter and gradient read, parameter and both moments read and written: 14 with bf16 moments, 22
with fp32 ones; the clip reads the gradients once more in torch, not in tigon, which is counted in
neither), and % of the device-to-device copy rate measured in the same process (a 1 GiB copy, 2 GiB
moved). Usage: python bench/compare/optim.py [--layers 8] [--steps 20] [--json out.json]"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from common import add_tigon_torch_to_path

add_tigon_torch_to_path()


def llama3_8b_shapes(layers: int) -> list[tuple[int, ...]]:
    d, kv, f, v = 4096, 1024, 14336, 128256
    shapes = [(v, d), (v, d), (d,)]
    for _ in range(layers):
        shapes += [(d, d), (kv, d), (kv, d), (d, d), (f, d), (f, d), (d, f), (d,), (d,)]
    return shapes


def copy_rate() -> float:
    n = 1 << 30
    a, b = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    del a, b
    return 2 * n / (statistics.median(times) * 1e-3) / 1e9


def time_steps(step, steps: int) -> float:
    for _ in range(3):
        step()
    times = []
    for _ in range(steps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        step()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    import tigon_torch
    import tigon_torch.optim as topt

    tigon_torch.load()
    shapes = llama3_8b_shapes(args.layers)
    numel = sum(torch.Size(s).numel() for s in shapes)
    ceiling = copy_rate()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    print(f"{torch.cuda.get_device_name()}, {numel / 1e6:.0f} M parameters ({len(shapes)} tensors), "
          f"copy {ceiling:.0f} GB/s")
    rows = []

    def run(name, make, clip, bytes_per_elem):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.02) for s in shapes]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        opt = make(params)
        if clip == "torch":
            def step():
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
        elif clip == "tigon":
            def step():
                topt.clip_grad_norm_(params, 1.0, optimizer=opt)
                opt.step()
        else:
            step = opt.step
        ms = time_steps(step, args.steps)
        gbs = numel * bytes_per_elem / (ms * 1e-3) / 1e9
        peak = torch.cuda.max_memory_allocated() / 2**30
        rows.append(dict(name=name, ms=ms, gbs=gbs, pct=100 * gbs / ceiling, peak_gib=peak))
        print(f"{name:58s} {ms:9.3f} ms {gbs:7.0f} GB/s {100 * gbs / ceiling:6.1f}%  peak {peak:6.1f} GiB")
        del opt, params
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    run("torch AdamW(fused=True), bf16 moments", lambda p: torch.optim.AdamW(p, lr=1e-4, fused=True), None, 14)
    run("tigon_torch.optim.AdamW, bf16 moments", lambda p: topt.AdamW(p, lr=1e-4), None, 14)
    run("tigon_torch.optim.AdamW, fp32 moments",
        lambda p: topt.AdamW(p, lr=1e-4, moments_dtype=torch.float32), None, 22)
    run("torch clip_grad_norm_ + AdamW(fused=True), bf16 moments",
        lambda p: torch.optim.AdamW(p, lr=1e-4, fused=True), "torch", 14)
    run("tigon clip_grad_norm_(optimizer=) + AdamW, bf16 moments", lambda p: topt.AdamW(p, lr=1e-4), "tigon", 14)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), copy_gbs=ceiling, numel=numel, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()

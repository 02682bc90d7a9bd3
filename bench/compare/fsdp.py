#!/usr/bin/env python3
"""Training under FSDP2 on several GPUs of one host: Hugging Face LlamaForCausalLM (LLaMA-3-8B's layer
shapes, --layers of them, random weights from a fixed seed), bf16, as HF eager, HF + Liger and HF +
tigon, each variant in fresh processes (one a rank, torch.multiprocessing), from identical weights.

    python bench/compare/fsdp.py --out OUTDIR [--ranks 2] [--layers 4] [--seq 4096] [--variants hf,liger,tigon]
    python bench/compare/fsdp.py --dry --out /tmp/fsdp      # two ranks on the CPU over gloo: a smoke test

Each rank: the model built with the same seed, patched, `fully_shard` on every decoder layer and on
the model (the LM head and embeddings in the root unit), torch's AdamW (fused on CUDA), batch --batch
of --seq tokens a rank (each rank its own batch), --warmup steps then --steps timed steps. Reported per
variant: tokens/s over all ranks (the slowest rank's step time), the peak memory of each rank
(torch.cuda.max_memory_allocated over the timed steps), and the losses of rank 0; OUTDIR/fsdp.json and
OUTDIR/fsdp.md. A variant whose import fails (Liger not installed) reads `unavailable`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.dont_write_bytecode = True
sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e  # noqa: E402  (the model, the patches, the batches)
from common import environment, log, write_json  # noqa: E402

VARIANTS = ["hf", "liger", "tigon"]
DRY = dict(device="cpu", layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=1024, seq=64,
           steps=2, warmup=1)


def rank_main(rank: int, args, store: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(rank)
        args.device = f"cuda:{rank}"
    res = {"rank": rank, "variant": args.variant}
    try:
        e2e.preflight(args.variant, args.device, args.cpu_reference)
    except ImportError as e:
        res["unavailable"] = f"{type(e).__name__}: {e}"
        write_json(out, res)
        return
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank,
                            world_size=args.ranks)
    from torch.distributed.fsdp import fully_shard

    model, _ = e2e.build_model(args)
    res["params"] = sum(p.numel() for p in model.parameters())
    res["patch"] = e2e.patch(model, args.variant, args.cpu_reference)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)
    res["losses"], res["step_s"] = [], []
    for step in range(args.warmup + args.steps):
        if step == args.warmup and cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + rank * 7919 + step)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(args.device)
        dist.barrier()
        t0 = time.perf_counter()
        loss = e2e.train_step(model, opt, ids)
        lv = float(loss)
        e2e.sync(args.device)
        # The step ends when the slowest rank's does.
        dt = torch.tensor([time.perf_counter() - t0], device=args.device)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        res["losses"].append(lv)
        res["step_s"].append(round(float(dt), 4))
        if rank == 0:
            log(f"[{args.variant}] step {step + 1}/{args.warmup + args.steps}{' (warm-up)' if step < args.warmup else ''}: "
                f"loss {lv:.4f}, {float(dt):.3f} s")
    res["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    write_json(out, res)
    dist.destroy_process_group()


def run_variant(args, variant: str, out_dir: Path) -> dict:
    import torch.multiprocessing as mp

    args.variant = variant
    store = out_dir / f"store-{variant}-{os.getpid()}"
    outs = [str(out_dir / f"fsdp-{variant}-rank{r}.json") for r in range(args.ranks)]
    t0 = time.perf_counter()
    mp.spawn(_spawned, args=(args, str(store), outs), nprocs=args.ranks)
    ranks = [json.loads(Path(o).read_text()) for o in outs]
    if any("unavailable" in r for r in ranks):
        return {"variant": variant, "unavailable": next(r["unavailable"] for r in ranks if "unavailable" in r)}
    timed = ranks[0]["step_s"][args.warmup:]
    step = sum(timed) / len(timed)
    return {"variant": variant, "patch": ranks[0]["patch"], "params": ranks[0]["params"],
            "tokens_per_s": args.ranks * args.batch * args.seq / step, "step_s": step,
            "peak_gib": [r["peak_gib"] for r in ranks], "losses": ranks[0]["losses"],
            "wall_s": round(time.perf_counter() - t0, 1)}


def _spawned(rank, args, store, outs):
    rank_main(rank, args, store, outs[rank])


def markdown(args, results: list[dict]) -> str:
    lines = [f"FSDP2, {args.ranks} ranks, {args.layers} layers of hidden {args.hidden}, vocab {args.vocab}, "
             f"batch {args.batch} x seq {args.seq} a rank, {args.steps} timed steps after {args.warmup}", "",
             "| variant | tokens/s | vs HF | step s | peak GiB per rank | loss (rank 0, last) |", "|---|---|---|---|---|---|"]
    hf = next((r for r in results if r["variant"] == "hf" and "tokens_per_s" in r), None)
    for r in results:
        if "unavailable" in r:
            lines.append(f"| {r['variant']} | unavailable: {r['unavailable'][:80]} | | | | |")
            continue
        rel = f"{r['tokens_per_s'] / hf['tokens_per_s']:.2f}x" if hf else ""
        lines.append(f"| {r['variant']} | {r['tokens_per_s']:,.0f} | {rel} | {r['step_s']:.3f} | "
                     f"{', '.join(f'{p:.1f}' for p in r['peak_gib'])} | {r['losses'][-1]:.4f} |")
    return "\n".join(lines) + "\n"


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", default="bench-compare-fsdp")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--dry", action="store_true", help="two ranks on the CPU over gloo, a tiny model")
    p.add_argument("--cpu-reference", action="store_true",
                   help="with --dry: tigon through the test suite's CPU reference kernels")
    p.add_argument("--device", default=None)
    for k in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "seq", "steps", "warmup"):
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=None)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attn", default="sdpa")
    a = p.parse_args(argv)
    defaults = dict(device="cuda", layers=4, seq=4096, steps=5, warmup=2,
                    **{k: v for k, v in e2e.LLAMA3_8B.items() if k not in ("layers", "rope_theta", "rms_norm_eps")})
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, DRY[k] if a.dry and k in DRY else v)
    a.seqs, a.ckpt_max = str(a.seq), a.seq  # what e2e.build_model reads
    bad = [v for v in a.variants.split(",") if v not in VARIANTS]
    if bad:
        p.error(f"unknown variant(s) {bad}; choose from {VARIANTS}")
    return a


def main() -> int:
    args = parse()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for v in args.variants.split(","):
        r = run_variant(args, v, out)
        results.append(r)
        log(f"[{v}] " + (f"unavailable: {r['unavailable']}" if "unavailable" in r else f"{r['tokens_per_s']:,.0f} tokens/s"))
    write_json(out / "fsdp.json", {"env": environment(), "args": vars(args), "results": results})
    md = markdown(args, results)
    (out / "fsdp.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

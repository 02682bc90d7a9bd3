#!/usr/bin/env python3
"""End-to-end training comparison: Hugging Face LlamaForCausalLM built from the LLaMA-3-8B config
(random weights from a fixed seed, no download), bf16, fused AdamW, batch 1, SDPA attention, as
HF eager, HF + Liger (apply_liger_kernel_to_llama) and HF + tigon (tigon_torch.apply_tigon_to_llama),
each in a fresh process, from identical weights and batches.

    python bench/compare/e2e.py --out OUTDIR [--phases train,ckpt] [--variants hf,liger,tigon]
                                [--seqs 4096,8192] [--max-seconds 500]
    python bench/compare/e2e.py --dry --out /tmp/e2e      # tiny model on the CPU: a smoke test

Variants: hf, liger, tigon (the default three), tigon_unfused_adds (tigon with fused_add_norm=False:
the residual adds as Hugging Face's adds) and tigon_torch_adamw (tigon's kernels, torch's fused AdamW).
The hf and liger variants step with torch.optim.AdamW(fused=True); the tigon variants (but
tigon_torch_adamw) with tigon_torch.optim.AdamW, same arguments, torch's fused numerics bit for bit.

--profile: after each sequence's timed steps, one more step under torch.profiler; the device time
of its kernels by category (GEMM, attention, each tigon op, optimizer, elementwise and copies), the
longest kernels and the device's longest idle gaps go to OUTDIR/e2e-profile-<variant>-<seq>.md (the
step itself is not timed).

Phases:
  train  no gradient checkpointing, each sequence of --seqs: --warmup steps, then --steps timed
         steps: tokens/s, peak memory, activation memory (peak minus weights, gradients and
         optimizer state, counted from the tensors), the per-step losses (warm-up steps included),
         and the SM clock and board power during the timed steps (nvidia-smi, where it runs).
  ckpt   gradient checkpointing (non-reentrant), batch 1: the longest sequence that trains one
         full step (forward, backward, optimizer step), doubling from --ckpt-start, then bisecting
         to --ckpt-resolution, up to --ckpt-max (262144); an OOM ends an attempt. An attempt
         whose estimated time (the last success scaled by the square of the length ratio) does
         not fit the time left is not made: the result is then a lower bound, said so.

The driver (no --worker) runs one subprocess per (phase, variant), gives each a fair share of the
time left of --max-seconds (a worker stops starting steps, sequences or attempts when its share is
spent, and says what it skipped), and writes OUTDIR/e2e.json and OUTDIR/e2e.md; each worker's
own result is OUTDIR/e2e-<phase>-<variant>.json. The model is built on the device in bf16 with the
same seed in every process and patched afterwards (model=...), so the weights are identical (a
checksum of a few parameters is recorded to show it).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.dont_write_bytecode = True
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Budget, environment, log, probe_tigon, write_json  # noqa: E402

VARIANTS = ["hf", "liger", "tigon", "tigon_unfused_adds", "tigon_torch_adamw"]
TIGON_VARIANTS = ("tigon", "tigon_unfused_adds", "tigon_torch_adamw")
TIGON_ADAMW = ("tigon", "tigon_unfused_adds")  # stepped by tigon_torch.optim.AdamW on the GPU
DEFAULT_VARIANTS = ["hf", "liger", "tigon"]
PHASES = ["train", "ckpt"]

# LLaMA-3-8B (meta-llama/Meta-Llama-3-8B config.json), written here: nothing is downloaded.
LLAMA3_8B = dict(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256,
                 rope_theta=500000.0, rms_norm_eps=1e-5)
DRY = dict(device="cpu", layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=1024,
           seqs="64,128", steps=2, warmup=1, ckpt_start=128, ckpt_max=512, ckpt_resolution=128)


# ------------------------------------------------------------------------------------------------
# Worker
# ------------------------------------------------------------------------------------------------


def build_model(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    max_seq = max([int(s) for s in args.seqs.split(",")] + [args.ckpt_max, 8192])
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=max_seq, rope_theta=LLAMA3_8B["rope_theta"],
        rms_norm_eps=LLAMA3_8B["rms_norm_eps"], tie_word_embeddings=False, use_cache=False,
        bos_token_id=128000 if args.vocab > 128001 else None, eos_token_id=128001 if args.vocab > 128001 else None)
    config._attn_implementation = args.attn
    torch.manual_seed(args.seed)
    if args.device.startswith("cuda"):
        torch.cuda.manual_seed_all(args.seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(args.device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    # Built under the default dtype bf16, as from_pretrained(dtype=torch.bfloat16) builds it: the
    # parameters are bf16 and RoPE's inv_freq buffer stays fp32 (model.to(bf16) would round it).
    dtypes = {p.dtype for p in model.parameters()}
    if dtypes != {torch.bfloat16}:
        raise RuntimeError(f"parameters not all bf16: {dtypes}")
    model.train()
    return model, config


def preflight(variant: str, device: str, cpu_reference: bool = False) -> None:
    """Imports what the variant needs before the model is built (raises ImportError)."""
    if variant == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama  # noqa: F401
    elif variant in TIGON_VARIANTS:
        tt, desc = probe_tigon(need_ops=device.startswith("cuda") or cpu_reference)
        if tt is None:
            raise ImportError(desc)
        if cpu_reference:
            # The test suite's reference mode: CPU implementations of tigon's operators, so the
            # patched model's tigon path runs here (checks the plumbing, not tigon's kernels).
            sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "torch" / "tests"))
            import reference_ops
            from tigon_torch import ops as tt_ops

            reference_ops.install()
            tt_ops.on_device = lambda t: t.device.type in ("cpu", "cuda")


def patch(model, variant: str, cpu_reference: bool = False) -> str:
    if variant == "hf":
        return "Hugging Face eager (unpatched)"
    if variant == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(model=model)  # rope, rms_norm, swiglu, fused linear cross-entropy
        import liger_kernel

        return f"apply_liger_kernel_to_llama(model=model) from {os.path.dirname(liger_kernel.__file__)}"
    if variant in TIGON_VARIANTS:
        tt, desc = probe_tigon(need_ops=model.device.type == "cuda")
        if tt is None:
            raise ImportError(desc)
        # rope, rms_norm (the residual adds fused with the norms unless asked not to), swiglu, fused
        # linear cross-entropy
        fused = variant != "tigon_unfused_adds"
        tt.apply_tigon_to_llama(model=model, fused_add_norm=fused)
        if model.device.type != "cuda":
            desc += (" (CPU: the CPU reference kernels, --cpu-reference)" if cpu_reference
                     else " (CPU: Hugging Face's code, tigon_torch's fallback)")
        return f"apply_tigon_to_llama(model=model{'' if fused else ', fused_add_norm=False'}), {desc}"
    raise ValueError(variant)


def checksum(model) -> list[float]:
    import torch

    with torch.no_grad():
        names = dict(model.named_parameters())
        picks = [n for n in names if n.endswith(("embed_tokens.weight", "layers.0.self_attn.q_proj.weight",
                                                  "layers.0.mlp.down_proj.weight", "lm_head.weight"))]
        return [round(float(names[n].float().sum()), 4) for n in sorted(picks)]


def tensor_bytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def static_bytes(model, opt) -> dict:
    params = list(model.parameters())
    state = [v for st in opt.state.values() for v in st.values() if hasattr(v, "numel")]
    return {"weights": tensor_bytes(params), "gradients": tensor_bytes(params), "optimizer": tensor_bytes(state)}


def make_optimizer(model, args, cuda: bool):
    """torch's fused AdamW, or tigon_torch's for the tigon variants on the GPU (same arguments)."""
    import torch

    kw = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    desc = f"AdamW(lr={args.lr}, betas=(0.9, 0.95), weight_decay=0.1"
    if cuda and args.variant in TIGON_ADAMW:
        from tigon_torch.optim import AdamW

        return AdamW(model.parameters(), **kw), "tigon_torch.optim." + desc + ")"
    return torch.optim.AdamW(model.parameters(), fused=cuda, **kw), "torch.optim." + desc + f", fused={cuda})"


# Kernel categories of the profile, first match wins (names as the profiler reports them).
PROFILE_CATEGORIES = [
    ("tigon AdamW", r"tigon.*adamw|adamw.*tigon"),
    ("tigon linear cross-entropy + cross-entropy", r"tigon.*(cross_entropy|::ce_|lce_)"),
    ("tigon RMSNorm, add + RMSNorm", r"tigon.*(rms_norm|layer_norm)"),
    ("tigon SwiGLU", r"tigon.*(gated|swiglu|glu)"),
    ("tigon RoPE", r"tigon.*rope"),
    ("tigon, other", r"tigon"),
    ("torch AdamW", r"(fused_?adam|FusedAdam|multi_tensor_apply)"),
    ("attention", r"(flash|fmha|attention|attn|cudnn)"),
    ("GEMM", r"(gemm|cutlass|xmma|nvjet|cublas|sm90_|Kernel2)"),
    ("reductions", r"(reduce_kernel|Reduce)"),
    ("elementwise, copies, fills", r"(elementwise|vectorized|unrolled|copy|Copy|fill|cat_|index|gather|scatter|[Mm]emcpy|[Mm]emset)"),
]


def category(kernel: str) -> str:
    """The profile's category of a kernel name (PROFILE_CATEGORIES, first match), else "other"."""
    return next((c for c, rx in PROFILE_CATEGORIES if re.search(rx, kernel)), "other")


def device_idle(spans):
    """(span, busy, gaps) of (start, end, name) device intervals in µs: from the first start to the last
    end, the time covered by any interval, and each gap as (length, the interval before, the one after)."""
    spans = sorted(spans)
    gaps, busy, reach, last = [], 0.0, None, None
    for a, b, name in spans:
        if reach is None or a > reach:
            if reach is not None:
                gaps.append((a - reach, last, name))
            busy += b - a
            reach, last = b, name
        elif b > reach:
            busy += b - reach
            reach, last = b, name
    return ((reach - spans[0][0]) if spans else 0.0), busy, gaps


class ClockSampler:
    """The GPU's SM clock (MHz), board power (W) and temperature (C), read by nvidia-smi every 50 ms
    from start() to stop() (nothing where nvidia-smi is missing): a step that takes longer with the
    same kernels shows here whether the clocks were lower."""

    def __init__(self, device: str):
        import shutil

        self.cmd = None
        if device.startswith("cuda") and shutil.which("nvidia-smi"):
            import torch

            index = torch.device(device).index
            self.cmd = ["nvidia-smi", "-i", str(torch.cuda.current_device() if index is None else index),
                        "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader,nounits",
                        "-lms", "50"]
        self.proc, self.samples = None, []

    def start(self):
        if self.cmd and self.proc is None:
            self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def stop(self):
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            out, _ = self.proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        for line in out.splitlines():
            try:
                self.samples.append(tuple(float(v) for v in line.split(",")))
            except ValueError:
                continue  # "[N/A]" or a partial line
        self.proc = None

    def summary(self) -> dict:
        """Median and lowest SM clock, mean power, highest temperature, and the sample count."""
        if not self.samples:
            return {}
        mhz = sorted(s[0] for s in self.samples)
        return {"sm_mhz_median": mhz[len(mhz) // 2], "sm_mhz_min": mhz[0],
                "power_w_mean": round(sum(s[1] for s in self.samples) / len(self.samples), 1),
                "temp_c_max": max((s[2] for s in self.samples if len(s) > 2), default=None),
                "samples": len(self.samples)}


def profile_step(model, opt, ids, path: Path, title: str) -> dict:
    """One training step under torch.profiler: kernel device time by category and the longest kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    sync("cuda")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        train_step(model, opt, ids)
        sync("cuda")
    kernels, spans = {}, []
    for e in prof.events():
        if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        if getattr(e, "is_user_annotation", False) or "#" in e.name or e.name.startswith("ProfilerStep"):
            continue  # a range annotation (Optimizer.step#AdamW.step) drawn on the device: not a kernel
        us = e.device_time_total  # a device event's own span, in µs
        k = kernels.setdefault(e.name, [0.0, 0])
        k[0] += us
        k[1] += 1
        spans.append((e.time_range.start, e.time_range.end, e.name))
    span, busy, gaps = device_idle(spans)
    total = sum(v[0] for v in kernels.values())
    cats = {c: [0.0, 0] for c, _ in PROFILE_CATEGORIES}
    cats["other"] = [0.0, 0]
    for name, (us, n) in kernels.items():
        c = category(name)
        cats[c][0] += us
        cats[c][1] += n
    L = [f"# Profile: {title}", "", f"Kernel device time of one step: {total / 1e3:.1f} ms over "
         f"{sum(v[1] for v in kernels.values())} launches; from the first kernel's start to the last one's end "
         f"{span / 1e3:.1f} ms, of which the device ran no kernel for {(span - busy) / 1e3:.1f} ms.", "",
         "| category | ms | % | launches |", "|---|---|---|---|"]
    for c, (us, n) in sorted(cats.items(), key=lambda kv: -kv[1][0]):
        if n:
            L.append(f"| {c} | {us / 1e3:.2f} | {100 * us / max(total, 1e-9):.1f} | {n} |")
    L += ["", "Longest kernels:", "", "| kernel | ms | launches |", "|---|---|---|"]
    for name, (us, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:30]:
        L.append(f"| `{name[:110]}` | {us / 1e3:.2f} | {n} |")
    L += ["", "Longest idle gaps on the device:", "", "| gap ms | after | before |", "|---|---|---|"]
    for us, before, after in sorted(gaps, key=lambda g: -g[0])[:12]:
        L.append(f"| {us / 1e3:.3f} | `{before[:70]}` | `{after[:70]}` |")
    path.write_text("\n".join(L) + "\n")
    return {"kernel_ms": round(total / 1e3, 2), "span_ms": round(span / 1e3, 2),
            "idle_ms": round((span - busy) / 1e3, 2),
            "categories_ms": {c: round(v[0] / 1e3, 2) for c, v in cats.items() if v[1]}, "file": path.name}


def make_batch(args, seq: int, step: int):
    import torch

    g = torch.Generator().manual_seed(args.seed * 1_000_003 + seq * 1009 + step)
    ids = torch.randint(0, args.vocab, (args.batch, seq), generator=g)
    return ids.to(args.device)


def train_step(model, opt, ids):
    out = model(input_ids=ids, labels=ids)
    loss = out.loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def sync(device: str):
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def is_oom(e: BaseException) -> bool:
    import torch

    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def worker(args) -> dict:
    import torch

    budget = Budget(args.max_seconds)
    res = {"variant": args.variant, "phase": args.phase, "env": environment(), "skipped": []}
    cuda = args.device.startswith("cuda")
    try:
        t0 = time.perf_counter()
        preflight(args.variant, args.device, args.cpu_reference)
        res["preflight_s"] = round(time.perf_counter() - t0, 1)
        t0 = time.perf_counter()
        model, config = build_model(args)
        res["build_s"] = round(time.perf_counter() - t0, 1)
        res["checksum"] = checksum(model)
        t0 = time.perf_counter()
        res["patch"] = patch(model, args.variant, args.cpu_reference)
        res["patch_s"] = round(time.perf_counter() - t0, 1)
    except ImportError as e:
        res["unavailable"] = f"{type(e).__name__}: {e}"
        log(f"[{args.variant}] unavailable: {res['unavailable']}")
        return res
    res["config"] = {k: getattr(config, k, None) for k in (
        "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
        "vocab_size", "rope_parameters", "rms_norm_eps", "max_position_embeddings")}
    res["config"]["attn_implementation"] = getattr(config, "_attn_implementation", None)
    res["params"] = sum(p.numel() for p in model.parameters())
    opt, res["optimizer"] = make_optimizer(model, args, cuda)
    tag = f"[{args.variant} {args.phase}]"
    log(f"{tag} built {res['params'] / 1e9:.2f} B params in {res['build_s']} s; {res['patch']}")

    if args.phase == "train":
        res["runs"] = []
        for seq in [int(s) for s in args.seqs.split(",")]:
            run = {"seq": seq, "batch": args.batch, "losses": [], "step_s": []}
            res["runs"].append(run)
            if budget.left() < 10:
                run["skipped"] = "no time left"
                res["skipped"].append(f"train seq {seq}: no time left")
                log(f"{tag} seq {seq}: skipped, no time left")
                continue
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            n_total = args.warmup + args.steps
            clocks = ClockSampler(args.device)
            try:
                for step in range(n_total):
                    if step == args.warmup and cuda:
                        sync(args.device)
                        torch.cuda.reset_peak_memory_stats()
                        clocks.start()
                    ids = make_batch(args, seq, step)
                    sync(args.device)
                    t0 = time.perf_counter()
                    loss = train_step(model, opt, ids)
                    lv = float(loss)  # synchronises
                    sync(args.device)
                    dt = time.perf_counter() - t0
                    run["losses"].append(lv)
                    run["step_s"].append(round(dt, 4))
                    timed = run["step_s"][args.warmup:]
                    tps = args.batch * seq / (sum(timed) / len(timed)) if timed else args.batch * seq / dt
                    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
                    left_steps = n_total - step - 1
                    log(f"{tag} seq {seq} step {step + 1}/{n_total}{' (warm-up)' if step < args.warmup else ''}: "
                        f"loss {lv:.4f}, {dt:.3f} s, {tps:,.0f} tokens/s, peak {peak:.1f} GiB, "
                        f"eta {left_steps * dt:.0f} s, {budget.elapsed():.0f} s elapsed")
                    if left_steps and budget.left() < dt * 1.5:
                        run["truncated"] = f"stopped after {step + 1} of {n_total} steps: time budget"
                        res["skipped"].append(f"train seq {seq}: {run['truncated']}")
                        log(f"{tag} seq {seq}: {run['truncated']}")
                        break
            except Exception as e:  # noqa: BLE001
                run["error"] = ("OOM: " if is_oom(e) else "") + f"{type(e).__name__}: {str(e)[:300]}"
                log(f"{tag} seq {seq}: {run['error']}")
                opt.zero_grad(set_to_none=True)
            finally:
                clocks.stop()
            if clocks.samples:
                run["clocks"] = clocks.summary()
                log(f"{tag} seq {seq}: during the timed steps {run['clocks']}")
            timed = run["step_s"][args.warmup:]
            if timed:
                mean = sum(timed) / len(timed)
                run["tokens_per_s"] = round(args.batch * seq / mean, 1)
                run["timed_steps"] = len(timed)
                run["median_step_s"] = sorted(timed)[len(timed) // 2]
                # 6 x parameters x tokens (embedding included) + causal attention 6 x layers x hidden x seq^2
                flops = 6 * res["params"] * seq * args.batch + 12 * args.layers * args.hidden * seq * seq * args.batch / 2
                run["model_tflops"] = round(flops / mean / 1e12, 1)
            if cuda:
                st = static_bytes(model, opt)
                run["static_bytes"] = st
                run["peak_bytes"] = torch.cuda.max_memory_allocated()
                run["activation_bytes"] = run["peak_bytes"] - sum(st.values())
                run["reserved_bytes"] = torch.cuda.max_memory_reserved()
            if cuda and args.profile and "error" not in run and args.result:
                try:
                    path = Path(args.result).parent / f"e2e-profile-{args.variant}-{seq}.md"
                    run["profile"] = profile_step(model, opt, make_batch(args, seq, n_total), path,
                                                  f"{args.variant}, seq {seq}, {res['optimizer']}")
                    log(f"{tag} seq {seq}: profile {run['profile']}")
                except Exception as e:  # noqa: BLE001
                    run["profile"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                    log(f"{tag} seq {seq}: profile failed: {run['profile']['error']}")
        return res

    # ckpt: the longest sequence one full step trains with gradient checkpointing.
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    search = {"attempts": [], "start": args.ckpt_start, "max": args.ckpt_max, "resolution": args.ckpt_resolution}
    res["search"] = search
    try:  # optimizer state allocated before the search
        train_step(model, opt, make_batch(args, min(1024, args.ckpt_start), 0))
        sync(args.device)
    except Exception as e:  # noqa: BLE001
        search["error"] = f"first step failed: {type(e).__name__}: {str(e)[:300]}"
        return res
    ok, bad, last_ok_s = 0, None, None

    def attempt(seq: int) -> bool | None:
        nonlocal last_ok_s
        if last_ok_s is not None and ok:
            est = last_ok_s * (seq / ok) ** 2
            if est > budget.left() - 5:
                note = f"seq {seq} not tried: estimated {est:.0f} s, {max(0, budget.left()):.0f} s left"
                search["attempts"].append({"seq": seq, "result": "not tried (time)", "estimate_s": round(est, 1)})
                res["skipped"].append(f"ckpt {note}")
                log(f"[{args.variant} ckpt] {note}")
                return None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        entry = {"seq": seq}
        try:
            if args.simulate_oom_above and seq > args.simulate_oom_above:
                raise torch.OutOfMemoryError(f"simulated (--simulate-oom-above {args.simulate_oom_above})")
            loss = float(train_step(model, opt, make_batch(args, seq, 0)))
            sync(args.device)
            entry.update(result="ok", loss=loss)
            last_ok_s = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001
            opt.zero_grad(set_to_none=True)
            entry.update(result="oom" if is_oom(e) else "error", error=f"{type(e).__name__}: {str(e)[:200]}")
        entry["s"] = round(time.perf_counter() - t0, 2)
        if cuda:
            entry["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        search["attempts"].append(entry)
        log(f"[{args.variant} ckpt] seq {seq}: {entry['result']} in {entry['s']} s"
            + (f", peak {entry['peak_gib']} GiB" if "peak_gib" in entry else "")
            + f", {budget.elapsed():.0f} s elapsed")
        return entry["result"] == "ok"

    seq, stopped = args.ckpt_start, False
    while seq <= args.ckpt_max:
        r = attempt(seq)
        if r is None:
            stopped = True
            break
        if not r:
            bad = seq
            break
        ok = seq
        seq *= 2
    if ok and ok < args.ckpt_max and bad is None and not stopped and seq > args.ckpt_max:
        r = attempt(args.ckpt_max)  # the cap itself when doubling stepped over it
        if r:
            ok = args.ckpt_max
        elif r is False:
            bad = args.ckpt_max
        else:
            stopped = True
    while bad is not None and not stopped and bad - ok > args.ckpt_resolution:
        mid = (ok + bad) // 2 // args.ckpt_resolution * args.ckpt_resolution
        if mid <= ok:
            break
        r = attempt(mid)
        if r is None:
            stopped = True
        elif r:
            ok = mid
        else:
            bad = mid
    search["longest_ok"] = ok
    search["first_failure"] = bad
    search["lower_bound_only"] = bool(stopped or (bad is None and ok < args.ckpt_max))
    log(f"[{args.variant} ckpt] longest sequence trained: {ok}"
        + (f" (fails at {bad})" if bad else "") + (" (a lower bound: time budget)" if search["lower_bound_only"] else ""))
    return res


# ------------------------------------------------------------------------------------------------
# Driver
# ------------------------------------------------------------------------------------------------


def passthrough(args) -> list[str]:
    out = []
    for k in ("device", "layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "seqs", "steps", "warmup",
              "batch", "lr", "seed", "attn", "ckpt_start", "ckpt_max", "ckpt_resolution", "simulate_oom_above"):
        out += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    if args.cpu_reference:
        out.append("--cpu-reference")
    if args.profile:
        out.append("--profile")
    return out


def driver(args) -> int:
    # A SIGTERM (timeout) ends the driver through SystemExit, so subprocess.run kills the worker.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    budget = Budget(args.max_seconds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    phases = [p for p in args.phases.split(",") if p]
    variants = [v for v in args.variants.split(",") if v]
    jobs = [(p, v) for p in phases for v in variants]
    results, skipped = {p: {} for p in phases}, []
    for i, (phase, variant) in enumerate(jobs):
        left = budget.left()
        share = min(left, max(left / (len(jobs) - i), args.min_job_seconds))
        if left < args.min_job_seconds:
            skipped.append(f"{phase} {variant}: not started, {max(0, budget.left()):.0f} s left")
            log(f"[driver] {skipped[-1]}")
            continue
        rpath = out / f"e2e-{phase}-{variant}.json"
        if rpath.exists():
            rpath.unlink()
        cmd = [sys.executable, __file__, "--worker", "--variant", variant, "--phase", phase, "--result", str(rpath),
               ] + passthrough(args)
        if math.isfinite(share):
            cmd += ["--max-seconds", str(round(share - args.grace_seconds, 1))]
        log(f"[driver] {phase} {variant}: "
            + (f"{share:.0f} s share" if math.isfinite(share) else "no time limit")
            + f", {budget.elapsed():.0f} s elapsed")
        t0 = time.perf_counter()
        try:
            rc = subprocess.run(cmd, timeout=share + 30 if math.isfinite(share) else None).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        wall = round(time.perf_counter() - t0, 1)
        if rpath.exists():
            results[phase][variant] = json.loads(rpath.read_text())
        else:
            results[phase][variant] = {"error": f"worker exited {rc} without a result"}
        results[phase][variant]["wall_s"] = wall
        results[phase][variant]["rc"] = rc
        save(out, args, results, skipped, budget)
    save(out, args, results, skipped, budget)
    log(f"[driver] wrote {out / 'e2e.json'} and {out / 'e2e.md'} in {budget.elapsed():.0f} s")
    for s in skipped:
        log(f"[driver] skipped: {s}")
    return 0


def save(out: Path, args, results: dict, skipped: list, budget: Budget) -> None:
    summary = {"env": environment(), "args": vars(args), "results": results, "skipped": skipped,
               "comparison": compare(results), "elapsed_s": round(budget.elapsed(), 1)}
    write_json(out / "e2e.json", summary)
    (out / "e2e.md").write_text(markdown(summary))


def compare(results: dict) -> dict:
    """Ratios to HF eager and the largest per-step loss difference from HF's, per sequence."""
    cmp = {}
    train = results.get("train", {})
    base = {r["seq"]: r for r in train.get("hf", {}).get("runs", [])}
    for v, res in train.items():
        for r in res.get("runs", []):
            b = base.get(r["seq"])
            if not b or v == "hf":
                continue
            c = {}
            if r.get("tokens_per_s") and b.get("tokens_per_s"):
                c["tokens_per_s_vs_hf"] = round(r["tokens_per_s"] / b["tokens_per_s"], 3)
            if r.get("peak_bytes") and b.get("peak_bytes"):
                c["peak_vs_hf"] = round(r["peak_bytes"] / b["peak_bytes"], 3)
            if r.get("activation_bytes") and b.get("activation_bytes"):
                c["activation_vs_hf"] = round(r["activation_bytes"] / b["activation_bytes"], 3)
            n = min(len(r["losses"]), len(b["losses"]))
            if n:
                c["max_abs_loss_diff_vs_hf"] = max(abs(r["losses"][i] - b["losses"][i]) for i in range(n))
                c["steps_compared"] = n
            cmp[f"{v}@{r['seq']}"] = c
    ck = results.get("ckpt", {})
    hf_long = ck.get("hf", {}).get("search", {}).get("longest_ok")
    for v, res in ck.items():
        s = res.get("search", {})
        if v != "hf" and hf_long and s.get("longest_ok"):
            cmp[f"{v}@ckpt"] = {"longest_vs_hf": round(s["longest_ok"] / hf_long, 2)}
    return cmp


def markdown(summary: dict) -> str:
    gib = 2**30
    env = summary["env"]
    res = summary["results"]
    cmp = summary["comparison"]
    L = ["# End to end (bench/compare/e2e.py)", "",
         "Environment: " + ", ".join(f"{k} {env.get(k)}" for k in ("gpu", "torch", "cuda", "transformers")), ""]
    a = summary["args"]
    L.append(f"Model: LlamaForCausalLM, {a['layers']} layers, hidden {a['hidden']}, intermediate {a['intermediate']}, "
             f"{a['heads']}/{a['kv_heads']} heads, vocab {a['vocab']}, bf16, batch {a['batch']}, {a['attn']} attention, "
             f"{a['warmup']} warm-up + {a['steps']} timed steps per sequence. Optimizer: "
             + ", ".join(sorted({r.get("optimizer", "") for d in res.values() for r in d.values() if r.get("optimizer")}))
             + ".")
    if "train" in res:
        L += ["", "| seq | variant | tokens/s | × HF | peak GiB | × HF | activation GiB | × HF | max abs loss diff vs HF |",
              "|---|---|---|---|---|---|---|---|---|"]
        seqs = sorted({r["seq"] for v in res["train"].values() for r in v.get("runs", [])})
        for seq in seqs:
            for v in VARIANTS:
                rv = res["train"].get(v)
                if rv is None:
                    continue
                if "unavailable" in rv or "error" in rv:
                    L.append(f"| {seq} | {v} | {rv.get('unavailable') or rv.get('error')} |||||||")
                    continue
                r = next((x for x in rv.get("runs", []) if x["seq"] == seq), None)
                if r is None:
                    continue
                c = cmp.get(f"{v}@{seq}", {})
                if "tokens_per_s" not in r:
                    L.append(f"| {seq} | {v} | {r.get('error') or r.get('skipped') or 'no timed step'} |||||||")
                    continue
                L.append(f"| {seq} | {v} | {r['tokens_per_s']:,.0f} | {c.get('tokens_per_s_vs_hf', '')} | "
                         f"{r.get('peak_bytes', 0) / gib:.1f} | {c.get('peak_vs_hf', '')} | "
                         f"{r.get('activation_bytes', 0) / gib:.1f} | {c.get('activation_vs_hf', '')} | "
                         f"{c.get('max_abs_loss_diff_vs_hf', '') if v != 'hf' else ''} |")
        clocked = [(v, r) for v, rv in res["train"].items() for r in rv.get("runs", []) if r.get("clocks")]
        if clocked:
            L += ["", "During the timed steps (nvidia-smi every 50 ms): SM clock median / lowest, mean board power, "
                  "highest temperature:", ""]
            L += [f"- {v} seq {r['seq']}: {r['clocks']['sm_mhz_median']:.0f} / {r['clocks']['sm_mhz_min']:.0f} MHz, "
                  f"{r['clocks']['power_w_mean']:.0f} W, {r['clocks']['temp_c_max']} C" for v, r in clocked]
        L += ["", "Per-step losses (warm-up steps first):", ""]
        for v, rv in res["train"].items():
            for r in rv.get("runs", []):
                L.append(f"- {v} seq {r['seq']}: " + ", ".join(f"{x:.4f}" for x in r.get("losses", [])))
    if "ckpt" in res:
        L += ["", "Gradient checkpointing, batch 1: the longest sequence one training step runs", "",
              "| variant | longest | first failure | × HF | note |", "|---|---|---|---|---|"]
        for v, rv in res["ckpt"].items():
            s = rv.get("search", {})
            note = rv.get("unavailable") or rv.get("error") or s.get("error") or \
                ("lower bound (time)" if s.get("lower_bound_only") else "") or \
                (f"reached --ckpt-max {s.get('max')}" if s.get("longest_ok") and s.get("longest_ok") == s.get("max") else "")
            L.append(f"| {v} | {s.get('longest_ok', '-')} | {s.get('first_failure') or '-'} | "
                     f"{cmp.get(f'{v}@ckpt', {}).get('longest_vs_hf', '')} | {note} |")
    skipped = summary.get("skipped", []) + [f"{p} {v}: {s}" for p, d in res.items() for v, r in d.items()
                                             for s in r.get("skipped", [])]
    if skipped:
        L += ["", "Skipped:", ""] + [f"- {s}" for s in skipped]
    return "\n".join(L) + "\n"


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", default="bench-compare-out")
    p.add_argument("--phases", default="train,ckpt", help=f"comma list of {PHASES}")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma list of {VARIANTS}")
    p.add_argument("--max-seconds", type=float, default=None, help="whole run (driver) or this worker")
    p.add_argument("--min-job-seconds", type=float, default=60.0, help="a worker starts only with this share")
    p.add_argument("--grace-seconds", type=float, default=20.0, help="kept back from each worker's share")
    p.add_argument("--dry", action="store_true", help="a tiny model on the CPU (" + ", ".join(f"{k} {v}" for k, v in DRY.items()) + ")")
    p.add_argument("--device", default=None, help="cuda (default) or cpu")
    p.add_argument("--layers", type=int, default=None, help=f"default {LLAMA3_8B['layers']}")
    p.add_argument("--hidden", type=int, default=None, help=f"default {LLAMA3_8B['hidden']}")
    p.add_argument("--intermediate", type=int, default=None, help=f"default {LLAMA3_8B['intermediate']}")
    p.add_argument("--heads", type=int, default=None, help=f"default {LLAMA3_8B['heads']}")
    p.add_argument("--kv-heads", type=int, default=None, help=f"default {LLAMA3_8B['kv_heads']}")
    p.add_argument("--vocab", type=int, default=None, help=f"default {LLAMA3_8B['vocab']}")
    p.add_argument("--seqs", default=None, help="train phase sequence lengths, default 4096,8192")
    p.add_argument("--steps", type=int, default=None, help="timed steps per sequence, default 5")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per sequence, default 2")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attn", default="sdpa", help="attn_implementation (sdpa, eager, flash_attention_2)")
    p.add_argument("--ckpt-start", type=int, default=None, help="first length tried, default 16384")
    p.add_argument("--ckpt-max", type=int, default=None, help="default 262144")
    p.add_argument("--ckpt-resolution", type=int, default=None, help="bisection stops at this gap, default 4096")
    p.add_argument("--simulate-oom-above", type=int, default=0,
                   help="smoke tests of the ckpt search: lengths above this fail as an OOM would")
    p.add_argument("--cpu-reference", action="store_true",
                   help="smoke tests on the CPU: tigon through the test suite's reference kernels "
                        "(examples/torch/tests/reference_ops.py) instead of Hugging Face's code")
    p.add_argument("--profile", action="store_true",
                   help="one more step per sequence under torch.profiler: OUTDIR/e2e-profile-<variant>-<seq>.md")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", default=None, help="run one variant in this process (a worker)")
    p.add_argument("--phase", default="train", help="the worker's phase")
    p.add_argument("--result", default=None, help="the worker's JSON result")
    a = p.parse_args(argv)
    defaults = dict(device="cuda", seqs="4096,8192", steps=5, warmup=2, ckpt_start=16384, ckpt_max=262144,
                    ckpt_resolution=4096, **{k: v for k, v in LLAMA3_8B.items() if k not in ("rope_theta", "rms_norm_eps")})
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, DRY[k] if a.dry and k in DRY else v)
    for name, got, allowed in (("phase", a.phases.split(","), PHASES), ("variant", a.variants.split(","), VARIANTS)):
        bad = [x for x in got if x and x not in allowed]
        if bad:
            p.error(f"unknown {name}(s) {bad}; choose from {allowed}")
    return a


def main() -> int:
    args = parse()
    if args.variant is not None and not args.worker:
        args.worker = True
        if args.result is None:
            args.result = str(Path(args.out) / f"e2e-{args.phase}-{args.variant}.json")
    if args.worker:
        if args.variant not in VARIANTS or args.phase not in PHASES:
            log(f"--variant must be one of {VARIANTS}, --phase one of {PHASES}")
            return 2
        res = worker(args)
        write_json(args.result, res)
        log(f"[{args.variant} {args.phase}] wrote {args.result}")
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())

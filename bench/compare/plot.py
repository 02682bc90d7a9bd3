#!/usr/bin/env python3
"""PNG plots of bench/compare's results (matplotlib; without it, says so and exits 0).

    python bench/compare/plot.py OUTDIR [--to DIR]

Reads OUTDIR/ops.json and/or OUTDIR/e2e.json (whichever exist) and writes into DIR (default OUTDIR):
  compare-ops-<op>.png      per op: throughput (GB/s, or TFLOP/s for linear cross-entropy) and peak
                            extra memory per implementation, one group per shape and mode
  compare-e2e-train.png     tokens/s, peak and activation memory per variant and sequence
  compare-e2e-losses.png    per-step losses of each variant, per sequence
  compare-e2e-ckpt.png      the longest sequence trained with gradient checkpointing
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

COLORS = {"eager": "#7f7f7f", "compile": "#1f77b4", "liger": "#ff7f0e", "tigon": "#2ca02c",
          "hf": "#7f7f7f"}


def plot_ops(data: dict, to: Path, plt) -> list[Path]:
    rows = [r for r in data.get("rows", []) if "ms" in r]
    written = []
    for op in dict.fromkeys(r["op"] for r in rows):
        rs = [r for r in rows if r["op"] == op]
        groups = list(dict.fromkeys((r["shape"], r["mode"]) for r in rs))
        impls = [i for i in ("eager", "compile", "liger", "tigon") if any(r["impl"] == i for r in rs)]
        tflops = any("tflops" in r for r in rs)
        fig, axes = plt.subplots(1, 2, figsize=(max(8, 2.2 * len(groups) + 4), 4.2))
        width = 0.8 / max(1, len(impls))
        for ax, key, label in ((axes[0], "tflops" if tflops else "gbps", "TFLOP/s" if tflops else "GB/s (useful bytes)"),
                               (axes[1], "peak_extra_bytes", "peak extra memory (GiB)")):
            for j, impl in enumerate(impls):
                xs, ys = [], []
                for g, (shape, mode) in enumerate(groups):
                    r = next((x for x in rs if (x["shape"], x["mode"]) == (shape, mode) and x["impl"] == impl), None)
                    if r is None or r.get(key) is None:
                        continue
                    xs.append(g + (j - (len(impls) - 1) / 2) * width)
                    ys.append(r[key] / 2**30 if key == "peak_extra_bytes" else r[key])
                ax.bar(xs, ys, width, label=impl, color=COLORS.get(impl))
            ax.set_xticks(range(len(groups)))
            ax.set_xticklabels([f"{s}\n{m}" for s, m in groups], fontsize=7)
            ax.set_ylabel(label)
            ax.grid(axis="y", alpha=0.3)
        axes[0].legend(fontsize=8)
        env = data.get("env", {})
        fig.suptitle(f"{op} (bf16, {env.get('gpu', 'no GPU')}, torch {env.get('torch')})", fontsize=10)
        fig.tight_layout()
        path = to / f"compare-ops-{op}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def plot_e2e(data: dict, to: Path, plt) -> list[Path]:
    written = []
    res = data.get("results", {})
    train = res.get("train", {})
    variants = [v for v in ("hf", "liger", "tigon") if v in train and "runs" in train[v]]
    if variants:
        seqs = sorted({r["seq"] for v in variants for r in train[v]["runs"]})
        fig, axes = plt.subplots(1, 3, figsize=(13, 4))
        width = 0.8 / len(variants)
        for ax, key, label, scale in ((axes[0], "tokens_per_s", "tokens/s", 1),
                                      (axes[1], "peak_bytes", "peak memory (GiB)", 2**30),
                                      (axes[2], "activation_bytes", "activation memory (GiB)", 2**30)):
            for j, v in enumerate(variants):
                xs, ys = [], []
                for g, seq in enumerate(seqs):
                    r = next((x for x in train[v]["runs"] if x["seq"] == seq), None)
                    if r is None or r.get(key) is None:
                        continue
                    xs.append(g + (j - (len(variants) - 1) / 2) * width)
                    ys.append(r[key] / scale)
                ax.bar(xs, ys, width, label=v, color=COLORS.get(v))
            ax.set_xticks(range(len(seqs)))
            ax.set_xticklabels([f"seq {s}" for s in seqs])
            ax.set_ylabel(label)
            ax.grid(axis="y", alpha=0.3)
        axes[0].legend()
        fig.suptitle("End to end, LlamaForCausalLM, batch 1, bf16, AdamW", fontsize=10)
        fig.tight_layout()
        path = to / "compare-e2e-train.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)

        fig, axes = plt.subplots(1, len(seqs), figsize=(5 * len(seqs), 3.8), squeeze=False)
        for ax, seq in zip(axes[0], seqs):
            for v in variants:
                r = next((x for x in train[v]["runs"] if x["seq"] == seq), None)
                if r and r.get("losses"):
                    ax.plot(range(1, len(r["losses"]) + 1), r["losses"], marker="o", label=v, color=COLORS.get(v))
            ax.set_title(f"seq {seq}")
            ax.set_xlabel("step (warm-up first)")
            ax.set_ylabel("loss")
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        path = to / "compare-e2e-losses.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)

    ck = {v: r.get("search", {}) for v, r in res.get("ckpt", {}).items() if r.get("search", {}).get("longest_ok")}
    if ck:
        fig, ax = plt.subplots(figsize=(6, 3.8))
        names = [v for v in ("hf", "liger", "tigon") if v in ck]
        ax.bar(names, [ck[v]["longest_ok"] / 1024 for v in names], color=[COLORS.get(v) for v in names])
        for i, v in enumerate(names):
            ax.text(i, ck[v]["longest_ok"] / 1024, f"{ck[v]['longest_ok'] // 1024}K"
                    + ("+" if ck[v].get("lower_bound_only") or ck[v]["longest_ok"] == ck[v].get("max") else ""),
                    ha="center", va="bottom")
        ax.set_ylabel("longest sequence (K tokens)")
        ax.set_title("Gradient checkpointing, batch 1 (+: a lower bound)", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        path = to / "compare-e2e-ckpt.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("outdir", help="the folder with ops.json and/or e2e.json")
    p.add_argument("--to", default=None, help="where the PNGs go (default OUTDIR)")
    a = p.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"plot.py: matplotlib is not installed ({e}); no plots written "
              "(pip install matplotlib, then run bench/compare/plot.py again on the JSON)", file=sys.stderr)
        return 0
    src = Path(a.outdir)
    to = Path(a.to) if a.to else src
    to.mkdir(parents=True, exist_ok=True)
    written = []
    found = False
    for name, fn in (("ops.json", plot_ops), ("e2e.json", plot_e2e)):
        f = src / name
        if f.exists():
            found = True
            written += fn(json.loads(f.read_text()), to, plt)
    if not found:
        print(f"plot.py: neither ops.json nor e2e.json in {src}", file=sys.stderr)
        return 1
    for w in written:
        print(w)
    return 0


if __name__ == "__main__":
    sys.exit(main())

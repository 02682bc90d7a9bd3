#!/usr/bin/env python3
"""Side-by-side per-op benchmark: PyTorch eager (the Hugging Face code), torch.compile of the same
code, Liger-Kernel (when importable) and tigon through tigon_torch, forward and forward + backward,
bf16, random data, at LLaMA-3-8B shapes and a small sweep.

    python bench/compare/ops.py --out OUTDIR [--ops rms_norm,rope] [--impls eager,compile,liger,tigon]
                                [--modes fwd,fwdbwd] [--sweep] [--max-seconds 400]

Per row: the median time of --reps calls (each timed with CUDA events after an L2 flush), GB/s of
useful bytes (each input read once, each output written once) or TFLOP/s (linear cross-entropy:
2NDV forward, 6NDV forward + backward), peak extra memory (torch.cuda.max_memory_allocated during
one call minus what was allocated before it, outputs and gradients included), the first call's time
for torch.compile, and the largest difference from eager's outputs (and gradients) relative to the
largest eager value. Every implementation gets its own inputs, generated from the same seed
(Liger overwrites some of its inputs).

--host measures the host's cost instead: tiny inputs (16 tokens at LLaMA-3-8B's widths; the linear
cross-entropy with a 4096-word vocabulary), each row the wall time per call of --host-calls calls
issued back to back and ended by one synchronisation (median of 5 such runs), so the host's work
(Python, autograd, dispatch, launches) decides it; the impl `torch` is torch's own native op where
one exists (F.rms_norm).

Writes OUTDIR/ops.json and OUTDIR/ops.md; bench/compare/plot.py draws them. Rows that do not fit in
--max-seconds are listed as skipped. Forward rows run under torch.no_grad() with inputs that do not
require gradients.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

sys.dont_write_bytecode = True
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Budget, environment, log, probe_liger, probe_tigon, write_json  # noqa: E402

OPS = ["rms_norm", "layer_norm", "add_rms_norm", "rope", "swiglu", "geglu", "cross_entropy",
       "linear_cross_entropy", "jsd", "kl_div", "tvd", "fused_linear_jsd", "dpo", "medusa"]
MEDUSA_WEIGHTS = [0.8 ** k for k in range(5)]
IMPLS = ["eager", "torch", "compile", "liger", "tigon"]
TORCH_NATIVE = {"rms_norm"}  # ops with a native torch op of their own (the impl `torch`)
MODES = ["fwd", "fwdbwd"]

# LLaMA-3-8B
HIDDEN, INTER, NQ, NKV, HD, VOCAB, EPS = 4096, 14336, 32, 8, 128, 128256, 1e-5
TOKENS = [8192, 16384]
ROPE_T = 4096


def main_shapes() -> list[tuple[str, dict]]:
    rows = []
    for n in TOKENS:
        for op in ("rms_norm", "layer_norm", "add_rms_norm"):
            rows.append((op, {"N": n, "D": HIDDEN}))
        rows.append(("rope", {"B": n // ROPE_T, "T": ROPE_T, "HQ": NQ, "HK": NKV, "HD": HD}))
        for op in ("swiglu", "geglu"):
            rows.append((op, {"N": n, "I": INTER}))
        rows.append(("cross_entropy", {"N": n, "V": VOCAB}))
        rows.append(("linear_cross_entropy", {"N": n, "D": HIDDEN, "V": VOCAB}))
    # Distillation at the issue's shape: 8192 tokens of LLaMA-3's vocabulary; the fused head with
    # a teacher as wide as the student and one twice as wide.
    for op in ("jsd", "kl_div", "tvd"):
        rows.append((op, {"N": 8192, "V": VOCAB}))
    for dt in (HIDDEN, 2 * HIDDEN):
        rows.append(("fused_linear_jsd", {"N": 8192, "D": HIDDEN, "DT": dt, "V": VOCAB}))
    # DPO on the LM head: 8 pairs of 1024-token sequences, with a reference model.
    rows.append(("dpo", {"B": 8, "T": 1024, "D": HIDDEN, "V": VOCAB}))
    # Medusa: 5 extra heads over the last hidden states of 4096 tokens.
    rows.append(("medusa", {"K": 5, "N": 4096, "D": HIDDEN, "V": VOCAB}))
    return rows


def host_shapes() -> list[tuple[str, dict]]:
    """--host: 16 tokens at LLaMA-3-8B's widths, the GPU's share of each call a few microseconds."""
    n = 16
    rows = [(op, {"N": n, "D": HIDDEN}) for op in ("rms_norm", "layer_norm", "add_rms_norm")]
    rows.append(("rope", {"B": 1, "T": n, "HQ": NQ, "HK": NKV, "HD": HD}))
    rows += [(op, {"N": n, "I": INTER}) for op in ("swiglu", "geglu")]
    rows.append(("cross_entropy", {"N": n, "V": VOCAB}))
    rows.append(("linear_cross_entropy", {"N": n, "D": HIDDEN, "V": 4096}))
    return rows


def sweep_shapes() -> list[tuple[str, dict]]:
    rows = []
    for d in (2048, 8192):
        for op in ("rms_norm", "layer_norm", "add_rms_norm"):
            rows.append((op, {"N": 16384, "D": d}))
    rows.append(("rope", {"B": 1, "T": 8192, "HQ": NQ, "HK": NKV, "HD": HD}))
    rows.append(("rope", {"B": 2, "T": 8192, "HQ": 64, "HK": 8, "HD": HD}))
    for i in (8192, 28672):
        for op in ("swiglu", "geglu"):
            rows.append((op, {"N": 16384, "I": i}))
    for v in (32000, 262144):
        rows.append(("cross_entropy", {"N": 8192, "V": v}))
    rows.append(("linear_cross_entropy", {"N": 4096, "D": HIDDEN, "V": VOCAB}))
    rows.append(("linear_cross_entropy", {"N": 8192, "D": 8192, "V": VOCAB}))
    return rows


def shape_str(op: str, s: dict) -> str:
    if op == "rope":
        return f"B{s['B']} T{s['T']} {s['HQ']}/{s['HK']}x{s['HD']}"
    if op == "linear_cross_entropy":
        return f"N{s['N']} D{s['D']} V{s['V']}"
    if op == "fused_linear_jsd":
        return f"N{s['N']} D{s['D']} teacher D{s['DT']} V{s['V']}"
    if op == "dpo":
        return f"{s['B']} pairs T{s['T']} D{s['D']} V{s['V']}"
    if op == "medusa":
        return f"{s['K']} heads N{s['N']} D{s['D']} V{s['V']}"
    if op in ("cross_entropy", "jsd", "kl_div", "tvd"):
        return f"{s['N']}x{s['V']}"
    return f"{s['N']}x{s.get('D', s.get('I'))}"


# ------------------------------------------------------------------------------------------------
# Cases: inputs, the eager (Hugging Face) code, the peers' calls, useful bytes / FLOPs
# ------------------------------------------------------------------------------------------------


@dataclass
class Case:
    inputs: list            # tensors passed to fn
    grad_inputs: list       # indices of inputs that get gradients in fwdbwd
    n_out: int              # outputs of fn (a tuple when > 1)
    scalar_out: bool        # the single output is a loss (backward from 1)
    bytes_fwd: int = 0
    bytes_fwdbwd: int = 0
    flops_fwd: float = 0.0
    flops_fwdbwd: float = 0.0
    note: str = ""
    leaf_views: dict = field(default_factory=dict)


def hf_pieces():
    """The Hugging Face code the patches replace, from transformers when it is installed, else the
    same lines written here (said in the JSON)."""
    import torch
    import torch.nn.functional as F

    try:
        from transformers.activations import ACT2FN
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

        return {"LlamaRMSNorm": LlamaRMSNorm, "apply_rotary_pos_emb": apply_rotary_pos_emb,
                "silu": ACT2FN["silu"], "gelu_tanh": ACT2FN["gelu_pytorch_tanh"], "source": "transformers"}
    except Exception:  # noqa: BLE001
        pass

    class LlamaRMSNorm(torch.nn.Module):
        def __init__(self, hidden_size, eps=1e-6):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(hidden_size))
            self.variance_epsilon = eps

        def forward(self, hidden_states):
            input_dtype = hidden_states.dtype
            hidden_states = hidden_states.to(torch.float32)
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
            return self.weight * hidden_states.to(input_dtype)

    def rotate_half(x):
        x1 = x[..., : x.shape[-1] // 2]
        x2 = x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), dim=-1)

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        cos = cos.unsqueeze(unsqueeze_dim)
        sin = sin.unsqueeze(unsqueeze_dim)
        return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)

    return {"LlamaRMSNorm": LlamaRMSNorm, "apply_rotary_pos_emb": apply_rotary_pos_emb, "silu": F.silu,
            "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "source": "copied Hugging Face code"}


def make_case(op: str, s: dict, device, dtype, seed: int, with_grad: bool) -> Case:
    import torch

    g = torch.Generator(device=device)
    g.manual_seed(seed)
    e = torch.tensor([], dtype=dtype).element_size()

    def randn(*shape, scale=1.0, dt=dtype):
        t = torch.randn(*shape, generator=g, device=device, dtype=torch.float32)
        if scale != 1.0:
            t.mul_(scale)
        return t.to(dt).requires_grad_(with_grad)

    if op in ("rms_norm", "layer_norm", "add_rms_norm"):
        n, d = s["N"], s["D"]
        x = randn(n, d)
        w = randn(d, scale=0.1)
        with torch.no_grad():
            w += 1
        if op == "rms_norm":
            return Case([x, w], [0, 1], 1, False, bytes_fwd=2 * n * d * e + d * e,
                        bytes_fwdbwd=5 * n * d * e + 3 * d * e)
        if op == "layer_norm":
            b = randn(d, scale=0.1)
            return Case([x, w, b], [0, 1, 2], 1, False, bytes_fwd=2 * n * d * e + 2 * d * e,
                        bytes_fwdbwd=5 * n * d * e + 6 * d * e)
        r = randn(n, d)
        return Case([x, r, w], [0, 1, 2], 2, False, bytes_fwd=4 * n * d * e + d * e,
                    bytes_fwdbwd=8 * n * d * e + 3 * d * e,
                    note="outputs (norm(x + r), x + r)")
    if op == "rope":
        b, t, hq, hk, hd = s["B"], s["T"], s["HQ"], s["HK"], s["HD"]
        # As the projections give them: [B, T, H, D] rows, used as [B, H, T, D] views.
        q = randn(b, t, hq, hd)
        k = randn(b, t, hk, hd)
        inv = 1.0 / (500000.0 ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
        ang = torch.arange(t, device=device, dtype=torch.float32)[:, None] * inv[None, :]
        emb = torch.cat((ang, ang), dim=-1)[None]
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        qk = (hq + hk) * b * t * hd * e
        tab = 2 * t * hd * e
        return Case([q, k, cos, sin], [0, 1], 2, False, bytes_fwd=2 * qk + tab, bytes_fwdbwd=4 * qk + 2 * tab,
                    note="q, k: transposed views [B, H, T, D] of [B, T, H, D]; tables [1, T, D]")
    if op in ("swiglu", "geglu"):
        n, i = s["N"], s["I"]
        a = randn(n, i)
        b = randn(n, i)
        return Case([a, b], [0, 1], 1, False, bytes_fwd=3 * n * i * e, bytes_fwdbwd=8 * n * i * e)
    if op == "cross_entropy":
        n, v = s["N"], s["V"]
        logits = randn(n, v)
        target = torch.randint(0, v, (n,), generator=g, device=device)
        return Case([logits, target], [0], 1, True, bytes_fwd=n * v * e + 8 * n, bytes_fwdbwd=2 * n * v * e + 8 * n,
                    note="bf16 logits; eager upcasts to fp32 as Hugging Face's ForCausalLMLoss does")
    if op == "linear_cross_entropy":
        n, d, v = s["N"], s["D"], s["V"]
        x = randn(n, d)
        w = randn(v, d, scale=d ** -0.5)
        target = torch.randint(0, v, (n,), generator=g, device=device)
        return Case([x, w, target], [0, 1], 1, True, flops_fwd=2.0 * n * d * v, flops_fwdbwd=6.0 * n * d * v,
                    note="eager: logits = x @ W^T, F.cross_entropy(logits.float(), target)")
    if op in ("jsd", "kl_div", "tvd"):
        n, v = s["N"], s["V"]
        # The student's input gets the gradient; the teacher's is data. JSD and KL take
        # log-probabilities (KL's target as probabilities, log_target=False), TVD probabilities.
        with torch.no_grad():
            student = torch.randn(n, v, generator=g, device=device).log_softmax(-1)
            teacher = torch.randn(n, v, generator=g, device=device).log_softmax(-1)
            if op == "kl_div":
                teacher = teacher.exp()
            if op == "tvd":
                student, teacher = student.exp(), teacher.exp()
        student = student.to(dtype).requires_grad_(with_grad)
        teacher = teacher.to(dtype)
        notes = {"jsd": "log-probs; eager: the generalised JSD (beta 0.5) in fp32, mean over rows",
                 "kl_div": "student log-probs, teacher probs; eager: F.kl_div(reduction='batchmean')",
                 "tvd": "probs; eager: 0.5 * |p - q| summed, mean over rows"}
        return Case([student, teacher], [0], 1, True, bytes_fwd=2 * n * v * e, bytes_fwdbwd=3 * n * v * e,
                    note=notes[op])
    if op == "fused_linear_jsd":
        n, d, dt, v = s["N"], s["D"], s["DT"], s["V"]
        x = randn(n, d)
        w = randn(v, d, scale=d ** -0.5)
        with torch.no_grad():
            xt = torch.randn(n, dt, generator=g, device=device).to(dtype)
            wt = (torch.randn(v, dt, generator=g, device=device) * dt ** -0.5).to(dtype)
        return Case([x, w, xt, wt], [0, 1], 1, True, flops_fwd=2.0 * n * v * (d + dt),
                    flops_fwdbwd=2.0 * n * v * (d + dt) + 4.0 * n * v * d,
                    note="eager: both heads' logits in fp32, log_softmax, the generalised JSD (beta 0.5)")
    if op == "dpo":
        b, t, d, v = s["B"], s["T"], s["D"], s["V"]
        x = randn(2 * b, t, d)
        w = randn(v, d, scale=d ** -0.5)
        with torch.no_grad():
            rx = torch.randn(2 * b, t, d, generator=g, device=device).to(dtype)
            rw = (w.detach().float() + 0.01 * torch.randn(v, d, generator=g, device=device) * d ** -0.5).to(dtype)
        target = torch.randint(0, v, (2 * b, t), generator=g, device=device)
        target[:, : t // 4] = -100  # the prompt
        n = 2 * b * t
        return Case([x, w, target, rx, rw], [0, 1], 1, True, flops_fwd=4.0 * n * d * v, flops_fwdbwd=8.0 * n * d * v,
                    note="sigmoid DPO, beta 0.1, reference model; eager: both heads' logits in fp32, log_softmax, "
                         "gather; FLOPs: the policy's forward and backward and the reference's forward")
    if op == "medusa":
        k, n, d, v = s["K"], s["N"], s["D"], s["V"]
        x = randn(n, d)
        ws = [randn(v, d, scale=d ** -0.5) for _ in range(k)]
        labels = torch.randint(0, v, (1, n), generator=g, device=device)
        targets = torch.full((k, n), -100, dtype=torch.long, device=device)
        for i in range(k):
            targets[i, : n - 2 - i] = labels[0, 2 + i:]
        return Case([x, targets, *ws], [0] + list(range(2, 2 + k)), 1, True, flops_fwd=2.0 * k * n * d * v,
                    flops_fwdbwd=6.0 * k * n * d * v,
                    note="head k predicts token t + k + 2, loss weights 0.8^k; eager: each head's logits in fp32, "
                         "F.cross_entropy; Liger: LigerFusedLinearCrossEntropyLoss per head (its Medusa example)")
    raise ValueError(op)


def _eager_medusa(x, targets, *ws):
    import torch.nn.functional as F

    return sum(hw * F.cross_entropy(F.linear(x, w).float(), t) for hw, w, t in zip(MEDUSA_WEIGHTS, ws, targets))


def _eager_dpo(x, w, target, rx, rw, beta=0.1):
    """DPO (sigmoid) as TRL's unfused trainer computes it: the logits materialised in fp32."""
    import torch
    import torch.nn.functional as F

    def seq(h, weight):
        lp = F.log_softmax((h @ weight.t()).float(), dim=-1)
        mask = target != -100
        tok = lp.gather(-1, torch.where(mask, target, 0).unsqueeze(-1)).squeeze(-1)
        return (tok * mask).sum(-1)

    n = target.shape[0] // 2
    pol = seq(x, w)
    with torch.no_grad():
        ref = seq(rx, rw)
    d = beta * ((pol[:n] - ref[:n]) - (pol[n:] - ref[n:]))
    return -F.logsigmoid(d).sum() / n


def _eager_jsd(student_lp, teacher_lp, beta: float = 0.5):
    """Liger's generalised JSD: beta KL(P || M) + (1 - beta) KL(Q || M), M = beta P + (1 - beta) Q,
    P the teacher's and Q the student's distribution, summed over the vocabulary, mean over rows."""
    s, t = student_lp.float(), teacher_lp.float()
    p, q = t.exp(), s.exp()
    log_m = (beta * p + (1 - beta) * q).log()
    return (beta * p * (t - log_m) + (1 - beta) * q * (s - log_m)).sum() / s.shape[0]


def eager_fn(op: str, s: dict, hf, inputs):
    import torch
    import torch.nn.functional as F

    if op == "rms_norm":
        m = _llama_rms_norm(hf, s, inputs[1])
        return lambda x, w: m(x)
    if op == "layer_norm":
        return lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, EPS)
    if op == "add_rms_norm":
        m = _llama_rms_norm(hf, s, inputs[2])

        def fn(x, r, w):
            h = x + r
            return m(h), h

        return fn
    if op == "rope":
        rot = hf["apply_rotary_pos_emb"]
        return lambda q, k, cos, sin: rot(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    if op == "swiglu":
        act = hf["silu"]
        return lambda a, b: act(a) * b
    if op == "geglu":
        act = hf["gelu_tanh"]
        return lambda a, b: act(a) * b
    if op == "cross_entropy":
        return lambda logits, t: F.cross_entropy(logits.float(), t)
    if op == "linear_cross_entropy":
        return lambda x, w, t: F.cross_entropy(F.linear(x, w).float(), t)
    if op == "jsd":
        return lambda s_, t: _eager_jsd(s_, t)
    if op == "kl_div":
        return lambda s_, t: F.kl_div(s_, t, reduction="batchmean")
    if op == "tvd":
        return lambda p, q: 0.5 * (p.float() - q.float()).abs().sum() / p.shape[0]
    if op == "fused_linear_jsd":
        return lambda x, w, xt, wt: _eager_jsd(F.linear(x, w).float().log_softmax(-1),
                                               F.linear(xt, wt).float().log_softmax(-1))
    if op == "dpo":
        return _eager_dpo
    if op == "medusa":
        return _eager_medusa
    raise ValueError(op)


def _llama_rms_norm(hf, s, w):
    """Hugging Face's LlamaRMSNorm module whose weight is the case's input tensor w (so its forward is
    the module's own code and w gets the gradient)."""
    m = hf["LlamaRMSNorm"](s["D"], eps=EPS)
    del m.weight
    m.weight = w
    return m


def torch_fn(op: str):
    """torch's own native op (TORCH_NATIVE)."""
    import torch.nn.functional as F

    if op == "rms_norm":
        return lambda x, w: F.rms_norm(x, (x.shape[-1],), w, EPS)
    raise ValueError(op)


def liger_fn(op: str, fn_cls):
    if op == "rms_norm":
        return lambda x, w: fn_cls.apply(x, w, EPS, 0.0, "llama", True)
    if op == "layer_norm":
        return lambda x, w, b: fn_cls.apply(x, w, b, EPS)
    if op == "add_rms_norm":
        return lambda x, r, w: fn_cls.apply(x, r, w, EPS, 0.0, "llama", False)
    if op == "rope":
        return lambda q, k, cos, sin: fn_cls.apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    if op in ("swiglu", "geglu"):
        return lambda a, b: fn_cls.apply(a, b)
    if op == "cross_entropy":
        return lambda logits, t: _first(fn_cls.apply(logits, t, None))
    if op == "linear_cross_entropy":
        return lambda x, w, t: _first(fn_cls.apply(x, w, t))
    if op == "jsd":
        return lambda s_, t: fn_cls.apply(s_, t)
    if op == "kl_div":
        return lambda s_, t: fn_cls.apply(s_, t, "batchmean")
    if op == "tvd":
        return lambda p, q: fn_cls.apply(p, q)
    if op == "fused_linear_jsd":
        return lambda x, w, xt, wt: fn_cls.apply(x, w, xt, wt)
    if op == "dpo":
        m = fn_cls()  # Liger's defaults: compiled, chunk_size 1
        return lambda x, w, t, rx, rw: m(w, x, t, None, rx, rw, None)[0]
    if op == "medusa":
        m = fn_cls()
        return lambda x, targets, *ws: sum(hw * m(w, x, t) for hw, w, t in zip(MEDUSA_WEIGHTS, ws, targets))
    raise ValueError(op)


def tigon_fn(op: str, tt):
    if op == "rms_norm":
        return lambda x, w: tt.tigon_rms_norm(x, w, EPS, 0.0, "llama", True)
    if op == "layer_norm":
        return lambda x, w, b: tt.tigon_layer_norm(x, w, b, EPS)
    if op == "add_rms_norm":
        return lambda x, r, w: tt.tigon_fused_add_rms_norm(x, r, w, EPS, 0.0, "llama", False)
    if op == "rope":
        return lambda q, k, cos, sin: tt.tigon_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    if op == "swiglu":
        return lambda a, b: tt.tigon_swiglu(a, b)
    if op == "geglu":
        return lambda a, b: tt.tigon_geglu(a, b)
    if op == "cross_entropy":
        # In place, as Liger: the gradient written over the logits in the forward.
        return lambda logits, t: tt.tigon_cross_entropy(logits, t, in_place=True)
    if op == "linear_cross_entropy":
        return lambda x, w, t: tt.tigon_fused_linear_cross_entropy(x, w, t)
    if op == "jsd":
        return lambda s_, t: tt.TigonJSDFunction.apply(s_, t)
    if op == "kl_div":
        return lambda s_, t: tt.TigonKLDivLossFunction.apply(s_, t, "batchmean")
    if op == "tvd":
        return lambda p, q: tt.TigonTVDLossFunction.apply(p, q)
    if op == "fused_linear_jsd":
        return lambda x, w, xt, wt: tt.TigonFusedLinearJSDFunction.apply(x, w, xt, wt)
    if op == "dpo":
        m = tt.TigonFusedLinearDPOLoss()
        return lambda x, w, t, rx, rw: m(w, x, t, None, rx, rw, None)[0]
    if op == "medusa":
        m = tt.TigonFusedLinearMultiHeadCrossEntropyLoss(head_weights=MEDUSA_WEIGHTS)
        return lambda x, targets, *ws: m(list(ws), x, targets)
    raise ValueError(op)


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------


def make_call(fn, case: Case, mode: str, grads_out: list | None):
    """A no-argument callable doing one forward (mode fwd) or one forward + backward (fwdbwd);
    returns the outputs (and gradients)."""
    import torch

    ins = case.inputs
    if mode == "fwd":
        def call():
            with torch.no_grad():
                return fn(*ins)
        return call
    wrt = [ins[i] for i in case.grad_inputs]

    def call():
        out = fn(*ins)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        gs = grads_out if grads_out is not None else [None] * len(outs)
        if case.scalar_out:
            gs = [torch.ones_like(outs[0])]
        dws = torch.autograd.grad(outs, wrt, gs)
        return outs, list(dws)
    return call


def host_time(call, calls: int, device) -> list[float]:
    """--host: microseconds per call of `calls` calls issued back to back and ended by one
    synchronisation, five times."""
    import torch

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(10):
        call()
    sync()
    us = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        sync()
        us.append((time.perf_counter() - t0) / calls * 1e6)
    return us


def time_call(call, reps: int, warmup: int, device, flush_buf, max_seconds: float,
              lead_us: float = 0.0) -> tuple[list[float], int]:
    import torch

    if device.type != "cuda":
        ts = []
        for _ in range(warmup):
            call()
        t_end = time.monotonic() + max_seconds
        for _ in range(reps):
            t0 = time.perf_counter()
            call()
            ts.append((time.perf_counter() - t0) * 1e3)
            if time.monotonic() > t_end:
                break
        return ts, len(ts)
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    # Estimate one call, then choose how many fit in max_seconds.
    t0 = time.perf_counter()
    call()
    torch.cuda.synchronize()
    one = time.perf_counter() - t0
    n = max(3, min(reps, int(max_seconds / max(one, 1e-6))))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    # The GPU spins for about lead_us before each start event (torch.cuda._sleep, ~2 GHz cycles), so the
    # host enqueues the whole call (Python, autograd, dispatch, launches) before the GPU reaches it:
    # the events time the GPU's work, not the host's. lead_us 0: no spin.
    cycles = int(lead_us * 2000)
    for i in range(n):
        if flush_buf is not None:
            flush_buf.zero_()
        if cycles > 0:
            torch.cuda._sleep(cycles)
        starts[i].record()
        call()
        ends[i].record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in zip(starts, ends)], n


def peak_extra(call, device) -> int | None:
    import torch

    if device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return int(peak)


def max_rel_diff(ref, got) -> float | None:
    import torch

    def flat(o):
        if isinstance(o, (tuple, list)):
            r = []
            for x in o:
                r += flat(x)
            return r
        return [o] if torch.is_tensor(o) else []

    a, b = flat(ref), flat(got)
    if len(a) != len(b):
        return None
    worst = 0.0
    for x, y in zip(a, b):
        if x.shape != y.shape:
            return None
        x32, y32 = x.detach().float(), y.detach().float()
        scale = x32.abs().max().item() or 1.0
        worst = max(worst, (x32 - y32).abs().max().item() / scale)
    return worst


# ------------------------------------------------------------------------------------------------


def run(args) -> int:
    import torch

    device = torch.device(args.device)
    dtype = torch.bfloat16
    budget = Budget(args.max_seconds)
    ops = [o for o in args.ops.split(",") if o]
    impls = [i for i in args.impls.split(",") if i]
    modes = [m for m in args.modes.split(",") if m]
    for name, got, allowed in (("op", ops, OPS), ("impl", impls, IMPLS), ("mode", modes, MODES)):
        bad = [x for x in got if x not in allowed]
        if bad:
            log(f"unknown {name}(s) {bad}; choose from {allowed}")
            return 2

    env = environment()
    hf = hf_pieces()
    env["eager_code"] = hf["source"]
    peers = {}
    liger, liger_missing, liger_desc = probe_liger()
    env["liger"] = liger_desc
    env["liger_missing"] = liger_missing
    # The CPU reference mode registers its own operators below, so it loads none here.
    tt, tigon_desc = probe_tigon(need_ops=device.type == "cuda" and not args.cpu_reference and "tigon" in impls)
    if args.cpu_reference and tt is not None:
        # The test suite's reference mode: CPU implementations of tigon's operators written from
        # its documented math. Checks this script's calls into tigon_torch, not tigon's kernels.
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "torch" / "tests"))
        import reference_ops
        from tigon_torch import ops as tt_ops

        reference_ops.install()
        tt_ops.on_device = lambda t: t.device.type in ("cpu", "cuda")
        tigon_desc += " with the CPU reference kernels (--cpu-reference: not tigon's kernels)"
    env["tigon"] = tigon_desc
    env["lead_us"] = args.lead_us if device.type == "cuda" else 0
    peers["liger"] = {op: ("ok" if op in liger else liger_missing.get(op)) for op in OPS}
    peers["tigon"] = tigon_desc
    log(f"eager code: {hf['source']}")
    log(f"liger: {liger_desc}; ops found: {sorted(liger) or 'none'}")
    log(f"tigon: {tigon_desc}")
    if device.type != "cuda":
        log("device is not CUDA: tigon and Liger need CUDA tensors; timings here are not measurements")

    shapes = [] if args.sweep_only else [r for r in (host_shapes() if args.host else main_shapes()) if r[0] in ops]
    if args.tokens:  # the LLaMA-3-8B shapes only; the sweep keeps its own sizes
        want = {int(t) for t in args.tokens.split(",")}
        shapes = [r for r in shapes if r[1].get("N", r[1].get("B", 0) * r[1].get("T", 0)) in want]
    if args.sweep or args.sweep_only:
        shapes += [r for r in sweep_shapes() if r[0] in ops]
    if args.scale != 1.0:  # smoke tests: shrink every dimension but head_dim
        shapes = [(op, {k: (v if k == "HD" else max(1, int(v * args.scale))) for k, v in s.items()})
                  for op, s in shapes]

    flush_buf = torch.empty(256 * 2**20, dtype=torch.int8, device=device) if device.type == "cuda" else None
    rows, skipped = [], []
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    def save():
        write_json(out_dir / "ops.json", {"env": env, "peers": peers, "rows": rows, "skipped": skipped,
                                          "args": vars(args), "elapsed_s": round(budget.elapsed(), 1)})
        (out_dir / "ops.md").write_text(markdown(rows, skipped, env))

    total = len(shapes) * len(modes) * len(impls)
    k = 0
    for op, s in shapes:
        for mode in modes:
            ref = None
            for impl in impls:
                k += 1
                if impl == "torch" and op not in TORCH_NATIVE:  # eager is torch's own ops there
                    continue
                tag = f"[{k}/{total} {budget.elapsed():6.0f}s] {op} {shape_str(op, s)} {mode} {impl}"
                if budget.left() < args.min_row_seconds:
                    skipped.append({"op": op, "shape": shape_str(op, s), "mode": mode, "impl": impl,
                                    "why": f"--max-seconds {args.max_seconds} reached"})
                    continue
                row = {"op": op, "shape": shape_str(op, s), "dims": s, "mode": mode, "impl": impl}
                try:
                    if impl == "liger" and op not in liger:
                        raise LookupError(liger_missing.get(op, "Liger-Kernel not importable"))
                    if impl == "tigon" and tt is None:
                        raise LookupError(tigon_desc)
                    if (impl == "liger" or (impl == "tigon" and not args.cpu_reference)) and device.type != "cuda":
                        raise LookupError(f"{impl} needs a CUDA device")
                    case = make_case(op, s, device, dtype, args.seed, mode == "fwdbwd")
                    row["note"] = case.note
                    if impl == "eager":
                        fn = eager_fn(op, s, hf, case.inputs)
                    elif impl == "torch":
                        fn = torch_fn(op)
                    elif impl == "compile":
                        torch._dynamo.reset()
                        fn = torch.compile(eager_fn(op, s, hf, case.inputs), dynamic=False)
                    elif impl == "liger":
                        fn = liger_fn(op, liger[op])
                    else:
                        fn = tigon_fn(op, tt)
                    grads_out = None
                    if mode == "fwdbwd" and not case.scalar_out:
                        with torch.no_grad():  # the output shapes, from eager (no compilation, no in-place peer)
                            probe = eager_fn(op, s, hf, case.inputs)(*[x.detach() for x in case.inputs])
                        probe = list(probe) if isinstance(probe, (tuple, list)) else [probe]
                        gg = torch.Generator(device=device)
                        gg.manual_seed(args.seed + 1)
                        grads_out = [torch.randn(p.shape, generator=gg, device=device, dtype=torch.float32)
                                     .to(p.dtype) for p in probe]
                        del probe
                    call = make_call(fn, case, mode, grads_out)
                    t0 = time.perf_counter()
                    first = call()
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    row["first_call_s"] = round(time.perf_counter() - t0, 3)
                    # Correctness against eager, on the first call's outputs (in-place peers change
                    # their inputs after it, not before).
                    if impl == "eager":
                        ref = first
                    elif ref is not None:
                        row["max_rel_diff_vs_eager"] = max_rel_diff(ref, first)
                    del first
                    if args.host:
                        us = host_time(call, args.host_calls, device)
                        row.update(host_us=round(statistics.median(us), 2), host_us_min=round(min(us), 2),
                                   calls=args.host_calls)
                        log(f"{tag}: {row['host_us']:.1f} us a call")
                        del call, fn, case, grads_out
                        rows.append(row)
                        save()
                        continue
                    row["peak_extra_bytes"] = peak_extra(call, device)
                    per_row = min(args.row_seconds, max(0.5, budget.left() - args.min_row_seconds))
                    ts, n = time_call(call, args.reps, args.warmup, device, flush_buf, per_row, args.lead_us)
                    ms = statistics.median(ts)
                    row.update(ms=round(ms, 4), ms_min=round(min(ts), 4), reps=n)
                    nbytes = case.bytes_fwd if mode == "fwd" else case.bytes_fwdbwd
                    flops = case.flops_fwd if mode == "fwd" else case.flops_fwdbwd
                    if nbytes:
                        row["useful_bytes"] = nbytes
                        row["gbps"] = round(nbytes / (ms * 1e-3) / 1e9, 1)
                    if flops:
                        row["flops"] = flops
                        row["tflops"] = round(flops / (ms * 1e-3) / 1e12, 1)
                    del call, fn, case, grads_out
                    log(f"{tag}: {ms:.4f} ms" + (f", {row['gbps']} GB/s" if "gbps" in row else "")
                        + (f", {row['tflops']} TFLOP/s" if "tflops" in row else "")
                        + (f", peak +{row['peak_extra_bytes'] / 2**30:.2f} GiB" if row.get("peak_extra_bytes") else ""))
                except LookupError as e:
                    row["unavailable"] = str(e)
                    log(f"{tag}: unavailable ({e})")
                except Exception as e:  # noqa: BLE001  (OOM, a peer's error: recorded, the run goes on)
                    row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                    log(f"{tag}: ERROR {row['error']}")
                    if args.verbose:
                        traceback.print_exc()
                rows.append(row)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                save()
            ref = None
    save()
    if skipped:
        log(f"skipped {len(skipped)} rows (time budget): see ops.json 'skipped'")
    log(f"wrote {out_dir / 'ops.json'} and {out_dir / 'ops.md'} in {budget.elapsed():.0f} s")
    return 0


def _fmt_bytes(b) -> str:
    if b is None:
        return "-"
    return f"{b / 2**30:.2f}"


def markdown(rows: list[dict], skipped: list[dict], env: dict) -> str:
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    lines = [
        "# Side-by-side, per op (bench/compare/ops.py)",
        "",
        "Environment: " + ", ".join(f"{k} {env.get(k)}" for k in ("gpu", "torch", "cuda", "triton", "transformers")),
        f"Liger: {env.get('liger')}; tigon: {env.get('tigon')}",
        "",
    ]
    if any("host_us" in r for r in rows):
        lines += ["Host cost (--host): each cell the wall time per call of calls issued back to back on tiny "
                  "inputs (median of 5 runs). 'vs best peer': the best peer's time / tigon's time (> 1: tigon "
                  "faster)."]
    else:
        lines += [
            "Each cell: median ms, then GB/s of useful bytes (or TFLOP/s for linear cross-entropy), then "
            "peak extra memory in GiB. 'vs best peer': the best peer's time / tigon's time (> 1: tigon faster).",
            (f"GPU time: the GPU spins about {env.get('lead_us', 0):g} us before each timed call, so the host's "
             "enqueueing of the call (Python, autograd, launches) is not timed."
             if env.get("lead_us") else "The host's enqueueing of each call is timed with it (no lead spin)."),
        ]
    lines += [
        "",
        "| op | shape | mode | " + " | ".join(impls) + " | vs best peer |",
        "|---|---|---|" + "---|" * len(impls) + "---|",
    ]
    keys = []
    for r in rows:
        key = (r["op"], r["shape"], r["mode"])
        if key not in keys:
            keys.append(key)
    for key in keys:
        cells, times = [], {}
        for impl in impls:
            r = next((x for x in rows if (x["op"], x["shape"], x["mode"]) == key and x["impl"] == impl), None)
            if r is None:
                cells.append("-")
            elif "host_us" in r:
                cells.append(f"{r['host_us']:.1f} us")
                times[impl] = r["host_us"]
            elif "ms" in r:
                rate = f"{r['tflops']} TF/s" if "tflops" in r else f"{r.get('gbps', '-')} GB/s"
                cells.append(f"{r['ms']:.3f} ms, {rate}, {_fmt_bytes(r.get('peak_extra_bytes'))} GiB")
                times[impl] = r["ms"]
            elif "unavailable" in r:
                cells.append("n/a")
            else:
                cells.append("error")
        peers = [t for i, t in times.items() if i != "tigon"]
        vs = f"{min(peers) / times['tigon']:.2f}x" if peers and "tigon" in times else "-"
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + f" | {vs} |")
    errs = [r for r in rows if "error" in r or "unavailable" in r]
    if errs:
        lines += ["", "Not measured:", ""]
        lines += [f"- {r['op']} {r['shape']} {r['mode']} {r['impl']}: {r.get('error') or r.get('unavailable')}"
                  for r in errs]
    diffs = [r for r in rows if r.get("max_rel_diff_vs_eager") is not None]
    if diffs:
        worst = max(diffs, key=lambda r: r["max_rel_diff_vs_eager"])
        lines += ["", f"Largest difference from eager (outputs and gradients, relative to the largest eager "
                      f"value): {worst['max_rel_diff_vs_eager']:.3g} ({worst['op']} {worst['shape']} "
                      f"{worst['mode']} {worst['impl']})."]
    if skipped:
        lines += ["", f"Skipped for time: {len(skipped)} rows."]
    return "\n".join(lines) + "\n"


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", default="bench-compare-out", help="output folder (ops.json, ops.md)")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma list of {OPS}")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma list of {IMPLS}")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {MODES}")
    p.add_argument("--tokens", default="", help="keep only LLaMA-3-8B shapes with these token counts (e.g. 16384); the sweep is kept whole")
    p.add_argument("--sweep", action="store_true", help="add the sweep of sizes after the LLaMA-3-8B shapes")
    p.add_argument("--sweep-only", action="store_true", help="the sweep of sizes without the LLaMA-3-8B shapes")
    p.add_argument("--reps", type=int, default=50, help="timed calls per row at most")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--row-seconds", type=float, default=1.5, help="time spent timing one row at most")
    p.add_argument("--lead-us", type=float, default=1000.0,
                   help="GPU spin (about, in microseconds) before each timed call, so that the host's "
                        "enqueueing of the call is not timed; 0 times it too")
    p.add_argument("--max-seconds", type=float, default=None, help="stop starting rows after this many seconds")
    p.add_argument("--min-row-seconds", type=float, default=5.0,
                   help="a row starts only with this much of --max-seconds left")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", help="cuda; cpu only for a smoke test (with --scale)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every dimension (smoke tests)")
    p.add_argument("--cpu-reference", action="store_true",
                   help="smoke test on the CPU: tigon rows through the test suite's reference kernels "
                        "(examples/torch/tests/reference_ops.py), so the calls are checked, not the kernels")
    p.add_argument("--host", action="store_true",
                   help="the host's cost per call on tiny inputs (host_shapes), calls back to back")
    p.add_argument("--host-calls", type=int, default=200, help="--host: calls per timed run")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of errors")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(run(parse()))

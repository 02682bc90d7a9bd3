"""Convergence: for each family, a mini model (2 layers, hidden 1024 — a compiled size of tigon's norm
kernels — and the family's real vocabulary size) trained 50 AdamW steps on a fixed synthetic corpus,
with and without apply_tigon_to_<family>, in fp32 and bf16: the loss curves, the final logits and the
final weights must agree within tolerance. The deviations are printed (pytest -s) so a failure shows
by how much."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import DEVICE
from models import FAMILIES, build_model

import tigon_torch as tt

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

STEPS = int(os.environ.get("TIGON_CONVERGENCE_STEPS", "50"))
BATCH, SEQ = 4, 128
LR = 1e-4

# (loss atol, loss rtol), (logits atol, logits rtol), (param atol, param rtol)
TOLERANCES = {
    torch.float32: ((1e-3, 1e-3), (5e-2, 1e-2), (5e-3, 1e-3)),
    torch.bfloat16: ((5e-2, 2e-2), (5e-1, 1e-1), (2e-2, 2e-2)),
}


def _corpus(vocab: int, steps: int, seed: int = 42):
    """A fixed synthetic corpus a mini model learns from in a few steps: tokens from a fixed set of
    1024 ids of the vocabulary with Zipf-like frequencies, each row repeating a short pattern (so both
    the unigram statistics and copying lower the loss), with 10% noise."""
    g = torch.Generator().manual_seed(seed)
    words = torch.randperm(vocab - 3, generator=g)[:1024] + 3
    freq = 1.0 / torch.arange(1, 1025, dtype=torch.float64)
    batches = []
    for _ in range(steps):
        pattern = words[torch.multinomial(freq, BATCH * 8, replacement=True, generator=g)].view(BATCH, 8)
        ids = pattern.repeat(1, SEQ // 8)
        noise = words[torch.multinomial(freq, ids.numel(), replacement=True, generator=g)].view(ids.shape)
        ids = torch.where(torch.rand(ids.shape, generator=g) < 0.1, noise, ids)
        labels = ids.clone()
        labels[:, :4] = -100
        batches.append((ids, labels))
    return batches


def _train(model, batches):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    losses = []
    model.train()
    for ids, labels in batches:
        out = model(input_ids=ids.to(DEVICE), labels=labels.to(DEVICE))
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.detach().float())
    return torch.stack(losses)


def _eval_logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids.to(DEVICE)).logits.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_mini_model_convergence(ext, family, dtype):
    vocab = FAMILIES[family][2]
    kw = dict(hidden=1024, layers=2, heads=8, kv_heads=4, intermediate=2048, dtype=dtype, device=DEVICE)
    batches = _corpus(vocab, STEPS)
    eval_ids = batches[-1][0]

    ref = build_model(family, seed=0, **kw)
    ref_losses = _train(ref, batches)
    ref_logits = _eval_logits(ref, eval_ids)
    ref_params = {n: p.detach().float().cpu() for n, p in ref.named_parameters()}
    del ref
    if DEVICE == "cuda":
        torch.cuda.empty_cache()

    model = build_model(family, seed=0, **kw)
    getattr(tt, f"apply_tigon_to_{family}")(model=model)
    losses = _train(model, batches)
    logits = _eval_logits(model, eval_ids)

    (la, lr), (ga, gr), (pa, pr) = TOLERANCES[dtype]
    print(f"\n{family} {dtype}: loss {ref_losses[0]:.4f} -> {ref_losses[-1]:.4f} (HF), "
          f"{losses[0]:.4f} -> {losses[-1]:.4f} (tigon); max |dloss| {(losses - ref_losses).abs().max():.3e}, "
          f"max |dlogits| {(logits - ref_logits).abs().max():.3e}")
    assert torch.isfinite(losses).all()
    assert losses[-1] < losses[0], "the patched model did not learn"
    torch.testing.assert_close(losses, ref_losses, atol=la, rtol=lr, msg=lambda m: f"loss curve: {m}")
    torch.testing.assert_close(logits, ref_logits, atol=ga, rtol=gr, msg=lambda m: f"final logits: {m}")
    worst = 0.0
    for n, p in model.named_parameters():
        q = ref_params[n]
        p = p.detach().float().cpu()
        worst = max(worst, float((p - q).abs().max()))
        torch.testing.assert_close(p, q, atol=pa, rtol=pr, msg=lambda m, n=n: f"parameter {n}: {m}")
    print(f"{family} {dtype}: max |dparam| {worst:.3e}")

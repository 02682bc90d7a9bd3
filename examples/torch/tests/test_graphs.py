"""A patched model's training step in a CUDA graph: captured whole with torch.cuda.graph (the
recipe of PyTorch's CUDA-graph notes: warm-up on a side stream, capture forward and backward with the
gradients unallocated, replay over new batches copied into the static inputs), and under
torch.compile(mode="reduce-overhead") (CUDA-graph trees). Every replayed step's loss and gradients
are compared with Hugging Face's unpatched model run eagerly on the same batch."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_rel
from models import build_model

import tigon_torch as tt

pytest.importorskip("transformers")

VOCAB = 4096


def _pair(dtype):
    # SDPA attention: HF's eager attention builds its mask from a host scalar copied to the device on
    # every forward, which a CUDA-graph capture rejects (transformers' masking_utils, eager_mask).
    kw = dict(dtype=dtype, device="cuda", vocab=VOCAB, hidden=256, heads=4, kv_heads=2, attn_implementation="sdpa")
    ref = build_model("llama", **kw)
    model = build_model("llama", **kw)
    model.load_state_dict(ref.state_dict())
    return ref, model


def _batch(seed, batch=2, seq=32):
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, seq), generator=g)
    labels = ids.clone()
    labels[:, : 3 + seed % 4] = -100
    return ids.cuda(), labels.cuda()


def _eager(ref, ids, labels):
    ref.zero_grad(set_to_none=True)
    out = ref(input_ids=ids, labels=labels, use_cache=False)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}


def _compare(loss, grads, want_loss, want_grads, dtype, what):
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(loss.float(), want_loss.float(), atol=tol, rtol=tol)
    assert grads.keys() == want_grads.keys(), what
    for n, g in grads.items():
        assert_rel(g, want_grads[n], dtype, factor=10.0, what=f"{what} grad {n}")


@pytest.mark.cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_training_step_in_a_cuda_graph(ext, dtype):
    ref, model = _pair(dtype)
    tt.apply_tigon_to_llama(model=model)
    model.train(), ref.train()
    ids, labels = _batch(0)
    static_ids, static_labels = ids.clone(), labels.clone()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: algorithm selection, workspaces
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            model(input_ids=static_ids, labels=static_labels, use_cache=False).loss.backward()
    torch.cuda.current_stream().wait_stream(side)

    model.zero_grad(set_to_none=True)  # the captured backward allocates and writes the gradients
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = model(input_ids=static_ids, labels=static_labels, use_cache=False).loss
        static_loss.backward()

    for seed in range(1, 4):
        ids, labels = _batch(seed)
        static_ids.copy_(ids)
        static_labels.copy_(labels)
        graph.replay()
        torch.cuda.synchronize()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        _compare(static_loss, grads, *_eager(ref, ids, labels), dtype, f"replay {seed}")


@pytest.mark.cuda_only
def test_training_steps_under_reduce_overhead(ext):
    """torch.compile(mode="reduce-overhead"): tigon's operators inside CUDA-graph trees, forward and
    backward, over batches of one shape."""
    ref, model = _pair(torch.float32)
    tt.apply_tigon_to_llama(model=model)
    model.train(), ref.train()
    compiled = torch.compile(model, mode="reduce-overhead")
    for seed in range(4):
        ids, labels = _batch(seed)
        model.zero_grad(set_to_none=True)
        out = compiled(input_ids=ids, labels=labels, use_cache=False)
        out.loss.backward()
        loss = out.loss.detach().clone()  # the graph's output buffer is reused by the next replay
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        _compare(loss, grads, *_eager(ref, ids, labels), torch.float32, f"step {seed}")

"""DDP and FSDP2 (fully_shard) around a patched model, one process (world size 1): the ops are per
rank, and the causal-LM loss reads the LM head's weight inside the model's forward, where FSDP has
gathered it. Loss and gradients must equal the unwrapped patched model's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from conftest import DEVICE, assert_rel
from models import build_model

import tigon_torch as tt

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    if dist.is_initialized():
        yield
        return
    backend = "nccl" if DEVICE == "cuda" else "gloo"
    store = tmp_path_factory.mktemp("dist") / "store"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _models(family):
    ref = build_model(family, vocab=4096, hidden=256, device=DEVICE)
    model = build_model(family, vocab=4096, hidden=256, device=DEVICE)
    model.load_state_dict(ref.state_dict())
    tt.apply_tigon_to_model(ref)
    tt.apply_tigon_to_model(model)
    ref.train(), model.train()
    return ref, model


def _step(model, ids):
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach()


def _grad(p):
    g = p.grad
    return g.full_tensor() if hasattr(g, "full_tensor") else g


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_ddp(ext, process_group, family):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ref, model = _models(family)
    ids = torch.randint(3, 4096, (2, 24), device=DEVICE)
    want = _step(ref, ids)
    got = _step(DDP(model), ids)
    torch.testing.assert_close(got, want)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_rel(_grad(p), q.grad, torch.float32, factor=5.0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fsdp2(ext, process_group, family):
    from torch.distributed.fsdp import fully_shard

    ref, model = _models(family)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    ids = torch.randint(3, 4096, (2, 24), device=DEVICE)
    want = _step(ref, ids)
    got = _step(model, ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_rel(_grad(p), q.grad, torch.float32, factor=5.0)

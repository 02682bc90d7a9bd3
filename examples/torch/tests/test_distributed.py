"""DDP and FSDP2 (fully_shard) around a patched model. One process (world size 1): the ops are per
rank, and the causal-LM loss reads the LM head's weight inside the model's forward, where FSDP has
gathered it; loss and gradients must equal the unwrapped patched model's. Two processes (world size 2;
two GPUs over NCCL, or the CPU reference kernels over gloo): each rank's loss equals the unwrapped
model's on that rank's batch, and the gathered gradients their mean over the ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import os

from conftest import DEVICE, assert_rel, load_ops
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


def _rank_ids(rank, device):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(3, 4096, (2, 24), generator=g).to(device)


def _check_ranks(out_dir, family, world):
    """Each rank's saved loss against the unwrapped patched model's on that rank's batch, and its
    gathered gradients against that model's averaged over the ranks (as the data-parallel wrappers
    average them), in one process."""
    ref = build_model(family, vocab=4096, hidden=256, device=DEVICE)
    tt.apply_tigon_to_model(ref)
    ref.train()
    losses = []
    for rank in range(world):
        out = ref(input_ids=_rank_ids(rank, DEVICE), labels=_rank_ids(rank, DEVICE))
        (out.loss / world).backward()
        losses.append(out.loss.detach().cpu())
    for rank in range(world):
        got = torch.load(out_dir / f"rank{rank}.pt")
        torch.testing.assert_close(got["loss"], losses[rank], atol=1e-5, rtol=1e-5)
        for n, q in ref.named_parameters():
            assert_rel(got["grads"][n].to(q.grad.device), q.grad, torch.float32, factor=5.0)


def _fsdp2_rank(rank, world, store, family, out_dir):
    """One rank of the two-process run (a spawned process): the patched model sharded with fully_shard,
    one step on this rank's batch; its loss and every gathered gradient saved for the parent."""
    load_ops()
    if DEVICE == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world)
    from torch.distributed.fsdp import fully_shard

    model = build_model(family, vocab=4096, hidden=256, device=device)  # the same seed: the same weights
    tt.apply_tigon_to_model(model)
    model.train()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    loss = _step(model, _rank_ids(rank, device))
    grads = {n: _grad(p).detach().float().cpu() for n, p in model.named_parameters()}
    torch.save({"loss": loss.cpu(), "grads": grads}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fsdp2_two_ranks(ext, tmp_path, family):
    if DEVICE == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("two GPUs needed")
    import torch.multiprocessing as mp

    mp.spawn(_fsdp2_rank, args=(2, str(tmp_path / "store"), family, str(tmp_path)), nprocs=2)
    _check_ranks(tmp_path, family, 2)


def _zero3_rank(rank, world, store, family, out_dir):
    """One rank of the two-process DeepSpeed ZeRO-3 run (a spawned process): the patched model under
    deepspeed.initialize (stage 3: every parameter partitioned and released after each use), two steps
    on this rank's batch; the second's loss and every full gradient (deepspeed.utils.safe_get_full_grad)
    saved for the parent."""
    load_ops()
    if DEVICE == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        device = torch.device("cpu")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world)
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    model = build_model(family, vocab=4096, hidden=256, device=device)
    tt.apply_tigon_to_model(model)
    model.train()
    cfg = {"train_micro_batch_size_per_gpu": 2,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0,
                                 "stage3_max_live_parameters": 0},  # partitioned, released after each use
           "optimizer": {"type": "SGD", "params": {"lr": 0.0}}, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                      dist_init_required=False)
    ids = _rank_ids(rank, device)
    # A first step (lr 0: the weights stay) so that the measured one runs on DeepSpeed's recorded trace.
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    grads = {n: safe_get_full_grad(p).detach().float().cpu() for n, p in engine.module.named_parameters()}
    torch.save({"loss": loss.detach().cpu(), "grads": grads}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_deepspeed_zero3_two_ranks(ext, tmp_path, family):
    """ZeRO-3 partitions the LM head's weight and gathers it around the head's forward. The patched
    forward still calls the head (which hands back its input instead of logits), so DeepSpeed gathers the
    weight before the fused loss reads it: each rank's loss and the full gradients as the unwrapped
    model's (the gradients averaged over the ranks)."""
    pytest.importorskip("deepspeed")
    if DEVICE == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("two GPUs needed")
    import torch.multiprocessing as mp

    mp.spawn(_zero3_rank, args=(2, str(tmp_path / "store"), family, str(tmp_path)), nprocs=2)
    _check_ranks(tmp_path, family, 2)

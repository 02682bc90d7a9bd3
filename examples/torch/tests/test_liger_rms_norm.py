"""Port of Liger-Kernel 0.8.2's test/transformers/test_rms_norm.py onto tigon_torch.

Same shapes, dtypes, option combinations and (atol, rtol) per case as Liger's; the reference is the
Hugging Face RMSNorm formula of each casting mode (Llama's, Gemma's, and the no-upcast one) written
here. Liger's functional test compares liger_rms_norm with LigerRMSNormFunction; here both tigon entry
points are compared with the reference. The DTensor cases need 4 or 8 GPUs and are skipped with fewer.
"""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE, REFERENCE
from liger_helpers import assert_close

import tigon_torch as tt

pytestmark = pytest.mark.gpu

EPS = 1e-6


def rms_llama(x, w, eps=EPS):
    """LlamaRMSNorm: statistics in fp32, the normalised x rounded to x's dtype, then times the weight."""
    dtype = x.dtype
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * y.to(dtype) if w is not None else y.to(dtype)


def rms_gemma(x, w, eps=EPS):
    """GemmaRMSNorm: everything in fp32 with the scale (1 + w), one rounding at the end."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if w is not None:
        y = y * (1.0 + w.float())
    return y.type_as(x)


def rms_none(x, w, eps=EPS):
    """No upcast: the arithmetic in x's dtype."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return w * y if w is not None else y


REFERENCES = [
    pytest.param(rms_llama, 0.0, "llama", id="llama"),
    pytest.param(rms_gemma, 1.0, "gemma", id="gemma"),
    pytest.param(rms_none, 0.0, "none", id="none"),
]


@pytest.mark.parametrize("bs, sl, hd", [(2, 128, 512), (5, 123, 123)])
@pytest.mark.parametrize("dtype, atol, rtol", [(torch.float32, 1e-4, 1e-6), (torch.bfloat16, 2e-1, 2e-2)])
@pytest.mark.parametrize("reference, offset, casting_mode", REFERENCES)
@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("elementwise_affine", [True, False])
def test_correctness(ext, seed, bs, sl, hd, dtype, atol, rtol, reference, offset, casting_mode, in_place,
                     elementwise_affine):
    x = torch.randn(bs, sl, hd, device=DEVICE, dtype=dtype)
    h1 = x.clone().requires_grad_(True)
    h2 = x.clone().requires_grad_(True)
    do = torch.randn(bs, sl, hd, device=DEVICE, dtype=dtype)

    w_ref = torch.ones(hd, device=DEVICE, dtype=dtype, requires_grad=True) if elementwise_affine else None
    ref_o = reference(h1, w_ref)
    ref_o.backward(do)

    norm = tt.TigonRMSNorm(hidden_size=hd, offset=offset, casting_mode=casting_mode, in_place=in_place,
                           elementwise_affine=elementwise_affine).to(DEVICE).to(dtype)
    out = norm(h2)
    out.backward(do.clone())  # in_place=True may write dX over the upstream gradient

    assert_close(out, ref_o, atol, rtol, "y")
    if elementwise_affine:
        assert_close(norm.weight.grad, w_ref.grad, atol, rtol, "dW")
    else:
        assert norm.weight is None
    assert_close(h2.grad, h1.grad, atol, rtol, "dX")


@pytest.mark.parametrize("bs, sl, hd", [(2, 2, 8), (9, 7, 41)])
@pytest.mark.parametrize("dtype, atol, rtol", [(torch.float32, 1e-4, 1e-6), (torch.bfloat16, 2e-1, 2e-2)])
@pytest.mark.parametrize("reference, offset, casting_mode", REFERENCES[:2])
@pytest.mark.parametrize("elementwise_affine", [True, False])
def test_correctness_functional(ext, seed, bs, sl, hd, dtype, atol, rtol, reference, offset, casting_mode,
                                elementwise_affine):
    x = torch.randn(bs, sl, hd, device=DEVICE, dtype=dtype)
    h0 = x.clone().requires_grad_(True)
    h1 = x.clone().requires_grad_(True)
    h2 = x.clone().requires_grad_(True)
    w = torch.randn(hd, device=DEVICE, dtype=dtype) if elementwise_affine else None

    y0 = reference(h0, w)
    y1 = tt.tigon_rms_norm(X=h1, W=w, eps=EPS, offset=offset, casting_mode=casting_mode)  # Liger's keywords
    y2 = tt.TigonRMSNormFunction.apply(h2, w, EPS, offset, casting_mode)
    assert_close(y1, y0, atol, rtol, "functional y")
    assert_close(y2, y0, atol, rtol, "Function y")

    grad = torch.randn_like(y0)
    y0.backward(grad.clone())
    y1.backward(grad.clone())  # in place by default: the upstream gradient's buffer is overwritten
    y2.backward(grad.clone())
    assert_close(h1.grad, h0.grad, atol, rtol, "functional dX")
    assert_close(h2.grad, h0.grad, atol, rtol, "Function dX")


# ------------------------------------------------------------------------------------------------
# DTensor input (tensor parallel): X sharded along the hidden dimension.
# ------------------------------------------------------------------------------------------------


def _dtensor_worker(rank, world_size, bs, sl, hd, dtype, atol, rtol, offset, casting_mode, file_name):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    import tigon_torch as tt

    dist.init_process_group("nccl", init_method=f"file://{file_name}", rank=rank, world_size=world_size)
    try:
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
        mesh = torch.distributed.device_mesh.init_device_mesh("cuda", (world_size,), mesh_dim_names=("tp",))
        torch.manual_seed(0)  # every rank draws the same tensors
        t = torch.randn(bs, sl, hd, device=device, dtype=dtype, requires_grad=True)
        dt = distribute_tensor(t, device_mesh=mesh, placements=[Shard(2)])
        w = torch.randn(hd, device=device, dtype=dtype)
        w1 = w.clone().requires_grad_(True)
        w2 = w.clone().requires_grad_(True)
        reference = rms_gemma if casting_mode == "gemma" else rms_llama

        y1 = tt.tigon_rms_norm(X=dt, W=w1, eps=EPS, offset=offset, casting_mode=casting_mode)
        t2 = t.detach().clone().requires_grad_(True)
        y2 = reference(t2, w2)
        y1_full = y1.full_tensor() if hasattr(y1, "full_tensor") else y1
        assert_close(y1_full, y2, atol, rtol, "y")

        grad = torch.randn_like(y2)
        dgrad = distribute_tensor(grad, device_mesh=mesh, placements=[Shard(2)])
        y1.backward(dgrad)
        y2.backward(grad)
        assert_close(w1.grad, w2.grad, atol, rtol, "dW")
        dx = dt.grad.full_tensor() if hasattr(dt.grad, "full_tensor") else dt.grad
        assert_close(dx, t2.grad, atol, rtol, "dX")
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda_only
@pytest.mark.parametrize("world_size, bs, sl, hd", [(4, 2, 2, 8), (8, 9, 7, 64)])
@pytest.mark.parametrize("dtype, atol, rtol", [(torch.float32, 1e-4, 1e-6), (torch.bfloat16, 2e-1, 2e-2)])
@pytest.mark.parametrize("offset, casting_mode", [(0.0, "llama"), (1.0, "gemma")])
def test_dtensor_rms_norm(ext, tmp_path, world_size, bs, sl, hd, dtype, atol, rtol, offset, casting_mode):
    if REFERENCE or torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs")
    import torch.multiprocessing as mp

    mp.spawn(_dtensor_worker, args=(world_size, bs, sl, hd, dtype, atol, rtol, offset, casting_mode,
                                    str(tmp_path / "store")), nprocs=world_size, join=True)

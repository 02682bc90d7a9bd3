"""Port of Liger-Kernel 0.8.2's test/transformers/test_layer_norm.py onto tigon_torch.

Same shapes, dtypes and (atol, rtol) as Liger's. test_liger_layer_norm compares TigonLayerNorm (Liger's
module: eps=1e-6, a bias parameter) with torch.nn.LayerNorm; Liger's functional test compares
liger_layer_norm with LigerLayerNormFunction, here both tigon entry points are compared with
torch.nn.functional.layer_norm. The references run in fp32 (fp64 in the CPU reference mode) on the
inputs' values and are rounded once to the inputs' dtype, as PyTorch's CUDA kernel does for bf16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE
from liger_helpers import REF_FLOAT, assert_close

import tigon_torch as tt

pytestmark = pytest.mark.gpu

TOLS = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 2e-2, 2e-2)]


def _rounded(t, dtype):
    """The reference computed in REF_FLOAT (fp32; fp64 in the CPU reference mode) on the inputs' values,
    rounded once to dtype: what PyTorch's CUDA layer norm gives for bf16 (fp32 arithmetic inside); its
    CPU bf16 backward is less accurate."""
    return t.detach().to(dtype)


@pytest.mark.parametrize("batch_size, seq_len, hidden_size",
                         [(2, 8, 64), (4, 16, 128), (1, 1, 1023), (3, 7, 256), (1, 1, 1500)])
@pytest.mark.parametrize("dtype, atol, rtol", TOLS)
def test_liger_layer_norm(ext, batch_size, seq_len, hidden_size, dtype, atol, rtol):
    torch.manual_seed(0)
    x = torch.randn(batch_size, seq_len, hidden_size, dtype=dtype, device=DEVICE)
    x1 = x.clone().requires_grad_(True)
    x2 = x.to(REF_FLOAT).requires_grad_(True)

    mine = tt.TigonLayerNorm(hidden_size, eps=1e-6).to(dtype).to(DEVICE)
    ref = torch.nn.LayerNorm(hidden_size, eps=1e-6).to(DEVICE).to(REF_FLOAT)  # on the same values (see _rounded)
    with torch.no_grad():
        ref.weight.copy_(mine.weight)
        ref.bias.copy_(mine.bias)

    y1, y2 = mine(x1), ref(x2)
    assert_close(y1, _rounded(y2, dtype), atol, rtol, "y")
    dy = torch.randn_like(x)
    y1.backward(dy, retain_graph=True)
    y2.backward(dy.to(REF_FLOAT), retain_graph=True)
    assert_close(x1.grad, _rounded(x2.grad, dtype), atol, rtol, "dx")
    assert_close(mine.weight.grad, _rounded(ref.weight.grad, dtype), atol, rtol, "dW")
    assert_close(mine.bias.grad, _rounded(ref.bias.grad, dtype), atol, rtol, "dB")


@pytest.mark.parametrize("batch_size, seq_len, hidden_size", [(2, 8, 64), (4, 16, 128), (3, 512, 128)])
@pytest.mark.parametrize("dtype, atol, rtol", TOLS)
def test_liger_layer_norm_functional(ext, hidden_size, batch_size, seq_len, dtype, atol, rtol):
    torch.manual_seed(0)
    x = torch.randn(batch_size, seq_len, hidden_size, dtype=dtype, device=DEVICE)
    w = torch.randn(hidden_size, device=DEVICE, dtype=dtype)
    b = torch.randn(hidden_size, device=DEVICE, dtype=dtype)
    leaves = [[t.clone().requires_grad_(True) for t in (x, w, b)] for _ in range(2)]
    (x1, w1, b1), (x2, w2, b2) = leaves
    x0, w0, b0 = (t.to(REF_FLOAT).requires_grad_(True) for t in (x, w, b))

    y0 = F.layer_norm(x0, (hidden_size,), w0, b0, eps=1e-6)  # compared after one rounding
    y1 = tt.tigon_layer_norm(X=x1, W=w1, B=b1, eps=1e-6)  # Liger's keywords
    y2 = tt.TigonLayerNormFunction.apply(x2, w2, b2, 1e-6)
    assert_close(y1, _rounded(y0, dtype), atol, rtol, "functional y")
    assert_close(y2, _rounded(y0, dtype), atol, rtol, "Function y")

    dy = torch.randn_like(y1)
    y0.backward(dy.to(REF_FLOAT))
    for y in (y1, y2):
        y.backward(dy, retain_graph=True)
    for tag, (xi, wi, bi) in (("functional", leaves[0]), ("Function", leaves[1])):
        assert_close(xi.grad, _rounded(x0.grad, dtype), atol, rtol, f"{tag} dx")
        assert_close(wi.grad, _rounded(w0.grad, dtype), atol, rtol, f"{tag} dW")
        assert_close(bi.grad, _rounded(b0.grad, dtype), atol, rtol, f"{tag} dB")

"""Port of Liger-Kernel 0.8.2's test/transformers/test_geglu.py onto tigon_torch.

Same shapes, dtypes and (atol, rtol) as Liger's GPU cases. test_correctness compares TigonGEGLUMLP with
Hugging Face's LlamaMLP with hidden_act="gelu_pytorch_tanh"; Liger's functional test compares
liger_geglu with LigerGELUMulFunction, here both tigon entry points are compared with
gelu(a, approximate="tanh") * b in fp32. Not ported: the NPU-only comparison method, and the six
LigerGEGLUMLPForGemma4 tests, which check how that Liger module reads Gemma 4's config (tigon has no
such module).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE
from liger_helpers import assert_close, cap_on_cpu

import tigon_torch as tt

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("bsz, seq_len, hidden_size, intermediate_size", [(2, 2048, 2048, 4096), (9, 41, 341, 4231)])
@pytest.mark.parametrize("dtype, atol, rtol", [(torch.float32, 1e-0, 2e-6), (torch.bfloat16, 1e-2, 1e-2)])
def test_correctness(ext, seed, bsz, seq_len, hidden_size, intermediate_size, dtype, atol, rtol):
    from transformers.models.llama.configuration_llama import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    cap_on_cpu(bsz * seq_len * intermediate_size * 4)
    config = LlamaConfig(hidden_size=hidden_size, intermediate_size=intermediate_size,
                         hidden_act="gelu_pytorch_tanh", num_attention_heads=1, num_key_value_heads=1,
                         head_dim=8)  # (an attention shape newer transformers releases accept)
    x = torch.randn(bsz, seq_len, hidden_size, device=DEVICE, dtype=dtype)
    G = torch.randn(hidden_size, intermediate_size, device=DEVICE, dtype=dtype)
    U = torch.randn(hidden_size, intermediate_size, device=DEVICE, dtype=dtype)
    D = torch.randn(intermediate_size, hidden_size, device=DEVICE, dtype=dtype)
    ref = LlamaMLP(config=config).to(DEVICE).to(dtype)
    mine = tt.TigonGEGLUMLP(config=config).to(DEVICE).to(dtype)
    for m in (ref, mine):
        m.gate_proj.weight.data = G.T
        m.up_proj.weight.data = U.T
        m.down_proj.weight.data = D.T

    x1 = x.clone().requires_grad_(True)
    x2 = x.clone().requires_grad_(True)
    y1, y2 = ref(x1), mine(x2)
    assert_close(y2, y1, atol, rtol, "y")
    dy = torch.randn_like(y1)
    y1.backward(dy.clone(), retain_graph=True)
    y2.backward(dy.clone(), retain_graph=True)
    for n in ("gate_proj", "up_proj", "down_proj"):
        assert_close(getattr(mine, n).weight.grad, getattr(ref, n).weight.grad, atol, rtol, f"d{n}")
    assert_close(x2.grad, x1.grad, atol, rtol, "dx")


def gelu_mul_ref(a, b):
    """gelu(a, approximate="tanh") * b in fp32, rounded once to a's dtype."""
    return (F.gelu(a.float(), approximate="tanh") * b.float()).to(a.dtype)


@pytest.mark.parametrize("bsz, seq_len, size", [(2, 2, 8), (9, 7, 41)])
@pytest.mark.parametrize("dtype, atol, rtol", [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 1e-2, 1e-2)])
def test_correctness_functional(ext, seed, bsz, seq_len, size, dtype, atol, rtol):
    a = torch.randn(bsz, seq_len, size, device=DEVICE, dtype=dtype)
    b = torch.randn(bsz, seq_len, size, device=DEVICE, dtype=dtype)
    a0, b0 = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    a1, b1 = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    a2, b2 = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    y0 = gelu_mul_ref(a0, b0)
    y1 = tt.tigon_geglu(a=a1, b=b1)
    y2 = tt.TigonGELUMulFunction.apply(a2, b2)
    assert_close(y1, y0, atol, rtol, "functional y")
    assert_close(y2, y0, atol, rtol, "Function y")
    grad = torch.randn_like(y0)
    for y in (y0, y1, y2):
        y.backward(grad.clone())
    for name, got, want in (("functional da", a1.grad, a0.grad), ("functional db", b1.grad, b0.grad),
                            ("Function da", a2.grad, a0.grad), ("Function db", b2.grad, b0.grad)):
        assert_close(got, want, atol, rtol, name)

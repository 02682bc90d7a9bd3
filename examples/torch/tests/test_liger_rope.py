"""Port of Liger-Kernel 0.8.2's test/transformers/test_rope.py onto tigon_torch.

Same shapes, dtypes, position-id layouts and (atol, rtol) as Liger's. test_correctness compares
tigon_rotary_pos_emb with Hugging Face's apply_rotary_pos_emb, with cos / sin from LlamaRotaryEmbedding.
Liger's functional test compares liger_rope with LigerRopeFunction; here both tigon entry points are
compared with a reference formula, including Liger's odd head_dim 41: the pairs (i, i + D // 2) for
i < D // 2 are rotated with cos / sin[..., i] and the last channel passes through, the tables being
Hugging Face's default rotary embedding for that head_dim (2 * ceil(D / 2) columns).
"""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE
from liger_helpers import assert_close

import tigon_torch as tt

pytestmark = pytest.mark.gpu

THETA = 10000.0  # LlamaConfig's default rope_theta


def rope_tables(head_dim, num_kv_heads, pos_ids, dtype):
    """cos, sin as Liger's test builds them: LlamaRotaryEmbedding(config=LlamaConfig(head_dim=...)) applied
    to a tensor of dtype at pos_ids. Newer transformers releases refuse an odd head_dim in the config;
    then the same default-RoPE formula is evaluated here (inv_freq over arange(0, D, 2) / D, the
    frequencies repeated twice, cos / sin in fp32 cast to dtype)."""
    try:
        from transformers.models.llama.configuration_llama import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        config = LlamaConfig(num_kv_heads=num_kv_heads, head_dim=head_dim)
        try:
            emb = LlamaRotaryEmbedding(config=config, device=DEVICE)
        except TypeError:  # transformers releases whose rotary embedding takes no device
            emb = LlamaRotaryEmbedding(config=config).to(DEVICE)
        x = torch.empty(1, 1, 1, head_dim, device=DEVICE, dtype=dtype)
        return emb(x, pos_ids)
    except Exception:
        if head_dim % 2 == 0:
            raise
    inv_freq = 1.0 / (THETA ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=DEVICE).float() / head_dim))
    freqs = pos_ids.float()[:, :, None] * inv_freq[None, None, :]
    table = torch.cat((freqs, freqs), dim=-1)
    return table.cos().to(dtype), table.sin().to(dtype)


def rope_reference(x, cos, sin):
    """x [batch, heads, seq, D]; cos / sin [1 or batch, seq, >= 2 * (D // 2)]: rotate_half over the first
    2 * (D // 2) channels with the first D // 2 table columns, the rest of x unchanged; arithmetic in x's
    dtype, as Hugging Face's apply_rotary_pos_emb."""
    half = x.shape[-1] // 2
    c = cos[:, None, :, :half]
    s = sin[:, None, :, :half]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, rest), dim=-1)


@pytest.mark.parametrize(
    "bsz, seq_len, num_q_heads, num_kv_heads, head_dim",
    [
        (1, 128, 32, 32, 64),
        (2, 128, 32, 32, 64),
        (1, 128, 32, 8, 64),
        (2, 128, 32, 8, 64),
        (3, 423, 73, 213, 92),
        (3, 423, 73, 155, 92),
    ],
)
@pytest.mark.parametrize("dtype, atol, rtol", [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 1e-1, 1e-5)])
@pytest.mark.parametrize("expand_position_ids", [True, False])
def test_correctness(ext, seed, bsz, seq_len, num_q_heads, num_kv_heads, head_dim, dtype, expand_position_ids,
                     atol, rtol):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    # [batch, heads, seq, D] views of [batch, seq, heads, D] memory, as Hugging Face's attention makes them
    q = torch.randn(bsz, seq_len, num_q_heads, head_dim, device=DEVICE).transpose(1, 2).to(dtype)
    k = torch.randn(bsz, seq_len, num_kv_heads, head_dim, device=DEVICE).transpose(1, 2).to(dtype)
    q1, k1 = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    q2, k2 = q.clone().requires_grad_(True), k.clone().requires_grad_(True)

    pos_ids = torch.arange(seq_len, device=DEVICE, dtype=torch.long).unsqueeze(0)
    if expand_position_ids:
        pos_ids = pos_ids.expand(bsz, -1)
    cos, sin = rope_tables(head_dim, num_kv_heads, pos_ids, dtype)

    hf_q, hf_k = apply_rotary_pos_emb(q1, k1, cos, sin)
    tg_q, tg_k = tt.tigon_rotary_pos_emb(q2, k2, cos, sin)
    assert_close(tg_q, hf_q, atol, rtol, "q")
    assert_close(tg_k, hf_k, atol, rtol, "k")

    dq = torch.randn_like(hf_q)
    dk = torch.randn_like(hf_k).to(dtype)
    q1_grad, k1_grad = torch.autograd.grad((hf_q, hf_k), (q1, k1), (dq, dk), allow_unused=True)
    q2_grad, k2_grad = torch.autograd.grad((tg_q, tg_k), (q2, k2), (dq.clone(), dk.clone()), allow_unused=True)
    assert_close(q2_grad, q1_grad, atol, rtol, "dq")
    assert_close(k2_grad, k1_grad, atol, rtol, "dk")


@pytest.mark.parametrize(
    "bsz, seq_len, num_q_heads, num_kv_heads, head_dim",
    [
        (1, 2, 2, 2, 8),
        (1, 2, 1, 2, 8),
        (9, 7, 41, 41, 41),  # odd head_dim: 20 pairs rotated, channel 40 passed through
    ],
)
@pytest.mark.parametrize("dtype, atol, rtol", [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 1e-1, 1e-5)])
@pytest.mark.parametrize("expand_position_ids", [True, False])
def test_functional_correctness(ext, seed, bsz, seq_len, num_q_heads, num_kv_heads, head_dim, expand_position_ids,
                                dtype, atol, rtol):
    q = torch.randn(bsz, num_q_heads, seq_len, head_dim, device=DEVICE, dtype=dtype)
    k = torch.randn(bsz, num_kv_heads, seq_len, head_dim, device=DEVICE, dtype=dtype)
    q0, k0 = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    q1, k1 = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    q2, k2 = q.clone().requires_grad_(True), k.clone().requires_grad_(True)

    pos_ids = torch.arange(seq_len, device=DEVICE, dtype=torch.long).unsqueeze(0)
    if expand_position_ids:
        pos_ids = pos_ids.expand(bsz, -1)
    cos, sin = rope_tables(head_dim, num_kv_heads, pos_ids, dtype)

    ref_q, ref_k = rope_reference(q0, cos, sin), rope_reference(k0, cos, sin)
    f_q, f_k = tt.tigon_rope(q=q1, k=k1, cos=cos, sin=sin)
    c_q, c_k = tt.TigonRopeFunction.apply(q2, k2, cos, sin)
    for name, got, want in (("functional q", f_q, ref_q), ("functional k", f_k, ref_k),
                            ("Function q", c_q, ref_q), ("Function k", c_k, ref_k)):
        assert_close(got, want, atol, rtol, name)
    if head_dim % 2:
        assert torch.equal(f_q[..., -1], q[..., -1]) and torch.equal(c_k[..., -1], k[..., -1]), (
            "the last channel of an odd head_dim must pass through unchanged")

    dq, dk = torch.randn_like(ref_q), torch.randn_like(ref_k)
    g0 = torch.autograd.grad((ref_q, ref_k), (q0, k0), (dq, dk), allow_unused=True)
    g1 = torch.autograd.grad((f_q, f_k), (q1, k1), (dq.clone(), dk.clone()), allow_unused=True)
    g2 = torch.autograd.grad((c_q, c_k), (q2, k2), (dq.clone(), dk.clone()), allow_unused=True)
    for name, got, want in (("functional dq", g1[0], g0[0]), ("functional dk", g1[1], g0[1]),
                            ("Function dq", g2[0], g0[0]), ("Function dk", g2[1], g0[1])):
        assert_close(got, want, atol, rtol, name)

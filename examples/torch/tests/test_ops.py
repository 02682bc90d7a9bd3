"""Each tigon function against the Hugging Face module or PyTorch reference it replaces, forward and
backward, on a CUDA device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE, assert_elem, assert_rel

import tigon_torch as tt

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEV = DEVICE


def _hf_rms(kind: str, hidden: int, eps: float, weight: torch.Tensor):
    if kind == "llama":
        from transformers.models.llama.modeling_llama import LlamaRMSNorm as Cls

        m = Cls(hidden, eps=eps)
    else:
        from transformers.models.gemma.modeling_gemma import GemmaRMSNorm as Cls

        m = Cls(hidden, eps=eps)
    m.weight = torch.nn.Parameter(weight.detach().clone())
    return m


def _grads(out, inputs, grad):
    return torch.autograd.grad(out, inputs, grad)


# ------------------------------------------------------------------------------------------------
# RMSNorm
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 7, 64), (3, 5, 4096), (257, 1000), (4, 2048)])
@pytest.mark.parametrize("kind", ["llama", "gemma"])
@pytest.mark.parametrize("in_place", [True, False])
def test_rms_norm_matches_hf(ext, seed, dtype, shape, kind, in_place):
    hidden, eps = shape[-1], 1e-6
    x = torch.randn(shape, device=DEV, dtype=dtype, requires_grad=True)
    w0 = (torch.randn(hidden, device=DEV) * 0.1 + (0.0 if kind == "gemma" else 1.0)).to(dtype)
    ref = _hf_rms(kind, hidden, eps, w0).to(DEV)
    y_ref = ref(x)
    dy = torch.randn_like(y_ref)
    dx_ref, dw_ref = _grads(y_ref, (x, ref.weight), dy)

    w = w0.clone().requires_grad_(True)
    offset, casting = (1.0, "gemma") if kind == "gemma" else (0.0, "llama")
    y = tt.TigonRMSNormFunction.apply(x, w, eps, offset, casting, in_place, None)
    dx, dw = _grads(y, (x, w), dy.clone())
    assert y.dtype == dtype and y.shape == x.shape
    assert_elem(y, y_ref, dtype)
    assert_rel(dx, dx_ref, dtype, what="dx")
    assert_rel(dw, dw_ref, dtype, factor=2.0, what="dW")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_fp32_weight(ext, seed, dtype):
    """Half-precision activations with an fp32 weight (mixed precision): Hugging Face's Llama norm then
    returns fp32; tigon returns the activations' dtype, equal to HF's result rounded once."""
    x = torch.randn(64, 2048, device=DEV, dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(2048, device=DEV)).requires_grad_(True)
    ref = _hf_rms("llama", 2048, 1e-5, w).to(DEV)
    y_ref = ref(x)
    y = tt.tigon_rms_norm(x, w, 1e-5)
    assert y.dtype == dtype
    assert_elem(y, y_ref.to(dtype), dtype)
    dy = torch.randn_like(y)
    dx_ref, dw_ref = _grads(y_ref, (x, ref.weight), dy.float())
    dx, dw = _grads(y, (x, w), dy)
    assert dw.dtype == torch.float32
    assert_rel(dx, dx_ref, dtype, what="dx")
    assert_rel(dw, dw_ref, dtype, what="dW")


def test_rms_norm_strided_layouts(ext, seed):
    """A transposed [B, H, T, D] view (the q / k norms of Qwen 3 and Gemma 3) gives, row for row, the
    same bits as the contiguous tensor, and the output keeps the input's layout."""
    base = torch.randn(2, 9, 4, 128, device=DEV, dtype=torch.bfloat16)
    xt = base.transpose(1, 2).requires_grad_(True)  # [B, H, T, D], not contiguous
    xc = xt.detach().contiguous().requires_grad_(True)
    w = torch.randn(128, device=DEV, dtype=torch.bfloat16)
    yt = tt.tigon_rms_norm(xt, w, 1e-6, 1.0, "gemma", False)
    yc = tt.tigon_rms_norm(xc, w, 1e-6, 1.0, "gemma", False)
    assert yt.stride() == xt.stride()
    torch.testing.assert_close(yt, yc, atol=0, rtol=0)
    dy = torch.randn_like(yc)
    (dxt,) = torch.autograd.grad(yt, xt, dy)
    (dxc,) = torch.autograd.grad(yc, xc, dy)
    torch.testing.assert_close(dxt, dxc, atol=0, rtol=0)


def test_rms_norm_no_weight_and_none_casting(ext, seed):
    x = torch.randn(33, 320, device=DEV, dtype=torch.float32, requires_grad=True)
    y = tt.TigonRMSNormFunction.apply(x, None, 1e-6, 0.0, "none", False, None)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert_elem(y, ref, torch.float32)
    dy = torch.randn_like(y)
    assert_rel(torch.autograd.grad(y, x, dy)[0], torch.autograd.grad(ref, x, dy)[0], torch.float32)


# ------------------------------------------------------------------------------------------------
# LayerNorm and the fused add + RMSNorm
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 11, 96), (64, 4096)])
@pytest.mark.parametrize("affine", ["both", "weight", "none"])
def test_layer_norm_matches_torch(ext, seed, dtype, shape, affine):
    hidden = shape[-1]
    x = (torch.randn(shape, device=DEV) * 3 + 5).to(dtype).requires_grad_(True)
    w = (1 + 0.1 * torch.randn(hidden, device=DEV)).to(dtype).requires_grad_(True) if affine != "none" else None
    b = (0.1 * torch.randn(hidden, device=DEV)).to(dtype).requires_grad_(True) if affine == "both" else None
    y_ref = F.layer_norm(x, (hidden,), w, b, 1e-5)
    y = tt.TigonLayerNormFunction.apply(x, w, b, 1e-5)
    assert_elem(y, y_ref, dtype)
    dy = torch.randn_like(y)
    inputs = [t for t in (x, w, b) if t is not None]
    for got, want, name in zip(_grads(y, inputs, dy), _grads(y_ref, inputs, dy), ("dx", "dW", "dB")):
        assert_rel(got, want, dtype, factor=2.0, what=name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["llama", "gemma"])
@pytest.mark.parametrize("in_place", [True, False])
def test_fused_add_rms_norm_matches_add_then_hf(ext, seed, dtype, kind, in_place):
    hidden = 1024
    x = torch.randn(5, 13, hidden, device=DEV, dtype=dtype, requires_grad=True)
    r = torch.randn(5, 13, hidden, device=DEV, dtype=dtype, requires_grad=True)
    w0 = (torch.randn(hidden, device=DEV) * 0.1 + (0.0 if kind == "gemma" else 1.0)).to(dtype)
    ref = _hf_rms(kind, hidden, 1e-6, w0).to(DEV)
    s_ref = x + r
    y_ref = ref(s_ref)
    w = w0.clone().requires_grad_(True)
    offset, casting = (1.0, "gemma") if kind == "gemma" else (0.0, "llama")
    y, s = tt.TigonFusedAddRMSNormFunction.apply(x, r, w, 1e-6, offset, casting, in_place)
    torch.testing.assert_close(s, s_ref, atol=0, rtol=0)
    assert_elem(y, y_ref, dtype)
    gy, gs = torch.randn_like(y), torch.randn_like(s)
    want = _grads((y_ref, s_ref), (x, r, ref.weight), (gy, gs))
    got = _grads((y, s), (x, r, w), (gy.clone(), gs.clone()))
    for g, e, name in zip(got, want, ("dx", "dr", "dW")):
        assert_rel(g, e, dtype, factor=2.0, what=name)


# ------------------------------------------------------------------------------------------------
# RoPE
# ------------------------------------------------------------------------------------------------


def _hf_rope(q, k, cos, sin, unsqueeze_dim=1):
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb  # handles partial rotary

    return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)


def _tables(batch, seq, dim, dtype, per_batch=False):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=DEV, dtype=torch.float32) / dim))
    pos = torch.arange(seq, device=DEV, dtype=torch.float32)
    if per_batch:
        pos = pos[None, :] + torch.arange(batch, device=DEV)[:, None] * 3
    else:
        pos = pos[None, :]
    freqs = pos[..., None] * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _check_rotation(q, k, out, ref, dtype):
    """tigon's rotated (q, k) `out` against the reference `ref`: values to the dtype's element
    tolerance, and the gradients with respect to q and k for one random upstream gradient (in the
    reference's dtype for the reference)."""
    assert_elem(out[0], ref[0].to(dtype), dtype)
    assert_elem(out[1], ref[1].to(dtype), dtype)
    gq, gk = torch.randn_like(out[0]), torch.randn_like(out[1])
    want = _grads(ref, (q, k), (gq.to(ref[0].dtype), gk.to(ref[1].dtype)))
    got = _grads(out, (q, k), (gq, gk))
    assert_rel(got[0], want[0], dtype, what="dq")
    assert_rel(got[1], want[1], dtype, what="dk")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)])
@pytest.mark.parametrize("rotary", ["full", "partial"])
@pytest.mark.parametrize("per_batch", [False, True])
def test_rope_matches_hf(ext, seed, dtype, heads, rotary, per_batch):
    batch, seq, hq, hk, dim = 2, 37, heads[0], heads[1], 128
    rd = dim if rotary == "full" else dim // 2
    # Hugging Face's layout: [B, T, H, D] projections viewed as [B, H, T, D].
    q = torch.randn(batch, seq, hq, dim, device=DEV, dtype=dtype).transpose(1, 2).requires_grad_(True)
    k = torch.randn(batch, seq, hk, dim, device=DEV, dtype=dtype).transpose(1, 2).requires_grad_(True)
    cos, sin = _tables(batch, seq, rd, dtype, per_batch)
    q_ref, k_ref = _hf_rope(q, k, cos, sin)
    q_out, k_out = tt.TigonRopeFunction.apply(q, k, cos, sin, None, 1)
    assert q_out.shape == q.shape and q_out.stride() == q.stride()
    _check_rotation(q, k, (q_out, k_out), (q_ref, k_ref), dtype)


def test_rope_unsqueeze_dim_2_fp32_tables_and_position_ids(ext, seed):
    batch, seq, h, dim = 3, 20, 4, 64
    dtype = torch.bfloat16
    q = torch.randn(batch, seq, h, dim, device=DEV, dtype=dtype, requires_grad=True)  # [B, T, H, D]
    k = torch.randn(batch, seq, h, dim, device=DEV, dtype=dtype, requires_grad=True)
    cos32, sin32 = _tables(batch, seq, dim, torch.float32)
    q_ref, k_ref = _hf_rope(q.float(), k.float(), cos32, sin32, unsqueeze_dim=2)
    q_out, k_out = tt.tigon_rope(q, k, cos32, sin32, None, 2)  # fp32 tables with bf16 q / k
    assert q_out.dtype == dtype
    assert_elem(q_out, q_ref.to(dtype), dtype)
    assert_elem(k_out, k_ref.to(dtype), dtype)
    # A full table indexed by position ids equals the table gathered beforehand.
    table_cos, table_sin = _tables(1, 100, dim, dtype)
    pos = torch.randint(0, 100, (batch, seq), device=DEV)
    gathered = (table_cos[0][pos], table_sin[0][pos])
    a = tt.tigon_rope(q, k, table_cos, table_sin, pos, 2)
    b = tt.tigon_rope(q, k, gathered[0], gathered[1], None, 2)
    torch.testing.assert_close(a[0], b[0], atol=0, rtol=0)
    torch.testing.assert_close(a[1], b[1], atol=0, rtol=0)


def _odd_rope_ref(x, cos, sin):
    """Liger-Kernel's RoPE for an odd head_dim D (Hugging Face's apply_rotary_pos_emb raises on it):
    the pairs (d, d + D // 2) for d < D // 2, both members with cos / sin[..., :D // 2], the last channel
    passed through. x: [batch, heads, seq, D]; cos / sin: [1 or batch, seq, width]."""
    n = x.shape[-1] // 2
    c, s = cos[..., :n].unsqueeze(1).float(), sin[..., :n].unsqueeze(1).float()
    x1, x2 = x[..., :n].float(), x[..., n:2 * n].float()
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, x[..., 2 * n:].float()), dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(9, 7, 41, 41, 41), (2, 5, 4, 2, 3), (1, 9, 3, 1, 127)])
@pytest.mark.parametrize("width", ["hf", "cut"])
def test_rope_odd_head_dim(ext, seed, dtype, shape, width):
    batch, seq, hq, hk, dim = shape  # (9, 7, 41, 41, 41): Liger's test
    q = torch.randn(batch, hq, seq, dim, device=DEV, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, hk, seq, dim, device=DEV, dtype=dtype, requires_grad=True)
    cos, sin = _tables(batch, seq, dim, dtype)  # Hugging Face's: dim + 1 wide
    assert cos.shape[-1] == dim + 1
    if width == "cut":
        cos, sin = cos[..., :dim].contiguous(), sin[..., :dim].contiguous()
    q_ref, k_ref = _odd_rope_ref(q, cos, sin), _odd_rope_ref(k, cos, sin)
    q_out, k_out = tt.TigonRopeFunction.apply(q, k, cos, sin, None, 1)
    assert q_out.shape == q.shape and q_out.dtype == dtype
    assert torch.equal(q_out[..., -1], q[..., -1]) and torch.equal(k_out[..., -1], k[..., -1])
    _check_rotation(q, k, (q_out, k_out), (q_ref, k_ref), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary", ["full", "partial"])
def test_interleaved_rope_matches_glm4(ext, seed, dtype, rotary):
    """GLM-4's apply_rotary_pos_emb (interleaved pairs of the first rotary_dim channels, the table's
    first half repeated per pair), as the patch calls it, against Hugging Face's, fp32 reference math."""
    from transformers.models.glm4 import modeling_glm4

    from tigon_torch import patch

    batch, seq, hq, hk, dim = 2, 19, 4, 2, 64
    rd = dim if rotary == "full" else dim // 2
    q = torch.randn(batch, seq, hq, dim, device=DEV, dtype=dtype).transpose(1, 2).requires_grad_(True)
    k = torch.randn(batch, seq, hk, dim, device=DEV, dtype=dtype).transpose(1, 2).requires_grad_(True)
    cos, sin = _tables(batch, seq, rd, dtype, per_batch=True)
    hf = modeling_glm4.apply_rotary_pos_emb
    q_ref, k_ref = hf(q.float(), k.float(), cos.float(), sin.float())
    q_out, k_out = patch._rope_glm(hf)(q, k, cos, sin)
    assert q_out.dtype == dtype and q_out.stride() == q.stride()
    assert torch.equal(q_out[..., rd:], q[..., rd:])
    _check_rotation(q, k, (q_out, k_out), (q_ref, k_ref), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_interleaved_rope_matches_llama4(ext, seed, dtype):
    """Llama 4's apply_rotary_emb (each pair a complex number times freqs_cis, in fp32, one rounding)
    and vision_apply_rotary_emb, as the patch calls them, against Hugging Face's."""
    from transformers.models.llama4 import modeling_llama4

    from tigon_torch import patch

    batch, seq, hq, hk, dim = 2, 23, 4, 2, 64
    inv = 1.0 / (500000.0 ** (torch.arange(0, dim, 2, device=DEV, dtype=torch.float32) / dim))
    pos = torch.arange(seq, device=DEV, dtype=torch.float32)[None, :] + torch.arange(batch, device=DEV)[:, None]
    freqs = torch.polar(torch.ones(batch, seq, dim // 2, device=DEV), pos[..., None] * inv)  # [B, S, D / 2]
    q = torch.randn(batch, seq, hq, dim, device=DEV, dtype=dtype, requires_grad=True)  # [B, S, H, D]
    k = torch.randn(batch, seq, hk, dim, device=DEV, dtype=dtype, requires_grad=True)
    for hf_fn, make, table in ((modeling_llama4.apply_rotary_emb, patch._rope_complex, freqs),
                               (modeling_llama4.vision_apply_rotary_emb, patch._rope_complex_vision,
                                freqs[:1].reshape(seq, 1, dim // 2))):
        qq, kk = (q, k) if table is freqs else (q[:1], k[:1])
        q_ref, k_ref = hf_fn(qq, kk, table)
        q_out, k_out = make(hf_fn)(qq, kk, table)
        assert q_out.dtype == dtype
        _check_rotation(q, k, (q_out, k_out), (q_ref, k_ref), dtype)


def _hf_mrope(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """Hugging Face's apply_multimodal_rotary_pos_emb (transformers 4.x's Qwen2-VL; transformers 5
    composes the same row in its rotary embedding): column block i of the row from plane i mod 3."""
    return _hf_rope(q, k, _hf_mrope_table(cos, mrope_section), _hf_mrope_table(sin, mrope_section), unsqueeze_dim)


def _hf_mrope_table(t, mrope_section):
    sec = list(mrope_section) * 2
    return torch.cat([m[i % 3] for i, m in enumerate(t.split(sec, dim=-1))], dim=-1)


def _mrope_tables(batch, seq, dim, dtype):
    """[3, batch, seq, dim] tables of three position grids (temporal, height, width)."""
    planes = [_tables(batch, seq, dim, torch.float32, per_batch=True) for _ in range(3)]
    scale = torch.tensor([1.0, 0.5, 0.25], device=DEV)[:, None, None, None]  # distinct angles per plane
    cos = torch.stack([c for c, _ in planes])
    ang = torch.atan2(torch.stack([s for _, s in planes]), cos) * scale
    return ang.cos().to(dtype), ang.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 37, 28, 4, 128, (16, 24, 24)), (1, 12, 12, 2, 96, (16, 16, 16)),
                                   (2, 9, 8, 8, 64, (8, 12, 12)), (1, 2, 2, 2, 8, (2, 1, 1))])
def test_mrope_matches_hf(ext, seed, dtype, shape):
    """Qwen2-VL's M-RoPE (Liger's shapes and sections) against Hugging Face's formula: the function,
    the functional forms and the drop-in, forward and backward."""
    batch, seq, hq, hk, dim, sec = shape
    q = torch.randn(batch, seq, hq, dim, device=DEV, dtype=dtype).transpose(1, 2).requires_grad_(True)
    k = torch.randn(batch, seq, hk, dim, device=DEV, dtype=dtype).transpose(1, 2).requires_grad_(True)
    cos, sin = _mrope_tables(batch, seq, dim, dtype)
    for fn in (tt.TigonQwen2VLMRopeFunction.apply, tt.tigon_qwen2vl_mrope, tt.tigon_multimodal_rotary_pos_emb):
        q_ref, k_ref = _hf_mrope(q, k, cos, sin, list(sec))
        q_out, k_out = fn(q, k, cos, sin, list(sec))
        assert q_out.shape == q.shape and q_out.dtype == dtype
        _check_rotation(q, k, (q_out, k_out), (q_ref, k_ref), dtype)


def test_mrope_sections_checked(ext):
    q = torch.randn(1, 2, 3, 64, device=DEV)
    cos, sin = _mrope_tables(1, 3, 64, torch.float32)
    with pytest.raises((ValueError, RuntimeError), match="mrope_section"):
        tt.TigonQwen2VLMRopeFunction.apply(q, q.clone(), cos, sin, [8, 12, 8])  # 28 pairs, not 32
    with pytest.raises((ValueError, RuntimeError), match="M-RoPE"):
        tt.TigonQwen2VLMRopeFunction.apply(q, q.clone(), cos[:2], sin[:2], [8, 12, 12])  # two planes
    # 3-D tables are composed ones (transformers 5's rotary embedding): the plain rotation.
    composed = [_hf_mrope_table(t, [8, 12, 12]) for t in (cos, sin)]
    a = tt.TigonQwen2VLMRopeFunction.apply(q, q.clone(), *composed, [8, 12, 12])
    b = tt.TigonQwen2VLMRopeFunction.apply(q, q.clone(), cos, sin, [8, 12, 12])
    torch.testing.assert_close(a[0], b[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_llama4_rope_function(ext, seed, dtype):
    """Liger's LigerLlama4RopeFunction signature (freqs_cis complex, or view_as_real's form) against
    Hugging Face's apply_rotary_emb."""
    from transformers.models.llama4 import modeling_llama4

    batch, seq, hq, hk, dim = 2, 17, 4, 2, 64
    inv = 1.0 / (500000.0 ** (torch.arange(0, dim, 2, device=DEV, dtype=torch.float32) / dim))
    pos = torch.arange(seq, device=DEV, dtype=torch.float32)[None, :] + torch.arange(batch, device=DEV)[:, None]
    freqs = torch.polar(torch.ones(batch, seq, dim // 2, device=DEV), pos[..., None] * inv)
    q = torch.randn(batch, seq, hq, dim, device=DEV, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, seq, hk, dim, device=DEV, dtype=dtype, requires_grad=True)
    for f in (freqs, torch.view_as_real(freqs)):
        for fn in (tt.TigonLlama4RopeFunction.apply, tt.tigon_llama4_text_rotary_pos_emb):
            _check_rotation(q, k, fn(q, k, f), modeling_llama4.apply_rotary_emb(q, k, freqs), dtype)
    vf = freqs[:1].reshape(seq, 1, dim // 2)
    q_ref, k_ref = modeling_llama4.vision_apply_rotary_emb(q[:1], k[:1], vf)
    q_out, k_out = tt.tigon_llama4_vision_rotary_pos_emb(q[:1], k[:1], vf)
    assert_elem(q_out, q_ref, dtype)
    assert_elem(k_out, k_ref, dtype)


def test_interleaved_rope_width_checked(ext):
    q = torch.randn(1, 2, 3, 64, device=DEV)
    cos, sin = _tables(1, 3, 62, torch.float32)
    cos, sin = cos[..., :31], sin[..., :31]  # odd: not whole pairs
    with pytest.raises((ValueError, RuntimeError), match="width"):
        tt.TigonInterleavedRopeFunction.apply(q, q, cos, sin, None, 1)


def test_rope_table_width_checked(ext):
    q = torch.randn(1, 2, 3, 64, device=DEV)
    cos, sin = _tables(1, 3, 66, torch.float32)  # wider than head_dim
    with pytest.raises((ValueError, RuntimeError), match="width"):
        tt.TigonRopeFunction.apply(q, q, cos, sin, None, 1)


# ------------------------------------------------------------------------------------------------
# Gated activations
# ------------------------------------------------------------------------------------------------


def _gated_ref(a, b, act, gm=1.0, dm=1.0):
    a32, b32 = a.float(), b.float()
    if act == "silu":
        v = F.silu(gm * a32)
    elif act == "gelu_tanh":
        v = F.gelu(gm * a32, approximate="tanh")
    else:
        v = F.gelu(gm * a32)
    return dm * v * b32


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 9, 352), (16, 14336), (7, 1001)])
def test_swiglu_geglu_match_reference(ext, seed, dtype, shape):
    for act, fn in (("silu", lambda a, b: tt.TigonSiLUMulFunction.apply(a, b)),
                    ("gelu_tanh", lambda a, b: tt.TigonGELUMulFunction.apply(a, b)),
                    ("gelu", lambda a, b: tt.TigonGatedMulFunction.apply(a, b, "gelu"))):
        a = torch.randn(shape, device=DEV, dtype=dtype, requires_grad=True)
        b = torch.randn(shape, device=DEV, dtype=dtype, requires_grad=True)
        c = fn(a, b)
        ref = _gated_ref(a, b, act)
        assert c.dtype == dtype
        assert_elem(c, ref.to(dtype), dtype)
        dc = torch.randn_like(c)
        want = _grads(ref, (a, b), dc.float())
        got = _grads(c, (a, b), dc)
        assert_rel(got[0], want[0], dtype, what=f"{act} da")
        assert_rel(got[1], want[1], dtype, what=f"{act} db")


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_backward_over_projections(ext, seed, dtype):
    """Liger's memory: with a and b computed by the graph (an MLP's projections) the backward writes da
    and db over them and allocates nothing; the gradients are the reference's, a and b's version
    counters are bumped (a node that saved a raises instead of reading a gradient), and leaves keep
    their values."""
    x = torch.randn(64, 256, device=DEV, dtype=dtype, requires_grad=True)
    wg = torch.randn(512, 256, device=DEV, dtype=dtype, requires_grad=True)
    wu = torch.randn(512, 256, device=DEV, dtype=dtype, requires_grad=True)
    dc = torch.randn(64, 512, device=DEV, dtype=dtype)
    a, b = x @ wg.t(), x @ wu.t()
    va, vb = a._version, b._version
    ref = _gated_ref(a, b, "silu")
    want = torch.autograd.grad(ref, (x, wg, wu), dc.float(), retain_graph=True)
    c = tt.TigonSiLUMulFunction.apply(a, b)
    ptr = a.data_ptr()
    da, db = torch.autograd.grad(c, (a, b), dc, retain_graph=True)
    assert da.data_ptr() == ptr and db.data_ptr() == b.data_ptr()  # written over a and b
    assert a._version > va and b._version > vb
    got = torch.autograd.grad((a, b), (x, wg, wu), (da, db))
    for g, e, name in zip(got, want, ("dx", "dWg", "dWu")):
        assert_rel(g, e, dtype, factor=2.0, what=name)
    # Another node that saved a: its backward raises rather than read the gradient written over a.
    a, b = x @ wg.t(), x @ wu.t()
    loss = (a * a).sum() + tt.TigonSiLUMulFunction.apply(a, b).float().sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    # Leaves, and views of leaves, are not overwritten.
    a0 = torch.randn(64, 512, device=DEV, dtype=dtype, requires_grad=True)
    b0 = torch.randn(64, 512, device=DEV, dtype=dtype, requires_grad=True)
    keep = (a0.detach().clone(), b0.detach().clone())
    tt.TigonSiLUMulFunction.apply(a0, b0).backward(dc)
    tt.TigonSiLUMulFunction.apply(a0.view(64, 512), b0[:, :]).backward(dc)
    assert torch.equal(a0.detach(), keep[0]) and torch.equal(b0.detach(), keep[1])


def test_swiglu_multipliers(ext, seed):
    a = torch.randn(8, 512, device=DEV, requires_grad=True)
    b = torch.randn(8, 512, device=DEV, requires_grad=True)
    c = tt.TigonSiLUMulFunction.apply(a, b, 0.5, 2.0)
    ref = _gated_ref(a, b, "silu", 0.5, 2.0)
    assert_elem(c, ref, torch.float32)
    dc = torch.randn_like(c)
    for g, e in zip(_grads(c, (a, b), dc), _grads(ref, (a, b), dc)):
        assert_rel(g, e, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_gate_up_matches_chunk(ext, seed, dtype):
    gu = torch.randn(3, 17, 2 * 768, device=DEV, dtype=dtype, requires_grad=True)
    c = tt.TigonFusedGateUpMulFunction.apply(gu, "silu")
    gate, up = gu.chunk(2, dim=-1)
    ref = _gated_ref(gate, up, "silu")
    assert_elem(c, ref.to(dtype), dtype)
    dc = torch.randn_like(c)
    assert_rel(torch.autograd.grad(c, gu, dc)[0], torch.autograd.grad(ref, gu, dc.float())[0], dtype)


def _mlp_ref(x, wg, wu, wd, act):
    """The MLP in fp32 from the same inputs: the reference for values and gradients."""
    a, b = x.float() @ wg.float().t(), x.float() @ wu.float().t()
    return _gated_ref(a, b, act) @ wd.float().t()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("shape", [(2, 9, 96), (37, 64)])
def test_gated_mlp_matches_reference(ext, seed, dtype, act, shape):
    hidden, inter = shape[-1], 160
    x = torch.randn(shape, device=DEV, dtype=dtype, requires_grad=True)
    ws = [(torch.randn(o, i, device=DEV, dtype=dtype) / i ** 0.5).requires_grad_()
          for o, i in ((inter, hidden), (inter, hidden), (hidden, inter))]
    y = tt.tigon_gated_mlp(x, *ws, act)
    ref = _mlp_ref(x, *ws, act)
    assert y.shape == x.shape and y.dtype == dtype
    assert_rel(y, ref, dtype, factor=2.0, what="y")
    dy = torch.randn_like(y)
    got = _grads(y, (x, *ws), dy)
    want = _grads(ref, (x, *ws), dy.float())
    for g, w, name in zip(got, want, ("dx", "dw_gate", "dw_up", "dw_down")):
        assert g.dtype == dtype and g.shape == w.shape
        assert_rel(g, w, dtype, factor=2.0, what=name)


def test_gated_mlp_output_takes_in_place_ops(ext, seed):
    """The output is a tensor of its own, not a view made inside the autograd function: an in-place op on
    it (Llama 4 adds the routed experts into the shared expert's output) is allowed, and the gradients
    are those of the output without it."""
    x = torch.randn(3, 5, 64, device=DEV, requires_grad=True)
    ws = [(torch.randn(o, i, device=DEV) / i ** 0.5).requires_grad_() for o, i in ((96, 64), (96, 64), (64, 96))]
    y = tt.tigon_gated_mlp(x, *ws)
    assert y.shape == x.shape and y._base is None
    y.add_(torch.randn_like(y))
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, *ws), dy)
    want = torch.autograd.grad(tt.tigon_gated_mlp(x, *ws), (x, *ws), dy)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_gated_mlp_backward_twice_and_frozen_weights(ext, seed):
    """The backward writes over no saved tensor: a retained graph gives the same gradients again; frozen
    weights get none, and x alone still gets its gradient."""
    x = torch.randn(5, 7, 64, device=DEV, requires_grad=True)
    ws = [(torch.randn(o, i, device=DEV) / i ** 0.5).requires_grad_() for o, i in ((96, 64), (96, 64), (64, 96))]
    y = tt.tigon_gated_mlp(x, *ws)
    dy = torch.randn_like(y)
    first = torch.autograd.grad(y, (x, *ws), dy, retain_graph=True)
    second = torch.autograd.grad(y, (x, *ws), dy)
    for f, s in zip(first, second):
        assert torch.equal(f, s)
    frozen = [w.detach() for w in ws]
    y2 = tt.tigon_gated_mlp(x, *frozen)
    (dx,) = torch.autograd.grad(y2, (x,), dy)
    assert torch.equal(dx, first[0])
    y3 = tt.tigon_gated_mlp(x.detach(), ws[0].detach(), ws[1].detach(), ws[2])  # only w_down trains
    (dwd,) = torch.autograd.grad(y3, (ws[2],), dy)
    assert torch.equal(dwd, first[3])
    y4 = tt.tigon_gated_mlp(x, *ws)
    (gx,) = torch.autograd.grad(y4, (x,), dy, create_graph=True)
    with pytest.raises(RuntimeError):  # once differentiable: a double backward raises
        gx.sum().backward()
    with pytest.raises(ValueError, match="gated MLP"):
        tt.tigon_gated_mlp(x, ws[0], ws[1], ws[0])


def test_gated_mlp_module_paths(ext, seed):
    """TigonSwiGLUMLP goes through the fused MLP without biases and keeps its projections with them, with
    the same values either way."""
    from types import SimpleNamespace

    from tigon_torch import functional as TF

    cfg = SimpleNamespace(hidden_size=64, intermediate_size=96, mlp_bias=False)
    m = tt.TigonSwiGLUMLP(cfg).to(DEV)
    x = torch.randn(3, 5, 64, device=DEV)
    assert TF.gated_mlp_fusable(m, x)
    ref = _mlp_ref(x, m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight, "silu")
    assert_rel(m(x), ref, torch.float32)
    handle = m.up_proj.register_forward_hook(lambda *_: None)
    assert not TF.gated_mlp_fusable(m, x)  # a hooked projection runs as a module
    assert_rel(m(x), ref, torch.float32)
    handle.remove()
    biased = tt.TigonSwiGLUMLP(SimpleNamespace(hidden_size=64, intermediate_size=96, mlp_bias=True)).to(DEV)
    assert not TF.gated_mlp_fusable(biased, x)
    assert not TF.gated_mlp_fusable(m, x.double())


# ------------------------------------------------------------------------------------------------
# Cross-entropy
# ------------------------------------------------------------------------------------------------


def _targets(rows, vocab, ignore_frac=0.2, ignore_index=-100):
    t = torch.randint(0, vocab, (rows,), device=DEV)
    t[torch.rand(rows, device=DEV) < ignore_frac] = ignore_index
    return t


def _ce_ref(logits, target, weight=None, ignore_index=-100, z=0.0, smoothing=0.0, reduction="mean", softcap=None):
    x = logits.float()
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    loss = F.cross_entropy(x, target, weight=weight, ignore_index=ignore_index, label_smoothing=smoothing,
                           reduction="none")
    valid = target != ignore_index
    lse = torch.logsumexp(x, dim=-1)
    zrow = z * lse * lse * valid
    rows = loss + zrow
    if reduction == "none":
        return rows, zrow
    if reduction == "sum":
        return rows.sum(), zrow.sum()
    denom = (weight[target.clamp_min(0)] * valid).sum() if weight is not None else valid.sum()
    return rows.sum() / denom, zrow.sum() / denom


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", ["plain", "weights_smoothing", "zloss_softcap"])
def test_cross_entropy_matches_torch(ext, seed, dtype, reduction, options):
    rows, vocab = 300, 32000
    logits = (torch.randn(rows, vocab, device=DEV) * 2).to(dtype).requires_grad_(True)
    target = _targets(rows, vocab)
    weight = smoothing = None
    z, cap, smoothing = 0.0, None, 0.0
    if options == "weights_smoothing":
        weight = torch.rand(vocab, device=DEV) + 0.5
        smoothing = 0.1
    elif options == "zloss_softcap":
        z, cap = 1e-4, 30.0
    loss, z_loss, acc, pred = tt.TigonCrossEntropyFunction.apply(
        logits, target, weight, -100, z, smoothing, reduction, cap, True, True, True)
    ref, zref = _ce_ref(logits, target, weight, -100, z, smoothing, reduction, cap)
    assert loss.dtype == dtype  # Liger's convention: the input's dtype
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(loss.float(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(z_loss.float(), zref, atol=tol, rtol=tol)
    valid = target != -100
    am = logits.float().argmax(-1)
    torch.testing.assert_close(pred, torch.where(valid, am, torch.full_like(am, -1)))
    correct = ((am == target) & valid).float()
    torch.testing.assert_close(acc, correct if reduction == "none" else correct.sum() / valid.sum())
    go = torch.rand_like(ref) + 0.5
    (g,) = torch.autograd.grad(loss, logits, go.to(loss.dtype))
    (g_ref,) = torch.autograd.grad(ref, logits, go.to(ref.dtype).to(loss.dtype).float())
    assert_rel(g, g_ref, dtype, factor=2.0, what="dlogits")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("upstream", ["one", "random"])
def test_cross_entropy_in_place_matches_out_of_place(ext, seed, dtype, reduction, upstream):
    """in_place=True: the same loss, and the same gradient after the upstream scaling (rows whose upstream
    gradient is 1 left as the forward wrote them); the gradient lives in the logits' own storage; a
    second backward through the graph raises instead of scaling twice."""
    rows, vocab = 67, 5003
    base = (torch.randn(rows, vocab, device=DEV) * 2).to(dtype)
    target = _targets(rows, vocab)
    ref_in = base.clone().requires_grad_(True)
    leaf = base.clone().requires_grad_(True)
    x = leaf * 1  # a non-leaf, as logits are: its storage is overwritten
    loss_ref = tt.tigon_cross_entropy(ref_in, target, reduction=reduction, label_smoothing=0.05)
    loss = tt.tigon_cross_entropy(x, target, reduction=reduction, label_smoothing=0.05, in_place=True)
    torch.testing.assert_close(loss, loss_ref, atol=0, rtol=0)
    if upstream == "one":
        go = torch.ones_like(loss_ref)
    else:
        go = (torch.rand(loss_ref.shape, device=DEV) + 0.5).to(loss.dtype)
        if reduction == "none":
            go[::3] = 1.0  # rows left as written, among scaled ones
    (g_ref,) = torch.autograd.grad(loss_ref, ref_in, go)
    (g,) = torch.autograd.grad(loss, x, go, retain_graph=True)
    assert g.data_ptr() == x.data_ptr()
    assert_rel(g, g_ref, dtype, what="in-place dlogits")
    if dtype == torch.float32:
        torch.testing.assert_close(g, g_ref, atol=1e-6, rtol=1e-5)
    with pytest.raises(RuntimeError, match="second backward"):
        torch.autograd.grad(loss, x, go)


def test_cross_entropy_in_place_edges(ext, seed):
    """in_place is ignored for float16 and with grad mode off; a node that saved the logits raises at its
    backward instead of reading the gradient; transposed logits (written through a copy) and zero rows
    still get the right gradient."""
    rows, vocab = 9, 301
    target = _targets(rows, vocab)
    x16 = torch.randn(rows, vocab, device=DEV).half().requires_grad_(True)
    before = x16.detach().clone()
    tt.tigon_cross_entropy(x16, target, in_place=True).backward()
    assert torch.equal(x16.detach(), before)
    x = torch.randn(rows, vocab, device=DEV).requires_grad_(True)
    before = x.detach().clone()
    with torch.no_grad():
        tt.tigon_cross_entropy(x, target, in_place=True)
    assert torch.equal(x.detach(), before)
    logits = torch.tanh(torch.randn(rows, vocab, device=DEV, requires_grad=True))  # tanh saves its output
    loss = tt.tigon_cross_entropy(logits, target, in_place=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    xt = torch.randn(vocab, rows, device=DEV).t().requires_grad_(True)
    ref = xt.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(tt.tigon_cross_entropy(xt, target, in_place=True), xt)
    (g_ref,) = torch.autograd.grad(tt.tigon_cross_entropy(ref, target), ref)
    torch.testing.assert_close(g, g_ref, atol=1e-6, rtol=1e-5)
    x0 = torch.randn(0, vocab, device=DEV, requires_grad=True)
    for reduction in ("mean", "sum", "none"):
        (g0,) = torch.autograd.grad(tt.tigon_cross_entropy(x0, target[:0], reduction=reduction, in_place=True).sum(),
                                    x0)
        assert g0.shape == (0, vocab)


def test_cross_entropy_all_ignored_and_modules(ext, seed):
    logits = torch.randn(8, 1000, device=DEV, requires_grad=True)
    target = torch.full((8,), -100, device=DEV)
    loss = tt.TigonCrossEntropyLoss()(logits, target)
    assert float(loss.detach()) == 0.0
    loss.backward()
    assert float(logits.grad.abs().max()) == 0.0


# ------------------------------------------------------------------------------------------------
# Fused linear cross-entropy
# ------------------------------------------------------------------------------------------------


def _flce_ref(x, w, target, b=None, **kw):
    logits = x.float() @ w.float().t()
    if b is not None:
        logits = logits + b.float()
    return _ce_ref(logits, target, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [0, 96])
def test_fused_linear_cross_entropy_matches_reference(ext, seed, monkeypatch, dtype, reduction, bias, chunk):
    monkeypatch.setenv("TIGON_TORCH_LCE_CHUNK", str(chunk))
    tokens, hidden, vocab = 300, 256, 32000
    x = (torch.randn(tokens, hidden, device=DEV) * 0.5).to(dtype).requires_grad_(True)
    w = (torch.randn(vocab, hidden, device=DEV) * 0.05).to(dtype).requires_grad_(True)
    b = (torch.randn(vocab, device=DEV) * 0.1).to(dtype).requires_grad_(True) if bias else None
    target = _targets(tokens, vocab)
    loss, _, _, _ = tt.TigonFusedLinearCrossEntropyFunction.apply(x, w, target, b, None, -100, 0.0, 0.0, reduction)
    ref, _ = _flce_ref(x, w, target, b, reduction=reduction)
    assert loss.dtype == torch.float32
    tol = 2e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(loss, ref, atol=tol, rtol=tol)
    go = torch.rand_like(ref) + 0.5
    inputs = [t for t in (x, w, b) if t is not None]
    got = _grads(loss, inputs, go)
    want = _grads(ref, inputs, go)
    for g, e, name in zip(got, want, ("dx", "dW", "dB")):
        assert g.dtype == dtype
        assert_rel(g, e, dtype, factor=3.0, what=name)


def test_fused_linear_cross_entropy_softcap_zloss_smoothing(ext, seed):
    tokens, hidden, vocab = 200, 128, 5000
    x = torch.randn(tokens, hidden, device=DEV, requires_grad=True)
    w = (torch.randn(vocab, hidden, device=DEV) * 0.1).requires_grad_(True)
    target = _targets(tokens, vocab)
    cw = torch.rand(vocab, device=DEV) + 0.5
    out = tt.tigon_fused_linear_cross_entropy(x, w, target, None, cw, -100, 1e-4, 0.1, "mean", 20.0, True,
                                              return_token_accuracy=True)
    ref, zref = _flce_ref(x, w, target, None, weight=cw, z=1e-4, smoothing=0.1, softcap=20.0)
    torch.testing.assert_close(out[0], ref, atol=1e-4, rtol=1e-4)
    got = _grads(out[0], (x, w), None)
    want = _grads(ref, (x, w), None)
    for g, e in zip(got, want):
        assert_rel(g, e, torch.float32, factor=5.0)


@pytest.mark.cuda_only
def test_fused_linear_cross_entropy_autocast(ext, seed):
    """fp32 parameters under bf16 autocast: the op runs in bf16 like the unfused head's matmul, and the
    gradients come back in the parameters' dtype."""
    x = torch.randn(128, 256, device=DEV, requires_grad=True)
    w = (torch.randn(8000, 256, device=DEV) * 0.05).requires_grad_(True)
    target = _targets(128, 8000)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = tt.tigon_fused_linear_cross_entropy(x, w, target)
        ref = F.cross_entropy((x @ w.t()).float(), target)
    torch.testing.assert_close(loss, ref, atol=2e-2, rtol=2e-2)
    gx, gw = _grads(loss, (x, w), None)
    rx, rw = _grads(ref, (x, w), None)
    assert gx.dtype == torch.float32 and gw.dtype == torch.float32
    assert_rel(gx, rx, torch.bfloat16, factor=2.0)
    assert_rel(gw, rw, torch.bfloat16, factor=2.0)


# ------------------------------------------------------------------------------------------------
# Errors, host synchronisation
# ------------------------------------------------------------------------------------------------


@pytest.mark.cuda_only
def test_tigon_status_becomes_python_exception(ext):
    x = torch.randn(4, 64, device=DEV)
    target = torch.randint(0, 64, (4,), device=DEV)
    with pytest.raises(ValueError, match=r"tigon::cross_entropy.*label_smoothing"):
        tt.TigonCrossEntropyFunction.apply(x, target, None, -100, 0.0, 1.5)
    with pytest.raises(ValueError, match=r"tigon::rms_norm_forward.*eps"):
        tt.TigonRMSNormFunction.apply(x, None, -1.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        tt.TigonFusedLinearCrossEntropyFunction.apply(x, torch.randn(64, 64, device=DEV), target, None, None,
                                                      -100, 0.0, 1.5, "mean", None, False, None, True)
    with pytest.raises(ValueError, match="CUDA"):
        tt.TigonRMSNormFunction.apply(torch.randn(4, 64), None, 1e-6)
    with pytest.raises(TypeError):
        tt.TigonRMSNormFunction.apply(x, torch.ones(64, device=DEV, dtype=torch.bfloat16), 1e-6)


@pytest.mark.cuda_only
def test_no_host_synchronisation(ext, seed):
    """Forward and backward of every function with CUDA's sync debug mode set to error."""
    dev = DEV
    x = torch.randn(64, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn_like(x, requires_grad=True)
    w = torch.ones(1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
    q = torch.randn(2, 8, 16, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 2, 16, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = _tables(2, 16, 64, torch.bfloat16)
    head = torch.randn(4000, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
    target = _targets(64, 4000)

    def step():
        total = tt.tigon_rms_norm(x, w).float().sum()
        total = total + tt.tigon_layer_norm(x, w, None).float().sum()
        y, s = tt.tigon_fused_add_rms_norm(x, r, w)
        total = total + y.float().sum() + s.float().sum()
        qo, ko = tt.tigon_rope(q, k, cos, sin)
        total = total + qo.float().sum() + ko.float().sum()
        total = total + tt.tigon_swiglu(x, r).float().sum() + tt.tigon_geglu(x, r).float().sum()
        logits = x @ head.t()
        total = total + tt.tigon_cross_entropy(logits, target).float()
        out = tt.tigon_cross_entropy(logits, target, return_token_accuracy=True, return_predicted_tokens=True)
        total = total + out[0].float()
        total = total + tt.tigon_fused_linear_cross_entropy(x, head, target)
        total = total + tt.tigon_fused_linear_cross_entropy(x, head, target, reduction="none").sum()
        total.backward()

    step()  # first calls: device queries, cuBLASLt plans
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def _compile_cases():
    def rope(x, w, head, target):
        q = x.view(2, 16, 4, 128).transpose(1, 2)
        k = (x * 2).view(2, 16, 4, 128)[:, :, :2].transpose(1, 2)
        cos, sin = _tables(1, 16, 128, x.dtype)
        qo, ko = tt.tigon_rope(q, k, cos, sin)
        return qo.sum() + (ko * ko).sum()

    return {
        "rms_norm": lambda x, w, head, target: (tt.tigon_rms_norm(x, w[:512], 1e-6, 1.0, "gemma") ** 2).sum(),
        "layer_norm": lambda x, w, head, target: (tt.tigon_layer_norm(x, w[:512], w[512:]) ** 2).sum(),
        "add_rms_norm": lambda x, w, head, target: sum(
            (o ** 2).sum() for o in tt.tigon_fused_add_rms_norm(x, x * 0.5, w[:512])),
        "rope": rope,
        "swiglu": lambda x, w, head, target: (tt.tigon_swiglu(x, x * w[:512], 0.5, 2.0) ** 2).sum(),
        "geglu": lambda x, w, head, target: (tt.tigon_geglu(x, x * w[:512]) ** 2).sum(),
        "fused_gate_up": lambda x, w, head, target: (tt.tigon_fused_gate_up(x * w[:512]) ** 2).sum(),
        "cross_entropy": lambda x, w, head, target: tt.tigon_cross_entropy(x @ head.t(), target, softcap=20.0),
        "cross_entropy_none": lambda x, w, head, target: (
            tt.tigon_cross_entropy(x @ head.t(), target, reduction="none") * w[:32]).sum(),
        "fused_linear_cross_entropy": lambda x, w, head, target: tt.tigon_fused_linear_cross_entropy(
            tt.tigon_rms_norm(x, w[:512], 1e-6, 0.0, "llama", False), head, target),
        "fused_linear_cross_entropy_none": lambda x, w, head, target: (
            tt.tigon_fused_linear_cross_entropy(x, head, target, reduction="none") * w[:32]).sum(),
    }


@pytest.mark.parametrize("case,backend", [(c, "aot_eager") for c in _compile_cases()] +
                         [("fused_linear_cross_entropy", "inductor"), ("rope", "inductor")])
def test_torch_compile(ext, seed, case, backend):
    """Each function inside torch.compile (operators with fake kernels; Dynamo and AOTAutograd with the
    aot_eager backend, and two cases through Inductor): the value and every gradient equal eager's."""
    f = _compile_cases()[case]
    x = torch.randn(32, 512, device=DEV, requires_grad=True)
    w = (torch.rand(1024, device=DEV) + 0.5).requires_grad_(True)
    head = (torch.randn(1000, 512, device=DEV) * 0.05).requires_grad_(True)
    target = _targets(32, 1000)
    eager = f(x, w, head, target)
    ge = torch.autograd.grad(eager, (x, w, head), allow_unused=True)
    torch._dynamo.reset()
    compiled = torch.compile(f, backend=backend)(x, w, head, target)
    gc = torch.autograd.grad(compiled, (x, w, head), allow_unused=True)
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)
    for a, b, name in zip(gc, ge, ("dx", "dw", "dhead")):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{case} {n}: {m}")


@pytest.mark.parametrize("heads", [None, 2])
def test_linear_cross_entropy_fp16_sum_gradients_past_fp16_range(ext, heads):
    """fp16 weights, reduction "sum": dW and dB before the upstream scale exceed fp16's range (1024
    tokens of one target, inputs of 100), the scaled gradients do not; they come back finite and equal
    to the fp32 computation scaled the same way."""
    torch.manual_seed(0)
    tokens, hidden, vocab = 1024, 16, 8
    x = torch.full((tokens, hidden), 100.0, device=DEV)
    w32 = torch.randn(vocab, hidden, device=DEV) * 1e-3
    b32 = torch.zeros(vocab, device=DEV)
    target = torch.zeros(tokens, dtype=torch.long, device=DEV)
    scale = 1e-3

    def grads(dtype):
        w = w32.clone().to(dtype).requires_grad_(True)
        b = b32.clone().to(dtype).requires_grad_(True)
        xs = x.to(dtype)
        if heads is None:
            loss = tt.tigon_fused_linear_cross_entropy(xs, w, target, bias=b, reduction="sum")
        else:  # the heads share one weight and bias: their gradients add up
            loss = tt.TigonFusedLinearMultiHeadCrossEntropyLoss(reduction="sum")(
                [w] * heads, xs, target.expand(heads, tokens), biases=[b] * heads)
        (loss * scale).backward()
        return [w.grad, b.grad]

    want = grads(torch.float32)
    assert max(float(g.abs().max()) for g in want) / scale > torch.finfo(torch.float16).max  # unscaled: past fp16
    for got, ref in zip(grads(torch.float16), want):
        assert got is not None and got.dtype == torch.float16, got
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.float(), ref, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 7, 128), (3, 1000), (4, 24576), (5, 0)])
def test_relu_squared_matches_hf_bitwise(ext, seed, dtype, shape):
    """Nemotron's activation (transformers' ReLUSquaredActivation: relu, then square): the value and
    the gradient equal autograd's through those two ops bit for bit in every dtype."""
    from transformers.activations import ReLUSquaredActivation

    x = (torch.randn(shape, device=DEV) * 3).to(dtype)
    x[..., :1] = 0.0  # the kink
    dy = torch.randn(shape, device=DEV).to(dtype)
    a, b = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    want = ReLUSquaredActivation()(a)
    got = tt.tigon_relu_squared(b)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, want)
    want.backward(dy)
    got.backward(dy)
    assert torch.equal(b.grad, a.grad)


def test_relu_squared_strided_input(ext, seed):
    """A column slice (rows apart by more than their width) reads through its strides."""
    base = torch.randn(6, 300, device=DEV, dtype=torch.bfloat16)
    x = base[:, 20:276].requires_grad_(False)
    got = tt.tigon_relu_squared(x)
    assert torch.equal(got, torch.square(torch.relu(x)))

"""Port of Liger-Kernel 0.8.2's test/transformers/test_swiglu.py onto tigon_torch.

Same shapes, dtypes, multipliers and (atol, rtol) as Liger's. References: Hugging Face's LlamaMLP,
Phi3MLP and MixtralExperts (eager), and PyTorch formulas written here for the Mixtral block-sparse
expert MLP (a module of transformers < 5), Falcon-H1's multiplier MLP and the functional cases. The
tigon side is TigonSwiGLUMLP / TigonPhi3MLP, or the same projections around tigon_swiglu /
TigonSiLUMulFunction where tigon has no module of its own (Mixtral's experts: the eager loop with
tigon's SwiGLU; Liger's own fused MoE kernel has no tigon counterpart). Liger's Blackwell test (its
tiled kernel against its one-row kernel, bit for bit) becomes: the same wide rows give bit-identical
results whether launched together or one row at a time, and match the formula. The DTensor cases need
4 or 8 GPUs and are skipped with fewer.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import DEVICE, REFERENCE
from liger_helpers import assert_close

import tigon_torch as tt

pytestmark = pytest.mark.gpu

MLP_SHAPES = [(2, 256, 256, 512), (6, 42, 123, 431)]
MLP_TOLS = [(torch.float32, 1e-0, 1e-5), (torch.bfloat16, 1e4, 1e-2)]


def _llama_config(hidden, inter, act="silu"):
    from transformers.models.llama.configuration_llama import LlamaConfig

    # one attention head of an even head_dim: newer transformers releases validate the attention shape
    return LlamaConfig(hidden_size=hidden, intermediate_size=inter, hidden_act=act, num_attention_heads=1,
                       num_key_value_heads=1, head_dim=8)


def _compare_mlps(ref, mine, x, pairs, atol, rtol):
    """ref(x) against mine(x) forward, and the gradients of x and of each (ref parameter, my parameter)."""
    x1 = x.clone().requires_grad_(True)
    x2 = x.clone().requires_grad_(True)
    y1, y2 = ref(x1), mine(x2)
    assert_close(y2, y1, atol, rtol, "y")
    dy = torch.randn_like(y1)
    y1.backward(dy.clone(), retain_graph=True)
    y2.backward(dy.clone(), retain_graph=True)
    for name, p_ref, p_mine in pairs:
        assert_close(p_mine.grad, p_ref.grad, atol, rtol, f"d{name}")
    assert_close(x2.grad, x1.grad, atol, rtol, "dx")


@pytest.mark.parametrize("bsz, seq_len, hidden_size, intermediate_size", MLP_SHAPES)
@pytest.mark.parametrize("dtype, atol, rtol", MLP_TOLS)
def test_correctness_llamamlp(ext, seed, bsz, seq_len, hidden_size, intermediate_size, dtype, atol, rtol):
    from transformers.models.llama.modeling_llama import LlamaMLP

    x = torch.randn(bsz, seq_len, hidden_size, device=DEVICE, dtype=dtype)
    G = torch.randn(hidden_size, intermediate_size, device=DEVICE, dtype=dtype)
    U = torch.randn(hidden_size, intermediate_size, device=DEVICE, dtype=dtype)
    D = torch.randn(intermediate_size, hidden_size, device=DEVICE, dtype=dtype)
    config = _llama_config(hidden_size, intermediate_size)
    ref = LlamaMLP(config=config).to(DEVICE).to(dtype)
    mine = tt.TigonSwiGLUMLP(config=config).to(DEVICE).to(dtype)
    for m in (ref, mine):
        m.gate_proj.weight.data = G.T
        m.up_proj.weight.data = U.T
        m.down_proj.weight.data = D.T
    pairs = [(n, getattr(ref, n).weight, getattr(mine, n).weight) for n in ("gate_proj", "up_proj", "down_proj")]
    _compare_mlps(ref, mine, x, pairs, atol, rtol)


class _BlockSparseTop2MLP(nn.Module):
    """Mixtral's per-expert MLP of transformers < 5: w2(act(w1(x)) * w3(x)), act = silu or tigon's SwiGLU."""

    def __init__(self, hidden, inter, tigon):
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)
        self.tigon = tigon

    def forward(self, x):
        if self.tigon:
            return self.w2(tt.TigonSiLUMulFunction.apply(self.w1(x), self.w3(x)))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


@pytest.mark.parametrize("bsz, seq_len, hidden_size, intermediate_size", MLP_SHAPES)
@pytest.mark.parametrize("dtype, atol, rtol", MLP_TOLS)
def test_correctness_mixtralblocksparsetop2mlp(ext, seed, bsz, seq_len, hidden_size, intermediate_size, dtype,
                                               atol, rtol):
    x = torch.randn(bsz, seq_len, hidden_size, device=DEVICE, dtype=dtype)
    G = torch.randn(hidden_size, intermediate_size, device=DEVICE, dtype=dtype)
    U = torch.randn(intermediate_size, hidden_size, device=DEVICE, dtype=dtype)
    D = torch.randn(hidden_size, intermediate_size, device=DEVICE, dtype=dtype)
    ref = _BlockSparseTop2MLP(hidden_size, intermediate_size, tigon=False).to(DEVICE).to(dtype)
    mine = _BlockSparseTop2MLP(hidden_size, intermediate_size, tigon=True).to(DEVICE).to(dtype)
    for m in (ref, mine):
        m.w1.weight.data = G.T
        m.w2.weight.data = U.T
        m.w3.weight.data = D.T
    pairs = [(n, getattr(ref, n).weight, getattr(mine, n).weight) for n in ("w1", "w2", "w3")]
    _compare_mlps(ref, mine, x, pairs, atol, rtol)


def _experts_forward(x, gate_up, down, top_k_index, top_k_weights, act):
    """Hugging Face's eager MixtralExperts loop with the gated activation act(gate, up)."""
    num_experts = gate_up.shape[0]
    out = torch.zeros_like(x)
    with torch.no_grad():
        mask = F.one_hot(top_k_index, num_classes=num_experts).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit:
        e = int(e[0])
        pos, tok = torch.where(mask[e])
        gate, up = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
        h = F.linear(act(gate, up), down[e]) * top_k_weights[tok, pos, None]
        out.index_add_(0, tok, h.to(out.dtype))
    return out


@pytest.mark.parametrize("bsz, seq_len, hidden_size, intermediate_size", MLP_SHAPES)
@pytest.mark.parametrize("dtype, atol, rtol", [(torch.float32, 30, 5e-2), (torch.bfloat16, 100.0, 5e-2)])
def test_correctness_mixtralexperts(ext, seed, bsz, seq_len, hidden_size, intermediate_size, dtype, atol, rtol):
    try:
        from transformers.models.mixtral.configuration_mixtral import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    except ImportError:
        pytest.skip("transformers has no MixtralExperts (before 5.0)")
    num_experts, top_k = 8, 2
    config = MixtralConfig(num_local_experts=num_experts, hidden_size=hidden_size, intermediate_size=intermediate_size,
                           experts_implementation="eager", hidden_act="silu", num_experts_per_tok=top_k)
    x = torch.randn(bsz * seq_len, hidden_size, device=DEVICE, dtype=dtype)
    GU = torch.randn(num_experts, 2 * intermediate_size, hidden_size, device=DEVICE, dtype=dtype)
    D = torch.randn(num_experts, hidden_size, intermediate_size, device=DEVICE, dtype=dtype)
    router = torch.randn(bsz * seq_len, num_experts, device=DEVICE, dtype=dtype).softmax(dim=-1)
    top_k_weights, top_k_index = router.topk(k=top_k, dim=-1)
    top_k_weights = top_k_weights / (top_k_weights.sum(dim=-1, keepdim=True) + 1e-9)

    ref = MixtralExperts(config=config).to(DEVICE).to(dtype)
    ref.gate_up_proj.data = GU.clone()
    ref.down_proj.data = D.clone()
    gu2 = GU.clone().requires_grad_(True)
    d2 = D.clone().requires_grad_(True)
    x1 = x.clone().requires_grad_(True)
    x2 = x.clone().requires_grad_(True)

    y1 = ref(x1, top_k_index, top_k_weights)
    y2 = _experts_forward(x2, gu2, d2, top_k_index, top_k_weights, tt.tigon_swiglu)
    assert_close(y2, y1, atol, rtol, "y")
    dy = torch.randn_like(y1)
    y1.backward(dy.clone())
    y2.backward(dy.clone())
    assert_close(gu2.grad, ref.gate_up_proj.grad, atol, rtol, "dgate_up_proj")
    assert_close(d2.grad, ref.down_proj.grad, atol, rtol, "ddown_proj")
    assert_close(x2.grad, x1.grad, atol, rtol, "dx")


@pytest.mark.parametrize("bsz, seq_len, hidden_size, intermediate_size", MLP_SHAPES)
@pytest.mark.parametrize("dtype, atol, rtol", MLP_TOLS)
def test_correctness_phi3mlp(ext, seed, bsz, seq_len, hidden_size, intermediate_size, dtype, atol, rtol):
    from transformers.models.phi3.configuration_phi3 import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3MLP

    config = Phi3Config(hidden_size=hidden_size, intermediate_size=intermediate_size, hidden_act="silu",
                        num_attention_heads=1, num_key_value_heads=1)
    x = torch.randn(bsz, seq_len, hidden_size, device=DEVICE, dtype=dtype)
    GU = torch.randn(hidden_size, intermediate_size * 2, device=DEVICE, dtype=dtype)
    D = torch.randn(intermediate_size, hidden_size, device=DEVICE, dtype=dtype)
    ref = Phi3MLP(config=config).to(DEVICE).to(dtype)
    mine = tt.TigonPhi3MLP(config=config).to(DEVICE).to(dtype)
    for m in (ref, mine):
        m.gate_up_proj.weight.data = GU.T
        m.down_proj.weight.data = D.T
    pairs = [(n, getattr(ref, n).weight, getattr(mine, n).weight) for n in ("gate_up_proj", "down_proj")]
    _compare_mlps(ref, mine, x, pairs, atol, rtol)


def silu_mul_ref(a, b, gate_multiplier=1.0, down_multiplier=1.0):
    """down_multiplier * silu(gate_multiplier * a) * b in fp32, rounded once to a's dtype."""
    af, bf = a.float(), b.float()
    return (F.silu(af * gate_multiplier) * bf * down_multiplier).to(a.dtype)


@pytest.mark.parametrize("bsz, seq_len, size", [(2, 8, 8), (9, 7, 41)])
@pytest.mark.parametrize("dtype, atol, rtol", [(torch.float32, 1e-0, 1e-5), (torch.bfloat16, 1e4, 1e-2)])
def test_correctness_functional(ext, seed, bsz, seq_len, size, dtype, atol, rtol):
    a = torch.randn(bsz, seq_len, size, device=DEVICE, dtype=dtype)
    b = torch.randn(bsz, seq_len, size, device=DEVICE, dtype=dtype)
    a0, b0 = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    a1, b1 = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    a2, b2 = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    y0 = silu_mul_ref(a0, b0)
    y1 = tt.tigon_swiglu(a=a1, b=b1)
    y2 = tt.TigonSiLUMulFunction.apply(a2, b2)
    assert_close(y1, y0, atol, rtol, "functional y")
    assert_close(y2, y0, atol, rtol, "Function y")
    grad = torch.randn_like(y0)
    for y in (y0, y1, y2):
        y.backward(grad.clone())
    for name, got, want in (("functional da", a1.grad, a0.grad), ("functional db", b1.grad, b0.grad),
                            ("Function da", a2.grad, a0.grad), ("Function db", b2.grad, b0.grad)):
        assert_close(got, want, atol, rtol, name)


@pytest.mark.parametrize("bsz, seq_len, size", [(2, 8, 8), (9, 7, 41)])
@pytest.mark.parametrize("gate_multiplier, down_multiplier", [(0.7, 1.3), (1.5, 0.5), (1.0, 1.0)])
@pytest.mark.parametrize("dtype, atol, rtol", [(torch.float32, 1e-3, 1e-5), (torch.bfloat16, 1e-1, 1e-2)])
def test_correctness_silumul_with_multipliers(ext, seed, bsz, seq_len, size, gate_multiplier, down_multiplier,
                                              dtype, atol, rtol):
    a = torch.randn(bsz, seq_len, size, device=DEVICE, dtype=dtype)
    b = torch.randn(bsz, seq_len, size, device=DEVICE, dtype=dtype)
    a1, b1 = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    a2, b2 = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    y_ref = silu_mul_ref(a1, b1, gate_multiplier, down_multiplier)
    y = tt.TigonSiLUMulFunction.apply(a2, b2, gate_multiplier, down_multiplier)
    assert_close(y, y_ref, atol, rtol, "y")
    grad = torch.randn_like(y_ref)
    y_ref.backward(grad.clone())
    y.backward(grad.clone())
    assert_close(a2.grad, a1.grad, atol, rtol, "da")
    assert_close(b2.grad, b1.grad, atol, rtol, "db")


def test_silumul_default_multipliers_backward_compat(ext, seed):
    """TigonSiLUMulFunction.apply(a, b) is exactly apply(a, b, 1.0, 1.0)."""
    a = torch.randn(4, 16, 32, device=DEVICE, dtype=torch.float32)
    b = torch.randn(4, 16, 32, device=DEVICE, dtype=torch.float32)
    a1, b1 = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    a2, b2 = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    y1 = tt.TigonSiLUMulFunction.apply(a1, b1)
    y2 = tt.TigonSiLUMulFunction.apply(a2, b2, 1.0, 1.0)
    torch.testing.assert_close(y1, y2, atol=0, rtol=0)
    grad = torch.randn_like(y1)
    y1.backward(grad.clone())
    y2.backward(grad.clone())
    torch.testing.assert_close(a1.grad, a2.grad, atol=0, rtol=0)
    torch.testing.assert_close(b1.grad, b2.grad, atol=0, rtol=0)


class _FalconH1MLP(nn.Module):
    """Falcon-H1's MLP: down_proj(silu(gate_proj(x) * gm) * up_proj(x)) * dm, in PyTorch or, with
    tigon=True, the gated product through TigonSiLUMulFunction with both multipliers."""

    def __init__(self, hidden, inter, gate_multiplier, down_multiplier, tigon):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.gm, self.dm, self.tigon = gate_multiplier, down_multiplier, tigon

    def forward(self, x):
        if self.tigon:
            return self.down_proj(tt.TigonSiLUMulFunction.apply(self.gate_proj(x), self.up_proj(x), self.gm, self.dm))
        return self.down_proj(F.silu(self.gate_proj(x) * self.gm) * self.up_proj(x)) * self.dm


@pytest.mark.parametrize("bsz, seq_len, hidden_size, intermediate_size", MLP_SHAPES)
@pytest.mark.parametrize("gate_multiplier, down_multiplier", [(0.7, 1.3), (1.5, 0.5)])
@pytest.mark.parametrize("dtype, atol, rtol", MLP_TOLS)
def test_correctness_falcon_h1_mlp(ext, seed, bsz, seq_len, hidden_size, intermediate_size, gate_multiplier,
                                   down_multiplier, dtype, atol, rtol):
    x = torch.randn(bsz, seq_len, hidden_size, device=DEVICE, dtype=dtype)
    G = torch.randn(hidden_size, intermediate_size, device=DEVICE, dtype=dtype)
    U = torch.randn(hidden_size, intermediate_size, device=DEVICE, dtype=dtype)
    D = torch.randn(intermediate_size, hidden_size, device=DEVICE, dtype=dtype)
    ref = _FalconH1MLP(hidden_size, intermediate_size, gate_multiplier, down_multiplier, False).to(DEVICE).to(dtype)
    mine = _FalconH1MLP(hidden_size, intermediate_size, gate_multiplier, down_multiplier, True).to(DEVICE).to(dtype)
    for m in (ref, mine):
        m.gate_proj.weight.data = G.T.contiguous()
        m.up_proj.weight.data = U.T.contiguous()
        m.down_proj.weight.data = D.T.contiguous()
    pairs = [(n, getattr(ref, n).weight, getattr(mine, n).weight) for n in ("gate_proj", "up_proj", "down_proj")]
    _compare_mlps(ref, mine, x, pairs, atol, rtol)


def _dtensor_worker(rank, world_size, bsz, seq_len, hidden_size, dtype, atol, rtol, file_name):
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
        torch.manual_seed(0)
        a = torch.randn(bsz, seq_len, hidden_size, device=device, dtype=dtype)
        b = torch.randn(bsz, seq_len, hidden_size, device=device, dtype=dtype)
        a1, b1 = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
        da = distribute_tensor(a1, device_mesh=mesh, placements=[Shard(2)])
        db = distribute_tensor(b1, device_mesh=mesh, placements=[Shard(2)])
        a2, b2 = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
        c1 = tt.TigonSiLUMulFunction.apply(da, db)
        c2 = silu_mul_ref(a2, b2)
        assert_close(c1.full_tensor(), c2, atol, rtol, "c")
        grad = torch.randn_like(c2)
        c1.backward(distribute_tensor(grad, device_mesh=mesh, placements=[Shard(2)]))
        c2.backward(grad)
        assert_close(da.grad.full_tensor(), a2.grad, atol, rtol, "da")
        assert_close(db.grad.full_tensor(), b2.grad, atol, rtol, "db")
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda_only
@pytest.mark.parametrize("world_size, bsz, seq_len, hidden_size", [(4, 2, 2, 8), (8, 9, 7, 64)])
@pytest.mark.parametrize("dtype, atol, rtol", [(torch.float32, 1e-4, 1e-6), (torch.bfloat16, 2e-1, 2e-2)])
def test_dtensor_tigon_silumul(ext, tmp_path, world_size, bsz, seq_len, hidden_size, dtype, atol, rtol):
    if REFERENCE or torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs")
    import torch.multiprocessing as mp

    mp.spawn(_dtensor_worker, args=(world_size, bsz, seq_len, hidden_size, dtype, atol, rtol,
                                    str(tmp_path / "store")), nprocs=world_size, join=True)


@pytest.mark.parametrize("n_rows, n_cols", [(4, 11009), (3, 14337), (4, 16384)])
@pytest.mark.parametrize("gate_multiplier", [1.0, 1.3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_wide_rows_launch_invariant(ext, n_rows, n_cols, gate_multiplier, dtype):
    torch.manual_seed(0)
    a = torch.randn(n_rows, n_cols, device=DEVICE, dtype=dtype)
    b = torch.randn(n_rows, n_cols, device=DEVICE, dtype=dtype)
    dc = torch.randn(n_rows, n_cols, device=DEVICE, dtype=dtype)

    def run(a_, b_, dc_):
        a_ = a_.clone().requires_grad_(True)
        b_ = b_.clone().requires_grad_(True)
        c = tt.TigonSiLUMulFunction.apply(a_, b_, gate_multiplier)
        c.backward(dc_)
        return c.detach(), a_.grad, b_.grad

    whole = run(a, b, dc)
    if not REFERENCE:  # (the CPU reference kernels' vectorised loops round their tails differently)
        rows = [run(a[i:i + 1].clone(), b[i:i + 1].clone(), dc[i:i + 1].clone()) for i in range(n_rows)]
        for j, name in enumerate(("c", "da", "db")):
            torch.testing.assert_close(whole[j], torch.cat([r[j] for r in rows]), atol=0, rtol=0,
                                       msg=lambda m, name=name: f"{name}, whole batch vs one row at a time: {m}")

    atol, rtol = (1e-3, 1e-5) if dtype == torch.float32 else (1e-1, 1e-2)
    a1, b1 = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    c_ref = silu_mul_ref(a1, b1, gate_multiplier)
    c_ref.backward(dc)
    assert_close(whole[0], c_ref, atol, rtol, "c")
    assert_close(whole[1], a1.grad, atol, rtol, "da")
    assert_close(whole[2], b1.grad, atol, rtol, "db")

"""The public API: the package importable without a GPU or the compiled operators, the layout helpers,
and the Liger-Kernel contract beyond signatures (tests/test_liger_signatures.py compares those):
return types, module defaults and parameters, the patch functions' switches, and the eager check of
out-of-range targets."""

from __future__ import annotations

import copy
import inspect
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE, REFERENCE

import tigon_torch as tt
from tigon_torch import ops, patch


def test_rotary_pos_emb_takes_hugging_face_calls():
    """tigon_rotary_pos_emb has Liger's signature (q, k, cos, sin, position_ids=None, unsqueeze_dim=1) and
    takes every call of Hugging Face's apply_rotary_pos_emb, which the patches replace with it: the same
    leading positional parameters, and each of Hugging Face's parameters by name with its default."""
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    hf_fn = apply_rotary_pos_emb
    if isinstance(hf_fn, torch.nn.Module):
        # With the `kernels` package, transformers (5.25 and later) wraps the function in a module whose
        # forward takes (*args, **kwargs) and calls the function it closes over.
        hf_fn = next(c.cell_contents for c in type(hf_fn).forward.__closure__ if inspect.isfunction(c.cell_contents))
    hf = list(inspect.signature(hf_fn).parameters.values())
    ours = inspect.signature(tt.tigon_rotary_pos_emb).parameters
    assert [p.name for p in hf[:4]] == list(ours)[:4]
    for p in hf:
        assert p.name in ours and ours[p.name].default == p.default, p.name


def test_casting_modes_and_reductions():
    assert [ops.casting_mode(m) for m in ("llama", "gemma", "none", 0, 1, 2)] == [0, 1, 2, 0, 1, 2]
    with pytest.raises(ValueError):
        ops.casting_mode("fp32")
    assert ops.reduction_code("mean") == 2
    with pytest.raises(ValueError):
        ops.reduction_code("avg")


@pytest.mark.parametrize("make", [
    lambda: torch.randn(2, 5, 8),
    lambda: torch.randn(2, 5, 3, 8).transpose(1, 2),  # [B, H, T, D] view of [B, T, H, D]
    lambda: torch.randn(4, 6, 16)[..., :8],  # strided rows (Phi-3's gate half)
    lambda: torch.randn(8).expand(3, 4, 8),  # row stride 0: must be copied
    lambda: torch.randn(7),
])
def test_row_layouts(make):
    t = make()
    order = ops.row_order(t)
    rows = ops.as_rows(t, order)
    assert rows.dim() == 2 and rows.shape[1] == t.shape[-1]
    assert rows.shape[1] == 1 or rows.stride(1) == 1
    assert rows.shape[0] <= 1 or rows.stride(0) >= rows.shape[1]
    buf, out = ops.empty_rows(t.shape, order, t.dtype, t.device)
    buf.copy_(rows)
    torch.testing.assert_close(out, t)  # same values, element for element
    assert out.shape == t.shape
    torch.testing.assert_close(ops.rows_as(buf, t.shape, order), t)


def test_transposed_view_is_not_copied():
    base = torch.randn(2, 5, 3, 8)
    t = base.transpose(1, 2)
    rows = ops.as_rows(t, ops.row_order(t))
    assert rows.data_ptr() == base.data_ptr()
    gate = torch.randn(4, 6, 16)[..., :8]
    rows = ops.as_rows(gate, ops.row_order(gate))
    assert rows.stride(0) == 16 and rows.data_ptr() == gate.data_ptr()


@pytest.mark.skipif(REFERENCE, reason="the CPU reference mode routes CPU tensors to its operators once they are "
                    "installed, so whether this raises depends on the order the tests run in")
def test_functions_reject_cpu_tensors_before_loading_anything():
    with pytest.raises(ValueError, match="CUDA"):
        tt.TigonRMSNormFunction.apply(torch.randn(2, 8), None, 1e-6)
    with pytest.raises(ValueError, match="CUDA"):
        tt.TigonFusedLinearCrossEntropyFunction.apply(torch.randn(2, 8), torch.randn(4, 8), torch.zeros(2).long(),
                                                      None, None, -100, 0.0, 0.0, "mean", None, False, None, True)


# ------------------------------------------------------------------------------------------------
# The Liger-Kernel contract beyond signatures (any machine)
# ------------------------------------------------------------------------------------------------


def test_norm_modules_take_liger_arguments():
    m = tt.TigonRMSNorm(8, 1e-5, 1.0, "gemma", "zeros", False, True, True)  # Liger's positional order
    assert (m.variance_epsilon, m.offset, m.casting_mode, m.in_place, m.row_mode) == (1e-5, 1.0, "gemma", False, True)
    assert m.elementwise_affine and torch.equal(m.weight.detach(), torch.zeros(8))
    assert tt.TigonRMSNorm(8, elementwise_affine=False).weight is None
    assert tt.TigonRMSNorm(8, casting_mode=-1).casting_mode == -1  # Liger's integer code for "none"
    with pytest.raises(ValueError, match="casting_mode"):
        tt.TigonRMSNorm(8, casting_mode="fp32")
    with pytest.raises(ValueError, match="init_fn"):
        tt.TigonRMSNorm(8, init_fn="randn")
    g = tt.TigonRMSNormForGemma2(8)
    assert (g.offset, g.casting_mode, g.in_place) == (1.0, "gemma", False) and not g.weight.detach().any()
    assert tt.TigonRMSNormForGemma3(8).in_place is False
    # The safe default (Liger's is in place): the backward writes dX over dY only when asked to.
    assert tt.TigonRMSNorm(8).in_place is False and tt.TigonRMSNormForGemma(8).in_place is False
    for fn in (tt.tigon_rms_norm, tt.tigon_fused_add_rms_norm):
        assert inspect.signature(fn).parameters["in_place"].default is False

    ln = tt.TigonLayerNorm(8)
    assert ln.eps == ln.variance_epsilon == 1e-6 and ln.hidden_size == 8
    assert set(ln.state_dict()) == {"weight", "bias"}  # Liger's module always has a bias parameter
    assert ln.bias.requires_grad and not ln.bias.detach().any()
    assert tt.TigonLayerNorm(8, bias=True).bias.detach().abs().sum() > 0  # Liger draws it from randn
    f = tt.TigonFusedAddRMSNorm(8)
    assert (f.variance_epsilon, f.in_place) == (1e-6, False)


def test_mlp_modules_check_the_activation():
    def cfg(**act):
        return SimpleNamespace(hidden_size=8, intermediate_size=16, **act)

    for cls in (tt.TigonSwiGLUMLP, tt.TigonPhi3SwiGLUMLP):
        with pytest.raises(ValueError, match="gelu"):
            cls(cfg(hidden_act="gelu"))
        cls(cfg(hidden_act="swish"))
    assert tt.TigonPhi3MLP is tt.TigonPhi3SwiGLUMLP
    assert tt.TigonGEGLUMLP(cfg(hidden_activation="gelu_pytorch_tanh")).act_kind == "gelu_tanh"
    assert tt.TigonGEGLUMLP(cfg(hidden_act="gelu", hidden_activation="gelu")).act_kind == "gelu"
    assert tt.TigonGEGLUMLP(cfg()).act_kind == "gelu_tanh"
    with pytest.raises(ValueError, match="silu"):
        tt.TigonGEGLUMLP(cfg(hidden_activation="silu"))


def test_cross_entropy_output_is_liger_s_and_unpacks():
    out = tt.CrossEntropyOutput(loss=torch.tensor(1.0), token_accuracy=torch.tensor(0.5))
    loss, z_loss, accuracy, predicted = out
    assert loss is out.loss and z_loss is None and accuracy is out.token_accuracy and predicted is None
    assert out[0] is out.loss and out[2] is out.token_accuracy and len(out) == 4


def test_check_targets(monkeypatch):
    tt.check_targets(torch.tensor([0, 5, -100, 9]), 10)
    for bad, value in ((torch.tensor([0, 10, -100]), 10), (torch.tensor([3, -1, -100]), -1),
                       (torch.tensor([-100, -5], dtype=torch.int32), -5)):
        with pytest.raises(tt.TargetOutOfRangeError,
                           match=rf"target {value} is out of bounds.*ignore_index \(-100\).*\[0, 10\).*size 10"):
            tt.check_targets(bad, 10)
    with pytest.raises(ValueError):
        tt.check_targets(torch.tensor([10]), 10)
    with pytest.raises(AssertionError):  # what Liger raises
        tt.check_targets(torch.tensor([10]), 10)
    with pytest.raises(tt.TargetOutOfRangeError, match=r"ignore_index \(7\)"):
        tt.check_targets(torch.tensor([7, -100]), 5, ignore_index=7)
    tt.check_targets(torch.tensor([7, 7]), 5, ignore_index=7)  # all ignored
    tt.check_targets(torch.tensor([], dtype=torch.long), 5)
    assert int(tt.count_invalid_targets(torch.tensor([0, 10, -100, -2, 4]), 5)) == 2
    monkeypatch.setenv("TIGON_TORCH_CHECK_TARGETS", "0")
    tt.check_targets(torch.tensor([10]), 10)  # switched off


def test_check_targets_is_skipped_while_compiling(monkeypatch):
    from tigon_torch import functions

    monkeypatch.setattr(functions, "_compiling", lambda: True)
    tt.check_targets(torch.tensor([10]), 10)


def test_rotary_pos_emb_fallback_indexes_tables_with_position_ids(monkeypatch):
    monkeypatch.setattr(ops, "on_device", lambda t: t.is_cuda)  # CPU tensors: the PyTorch math
    q, k = torch.randn(2, 3, 5, 8), torch.randn(2, 1, 5, 8)
    cos, sin = torch.randn(1, 20, 8), torch.randn(1, 20, 8)
    pos = torch.randint(0, 20, (2, 5))
    got = tt.tigon_rotary_pos_emb(q, k, cos, sin, pos)
    want = tt.tigon_rotary_pos_emb(q, k, cos[0][pos], sin[0][pos])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_patch_switches_in_liger_order(monkeypatch):
    pytest.importorskip("transformers")
    from models import build_model

    monkeypatch.setattr(ops, "on_device", lambda t: t.is_cuda)
    model = build_model("llama", vocab=256)
    tt.apply_tigon_to_llama(False, False, False, True, False, model)  # rope, ce, flce, rms_norm, swiglu, model
    assert "forward" in model.model.norm.__dict__
    assert "forward" not in model.model.layers[0].mlp.__dict__ and "forward" not in model.__dict__
    with pytest.raises(TypeError):
        tt.apply_tigon_to_llama(True, False, True, True, True, None, True)  # fused_mlp is keyword-only
    tt.unpatch()

    g = build_model("gemma2", vocab=256)
    tt.apply_tigon_to_gemma2(geglu=False, model=g)
    assert "forward" in g.model.norm.__dict__ and "forward" not in g.model.layers[0].mlp.__dict__
    with pytest.raises(TypeError):
        tt.apply_tigon_to_gemma2(swiglu=False, model=g)
    tt.unpatch()
    # Liger's _apply_liger_kernel_to_instance: keywords the family's function does not take are dropped.
    tt._apply_tigon_to_instance(g, swiglu=False, rope=False)
    assert "forward" in g.model.layers[0].mlp.__dict__
    tt._apply_tigon_to_instance(torch.nn.Linear(2, 2))  # no family: nothing patched
    tt._apply_tigon("no_such_model_type")


def _gemma3_multimodal(vocab=256, seed=0):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, query_pre_attn_scalar=16,
                sliding_window=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28,
                  patch_size=14)
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=vocab - 1,
                       boi_token_index=vocab - 2, eoi_token_index=vocab - 3)
    for c in (cfg, cfg.text_config, cfg.vision_config):
        c._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(cfg)
    with torch.no_grad():  # a projection of zeros (its initialisation) would hide the vision tower
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.1)
    return model


def _gemma3_batch(vocab=256, device="cpu"):
    g = torch.Generator().manual_seed(0)
    text = torch.randint(3, vocab - 3, (2, 10), generator=g)
    ids = torch.cat([torch.full((2, 4), vocab - 1), text], dim=1)  # 4 image tokens per sample
    labels = ids.clone()
    labels[:, :4] = -100
    pixels = torch.randn(2, 3, 28, 28, generator=g)
    return ids.to(device), pixels.to(device), labels.to(device)


def test_gemma3_patch_covers_the_multimodal_model(monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setattr(ops, "on_device", lambda t: t.is_cuda)  # CPU tensors: Hugging Face's code
    ref = _gemma3_multimodal()
    model = copy.deepcopy(ref)
    tt.apply_tigon_to_gemma3(model=model)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert norms and all(m.forward.__func__ is patch._layer_norm_forward for m in norms)
    assert model.model.multi_modal_projector.mm_soft_emb_norm.forward.__func__ is patch._rms_norm_forward
    assert "forward" in model.__dict__ and model._tigon_flce and not model._tigon_ce

    ids, pixels, labels = _gemma3_batch()
    model.train(), ref.train()
    out, want = model(input_ids=ids, pixel_values=pixels, labels=labels), ref(input_ids=ids, pixel_values=pixels,
                                                                              labels=labels)
    torch.testing.assert_close(out.loss, want.loss)
    torch.testing.assert_close(out.logits, want.logits)
    assert isinstance(model(input_ids=ids, pixel_values=pixels, labels=labels, return_dict=False), tuple)
    tt.unpatch()
    assert "forward" not in model.__dict__ and all("forward" not in m.__dict__ for m in norms)

    tt.apply_tigon_to_gemma3(layer_norm=False, model=model)
    assert all("forward" not in m.__dict__ for m in norms)


def test_gemma3_class_patch_leaves_torch_nn_alone():
    pytest.importorskip("transformers")
    from transformers.models.gemma3 import modeling_gemma3
    from transformers.models.siglip import modeling_siglip

    forward = modeling_gemma3.Gemma3ForConditionalGeneration.forward
    layer_norm_forward = torch.nn.LayerNorm.forward
    tt.apply_tigon_to_gemma3()
    assert modeling_siglip.nn is not torch.nn and modeling_siglip.nn.Linear is torch.nn.Linear
    assert torch.nn.LayerNorm.forward is layer_norm_forward
    assert modeling_gemma3.Gemma3ForConditionalGeneration.forward is not forward
    model = _gemma3_multimodal()
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert norms and all(type(m).__name__ == "TigonNNLayerNorm" for m in norms)
    tt.unpatch()
    assert modeling_siglip.nn is torch.nn
    assert modeling_gemma3.Gemma3ForConditionalGeneration.forward is forward
    assert not any(type(m).__name__.startswith("Tigon") for m in _gemma3_multimodal().modules())


# ------------------------------------------------------------------------------------------------
# With the operators (GPU, or the CPU reference mode)
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_norm_defaults_keep_a_gradient_another_branch_needs(ext, seed):
    """x + norm(x) and norm(x) + norm2(x): dY of the norm's output is also the gradient of another
    branch, so with the defaults of the modules and functional calls the backward must leave it
    alone; the gradients equal the same graph in plain PyTorch."""
    x = torch.randn(3, 16, 64, device=DEVICE, requires_grad=True)
    w = torch.rand(64, device=DEVICE) + 0.5

    def plain(v):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    m = tt.TigonRMSNorm(64).to(DEVICE)
    with torch.no_grad():
        m.weight.copy_(w)
    calls = {
        "module": lambda v: m(v),
        "functional": lambda v: tt.tigon_rms_norm(v, w, 1e-6),
        "fused add": lambda v: tt.tigon_fused_add_rms_norm(v, torch.zeros_like(v), w, 1e-6)[0],
    }
    xr = x.detach().clone().requires_grad_()
    (xr + plain(xr)).pow(2).sum().backward()
    for name, norm in calls.items():
        x.grad = None
        (x + norm(x)).pow(2).sum().backward()
        torch.testing.assert_close(x.grad, xr.grad, atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.gpu
def test_losses_return_liger_types(ext, seed):
    x = torch.randn(6, 10, device=DEVICE, requires_grad=True)
    target = torch.tensor([0, 3, -100, 9, 2, 1], device=DEVICE)
    loss = tt.tigon_cross_entropy(x, target)
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0
    out = tt.tigon_cross_entropy(x, target, lse_square_scale=1e-4, return_z_loss=True, return_token_accuracy=True)
    assert isinstance(out, tt.CrossEntropyOutput) and out.z_loss is not None and out.predicted_tokens is None
    assert isinstance(tt.TigonCrossEntropyLoss(return_predicted_tokens=True)(x, target), tt.CrossEntropyOutput)
    # torch's deprecated size_average / reduce select the reduction, as in torch.nn.functional.cross_entropy
    with pytest.warns(UserWarning):
        per_token = tt.tigon_cross_entropy(x, target, None, None, -100, False)
    torch.testing.assert_close(per_token, F.cross_entropy(x, target, reduction="none"), atol=1e-5, rtol=1e-5)
    with pytest.warns(UserWarning):
        total = tt.tigon_cross_entropy(x, target, size_average=False)
    torch.testing.assert_close(total, F.cross_entropy(x, target, reduction="sum"), atol=1e-5, rtol=1e-5)

    h = torch.randn(6, 4, device=DEVICE, requires_grad=True)
    w = torch.randn(10, 4, device=DEVICE, requires_grad=True)
    assert isinstance(tt.tigon_fused_linear_cross_entropy(h, w, target), torch.Tensor)
    out = tt.TigonFusedLinearCrossEntropyLoss(return_predicted_tokens=True)(w, h, target)
    assert isinstance(out, tt.CrossEntropyOutput) and out.predicted_tokens.shape == (6,)
    loss, _, _, predicted = tt.tigon_fused_linear_cross_entropy(h, w, target, return_token_accuracy=True)
    assert loss.dim() == 0 and predicted is None


@pytest.mark.gpu
@pytest.mark.parametrize("in_place", [False, True])
def test_bad_target_raises_before_any_gradient(ext, seed, in_place):
    base = torch.randn(4, 10, device=DEVICE, requires_grad=True)
    logits = base * 1.0
    before = logits.detach().clone()
    target = torch.tensor([1, 10, -100, 2], device=DEVICE)
    with pytest.raises(tt.TargetOutOfRangeError, match=r"target 10 .*ignore_index \(-100\).*size 10"):
        tt.tigon_cross_entropy(logits, target, in_place=in_place)
    assert torch.equal(logits.detach(), before)  # in place or not, nothing was written
    with pytest.raises(tt.TargetOutOfRangeError, match="target -3"):
        tt.TigonCrossEntropyLoss(ignore_index=-1)(logits, torch.tensor([1, -3, -1, 2], device=DEVICE))
    tt.TigonCrossEntropyLoss(ignore_index=-1)(logits, torch.tensor([1, -1, -1, 2], device=DEVICE))

    h = torch.randn(4, 8, device=DEVICE, requires_grad=True)
    w = torch.randn(10, 8, device=DEVICE, requires_grad=True)
    for reduction in ("mean", "none"):
        with pytest.raises(tt.TargetOutOfRangeError, match="target 10"):
            tt.tigon_fused_linear_cross_entropy(h, w, target, reduction=reduction)
    with pytest.raises(AssertionError):
        tt.TigonFusedLinearCrossEntropyFunction.apply(h, w, target)
    assert h.grad is None and w.grad is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("n", [1, 7, 3000, 200_003])
def test_check_targets_finds_the_extreme_bad_target_anywhere(ext, dtype, n):
    """check_targets on device targets (tigon.target_range: the blocks' (min, max, count) merged on the
    host): a bad value at the start, the middle or the end of a long vector, on its own or beside others,
    is reported as the smallest negative or, with none, the largest too-large target; a good batch
    returns its number of targets that are not ignore_index."""
    vocab = 50
    base = torch.arange(n, device=DEVICE, dtype=torch.int64).remainder(vocab).to(dtype)
    base[::3] = -100
    assert tt.check_targets(base, vocab) == n - (n + 2) // 3
    for at in sorted({0, n // 2, n - 1}):
        for bad in (vocab, -1, 10**6):
            t = base.clone()
            t[at] = bad
            with pytest.raises(tt.TargetOutOfRangeError, match=rf"target {bad} is out of bounds"):
                tt.check_targets(t, vocab)
    if n > 2:
        t = base.clone()
        t[0], t[n - 1] = vocab + 5, -7  # a negative target is named first
        with pytest.raises(tt.TargetOutOfRangeError, match=r"target -7 is out of bounds"):
            tt.check_targets(t, vocab)
    assert tt.check_targets(torch.full((n,), -100, device=DEVICE, dtype=dtype), vocab) == 0  # all ignored
    assert tt.check_targets(torch.full((n,), 7, device=DEVICE, dtype=dtype), 5, ignore_index=7) == 0
    strided = torch.stack([base, base]).t()[:, 0]  # not contiguous
    assert tt.check_targets(strided, vocab) == n - (n + 2) // 3


@pytest.mark.cuda_only
def test_check_targets_is_a_synchronisation_torch_reports(ext):
    """CUDA's sync debug mode "warn" reports the eager target check's synchronisation, as it reports
    torch's own (mode "error" skips the check: see _target_check_mode)."""
    target = torch.tensor([1, 2, -100], device="cuda")
    prev = torch.cuda.get_sync_debug_mode()
    try:
        torch.cuda.set_sync_debug_mode("warn")
        with pytest.warns(UserWarning, match="synchroniz"):
            tt.check_targets(target, 5)
    finally:
        torch.cuda.set_sync_debug_mode(prev)


@pytest.mark.cuda_only
def test_target_range_refuses_graph_capture(ext):
    """tigon.target_range synchronises, so under capture it raises a ValueError naming the reason
    (check_targets does not call it there)."""
    target = torch.tensor([1, 2, -100], device="cuda")
    assert list(ops.ops().target_range(target, -100)) == [0, 2, 2]
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="CUDA graph"):
        with torch.cuda.graph(graph):
            ops.ops().target_range(target, -100)


@pytest.mark.cuda_only
def test_bad_target_under_graph_capture_gives_nan_and_a_count(ext):
    """Under CUDA-graph capture the host check is skipped: the loss is NaN and count_invalid_targets,
    captured with it, counts the bad targets on the device."""
    x = torch.randn(4, 10, device="cuda")
    target = torch.tensor([1, 10, -100, 2], device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph
        tt.tigon_cross_entropy(x, torch.zeros_like(target))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = tt.tigon_cross_entropy(x, target)
        count = tt.count_invalid_targets(target, 10)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isnan(loss) and int(count) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("loss", ["fused_linear_cross_entropy", "cross_entropy"])
def test_gemma3_multimodal_loss(ext, loss):
    pytest.importorskip("transformers")
    ref = _gemma3_multimodal().to(DEVICE)
    model = copy.deepcopy(ref)
    fused = loss == "fused_linear_cross_entropy"
    tt.apply_tigon_to_gemma3(cross_entropy=not fused, fused_linear_cross_entropy=fused, model=model)
    ids, pixels, labels = _gemma3_batch(device=DEVICE)
    model.train(), ref.train()
    n = torch.tensor(11, device=DEVICE)
    for kwargs in ({}, {"num_items_in_batch": n}):
        out = model(input_ids=ids, pixel_values=pixels, labels=labels, **kwargs)
        want = ref(input_ids=ids, pixel_values=pixels, labels=labels, **kwargs)
        assert (out.logits is None) == fused
        torch.testing.assert_close(out.loss, want.loss, atol=1e-4, rtol=1e-4)
        out.loss.backward()
        want.loss.backward()
        post_norm = next(n for n, _ in ref.named_modules() if n.endswith("post_layernorm"))
        for name in ("lm_head", post_norm):
            got, exp = model.get_submodule(name).weight.grad, ref.get_submodule(name).weight.grad
            torch.testing.assert_close(got, exp, atol=1e-4, rtol=1e-3)
        model.zero_grad(), ref.zero_grad()

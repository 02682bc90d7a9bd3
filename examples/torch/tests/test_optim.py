"""tigon_torch.optim: AdamW and Adam against torch's fused optimizers (fp32 and bf16 parameters, param
groups, a Tensor learning rate and one that changes, GradScaler's grad_scale and found_inf, Adam's L2
decay), state dicts loaded both ways with torch's, moved gradients (re-planning), fp32 moments and master
weights, the clip whose factor the step applies, a captured step replayed, and the rejected calls."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import DEVICE

import tigon_torch.optim as topt

pytestmark = pytest.mark.gpu

SHAPES = [(64, 48), (48,), (40000,), (3, 5, 7)]  # one tensor across a 32768-element chunk boundary


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(*s, generator=g) * 0.5).to(device=DEVICE, dtype=dtype)) for s in SHAPES]


def _grads(params, step, scale=1.0):
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(*p.shape, generator=g) * 0.1 * scale).to(device=p.device, dtype=p.dtype) for p in params]


def _torch_opt(cls, params, **kw):
    try:
        return cls(params, fused=True, **kw)
    except (RuntimeError, ValueError):  # a build without the fused kernel on this device
        return cls(params, foreach=False, **kw)


def _run(opt, params, steps, start=0, scale=1.0):
    for t in range(start, start + steps):
        for p, g in zip(params, _grads(params, t, scale)):
            p.grad = g  # new gradient tensors every step: the plan follows them
        opt.step()


# tigon's step follows the rounding of torch's fused CUDA kernel as of torch 2.11 (every operation in fp32,
# the multiply-adds fused): there the results are torch's bit for bit. Elsewhere (torch's CPU kernel in the
# reference mode, older CUDA kernels with fp64 products) they differ by roundings.
_TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
EXACT = DEVICE == "cuda" and _TORCH >= (2, 11)


def _close(a, b, dtype, exact=True):
    for x, y in zip(a, b):
        x, y = x.detach(), y.detach()
        if EXACT and exact:
            off = (x != y) & ~(x.isnan() & y.isnan())
            assert not off.any(), (f"{int(off.sum())} of {x.numel()} elements differ from torch's, first "
                                   f"{float(x[off][0])} against {float(y[off][0])}")
        elif dtype == torch.float32:
            torch.testing.assert_close(x, y, rtol=2e-6, atol=1e-7)
        else:  # roundings of the dtype apart, of the value and, where terms cancel, of the tensor's scale
            eps, yf = torch.finfo(dtype).eps, y.float()
            bound = eps * (2 * yf.abs() + 8 * yf.abs().mean())
            assert ((x.float() - yf).abs() <= bound).all(), float(((x.float() - yf).abs() / bound).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["AdamW", "Adam"])
def test_matches_torch(ext, dtype, kind):
    """Five steps with fresh gradients: the parameters and both moments as torch's fused optimizer's (AdamW
    bit for bit on CUDA with torch >= 2.11)."""
    ours_p, ref_p = _params(dtype), _params(dtype)
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ours = getattr(topt, kind)(ours_p, **kw)
    ref = _torch_opt(getattr(torch.optim, kind), ref_p, **kw)
    _run(ours, ours_p, 5)
    _run(ref, ref_p, 5)
    # Adam's L2 term g + p * wd: torch 2.11 rounds it otherwise than one fused fp32 multiply-add in about
    # 1% of the elements (H100): a rounding of the moments apart there.
    exact = kind == "AdamW"
    _close(ours_p, ref_p, dtype, exact)
    for a, b in zip(ours_p, ref_p):
        _close([ours.state[a]["exp_avg"], ours.state[a]["exp_avg_sq"]],
               [ref.state[b]["exp_avg"], ref.state[b]["exp_avg_sq"]], dtype, exact)
        assert float(ours.state[a]["step"]) == 5.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_at_late_steps(ext, dtype):
    """Steps 20001 to 20003 (the bias corrections' powers far from 1), loaded through state dicts."""
    ours_p, ref_p = _params(dtype), _params(dtype)
    kw = dict(lr=3e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    ours, ref = topt.AdamW(ours_p, **kw), _torch_opt(torch.optim.AdamW, ref_p, **kw)
    _run(ours, ours_p, 2)
    _run(ref, ref_p, 2)
    for opt in (ours, ref):
        sd = copy.deepcopy(opt.state_dict())
        for st in sd["state"].values():
            st["step"] = torch.full_like(st["step"], 20000.0)
        opt.load_state_dict(sd)
    _run(ours, ours_p, 3, start=2)
    _run(ref, ref_p, 3, start=2)
    _close(ours_p, ref_p, dtype)
    for a, b in zip(ours_p, ref_p):
        _close([ours.state[a]["exp_avg_sq"]], [ref.state[b]["exp_avg_sq"]], dtype)
        assert float(ours.state[a]["step"]) == 20003.0


def test_param_groups_and_learning_rates(ext):
    """Groups with their own lr and weight decay, an lr that changes between steps (a scheduler), and a
    Tensor lr."""
    ours_p, ref_p = _params(torch.float32), _params(torch.float32)
    groups = lambda ps, lr2: [{"params": ps[:2]}, {"params": ps[2:], "lr": lr2, "weight_decay": 0.0}]  # noqa
    ours = topt.AdamW(groups(ours_p, torch.tensor(3e-3, device=DEVICE)), lr=1e-2, weight_decay=0.05)
    ref = _torch_opt(torch.optim.AdamW, groups(ref_p, torch.tensor(3e-3, device=DEVICE)), lr=1e-2,
                     weight_decay=0.05)
    sched = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (ours, ref)]
    for t in range(4):
        for opt, ps in ((ours, ours_p), (ref, ref_p)):
            for p, g in zip(ps, _grads(ps, t)):
                p.grad = g
            opt.step()
        for s in sched:
            s.step()
    _close(ours_p, ref_p, torch.float32)


@pytest.mark.parametrize("direction", ["tigon_to_torch", "torch_to_tigon"])
def test_state_dict_both_ways(ext, direction):
    """A state dict saved by one optimizer loads into the other, which continues as the first would."""
    dtype = torch.bfloat16
    kw = dict(lr=1e-2, weight_decay=0.1)
    first_p = _params(dtype)
    first = topt.AdamW(first_p, **kw) if direction == "tigon_to_torch" else _torch_opt(torch.optim.AdamW, first_p, **kw)
    _run(first, first_p, 3)
    sd = copy.deepcopy(first.state_dict())
    second_p = [torch.nn.Parameter(p.detach().clone()) for p in first_p]
    second = (_torch_opt(torch.optim.AdamW, second_p, **kw) if direction == "tigon_to_torch"
              else topt.AdamW(second_p, **kw))
    second.load_state_dict(sd)
    _run(first, first_p, 3, start=3)
    _run(second, second_p, 3, start=3)
    _close(second_p, first_p, dtype)
    assert float(second.state[second_p[0]]["step"]) == 6.0


def test_grad_scaler_attributes(ext):
    """GradScaler's protocol: the step divides the gradients by optimizer.grad_scale and skips
    everything (the step count included) when optimizer.found_inf is nonzero, as torch's fused AdamW."""
    ours_p, ref_p = _params(torch.float32), _params(torch.float32)
    ours, ref = topt.AdamW(ours_p, lr=1e-2), _torch_opt(torch.optim.AdamW, ref_p, lr=1e-2)
    assert ours._step_supports_amp_scaling
    for t, inf in enumerate([0.0, 1.0, 0.0]):
        for opt, ps in ((ours, ours_p), (ref, ref_p)):
            for p, g in zip(ps, _grads(ps, t, scale=8.0)):
                p.grad = g
            opt.grad_scale = torch.full((), 8.0, device=DEVICE)
            opt.found_inf = torch.full((), inf, device=DEVICE)
            opt.step()
            del opt.grad_scale, opt.found_inf
    _close(ours_p, ref_p, torch.float32)
    assert float(ours.state[ours_p[0]]["step"]) == 2.0


def test_moved_and_missing_gradients(ext):
    """zero_grad(set_to_none=True) gives new gradient tensors every step (a new plan), a parameter
    without a gradient is skipped, and one whose gradient returns continues."""
    ours_p, ref_p = _params(torch.float32), _params(torch.float32)
    ours, ref = topt.AdamW(ours_p, lr=1e-2), _torch_opt(torch.optim.AdamW, ref_p, lr=1e-2)
    for t in range(4):
        for opt, ps in ((ours, ours_p), (ref, ref_p)):
            opt.zero_grad(set_to_none=True)
            for i, (p, g) in enumerate(zip(ps, _grads(ps, t))):
                if not (t == 1 and i == 0):
                    p.grad = g
            opt.step()
    _close(ours_p, ref_p, torch.float32)


def test_step_holds_no_gradient(ext):
    """After step() (and clip_grad_norm_(optimizer=)), the optimizer keeps no reference to a gradient:
    zero_grad(set_to_none=True) frees it at once, so the next backward's gradients do not come on top
    of the last step's; the plan is still reused while the addresses stay."""
    import weakref

    ps = _params(torch.float32)
    opt = topt.AdamW(ps, lr=1e-2)
    for t in range(3):
        for p, g in zip(ps, _grads(ps, t)):
            p.grad = g
        del g  # the loop's last reference
        if t == 1:
            topt.clip_grad_norm_(ps, 1.0, optimizer=opt)
        opt.step()
        refs = [weakref.ref(p.grad) for p in ps]
        opt.zero_grad(set_to_none=True)
        assert all(r() is None for r in refs), "a gradient outlived zero_grad(set_to_none=True)"
    for p in ps:
        p.grad = torch.zeros_like(p)  # kept in place from here on
    opt.step()
    plans = [b.plan for b in opt._buckets.values()]
    opt.step()
    assert all(a is b for a, b in zip(plans, [b.plan for b in opt._buckets.values()])), "the plan was rebuilt"


def test_fp32_moments_and_master_weights(ext):
    """bf16 parameters with fp32 moments and fp32 masters follow torch's fp32 AdamW on the masters'
    values; each parameter is its master rounded to bf16."""
    ours_p = _params(torch.bfloat16)
    ref_p = [torch.nn.Parameter(p.detach().float()) for p in ours_p]
    ours = topt.AdamW(ours_p, lr=1e-2, weight_decay=0.1, moments_dtype=torch.float32, master_weights=True)
    ref = _torch_opt(torch.optim.AdamW, ref_p, lr=1e-2, weight_decay=0.1)
    for t in range(4):
        grads = _grads(ours_p, t)
        for p, q, g in zip(ours_p, ref_p, grads):
            p.grad, q.grad = g, g.float()
        ours.step()
        ref.step()
    for p, q in zip(ours_p, ref_p):
        st = ours.state[p]
        assert st["exp_avg"].dtype == torch.float32 and st["master"].dtype == torch.float32
        torch.testing.assert_close(st["master"], q.detach(), rtol=2e-6, atol=1e-7)
        assert torch.equal(p.detach(), st["master"].to(torch.bfloat16))


def test_clip_grad_norm_hands_the_factor_to_the_step(ext):
    """clip_grad_norm_(..., optimizer=opt) returns torch's total norm and leaves the gradients as they
    are; the next step applies the factor: the result equals torch's clip then torch's step."""
    ours_p, ref_p = _params(torch.float32), _params(torch.float32)
    ours, ref = topt.AdamW(ours_p, lr=1e-2), _torch_opt(torch.optim.AdamW, ref_p, lr=1e-2)
    for t in range(3):
        grads = _grads(ours_p, t, scale=20.0)
        for p, q, g in zip(ours_p, ref_p, grads):
            p.grad, q.grad = g.clone(), g.clone()
        n_ours = topt.clip_grad_norm_(ours_p, 1.0, optimizer=ours)
        n_ref = torch.nn.utils.clip_grad_norm_(ref_p, 1.0)
        torch.testing.assert_close(n_ours, n_ref.float(), rtol=1e-5, atol=0)
        assert all(torch.equal(p.grad, g) for p, g in zip(ours_p, grads))  # not scaled in place
        ours.step()
        ref.step()
    _close(ours_p, ref_p, torch.float32, exact=False)  # the norms' summation orders differ
    # Without an optimizer: torch's function.
    n = topt.clip_grad_norm_(ref_p, 1e9)
    assert n.shape == ()


def test_rejected_and_uneven_counts(ext):
    p = _params(torch.float32)
    with pytest.raises(NotImplementedError, match="amsgrad"):
        topt.AdamW(p, amsgrad=True)
    with pytest.raises(NotImplementedError, match="maximize"):
        topt.AdamW(p, maximize=True)
    with pytest.raises(ValueError, match="betas"):
        topt.AdamW(p, betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="moments_dtype"):
        topt.AdamW(p, moments_dtype=torch.float16)
    opt = topt.AdamW(p)
    p[0].grad = torch.zeros(48, 64, device=DEVICE).t()  # a transposed gradient
    with pytest.raises(ValueError, match="contiguous"):
        opt.step()
    p[0].grad = None
    with pytest.raises(ValueError, match="max_norm"):
        topt.clip_grad_norm_(p, 0.0, optimizer=opt)

    # One group whose parameters hold different step counts (a state dict edited by hand) steps each
    # with its own count, as torch does.
    q, r = _params(torch.float32), _params(torch.float32)
    ours, ref = topt.AdamW(q, lr=1e-2), _torch_opt(torch.optim.AdamW, r, lr=1e-2)
    _run(ours, q, 1)
    _run(ref, r, 1)
    sd_ours, sd_ref = ours.state_dict(), ref.state_dict()
    sd_ours["state"][0]["step"] = torch.tensor(7.0)
    sd_ref["state"][0]["step"] = torch.tensor(7.0, device=DEVICE)
    ours.load_state_dict(sd_ours)
    ref.load_state_dict(sd_ref)
    _run(ours, q, 2, start=1)
    _run(ref, r, 2, start=1)
    _close(q, r, torch.float32)
    assert float(ours.state[q[0]]["step"]) == 9.0 and float(ours.state[q[1]]["step"]) == 3.0


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_captured_step_replays_as_eager(ext):
    """capturable=True with a Tensor lr: a step captured in a CUDA graph and replayed three times equals
    three eager steps (static gradients, as graph training keeps them)."""
    eager_p, graph_p = _params(torch.bfloat16), _params(torch.bfloat16)
    lr = lambda: torch.tensor(1e-2, device=DEVICE)  # noqa: E731
    eager = topt.AdamW(eager_p, lr=lr(), capturable=True)
    graphed = topt.AdamW(graph_p, lr=lr(), capturable=True)
    for ps in (eager_p, graph_p):
        for p, g in zip(ps, _grads(ps, 0)):
            p.grad = g
    eager.step()
    graphed.step()  # the plan, before capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        with torch.cuda.graph(graph, stream=s):
            graphed.step()
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(3):
        eager.step()
        graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(eager_p, graph_p))
    assert float(graphed.state[graph_p[0]]["step"]) == 4.0  # 1 eager step + 3 replays (capture runs nothing)

"""tigon_torch.optim: torch.optim.AdamW and Adam on tigon's multi-tensor step (tigon/optim/adamw.cuh),
and a gradient-norm clip whose factor the step applies.

`AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, ...)` takes torch.optim.AdamW's
arguments and param groups, keeps the same state ("step", "exp_avg", "exp_avg_sq": state dicts load
both ways with torch's) and computes AdamW with the roundings of torch's fused CUDA kernel (torch 2.11:
fp32 throughout, the multiply-adds fused), so that AdamW's results are torch's bit for bit (Adam's L2 term
can differ by a rounding; docs/adamw.md). Per step, each group's parameters of one device and dtype go
through two launches (the step count, then every element), with the learning rate and the step count
read from device memory: no host synchronisation, and with `capturable=True` one CUDA graph serves
every step (give `lr` as a CUDA tensor to change it between replays). GradScaler's `grad_scale` and
`found_inf` are honoured inside the step (`_step_supports_amp_scaling`).

Beyond torch: `moments_dtype=torch.float32` keeps fp32 moments for 16-bit parameters (torch keeps them
in the parameter's dtype); `master_weights=True` keeps an fp32 master copy of each 16-bit parameter
(state "master") and writes the parameter as its rounding; `stochastic_rounding=True` rounds bf16
parameters without masters stochastically (seeded by `seed`).

Its param groups record `fused=True` (unless given otherwise): a torch optimizer that loads its state
dict takes torch's fused path, whose numerics it shares.

Not supported (a clear error): amsgrad, maximize, differentiable, sparse or non-contiguous tensors,
gradients in another dtype than their parameter.
"""

from __future__ import annotations

from typing import Iterable

import torch

from . import ops as _ops
from .ops import ops

__all__ = ["AdamW", "Adam", "clip_grad_norm_"]

_CHUNK = 32768  # elements per chunk of the step (tigon::detail::kAdamWChunk)
_TENSOR_ENTRY_BYTES = 56  # sizeof(tigon::detail::AdamWTensorEntry)


def plan_bytes(numels: list[int]) -> int:
    """Bytes of the plan adamw_plan builds for tensors of these sizes: the tensor table and one 8-byte
    entry per chunk, each rounded up to 256 bytes (tigon::adamw_workspace_bytes)."""

    def up(n: int) -> int:
        return (n + 255) // 256 * 256

    chunks = sum((n + _CHUNK - 1) // _CHUNK for n in numels)
    return up(len(numels) * _TENSOR_ENTRY_BYTES) + up(chunks * 8)


class _Bucket:
    """One launch's parameters: a group's tensors of one device, dtype, moment dtype, master choice and
    step count (a device tensor they share), with the plan (rebuilt when any buffer moved). Between
    steps it keeps only the buffers' addresses and sizes (key), no tensor: a gradient set to None is
    freed at once, not held until the next step."""

    __slots__ = ("params", "grads", "exp_avgs", "exp_avg_sqs", "masters", "step", "key", "plan")

    def __init__(self):
        self.params, self.grads, self.exp_avgs, self.exp_avg_sqs, self.masters = [], [], [], [], []
        self.step = None
        self.key = None
        self.plan = None

    def release(self):
        self.params, self.grads, self.exp_avgs, self.exp_avg_sqs, self.masters = [], [], [], [], []


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW on tigon's fused multi-tensor step (module docstring)."""

    _decoupled = True
    _step_supports_amp_scaling = True

    def __init__(self, params, lr: float | torch.Tensor = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False, foreach=None,
                 capturable: bool = False, differentiable: bool = False, fused=None, moments_dtype=None,
                 master_weights: bool = False, stochastic_rounding: bool = False, seed: int = 0):
        name = type(self).__name__
        if isinstance(lr, torch.Tensor):
            if lr.numel() != 1:
                raise ValueError(f"tigon_torch.optim.{name}: a Tensor lr must hold one value, got {lr.numel()}")
        elif not 0.0 <= lr:
            raise ValueError(f"tigon_torch.optim.{name}: invalid learning rate {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"tigon_torch.optim.{name}: invalid epsilon value {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"tigon_torch.optim.{name}: betas must be in [0, 1), got {tuple(betas)}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"tigon_torch.optim.{name}: invalid weight_decay value {weight_decay}")
        for flag, what in ((amsgrad, "amsgrad"), (maximize, "maximize"), (differentiable, "differentiable")):
            if flag:
                raise NotImplementedError(f"tigon_torch.optim.{name}: {what}=True is not supported; use "
                                          f"torch.optim.{name}")
        if moments_dtype not in (None, torch.float32):
            raise ValueError(f"tigon_torch.optim.{name}: moments_dtype must be None (the parameter's dtype, as "
                             f"torch) or torch.float32, got {moments_dtype}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=False,
                        maximize=False, foreach=foreach, capturable=capturable, differentiable=False,
                        fused=True if fused is None else fused,
                        decoupled_weight_decay=self._decoupled, moments_dtype=moments_dtype,
                        master_weights=master_weights, stochastic_rounding=stochastic_rounding)
        super().__init__(params, defaults)
        self.seed = int(seed)
        self._buckets: dict = {}
        self._clip_factor = None

    def __setstate__(self, state):
        super().__setstate__(state)
        for g in self.param_groups:
            self._group_defaults(g)
        self.__dict__.setdefault("seed", 0)
        self._buckets, self._clip_factor = {}, None
        self._merge_steps()

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        for g in self.param_groups:
            self._group_defaults(g)
        self._buckets = {}  # the loaded state's tensors are new: every plan is remade
        self._merge_steps()

    def state_dict(self):
        """torch's state dict, each parameter with a step count of its own (the optimizer shares one
        device tensor among the parameters that step together; torch's optimizers count per tensor)."""
        sd = super().state_dict()
        sd["state"] = {k: (dict(v, step=v["step"].clone()) if isinstance(v.get("step"), torch.Tensor) else v)
                       for k, v in sd["state"].items()}
        return sd

    def _merge_steps(self):
        """After a load: the parameters of a group whose step counts are equal share one fp32 device tensor
        for it, so that they step in one launch (reads each count once: a host synchronisation)."""
        for g in self.param_groups:
            shared: dict = {}
            for p in g["params"]:
                st = self.state.get(p)
                if not st or "step" not in st:
                    continue
                v = float(st["step"])
                key = (p.device, v)
                if key not in shared:
                    shared[key] = torch.full((), v, dtype=torch.float32, device=p.device)
                st["step"] = shared[key]

    def _group_defaults(self, g):
        # A torch.optim state dict lacks tigon's keys; and tigon's supports none of these.
        for k, v in (("moments_dtype", None), ("master_weights", False), ("stochastic_rounding", False)):
            g.setdefault(k, v)
        for k in ("amsgrad", "maximize", "differentiable"):
            if g.get(k, False):
                raise NotImplementedError(f"tigon_torch.optim.{type(self).__name__}: {k}=True is not supported")
        g["decoupled_weight_decay"] = self._decoupled

    # -- the buckets -----------------------------------------------------------------------------

    def _state_of(self, p, g):
        """The parameter's state, made on first use (zero moments; an fp32 master copy when asked) or
        brought to the group's layout after a load (moments in the group's dtype, on the device)."""
        st = self.state[p]
        mdt = g["moments_dtype"] or p.dtype
        if "exp_avg" not in st:
            st["exp_avg"] = torch.zeros_like(p, dtype=mdt, memory_format=torch.contiguous_format)
            st["exp_avg_sq"] = torch.zeros_like(p, dtype=mdt, memory_format=torch.contiguous_format)
        else:
            for k in ("exp_avg", "exp_avg_sq"):
                if st[k].dtype != mdt or st[k].device != p.device or not st[k].is_contiguous():
                    st[k] = st[k].to(device=p.device, dtype=mdt, memory_format=torch.contiguous_format)
        wants_master = g["master_weights"] and p.dtype != torch.float32
        if wants_master and "master" not in st:
            st["master"] = p.detach().float().contiguous()
        elif not wants_master:
            st.pop("master", None)
        return st

    @staticmethod
    def _lr_args(g, device):
        """(lr tensor or None, lr value): a Tensor lr as a device fp32 scalar the step reads; a float lr
        as a constant (rounded to fp32 in the step, as torch's fused kernel rounds it)."""
        lr = g["lr"]
        if isinstance(lr, torch.Tensor):
            if not (lr.device == device and lr.dtype == torch.float32):
                lr = lr.to(device=device, dtype=torch.float32)
            return lr, 0.0
        return None, float(lr)

    def _collect(self):
        """The launches of this step: per group, the parameters with a gradient, by device, dtype, moment
        dtype, master choice and step count (one device tensor shared by the parameters that step
        together). Each launch's plan is reused while none of its buffers moved. A parameter without a
        gradient takes no step: it gets a step count of its own if it shared one with parameters that do."""
        name = type(self).__name__
        out, live = [], {}
        if any(not (isinstance(st.get("step"), torch.Tensor) and st["step"].device == p.device
                    and st["step"].dtype == torch.float32 and st["step"].dim() == 0)
               for g in self.param_groups for p in g["params"] for st in (self.state.get(p),)
               if st and "step" in st):
            self._merge_steps()  # counts set by hand or on another device: once
        for gi, g in enumerate(self.param_groups):
            groups: dict = {}
            fresh: dict = {}  # per device, the step count of parameters stepping for the first time
            idle = []
            for p in g["params"]:
                if p.grad is None:
                    idle.append(p)
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError(f"tigon_torch.optim.{name} does not support sparse gradients")
                if torch.is_complex(p):
                    raise NotImplementedError(f"tigon_torch.optim.{name} does not support complex parameters")
                if grad.dtype != p.dtype:
                    raise TypeError(f"tigon_torch.optim.{name}: a gradient has dtype {grad.dtype}, its parameter "
                                    f"{p.dtype}; the step reads gradients in the parameter's dtype")
                if not _ops.on_device(p):
                    raise ValueError(f"tigon_torch.optim.{name}: parameters must be CUDA tensors, got {p.device}")
                if not (p.is_contiguous() and grad.is_contiguous()):
                    raise ValueError(f"tigon_torch.optim.{name}: parameters and gradients must be contiguous")
                st = self._state_of(p, g)
                step = st.get("step")
                if step is None:
                    if p.device not in fresh:
                        fresh[p.device] = torch.zeros((), dtype=torch.float32, device=p.device)
                    step = st["step"] = fresh[p.device]
                k = (p.device, p.dtype, st["exp_avg"].dtype, "master" in st, id(step))
                groups.setdefault(k, (step, []))[1].append((p, st))
            stepping = {id(step) for step, _ in groups.values()}
            for p in idle:
                st = self.state.get(p)
                if st and isinstance(st.get("step"), torch.Tensor) and id(st["step"]) in stepping:
                    st["step"] = st["step"].clone()  # enqueued before this step's count moves
            for k, (step, members) in groups.items():
                bkey = (gi,) + k
                b = self._buckets.get(bkey) or _Bucket()
                live[bkey] = b
                b.step = step
                self._fill(b, members)
                out.append((g, b))
        self._buckets = live
        return out

    def _fill(self, b, members):
        b.params = [p for p, _ in members]
        b.grads = [p.grad for p, _ in members]
        b.exp_avgs = [st["exp_avg"] for _, st in members]
        b.exp_avg_sqs = [st["exp_avg_sq"] for _, st in members]
        b.masters = [st["master"] for _, st in members if "master" in st]
        key = tuple((t.data_ptr(), t.numel()) for lst in (b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, b.masters)
                    for t in lst)
        if key != b.key:
            if b.params[0].is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"tigon_torch.optim.{type(self).__name__}: the parameters or gradients moved "
                                   "during CUDA graph capture; run a step before capturing, and keep the gradients "
                                   "in place (zero_grad(set_to_none=False))")
            b.plan = ops().adamw_plan(b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, b.masters)
            b.key = key

    # -- the step ---------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        clip, self._clip_factor = self._clip_factor, None
        for g, b in self._collect():
            dev = b.params[0].device
            beta1, beta2 = g["betas"]
            stochastic = bool(g["stochastic_rounding"]) and b.params[0].dtype == torch.bfloat16 and not b.masters
            ops().adamw_step(b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, b.masters, b.plan,
                             *self._lr_args(g, dev), b.step, float(beta1), float(beta2), float(g["eps"]),
                             float(g["weight_decay"]), self._decoupled, _on(grad_scale, dev), _on(clip, dev),
                             _on(found_inf, dev), stochastic, self.seed)
            b.release()
        return loss


class Adam(AdamW):
    """torch.optim.Adam (L2 weight decay added to the gradient) on tigon's fused step."""

    _decoupled = False

    def __init__(self, params, lr: float | torch.Tensor = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, **kwargs):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)


def _on(t, device):
    """A device scalar (fp32) on the parameters' device, or None."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        return torch.full((), float(t), dtype=torch.float32, device=device)
    return t if (t.device == device and t.dtype == torch.float32) else t.to(device=device, dtype=torch.float32)


def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach=None, *, optimizer: AdamW | None = None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_, with the scaling handed to a tigon optimizer.

    With `optimizer` (a tigon_torch.optim.AdamW / Adam whose parameters with gradients are exactly
    `parameters`) and the 2-norm, the global norm comes from tigon's kernel over the optimizer's plan
    (one read of the gradients, deterministic) and the clip factor min(1, max_norm / (norm + 1e-6)) is
    applied by the optimizer's next step() as it reads the gradients: the gradients themselves are not
    scaled, and no pass over them is spent on it. Returns the total norm (a 0-d fp32 tensor on the
    gradients' device). Without `optimizer`, or for another norm, it is torch's function."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = list(parameters)
    if optimizer is None or float(norm_type) != 2.0:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
    if not isinstance(optimizer, AdamW):
        raise TypeError(f"tigon_torch.optim.clip_grad_norm_: optimizer must be a tigon_torch.optim.AdamW or Adam, "
                        f"got {type(optimizer).__name__}")
    max_norm = float(max_norm)
    if not max_norm > 0.0 or max_norm == float("inf"):
        raise ValueError(f"tigon_torch.optim.clip_grad_norm_: max_norm must be finite and > 0, got {max_norm}")
    with torch.no_grad():
        buckets = optimizer._collect()
        mine = {id(p) for p in parameters if p.grad is not None}
        theirs = {id(p) for _, b in buckets for p in b.params}
        if mine != theirs:
            raise ValueError("tigon_torch.optim.clip_grad_norm_: with optimizer=, the parameters with gradients must "
                             "be exactly the optimizer's")
        if not buckets:
            return torch.zeros(())
        dev = buckets[0][1].params[0].device
        if any(b.params[0].device != dev for _, b in buckets):
            raise NotImplementedError("tigon_torch.optim.clip_grad_norm_: with optimizer=, the parameters must be on "
                                      "one device")
        grad_scale = _on(getattr(optimizer, "grad_scale", None), dev)
        norms = torch.empty(len(buckets), dtype=torch.float32, device=dev)
        factor = torch.empty((), dtype=torch.float32, device=dev)
        for i, (_, b) in enumerate(buckets):
            ops().adamw_grad_norm(b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, b.masters, b.plan, max_norm,
                                  norms[i], factor if len(buckets) == 1 else None, grad_scale)
            b.release()
        if len(buckets) == 1:
            total = norms[0]
        else:  # the buckets' norms combined, and torch's factor from the total
            total = norms.double().square().sum().sqrt().float()
            factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(f"The total norm of order 2.0 for gradients from `parameters` is non-finite, so it "
                               f"cannot be clipped. To disable this error and scale the gradients by the non-finite "
                               f"norm anyway, set `error_if_nonfinite=False`")
        optimizer._clip_factor = factor
        return total

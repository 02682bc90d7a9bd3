"""Preference losses on the fused LM head: Liger-Kernel's chunked_loss API (LigerFusedLinearDPOLoss,
ORPO, CPO, SimPO, KTO and their functions), on tigon's per-token log-probabilities
(TigonFusedLinearLogProbFunction), so that no [tokens, vocab] logits are ever held.

The paired losses (DPO, ORPO, CPO, SimPO) take [2B, T, H] hidden states with [2B, T] targets: the first
B sequences are the chosen completions, the last B the rejected ones, as Liger and TRL lay them out. KTO
is unpaired: [B, T, H] and [B, T], one preference label per sequence. Per sequence, the log-prob is
the sum (average_log_prob: the mean) of log p(target) over its tokens whose target is not ignore_index.
A sequence with every target ignored has log-prob 0 (its mean is defined as 0, never 0 / 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import ops as _o
from .functions import (TigonFusedLinearLogProbFunction, _cast, _head_grad_dtype, _head_operands, _head_sums,
                        _ignored_logit_sums, _kept_rows, _scaled_grad, _spread, _take, check_targets)
from .ops import ops, vector

DPO_LOSS_TYPES = ("sigmoid", "hinge", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero",
                  "apo_down", "discopop")


def _check_pairs(_input, target, name="_input"):
    if target.dim() != 2 or _input.dim() != 3 or tuple(_input.shape[:2]) != tuple(target.shape):
        raise ValueError(f"tigon_torch: {name} must be [2B, T, H] and target [2B, T]; got {tuple(_input.shape)} "
                         f"and {tuple(target.shape)}")
    if target.shape[0] % 2 != 0:
        raise ValueError(f"tigon_torch: the batch holds chosen and rejected halves of one size: {target.shape[0]} "
                         "sequences is odd")


def sequence_logps(_input, weight, target, bias=None, ignore_index=-100, average_log_prob=False):
    """(per-sequence log-probs [2B], per-token log-probs [2B, T], the token mask [2B, T], per-token logit sums
    [2B, T]) of the head on _input [2B, T, H]."""
    logp, _, logit_sum = TigonFusedLinearLogProbFunction.apply(_input, weight, target, bias, ignore_index, 1.0)
    mask = target != ignore_index
    seq = logp.sum(-1)  # ignored tokens give 0
    if average_log_prob:
        count = mask.sum(-1)
        seq = torch.where(count > 0, seq / count.clamp_min(1), torch.zeros_like(seq))
    return seq, logp, mask, logit_sum


def dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps=None, ref_rejected_logps=None, beta=0.1,
             loss_type="sigmoid", label_smoothing=0.0, discopop_tau=0.05):
    """(loss, chosen_rewards, rejected_rewards): the DPO family's loss summed over the pairs and divided by
    their number, the formulas of Liger-Kernel's LigerFusedLinearDPOFunction.preference_loss_fn (and TRL's)."""
    zero = torch.zeros((), device=chosen_logps.device)
    ref_c = ref_chosen_logps if ref_chosen_logps is not None else zero
    ref_r = ref_rejected_logps if ref_rejected_logps is not None else zero
    chosen_lr = chosen_logps - ref_c
    rejected_lr = rejected_logps - ref_r
    chosen_rewards = beta * chosen_lr
    rejected_rewards = beta * rejected_lr
    d = beta * (chosen_lr - rejected_lr)
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(d)
    elif loss_type == "hinge":
        losses = torch.relu(1 - d)
    elif loss_type == "exo_pair":
        if label_smoothing <= 0.0:
            raise ValueError("tigon_torch: loss_type 'exo_pair' needs label_smoothing > 0 (the EXO paper uses 1e-3)")
        eps = torch.tensor(label_smoothing, device=d.device)
        losses = (torch.sigmoid(d) * (F.logsigmoid(d) - torch.log1p(-eps))
                  + torch.sigmoid(-d) * (F.logsigmoid(-d) - torch.log(eps)))
    elif loss_type == "nca_pair":
        losses = -F.logsigmoid(chosen_rewards) - 0.5 * F.logsigmoid(-chosen_rewards) - 0.5 * F.logsigmoid(-rejected_rewards)
    elif loss_type == "robust":
        if not 0.0 <= label_smoothing < 0.5:
            raise ValueError(f"tigon_torch: loss_type 'robust' needs label_smoothing in [0, 0.5), got {label_smoothing}")
        losses = (-(1 - label_smoothing) * F.logsigmoid(d) + label_smoothing * F.logsigmoid(-d)) / (1 - 2 * label_smoothing)
    elif loss_type == "bco_pair":
        losses = -F.logsigmoid(chosen_rewards) - F.logsigmoid(-rejected_rewards)
    elif loss_type == "sppo_hard":
        losses = (chosen_lr - 0.5 / beta) ** 2 + (rejected_lr + 0.5 / beta) ** 2
    elif loss_type == "apo_zero":
        losses = (1 - torch.sigmoid(beta * chosen_lr)) + torch.sigmoid(beta * rejected_lr)
    elif loss_type == "apo_down":
        losses = torch.sigmoid(beta * chosen_lr) + (1 - torch.sigmoid(beta * (chosen_lr - rejected_lr)))
    elif loss_type == "discopop":
        mod = torch.sigmoid(d / discopop_tau)
        losses = -F.logsigmoid(d) * (1 - mod) + torch.exp(-d) * mod
    else:
        raise ValueError(f"tigon_torch: unknown DPO loss_type {loss_type!r}; choose from {DPO_LOSS_TYPES}")
    return losses.sum() / chosen_logps.shape[0], chosen_rewards, rejected_rewards


# Tokens per pair-chunk of the fused preference pass: the chunk's logits are kept between its forward and
# its gradient (2048 tokens of a 128256 vocabulary in bf16: 525 MB).
_PAIR_CHUNK_TOKENS = 2048


def _kept_bytes(tokens, vocab, elem, bias=False):
    """The workspace tigon.linear_logprob keeps its logits in (linear_logprob_workspace_bytes with
    keep_logits: all the tokens' logits, with a bias a slot for its aligned copy, and a ones vector,
    each rounded up to 256 bytes)."""
    def up(n):
        return (n + 255) // 256 * 256
    return up(tokens * vocab * elem) + (up(vocab * elem) if bias else 0) + up(tokens * elem)


class _FusedPairPreference(torch.autograd.Function):
    """The paired preference losses' value and gradients in one pass over chunks of pairs, as Liger's
    chunked losses compute them: per chunk of pairs (the chosen and the rejected sequences of each) the
    per-token log-probs (tigon.linear_logprob, the chunk's logits kept in a workspace), the chunk's share
    of the loss and its gradient with respect to those log-probs (autograd over [tokens] values), then
    dx, dW and db from the kept logits (tigon.linear_logprob_bwd, no second logits GEMM): 6 N D V FLOPs
    instead of the 8 of a log-prob forward and a separate backward. The loss functions are sums over the
    pairs divided by their number (every paired loss here is), so a chunk of P of the B pairs carries
    P / B of its loss_fn value. kept_count: check_targets' count of the targets that are not ignored (None
    when the check did not run); with enough ignored (functions._kept_rows) each chunk runs its kept rows
    alone. Returns (loss, chosen, rejected, chosen_logit_sum, rejected_logit_sum, nll, *aux) with aux
    loss_fn's further outputs (per-pair ones concatenated, scalars weighted)."""

    @staticmethod
    def forward(ctx, x, w, b, target, ref_c, ref_r, ignore_index, average_log_prob, compute_nll_loss, alpha, loss_fn,
                kept_count):
        n, T = target.shape[0] // 2, target.shape[1]
        H = x.shape[-1]
        vocab = w.shape[0]
        want_dx, want_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        want_db = b is not None and ctx.needs_input_grad[2]
        dev = x.device
        mask = target != ignore_index
        count = mask[:n].sum()
        nll_count = count.clamp_min(1).to(torch.float32)
        dx = torch.empty(x.shape, dtype=x.dtype, device=dev) if want_dx else None
        gdt = _head_grad_dtype(w.dtype)  # as the linear log-probs: the weight's dtype (float16: float32)
        dw = torch.zeros(w.shape, dtype=gdt, device=dev) if want_dw else None
        db = torch.zeros(vocab, dtype=gdt, device=dev) if want_db else None
        P = max(1, min(n, _PAIR_CHUNK_TOKENS // max(1, 2 * T)))
        # Each sequence's count of tokens that are not ignored (one synchronisation), when enough of the
        # batch is ignored for the chunks to run their kept rows alone (_kept_rows).
        seq_counts = mask.sum(-1).tolist() if _kept_rows(target, kept_count, ignore_index) is not None else None
        head_sums = _head_sums(w, b) if seq_counts is not None else None  # the skipped rows' logit sums
        pieces = {"c": [], "r": [], "csum": [], "rsum": [], "nll": [], "loss": [], "aux": []}
        kept = None
        first = True
        for i0 in range(0, n, P):
            i1 = min(n, i0 + P)
            p = i1 - i0
            xc = torch.cat([x[i0:i1], x[n + i0:n + i1]]).reshape(-1, H).contiguous()
            tc = torch.cat([target[i0:i1], target[n + i0:n + i1]]).reshape(-1).contiguous()
            rows = xc.shape[0]
            keep = None
            if seq_counts is not None:
                cnt = sum(seq_counts[i0:i1]) + sum(seq_counts[n + i0:n + i1])
                keep = _kept_rows(tc, cnt, ignore_index)
            xk, tk = _take(keep, xc, tc)
            rk = xk.shape[0]
            need = _kept_bytes(rk, vocab, x.element_size(), b is not None)
            if kept is None or kept.numel() < need:
                kept = torch.empty(need, dtype=torch.uint8, device=dev)
            logp = torch.empty(rk, dtype=torch.float32, device=dev)
            lse = torch.empty_like(logp)
            lsum = torch.empty_like(logp)
            ops().linear_logprob(xk, w, b, tk, logp, lse, None, lsum, None, int(ignore_index), 1.0, 0, kept)
            if keep is not None:
                logp = _spread(logp, keep, rows)
                lsum = _spread(lsum, keep, rows).index_copy_(
                    0, *_ignored_logit_sums(xc, head_sums, tc, ignore_index, rows - rk))
            lp = logp.view(2 * p, T).detach().requires_grad_(True)
            m = mask[torch.cat([torch.arange(i0, i1, device=dev), torch.arange(n + i0, n + i1, device=dev)])]
            with torch.enable_grad():
                seq = lp.sum(-1)
                if average_log_prob:
                    cnt = m.sum(-1)
                    seq = torch.where(cnt > 0, seq / cnt.clamp_min(1), torch.zeros_like(seq))
                args = (seq[:p], seq[p:])
                if ref_c is not None:
                    args = args + (ref_c[i0:i1], ref_r[i0:i1])
                out = loss_fn(*args)
                pref, aux = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
                share = pref * (p / n)
                total = share
                if compute_nll_loss:
                    nll_c = -lp[:p].sum() / nll_count
                    total = total + alpha * nll_c
                    pieces["nll"].append(nll_c.detach())
                (g,) = torch.autograd.grad(total, lp)
            pieces["c"].append(seq[:p].detach())
            pieces["r"].append(seq[p:].detach())
            pieces["csum"].append(lsum.view(2 * p, T)[:p].sum())
            pieces["rsum"].append(lsum.view(2 * p, T)[p:].sum())
            pieces["loss"].append(share.detach())
            pieces["aux"].append([(a.detach(), p) for a in aux])
            if want_dx or want_dw or want_db:
                (gk,) = _take(keep, g.reshape(-1))
                dxc = torch.empty_like(xk) if want_dx else None
                ops().linear_logprob_bwd(xk, w, b, tk, lse, None, gk.contiguous(), None, dxc, dw, db,
                                         int(ignore_index), 1.0, 0, not first, kept)
                first = False
                dxc = _spread(dxc, keep, rows)
                if dxc is not None:
                    d2 = dxc.view(2 * p, T, H)
                    dx[i0:i1] = d2[:p]
                    dx[n + i0:n + i1] = d2[p:]
        zero = torch.zeros((), device=dev)
        nll = torch.stack(pieces["nll"]).sum() if pieces["nll"] else zero
        loss = torch.stack(pieces["loss"]).sum() + alpha * nll
        aux_out = []
        for k in range(len(pieces["aux"][0])):
            vals = [(chunk[k][0], chunk[k][1]) for chunk in pieces["aux"]]
            if vals[0][0].dim() == 0:
                aux_out.append(sum(v * (q / n) for v, q in vals))
            else:
                aux_out.append(torch.cat([v for v, _ in vals]))
        denom = n * T * vocab
        ctx.save_for_backward(dx, dw, db)
        ctx.dtypes = (x.dtype, w.dtype, b.dtype if b is not None else None)
        outs = (loss, torch.cat(pieces["c"]), torch.cat(pieces["r"]), torch.stack(pieces["csum"]).sum() / denom,
                torch.stack(pieces["rsum"]).sum() / denom, nll, *aux_out)
        for t in outs[1:]:
            ctx.mark_non_differentiable(t)
        return outs

    @staticmethod
    def backward(ctx, grad_loss, *_):
        go = grad_loss.reshape(())
        dx, dw, db = (_scaled_grad(t, go, d) for t, d in zip(ctx.saved_tensors, ctx.dtypes))
        return dx, dw, db, None, None, None, None, None, None, None, None, None


def _fused_pairs_apply(_input, weight, target, bias, ignore_index, average_log_prob, compute_nll_loss, alpha, loss_fn,
                       ref_logps):
    """_preference through _FusedPairPreference: (loss, metrics) in the layout _preference returns."""
    x, w, b = _head_operands(_input, weight, bias)
    kept_count = check_targets(target.reshape(-1), weight.shape[0], int(ignore_index))
    ref_c, ref_r = ref_logps if ref_logps else (None, None)
    out = _FusedPairPreference.apply(x.contiguous(), w.contiguous(), vector(b), target.contiguous(), ref_c, ref_r,
                                     int(ignore_index), bool(average_log_prob), bool(compute_nll_loss), float(alpha),
                                     loss_fn, kept_count)
    return out[0], tuple(out[1:])


def _fusable(_input, weight, bias, nll_target):
    """Whether the fused pass applies: a training call (some gradient wanted), no separate NLL targets."""
    wants = _input.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    return nll_target is None and torch.is_grad_enabled() and wants and _o.on_device(_input)


def _preference(_input, weight, target, bias, ignore_index, average_log_prob, compute_nll_loss, nll_target, alpha,
                loss_fn, ref_logps=None):
    """The shared body of the preference losses, as Liger's LigerFusedLinearPreferenceBase composes them:
    (loss, (chosen_logps, rejected_logps, chosen_logits_mean, rejected_logits_mean, nll_loss, *aux)) with
    loss = alpha * nll_loss + loss_fn(chosen_logps, rejected_logps, *ref_logps)[0] and aux the rest of
    loss_fn's outputs (detached). In training (a gradient wanted, no nll_target) through _FusedPairPreference."""
    _check_pairs(_input, target)
    if _fusable(_input, weight, bias, nll_target):
        return _fused_pairs_apply(_input, weight, target, bias, ignore_index, average_log_prob, compute_nll_loss,
                                  alpha, loss_fn, ref_logps)
    n = target.shape[0] // 2
    seq, logp, mask, logit_sum = sequence_logps(_input, weight, target, bias, ignore_index, average_log_prob)
    chosen, rejected = seq[:n], seq[n:]
    out = loss_fn(chosen, rejected, *(ref_logps or ()))
    pref, aux = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
    zero = torch.zeros((), device=_input.device)
    nll = zero
    if compute_nll_loss:
        if nll_target is not None:
            if tuple(nll_target.shape) != tuple(target.shape):
                raise ValueError(f"tigon_torch: nll_target is {tuple(nll_target.shape)}, target {tuple(target.shape)}")
            nlp = TigonFusedLinearLogProbFunction.apply(_input[:n], weight, nll_target[:n], bias, ignore_index, 1.0)[0]
            count = (nll_target[:n] != ignore_index).sum()
        else:
            nlp, count = logp[:n], mask[:n].sum()
        nll = torch.where(count > 0, -nlp.sum() / count.clamp_min(1), zero)
    loss = alpha * nll + pref
    denom = n * target.shape[1] * weight.shape[0]
    metrics = (chosen.detach(), rejected.detach(), logit_sum[:n].sum() / denom, logit_sum[n:].sum() / denom,
               nll.detach())
    return loss, (*metrics, *(a.detach() for a in aux))


class TigonFusedLinearDPOFunction:
    """Liger's LigerFusedLinearDPOFunction: apply(_input, weight, target, bias=None, ref_input=None,
    ref_weight=None, ref_bias=None, ignore_index=-100, beta=0.1, compute_nll_loss=False, compiled=True,
    use_ref_model=True, average_log_prob=False, chunk_size=1, loss_type="sigmoid", label_smoothing=0.0,
    discopop_tau=0.05, alpha=1.0) -> (loss, (chosen_logps [B], rejected_logps [B], chosen_logits_mean,
    rejected_logits_mean, nll_loss, chosen_rewards [B], rejected_rewards [B])).

    loss = alpha * nll_loss + the DPO loss; nll_loss is the mean of -log p(target) over the chosen
    sequences' non-ignored tokens (0 when there are none, or without compute_nll_loss); the logits means are
    the sums of every chosen (rejected) token's logits over B T V. With use_ref_model, ref_input (and
    ref_weight, ref_bias; the policy's weight and bias where not given) give the reference log-probs, without
    gradient. compiled and chunk_size are Liger's placeholders here: the op is chunked inside tigon."""

    @staticmethod
    def apply(_input, weight, target, bias=None, ref_input=None, ref_weight=None, ref_bias=None, ignore_index=-100,
              beta=0.1, compute_nll_loss=False, compiled=True, use_ref_model=True, average_log_prob=False,
              chunk_size=1, loss_type="sigmoid", label_smoothing=0.0, discopop_tau=0.05, alpha=1.0):
        del compiled, chunk_size
        if loss_type not in DPO_LOSS_TYPES:
            raise ValueError(f"tigon_torch: unknown DPO loss_type {loss_type!r}; choose from {DPO_LOSS_TYPES}")
        _check_pairs(_input, target)
        ref = None
        if use_ref_model:
            if ref_input is None:
                raise ValueError("tigon_torch: use_ref_model needs ref_input")
            _check_pairs(ref_input, target, "ref_input")
            if ref_input.shape[0] != _input.shape[0]:
                raise ValueError(f"tigon_torch: ref_input has {ref_input.shape[0]} sequences, _input {_input.shape[0]}")
            with torch.no_grad():
                rw = ref_weight if ref_weight is not None else weight
                rb = ref_bias if ref_bias is not None else (bias if ref_weight is None else None)
                ref_seq = sequence_logps(ref_input, rw.detach(), target, rb.detach() if rb is not None else None,
                                         ignore_index, average_log_prob)[0]
            n = target.shape[0] // 2
            ref = (ref_seq[:n], ref_seq[n:])

        def fn(c, r, rc=None, rr=None):
            return dpo_loss(c, r, rc, rr, beta, loss_type, label_smoothing, discopop_tau)

        return _preference(_input, weight, target, bias, ignore_index, average_log_prob, compute_nll_loss, None,
                           alpha, fn, ref)


class TigonFusedLinearDPOLoss(nn.Module):
    """Liger's LigerFusedLinearDPOLoss: forward(lin_weight, _input, target, bias=None, ref_input=None,
    ref_weight=None, ref_bias=None) -> (loss, metrics) as TigonFusedLinearDPOFunction.apply returns them."""

    def __init__(self, ignore_index: int = -100, beta: float = 0.1, alpha: float = 1.0, compute_nll_loss: bool = False,
                 compiled: bool = True, use_ref_model: bool = True, average_log_prob: bool = False,
                 chunk_size: int = 1, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
                 discopop_tau: float = 0.05):
        super().__init__()
        if loss_type not in DPO_LOSS_TYPES:
            raise ValueError(f"tigon_torch: unknown DPO loss_type {loss_type!r}; choose from {DPO_LOSS_TYPES}")
        if loss_type == "exo_pair" and label_smoothing <= 0.0:
            raise ValueError("tigon_torch: loss_type 'exo_pair' needs label_smoothing > 0 (the EXO paper uses 1e-3)")
        if loss_type == "robust" and not 0.0 <= label_smoothing < 0.5:
            raise ValueError(f"tigon_torch: loss_type 'robust' needs label_smoothing in [0, 0.5), got {label_smoothing}")
        self.ignore_index = ignore_index
        self.beta = beta
        self.alpha = alpha
        self.compute_nll_loss = compute_nll_loss
        self.compiled = compiled
        self.use_ref_model = use_ref_model
        self.average_log_prob = average_log_prob
        self.chunk_size = chunk_size
        self.loss_type = loss_type
        self.label_smoothing = label_smoothing
        self.discopop_tau = discopop_tau

    def forward(self, lin_weight, _input, target, bias=None, ref_input=None, ref_weight=None, ref_bias=None):
        return TigonFusedLinearDPOFunction.apply(
            _input, lin_weight, target, bias, ref_input, ref_weight, ref_bias, self.ignore_index, self.beta,
            self.compute_nll_loss, self.compiled, self.use_ref_model, self.average_log_prob, self.chunk_size,
            self.loss_type, self.label_smoothing, self.discopop_tau, self.alpha)


# ------------------------------------------------------------------------------------------------
# ORPO, CPO, SimPO: reference-free preference losses (Liger's chunked_loss classes)
# ------------------------------------------------------------------------------------------------


def orpo_loss(chosen_logps, rejected_logps, beta=0.1):
    """(loss, chosen_rewards, rejected_rewards, log_odds_ratio, log_odds_chosen): ORPO's odds-ratio term,
    -beta mean log sigmoid(log odds(chosen) - log odds(rejected)), odds(y) = p(y) / (1 - p(y))."""
    n = chosen_logps.shape[0]
    log_odds = (chosen_logps - rejected_logps) - (torch.log1p(-torch.exp(chosen_logps))
                                                  - torch.log1p(-torch.exp(rejected_logps)))
    ratio = F.logsigmoid(log_odds)
    return (-beta * ratio.sum() / n, beta * chosen_logps, beta * rejected_logps, ratio.sum() / n, log_odds.sum() / n)


def cpo_loss(chosen_logps, rejected_logps, beta=0.1, label_smoothing=0.0, gamma=0.0):
    """(loss, chosen_rewards, rejected_rewards): the CPO (gamma 0) and SimPO (margin gamma) sigmoid loss of
    beta (chosen - rejected) - gamma with label smoothing, summed over the pairs and divided by their number."""
    d = beta * (chosen_logps - rejected_logps) - gamma
    losses = -F.logsigmoid(d) * (1 - label_smoothing) - F.logsigmoid(-d) * label_smoothing
    return losses.sum() / chosen_logps.shape[0], beta * chosen_logps, beta * rejected_logps


class TigonFusedLinearORPOFunction:
    """Liger's LigerFusedLinearORPOFunction: apply(_input, weight, target, bias=None, ignore_index=-100,
    beta=0.1, compute_nll_loss=True, nll_target=None, compiled=True, chunk_size=1) -> (loss, (chosen_logps,
    rejected_logps, chosen_logits_mean, rejected_logits_mean, nll_loss, chosen_rewards, rejected_rewards,
    log_odds_ratio, log_odds_chosen)); the log-probs averaged over each completion's tokens; nll_target
    (optional, [2B, T]) gives the NLL its own targets."""

    @staticmethod
    def apply(_input, weight, target, bias=None, ignore_index=-100, beta=0.1, compute_nll_loss=True, nll_target=None,
              compiled=True, chunk_size=1):
        return _preference(_input, weight, target, bias, ignore_index, True, compute_nll_loss, nll_target, 1.0,
                           lambda c, r: orpo_loss(c, r, beta))


class TigonFusedLinearCPOFunction:
    """Liger's LigerFusedLinearCPOFunction: apply(_input, weight, target, bias=None, ignore_index=-100,
    beta=0.1, alpha=1.0, label_smoothing=0.0, compute_nll_loss=True, compiled=True, average_log_prob=False,
    chunk_size=1) -> (loss, (chosen_logps, rejected_logps, chosen_logits_mean, rejected_logits_mean,
    nll_loss, chosen_rewards, rejected_rewards))."""

    @staticmethod
    def apply(_input, weight, target, bias=None, ignore_index=-100, beta=0.1, alpha=1.0, label_smoothing=0.0,
              compute_nll_loss=True, compiled=True, average_log_prob=False, chunk_size=1):
        return _preference(_input, weight, target, bias, ignore_index, average_log_prob, compute_nll_loss, None,
                           alpha, lambda c, r: cpo_loss(c, r, beta, label_smoothing))


class TigonFusedLinearSimPOFunction:
    """Liger's LigerFusedLinearSimPOFunction: apply(_input, weight, target, bias=None, ignore_index=-100,
    beta=0.1, alpha=1.0, label_smoothing=0.0, compute_nll_loss=False, compiled=True, gamma=0.5,
    chunk_size=1) -> (loss, (chosen_logps, rejected_logps, chosen_logits_mean, rejected_logits_mean,
    nll_loss, chosen_rewards, rejected_rewards)); the log-probs averaged over each completion's tokens."""

    @staticmethod
    def apply(_input, weight, target, bias=None, ignore_index=-100, beta=0.1, alpha=1.0, label_smoothing=0.0,
              compute_nll_loss=False, compiled=True, gamma=0.5, chunk_size=1):
        return _preference(_input, weight, target, bias, ignore_index, True, compute_nll_loss, None, alpha,
                           lambda c, r: cpo_loss(c, r, beta, label_smoothing, gamma))


class TigonFusedLinearORPOLoss(nn.Module):
    """Liger's LigerFusedLinearORPOLoss: __init__(ignore_index=-100, beta=0.1, compute_nll_loss=True,
    compiled=True, chunk_size=1); forward(lin_weight, _input, target, bias=None, nll_target=None)."""

    def __init__(self, ignore_index: int = -100, beta: float = 0.1, compute_nll_loss: bool = True,
                 compiled: bool = True, chunk_size: int = 1):
        super().__init__()
        self.ignore_index, self.beta, self.compute_nll_loss = ignore_index, beta, compute_nll_loss
        self.compiled, self.chunk_size = compiled, chunk_size

    def forward(self, lin_weight, _input, target, bias=None, nll_target=None):
        return TigonFusedLinearORPOFunction.apply(_input, lin_weight, target, bias, self.ignore_index, self.beta,
                                                  self.compute_nll_loss, nll_target, self.compiled, self.chunk_size)


class TigonFusedLinearCPOLoss(nn.Module):
    """Liger's LigerFusedLinearCPOLoss: __init__(ignore_index=-100, beta=0.1, alpha=1.0, label_smoothing=0.0,
    compute_nll_loss=True, compiled=True, average_log_prob=False, chunk_size=1); forward(lin_weight, _input,
    target, bias=None)."""

    def __init__(self, ignore_index: int = -100, beta: float = 0.1, alpha: float = 1.0, label_smoothing: float = 0.0,
                 compute_nll_loss: bool = True, compiled: bool = True, average_log_prob: bool = False,
                 chunk_size: int = 1):
        super().__init__()
        self.ignore_index, self.beta, self.alpha, self.label_smoothing = ignore_index, beta, alpha, label_smoothing
        self.compute_nll_loss, self.compiled = compute_nll_loss, compiled
        self.average_log_prob, self.chunk_size = average_log_prob, chunk_size

    def forward(self, lin_weight, _input, target, bias=None):
        return TigonFusedLinearCPOFunction.apply(_input, lin_weight, target, bias, self.ignore_index, self.beta,
                                                 self.alpha, self.label_smoothing, self.compute_nll_loss,
                                                 self.compiled, self.average_log_prob, self.chunk_size)


class TigonFusedLinearSimPOLoss(nn.Module):
    """Liger's LigerFusedLinearSimPOLoss: __init__(ignore_index=-100, beta=0.1, alpha=1.0, label_smoothing=0.0,
    compute_nll_loss=True, compiled=True, gamma=0.5, chunk_size=1); forward(lin_weight, _input, target,
    bias=None)."""

    def __init__(self, ignore_index: int = -100, beta: float = 0.1, alpha: float = 1.0, label_smoothing: float = 0.0,
                 compute_nll_loss: bool = True, compiled: bool = True, gamma: float = 0.5, chunk_size: int = 1):
        super().__init__()
        self.ignore_index, self.beta, self.alpha, self.label_smoothing = ignore_index, beta, alpha, label_smoothing
        self.compute_nll_loss, self.compiled, self.gamma, self.chunk_size = compute_nll_loss, compiled, gamma, chunk_size

    def forward(self, lin_weight, _input, target, bias=None):
        return TigonFusedLinearSimPOFunction.apply(_input, lin_weight, target, bias, self.ignore_index, self.beta,
                                                   self.alpha, self.label_smoothing, self.compute_nll_loss,
                                                   self.compiled, self.gamma, self.chunk_size)


# ------------------------------------------------------------------------------------------------
# KTO: an unpaired preference loss (Liger's LigerFusedLinearKTOFunction / LigerFusedLinearKTOLoss)
# ------------------------------------------------------------------------------------------------


def _check_unpaired(_input, target, name="_input"):
    if target.dim() != 2 or _input.dim() != 3 or tuple(_input.shape[:2]) != tuple(target.shape):
        raise ValueError(f"tigon_torch: {name} must be [B, T, H] and target [B, T]; got {tuple(_input.shape)} "
                         f"and {tuple(target.shape)}")


def _preference_labels(preference_labels, n):
    """preference_labels [B] as a bool tensor (True: a chosen / desirable completion)."""
    if preference_labels is None:
        raise ValueError("tigon_torch: KTO needs preference_labels, a bool tensor [B] (True: chosen)")
    if not isinstance(preference_labels, torch.Tensor) or tuple(preference_labels.shape) != (n,):
        shape = tuple(preference_labels.shape) if isinstance(preference_labels, torch.Tensor) else preference_labels
        raise ValueError(f"tigon_torch: preference_labels must be [B] = [{n}], one per sequence; got {shape}")
    if preference_labels.dtype == torch.bool:
        return preference_labels
    if preference_labels.is_floating_point() or preference_labels.is_complex():
        raise ValueError(f"tigon_torch: preference_labels must be bool (or integer 0 / 1), got "
                         f"{preference_labels.dtype}")
    return preference_labels != 0


def kto_loss(logps, preference_labels, ref_logps=None, beta=0.1, kl=None):
    """(loss, chosen_rewards_sum, rejected_rewards_sum) of KTO (Liger's LigerFusedLinearKTOFunction
    .preference_loss_fn): with r = logps - ref_logps (logps without a reference) and s = +1 for a chosen
    sequence, -1 for a rejected one, loss = sum(1 - sigmoid(beta (r - kl) s)) / B; rewards = beta r."""
    ratio = logps - ref_logps if ref_logps is not None else logps
    sign = torch.where(preference_labels, 1.0, -1.0)
    z = ratio - kl if kl is not None else ratio
    losses = 1 - torch.sigmoid(beta * z * sign)
    rewards = beta * ratio
    zero = torch.zeros_like(rewards)
    return (losses.sum() / logps.shape[0], torch.where(preference_labels, rewards, zero).sum(),
            torch.where(preference_labels, zero, rewards).sum())


class TigonFusedLinearKTOFunction:
    """Liger's LigerFusedLinearKTOFunction: apply(_input, weight, target, preference_labels, bias=None,
    ref_input=None, ref_weight=None, ref_bias=None, kl=None, ignore_index=-100, beta=0.1, compiled=True,
    use_ref_model=True, average_log_prob=False, chunk_size=1) -> (loss, (chosen_logps_sum,
    rejected_logps_sum, chosen_logits_sum, rejected_logits_sum, chosen_rewards_sum, rejected_rewards_sum)).

    _input [B, T, H] and target [B, T] hold B completions, each labelled by preference_labels [B] (bool,
    True: desirable; integer 0 / 1 labels are read as bool); the batch is unpaired, in any order. Each
    sequence's log-prob is the sum (average_log_prob: the mean) of log p(target) over its tokens whose
    target is not ignore_index (0 when they are all ignored). With r its log-ratio to the reference model
    (the log-prob itself without use_ref_model), loss = sum over the sequences of
    1 - sigmoid(beta (r - kl)) for a chosen one and 1 - sigmoid(beta (kl - r)) for a rejected one, divided
    by B. kl (optional, no gradient) is the estimate of KL(policy || reference) that TRL passes: one value
    (a 0-d or one-element tensor) for the whole batch, or one per sequence ([B]). The metrics are sums
    over the chosen (rejected) sequences: of their log-probs, of all their logits (every token, ignored
    ones included, over the vocabulary), of their rewards beta r. With use_ref_model, ref_input [B, T, H']
    (and ref_weight, ref_bias; the policy's weight and bias where ref_weight is not given) give the
    reference log-probs, without gradient. compiled and chunk_size are Liger's placeholders here: the op
    is chunked inside tigon."""

    @staticmethod
    def apply(_input, weight, target, preference_labels, bias=None, ref_input=None, ref_weight=None, ref_bias=None,
              kl=None, ignore_index=-100, beta=0.1, compiled=True, use_ref_model=True, average_log_prob=False,
              chunk_size=1):
        del compiled, chunk_size
        _check_unpaired(_input, target)
        n = target.shape[0]
        labels = _preference_labels(preference_labels, n)
        if kl is not None:
            if not isinstance(kl, torch.Tensor):
                kl = torch.tensor(float(kl), device=_input.device)
            if kl.numel() == 1:
                kl = kl.detach().reshape(())
            elif tuple(kl.shape) == (n,):
                kl = kl.detach()
            else:
                raise ValueError(f"tigon_torch: kl must hold one value or one per sequence ([{n}]); got "
                                 f"{tuple(kl.shape)}")
        ref_seq = None
        if use_ref_model:
            if ref_input is None:
                raise ValueError("tigon_torch: use_ref_model needs ref_input")
            _check_unpaired(ref_input, target, "ref_input")
            with torch.no_grad():
                rw = ref_weight if ref_weight is not None else weight
                rb = ref_bias if ref_bias is not None else (bias if ref_weight is None else None)
                ref_seq = sequence_logps(ref_input, rw.detach(), target, rb.detach() if rb is not None else None,
                                         ignore_index, average_log_prob)[0]
        seq, _, _, logit_sum = sequence_logps(_input, weight, target, bias, ignore_index, average_log_prob)
        loss, chosen_rewards, rejected_rewards = kto_loss(seq, labels, ref_seq, beta, kl)
        seq_d = seq.detach()
        zero = torch.zeros_like(seq_d)
        logits = logit_sum.sum(-1)
        metrics = (torch.where(labels, seq_d, zero).sum(), torch.where(labels, zero, seq_d).sum(),
                   torch.where(labels, logits, zero).sum(), torch.where(labels, zero, logits).sum(),
                   chosen_rewards.detach(), rejected_rewards.detach())
        return loss, metrics


class TigonFusedLinearKTOLoss(nn.Module):
    """Liger's LigerFusedLinearKTOLoss: __init__(ignore_index=-100, beta=0.1, compiled=True,
    use_ref_model=False, average_log_prob=False, chunk_size=1); forward(_input, lin_weight, target,
    bias=None, preference_labels=None, ref_input=None, ref_weight=None, ref_bias=None, kl=None) -> (loss,
    metrics) as TigonFusedLinearKTOFunction.apply returns them. As in Liger, forward takes _input before
    the weight (the DPO family's modules take the weight first), and preference_labels is required."""

    def __init__(self, ignore_index: int = -100, beta: float = 0.1, compiled: bool = True,
                 use_ref_model: bool = False, average_log_prob: bool = False, chunk_size: int = 1):
        super().__init__()
        self.ignore_index, self.beta, self.compiled = ignore_index, beta, compiled
        self.use_ref_model, self.average_log_prob, self.chunk_size = use_ref_model, average_log_prob, chunk_size

    def forward(self, _input, lin_weight, target, bias=None, preference_labels=None, ref_input=None, ref_weight=None,
                ref_bias=None, kl=None):
        return TigonFusedLinearKTOFunction.apply(
            _input, lin_weight, target, preference_labels, bias, ref_input, ref_weight, ref_bias, kl,
            self.ignore_index, self.beta, self.compiled, self.use_ref_model, self.average_log_prob, self.chunk_size)

"""Preference losses on the fused LM head: Liger-Kernel's chunked_loss API (LigerFusedLinearDPOLoss and
its function), on tigon's per-token log-probabilities (TigonFusedLinearLogProbFunction), so that no
[tokens, vocab] logits are ever held.

The batch is [2B, T, H] hidden states with [2B, T] targets: the first B sequences are the chosen
completions, the last B the rejected ones, as Liger and TRL lay them out. Per sequence, the log-prob is
the sum (average_log_prob: the mean) of log p(target) over its tokens whose target is not ignore_index.
A sequence with every target ignored has log-prob 0 (its mean is defined as 0, never 0 / 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .functions import TigonFusedLinearLogProbFunction

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


def _preference(_input, weight, target, bias, ignore_index, average_log_prob, compute_nll_loss, nll_target, alpha,
                loss_fn, ref_logps=None):
    """The shared body of the preference losses, as Liger's LigerFusedLinearPreferenceBase composes them:
    (loss, (chosen_logps, rejected_logps, chosen_logits_mean, rejected_logits_mean, nll_loss, *aux)) with
    loss = alpha * nll_loss + loss_fn(chosen_logps, rejected_logps, *ref_logps)[0] and aux the rest of
    loss_fn's outputs (detached)."""
    _check_pairs(_input, target)
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

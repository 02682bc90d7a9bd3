"""Policy-gradient losses on the fused LM head: Liger-Kernel's chunked GRPO (LigerFusedLinearGRPOLoss and
its function) on tigon's per-token log-probabilities (TigonFusedLinearLogProbFunction, with the sampling
temperature), so that no [tokens, vocab] logits are ever held.

The batch is B sampled completions: hidden states [B, T, H], the sampled token ids [B, T], the
completion mask [B, T] (1 for a completion token, 0 for padding) and one advantage per completion [B].
Every quantity below is per token, [B, T] (or per sequence, [B, 1], with importance_sampling_level
"sequence"); the loss types differ in how they reduce it.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn

from .functions import TigonFusedLinearLogProbFunction

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
_PAD = -100  # the log-prob op's ignore_index for padding ids outside the vocabulary


def _check_options(loss_type, importance_sampling_level, max_completion_length, sapo_temperature_pos,
                   sapo_temperature_neg, delta):
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"tigon_torch: unknown GRPO loss_type {loss_type!r}; choose from {GRPO_LOSS_TYPES}")
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"tigon_torch: unknown importance_sampling_level {importance_sampling_level!r}; choose "
                         f"from {IMPORTANCE_SAMPLING_LEVELS}")
    if importance_sampling_level == "sequence" and loss_type in ("cispo", "sapo", "vespo"):
        raise ValueError(f"tigon_torch: sequence-level importance sampling is not supported for loss_type "
                         f"{loss_type!r}; use importance_sampling_level='token'")
    if loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError("tigon_torch: loss_type 'dr_grpo' needs max_completion_length")
    if loss_type == "dr_grpo" and not max_completion_length > 0:
        raise ValueError(f"tigon_torch: max_completion_length must be > 0, got {max_completion_length}")
    if not sapo_temperature_pos > 0:
        raise ValueError(f"tigon_torch: sapo_temperature_pos must be > 0, got {sapo_temperature_pos}")
    if not sapo_temperature_neg > 0:
        raise ValueError(f"tigon_torch: sapo_temperature_neg must be > 0, got {sapo_temperature_neg}")
    if delta is not None and not delta > 0:
        raise ValueError(f"tigon_torch: delta must be > 0 (or None), got {delta}")


def _check_per_token(t, shape, name):
    if t is not None and tuple(t.shape) != shape:
        raise ValueError(f"tigon_torch: {name} must be [B, T] = {list(shape)}, like selected_token_ids; got "
                         f"{tuple(t.shape)}")


def _vllm_ratio(vllm_is_ratio, shape):
    """vllm_is_ratio as [B, 1] or [B, T] (a [B] ratio becomes [B, 1])."""
    if vllm_is_ratio is None:
        return None
    b, t = shape
    if vllm_is_ratio.dim() == 1 and vllm_is_ratio.shape[0] == b:
        return vllm_is_ratio.detach().reshape(b, 1)
    if vllm_is_ratio.dim() == 2 and vllm_is_ratio.shape[0] == b and vllm_is_ratio.shape[1] in (1, t):
        return vllm_is_ratio.detach()
    raise ValueError(f"tigon_torch: vllm_is_ratio must be [B] = [{b}], [B, 1] or [B, T] = [{b}, {t}]; got "
                     f"{tuple(vllm_is_ratio.shape)}")


def dapo_normalizer(attention_mask, num_items_in_batch=None):
    """The token count the dapo / cispo / vespo losses divide by, at least 1: num_items_in_batch (the
    active tokens of the whole generation batch, TRL's) divided by the world size when it is given, else
    the mask's sum, summed over the processes (all_reduce) and divided by the world size when
    torch.distributed is initialised."""
    dist = torch.distributed
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            total = num_items_in_batch.to(device=attention_mask.device, dtype=torch.float32)
        else:
            total = torch.as_tensor(float(num_items_in_batch), device=attention_mask.device, dtype=torch.float32)
    else:
        total = attention_mask.to(torch.float32).sum()
        if distributed:
            total = total.clone()
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return torch.clamp(total / world, min=1.0)


@torch.no_grad()
def vespo_weights(advantages, log_ratio, mask, vllm_is_ratio=None, k_pos=2.0, lambda_pos=3.0, k_neg=3.0,
                  lambda_neg=2.0):
    """VESPO's per-sequence gradient weight [B, 1], without gradient: phi(w) = exp(lambda (1 - w)) w^k
    (phi(1) = 1), w the sequence's importance ratio (the masked sum of the per-token log-ratios clamped to
    [-20, 20], plus the sum of log vllm_is_ratio over its last axis, the log clamped to [log 1e-8, 20]),
    k and lambda chosen by the advantage's sign (>= 0: the _pos pair); NaN or inf weights become 0."""
    floor = math.log(1e-8)
    seq = (log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)
    if vllm_is_ratio is not None:
        seq = seq + torch.log(vllm_is_ratio).clamp(floor, 20.0).sum(-1, keepdim=True)
    log_w = seq.clamp(floor, 20.0)
    nonneg = advantages.unsqueeze(-1) >= 0
    k = torch.where(nonneg, k_pos, k_neg)
    lam = torch.where(nonneg, lambda_pos, lambda_neg).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def grpo_loss(per_token_logps, attention_mask, advantages, ref_per_token_logps=None, old_per_token_logps=None,
              epsilon_low=0.2, epsilon_high=0.2, beta=0.04, loss_type="dapo", max_completion_length=None,
              importance_sampling_level="token", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
              vllm_is_ratio=None, delta=None, use_bias_correction_kl=False, vespo_k_pos=2.0, vespo_lambda_pos=3.0,
              vespo_k_neg=3.0, vespo_lambda_neg=2.0, num_items_in_batch=None):
    """(loss, metrics) of the GRPO family from per-token log-probs [B, T] (with gradient), the formulas of
    Liger-Kernel's LigerFusedLinearGRPOFunction.ppo_loss_fn over the whole batch; metrics is (the mean k3 KL
    over the completion tokens, only when beta != 0; the clipped fraction of the completion tokens).

    old_per_token_logps (the sampling policy's) and ref_per_token_logps default to the log-probs
    themselves, detached (ratio 1, KL 0). vllm_is_ratio is [B, 1] or [B, T]. Where attention_mask is 0,
    the old and reference log-probs are replaced by the policy's (ratio 1, KL 0) before any exponential,
    so that padding never turns into inf * 0; those tokens are masked out of every loss but luspo's,
    which weights every token, padding included, as Liger does."""
    logp = per_token_logps
    mask = attention_mask.to(torch.float32)
    valid = mask != 0
    n = mask.shape[0]
    lp_d = logp.detach()
    old = old_per_token_logps.detach().float() if old_per_token_logps is not None else lp_d
    ref = ref_per_token_logps.detach().float() if ref_per_token_logps is not None else lp_d
    if loss_type != "luspo":
        old = torch.where(valid, old, lp_d)
        ref = torch.where(valid, ref, lp_d)
    adv = advantages.detach().float().unsqueeze(1)
    log_ratio = logp - old
    if importance_sampling_level == "token":
        log_w = log_ratio
    else:
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef = torch.exp(log_w)
    no_clip = torch.zeros_like(coef, dtype=torch.bool)
    if loss_type == "cispo":
        clipped = torch.clamp(coef, max=epsilon_high).detach()
        low, high = no_clip, coef > epsilon_high
    elif loss_type in ("sapo", "vespo"):
        clipped, low, high = None, no_clip, no_clip
    else:
        clipped = torch.clamp(coef, 1 - epsilon_low, 1 + epsilon_high)
        low, high = coef < 1 - epsilon_low, coef > 1 + epsilon_high

    if loss_type == "cispo":
        per_token = -clipped * adv * logp
    elif loss_type == "sapo":
        a = adv.expand_as(coef)
        gate_pos = torch.sigmoid(sapo_temperature_pos * (coef - 1)) * 4 / sapo_temperature_pos
        gate_neg = torch.sigmoid(sapo_temperature_neg * (coef - 1)) * 4 / sapo_temperature_neg
        per_token = -torch.where(a > 0, gate_pos, gate_neg) * a
    elif loss_type == "vespo":
        phi = vespo_weights(advantages.detach().float(), log_ratio.detach(), mask, vllm_is_ratio, vespo_k_pos,
                            vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg)
        per_token = -phi * adv * logp
    else:
        c = torch.clamp(coef, max=delta) if delta is not None else coef
        per_token = -torch.min(c * adv, clipped * adv)
    if vllm_is_ratio is not None and loss_type != "vespo":
        per_token = per_token * vllm_is_ratio
    if beta != 0.0:
        d = ref - logp
        kl = torch.exp(d) - d - 1.0  # k3, an estimate of KL(policy || reference)
        if use_bias_correction_kl:
            kl = kl * torch.exp(log_w)
        per_token = per_token + beta * kl

    def masked(t):
        t = t * mask
        return t if loss_type == "luspo" else torch.where(valid, t, torch.zeros_like(t))

    tokens = mask.sum().clamp(min=1.0)
    if loss_type in ("grpo", "sapo"):
        loss = (masked(per_token).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / n
    elif loss_type == "bnpo":
        loss = masked(per_token).sum() / tokens
    elif loss_type == "dr_grpo":
        loss = masked(per_token).sum() / (n * max_completion_length)
    elif loss_type in ("dapo", "cispo", "vespo"):
        loss = masked(per_token).sum() / dapo_normalizer(attention_mask, num_items_in_batch)
    elif loss_type == "luspo":
        weighted = per_token * mask.sum(1, keepdim=True)
        loss = weighted.sum() / (n * weighted.shape[1])
    else:
        raise ValueError(f"tigon_torch: unknown GRPO loss_type {loss_type!r}; choose from {GRPO_LOSS_TYPES}")

    metrics = []
    if beta != 0.0:
        metrics.append(masked(kl.detach()).sum() / tokens)
    is_clipped = (low & (adv < 0)) | (high & (adv > 0))
    metrics.append(masked(is_clipped.expand_as(mask).float()).sum() / tokens)
    return loss, metrics


class TigonFusedLinearGRPOFunction:
    """Liger's LigerFusedLinearGRPOFunction: apply(_input, weight, selected_token_ids, attention_mask,
    advantages, bias=None, ref_per_token_logps=None, old_per_token_logps=None, ref_input=None,
    ref_weight=None, ref_bias=None, beta=0.04, epsilon_low=0.2, epsilon_high=0.2, loss_type="dapo",
    max_completion_length=None, importance_sampling_level="token", sapo_temperature_pos=1.0,
    sapo_temperature_neg=1.05, temperature=1.0, compiled=True, use_ref_model=True, chunk_size=1,
    vllm_is_ratio=None, delta=None, use_bias_correction_kl=False, vespo_k_pos=2.0, vespo_lambda_pos=3.0,
    vespo_k_neg=3.0, vespo_lambda_neg=2.0, num_items_in_batch=None) -> (loss, metrics), metrics a tuple of
    0-d tensors: (kl, clip_ratio) when beta != 0, else (clip_ratio,).

    _input [B, T, H] are the completions' hidden states, selected_token_ids [B, T] the sampled tokens,
    attention_mask [B, T] the completion mask, advantages [B]. Per token, logp = log softmax((_input W^T
    + bias) / temperature)[selected id] (computed for every token, padding included; an id outside
    [0, V) where the mask is 0 gives 0), the importance ratio exp(logp - old_per_token_logps) (1 without
    them; importance_sampling_level "sequence": the exp of the masked mean log-ratio of the sequence),
    clipped to [1 - epsilon_low, 1 + epsilon_high]; the per-token loss is
    -min(ratio A, clipped ratio A) (ratio clamped to delta from above first, when given), cispo's
    -min(ratio, epsilon_high).detach() A logp, sapo's soft gate, vespo's weighted -phi A logp; times
    vllm_is_ratio when given; plus beta times the k3 KL estimate exp(ref - logp) - (ref - logp) - 1 when
    beta != 0 (times the ratio with use_bias_correction_kl).

    Reductions, by loss_type: grpo and sapo: each sequence's masked mean, summed and divided by B; bnpo:
    the masked sum over the mask's sum; dr_grpo: the masked sum over B * max_completion_length; dapo,
    cispo, vespo: the masked sum over num_items_in_batch (or the mask's sum, over all processes) divided
    by the world size; luspo: every token's loss times its sequence's mask sum, summed, over B T. The
    metrics are the masked means over the batch's completion tokens of the KL and of the clipped
    indicator (a ratio below the low bound with A < 0 or above the high bound with A > 0).

    With use_ref_model, the reference log-probs are ref_per_token_logps, or (when it is None and
    beta != 0) those of ref_input [B, T, H'] under ref_weight and ref_bias (the policy's weight and
    bias where ref_weight is not given), at the same temperature, without gradient. Only the policy
    (_input, weight, bias) takes gradients. compiled and chunk_size are Liger's placeholders here: the
    op is chunked inside tigon."""

    @staticmethod
    def apply(_input, weight, selected_token_ids, attention_mask, advantages, bias=None, ref_per_token_logps=None,
              old_per_token_logps=None, ref_input=None, ref_weight=None, ref_bias=None, beta=0.04, epsilon_low=0.2,
              epsilon_high=0.2, loss_type="dapo", max_completion_length=None, importance_sampling_level="token",
              sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, temperature=1.0, compiled=True,
              use_ref_model=True, chunk_size=1, vllm_is_ratio=None, delta=None, use_bias_correction_kl=False,
              vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0,
              num_items_in_batch=None):
        del compiled, chunk_size
        _check_options(loss_type, importance_sampling_level, max_completion_length, sapo_temperature_pos,
                       sapo_temperature_neg, delta)
        ids = selected_token_ids
        if ids.dim() != 2 or _input.dim() != 3 or tuple(_input.shape[:2]) != tuple(ids.shape):
            raise ValueError(f"tigon_torch: _input must be [B, T, H] and selected_token_ids [B, T]; got "
                             f"{tuple(_input.shape)} and {tuple(ids.shape)}")
        shape = tuple(ids.shape)
        if attention_mask is None:
            raise ValueError("tigon_torch: GRPO needs attention_mask, the completion mask [B, T]")
        _check_per_token(attention_mask, shape, "attention_mask")
        if tuple(advantages.shape) != shape[:1]:
            raise ValueError(f"tigon_torch: advantages must be [B] = [{shape[0]}], one per completion; got "
                             f"{tuple(advantages.shape)}")
        _check_per_token(old_per_token_logps, shape, "old_per_token_logps")
        ratio = _vllm_ratio(vllm_is_ratio, shape)
        if use_ref_model:
            if ref_per_token_logps is None and ref_input is None:
                raise ValueError("tigon_torch: use_ref_model needs ref_per_token_logps or ref_input")
            if ref_per_token_logps is not None:
                _check_per_token(ref_per_token_logps, shape, "ref_per_token_logps")
                if ref_input is not None:
                    warnings.warn("tigon_torch: both ref_per_token_logps and ref_input are given; using "
                                  "ref_per_token_logps", stacklevel=2)
            elif ref_input.dim() != 3 or tuple(ref_input.shape[:2]) != shape:
                raise ValueError(f"tigon_torch: ref_input must be [B, T, H] = {list(shape)} + [H]; got "
                                 f"{tuple(ref_input.shape)}")

        vocab = weight.shape[0]
        pad = (attention_mask == 0) & ((ids < 0) | (ids >= vocab))
        target = ids.masked_fill(pad, _PAD)
        logp = TigonFusedLinearLogProbFunction.apply(_input, weight, target, bias, _PAD, temperature)[0]
        ref = None
        if use_ref_model:
            if ref_per_token_logps is not None:
                ref = ref_per_token_logps
            elif beta != 0.0:  # the reference log-probs enter the KL term only
                with torch.no_grad():
                    rw = ref_weight if ref_weight is not None else weight
                    rb = ref_bias if ref_bias is not None else (bias if ref_weight is None else None)
                    ref = TigonFusedLinearLogProbFunction.apply(
                        ref_input, rw.detach(), target, rb.detach() if rb is not None else None, _PAD,
                        temperature)[0]
        loss, metrics = grpo_loss(
            logp, attention_mask, advantages, ref, old_per_token_logps, epsilon_low, epsilon_high, beta, loss_type,
            max_completion_length, importance_sampling_level, sapo_temperature_pos, sapo_temperature_neg, ratio,
            delta, use_bias_correction_kl, vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg,
            num_items_in_batch)
        return loss, tuple(m.detach() for m in metrics)


class TigonFusedLinearGRPOLoss(nn.Module):
    """Liger's LigerFusedLinearGRPOLoss: __init__(beta=0.04, compiled=True, use_ref_model=True,
    chunk_size=1, epsilon_low=0.2, epsilon_high=0.2, loss_type="dapo", max_completion_length=None,
    importance_sampling_level="token", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
    temperature=1.0, delta=None, use_bias_correction_kl=False, vespo_k_pos=2.0, vespo_lambda_pos=3.0,
    vespo_k_neg=3.0, vespo_lambda_neg=2.0); forward(_input, lin_weight, selected_token_ids,
    attention_mask, advantages, bias=None, ref_per_token_logps=None, old_per_token_logps=None,
    ref_input=None, ref_weight=None, ref_bias=None, vllm_is_ratio=None, num_items_in_batch=None) ->
    (loss, metrics) as TigonFusedLinearGRPOFunction.apply returns them. The options are checked here
    (an unknown loss_type or importance_sampling_level, dr_grpo without max_completion_length, a SAPO
    temperature or delta that is not > 0 raise ValueError)."""

    def __init__(self, beta: float = 0.04, compiled: bool = True, use_ref_model: bool = True, chunk_size: int = 1,
                 epsilon_low: float = 0.2, epsilon_high: float = 0.2, loss_type: str = "dapo",
                 max_completion_length: int | None = None, importance_sampling_level: str = "token",
                 sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05, temperature: float = 1.0,
                 delta: float | None = None, use_bias_correction_kl: bool = False, vespo_k_pos: float = 2.0,
                 vespo_lambda_pos: float = 3.0, vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0):
        super().__init__()
        _check_options(loss_type, importance_sampling_level, max_completion_length, sapo_temperature_pos,
                       sapo_temperature_neg, delta)
        self.beta, self.compiled, self.use_ref_model, self.chunk_size = beta, compiled, use_ref_model, chunk_size
        self.epsilon_low, self.epsilon_high, self.loss_type = epsilon_low, epsilon_high, loss_type
        self.max_completion_length = max_completion_length
        self.importance_sampling_level = importance_sampling_level
        self.sapo_temperature_pos, self.sapo_temperature_neg = sapo_temperature_pos, sapo_temperature_neg
        self.temperature, self.delta, self.use_bias_correction_kl = temperature, delta, use_bias_correction_kl
        self.vespo_k_pos, self.vespo_lambda_pos = vespo_k_pos, vespo_lambda_pos
        self.vespo_k_neg, self.vespo_lambda_neg = vespo_k_neg, vespo_lambda_neg

    def forward(self, _input, lin_weight, selected_token_ids, attention_mask, advantages, bias=None,
                ref_per_token_logps=None, old_per_token_logps=None, ref_input=None, ref_weight=None, ref_bias=None,
                vllm_is_ratio=None, num_items_in_batch=None):
        return TigonFusedLinearGRPOFunction.apply(
            _input, lin_weight, selected_token_ids, attention_mask, advantages, bias, ref_per_token_logps,
            old_per_token_logps, ref_input, ref_weight, ref_bias, self.beta, self.epsilon_low, self.epsilon_high,
            self.loss_type, self.max_completion_length, self.importance_sampling_level, self.sapo_temperature_pos,
            self.sapo_temperature_neg, self.temperature, self.compiled, self.use_ref_model, self.chunk_size,
            vllm_is_ratio, self.delta, self.use_bias_correction_kl, self.vespo_k_pos, self.vespo_lambda_pos,
            self.vespo_k_neg, self.vespo_lambda_neg, num_items_in_batch)

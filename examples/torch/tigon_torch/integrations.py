"""Trainer integrations: TRL's fused LM head on tigon's per-token log-probabilities.

TRL (1.x) scores completions without logits through its fused LM head: `trl.trainer.utils.add_fused_lm_head(model)`
makes `model(..., labels=labels, fused_lm_head=True)` return per-token log-probabilities (and, when asked,
entropies), and DPOTrainer, KTOTrainer, GRPOTrainer, RLOOTrainer and SFTTrainer call it for the policy and the
reference model. `patch_trl()` routes those calls through tigon.linear_logprob
(TigonFusedLinearLogProbFunction): the same values and gradients, the logits never held, the backward's
gradient GEMMs accumulated in fp32.
"""

from __future__ import annotations

from . import ops as _o
from .functions import TigonFusedLinearLogProbFunction
from .patch import _set

_TIGON_OUTPUTS = frozenset(("log_probs", "entropy", "mean_logits", "is_top1"))


def _tigon_chunked_logprob(original):
    class TigonChunkedLogProb:
        """TRL's ChunkedLogProbFunction with its `apply` signature, over tigon.linear_logprob: the log-probs,
        the entropy, the mean logit (over the temperature, as TRL takes it) and whether the target is the first
        argmax. A call tigon does not compute goes to TRL's own function: a final-logit softcap (Gemma 2 / 3),
        a logit scale other than 1 (Granite, MiniCPM3, Falcon-H1, ...), `log_sum_sq_probs` (WPO's weights), or
        CPU tensors."""

        tigon = True

        @staticmethod
        def apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
                  logit_scale=1.0, outputs=("log_probs",)):
            outputs = tuple(outputs)
            supported = (final_logit_softcapping is None and float(logit_scale) == 1.0
                         and set(outputs) <= _TIGON_OUTPUTS and _o.on_device(hidden))
            if not supported:
                return original.apply(hidden, weight, bias, targets, temperature, chunk_size,
                                      final_logit_softcapping, logit_scale, outputs)
            top1 = "is_top1" in outputs
            res = TigonFusedLinearLogProbFunction.apply(hidden, weight, targets, bias, -100, float(temperature), top1)
            logp, entropy, logit_sum = res[:3]
            mean_logits = logit_sum / (float(temperature) * weight.shape[0]) if "mean_logits" in outputs else None
            return (logp, entropy if "entropy" in outputs else None, None, mean_logits, res[3] if top1 else None)

    return TigonChunkedLogProb


def patch_trl() -> None:
    """Route TRL's fused LM head (`model(..., labels=labels, fused_lm_head=True)` after
    `trl.trainer.utils.add_fused_lm_head`, which TRL's trainers apply themselves) through tigon's per-token
    log-probabilities. Call it once, before training; calling it again changes nothing; tigon_torch.unpatch()
    undoes it. Needs TRL 1.x (`trl.trainer.utils.add_fused_lm_head`)."""
    try:
        import trl.trainer.utils as trl_utils
    except ImportError as e:
        raise ImportError("tigon_torch.patch_trl needs TRL (pip install trl)") from e
    original = getattr(trl_utils, "_ChunkedLogProbFunction", None)
    if original is None or not hasattr(trl_utils, "add_fused_lm_head"):
        raise RuntimeError("tigon_torch.patch_trl: this TRL has no fused LM head "
                           "(trl.trainer.utils.add_fused_lm_head); TRL 1.x has it")
    if getattr(original, "tigon", False):
        return
    _set(trl_utils, "_ChunkedLogProbFunction", _tigon_chunked_logprob(original))


__all__ = ["patch_trl"]

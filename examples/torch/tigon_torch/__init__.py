"""tigon_torch: PyTorch autograd functions, modules and Hugging Face patches over tigon's fused
training kernels (RMSNorm, LayerNorm, fused add + RMSNorm, RoPE, SwiGLU / GeGLU, cross-entropy,
fused linear cross-entropy, the distillation divergences: JSD, KL divergence, TVD, fused linear JSD;
the post-training losses on the fused LM head: DPO, ORPO, CPO, SimPO, KTO, GRPO).

The compiled operators load on first use (tigon_torch.load(): the pip-built extension, or a JIT
build). Importing the package needs neither a GPU nor the extension.

A Liger-Kernel user's code runs with `liger` renamed to `tigon`: apply_liger_kernel_to_<family> ->
apply_tigon_to_<family>, LigerX -> TigonX, liger_x -> tigon_x, with Liger's parameters, order,
defaults and return types (docs/torch.md, "The Liger-Kernel API").
"""

from ._ext import load
from .functional import (
    CrossEntropyOutput,
    tigon_causal_lm_loss,
    tigon_cross_entropy,
    tigon_fused_add_rms_norm,
    tigon_fused_gate_up,
    tigon_fused_linear_cpo,
    tigon_fused_linear_cross_entropy,
    tigon_fused_linear_dpo,
    tigon_fused_linear_grpo,
    tigon_fused_linear_jsd,
    tigon_fused_linear_kto,
    tigon_fused_linear_orpo,
    tigon_fused_linear_simpo,
    tigon_gated_mlp,
    tigon_geglu,
    tigon_jsd,
    tigon_kl_div,
    tigon_layer_norm,
    tigon_rms_norm,
    tigon_rope,
    tigon_interleaved_rotary_pos_emb,
    tigon_llama4_text_rotary_pos_emb,
    tigon_llama4_vision_rotary_pos_emb,
    tigon_multimodal_rotary_pos_emb,
    tigon_qwen2vl_mrope,
    tigon_relu_squared,
    tigon_rotary_pos_emb,
    tigon_swiglu,
    tigon_tvd,
)
from .functions import (
    TigonCrossEntropyFunction,
    TigonFusedAddRMSNormFunction,
    TigonFusedGateUpMulFunction,
    TigonFusedLinearCrossEntropyFunction,
    TigonFusedLinearJSDFunction,
    TigonFusedLinearLogProbFunction,
    TigonFusedLinearMultiHeadCrossEntropyFunction,
    TigonGatedMLPFunction,
    TigonGatedMulFunction,
    TigonGELUMulFunction,
    TigonInterleavedRopeFunction,
    TigonJSDFunction,
    TigonKLDivLossFunction,
    TigonLayerNormFunction,
    TigonLlama4RopeFunction,
    TigonQwen2VLMRopeFunction,
    TigonReLUSquaredFunction,
    TigonRMSNormFunction,
    TigonRopeFunction,
    TigonSiLUMulFunction,
    TigonTVDLossFunction,
    TargetOutOfRangeError,
    check_targets,
    count_invalid_targets,
    medusa_targets,
)
from .preference import (
    TigonFusedLinearCPOFunction,
    TigonFusedLinearCPOLoss,
    TigonFusedLinearDPOFunction,
    TigonFusedLinearDPOLoss,
    TigonFusedLinearKTOFunction,
    TigonFusedLinearKTOLoss,
    TigonFusedLinearORPOFunction,
    TigonFusedLinearORPOLoss,
    TigonFusedLinearSimPOFunction,
    TigonFusedLinearSimPOLoss,
)
from .rl import TigonFusedLinearGRPOFunction, TigonFusedLinearGRPOLoss
from .integrations import patch_trl
from .modules import (
    TigonCrossEntropyLoss,
    TigonFusedAddRMSNorm,
    TigonFusedLinearCrossEntropyLoss,
    TigonFusedLinearMultiHeadCrossEntropyLoss,
    TigonFusedLinearJSD,
    TigonGEGLUMLP,
    TigonJSD,
    TigonKLDIVLoss,
    TigonLayerNorm,
    TigonPhi3MLP,
    TigonPhi3SwiGLUMLP,
    TigonRMSNorm,
    TigonRMSNormForGemma,
    TigonRMSNormForGemma2,
    TigonRMSNormForGemma3,
    TigonSwiGLUMLP,
    TigonTVDLoss,
)
from .patch import (
    AutoTigonForCausalLM,
    _apply_tigon,
    _apply_tigon_to_instance,
    apply_tigon_to_falcon_h1,
    apply_tigon_to_gemma,
    apply_tigon_to_gemma2,
    apply_tigon_to_gemma3,
    apply_tigon_to_gemma3_text,
    apply_tigon_to_glm4,
    apply_tigon_to_gpt_oss,
    apply_tigon_to_granite,
    apply_tigon_to_llama,
    apply_tigon_to_llama4,
    apply_tigon_to_mistral,
    apply_tigon_to_mixtral,
    apply_tigon_to_model,
    apply_tigon_to_nemotron,
    apply_tigon_to_olmo2,
    apply_tigon_to_olmo3,
    apply_tigon_to_phi,
    apply_tigon_to_phi3,
    apply_tigon_to_qwen2,
    apply_tigon_to_qwen2_5_vl,
    apply_tigon_to_qwen2_vl,
    apply_tigon_to_qwen3,
    apply_tigon_to_qwen3_moe,
    apply_tigon_to_qwen3_vl,
    apply_tigon_to_smollm3,
    unpatch,
)

__version__ = "0.1.0"

__all__ = [name for name in dir() if name.startswith(("Tigon", "tigon_", "apply_tigon_"))] + [
    "CrossEntropyOutput", "TargetOutOfRangeError", "check_targets", "count_invalid_targets", "load", "medusa_targets",
    "unpatch", "patch_trl", "AutoTigonForCausalLM",
    "_apply_tigon", "_apply_tigon_to_instance"]

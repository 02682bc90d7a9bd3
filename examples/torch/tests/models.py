"""Mini Hugging Face models of every family tigon_torch patches, built from configs (no download)."""

from __future__ import annotations

import torch

# family -> (config class, causal-LM class, the family's real vocabulary size)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", 32000),
    "mistral": ("MistralConfig", "MistralForCausalLM", 32768),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", 151936),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", 151936),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", 256000),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", 256000),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", 262144),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", 32064),
}


def make_config(family: str, vocab: int | None = None, hidden: int = 64, layers: int = 2, heads: int = 4,
                kv_heads: int = 2, intermediate: int | None = None, head_dim: int | None = None):
    import transformers

    cfg_name, _, real_vocab = FAMILIES[family]
    cfg_cls = getattr(transformers, cfg_name)
    head_dim = head_dim or hidden // heads
    kwargs = dict(
        vocab_size=vocab or real_vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=family.startswith("gemma"),
    )
    if family != "phi3":
        kwargs["head_dim"] = head_dim
    else:
        kwargs["partial_rotary_factor"] = 0.5  # RoPE on half of each head (tigon's partial rotary path)
    if family in ("gemma2", "gemma3_text"):
        kwargs.update(query_pre_attn_scalar=head_dim, sliding_window=16)
    if family == "gemma2":
        kwargs.update(final_logit_softcapping=30.0, attn_logit_softcapping=50.0)
    if family == "gemma3_text":
        kwargs.update(final_logit_softcapping=30.0)
    cfg = cfg_cls(**kwargs)
    cfg._attn_implementation = "eager"
    return cfg


def build_model(family: str, seed: int = 0, dtype=torch.float32, device="cpu", attn_implementation="eager",
                **config_kwargs):
    import transformers

    _, lm_name, _ = FAMILIES[family]
    cfg = make_config(family, **config_kwargs)
    cfg._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = getattr(transformers, lm_name)(cfg)
    return model.to(device=device, dtype=dtype)

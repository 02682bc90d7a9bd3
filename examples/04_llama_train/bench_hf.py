"""Hugging Face's LlamaDecoderLayer at the shapes of `example_llama_train --bench-layer`: forward and
backward (the input's and every weight's gradient), bfloat16, SDPA attention, in eager mode and under
torch.compile, medians of 20 timed with CUDA events after warm-up.

    python bench_hf.py [--seq 4096] [--batch 1]
"""

import argparse
import statistics

import torch


def layer_and_inputs(batch, seq):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, num_hidden_layers=1, max_position_embeddings=seq, rms_norm_eps=1e-5)
    cfg._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(cfg, layer_idx=0).to("cuda", torch.bfloat16)
    for n, p in layer.named_parameters():
        torch.nn.init.normal_(p, 0.0, 0.02) if "norm" not in n else torch.nn.init.ones_(p)
    rope = LlamaRotaryEmbedding(cfg).to("cuda")
    x = torch.randn(batch, seq, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(seq, device="cuda").unsqueeze(0).expand(batch, -1)
    cos, sin = rope(x, pos)
    dy = torch.randn_like(x)
    return layer, x, pos, (cos, sin), dy


def step(layer, x, pos, emb, dy):
    out = layer(x, attention_mask=None, position_ids=pos, position_embeddings=emb)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(dy)


def time_ms(fn, reps=20, warmup=5):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    layer, x, pos, emb, dy = layer_and_inputs(args.batch, args.seq)

    def eager():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        step(layer, x, pos, emb, dy)

    compiled = torch.compile(layer)

    def comp():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        step(compiled, x, pos, emb, dy)

    print(f"HF LlamaDecoderLayer, hidden 4096, heads 32 / 8 x 128, intermediate 14336, batch {args.batch} x seq "
          f"{args.seq}, bf16, forward + backward (medians of 20):")
    print(f"  eager          {time_ms(eager):.3f} ms")
    print(f"  torch.compile  {time_ms(comp):.3f} ms")
    torch.cuda.reset_peak_memory_stats()
    eager()
    torch.cuda.synchronize()
    print(f"  eager peak memory {torch.cuda.max_memory_allocated() / 1e6:.0f} MB")


if __name__ == "__main__":
    main()

"""A few DPO steps of a small Llama with TRL's DPOTrainer, its LM head on tigon's per-token log-probs
(tigon_torch.patch_trl), beside TRL's own head from the same weights: the losses and metrics of each
step, the time per step and the peak memory. Runs offline: the model is built from a config, the
tokenizer from a word list, the preference pairs in code.

    python examples/torch/scripts/trl_dpo.py                 # 8 steps, tigon and TRL, on the GPU
    python examples/torch/scripts/trl_dpo.py --steps 20 --hidden 1024 --layers 4 --vocab 32000
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

WORDS = "the cat dog sat ran on mat log fast slow a red blue big small".split()


def toy_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def toy_pairs(n=8):
    from datasets import Dataset

    prompts = ["the cat", "a dog", "the big dog", "a small cat"]
    chosen = [" sat on the mat", " ran fast", " sat on a log", " ran slow"]
    rejected = [" ran on the log", " sat slow", " ran on the mat", " sat fast"]
    k = (n + 3) // 4
    return Dataset.from_dict({"prompt": (prompts * k)[:n], "chosen": (chosen * k)[:n],
                              "rejected": (rejected * k)[:n]})


def small_llama(vocab, hidden, layers, device, dtype, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
                      max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype)


def train(patched, steps=8, vocab=320, hidden=64, layers=2, batch=4, device="cuda", dtype=torch.float32,
          outdir=None):
    """DPO steps from fixed weights: (the per-step logs, the trained parameters, seconds per step, peak MB)."""
    import tigon_torch
    from trl import DPOConfig, DPOTrainer

    tigon_torch.unpatch()
    if patched:
        tigon_torch.patch_trl()
    model = small_llama(vocab, hidden, layers, device, dtype)
    ref = small_llama(vocab, hidden, layers, device, dtype)
    args = DPOConfig(output_dir=outdir or tempfile.mkdtemp(), per_device_train_batch_size=batch, max_steps=steps,
                     learning_rate=1e-3, report_to=[], logging_steps=1, save_strategy="no", seed=0, beta=0.1,
                     use_cpu=device == "cpu", bf16=False, disable_tqdm=True)
    trainer = DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=toy_pairs(2 * batch * steps),
                         processing_class=toy_tokenizer())
    if device != "cpu":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.train()
    if device != "cpu":
        torch.cuda.synchronize()
    secs = (time.perf_counter() - t0) / steps
    peak = torch.cuda.max_memory_allocated() / 2**20 if device != "cpu" else 0.0
    logs = [h for h in trainer.state.log_history if "loss" in h]
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    tigon_torch.unpatch()
    return logs, params, secs, peak


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=320)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    kw = dict(steps=a.steps, vocab=a.vocab, hidden=a.hidden, layers=a.layers, batch=a.batch, device=a.device)
    runs = {"tigon": train(True, **kw), "trl": train(False, **kw)}
    keys = ("loss", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected", "entropy")
    print("step  head   " + "  ".join(f"{k:>17}" for k in keys))
    for i in range(a.steps):
        for name, (logs, *_rest) in runs.items():
            print(f"{i + 1:4d}  {name:5s}  " + "  ".join(f"{logs[i][k]:17.6f}" for k in keys))
    for name, (_logs, _p, secs, peak) in runs.items():
        print(f"{name}: {secs * 1e3:.1f} ms a step (the trainer's, data loading included), peak {peak:.0f} MB")
    drift = max(float((runs["tigon"][1][k].float() - runs["trl"][1][k].float()).norm()
                      / runs["trl"][1][k].float().norm().clamp_min(1e-30)) for k in runs["trl"][1])
    print(f"largest relative difference of a trained parameter, tigon against TRL: {drift:.2e}")


if __name__ == "__main__":
    main()

"""Checks example_llama_train's first step against Hugging Face's LlamaForCausalLM.

    example_llama_train --dump DIR
    python reference.py DIR [--device cuda]
    python reference.py --example PATH/example_llama_train   # runs it with --dump into a temporary folder

Loads the weights the C++ model started from into transformers' LlamaForCausalLM, runs the same
batch (the loss is the mean cross-entropy over the targets that are not -100, the logits in fp32, as
HF's loss takes them) and the backward, twice: in bfloat16, as a PyTorch user trains, and in fp32,
the reference. For the loss and every parameter gradient it prints the relative L2 error of the C++
result and of HF's bfloat16 result against the fp32 one. The C++ step passes when each of its
errors is at most twice HF's bfloat16 error or within 1e-2 (the loss: within 2e-3 relative).
Exits 1 on a failure; with --example, 77 (skipped) where the example finds no GPU.
"""

import argparse
import json
import pathlib
import sys

try:
    import torch
    import torch.nn.functional as F
except ImportError as e:  # ctest's entry (--example) reports skipped where this Python has no torch
    print(f"SKIPPED: {e}")
    sys.exit(77 if "--example" in sys.argv else 1)


def read(path, dtype, shape):
    data = bytearray(pathlib.Path(path).read_bytes())
    return torch.frombuffer(data, dtype=dtype).reshape(shape).clone()


def hf_config(c):
    from transformers import LlamaConfig

    kwargs = dict(
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_hidden_layers"],
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"],
        head_dim=c["head_dim"],
        rms_norm_eps=c["rms_norm_eps"],
        max_position_embeddings=c["seq"],
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
    )
    cfg = LlamaConfig(**kwargs)
    cfg.rope_theta = c["rope_theta"]  # transformers 4's field; 5 reads rope_parameters
    if isinstance(getattr(cfg, "rope_parameters", None), dict):
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": c["rope_theta"]}
    cfg._attn_implementation = "sdpa"
    return cfg


def split_names(c):
    """HF parameter name -> (fused file name, row slice) for every parameter."""
    d, i = c["hidden_size"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    out = {"model.embed_tokens.weight": ("model.embed_tokens.weight", None),
           "model.norm.weight": ("model.norm.weight", None),
           "lm_head.weight": ("lm_head.weight", None)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        qkv = p + "self_attn.qkv_proj.weight"
        gu = p + "mlp.gate_up_proj.weight"
        out[p + "input_layernorm.weight"] = (p + "input_layernorm.weight", None)
        out[p + "self_attn.q_proj.weight"] = (qkv, slice(0, q))
        out[p + "self_attn.k_proj.weight"] = (qkv, slice(q, q + kv))
        out[p + "self_attn.v_proj.weight"] = (qkv, slice(q + kv, q + 2 * kv))
        out[p + "self_attn.o_proj.weight"] = (p + "self_attn.o_proj.weight", None)
        out[p + "post_attention_layernorm.weight"] = (p + "post_attention_layernorm.weight", None)
        out[p + "mlp.gate_proj.weight"] = (gu, slice(0, i))
        out[p + "mlp.up_proj.weight"] = (gu, slice(i, 2 * i))
        out[p + "mlp.down_proj.weight"] = (p + "mlp.down_proj.weight", None)
    return out


def run(model, tokens, targets, dtype, rotary):
    model = model.to(dtype)
    for module, inv_freq in rotary:  # the rotary frequencies stay fp32, as from_pretrained keeps them
        module.inv_freq = inv_freq.clone()
    model.zero_grad(set_to_none=True)
    hidden = model.model(input_ids=tokens).last_hidden_state
    logits = model.lm_head(hidden).float()
    loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1), ignore_index=-100)
    loss.backward()
    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters()}
    return loss.item(), grads


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=pathlib.Path, nargs="?")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--example", type=pathlib.Path, help="run this example_llama_train binary to make the dump")
    args = ap.parse_args()
    if args.example is not None:
        import subprocess
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            run = subprocess.run([str(args.example), "--dump", tmp, "--first-step-only"])
            if run.returncode == 77:  # no GPU: skipped
                sys.exit(77)
            if run.returncode != 0:
                sys.exit(f"{args.example} exited with {run.returncode}")
            check(pathlib.Path(tmp), args.device)
        return
    if args.dir is None:
        ap.error("give the dump folder, or --example")
    check(args.dir, args.device)


def check(directory, device):
    """Compares the dump in directory with Hugging Face's step on device; exits 1 on a failure."""
    from transformers import LlamaForCausalLM

    c = json.loads((directory / "config.json").read_text())
    shape = (c["batch"], c["seq"])
    tokens = read(directory / "tokens.bin", torch.int64, shape).to(device)
    targets = read(directory / "targets.bin", torch.int64, shape).to(device)
    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_config(c)).to(device)
    # model.to(bfloat16) would round the rotary buffers too (a model loaded with from_pretrained(dtype=
    # torch.bfloat16) keeps them fp32): kept aside in fp32 and put back after each cast.
    rotary = [(m, m.inv_freq.detach().float().clone()) for m in model.modules() if hasattr(m, "inv_freq")]
    names = split_names(c)
    files = {}

    def fused(sub, file_name, like):
        key = (sub, file_name)
        if key not in files:
            path = directory / sub / (file_name + ".bin")
            numel = path.stat().st_size // 2
            files[key] = read(path, torch.bfloat16, (numel // like.shape[-1], like.shape[-1]) if like.dim() > 1 else (numel,))
        return files[key]

    params = dict(model.named_parameters())
    if set(params) != set(names):
        sys.exit(f"parameter names differ: {sorted(set(params) ^ set(names))}")
    cpp_grads = {}
    with torch.no_grad():
        for n, p in params.items():
            file_name, rows = names[n]
            w = fused("", file_name, p)
            g = fused("grad", file_name, p)
            p.copy_(w if rows is None else w[rows])
            cpp_grads[n] = (g if rows is None else g[rows]).float()

    loss_bf16, grads_bf16 = run(model, tokens, targets, torch.bfloat16, rotary)
    loss_fp32, grads_fp32 = run(model, tokens, targets, torch.float32, rotary)
    loss_cpp = c["loss"]

    failures = 0
    err_cpp, err_hf = abs(loss_cpp - loss_fp32) / abs(loss_fp32), abs(loss_bf16 - loss_fp32) / abs(loss_fp32)
    ok = err_cpp <= max(2 * err_hf, 2e-3)
    failures += not ok
    print(f"{'':48s} {'C++ (tigon)':>12s} {'HF bf16':>12s}")
    print(f"{'loss (fp32 reference ' + format(loss_fp32, '.5f') + ')':48s} {loss_cpp:12.5f} {loss_bf16:12.5f}  "
          f"{'ok' if ok else 'FAILED'}")
    print(f"{'relative L2 error of the gradient vs fp32':48s}")
    for n in params:
        e_cpp, e_hf = rel(cpp_grads[n], grads_fp32[n]), rel(grads_bf16[n], grads_fp32[n])
        ok = e_cpp <= max(2 * e_hf, 1e-2)
        failures += not ok
        print(f"  {n:46s} {e_cpp:12.2e} {e_hf:12.2e}  {'ok' if ok else 'FAILED'}")
    print(f"{len(params) + 1 - failures} of {len(params) + 1} checks passed on {device}")
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()

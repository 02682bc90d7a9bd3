"""tigon_torch.patch_trl: TRL's fused LM head (trl.trainer.utils.add_fused_lm_head) on tigon's per-token
log-probabilities. The patched head against TRL's own on a small Llama (log-probs, entropy, mean logits,
is_top1, the loss and the gradients; fp32 and bf16); the calls tigon does not take (a softcap, a logit
scale, log_sum_sq_probs) handed to TRL's function; a few DPOTrainer steps with and without the patch from
the same weights, and of SFTTrainer. Skipped without TRL."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE, assert_rel, count_applies

import tigon_torch as tt
import tigon_torch.integrations as integ

trl = pytest.importorskip("trl")
trl_utils = pytest.importorskip("trl.trainer.utils")
if not hasattr(trl_utils, "add_fused_lm_head"):
    pytest.skip("this TRL has no fused LM head", allow_module_level=True)

pytestmark = pytest.mark.gpu

ALL = ("log_probs", "entropy", "mean_logits", "is_top1")


def _script():
    """examples/torch/scripts/trl_dpo.py as a module: the small model, the toy data and the DPO run the
    example makes."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "trl_dpo.py"
    spec = importlib.util.spec_from_file_location("trl_dpo", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


script = _script()


@pytest.fixture
def calls(monkeypatch):
    """The number of times the patched head ran tigon's function."""
    return count_applies(monkeypatch, integ, "TigonFusedLinearLogProbFunction")


def head_run(model, ids, labels, outputs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels, fused_lm_head=True)
    (out.loss + 0.1 * out.entropy.sum()).backward()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
    return out, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_patched_head_matches_trl(ext, dtype, calls):
    model = script.small_llama(320, 64, 2, DEVICE, dtype)
    trl_utils.add_fused_lm_head(model, temperature=0.9, outputs=ALL)
    ids = torch.randint(2, 320, (3, 24), device=DEVICE)
    labels = ids.clone()
    labels[:, :7] = -100  # the prompt
    labels[2, 15:] = -100
    ref, ref_grads = head_run(model, ids, labels, ALL)
    tt.patch_trl()
    tt.patch_trl()  # a second call changes nothing
    got, grads = head_run(model, ids, labels, ALL)
    assert calls[0] == 1
    mask = labels[:, 1:] != -100
    for name in ("log_probs", "entropy", "mean_logits"):
        a, b = getattr(got, name), getattr(ref, name)
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert_rel(a[mask], b[mask], dtype, 4.0, name)
        assert torch.all(a[~mask] == 0), name
    assert got.is_top1.dtype == torch.bool and torch.equal(got.is_top1, ref.is_top1)
    assert_rel(got.loss, ref.loss, dtype, 4.0, "loss")
    assert grads.keys() == ref_grads.keys()
    for k in grads:
        assert_rel(grads[k], ref_grads[k], dtype, 8.0, k)
    tt.unpatch()
    assert not getattr(trl_utils._ChunkedLogProbFunction, "tigon", False)


def test_calls_tigon_does_not_take_go_to_trl(ext, calls):
    tt.patch_trl()
    patched = trl_utils._ChunkedLogProbFunction
    assert patched.tigon
    x = torch.randn(10, 16, device=DEVICE)
    w = torch.randn(50, 16, device=DEVICE) * 0.3
    t = torch.randint(0, 50, (10,), device=DEVICE)
    tt.unpatch()
    original = trl_utils._ChunkedLogProbFunction
    for kwargs in ({"final_logit_softcapping": 30.0}, {"logit_scale": 0.5},
                   {"outputs": ("log_probs", "log_sum_sq_probs")}):
        args = dict(final_logit_softcapping=None, logit_scale=1.0, outputs=("log_probs",))
        args.update(kwargs)
        a = patched.apply(x, w, None, t, 1.0, 4096, args["final_logit_softcapping"], args["logit_scale"],
                          args["outputs"])
        b = original.apply(x, w, None, t, 1.0, 4096, args["final_logit_softcapping"], args["logit_scale"],
                           args["outputs"])
        for u, v in zip(a, b):
            assert (u is None) == (v is None)
            if u is not None:
                torch.testing.assert_close(u, v)
    assert calls[0] == 0


def test_dpo_trainer_steps(ext, tmp_path, calls):
    kw = dict(steps=3, device=DEVICE)
    ref_logs, ref_w, _, _ = script.train(False, outdir=str(tmp_path / "trl"), **kw)
    assert calls[0] == 0
    logs, w, _, _ = script.train(True, outdir=str(tmp_path / "tigon"), **kw)
    assert calls[0] >= 6  # policy and reference, every step
    assert len(logs) == len(ref_logs) == 3
    for a, b in zip(logs, ref_logs):
        for key in ("loss", "logps/chosen", "logps/rejected", "rewards/margins", "entropy", "mean_token_accuracy"):
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-4), key
    for k in w:
        assert_rel(w[k], ref_w[k], torch.float32, 50.0, k)


def test_sft_trainer_steps(ext, tmp_path, calls):
    """SFTTrainer scores its loss through the fused head too (log-probs, entropy, is_top1 for the token
    accuracy): three steps with and without the patch from the same weights."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    data = Dataset.from_dict({"text": ["the cat sat on the mat", "a dog ran fast", "the big dog sat on a log",
                                       "a small cat ran slow"] * 3})

    def train(patched):
        tt.unpatch()
        if patched:
            tt.patch_trl()
        model = script.small_llama(320, 64, 2, DEVICE, torch.float32)
        args = SFTConfig(output_dir=str(tmp_path / str(patched)), per_device_train_batch_size=4, max_steps=3,
                         learning_rate=1e-3, report_to=[], logging_steps=1, save_strategy="no", seed=0,
                         use_cpu=DEVICE == "cpu", bf16=False, disable_tqdm=True)
        trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=script.toy_tokenizer())
        trainer.train()
        tt.unpatch()
        return ([h for h in trainer.state.log_history if "loss" in h],
                {k: p.detach().clone() for k, p in model.named_parameters()})

    ref_logs, ref_w = train(False)
    assert calls[0] == 0
    logs, w = train(True)
    assert calls[0] >= 3
    assert len(logs) == len(ref_logs) == 3
    for a, b in zip(logs, ref_logs):
        for key in ("loss", "entropy", "mean_token_accuracy"):
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-4), key
    for k in w:
        assert_rel(w[k], ref_w[k], torch.float32, 50.0, k)

"""The Trainer path: a patched model handed to Hugging Face's Trainer trains as the unpatched one does.
Three optimizer steps from the same weights with and without apply_tigon_to_model, with gradient
accumulation (the Trainer passes num_items_in_batch to the model's loss), with gradient checkpointing,
and with torch.compile of the patched model; the logged losses and the final weights agree, and the
fused loss ran on every micro-batch."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE, REFERENCE, assert_rel, count_applies
from models import build_model

import tigon_torch as tt
import tigon_torch.functional as tfn

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = pytest.mark.gpu


@pytest.fixture
def fused_calls(monkeypatch):
    """The number of times the patched causal-LM loss ran tigon's fused linear cross-entropy."""
    return count_applies(monkeypatch, tfn, "TigonFusedLinearCrossEntropyFunction")


class _Tokens(torch.utils.data.Dataset):
    """Fixed random token rows with labels; the first positions of each row are ignored (-100), and
    rows differ in their ignored count, so that the token count differs between micro-batches."""

    def __init__(self, vocab, rows=16, seq=48):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (rows, seq), generator=g)
        self.labels = self.ids.clone()
        for r in range(rows):
            self.labels[r, : 2 + 3 * (r % 5)] = -100

    def __len__(self):
        return self.ids.shape[0]

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i], "attention_mask": torch.ones_like(self.ids[i])}


def _train(tmp_path, patched, family="llama", accumulation=2, checkpointing=False, compile=False):
    vocab = 4096
    model = build_model(family, dtype=torch.float32, device=DEVICE, vocab=vocab, hidden=128, heads=4, kv_heads=2)
    if patched:
        tt.apply_tigon_to_model(model)
    # SGD, so that the final weights differ as the gradients do (Adam's first steps move every weight
    # by about the learning rate, whatever its gradient's size).
    fields = transformers.TrainingArguments.__dataclass_fields__
    ckpt = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / f"{family}-{patched}"), per_device_train_batch_size=2,
        gradient_accumulation_steps=accumulation, max_steps=3, learning_rate=0.05, optim="sgd", logging_steps=1,
        report_to=[], save_strategy="no", seed=0, data_seed=0, use_cpu=DEVICE == "cpu", bf16=False,
        disable_tqdm=True, torch_compile=compile, dataloader_num_workers=0, **{ckpt: checkpointing})
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(vocab))
    trainer.train()
    tt.unpatch()
    logs = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return logs, {k: p.detach().clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_trainer_patched_model(ext, tmp_path, fused_calls, family, checkpointing):
    ref_logs, ref_w = _train(tmp_path, False, family, checkpointing=checkpointing)
    assert fused_calls[0] == 0
    logs, w = _train(tmp_path, True, family, checkpointing=checkpointing)
    assert fused_calls[0] == 3 * 2  # every micro-batch of the three steps
    assert len(logs) == len(ref_logs) == 3
    assert logs == pytest.approx(ref_logs, rel=2e-4, abs=1e-5)
    for k in w:
        assert_rel(w[k], ref_w[k], torch.float32, 50.0, k)


def test_trainer_num_items_in_batch(ext, tmp_path, fused_calls):
    """With gradient accumulation the loss is the sum over the accumulated micro-batches divided by
    their total token count (num_items_in_batch), not the mean of the micro-batch means; the rows'
    token counts differ, so the two disagree, and the patched run matches Hugging Face's at
    accumulation 4."""
    ref_logs, ref_w = _train(tmp_path, False, accumulation=4)
    logs, w = _train(tmp_path, True, accumulation=4)
    assert fused_calls[0] == 3 * 4
    assert logs == pytest.approx(ref_logs, rel=2e-4, abs=1e-5)
    for k in w:
        assert_rel(w[k], ref_w[k], torch.float32, 50.0, k)


@pytest.mark.cuda_only
def test_trainer_torch_compile(ext, tmp_path, fused_calls):
    """TrainingArguments(torch_compile=True) on the patched model: the tigon operators trace as custom
    ops (their fake kernels), and the compiled run trains as the eager unpatched one."""
    if REFERENCE:
        pytest.skip("compiles the CUDA operators")
    ref_logs, ref_w = _train(tmp_path, False)
    logs, w = _train(tmp_path, True, compile=True)
    assert fused_calls[0] >= 1
    assert logs == pytest.approx(ref_logs, rel=1e-3, abs=1e-4)
    for k in w:
        assert_rel(w[k], ref_w[k], torch.float32, 100.0, k)

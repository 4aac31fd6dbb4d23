"""unifusion.integrations.checkpoints: every trainer's checkpoints on a tied-embedding model are folders
``DiffusionLM.from_pretrained`` opens, and a GRPO run stopped and resumed from its checkpoint reaches the weights of
the run that never stopped, bit for bit (float32, one process); without the row-seed generator's saved state it
does not."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import unifusion as uf

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from transformers import PreTrainedTokenizerFast, TrainerCallback, TrainingArguments  # noqa: E402
from trl import SFTConfig  # noqa: E402

from unifusion.integrations import DiffusionTrainer  # noqa: E402
from unifusion.integrations.trl import DiffusionGRPOConfig, DiffusionGRPOTrainer, DiffusionSFTTrainer  # noqa: E402

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from _hf_tiny import tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return PreTrainedTokenizerFast.from_pretrained(ROOT / "data" / "tiny_tokenizer")


def tied(tok) -> uf.DiffusionLM:
    torch.manual_seed(0)
    model = uf.adapt_ar_model(tiny_model("llama", tie_word_embeddings=True), add_mask_token=True, block_size=4,
                              tokenizer=tok)
    assert model.lm_head_weight is model.hf_model.get_input_embeddings().weight
    return model


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_sft_and_trainer_checkpoints_of_a_tied_model_load_as_models(tmp_path, tok) -> None:
    rows = [{"prompt": "ab cd ef", "completion": " gh ij kl"}, {"prompt": "qr st", "completion": " uv wx"}]
    common = dict(max_steps=1, per_device_train_batch_size=2, report_to=[], use_cpu=True, save_strategy="steps",
                  save_steps=1, learning_rate=1e-3, gradient_checkpointing=False)
    model = tied(tok)
    sft = DiffusionSFTTrainer(model, SFTConfig(str(tmp_path / "sft"), **common),
                              train_dataset=datasets.Dataset.from_list(rows * 2), processing_class=tok)
    sft.train()
    assert same_weights(uf.DiffusionLM.from_pretrained(tmp_path / "sft" / "checkpoint-1"), model)

    model = tied(tok)
    rows = [{"input_ids": torch.arange(5, 13)}] * 4
    plain = DiffusionTrainer(model, TrainingArguments(str(tmp_path / "plain"), **common), train_dataset=rows)
    plain.train()
    plain.save_model(str(tmp_path / "final"))
    for folder in (tmp_path / "plain" / "checkpoint-1", tmp_path / "final"):
        assert same_weights(uf.DiffusionLM.from_pretrained(folder), model)


class StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def grpo(tok, out: Path, *, stop: int | None = None, resume: Path | None = None) -> uf.DiffusionLM:
    model = tied(tok)
    args = DiffusionGRPOConfig(str(out), max_steps=4, per_device_train_batch_size=4, num_generations=2,
                               max_completion_length=8, report_to=[], use_cpu=True, save_strategy="steps",
                               save_steps=2, learning_rate=1e-2, beta=0.1, seed=3, decoding_policy="low_confidence",
                               num_steps=2, gradient_checkpointing=False)
    prompts = datasets.Dataset.from_list([{"prompt": "the cat and the dog"}, {"prompt": "a bird"}] * 4)
    trainer = DiffusionGRPOTrainer(
        model, reward_funcs=lambda completion_ids, **_: [sum(c) / (128.0 * len(c)) for c in completion_ids],
        args=args, train_dataset=prompts, processing_class=tok, callbacks=[StopAt(stop)] if stop else None)
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    return model


def test_grpo_resumed_from_its_checkpoint_is_the_uninterrupted_run(tmp_path, tok, monkeypatch) -> None:
    whole = grpo(tok, tmp_path / "whole")
    assert same_weights(uf.DiffusionLM.from_pretrained(tmp_path / "whole" / "checkpoint-4"), whole)
    grpo(tok, tmp_path / "stopped", stop=2)
    checkpoint = tmp_path / "stopped" / "checkpoint-2"
    assert same_weights(grpo(tok, tmp_path / "stopped", resume=checkpoint), whole)
    # the control: the same resume without the row-seed generator's state draws other rollouts
    monkeypatch.setattr(DiffusionGRPOTrainer, "load_extra_checkpoint_state", lambda self, state: None)
    assert not same_weights(grpo(tok, tmp_path / "stopped", resume=checkpoint), whole)

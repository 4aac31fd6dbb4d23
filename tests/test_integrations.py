"""unifusion.integrations: DiffusionTrainer (a transformers.Trainer whose compute_loss is diffusion_loss) on a tiny
block model — two training steps, and the loss equals diffusion_loss on the same batch and seed."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import unifusion as uf

pytest.importorskip("accelerate")  # transformers.Trainer needs it

from unifusion.integrations import ChatDataCollator, DiffusionTrainer  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _hf_tiny import tiny_model  # noqa: E402


def _examples(n: int = 8, length: int = 12) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        prompt = torch.zeros(length, dtype=torch.bool)
        prompt[:3] = True
        out.append({"input_ids": torch.randint(4, 128, (length,), generator=g), "prompt_mask": prompt})
    return out


def _collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def _trainer(tmp_path, model, **kwargs) -> DiffusionTrainer:
    from transformers import TrainingArguments

    args = TrainingArguments(str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to=[], use_cpu=True,
                             save_strategy="no", logging_steps=1, learning_rate=1e-3)
    return DiffusionTrainer(model, args, train_dataset=_examples(), data_collator=_collate, **kwargs)


@pytest.mark.parametrize("loss_kwargs", [None, {"complementary": True, "anneal_steps": 10}])
def test_two_steps_and_the_loss_is_diffusion_loss(tmp_path, loss_kwargs) -> None:
    model = uf.adapt_ar_model(tiny_model("llama"), add_mask_token=True, block_size=4)
    trainer = _trainer(tmp_path, model, loss_kwargs=loss_kwargs)
    before = model.lm_head_weight.detach().clone()
    result = trainer.train()
    assert result.global_step == 2 and torch.isfinite(torch.tensor(result.training_loss))
    assert not torch.equal(before, model.lm_head_weight)
    batch = _collate(_examples()[:4])
    kernel = uf.MaskKernel(model.num_states, model.mask_token_id)
    extra = {} if loss_kwargs is None else {"complementary": True, "anneal_steps": 10, "step": 2}
    torch.manual_seed(7)
    got = trainer.compute_loss(model, batch)
    torch.manual_seed(7)
    expected = uf.diffusion_loss(model, batch["input_ids"], kernel, prompt_mask=batch["prompt_mask"], **extra).mean()
    torch.testing.assert_close(got, expected)
    # transformers' labels convention (-100 = not trained on) is the same prompt
    labels = torch.where(batch["prompt_mask"], -100, batch["input_ids"])
    torch.manual_seed(7)
    by_labels = trainer.compute_loss(model, {"input_ids": batch["input_ids"], "labels": labels})
    torch.testing.assert_close(by_labels, expected)
    loss, out = trainer.compute_loss(model, batch, return_outputs=True)
    assert isinstance(out, uf.training.DiffusionLossOutput) and loss.shape == ()


def test_bad_arguments(tmp_path) -> None:
    model = uf.adapt_ar_model(tiny_model("llama"), add_mask_token=True, block_size=4)
    with pytest.raises(TypeError, match="kernel: expected a unifusion Kernel"):
        _trainer(tmp_path, model, kernel="mask")
    with pytest.raises(ValueError, match=r"loss_kwargs: \['prompt_mask'\] come from the batch"):
        _trainer(tmp_path, model, loss_kwargs={"prompt_mask": None})
    trainer = _trainer(tmp_path, model)
    with pytest.raises(ValueError, match="inputs: position_ids"):
        trainer.compute_loss(model, {"input_ids": torch.ones(1, 8, dtype=torch.long) * 5,
                                     "position_ids": torch.arange(8)[None]})
    # without a kernel, the default comes from the Denoiser inside the trainer's model: a plain module has none
    trainer = _trainer(tmp_path, model)  # no kernel chosen yet
    with pytest.raises(TypeError, match=r"kernel: the model \(Linear\) is not a unifusion Denoiser"):
        trainer.compute_loss(torch.nn.Linear(2, 2), {"input_ids": torch.ones(1, 8, dtype=torch.long) * 5})


def test_chat_data_collator_returns_the_trainer_dict() -> None:
    from test_chat import CHAT, tiny_tokenizer  # a word-level tokenizer with a chat template

    tok = tiny_tokenizer()
    packed = ChatDataCollator(tok, max_length=32, packing=True)([CHAT, CHAT[:2]])
    assert set(packed) == {"input_ids", "attention_mask", "prompt_mask", "document_ids"}
    assert packed["document_ids"].shape == packed["input_ids"].shape and packed["document_ids"].max() == 1
    padded = ChatDataCollator(tok, max_length=32)([CHAT, CHAT[:2]])
    assert set(padded) == {"input_ids", "attention_mask", "prompt_mask"}

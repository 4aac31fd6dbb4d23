"""unifusion.integrations.trl: TRL's SFTTrainer with the diffusion loss on a tiny block model — two steps on a
prompt-completion dataset; TRL's labels (-100 on the prompt) become the prompt mask; the loss equals diffusion_loss
on the same batch and seed."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

import unifusion as uf

pytest.importorskip("trl")
pytest.importorskip("datasets")

from unifusion.integrations.trl import DiffusionSFTTrainer  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _hf_tiny import tiny_model  # noqa: E402

DATA = Path(__file__).parent / "data"


def test_sft_two_steps_and_the_loss_is_diffusion_loss(tmp_path) -> None:
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig

    tok = PreTrainedTokenizerFast.from_pretrained(DATA / "tiny_tokenizer")
    model = uf.adapt_ar_model(tiny_model("llama"), add_mask_token=True, block_size=4, tokenizer=tok)
    rows = [{"prompt": "ab cd ef", "completion": " gh ij kl mn op"}, {"prompt": "qr st", "completion": " uv wx"}]
    args = SFTConfig(str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to=[], use_cpu=True,
                     save_strategy="no", logging_steps=1, learning_rate=1e-3, gradient_checkpointing=False)
    trainer = DiffusionSFTTrainer(model, args, train_dataset=Dataset.from_list(rows * 4), processing_class=tok,
                                  loss_kwargs={"complementary": True})
    before = model.lm_head_weight.detach().clone()
    result = trainer.train()
    assert result.global_step == 2 and torch.isfinite(torch.tensor(result.training_loss))
    assert not torch.equal(before, model.lm_head_weight)

    batch = next(iter(trainer.get_train_dataloader()))
    labels, attention = batch["labels"], batch["attention_mask"]
    prompt = (labels == -100) & attention.bool()
    assert prompt.any() and (attention.bool() & ~prompt).any()  # TRL masked the prompts, completions are trained
    torch.manual_seed(3)
    got = trainer.compute_loss(model, batch)
    torch.manual_seed(3)
    kernel = uf.MaskKernel(model.num_states, model.mask_token_id)
    expected = uf.diffusion_loss(model, batch["input_ids"], kernel, attention_mask=attention, prompt_mask=prompt,
                                 complementary=True).mean()
    torch.testing.assert_close(got, expected)

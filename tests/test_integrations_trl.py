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


def _sft(tmp_path, model, tok, rows, **config):
    from datasets import Dataset
    from trl import SFTConfig

    args = SFTConfig(str(tmp_path), max_steps=2, per_device_train_batch_size=2, report_to=[], use_cpu=True,
                     save_strategy="no", learning_rate=1e-3, gradient_checkpointing=False, **config)
    return DiffusionSFTTrainer(model, args, train_dataset=Dataset.from_list(rows), processing_class=tok)


TEXTS = [{"text": t} for t in ["the cat sat on the mat", "a dog", "she was in the garden with her", "it is not",
                               "they were at the house of his", "we had a", "you and i"]]


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split"])
def test_packed_sft_keeps_the_documents_apart(tmp_path, strategy) -> None:
    """TRL 1.16's bfd strategies (which force padding-free batches in TRL): each packed row reaches the loss padded,
    with document_ids marking the documents TRL laid end to end — each one a tokenised text of the dataset — and the
    first token of a document that starts inside a block unscored; training runs."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(DATA / "tiny_tokenizer")
    model = uf.adapt_ar_model(tiny_model("llama"), add_mask_token=True, block_size=4, tokenizer=tok)
    trainer = _sft(tmp_path, model, tok, TEXTS * 2, packing=True, packing_strategy=strategy, max_length=12)
    documents = {tuple(tok(r["text"])["input_ids"] + [tok.eos_token_id]) for r in TEXTS}
    batch = next(iter(trainer.get_train_dataloader()))
    assert "position_ids" not in batch and batch["input_ids"].dim() == 2
    seen = 0
    for ids, docs, labels, mask in zip(batch["input_ids"], batch["document_ids"], batch["labels"],
                                       batch["attention_mask"], strict=True):
        real = mask.bool()
        assert bool((docs[~real] == -1).all())
        for d in docs[real].unique().tolist():
            cols = (docs == d).nonzero().flatten()
            assert bool((cols.diff() == 1).all())  # one run per document
            piece = tuple(ids[cols].tolist())
            assert piece in documents or strategy == "bfd_split" and any(
                piece == full[i:i + len(piece)] for full in documents for i in range(len(full)))
            start = int(cols[0])
            assert (labels[start] == -100) == bool(start % 4), (start, labels)  # inside a block: unscored
            seen += 1
    assert seen > batch["input_ids"].shape[0]  # some row holds several documents
    result = trainer.train()
    assert result.global_step == 2 and torch.isfinite(torch.tensor(result.training_loss))


def test_packing_that_cannot_keep_documents_apart_is_refused_with_advice_that_works(tmp_path) -> None:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(DATA / "tiny_tokenizer")
    block = uf.adapt_ar_model(tiny_model("llama"), add_mask_token=True, block_size=4, tokenizer=tok)
    with pytest.raises(ValueError, match="packing_strategy: 'wrapped' cuts documents .* use packing_strategy='bfd'"):
        _sft(tmp_path, block, tok, TEXTS, packing=True, packing_strategy="wrapped", max_length=12)
    _sft(tmp_path, block, tok, TEXTS, packing=True, packing_strategy="bfd", max_length=12)  # the advice works
    with pytest.raises(ValueError, match="padding_free: .* leave padding_free=False"):
        _sft(tmp_path, block, tok, TEXTS, padding_free=True)
    _sft(tmp_path, block, tok, TEXTS, padding_free=False)
    plain = uf.adapt_ar_model(tiny_model("llama"), add_mask_token=True, tokenizer=tok)
    with pytest.raises(ValueError, match="packing: .* needs a block model .* or packing=False"):
        _sft(tmp_path, plain, tok, TEXTS, packing=True, max_length=12)
    with pytest.raises(ValueError, match="packing: rows of max_length=4 hold one block"):
        _sft(tmp_path, block, tok, TEXTS, packing=True, max_length=4)

"""unifusion.hf.ar.adapt: wrapping a causal LM (vocabulary, mask token, BOS, double wrapping, unsupported models)."""

from __future__ import annotations

import pytest
import torch
from _hf_tiny import VOCAB, random_ids, tiny_config, tiny_model
from torch import nn

from unifusion.hf import DiffusionLM, adapt_ar_model

L = 8
MASK_ID = 3


# ---------------------------------------------------------------------------------------------------------------
# vocabulary, mask token, BOS


@torch.no_grad()
def test_mask_token_is_added_with_mean_embedding() -> None:
    base = tiny_model("llama")
    w = base.get_input_embeddings().weight.clone()
    w_out = base.get_output_embeddings().weight.clone()
    model = adapt_ar_model(base)
    assert model.mask_token_id == VOCAB and model.added_mask_token
    assert model.vocab_size == model.num_states == VOCAB + 1
    torch.testing.assert_close(model.base_model.get_input_embeddings().weight[VOCAB], w.mean(0))
    torch.testing.assert_close(model.lm_head_weight[VOCAB], w_out.mean(0))
    x = random_ids()
    x[:, 2] = model.mask_token_id
    assert model(x).shape == (2, L, VOCAB + 1)

def test_mask_token_tied_model_stays_tied() -> None:
    model = adapt_ar_model(tiny_model("gpt2"))
    assert model.lm_head_weight is model.base_model.get_input_embeddings().weight
    assert model.num_states == VOCAB + 1

def test_given_mask_token_is_validated() -> None:
    model = adapt_ar_model(tiny_model("llama"), mask_token_id=5)
    assert model.mask_token_id == 5 and model.num_states == VOCAB
    with pytest.raises(ValueError, match=r"mask_token_id: expected a token id in \[0, 128\), got 128"):
        adapt_ar_model(tiny_model("llama"), mask_token_id=VOCAB)
    with pytest.raises(TypeError, match="mask_token_id"):
        adapt_ar_model(tiny_model("llama"), mask_token_id=True)

def test_bos_resolution() -> None:
    assert adapt_ar_model(tiny_model("llama"), bos_token_id=7, mask_token_id=3).bos_token_id == 7
    assert adapt_ar_model(tiny_model("llama", bos_token_id=None), mask_token_id=3).bos_token_id == 2  # eos
    with pytest.raises(ValueError, match="bos_token_id"):
        adapt_ar_model(tiny_model("llama", bos_token_id=None, eos_token_id=None), mask_token_id=3)
    with pytest.raises(ValueError, match="bos_token_id"):
        adapt_ar_model(tiny_model("llama"), bos_token_id=10_000, mask_token_id=3)

def test_uniform_only_adaptation_keeps_the_vocabulary(tmp_path):
    """add_mask_token=False (the paper's uniform setting): no resize, logits equal the AR model's, round-trips."""
    base = tiny_model("llama")
    reference = tiny_model("llama")
    model = adapt_ar_model(base, add_mask_token=False)
    assert model.mask_token_id is None and model.num_states == VOCAB
    assert base.get_input_embeddings().weight.shape[0] == VOCAB
    x = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    logits = model(x, bidirectional_prob=0.0)
    bos = torch.full((2, 1), model.bos_token_id)
    expected = reference(torch.cat([bos, x], 1)).logits[:, :-1]
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    model.save_pretrained(tmp_path)
    loaded = DiffusionLM.from_pretrained(tmp_path)
    assert loaded.mask_token_id is None and loaded.num_states == VOCAB
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    with pytest.raises(TypeError, match="add_mask_token"):
        adapt_ar_model(tiny_model("llama"), add_mask_token="no")


# ---------------------------------------------------------------------------------------------------------------
# wrapping, unsupported models


def test_wrapping_twice_warns_and_can_be_undone() -> None:
    base = tiny_model("llama")
    model = adapt_ar_model(base, mask_token_id=MASK_ID)
    assert model.base_model is base  # not a copy
    with pytest.warns(UserWarning, match="already a DiffusionLM"):
        again = adapt_ar_model(model)
    assert again is model

def test_unsupported_models_are_rejected_with_the_supported_list() -> None:
    from transformers import AutoModel, AutoModelForCausalLM

    with pytest.raises(TypeError, match="expected a Hugging Face causal LM"):
        adapt_ar_model(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="nn.Module"):
        adapt_ar_model("gpt2")  # type: ignore[arg-type]
    bert = AutoModel.from_config(tiny_config("bert", **{"hidden_size": 32, "num_hidden_layers": 1,
                                                        "num_attention_heads": 2, "intermediate_size": 32}))
    with pytest.raises((TypeError, ValueError), match="supported model types: .*llama"):
        adapt_ar_model(bert)
    opt = AutoModelForCausalLM.from_config(tiny_config(
        "opt", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, ffn_dim=32,
        word_embed_proj_dim=32, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    with pytest.raises(ValueError, match="'opt' is not supported.*4D attention masks"):
        adapt_ar_model(opt)
    backbone = AutoModel.from_config(tiny_config("llama"))  # a LlamaModel: no output head
    with pytest.raises(TypeError, match="output head"):
        adapt_ar_model(backbone)

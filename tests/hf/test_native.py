"""unifusion.hf.native: what every released diffusion LM kind checks when it is built (the kinds' own behaviour is
tested in tests/hf/llada, tests/hf/dream, tests/hf/sdar, tests/hf/lladamoe, tests/hf/fast_dllm and tests/hf/llada2
against their reference code)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _hf_tiny import tiny_native
from transformers import PreTrainedTokenizerFast

TOKENIZER = Path(__file__).resolve().parents[1] / "data" / "tiny_tokenizer"


@pytest.mark.parametrize("kind", ["llada", "dream", "sdar", "lladamoe", "fast_dllm", "llada2"])
def test_a_tokenizer_whose_mask_token_contradicts_the_config_is_refused(kind: str) -> None:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(TOKENIZER)
    model = tiny_native(kind, tokenizer)  # mask id = len(tokenizer): a token the tokenizer does not name
    assert model.mask_token_id == len(tokenizer) and model.tokenizer is tokenizer
    tokenizer.add_special_tokens({"mask_token": tokenizer.convert_ids_to_tokens(5)})
    assert tokenizer.mask_token_id == 5
    with pytest.raises(ValueError, match=f"tokenizer: its mask token is id 5, the checkpoint's config says mask id "
                                         f"{len(tokenizer)}"):
        tiny_native(kind, tokenizer)

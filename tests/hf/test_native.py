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


@pytest.mark.parametrize("kind", ["llada", "dream", "sdar", "fast_dllm"])
def test_head_fn_takes_the_heads_place_on_the_forwards_hidden_states(kind: str) -> None:
    """``forward(..., head_fn=f)`` returns ``f(h)`` of the hidden states ``hidden_states`` gives for the same
    arguments (bidirectional and shifted kinds; the block kinds' ``[x_t | clean]`` training stream)."""
    import torch

    tokenizer = PreTrainedTokenizerFast.from_pretrained(TOKENIZER)
    model = tiny_native(kind, tokenizer).eval()
    g = torch.Generator().manual_seed(0)
    x0 = torch.randint(5, len(tokenizer), (2, 8), generator=g)
    x_t = torch.where(torch.rand(2, 8, generator=g) < 0.5, model.mask_token_id, x0)
    pad = torch.ones(2, 8, dtype=torch.long)
    pad[1, :3] = 0
    conditioning = model.block_conditioning(x0)
    with torch.no_grad():
        got = model(x_t, attention_mask=pad, head_fn=lambda h: h, **conditioning)
        want = model.hidden_states(x_t, attention_mask=pad, **conditioning)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="head_fn: replaces the output head"):
        model(x_t, 0.5, x0=x0, kernel=model.kernel, head_fn=lambda h: h)

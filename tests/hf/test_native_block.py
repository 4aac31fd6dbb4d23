"""The block-causal machinery of the released block diffusion LMs (unifusion/hf/native_block.py), on a tiny random
block kind (SDAR's: Qwen3, block size 4): the attention patterns, the [x_t | x_0] training stream, and the exact
block KV cache (cached = uncached)."""

from __future__ import annotations

import pytest
import torch

import unifusion as uf
from unifusion.hf import SDARLM
from unifusion.hf.native_block import BlockCausalPattern, DoubledStreamPattern, NativeBlockCache
from unifusion.samplers.policies import ConfidenceThreshold, LowConfidence

MASK = 63
SOURCE = {"model_type": "sdar", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 128,
          "rope_theta": 10000.0, "mask_token_id": MASK, "block_size": 4, "eos_token_id": 62, "pad_token_id": 0,
          "bos_token_id": 1}


@pytest.fixture(scope="module")
def model() -> SDARLM:
    torch.manual_seed(0)
    return SDARLM.from_source(SOURCE).eval()


def test_block_causal_pattern_is_bidirectional_in_blocks_causal_across_and_blocks_padded_keys():
    key_valid = torch.tensor([[True] * 5, [False, False, True, True, True]])
    allowed = BlockCausalPattern(2, 5, 2, key_valid).allowed()[:, 0]
    expected = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    assert torch.equal(allowed[0].long(), expected)
    padded = expected.clone()
    padded[:, :2] = 0
    padded[0, 0] = padded[1, 1] = 1  # a padded query sees itself only
    assert torch.equal(allowed[1].long(), padded)
    assert BlockCausalPattern(1, 4, 4, None).is_full and not BlockCausalPattern(1, 5, 4, None).is_full


def test_doubled_stream_pattern_is_bd3lms():
    allowed = DoubledStreamPattern(1, 4, 2, None).allowed()[0, 0].long()
    # rows: noisy 0..3, clean 4..7; noisy block b sees its own noisy block and the clean blocks before it
    expected = torch.tensor([[1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0],
                             [0, 0, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 0, 0],
                             [0, 0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1, 0, 0],
                             [0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1, 1]])
    assert torch.equal(allowed, expected)


def test_training_stream_sees_the_clean_earlier_blocks_and_its_own_noisy_block(model):
    g = torch.Generator().manual_seed(1)
    x0 = torch.randint(2, 60, (1, 10), generator=g)
    x_t = torch.where(torch.rand(1, 10, generator=g) < 0.5, MASK, x0)
    with torch.no_grad():
        base = model(x_t, clean=x0)
        # with clean = x_t it is the one-stream forward (the uncached decoder's)
        torch.testing.assert_close(model(x_t, clean=x_t), model(x_t), rtol=0, atol=1e-5)
        other_noisy = x_t.clone()
        other_noisy[0, 0] = MASK if x_t[0, 0] != MASK else 5  # block 0's noisy token: block 1 must not see it
        moved = model(other_noisy, clean=x0)
        other_clean = x0.clone()
        other_clean[0, 9] = (x0[0, 9] + 1) % 60  # the last block's clean token: no noisy prediction sees it
        moved_clean = model(x_t, clean=other_clean)
        earlier_clean = x0.clone()
        earlier_clean[0, 1] = (x0[0, 1] + 1) % 60  # block 0's clean token: blocks 1 and 2 see it, block 0 not
        moved_earlier = model(x_t, clean=earlier_clean)
    torch.testing.assert_close(moved[:, 4:], base[:, 4:], rtol=0, atol=1e-6)
    assert not torch.allclose(moved[:, :4], base[:, :4])
    torch.testing.assert_close(moved_clean, base, rtol=0, atol=1e-6)
    torch.testing.assert_close(moved_earlier[:, :4], base[:, :4], rtol=0, atol=1e-6)
    assert not torch.allclose(moved_earlier[:, 4:], base[:, 4:])


@pytest.mark.parametrize("merge_commits", [False, True])
def test_cached_step_logits_equal_the_one_stream_forward(model, merge_commits):
    """Prompt of 5 (not a multiple of 4: blocks cut backward from its end) with a left-padded row; each step's
    cached logits equal the uncached forward on the sequence as it stands, behind the (−P) mod K invisible pads."""
    prompt = torch.randint(2, 60, (2, 5), generator=torch.Generator().manual_seed(2))
    prompt_mask = torch.tensor([[False, False, True, True, True], [True] * 5])
    decoder = model.block_decoder(merge_commits=merge_commits)
    assert isinstance(decoder, NativeBlockCache)
    state = decoder.start_blocks(prompt, prompt_mask)
    rows, t = torch.arange(2), torch.full((2,), 0.5)
    seq, valid = prompt.clone(), prompt_mask.clone()
    blocks = [torch.tensor([[MASK, 7, MASK, 9], [MASK, MASK, MASK, MASK]]), torch.tensor([[3, MASK, 4, MASK]] * 2),
              torch.tensor([[MASK, 8]] * 2)]
    for b, block in enumerate(blocks):
        K = block.shape[1]
        cached = decoder.denoise_block(state, block, t, rows, None)
        full = torch.cat([torch.full((2, 3), 5), seq, block], 1)  # 3 invisible pads: 3 + 5 ≡ 0 (mod 4)
        mask = torch.cat([torch.zeros(2, 3, dtype=torch.bool), valid, torch.ones(2, K, dtype=torch.bool)], 1)
        with torch.no_grad():
            direct = model(full, attention_mask=mask.long())[:, -K:]
        torch.testing.assert_close(cached, direct, rtol=1e-5, atol=1e-5)
        again = decoder.denoise_block(state, block, t, rows, None)  # the step left the cache as it was
        torch.testing.assert_close(again, direct, rtol=1e-5, atol=1e-5)
        committed = torch.where(block == MASK, 11 + b, block)
        if b < len(blocks) - 1:
            state = decoder.commit_block(state, committed, rows)
        seq = torch.cat([seq, committed], 1)
        valid = torch.cat([valid, torch.ones(2, K, dtype=torch.bool)], 1)
    assert state.extra_forwards is not None and state.extra_forwards.tolist() == [3 - merge_commits * 2] * 2


def test_generate_cached_equals_uncached_token_for_token(model):
    prompt = torch.randint(2, 60, (2, 6), generator=torch.Generator().manual_seed(3))
    attn = torch.tensor([[0, 1, 1, 1, 1, 1], [1] * 6])
    for policy, extra in ((LowConfidence(), {"do_sample": False}),
                          (ConfidenceThreshold(0.05), {"temperature": 0.9})):
        outs = []
        for kw in ({"use_cache": False}, {"use_cache": True}, {"use_cache": True, "merge_commits": True}):
            g = [torch.Generator().manual_seed(i) for i in range(2)]
            outs.append(model.generate(prompt, attention_mask=attn, max_new_tokens=10, policy=policy, num_steps=2,
                                       eos_token_id=None, generator=g, **extra, **kw))
        assert outs[0].shape == (2, 16) and torch.equal(outs[0][:, :6], prompt)
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    with pytest.raises(ValueError, match="block_size"):
        model.generate(prompt, max_new_tokens=8, policy=LowConfidence(), block_size=8)
    with pytest.raises(ValueError, match="cache_refresh"):
        model.generate(prompt, max_new_tokens=8, policy=LowConfidence(), cache_refresh=1)


def test_block_kind_takes_one_time_per_block_and_refuses_bad_inputs(model):
    x0 = torch.randint(2, 60, (2, 10))
    x_t = torch.where(torch.arange(10) % 3 == 0, MASK, x0)
    kernel = uf.MaskKernel(64, MASK)
    with torch.no_grad():
        per_block = model(x_t, torch.tensor([[0.2, 0.5, 0.8], [0.4, 0.4, 0.4]]), x0=x0, kernel=kernel,
                          objective="mdlm", clean=x0)
        per_row = model(x_t, torch.tensor([0.4, 0.4]), x0=x0, kernel=kernel, objective="mdlm", clean=x0)
    torch.testing.assert_close(per_block[1], per_row[1])
    assert per_block[0, 0] > 0 and torch.isclose(per_block[0, 0] * 0.2, per_row[0, 0] * 0.4)
    with pytest.raises(ValueError, match="clean: expected"):
        model(x_t, clean=x0[:, :5])
    with pytest.raises(ValueError, match="t: got shape"):
        model(x_t, torch.zeros(2, 2) + 0.5, x0=x0, kernel=kernel)
    with pytest.raises(ValueError, match="block_size = 0"):
        SDARLM.from_source({**SOURCE, "block_size": 0})

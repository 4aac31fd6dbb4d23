"""The frontier with a decoding policy: tokens per forward next to GenPPL and entropy, for an x0 callable
(PolicySampler) and a DiffusionLM (its generate, block model included), equal to the samplers' own counts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _hf_tiny import tiny_model

import unifusion as uf
from unifusion.eval import frontier
from unifusion.eval.frontier import PolicyFrontierSampler
from unifusion.samplers import PolicySampler
from unifusion.samplers.policies import ConfidenceThreshold, LowConfidence

DATA = Path(__file__).parents[1] / "data"


def test_fixed_count_policy_reports_its_tokens_per_forward(tmp_path, tokenizer, judge):
    model = uf.adapt_ar_model(tiny_model("llama", vocab_size=len(tokenizer), seed=2)).eval()
    kernel = uf.MaskKernel(model.num_states, model.mask_token_id)
    res = frontier(model, kernel, steps=(2, 4), seeds=(0, 1), num_samples=3, seq_len=8, judge_model=judge,
                   judge_tokenizer=tokenizer, tokenizer=tokenizer, out_dir=tmp_path, entropy_tokenizer=tokenizer,
                   batch_size=2, policy=LowConfidence(), block_size=4, plot=False, progress=False)
    # 8 tokens in blocks of 4: N steps per block commit 4 / N tokens per forward
    assert [row["tokens_per_forward"] for row in res.summary] == [2.0, 1.0]
    assert all(r["tokens_per_forward"] in (2.0, 1.0) for r in res.runs)
    assert "tokens/forward" in res.table()
    # the samples are the policy sampler's (one generator per (steps, seed), batches of 2)
    g = torch.Generator().manual_seed(0)
    sampler = PolicySampler(model, kernel, LowConfidence(), num_steps=2, block_size=4)
    first = torch.cat([sampler.sample(2, 8, generator=g), sampler.sample(1, 8, generator=g)])
    g = torch.Generator().manual_seed(0)
    again = PolicyFrontierSampler(model, kernel, 2, policy=LowConfidence(), block_size=4)
    assert torch.equal(torch.cat([again.sample(2, 8, generator=g), again.sample(1, 8, generator=g)]), first)


def test_adaptive_policy_on_a_block_model_and_an_x0_callable(tmp_path, tokenizer, judge):
    block = uf.adapt_ar_model(tiny_model("llama", vocab_size=len(tokenizer), seed=2), block_size=4).eval()
    kernel = uf.MaskKernel(block.num_states, block.mask_token_id)
    s = PolicyFrontierSampler(block, kernel, 4, policy=ConfidenceThreshold(0.2))
    ids = s.sample(3, 8, generator=torch.Generator().manual_seed(0))
    # at least one token per step; the cache's one commit call (2 blocks, no prompt) counts too
    assert ids.shape == (3, 8) and s.tokens_per_forward is not None and s.tokens_per_forward >= 8 / 9
    plain = uf.adapt_ar_model(tiny_model("llama", vocab_size=len(tokenizer), seed=2)).eval()
    with pytest.raises(ValueError, match="clean"):  # a block model is no full-sequence x0 callable
        block(ids, torch.full((3,), 0.5))
    res = frontier(lambda x, t: plain(x, t), kernel, steps=(4,), seeds=(0,), num_samples=2, seq_len=8,
                   judge_model=judge, judge_tokenizer=tokenizer, tokenizer=tokenizer, out_dir=tmp_path,
                   entropy_tokenizer=tokenizer, policy=ConfidenceThreshold(0.2), block_size=4, plot=False,
                   progress=False)
    assert res.summary[0]["tokens_per_forward"] >= 1.0
    with pytest.raises(ValueError, match="block_size"):
        frontier(block, kernel, steps=(4,), seeds=(0,), num_samples=2, seq_len=8, judge_model=judge,
                 judge_tokenizer=tokenizer, tokenizer=tokenizer, out_dir=tmp_path, block_size=4, progress=False)

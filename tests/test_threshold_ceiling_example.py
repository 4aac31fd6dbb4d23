"""``examples/threshold_ceiling.py``: the marginal oracle's x_θ against exact enumeration on a tiny model, its commits
against the threshold's two ends, the prompts against the demo's, and a tiny run end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _examples import load_example
from _hf_tiny import tiny_model


def _example():
    return load_example("threshold_ceiling")


def _peaked_tiny(seed: int = 0):
    """The tiny llama (vocabulary 128) with its head scaled so that its next-token distributions are far from
    uniform (a random head's are nearly flat): marginals with a few likely tokens, as text has."""
    model = tiny_model("llama", seed=seed)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(25.0)
    return model.eval()


@torch.no_grad()
def _exact_two_token_marginals(model, prefix):
    """``(p1 (V,), p2 (V,), joint (V, V))`` float64: the next token, the one after it (summed over the first) and
    their joint, enumerated over the whole vocabulary."""
    V = model.config.vocab_size
    p1 = torch.softmax(model(prefix).logits[0, -1].double(), -1)
    rows = torch.cat([prefix.expand(V, -1), torch.arange(V).view(V, 1)], 1)
    p2_given = torch.softmax(model(rows).logits[:, -1].double(), -1)  # (V first tokens, V second tokens)
    joint = p1[:, None] * p2_given
    return p1, joint.sum(0), joint


def test_the_sampled_marginals_equal_enumeration_and_condition_on_a_committed_right_token() -> None:
    """x_θ of a block of two from S = 20,000 continuations: both positions' marginals, and the first position's given
    a committed second token (the rejection step), equal the enumerated ones to within 0.02 (≥ 5 standard errors of
    a frequency)."""
    ex = _example()
    model = _peaked_tiny()
    prefix = torch.tensor([[5, 17, 42, 9]])
    p1, p2, joint = _exact_two_token_marginals(model, prefix)
    samples = ex.sample_continuations(model, prefix, 2, 20_000, 1.0, torch.Generator().manual_seed(0))
    assert samples.shape == (20_000, 2)
    x0 = ex.marginal_log_probs(samples, 128).exp()
    assert torch.allclose(x0.sum(-1), torch.ones(2, dtype=torch.float64))
    assert float((x0[0] - p1).abs().max()) < 0.02 and float((x0[1] - p2).abs().max()) < 0.02

    b = int(p2.argmax())  # a committed second token the decoder could have chosen
    block, committed = torch.tensor([0, b]), torch.tensor([False, True])
    survivors = ex.agreeing(samples, 0, block, committed)
    assert bool((survivors[:, 1] == b).all()) and len(survivors) == int((samples[:, 1] == b).sum())
    given = ex.marginal_log_probs(survivors, 128).exp()[0]
    exact_given = joint[:, b] / joint[:, b].sum()
    assert float((given - exact_given).abs().max()) < 0.03  # fewer draws survive: p2(b) of 20,000


def test_agreeing_reads_only_the_committed_positions_from_start() -> None:
    ex = _example()
    samples = torch.tensor([[1, 2, 3], [1, 9, 3], [4, 2, 3], [1, 2, 8]])  # continuations of block positions 1..3
    block = torch.tensor([7, 0, 2, 3])  # position 0 committed as the prefix; 2 and 3 committed; 1 masked
    committed = torch.tensor([True, False, True, True])
    assert ex.agreeing(samples, 1, block, committed).tolist() == [[1, 2, 3], [4, 2, 3]]


@pytest.mark.parametrize("threshold, forwards_per_block", [(0.0, 1), (1.0, 4)])
def test_the_thresholds_ends_commit_a_block_at_once_or_a_position_at_a_time(threshold, forwards_per_block) -> None:
    """τ = 0 commits every position of a block in its first step; τ = 1 one position per step (the tiny random
    model's unscaled distributions are nearly uniform over 128 tokens, so no frequency of 64 samples reaches 1)."""
    ex = _example()
    model = tiny_model("llama", seed=1).eval()
    d = ex.threshold_decode(model, torch.tensor([[3, 4, 5]]), block_size=4, new_tokens=8, threshold=threshold,
                            num_samples=64, temperature=1.0, vocab_size=128, generator=torch.Generator().manual_seed(0))
    assert len(d.tokens) == 8 and all(0 <= t < 128 for t in d.tokens)
    assert d.forwards == 2 * forwards_per_block and sum(s["committed"] for s in d.steps) == 8
    assert [s["block"] for s in d.steps] == [0] * forwards_per_block + [1] * forwards_per_block
    assert d.unconditioned == 0


def test_the_decode_is_reproducible_under_its_generator() -> None:
    ex = _example()
    model = _peaked_tiny(seed=2)
    runs = [ex.threshold_decode(model, torch.tensor([[3, 4, 5]]), block_size=4, new_tokens=8, threshold=0.9,
                                num_samples=32, temperature=1.0, vocab_size=128,
                                generator=torch.Generator().manual_seed(7)) for _ in range(2)]
    assert runs[0] == runs[1] and 2 <= runs[0].forwards <= 8


def test_the_prompts_are_the_demos_held_out_prompts() -> None:
    """The demo's first held-out prompt (its samples open with it) and the split's size."""
    from unifusion.hf import load_smollm2_tokenizer

    tokenizer = load_smollm2_tokenizer()
    prompts = _example().demo_prompts(tokenizer, 8, 16, 48)
    assert prompts.shape == (8, 16)
    assert tokenizer.decode(prompts[0]) == "If mutability is desired, you could use lists instead of tuples.  Here"
    with pytest.raises(ValueError, match="count"):
        _example().demo_prompts(tokenizer, 10_000, 16, 48)


def test_bad_input_is_refused() -> None:
    ex = _example()
    model = tiny_model("llama").eval()
    with pytest.raises(ValueError, match="new_tokens"):
        ex.threshold_decode(model, torch.tensor([[1, 2]]), block_size=4, new_tokens=6, threshold=0.9, num_samples=4,
                            temperature=1.0, vocab_size=128, generator=torch.Generator())
    for argv, name in ((["--temperature", "0"], "--temperature"), (["--num-samples", "0"], "--num-samples")):
        with pytest.raises(ValueError, match=name):
            ex.parse_args(argv)


def test_tiny_run_writes_the_report(tmp_path: Path) -> None:
    report = _example().main(["--model", "tiny", "--num-prompts", "2", "--new-tokens", "8", "--num-samples", "8",
                              "--thresholds", "0.9", "0", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "report.json").read_text()) == json.loads(json.dumps(report))
    for tau, forwards_per_prompt in (("0.9", None), ("0", 1)):
        entry = report["thresholds"][tau]
        assert len(entry["prompts"]) == 2 and entry["steps"] == sum(p["forwards"] for p in entry["prompts"])
        assert entry["tokens_per_forward"] == pytest.approx(16 / entry["steps"])
        assert 1.0 <= entry["min"] <= entry["max"] <= 8.0
        if forwards_per_prompt is not None:
            assert all(p["forwards"] == forwards_per_prompt for p in entry["prompts"])

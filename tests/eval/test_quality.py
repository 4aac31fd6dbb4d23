"""GenPPL, unigram entropy, retokenization and the offline GPT-2 tokenizer against naive references."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch
from _hf_tiny import tiny_model

from unifusion.eval import PerplexityResult, generative_perplexity, gpt2_tokenizer, retokenize, unigram_entropy

DATA = Path(__file__).parents[1] / "data"

TEXTS = [
    "the cat sat on the mat .",
    "a dog",
    "the big red car went to the city because the sun was hot and the road was fast .",
    "yes",
    "she sees the moon and the star in the sky , he sees the rain .",
]


def _reference_genppl(texts, model, tokenizer, add_bos=True, max_length=None):
    """One text at a time, no padding, float64 log-softmax."""
    total, count = 0.0, 0
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        seq = ([tokenizer.bos_token_id] if add_bos else []) + ids
        windows = [seq] if max_length is None else [seq[k: k + max_length] for k in range(0, len(seq), max_length)]
        for w in windows:
            if len(w) < 2:
                continue
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([w])).logits[0].double()
            logp = torch.log_softmax(logits[:-1], -1)
            total += float(-logp.gather(-1, torch.tensor(w[1:])[:, None]).sum())
            count += len(w) - 1
    return math.exp(total / count), total, count


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_genppl_matches_unpadded_per_sample_loop(family, tokenizer):
    model = tiny_model(family, seed=3)
    result = generative_perplexity(TEXTS, model, tokenizer, batch_size=3, progress=False)
    ppl, total, count = _reference_genppl(TEXTS, model, tokenizer)
    assert isinstance(result, PerplexityResult)
    assert result.num_tokens == count == sum(len(t.split()) for t in TEXTS)  # BOS makes every word scored
    assert result.total_nll == pytest.approx(total, rel=1e-5)
    assert float(result) == pytest.approx(ppl, rel=1e-5)
    # pooled, not a mean of per-sample perplexities; per-sample parts add up
    assert sum(result.per_sample_nll) == pytest.approx(result.total_nll, rel=1e-9)
    assert result.per_sample_tokens == [len(t.split()) for t in TEXTS]
    per_sample_mean = sum(math.exp(n / c) for n, c in zip(result.per_sample_nll, result.per_sample_tokens)) / len(TEXTS)
    assert abs(per_sample_mean - float(result)) > 1e-3


def test_genppl_batch_size_and_order_do_not_matter(tokenizer):
    model = tiny_model("llama", seed=4)
    a = generative_perplexity(TEXTS, model, tokenizer, batch_size=1, progress=False)
    b = generative_perplexity(TEXTS, model, tokenizer, batch_size=8, progress=False)
    c = generative_perplexity(TEXTS[::-1], model, tokenizer, batch_size=2, progress=False)
    assert b.perplexity == pytest.approx(a.perplexity, rel=1e-5)
    assert c.perplexity == pytest.approx(a.perplexity, rel=1e-5)
    assert c.per_sample_nll[::-1] == pytest.approx(a.per_sample_nll, rel=1e-5)


def test_genppl_without_bos_and_with_windows(tokenizer):
    model = tiny_model("gpt2", seed=5)
    no_bos = generative_perplexity(TEXTS, model, tokenizer, add_bos=False, progress=False)
    ppl, _, count = _reference_genppl(TEXTS, model, tokenizer, add_bos=False)
    assert no_bos.num_tokens == count and float(no_bos) == pytest.approx(ppl, rel=1e-5)
    windowed = generative_perplexity(TEXTS, model, tokenizer, max_length=5, batch_size=4, progress=False)
    ppl, _, count = _reference_genppl(TEXTS, model, tokenizer, max_length=5)
    assert windowed.num_tokens == count and float(windowed) == pytest.approx(ppl, rel=1e-5)


def test_genppl_bad_input(tokenizer):
    model = tiny_model("gpt2", seed=0)
    with pytest.raises(ValueError, match="texts"):
        generative_perplexity([], model, tokenizer, progress=False)
    with pytest.raises(TypeError, match="texts"):
        generative_perplexity("the cat", model, tokenizer, progress=False)
    with pytest.raises(ValueError, match="batch_size"):
        generative_perplexity(TEXTS, model, tokenizer, batch_size=0, progress=False)
    small = tiny_model("gpt2", seed=0, vocab_size=64)  # tokenizer ids reach 127
    with pytest.raises(ValueError, match="judge_tokenizer.*vocabulary"):
        generative_perplexity(TEXTS, small, tokenizer, progress=False)
    with pytest.raises(ValueError, match="texts"):
        generative_perplexity(["", ""], model, tokenizer, add_bos=False, progress=False)


def _reference_entropy(ids):
    n = len(ids)
    if n == 0:
        return 0.0
    return -sum(c / n * math.log(c / n) for c in Counter(ids).values())


def test_unigram_entropy_lists_and_padded_tensor_agree_with_counter():
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 9, (n,), generator=g).tolist() for n in (1, 5, 17, 40, 0)]
    rows.append([3] * 12)  # a constant sample has entropy 0
    rows.append(list(range(16)))  # all distinct: log N
    expected = torch.tensor([_reference_entropy(r) for r in rows], dtype=torch.float64)
    got = unigram_entropy(rows)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected)
    assert got[-2] == 0 and got[-1] == pytest.approx(math.log(16))
    # padded tensor + mask, with pad ids that collide with real ids
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[b, : len(r)] = True
    torch.testing.assert_close(unigram_entropy(ids, mask), expected)
    full = torch.randint(0, 50, (4, 33), generator=g)
    torch.testing.assert_close(unigram_entropy(full), torch.tensor([_reference_entropy(r) for r in full.tolist()],
                                                                    dtype=torch.float64))


def test_unigram_entropy_bad_input():
    with pytest.raises(TypeError, match="token_ids"):
        unigram_entropy(torch.rand(2, 3))
    with pytest.raises(ValueError, match="token_ids"):
        unigram_entropy(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="mask"):
        unigram_entropy(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 4))
    with pytest.raises(ValueError, match="token_ids"):
        unigram_entropy([])


def test_gpt2_tokenizer_offline_round_trips_and_retokenize():
    tok = gpt2_tokenizer()
    assert len(tok) == 50257 and tok.bos_token_id == 50256
    text = "Hello world, this is GPT-2.  Two  spaces\n\nand a newline — ünïcödé!"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[:2] == [15496, 995]  # GPT-2's ids for "Hello", " world"
    assert tok.decode(ids) == text
    assert retokenize([text, "Hello"], tok) == [ids, [15496]]
    assert gpt2_tokenizer() is tok  # cached
    with pytest.raises(ValueError, match="texts"):
        retokenize([], tok)

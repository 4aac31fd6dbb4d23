"""DiffusionLM.generate with a decoding policy (unifusion.samplers.generation) and the cached decoders
(unifusion.hf.ar.decoding): the policy path is PolicySampler's, left padding with the tokenizer's mask, the padding and
length checks, EOS defaults, the approximate dual cache (refresh 1 = uncached; K + 1 positions per cached step), and
the save-time tokenizer warning — on tiny random models (tests/_hf_tiny.py)."""

from __future__ import annotations

import warnings

import pytest
import torch
from _cpu import FLEX_UNRELIABLE_ON_THIS_CPU
from _hf_tiny import VOCAB, tiny_model

import unifusion as uf
from unifusion.hf import adapt_ar_model
from unifusion.samplers import PolicySampler
from unifusion.samplers.policies import ConfidenceThreshold, LowConfidence, RandomOrder

MASK_ID = 3
EOS = 2  # the tiny config's eos_token_id
PAD = 0  # the tiny config's pad_token_id


def _model(seed: int = 0, **kw):
    return adapt_ar_model(tiny_model("llama", seed=seed, **kw), mask_token_id=MASK_ID).eval()


def _prompt(B: int = 2, P: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, VOCAB, (B, P), generator=torch.Generator().manual_seed(seed))


def _gens(B: int, seed: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + r) for r in range(B)]


class BackboneCalls:
    """Counts the positions of every call of the Hugging Face backbone (a forward pre-hook)."""

    def __init__(self, model) -> None:
        self.lengths: list[int] = []
        self.handle = model.hf_model.base_model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        x = kwargs.get("input_ids")
        if x is None:
            x = kwargs.get("inputs_embeds")
        self.lengths.append(int(x.shape[1]))

    def close(self) -> None:
        self.handle.remove()


def test_policy_path_is_the_policy_sampler_on_the_model() -> None:
    model = _model()
    prompt = _prompt(2, 4)
    kernel = uf.MaskKernel(model.num_states, MASK_ID)
    out = model.generate(prompt, max_new_tokens=8, policy=LowConfidence(), num_steps=4, block_size=4,
                         eos_token_id=None, generator=torch.Generator().manual_seed(1))
    full = torch.cat([prompt, torch.full((2, 8), -1)], 1)
    ref = PolicySampler(model, kernel, LowConfidence(), num_steps=4, block_size=4).sample(
        2, 12, prompt=full, generator=torch.Generator().manual_seed(1))
    assert torch.equal(out, ref)
    assert torch.equal(out[:, :4], prompt) and not (out == MASK_ID).any()


@pytest.mark.parametrize("refresh", [None, 1, 3])
def test_left_padding_with_the_mask_equals_each_row_alone(refresh) -> None:
    """A left-padded batch with the tokenizer's attention_mask and per-row generators: each row equals the row run
    alone (x0 path and the approximate cache, whose decisions are per row too)."""
    model = _model()
    short, long = _prompt(1, 2, seed=1), _prompt(1, 5, seed=2)
    batch = torch.cat([torch.cat([torch.full((1, 3), PAD), short], 1), long])
    mask = torch.tensor([[0, 0, 0, 1, 1], [1, 1, 1, 1, 1]])
    kw = dict(max_new_tokens=8, policy=RandomOrder(), num_steps=4, block_size=4, eos_token_id=None,
              cache_refresh=refresh)
    out = model.generate(batch, attention_mask=mask, generator=_gens(2), **kw)
    alone0 = model.generate(short, generator=_gens(1, 0), **kw)
    alone1 = model.generate(long, generator=_gens(1, 1), **kw)
    assert torch.equal(out[0, 3:], alone0[0])
    assert torch.equal(out[1], alone1[0])


def test_ambiguous_padding_without_a_mask_is_refused() -> None:
    model = _model()
    batch = torch.cat([torch.cat([torch.full((1, 2), PAD), _prompt(1, 2)], 1), _prompt(1, 4, seed=3)])
    with pytest.raises(ValueError, match="attention_mask"):
        model.generate(batch, max_new_tokens=4, num_steps=2)
    with pytest.raises(ValueError, match="attention_mask"):
        model.generate(batch, max_new_tokens=4, policy=LowConfidence())
    right = torch.cat([torch.cat([_prompt(1, 2), torch.full((1, 2), PAD)], 1), _prompt(1, 4, seed=3)])
    with pytest.raises(ValueError, match="right-padded"):
        model.generate(right, max_new_tokens=4, num_steps=2)
    # an explicit mask of ones says the pads are text
    out = model.generate(batch, max_new_tokens=4, num_steps=2, attention_mask=torch.ones_like(batch))
    assert out.shape == (2, 8)


def test_policy_none_takes_the_attention_mask() -> None:
    """The full-sequence sampler with a left-padded batch: the model is called with the padding mask (so the padded
    row's tokens do not depend on its pads' ids)."""
    model = _model()
    short = _prompt(1, 2, seed=1)
    mask = torch.tensor([[0, 0, 1, 1]])
    a = model.generate(torch.cat([torch.full((1, 2), PAD), short], 1), attention_mask=mask, max_new_tokens=4,
                       num_steps=3, generator=torch.Generator().manual_seed(0))
    b = model.generate(torch.cat([torch.full((1, 2), 7), short], 1), attention_mask=mask, max_new_tokens=4,
                       num_steps=3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a[:, 2:], b[:, 2:])


def test_length_beyond_the_positions_is_a_value_error() -> None:
    model = _model()  # max_position_embeddings = 128
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.generate(_prompt(1, 4), seq_len=128, num_steps=2)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.generate(_prompt(1, 4), max_new_tokens=200, policy=LowConfidence())
    assert model.generate(_prompt(1, 4), seq_len=127, num_steps=1).shape == (1, 127)


def test_eos_defaults_to_the_config_with_a_policy_and_stops_rows() -> None:
    model = _model()
    with torch.no_grad():  # make EOS the most likely token everywhere
        model.hf_model.lm_head.weight[EOS] += 5.0 * model.hf_model.model.norm.weight.sign()
    out = model.generate(_prompt(2, 3), max_new_tokens=8, policy=LowConfidence(), block_size=4, num_steps=4,
                         return_dict=True, generator=torch.Generator().manual_seed(0))
    seq = out.sequences
    for r in range(2):
        gen = seq[r, 3:]
        first = int((gen == EOS).int().argmax())
        assert (gen == EOS).any() and (gen[first:] == EOS).all()
    assert torch.allclose(out.tokens_per_forward * out.num_forwards.float(),
                          ((seq[:, 3:] != EOS).sum(-1) + 1).float().clamp_max(8))
    # no EOS with policy=None unless asked
    plain = model.generate(_prompt(2, 3), max_new_tokens=8, num_steps=4, generator=torch.Generator().manual_seed(0))
    filled = model.generate(_prompt(2, 3), max_new_tokens=8, num_steps=4, eos_token_id=EOS, pad_token_id=PAD,
                            generator=torch.Generator().manual_seed(0))
    for r in range(2):
        gen, got = plain[r, 3:], filled[r, 3:]
        if (gen == EOS).any():
            first = int((gen == EOS).int().argmax())
            assert torch.equal(got[:first + 1], gen[:first + 1]) and (got[first + 1:] == PAD).all()
        else:
            assert torch.equal(got, gen)


def test_refresh_every_step_is_the_uncached_computation() -> None:
    model = _model()
    prompt = _prompt(2, 5)
    kw = dict(max_new_tokens=12, policy=ConfidenceThreshold(0.2), block_size=4, eos_token_id=None,
              generator=_gens(2, 5))
    uncached = model.generate(prompt, **kw)
    kw["generator"] = _gens(2, 5)
    assert torch.equal(model.generate(prompt, cache_refresh=1, **kw), uncached)


def test_approximate_cache_runs_one_block_between_refreshes() -> None:
    """With cache_refresh=N, a block's first step and every N-th run the whole sequence (L + 1 positions); every
    other backbone call sees the block's K + 1 positions only."""
    model = _model()
    P, new, K = 5, 12, 4
    calls = BackboneCalls(model)
    try:
        out = model.generate(_prompt(1, P), max_new_tokens=new, policy=LowConfidence(), num_steps=4, block_size=K,
                             eos_token_id=None, cache_refresh=2, return_dict=True,
                             generator=torch.Generator().manual_seed(0))
    finally:
        calls.close()
    L = P + new
    assert calls.lengths == [L + 1, K + 1] * 2 * (new // K)
    assert int(out.num_forwards[0]) == 4 * (new // K)


def test_approximate_cache_drift_is_bounded_on_a_tiny_model() -> None:
    """The approximate cache changes some tokens (it is not exact), but the prompt and shapes hold; the measured
    agreement with uncached decoding is reported by benchmarks/decoding.py."""
    model = _model()
    prompt = _prompt(4, 5)
    kw = dict(max_new_tokens=16, policy=LowConfidence(), num_steps=4, block_size=8, eos_token_id=None)
    uncached = model.generate(prompt, generator=_gens(4), **kw)
    cached = model.generate(prompt, generator=_gens(4), cache_refresh=4, **kw)
    assert cached.shape == uncached.shape and torch.equal(cached[:, :5], prompt)
    agree = (cached[:, 5:] == uncached[:, 5:]).float().mean()
    assert agree > 0.25  # a random tiny model: loose; the real model's number is in the benchmark


def test_bad_cache_arguments() -> None:
    model = _model()
    with pytest.raises(ValueError, match="cache_refresh"):
        model.generate(_prompt(1, 3), max_new_tokens=4, policy=LowConfidence(), cache_refresh=0)
    with pytest.raises(ValueError, match="cache_refresh"):
        model.generate(_prompt(1, 3), max_new_tokens=4, policy=LowConfidence(), cache_refresh=2, use_cache=False)
    with pytest.raises(ValueError, match="block_size"):
        model.generate(_prompt(1, 3), max_new_tokens=4, block_size=2, num_steps=2)
    with pytest.raises(ValueError, match="eos_token_id"):
        model.generate(_prompt(1, 3), max_new_tokens=4, policy=LowConfidence(), eos_token_id="first")
    no_mask = adapt_ar_model(tiny_model("llama"), add_mask_token=False)
    with pytest.raises(ValueError, match="cache_refresh"):
        no_mask.generate(_prompt(1, 3), max_new_tokens=4, policy=LowConfidence(), cache_refresh=2,
                         kernel=uf.MaskKernel(no_mask.num_states, 3))


def test_save_pretrained_without_a_tokenizer_warns(tmp_path) -> None:
    model = _model()
    with pytest.warns(UserWarning, match="tokenizer"):
        model.save_pretrained(tmp_path / "m")
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "tokenizer.json").write_text("{}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.save_pretrained(tmp_path / "t")  # a tokenizer is already there


# -- the exact block cache (BlockCacheDecoder) against the block computation written out without a cache


class UncachedBlocks:
    """x0 callable: for every block of K after column P, one forward of [clean stream (bos, x[:s-1]) | anchor x[s-1] |
    x_t of the block] with the block-causal mask (clean causal, the block bidirectional over itself and the clean
    prefix) — the computation the cache reproduces, written with no cache at all."""

    def __init__(self, model, P: int, K: int) -> None:
        self.model, self.P, self.K = model, P, K
        self.num_states = model.num_states

    def __call__(self, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        model, (B, L) = self.model, x_t.shape
        out = torch.zeros(B, L, model.num_states)
        bos = torch.full((B, 1), model.bos_token_id)
        for s in range(self.P, L, self.K):
            k = min(self.K, L - s)
            ids = torch.cat([bos, x_t[:, :s + k]], 1)  # clean stream = internal [bos, x[:s-1]], then anchor, block
            n = s + k + 1
            A = torch.ones(n, n, dtype=torch.bool).tril()
            A[s:, s:] = True
            h = model.hf_model.base_model(input_ids=ids, position_ids=torch.arange(n)[None].expand(B, n),
                                          attention_mask=A[None, None].expand(B, 1, n, n)).last_hidden_state
            out[:, s:s + k] = model.logits_from_hidden(h[:, s:s + k])
        return out


@pytest.mark.parametrize("policy", [LowConfidence(), ConfidenceThreshold(0.3), RandomOrder()])
@pytest.mark.parametrize("P", [0, 3, 4])
def test_block_cache_equals_the_uncached_block_computation(policy, P) -> None:
    from unifusion.hf.ar.decoding import BlockCacheDecoder

    model = _model()
    K, L, B = 4, P + 10, 3  # a ragged last block
    kernel = uf.MaskKernel(model.num_states, MASK_ID)
    prompt = torch.cat([_prompt(B, P), torch.full((B, L - P), -1)], 1)
    kw = dict(num_steps=2, block_size=K)
    cached = PolicySampler(BlockCacheDecoder(model), kernel, policy, **kw).sample(
        B, L, prompt=prompt, generator=_gens(B))
    uncached = PolicySampler(UncachedBlocks(model, P, K), kernel, policy, **kw).sample(
        B, L, prompt=prompt, generator=_gens(B))
    assert torch.equal(cached, uncached)


def test_block_cache_rows_stopping_at_eos_and_left_padding() -> None:
    """Rows that stop at EOS leave the cache (later calls have fewer rows); a left-padded row equals the row alone."""
    from unifusion.hf.ar.decoding import BlockCacheDecoder

    model = _model()
    with torch.no_grad():
        model.hf_model.lm_head.weight[EOS] += 1.5 * model.hf_model.model.norm.weight.sign()
    kernel = uf.MaskKernel(model.num_states, MASK_ID)
    short, long = _prompt(1, 2, seed=1), _prompt(1, 4, seed=2)
    L = 4 + 12
    batch = torch.cat([torch.cat([torch.full((1, 2), PAD), short], 1), long])
    prompt = torch.cat([batch, torch.full((2, 12), -1)], 1)
    sampler = PolicySampler(BlockCacheDecoder(model), kernel, LowConfidence(), num_steps=4, block_size=4)
    out = sampler.sample(2, L, prompt=prompt, attention_mask=torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]),
                         generator=_gens(2), eos_token_id=EOS, return_dict=True)
    alone0 = sampler.sample(1, L - 2, prompt=torch.cat([short, torch.full((1, 12), -1)], 1), generator=_gens(1, 0),
                            eos_token_id=EOS, return_dict=True)
    alone1 = sampler.sample(1, L, prompt=prompt[1:], generator=_gens(1, 1), eos_token_id=EOS, return_dict=True)
    assert torch.equal(out.sequences[0, 2:], alone0.sequences[0]) and torch.equal(out.sequences[1], alone1.sequences[0])
    assert out.num_forwards.tolist() == [int(alone0.num_forwards[0]), int(alone1.num_forwards[0])]


def test_block_cache_runs_one_block_per_call_after_the_prefill() -> None:
    """After the prefill every step runs the block's K + 1 positions and every commit its K clean ones; with
    merge_commits the prefill rides with the first block's first step (P + K + 1 positions) and each commit with the
    next block's first step (2K + 1 positions), same tokens."""
    from unifusion.hf.ar.decoding import BlockCacheDecoder

    model = _model()
    P, K, new = 6, 4, 12
    kernel = uf.MaskKernel(model.num_states, MASK_ID)
    outs, lengths = [], []
    for merge in (False, True):
        calls = BackboneCalls(model)
        try:
            outs.append(PolicySampler(BlockCacheDecoder(model, merge_commits=merge), kernel, LowConfidence(),
                                      num_steps=2, block_size=K).sample(
                2, P + new, prompt=torch.cat([_prompt(2, P), torch.full((2, new), -1)], 1), generator=_gens(2),
                return_dict=True))
        finally:
            calls.close()
        lengths.append(calls.lengths)
    nb = new // K
    assert lengths[0] == [P] + [K + 1] * 2 + [K, K + 1, K + 1] * (nb - 1)
    assert lengths[1] == [P + K + 1, K + 1] + [2 * K + 1, K + 1] * (nb - 1)
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    # num_forwards counts every backbone call: the prefill, the steps and the separate commits
    assert [o.num_forwards.tolist() for o in outs] == [[len(n)] * 2 for n in lengths] == [[3 * nb] * 2,
                                                                                          [2 * nb] * 2]


@pytest.mark.parametrize("time_conditioning", [False, True])
def test_merged_commits_equal_the_uncached_blocks(time_conditioning) -> None:
    """merge_commits (the clean block and the next noisy one in one call, the clean positions at time 0) gives the
    tokens of the uncached block-causal forward, rows stopping at EOS in between included."""
    from unifusion.hf.ar.decoding import BlockCacheDecoder

    hf = tiny_model("llama")
    model = adapt_ar_model(hf, mask_token_id=MASK_ID, block_size=4, time_conditioning=time_conditioning).eval()
    with torch.no_grad():
        model.hf_model.lm_head.weight.mul_(8.0)  # confident: several tokens per step
    kernel = uf.MaskKernel(model.num_states, MASK_ID)
    B, P, new = 3, 4, 12
    prompt = torch.cat([_prompt(B, P), torch.full((B, new), -1)], 1)
    eos = int(model.generate(prompt[:, :P], max_new_tokens=new, policy=ConfidenceThreshold(0.2), eos_token_id=None,
                             generator=_gens(B))[0, P + 5])  # a token row 0 makes in its second block
    runs = [PolicySampler(m, kernel, ConfidenceThreshold(0.2), block_size=4).sample(
        B, P + new, prompt=prompt, generator=_gens(B), eos_token_id=eos, return_dict=True)
        for m in (BlockCacheDecoder(model, merge_commits=True), BlockCacheDecoder(model))]
    uncached = model.generate(prompt[:, :P], max_new_tokens=new, policy=ConfidenceThreshold(0.2), eos_token_id=eos,
                              use_cache=False, generator=_gens(B), return_dict=True)
    assert runs[0].num_forwards.min() < runs[0].num_forwards.max()  # a row stopped at EOS before the others
    for run in runs:
        assert torch.equal(run.sequences, uncached.sequences)
    # the same steps; merged, the prefill and the commits ride with steps: no call of the cache's own
    assert torch.equal(runs[0].num_forwards, uncached.num_forwards)
    assert (runs[1].num_forwards >= uncached.num_forwards + 1).all(), (runs[1].num_forwards, uncached.num_forwards)


@pytest.mark.parametrize("P", [0, 4])
def test_block_cache_equals_uncached_under_uniform_noise(P) -> None:
    """EntropyBound (uniform noise): the block is resampled every step; cached == uncached token for token."""
    from unifusion.hf.ar.decoding import BlockCacheDecoder
    from unifusion.samplers.policies import EntropyBound

    model = adapt_ar_model(tiny_model("llama"), add_mask_token=False).eval()
    with torch.no_grad():
        model.hf_model.lm_head.weight.mul_(8.0)  # confident enough for the stopping rule to fire sometimes
    K, L, B = 4, P + 12, 2
    kernel = uf.UniformKernel(model.num_states)
    prompt = torch.cat([_prompt(B, P), torch.full((B, L - P), -1)], 1)
    runs = [PolicySampler(m, kernel, EntropyBound(1.0), num_steps=4, block_size=K).sample(
        B, L, prompt=prompt, generator=_gens(B), return_dict=True)
        for m in (BlockCacheDecoder(model), UncachedBlocks(model, P, K))]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    # the same steps; the cache adds its prefill (P > 0) and one commit call per finished block but the last
    assert torch.equal(runs[0].num_forwards, runs[1].num_forwards + (L - P) // K - 1 + int(P > 0))


# -- generate on a block model: the exact cache against the block-causal training forward


def _block_model(mask: bool = True, K: int = 4):
    hf = tiny_model("llama")
    if mask:
        return adapt_ar_model(hf, mask_token_id=MASK_ID, block_size=K).eval()
    return adapt_ar_model(hf, add_mask_token=False, block_size=K).eval()


@pytest.mark.parametrize("policy", ["low_confidence", "threshold", "random", "entropy_bound"])
@pytest.mark.parametrize("P", [0, 3, 4, 6])
def test_generate_on_a_block_model_cached_equals_uncached(policy, P) -> None:
    """use_cache=True (prefill, K + 1 positions per step, one forward per commit) gives the tokens of
    use_cache=False (every step the block-causal training forward, model(x_t, t, clean=x_t)) and of merged commits,
    for mask policies and EntropyBound under uniform noise; all start the first block where the prompt ends, also when
    K does not divide its length (the uncached path then runs behind invisible left pads)."""
    from unifusion.samplers.policies import make_policy

    uniform = policy == "entropy_bound"
    model = _block_model(mask=not uniform)
    if uniform:
        with torch.no_grad():
            model.hf_model.lm_head.weight.mul_(8.0)
    B = 3
    prompt = _prompt(B, P) if P else torch.zeros((B, 0), dtype=torch.long)
    kw = dict(max_new_tokens=10, policy=make_policy(policy, threshold=0.3 if policy == "threshold" else None),
              num_steps=2 if not uniform else 4, eos_token_id=None, return_dict=True)
    cached = model.generate(prompt, generator=_gens(B), **kw)
    uncached = model.generate(prompt, generator=_gens(B), use_cache=False, **kw)
    merged = model.generate(prompt, generator=_gens(B), merge_commits=True, **kw)
    nb = -(-10 // 4)
    # the same steps; the cache adds its prefill (P > 0) and one commit call per block but the last, merged none
    for other, extra in ((uncached, nb - 1 + int(P > 0)), (merged, nb - 1 + int(P > 0))):
        assert torch.equal(cached.sequences, other.sequences)
        assert torch.equal(cached.num_forwards, other.num_forwards + extra), (cached.num_forwards, other.num_forwards)


@pytest.mark.parametrize("use_cache", [True, False])
def test_generate_on_a_block_model_left_padded_rows_equal_each_row_alone(use_cache) -> None:
    """Prompts of 3 and 6 tokens, left-padded to 6 (K = 4 divides neither): each row's tokens are those of the row
    alone, cached and uncached (the first block starts at each prompt's end either way)."""
    model = _block_model(K=4)
    short, long = _prompt(1, 3, seed=1), _prompt(1, 6, seed=2)
    batch = torch.cat([torch.cat([torch.full((1, 3), PAD), short], 1), long])
    kw = dict(max_new_tokens=9, policy=LowConfidence(), num_steps=2, eos_token_id=None, use_cache=use_cache)
    out = model.generate(batch, attention_mask=torch.tensor([[0, 0, 0, 1, 1, 1], [1] * 6]), generator=_gens(2),
                         **kw)
    alone = [model.generate(row, generator=_gens(1, r), **kw) for r, row in enumerate((short, long))]
    assert torch.equal(out[0, 3:], alone[0][0]) and torch.equal(out[1], alone[1][0])
    assert torch.equal(out[0, :3], batch[0, :3])  # the pads come back as given


def test_generate_on_a_block_model_sees_one_block_per_call_after_the_prefill() -> None:
    model = _block_model(K=4)
    P, new = 8, 16
    calls = BackboneCalls(model)
    try:
        out = model.generate(_prompt(2, P), max_new_tokens=new, policy=ConfidenceThreshold(0.5), eos_token_id=None,
                             return_dict=True, generator=_gens(2))
    finally:
        calls.close()
    assert calls.lengths[0] == P and max(calls.lengths[1:]) <= 4 + 1
    assert len(calls.lengths) == int(out.num_forwards.max())  # every call: prefill, steps, commits
    # the uncached path runs the two-stream forward over the whole sequence at every step
    calls = BackboneCalls(model)
    try:
        model.generate(_prompt(2, P), max_new_tokens=new, policy=ConfidenceThreshold(0.5), eos_token_id=None,
                       generator=_gens(2), use_cache=False)
    finally:
        calls.close()
    L, nb = P + new, (P + new) // 4
    assert set(calls.lengths) == {2 * L - 4 + nb}


def test_generate_merge_commits_same_tokens_one_call_fewer_per_block() -> None:
    """generate(..., merge_commits=True): the tokens of the default cache, the prefill inside the first step
    (P + K + 1 positions) and the commit of each finished block inside the next block's first step (2K + 1
    positions), so n_b fewer calls for n_b blocks."""
    model = _block_model(K=4)
    P, new, nb = 5, 12, 3
    outs, lengths = [], []
    for merge in (False, True):
        calls = BackboneCalls(model)
        try:
            outs.append(model.generate(_prompt(2, P), max_new_tokens=new, policy=LowConfidence(), num_steps=2,
                                       eos_token_id=None, generator=_gens(2), merge_commits=merge))
        finally:
            calls.close()
        lengths.append(calls.lengths)
    assert torch.equal(outs[0], outs[1])
    assert lengths[1] == [P + 5, 5] + [4 + 5, 5] * (nb - 1) and len(lengths[0]) == len(lengths[1]) + nb


def test_block_model_arguments() -> None:
    model = _block_model(K=4)
    with pytest.raises(ValueError, match="block_size"):
        model.generate(_prompt(1, 4), max_new_tokens=8, policy=LowConfidence(), block_size=8)
    with pytest.raises(ValueError, match="cache_refresh"):
        model.generate(_prompt(1, 4), max_new_tokens=8, policy=LowConfidence(), cache_refresh=2)
    with pytest.raises(ValueError, match="merge_commits"):
        model.generate(_prompt(1, 4), max_new_tokens=8, policy=LowConfidence(), use_cache=False, merge_commits=True)
    with pytest.raises(ValueError, match="merge_commits"):
        adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID).generate(
            _prompt(1, 4), max_new_tokens=8, policy=LowConfidence(), merge_commits=True)
    out = model.generate(_prompt(1, 4), max_new_tokens=8, policy=LowConfidence(), block_size=4, num_steps=4)
    assert out.shape == (1, 12)


@FLEX_UNRELIABLE_ON_THIS_CPU
@torch.no_grad()
def test_flex_attention_block_model_cached_equals_uncached(static_flex: None) -> None:
    """A block model on flex attention decodes through the cache too (the masks as BlockMasks), with the tokens of the
    uncached block-causal forward."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    hf = tiny_model("llama")
    hf.set_attn_implementation("flex_attention")
    model = adapt_ar_model(hf, mask_token_id=MASK_ID, block_size=4).eval()
    kw = dict(max_new_tokens=8, policy=LowConfidence(), num_steps=2, eos_token_id=None, return_dict=True)
    cached = model.generate(_prompt(2, 4), generator=_gens(2), **kw)
    uncached = model.generate(_prompt(2, 4), generator=_gens(2), use_cache=False, **kw)
    assert torch.equal(cached.sequences, uncached.sequences)


# -- defaults that work, numbers that are true (issue 31)


@pytest.mark.parametrize("mask", [True, False])
def test_a_block_model_decodes_with_the_default_policy(mask) -> None:
    """``generate(prompt, max_new_tokens=N)`` with no policy on a block model: the default policy
    (:func:`~unifusion.samplers.policies.default_policy`: LowConfidence for a mask kernel, EntropyBound(1.0) for a
    uniform one), the same tokens as naming it."""
    from unifusion.samplers.policies import EntropyBound, default_policy
    from unifusion.samplers.policies.registry import DEFAULT_BOUND

    model = _block_model(mask=mask)
    kernel = uf.MaskKernel(model.num_states, MASK_ID) if mask else uf.UniformKernel(model.num_states)
    named = LowConfidence() if mask else EntropyBound(DEFAULT_BOUND)
    assert type(default_policy(kernel)) is type(named)
    out = model.generate(_prompt(2, 3), max_new_tokens=9, generator=_gens(2))
    ref = model.generate(_prompt(2, 3), max_new_tokens=9, policy=named, generator=_gens(2))
    assert out.shape == (2, 12) and torch.equal(out, ref)
    with pytest.raises(ValueError, match="policy: no decoding policy decodes HybridKernel"):
        default_policy(uf.HybridKernel(model.num_states, MASK_ID, p_uniform=0.2))


FORWARD_CASES = {
    "low_confidence-2-steps": dict(policy=LowConfidence(), num_steps=2),
    "low_confidence-default-steps": dict(policy=LowConfidence()),
    "threshold-0": dict(policy=ConfidenceThreshold(0.0)),
    "threshold-0.5": dict(policy=ConfidenceThreshold(0.5)),
    "merged-commits": dict(policy=LowConfidence(), num_steps=2, merge_commits=True),
    "uncached": dict(policy=LowConfidence(), num_steps=2, use_cache=False),
    "no-prompt": dict(policy=RandomOrder(), num_steps=2, P=0),
    "entropy-bound": dict(policy="entropy_bound", num_steps=3),
    "bidirectional-policy": dict(policy=LowConfidence(), num_steps=2, block_size=4, block=False),
    "bidirectional-dual-cache": dict(policy=LowConfidence(), num_steps=2, block_size=4, cache_refresh=2, block=False),
    "bidirectional-bayesian": dict(policy=None, num_steps=5, block=False),
}


@pytest.mark.parametrize("case", list(FORWARD_CASES))
def test_num_forwards_counts_every_backbone_call(case) -> None:
    """A forward hook on the backbone counts its calls; ``num_forwards`` reports exactly that many (prefill and
    commit passes included), so ``tokens_per_forward`` is generated tokens / backbone calls."""
    from unifusion.samplers.policies import EntropyBound

    kw = dict(FORWARD_CASES[case])
    P, block = kw.pop("P", 5), kw.pop("block", True)
    if kw["policy"] == "entropy_bound":
        model, kw["policy"] = _block_model(mask=False), EntropyBound(1.0)
    else:
        model = _block_model() if block else _model()
    prompt = _prompt(1, P) if P else torch.zeros((1, 0), dtype=torch.long)
    calls = BackboneCalls(model)
    try:
        out = model.generate(prompt, max_new_tokens=14, eos_token_id=None, return_dict=True,
                             generator=_gens(1), **kw)
    finally:
        calls.close()
    assert int(out.num_forwards[0]) == len(calls.lengths), (out.num_forwards, calls.lengths)
    assert float(out.tokens_per_forward[0]) == pytest.approx(14 / len(calls.lengths))


def test_a_wrong_shape_attention_mask_in_generate_is_a_value_error() -> None:
    """A mask narrower or wider than the prompt would pair its columns with the wrong tokens."""
    model = _model()
    prompt = _prompt(2, 6)
    for bad in (torch.ones(2, 3, dtype=torch.long), torch.ones(2, 7, dtype=torch.long),
                torch.ones(1, 6, dtype=torch.long), torch.ones(6, dtype=torch.long)):
        with pytest.raises(ValueError, match=r"attention_mask: expected shape \(2, 6\) like prompt_ids"):
            model.generate(prompt, max_new_tokens=4, policy=LowConfidence(), attention_mask=bad)
    with pytest.raises(TypeError, match="attention_mask: expected a"):
        model.generate(prompt, max_new_tokens=4, attention_mask=[[1] * 6] * 2)
    # a (P,) mask for a (P,) prompt is one row
    out = model.generate(prompt[0], max_new_tokens=4, policy=LowConfidence(), attention_mask=torch.ones(6),
                         generator=_gens(1))
    assert out.shape == (1, 10)


def test_a_kernel_contradicting_the_recorded_one_warns_naming_both() -> None:
    """A mask-trained block model decoded with uniform noise (UniformKernel + EntropyBound) runs, with a warning that
    names both kernels; the recorded kernel itself (or none given) does not warn."""
    from unifusion.samplers.policies import EntropyBound

    model = _block_model()
    model.kernel = uf.MaskKernel(model.num_states, MASK_ID)
    with pytest.warns(UserWarning, match="kernel: UniformKernel contradicts the kernel recorded with the model "
                                         r"\(MaskKernel"):
        model.generate(_prompt(1, 4), max_new_tokens=4, kernel=uf.UniformKernel(model.num_states),
                       policy=EntropyBound(1.0), generator=_gens(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.generate(_prompt(1, 4), max_new_tokens=4, generator=_gens(1))
        model.generate(_prompt(1, 4), max_new_tokens=4, kernel=uf.MaskKernel(model.num_states, MASK_ID),
                       generator=_gens(1))

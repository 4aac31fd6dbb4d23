"""Rollouts for RL: the commit trace of PolicySampler / DiffusionLM.generate (return_trace=True), groups of
completions per prompt in one batch (num_return_sequences) and the independence of a row from its neighbours."""

import sys
from pathlib import Path

import pytest
import torch

import unifusion as uf
from unifusion.samplers import PolicySampler
from unifusion.samplers.policies import ConfidenceThreshold, EntropyBound, LowConfidence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rl._exact import adapted  # noqa: E402

P, NEW, K = 6, 10, 4  # the prompt's end is not a block boundary: blocks start where the prompt ends


@pytest.fixture(scope="module")
def block_model():
    return adapted(block_size=K)


def _gens(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def _prompts(B, seed=0):
    return torch.randint(4, 128, (B, P), generator=torch.Generator().manual_seed(seed))


PATHS = [dict(use_cache=True), dict(use_cache=True, merge_commits=True), dict(use_cache=False)]
POLICIES = [(LowConfidence, dict(num_steps=2)), (lambda: ConfidenceThreshold(0.05), {})]


def _an_eos(model, prompt, seeds, path):
    """A token the first row generates mid-completion (so EOS stopping really stops a row there)."""
    out = model.generate(prompt[:1], max_new_tokens=NEW, policy=LowConfidence(), num_steps=2, eos_token_id=None,
                         generator=_gens(seeds[:1]), **path)
    return int(out[0, P + 3])


@pytest.mark.parametrize("path", PATHS[:2])
def test_a_rows_rollout_does_not_depend_on_its_neighbours(block_model, path):
    """A group of 3 completions per prompt in one call (num_return_sequences), per-row generators, EOS stopping:
    each row equals the row generated alone with its seed, among other neighbours and alone, trace included."""
    prompt = _prompts(2)
    seeds = [10, 11, 12, 13, 14, 15]
    eos = _an_eos(block_model, prompt, seeds, path)
    kw = dict(max_new_tokens=NEW, policy=LowConfidence(), num_steps=2, eos_token_id=eos, return_trace=True, **path)
    group = block_model.generate(prompt, num_return_sequences=3, generator=_gens(seeds), **kw)
    assert group.sequences.shape == (6, P + NEW)
    assert torch.equal(group.sequences[:, :P], prompt.repeat_interleave(3, 0))
    stopped = (group.sequences[:, P:] == eos).any(-1)
    assert stopped[0] and group.commit_step[0, P + 4:].eq(-1).all()  # stopped at the EOS, nothing after it
    assert group.num_forwards[0] < group.num_forwards.max()  # and took fewer calls than a row that ran on
    others = block_model.generate(torch.cat([prompt[:1], _prompts(2, seed=1)]), generator=_gens([10, 20, 21]), **kw)
    for b in (0, 2, 4):
        alone = block_model.generate(prompt[b // 3], generator=_gens([seeds[b]]), **kw)
        _same_row(group, b, alone, 0)
    _same_row(others, 0, group, 0)


def _same_row(a, i, b, j):
    """Row i of rollout a is row j of rollout b: the same tokens, calls and steps; the same log-probs up to the
    rounding of a batched matmul of another batch size."""
    for field in ("sequences", "num_forwards", "commit_step"):
        assert torch.equal(getattr(a, field)[i], getattr(b, field)[j]), (i, field)
    assert torch.allclose(a.commit_logprob[i], b.commit_logprob[j], atol=1e-5, rtol=0)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("policy, opts", POLICIES)
def test_trace_steps_are_consistent_with_num_forwards(block_model, path, policy, opts):
    prompt = _prompts(3)
    eos = _an_eos(block_model, prompt, [0, 1, 2], path)
    out = block_model.generate(prompt, max_new_tokens=NEW, policy=policy(), eos_token_id=eos, return_trace=True,
                               generator=_gens([0, 1, 2]), **opts, **path)
    step, logp = out.commit_step, out.commit_logprob
    assert step.dtype == torch.int64 and logp.dtype == torch.float32 and step.shape == out.sequences.shape
    assert step[:, :P].eq(-1).all() and logp[:, :P].eq(0).all()
    for b in range(3):
        gen = out.sequences[b, P:]
        end = int((gen == eos).int().argmax()) if (gen == eos).any() else NEW - 1
        s = step[b, P:]
        assert s[:end + 1].ge(0).all() and s[end + 1:].eq(-1).all()  # every position up to the EOS has a step
        assert int(s.max()) == int(out.num_forwards[b]) - 1  # < num_forwards, and the last call committed
        blocks = [s[i:i + K][s[i:i + K] >= 0] for i in range(0, end + 1, K)]
        for earlier, later in zip(blocks, blocks[1:]):
            assert int(earlier.max()) < int(later.min())  # a later block's steps come after
        assert (logp[b, P:][s >= 0] <= 0).all() and logp[b, P:][s < 0].eq(0).all()
    assert torch.allclose(out.commit_prob, logp.exp())


def test_cached_steps_count_the_prefill_and_the_commit_passes(block_model):
    """With the block cache the prefill is call 0 and a separate commit pass takes an index; merged, neither does
    (the prefill and the commit ride with denoising steps)."""
    prompt = _prompts(1)
    kw = dict(max_new_tokens=8, policy=LowConfidence(), num_steps=2, eos_token_id=None, return_trace=True,
              generator=_gens([3]))
    plain = block_model.generate(prompt, use_cache=False, **kw).commit_step[0, P:]
    cached = block_model.generate(prompt, **kw).commit_step[0, P:]
    merged = block_model.generate(prompt, merge_commits=True, **kw).commit_step[0, P:]
    assert sorted(set(plain.tolist())) == [0, 1, 2, 3]
    assert sorted(set(cached.tolist())) == [1, 2, 4, 5]  # 0 prefill, 3 the first block's commit pass
    assert sorted(set(merged.tolist())) == [0, 1, 2, 3]


def test_greedy_decoding_records_the_argmax_probability(block_model):
    out = block_model.generate(_prompts(2), max_new_tokens=NEW, policy=LowConfidence(), num_steps=2, do_sample=False,
                               eos_token_id=None, return_trace=True)
    assert out.commit_step[:, P:].ge(0).all() and out.commit_logprob[:, P:].lt(0).all()


def test_return_trace_refuses_what_commits_nothing(block_model):
    V = 9
    kernel = uf.UniformKernel(V)
    sampler = PolicySampler(lambda x, t: torch.zeros(*x.shape, V), kernel, EntropyBound(1.0), block_size=4)
    with pytest.raises(ValueError, match="return_trace"):
        sampler.sample(2, 8, return_trace=True)
    with pytest.raises(ValueError, match="return_trace"):
        adapted().generate(_prompts(1), max_new_tokens=4, return_trace=True)  # the BayesianSampler
    with pytest.raises(TypeError, match="return_trace"):
        block_model.generate(_prompts(1), max_new_tokens=4, return_trace=1)
    with pytest.raises(ValueError, match="num_return_sequences"):
        block_model.generate(_prompts(1), max_new_tokens=4, num_return_sequences=0)
    with pytest.raises(ValueError, match="generator"):  # one generator per returned row
        block_model.generate(_prompts(2), max_new_tokens=4, num_return_sequences=2, generator=_gens([0, 1]))


def test_the_sampler_without_trace_returns_what_it_did():
    """return_trace changes nothing else: the same tokens and calls, no trace fields without it."""
    V, mask = 12, 11
    kernel = uf.MaskKernel(V, mask)
    w = torch.randn(V, V, generator=torch.Generator().manual_seed(0))

    def model(x, t):
        return w[x] + torch.arange(x.shape[1])[None, :, None] * 0.1

    sampler = PolicySampler(model, kernel, LowConfidence(), num_steps=2, block_size=3)
    a = sampler.sample(2, 9, generator=_gens([1, 2]), return_dict=True)
    b = sampler.sample(2, 9, generator=_gens([1, 2]), return_trace=True)
    assert a.commit_step is None and a.commit_logprob is None and a.commit_prob is None
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.num_forwards, b.num_forwards)
    assert b.commit_step.ge(0).all() and int(b.commit_step.max()) == 5


def test_a_stop_column_drops_the_trace_after_it():
    """stopping (stop strings) replaces the tokens after a row's stop column by the fill: no step there."""
    V, mask = 12, 11
    kernel = uf.MaskKernel(V, mask)
    w = torch.randn(V, V, generator=torch.Generator().manual_seed(0))
    sampler = PolicySampler(lambda x, t: w[x], kernel, LowConfidence(), num_steps=2, block_size=3)

    def stop(b, tokens, cols):
        return torch.tensor([4, -1]) if b == 1 else None

    out = sampler.sample(2, 9, generator=_gens([1, 2]), return_trace=True, stopping=stop, pad_token_id=0)
    assert out.commit_step[0, :5].ge(0).all() and out.commit_step[0, 5:].eq(-1).all()
    assert out.commit_logprob[0, 5:].eq(0).all() and out.sequences[0, 5:].eq(0).all()
    assert out.commit_step[1].ge(0).all() and int(out.num_forwards[0]) == 4

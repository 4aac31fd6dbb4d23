"""The "trace" estimator of sequence_logprob: the replay of a decoder's commit order (TraceRL) equals the log-probs
the sampler committed with, and the exact sum over the groups of a fixed order by enumeration."""

import pytest
import torch

from unifusion.rl import sequence_logprob
from unifusion.rl.estimators import plan_trace
from unifusion.samplers.policies import ConfidenceThreshold, LowConfidence, MaskPolicy

from ._exact import adapted, subset_log_probs

P, NEW = 6, 10


@pytest.fixture(scope="module")
def models():
    return {"block": adapted(block_size=4), "plain": adapted()}


def _gens(n):
    return [torch.Generator().manual_seed(100 + i) for i in range(n)]


LOW, THRESHOLD = (LowConfidence, dict(num_steps=2)), (lambda: ConfidenceThreshold(0.05), {})
CASES = [  # (model, decoding path, policy, temperature)
    ("block", dict(use_cache=True), LOW, 1.0), ("block", dict(use_cache=True), THRESHOLD, 0.7),
    ("block", dict(use_cache=True, merge_commits=True), LOW, 0.7),
    ("block", dict(use_cache=True, merge_commits=True), THRESHOLD, 1.0),
    ("block", dict(use_cache=False), LOW, 0.7), ("block", dict(use_cache=False), THRESHOLD, 1.0),
    ("plain", dict(block_size=4), LOW, 1.0), ("plain", dict(block_size=4), THRESHOLD, 0.7)]


@pytest.mark.parametrize("kind, path, decoding, temperature", CASES)
def test_the_replay_equals_the_log_probs_the_sampler_committed_with(models, kind, path, decoding, temperature):
    policy, opts = decoding
    model = models[kind]
    prompt = torch.randint(4, 128, (3, P), generator=torch.Generator().manual_seed(0))
    out = model.generate(prompt, max_new_tokens=NEW, policy=policy(), eos_token_id=None, temperature=temperature,
                         return_trace=True, generator=_gens(3), **opts, **path)
    completion = out.commit_step >= 0
    assert completion[:, P:].all()
    with torch.no_grad():
        r = sequence_logprob(model, out.sequences, completion, estimator="trace", trace=out.commit_step,
                             temperature=temperature)
    torch.testing.assert_close(r.per_token, out.commit_logprob, atol=1e-5, rtol=0)
    torch.testing.assert_close(r.sequence, out.commit_logprob.sum(-1), atol=2e-5, rtol=0)
    steps_per_block = 2 if opts else None
    if kind == "block" and steps_per_block:
        assert r.num_forwards == steps_per_block  # every block at its own state in one pass
    if kind == "plain":
        assert r.num_forwards == len(set(out.commit_step[0, P:].tolist()))


def _exact_replay(lp, steps, positions):
    """Σ_s Σ_{i ∈ G_s} log p(x_i | the positions with step ≥ s masked), from the enumerated subsets."""
    total = 0.0
    for s in sorted(set(steps)):
        masked = frozenset(p for p, q in zip(positions, steps) if q >= s)
        total += sum(float(lp[masked][p]) for p, q in zip(positions, steps) if q == s)
    return total


@pytest.mark.parametrize("kind, prompt_len, steps", [
    ("plain", 3, [7, 3, 3, 10, 3]),  # steps need not be contiguous: groups {1, 2, 4}, {0}, {3} of the completion
    ("plain", 3, [0, 1, 2, 3, 4]),
    ("block", 4, [2, 1, 1, 5, 4, 4]),  # blocks of 2 from column 4: {4, 5}, {6, 7}, {8, 9}
])
def test_the_replay_is_the_exact_sum_over_the_groups_of_the_order(kind, prompt_len, steps):
    model = adapted(block_size=2) if kind == "block" else adapted()
    L = prompt_len + len(steps)
    x0 = torch.randint(4, 128, (L,), generator=torch.Generator().manual_seed(1))
    positions = list(range(prompt_len, L))
    lp = subset_log_probs(model, x0, positions, clean=kind == "block")
    trace = torch.full((2, L), -1)
    trace[:, prompt_len:] = torch.tensor(steps)
    trace[1, prompt_len:] += 100  # a shifted order: the same groups
    completion = trace >= 0
    with torch.no_grad():
        r = sequence_logprob(model, x0.repeat(2, 1), completion, estimator="trace", trace=trace)
    exact = _exact_replay(lp, steps, positions)
    assert abs(float(r.sequence[0]) - exact) < 1e-4 and abs(float(r.sequence[1]) - exact) < 1e-4
    assert r.per_token[:, :prompt_len].eq(0).all()


def test_plan_trace_groups_by_step_within_blocks():
    trace = torch.tensor([[-1, -1, 5, 3, 3, 9, 8, 8]])
    completion = trace >= 0
    plain = plan_trace(trace, completion)
    assert plain.num_passes == 4  # steps 3, 5, 8, 9
    assert plain.scored[0, 0].tolist() == [False, False, False, True, True, False, False, False]
    assert plain.noised[1, 0].tolist() == [False, False, True, False, False, True, True, True]
    blocks = plan_trace(trace, completion, block_size=3)  # blocks {2, 3, 4}, {5, 6, 7}
    assert blocks.num_passes == 2
    assert blocks.scored[0, 0].tolist() == [False, False, False, True, True, False, True, True]
    assert blocks.noised[0, 0].tolist() == [False, False, True, True, True, True, True, True]
    assert blocks.t[0, 3].item() == pytest.approx(1 - 1e-3) and blocks.t[0, 6].item() == pytest.approx(3 / 6)


def test_gradients_flow_through_the_replay(models):
    model = models["plain"]
    x0 = torch.randint(4, 128, (2, 8), generator=torch.Generator().manual_seed(2))
    trace = torch.tensor([[-1, -1, -1, 0, 0, 1, 2, 2]] * 2)
    r = sequence_logprob(model, x0, trace >= 0, estimator="trace", trace=trace)
    r.sequence.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    model.zero_grad()


def test_bad_input_names_the_argument(models):
    model = models["plain"]
    x0 = torch.randint(4, 128, (2, 8), generator=torch.Generator().manual_seed(2))
    trace = torch.tensor([[-1, -1, -1, 0, 0, 1, 2, 2]] * 2)
    completion = trace >= 0
    with torch.no_grad():
        with pytest.raises(ValueError, match="trace: estimator='trace' needs"):
            sequence_logprob(model, x0, completion, estimator="trace")
        with pytest.raises(ValueError, match=r"trace: expected a \(2, 8\) integer"):
            sequence_logprob(model, x0, completion, estimator="trace", trace=trace[:, :4])
        with pytest.raises(ValueError, match=r"trace: expected a \(2, 8\) integer"):
            sequence_logprob(model, x0, completion, estimator="trace", trace=trace.float())
        with pytest.raises(ValueError, match="without a commit step"):
            sequence_logprob(model, x0, completion | (torch.arange(8) == 2), estimator="trace", trace=trace)
        with pytest.raises(ValueError, match="num_samples"):
            sequence_logprob(model, x0, completion, estimator="trace", trace=trace, num_samples=2)
        with pytest.raises(ValueError, match="temperature"):
            sequence_logprob(model, x0, completion, estimator="trace", trace=trace, temperature=0.0)
        with pytest.raises(TypeError, match="temperature"):
            sequence_logprob(model, x0, completion, estimator="elbo", temperature=0.5)
        with pytest.raises(ValueError, match="attention_mask: expected each row's real tokens in one run"):
            sequence_logprob(model, x0, completion, estimator="trace", trace=trace,
                             attention_mask=torch.tensor([[1, 0, 1, 1, 1, 1, 1, 1]] * 2))


def test_rows_whose_generated_regions_start_at_other_columns_replay_as_each_row_alone(models):
    """A block model's rows with generated starts in different columns mod K (row 1 a column later): each row
    scores as it does alone (the blocks cut from each row's own start)."""
    x0 = torch.randint(4, 128, (2, 8), generator=torch.Generator().manual_seed(2))
    trace = torch.tensor([[-1, -1, -1, 0, 0, 1, 2, 2], [-1, -1, -1, -1, 0, 1, 2, 2]])
    with torch.no_grad():
        both = sequence_logprob(models["block"], x0, trace >= 0, estimator="trace", trace=trace).sequence
        alone = [sequence_logprob(models["block"], x0[b:b + 1], trace[b:b + 1] >= 0, estimator="trace",
                                  trace=trace[b:b + 1]).sequence for b in range(2)]
    torch.testing.assert_close(both, torch.cat(alone))


class LeftToRight(MaskPolicy):
    """Commits the leftmost masked positions first: nothing after an EOS is committed before the EOS."""

    def confidence(self, step):
        return -torch.arange(step.tokens.shape[1], dtype=torch.float32).expand(step.tokens.shape)


@pytest.mark.parametrize("kind, path", [("block", dict(use_cache=True)), ("plain", dict(block_size=4))])
def test_rows_stopped_at_eos_replay_exactly_up_to_the_eos(models, kind, path):
    """Scored up to the EOS, the fill after it out of the completion (step -1, masked in every pass as the decoder
    saw it): the replay equals the committed log-probs."""
    model = models[kind]
    prompt = torch.randint(4, 128, (3, P), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=NEW, policy=LeftToRight(), num_steps=2, **path)
    eos = int(model.generate(prompt[:1], eos_token_id=None, generator=_gens(1), **kw)[0, P + 5])
    out = model.generate(prompt, eos_token_id=eos, return_trace=True, generator=_gens(3), **kw)
    assert (out.commit_step[0, P + 6:] == -1).all() and (out.sequences[0, P + 6:] == eos).all()  # row 0 stopped
    completion = out.commit_step >= 0
    with torch.no_grad():
        r = sequence_logprob(model, out.sequences, completion, estimator="trace", trace=out.commit_step)
    torch.testing.assert_close(r.per_token, out.commit_logprob, atol=1e-5, rtol=0)

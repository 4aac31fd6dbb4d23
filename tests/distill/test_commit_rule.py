"""The learned commit rule (unifusion.distill.commit_rule) on a tiny random block model: the recorded examples are the
model's own states at the teacher's steps (replayed through the uncached block forward), the head trains without
touching the model, the policy commits exactly what the head accepts, cached decoding equals uncached, save/load."""

from __future__ import annotations

import math

import pytest
import torch
from _hf_tiny import VOCAB, tiny_model

import unifusion as uf
from unifusion.distill import (
    CommitHead,
    CommitRuleData,
    LearnedCommit,
    OracleCommit,
    collect_commit_data,
    train_commit_head,
)
from unifusion.samplers import PolicySampler
from unifusion.samplers.policies import (
    BlockStep,
    ConfidenceThreshold,
    EntropyBound,
    LowConfidence,
    PolicyStep,
    RowRandomness,
)

MASK_ID, K = 3, 4


@pytest.fixture(scope="module")
def model():
    return uf.adapt_ar_model(tiny_model("llama", seed=0), mask_token_id=MASK_ID, block_size=K).eval()


def _prompts(n: int, P: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, VOCAB, (n, P), generator=torch.Generator().manual_seed(seed))


def _trained_head(model, seed: int = 0) -> tuple[CommitHead, CommitRuleData, list[float]]:
    data = collect_commit_data(model, _prompts(8, seed=seed), max_new_tokens=12, eos_token_id=None)
    torch.manual_seed(seed)
    head = CommitHead(model.config.hidden_size, width=32)
    losses = train_commit_head(head, data, steps=300, lr=3e-3, generator=torch.Generator().manual_seed(seed))
    return head, data, losses


def test_recorded_examples_are_the_models_states_at_the_teachers_steps(model):
    """Replay the greedy LowConfidence trace (one commit per step): at each step of block b the positions committed
    at or after it are masked; the uncached block forward's hidden states there, their argmax probability and
    whether the argmax is the final token are the recorded examples, in the recording's order."""
    B, P, new = 2, 4, 8
    prompt = _prompts(B, P)
    data = collect_commit_data(model, prompt, max_new_tokens=new, eos_token_id=None)
    out = model.generate(prompt, max_new_tokens=new, policy=LowConfidence(), do_sample=False, eos_token_id=None,
                         return_trace=True)
    seq, step = out.sequences, out.commit_step
    hidden, conf, label = [], [], []
    for b in range(new // K):
        cols = torch.arange(P + b * K, P + (b + 1) * K)
        for n in range(K):  # one commit per step: the n-th step of the block masks the positions committed at or after
            for r in range(B):
                order = step[r, cols].sort().values
                masked = step[r, cols] >= order[n]
                x = seq[r:r + 1].clone()
                x[0, cols[masked]] = MASK_ID
                x[0, P + (b + 1) * K:] = MASK_ID
                with torch.no_grad():
                    h = model.block_forward().hidden_states(x, None)[0, cols]  # (K, d)
                    probs = torch.softmax(model.logits_from_hidden(h).float(), -1)
                probs[:, MASK_ID] = 0  # the sampler's x_θ never puts mass on the mask state
                probs = probs / probs.sum(-1, keepdim=True)
                for j in masked.nonzero().flatten().tolist():
                    hidden.append(h[j])
                    conf.append(probs[j].max())
                    label.append(int(probs[j].argmax()) == int(seq[r, cols[j]]))
    assert len(data) == B * (new // K) * K * (K + 1) // 2 == len(label)
    torch.testing.assert_close(data.hidden, torch.stack(hidden), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(data.confidence, torch.stack(conf), atol=1e-5, rtol=1e-4)
    assert data.label.tolist() == label
    assert data.num_tokens == B * new and data.num_forwards == int(out.num_forwards.sum())
    assert 0.0 < data.positive_rate < 1.0  # both kinds occur: the argmax at a masked position changes at times


def test_hidden_states_through_the_head_are_the_logits(model):
    """The seam the policy reads: the uncached block forward's and the plain forward's hidden states, through the
    output head, are their logits; a block model's cached step gives them too."""
    x = _prompts(2, 11, seed=3)
    x[:, 6:] = MASK_ID
    with torch.no_grad():
        forward = model.block_forward()
        assert torch.equal(forward.logits_from_hidden(forward.hidden_states(x, None)), forward(x, None))
        torch.testing.assert_close(model.logits_from_hidden(model.hidden_states(x[:, :4])), model(x[:, :4]))
        decoder = model.block_decoder()
        state = decoder.start_blocks(x[:, :4], torch.ones(2, 4, dtype=torch.bool))
        rows = torch.arange(2)
        h = decoder.denoise_block_hidden(state, x[:, 4:8], torch.full((2,), 0.5), rows, None)
        logits = decoder.denoise_block(state, x[:, 4:8], torch.full((2,), 0.5), rows, None)
        assert h.shape == (2, K, model.config.hidden_size)
        torch.testing.assert_close(decoder.logits_from_hidden(h), logits)
    with pytest.raises(ValueError, match="clean"):
        uf.adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID).hidden_states(x, clean=x)


def test_training_fits_the_trajectories_and_leaves_the_model_unchanged(model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flags = {k: p.requires_grad for k, p in model.named_parameters()}
    head, data, losses = _trained_head(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert {k: p.requires_grad for k, p in model.named_parameters()} == flags
    assert all(p.grad is None for p in model.parameters())
    # better than the best constant predictor on the data it learned from (the base rate's cross-entropy)
    q = data.positive_rate
    constant = -(q * math.log(q) + (1 - q) * math.log(1 - q))
    assert sum(losses[-20:]) / 20 < 0.8 * constant, (losses[-20:], constant)
    assert head.accuracy(data) > max(q, 1 - q)


def test_head_learns_a_rule_of_the_hidden_state():
    """The trainer recovers a label that is a function of the hidden state alone (a held-out check of the fit)."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2000, 16, generator=g)
    c = torch.rand(2000, generator=g)
    y = h[:, 3] + 0.5 * h[:, 7] > 0.2
    train, test = (CommitRuleData(h[s], c[s], y[s]) for s in (slice(0, 1500), slice(1500, None)))
    torch.manual_seed(0)
    head = CommitHead(16, width=32)
    train_commit_head(head, train, steps=400, lr=3e-3, generator=torch.Generator().manual_seed(1))
    assert head.accuracy(test) > 0.95 > max(test.positive_rate, 1 - test.positive_rate)


def test_policy_commits_exactly_what_the_head_accepts(model):
    torch.manual_seed(1)
    head = CommitHead(model.config.hidden_size, width=8)
    B, Kb, d = 3, 6, model.config.hidden_size
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(B, Kb, d, generator=g)
    probs = torch.softmax(torch.randn(B, Kb, 11, generator=g) * 3, -1)
    undecided = torch.rand(B, Kb, generator=g) < 0.7
    undecided[:, 0] = True
    step = PolicyStep(probs=probs, tokens=probs.argmax(-1), undecided=undecided,
                      num_commit=torch.ones(B, dtype=torch.long), randomness=RowRandomness(None, None, B),
                      hidden=hidden)
    with torch.no_grad():
        score = torch.sigmoid(head(hidden, probs.max(-1).values))
    for tau in (0.0, float(score.median()), 1.0):
        commit = LearnedCommit(head, tau).select(step)
        accepted = undecided & (score >= tau)
        best = score.masked_fill(~undecided, -1).argmax(-1)  # the one forced commit of a step
        forced = torch.zeros_like(undecided).scatter_(1, best[:, None], True)
        assert torch.equal(commit, accepted | forced), tau
    assert torch.equal(LearnedCommit(head, 0.0).select(step), undecided)  # τ = 0: every masked position


@pytest.mark.parametrize("P", [0, 3])
def test_cached_decoding_with_the_learned_rule_equals_uncached(model, P):
    head, _, _ = _trained_head(model)
    B, new = 3, 10
    prompt = _prompts(B, P) if P else torch.zeros((B, 0), dtype=torch.long)
    for tau in (0.3, 0.9):
        kw = dict(max_new_tokens=new, policy=LearnedCommit(head, tau), do_sample=False, eos_token_id=None,
                  return_dict=True)
        cached = model.generate(prompt, **kw)
        uncached = model.generate(prompt, use_cache=False, **kw)
        merged = model.generate(prompt, merge_commits=True, **kw)
        nb = -(-new // K)
        for other, extra in ((uncached, nb - 1 + int(P > 0)), (merged, nb - 1 + int(P > 0))):
            assert torch.equal(cached.sequences, other.sequences)
            assert torch.equal(cached.num_forwards, other.num_forwards + extra)
    # τ = 0 decodes each block in one forward
    one = model.generate(prompt, max_new_tokens=new, policy=LearnedCommit(head, 0.0), do_sample=False,
                         eos_token_id=None, use_cache=False, return_dict=True)
    assert torch.equal(one.num_forwards, torch.full((B,), nb))


def test_prefix_cache_refreshed_every_step_equals_uncached_with_the_learned_rule(model):
    """A fully bidirectional model: the approximate dual cache at refresh 1 is the uncached computation, so it
    commits what the uncached path commits (PrefixCacheDecoder.denoise_block_hidden)."""
    head, _, _ = _trained_head(model)
    plain = uf.adapt_ar_model(tiny_model("llama", seed=0), mask_token_id=MASK_ID).eval()
    kw = dict(max_new_tokens=8, policy=LearnedCommit(head, 0.6), block_size=K, do_sample=False, eos_token_id=None,
              return_dict=True)
    cached = plain.generate(_prompts(2, 3), cache_refresh=1, **kw)
    uncached = plain.generate(_prompts(2, 3), use_cache=False, **kw)
    assert torch.equal(cached.sequences, uncached.sequences)
    assert torch.equal(cached.num_forwards, uncached.num_forwards)


def test_save_and_load(tmp_path, model):
    head, data, _ = _trained_head(model)
    path = head.save(tmp_path / "sub" / "commit_head.safetensors")
    again = CommitHead.load(path)
    assert (again.hidden_size, again.width) == (head.hidden_size, head.width)
    with torch.no_grad():
        assert torch.equal(again(data.hidden, data.confidence), head(data.hidden, data.confidence))
    with pytest.raises(ValueError, match="path"):
        CommitHead.load(tmp_path / "missing.safetensors")
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="path"):
        CommitHead.load(tmp_path / "other.safetensors")


def test_bad_input_names_the_argument(model):
    head = CommitHead(model.config.hidden_size, width=4)
    with pytest.raises(ValueError, match="threshold"):
        LearnedCommit(head, 1.5)
    with pytest.raises(TypeError, match="head"):
        LearnedCommit(object(), 0.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hidden_size"):
        CommitHead(0)
    with pytest.raises(ValueError, match="hidden"):
        head(torch.zeros(2, 5), torch.zeros(2))
    with pytest.raises(TypeError, match="policy"):
        collect_commit_data(model, _prompts(1), max_new_tokens=4, policy=EntropyBound(1.0))
    with pytest.raises(ValueError, match="prompt_ids"):
        collect_commit_data(model, torch.zeros(4, dtype=torch.long), max_new_tokens=4)
    with pytest.raises(ValueError, match="data"):
        train_commit_head(head, CommitRuleData(torch.zeros(0, 32), torch.zeros(0), torch.zeros(0, dtype=torch.bool)))
    with pytest.raises(ValueError, match="weight_decay"):
        train_commit_head(head, CommitRuleData(torch.zeros(1, 32), torch.zeros(1), torch.ones(1, dtype=torch.bool)),
                          weight_decay=-1.0)
    with pytest.raises(ValueError, match="steps"):
        train_commit_head(head, CommitRuleData(torch.zeros(1, 32), torch.zeros(1), torch.ones(1, dtype=torch.bool)),
                          steps=0)
    # a model that gives no hidden states cannot run a policy that reads them
    kernel = uf.MaskKernel(VOCAB + 1, MASK_ID)

    def x0(x_t, t):
        return torch.zeros(*x_t.shape, VOCAB + 1)

    with pytest.raises(ValueError, match="policy.*hidden_states"):
        PolicySampler(x0, kernel, LearnedCommit(head), block_size=K)
    PolicySampler(x0, kernel, ConfidenceThreshold(0.9), block_size=K)  # the others need none


def test_oracle_commit_is_low_confidence_plus_every_candidate_equal_to_the_reference():
    """One step on rows 2 and 0 of a batch of 3: the most confident undecided position, and every undecided one
    whose argmax equals the reference at its column; a column past the sequence (a finished row's block) never."""
    g = torch.Generator().manual_seed(0)
    B, L, V = 3, 12, 7
    logits = torch.randn(2, K, V, generator=g)
    undecided = torch.tensor([[True, True, False, True], [True, True, True, True]])
    columns = torch.tensor([[4, 5, 6, 7], [8, 9, 10, L]])
    reference = torch.randint(0, V, (B, L), generator=g)
    argmax = logits.softmax(-1).argmax(-1)
    reference[2, 4], reference[2, 7] = argmax[0, 0], argmax[0, 3]  # rows[0] = 2: columns 4 and 7 match
    reference[0, 9] = argmax[1, 1]  # rows[1] = 0: column 9 matches
    randomness = RowRandomness(torch.Generator().manual_seed(0), torch.tensor([2, 0]), B)
    where = BlockStep(0, K, columns, L)
    tokens, commit, _ = OracleCommit(reference).decide(logits, undecided, torch.ones(2, dtype=torch.long),
                                                      randomness, where, mask_id=None, do_sample=False)
    assert torch.equal(tokens, argmax)
    top = torch.zeros_like(undecided)
    for r in range(2):
        top[r, logits[r].softmax(-1).max(-1).values.masked_fill(~undecided[r], -1).argmax()] = True
    match = torch.zeros_like(undecided)
    match[0, 0] = match[0, 3] = match[1, 1] = True
    assert torch.equal(commit, top | match)
    with pytest.raises(ValueError, match="reference"):
        OracleCommit(reference[:, :-1]).decide(logits, undecided, torch.ones(2, dtype=torch.long), randomness,
                                               where, mask_id=None, do_sample=False)
    with pytest.raises(ValueError, match="where"):
        OracleCommit(reference).decide(logits, undecided, torch.ones(2, dtype=torch.long), randomness, BlockStep(),
                                       mask_id=None, do_sample=False)


def test_oracle_commit_decodes(model):
    """A reference the model never predicts (the mask id) leaves LowConfidence's decode exactly; the model's own
    one-token-per-forward decode as the reference takes at most its forwards, cached as uncached; bad references
    are refused."""
    B, P, new = 3, 4, 12
    prompt = _prompts(B, P, seed=3)
    kw = dict(max_new_tokens=new, num_steps=K, do_sample=False, eos_token_id=None, return_dict=True)
    plain = model.generate(prompt, policy=LowConfidence(), **kw)
    never = model.generate(prompt, policy=OracleCommit(torch.full_like(plain.sequences, MASK_ID)), **kw)
    assert torch.equal(never.sequences, plain.sequences) and torch.equal(never.num_forwards, plain.num_forwards)
    oracle = model.generate(prompt, policy=OracleCommit(plain.sequences), **kw)
    uncached = model.generate(prompt, policy=OracleCommit(plain.sequences), use_cache=False, **kw)
    assert torch.equal(oracle.sequences, uncached.sequences)
    assert bool((oracle.num_forwards <= plain.num_forwards).all())
    assert int(oracle.num_forwards.sum()) < int(plain.num_forwards.sum())  # this model has tokens decoded early
    assert torch.equal(oracle.sequences[:, :P], prompt)
    with pytest.raises(TypeError, match="reference"):
        OracleCommit(plain.sequences.tolist())
    with pytest.raises(ValueError, match="reference"):
        OracleCommit(plain.sequences.float())
    with pytest.raises(ValueError, match="reference"):
        model.generate(prompt[:2], policy=OracleCommit(plain.sequences), **kw)

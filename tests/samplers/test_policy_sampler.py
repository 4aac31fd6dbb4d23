"""PolicySampler's semantics pinned on synthetic x0 models whose answers are known exactly."""

import itertools
import math

import pytest
import torch

import unifusion as uf
from unifusion.samplers import BlockDenoiser, PolicyOutput, PolicySampler
from unifusion.samplers.policies import (
    ConfidenceThreshold,
    EntropyBound,
    LowConfidence,
    RandomOrder,
    TopKEntropy,
    TopKMargin,
)


class ExactPosterior:
    """The x0 model of a known joint p over {0..C−1}^L: at every position, the exact conditional marginal given the
    visible (unmasked) tokens, p(x_j = c | x_visible) = Σ_{x consistent} p(x) [x_j = c] / Σ_{x consistent} p(x)."""

    def __init__(self, joint, C, L):
        self.joint, self.C, self.L, self.mask_id = joint, C, L, C
        self.seqs = torch.tensor([s[::-1] for s in itertools.product(range(C), repeat=L)])  # row n: n in base C

    def __call__(self, x, t):
        visible = x != self.mask_id
        consistent = ((self.seqs[None] == x[:, None]) | ~visible[:, None]).all(-1)  # (B, N)
        w = self.joint[None] * consistent
        onehot = torch.nn.functional.one_hot(self.seqs, self.C).double()  # (N, L, C)
        marginal = torch.einsum("bn,nlc->blc", w, onehot)
        marginal = marginal / marginal.sum(-1, keepdim=True)
        logits = marginal.log()
        return torch.cat([logits, torch.full_like(logits[..., :1], -math.inf)], -1).float()  # the mask state


def _index(seqs, C):
    return (seqs * C ** torch.arange(seqs.shape[1])).sum(-1)


def _expected_tv(p, n):
    """E[TV(empirical, p)] for n draws ≈ ½ Σ_x √(2 p(x)(1 − p(x)) / (π n)) (the mean absolute deviation of a
    binomial count)."""
    return 0.5 * (2 * p * (1 - p) / (math.pi * n)).sqrt().sum().item()


def test_random_order_one_token_per_step_samples_the_exact_joint():
    C, L, n = 3, 4, 20000
    joint = torch.softmax(2.5 * torch.randn(C ** L, generator=torch.Generator().manual_seed(0), dtype=torch.float64),
                          0)
    model = ExactPosterior(joint, C, L)
    kernel = uf.MaskKernel(C + 1, C)
    bound = 1.5 * _expected_tv(joint, n)  # ≈ 0.035; the TV of a correct sampler concentrates around 1/1.5 of this
    for block_size in (None, 2):
        seqs = PolicySampler(model, kernel, RandomOrder(), block_size=block_size).sample(
            n, L, generator=torch.Generator().manual_seed(1))
        empirical = torch.bincount(_index(seqs, C), minlength=C ** L).double() / n
        assert 0.5 * (empirical - joint).abs().sum().item() < bound, block_size
    # committing every position in one forward samples the product of the marginals instead: far outside the bound
    seqs = PolicySampler(model, kernel, ConfidenceThreshold(0.0)).sample(n, L,
                                                                         generator=torch.Generator().manual_seed(2))
    empirical = torch.bincount(_index(seqs, C), minlength=C ** L).double() / n
    assert 0.5 * (empirical - joint).abs().sum().item() > 4 * bound
    # a prompt: the conditional p(x_1.. | x_0 = 1)
    prompt = torch.tensor([1, -1, -1, -1])
    seqs = PolicySampler(model, kernel, RandomOrder(), block_size=2).sample(
        n, L, prompt=prompt, generator=torch.Generator().manual_seed(3))
    assert (seqs[:, 0] == 1).all()
    conditional = joint * (model.seqs[:, 0] == 1)
    conditional = conditional / conditional.sum()
    empirical = torch.bincount(_index(seqs, C), minlength=C ** L).double() / n
    assert 0.5 * (empirical - conditional).abs().sum().item() < 1.5 * _expected_tv(conditional, n)


class HashModel:
    """A deterministic, row-local, causal, padding-aware x0 model: the logits at position j are a fixed random row
    picked by an integer hash of the real, non-mask tokens at positions ≤ j and of j's position counted from the
    row's first real token (so a left-padded row gives what the row alone gives, and later positions never matter).
    Also a :class:`BlockDenoiser` over the same function. Records the batch size and width of every call."""

    def __init__(self, num_states, mask_id=None, scale=3.0, seed=0):
        self.S, self.mask_id = num_states, mask_id
        self.table = scale * torch.randn(1009, num_states, generator=torch.Generator().manual_seed(seed))
        self.calls = []
        self.positions = []  # (block, positions) of every denoise_block call
        self.zero_unread = False

    def logits(self, x, attention_mask):
        real = torch.ones_like(x, dtype=torch.bool) if attention_mask is None else attention_mask
        rel = torch.cumsum(real.long(), -1) - 1  # position counted from the first real token
        seen = real & (x != (-1 if self.mask_id is None else self.mask_id))
        h = torch.cumsum(torch.where(seen, (x + 1) * (rel + 2), 0), -1)
        return self.table[(h + 31 * rel) % 1009]

    def __call__(self, x, t, attention_mask=None):
        self.calls.append(("x0", x.shape[0], x.shape[1]))
        return self.logits(x, attention_mask)

    # the BlockDenoiser path
    def start_blocks(self, prefix, prefix_mask):
        self.calls.append(("prefill", prefix.shape[0], prefix.shape[1]))
        return {"tokens": prefix, "mask": prefix_mask}

    def denoise_block(self, state, block, t, rows, self_condition, positions=None):
        self.calls.append(("block", block.shape[0], block.shape[1]))
        self.positions.append((block.clone(), positions))
        x = torch.cat([state["tokens"][rows], block], 1)
        mask = torch.cat([state["mask"][rows], torch.ones_like(block, dtype=torch.bool)], 1)
        logits = self.logits(x, mask)[:, -block.shape[1]:]
        if positions is not None and self.zero_unread:  # only the listed positions are read
            read = torch.zeros_like(block, dtype=torch.bool).scatter_(1, positions, True)
            logits = logits.masked_fill(~read[..., None], 0.0)
        return logits

    def commit_block(self, state, block, rows):
        full = torch.zeros(state["tokens"].shape[0], block.shape[1], dtype=torch.long)
        full[rows] = block
        return {"tokens": torch.cat([state["tokens"], full], 1),
                "mask": torch.cat([state["mask"], torch.ones_like(full, dtype=torch.bool)], 1)}


class XOnly:
    """The x0 callable of a HashModel without its block path."""

    def __init__(self, model):
        self.model = model

    def __call__(self, x, t, attention_mask=None):
        return self.model(x, t, attention_mask=attention_mask)


def _gens(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


MASK, UNIFORM = uf.MaskKernel(12, 11), uf.UniformKernel(12)
CASES = [
    (MASK, lambda: LowConfidence(), dict(num_steps=2, block_size=4, temperature=0.9, top_p=0.95)),
    (MASK, lambda: RandomOrder(), dict(block_size=3)),
    (MASK, lambda: TopKMargin(), dict(num_steps=3, block_size=5, top_k=6)),
    (MASK, lambda: TopKEntropy(), dict(num_steps=4)),
    (MASK, lambda: ConfidenceThreshold(0.3), dict(block_size=4)),
    (UNIFORM, lambda: EntropyBound(0.7, stability_threshold=0, confidence_threshold=0.6),
     dict(num_steps=5, block_size=4)),  # rows stop their blocks after different numbers of steps
    (UNIFORM, lambda: EntropyBound(0.5, confidence_threshold=None), dict(num_steps=3, top_k=8, temperature=1.2)),
]


@pytest.mark.parametrize("kernel,policy,options", CASES)
def test_rows_with_per_row_generators_equal_the_rows_alone(kernel, policy, options):
    """Per-row generators: each row of a batch, its prompt left-padded to the longest (attention_mask), gives the
    tokens of that row run alone without padding, whatever its neighbours — EOS stops included."""
    L, P = 14, 4
    lengths = [2, 4, 3, 1]
    prompt = torch.full((4, L), -1)
    mask = torch.zeros(4, P, dtype=torch.bool)
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(0, 11, (n,), generator=g) for n in lengths]
    for b, ids in enumerate(rows):
        prompt[b, :P] = 0  # the pad id
        prompt[b, P - len(ids):P] = ids
        mask[b, P - len(ids):] = True
    model = HashModel(kernel.num_states, kernel.mask_id)
    sampler = PolicySampler(model, kernel, policy(), **options)
    seeds = [11, 12, 13, 14]
    batch = sampler.sample(4, L, prompt=prompt, attention_mask=mask, generator=_gens(seeds), eos_token_id=3,
                           return_dict=True)
    for b, ids in enumerate(rows):
        pad = P - len(ids)
        alone = torch.cat([ids, torch.full((L - P,), -1)])
        single = sampler.sample(1, L - pad, prompt=alone, generator=_gens([seeds[b]]), eos_token_id=3,
                                return_dict=True)
        assert torch.equal(batch.sequences[b, pad:], single.sequences[0]), b
        assert batch.num_forwards[b] == single.num_forwards[0]
        assert batch.tokens_per_forward[b] == single.tokens_per_forward[0]


@pytest.mark.parametrize("kernel,policy,options", CASES)
@pytest.mark.parametrize("per_row", [False, True])
def test_block_denoiser_path_equals_the_x0_path(kernel, policy, options, per_row):
    """A model with a block path ("denoise this block against the prefix") gives the tokens of the same model called
    on the whole sequence, under the same randomness; its calls after the prefill see one block at most. Mask
    policies pass the masked positions (the only logits they read: the block path zeroes the rest here)."""
    L, B = 15, 3
    prompt = torch.full((B, L), -1)
    prompt[:, :3] = torch.randint(0, 11, (B, 3), generator=torch.Generator().manual_seed(0))
    model = HashModel(kernel.num_states, kernel.mask_id)
    model.zero_unread = True
    outs = []
    for m in (model, XOnly(model)):
        generator = _gens(range(B)) if per_row else torch.Generator().manual_seed(7)
        outs.append(PolicySampler(m, kernel, policy(), **options).sample(B, L, prompt=prompt, generator=generator,
                                                                         eos_token_id=2, return_dict=True))
    assert isinstance(model, BlockDenoiser)
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert torch.equal(outs[0].num_forwards, outs[1].num_forwards)
    width = options.get("block_size") or L - 3
    assert all(w <= width for kind, _, w in model.calls if kind == "block")
    assert sum(kind == "prefill" for kind, _, _ in model.calls) == 1
    for block, positions in model.positions:
        masked = block == kernel.mask_id if kernel.mask_id is not None else torch.ones_like(block, dtype=torch.bool)
        if positions is None:  # every position is read
            continue
        m = int(masked.sum(-1).max())
        assert positions.shape == (block.shape[0], m) and m < block.shape[1]
        for row, pos in zip(masked, positions):  # the masked positions first, ascending
            assert pos[:int(row.sum())].tolist() == row.nonzero().flatten().tolist()
    if kernel.mask_id is not None and options.get("num_steps", 1) > 1:
        assert any(p is not None for _, p in model.positions)


def test_use_cache_false_calls_the_model_as_an_x0_callable():
    model = HashModel(12, 11)
    PolicySampler(model, MASK, LowConfidence(), block_size=4, use_cache=False).sample(2, 8)
    assert {kind for kind, _, _ in model.calls} == {"x0"}


class Recorder:
    """Wraps an x0 callable; records, per call, the batch size and the tokens it saw."""

    def __init__(self, fn):
        self.fn, self.inputs = fn, []

    def __call__(self, x, t):
        self.inputs.append(x.clone())
        return self.fn(x, t)


def _fixed_logits(rows):
    """An x0 callable returning the same logits (L, S) for every row."""
    return lambda x, t: rows.expand(x.shape[0], -1, -1).clone()


def test_threshold_zero_commits_a_whole_block_in_one_forward():
    model = HashModel(12, 11)
    out = PolicySampler(model, MASK, ConfidenceThreshold(0.0), block_size=4).sample(
        3, 12, generator=torch.Generator().manual_seed(0), return_dict=True)
    assert out.num_forwards.tolist() == [3, 3, 3]
    assert out.tokens_per_forward.tolist() == [4.0, 4.0, 4.0]
    assert (out.sequences != 11).all()


def test_a_threshold_no_position_reaches_commits_one_token_per_forward():
    logits = torch.randn(1, 10, 12, generator=torch.Generator().manual_seed(0))  # never certain: p < 1
    model = Recorder(_fixed_logits(logits))
    out = PolicySampler(model, MASK, ConfidenceThreshold(1.0)).sample(2, 10, return_dict=True)
    assert out.num_forwards.tolist() == [10, 10]
    assert out.tokens_per_forward.tolist() == [1.0, 1.0]
    masked = [int((x == 11).sum()) for x in model.inputs]
    assert masked == [2 * (10 - i) for i in range(10)]


def test_threshold_commits_exactly_the_positions_at_or_above_it():
    """Each step commits {undecided j : x_θ,j(z_j) ≥ 0.5} ∪ {the most confident}, with x_θ and z as the sampler
    drew them (the policy is spied on), and writes exactly those tokens."""
    seen = []

    class Spy(ConfidenceThreshold):
        def select(self, step):
            commit = super().select(step)
            seen.append((step, commit))
            return commit

    logits = torch.randn(1, 12, 12, generator=torch.Generator().manual_seed(3)) * 2.5
    out = PolicySampler(_fixed_logits(logits), MASK, Spy(0.5)).sample(2, 12, generator=torch.Generator().manual_seed(0),
                                                                    return_dict=True)
    sizes = []
    for step, commit in seen:
        c = step.probs.gather(-1, step.tokens.unsqueeze(-1)).squeeze(-1)
        top = torch.where(step.undecided, c, -1.0).argmax(-1)
        expected = step.undecided & (c >= 0.5)
        expected[torch.arange(c.shape[0]), top] = True
        assert torch.equal(commit, expected)
        sizes += commit.sum(-1).tolist()
    assert max(sizes) >= 2 and min(sizes) == 1  # both rules were exercised
    assert (out.sequences != 11).all()


def test_low_confidence_commits_the_most_confident_first():
    """Position j puts probability q_j on token 0 (q_j from 0.9982 to 0.99997, all distinct) and spreads the rest over
    the other ten tokens: the positions are unmasked in decreasing q_j, one per step."""
    s = torch.tensor([10.0, 13.0, 11.0, 14.0, 10.5, 12.0, 12.5, 11.5])
    logits = torch.zeros(1, 8, 12)
    logits[0, :, 0] = s
    model = Recorder(_fixed_logits(logits))
    out = PolicySampler(model, MASK, LowConfidence()).sample(1, 8, generator=torch.Generator().manual_seed(0),
                                                           return_dict=True)
    assert (out.sequences == 0).all()
    order = [int((b != 11).long().sub((a != 11).long()).argmax()) for a, b in
             zip(model.inputs, model.inputs[1:] + [out.sequences])]
    assert order == torch.argsort(s, descending=True).tolist()


def test_fixed_count_schedule_spreads_evenly_remainder_first():
    """⌈r / steps left⌉ per step: LLaDA's get_num_transfer_tokens (10 over 4 steps: 3, 3, 2, 2); a kept position
    inside the block counts as decided (8 over 4 steps: 2 each); the last, shorter block: one per step."""
    model = Recorder(HashModel(12, 11))
    prompt = torch.full((1, 14), -1)
    prompt[0, 13] = 5  # kept at the end of the second block
    PolicySampler(model, MASK, LowConfidence(), num_steps=4, block_size=10).sample(1, 14, prompt=prompt)
    masked = [int((x == 11).sum()) for x in model.inputs] + [0]
    assert [a - b for a, b in zip(masked, masked[1:])] == [3, 3, 2, 2, 1, 1, 1]


def _eos_model(eos, position, rows_with_eos=None):
    """x0 logits: EOS almost surely at ``position`` (for rows whose first token is in ``rows_with_eos``, all rows if
    None), uniform over tokens 0..3 elsewhere, never EOS elsewhere."""

    def model(x, t):
        B, L = x.shape
        logits = torch.full((B, L, 12), -math.inf)
        logits[..., :4] = 0.0
        hit = torch.ones(B, dtype=torch.bool) if rows_with_eos is None else torch.isin(x[:, 0], rows_with_eos)
        logits[hit, position] = -math.inf
        logits[hit, position, eos] = 0.0
        return logits

    return model


@pytest.mark.parametrize("pad", [None, 9])
def test_eos_stops_a_row_and_fills_after_it(pad):
    model = Recorder(_eos_model(eos=7, position=3, rows_with_eos=torch.tensor([1])))
    prompt = torch.full((2, 10), -1)
    prompt[:, 0] = torch.tensor([0, 1])  # row 1 produces EOS at position 3, row 0 never does
    out = PolicySampler(model, MASK, LowConfidence()).sample(2, 10, prompt=prompt, eos_token_id=7, pad_token_id=pad,
                                                           generator=torch.Generator().manual_seed(0),
                                                           return_dict=True)
    fill = 7 if pad is None else pad
    # row 1: EOS (probability 1) first, then positions 1 and 2 (ties, lower first): done after 3 forwards
    assert out.sequences[1, 3] == 7 and (out.sequences[1, 4:] == fill).all()
    assert (out.sequences[1, 1:3] < 4).all()
    assert out.num_forwards.tolist() == [9, 3]
    assert [x.shape[0] for x in model.inputs] == [2, 2, 2] + [1] * 6  # finished rows cost no forwards
    generated = torch.tensor([9, 3])  # up to and including the first EOS
    assert torch.equal(out.tokens_per_forward, generated / out.num_forwards)


def test_eos_with_entropy_bound_stops_after_the_block():
    model = _eos_model(eos=7, position=5)  # EOS in the second block
    out = PolicySampler(model, UNIFORM, EntropyBound(1.0, confidence_threshold=None), num_steps=3,
                        block_size=4).sample(2, 16, eos_token_id=7, generator=torch.Generator().manual_seed(0),
                                             return_dict=True)
    assert (out.sequences[:, 5] == 7).all() and (out.sequences[:, 6:] == 7).all()
    assert out.num_forwards.tolist() == [6, 6]  # two blocks of three steps; blocks 3 and 4 never run
    assert torch.allclose(out.tokens_per_forward, torch.tensor([1.0, 1.0]))


def test_tokens_per_forward_is_generated_tokens_over_forwards():
    model = HashModel(12, 11)
    prompt = torch.full((3, 20), -1)
    prompt[:, :4] = 1
    prompt[1, 10] = 2  # a kept token inside the generated region does not count
    for policy, kw in ((ConfidenceThreshold(0.2), {}), (LowConfidence(), dict(num_steps=3))):
        out = PolicySampler(model, MASK, policy, block_size=8, **kw).sample(
            3, 20, prompt=prompt, generator=_gens([0, 1, 2]), eos_token_id=4, return_dict=True)
        assert isinstance(out, PolicyOutput)
        generated = (prompt == -1).clone()
        for b in range(3):
            hits = ((out.sequences[b] == 4) & generated[b]).nonzero()
            if len(hits):
                generated[b, int(hits[0]) + 1:] = False
        assert torch.equal(out.tokens_per_forward, generated.sum(-1) / out.num_forwards)


def test_entropy_bound_stops_a_block_early_when_stable_and_confident():
    logits = torch.zeros(1, 8, 12)
    logits[0, :, 5] = 30.0  # certain: entropy ≈ 0, the argmax never changes
    out = PolicySampler(_fixed_logits(logits), UNIFORM, EntropyBound(0.1, stability_threshold=1), num_steps=10,
                        block_size=4).sample(2, 8, return_dict=True)
    assert (out.sequences == 5).all()
    assert out.num_forwards.tolist() == [4, 4]  # 2 steps per block: the second sees a stable argmax


def test_returns_tokens_without_return_dict():
    out = PolicySampler(HashModel(12, 11), MASK, LowConfidence(), block_size=4).sample(2, 8)
    assert isinstance(out, torch.Tensor) and out.shape == (2, 8) and out.dtype == torch.long


def test_nothing_to_generate():
    prompt = torch.arange(6)[None]
    out = PolicySampler(HashModel(12, 11), MASK, LowConfidence()).sample(1, 6, prompt=prompt, return_dict=True)
    assert torch.equal(out.sequences, prompt) and out.num_forwards.tolist() == [0]
    assert out.tokens_per_forward.tolist() == [0.0]


def test_bad_input_is_a_value_error_naming_the_argument():
    model = HashModel(12, 11)
    with pytest.raises(ValueError, match="policy: EntropyBound"):
        PolicySampler(model, MASK, EntropyBound(0.1))
    with pytest.raises(ValueError, match="policy: LowConfidence"):
        PolicySampler(model, UNIFORM, LowConfidence())
    with pytest.raises(ValueError, match="num_steps"):
        PolicySampler(model, MASK, LowConfidence(), num_steps=5, block_size=4)
    PolicySampler(model, MASK, ConfidenceThreshold(0.9), num_steps=5, block_size=4)  # adaptive: a cap only
    with pytest.raises(ValueError, match="num_steps"):
        PolicySampler(model, MASK, TopKMargin(), num_steps=9).sample(1, 10, prompt=torch.tensor([1, 2] + [-1] * 8))
    sampler = PolicySampler(model, MASK, LowConfidence())
    for value in (12, -1, 11):  # out of range, negative, the mask id
        with pytest.raises(ValueError, match="eos_token_id"):
            sampler.sample(1, 4, eos_token_id=value)
    with pytest.raises(ValueError, match="pad_token_id"):
        sampler.sample(1, 4, eos_token_id=1, pad_token_id=12)
    with pytest.raises(ValueError, match="pad_token_id"):
        sampler.sample(1, 4, pad_token_id=1)
    with pytest.raises(TypeError, match="policy"):
        PolicySampler(model, MASK, "low_confidence")
    with pytest.raises(ValueError, match="temperature"):
        PolicySampler(model, MASK, LowConfidence(), temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        PolicySampler(model, MASK, LowConfidence(), top_p=1.5)


def test_bad_attention_masks():
    prompt = torch.full((2, 8), -1)
    prompt[:, :3] = 1
    sampler = PolicySampler(XOnly(HashModel(12, 11)), MASK, LowConfidence())
    with pytest.raises(ValueError, match="attention_mask: expected left padding"):
        sampler.sample(2, 8, prompt=prompt, attention_mask=torch.tensor([[1, 1, 0], [1, 1, 1]]))
    with pytest.raises(ValueError, match="attention_mask: marks a position as padding where the prompt generates"):
        sampler.sample(2, 8, prompt=prompt, attention_mask=torch.tensor([[0] * 4 + [1] * 4, [1] * 8]))
    with pytest.raises(ValueError, match="attention_mask: expected shape"):
        sampler.sample(2, 8, prompt=prompt, attention_mask=torch.ones(2, 9, dtype=torch.long))
    with pytest.raises(TypeError, match="attention_mask: the model does not take"):
        PolicySampler(lambda x, t: HashModel(12, 11).logits(x, None), MASK, LowConfidence()).sample(
            2, 8, prompt=prompt, attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]))
    ragged = torch.full((2, 8), -1)
    ragged[0, :3], ragged[1, :2] = 1, 1
    with pytest.raises(ValueError, match="prompt: the block path"):
        PolicySampler(HashModel(12, 11), MASK, LowConfidence()).sample(2, 8, prompt=ragged)


@pytest.mark.parametrize("kernel,policy,options", CASES[:1] + CASES[4:6])
@pytest.mark.parametrize("cached", [True, False])
def test_one_host_sync_per_step(kernel, policy, options, cached):
    """The setup reads back its checks, the rows' starts and the first output's check; each step reads back which rows
    still run; a block adds at most three such reads (which rows start it, the read that finds none left, the rows
    the block path commits); nothing else syncs, whatever the number of positions."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from _dispatch_count import DispatchCounter

    model = HashModel(kernel.num_states, kernel.mask_id)
    sampler = PolicySampler(model if cached else XOnly(model), kernel, policy(), **options)
    prompt = torch.tensor([1, 2] + [-1] * 14)
    with DispatchCounter() as c:
        sampler.sample(3, 16, prompt=prompt, generator=torch.Generator().manual_seed(0))
    steps = sum(kind != "prefill" for kind, _, _ in model.calls)
    num_blocks = math.ceil(14 / (options.get("block_size") or 14))
    assert steps >= 3
    assert c.syncs <= 3 + steps + 3 * num_blocks, c.sync_ops


@pytest.mark.parametrize("family", ["mask", "uniform"])
def test_a_diffusion_lm_with_left_padded_prompts(family):
    """A DiffusionLM takes the attention mask (its position ids skip the padding): each left-padded row equals the
    row alone (on this CPU the tiny model's arithmetic does not change with the batch shape)."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from _hf_tiny import tiny_model

    model = uf.adapt_ar_model(tiny_model("llama"))
    S, m = model.num_states, model.mask_token_id
    kernel, policy = (uf.MaskKernel(S, m), LowConfidence()) if family == "mask" else (uf.UniformKernel(S),
                                                                                      EntropyBound(0.5))
    prompt = torch.full((3, 16), -1)
    prompt[:, :4] = torch.tensor([[0, 0, 5, 6], [0, 7, 8, 9], [3, 4, 5, 6]])
    mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]])
    sampler = PolicySampler(model, kernel, policy, num_steps=2, block_size=4)
    out = sampler.sample(3, 16, prompt=prompt, attention_mask=mask, generator=_gens(range(3)), eos_token_id=2,
                         return_dict=True)
    assert out.num_forwards.tolist() == [6, 6, 6]
    for b, pad in enumerate([2, 1, 0]):
        single = sampler.sample(1, 16 - pad, prompt=prompt[b, pad:], generator=_gens([b]), eos_token_id=2)
        assert torch.equal(single[0], out.sequences[b, pad:])
    with pytest.raises(ValueError, match="kernel"):  # the model's own mask token
        PolicySampler(model, uf.MaskKernel(S, 3), LowConfidence())

"""The decoding policies as pure functions: each against a slow per-row reference or hand-made values."""

import math

import pytest
import torch

import unifusion as uf
from unifusion.samplers.policies import (
    ConfidenceThreshold,
    EntropyBound,
    LowConfidence,
    PolicyStep,
    RandomOrder,
    RowRandomness,
    TopKEntropy,
    TopKMargin,
    categorical_entropy,
    select_top,
)
from unifusion.samplers.policies.uniform import entropy_bound_step


def _slow_select_top(score, eligible, count):
    """Per row: sort eligible positions by (−score, position), take the first count."""
    out = torch.zeros_like(eligible)
    for b in range(score.shape[0]):
        order = sorted((j for j in range(score.shape[1]) if eligible[b, j]), key=lambda j: (-float(score[b, j]), j))
        for j in order[: int(count[b])]:
            out[b, j] = True
    return out


def _step(probs, tokens, undecided, num_commit, seed=0):
    B = probs.shape[0]
    return PolicyStep(probs=probs, tokens=tokens, undecided=undecided, num_commit=num_commit,
                      randomness=RowRandomness(torch.Generator().manual_seed(seed), None, B))


def _random_step(B=5, K=9, V=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(3 * torch.randn(B, K, V, generator=g), -1)
    probs[0, :3] = probs[0, 0]  # exact ties within a row
    tokens = torch.multinomial(probs.view(-1, V), 1, generator=g).view(B, K)
    undecided = torch.rand(B, K, generator=g) < 0.7
    undecided[1] = False  # a row with nothing left
    undecided[0, :3] = True
    num_commit = torch.randint(0, K + 2, (B,), generator=g)
    return _step(probs, tokens, undecided, num_commit, seed)


@pytest.mark.parametrize("seed", range(4))
def test_select_top_matches_per_row_reference(seed):
    step = _random_step(seed=seed)
    score = step.probs.gather(-1, step.tokens.unsqueeze(-1)).squeeze(-1)
    fast = select_top(score, step.undecided, step.num_commit)
    assert torch.equal(fast, _slow_select_top(score, step.undecided, step.num_commit))
    assert not (fast & ~step.undecided).any()
    assert torch.equal(fast.sum(-1), torch.minimum(step.num_commit, step.undecided.sum(-1)))


@pytest.mark.parametrize("policy,confidence", [
    (LowConfidence(), lambda p, z: p.gather(-1, z.unsqueeze(-1)).squeeze(-1)),
    (TopKMargin(), lambda p, z: p.sort(-1, descending=True).values[..., :2].diff(dim=-1).neg().squeeze(-1)),
    (TopKEntropy(), lambda p, z: (p * torch.where(p > 0, p.log(), 0.0)).sum(-1)),
])
def test_mask_policies_commit_the_most_confident(policy, confidence):
    for seed in range(3):
        step = _random_step(seed=seed)
        expected = _slow_select_top(confidence(step.probs, step.tokens), step.undecided, step.num_commit)
        assert torch.equal(policy.select(step), expected)


def test_random_order_is_a_uniform_order_from_the_step_generator():
    step = _random_step(seed=1)
    u = torch.rand((5, 9), generator=torch.Generator().manual_seed(1))  # the policy's one draw
    assert torch.equal(RandomOrder().select(step), _slow_select_top(u, step.undecided, step.num_commit))
    # per-row generators: row b draws (1, K) from its own generator
    gens = tuple(torch.Generator().manual_seed(10 + b) for b in range(5))
    per_row = PolicyStep(step.probs, step.tokens, step.undecided, step.num_commit, RowRandomness(gens, None, 5))
    u_rows = torch.cat([torch.rand((1, 9), generator=torch.Generator().manual_seed(10 + b)) for b in range(5)])
    assert torch.equal(RandomOrder().select(per_row), _slow_select_top(u_rows, step.undecided, step.num_commit))


def test_confidence_threshold_commits_exactly_the_positions_at_or_above_it():
    V = 4
    probs = torch.zeros(1, 6, V)
    conf = torch.tensor([0.49, 0.5, 0.51, 0.9, 0.3, 0.95])
    probs[0, :, 1] = conf
    probs[0, :, 2] = 1 - conf
    tokens = torch.ones(1, 6, dtype=torch.long)  # the drawn token: its probability is conf
    undecided = torch.tensor([[True, True, True, True, True, False]])  # 0.95 already decided
    one = torch.ones(1, dtype=torch.long)
    commit = ConfidenceThreshold(0.5).select(_step(probs, tokens, undecided, one))
    assert commit.tolist() == [[False, True, True, True, False, False]]
    # no position reaches the threshold: the most confident undecided one only
    assert ConfidenceThreshold(1.0).select(_step(probs, tokens, undecided, one)).tolist() == [
        [False, False, False, True, False, False]]
    # threshold 0: every undecided position
    assert torch.equal(ConfidenceThreshold(0.0).select(_step(probs, tokens, undecided, one)), undecided)
    # num_commit is a floor: at least the 3 most confident
    three = torch.full((1,), 3)
    assert ConfidenceThreshold(1.0).select(_step(probs, tokens, undecided, three)).tolist() == [
        [False, True, True, True, False, False]]


def test_entropy_bound_accepts_lowest_entropies_within_the_bound():
    H = torch.tensor([[0.5, 0.125, 0.25, 2.0, 0.0625]])  # exact in binary: sums are exact
    eligible = torch.tensor([[True, True, True, True, False]])  # 0.0625 is a prompt position
    # sorted eligible: 0.125, 0.25, 0.5, 2.0; the sums before each (the sum minus its largest term): 0, 0.125,
    # 0.375, 0.875
    cases = {0.0: [1], 0.125: [1, 2], 0.37: [1, 2], 0.375: [0, 1, 2], 0.87: [0, 1, 2], 0.875: [0, 1, 2, 3],
             math.inf: [0, 1, 2, 3]}
    for bound, accepted in cases.items():
        got = EntropyBound(bound).accept(H, eligible)
        assert got[0].nonzero().flatten().tolist() == accepted, bound


def test_entropy_bound_accept_matches_per_row_reference():
    g = torch.Generator().manual_seed(0)
    H = torch.rand(6, 11, generator=g) * 2
    eligible = torch.rand(6, 11, generator=g) < 0.8
    for bound in (0.0, 0.3, 1.0, 4.0):
        fast = EntropyBound(bound).accept(H, eligible)
        for b in range(6):
            order = sorted((j for j in range(11) if eligible[b, j]), key=lambda j: float(H[b, j]))
            total, expected = 0.0, set()
            for j in order:
                if total <= bound or not expected:
                    expected.add(j)
                total += float(H[b, j])
                if total > bound:
                    break
            assert set(fast[b].nonzero().flatten().tolist()) == expected


def test_categorical_entropy_is_torch_distributions_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 8, 50, generator=g) * 5
    logits[0, 0, :10] = -torch.inf
    expected = torch.distributions.Categorical(logits=logits).entropy()
    assert torch.equal(categorical_entropy(logits), expected)


def test_exponential_draw_is_torch_multinomial():
    """EntropyBound draws argmax(p / q), q ~ Exp(1) of the probabilities' shape: what torch.multinomial(p, 1)
    does, from the same generator state (so a global-RNG run follows DiffusionGemma's draws)."""
    for seed in range(3):
        p = torch.softmax(torch.randn(6 * 5, 37, generator=torch.Generator().manual_seed(seed)) * 3, -1)
        ref = torch.multinomial(p, 1, generator=torch.Generator().manual_seed(seed)).view(6, 5)
        q = RowRandomness(torch.Generator().manual_seed(seed), None, 6).exponential((5, 37), p.device)
        assert torch.equal((p.view(6, 5, 37) / q).argmax(-1), ref)


def test_temperature_schedule_is_the_references_arithmetic():
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        LinearTemperatureScheduleLogitsProcessor,
    )

    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(0))
    ref = LinearTemperatureScheduleLogitsProcessor(t_min=0.4, t_max=0.8, max_denoising_steps=7)
    policy = EntropyBound(0.1, t_max=0.8, t_min=0.4)
    for step in range(7):
        cur = torch.tensor(7 - step, dtype=torch.int32)
        assert torch.equal(logits / policy.temperature_at(step, 7, logits.device), ref(None, logits, cur_step=cur))
    assert float(policy.temperature_at(0, 7, logits.device)) == pytest.approx(0.8)
    assert float(policy.temperature_at(6, 7, logits.device)) == pytest.approx(0.4 + 0.4 / 7)


def test_entropy_bound_stops_when_stable_and_confident():
    policy = EntropyBound(0.1, stability_threshold=2, confidence_threshold=0.5)
    eligible = torch.ones(2, 3, dtype=torch.bool)
    history = policy.initial_history(2, 3, torch.device("cpu"))
    a = torch.tensor([[1, 2, 3], [4, 5, 6]])
    low, high = torch.full((2, 3), 0.1), torch.full((2, 3), 0.9)
    stop, history = policy.stop(history, a, low, eligible)
    assert stop.tolist() == [False, False]  # no history yet
    stop, history = policy.stop(history, a, low, eligible)
    assert stop.tolist() == [False, False]  # stable for one step only
    stop, history = policy.stop(history, a, torch.stack([low[0], high[1]]), eligible)
    assert stop.tolist() == [True, False]  # stable for two steps; row 1 not confident
    b = a.clone()
    b[0, 0] = 9
    stop, _ = policy.stop(history, b, low, eligible)
    assert stop.tolist() == [False, True]
    never = EntropyBound(0.1, confidence_threshold=None)
    assert not never.stop(never.initial_history(2, 3, a.device), a, low * 0, eligible)[0].any()
    always = EntropyBound(0.1, stability_threshold=0, confidence_threshold=0.5)
    assert always.stop(always.initial_history(2, 3, a.device), a, low, eligible)[0].all()


def test_entropy_bound_step_accepts_draws_and_renoises_the_rest():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, 20, generator=g) * 4
    canvas = torch.randint(0, 20, (3, 6), generator=g)
    eligible = torch.ones(3, 6, dtype=torch.bool)
    eligible[2, :2] = False  # prompt positions inside the block
    policy = EntropyBound(1.0)
    out = entropy_bound_step(policy, logits, canvas, eligible, policy.initial_history(3, 6, logits.device),
                             RowRandomness(torch.Generator().manual_seed(1), None, 3), step=0, num_steps=4)
    # the draws, by hand: Exp(1) over (B, K, V), then randint (B, K)
    g1 = torch.Generator().manual_seed(1)
    scaled = logits / policy.temperature_at(0, 4, logits.device)
    q = torch.empty(3, 6, 20).exponential_(1, generator=g1)
    draw = (torch.softmax(scaled, -1) / q).argmax(-1)
    noise = torch.randint(0, 20, (3, 6), generator=g1)
    accepted = policy.accept(categorical_entropy(scaled), eligible)
    assert torch.equal(out.accepted, accepted) and accepted.any(-1).all()
    assert torch.equal(out.canvas, torch.where(eligible, torch.where(accepted, draw, noise), canvas))
    assert torch.equal(out.argmax, scaled.argmax(-1))
    assert torch.equal(out.logits, scaled)


@pytest.mark.parametrize("make,match", [
    (lambda: ConfidenceThreshold(1.5), "threshold"),
    (lambda: ConfidenceThreshold(-0.1), "threshold"),
    (lambda: ConfidenceThreshold(float("nan")), "threshold"),
    (lambda: EntropyBound(-1.0), "bound"),
    (lambda: EntropyBound(float("nan")), "bound"),
    (lambda: EntropyBound(0.1, t_max=0.0), "t_max"),
    (lambda: EntropyBound(0.1, t_min=0.9, t_max=0.8), "t_min"),
    (lambda: EntropyBound(0.1, stability_threshold=-1), "stability_threshold"),
    (lambda: EntropyBound(0.1, confidence_threshold=0.0), "confidence_threshold"),
])
def test_thresholds_outside_their_range_are_value_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("make,match", [
    (lambda: ConfidenceThreshold("0.5"), "threshold"),
    (lambda: EntropyBound(True), "bound"),
    (lambda: EntropyBound(0.1, stability_threshold=1.0), "stability_threshold"),
])
def test_threshold_types_are_type_errors(make, match):
    with pytest.raises(TypeError, match=match):
        make()


def test_policies_check_their_kernel():
    mask_kernel, uniform_kernel = uf.MaskKernel(8, 7), uf.UniformKernel(8)
    for policy in (RandomOrder(), LowConfidence(), TopKMargin(), TopKEntropy(), ConfidenceThreshold(0.9)):
        policy.check_kernel(mask_kernel)
        with pytest.raises(ValueError, match="policy: .* needs a mask kernel"):
            policy.check_kernel(uniform_kernel)
        with pytest.raises(ValueError, match="policy"):
            policy.check_kernel(uf.HybridKernel(8, 7, p_uniform=0.2))
    EntropyBound(0.1).check_kernel(uniform_kernel)
    for kernel in (mask_kernel, uf.HybridKernel(8, 7, p_uniform=0.2)):
        with pytest.raises(ValueError, match="policy: EntropyBound .* needs a uniform kernel"):
            EntropyBound(0.1).check_kernel(kernel)


def test_policies_make_no_host_syncs():
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from _dispatch_count import DispatchCounter

    from unifusion.samplers.policies.mask import mask_step

    step = _random_step(seed=0)
    logits = torch.randn(5, 9, 8)
    undecided = step.undecided
    for policy in (RandomOrder(), LowConfidence(), TopKMargin(), TopKEntropy(), ConfidenceThreshold(0.5)):
        for randomness in (step.randomness, RowRandomness(tuple(torch.Generator() for _ in range(5)), None, 5)):
            with DispatchCounter() as c:
                mask_step(policy, logits, undecided, step.num_commit, randomness, mask_id=7, temperature=0.8,
                          top_k=5, top_p=0.9)
            assert c.syncs == 0, (policy, c.sync_ops)
    policy = EntropyBound(0.5)
    with DispatchCounter() as c:
        entropy_bound_step(policy, logits, torch.zeros(5, 9, dtype=torch.long), undecided,
                           policy.initial_history(5, 9, logits.device), step.randomness, step=1, num_steps=3,
                           top_p=0.9)
    assert c.syncs == 0, c.sync_ops


def test_even_split_is_llada_get_num_transfer_tokens_recomputed_from_the_live_count():
    from unifusion.samplers.policies import EvenSplit

    left, counts = torch.tensor([10, 3, 0]), []
    for i in range(4):
        n = EvenSplit().counts(left, i, 4)
        counts.append(n.tolist())
        left = left - n
    assert counts == [[3, 1, 0], [3, 1, 0], [2, 1, 0], [2, 0, 0]] and left.tolist() == [0, 0, 0]


def test_time_grid_is_dreams_count_on_its_float32_grid():
    from unifusion.samplers.policies import TimeGrid

    # Dream: t = linspace(1, 1e-3, 3) = [1, 0.5005, 0.001]; step 0 commits int(8 (1 - 0.5005)) = 3, the last all
    assert TimeGrid().counts(torch.tensor([8, 7]), 0, 2).tolist() == [3, 3]
    assert TimeGrid().counts(torch.tensor([5, 4]), 1, 2).tolist() == [5, 4]
    early = TimeGrid(eps=0.5).counts(torch.tensor([8]), 0, 64)  # 1 − t_1/t_0 < 1/8: nothing yet
    assert early.tolist() == [0]
    assert TimeGrid() == TimeGrid(1e-3) and TimeGrid() != TimeGrid(0.01)
    for bad in (0.0, 1.0, math.nan):
        with pytest.raises(ValueError, match="eps: expected a float in \\(0, 1\\)"):
            TimeGrid(bad)


def test_a_schedule_is_a_policy_option_and_time_grid_lifts_the_step_bound():
    from unifusion.samplers.policies import TimeGrid

    policy = TopKMargin(schedule=TimeGrid())
    assert repr(policy) == "TopKMargin(schedule=TimeGrid(eps=0.001))" and repr(TopKMargin()) == "TopKMargin()"
    assert policy.max_steps(4) is None and TopKMargin().max_steps(4) == 4 and ConfidenceThreshold(0.5).max_steps(4) \
        is None
    with pytest.raises(TypeError, match="schedule: expected a TransferSchedule"):
        LowConfidence(schedule="dream")
    kernel = uf.MaskKernel(8, 7)
    model = lambda x, t: torch.randn(*x.shape, 8)  # noqa: E731
    uf.samplers.PolicySampler(model, kernel, policy, num_steps=12, block_size=4)  # 12 steps for 4 positions
    with pytest.raises(ValueError, match="num_steps: TopKMargin commits a fixed count per step"):
        uf.samplers.PolicySampler(model, kernel, TopKMargin(), num_steps=12, block_size=4)


def test_reference_policies_refuse_bad_options_naming_them():
    from unifusion.samplers.policies import DreamOrder, LLaDAOrder, SDAROrder

    with pytest.raises(ValueError, match="remasking: expected one of"):
        LLaDAOrder("top_k")
    with pytest.raises(ValueError, match="alg: expected one of"):
        DreamOrder("greedy")
    with pytest.raises(ValueError, match="alg_temp: expected None or a finite float >= 0"):
        DreamOrder(alg_temp=-1.0)
    with pytest.raises(ValueError, match="strategy: expected one of"):
        SDAROrder("entropy_bounded")
    with pytest.raises(ValueError, match="eps"):
        DreamOrder(eps=2.0)


def test_reference_policies_by_name():
    from unifusion.samplers.policies import POLICY_NAMES, DreamOrder, LLaDAOrder, SDAROrder, make_policy

    assert repr(make_policy("llada_random")) == repr(LLaDAOrder("random"))
    assert repr(make_policy("dream_topk_margin")) == repr(DreamOrder("topk_margin"))
    assert repr(make_policy("sdar", threshold=0.3)) == repr(SDAROrder("low_confidence_dynamic", 0.3))
    assert repr(make_policy("sdar_sequential")) == repr(SDAROrder("sequential"))
    assert {"llada", "dream_origin", "sdar_static"} <= set(POLICY_NAMES)
    assert repr(make_policy("fast_dllm_v2", threshold=0.7)) == "FastDLLMv2Order(threshold=0.7, small_block_size=8)"
    with pytest.raises(ValueError, match="threshold: only the threshold, sdar and fast_dllm_v2 policies take one"):
        make_policy("llada", threshold=0.5)


def test_rounded_split_is_dllms_mdlm_schedule_and_skips_empty_steps():
    from unifusion.samplers.policies import LLaDAOrder, RoundedSplit

    # the nonzero counts of dllm's get_num_transfer_tokens(LinearAlphaScheduler()) (ca17675), run on these inputs
    theirs = {(5, 2): [2, 3], (4, 8): [1, 1, 1, 1], (7, 3): [2, 2, 3], (13, 5): [3, 2, 3, 2, 3], (5, 3): [2, 1, 2],
              (31, 8): [4, 4, 4, 4, 4, 4, 4, 3]}
    for (n, N), expected in theirs.items():
        left, counts = torch.tensor([n]), []
        for i in range(N):
            c = RoundedSplit().counts(left, i, N)
            counts.append(int(c))
            left = left - c
        assert [c for c in counts if c] == expected and int(left) == 0, (n, N)
    kernel = uf.MaskKernel(8, 7)
    model = lambda x, t: torch.randn(*x.shape, 8)  # noqa: E731
    sampler = uf.samplers.PolicySampler(model, kernel, LLaDAOrder(schedule=RoundedSplit()), num_steps=8,
                                        block_size=4)
    out = sampler.sample(2, 6, prompt=torch.tensor([3, 4, -1, -1, -1, -1]), return_dict=True)
    assert out.num_forwards.tolist() == [4, 4]  # 4 positions over 8 steps: 4 steps commit, 4 are skipped
    assert repr(LLaDAOrder(schedule=RoundedSplit())) == "LLaDAOrder(remasking='low_confidence', " \
        "schedule=RoundedSplit())"

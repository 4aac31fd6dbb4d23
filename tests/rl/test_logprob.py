"""sequence_logprob against exact enumeration on tiny random models (completions of 5–7 tokens).

Each unbiased estimator is run on R copies of one row with one generator per copy: R independent estimates in one
call (rows draw independently), whose mean must lie within 4 standard errors of the exact value.
"""

from __future__ import annotations

import math

import pytest
import torch

import unifusion as uf
from unifusion.rl import sequence_logprob
from unifusion.rl.estimators import combine_logps, gauss_legendre, plan_masks

from ._exact import (
    MASK,
    adapted,
    decoder_block_log_probs,
    exact_elbo,
    exact_log_likelihood,
    exact_mean_field,
    generators,
    mean_and_se,
    sharpened,
    subset_log_probs,
    tiny_diffusion_gemma,
    truncated_elbo,
)

L, P = 8, 3  # 3 prompt tokens, 5 completion tokens
POS = list(range(P, L))
R = 300


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = adapted()
    x0 = torch.randint(4, 128, (L,), generator=torch.Generator().manual_seed(1))
    lp = subset_log_probs(model, x0, POS)
    comp = torch.zeros(R, L, dtype=torch.bool)
    comp[:, P:] = True
    return model, x0, lp, comp


def _run(model, x0, comp, estimator, K, seed=0, **opts):
    with torch.no_grad():
        return sequence_logprob(model, x0.repeat(comp.shape[0], 1), comp, estimator=estimator, num_samples=K,
                                generator=generators(comp.shape[0], seed), **opts)


@pytest.mark.parametrize("estimator, K, opts", [
    ("elbo", 2, {}), ("elbo_discrete", 1, {}), ("elbo_discrete", 3, {}), ("coupled", 1, {}),
    ("quadrature", 3, {"masks": "bernoulli"})])
def test_unbiased_estimators_match_the_exact_elbo(setup, estimator, K, opts):
    model, x0, lp, comp = setup
    elbo = exact_elbo(lp, POS)
    out = _run(model, x0, comp, estimator, K, **opts)
    mu, se = mean_and_se(out.sequence)
    assert abs(mu - elbo) < 4 * se + 1e-4, (estimator, mu, se, elbo)
    assert torch.allclose(out.per_token.sum(-1), out.sequence) and (out.per_token[:, :P] == 0).all()


def test_the_oracles_elbo_is_below_their_log_likelihood():
    """A check of the oracles in _exact.py (which the library checks here lean on), not of the library."""
    for seed in range(3):
        model = adapted(seed=seed)
        x0 = torch.randint(4, 128, (L,), generator=torch.Generator().manual_seed(seed))
        lp = subset_log_probs(model, x0, POS)
        assert exact_elbo(lp, POS) <= exact_log_likelihood(lp, POS) + 1e-9


def test_mean_field_without_prompt_masking_is_the_fully_masked_factorisation(setup):
    model, x0, lp, comp = setup
    out = _run(model, x0, comp[:2], "mean_field", 1, prompt_mask_prob=0.0)
    assert torch.allclose(out.sequence.double(), torch.full((2,), exact_mean_field(lp, POS), dtype=torch.float64),
                          atol=1e-4)
    masked = _run(model, x0, comp[:40], "mean_field", 1, prompt_mask_prob=0.5)
    assert masked.sequence.std() > 0  # the prompt corruption moves the estimate


def _quadrature_expectation(lp, K, masks):
    """The exact expectation of the quadrature estimate: Σ_j w_j / t_j · E_M[Σ_{i∈M} log p]."""
    n = len(POS)
    nodes, weights = gauss_legendre(K)
    total = 0.0
    for t, w in zip(nodes, weights):
        if masks == "bernoulli":
            inner = sum(t ** len(M) * (1 - t) ** (n - len(M)) * float(v[sorted(M)].sum()) for M, v in lp.items())
        else:
            size = min(n, max(1, round(n * t)))
            subsets = [M for M in lp if len(M) == size]
            inner = sum(float(lp[M][sorted(M)].sum()) for M in subsets) / len(subsets)
        total += w / t * inner
    return total


def test_quadrature_is_exact_with_bernoulli_masks_and_k_at_least_n_over_2(setup):
    model, x0, lp, comp = setup
    elbo = exact_elbo(lp, POS)
    assert abs(_quadrature_expectation(lp, 3, "bernoulli") - elbo) < 1e-9  # K = 3 >= n / 2
    assert abs(_quadrature_expectation(lp, 2, "bernoulli") - elbo) > 1e-6  # K = 2 < n / 2: a quadrature error
    for K in (1, 2):  # GDPO's exact counts: the MC mean is the estimator's own expectation, biased by the rounding
        expected = _quadrature_expectation(lp, K, "exact_count")
        mu, se = mean_and_se(_run(model, x0, comp, "quadrature", K).sequence)
        assert abs(mu - expected) < 4 * se + 1e-4
        nodes, weights = gauss_legendre(K)
        rho = sum(w * min(5, max(1, round(5 * t))) / (5 * t) for t, w in zip(nodes, weights))
        assert abs(expected / elbo - rho) < 0.05  # the stated error: the count/time mismatch factor


def _exact_eubo(lp, beta):
    """Σ_i (1/β) log E_{l ~ U{1..n}, M ∋ i, |M| = l}[p(x_i | x_¬M)^β]."""
    n = len(POS)
    total = 0.0
    for i in POS:
        acc = 0.0
        for size in range(1, n + 1):
            subsets = [M for M in lp if len(M) == size and i in M]
            acc += sum(math.exp(beta * float(lp[M][i])) for M in subsets) / len(subsets) / n
        total += math.log(acc) / beta
    return total


@pytest.mark.parametrize("eubo_beta", [1.0, 1.5, 2.0])
def test_the_eubo_is_above_the_exact_log_likelihood(setup, eubo_beta):
    model, x0, lp, comp = setup
    assert _exact_eubo(lp, eubo_beta) >= exact_log_likelihood(lp, POS)
    # the Monte-Carlo estimate is a log of a mean: it approaches the bound from below as K grows
    mu, _ = mean_and_se(_run(model, x0, comp[:60], "eubo", 32, eubo_beta=eubo_beta).sequence)
    assert abs(mu - _exact_eubo(lp, eubo_beta)) < 0.3


def test_fused_scores_equal_the_materialised_log_probs(setup):
    model, x0, lp, comp = setup
    B = 4
    for estimator in ("coupled", "eubo", "mean_field"):
        opts = {"prompt_mask_prob": 0.0} if estimator == "mean_field" else {}  # the enumeration keeps c clean
        out = _run(model, x0, comp[:B], estimator, 2, seed=3, **opts)
        plan = plan_masks(estimator, comp[:B], num_samples=2, generator=generators(B, 3), **opts)
        log_probs = torch.stack([torch.stack([lp[frozenset(torch.nonzero(plan.noised[k, b]).flatten().tolist())]
                                              for b in range(B)]) for k in range(plan.num_passes)])
        assert torch.allclose(out.per_token.double(), combine_logps(plan, log_probs), atol=1e-4)


def test_gradients_flow_and_old_policies_score_without():
    model = adapted()
    x0 = torch.randint(4, 128, (2, L), generator=torch.Generator().manual_seed(2))
    comp = torch.zeros(2, L, dtype=torch.bool)
    comp[:, P:] = True
    for estimator in ("elbo", "coupled", "eubo"):
        model.zero_grad()
        out = sequence_logprob(model, x0, comp, estimator=estimator, generator=torch.Generator().manual_seed(0))
        (out.sequence * torch.tensor([1.0, -2.0])).sum().backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("noise", ["uniform", "hybrid"])
def test_uniform_and_hybrid_kernel_elbo_agrees_with_nll_bound(noise):
    if noise == "uniform":
        model = uf.adapt_ar_model(adapted().hf_model, add_mask_token=False)
        kernel: uf.Kernel = uf.UniformKernel(model.num_states)
    else:  # GIDD's hybrid: mask and uniform noise
        model = adapted()
        kernel = uf.HybridKernel(model.num_states, MASK, p_uniform=0.2)
    x0 = torch.randint(4, 128, (L,), generator=torch.Generator().manual_seed(4))
    comp = torch.zeros(R, L, dtype=torch.bool)
    comp[:, P:] = True
    mine = _run(model, x0, comp, "elbo", 2, kernel=kernel).sequence
    bound = uf.eval.nll_bound(model, x0.repeat(R, 1), kernel, num_times=2, per_token=False, prompt_mask=~comp,
                              generator=torch.Generator().manual_seed(9))  # R independent estimates of −ELBO
    (m1, s1), (m2, s2) = mean_and_se(mine), mean_and_se(-bound)
    assert abs(m1 - m2) < 4 * math.hypot(s1, s2)


# A block model (K = 4) whose prompt length is not a multiple of K: the decoder's blocks are [6, 10), [10, 14);
# blocks at column multiples of K would be [6, 8), [8, 12), [12, 14). Times in [t_min, 1] (the "elbo" estimator's
# t_min) keep the 1/t weights small, so that a few hundred draws tell the two partitions apart.
KB, PB, NB, RB = 4, 6, 8, 200


@pytest.fixture(scope="module")
def block_setup():
    model = sharpened(block_size=KB)
    x0 = torch.randint(4, 128, (PB + NB,), generator=torch.Generator().manual_seed(5))
    return model, x0


@pytest.mark.parametrize("t_min", [0.8])
def test_block_elbo_is_the_exact_elbo_of_the_blocks_the_decoder_samples(block_setup, t_min):
    """(b) of issue 43: the estimate's mean is the block ELBO enumerated with the decoder's own forward on the
    decoder's blocks, and far (> 8 SE) from the ELBO of blocks cut at column multiples of K."""
    model, x0 = block_setup
    decoder = sum(truncated_elbo(decoder_block_log_probs(model, x0, lo, hi), list(range(lo, hi)), t_min)
                  for lo, hi in ((6, 10), (10, 14)))
    columns = sum(truncated_elbo(subset_log_probs(model, x0, list(range(lo, hi)), clean=True), list(range(lo, hi)),
                                 t_min) for lo, hi in ((6, 8), (8, 12), (12, 14)))
    comp = torch.zeros(RB, PB + NB, dtype=torch.bool)
    comp[:, PB:] = True
    mu, se = mean_and_se(_run(model, x0, comp, "elbo", 4, t_min=t_min).sequence)
    assert abs(mu - decoder) < 4 * se, (mu, se, decoder)
    assert abs(columns - decoder) > 8 * se, (columns, decoder, se)  # the test tells the partitions apart
    with pytest.raises(ValueError, match="estimator"):
        _run(model, x0, comp[:1], "coupled", 1)


def test_block_elbo_does_not_depend_on_the_rows_alignment(block_setup):
    """(a) of issue 43, "elbo": the same prompt and completion left-aligned (P = 6, P mod K = 2) and left-padded to a
    block boundary (2 pads), each with its own seeds: equal expectations (4 SE)."""
    model, x0 = block_setup
    L = PB + NB
    aligned = torch.zeros(RB, L, dtype=torch.bool)
    aligned[:, PB:] = True
    padded_ids = torch.cat([torch.zeros(RB, 2, dtype=torch.long), x0.repeat(RB, 1)], 1)
    padded = torch.cat([torch.zeros(RB, 2, dtype=torch.bool), aligned], 1)
    attention = torch.cat([torch.zeros(RB, 2), torch.ones(RB, L)], 1).long()
    with torch.no_grad():
        left = sequence_logprob(model, x0.repeat(RB, 1), aligned, num_samples=4, t_min=0.8,
                                generator=generators(RB, 1)).sequence
        pads = sequence_logprob(model, padded_ids, padded, num_samples=4, t_min=0.8, generator=generators(RB, 2),
                                attention_mask=attention).sequence
    (m1, s1), (m2, s2) = mean_and_se(left), mean_and_se(pads)
    assert abs(m1 - m2) < 4 * math.hypot(s1, s2), (m1, s1, m2, s2)


def test_trace_replay_does_not_depend_on_the_rows_alignment(block_setup):
    """(a) of issue 43, "trace" (deterministic): a rollout of the block model (P = 6) replayed in generate's layout
    and left-padded to a block boundary gives the same log-probs, which are the ones the sampler committed with."""
    model, x0 = block_setup
    with torch.no_grad():
        out = model.generate(x0[None, :PB], max_new_tokens=NB, policy=uf.samplers.policies.LowConfidence(),
                             num_steps=KB, return_trace=True, generator=torch.Generator().manual_seed(3),
                             eos_token_id=None)
    ids, trace = out.sequences, out.commit_step
    comp = trace >= 0
    pad = torch.zeros(1, 2, dtype=torch.long)
    with torch.no_grad():
        left = sequence_logprob(model, ids, comp, estimator="trace", trace=trace)
        pads = sequence_logprob(model, torch.cat([pad, ids], 1), torch.cat([pad.bool(), comp], 1),
                                estimator="trace", trace=torch.cat([pad - 1, trace], 1),
                                attention_mask=torch.cat([pad, torch.ones_like(ids)], 1))
    torch.testing.assert_close(pads.per_token[:, 2:], left.per_token, rtol=0, atol=1e-5)
    torch.testing.assert_close(left.sequence, out.commit_logprob.sum(-1), rtol=0, atol=1e-4)


def test_diffusion_gemma_elbo_agrees_with_nll_bound():
    model = tiny_diffusion_gemma(canvas_length=4)
    Ld, Pd, Rd = 9, 3, 120
    x0 = torch.randint(3, 125, (Ld,), generator=torch.Generator().manual_seed(6)).repeat(Rd, 1)
    comp = torch.zeros(Rd, Ld, dtype=torch.bool)
    comp[:, Pd:] = True
    mine = _run(model, x0[0], comp, "elbo", 1).sequence
    with torch.no_grad():
        bound = uf.eval.nll_bound(model.conditioned_on(x0, prompt_mask=~comp), x0, model.kernel, num_times=1,
                                  per_token=False, prompt_mask=~comp, generator=torch.Generator().manual_seed(9))
    (m1, s1), (m2, s2) = mean_and_se(mine), mean_and_se(-bound)
    assert abs(m1 - m2) < 4 * math.hypot(s1, s2)
    with pytest.raises(ValueError, match="completion_mask"):  # a row without a prompt token
        sequence_logprob(model, x0[:1], torch.ones(1, Ld, dtype=torch.bool))


def test_shared_masks_lower_the_variance_of_a_difference_of_two_policies(setup, capsys):
    """What a ratio uses: log π_new − log π_old, at equal forwards, with shared vs independent randomness."""
    model, x0, _, comp = setup
    other = adapted(seed=0)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.003 * torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))
    rows = comp[:150]
    for estimator, K in (("elbo", 2), ("elbo_discrete", 2), ("coupled", 1)):
        a = _run(model, x0, rows, estimator, K, seed=1).sequence
        shared = _run(other, x0, rows, estimator, K, seed=1).sequence - a
        independent = _run(other, x0, rows, estimator, K, seed=2).sequence - a
        print(f"{estimator}: var shared {float(shared.var()):.4g}, independent {float(independent.var()):.4g}")
        assert shared.var() < independent.var() / 4
    # coupled pairs against independent masks at the same forward count (2 forwards each)
    pair = _run(other, x0, rows, "coupled", 1, seed=1).sequence - _run(model, x0, rows, "coupled", 1, seed=1).sequence
    indep = _run(other, x0, rows, "elbo_discrete", 2, seed=1).sequence - \
        _run(model, x0, rows, "elbo_discrete", 2, seed=2).sequence
    print(f"coupled shared {float(pair.var()):.4g} vs elbo_discrete independent {float(indep.var()):.4g}")
    assert pair.var() < indep.var()


def test_bad_input_names_the_argument(setup):
    model, x0, _, comp = setup
    ids = x0.repeat(2, 1)
    c = comp[:2].clone()
    with pytest.raises(ValueError, match="num_samples"):
        sequence_logprob(model, ids, c, num_samples=0)
    empty = c.clone()
    empty[1] = False
    with pytest.raises(ValueError, match="completion_mask"):
        sequence_logprob(model, ids, empty)
    uniform = uf.UniformKernel(model.num_states)
    for estimator in ("elbo_discrete", "mean_field"):
        with pytest.raises(ValueError, match="estimator"):
            sequence_logprob(model, ids, c, estimator=estimator, kernel=uniform)
    with pytest.raises(ValueError, match="estimator"):
        sequence_logprob(model, ids, c, estimator="iwae")
    with pytest.raises(TypeError, match="eubo_beta"):
        sequence_logprob(model, ids, c, estimator="coupled", eubo_beta=1.0)
    pad = torch.ones_like(ids)
    pad[:, -1] = 0
    with pytest.raises(ValueError, match="completion_mask"):
        sequence_logprob(model, ids, c, attention_mask=pad)


def test_holes_in_the_attention_mask_and_mask_tokens_in_the_input_are_refused(setup):
    """Checked as diffusion_loss and generate check them: a right-padded prompt followed by its completion (a pad
    between real tokens) and the mask id at a real position are ValueErrors naming the argument; padding on both
    sides of one run of real tokens is what a batch of rollouts has, and scores as the row alone."""
    model, x0, _, comp = setup
    ids, c = x0.repeat(2, 1), comp[:2].clone()
    holes = torch.ones_like(ids)
    holes[0, 1] = 0  # inside the prompt, before the completion
    with pytest.raises(ValueError, match="attention_mask: expected each row's real tokens in one run"):
        sequence_logprob(model, ids, c, attention_mask=holes)
    masked = ids.clone()
    masked[1, P + 1] = MASK
    with pytest.raises(ValueError, match=rf"input_ids: the mask token \(id {MASK}\) at real positions of rows \[1\]"):
        sequence_logprob(model, masked, c)
    both = torch.zeros(1, L + 3, dtype=torch.long)
    both[0, 1:L + 1] = 1  # one pad on the left, two on the right
    row = torch.cat([torch.zeros(1, 1, dtype=torch.long), x0[None], torch.zeros(1, 2, dtype=torch.long)], 1)
    scored = torch.cat([torch.zeros(1, 1, dtype=torch.bool), comp[:1], torch.zeros(1, 2, dtype=torch.bool)], 1)
    with torch.no_grad():
        padded = sequence_logprob(model, row, scored, attention_mask=both, estimator="mean_field",
                                  prompt_mask_prob=0.0).sequence
        alone = sequence_logprob(model, x0[None], comp[:1], estimator="mean_field", prompt_mask_prob=0.0).sequence
    torch.testing.assert_close(padded, alone, rtol=0, atol=1e-4)


def test_under_bf16_autocast_the_head_and_the_sums_stay_float32():
    """What the estimators add to a bf16 backbone's rounding: nothing. Their fused head (logits, log-softmax, the
    1/t-weighted sums) computes from the float32 hidden states in float32 under bf16 autocast, bit for bit as without
    it; the remaining |bf16 − fp32| of a bf16 run is the backbone's (docs/guides/rl.md, "bf16")."""
    torch.manual_seed(0)
    h = torch.randn(2, 6, 32)
    weight = torch.randn(128, 32)
    x0 = torch.randint(4, 120, (2, 6))
    x_t = torch.where(torch.rand(2, 6) < 0.5, torch.full_like(x0, MASK), x0)
    kernel = uf.MaskKernel(128, MASK)
    plain = uf.losses.fused_linear_diffusion_loss(h, weight, x0, x_t, torch.tensor([0.3, 0.8]), kernel,
                                                   objective="gidd")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = uf.losses.fused_linear_diffusion_loss(h, weight, x0, x_t, torch.tensor([0.3, 0.8]), kernel,
                                                       objective="gidd")
    assert mixed.dtype == torch.float32
    torch.testing.assert_close(mixed, plain, rtol=0, atol=0)


class ToyKind(uf.denoiser.DenoiserModule):
    """A model kind defined outside the package (no registration, no DiffusionLM): an embedding plus the mean of the
    row's real tokens as its hidden state, a linear head, the fused loss on request."""

    mask_token_id = MASK

    def __init__(self, S: int = 32, d: int = 8) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Parameter(torch.randn(S, d, generator=g))
        self.head = torch.nn.Parameter(torch.randn(S, d, generator=g))

    @property
    def num_states(self) -> int:
        return int(self.head.shape[0])

    @property
    def device(self) -> torch.device:
        return self.head.device

    def _hidden(self, x_t, attention_mask):
        real = torch.ones_like(x_t, dtype=torch.float32) if attention_mask is None else attention_mask.float()
        e = self.emb[x_t]
        context = (e * real[..., None]).sum(1, keepdim=True) / real.sum(1, keepdim=True)[..., None]
        return torch.tanh(e + context)

    def forward(self, x_t, t=None, *, x0=None, kernel=None, objective="gidd", position_weight=None,
                attention_mask=None, **kwargs):
        h = self._hidden(x_t, attention_mask)
        if x0 is None:
            return self.logits_from_hidden(h)
        return uf.losses.fused_linear_diffusion_loss(h, self.head, x0, x_t, t[:, None].expand(x_t.shape), kernel,
                                                     objective=objective, position_weight=position_weight)

    def logits_from_hidden(self, h):
        return h @ self.head.T

    def generate(self, prompt_ids, *args, **kwargs):
        raise NotImplementedError

    def save_pretrained(self, save_directory, tokenizer=None, *, kernel=None):
        raise NotImplementedError

    @classmethod
    def from_pretrained(cls, directory, *, dtype=None, device=None, load_tokenizer=True):
        raise NotImplementedError


def test_a_model_kind_from_outside_the_package_is_scored():
    """sequence_logprob takes any Denoiser: the mean field of a kind it has never seen equals Σ_i log p(y_i | the
    completion masked) from the kind's own logits; check_estimator applies the kind's rules (a mask kernel here)."""
    model = ToyKind()
    x0 = torch.randint(4, 32, (2, 7), generator=torch.Generator().manual_seed(1))
    comp = torch.zeros(2, 7, dtype=torch.bool)
    comp[:, 3:] = True
    assert isinstance(uf.rl.check_estimator(model, "coupled"), uf.MaskKernel)
    with torch.no_grad():
        got = sequence_logprob(model, x0, comp, estimator="mean_field", prompt_mask_prob=0.0).sequence
        logits = model(torch.where(comp, MASK, x0)).double()
    logits[..., MASK] = -math.inf
    lp = torch.log_softmax(logits, -1).gather(-1, x0[..., None])[..., 0]
    torch.testing.assert_close(got.double(), (lp * comp).sum(-1), rtol=0, atol=1e-4)

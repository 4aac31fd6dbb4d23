"""Tests for unifusion.samplers: Algorithm 2 (BayesianSampler), τ-leaping (EulerSampler) and their pure pieces.

Exactness checks use the fact that for independent positions the rate-optimal x0 head is the data distribution p
itself: a model that ignores its input and returns log p must make Algorithm 2 reproduce p for any number of steps.
"""

from __future__ import annotations

import math

import pytest
import torch

import unifusion as uf
from unifusion.samplers import PARAMETERIZATIONS, PROMPT_FILL, BayesianSampler, EulerSampler, _draws, x0_model_as
from unifusion.samplers._draws import sample_weights, x0_weights
from unifusion.samplers._step import bayesian_step, posterior_mixture
from unifusion.samplers.euler import euler_step_probs

S = 5  # clean states
CHI2_4DF_1E5 = 25.7  # chi-square critical value, 4 degrees of freedom, p = 1e-5 (fixed seeds: deterministic anyway)


def kernels() -> dict[str, uf.Kernel]:
    return {
        "uniform": uf.UniformKernel(S),
        "mask": uf.MaskKernel(S + 1, mask_id=S),
        "hybrid": uf.HybridKernel(S + 1, mask_id=2, p_uniform=0.4),  # mask id inside the vocabulary
    }


def clean_ids(kernel: uf.Kernel) -> torch.Tensor:
    return torch.nonzero(kernel.clean_state_mask).squeeze(-1)


def data_distribution(L: int = 2, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(2.0 * torch.randn(L, S, generator=g, dtype=torch.float64), -1)  # (L, S)


def constant_model(kernel: uf.Kernel, p: torch.Tensor, mask_logit: float = 8.0):
    """A model that ignores its input and returns log p (a large logit on the mask state, which must be ignored)."""
    L = p.shape[0]
    logits = torch.full((L, kernel.num_states), mask_logit, dtype=torch.float32)
    logits[:, clean_ids(kernel)] = p.log().float()

    def model(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return logits.expand(x_t.shape[0], L, kernel.num_states)

    return model


def chi2(counts: torch.Tensor, p: torch.Tensor) -> float:
    n = counts.sum()
    return float(((counts - n * p) ** 2 / (n * p)).sum())


def clean_histogram(x: torch.Tensor, kernel: uf.Kernel) -> torch.Tensor:
    """(L, S) counts of each clean state per position."""
    counts = torch.stack([torch.bincount(x[:, i], minlength=kernel.num_states) for i in range(x.shape[1])])
    return counts[:, clean_ids(kernel)].double()


def random_table_model(V: int, seed: int = 0, time_weight: float = 1.0):
    """A deterministic model with dependence on the neighbours (and on t unless time_weight = 0), float64 logits."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(V, V, generator=g, dtype=torch.float64)
    U = torch.randn(V, V, generator=g, dtype=torch.float64)
    c = torch.randn(V, generator=g, dtype=torch.float64)

    def model(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return W[torch.roll(x_t, 1, 1)] + U[x_t] + time_weight * c * t.double()[:, None, None]

    return model


def pair_denoiser(kernel: uf.Kernel, joint: torch.Tensor):
    """The rate-optimal x0 head for data over pairs (x^1, x^2) ~ joint ``(S, S)`` over clean states.

    Algorithm 2 multiplies x_θ^i by the likelihood q_{t|0}(z_t^i | ·) of the position's own token, so the optimal
    head is the posterior given the *other* positions, x_θ^1 = P(x0^1 | z_t^2) (Theorem 3.5: μ = P(x0^i | z_t)).
    """
    clean = clean_ids(kernel)

    def model(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        B = x_t.shape[0]
        t64 = t.double()
        like = [kernel.transition_into(x_t[:, i], 0.0, t64)[:, clean] for i in range(2)]  # (B, S) each
        logits = torch.full((B, 2, kernel.num_states), -1e4, dtype=torch.float64)
        logits[:, 0, clean] = (like[1] @ joint.T).clamp_min(1e-300).log()  # P(x0^1 | z^2) ∝ Σ_b joint(·, b) q(z^2|b)
        logits[:, 1, clean] = (like[0] @ joint).clamp_min(1e-300).log()
        return logits

    return model


# ----------------------------------------------------------------------------------------------------------------
# pure pieces


@pytest.mark.parametrize("name", ["uniform", "mask", "hybrid"])
def test_posterior_mixture_equals_kernel_posterior_float64(name: str) -> None:
    kernel = kernels()[name]
    V = kernel.num_states
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(3, V, V, generator=g, dtype=torch.float64), -1)
    if kernel.mask_id is not None:
        p[..., kernel.mask_id] = 0.0
        p = p / p.sum(-1, keepdim=True)
    x_t = torch.arange(V).expand(3, V)  # every current state
    for t, s in [(0.999, 0.9), (0.6, 0.55), (0.3, 0.0), (0.05, 0.0)]:
        t_, s_ = torch.tensor(t, dtype=torch.float64), torch.tensor(s, dtype=torch.float64)
        mix = posterior_mixture(kernel, p, x_t, t_, s_)
        ref = kernel.posterior(p, x_t, s, t_)
        torch.testing.assert_close(mix, ref, rtol=1e-11, atol=1e-13)
        if s == 0.0 and kernel.mask_id is not None:
            assert float(mix[..., kernel.mask_id].abs().max()) == 0.0  # s = 0: clean tokens only


def dense_kernel() -> uf.GeneratorKernel:
    R = torch.rand(4, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    R = R - torch.diag(torch.diagonal(R))
    return uf.GeneratorKernel(R - torch.diag(R.sum(-1)), schedule=uf.schedules.LinearSchedule())


@pytest.mark.parametrize("name", ["uniform", "mask", "hybrid", "generator"])
def test_bayesian_step_draws_from_the_posterior(name: str) -> None:
    kernel = dense_kernel() if name == "generator" else kernels()[name]
    V, n = kernel.num_states, 40_000
    g = torch.Generator().manual_seed(2)
    p = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64), -1)
    if kernel.mask_id is not None:
        p[kernel.mask_id] = 0.0
        p = p / p.sum()
    t, s = torch.tensor(0.7, dtype=torch.float64), torch.tensor(0.4, dtype=torch.float64)
    for b in range(V):
        x_t = torch.full((n, 1), b)
        out = bayesian_step(p.expand(n, 1, V).clone(), x_t, kernel, t, s, g)
        freq = torch.bincount(out.flatten(), minlength=V).double() / n
        ref = kernel.posterior(p, torch.tensor(b), 0.4, t)
        assert float((freq - ref).abs().sum()) / 2 < 0.015, (b, freq, ref)
        assert bool((freq[ref == 0] == 0).all())  # impossible states never drawn


@pytest.mark.parametrize("backend", ["compiled", "eager"])
@pytest.mark.parametrize("V,mask_id", [(4099, 4098), (4096, 100), (4096, None), (300, 299)])
def test_block_log_mass_against_float64_logsumexp(V, mask_id, backend, monkeypatch) -> None:
    """Block masses of the direct draw (compiled from COMPILE_MIN_STATES states up) against a float64 per-block
    logsumexp: a tail block, an exact multiple of the block size, a mask id inside a block, no mask."""
    uf.backend.set_backend(backend)
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(2, 3, V, generator=g) * 4
    ref = logits.double() / 0.7
    if mask_id is not None:
        ref[..., mask_id] = -math.inf
    nb = -(-V // 256)
    ref = torch.nn.functional.pad(ref, (0, nb * 256 - V), value=-math.inf).unflatten(-1, (nb, 256)).logsumexp(-1)
    key = ("cpu", torch.float32, torch.float32, mask_id is None, False, 256)
    out = uf._compile.run(_draws.block_log_mass, key, lambda fn: fn(logits, mask_id, 0.7, 256, torch.float32),
                          lambda: _draws.block_log_mass(logits, mask_id, 0.7, 256, torch.float32),
                          num_logits=logits.numel(), what=lambda: "block masses")
    assert out.shape == (2, 3, nb) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("backend", ["compiled", "eager"])
@pytest.mark.parametrize("mask_id", [None, 4100])
def test_draw_from_logits_is_the_softmax_and_matches_the_workspace_path(mask_id, backend, monkeypatch) -> None:
    """The direct draw (no softmax over V) follows softmax(l / T) with the mask excluded, returns x_θ(x_t), and
    with the same uniforms picks the same states as the workspace path (softmax + two-level inverse CDF)."""
    uf.backend.set_backend(backend)
    V, n, T = 4200, 100_000, 1.3
    g = torch.Generator().manual_seed(11)
    l = torch.full((V,), -30.0)
    hot = torch.tensor([3, 700, 2049, 4100, 4199])  # across blocks, one of them the mask id
    l[hot] = torch.tensor([1.0, 2.0, 0.5, 3.0, 1.5])
    logits = l.expand(1, n, V)
    x_t = torch.full((1, n), 700)
    u = torch.rand(1, n, 2, generator=g)
    z, p_b = _draws.draw_from_logits(logits, x_t, u, mask_id=mask_id, temperature=T, dtype=torch.float32)
    p = torch.softmax(l.double() / T if mask_id is None else torch.where(torch.arange(V) == mask_id, -math.inf,
                                                                           l.double()) / T, -1)
    torch.testing.assert_close(p_b, p[700].float().expand(1, n), rtol=1e-5, atol=0)
    freq = torch.bincount(z.flatten(), minlength=V).double()
    keep = hot if mask_id is None else hot[hot != mask_id]
    if mask_id is not None:
        assert int(freq[mask_id]) == 0
    assert chi2(freq[keep], p[keep] / p[keep].sum()) < CHI2_4DF_1E5  # ≤ 4 degrees of freedom
    w = x0_weights(logits, torch.empty(1, n, V), mask_id=mask_id, temperature=T)
    z_ref, _ = sample_weights(w, u)
    assert float((z == z_ref).double().mean()) > 0.999


def test_sampler_direct_and_workspace_paths_agree(monkeypatch) -> None:
    """BayesianSampler's default path (direct draw) and its workspace path (taken with top-k = V) give the same
    tokens from the same generator, up to float rounding at inverse-CDF boundaries."""
    uf.backend.set_backend("compiled")  # the direct path at this vocabulary size
    V = 2100
    kernel = uf.HybridKernel(V, mask_id=V - 1, p_uniform=0.3)
    head = torch.randn(1, 64, V, generator=torch.Generator().manual_seed(1)) * 3

    def model(x, t):
        return head.expand(x.shape[0], -1, -1)

    out = [BayesianSampler(model, kernel, 8, top_k=top_k).sample(4, 64, generator=torch.Generator().manual_seed(5))
           for top_k in (None, V)]
    assert float((out[0] == out[1]).double().mean()) > 0.99


def test_sample_weights_matches_weights_and_skips_zeros() -> None:
    V, n = 37, 200_000  # not a multiple of the block size: a tail block
    g = torch.Generator().manual_seed(3)
    w = torch.rand(V, generator=g, dtype=torch.float64) * 3.0
    w[[0, 5, V - 1]] = 0.0  # zero weights, including the last id (an added mask token sits there)
    u = torch.rand(n, 2, generator=g, dtype=torch.float64)
    idx, total = sample_weights(w.expand(n, V), u, block_size=8)
    freq = torch.bincount(idx, minlength=V).double()
    assert bool((freq[[0, 5, V - 1]] == 0).all())
    torch.testing.assert_close(total, w.sum().expand(n))
    keep = w > 0
    assert chi2(freq[keep], (w / w.sum())[keep]) < 90.0  # 33 dof, p ≈ 1e-7
    # u at the top end of [0, 1) still picks a state with positive weight
    top = torch.full((1, 2), 1.0 - 2**-53, dtype=torch.float64)
    assert float(w[sample_weights(w[None], top, block_size=8)[0]]) > 0


def test_x0_weights_against_naive_reference() -> None:
    g = torch.Generator().manual_seed(4)
    V, mask_id = 12, 7
    logits = torch.randn(3, 4, V, generator=g, dtype=torch.float64) * 2
    out = torch.empty_like(logits)
    # temperature and the mask state
    w = x0_weights(logits, out, mask_id=mask_id, temperature=0.5)
    ref = torch.softmax(logits / 0.5, -1)
    ref[..., mask_id] = 0.0
    torch.testing.assert_close(w, ref)
    # top-k keeps exactly the k largest clean entries
    w = x0_weights(logits, out, mask_id=mask_id, top_k=3).clone()
    assert bool(((w > 0).sum(-1) == 3).all()) and bool((w[..., mask_id] == 0).all())
    clean_logits = logits.index_fill(-1, torch.tensor([mask_id]), -math.inf)
    top3 = clean_logits.topk(3, -1).indices
    assert bool((w.gather(-1, top3) > 0).all())
    # top-p: the smallest set of most likely tokens holding >= top_p of the mass
    w = x0_weights(logits, out, mask_id=None, top_p=0.6).clone()
    p = torch.softmax(logits, -1)
    for row_w, row_p in zip(w.reshape(-1, V), p.reshape(-1, V)):
        order = row_p.argsort(descending=True)
        k = int((row_p[order].cumsum(0) < 0.6).sum()) + 1
        assert set(torch.nonzero(row_w).flatten().tolist()) == set(order[:k].tolist())
    # bf16 logits are upcast into the float32 workspace
    w32 = x0_weights(logits.bfloat16(), torch.empty(3, 4, V), mask_id=None)
    torch.testing.assert_close(w32, torch.softmax(logits.bfloat16().float(), -1))


def test_euler_step_probs_clamps_and_renormalises() -> None:
    rates = torch.tensor([[0.0, 1.0, 3.0], [2.0, 0.0, 2.0]], dtype=torch.float64)
    x_t = torch.tensor([0, 1])
    small = euler_step_probs(rates, x_t, 0.1)
    torch.testing.assert_close(small, torch.tensor([[0.6, 0.1, 0.3], [0.2, 0.6, 0.2]], dtype=torch.float64))
    big = euler_step_probs(rates, x_t, 1.0)  # Δt λ = 4 > 1: jumps renormalised, stay 0
    torch.testing.assert_close(big, torch.tensor([[0.0, 0.25, 0.75], [0.5, 0.0, 0.5]], dtype=torch.float64))


# ----------------------------------------------------------------------------------------------------------------
# BayesianSampler


@pytest.mark.parametrize("num_steps", [1, 4, 16])
@pytest.mark.parametrize("name", ["uniform", "mask", "hybrid"])
def test_bayesian_sampler_reproduces_independent_data(name: str, num_steps: int) -> None:
    kernel = kernels()[name]
    p = data_distribution()
    n = 20_000
    x = BayesianSampler(constant_model(kernel, p), kernel, num_steps).sample(
        n, 2, generator=torch.Generator().manual_seed(5))
    assert x.shape == (n, 2) and x.dtype == torch.int64
    if kernel.mask_id is not None:
        assert not bool((x == kernel.mask_id).any())  # the last step lands on clean tokens
    counts = clean_histogram(x, kernel)
    assert float(counts.sum()) == 2 * n
    for i in range(2):
        assert chi2(counts[i], p[i]) < CHI2_4DF_1E5
        assert float((counts[i] / n - p[i]).abs().sum()) / 2 < 0.02


def test_bayesian_sampler_generator_kernel_reproduces_data() -> None:
    uniform_generator = torch.full((S, S), 1.0 / S, dtype=torch.float64) - torch.eye(S, dtype=torch.float64)
    kernel = uf.GeneratorKernel(uniform_generator, schedule=uf.schedules.LinearSchedule())
    p = data_distribution(L=1)
    x = BayesianSampler(constant_model(kernel, p), kernel, 4).sample(20_000, 1,
                                                                     generator=torch.Generator().manual_seed(6))
    assert chi2(clean_histogram(x, kernel)[0], p[0]) < CHI2_4DF_1E5


@pytest.mark.parametrize("name", ["uniform", "mask"])
def test_bayesian_sampler_dependent_pairs(name: str) -> None:
    """Data x^1 = x^2 (uniform): factorised steps lose the dependence at N = 1 and recover it at many steps."""
    kernel = kernels()[name]
    joint = torch.eye(S, dtype=torch.float64) / S
    model = pair_denoiser(kernel, joint)
    agree = {}
    for N in (1, 96):
        x = BayesianSampler(model, kernel, N, dtype=torch.float64).sample(
            4000, 2, generator=torch.Generator().manual_seed(7))
        agree[N] = float((x[:, 0] == x[:, 1]).double().mean())
        marginal = clean_histogram(x, kernel)[0] / 4000
        assert float((marginal - 1 / S).abs().max()) < 0.04
    assert agree[1] < 0.5
    assert agree[96] > 0.97


def test_same_generator_same_tokens_and_different_seed_differs() -> None:
    kernel = kernels()["hybrid"]
    sampler = BayesianSampler(random_table_model(kernel.num_states), kernel, 8, top_k=4, temperature=0.8)
    a = sampler.sample(16, 12, generator=torch.Generator().manual_seed(8))
    b = sampler.sample(16, 12, generator=torch.Generator().manual_seed(8))
    c = sampler.sample(16, 12, generator=torch.Generator().manual_seed(9))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_top_k_one_and_float64_dtype() -> None:
    kernel = kernels()["mask"]
    p = data_distribution()
    x = BayesianSampler(constant_model(kernel, p), kernel, 3, top_k=1, dtype=torch.float64).sample(
        500, 2, generator=torch.Generator().manual_seed(10))
    assert torch.equal(x, p.argmax(-1).expand(500, 2))  # mask ids are 0..S-1 for this kernel


def test_low_temperature_concentrates_and_bf16_logits_work() -> None:
    kernel = kernels()["uniform"]
    p = data_distribution()
    base = constant_model(kernel, p)
    bf16 = lambda x_t, t: base(x_t, t).bfloat16()
    x = BayesianSampler(bf16, kernel, 4, temperature=0.05).sample(2000, 2,
                                                                   generator=torch.Generator().manual_seed(11))
    assert float((x == p.argmax(-1)).double().mean()) > 0.97


@pytest.mark.parametrize("form", ["fill", "pair"])
def test_prompt_prefix_and_infilling(form: str) -> None:
    kernel = kernels()["mask"]
    V, B, L = kernel.num_states, 6, 10
    inner = random_table_model(V, seed=12)
    seen: list[torch.Tensor] = []

    def model(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        seen.append(x_t.clone())
        return inner(x_t, t)

    g = torch.Generator().manual_seed(13)
    ids = torch.randint(0, S, (B, L), generator=g)
    for keep in (torch.arange(L) < 4, torch.rand(B, L, generator=g) < 0.5):  # prefix, arbitrary infilling mask
        keep = keep.expand(B, L)
        prompt = torch.where(keep, ids, PROMPT_FILL) if form == "fill" else (ids, keep)
        seen.clear()
        x = BayesianSampler(model, kernel, 12).sample(B, L, prompt=prompt, generator=g)
        assert torch.equal(x[keep], ids[keep])
        assert not bool((x == kernel.mask_id).any())
        assert len(seen) == 12
        for x_seen in seen:  # the model saw the kept tokens at every step
            assert torch.equal(x_seen[keep], ids[keep])


def test_prompt_conditions_the_generated_positions() -> None:
    kernel = kernels()["mask"]  # a visible token is certainly clean: P(x0^2 = 3 | z^1 = 3) = 1
    model = pair_denoiser(kernel, torch.eye(S, dtype=torch.float64) / S)
    prompt = torch.tensor([3, PROMPT_FILL])
    x = BayesianSampler(model, kernel, 16).sample(300, 2, prompt=prompt, generator=torch.Generator().manual_seed(14))
    assert bool((x[:, 0] == 3).all())
    assert float((x[:, 1] == 3).double().mean()) > 0.99


def test_cache_unchanged_same_tokens_fewer_calls() -> None:
    kernel = kernels()["mask"]
    inner = random_table_model(kernel.num_states, seed=15, time_weight=0.0)  # ignores t
    calls = {"n": 0}

    def model(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return inner(x_t, t)

    out = {}
    for cache in (False, True):
        calls["n"] = 0
        sampler = BayesianSampler(model, kernel, 64, cache_unchanged=cache)
        out[cache] = (sampler.sample(2, 3, generator=torch.Generator().manual_seed(16)), calls["n"])
    assert torch.equal(out[False][0], out[True][0])
    assert out[False][1] == 64
    assert out[True][1] < 64


def test_callback_sees_the_trajectory_and_can_stop() -> None:
    kernel = kernels()["mask"]
    record: list[tuple[int, float, int]] = []

    def watch(step: int, t: float, x_t: torch.Tensor) -> bool:
        record.append((step, t, int((x_t == kernel.mask_id).sum())))
        return False

    sampler = BayesianSampler(random_table_model(kernel.num_states), kernel, 8)
    sampler.sample(4, 6, generator=torch.Generator().manual_seed(17), callback=watch, progress=True)
    assert [r[0] for r in record] == list(range(1, 9))
    assert record[-1][1] == 0.0 and record[-1][2] == 0
    assert all(a[1] > b[1] for a, b in zip(record, record[1:]))
    assert all(a[2] >= b[2] for a, b in zip(record, record[1:]))  # masks only disappear

    stopped = sampler.sample(4, 6, generator=torch.Generator().manual_seed(17), callback=lambda n, t, x: n == 2)
    assert bool((stopped == kernel.mask_id).any())  # returned after 2 of 8 steps, still partly masked


def test_diffusion_lm_samples() -> None:
    from _hf_tiny import tiny_model

    model = uf.adapt_ar_model(tiny_model("llama"))  # adds a mask token: vocabulary 129
    kernel = uf.MaskKernel(model.num_states, model.mask_token_id)
    prompt = torch.full((2, 8), PROMPT_FILL)
    prompt[:, :3] = torch.tensor([5, 6, 7])
    x = BayesianSampler(model, kernel, 4).sample(2, 8, prompt=prompt, generator=torch.Generator().manual_seed(18))
    assert x.shape == (2, 8)
    assert not bool((x == model.mask_token_id).any())
    assert torch.equal(x[:, :3], prompt[:, :3])


# ----------------------------------------------------------------------------------------------------------------
# one generator per row


def _rows_prompt(kernel: uf.Kernel, B: int, L: int, seed: int) -> torch.Tensor:
    """Different prompts per row: a prefix of row-dependent length and a few infilled positions."""
    g = torch.Generator().manual_seed(seed)
    clean = clean_ids(kernel)
    ids = clean[torch.randint(0, clean.numel(), (B, L), generator=g)]
    keep = (torch.arange(L) < torch.arange(B)[:, None] % 3) | (torch.rand(B, L, generator=g) < 0.2)
    return torch.where(keep, ids, PROMPT_FILL)


def _seeded(seeds: list[int]) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed) for seed in seeds]


SAMPLING_OPTIONS = [{}, {"top_k": 2}, {"top_p": 0.8, "temperature": 0.7}]


@pytest.mark.parametrize("options", SAMPLING_OPTIONS, ids=["plain", "top_k", "top_p_temperature"])
@pytest.mark.parametrize("name", ["uniform", "mask", "hybrid", "generator"])
def test_per_row_generators_reproduce_batches_of_one(name: str, options: dict) -> None:
    """Row b of a batch sampled with generators[b] is the batch of one sampled with that generator (same prompt row),
    whichever rows are beside it: permuted, duplicated, or alone. float64 model: its arithmetic is row-wise exact."""
    kernel = dense_kernel() if name == "generator" else kernels()[name]
    sampler = BayesianSampler(random_table_model(kernel.num_states, seed=30), kernel, 6, dtype=torch.float64,
                              **options)
    B, L = 5, 9
    prompt = _rows_prompt(kernel, B, L, seed=31)
    seeds = [40, 41, 42, 43, 40]  # the last row repeats the first's seed on another prompt
    batch = sampler.sample(B, L, prompt=prompt, generator=_seeded(seeds))
    alone = torch.cat([sampler.sample(1, L, prompt=prompt[b:b + 1], generator=torch.Generator().manual_seed(seed))
                       for b, seed in enumerate(seeds)])
    assert torch.equal(batch, alone)
    order = [3, 0, 4, 1, 2]
    permuted = sampler.sample(B, L, prompt=prompt[order], generator=_seeded([seeds[b] for b in order]))
    assert torch.equal(permuted, batch[order])
    twice = sampler.sample(2, L, prompt=prompt[[2, 2]], generator=_seeded([seeds[2]] * 2))
    assert torch.equal(twice, batch[[2, 2]])
    kept = prompt != PROMPT_FILL
    assert torch.equal(batch[kept], prompt[kept])
    if kernel.mask_id is not None:
        assert not bool((batch == kernel.mask_id).any())
    # one per-row generator is the single generator, and a batch of one equals its one-generator run
    assert torch.equal(sampler.sample(1, L, prompt=prompt[:1], generator=_seeded([40])), alone[:1])


def test_per_row_generators_at_lm_vocabulary_size(monkeypatch) -> None:
    """V ≥ COMPILE_MIN_STATES (several blocks of 256 states in the two-level draw; the eager backend, so no run
    switches to a compiled pass half-way): rows still equal their batches of one."""
    uf.backend.set_backend("eager")
    V = _draws.COMPILE_MIN_STATES + 3
    kernel = uf.MaskKernel(V, mask_id=V - 1)
    table = torch.randn(V, V, generator=torch.Generator().manual_seed(32), dtype=torch.float64) * 4

    def model(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return table[x_t]

    sampler = BayesianSampler(model, kernel, 4, dtype=torch.float64)
    batch = sampler.sample(3, 5, generator=_seeded([1, 2, 3]))
    alone = torch.cat([sampler.sample(1, 5, generator=torch.Generator().manual_seed(seed)) for seed in (1, 2, 3)])
    assert torch.equal(batch, alone)
    assert not bool((batch == kernel.mask_id).any())


@pytest.mark.parametrize("parameterization", ["x0", "sedd"])
@pytest.mark.parametrize("name", ["uniform", "mask", "generator"])
def test_euler_per_row_generators_reproduce_batches_of_one(name: str, parameterization: str) -> None:
    kernel = dense_kernel() if name == "generator" else kernels()[name]
    model = random_table_model(kernel.num_states, seed=33)
    head = model if parameterization == "x0" else x0_model_as(model, kernel, parameterization, dtype=torch.float64)
    sampler = EulerSampler(head, kernel, 5, parameterization=parameterization, dtype=torch.float64)
    B, L = 4, 7
    prompt = _rows_prompt(kernel, B, L, seed=34)
    seeds = [50, 51, 52, 50]
    batch = sampler.sample(B, L, prompt=prompt, generator=_seeded(seeds))
    alone = torch.cat([sampler.sample(1, L, prompt=prompt[b:b + 1], generator=torch.Generator().manual_seed(seed))
                       for b, seed in enumerate(seeds)])
    assert torch.equal(batch, alone)


def test_diffusion_lm_generate_with_per_row_generators() -> None:
    from _hf_tiny import tiny_model

    model = uf.adapt_ar_model(tiny_model("llama")).eval()
    prompts = torch.tensor([[5, 6, 7], [8, 9, 10], [5, 6, 7]])
    options = {"max_new_tokens": 6, "num_steps": 4, "temperature": 0.8, "top_k": 20}
    batch = model.generate(prompts, generator=_seeded([60, 61, 60]), **options)
    alone = torch.cat([model.generate(prompts[b:b + 1], generator=torch.Generator().manual_seed(seed), **options)
                       for b, seed in enumerate([60, 61, 60])])
    assert torch.equal(batch, alone)
    assert torch.equal(batch[0], batch[2])  # same prompt, same seed
    with pytest.raises(ValueError, match=r"generator: expected one generator per row, batch_size = 3 in all, got 2"):
        model.generate(prompts, generator=_seeded([1, 2]), **options)
    with pytest.raises(TypeError, match="generator: expected one torch.Generator per row, got int at index 1"):
        model.generate(prompts, generator=[torch.Generator(), 3, torch.Generator()], **options)


@pytest.mark.parametrize("cls", [BayesianSampler, EulerSampler])
def test_bad_per_row_generators(cls) -> None:
    kernel = uf.MaskKernel(S + 1, mask_id=S)
    sampler = cls(lambda x_t, t: torch.zeros(*x_t.shape, S + 1), kernel, 2)
    with pytest.raises(ValueError, match=r"generator: expected one generator per row, batch_size = 3 in all, got 2"):
        sampler.sample(3, 4, generator=_seeded([1, 2]))
    with pytest.raises(ValueError, match="generator: expected one generator per row"):
        sampler.sample(1, 4, generator=[])
    with pytest.raises(TypeError, match="generator: expected one torch.Generator per row, got int at index 1"):
        sampler.sample(2, 4, generator=[torch.Generator(), 7])
    with pytest.raises(TypeError, match=r"generator: expected a torch.Generator or None, got int; use "
                                        r"torch.Generator\(\).manual_seed\(7\) \(or a list of batch_size = 2"):
        sampler.sample(2, 4, generator=7)
    with pytest.raises(TypeError, match="generator: expected a torch.Generator or None, got generator"):
        sampler.sample(2, 4, generator=(g for g in _seeded([1, 2])))
    # a device type other than the sampling device's (no CUDA needed: the check reads metadata only)
    with pytest.raises(ValueError, match=r"generator: the generator of row 0 is on cpu but sampling runs on cuda"):
        sampler.sample(2, 4, generator=_seeded([1, 2]), device="cuda")


# ----------------------------------------------------------------------------------------------------------------
# EulerSampler


@pytest.mark.parametrize("name", ["uniform", "mask", "hybrid", "generator"])
def test_euler_parameterizations_give_identical_samples(name: str) -> None:
    kernel = dense_kernel() if name == "generator" else kernels()[name]
    model = random_table_model(kernel.num_states, seed=19)
    outs = {}
    for par in PARAMETERIZATIONS:
        sampler = EulerSampler(x0_model_as(model, kernel, par, dtype=torch.float64), kernel, 6,
                               parameterization=par, dtype=torch.float64)
        outs[par] = sampler.sample(300, 5, generator=torch.Generator().manual_seed(20))
    for par, x in outs.items():
        assert torch.equal(x, outs["x0"]), par
    if kernel.mask_id is not None:
        assert not bool((outs["x0"] == kernel.mask_id).any())


@pytest.mark.parametrize("name", ["uniform", "mask", "hybrid"])
def test_euler_sampler_approaches_data_with_many_steps(name: str) -> None:
    kernel = kernels()[name]
    p = data_distribution()
    n = 20_000
    x = EulerSampler(constant_model(kernel, p), kernel, 64).sample(n, 2, generator=torch.Generator().manual_seed(21))
    counts = clean_histogram(x, kernel)
    assert float(counts.sum()) == 2 * n  # clean tokens only
    for i in range(2):
        assert float((counts[i] / n - p[i]).abs().sum()) / 2 < 0.03


def test_euler_final_step_argmax_and_single_step() -> None:
    kernel = kernels()["mask"]
    p = data_distribution()
    x = EulerSampler(constant_model(kernel, p), kernel, 1, final_step="argmax").sample(50, 2)
    assert torch.equal(x, p.argmax(-1).expand(50, 2))  # from all-mask, the posterior's mode is x_θ's


def test_euler_ctmc_native_head_shapes() -> None:
    kernel = kernels()["uniform"]
    conv = x0_model_as(random_table_model(S), kernel, "ctmc")
    head = conv(torch.zeros(3, 4, dtype=torch.long), torch.full((3,), 0.5))
    assert head[0].shape == (3, 4) and head[1].shape == (3, 4, S)
    bad = lambda x_t, t: (head[0][:, :2], head[1])
    with pytest.raises(ValueError, match="log_exit_rate"):
        EulerSampler(bad, kernel, 3, parameterization="ctmc").sample(3, 4)
    with pytest.raises(TypeError, match="pair"):
        EulerSampler(lambda x_t, t: head[1], kernel, 3, parameterization="ctmc").sample(3, 4)


# ----------------------------------------------------------------------------------------------------------------
# bad input


def _model(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return torch.zeros(*x_t.shape, S)


@pytest.mark.parametrize(("kwargs", "error", "name"), [
    ({"num_steps": 0}, ValueError, "num_steps"),
    ({"num_steps": 2.0}, TypeError, "num_steps"),
    ({"eps": 0.0}, ValueError, "eps"),
    ({"eps": 1.0}, ValueError, "eps"),
    ({"top_p": 0.0}, ValueError, "top_p"),
    ({"top_p": 1.5}, ValueError, "top_p"),
    ({"top_k": 0}, ValueError, "top_k"),
    ({"temperature": 0.0}, ValueError, "temperature"),
    ({"temperature": -1.0}, ValueError, "temperature"),
    ({"dtype": torch.bfloat16}, ValueError, "dtype"),
    ({"kernel": "uniform"}, TypeError, "kernel"),
    ({"model": 3}, TypeError, "model"),
])
@pytest.mark.parametrize("cls", [BayesianSampler, EulerSampler])
def test_bad_constructor_arguments(cls, kwargs, error, name) -> None:
    args = {"model": _model, "kernel": uf.UniformKernel(S), "num_steps": 4}
    args.update(kwargs)
    model, kernel, num_steps = args.pop("model"), args.pop("kernel"), args.pop("num_steps")
    with pytest.raises(error, match=name):
        cls(model, kernel, num_steps, **args)


def test_bad_parameterization_and_options() -> None:
    with pytest.raises(ValueError, match="parameterization"):
        EulerSampler(_model, uf.UniformKernel(S), 4, parameterization="score")
    with pytest.raises(ValueError, match="parameterization"):
        x0_model_as(_model, uf.UniformKernel(S), "mdlm")
    with pytest.raises(ValueError, match="temperature"):
        EulerSampler(_model, uf.UniformKernel(S), 4, parameterization="sedd", temperature=0.5)
    with pytest.raises(ValueError, match="final_step"):
        EulerSampler(_model, uf.UniformKernel(S), 4, final_step="mode")


@pytest.mark.parametrize("cls", [BayesianSampler, EulerSampler])
def test_bad_sample_arguments(cls) -> None:
    kernel = uf.MaskKernel(S + 1, mask_id=S)
    sampler = cls(lambda x_t, t: torch.zeros(*x_t.shape, S + 1), kernel, 2)
    with pytest.raises(ValueError, match="prompt"):
        sampler.sample(2, 4, prompt=torch.full((2, 5), PROMPT_FILL))
    with pytest.raises(ValueError, match="prompt"):
        sampler.sample(2, 4, prompt=torch.tensor([0, 9, -1, -1]))  # id out of range
    with pytest.raises(ValueError, match="prompt"):
        sampler.sample(2, 4, prompt=torch.tensor([0, S, -1, -1]))  # the mask id is not a clean token
    with pytest.raises(TypeError, match="prompt"):
        sampler.sample(2, 4, prompt=torch.zeros(4))
    with pytest.raises(TypeError, match="prompt"):
        sampler.sample(2, 4, prompt=(torch.zeros(4, dtype=torch.long), torch.ones(4)))
    with pytest.raises(ValueError, match="batch_size"):
        sampler.sample(0, 4)
    with pytest.raises(TypeError, match="callback"):
        sampler.sample(2, 4, callback=5)
    wrong = cls(lambda x_t, t: torch.zeros(*x_t.shape, S), kernel, 2)  # S logits for S + 1 states
    with pytest.raises(ValueError, match=r"\(B, L, num_states\) = \(2, 4, 6\)"):
        wrong.sample(2, 4)
    with pytest.raises(TypeError, match="model"):
        cls(lambda x_t, t: [0.0], kernel, 2).sample(2, 4)

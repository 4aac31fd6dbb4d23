"""Tests for unifusion.kernels: every kernel kind against dense float64 references and CTMC invariants."""

from __future__ import annotations

import math

import pytest
import reference as ref
import torch
from reference import DT, KINDS

import unifusion as uf
from unifusion.schedules import CosineSchedule, LinearSchedule, LogLinearSchedule, Schedule

N = 20  # random instances per check


def _t(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=DT)


def _library_P(kernel: uf.Kernel, s: float, t: float) -> torch.Tensor:
    """P_{s,t} ``(S, S)`` assembled from transition_into columns (column j = q_{t|s}(j | ·))."""
    ids = torch.arange(kernel.num_states)
    return kernel.transition_into(ids, _t(s), _t(t)).T


def _library_R(kernel: uf.Kernel, t: float) -> torch.Tensor:
    """R_t ``(S, S)`` from rate_into columns, diagonal from row sums."""
    ids = torch.arange(kernel.num_states)
    R = kernel.rate_into(ids, _t(t)).T.clone()
    R -= torch.diag(R.sum(-1))
    return R


@pytest.mark.parametrize("kind", KINDS)
def test_marginal_and_rates_match_dense_reference(kind: str) -> None:
    for kernel, S, g in ref.instances(kind, N, seed=1):
        t = ref.random_time(g)
        P, R = ref.P0(kernel, t), ref.rate_matrix(kernel, t)
        ids = torch.arange(S)
        assert ref.rel_err(kernel.marginal(ids, _t(t)), P) <= 1e-13
        p = ref.random_distribution(kernel, g)
        assert ref.rel_err(kernel.marginal(p, _t(t)), p @ P) <= 1e-13
        assert ref.rel_err(_library_R(kernel, t), R) <= 1e-13


@pytest.mark.parametrize("kind", KINDS)
def test_marginal_rows_sum_to_one_identity_at_zero_rates_nonnegative(kind: str) -> None:
    for kernel, S, _ in ref.instances(kind, N, seed=2):
        ids = torch.arange(S)
        # GIDD's hybrid leaves the identity like t^{γ/2} (γ ≥ 0.2 here), hence the tiny first time
        ts = torch.tensor([1e-80, 1e-9, 1e-4, 0.2, 0.5, 0.8, 0.999], dtype=DT)[:, None]
        q = kernel.marginal(ids[None], ts)  # (7, S, S): a grid of times over one token row (1, S)
        torch.testing.assert_close(q.sum(-1), torch.ones(7, S, dtype=DT), rtol=0, atol=1e-13)
        assert bool((q >= 0).all())
        torch.testing.assert_close(q[0], torch.eye(S, dtype=DT), rtol=0, atol=1e-6)  # q_{0+} → identity
        rates = kernel.rate_into(ids[None], ts)
        assert bool((rates >= 0).all()) and bool((rates.diagonal(dim1=-2, dim2=-1) == 0).all())


@pytest.mark.parametrize("kind", KINDS)
def test_transition_into_and_chapman_kolmogorov(kind: str) -> None:
    for kernel, S, g in ref.instances(kind, N, seed=3):
        s, t = sorted([ref.random_time(g), ref.random_time(g)])
        P_st = _library_P(kernel, s, t)
        assert ref.rel_err(P_st, ref.Pst(kernel, s, t)) <= 1e-12
        assert ref.rel_err(_library_P(kernel, 0.0, t), ref.P0(kernel, t)) <= 1e-13
        # Chapman–Kolmogorov with the library's own matrices
        assert ref.rel_err(_library_P(kernel, 0.0, s) @ P_st, _library_P(kernel, 0.0, t)) <= 1e-13
        torch.testing.assert_close(P_st.sum(-1), torch.ones(S, dtype=DT), rtol=0, atol=1e-13)


@pytest.mark.parametrize("kind", KINDS)
def test_posterior_is_bayes(kind: str) -> None:
    for kernel, S, g in ref.instances(kind, N, seed=4):
        s, t = sorted([ref.random_time(g), ref.random_time(g)])
        if g.initial_seed() % 2:  # also s = 0
            s = 0.0
        x_theta = ref.random_distribution(kernel, g)
        post = kernel.posterior(x_theta.expand(S, S), torch.arange(S), _t(s), _t(t))
        P_st, q_s = ref.Pst(kernel, s, t), x_theta @ ref.P0(kernel, s)
        for j in range(S):
            bayes = torch.tensor([float(P_st[a, j] * q_s[a]) for a in range(S)], dtype=DT)
            if bayes.sum() > 0:
                # 1e-11: the reference's P_{s,t} = P_{0,s}^{-1} P_{0,t} loses a digit to the solve
                assert ref.rel_err(post[j], bayes / bayes.sum()) <= 1e-11
                assert abs(float(post[j].sum()) - 1.0) <= 1e-13


@pytest.mark.parametrize("kind", KINDS)
def test_kolmogorov_forward_equation(kind: str) -> None:
    """d/dt q_{t|0} = q_{t|0} R_t by (4th-order) central differences, R_t from rate_into columns."""
    h = 1e-4
    for kernel, S, g in ref.instances(kind, N, seed=5):
        t = ref.random_time(g, 0.05, 0.9)
        ids = torch.arange(S)
        q = {k: kernel.marginal(ids, _t(t + k * h)) for k in (-2, -1, 1, 2)}
        dq = (8 * (q[1] - q[-1]) - (q[2] - q[-2])) / (12 * h)
        rhs = kernel.marginal(ids, _t(t)) @ _library_R(kernel, t)
        assert ref.rel_err(dq, rhs) <= 1e-7


@pytest.mark.parametrize("kind", KINDS)
def test_sample_frequencies_match_marginal(kind: str) -> None:
    g = torch.Generator().manual_seed(6)
    n = 40_000
    for kernel, S, _ in ref.instances(kind, 3, seed=6):
        x0 = int(ref.clean_states(kernel)[-1])
        t = 0.6
        draws = kernel.sample(torch.full((n,), x0), _t(t), generator=g)
        assert draws.dtype == torch.int64
        counts = torch.bincount(draws, minlength=S).to(DT)
        expected = n * kernel.marginal(torch.tensor(x0), _t(t))
        keep = expected > 0
        assert bool((counts[~keep] == 0).all())
        chi2 = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
        dof = int(keep.sum()) - 1
        assert chi2 < dof + 6 * math.sqrt(2 * dof) + 10  # loose: ≈ 6 σ


def test_sampling_is_reproducible_with_a_generator() -> None:
    kernel = uf.HybridKernel(11, 3, p_uniform=0.4)
    x0 = torch.arange(11).repeat(5)
    a = kernel.sample(x0, 0.5, generator=torch.Generator().manual_seed(0))
    b = kernel.sample(x0, 0.5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a, b)


def _assert_same_kernel(a: uf.Kernel, b: uf.Kernel, tol: float = 1e-12) -> None:
    S = a.num_states
    ids = torch.arange(S)
    g = torch.Generator().manual_seed(7)
    for _ in range(5):
        s, t = sorted([ref.random_time(g), ref.random_time(g)])
        assert ref.rel_err(a.marginal(ids, _t(t)), b.marginal(ids, _t(t))) <= tol
        assert ref.rel_err(a.rate_into(ids, _t(t)), b.rate_into(ids, _t(t))) <= tol
        assert ref.rel_err(a.transition_into(ids, _t(s), _t(t)), b.transition_into(ids, _t(s), _t(t))) <= tol
        p = ref.random_distribution(a, g)
        assert ref.rel_err(a.posterior(p.expand(S, S), ids, _t(s), _t(t)),
                           b.posterior(p.expand(S, S), ids, _t(s), _t(t))) <= tol


@pytest.mark.parametrize("schedule", [LinearSchedule(), CosineSchedule(), LogLinearSchedule(0.01)], ids=repr)
def test_generator_forms_reproduce_structured_kernels(schedule: Schedule) -> None:
    S, m = 6, 2
    uniform = torch.ones(S, S, dtype=DT) / S - torch.eye(S, dtype=DT)
    _assert_same_kernel(uf.GeneratorKernel(uniform, schedule=schedule), uf.UniformKernel(S, schedule))
    absorbing = torch.zeros(S, S, dtype=DT)
    absorbing[:, m] = 1.0
    absorbing -= torch.diag(absorbing.sum(-1))
    _assert_same_kernel(uf.GeneratorKernel(absorbing, schedule=schedule, mask_id=m), uf.MaskKernel(S, m, schedule))


def test_hybrid_with_no_uniform_noise_is_the_mask_kernel() -> None:
    _assert_same_kernel(uf.HybridKernel(7, 4, p_uniform=0.0, gamma=1.3), uf.MaskKernel(7, 4), tol=1e-14)


def test_priors_and_clean_states() -> None:
    S = 5
    torch.testing.assert_close(uf.UniformKernel(S).prior(dtype=DT), torch.full((S,), 0.2, dtype=DT))
    e = torch.zeros(S, dtype=DT)
    e[1] = 1.0
    torch.testing.assert_close(uf.MaskKernel(S, 1).prior(dtype=DT), e)
    R = ref.random_generator_matrix(S, torch.Generator().manual_seed(0))
    pi = uf.GeneratorKernel(R).prior(dtype=DT)
    torch.testing.assert_close(pi @ R, torch.zeros(S, dtype=DT), rtol=0, atol=1e-12)  # stationary
    assert abs(float(pi.sum()) - 1) < 1e-14
    # the prior at time t is the normalised noise vector
    hybrid = uf.HybridKernel(S, 1, 0.3)
    t = 0.4
    noise = ref.P0(hybrid, t)[0].clone()
    noise[0] -= float(ref.P0(hybrid, t)[0, 0] - ref.P0(hybrid, t)[2, 0])  # remove α_t from the diagonal
    torch.testing.assert_close(hybrid.prior(t, dtype=DT), noise / noise.sum())
    draws = uf.MaskKernel(S, 1).sample_prior((3, 4), generator=torch.Generator().manual_seed(0))
    assert draws.shape == (3, 4) and bool((draws == 1).all())
    assert uf.MaskKernel(S, 1).clean_state_mask.tolist() == [True, False, True, True, True]
    assert bool(uf.UniformKernel(S).clean_state_mask.all())


@pytest.mark.parametrize("gamma", [0.2, 1.0, 2.0])
def test_hybrid_terminal_prior_is_all_mask(gamma: float) -> None:
    """GIDD's c_1 = 0, so p_prior = e_mask exactly; Algorithm 2 starts from it (sample_prior)."""
    S, m = 5, 1
    e = torch.zeros(S, dtype=DT)
    e[m] = 1.0
    kernel = uf.HybridKernel(S, m, 0.3, gamma)
    torch.testing.assert_close(kernel.prior(dtype=DT), e, rtol=0, atol=1e-12)
    draws = kernel.sample_prior((2000,), generator=torch.Generator().manual_seed(0))
    assert bool((draws == m).all())


def test_time_broadcasting() -> None:
    kernel = uf.HybridKernel(6, 0, 0.5)
    x0 = torch.tensor([[1, 2, 3], [4, 5, 1]])
    t = torch.tensor([[0.2], [0.7]], dtype=DT)
    q = kernel.marginal(x0, t)
    assert q.shape == (2, 3, 6)
    for b in range(2):
        for l in range(3):
            torch.testing.assert_close(q[b, l], kernel.marginal(x0[b, l], t[b, 0]))
    assert kernel.rate_into(x0, t).shape == (2, 3, 6)
    assert kernel.transition_into(x0, 0.1, t).shape == (2, 3, 6)


@pytest.mark.parametrize("kernel", [uf.UniformKernel(262_144), uf.MaskKernel(262_144, 5),
                                    uf.HybridKernel(262_144, 5, p_uniform=0.2)], ids=repr)
def test_structured_kernels_are_linear_in_the_vocabulary(kernel: uf.Kernel) -> None:
    """S = 262,144 on a few positions: an S×S float tensor (275 GB) could never be built, so success proves O(S)."""
    S = kernel.num_states
    g = torch.Generator().manual_seed(0)
    x0 = torch.tensor([7, 1000, 262_143])
    t = torch.tensor([0.1, 0.5, 0.9])
    x_t = kernel.sample(x0, t, generator=g)
    q = kernel.marginal(x0, t)
    assert q.shape == (3, S)
    torch.testing.assert_close(q.sum(-1), torch.ones(3), rtol=0, atol=1e-5)
    rates = kernel.rate_into(x_t, t)
    assert bool((rates >= 0).all()) and bool((rates.gather(-1, x_t[:, None]) == 0).all())
    logits = torch.randn(3, S, generator=g)
    x0_probs = torch.softmax(logits.index_fill(-1, torch.tensor([5]), -math.inf) if kernel.mask_id else logits, -1)
    post = kernel.posterior(x0_probs, x_t, t / 2, t)
    torch.testing.assert_close(post.sum(-1), torch.ones(3), rtol=0, atol=1e-5)
    loss = uf.losses.gidd_loss(logits, x0, x_t, t, kernel)
    assert loss.shape == (3,) and bool(torch.isfinite(loss).all()) and bool((loss >= 0).all())


def test_sample_prior_at_tensor_times_draws_from_the_prior_of_each_row() -> None:
    """``sample_prior(shape, t=tensor)`` draws each position from π at its own time: two rows at t = 0.2 and 0.7
    of GIDD's hybrid match ``prior(t)`` within 5 standard errors per state."""
    kernel = uf.HybridKernel(6, 0, 0.5)
    t, n = torch.tensor([0.2, 0.7], dtype=DT), 20_000
    draws = kernel.sample_prior((2, n), t=t, generator=torch.Generator().manual_seed(0))
    assert draws.shape == (2, n) and draws.dtype == torch.long
    for b in range(2):
        pi = kernel.prior(float(t[b]), dtype=DT)
        freq = torch.bincount(draws[b], minlength=6).to(DT) / n
        se = (pi * (1 - pi) / n).sqrt()
        assert bool(((freq - pi).abs() <= 5 * se + 1e-12).all()), (b, freq, pi)
    assert not torch.allclose(kernel.prior(0.2, dtype=DT), kernel.prior(0.7, dtype=DT), atol=0.05)


def test_generator_kernel_copies_its_matrices_to_a_device_once() -> None:
    """The dense kernel keeps its float64 matrices on the host and reuses one copy per device and dtype (a copy of host
    memory to a GPU per sampler step would make the host wait each time); a changed matrix is copied again."""
    from _dispatch_count import count_syncs

    S = 5
    R = torch.ones(S, S, dtype=DT) / S - torch.eye(S, dtype=DT)
    kernel = uf.GeneratorKernel(R.clone())
    ids, t = torch.arange(S, device="meta"), torch.full((S,), 0.5, device="meta")
    copies = [count_syncs(kernel.rate_column, ids, t)[1].sync_ops["copy to device"] for _ in range(3)]
    assert copies == [1, 0, 0]
    prior = count_syncs(kernel.noise_distribution, None, torch.float32, torch.device("meta"))[1]
    assert prior.sync_ops["copy to device"] == 1
    rates = kernel.rate_into(torch.arange(S), torch.full((S,), 0.5))  # float32, through the cached float32 copy
    kernel.generator.mul_(2.0)  # changed in place: the cached copy is stale and replaced
    torch.testing.assert_close(kernel.rate_into(torch.arange(S), torch.full((S,), 0.5)), 2.0 * rates)
    kernel.generator = R.clone()  # replaced
    torch.testing.assert_close(kernel.rate_into(torch.arange(S), torch.full((S,), 0.5)), rates)

"""The paper's App. B verification, reproduced: Lemma A.2, Proposition 3.2 (conditional/marginal split and the ELBO
bound) and Corollary 3.4's optimum, exactly on small state spaces."""

from __future__ import annotations

import pytest
import reference as ref
import torch
from reference import DT, KINDS

import unifusion as uf

N = 20


def _t(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=DT)


def _posterior_x0(kernel: uf.Kernel, p_data: torch.Tensor, t: float) -> torch.Tensor:
    """p(x0 = z | X_t = j) ``(S_j, S_z)`` by Bayes with the library's marginal; rows with q_t(j) = 0 are 0."""
    S = kernel.num_states
    joint = p_data[:, None] * kernel.marginal(torch.arange(S), _t(t))  # (z, j)
    q_t = joint.sum(0)
    return torch.where(q_t[:, None] > 0, joint.T / q_t.clamp_min(1e-300)[:, None], torch.zeros_like(joint.T))


def _true_rates_all(kernel: uf.Kernel, t: float) -> torch.Tensor:
    """R̂_t(j, i | x0) for every (x0, j) ``(S_z, S_j, S_i)``."""
    S = kernel.num_states
    x0 = torch.arange(S)[:, None].expand(S, S)
    x_t = torch.arange(S)[None, :].expand(S, S)
    return uf.ReverseRate.true_conditional(kernel, x0, x_t, _t(t)).rates


@pytest.mark.parametrize("kind", KINDS)
def test_lemma_a2_conditional_rates_average_to_the_marginal_rate(kind: str) -> None:
    """E[R̂_t(j, i | X0) | X_t = j] = R̂_t(j, i), exact sum over x0 with a random p_data."""
    for kernel, S, g in ref.instances(kind, N, seed=40):
        t = ref.random_time(g)
        p_data = ref.random_distribution(kernel, g)
        post = _posterior_x0(kernel, p_data, t)  # (j, z)
        lhs = torch.einsum("jz,zji->ji", post, _true_rates_all(kernel, t))
        marginal = uf.ReverseRate.from_x0(kernel, p_data.expand(S, S), torch.arange(S), _t(t)).rates
        dense = torch.tensor([ref.marginal_rates(kernel, p_data, j, t) for j in range(S)], dtype=DT)
        assert ref.rel_err(lhs, dense) <= 1e-13
        assert ref.rel_err(marginal, dense) <= 1e-13


def _objectives(kernel: uf.Kernel, p_data: torch.Tensor, t: float, logits: torch.Tensor) -> tuple[float, float]:
    """(conditional form, marginal form without C_gap) of Proposition 3.2 at a fixed t, for an x0 head
    ``logits (S_j, S)``: Σ_j q_t(j) E[D_t(j, X0) | X_t = j] and Σ_j q_t(j) Σ_i f(R̂_t(j, i), R̂^θ_t(j, i))."""
    S = kernel.num_states
    ids = torch.arange(S)
    x0 = ids[:, None].expand(S, S)
    x_t = ids[None, :].expand(S, S)
    q0 = kernel.marginal(ids, _t(t))  # (z, j)
    q_t = p_data @ q0
    live = q0 > 0  # D_t is only evaluated where x_t is possible under x0
    d_t = uf.bregman_rate_loss(uf.ReverseRate.true_conditional(kernel, x0, x_t, _t(t)),
                               uf.ReverseRate.from_x0_logits(kernel, logits.expand(S, S, S), x_t, _t(t)))
    conditional = float((p_data[:, None] * q0 * torch.where(live, d_t, torch.zeros_like(d_t))).sum())
    marginal_rate = uf.ReverseRate.from_x0(kernel, p_data.expand(S, S), ids, _t(t))
    model = uf.ReverseRate.from_x0_logits(kernel, logits, ids, _t(t))
    d_marg = uf.bregman_rate_loss(marginal_rate, model)
    marginal = float((q_t * torch.where(q_t > 0, d_marg, torch.zeros_like(d_marg))).sum())
    return conditional, marginal


@pytest.mark.parametrize("kind", KINDS)
def test_proposition_3_2_gap_is_nonnegative_and_independent_of_the_model(kind: str) -> None:
    for kernel, S, g in ref.instances(kind, N, seed=41):
        t = ref.random_time(g)
        p_data = ref.random_distribution(kernel, g)
        gaps = []
        for _ in range(2):
            cond, marg = _objectives(kernel, p_data, t, ref.random_logits((S, S), g))
            gaps.append(cond - marg)
        # Jensen's gap Σ_j q_t(j) Σ_i (E[R log R | j] − R̄ log R̄), computed directly
        post = _posterior_x0(kernel, p_data, t)
        R = _true_rates_all(kernel, t)  # (z, j, i)
        R_bar = torch.einsum("jz,zji->ji", post, R)
        xlogx = lambda x: torch.where(x > 0, x * torch.log(torch.where(x > 0, x, torch.ones_like(x))), 0.0)
        q_t = p_data @ kernel.marginal(torch.arange(S), _t(t))
        jensen = float((q_t[:, None] * (torch.einsum("jz,zji->ji", post, xlogx(R)) - xlogx(R_bar))).sum())
        scale = max(1.0, abs(cond))
        assert abs(gaps[0] - gaps[1]) <= 1e-13 * scale
        assert abs(gaps[0] - jensen) <= 1e-13 * scale
        assert gaps[0] >= -1e-13 * scale and jensen >= -1e-13 * scale


@pytest.mark.parametrize("kind", KINDS)
def test_numerical_optimum_is_the_marginal_reverse_rate(kind: str) -> None:
    """argmin over free log-rates of E[f(R̂(j, ·|X0), e^ℓ) | X_t = j] is R̂_t(j, i) = R_t(i, j) q_t(i)/q_t(j)."""
    worst = 0.0
    for kernel, S, g in ref.instances(kind, N, seed=42):
        t = ref.random_time(g)
        p_data = ref.random_distribution(kernel, g)
        post = _posterior_x0(kernel, p_data, t)
        rates = _true_rates_all(kernel, t)
        j = int(torch.randint(0, S, (1,), generator=g)) if kernel.mask_id is None else kernel.mask_id
        target = torch.tensor(ref.marginal_rates(kernel, p_data, j, t), dtype=DT)
        free = target > 0  # coordinates with a positive optimum (the others run off to −∞)
        x0 = torch.arange(S)
        true = uf.ReverseRate.true_conditional(kernel, x0, torch.full((S,), j), _t(t))
        weight = post[j]

        def objective(ell: torch.Tensor, S=S, free=free, j=j, weight=weight, true=true) -> torch.Tensor:
            row = torch.zeros(S, dtype=DT).masked_scatter(free, ell.exp())
            model = uf.ReverseRate(row.expand(S, S), torch.full((S,), j))
            return (weight * uf.bregman_rate_loss(true, model)).sum()

        ell = torch.zeros(int(free.sum()), dtype=DT)
        for _ in range(50):  # Newton on a separable strictly convex objective
            ell_ = ell.clone().requires_grad_(True)
            (grad,) = torch.autograd.grad(objective(ell_), ell_, create_graph=True)
            hess = torch.stack([torch.autograd.grad(grad[k], ell_, retain_graph=True)[0][k]
                                for k in range(len(grad))])
            step = (grad / hess).detach()
            ell = ell - step.clamp(-2.0, 2.0)
            if float(step.abs().max()) < 1e-15:
                break
        assert rates.shape == (S, S, S)
        worst = max(worst, ref.rel_err(ell.exp(), target[free]))
    assert worst <= 1e-8


def _reverse_generator(kernel: uf.Kernel, logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The model's reverse generator at times ``t (T,)``: ``(T, S, S)``, rows j from the x0 head at state j."""
    S = kernel.num_states
    ids = torch.arange(S)
    rates = uf.ReverseRate.from_x0_logits(kernel, logits.expand(len(t), S, S), ids.expand(len(t), S),
                                          t[:, None]).rates
    return rates - torch.diag_embed(rates.sum(-1))


@pytest.mark.parametrize("kind", KINDS)
def test_elbo_bound_holds_on_exhaustive_examples(kind: str) -> None:
    """Proposition 3.2, single position: integrate the model's reverse CTMC exactly from the prior at 1 − δ down to δ
    and check KL(q_{δ|0}(·|x0) ‖ ρ_δ) ≤ KL(q_{1−δ|0}(·|x0) ‖ ρ_{1−δ}) + ∫_δ^{1−δ} E_{x_t}[D_t] dt for every x0 (the
    proof's truncated inequality; as δ → 0 its left side is −log p_θ(x0))."""
    delta, steps = 1e-3, 600
    u = torch.linspace(0.0, 1.0, steps + 1, dtype=DT)
    grid = delta + (1 - 2 * delta) * (1 - torch.cos(torch.pi * u)) / 2  # dense near both ends
    mid, width = (grid[1:] + grid[:-1]) / 2, grid[1:] - grid[:-1]
    for kernel, S, g in ref.instances(kind, 4, seed=43, s_range=(3, 5)):
        logits = ref.random_logits((S, S), g)
        clean = torch.tensor(ref.clean_states(kernel))
        uniform_clean = torch.zeros(S, dtype=DT).index_fill(0, clean, 1.0 / len(clean))
        prior = kernel.marginal(uniform_clean, _t(1 - delta))  # the prior at the truncated terminal time
        gen = _reverse_generator(kernel, logits, mid)  # (steps, S, S)
        step_maps = torch.linalg.matrix_exp(width[:, None, None] * gen)  # exponential midpoint rule
        rho = prior.clone()
        for k in reversed(range(steps)):  # backwards in time: ρ_{t−h} = ρ_t exp(h R̂^θ)
            rho = rho @ step_maps[k]
        # E_{x_t ~ q_{t|0}(·|x0)}[D_t(x_t, x0)] for every x0 (z) and midpoint at once: (steps, z, j)
        Z = len(clean)
        x0 = clean[None, :, None].expand(steps, Z, S)
        x_t = torch.arange(S)[None, None, :].expand(steps, Z, S)
        q_mid = kernel.marginal(clean[None, :], mid[:, None])  # (steps, Z, S)
        d_t = uf.losses.gidd_loss(logits.expand(steps, Z, S, S), x0, x_t, mid[:, None, None], kernel)
        d_t = torch.where(q_mid > 0, d_t, torch.zeros_like(d_t))
        integral = (width[:, None] * (q_mid * d_t).sum(-1)).sum(0)  # (Z,)
        kl = lambda p, q: torch.where(p > 0, p * (p.log() - q.log()), torch.zeros_like(p)).sum(-1)
        lhs = kl(kernel.marginal(clean, _t(delta)), rho)
        rhs = kl(kernel.marginal(clean, _t(1 - delta)), prior) + integral
        assert bool((lhs <= rhs).all()), f"ELBO violated: {lhs} > {rhs}"
        assert abs(float(rho.sum()) - 1.0) <= 1e-10

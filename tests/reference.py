"""Naive float64 dense references for the core tests (independent of unifusion's code paths).

Everything here reads only a kernel's *parameters* (``num_states``, ``mask_id``, the schedule's type and ``eps``,
``p_uniform``, ``gamma``, the generator matrix) and rebuilds the chain from the paper's definitions:

* P_{0,t} ``(S, S)`` in closed form (interpolating kernels, eq. (mixture) / GIDD) or by ``matrix_exp`` (generator form);
* the forward generator R_t = P_{0,t}^{-1} ∂_t P_{0,t} (Definition 2.2's ODE ∂_t P_{0,t} = P_{0,t} R_t), with ∂_t by
  autograd of the closed form — so the library's rank-one rate formulas are checked against a derivation they do
  not share;
* rates and losses by their literal formulas (§2, Theorem 3.3, App. A) with Python loops over states.

Also the random-instance factory shared by the tests (kernels of every kind, heads, data distributions).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import mpmath
import torch

import unifusion as uf

mpmath.mp.dps = 40  # the scalar loss formulas below cancel near their optimum: evaluate them in 40 digits
_mpf, _log = mpmath.mpf, mpmath.log

DT = torch.float64
KINDS = ("uniform", "mask", "hybrid", "generator", "generator_scheduled")


# ---------------------------------------------------------------------------------------------------------- factory
def random_schedule(gen: torch.Generator) -> uf.schedules.Schedule:
    k = int(torch.randint(0, 3, (1,), generator=gen))
    if k == 0:
        return uf.schedules.LinearSchedule()
    if k == 1:
        return uf.schedules.CosineSchedule()
    return uf.schedules.LogLinearSchedule(eps=float(10 ** (-1 - 3 * torch.rand((), generator=gen, dtype=DT))))


def random_generator_matrix(S: int, gen: torch.Generator) -> torch.Tensor:
    """Dense R̄ ``(S, S)``: positive off-diagonal rates, rows summing to 0."""
    R = torch.rand(S, S, generator=gen, dtype=DT) * 2.0 + 0.05
    R.fill_diagonal_(0.0)
    R -= torch.diag(R.sum(-1))
    return R


def random_kernel(kind: str, S: int, gen: torch.Generator) -> uf.Kernel:
    mask_id = int(torch.randint(0, S, (1,), generator=gen))
    if kind == "uniform":
        return uf.UniformKernel(S, random_schedule(gen))
    if kind == "mask":
        return uf.MaskKernel(S, mask_id, random_schedule(gen))
    if kind == "hybrid":
        p_u = float(torch.rand((), generator=gen, dtype=DT)) * 0.9
        gamma = 0.2 + 1.8 * float(torch.rand((), generator=gen, dtype=DT))
        return uf.HybridKernel(S, mask_id, p_uniform=p_u, gamma=gamma)
    if kind == "generator":
        return uf.GeneratorKernel(random_generator_matrix(S, gen))
    if kind == "generator_scheduled":
        return uf.GeneratorKernel(random_generator_matrix(S, gen), schedule=random_schedule(gen))
    raise ValueError(kind)


def instances(kind: str, n: int, seed: int, s_range: tuple[int, int] = (3, 8)):
    """Yield ``n`` (kernel, S, generator) triples of one kind with S uniform in ``s_range`` (inclusive)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        S = int(torch.randint(s_range[0], s_range[1] + 1, (1,), generator=gen))
        yield random_kernel(kind, S, gen), S, gen


def clean_states(kernel: uf.Kernel) -> list[int]:
    return [k for k in range(kernel.num_states) if k != kernel.mask_id]


def random_distribution(kernel: uf.Kernel, gen: torch.Generator) -> torch.Tensor:
    """A random distribution over clean states ``(S,)`` float64 (0 on the mask), all clean entries positive."""
    w = torch.exp(2.0 * torch.randn(kernel.num_states, generator=gen, dtype=DT))
    if kernel.mask_id is not None:
        w[kernel.mask_id] = 0.0
    return w / w.sum()


def random_logits(shape: tuple[int, ...], gen: torch.Generator, scale: float = 2.0) -> torch.Tensor:
    return scale * torch.randn(*shape, generator=gen, dtype=DT)


def random_time(gen: torch.Generator, lo: float = 0.05, hi: float = 0.95) -> float:
    return lo + (hi - lo) * float(torch.rand((), generator=gen, dtype=DT))


# ---------------------------------------------------------------------------------------------------------- schedules
def alpha_fn(schedule: uf.schedules.Schedule) -> Callable[[torch.Tensor], torch.Tensor]:
    """α_t of a schedule from its textbook definition (by type, not by calling the library)."""
    name = type(schedule).__name__
    if name == "LinearSchedule":
        return lambda t: 1.0 - t
    if name == "CosineSchedule":
        return lambda t: torch.cos(0.5 * math.pi * t)
    if name == "LogLinearSchedule":
        eps = schedule.eps
        # α = e^{−σ(t)} with σ(t) = −log(1 − (1−ε)t)
        return lambda t: torch.exp(torch.log(1.0 - (1.0 - eps) * t))
    if name == "GeometricSchedule":  # SEDD: α = e^{−σ}, σ(t) = σ_min^{1−t} σ_max^t
        lo, hi = schedule.sigma_min, schedule.sigma_max
        return lambda t: torch.exp(-(lo ** (1.0 - t)) * hi**t)
    if name == "MDLMCosineSchedule":  # MDLM: α = ε + (1 − ε) cos(π t / 2)
        eps = schedule.eps
        return lambda t: eps + (1.0 - eps) * torch.cos(0.5 * math.pi * t)
    if name == "DUOCosineSchedule":  # DUO: α = 1 − sin(π (1 − ε) t / 2)
        eps = schedule.eps
        return lambda t: 1.0 - torch.sin(0.5 * math.pi * (1.0 - eps) * t)
    raise TypeError(name)


def derivative(fn: Callable[[torch.Tensor], torch.Tensor], t: float) -> torch.Tensor:
    """d fn / dt at t by autograd (exact to rounding), fn: scalar → any shape."""
    return torch.autograd.functional.jacobian(fn, torch.tensor(float(t), dtype=DT))


# ---------------------------------------------------------------------------------------------------------- dense chain
def transition_fn(kernel: uf.Kernel) -> Callable[[torch.Tensor], torch.Tensor]:
    """t ↦ P_{0,t} ``(S, S)``, rows = from-state, built from the definitions."""
    S = kernel.num_states
    eye = torch.eye(S, dtype=DT)
    ones = torch.ones(S, 1, dtype=DT)
    if isinstance(kernel, uf.GeneratorKernel):
        R_bar = kernel.generator.to(DT)
        if kernel.schedule is None:
            return lambda t: torch.linalg.matrix_exp(t * R_bar)
        alpha = alpha_fn(kernel.schedule)
        return lambda t: torch.linalg.matrix_exp(-torch.log(alpha(t)) * R_bar)
    if isinstance(kernel, uf.HybridKernel):
        m_id, p_u, gamma = kernel.mask_id, kernel.p_uniform, kernel.gamma
        e_m = torch.zeros(S, dtype=DT)
        e_m[m_id] = 1.0
        u = torch.ones(S, dtype=DT) / (S - 1)
        u[m_id] = 0.0

        def P_hybrid(t: torch.Tensor) -> torch.Tensor:
            c = 2.0**gamma * p_u / (1.0 - p_u) * (t * (1.0 - t)) ** (gamma / 2.0)
            alpha = (1.0 - t) / (1.0 + c)
            m = (t * e_m + c * u) / (1.0 + c)
            return alpha * eye + ones * m
        return P_hybrid
    alpha = alpha_fn(kernel.schedule)
    if isinstance(kernel, uf.MaskKernel):
        pi = torch.zeros(S, dtype=DT)
        pi[kernel.mask_id] = 1.0
    elif isinstance(kernel, uf.UniformKernel):
        pi = torch.full((S,), 1.0 / S, dtype=DT)
    else:
        raise TypeError(type(kernel).__name__)
    return lambda t: alpha(t) * eye + (1.0 - alpha(t)) * ones * pi


def P0(kernel: uf.Kernel, t: float) -> torch.Tensor:
    """P_{0,t} ``(S, S)``: q_{t|0}(j|i) = P[i, j]."""
    return _P0_cached(kernel, float(t)).clone()


@functools.lru_cache(maxsize=4096)
def _P0_cached(kernel: uf.Kernel, t: float) -> torch.Tensor:
    return transition_fn(kernel)(torch.tensor(t, dtype=DT))


def Pst(kernel: uf.Kernel, s: float, t: float) -> torch.Tensor:
    """P_{s,t}: exp((σ(t) − σ(s)) R̄) in generator form, else P_{0,s}^{-1} P_{0,t} (invertible for s < 1)."""
    if isinstance(kernel, uf.GeneratorKernel):
        if kernel.schedule is None:
            sigma = lambda u: u
        else:
            alpha = alpha_fn(kernel.schedule)
            sigma = lambda u: -math.log(float(alpha(torch.tensor(u, dtype=DT))))
        return torch.linalg.matrix_exp((sigma(t) - sigma(s)) * kernel.generator.to(DT))
    return torch.linalg.solve(P0(kernel, s), P0(kernel, t))


def rate_matrix(kernel: uf.Kernel, t: float) -> torch.Tensor:
    """R_t ``(S, S)`` (cached; see :func:`_rate_matrix`)."""
    return _rate_matrix_cached(kernel, float(t)).clone()


@functools.lru_cache(maxsize=4096)
def _rate_matrix_cached(kernel: uf.Kernel, t: float) -> torch.Tensor:
    return _rate_matrix(kernel, t)


def _rate_matrix(kernel: uf.Kernel, t: float) -> torch.Tensor:
    """R_t = P_{0,t}^{-1} ∂_t P_{0,t} ``(S, S)`` (σ'(t) R̄ for generator kernels); off-diagonal entries cleaned of
    rounding, diagonal = −row sums."""
    if isinstance(kernel, uf.GeneratorKernel):
        # generator form: R_t = σ'(t) R̄ with σ(t) = t or −log α_t (P^{-1}Ṗ is ill-conditioned near stationarity)
        if kernel.schedule is None:
            R = kernel.generator.to(DT).clone()
        else:
            alpha = alpha_fn(kernel.schedule)
            R = derivative(lambda u: -torch.log(alpha(u)), t) * kernel.generator.to(DT)
    else:
        fn = transition_fn(kernel)
        P = fn(torch.tensor(float(t), dtype=DT))
        R = torch.linalg.solve(P, derivative(fn, t))
    S = kernel.num_states
    for i in range(S):
        for j in range(S):
            if i != j and abs(R[i, j]) < 1e-13 * max(1.0, float(R.abs().max())):
                R[i, j] = 0.0
        R[i, i] = 0.0
        R[i, i] = -R[i].sum()
    return R


def alpha_prime_over(kernel: uf.Kernel, t: float) -> tuple[float, float]:
    """(α_t, α_t') of an interpolating kernel with a schedule (autograd of the textbook α)."""
    a = alpha_fn(kernel.schedule)
    return float(a(torch.tensor(float(t), dtype=DT))), float(derivative(a, t))


# ---------------------------------------------------------------------------------------------------------- rates
def f(r: float, c: float) -> float:
    """Bregman divergence of u log u with Definition 3.1's boundary cases."""
    if r == 0.0:
        return c
    if c == 0.0:
        return math.inf
    r, c = _mpf(r), _mpf(c)
    return float(r * _log(r / c) - r + c)


def x0_probs_from_logits(kernel: uf.Kernel, logits: torch.Tensor) -> torch.Tensor:
    """softmax over clean states (mask entry 0), float64, 1-D."""
    z = logits.to(DT).clone()
    if kernel.mask_id is not None:
        z[kernel.mask_id] = -math.inf
    return torch.softmax(z, -1)


def true_rates(kernel: uf.Kernel, x0: int, j: int, t: float) -> list[float]:
    """R̂_t(j, i | x0) = R_t(i, j) q_{t|0}(i|x0) / q_{t|0}(j|x0) for every i (0 at i = j or q(j|x0) = 0)."""
    P, R = P0(kernel, t), rate_matrix(kernel, t)
    S = kernel.num_states
    out = [0.0] * S
    if P[x0, j] <= 0:
        return out
    for i in range(S):
        if i != j:
            out[i] = float(R[i, j] * P[x0, i] / P[x0, j])
    return out


def x0_rates(kernel: uf.Kernel, x_theta: torch.Tensor, j: int, t: float) -> list[float]:
    """R̂_t(j, i | x_θ) = R_t(i, j) q_t(i|x_θ) / q_t(j|x_θ), q_t(k|x_θ) = Σ_z x_θ(z) q_{t|0}(k|z)."""
    P, R = P0(kernel, t), rate_matrix(kernel, t)
    S = kernel.num_states
    q = [sum(float(x_theta[z]) * float(P[z, k]) for z in range(S)) for k in range(S)]
    return [0.0 if (i == j or q[j] <= 0) else float(R[i, j]) * q[i] / q[j] for i in range(S)]


def score_rates(kernel: uf.Kernel, score: torch.Tensor, j: int, t: float) -> list[float]:
    R = rate_matrix(kernel, t)
    return [0.0 if i == j else float(R[i, j]) * float(score[i]) for i in range(kernel.num_states)]


def b_operator(kernel: uf.Kernel, mu: torch.Tensor, j: int, t: float) -> list[float]:
    """(B_{j,t} μ)_i = Σ_z μ(z) q_{t|0}(i|z) / q_{t|0}(j|z) (z over μ's support)."""
    P = P0(kernel, t)
    S = kernel.num_states
    return [sum(float(mu[z]) * float(P[z, i]) / float(P[z, j]) for z in range(S) if mu[z] > 0) for i in range(S)]


def m2s_rates(kernel: uf.Kernel, mu: torch.Tensor, j: int, t: float) -> list[float]:
    R = rate_matrix(kernel, t)
    if all(float(R[i, j]) == 0.0 for i in range(kernel.num_states) if i != j):
        return [0.0] * kernel.num_states
    s = b_operator(kernel, mu, j, t)
    return [0.0 if i == j else float(R[i, j]) * s[i] for i in range(kernel.num_states)]


def marginal_rates(kernel: uf.Kernel, p_data: torch.Tensor, j: int, t: float) -> list[float]:
    """R̂_t(j, i) = R_t(i, j) q_t(i) / q_t(j) with q_t = p_data P_{0,t}."""
    return x0_rates(kernel, p_data, j, t)


def rate_divergence(true: list[float], model: list[float], j: int) -> float:
    """D_t = Σ_{i≠j} f(true_i, model_i)."""
    return float(sum(_mpf(f(true[i], model[i])) for i in range(len(true)) if i != j))


# ---------------------------------------------------------------------------------------------------- losses (App. A)
def sedd_loss(log_score: torch.Tensor, x0: int, j: int, t: float, kernel: uf.Kernel) -> float:
    """Σ_{y≠x_t} Q_t(x_t, y) (s_y − r_y log s_y + K(r_y)), Q_t = R_tᵀ, K(a) = a(log a − 1)."""
    P, R = P0(kernel, t), rate_matrix(kernel, t)
    total = 0.0
    for y in range(kernel.num_states):
        if y == j:
            continue
        Q = float(R[y, j])
        if Q == 0.0:
            continue
        r = _mpf(float(P[x0, y])) / _mpf(float(P[x0, j]))
        s = mpmath.exp(_mpf(float(log_score[y])))
        K = 0 if r == 0 else r * (_log(r) - 1)
        total += Q * (s - r * _log(s) + K)
    return float(total)


def mdlm_loss(logits: torch.Tensor, x0: int, j: int, t: float, kernel: uf.MaskKernel) -> float:
    """(α_t'/(1 − α_t)) log x_θ(x0) at a masked x_t, 0 elsewhere."""
    if j != kernel.mask_id:
        return 0.0
    a, da = alpha_prime_over(kernel, t)
    x = x0_probs_from_logits(kernel, logits)
    return da / (1.0 - a) * math.log(float(x[x0]))


def gidd_loss(logits: torch.Tensor, x0: int, j: int, t: float, kernel: uf.Kernel) -> float:
    """w_t(z_t, x) [KL(q_t(·|x) ‖ q_t(·|x_θ)) + ρ − log ρ − 1], w = (β_t π_t' − (α_t'/α_t) π_t)(z_t)/q_t(z_t|x).

    α_t, β_t π_t and their derivatives come from the interpolating closed form (autograd); interpolating kernels only.
    """
    S = kernel.num_states
    fn = transition_fn(kernel)
    tt = torch.tensor(float(t), dtype=DT)
    # α_t = P[a, a] − P[b, a] for a ≠ b; β_t π_t(k) = P[a, k] for a ≠ k (take a row that is not k)
    def alpha(t_: torch.Tensor) -> torch.Tensor:
        P = fn(t_)
        return P[0, 0] - P[1, 0]

    def beta_pi(t_: torch.Tensor) -> torch.Tensor:
        P = fn(t_)
        return torch.stack([P[(k + 1) % S, k] for k in range(S)])

    a, da = float(alpha(tt)), float(derivative(alpha, t))
    m, dm = beta_pi(tt), derivative(beta_pi, t)
    beta = 1.0 - a
    pi, dpi = m / beta, (dm * beta + m * da) / beta**2  # π = m/β, β' = −α'
    P = fn(tt)
    q0 = P[x0]
    x = x0_probs_from_logits(kernel, logits)
    q_theta = x @ P
    if float(q0[j]) == 0.0:
        raise ValueError("x_t impossible under x0")
    w = (beta * float(dpi[j]) - da / a * float(pi[j])) / float(q0[j])
    kl = sum(_mpf(float(q0[k])) * _log(_mpf(float(q0[k])) / float(q_theta[k])) for k in range(S) if q0[k] > 0)
    rho = _mpf(float(q0[j])) / float(q_theta[j])
    return float(w * (kl + rho - _log(rho) - 1))


def m2s_loss(mu_logits: torch.Tensor, x0: int, j: int, t: float, kernel: uf.Kernel) -> float:
    """Σ_{y≠x_t} R_t(y, x_t) h(s_y, r_y), s = B_{x_t,t} μ, h(s, r) = s − r log s + r log r − r, h(s, 0) = s."""
    P, R = P0(kernel, t), rate_matrix(kernel, t)
    mu = x0_probs_from_logits(kernel, mu_logits)
    if all(float(R[y, j]) == 0.0 for y in range(kernel.num_states) if y != j):
        return 0.0
    s = b_operator(kernel, mu, j, t)
    total = 0.0
    for y in range(kernel.num_states):
        if y == j or float(R[y, j]) == 0.0:
            continue
        r = _mpf(float(P[x0, y])) / _mpf(float(P[x0, j]))
        sy = _mpf(s[y])
        h = sy if r == 0 else sy - r * _log(sy) + r * _log(r) - r
        total += float(R[y, j]) * h
    return float(total)


def ctmc_loss(log_exit_rate: float, jump_logits: torch.Tensor, x0: int, j: int, t: float,
              kernel: uf.Kernel) -> float:
    """KL_Poi(λ̂ ‖ λ_θ) + λ̂ KL_Cat(r̂ ‖ r_θ), r_θ = softmax of the jump logits over i ≠ x_t."""
    S = kernel.num_states
    true = true_rates(kernel, x0, j, t)
    lam_hat = sum(true)
    lam = math.exp(log_exit_rate)
    z = jump_logits.to(DT).clone()
    z[j] = -math.inf
    r_theta = torch.softmax(z, -1)
    if lam_hat == 0:
        return lam
    lam_hat_mp = sum(_mpf(v) for v in true)
    poisson = lam_hat_mp * _log(lam_hat_mp / lam) - lam_hat_mp + lam
    cat = sum(true[i] / lam_hat_mp * _log(true[i] / lam_hat_mp / float(r_theta[i]))
              for i in range(S) if i != j and true[i] > 0)
    return float(poisson + lam_hat_mp * cat)


# ---------------------------------------------------------------------------------------------------------- errors
def rel_err(a: torch.Tensor | float, b: torch.Tensor | float) -> float:
    """max |a − b| / max(|b|, tiny) over all entries (scale of the reference)."""
    a = torch.as_tensor(a, dtype=DT)
    b = torch.as_tensor(b, dtype=DT)
    scale = float(b.abs().max()) if b.numel() else 0.0
    return float((a - b).abs().max()) / max(scale, 1e-300) if b.numel() else 0.0

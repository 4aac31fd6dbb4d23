"""nll_bound (Proposition 3.2) against exact computations on tiny exhaustive state spaces.

Everything is enumerable for S ≤ 4 states and L ≤ 2 positions (≤ 16 sequences):

* the exact −log p_θ(x0) of the model's reverse CTMC: the sequence-level reverse generator (rates from
  ``ReverseRate.from_x0_logits`` per position) is integrated from the prior at t ≈ 1 down to t = 0 with matrix
  exponentials on a fine grid;
* the exact bound: ∫ Σ_{x_t} q(x_t|x0) Σ_i D_t^i dt + C_ELBO by Gauss–Legendre quadrature, D_t from
  ``bregman_rate_loss`` (Definition 3.1 directly, not gidd_loss).

Then: bound ≥ exact NLL for a random head; the rate-optimal head x_θ^i = p_data(x0^i | x_t^{−i}) makes both equal
−log p_data(x0); nll_bound's Monte Carlo estimate matches the exact bound within its standard error.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

import unifusion as uf
from unifusion.eval import nll_bound
from unifusion.eval.likelihood import prior_kl

L = 2


def _kernel(kind: str) -> uf.Kernel:
    if kind == "uniform":
        return uf.UniformKernel(3)
    if kind == "mask":
        return uf.MaskKernel(4, mask_id=3)
    return uf.HybridKernel(4, mask_id=3, p_uniform=0.3)


def _states(S: int) -> torch.Tensor:
    return torch.tensor(list(itertools.product(range(S), repeat=L)), dtype=torch.long)  # (S^L, L)


def _index(x: torch.Tensor, S: int) -> torch.Tensor:
    return x[..., 0] * S + x[..., 1]


class TableModel:
    """A random x0 head: logits = A[x_t] + t·C[x_t] (depends on the whole sequence and on t)."""

    def __init__(self, S: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.S = S
        self.A = 1.5 * torch.randn(S**L, L, S, generator=g, dtype=torch.float64)
        self.C = torch.randn(S**L, L, S, generator=g, dtype=torch.float64)

    def __call__(self, x_t: torch.Tensor, t: torch.Tensor, **_: object) -> torch.Tensor:
        idx = _index(x_t, self.S)
        return self.A[idx] + t.double()[:, None, None] * self.C[idx]


class OptimalModel:
    """The rate-optimal x0 head for data p_data: x_θ^i(y | x_t) = p_data(x0^i = y | x_t^{−i})."""

    def __init__(self, kernel: uf.Kernel, p_data: torch.Tensor, clean: int) -> None:
        self.kernel, self.p_data, self.clean = kernel, p_data, clean
        self.x0s = _states(clean)  # (clean^L, L)

    def __call__(self, x_t: torch.Tensor, t: torch.Tensor, **_: object) -> torch.Tensor:
        B, S = x_t.shape[0], self.kernel.num_states
        q = self.kernel.marginal(self.x0s[None], t.double()[:, None, None])  # (B, N0, L, S): q_{t|0}(·|x0^j)
        lik = q.gather(-1, x_t[:, None, :, None].expand(B, len(self.x0s), L, 1)).squeeze(-1)  # (B, N0, L)
        out = torch.full((B, L, S), -1e30, dtype=torch.float64)
        for i in range(L):
            w = self.p_data * lik[..., [j for j in range(L) if j != i]].prod(-1)  # p(x0) Π_{j≠i} q(x_t^j|x0^j)
            post = torch.zeros(B, self.clean, dtype=torch.float64).index_add_(1, self.x0s[:, i], w)
            out[:, i, : self.clean] = torch.log(post / post.sum(-1, keepdim=True))
        return out


def exact_nll(model, kernel: uf.Kernel, x0: torch.Tensor) -> float:
    """−log p_θ(x0) of the reverse CTMC, by matrix exponentials on a fine grid from t = 1 − 1e-6 to 0."""
    S = kernel.num_states
    X = _states(S)  # (N, L)
    N = X.shape[0]
    grid = np.unique(np.concatenate([np.linspace(0.0, 0.99, 800), 1.0 - np.logspace(-2, -6, 200)]))[::-1]
    mids = torch.tensor(0.5 * (grid[:-1] + grid[1:]), dtype=torch.float64)  # (T,)
    h = torch.tensor(grid[:-1] - grid[1:], dtype=torch.float64)
    T = len(mids)
    logits = model(X.repeat(T, 1), mids.repeat_interleave(N)).reshape(T, N, L, S)
    rate = uf.ReverseRate.from_x0_logits(kernel, logits, X, mids[:, None, None]).rates  # (T, N, L, S)
    Qs = torch.zeros(T, N, N, dtype=torch.float64)
    for i in range(L):
        for y in range(S):
            Y = X.clone()
            Y[:, i] = y
            Qs[:, torch.arange(N), _index(Y, S)] += torch.where(X[:, i] == y, 0.0, rate[:, :, i, y])
    Qs -= torch.diag_embed(Qs.sum(-1))
    P = torch.linalg.matrix_exp(h[:, None, None] * Qs)
    prior = kernel.prior(None, dtype=torch.float64)
    rho = (prior[X[:, 0]] * prior[X[:, 1]]).unsqueeze(0)  # (1, N), product prior
    for Pn in P:
        rho = rho @ Pn
    return -math.log(float(rho[0, _index(x0, S)]))


def exact_bound(model, kernel: uf.Kernel, x0: torch.Tensor, nodes: int = 200) -> float:
    """∫_0^1 Σ_{x_t} q(x_t|x0) Σ_i D_t^i dt + C_ELBO with D_t from Definition 3.1 (bregman_rate_loss)."""
    S = kernel.num_states
    X = _states(S)
    N = X.shape[0]
    z, w = np.polynomial.legendre.leggauss(nodes)
    total = 0.0
    for zn, wn in zip(z, w):
        t = torch.tensor(0.5 * (zn + 1.0), dtype=torch.float64)
        q = kernel.marginal(x0, t)  # (L, S)
        q_seq = q[0, X[:, 0]] * q[1, X[:, 1]]  # (N,)
        logits = model(X, t.expand(N))
        x0_rows = x0.expand(N, L)
        D = uf.bregman_rate_loss(uf.ReverseRate.true_conditional(kernel, x0_rows, X, t),
                                 uf.ReverseRate.from_x0_logits(kernel, logits, X, t))  # (N, L)
        D = torch.where(q_seq[:, None] > 0, D, torch.zeros_like(D))
        total += 0.5 * wn * float((q_seq * D.sum(-1)).sum())
    return total + float(prior_kl(kernel, x0).sum())


def _p_data(clean: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    p = torch.rand(clean**L, generator=g, dtype=torch.float64) + 0.2
    return p / p.sum()


@pytest.mark.parametrize("kind", ["uniform", "mask", "hybrid"])
def test_bound_dominates_exact_nll_for_a_random_head(kind: str) -> None:
    kernel = _kernel(kind)
    model = TableModel(kernel.num_states, seed=1)
    x0 = torch.tensor([1, 0])
    nll = exact_nll(model, kernel, x0)
    bound = exact_bound(model, kernel, x0)
    assert bound >= nll - 1e-4
    assert bound - nll > 1e-2  # a random head is far from optimal: the gap is real, not rounding


@pytest.mark.parametrize("kind", ["uniform", "mask"])
def test_rate_optimal_head_makes_the_bound_tight(kind: str) -> None:
    kernel = _kernel(kind)
    clean = 3
    p_data = _p_data(clean)
    model = OptimalModel(kernel, p_data, clean)
    x0 = torch.tensor([2, 1])
    target = -math.log(float(p_data[_index(x0, clean)]))
    assert exact_nll(model, kernel, x0) == pytest.approx(target, abs=2e-3)
    assert exact_bound(model, kernel, x0) == pytest.approx(target, abs=2e-3)


@pytest.mark.parametrize("kind", ["uniform", "mask"])
def test_monte_carlo_estimate_matches_exact_bound(kind: str) -> None:
    kernel = _kernel(kind)
    model = TableModel(kernel.num_states, seed=3)
    x0 = torch.tensor([0, 2])
    reference = exact_bound(model, kernel, x0)
    g = torch.Generator().manual_seed(0)
    est = nll_bound(model, x0.expand(3000, L).clone(), kernel, num_times=8, generator=g, per_token=False)
    assert est.shape == (3000,) and est.dtype == torch.float64
    se = float(est.std()) / math.sqrt(est.numel())
    assert abs(float(est.mean()) - reference) < 4 * se + 1e-3
    # per-token is the sequence bound / L
    g = torch.Generator().manual_seed(0)
    per_tok = nll_bound(model, x0.expand(3000, L).clone(), kernel, num_times=8, generator=g)
    torch.testing.assert_close(per_tok, est / L)


def test_prior_kl_zero_when_chain_forgets_and_positive_otherwise() -> None:
    x0 = torch.tensor([[0, 3, 5]])
    assert torch.equal(prior_kl(uf.UniformKernel(8), x0), torch.zeros(1, 3, dtype=torch.float64))
    assert torch.equal(prior_kl(uf.MaskKernel(8, mask_id=7), x0), torch.zeros(1, 3, dtype=torch.float64))
    eps = 0.1
    kl = prior_kl(uf.UniformKernel(8, uf.schedules.LogLinearSchedule(eps)), x0)
    q_self = eps + (1 - eps) / 8
    q_other = (1 - eps) / 8
    expected = q_self * math.log(q_self * 8) + 7 * q_other * math.log(q_other * 8)
    torch.testing.assert_close(kl, torch.full((1, 3), expected, dtype=torch.float64))


def test_attention_mask_excludes_padding_and_is_passed_to_the_model() -> None:
    kernel = uf.UniformKernel(3)
    seen = {}

    class Recorder(TableModel):
        def __call__(self, x_t, t, attention_mask=None):
            seen.setdefault("masks", []).append(attention_mask)
            return super().__call__(x_t, t)

    model = Recorder(3, seed=2)
    x0 = torch.tensor([[1, 2], [1, 2]])
    mask = torch.tensor([[1, 1], [1, 0]])
    g = torch.Generator().manual_seed(0)
    out = nll_bound(model, x0, kernel, num_times=4, generator=g, attention_mask=mask, per_token=False)
    assert len(seen["masks"]) == 1 and torch.equal(seen["masks"][0], mask.repeat(4, 1))  # the 4 times in one call
    assert torch.isfinite(out).all() and (out > 0).all()
    seen.clear()
    nll_bound(model, x0, kernel, num_times=4, attention_mask=mask, batch_size=2)  # one time (2 rows) per call
    assert len(seen["masks"]) == 4 and all(torch.equal(m, mask) for m in seen["masks"])


def test_times_per_call_do_not_change_the_estimator() -> None:
    """Several times per model call (the default) or one: the same estimator — its mean over many sequences agrees
    within the Monte Carlo error, and every call gets one time per row."""
    kernel = uf.UniformKernel(4)
    model = TableModel(4, seed=3)
    x0 = torch.tensor([[1, 3]]).expand(2000, 2).clone()
    calls = []

    class Counting(TableModel):
        def __call__(self, x_t, t):
            calls.append(tuple(x_t.shape))
            assert t.shape == (x_t.shape[0],)
            return model(x_t, t)

    est = {}
    for batch_size in (None, 2000, 6000):
        calls.clear()
        est[batch_size] = nll_bound(Counting(4), x0, kernel, num_times=6, batch_size=batch_size,
                                    generator=torch.Generator().manual_seed(7), per_token=False)
        expected_calls = {None: 1, 2000: 6, 6000: 2}[batch_size]
        assert len(calls) == expected_calls and sum(c[0] for c in calls) == 6 * 2000
    for a in (2000, 6000):
        diff = (est[None].mean() - est[a].mean()).abs()
        sem = (est[None].var() / 2000 + est[a].var() / 2000).sqrt()
        assert diff < 5 * sem, (a, float(diff), float(sem))
    with pytest.raises(ValueError, match="batch_size"):
        nll_bound(model, x0, kernel, num_times=2, batch_size=0)


def test_bad_input() -> None:
    kernel = uf.UniformKernel(3)
    model = TableModel(3)
    x0 = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="num_times"):
        nll_bound(model, x0, kernel, num_times=0)
    with pytest.raises(TypeError, match="num_times"):
        nll_bound(model, x0, kernel, num_times=2.5)
    with pytest.raises(ValueError, match="x0"):
        nll_bound(model, torch.zeros(3, dtype=torch.long), kernel)
    with pytest.raises(ValueError, match="x0"):
        nll_bound(model, torch.full((1, 2), 5), kernel)
    with pytest.raises(ValueError, match="t_min"):
        nll_bound(model, x0, kernel, t_min=1.0)
    with pytest.raises(TypeError, match="kernel"):
        nll_bound(model, x0, "uniform")


class _Float32(TableModel):
    def __call__(self, x_t: torch.Tensor, t: torch.Tensor, **_: object) -> torch.Tensor:
        return super().__call__(x_t, t).float()


@pytest.mark.parametrize("kind", ["uniform", "mask", "hybrid"])
def test_the_fast_loss_gives_the_reference_bound(kind: str) -> None:
    """nll_bound runs D_t through the fast x0-head loss; ``reference=True`` runs the same times and corruptions (same
    generator state) through ``reference_gidd_loss``: the same bound to float64 rounding for float64 logits and to
    float32 rounding for float32 logits, per sequence and per token, with and without padding."""
    kernel = _kernel(kind)
    x0 = torch.randint(0, 3, (64, L), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(64, L, dtype=torch.long)
    mask[::3, 1] = 0
    # float32: a few float32 ulps of the sum (measured ≤ 1e-6 relative); float64: ~1e-15 (measured)
    for model, rtol, atol in ((TableModel(kernel.num_states, seed=4), 1e-12, 1e-12),
                              (_Float32(kernel.num_states, seed=4), 5e-6, 1e-6)):
        for kwargs in ({"per_token": False}, {"attention_mask": mask}):
            fast, ref = (nll_bound(model, x0, kernel, num_times=4, generator=torch.Generator().manual_seed(0),
                                   reference=reference, batch_size=128, **kwargs) for reference in (False, True))
            assert fast.dtype == ref.dtype == torch.float64 and bool((ref >= 0).all()) and bool((ref > 0).any())
            torch.testing.assert_close(fast, ref, rtol=rtol, atol=atol)
    with pytest.raises(TypeError, match="reference: expected a bool"):
        nll_bound(TableModel(kernel.num_states), x0, kernel, num_times=1, reference=1)  # type: ignore[arg-type]


def test_reference_is_the_swap_the_benchmark_makes(monkeypatch) -> None:
    """``reference=True`` is the module's loss swapped for ``reference_gidd_loss`` at one time per model call (0.1's
    schedule; the baseline benchmarks/nll_bound.py times): the same numbers as that swap with ``batch_size=B``."""
    from unifusion.eval import likelihood

    kernel = _kernel("mask")
    model = TableModel(kernel.num_states, seed=5)
    x0 = torch.randint(0, 3, (16, L), generator=torch.Generator().manual_seed(2))
    ref = nll_bound(model, x0, kernel, num_times=3, generator=torch.Generator().manual_seed(0), reference=True)
    monkeypatch.setattr(likelihood, "x0_head_loss", uf.losses.reference_gidd_loss)
    swapped = nll_bound(model, x0, kernel, num_times=3, generator=torch.Generator().manual_seed(0), batch_size=16)
    torch.testing.assert_close(swapped, ref, rtol=0, atol=0)

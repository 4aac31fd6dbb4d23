"""Tests for unifusion.conversions: Theorem 3.5's exact conversions of an x0 head."""

from __future__ import annotations

import pytest
import reference as ref
import torch
from reference import DT, KINDS

import unifusion as uf

N = 20
TOL = 1e-13


def _t(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=DT)


@pytest.mark.parametrize("kind", KINDS)
def test_conversions_reproduce_the_x0_rates(kind: str) -> None:
    """convert_x0_to(target) → matching ReverseRate constructor == ReverseRate.from_x0, and the outputs equal
    Theorem 3.5's formulas evaluated densely."""
    for kernel, S, g in ref.instances(kind, N, seed=20):
        t = ref.random_time(g)
        x_t = torch.arange(S)
        x_theta = torch.stack([ref.x0_probs_from_logits(kernel, z) for z in ref.random_logits((S, S), g)])
        target = uf.ReverseRate.from_x0(kernel, x_theta, x_t, _t(t))
        active = target.rates.sum(-1) > 0  # Theorem 3.5 speaks of nonzero induced rows

        rate = uf.convert_x0_to("rate", x_theta, kernel, x_t, _t(t))
        assert isinstance(rate, uf.ReverseRate)
        assert ref.rel_err(rate.rates, target.rates) <= TOL

        score = uf.convert_x0_to("sedd", x_theta, kernel, x_t, _t(t))
        assert ref.rel_err(uf.ReverseRate.from_score(kernel, score, x_t, _t(t)).rates, target.rates) <= TOL

        lam, jump = uf.convert_x0_to("ctmc", x_theta, kernel, x_t, _t(t))
        assert ref.rel_err(uf.ReverseRate.from_exit_jump(lam, jump, x_t).rates, target.rates) <= TOL
        torch.testing.assert_close(jump[active].sum(-1), torch.ones(int(active.sum()), dtype=DT), rtol=0,
                                   atol=1e-15)

        mu = uf.convert_x0_to("m2s", x_theta, kernel, x_t, _t(t), strict=kernel.mask_id is None)
        m2s = uf.ReverseRate.from_posterior_mean(kernel, mu, x_t, _t(t))
        assert ref.rel_err(m2s.rates, target.rates) <= TOL

        P = ref.P0(kernel, t)
        for j in range(S):
            q = x_theta[j] @ P
            assert ref.rel_err(score[j], q / q[j]) <= TOL  # s_i = q_t(i|x_θ)/q_t(j|x_θ)
            if all(float(P[z, j]) > 0 for z in ref.clean_states(kernel)):
                mu_ref = x_theta[j] * P[:, j] / q[j]  # μ(z) = x_θ(z) q_{t|0}(j|z)/q_t(j|x_θ)
                assert ref.rel_err(mu[j], mu_ref) <= TOL
                b_mu = torch.tensor(ref.b_operator(kernel, mu[j], j, t), dtype=DT)
                off = torch.arange(S) != j
                assert ref.rel_err(b_mu[off], (q / q[j])[off]) <= TOL  # (B_{j,t} μ)_i = s_i
                torch.testing.assert_close(mu[j].sum(), _t(1.0), rtol=0, atol=1e-15)


def test_m2s_is_undefined_at_unreachable_states() -> None:
    kernel = uf.MaskKernel(5, 0)
    x_theta = torch.softmax(torch.randn(5, 5, dtype=DT).index_fill(-1, torch.tensor([0]), -torch.inf), -1)
    x_t = torch.arange(5)
    with pytest.raises(ValueError, match="x_t"):
        uf.convert_x0_to("m2s", x_theta, kernel, x_t, 0.5)
    mu = uf.convert_x0_to("m2s", x_theta, kernel, x_t, 0.5, strict=False)
    torch.testing.assert_close(mu[1:], torch.eye(5, dtype=DT)[1:])  # μ = e_{x_t} on unreachable rows
    # at the mask state μ is the posterior over clean tokens: x_θ itself (q_{t|0}(m|z) is the same for all z)
    torch.testing.assert_close(mu[0], x_theta[0], rtol=1e-15, atol=0)
    with uf.validation.validation(False):  # the reachability check reads values: skipped without validation
        uf.convert_x0_to("m2s", x_theta, kernel, x_t, 0.5)


def test_unknown_target() -> None:
    with pytest.raises(ValueError, match="target"):
        uf.convert_x0_to("score", torch.full((3,), 1 / 3), uf.UniformKernel(3), torch.tensor(0), 0.5)

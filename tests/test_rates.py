"""Tests for unifusion.rates: every ReverseRate constructor against the literal §2 / Theorem 3.3 formulas."""

from __future__ import annotations

import pytest
import reference as ref
import torch
from reference import DT, KINDS

import unifusion as uf

N = 20
TOL = 1e-13  # relative to the largest reference rate of the row


def _t(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=DT)


@pytest.mark.parametrize("kind", KINDS)
def test_true_conditional_rates(kind: str) -> None:
    for kernel, S, g in ref.instances(kind, N, seed=10):
        t = ref.random_time(g)
        x0 = torch.tensor(ref.clean_states(kernel)).repeat_interleave(S)  # every (x0, j) pair
        x_t = torch.arange(S).repeat(len(ref.clean_states(kernel)))
        rate = uf.ReverseRate.true_conditional(kernel, x0, x_t, _t(t))
        for n in range(len(x0)):
            expected = ref.true_rates(kernel, int(x0[n]), int(x_t[n]), t)
            assert ref.rel_err(rate.rates[n], expected) <= TOL
        torch.testing.assert_close(rate.log_rates.exp(), rate.rates, rtol=1e-15, atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_x0_score_posterior_mean_and_exit_jump_rates(kind: str) -> None:
    for kernel, S, g in ref.instances(kind, N, seed=11):
        t = ref.random_time(g)
        x_t = torch.arange(S)
        logits = ref.random_logits((S, S), g)
        x_theta = torch.stack([ref.x0_probs_from_logits(kernel, logits[j]) for j in range(S)])
        score = torch.exp(ref.random_logits((S, S), g))
        mu = torch.stack([ref.x0_probs_from_logits(kernel, z) for z in ref.random_logits((S, S), g)])
        lam = torch.exp(ref.random_logits((S,), g))
        jump = torch.softmax(ref.random_logits((S, S), g).scatter(-1, x_t[:, None], -torch.inf), -1)
        from_x0 = uf.ReverseRate.from_x0(kernel, x_theta, x_t, _t(t))
        from_logits = uf.ReverseRate.from_x0_logits(kernel, logits, x_t, _t(t))
        from_score = uf.ReverseRate.from_score(kernel, score, x_t, _t(t))
        from_mu = uf.ReverseRate.from_posterior_mean(kernel, mu, x_t, _t(t))
        from_ctmc = uf.ReverseRate.from_exit_jump(lam, jump, x_t)
        for j in range(S):
            expected = ref.x0_rates(kernel, x_theta[j], j, t)
            assert ref.rel_err(from_x0.rates[j], expected) <= TOL
            assert ref.rel_err(from_logits.rates[j], expected) <= TOL
            assert ref.rel_err(from_score.rates[j], ref.score_rates(kernel, score[j], j, t)) <= TOL
            reachable = all(float(ref.P0(kernel, t)[z, j]) > 0 for z in ref.clean_states(kernel))
            if reachable:
                assert ref.rel_err(from_mu.rates[j], ref.m2s_rates(kernel, mu[j], j, t)) <= TOL
            expected_ctmc = [0.0 if i == j else float(lam[j] * jump[j, i]) for i in range(S)]
            assert ref.rel_err(from_ctmc.rates[j], expected_ctmc) <= TOL


def test_mask_kernel_rates_live_on_the_mask_state_only() -> None:
    kernel = uf.MaskKernel(6, 2, uf.schedules.CosineSchedule())
    g = torch.Generator().manual_seed(0)
    x_t = torch.arange(6)
    mu = torch.softmax(ref.random_logits((6, 6), g).index_fill(-1, torch.tensor([2]), -torch.inf), -1)
    for rate in (uf.ReverseRate.from_x0_logits(kernel, ref.random_logits((6, 6), g), x_t, 0.3),
                 uf.ReverseRate.from_posterior_mean(kernel, mu, x_t, 0.3),
                 uf.ReverseRate.true_conditional(kernel, torch.tensor(4), x_t, 0.3)):
        nonzero = rate.rates.abs().sum(-1) > 0
        assert nonzero.tolist() == [j == 2 for j in range(6)]
        assert float(rate.rates[2, 2]) == 0.0


def test_reverse_rate_basics() -> None:
    g = torch.Generator().manual_seed(1)
    S = 7
    rates = torch.rand(4, S, generator=g, dtype=DT)
    rates[2] = 0.0
    x_t = torch.tensor([0, 3, 5, 6])
    rate = uf.ReverseRate(rates, x_t)
    assert bool((rate.rates.gather(-1, x_t[:, None]) == 0).all())
    expected_exit = torch.stack([rates[n].sum() - rates[n, x_t[n]] for n in range(4)])
    torch.testing.assert_close(rate.exit_rate, expected_exit, rtol=1e-15, atol=0)
    sums = rate.jump_probs.sum(-1)
    torch.testing.assert_close(sums[[0, 1, 3]], torch.ones(3, dtype=DT), rtol=0, atol=1e-15)
    assert float(sums[2]) == 0.0 and bool((rate.jump_probs >= 0).all())
    # round trip through (λ, r)
    back = uf.ReverseRate.from_exit_jump(rate.exit_rate, rate.jump_probs, x_t)
    torch.testing.assert_close(back.rates, rate.rates, rtol=1e-15, atol=0)
    assert "ReverseRate" in repr(rate)


def test_time_broadcasts_against_states() -> None:
    kernel = uf.HybridKernel(9, 8, 0.3, 1.5)
    g = torch.Generator().manual_seed(2)
    x_t = torch.randint(0, 9, (2, 3), generator=g)
    logits = ref.random_logits((2, 3, 9), g)
    t = torch.tensor([[0.25], [0.75]], dtype=DT)
    batched = uf.ReverseRate.from_x0_logits(kernel, logits, x_t, t)
    assert batched.rates.shape == (2, 3, 9) and batched.x_t.shape == (2, 3)
    for b in range(2):
        for l in range(3):
            single = uf.ReverseRate.from_x0_logits(kernel, logits[b, l], x_t[b, l], t[b, 0])
            torch.testing.assert_close(batched.rates[b, l], single.rates, rtol=1e-15, atol=0)
    # a Python float time and a single state broadcast against a batch of heads
    shared = uf.ReverseRate.from_x0_logits(kernel, logits, x_t[0, 0], 0.5)
    assert shared.rates.shape == (2, 3, 9)


def test_dtype_follows_inputs() -> None:
    kernel = uf.UniformKernel(5)
    x_t = torch.tensor([1, 2])
    logits32 = torch.randn(2, 5)
    assert uf.ReverseRate.from_x0_logits(kernel, logits32, x_t, 0.5).rates.dtype == torch.float32
    assert uf.ReverseRate.from_x0_logits(kernel, logits32.bfloat16(), x_t, 0.5).rates.dtype == torch.float32
    assert uf.ReverseRate.from_x0_logits(kernel, logits32.double(), x_t, 0.5).rates.dtype == DT

"""Tests for unifusion.schedules: α_t against the textbook definitions and high-precision values."""

from __future__ import annotations

import math

import mpmath
import pytest
import torch
from reference import DT, alpha_fn, derivative

import unifusion as uf

SCHEDULES = [uf.LinearSchedule(), uf.CosineSchedule(), uf.LogLinearSchedule(), uf.LogLinearSchedule(eps=0.2)]


def _mp_alpha(schedule: uf.Schedule, t: float) -> mpmath.mpf:
    t = mpmath.mpf(t)
    if isinstance(schedule, uf.CosineSchedule):
        return mpmath.cos(mpmath.pi * t / 2)
    if isinstance(schedule, uf.LogLinearSchedule):
        return 1 - (1 - mpmath.mpf(schedule.eps)) * t
    return 1 - t


@pytest.mark.parametrize("schedule", SCHEDULES, ids=repr)
def test_alpha_matches_definition_and_is_monotone(schedule: uf.Schedule) -> None:
    t = torch.linspace(0.0, 1.0 - 1e-6, 1001, dtype=DT)
    alpha = schedule.alpha(t)
    torch.testing.assert_close(alpha, alpha_fn(schedule)(t), rtol=1e-15, atol=1e-15)
    assert float(alpha[0]) == 1.0
    assert bool((alpha[1:] <= alpha[:-1]).all())
    assert bool((alpha > 0).all())
    assert alpha.dtype == DT and alpha.shape == t.shape


@pytest.mark.parametrize("schedule", SCHEDULES, ids=repr)
def test_derivative_and_hazard(schedule: uf.Schedule) -> None:
    for t in [1e-6, 0.1, 0.37, 0.5, 0.9, 0.999]:
        tt = torch.tensor(t, dtype=DT)
        d_ref = float(derivative(alpha_fn(schedule), t))
        assert abs(float(schedule.alpha_prime(tt)) - d_ref) <= 1e-14 * max(1.0, abs(d_ref))
        h_ref = -d_ref / float(alpha_fn(schedule)(tt))
        assert abs(float(schedule.hazard(tt)) - h_ref) <= 1e-13 * h_ref
        assert float(schedule.hazard(tt)) >= 0.0


@pytest.mark.parametrize("schedule", SCHEDULES, ids=repr)
def test_one_minus_alpha_and_log_alpha_are_accurate(schedule: uf.Schedule) -> None:
    """β_t has no cancellation near t = 0 and log α_t is accurate: compare with 50-digit mpmath."""
    mpmath.mp.dps = 50
    for t in [1e-12, 1e-8, 1e-4, 0.3, 0.7, 0.99]:
        tt = torch.tensor(t, dtype=DT)
        a = _mp_alpha(schedule, t)
        beta, log_a = float(1 - a), float(mpmath.log(a))
        assert abs(float(schedule.one_minus_alpha(tt)) - beta) <= 4e-16 * abs(beta)
        assert abs(float(schedule.log_alpha(tt)) - log_a) <= 1e-15 * max(abs(log_a), 1e-300) + 1e-300


def test_schedules_keep_shape_and_dtype() -> None:
    t = torch.rand(2, 3, dtype=torch.float32) * 0.9 + 0.05
    for schedule in SCHEDULES:
        for fn in (schedule.alpha, schedule.alpha_prime, schedule.one_minus_alpha, schedule.log_alpha,
                   schedule.hazard):
            out = fn(t)
            assert out.shape == (2, 3) and out.dtype == torch.float32


def test_loglinear_eps_validation_equality_and_repr() -> None:
    with pytest.raises(ValueError, match="eps"):
        uf.LogLinearSchedule(eps=1.0)
    with pytest.raises(ValueError, match="eps"):
        uf.LogLinearSchedule(eps=-0.1)
    with pytest.raises(TypeError, match="eps"):
        uf.LogLinearSchedule(eps="0.1")  # type: ignore[arg-type]
    assert uf.LogLinearSchedule(0.01) == uf.LogLinearSchedule(0.01)
    assert uf.LogLinearSchedule(0.01) != uf.LogLinearSchedule(0.02)
    assert hash(uf.LogLinearSchedule(0.01)) == hash(uf.LogLinearSchedule(0.01))
    assert uf.LinearSchedule() != uf.CosineSchedule()
    assert "eps=0.01" in repr(uf.LogLinearSchedule(0.01))
    # α_1 = eps: the chain never fully forgets the data
    assert math.isclose(float(uf.LogLinearSchedule(0.01).alpha(torch.tensor(1.0, dtype=DT))), 0.01, rel_tol=1e-14)

"""Tests for unifusion.schedules: α_t against the textbook definitions and high-precision values."""

from __future__ import annotations

import math

import mpmath
import pytest
import torch
from reference import DT, alpha_fn, derivative

import unifusion as uf
from unifusion.schedules import (
    CosineSchedule,
    DUOCosineSchedule,
    GeometricSchedule,
    LinearSchedule,
    LogLinearSchedule,
    MDLMCosineSchedule,
    Schedule,
)

SCHEDULES = [LinearSchedule(), CosineSchedule(), LogLinearSchedule(), LogLinearSchedule(eps=0.2),
             GeometricSchedule(), GeometricSchedule(0.01, 5.0), MDLMCosineSchedule(),
             MDLMCosineSchedule(0.1), DUOCosineSchedule(), DUOCosineSchedule(0.1)]


def _mp_alpha(schedule: Schedule, t: float) -> mpmath.mpf:
    t = mpmath.mpf(t)
    if isinstance(schedule, CosineSchedule):
        return mpmath.cos(mpmath.pi * t / 2)
    if isinstance(schedule, LogLinearSchedule):
        return 1 - (1 - mpmath.mpf(schedule.eps)) * t
    if isinstance(schedule, GeometricSchedule):
        lo, hi = mpmath.mpf(schedule.sigma_min), mpmath.mpf(schedule.sigma_max)
        return mpmath.exp(-(lo ** (1 - t)) * hi**t)
    if isinstance(schedule, MDLMCosineSchedule):
        eps = mpmath.mpf(schedule.eps)
        return eps + (1 - eps) * mpmath.cos(mpmath.pi * t / 2)
    if isinstance(schedule, DUOCosineSchedule):
        return 1 - mpmath.sin(mpmath.pi * (1 - mpmath.mpf(schedule.eps)) * t / 2)
    return 1 - t


@pytest.mark.parametrize("schedule", SCHEDULES, ids=repr)
def test_alpha_matches_definition_and_is_monotone(schedule: Schedule) -> None:
    t = torch.linspace(0.0, 1.0 - 1e-6, 1001, dtype=DT)
    alpha = schedule.alpha(t)
    torch.testing.assert_close(alpha, alpha_fn(schedule)(t), rtol=1e-15, atol=1e-15)
    # α_0 = 1, except SEDD's geometric noise: σ(0) = σ_min > 0
    alpha_0 = math.exp(-schedule.sigma_min) if isinstance(schedule, GeometricSchedule) else 1.0
    assert math.isclose(float(alpha[0]), alpha_0, rel_tol=2e-16)
    assert bool((alpha[1:] <= alpha[:-1]).all())
    assert bool((alpha > 0).all())
    assert alpha.dtype == DT and alpha.shape == t.shape


@pytest.mark.parametrize("schedule", SCHEDULES, ids=repr)
def test_derivative_and_hazard(schedule: Schedule) -> None:
    mpmath.mp.dps = 50
    for t in [1e-6, 0.1, 0.37, 0.5, 0.9, 0.999]:
        tt = torch.tensor(t, dtype=DT)
        d_ref = float(mpmath.diff(lambda x: _mp_alpha(schedule, x), mpmath.mpf(t)))
        assert abs(float(derivative(alpha_fn(schedule), t)) - d_ref) <= 1e-12 * max(1.0, abs(d_ref))  # the ref itself
        assert abs(float(schedule.alpha_prime(tt)) - d_ref) <= 1e-14 * max(1.0, abs(d_ref))
        h_ref = -d_ref / float(_mp_alpha(schedule, t))
        assert abs(float(schedule.hazard(tt)) - h_ref) <= 1e-13 * h_ref
        assert float(schedule.hazard(tt)) >= 0.0


@pytest.mark.parametrize("schedule", SCHEDULES, ids=repr)
def test_one_minus_alpha_and_log_alpha_are_accurate(schedule: Schedule) -> None:
    """β_t has no cancellation near t = 0 and log α_t is accurate: compare with 50-digit mpmath."""
    mpmath.mp.dps = 50
    for t in [1e-12, 1e-8, 1e-4, 0.3, 0.7, 0.99]:
        tt = torch.tensor(t, dtype=DT)
        a = _mp_alpha(schedule, t)
        beta, log_a = float(1 - a), float(mpmath.log(a))
        # SEDD's σ = σ_min e^{t log(σ_max/σ_min)} carries the exponential's t·log(σ_max/σ_min) ulp
        ulps = 4.0 if not isinstance(schedule, GeometricSchedule) else 4.0 + 2 * t * math.log(
            schedule.sigma_max / schedule.sigma_min)
        assert abs(float(schedule.one_minus_alpha(tt)) - beta) <= ulps * 1.12e-16 * abs(beta)
        assert abs(float(schedule.log_alpha(tt)) - log_a) <= 2.5 * ulps * 1.12e-16 * max(abs(log_a), 1e-300) + 1e-300


def test_schedules_keep_shape_and_dtype() -> None:
    t = torch.rand(2, 3, dtype=torch.float32) * 0.9 + 0.05
    for schedule in SCHEDULES:
        for fn in (schedule.alpha, schedule.alpha_prime, schedule.one_minus_alpha, schedule.log_alpha,
                   schedule.hazard):
            out = fn(t)
            assert out.shape == (2, 3) and out.dtype == torch.float32


def test_loglinear_eps_validation_equality_and_repr() -> None:
    with pytest.raises(ValueError, match="eps"):
        LogLinearSchedule(eps=1.0)
    with pytest.raises(ValueError, match="eps"):
        LogLinearSchedule(eps=-0.1)
    with pytest.raises(TypeError, match="eps"):
        LogLinearSchedule(eps="0.1")  # type: ignore[arg-type]
    assert LogLinearSchedule(0.01) == LogLinearSchedule(0.01)
    assert LogLinearSchedule(0.01) != LogLinearSchedule(0.02)
    assert hash(LogLinearSchedule(0.01)) == hash(LogLinearSchedule(0.01))
    assert LinearSchedule() != CosineSchedule()
    assert "eps=0.01" in repr(LogLinearSchedule(0.01))
    # α_1 = eps: the chain never fully forgets the data
    assert math.isclose(float(LogLinearSchedule(0.01).alpha(torch.tensor(1.0, dtype=DT))), 0.01, rel_tol=1e-14)


def test_peer_schedules_validate_their_arguments_and_compare_by_value() -> None:
    with pytest.raises(ValueError, match="sigma_min, sigma_max"):
        GeometricSchedule(20.0, 1e-4)
    with pytest.raises(TypeError, match="sigma_min"):
        GeometricSchedule("1e-4")  # type: ignore[arg-type]
    for cls in (MDLMCosineSchedule, DUOCosineSchedule):
        with pytest.raises(ValueError, match="eps"):
            cls(eps=1.0)
        assert cls(0.01) == cls(0.01) and cls(0.01) != cls(0.02) and hash(cls(0.01)) == hash(cls(0.01))
        assert "eps=0.01" in repr(cls(0.01))
    with pytest.raises(TypeError, match="chain_factor"):
        DUOCosineSchedule(chain_factor=1)  # type: ignore[arg-type]
    assert DUOCosineSchedule(chain_factor=False) != DUOCosineSchedule()
    assert GeometricSchedule() != LogLinearSchedule()


def test_duo_published_derivative_lacks_the_chain_factor() -> None:
    """DUO's code returns dα/dt' (t' = (1 − ε) t); ``chain_factor=False`` reproduces it: the true α' / (1 − ε)."""
    t = torch.tensor([1e-3, 0.3, 0.9, 0.999], dtype=DT)
    eps = 0.05
    true, published = DUOCosineSchedule(eps), DUOCosineSchedule(eps, chain_factor=False)
    torch.testing.assert_close(published.alpha(t), true.alpha(t), rtol=0, atol=0)
    torch.testing.assert_close(published.alpha_prime(t), true.alpha_prime(t) / (1 - eps), rtol=1e-15, atol=0)


@pytest.mark.parametrize("schedule", [GeometricSchedule(), MDLMCosineSchedule(), DUOCosineSchedule()],
                         ids=repr)
def test_peer_schedules_drive_kernels_to_finite_losses(schedule: Schedule) -> None:
    """Every kernel takes the peers' schedules; the fast loss equals the reference on them."""
    g = torch.Generator().manual_seed(0)
    for kernel in (uf.UniformKernel(11, schedule), uf.MaskKernel(11, 10, schedule)):
        x0 = torch.randint(0, 10, (64,), generator=g)
        t = torch.rand(64, generator=g, dtype=DT) * (1 - 2e-6) + 1e-6
        x_t = kernel.sample(x0, t, generator=g)
        logits = torch.randn(64, 11, generator=g, dtype=DT)
        fast = uf.losses.gidd_loss(logits, x0, x_t, t, kernel)
        torch.testing.assert_close(fast, uf.losses.reference_gidd_loss(logits, x0, x_t, t, kernel), rtol=1e-10,
                                   atol=1e-300)
        assert bool(torch.isfinite(fast).all())


@pytest.mark.parametrize("schedule", SCHEDULES, ids=repr)
def test_every_method_takes_a_float_a_0d_tensor_and_any_shape(schedule: Schedule) -> None:
    """One convention for every schedule and method: a Python float gives a 0-d float64 tensor equal to the float64
    tensor call; a 0-d or n-d tensor keeps its shape and dtype; no other type is accepted."""
    methods = ["alpha", "alpha_prime", "one_minus_alpha", "log_alpha", "hazard"]
    if isinstance(schedule, GeometricSchedule):
        methods.append("sigma")
    grid = torch.tensor([[0.1, 0.37], [0.5, 0.93]], dtype=DT)
    for name in methods:
        fn = getattr(schedule, name)
        full = fn(grid)
        assert full.shape == (2, 2) and full.dtype == DT, name
        for i, value in enumerate([0.1, 0.37, 0.5, 0.93]):
            from_float = fn(value)
            assert isinstance(from_float, torch.Tensor) and from_float.shape == () and from_float.dtype == DT, name
            from_0d = fn(torch.tensor(value, dtype=torch.float32))
            assert from_0d.shape == () and from_0d.dtype == torch.float32, name
            # elementwise: the value at that point of the grid (to an ulp: vectorised and scalar kernels may differ)
            assert math.isclose(float(from_float), float(full.reshape(-1)[i]), rel_tol=1e-14, abs_tol=1e-300), name
            assert math.isclose(float(from_0d), float(from_float), rel_tol=1e-5, abs_tol=1e-6), name
        with pytest.raises(TypeError, match="t: expected a float or a floating-point tensor"):
            fn(torch.tensor([1, 2]))
        with pytest.raises(TypeError, match="t: expected a float or a floating-point tensor.*str"):
            fn("0.5")
        with pytest.raises(TypeError, match="t: .*bool"):
            fn(True)

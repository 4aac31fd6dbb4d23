"""Noise schedules α_t for interpolating kernels (paper §2, Definition 2.2 (2)).

A schedule maps a time ``t ∈ (0, 1)`` to the probability ``α_t`` that a token is still clean, with ``α_0 = 1``
and ``α_t`` non-increasing. Kernels use ``alpha(t)``, ``alpha_prime(t) = dα_t/dt`` and the (non-negative)
hazard ``-α_t'/α_t``. All methods take tensors of any shape and return tensors of the same shape and dtype.
"""

from __future__ import annotations

import math

import torch

__all__ = ["Schedule", "LinearSchedule", "CosineSchedule", "LogLinearSchedule"]


class Schedule:
    """Base class: subclasses implement :meth:`alpha` and :meth:`alpha_prime`."""

    def alpha(self, t: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        """α_t, the probability that a token is untouched at time ``t``; shape of ``t``."""
        raise NotImplementedError  # abstractmethod

    def alpha_prime(self, t: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        """dα_t/dt (≤ 0); shape of ``t``."""
        raise NotImplementedError  # abstractmethod

    def one_minus_alpha(self, t: torch.Tensor) -> torch.Tensor:
        """β_t = 1 − α_t, computed without cancellation near t = 0 where the subclass can."""
        return 1.0 - self.alpha(t)

    def log_alpha(self, t: torch.Tensor) -> torch.Tensor:
        """log α_t."""
        return torch.log(self.alpha(t))

    def hazard(self, t: torch.Tensor) -> torch.Tensor:
        """−α_t'/α_t ≥ 0, the rate at which a clean token gets corrupted at time ``t``."""
        return -self.alpha_prime(t) / self.alpha(t)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(sorted(vars(self).items()))))


class LinearSchedule(Schedule):
    """α_t = 1 − t (the paper's schedule, §3.2); α_t' = −1."""

    def alpha(self, t: torch.Tensor) -> torch.Tensor:
        return 1.0 - t

    def alpha_prime(self, t: torch.Tensor) -> torch.Tensor:
        return torch.full_like(t, -1.0)

    def one_minus_alpha(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    def log_alpha(self, t: torch.Tensor) -> torch.Tensor:
        return torch.log1p(-t)

    def hazard(self, t: torch.Tensor) -> torch.Tensor:
        return 1.0 / (1.0 - t)


class CosineSchedule(Schedule):
    """α_t = cos(π t / 2); α_t' = −(π/2) sin(π t / 2).

    Near t = 1 it evaluates α_t = sin(π (1 − t) / 2) (1 − t is exact there), near t = 0 it evaluates
    1 − α_t = 2 sin²(π t / 4) and log α_t = log1p(−2 sin²(π t / 4)), so no branch cancels in float32.
    """

    def alpha(self, t: torch.Tensor) -> torch.Tensor:
        return torch.where(t < 0.5, torch.cos(0.5 * math.pi * t), torch.sin(0.5 * math.pi * (1.0 - t)))

    def alpha_prime(self, t: torch.Tensor) -> torch.Tensor:
        return -0.5 * math.pi * torch.where(t < 0.5, torch.sin(0.5 * math.pi * t),
                                            torch.cos(0.5 * math.pi * (1.0 - t)))

    def one_minus_alpha(self, t: torch.Tensor) -> torch.Tensor:
        return 2.0 * torch.sin(0.25 * math.pi * t) ** 2

    def log_alpha(self, t: torch.Tensor) -> torch.Tensor:
        return torch.where(t < 0.5, torch.log1p(-self.one_minus_alpha(t)), torch.log(self.alpha(t)))

    def hazard(self, t: torch.Tensor) -> torch.Tensor:
        # (π/2) tan(π t / 2) = (π/2) / tan(π (1 − t) / 2)
        return 0.5 * math.pi * torch.where(t < 0.5, torch.tan(0.5 * math.pi * t),
                                           1.0 / torch.tan(0.5 * math.pi * (1.0 - t)))


class LogLinearSchedule(Schedule):
    """SEDD's log-linear schedule: σ(t) = −log(1 − (1 − eps) t), so α_t = e^{−σ(t)} = 1 − (1 − eps) t.

    ``eps`` keeps α_1 = eps > 0 (the chain never fully forgets the data at t = 1).
    """

    def __init__(self, eps: float = 1e-3) -> None:
        if isinstance(eps, bool) or not isinstance(eps, (int, float)):
            raise TypeError(f"eps: expected a float, got {type(eps).__name__}")
        if not 0.0 <= eps < 1.0:
            raise ValueError(f"eps: expected a value in [0, 1), got {eps}")
        self.eps = float(eps)

    def alpha(self, t: torch.Tensor) -> torch.Tensor:
        # eps + (1 − eps)(1 − t): no cancellation near t = 1
        return self.eps + (1.0 - self.eps) * (1.0 - t)

    def alpha_prime(self, t: torch.Tensor) -> torch.Tensor:
        return torch.full_like(t, -(1.0 - self.eps))

    def one_minus_alpha(self, t: torch.Tensor) -> torch.Tensor:
        return (1.0 - self.eps) * t

    def log_alpha(self, t: torch.Tensor) -> torch.Tensor:
        return torch.where(t < 0.5, torch.log1p(-(1.0 - self.eps) * t), torch.log(self.alpha(t)))

    def hazard(self, t: torch.Tensor) -> torch.Tensor:
        return (1.0 - self.eps) / self.alpha(t)

    def __repr__(self) -> str:
        return f"LogLinearSchedule(eps={self.eps})"

"""Noise schedules α_t for interpolating kernels (paper §2, Definition 2.2 (2)).

A schedule maps a time ``t ∈ (0, 1)`` to the probability ``α_t`` that a token is still clean, with ``α_0 = 1``
and ``α_t`` non-increasing. Kernels use ``alpha(t)``, ``alpha_prime(t) = dα_t/dt`` and the (non-negative)
hazard ``-α_t'/α_t``. All methods take ``t`` as a floating-point tensor of any shape (0-d included) and return a
tensor of the same shape and dtype, or as a Python float, which gives a 0-d float64 tensor (a Python float is a
double: nothing is rounded). Schedules are elementwise, so the row rule for times (docs/concepts.md) does not apply
here: the kernels shape ``t`` before calling a schedule. No value is checked (no device sync): a kernel checks
t ∈ (0, 1) once per call.
"""

from __future__ import annotations

import math

import torch

__all__ = ["Schedule", "LinearSchedule", "CosineSchedule", "LogLinearSchedule", "GeometricSchedule",
           "MDLMCosineSchedule", "DUOCosineSchedule"]


def _as_time(t: object) -> torch.Tensor:
    """``t`` as a floating-point tensor: a tensor unchanged, a Python float (or int) as a 0-d float64 tensor."""
    if isinstance(t, torch.Tensor):
        if not t.dtype.is_floating_point:
            raise TypeError(f"t: expected a float or a floating-point tensor of times, got dtype {t.dtype}")
        return t
    if isinstance(t, (int, float)) and not isinstance(t, bool):
        return torch.tensor(float(t), dtype=torch.float64)
    raise TypeError(f"t: expected a float or a floating-point tensor of times, got {type(t).__name__}")


class Schedule:
    """Base class: subclasses implement :meth:`alpha` and :meth:`alpha_prime`.

    The kernels always call a schedule with a floating-point tensor; the built-in schedules (and the base class's
    derived methods) also take a Python float, which gives a 0-d float64 tensor.
    """

    def alpha(self, t: torch.Tensor | float) -> torch.Tensor:  # pragma: no cover - abstract
        """α_t, the probability that a token is untouched at time ``t``; shape of ``t``."""
        raise NotImplementedError  # abstractmethod

    def alpha_prime(self, t: torch.Tensor | float) -> torch.Tensor:  # pragma: no cover - abstract
        """dα_t/dt (≤ 0); shape of ``t``."""
        raise NotImplementedError  # abstractmethod

    def one_minus_alpha(self, t: torch.Tensor | float) -> torch.Tensor:
        """β_t = 1 − α_t, computed without cancellation near t = 0 where the subclass can."""
        t = _as_time(t)
        return 1.0 - self.alpha(t)

    def log_alpha(self, t: torch.Tensor | float) -> torch.Tensor:
        """log α_t."""
        t = _as_time(t)
        return torch.log(self.alpha(t))

    def hazard(self, t: torch.Tensor | float) -> torch.Tensor:
        """−α_t'/α_t ≥ 0, the rate at which a clean token gets corrupted at time ``t``."""
        t = _as_time(t)
        return -self.alpha_prime(t) / self.alpha(t)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(sorted(vars(self).items()))))


class LinearSchedule(Schedule):
    """α_t = 1 − t (the paper's schedule, §3.2); α_t' = −1."""

    def alpha(self, t: torch.Tensor | float) -> torch.Tensor:
        t = _as_time(t)
        return 1.0 - t

    def alpha_prime(self, t: torch.Tensor | float) -> torch.Tensor:
        t = _as_time(t)
        return torch.full_like(t, -1.0)

    def one_minus_alpha(self, t: torch.Tensor | float) -> torch.Tensor:
        t = _as_time(t)
        return t.clone()

    def log_alpha(self, t: torch.Tensor | float) -> torch.Tensor:
        t = _as_time(t)
        return torch.log1p(-t)

    def hazard(self, t: torch.Tensor | float) -> torch.Tensor:
        t = _as_time(t)
        return 1.0 / (1.0 - t)


class CosineSchedule(Schedule):
    """α_t = cos(π t / 2); α_t' = −(π/2) sin(π t / 2).

    Near t = 1 it evaluates α_t = sin(π (1 − t) / 2) (1 − t is exact there), near t = 0 it evaluates
    1 − α_t = 2 sin²(π t / 4) and log α_t = log1p(−2 sin²(π t / 4)), so no branch cancels in float32.
    """

    def alpha(self, t: torch.Tensor | float) -> torch.Tensor:
        t = _as_time(t)
        return torch.where(t < 0.5, torch.cos(0.5 * math.pi * t), torch.sin(0.5 * math.pi * (1.0 - t)))

    def alpha_prime(self, t: torch.Tensor | float) -> torch.Tensor:
        t = _as_time(t)
        return -0.5 * math.pi * torch.where(t < 0.5, torch.sin(0.5 * math.pi * t),
                                            torch.cos(0.5 * math.pi * (1.0 - t)))

    def one_minus_alpha(self, t: torch.Tensor | float) -> torch.Tensor:
        t = _as_time(t)
        return 2.0 * torch.sin(0.25 * math.pi * t) ** 2

    def log_alpha(self, t: torch.Tensor | float) -> torch.Tensor:
        t = _as_time(t)
        return torch.where(t < 0.5, torch.log1p(-self.one_minus_alpha(t)), torch.log(self.alpha(t)))

    def hazard(self, t: torch.Tensor | float) -> torch.Tensor:
        t = _as_time(t)
        # (π/2) tan(π t / 2) = (π/2) / tan(π (1 − t) / 2)
        return 0.5 * math.pi * torch.where(t < 0.5, torch.tan(0.5 * math.pi * t),
                                           1.0 / torch.tan(0.5 * math.pi * (1.0 - t)))


class LogLinearSchedule(Schedule):
    """SEDD's log-linear schedule: σ(t) = −log(1 − (1 − eps) t), so α_t = e^{−σ(t)} = 1 − (1 − eps) t.

    ``eps`` keeps α_1 = eps > 0 (the chain never fully forgets the data at t = 1).
    """

    def __init__(self, eps: float = 1e-3) -> None:
        self.eps = _check_eps(eps)

    def alpha(self, t: torch.Tensor | float) -> torch.Tensor:
        t = _as_time(t)
        # eps + (1 − eps)(1 − t): no cancellation near t = 1
        return self.eps + (1.0 - self.eps) * (1.0 - t)

    def alpha_prime(self, t: torch.Tensor | float) -> torch.Tensor:
        t = _as_time(t)
        return torch.full_like(t, -(1.0 - self.eps))

    def one_minus_alpha(self, t: torch.Tensor | float) -> torch.Tensor:
        t = _as_time(t)
        return (1.0 - self.eps) * t

    def log_alpha(self, t: torch.Tensor | float) -> torch.Tensor:
        t = _as_time(t)
        return torch.where(t < 0.5, torch.log1p(-(1.0 - self.eps) * t), torch.log(self.alpha(t)))

    def hazard(self, t: torch.Tensor | float) -> torch.Tensor:
        t = _as_time(t)
        return (1.0 - self.eps) / self.alpha(t)

    def __repr__(self) -> str:
        return f"LogLinearSchedule(eps={self.eps})"


def _check_eps(eps: object) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps: expected a float, got {type(eps).__name__}")
    if not 0.0 <= eps < 1.0:
        raise ValueError(f"eps: expected a value in [0, 1), got {eps}")
    return float(eps)


class GeometricSchedule(Schedule):
    """SEDD's geometric noise: σ(t) = σ_min^{1−t} σ_max^t, α_t = e^{−σ(t)}.

    dσ/dt = σ(t) log(σ_max/σ_min) is the hazard −α_t'/α_t. SEDD's defaults are σ_min = 1e-4, σ_max = 20 (its
    configuration values). Note α_0 = e^{−σ_min} < 1: at t = 0 a token has already been corrupted with probability
    1 − e^{−σ_min} ≈ σ_min, as in SEDD. 1 − α_t = −expm1(−σ) and log α_t = −σ are exact at both ends.

    SEDD writes its rate matrix as Q_t = (dσ/dt) Q̄; ``UniformKernel(S, GeometricSchedule())`` is its uniform graph
    and ``MaskKernel(S, mask_id, GeometricSchedule())`` its absorbing graph (see docs/guides/peers.md).
    """

    def __init__(self, sigma_min: float = 1e-4, sigma_max: float = 20.0) -> None:
        for name, v in (("sigma_min", sigma_min), ("sigma_max", sigma_max)):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"{name}: expected a float, got {type(v).__name__}")
        if not 0.0 < sigma_min < sigma_max or not math.isfinite(sigma_max):
            raise ValueError(f"sigma_min, sigma_max: expected 0 < sigma_min < sigma_max < inf, got sigma_min="
                             f"{sigma_min}, sigma_max={sigma_max}")
        self.sigma_min = float(sigma_min)
        self.sigma_max = float(sigma_max)

    def sigma(self, t: torch.Tensor | float) -> torch.Tensor:
        """Total noise σ(t) = σ_min (σ_max/σ_min)^t (relative error ~ t log(σ_max/σ_min) ulp)."""
        t = _as_time(t)
        return self.sigma_min * torch.exp(t * math.log(self.sigma_max / self.sigma_min))

    def alpha(self, t: torch.Tensor | float) -> torch.Tensor:
        t = _as_time(t)
        return torch.exp(-self.sigma(t))

    def alpha_prime(self, t: torch.Tensor | float) -> torch.Tensor:
        t = _as_time(t)
        return -self.hazard(t) * self.alpha(t)

    def one_minus_alpha(self, t: torch.Tensor | float) -> torch.Tensor:
        t = _as_time(t)
        return -torch.expm1(-self.sigma(t))

    def log_alpha(self, t: torch.Tensor | float) -> torch.Tensor:
        t = _as_time(t)
        return -self.sigma(t)

    def hazard(self, t: torch.Tensor | float) -> torch.Tensor:
        t = _as_time(t)
        return self.sigma(t) * math.log(self.sigma_max / self.sigma_min)

    def __repr__(self) -> str:
        return f"GeometricSchedule(sigma_min={self.sigma_min}, sigma_max={self.sigma_max})"


class MDLMCosineSchedule(Schedule):
    """MDLM's cosine noise (``CosineNoise``): α_t = ε + (1 − ε) cos(π t / 2), σ = −log α_t.

    Not :class:`CosineSchedule` (which is ε = 0). α_1 = ε > 0. Near t = 0, 1 − α_t = 2 (1 − ε) sin²(π t / 4); near
    t = 1, α_t = ε + (1 − ε) sin(π (1 − t) / 2): no branch cancels. MDLM's dσ/dt = (π/2)(1 − ε) sin(π t/2)/α_t is
    :meth:`hazard`.
    """

    def __init__(self, eps: float = 1e-3) -> None:
        self.eps = _check_eps(eps)

    def _cos(self, t: torch.Tensor) -> torch.Tensor:  # cos(π t / 2), accurate near t = 1
        return torch.where(t < 0.5, torch.cos(0.5 * math.pi * t), torch.sin(0.5 * math.pi * (1.0 - t)))

    def alpha(self, t: torch.Tensor | float) -> torch.Tensor:
        t = _as_time(t)
        return self.eps + (1.0 - self.eps) * self._cos(t)

    def alpha_prime(self, t: torch.Tensor | float) -> torch.Tensor:
        t = _as_time(t)
        sin = torch.where(t < 0.5, torch.sin(0.5 * math.pi * t), torch.cos(0.5 * math.pi * (1.0 - t)))
        return -0.5 * math.pi * (1.0 - self.eps) * sin

    def one_minus_alpha(self, t: torch.Tensor | float) -> torch.Tensor:
        t = _as_time(t)
        return 2.0 * (1.0 - self.eps) * torch.sin(0.25 * math.pi * t) ** 2

    def log_alpha(self, t: torch.Tensor | float) -> torch.Tensor:
        t = _as_time(t)
        return torch.where(t < 0.5, torch.log1p(-self.one_minus_alpha(t)), torch.log(self.alpha(t)))

    def hazard(self, t: torch.Tensor | float) -> torch.Tensor:
        t = _as_time(t)
        return -self.alpha_prime(t) / self.alpha(t)

    def __repr__(self) -> str:
        return f"MDLMCosineSchedule(eps={self.eps})"


class DUOCosineSchedule(Schedule):
    """DUO's cosine schedule: with t' = (1 − ε) t, α_t = 1 − sin(π t' / 2) (convex in t; α_1 = 1 − cos(π ε / 2)).

    Not :class:`CosineSchedule`. 1 − α_t = sin(π t'/2) exactly; near t' = 1, α_t = 2 sin²(π (1 − t') / 4) with
    1 − t' = ε + (1 − ε)(1 − t) (no cancellation). The true derivative is α_t' = −(π/2)(1 − ε) cos(π t'/2).

    DUO's code returns dα/dt' instead (its ``dalpha_t`` lacks the chain factor 1 − ε), and its UDLM loss is linear in
    it, so DUO's reported ELBO is the true ELBO divided by (1 − ε). ``chain_factor=False`` reproduces DUO's numbers
    exactly (α' then no longer matches α: use it only to compare with DUO); the default is the consistent schedule.
    """

    def __init__(self, eps: float = 1e-3, *, chain_factor: bool = True) -> None:
        self.eps = _check_eps(eps)
        if not isinstance(chain_factor, bool):
            raise TypeError(f"chain_factor: expected a bool, got {type(chain_factor).__name__}")
        self.chain_factor = chain_factor

    def _one_minus_tp(self, t: torch.Tensor) -> torch.Tensor:  # 1 − t' without cancellation
        return self.eps + (1.0 - self.eps) * (1.0 - t)

    def alpha(self, t: torch.Tensor | float) -> torch.Tensor:
        t = _as_time(t)
        tp = (1.0 - self.eps) * t
        return torch.where(tp < 0.5, 1.0 - torch.sin(0.5 * math.pi * tp),
                           2.0 * torch.sin(0.25 * math.pi * self._one_minus_tp(t)) ** 2)

    def alpha_prime(self, t: torch.Tensor | float) -> torch.Tensor:
        t = _as_time(t)
        d = -0.5 * math.pi * torch.sin(0.5 * math.pi * self._one_minus_tp(t))  # dα/dt' = −(π/2) cos(π t'/2)
        return d * (1.0 - self.eps) if self.chain_factor else d

    def one_minus_alpha(self, t: torch.Tensor | float) -> torch.Tensor:
        t = _as_time(t)
        return torch.sin(0.5 * math.pi * (1.0 - self.eps) * t)

    def log_alpha(self, t: torch.Tensor | float) -> torch.Tensor:
        t = _as_time(t)
        tp = (1.0 - self.eps) * t
        return torch.where(tp < 0.5, torch.log1p(-self.one_minus_alpha(t)), torch.log(self.alpha(t)))

    def __repr__(self) -> str:
        extra = "" if self.chain_factor else ", chain_factor=False"
        return f"DUOCosineSchedule(eps={self.eps}{extra})"

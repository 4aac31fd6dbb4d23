"""The master objective's pointwise rate divergence (paper Definition 3.1).

D_t(x_t, x0; θ) = Σ_{y ≠ x_t} f(R̂_t(x_t, y | x0), R̂^θ_t(x_t, y)),  f(r, c) = r log(r/c) − r + c,
with f(0, c) = c, f(0, 0) = 0 and f(r, 0) = +∞ for r > 0.
"""

from __future__ import annotations

import torch

from .. import _validation as V
from .._math import bregman_from_log_ratio, bregman_from_logs, safe_log
from ..rates import ReverseRate

__all__ = ["bregman_rate_loss", "bregman_divergence"]


def bregman_divergence(r: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Elementwise f(r, c) = r log(r/c) − r + c ≥ 0 with Definition 3.1's boundary cases (any shapes that broadcast)."""
    r, c = V.check_tensor("r", r), V.check_tensor("c", c)
    both = (r > 0) & (c > 0)
    safe_c = torch.where(both, c, torch.ones_like(c))
    # ℓ = log(r/c) = log1p((r − c)/c): r − c is exact when r ≈ c, so f keeps its relative accuracy at the optimum
    l = torch.log1p(torch.where(both, r - c, torch.zeros_like(r)) / safe_c)
    return torch.where(both, bregman_from_log_ratio(torch.log(safe_c), l), bregman_from_logs(safe_log(r), safe_log(c)))


def _as_rate(name: str, value: object, x_t: torch.Tensor | None) -> ReverseRate:
    if isinstance(value, ReverseRate):
        return value
    if isinstance(value, torch.Tensor):
        if x_t is None:
            raise TypeError(f"{name}: a raw rate tensor needs x_t=...; or pass a ReverseRate")
        return ReverseRate(value, x_t)
    raise TypeError(f"{name}: expected a ReverseRate or a rate tensor (..., S), got {type(value).__name__}")


def bregman_rate_loss(true: ReverseRate | torch.Tensor, model: ReverseRate | torch.Tensor,
                      x_t: torch.Tensor | None = None) -> torch.Tensor:
    """D_t = Σ_{i ≠ x_t} f(true_i, model_i) per position, ``(...)`` (no reduction).

    Args:
        true: the target rates (usually ``ReverseRate.true_conditional(kernel, x0, x_t, t)``).
        model: the model's induced rates (any ``ReverseRate`` constructor).
        x_t: current states ``(...)``; needed only when ``true``/``model`` are raw ``(..., S)`` rate tensors.

    Returns ``+inf`` where the model puts zero rate on a target the truth reaches (f(r, 0) = ∞).
    """
    true_r = _as_rate("true", true, x_t)
    model_r = _as_rate("model", model, x_t)
    if true_r.num_states != model_r.num_states:
        raise ValueError(f"model: expected {true_r.num_states} states like `true`, got {model_r.num_states}")
    if true_r.x_t.shape != model_r.x_t.shape or (V.validation_enabled() and not torch.equal(true_r.x_t, model_r.x_t)):
        raise ValueError("model: the two rate rows must be taken at the same current states x_t")
    log_r = true_r.log_rates if true_r.log_rates is not None else safe_log(true_r.rates)
    log_c = model_r.log_rates if model_r.log_rates is not None else safe_log(model_r.rates)
    dtype = V.compute_dtype(log_r, log_c)
    f = bregman_from_logs(log_r.to(dtype), log_c.to(dtype))
    # the x_t entry is (0, 0) -> f = 0 by construction
    return f.sum(-1)

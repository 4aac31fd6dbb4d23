"""Numerically careful functions shared by rates and losses (private module; public names inside the package).

The Bregman divergence of φ(u) = u log u is f(r, c) = r log(r/c) − r + c. Written through ℓ = log(r/c),
f(r, c) = c · g(ℓ) with g(ℓ) = ℓ e^ℓ − e^ℓ + 1 ≥ 0. Near the optimum (ℓ → 0) the direct formula cancels to
ℓ²/2, so |ℓ| < 1/2 uses the Taylor series g(ℓ) = Σ_{k≥2} (k−1) ℓ^k / k!, which is exact to float64 rounding there.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

_SERIES_CUTOFF = 0.5
# g(l)  = sum_{k>=2} (k-1)/k! l^k      (Bregman)      and      e^l - 1 - l = sum_{k>=2} l^k / k!
_G_COEFFS = [(k - 1) / math.factorial(k) for k in range(2, 19)]
_EXPM1_COEFFS = [1.0 / math.factorial(k) for k in range(2, 19)]


def _series(l: torch.Tensor, coeffs: list[float]) -> torch.Tensor:
    # Horner on l^2 * (c2 + c3 l + c4 l^2 + ...)
    acc = torch.full_like(l, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        acc = acc * l + c
    return acc * l * l


def bregman_g(l: torch.Tensor) -> torch.Tensor:
    """g(ℓ) = ℓ e^ℓ − e^ℓ + 1 = f(e^ℓ, 1) ≥ 0, accurate where it is finite in the dtype (|ℓ| < ~88 in float32,
    ~709 in float64; it overflows beyond). Callers with larger ℓ use c g(ℓ) = r (ℓ − 1) + c with r = c e^ℓ known
    (see :func:`bregman_from_log_ratio`)."""
    small = l.abs() < _SERIES_CUTOFF
    l_small = torch.where(small, l, torch.zeros_like(l))
    direct = torch.expm1(l) * (l - 1.0) + l
    return torch.where(small, _series(l_small, _G_COEFFS), direct)


def expm1_minus_x(l: torch.Tensor) -> torch.Tensor:
    """e^ℓ − 1 − ℓ ≥ 0, accurate near 0."""
    small = l.abs() < _SERIES_CUTOFF
    l_small = torch.where(small, l, torch.zeros_like(l))
    return torch.where(small, _series(l_small, _EXPM1_COEFFS), torch.expm1(l) - l)


def bregman_from_logs(log_r: torch.Tensor, log_c: torch.Tensor) -> torch.Tensor:
    """f(r, c) = r log(r/c) − r + c from log r and log c (elementwise, any shape).

    Boundary cases of Definition 3.1: f(0, c) = c (log_r = −inf), f(0, 0) = 0, f(r, 0) = +inf (r > 0).
    Gradients are finite wherever the value is finite (the unused branches are fed safe values).
    """
    r_zero = torch.isneginf(log_r)
    c_zero = torch.isneginf(log_c)
    both = ~r_zero & ~c_zero
    safe_r = torch.where(both, log_r, torch.zeros_like(log_r))
    safe_c = torch.where(both, log_c, torch.zeros_like(log_c))
    l = safe_r - safe_c
    c = torch.exp(safe_c)
    small = l.abs() < _SERIES_CUTOFF
    l_small = torch.where(small, l, torch.zeros_like(l))
    # small |l|: c * g(l); otherwise r*l - r + c with r = c e^l (no overflow of e^l alone)
    r = torch.exp(safe_r)
    value = torch.where(small, c * _series(l_small, _G_COEFFS), r * l - r + c)
    c_only = torch.exp(torch.where(c_zero, torch.zeros_like(log_c), log_c))
    value = torch.where(r_zero, torch.where(c_zero, torch.zeros_like(value), c_only), value)
    return torch.where(~r_zero & c_zero, torch.full_like(value, math.inf), value)


def bregman_from_log_ratio(log_c: torch.Tensor, l: torch.Tensor, log_r: torch.Tensor | None = None) -> torch.Tensor:
    """f(r, c) from log c and ℓ = log(r/c) given directly (for callers that can compute ℓ without cancelling).

    ℓ = −inf means r = 0 (f = c); log_c = −inf with finite ℓ means r = c = 0 (f = 0); ℓ = +inf means c = 0 < r (∞).
    ``log_r`` (optional, same shape): log r when the caller knows it. Then r is e^{log r} rather than c e^ℓ, which
    stays exact when c underflows and ℓ is huge (a confidently wrong model: c = e^{−10⁴}, ℓ = 10⁴, r = O(1)), where
    c e^ℓ would be 0 · ∞.
    """
    finite = torch.isfinite(l) & ~torch.isneginf(log_c)
    l_safe = torch.where(finite, l, torch.zeros_like(l))
    c = torch.exp(torch.where(torch.isneginf(log_c), torch.full_like(log_c, -math.inf), log_c))
    small = l_safe.abs() < _SERIES_CUTOFF
    l_small = torch.where(small, l_safe, torch.zeros_like(l_safe))
    if log_r is None:
        r = c * torch.exp(l_safe)
    else:
        r = torch.exp(torch.where(finite, log_r, torch.zeros_like(log_r)))
    value = torch.where(small, c * _series(l_small, _G_COEFFS), r * (l_safe - 1.0) + c)
    value = torch.where(finite, value, torch.zeros_like(value))
    value = torch.where(torch.isneginf(l), c, value)
    return torch.where(torch.isposinf(l), torch.full_like(value, math.inf), value)


def safe_log(x: torch.Tensor) -> torch.Tensor:
    """log x with log 0 = −inf and no NaN gradient at 0 (gradient 0 there)."""
    pos = x > 0
    out = torch.log(torch.where(pos, x, torch.ones_like(x)))
    return torch.where(pos, out, torch.full_like(out, -math.inf))


def softplus(z: torch.Tensor) -> torch.Tensor:
    """log(1 + e^z), exact to rounding for every z (torch's softplus switches to z above a threshold)."""
    pos = z > 0
    return torch.where(pos, z.clamp_min(0) + torch.log1p(torch.exp(-z.clamp_min(0))),
                       torch.log1p(torch.exp(z.clamp_max(0))))


class _ExactLogSoftmax(torch.autograd.Function):
    """log-softmax over the last dim whose gradient is exact at the most likely entry j as well.

    Autograd's ∂/∂l_z = g_z − p_z Σ_y g_y is, at z = j with p_j ≈ 1, a difference of two nearly equal numbers (its
    true value is O(1 − p_j)); since the entries of each row sum to zero (the output is invariant to adding a constant
    to the logits), the entry at j is computed as −Σ_{z≠j} instead. Entries at −inf (a mask state) get gradient 0.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:
        out = torch.log_softmax(logits, dim=-1)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor) -> torch.Tensor:
        (out,) = ctx.saved_tensors
        excluded = torch.isneginf(out)
        grad_out = torch.where(excluded, torch.zeros_like(grad_out), grad_out)
        grad = grad_out - out.exp() * grad_out.sum(-1, keepdim=True)
        grad = torch.where(excluded, torch.zeros_like(grad), grad)
        j = out.argmax(-1, keepdim=True)
        return grad.scatter(-1, j, -grad.scatter(-1, j, 0.0).sum(-1, keepdim=True))


def log_softmax(logits: torch.Tensor, exclude: torch.Tensor | int | None = None, *,
                exact_gradient: bool = False) -> torch.Tensor:
    """log-softmax over the last dim with the ids ``exclude`` (an int, or ids ``(...)`` one per row) at −inf
    (probability 0, no gradient).

    ``exact_gradient=True``: the gradient is exact at the most likely entry too (:class:`_ExactLogSoftmax`; the
    references need it for confident models), at the cost of a custom backward. The values are the same either way.
    """
    if isinstance(exclude, int):
        index = torch.full((1,), exclude, dtype=torch.long, device=logits.device)  # filled there: no host copy
        logits = logits.index_fill(-1, index, float("-inf"))
    elif exclude is not None:
        logits = logits.scatter(-1, exclude.unsqueeze(-1), float("-inf"))
    if exact_gradient:
        return _ExactLogSoftmax.apply(logits)
    return torch.log_softmax(logits, dim=-1)

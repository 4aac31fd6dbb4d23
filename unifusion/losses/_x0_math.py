"""Element-wise math of the fast x0-head loss (:mod:`unifusion.losses.fast`): x − log1p x without cancellation,
the compensated e^{l − max} of float32 logits, and a softplus that never overflows."""

from __future__ import annotations

import torch

__all__ = ["C_SCALE", "LOGIT_FLOOR", "exp_minus_max", "softplus", "x_minus_log1p", "x_minus_log1p_and_ratio"]


def x_minus_log1p(x: torch.Tensor, log_x: torch.Tensor | None = None) -> torch.Tensor:
    """x − log1p(x) ≥ 0 for x ≥ 0, to a few ulp in the dtype of ``x`` (no cancellation for small x).

    log1p(x) = 2 atanh(v) with v = x / (2 + x), and x − 2v = x v, so x − log1p(x) = x v − 2 v³ S(v²) with
    S(w) = Σ_j w^j / (2j + 3) = 1/3 + w/5 + w²/7 + …. float32: that below x = 1 (v < 1/3: six terms of S); above
    it, log1p(x) = log x + log1p(1/x) = log x + 2 atanh(v) with v = 1 / (2x + 1) < 1/3, so
    x − log1p(x) = x − log x − 2v − 2 v³ S(v²), the same series: one division and no transcendental function
    when the caller knows ``log_x`` (the fast loss has it from the logits; ``None``: ``torch.log(x)``). Within
    4e-7 relative of the truth for float32 ``x`` with ``log_x`` exact to its ulp. float64: the series below
    x = 1/10 (seven terms), the direct formula above it (where it loses ≤ 4 bits).
    """
    return x_minus_log1p_and_ratio(x, log_x, False)[0]


def x_minus_log1p_and_ratio(x: torch.Tensor, log_x: torch.Tensor | None, with_ratio: bool,
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`x_minus_log1p` and, if ``with_ratio``, x / (1 + x). float32 shares one division between them:
    q = 1 / ((1 + x) D) with v = N / D as above gives v = N (1 + x) q and x / (1 + x) = x D q."""
    ratio = None
    if x.dtype == torch.float64:
        small = x < 0.1
        xs = torch.where(small, x, torch.zeros_like(x))
        v = xs / (2.0 + xs)
        base, terms = xs * v, 7
        if with_ratio:
            ratio = x / (1.0 + x)
    else:
        if log_x is None:
            log_x = torch.log(x)
        small = x < 1.0
        # x capped at 1e18 (where v < 1e-18 and x/(1+x) = 1) keeps (1 + x) D ≤ 2 (1 + x)² finite
        x_capped = torch.clamp(x, max=1e18)
        numerator, denominator = torch.where(small, x, 1.0), torch.where(small, x + 2.0, 2.0 * x_capped + 1.0)
        if with_ratio:
            one_plus_x = 1.0 + x_capped
            q = 1.0 / (one_plus_x * denominator)
            v = numerator * one_plus_x * q
            ratio = x_capped * denominator * q
            del one_plus_x, q  # (eager: fewer (n, S) temporaries alive at once)
        else:
            v = numerator / denominator
        del x_capped, numerator, denominator
        base, terms = torch.where(small, x * v, x - log_x - 2.0 * v), 6
    w = v * v
    acc = torch.full_like(w, 1.0 / (2 * terms + 1))
    for j in range(terms - 1, 0, -1):
        acc = acc * w + 1.0 / (2 * j + 1)
    series = base - 2.0 * v * w * acc
    if x.dtype == torch.float64:
        return torch.where(small, series, x - torch.log1p(x)), ratio
    return series, ratio


# scale of the float32 sum Σ P E (see :func:`unifusion.losses._x0_elements.noise_sums`)
C_SCALE = 2.0**100
# l below this is treated as −inf by the compensated exp (a finite stand-in: TwoSum of −inf gives NaN)
LOGIT_FLOOR = -(2.0**100)


def exp_minus_max(l: torch.Tensor, mx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d, d_lo, P) for float32 logits ``l`` ``(n, S)`` and their row maxima ``mx`` ``(n,)``: d = fl(l − M), its
    rounding error d_lo = (l − M) − d exactly (TwoSum: with b = −M, b_v = d − l, a_v = d − b_v, d_lo = (l − a_v) +
    (−M − b_v); exact for any finite l, M in round-to-nearest without reassociation, which neither Inductor's C++
    (``-fno-unsafe-math-optimizations``) nor Triton applies), and P = e^{l − M} = e^d (1 + d_lo) to an ulp or two.
    Logits below :data:`LOGIT_FLOOR` (−inf: a masked column) count as that floor, P = 0."""
    l = torch.clamp_min(l, LOGIT_FLOOR)
    m = mx.unsqueeze(-1)
    d = l - m
    b_virtual = d - l
    d_lo = (l - (d - b_virtual)) - (m + b_virtual)
    del l, b_virtual  # (eager: fewer (n, S) temporaries alive at once)
    P = torch.exp(d)
    return d, d_lo, P + P * d_lo


def softplus(z: torch.Tensor) -> torch.Tensor:
    """log(1 + e^z) for every z (−inf → 0) without overflow: max(z, 0) + log1p(e^{−|z|}), in the fewest ops. Nothing
    differentiates through it (the fast loss's gradient is analytic); :func:`unifusion._math.softplus` is the same
    value with autograd's gradient right at z = 0 too, for the reference losses."""
    return torch.clamp(z, min=0.0) + torch.log1p(torch.exp(-torch.abs(z)))

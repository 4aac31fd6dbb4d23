"""The equations of the fast x0-head loss (:mod:`unifusion.losses.fast`): per element of the logits and per row.

Read top to bottom:

* **element math** — x − log1p x without cancellation, the compensated e^{l − max} of float32 logits, a softplus
  that never overflows;
* **the logit-free rows** — :class:`RowTensors`, the ``(N,)`` quantities of the kernel, the times and the weights
  that :func:`unifusion.losses.fast.prepare_x0_rows` computes once per call;
* **the element passes** — what each of the three ``(n, S)`` passes over a block of rows of logits computes: pass 1
  the row maximum M and s' = Σ_y e^{l_y − M} − 1 (:func:`sum_off_max`), pass 2 (uniform noise only) the sums over
  the clean states (:func:`noise_sums`), pass 3 the gradient (:func:`grad_block`). Each is a pure function of one
  block, written with out-of-place tensor ops that ``torch.compile`` fuses into a loop per row;
* **the per-row terms** — :func:`row_terms` turns the row maximum, s, the logits at the few columns a row reads
  alone (x0, x_t) and the uniform-noise sums into the loss, the per-row factors of the gradient pass and the
  gradient at those columns. Everything there is ``(n,)`` in the rows' precision (float64 wherever the device has
  it): it costs nothing next to the ``(n, S)`` passes and removes every float32 rounding of a large per-row number
  that would feed a small result.

The equations are in :mod:`unifusion.losses.fast` and in :func:`unifusion.losses._x0_driver.loss_and_grad`, which
runs these pieces in order (on all rows at once, compiled, or on blocks of rows, eagerly). The named structures
below are what the driver hands between the pieces; they are named tuples, which ``torch.compile`` traces without
graph breaks.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .._math import bregman_g, expm1_minus_x

__all__ = ["C_SCALE", "LOGIT_FLOOR", "Columns", "Config", "Noise", "NoiseScale", "RowStats", "RowTensors", "RowTerms",
           "Softmax", "column_ids", "column_index", "compute_logits", "constants", "e_off_x0", "exp_minus_max",
           "exp_off_max", "gather_columns", "grad_block", "need_c", "noise_scale", "noise_sums", "row_terms",
           "softplus", "sum_off_max", "x_minus_log1p", "x_minus_log1p_and_ratio"]


# ---------------------------------------------------------------------------------------------------- element math
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


# scale of the float32 sum Σ P E (see :func:`noise_sums`)
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


# ---------------------------------------------------------------------------------------------------- the rows
class RowTensors(NamedTuple):
    """Per-position quantities that do not depend on the logits, each ``(N,)``; floating ones in the row precision
    (float64; float32 on MPS). A ``NamedTuple``: compiled functions take it as one argument and trace it field by
    field."""

    x0: torch.Tensor            # clean token, int64
    x_t: torch.Tensor           # noisy token, int64
    alpha: torch.Tensor         # α_t
    log_alpha: torch.Tensor     # log α_t
    u: torch.Tensor             # uniform noise mass of one clean state, m_t(y) for y clean ≠ x0
    alpha_over_u: torch.Tensor  # α_t / u (α_t where u = 0)
    m_x0: torch.Tensor          # m_t(x0)
    m_xt: torch.Tensor          # m_t(x_t)
    log_m_x0: torch.Tensor      # log m_t(x0) (−inf where 0)
    log_m_xt: torch.Tensor      # log m_t(x_t) (−inf where 0)
    same: torch.Tensor          # x_t = x0, bool
    possible: torch.Tensor      # q_t(x_t | x0) > 0, bool
    u_pos: torch.Tensor         # u > 0, bool
    x0_is_mask: torch.Tensor    # bool
    xt_is_mask: torch.Tensor    # bool
    w_active: torch.Tensor      # loss weight w where the forward rate into x_t is positive, else 0
    v_active: torch.Tensor      # forward rate into x_t where x_t is impossible under x0 (the exit-rate loss), else 0
    A: torch.Tensor             # w α_t where the loss is the ELBO term, else 0


# ---------------------------------------------------------------------------------------------------- element passes
def constants(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """0-d zero and one for torch.where: a Python number there becomes a new scalar tensor (an op) at every call; in
    the element dtype, and per-row where()s take them too (a 0-d tensor does not change the result's dtype)."""
    return torch.zeros((), dtype=dtype, device=device), torch.ones((), dtype=dtype, device=device)


def column_ids(S: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """0 … S − 1 ``(S,)``: as floats where exact (below 2^24 states; Inductor's CPU loops compare those in one
    instruction, int64 ids in several), int64 beyond."""
    return torch.arange(S, device=device, dtype=dtype if S < 2**24 else torch.int64)


def compute_logits(logits: torch.Tensor, col: torch.Tensor, mask_id: int | None, dtype: torch.dtype,
                   ) -> torch.Tensor:
    """The logits ``(n, S)`` in the element dtype, −inf at the mask column (MDLM's SUBS: the mask entry of the head
    is ignored)."""
    l = logits.to(dtype)
    if mask_id is not None:
        l = torch.where(col == mask_id, -math.inf, l)
    return l


def exp_off_max(logits_dtype: torch.dtype, l: torch.Tensor, mx: torch.Tensor, dtype: torch.dtype,
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(d, d_lo, P) of ``l`` ``(n, S)`` and its row maxima ``mx`` ``(n,)`` (in the element dtype): d = l − M (log P,
    exactly the value exponentiated; 0 at the maximum), P = e^{l − M}, and for float32 logits the rounding error
    d_lo of d with P compensated for it (:func:`exp_minus_max`; ``None`` otherwise)."""
    if logits_dtype == torch.float32 and dtype == torch.float32:
        return exp_minus_max(l, mx)
    d = l - mx.unsqueeze(-1)
    return d, None, torch.exp(d)


def sum_off_max(below: torch.Tensor, P: torch.Tensor, zero0: torch.Tensor, one0: torch.Tensor, rdt: torch.dtype,
                ) -> torch.Tensor:
    """s' = s − 1 = Σ_{P<1} P + (#{P = 1} − 1) ``(n,)`` in the rows' precision ``rdt``: 1 − p_j = s'/s to rounding
    even where p_j rounds to 1; and s = 1 + s' (a float32 Σ P would carry ~0.5 ulp of s per term it adds to a sum
    near 1: 2e-7 at 40 terms; Σ_{P<1} P is a sum of small terms, accurate relative to itself)."""
    return torch.where(below, P, zero0).sum(-1).to(rdt) + (torch.where(below, zero0, one0).sum(-1) - 1.0)


def noise_sums(d: torch.Tensor, d_lo: torch.Tensor | None, P: torch.Tensor, at_x0: torch.Tensor,
               k_e: torch.Tensor, log_k: tuple[torch.Tensor, torch.Tensor] | None, u_pos: torch.Tensor,
               zero0: torch.Tensor, one0: torch.Tensor, need_loss: bool, need_c: bool, dtype: torch.dtype,
               ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The uniform-noise sums over a block ``(n, S)``, each ``(n,)`` in the element dtype: Σ_{y≠x0} (x_y − log1p
    x_y) (if ``need_loss``), and (if ``need_c``) 2^100 Σ_{y≠x0} P_y e_y and T = Σ_{y≠x0} e_y (1 − P_y), with
    x = k P and e_y = x_y / (1 + x_y) off x0 (1 where u = 0). ``k_e`` is k ``(n,)`` in the element dtype, ``log_k``
    log k as element-dtype hi + lo (``None``: float64 elements, where log x_y is computed from x_y)."""
    X = torch.where(at_x0, zero0, P * k_e.unsqueeze(-1))
    f_sum = pce_sum = T = ratio = None
    if need_loss:
        log_X = None
        if log_k is not None:  # log x_y = d_y + log k, log k as hi + lo (its rows' precision)
            log_k_hi, log_k_lo = log_k
            lo = log_k_lo.unsqueeze(-1) if d_lo is None else d_lo + log_k_lo.unsqueeze(-1)
            log_X = (d + log_k_hi.unsqueeze(-1)) + lo
        f_X, ratio = x_minus_log1p_and_ratio(X, log_X, need_c)
        del log_X  # (eager: fewer (n, S) temporaries alive at once)
        f_sum = f_X.sum(-1)
        del f_X
    if need_c:
        ratio = X / (1.0 + X) if ratio is None else ratio
        del X
        E = torch.where(at_x0, zero0, torch.where(u_pos.unsqueeze(-1), ratio, one0))  # x0's term: pe_x0 per row
        del ratio
        # Σ p e ≈ k Σ P² where P is small: float32 products P E underflow from P ~ e^{−44} (k ~ 1) although A c'
        # (the gradient at x0) may be a normal number; scaled by 2^100 (exact) they stay normal to P E ~ 2^{−226}
        # (no overflow: Σ ≤ S 2^100), so every product that matters for a gradient above 2^{−126} is normal
        pce_sum = (P * C_SCALE * E).sum(-1)
        T = (E * (1.0 - P)).sum(-1)
    return f_sum, pce_sum, T


def grad_block(below: torch.Tensor, P: torch.Tensor, factors: torch.Tensor, u_pos: torch.Tensor,
               uniform_noise: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """∂L/∂logits ``(n, S)`` in ``out_dtype`` at every column as if it were neither x0 nor x_t: P (a e − b) below
    the maximum, g_j at it (``factors`` = (a, b, g_j, k) ``(4, n, 1)`` from
    :func:`row_terms`)."""
    a_e, b_e, g_j_e, k_e = factors
    e = e_off_x0(P, k_e.squeeze(-1) if uniform_noise else None, u_pos)
    return torch.where(below, P * (a_e * e - b_e), g_j_e).to(out_dtype)


def e_off_x0(P: torch.Tensor, k: torch.Tensor | None, u_pos: torch.Tensor) -> torch.Tensor | float:
    """e_z = 1 − q0_z/qθ_z for z ≠ x0 from P_z ``(n, m)``: x/(1 + x) with x = k P (1 where u = 0 or ``k`` is
    ``None``, the mask kernel)."""
    if k is None:
        return 1.0
    X = P * k.unsqueeze(-1)
    return torch.where(u_pos.unsqueeze(-1), X / (1.0 + X), torch.ones((), dtype=X.dtype, device=X.device))


# ---------------------------------------------------------------------------------------------------- per row
class Config(NamedTuple):
    """The static facts of one call of the loss passes (what a compiled copy specialises on)."""

    uniform_noise: bool  # u > 0 on some row: the noise pass runs
    need_loss: bool
    need_grad: bool
    need_stats: bool     # return the RowStats a later gradient pass starts from
    dtype: torch.dtype   # element dtype of the (n, S) passes


class RowStats(NamedTuple):
    """What a loss pass hands to a later gradient pass on the same logits, each ``(n,)`` in the rows' precision."""

    mx: torch.Tensor      # M = max_y l_y
    s: torch.Tensor       # s = Σ_y P_y, P_y = e^{l_y − M}
    s_off: torch.Tensor   # s' = s − 1, summed as Σ_{P<1} P + (#{P = 1} − 1)
    c_rest: torch.Tensor  # c' = Σ_{y≠x0} p_y e_y
    T: torch.Tensor       # T = Σ_{y≠x0} e_y (1 − P_y) (zeros without uniform noise)


class Softmax(NamedTuple):
    """Pass 1 per row, in the rows' precision: the maximum M, s and s'."""

    mx: torch.Tensor
    s: torch.Tensor
    s_off: torch.Tensor


class Columns(NamedTuple):
    """Per-row columns (int64 ids) or the values there: x0 ``(n,)``, x_t ``(n,)`` and, for a gradient, the two
    columns j ``(n, 2)`` whose gradient is written apart (``None`` without a gradient)."""

    x0: torch.Tensor
    x_t: torch.Tensor
    j: torch.Tensor | None


class NoiseScale(NamedTuple):
    """k = α / (u s) with x_y = k P_y off x0: in the rows' precision, in the element dtype, and log k as element-dtype
    hi + lo (``None`` unless the loss is needed in float32 elements)."""

    k: torch.Tensor
    k_e: torch.Tensor
    log_k: tuple[torch.Tensor, torch.Tensor] | None


class Noise(NamedTuple):
    """Uniform noise per row: k (rows' precision) and the sums of pass 2 (element dtype); all ``None`` for a mask
    kernel (and the sums for what a call does not need)."""

    k: torch.Tensor | None
    f_sum: torch.Tensor | None    # Σ_{y≠x0} (x_y − log1p x_y)
    pce_sum: torch.Tensor | None  # 2^100 Σ_{y≠x0} P_y e_y
    T: torch.Tensor | None        # Σ_{y≠x0} e_y (1 − P_y)


class RowTerms(NamedTuple):
    """What :func:`row_terms` returns: the loss ``(n,)`` (element dtype), the gradient pass's factors (a, b, g_j, k)
    ``(4, n, 1)`` (element dtype), the gradient at the columns j (ids and values, ``(n, 2)``) and the statistics."""

    loss: torch.Tensor | None
    factors: torch.Tensor | None
    fix_index: torch.Tensor | None
    fix_value: torch.Tensor | None
    stats: RowStats | None


def need_c(config: Config, stats: RowStats | None) -> bool:
    """Whether c' = Σ_{y≠x0} p_y e_y (and T) must be summed: for the statistics, or for a gradient without them."""
    return config.need_stats or (config.need_grad and stats is None)


def column_index(rows: RowTensors, need_grad: bool) -> Columns:
    """The columns each row reads alone: x0 and x_t (0 where one is the mask id, which may lie outside the columns —
    the caller slices an end mask column off — and is flagged anyway); with ``need_grad`` also j = (x0, x_t), a real
    column in place of a mask id (its value recomputed)."""
    x0, x_t, x0_is_mask, xt_is_mask = rows.x0, rows.x_t, rows.x0_is_mask, rows.xt_is_mask
    x0_c, xt_c = torch.where(x0_is_mask, 0, x0), torch.where(xt_is_mask, 0, x_t)
    if not need_grad:
        return Columns(x0_c, xt_c, None)
    j1 = torch.where(x0_is_mask, xt_c, x0)
    return Columns(x0_c, xt_c, torch.stack((j1, torch.where(xt_is_mask, j1, x_t)), -1))


def gather_columns(src: torch.Tensor, index: Columns, mask_id: int | None, dtype: torch.dtype) -> Columns:
    """``src[n, i[n]]`` for each index of :func:`column_index` (``(n,)`` or ``(n, 2)``) in ``dtype``, −inf at
    ``mask_id``: the values of :func:`compute_logits` at those columns (``src`` the
    logits themselves, or those already computed with ``mask_id=None``)."""
    values: list[torch.Tensor | None] = []
    for i in index:
        if i is None:
            values.append(None)
            continue
        v = (src.gather(-1, i.unsqueeze(-1)).squeeze(-1) if i.dim() == 1 else src.gather(-1, i)).to(dtype)
        values.append(v if mask_id is None else torch.where(i == mask_id, -math.inf, v))
    return Columns(*values)  # type: ignore[arg-type]  # x0 and x_t are never None


def noise_scale(alpha_over_u: torch.Tensor, s: torch.Tensor, need_loss: bool, dtype: torch.dtype) -> NoiseScale:
    """k = α / (u s) ``(n,)`` in the rows' precision and the element dtype ``dtype``, and (if ``need_loss`` and the
    element dtype is not float64) log k as element-dtype hi + lo."""
    k = alpha_over_u / s
    log_k = None
    if need_loss and dtype != torch.float64:
        log_k_full = torch.log(k)
        log_k_hi = log_k_full.to(dtype)
        log_k = (log_k_hi, (log_k_full - log_k_hi).to(dtype))
    return NoiseScale(k, k.to(dtype), log_k)


def row_terms(rows: RowTensors, softmax: Softmax, index: Columns, values: Columns, noise: Noise,
              stats: RowStats | None, grad_scale: torch.Tensor | None, consts: tuple[torch.Tensor, torch.Tensor],
              config: Config) -> RowTerms:
    """Everything per row, ``(n,)`` in the rows' precision: from pass 1 (``softmax``), the logits at the columns
    ``index`` (``values``, element dtype) and pass 2 (``noise``), or the statistics ``stats`` of an earlier call:
    the loss (if ``config.need_loss``), the gradient's per-row factors for
    :func:`grad_block` and its values at the columns j (if ``config.need_grad``;
    ``grad_scale`` ``(n,)`` is g, ones when ``None``), and the row statistics (if ``config.need_stats``).
    ``consts`` are 0-d zero and one in the element dtype."""
    x0, x_t, alpha, log_alpha, u = rows.x0, rows.x_t, rows.alpha, rows.log_alpha, rows.u
    m_x0, m_xt, log_m_x0, log_m_xt = rows.m_x0, rows.m_xt, rows.log_m_x0, rows.log_m_xt
    same, possible, u_pos, x0_is_mask, xt_is_mask = rows.same, rows.possible, rows.u_pos, rows.x0_is_mask, \
        rows.xt_is_mask
    w_active, v_active, A = rows.w_active, rows.v_active, rows.A
    mx_r, s, s_off = softmax
    zero0, one0 = consts
    rdt = alpha.dtype
    log_s = torch.log(s)
    # l_x0 − M in the rows' precision: exact for float32 operands up to 2^{−53} |l_x0 − M|
    d_x0, d_xt = values.x0 - mx_r, values.x_t - mx_r
    j_is_x0 = (d_x0 == 0) & ~x0_is_mask  # x0 at the maximum (P_x0 = 1): 1 − p_x0 = s'/s
    one_minus_p_j = s_off / s
    near_one = j_is_x0 & (one_minus_p_j < 0.5)  # log p_x0 = log1p(−(1 − p_x0)) there, l_x0 − max − log s elsewhere
    log_p_x0 = torch.where(near_one, torch.log1p(-one_minus_p_j), d_x0 - log_s).masked_fill(x0_is_mask, -math.inf)
    log_p_xt = (d_xt - log_s).masked_fill(xt_is_mask, -math.inf)
    p_x0, p_xt = torch.exp(log_p_x0), torch.exp(log_p_xt)
    one_minus_p_x0 = torch.where(j_is_x0, one_minus_p_j, -torch.expm1(log_p_x0))  # p_x0 ≤ 1/2 if x0 is not j
    # qθ = α p + m in linear space, a few ulp (its log from logaddexp of logs of size 10–30 would carry ~30 ulp);
    # from logs only where it underflows: a confidently wrong model under the mask kernel (m = 0, p = e^{−10⁴})
    tiny = torch.finfo(rdt).tiny / torch.finfo(rdt).eps
    q_theta_x0, q_theta_xt = alpha * p_x0 + m_x0, alpha * p_xt + m_xt
    lin_x0, lin_xt = q_theta_x0 > tiny, q_theta_xt > tiny
    log_q_theta_x0 = torch.where(lin_x0, torch.log(torch.where(lin_x0, q_theta_x0, one0)),
                                 torch.logaddexp(log_alpha + log_p_x0, log_m_x0))
    log_q_theta_xt = torch.where(lin_xt, torch.log(torch.where(lin_xt, q_theta_xt, one0)),
                                 torch.logaddexp(log_alpha + log_p_xt, log_m_xt))
    # at x0: q0/qθ = 1 + r with r = α (1 − p_x0) / qθ(x0) ≥ 0, ℓ = log1p(r); where qθ(x0) underflows, ℓ from logs
    # (finite: 10⁴ for a model wrong by 10⁴ nats, where r and 1/qθ are not)
    r_x0 = alpha * one_minus_p_x0 / torch.where(lin_x0, q_theta_x0, one0)
    l_at_x0 = torch.where(lin_x0, torch.log1p(r_x0),
                          softplus(log_alpha + torch.log(one_minus_p_x0) - log_q_theta_x0))
    # off x0: ρ = m(x_t) / qθ(x_t) = 1 / (1 + y), y = α p_xt / m(x_t)
    y_xt = alpha * p_xt / torch.where(m_xt > 0, m_xt, one0)
    # ρ enters only rows with a non-zero weight (at a clean token of the mask kernel ρ = 1/p_θ(x0) may overflow)
    used = possible & (w_active != 0)
    log_rho = torch.where(used, torch.where(same, l_at_x0, -torch.log1p(y_xt)), zero0)
    at_x0_lin = same & lin_x0 & used
    one_minus_rho = torch.where(at_x0_lin, -r_x0, torch.where(same, -torch.expm1(log_rho), y_xt / (1.0 + y_xt)))
    one_minus_rho = torch.where(used, one_minus_rho, zero0)
    # p_x0 e_x0 with e_y = 1 − q0_y/qθ_y: −(1 − p_x0) α p_x0 / qθ(x0) ∈ [−1, 0] (e_x0 alone is −1/p_x0 at worst)
    pe_x0 = -one_minus_p_x0 * torch.where(lin_x0, alpha * (p_x0 / torch.where(lin_x0, q_theta_x0, one0)),
                                          torch.exp(log_alpha + log_p_x0 - log_q_theta_x0))
    # c = Σ_y p_y e_y = c' + p_x0 e_x0 with c' = Σ_{y≠x0} p_y e_y (kept apart: the gradient at x0 needs c' alone),
    # T = Σ_{y≠x0} e_y (1 − P_y) (the gradient at j; see loss_and_grad)
    f_sum, pce_sum, T = noise.f_sum, noise.pce_sum, noise.T
    c_rest: torch.Tensor | None
    if stats is not None:
        c_rest, T = stats.c_rest, stats.T
    elif not config.uniform_noise:  # u = 0 (mask kernel): e_y = 1 off x0, so c' = 1 − p_x0 (T is not used)
        c_rest = one_minus_p_x0
    else:
        c_rest = None if pce_sum is None else pce_sum / (s * C_SCALE)

    loss = None
    if config.need_loss:
        # Σ_y f(q0_y, qθ_y) = f at x0 + (u Σ_{y≠x0} (x_y − log1p x_y)  or  α (1 − p_x0) when u = 0)
        # f(q0, qθ) at x0 = qθ g(ℓ) (series near ℓ = 0), = q0 (ℓ − 1) + qθ otherwise (q0 = α + m(x0): no e^ℓ)
        q_theta = torch.where(lin_x0, q_theta_x0, torch.exp(log_q_theta_x0))
        small = l_at_x0 < 0.5
        term1 = torch.where(small, q_theta * bregman_g(torch.where(small, l_at_x0, zero0)),
                            (alpha + m_x0) * (l_at_x0 - 1.0) + q_theta)
        term2 = alpha * one_minus_p_x0
        if f_sum is not None:
            term2 = torch.where(u_pos, u * f_sum, term2)
        # ρ − 1 − log ρ: r − log1p(r) at x0 (accurate for every r ≥ 0), e^{log ρ} − 1 − log ρ elsewhere (log ρ ≤ 0)
        rho_term = torch.where(at_x0_lin, x_minus_log1p(torch.where(at_x0_lin, r_x0, zero0)), expm1_minus_x(log_rho))
        term = term1 + term2 + rho_term
        exit_theta = v_active * torch.expm1(torch.where(v_active > 0, -log_q_theta_xt, zero0))
        loss = torch.where(possible, w_active * term, exit_theta).to(config.dtype)
    # need_stats implies need_c
    if config.need_stats and T is None:  # mask kernel: T is not used, kept for a uniform layout of the statistics
        T = torch.zeros_like(alpha)
    out_stats = None
    if config.need_stats and c_rest is not None and T is not None:
        out_stats = RowStats(mx_r, s, s_off, c_rest, T)
    if not config.need_grad:
        return RowTerms(loss, None, None, None, out_stats)
    assert c_rest is not None  # need_grad: c' is computed or given
    c = c_rest + pe_x0

    # ---- ∂L/∂logit_z = p_z [A (e_z − c) − H p_xt] + δ_{z,x_t} H p_xt
    g = None if grad_scale is None else grad_scale.to(rdt)
    A_g = A if g is None else A * g
    p_xt_over_q_xt = torch.where(lin_xt, p_xt / torch.where(lin_xt, q_theta_xt, one0),
                                 torch.exp(log_p_xt - log_q_theta_xt))
    exit_scale = torch.exp(torch.where(v_active > 0, -log_q_theta_xt, zero0))  # 1/qθ(x_t) where the loss is an exit
    g_exit = -alpha * v_active * p_xt_over_q_xt * exit_scale
    Hp = torch.where(possible, A_g * one_minus_rho * p_xt_over_q_xt,
                     g_exit if g is None else g_exit * g)
    a_row, b_row = A_g / s, (A_g * c + Hp) / s  # ∂L/∂logit_z = P_z (a e_z − b) + δ_{z,x_t} H p_xt
    # at a column j ≠ x0 at the maximum: (A g (e_j − c) + H (s δ_{j,x_t} − 1)) / s (p_j = 1/s), e_j − c as in
    # loss_and_grad's docstring (no cancellation; u > 0 on every row of a uniform-noise kernel), s δ − 1 = s' at
    # j = x_t (never a mask x_t)
    k = noise.k
    if k is not None:
        assert T is not None  # computed or given with c'
        one_plus_k = 1.0 + k
        e_j_minus_c = T / (one_plus_k * s) + p_x0 * (k / one_plus_k) - pe_x0
    else:
        e_j_minus_c = p_x0 - pe_x0
    A_e = A_g * e_j_minus_c
    g_j, g_j_xt = (A_e - Hp) / s, (A_e + Hp * s_off) / s
    # the element pass writes every column as if it were neither x0 nor x_t (no per-element index test; the maximum
    # by its P = 1) from these per-row factors (its dtype, one conversion); then those two columns per row here
    factors = torch.stack((a_row, b_row, g_j, a_row if k is None else k)).to(config.dtype).unsqueeze(-1)
    j = index.j  # (n, 2)
    assert j is not None and values.j is not None  # need_grad: the columns j are gathered
    d_j = values.j - mx_r.unsqueeze(-1)
    P_j = torch.exp(d_j)
    is_xt = (j == x_t.unsqueeze(-1)) & ~xt_is_mask.unsqueeze(-1)
    H_j = torch.where(is_xt, Hp.unsqueeze(-1), 0.0)
    value_j = P_j * (a_row.unsqueeze(-1) * e_off_x0(P_j, k, u_pos) - b_row.unsqueeze(-1)) + H_j
    value_j = torch.where(d_j < 0, value_j, torch.where(is_xt, g_j_xt.unsqueeze(-1), g_j.unsqueeze(-1)))
    # at z = x0: A g (p_x0 e_x0 (1 − p_x0) − p_x0 c') + H ([x0 = x_t] − p_x0) (both A-terms ≤ 0; e_x0 itself may
    # overflow; 0 at a mask x0, where p_x0 = p_x0 e_x0 = 0)
    g_x0 = A_g * (pe_x0 * one_minus_p_x0 - p_x0 * c_rest) + Hp * torch.where(same, one_minus_p_x0, -p_x0)
    value_j = torch.where(j == x0.unsqueeze(-1), g_x0.unsqueeze(-1), value_j)
    return RowTerms(loss, factors, j, value_j, out_stats)

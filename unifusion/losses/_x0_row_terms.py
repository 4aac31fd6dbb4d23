"""The per-row half of the fast x0-head loss: everything per row between the element passes, from row sums.

:func:`row_terms` turns the row maximum M, s = Σ_y e^{l_y − M}, the logits at the few columns a row reads alone (x0,
x_t) and the uniform-noise sums of :func:`unifusion.losses._x0_elements.noise_sums` into the loss, the per-row
factors of the gradient pass and the gradient at those columns (equations in :mod:`unifusion.losses.fast` and in
:func:`unifusion.losses._x0_passes.loss_and_grad`). Everything here is ``(n,)`` in the rows' precision (float64
wherever the device has it): it costs nothing next to the ``(n, S)`` passes and removes every float32 rounding of a
large per-row number that would feed a small result. The named structures below are what the driver hands between
the pieces; they are named tuples, which ``torch.compile`` traces without graph breaks.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .._math import bregman_g, expm1_minus_x
from ._x0_elements import e_off_x0
from ._x0_math import C_SCALE, softplus, x_minus_log1p
from ._x0_rows import RowTensors

__all__ = ["Columns", "Config", "Noise", "NoiseScale", "RowStats", "RowTerms", "Softmax", "column_index",
           "gather_columns", "need_c", "noise_scale", "row_terms"]


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
    ``mask_id``: the values of :func:`~unifusion.losses._x0_elements.compute_logits` at those columns (``src`` the
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
    :func:`~unifusion.losses._x0_elements.grad_block` and its values at the columns j (if ``config.need_grad``;
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

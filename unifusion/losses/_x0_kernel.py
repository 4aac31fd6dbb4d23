"""The per-row arithmetic of :mod:`unifusion.losses.fast` as one pure tensor function, and how it is run.

:func:`loss_and_grad` maps a block of logits ``(n, S)`` and the logit-free per-row quantities ``(n,)`` to the loss
``(n,)`` and, optionally, ∂(Σ_n g_n L_n)/∂logits ``(n, S)`` (equations in :mod:`unifusion.losses.fast`). It is written
with plain out-of-place tensor ops so that ``torch.compile`` can fuse it: Inductor turns it into a few loops per row
(max, Σ exp off the max with the count at it, Σ (x − log1p x) with Σ p e, then the gradient store). On CPU it keeps
exp(l − max) between those loops, so :func:`run` calls a loss pass on blocks of rows small enough for that buffer to
stay in cache; a gradient pass from saved statistics (one loop per row) and everything on GPUs run on all rows at once.
That is what puts the loss at or below the cost of a cross-entropy. Eagerly (the eager backend, and the fallback when
compiling fails) the same pieces run one by one: each of the three element passes (max and s'; the uniform-noise sums;
the gradient) over blocks of rows, the per-row math between them once over all rows, so that on an accelerator a batch
costs the per-row ops once plus a few dozen ops per block (:data:`EAGER_ACCELERATOR_PASS_BYTES`).

Backends: :func:`unifusion.set_backend` (``"auto"`` by default: eager first, compiled in the background once a
configuration repeats with enough work; ``"compiled"``; ``"eager"``; see :mod:`unifusion._compile`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from .. import _compile
from .._math import bregman_g, expm1_minus_x

__all__ = ["loss_and_grad", "run", "x_minus_log1p"]

# eager backend. loss_and_grad is three passes over the (rows, S) elements with per-row math between them; eagerly
# each pass runs on blocks of rows and the per-row math once over all rows (_eager). On the CPU every pass takes
# blocks of EAGER_BLOCK_ELEMENTS logits (a few MB of temporaries that fit the caches; an op is a cheap call there),
# spread over Python threads. On an accelerator every op is a kernel launch: a batch costs ~420 per-row ops once
# plus, per block, ~14 (max and s'), ~60 (uniform noise: Σ (x − log1p x), Σ P e, T) and ~15 (the gradient) ops on
# (rows, S) tensors at bf16 logits (~25 in the first and last for float32 logits). So each pass takes as many rows
# as keep its temporaries (EAGER_PASS_WIDTH) within its byte budget (EAGER_ACCELERATOR_PASS_BYTES). The budgets keep
# every phase at or below the peak of the earlier eager blocks (2²⁷ logits through the whole function, bf16 logits:
# 8.9 GiB of temporaries in a forward with uniform noise, 2.1 GiB in one without — the max pass alone — and 3.3 GiB
# beside the gradient in the backward). bf16 16,384 × 262,144 then takes 27 + 26 + 25 blocks, 2,654 launches
# (15,754 before; 1,027 for the mask kernel, 13,328 before), 16,384 × 49,152 849 (3,454); tests/test_launch_count.py
# counts them and measures the temporaries on the meta device.
EAGER_BLOCK_ELEMENTS = 1 << 18
EAGER_ACCELERATOR_PASS_BYTES = {"max": 2 << 30, "noise": 8 << 30, "grad": 3 << 30}
# (rows, S) temporaries each pass holds at once at most, in elements of the element dtype, as (bf16/fp16/float64
# logits, float32 logits: compensated l − M); measured: bf16 12, 50, 17 bytes per logit; float32 28, 58, 28;
# float64 24, 98, 33
EAGER_PASS_WIDTH = {"max": (3.25, 7.25), "noise": (12.75, 14.75), "grad": (4.5, 7.25)}


def eager_block_rows(device: torch.device, S: int, logits_dtype: torch.dtype, dtype: torch.dtype,
                     pass_name: str) -> int:
    """Rows per block of the eager pass ``pass_name`` (``"max"``, ``"noise"``, ``"grad"``) over ``(rows, S)``
    logits of ``logits_dtype`` with element dtype ``dtype`` on ``device``: :data:`EAGER_BLOCK_ELEMENTS` logits on
    the CPU; elsewhere as many rows as keep the pass's temporaries (:data:`EAGER_PASS_WIDTH` elements of ``dtype``
    per logit) within its :data:`EAGER_ACCELERATOR_PASS_BYTES`."""
    S = max(S, 1)
    if device.type == "cpu":
        return max(1, EAGER_BLOCK_ELEMENTS // S)
    width = EAGER_PASS_WIDTH[pass_name][logits_dtype == torch.float32 and dtype == torch.float32]
    return max(1, int(EAGER_ACCELERATOR_PASS_BYTES[pass_name] // (width * dtype.itemsize * S)))


# compiled backend on CPU: elements per call (Inductor's CPU loops store exp(l − max) between passes; a block this
# size keeps it in the last-level cache)
COMPILED_CPU_BLOCK_ELEMENTS = 1 << 22
# recompute exp/log1p per pass instead of storing N×S intermediates (Inductor realises a buffer read > 4 times)
_INDUCTOR_OPTIONS = {"realize_reads_threshold": 1000, "realize_opcount_threshold": 100000,
                     "realize_acc_reads_threshold": 1000, "realize_cpu_acc_reads_threshold": 1000,
                     "realize_cpu_opcount_threshold": 100000}
ROW_FIELDS = ("x0", "x_t", "alpha", "log_alpha", "u", "alpha_over_u", "m_x0", "m_xt", "log_m_x0", "log_m_xt",
              "safe_log_m_xt",
              "same", "possible", "u_pos", "x0_is_mask", "xt_is_mask", "w_active", "v_active", "A")
# row statistics a loss pass hands to a later gradient pass (see loss_and_grad and stats_buffers)
NUM_STATS = 5


def stats_buffers(num_rows: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Empty ``(num_rows,)`` buffers in ``dtype`` (the rows' precision) for the :data:`NUM_STATS` row statistics of
    :func:`loss_and_grad`: the row maximum M, s, s', c' and T."""
    return tuple(torch.empty(num_rows, dtype=dtype, device=device) for _ in range(NUM_STATS))


# ---------------------------------------------------------------------------------------------------- math
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
    return _x_minus_log1p_and_ratio(x, log_x, False)[0]


def _x_minus_log1p_and_ratio(x: torch.Tensor, log_x: torch.Tensor | None, with_ratio: bool,
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


def loss_and_grad(logits: torch.Tensor, rows: tuple[torch.Tensor, ...], mask_id: int | None,
                  grad_scale: torch.Tensor | None, stats: tuple[torch.Tensor, ...] | None,
                  grad_out: torch.Tensor | None, uniform_noise: bool, need_loss: bool, need_grad: bool,
                  need_stats: bool, dtype: torch.dtype,
                  ) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None,
                             tuple[torch.Tensor, ...] | None]:
    """Loss ``(n,)`` in ``dtype`` (if ``need_loss``), gradient ``(n, S)`` in the logits' dtype (if ``need_grad``,
    into ``grad_out``) and, if ``need_stats``, the :data:`NUM_STATS` row statistics ``(n,)`` in the rows' precision
    (:func:`stats_buffers`): the row maximum M = max_y l_y of the logits, s = Σ_y P_y with P_y = e^{l_y − M},
    s' = s − 1 summed as Σ_{P_y < 1} P_y + (#{P_y = 1} − 1), c' = Σ_{y≠x0} p_y e_y and T = Σ_{y≠x0} e_y (1 − P_y).

    **Two precisions.** ``dtype`` (float32 for bf16/fp16/fp32 logits, float64 for float64 ones) is that of the
    ``(n, S)`` element passes; every per-row quantity (the logit-free ``rows``, the gathered logits at x0 and x_t,
    log s, the weights a, b of the gradient, the loss terms) is computed in the rows' dtype, float64 wherever the
    device has it (float32 on MPS). That costs nothing (``(n,)`` tensors) and removes every float32 rounding of a
    large per-row number that would feed a small result: log p = (l − M) − log s rounded once in float32 carries an
    absolute error of 2^{−24} (|M| + log S), i.e. that relative error in p and in everything built from it; α p_x0
    rounded alone can be subnormal where α p_x0 / qθ(x0) is a normal number.

    **Rounding of l − M (float32 logits).** d = fl(l − M) is off by up to 2^{−24}|d| (exact when l ≥ M/2, Sterbenz),
    so e^d carries that relative error: 6e-6 at |d| = 104, the last d with e^d a float32 — and every sum, loss and
    gradient entry inherits it from its dominant terms (e.g. 1 − p_x0 = s'/s for a confident model, from tokens
    ~20 nats below the maximum, systematically when their logits are equal: padded vocabulary rows). So float32
    logits get the exact error d_lo = (l − M) − d of the subtraction (Knuth's TwoSum, five float32 operations, no
    ordering of |l| and |M| needed) and P = e^d (1 + d_lo) (the second-order term d_lo²/2 < 2e-11 is dropped), and
    log x_y = d + log k uses d + d_lo. bf16/fp16 logits skip this: two 8-bit (11-bit) significands differ exactly in
    float32 unless the smaller of |l|, |M| is below 2^{−17} |l − M| (fp16: 2^{−14}), i.e. a logit within ~1e-3 of 0
    and ≥ 16 nats from the maximum, where e^d is off by ≤ 2^{−24}|d| as above.

    **The token holding most of the probability.** Where a column j at the maximum (P_j = 1) has p_j ≈ 1 (a confident
    model), 1 − p_j and the gradient at j are far below the terms a direct formula subtracts: log p_x0 = l_x0 − M −
    log s carries an absolute error of one ulp of 1, all of log p_x0 ≈ −(1 − p_x0) once that is smaller, and
    ∂L/∂l_j = p_j [A (e_j − c) − H] + δ_{j,x_t} H is a difference of O(A) terms whose true value is O(A (1 − p_j)).
    So 1 − p_j = s'/s is summed from the other tokens (two more accumulators in the pass that sums s: the entries
    below the maximum and the count of those at it, so no argmax and no column index is needed), and the gradient at
    every column with P = 1 is written without subtractions of such terms: e_j − c = Σ_y p_y (e_j − e_y) with, off
    x0, e_j − e_y = k (1 − P_y) / ((1 + k)(1 + k P_y)) (x = k P, P_j = 1), i.e. T / ((1 + k) s), and at x0
    p_x0 (e_j − e_x0) = p_x0 k / (1 + k) − p_x0 e_x0 (both ≥ 0); at j = x0 it is p_x0 e_x0 (1 − p_x0) − p_x0 c'
    (both ≤ 0). With ties at the maximum p_j ≤ 1/2 and the direct formulas are accurate too.

    ``rows`` holds the tensors named in ``ROW_FIELDS`` (each ``(n,)``, floating ones in the row precision);
    ``mask_id`` is the mask state or ``None``; ``grad_scale`` ``(n,)`` is g (ones when ``None``). Passing the
    statistics of an earlier call on the same logits as ``stats`` leaves the gradient one pass over each row (exp,
    divide, store). The gradient needs ``grad_out`` (logits' shape and dtype), or ``grad_out=None`` to write it over
    ``logits`` (after every read of them): it is written there except at the columns x0 and x_t of each row, and
    ``(index, value)``, each ``(n, 2)``, is returned in its place: ``_put(grad_out, index, value)`` completes it
    (:func:`run` does; inside a compiled function that scatter would cost a copy of the block). The in-place case
    takes the logits once rather than as two arguments that alias: a compiled function given aliasing inputs gets a
    "synthetic base" from AOTAutograd, and Inductor's on-disk cache then hands a later process a graph for another
    view/base relation (an ``AssertionError: expected size ...`` on its first call; torch 2.15).

    **Pieces.** Three passes over the ``(n, S)`` elements with per-row math between them, each a function of its
    own: pass 1 (:func:`_compute_logits`, :func:`_exp_off_max`, :func:`_sum_off_max`: M and s'), the values at the
    columns each row reads alone (:func:`_column_index`, :func:`_gather_columns`), k (:func:`_noise_scale`), pass 2
    (:func:`_noise_sums`, uniform noise only), the per-row terms (:func:`_row_terms`: the loss, the gradient's
    per-row factors and its values at x0 and x_t) and pass 3 (:func:`_grad_block`). Here they run in that order on
    one block, which ``torch.compile`` fuses; the eager backend runs each pass on blocks of rows and the per-row
    pieces once over all rows (:func:`_eager`).
    """
    x0, alpha_over_u, u_pos = rows[0], rows[5], rows[13]
    rdt = rows[2].dtype  # per-row precision
    zero0, one0 = _constants(dtype, logits.device)
    col = _column_ids(logits.shape[-1], dtype, logits.device)
    # ---- pass 1, softmax over clean states, unnormalised: P = exp(l − M), s = 1 + s'; P = 1 exactly at the maximum
    l = _compute_logits(logits, col, mask_id, dtype)
    mx = l.amax(-1) if stats is None else stats[0].to(dtype)
    d, d_lo, P = _exp_off_max(logits.dtype, l, mx, dtype)
    below = d < 0
    if stats is None:
        mx_r, s_off = mx.to(rdt), _sum_off_max(below, P, zero0, one0, rdt)
        s = s_off + 1.0
    else:
        mx_r, s, s_off = stats[0], stats[1], stats[2]
    index = _column_index(rows, need_grad)
    cols = _gather_columns(l, index, None, dtype)
    # ---- pass 2 (uniform noise): Σ_{y≠x0} (x_y − log1p x_y), Σ_{y≠x0} P_y e_y, T
    k = k_e = log_k = None
    sums: tuple[torch.Tensor | None, ...] = (None, None, None)
    if uniform_noise:
        k, k_e, log_k = _noise_scale(alpha_over_u, s, need_loss, dtype)
        if need_loss or _need_c(stats, need_grad, need_stats):
            at_x0 = col == x0.to(col.dtype).unsqueeze(-1)
            sums = _noise_sums(d, d_lo, P, at_x0, k_e, log_k, u_pos, zero0, one0, need_loss,
                               _need_c(stats, need_grad, need_stats), dtype)
    # ---- per row: the loss, the gradient's factors and its values at x0 and x_t
    loss, factors, fix, out_stats = _row_terms(rows, mx_r, s, s_off, index, cols, k, sums, stats, grad_scale, zero0,
                                               one0, uniform_noise, need_loss, need_grad, need_stats, dtype)
    if factors is None or fix is None:
        return loss, None, out_stats
    # ---- pass 3: the gradient
    grad = _grad_block(below, P, factors, u_pos, uniform_noise, logits.dtype)
    (logits if grad_out is None else grad_out).copy_(grad)
    return loss, (fix[0], fix[1].to(logits.dtype)), out_stats


# --------------------------------------------------------------------------- the pieces of loss_and_grad
def _need_c(stats: tuple[torch.Tensor, ...] | None, need_grad: bool, need_stats: bool) -> bool:
    """Whether c' = Σ_{y≠x0} p_y e_y (and T) must be summed: for the statistics, or for a gradient without them."""
    return need_stats or (need_grad and stats is None)


def _constants(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """0-d zero and one for torch.where: a Python number there becomes a new scalar tensor (an op) at every call; in
    the element dtype, and per-row where()s take them too (a 0-d tensor does not change the result's dtype)."""
    return torch.zeros((), dtype=dtype, device=device), torch.ones((), dtype=dtype, device=device)


def _column_ids(S: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """0 … S − 1 ``(S,)``: as floats where exact (below 2^24 states; Inductor's CPU loops compare those in one
    instruction, int64 ids in several), int64 beyond."""
    return torch.arange(S, device=device, dtype=dtype if S < 2**24 else torch.int64)


def _compute_logits(logits: torch.Tensor, col: torch.Tensor, mask_id: int | None, dtype: torch.dtype,
                    ) -> torch.Tensor:
    """The logits ``(n, S)`` in the element dtype, −inf at the mask column (MDLM's SUBS: the mask entry of the head
    is ignored)."""
    l = logits.to(dtype)
    if mask_id is not None:
        l = torch.where(col == mask_id, -math.inf, l)
    return l


def _exp_off_max(logits_dtype: torch.dtype, l: torch.Tensor, mx: torch.Tensor, dtype: torch.dtype,
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(d, d_lo, P) of ``l`` ``(n, S)`` and its row maxima ``mx`` ``(n,)`` (in the element dtype): d = l − M (log P,
    exactly the value exponentiated; 0 at the maximum), P = e^{l − M}, and for float32 logits the rounding error
    d_lo of d with P compensated for it (:func:`_exp_minus_max`; ``None`` otherwise)."""
    if logits_dtype == torch.float32 and dtype == torch.float32:
        return _exp_minus_max(l, mx)
    d = l - mx.unsqueeze(-1)
    return d, None, torch.exp(d)


def _sum_off_max(below: torch.Tensor, P: torch.Tensor, zero0: torch.Tensor, one0: torch.Tensor, rdt: torch.dtype,
                 ) -> torch.Tensor:
    """s' = s − 1 = Σ_{P<1} P + (#{P = 1} − 1) ``(n,)`` in the rows' precision ``rdt``: 1 − p_j = s'/s to rounding
    even where p_j rounds to 1; and s = 1 + s' (a float32 Σ P would carry ~0.5 ulp of s per term it adds to a sum
    near 1: 2e-7 at 40 terms; Σ_{P<1} P is a sum of small terms, accurate relative to itself)."""
    return torch.where(below, P, zero0).sum(-1).to(rdt) + (torch.where(below, zero0, one0).sum(-1) - 1.0)


def _column_index(rows: tuple[torch.Tensor, ...], need_grad: bool) -> tuple[torch.Tensor, ...]:
    """The columns each row reads alone: x0 and x_t ``(n,)`` (0 where one is the mask id, which may lie outside the
    columns — :func:`run` slices the mask column off — and is flagged anyway); with ``need_grad`` also the two
    columns whose gradient is written apart, j = (x0, x_t) ``(n, 2)``, a real column in place of a mask id (its
    value recomputed)."""
    x0, x_t, x0_is_mask, xt_is_mask = rows[0], rows[1], rows[14], rows[15]
    x0_c, xt_c = torch.where(x0_is_mask, 0, x0), torch.where(xt_is_mask, 0, x_t)
    if not need_grad:
        return x0_c, xt_c
    j1 = torch.where(x0_is_mask, xt_c, x0)
    return x0_c, xt_c, torch.stack((j1, torch.where(xt_is_mask, j1, x_t)), -1)


def _gather_columns(src: torch.Tensor, index: tuple[torch.Tensor, ...], mask_id: int | None, dtype: torch.dtype,
                    ) -> tuple[torch.Tensor, ...]:
    """``src[n, i[n]]`` (``(n,)`` for an ``(n,)`` index ``i``, ``(n, 2)`` for an ``(n, 2)`` one) in ``dtype``, −inf
    at ``mask_id``, for each index of :func:`_column_index`: the values of :func:`_compute_logits` at those columns
    (``src`` the logits themselves, or those already computed with ``mask_id=None``)."""
    values = []
    for i in index:
        v = (src.gather(-1, i.unsqueeze(-1)).squeeze(-1) if i.dim() == 1 else src.gather(-1, i)).to(dtype)
        values.append(v if mask_id is None else torch.where(i == mask_id, -math.inf, v))
    return tuple(values)


def _noise_scale(alpha_over_u: torch.Tensor, s: torch.Tensor, need_loss: bool, dtype: torch.dtype,
                 ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """k = α / (u s) ``(n,)`` with x_y = α p_y / u = k P_y off x0, in the rows' precision and the element dtype, and
    (if ``need_loss`` and the element dtype is not float64) log k as element-dtype hi + lo."""
    k = alpha_over_u / s
    log_k = None
    if need_loss and dtype != torch.float64:
        log_k_full = torch.log(k)
        log_k_hi = log_k_full.to(dtype)
        log_k = (log_k_hi, (log_k_full - log_k_hi).to(dtype))
    return k, k.to(dtype), log_k


def _noise_sums(d: torch.Tensor, d_lo: torch.Tensor | None, P: torch.Tensor, at_x0: torch.Tensor,
                k_e: torch.Tensor, log_k: tuple[torch.Tensor, torch.Tensor] | None, u_pos: torch.Tensor,
                zero0: torch.Tensor, one0: torch.Tensor, need_loss: bool, need_c: bool, dtype: torch.dtype,
                ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The uniform-noise sums over a block ``(n, S)``, each ``(n,)`` in the element dtype: Σ_{y≠x0} (x_y − log1p
    x_y) (if ``need_loss``), and (if ``need_c``) 2^100 Σ_{y≠x0} P_y e_y and T = Σ_{y≠x0} e_y (1 − P_y), with
    x = k P and e_y = x_y / (1 + x_y) off x0 (1 where u = 0)."""
    X = torch.where(at_x0, zero0, P * k_e.unsqueeze(-1))
    f_sum = pce_sum = T = ratio = None
    if need_loss:
        log_X = None
        if log_k is not None:  # log x_y = d_y + log k, log k as hi + lo (its rows' precision)
            log_k_hi, log_k_lo = log_k
            lo = log_k_lo.unsqueeze(-1) if d_lo is None else d_lo + log_k_lo.unsqueeze(-1)
            log_X = (d + log_k_hi.unsqueeze(-1)) + lo
        f_X, ratio = _x_minus_log1p_and_ratio(X, log_X, need_c)
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
        pce_sum = (P * _C_SCALE * E).sum(-1)
        T = (E * (1.0 - P)).sum(-1)
    return f_sum, pce_sum, T


def _row_terms(rows: tuple[torch.Tensor, ...], mx_r: torch.Tensor, s: torch.Tensor, s_off: torch.Tensor,
               index: tuple[torch.Tensor, ...], cols: tuple[torch.Tensor, ...], k: torch.Tensor | None,
               sums: tuple[torch.Tensor | None, ...], stats: tuple[torch.Tensor, ...] | None,
               grad_scale: torch.Tensor | None, zero0: torch.Tensor, one0: torch.Tensor, uniform_noise: bool,
               need_loss: bool, need_grad: bool, need_stats: bool, dtype: torch.dtype,
               ) -> tuple[torch.Tensor | None, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None,
                          tuple[torch.Tensor, ...] | None]:
    """Everything per row, ``(n,)`` in the rows' precision, from the row maxima ``mx_r``, s, s', the logits at the
    columns of :func:`_column_index` ``cols`` (element dtype), k and the sums of :func:`_noise_sums` (or the
    statistics ``stats`` of an earlier call): the loss (in ``dtype``), the gradient's factors ``(4, n, 1)`` in the
    element dtype for :func:`_grad_block` with its values at the columns j ``(index (n, 2), value (n, 2))`` (if
    ``need_grad``), and the row statistics (if ``need_stats``)."""
    (x0, x_t, alpha, log_alpha, u, alpha_over_u, m_x0, m_xt, log_m_x0, log_m_xt, safe_log_m_xt, same, possible,
     u_pos, x0_is_mask, xt_is_mask, w_active, v_active, A) = rows
    rdt = alpha.dtype
    log_s = torch.log(s)
    # l_x0 − M in the rows' precision: exact for float32 operands up to 2^{−53} |l_x0 − M|
    d_x0, d_xt = cols[0] - mx_r, cols[1] - mx_r
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
                          _softplus(log_alpha + torch.log(one_minus_p_x0) - log_q_theta_x0))
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
    f_sum, pce_sum, T = sums
    c_rest: torch.Tensor | None
    if stats is not None:
        c_rest, T = stats[3], stats[4]
    elif not uniform_noise:  # u = 0 (mask kernel): e_y = 1 off x0, so c' = 1 − p_x0 (T is not used)
        c_rest = one_minus_p_x0
    else:
        c_rest = None if pce_sum is None else pce_sum / (s * _C_SCALE)

    loss = None
    if need_loss:
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
        loss = torch.where(possible, w_active * term, exit_theta).to(dtype)
    # need_stats implies need_c
    if need_stats and T is None:  # mask kernel: T is not used, kept for a uniform layout of the statistics
        T = torch.zeros_like(alpha)
    out_stats = (mx_r, s, s_off, c_rest, T) if need_stats and c_rest is not None and T is not None else None
    if not need_grad:
        return loss, None, None, out_stats
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
    factors = torch.stack((a_row, b_row, g_j, a_row if k is None else k)).to(dtype).unsqueeze(-1)
    j = index[2]  # (n, 2)
    d_j = cols[2] - mx_r.unsqueeze(-1)
    P_j = torch.exp(d_j)
    is_xt = (j == x_t.unsqueeze(-1)) & ~xt_is_mask.unsqueeze(-1)
    H_j = torch.where(is_xt, Hp.unsqueeze(-1), 0.0)
    value_j = P_j * (a_row.unsqueeze(-1) * _e_off_x0(P_j, k, u_pos) - b_row.unsqueeze(-1)) + H_j
    value_j = torch.where(d_j < 0, value_j, torch.where(is_xt, g_j_xt.unsqueeze(-1), g_j.unsqueeze(-1)))
    # at z = x0: A g (p_x0 e_x0 (1 − p_x0) − p_x0 c') + H ([x0 = x_t] − p_x0) (both A-terms ≤ 0; e_x0 itself may
    # overflow; 0 at a mask x0, where p_x0 = p_x0 e_x0 = 0)
    g_x0 = A_g * (pe_x0 * one_minus_p_x0 - p_x0 * c_rest) + Hp * torch.where(same, one_minus_p_x0, -p_x0)
    value_j = torch.where(j == x0.unsqueeze(-1), g_x0.unsqueeze(-1), value_j)
    return loss, factors, (j, value_j), out_stats


def _grad_block(below: torch.Tensor, P: torch.Tensor, factors: torch.Tensor, u_pos: torch.Tensor,
                uniform_noise: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """∂L/∂logits ``(n, S)`` in ``out_dtype`` at every column as if it were neither x0 nor x_t: P (a e − b) below
    the maximum, g_j at it (``factors`` = (a, b, g_j, k) ``(4, n, 1)`` from :func:`_row_terms`)."""
    a_e, b_e, g_j_e, k_e = factors
    e = _e_off_x0(P, k_e.squeeze(-1) if uniform_noise else None, u_pos)
    return torch.where(below, P * (a_e * e - b_e), g_j_e).to(out_dtype)


# scale of the float32 sum Σ P E (see _noise_sums)
_C_SCALE = 2.0**100
# l below this is treated as −inf by the compensated exp (a finite stand-in: TwoSum of −inf gives NaN)
_LOGIT_FLOOR = -(2.0**100)


def _exp_minus_max(l: torch.Tensor, mx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d, d_lo, P) for float32 logits ``l`` ``(n, S)`` and their row maxima ``mx`` ``(n,)``: d = fl(l − M), its
    rounding error d_lo = (l − M) − d exactly (TwoSum: with b = −M, b_v = d − l, a_v = d − b_v, d_lo = (l − a_v) +
    (−M − b_v); exact for any finite l, M in round-to-nearest without reassociation, which neither Inductor's C++
    (``-fno-unsafe-math-optimizations``) nor Triton applies), and P = e^{l − M} = e^d (1 + d_lo) to an ulp or two.
    Logits below :data:`_LOGIT_FLOOR` (−inf: a masked column) count as that floor, P = 0."""
    l = torch.clamp_min(l, _LOGIT_FLOOR)
    m = mx.unsqueeze(-1)
    d = l - m
    b_virtual = d - l
    d_lo = (l - (d - b_virtual)) - (m + b_virtual)
    del l, b_virtual  # (eager: fewer (n, S) temporaries alive at once)
    P = torch.exp(d)
    return d, d_lo, P + P * d_lo


def _softplus(z: torch.Tensor) -> torch.Tensor:
    """log(1 + e^z) for every z (−inf → 0) without overflow: max(z, 0) + log1p(e^{−|z|})."""
    return torch.clamp(z, min=0.0) + torch.log1p(torch.exp(-torch.abs(z)))


def _e_off_x0(P: torch.Tensor, k: torch.Tensor | None, u_pos: torch.Tensor) -> torch.Tensor | float:
    """e_z = 1 − q0_z/qθ_z for z ≠ x0 from P_z ``(n, m)``: x/(1 + x) with x = k P (1 where u = 0 or ``k`` is
    ``None``, the mask kernel)."""
    if k is None:
        return 1.0
    X = P * k.unsqueeze(-1)
    return torch.where(u_pos.unsqueeze(-1), X / (1.0 + X), torch.ones((), dtype=X.dtype, device=X.device))


# ---------------------------------------------------------------------------------------------------- running it
def run(logits: torch.Tensor, rows: tuple[torch.Tensor, ...], mask_id: int | None, *,
        uniform_noise: bool, dtype: torch.dtype, need_loss: bool = True, need_grad: bool = False,
        need_stats: bool = False, grad_scale: torch.Tensor | None = None,
        stats: tuple[torch.Tensor, ...] | None = None, grad_into_logits: bool = False,
        ) -> tuple[torch.Tensor | None, torch.Tensor | None, tuple[torch.Tensor, ...] | None]:
    """:func:`loss_and_grad` of all rows on the selected backend, in blocks of rows where that is faster.
    ``grad_into_logits``: write the gradient over ``logits`` (returned as the gradient; saves a block of memory).

    A mask state in the first or last column (where kernels usually put it) is left out by slicing the logits
    instead of masking that column in every pass; its gradient is 0.
    """
    flags = (uniform_noise, need_loss, need_grad, need_stats, dtype)
    grad = None
    if need_grad:
        grad = logits if grad_into_logits else torch.empty_like(logits)
    S = logits.shape[-1]
    if mask_id is not None and S > 1 and mask_id in (0, S - 1):
        lo = 1 if mask_id == 0 else 0
        rows = tuple(ids - lo for ids in rows[:2]) + tuple(rows[2:])  # the mask id (now out of range) is flagged
        keep = slice(lo, lo + S - 1)
        loss, _, out_stats = _run(logits[:, keep], rows, None, grad_scale, stats, flags,
                                  None if grad is None else grad[:, keep])
        if grad is not None:
            grad[:, mask_id] = 0
        return loss, grad, out_stats
    return _run(logits, rows, mask_id, grad_scale, stats, flags, grad)


def _run(logits: torch.Tensor, rows: tuple[torch.Tensor, ...], mask_id: int | None,
         grad_scale: torch.Tensor | None, stats: tuple[torch.Tensor, ...] | None, flags: tuple,
         grad_out: torch.Tensor | None):
    """:func:`run` without the mask-column slicing; the gradient (if any) goes into ``grad_out``."""
    if torch.compiler.is_compiling():  # inside the caller's own compiled region: trace it inline, all rows at once
        return _blocks(loss_and_grad, None, logits, rows, mask_id, grad_scale, stats, flags, grad_out)
    in_place = grad_out is not None and grad_out.data_ptr() == logits.data_ptr()
    key = (logits.device.type, logits.dtype, mask_id is None, grad_scale is None, stats is None, in_place,
           logits.is_contiguous()) + flags
    # on CPU Inductor stores exp(l − max) between the row loops of a loss pass, so blocks of rows keep that in
    # cache; a gradient from saved statistics is one loop per row (nothing stored between loops), so it runs on all
    # rows at once, as everything does on GPUs (fewer calls: each costs ~0.3 ms of guards and set-up)
    block = None
    if logits.device.type == "cpu" and (stats is None or flags[1]):
        block = COMPILED_CPU_BLOCK_ELEMENTS
    return _compile.run(
        loss_and_grad, key,
        lambda fn: _blocks(fn, block, logits, rows, mask_id, grad_scale, stats, flags, grad_out),
        lambda: _eager(logits, rows, mask_id, grad_scale, stats, flags, grad_out),
        options=_INDUCTOR_OPTIONS, work=logits.numel(),
        warmup=lambda fn: _warmup(fn, logits, rows, mask_id, grad_scale, stats, flags, grad_out, in_place))


def _warmup(fn: Callable, logits: torch.Tensor, rows: tuple[torch.Tensor, ...], mask_id: int | None,
            grad_scale: torch.Tensor | None, stats: tuple[torch.Tensor, ...] | None, flags: tuple,
            grad_out: torch.Tensor | None, in_place: bool) -> None:
    """Call ``fn`` (a compiled :func:`loss_and_grad`) on a copy of the first rows of a real call — at most two, so
    Dynamo specialises sizes 0/1 exactly as for the call itself — with the same dtypes, strides and in-place
    relation between the gradient and the logits. What ``"auto"`` compiles in the background."""
    n = min(logits.shape[0], 2)
    warm = torch.empty_strided((n, logits.shape[1]), logits.stride(), dtype=logits.dtype, device=logits.device)
    warm.copy_(logits[:n]).requires_grad_(logits.requires_grad)  # Dynamo guards on requires_grad too
    grad = None  # in place: the gradient goes over ``warm``, as over the logits in the real call
    if grad_out is not None and not in_place:
        grad = torch.empty_strided((n, grad_out.shape[1]), grad_out.stride(), dtype=grad_out.dtype,
                                   device=grad_out.device)
    cut = (lambda x: None if x is None else tuple(v[:n].clone() for v in x))
    fn(warm, cut(rows), mask_id, None if grad_scale is None else grad_scale[:n].clone(), cut(stats), grad, *flags)


def _put(grad: torch.Tensor, index: torch.Tensor, value: torch.Tensor) -> None:
    """``grad[n, index[n, i]] = value[n, i]`` (what ``scatter_`` does, without the copy of ``grad`` that CPU
    ``scatter_`` makes)."""
    rows = torch.arange(grad.shape[0], device=grad.device).unsqueeze(-1).expand_as(index)
    grad.index_put_((rows, index), value)


def _block_edges(N: int, rows_per_block: int) -> list[int]:
    """Row edges of ⌈N / rows_per_block⌉ blocks split evenly (256 rows at 85 per block: four of 64, not
    85 + 85 + 85 + 1): a one-row remainder would make a compiled function recompile for size 1 (Dynamo specialises
    sizes 0 and 1), a multi-second stall in the middle of a run."""
    num_blocks = max(1, -(-N // max(rows_per_block, 1)))
    return [N * i // num_blocks for i in range(num_blocks + 1)]


def _blocks(fn: Callable, block_elements: int | None, logits: torch.Tensor, rows: tuple[torch.Tensor, ...],
            mask_id: int | None, grad_scale: torch.Tensor | None, stats: tuple[torch.Tensor, ...] | None,
            flags: tuple, grad_out: torch.Tensor | None = None):
    """``fn`` (:func:`loss_and_grad`, compiled) over blocks of at most ``block_elements`` logits (all rows at once
    when ``None``), writing into full-size outputs (the gradient into ``grad_out``, which may be ``logits``
    itself)."""
    N, S = logits.shape
    in_place = grad_out is not None and grad_out.data_ptr() == logits.data_ptr()  # fn gets the logits once then
    R = N if block_elements is None else max(1, min(N, block_elements // max(S, 1)))
    if R >= N:
        loss, fix, out_stats = fn(logits, rows, mask_id, grad_scale, stats, None if in_place else grad_out, *flags)
        if grad_out is not None:
            _put(grad_out, *fix)
        return loss, grad_out, out_stats
    uniform_noise, need_loss, need_grad, need_stats, dtype = flags
    loss = torch.empty(N, dtype=dtype, device=logits.device) if need_loss else None
    grad = grad_out
    out_stats = stats_buffers(N, rows[2].dtype, logits.device) if need_stats else None

    def cut(x, lo: int, hi: int):
        if isinstance(x, tuple):
            return tuple(v[lo:hi] for v in x)
        return None if x is None else x[lo:hi]

    edges = _block_edges(N, R)
    for a, b in zip(edges[:-1], edges[1:]):
        blk_loss, fix, blk_stats = fn(logits[a:b], cut(rows, a, b), mask_id, cut(grad_scale, a, b),
                                      cut(stats, a, b), None if in_place else cut(grad, a, b), *flags)
        if grad is not None:
            _put(grad[a:b], *fix)
        if loss is not None:
            loss[a:b] = blk_loss
        if out_stats is not None:
            for dst, src in zip(out_stats, blk_stats):
                dst[a:b] = src
    return loss, grad, out_stats


class _BlockRunner:
    """Runs ``job(a, b)`` over the blocks of rows [a, b) of a pass (:meth:`each`). In a ``with`` block on the CPU,
    with ``threads`` > 1 and the global-state lock free, it spreads the blocks over that many Python threads that
    run single-threaded ops, and the caller's own ops between passes run on one intra-op thread too (the eager
    backend: thousands of small OpenMP regions, or one per vector op of the per-row math, stall on a busy machine).
    Every job runs without autograd and in the caller's inference mode (both are per thread: a worker starts
    outside it, and the buffers the caller made under it would be inference tensors there)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.inference = torch.is_inference_mode_enabled()
        self.pool: ThreadPoolExecutor | None = None
        self.previous = 0

    def __enter__(self) -> _BlockRunner:
        # the pool sets the process's thread count to 1 for its duration: not while a background compilation traces
        # (it would record that count in its guards), so then run the blocks in this thread instead
        if self.threads > 1 and _compile.GLOBAL_STATE_LOCK.acquire(blocking=False):
            self.previous = torch.get_num_threads()
            torch.set_num_threads(1)
            self.pool = ThreadPoolExecutor(self.threads)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None
            torch.set_num_threads(self.previous)
            _compile.GLOBAL_STATE_LOCK.release()

    def each(self, job: Callable[[int, int], None], edges: list[int]) -> None:
        num_blocks = len(edges) - 1

        def work(first: int, last: int) -> None:  # blocks first … last − 1
            with torch.inference_mode(self.inference), torch.no_grad():
                for a, b in zip(edges[first:last], edges[first + 1:last + 1]):
                    job(a, b)

        workers = 1 if self.pool is None else max(1, min(self.threads, num_blocks // 2))
        if workers == 1:
            work(0, num_blocks)
            return
        assert self.pool is not None
        bounds = [num_blocks * i // workers for i in range(workers + 1)]
        for done in [self.pool.submit(work, lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]:
            done.result()


@torch.no_grad()
def _eager(logits: torch.Tensor, rows: tuple[torch.Tensor, ...], mask_id: int | None,
           grad_scale: torch.Tensor | None, stats: tuple[torch.Tensor, ...] | None, flags: tuple,
           grad_out: torch.Tensor | None):
    """:func:`loss_and_grad` of all rows, eagerly: each of its element passes on blocks of rows
    (:func:`eager_block_rows`; on the CPU spread over Python threads), the per-row math between them once over all
    rows, so that the ops of a batch are those of the per-row math plus each pass's per block. The gradient goes
    into ``grad_out``."""
    uniform_noise, need_loss, need_grad, need_stats, dtype = flags
    N, S = logits.shape
    device = logits.device

    def edges(pass_name: str) -> list[int]:
        return _block_edges(N, eager_block_rows(device, S, logits.dtype, dtype, pass_name))

    threads = torch.get_num_threads() if device.type == "cpu" and len(edges("max")) > 4 else 1
    with _BlockRunner(threads) as runner:
        return _eager_passes(runner, edges, logits, rows, mask_id, grad_scale, stats, flags, grad_out)


def _eager_passes(runner: _BlockRunner, edges: Callable[[str], list[int]], logits: torch.Tensor,
                  rows: tuple[torch.Tensor, ...], mask_id: int | None, grad_scale: torch.Tensor | None,
                  stats: tuple[torch.Tensor, ...] | None, flags: tuple, grad_out: torch.Tensor | None):
    """The body of :func:`_eager`: the pieces of :func:`loss_and_grad` in its order, the passes through
    ``runner`` on the blocks ``edges(pass)``."""
    uniform_noise, need_loss, need_grad, need_stats, dtype = flags
    N, S = logits.shape
    device = logits.device
    x0, alpha_over_u, u_pos = rows[0], rows[5], rows[13]
    rdt = rows[2].dtype
    zero0, one0 = _constants(dtype, device)
    col = _column_ids(S, dtype, device)

    def exp_off_max(a: int, b: int, mx_blk: torch.Tensor | None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(M, d, d_lo, P) of the rows a … b − 1 (M from the block when ``mx_blk`` is ``None``)."""
        l = _compute_logits(logits[a:b], col, mask_id, dtype)
        mx_blk = l.amax(-1) if mx_blk is None else mx_blk
        return (mx_blk, *_exp_off_max(logits.dtype, l, mx_blk, dtype))

    # ---- pass 1: M and s'
    if stats is None:
        mx = torch.empty(N, dtype=dtype, device=device)
        s_off = torch.empty(N, dtype=rdt, device=device)

        def max_and_sum(a: int, b: int) -> None:
            mx_blk, d, _, P = exp_off_max(a, b, None)
            below = d < 0
            del d  # one (rows, S) temporary fewer at the peak
            mx[a:b] = mx_blk
            s_off[a:b] = _sum_off_max(below, P, zero0, one0, rdt)

        runner.each(max_and_sum, edges("max"))
        mx_r = mx.to(rdt)
        s = s_off + 1.0
    else:
        mx_r, s, s_off = stats[0], stats[1], stats[2]
        mx = mx_r.to(dtype)
    index = _column_index(rows, need_grad)
    cols = _gather_columns(logits, index, mask_id, dtype)
    # ---- pass 2 (uniform noise): Σ_{y≠x0} (x_y − log1p x_y), Σ_{y≠x0} P_y e_y, T
    k = None
    sums: tuple[torch.Tensor | None, ...] = (None, None, None)
    need_c = _need_c(stats, need_grad, need_stats)
    if uniform_noise:
        k, k_e, log_k = _noise_scale(alpha_over_u, s, need_loss, dtype)
        if need_loss or need_c:
            sums = tuple(torch.empty(N, dtype=dtype, device=device) if need else None
                         for need in (need_loss, need_c, need_c))
            x0_ids = x0.to(col.dtype)

            def noise(a: int, b: int) -> None:
                _, d, d_lo, P = exp_off_max(a, b, mx[a:b])
                at_x0 = col == x0_ids[a:b].unsqueeze(-1)
                out = _noise_sums(d, d_lo, P, at_x0, k_e[a:b], None if log_k is None else (log_k[0][a:b],
                                  log_k[1][a:b]), u_pos[a:b], zero0, one0, need_loss, need_c, dtype)
                for dst, src in zip(sums, out):
                    if dst is not None and src is not None:
                        dst[a:b] = src

            runner.each(noise, edges("noise"))
    # ---- per row, all rows at once
    loss, factors, fix, out_stats = _row_terms(rows, mx_r, s, s_off, index, cols, k, sums, stats, grad_scale, zero0,
                                               one0, uniform_noise, need_loss, need_grad, need_stats, dtype)
    if factors is None or fix is None or grad_out is None:
        return loss, None, out_stats
    # ---- pass 3: the gradient (over the logits themselves when grad_out is them: each block after its reads)
    grad = grad_out

    def store(a: int, b: int) -> None:
        _, d, _, P = exp_off_max(a, b, mx[a:b])
        below = d < 0
        del d
        grad[a:b] = _grad_block(below, P, factors[:, a:b], u_pos[a:b], uniform_noise, grad.dtype)

    runner.each(store, edges("grad"))
    _put(grad, fix[0], fix[1].to(grad.dtype))
    return loss, grad, out_stats

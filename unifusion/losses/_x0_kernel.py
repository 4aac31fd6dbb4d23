"""The per-row arithmetic of :mod:`unifusion.losses.fast` as one pure tensor function, and how it is run.

:func:`loss_and_grad` maps a block of logits ``(n, S)`` and the logit-free per-row quantities ``(n,)`` to the loss
``(n,)`` and, optionally, ∂(Σ_n g_n L_n)/∂logits ``(n, S)`` (equations in :mod:`unifusion.losses.fast`). It is written
with plain out-of-place tensor ops so that ``torch.compile`` can fuse it: Inductor turns it into a few loops per row
(max, Σ exp, Σ (x − log1p x) with Σ p e, then the gradient store). On CPU it keeps exp(l − max) between those loops,
so :func:`run` calls it on blocks of rows small enough for that buffer to stay in cache; on GPUs, on all rows at
once. That is what puts the loss at or below the cost of a cross-entropy; eagerly the same function makes ~20
passes and runs on smaller blocks.

Backends: :func:`unifusion.set_backend` (``"compiled"`` by default, ``"eager"``; see :mod:`unifusion._compile`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from .. import _compile
from .._math import bregman_g, expm1_minus_x

__all__ = ["loss_and_grad", "run", "x_minus_log1p"]

_THREAD_LOCK = threading.Lock()

# eager backend: elements per block of rows processed at once (a few MB of temporaries; fits the caches)
EAGER_BLOCK_ELEMENTS = 1 << 18
# compiled backend on CPU: elements per call (Inductor's CPU loops store exp(l − max) between passes; a block this
# size keeps it in the last-level cache)
COMPILED_CPU_BLOCK_ELEMENTS = 1 << 22
# recompute exp/log1p per pass instead of storing N×S intermediates (Inductor realises a buffer read > 4 times)
_INDUCTOR_OPTIONS = {"realize_reads_threshold": 1000, "realize_opcount_threshold": 100000,
                     "realize_acc_reads_threshold": 1000, "realize_cpu_acc_reads_threshold": 1000,
                     "realize_cpu_opcount_threshold": 100000}
ROW_FIELDS = ("x0", "x_t", "alpha", "log_alpha", "u", "alpha_over_u", "log_m_x0", "log_m_xt", "safe_log_m_xt",
              "same", "possible", "u_pos", "x0_is_mask", "xt_is_mask", "w_active", "v_active", "A")


# ---------------------------------------------------------------------------------------------------- math
def x_minus_log1p(x: torch.Tensor) -> torch.Tensor:
    """x − log1p(x) ≥ 0 for x ≥ 0, to a few ulp in the dtype of ``x`` (no cancellation for small x).

    With y = x / (2 + x), log1p(x) = 2 atanh(y) = 2 Σ_k y^(2k+1)/(2k+1) and x − 2y = x y, so
    x − log1p(x) = x y − 2 y³ (1/3 + y²/5 + y⁴/7 + …); used below a cut-off (x < 1/2 in float32: y² < 0.04, six
    terms; x < 1/10 in float64: y² < 0.0023, seven terms), the direct formula above it (where it loses ≤ 4 bits).
    """
    if x.dtype == torch.float64:
        cut, terms = 0.1, 7
    else:
        cut, terms = 0.5, 6
    small = x < cut
    xs = torch.where(small, x, torch.zeros_like(x))
    y = xs / (2.0 + xs)
    y2 = y * y
    acc = torch.full_like(y2, 1.0 / (2 * terms + 1))
    for k in range(terms - 1, 0, -1):
        acc = acc * y2 + 1.0 / (2 * k + 1)
    series = xs * y - 2.0 * y * y2 * acc
    return torch.where(small, series, x - torch.log1p(x))


def loss_and_grad(logits: torch.Tensor, rows: tuple[torch.Tensor, ...], mask_id: int | None,
                  grad_scale: torch.Tensor | None, stats: tuple[torch.Tensor, ...] | None,
                  grad_out: torch.Tensor | None, uniform_noise: bool, need_loss: bool, need_grad: bool,
                  need_stats: bool, dtype: torch.dtype,
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None, tuple[torch.Tensor, ...] | None]:
    """Loss ``(n,)`` in ``dtype`` (if ``need_loss``), gradient ``(n, S)`` in the logits' dtype (if ``need_grad``)
    and, if ``need_stats``, the row statistics (max_y l_y, s = Σ_y exp(l_y − max), c = Σ_y p_y e_y), each ``(n,)``.

    ``rows`` holds the tensors named in ``ROW_FIELDS`` (each ``(n,)``); ``mask_id`` is the mask state or
    ``None``; ``grad_scale`` ``(n,)`` is g (ones when ``None``). Passing the statistics of an earlier call on the
    same logits as ``stats`` leaves the gradient one pass over each row (exp, divide, store). With ``grad_out``
    (logits' shape and dtype) the gradient is written there and ``None`` is returned in its place.
    """
    (x0, x_t, alpha, log_alpha, u, alpha_over_u, log_m_x0, log_m_xt, safe_log_m_xt, same, possible, u_pos,
     x0_is_mask, xt_is_mask, w_active, v_active, A) = rows
    S = logits.shape[-1]
    neg_inf = torch.full_like(alpha, -math.inf)
    zero = torch.zeros_like(alpha)
    col = torch.arange(S, device=logits.device)
    l = logits.to(dtype)
    if mask_id is not None:  # MDLM's SUBS: the mask entry of the head is ignored
        l = torch.where(col == mask_id, -math.inf, l)
    # ---- softmax over clean states, unnormalised: P = exp(l − max), s = Σ P
    mx = l.amax(-1) if stats is None else stats[0]
    P = torch.exp(l - mx.unsqueeze(-1))
    s = P.sum(-1) if stats is None else stats[1]
    shift = mx + torch.log(s)
    l_x0 = l.gather(-1, x0.unsqueeze(-1)).squeeze(-1)
    l_xt = l.gather(-1, x_t.unsqueeze(-1)).squeeze(-1)
    log_p_x0 = torch.where(x0_is_mask, neg_inf, l_x0 - shift)
    log_p_xt = torch.where(xt_is_mask, neg_inf, l_xt - shift)

    log_q_theta_x0 = torch.logaddexp(log_alpha + log_p_x0, log_m_x0)
    log_q_theta_xt = torch.logaddexp(log_alpha + log_p_xt, log_m_xt)
    one_minus_p_x0 = -torch.expm1(log_p_x0)
    # log(q0/qθ) at x0 = log1p(α (1 − p_x0) / qθ(x0)) and, off x0, log ρ = −log1p(α p_xt / m(x_t)): no difference
    # of two logs, so both stay accurate when they are tiny (t → 1)
    l_at_x0 = torch.log1p(alpha * one_minus_p_x0 * torch.exp(-log_q_theta_x0))
    log_rho = torch.where(same, l_at_x0, -torch.log1p(torch.exp(log_alpha + log_p_xt - safe_log_m_xt)))
    log_rho = torch.where(possible, log_rho, zero)
    e_x0 = -alpha * one_minus_p_x0 * torch.exp(-log_q_theta_x0)  # e_y = 1 − q0_y/qθ_y at y = x0
    at_x0 = col == x0.unsqueeze(-1)
    X = E = None
    if uniform_noise:
        k = alpha_over_u / s  # x_y = α p_y / u = k P_y  (off x0)
        X = torch.where(at_x0, 0.0, P * k.unsqueeze(-1))
    need_c = need_stats or (need_grad and stats is None)
    if uniform_noise and (need_c or need_grad):  # e_y = x_y / (1 + x_y) off x0 (1 where u = 0)
        E = torch.where(at_x0, e_x0.unsqueeze(-1), torch.where(u_pos.unsqueeze(-1), X / (1.0 + X), 1.0))
    if stats is not None:
        c = stats[2]
    elif not uniform_noise:  # u = 0 (mask kernel): e_y = 1 off x0, so c = (1 − p_x0) + p_x0 e_x0
        c = one_minus_p_x0 + torch.exp(log_p_x0) * e_x0
    else:
        c = (P * E).sum(-1) / s if need_c else None

    loss = None
    if need_loss:
        # Σ_y f(q0_y, qθ_y) = f at x0 + (u Σ_{y≠x0} (x_y − log1p x_y)  or  α (1 − p_x0) when u = 0)
        term1 = torch.exp(log_q_theta_x0) * bregman_g(l_at_x0)
        term2 = alpha * one_minus_p_x0
        if X is not None:
            term2 = torch.where(u_pos, u * x_minus_log1p(X).sum(-1), term2)
        term = term1 + term2 + expm1_minus_x(log_rho)
        exit_theta = v_active * torch.expm1(-log_q_theta_xt)
        loss = torch.where(possible, w_active * term, exit_theta)
    out_stats = (mx, s, c) if need_stats else None
    if not need_grad:
        return loss, None, out_stats

    # ---- ∂L/∂logit_z = p_z [A (e_z − c) − H p_xt] + δ_{z,x_t} H p_xt
    g = grad_scale.to(dtype) if grad_scale is not None else 1.0
    A_g = A * g
    p_xt_over_q_xt = torch.exp(log_p_xt - log_q_theta_xt)
    Hp = torch.where(possible, A_g * (-torch.expm1(log_rho)) * p_xt_over_q_xt,
                     -alpha * v_active * p_xt_over_q_xt * torch.exp(-log_q_theta_xt) * g)
    if E is None:
        E = torch.where(at_x0, e_x0.unsqueeze(-1), 1.0)
    coef = (A_g.unsqueeze(-1) * E - (A_g * c + Hp).unsqueeze(-1)) / s.unsqueeze(-1)
    at_xt = (col == x_t.unsqueeze(-1)) & ~xt_is_mask.unsqueeze(-1)
    grad = (P * coef + torch.where(at_xt, Hp.unsqueeze(-1), 0.0)).to(logits.dtype)
    if grad_out is not None:
        grad_out.copy_(grad)
        grad = None
    return loss, grad, out_stats


# ---------------------------------------------------------------------------------------------------- running it
def run(logits: torch.Tensor, rows: tuple[torch.Tensor, ...], mask_id: int | None, *,
        uniform_noise: bool, dtype: torch.dtype, need_loss: bool = True, need_grad: bool = False,
        need_stats: bool = False, grad_scale: torch.Tensor | None = None,
        stats: tuple[torch.Tensor, ...] | None = None, grad_into_logits: bool = False,
        ) -> tuple[torch.Tensor | None, torch.Tensor | None, tuple[torch.Tensor, ...] | None]:
    """:func:`loss_and_grad` of all rows on the selected backend, in blocks of rows where that is faster.
    ``grad_into_logits``: write the gradient over ``logits`` (returned as the gradient; saves a block of memory)."""
    flags = (uniform_noise, need_loss, need_grad, need_stats, dtype)
    in_place = grad_into_logits and need_grad
    if torch.compiler.is_compiling():  # inside the caller's own compiled region: trace it inline, all rows at once
        return _blocks(loss_and_grad, None, False, logits, rows, mask_id, grad_scale, stats, flags, in_place)
    key = (logits.device.type, logits.dtype, mask_id is None, grad_scale is None, stats is None, in_place) + flags
    # on CPU Inductor stores exp(l − max) between its row loops, so blocks of rows keep that in cache; on GPUs one
    # call over all rows
    block = COMPILED_CPU_BLOCK_ELEMENTS if logits.device.type == "cpu" else None
    return _compile.run(
        loss_and_grad, key,
        lambda fn: _blocks(fn, block, False, logits, rows, mask_id, grad_scale, stats, flags, in_place),
        lambda: _blocks(loss_and_grad, EAGER_BLOCK_ELEMENTS, True, logits, rows, mask_id, grad_scale, stats, flags,
                        in_place),
        options=_INDUCTOR_OPTIONS)


def _blocks(fn: Callable, block_elements: int | None, threaded: bool, logits: torch.Tensor,
            rows: tuple[torch.Tensor, ...], mask_id: int | None, grad_scale: torch.Tensor | None,
            stats: tuple[torch.Tensor, ...] | None, flags: tuple, in_place: bool = False):
    """``fn`` over blocks of about ``block_elements`` logits (all rows at once when ``None``), writing into
    full-size outputs (the gradient over the logits when ``in_place``). ``threaded``: on CPU split the blocks over
    ``torch.get_num_threads()`` Python threads that run single-threaded ops (the eager backend: thousands of small
    OpenMP regions stall on a busy machine)."""
    N, S = logits.shape
    R = N if block_elements is None else max(1, min(N, block_elements // max(S, 1)))
    if R >= N:
        out = fn(logits, rows, mask_id, grad_scale, stats, logits if in_place else None, *flags)
        return (out[0], logits, out[2]) if in_place else out
    uniform_noise, need_loss, need_grad, need_stats, dtype = flags
    loss = torch.empty(N, dtype=dtype, device=logits.device) if need_loss else None
    grad = (logits if in_place else torch.empty_like(logits)) if need_grad else None
    out_stats = tuple(torch.empty(N, dtype=dtype, device=logits.device) for _ in range(3)) if need_stats else None

    def cut(x, lo: int, hi: int):
        if isinstance(x, tuple):
            return tuple(v[lo:hi] for v in x)
        return None if x is None else x[lo:hi]

    @torch.no_grad()  # grad mode is per thread: the callers' no_grad does not reach the pool's threads
    def work(lo: int, hi: int) -> None:
        for a in range(lo, hi, R):
            b = min(a + R, hi)
            blk_loss, _, blk_stats = fn(logits[a:b], cut(rows, a, b), mask_id, cut(grad_scale, a, b),
                                        cut(stats, a, b), cut(grad, a, b), *flags)
            if loss is not None:
                loss[a:b] = blk_loss
            if out_stats is not None:
                for dst, src in zip(out_stats, blk_stats):
                    dst[a:b] = src

    workers = torch.get_num_threads() if threaded and logits.device.type == "cpu" else 1
    workers = max(1, min(workers, N // (2 * R)))
    if workers == 1:
        work(0, N)
        return loss, grad, out_stats
    bounds = [N * i // workers for i in range(workers + 1)]
    with _THREAD_LOCK:
        previous = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with ThreadPoolExecutor(workers) as pool:
                for job in [pool.submit(work, lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]:
                    job.result()
        finally:
            torch.set_num_threads(previous)
    return loss, grad, out_stats

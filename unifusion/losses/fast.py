"""x0-head losses at the cost of a cross-entropy: analytic gradient, chunked over positions, no N×V temporaries.

For an x0 head on an interpolating kernel q_{t|0}(j|i) = α_t δ_ij + m_t(j) (uniform, mask, GIDD's hybrid) every
published loss of an x0 prediction equals, per position, the master objective D_t between the true conditional
rates and the rates the head induces (Theorem 3.3; by Theorem 3.5 the SEDD score, the M2S mean and the Neural-CTMC
exit/jump pair converted from the head induce the same rates), written as GIDD does (App. A, eq. loss-gidd):

    L = w · [Σ_y f(q0_y, qθ_y) + ρ − log ρ − 1],    q0 = q_t(·|x0),  qθ = α p + m,  p = softmax(logits) (clean),
    ρ = q0(x_t)/qθ(x_t),  f(r, c) = r log(r/c) − r + c,  w = R_t(·, x_t)/q0(x_t) for the ELBO ("clip", "dynamic":
    GIDD's heuristic weights; they replace w the same way for every objective).

With u = m(y) the uniform noise mass of a clean state y ≠ x0 and x_y = α p_y / u the sum splits into per-row terms
and one sum over the vocabulary, each non-negative (no cancellation):

    Σ_y f(q0_y, qθ_y) = f(α + m(x0), α p_x0 + m(x0)) + u Σ_{y clean, y≠x0} (x_y − log1p x_y)     (u > 0)
                      = f(α + m(x0), α p_x0 + m(x0)) + α (1 − p_x0)                                (u = 0, mask)

and the gradient is O(V) per row: with e_y = 1 − q0_y/qθ_y (= x_y/(1+x_y) off x0), h = (1 − ρ)/qθ(x_t),

    ∂L/∂logit_z = w α p_z [e_z − Σ_y p_y e_y + (δ_{z,x_t} − p(x_t)) h].

:func:`x0_head_loss` evaluates both in one pass over blocks of rows and stashes only the gradient (the logits'
dtype, N×V) for the backward pass, which scales it in place by the incoming per-position gradient. Math runs in
float32 for bf16/fp16/fp32 logits (float64 for float64 logits); the sum of x − log1p x runs in float64 because its
terms are ~x²/2 where x is small. The reference implementations are :mod:`unifusion.losses.native`.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import torch
from torch.autograd.function import once_differentiable

from .. import _validation as V
from .._math import bregman_g, expm1_minus_x, safe_log
from ..kernels import HybridKernel, InterpolatingKernel, Kernel, MaskKernel, UniformKernel
from ..rates import _check_kernel
from . import native
from .native import GIDD_WEIGHTINGS, _dynamic_weight

__all__ = ["x0_head_loss", "gidd_loss", "mdlm_loss", "X0_HEAD_OBJECTIVES"]

X0_HEAD_OBJECTIVES = ("gidd", "mdlm", "sedd", "m2s", "ctmc")

# elements per block of rows processed at once (a few MB of float32 temporaries; fits the caches)
_BLOCK_ELEMENTS = 1 << 18
_THREAD_LOCK = threading.Lock()


# ---------------------------------------------------------------------------------------------------- row setup
@dataclass
class _Rows:
    """Per-position quantities that do not depend on the logits, flattened to ``(N,)`` in the compute dtype."""

    x0: torch.Tensor          # int64 (N,)
    x_t: torch.Tensor         # int64 (N,)
    alpha: torch.Tensor       # α_t
    u: torch.Tensor           # uniform noise mass of one clean state, m_t(y) for y clean ≠ x0
    m_x0: torch.Tensor        # m_t(x0)
    m_xt: torch.Tensor        # m_t(x_t)
    v: torch.Tensor           # forward rate into x_t, R_t(·, x_t)
    w: torch.Tensor           # loss weight (ELBO, clipped or dynamic)
    x0_is_mask: torch.Tensor  # bool
    xt_is_mask: torch.Tensor  # bool
    uniform_noise: bool       # u > 0 (uniform, hybrid with p_uniform > 0); False for the mask kernel
    mask_id: int | None
    dtype: torch.dtype
    # derived, logit-free (filled by __post_init__)
    log_alpha: torch.Tensor = None  # type: ignore[assignment]
    log_m_x0: torch.Tensor = None  # type: ignore[assignment]
    log_m_xt: torch.Tensor = None  # type: ignore[assignment]
    safe_log_m_xt: torch.Tensor = None  # type: ignore[assignment]
    same: torch.Tensor = None  # type: ignore[assignment]
    possible: torch.Tensor = None  # type: ignore[assignment]
    u_pos: torch.Tensor = None  # type: ignore[assignment]
    alpha_over_u: torch.Tensor = None  # type: ignore[assignment]
    w_active: torch.Tensor = None  # type: ignore[assignment]
    v_active: torch.Tensor = None  # type: ignore[assignment]
    A: torch.Tensor = None  # type: ignore[assignment]
    zero: torch.Tensor = None  # type: ignore[assignment]
    neg_inf: torch.Tensor = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.log_alpha is not None:
            return  # a slice of an already completed instance
        zero = torch.zeros_like(self.alpha)
        self.zero = zero
        self.neg_inf = torch.full_like(zero, -math.inf)
        self.log_alpha = torch.log(self.alpha)
        self.log_m_x0 = safe_log(self.m_x0)
        self.log_m_xt = safe_log(self.m_xt)
        self.same = self.x_t == self.x0
        self.possible = self.same | (self.m_xt > 0)
        self.safe_log_m_xt = torch.where(self.possible & ~self.same, self.log_m_xt, zero)
        self.u_pos = self.u > 0
        self.alpha_over_u = self.alpha / torch.where(self.u_pos, self.u, torch.ones_like(self.u))
        active = self.v > 0
        # x_t impossible under x0 (true rates 0 by convention): the loss is the model's exit rate v (1/qθ(x_t) − 1)
        self.w_active = torch.where(active, self.w, zero)
        self.v_active = torch.where(active & ~self.possible, self.v, zero)
        self.A = torch.where(active & self.possible, self.w * self.alpha, zero)

    def __getitem__(self, s: slice) -> _Rows:
        fields = {k: (v[s] if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()}
        return _Rows(**fields)


def _is_fast_kernel(kernel: Kernel) -> bool:
    return isinstance(kernel, (UniformKernel, MaskKernel, HybridKernel))


def _has_uniform_noise(kernel: InterpolatingKernel) -> bool:
    if isinstance(kernel, MaskKernel):
        return False
    if isinstance(kernel, HybridKernel):
        return kernel.B > 0.0
    return True


def _check_weighting(weighting: object, max_weight: object) -> None:
    if weighting not in GIDD_WEIGHTINGS:
        raise ValueError(f"weighting: expected one of {GIDD_WEIGHTINGS}, got {weighting!r}")
    if isinstance(max_weight, bool) or not isinstance(max_weight, (int, float)) or not max_weight > 0:
        raise ValueError(f"max_weight: expected a positive float, got {max_weight!r}")


def _check_objective(objective: object, kernel: Kernel) -> None:
    if objective not in X0_HEAD_OBJECTIVES:
        raise ValueError(f"objective: expected one of {X0_HEAD_OBJECTIVES}, got {objective!r}")
    if objective == "mdlm" and not isinstance(kernel, MaskKernel):
        raise TypeError(f"kernel: objective='mdlm' needs a MaskKernel, got {type(kernel).__name__}")


def _prepare_rows(kernel: Kernel, num_rows_shape: tuple[int, ...] | None, x0: object, x_t: object,
                  t: object, dtype: torch.dtype, device: torch.device, weighting: str,
                  max_weight: float) -> tuple[_Rows, tuple[int, ...]]:
    """Validate ids and times, broadcast them to the positions' shape, and compute every logit-free quantity."""
    S = kernel.num_states
    x0 = V.check_token_ids("x0", x0, S)
    x_t = V.check_token_ids("x_t", x_t, S)
    try:
        shape = tuple(torch.broadcast_shapes(x0.shape, x_t.shape))
    except RuntimeError:
        raise ValueError(f"x0: shape {tuple(x0.shape)} does not broadcast with x_t's {tuple(x_t.shape)}") from None
    if num_rows_shape is not None and tuple(num_rows_shape) != shape:
        raise ValueError(f"x0_logits: expected leading shape {shape} (that of x_t), got {tuple(num_rows_shape)}")
    t_ = V.check_time("t", t, device=device, dtype=dtype)
    try:
        t_ = torch.broadcast_to(t_, shape)
    except RuntimeError:
        raise ValueError(f"t: shape {tuple(t_.shape)} does not broadcast to x_t's shape {shape}") from None
    x0 = x0.to(device).expand(shape).reshape(-1)
    x_t = x_t.to(device).expand(shape).reshape(-1)
    t_ = t_.reshape(-1)

    assert isinstance(kernel, InterpolatingKernel)
    alpha, a, b = kernel._coefficients(t_)
    u = b / kernel._unif_count()
    m_x0 = kernel._noise_at(x0, a, b)
    m_xt = kernel._noise_at(x_t, a, b)
    v_mask, v_unif = kernel._rate_coefficients(t_)
    v = torch.where(kernel._is_mask(x_t), v_mask,
                    torch.where(kernel._in_uniform_support(x_t), v_unif, torch.zeros_like(v_unif)))
    q0_xt = torch.where(x_t == x0, alpha, torch.zeros_like(alpha)) + m_xt
    if weighting == "dynamic":
        w = _dynamic_weight(kernel, x0, x_t, t_).clamp(0.0, max_weight)
    else:
        w = v / torch.where(q0_xt > 0, q0_xt, torch.ones_like(q0_xt))
        if weighting == "clip":
            w = w.clamp(0.0, max_weight)
    rows = _Rows(x0=x0, x_t=x_t, alpha=alpha, u=u, m_x0=m_x0, m_xt=m_xt, v=v, w=w.to(dtype),
                 x0_is_mask=kernel._is_mask(x0), xt_is_mask=kernel._is_mask(x_t),
                 uniform_noise=_has_uniform_noise(kernel), mask_id=kernel.mask_id, dtype=dtype)
    return rows, shape


# ---------------------------------------------------------------------------------------------------- the kernel
def _clean_max(logits: torch.Tensor, mask_id: int | None) -> torch.Tensor:
    """Row max over clean states (the mask column excluded), ``(R,)``, without copying the block."""
    if mask_id is None:
        return logits.amax(-1)
    V_ = logits.shape[-1]
    parts = [logits[:, :mask_id], logits[:, mask_id + 1:]]
    maxes = [p.amax(-1) for p in parts if p.shape[-1] > 0]
    return maxes[0] if len(maxes) == 1 else torch.maximum(maxes[0], maxes[1]) if V_ > 1 else maxes[0]


def _rows_loss_and_grad(logits: torch.Tensor, rows: _Rows, grad_out: torch.Tensor | None,
                        grad_scale: torch.Tensor | None = None,
                        block_elements: int = _BLOCK_ELEMENTS) -> torch.Tensor:
    """Loss ``(N,)`` (compute dtype) of logits ``(N, V)``; writes ∂(Σ_n g_n L_n)/∂logits into ``grad_out`` when given.

    ``grad_scale`` ``(N,)`` is g (ones when None). ``grad_out`` may be ``logits`` itself (each block is read before
    its gradient is written). On CPU the rows are split over ``torch.get_num_threads()`` Python threads that run
    single-threaded ops (many small parallel regions stall badly on a busy machine); elsewhere one loop.
    """
    N, S = logits.shape
    loss = torch.empty(N, dtype=rows.dtype, device=logits.device)
    R = max(1, min(N, block_elements // max(S, 1)))
    workers = torch.get_num_threads() if logits.device.type == "cpu" else 1
    workers = max(1, min(workers, N // (2 * R)))
    if workers == 1:
        _loss_rows(logits, rows, grad_out, grad_scale, loss, 0, N, R)
        return loss
    bounds = [N * i // workers for i in range(workers + 1)]
    with _THREAD_LOCK:
        previous = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with ThreadPoolExecutor(workers) as pool:
                jobs = [pool.submit(_loss_rows, logits, rows, grad_out, grad_scale, loss, lo, hi, R)
                        for lo, hi in zip(bounds[:-1], bounds[1:])]
                for job in jobs:
                    job.result()
        finally:
            torch.set_num_threads(previous)
    return loss


@torch.no_grad()
def _loss_rows(logits: torch.Tensor, rows: _Rows, grad_out: torch.Tensor | None, grad_scale: torch.Tensor | None,
               loss: torch.Tensor, lo: int, hi: int, R: int) -> None:
    """Rows ``lo:hi`` of :func:`_rows_loss_and_grad`, in blocks of ``R`` rows."""
    S = logits.shape[-1]
    dtype = rows.dtype
    R = min(R, hi - lo)
    P = torch.empty(R, S, dtype=dtype, device=logits.device)
    E = torch.empty_like(P) if (grad_out is not None and rows.uniform_noise) else None
    X64 = torch.empty(R, S, dtype=torch.float64, device=logits.device) if rows.uniform_noise else None
    for start in range(lo, hi, R):
        stop = min(start + R, hi)
        n = stop - start
        blk = rows[start:stop]
        lb = logits[start:stop]
        Pb = P[:n]
        x0, x_t = blk.x0.unsqueeze(-1), blk.x_t.unsqueeze(-1)
        # ---- softmax over clean states, unnormalised: P = exp(l − max), s = Σ P
        mx = _clean_max(lb, blk.mask_id).to(dtype)
        if lb.dtype == dtype:
            torch.sub(lb, mx.unsqueeze(-1), out=Pb)
        else:  # bf16/fp16: one vectorised conversion, then same-dtype math
            Pb.copy_(lb).sub_(mx.unsqueeze(-1))
        if blk.mask_id is not None:
            Pb[:, blk.mask_id] = -math.inf
        Pb.exp_()
        s = Pb.sum(-1)
        P_xt = Pb.gather(-1, x_t).squeeze(-1)
        shift = mx + torch.log(s)
        log_p_x0 = torch.where(blk.x0_is_mask, blk.neg_inf, lb.gather(-1, x0).squeeze(-1).to(dtype) - shift)
        log_p_xt = torch.where(blk.xt_is_mask, blk.neg_inf, lb.gather(-1, x_t).squeeze(-1).to(dtype) - shift)

        alpha = blk.alpha
        log_q_theta_x0 = torch.logaddexp(blk.log_alpha + log_p_x0, blk.log_m_x0)
        log_q_theta_xt = torch.logaddexp(blk.log_alpha + log_p_xt, blk.log_m_xt)
        one_minus_p_x0 = -torch.expm1(log_p_x0)
        # log(q0/qθ) at x0 = log1p(α (1 − p_x0) / qθ(x0)) and, off x0, log ρ = −log1p(α p_xt / m(x_t)): no
        # difference of two logs, so both stay accurate when they are tiny (t → 1)
        l_x0 = torch.log1p(alpha * one_minus_p_x0 * torch.exp(-log_q_theta_x0))
        log_rho = torch.where(blk.same, l_x0, -torch.log1p(torch.exp(blk.log_alpha + log_p_xt - blk.safe_log_m_xt)))
        log_rho = torch.where(blk.possible, log_rho, blk.zero)

        # ---- Σ_y f(q0_y, qθ_y) = f at x0 + (u Σ_{y≠x0} (x_y − log1p x_y)  or  α (1 − p_x0) when u = 0)
        term1 = torch.exp(log_q_theta_x0) * bregman_g(l_x0)
        term2 = alpha * one_minus_p_x0
        if blk.uniform_noise:
            # x = α p / u = P · k with k = α/(u s); in float64 because x − log1p x ≈ x²/2 for small x
            Xb = X64[:n]
            Xb.copy_(Pb).mul_((blk.alpha_over_u / s).to(torch.float64).unsqueeze(-1))
            Xb.scatter_(-1, x0, 0.0)
            sum_x = Xb.sum(-1)
            sum_log1p = Xb.log1p_().sum(-1)
            term2 = torch.where(blk.u_pos, blk.u * (sum_x - sum_log1p).to(dtype), term2)
        term = term1 + term2 + expm1_minus_x(log_rho)
        exit_theta = blk.v_active * torch.expm1(-log_q_theta_xt)
        loss[start:stop] = torch.where(blk.possible, blk.w_active * term, exit_theta)
        if grad_out is None:
            continue

        # ---- gradient: g_z = p_z [A (e_z − c) − H p_xt] + δ_{z,x_t} H p_xt
        g = grad_scale[start:stop].to(dtype) if grad_scale is not None else 1.0
        A = blk.A * g
        p_xt_over_q_xt = torch.exp(log_p_xt - log_q_theta_xt)
        Hp = torch.where(blk.possible, A * (-torch.expm1(log_rho)) * p_xt_over_q_xt,
                         -alpha * blk.v_active * p_xt_over_q_xt * torch.exp(-log_q_theta_xt) * g)
        e_x0 = -alpha * one_minus_p_x0 * torch.exp(-log_q_theta_x0)
        gb = grad_out[start:stop]
        if blk.uniform_noise:
            # e_y = x_y/(1 + x_y) = P_y / (P_y + u s/α) off x0
            Eb = E[:n]
            torch.add(Pb, (s / blk.alpha_over_u).unsqueeze(-1), out=Eb)
            torch.div(Pb, Eb, out=Eb)
            Eb.scatter_(-1, x0, e_x0.unsqueeze(-1))
            c = torch.linalg.vecdot(Pb, Eb) / s
            # E ← (A e − A c − Hp) / s, then g = P ⊙ E (P unnormalised: p = P/s)
            torch.addcmul((-(A * c + Hp) / s).unsqueeze(-1), Eb, (A / s).unsqueeze(-1), out=Eb)
            coef_xt = Eb.gather(-1, x_t).squeeze(-1)
            if gb.dtype == dtype:
                torch.mul(Pb, Eb, out=gb)
            else:
                gb.copy_(Eb.mul_(Pb))
        else:
            # u = 0 (mask kernel): e_y = 1 off x0, so c = (1 − p_x0) + p_x0 e_x0 and g = p (A − A c − Hp) off x0
            c = one_minus_p_x0 + torch.exp(log_p_x0) * e_x0
            at_x0 = A * e_x0 - A * c - Hp
            base = (A - A * c - Hp) / s
            if gb.dtype == dtype:
                torch.mul(Pb, base.unsqueeze(-1), out=gb)
            else:
                gb.copy_(Pb.mul_(base.unsqueeze(-1)))
            gb.scatter_(-1, x0, (torch.exp(log_p_x0) * at_x0).unsqueeze(-1).to(gb.dtype))
            coef_xt = torch.where(blk.same, at_x0 / s, base)
        # the x_t entry: P_xt · coef + H p_xt (P_xt = 0 at the mask state)
        g_xt = torch.where(blk.xt_is_mask, blk.zero, P_xt * coef_xt + Hp)
        gb.scatter_(-1, x_t, g_xt.unsqueeze(-1).to(gb.dtype))


class _X0HeadLossFunction(torch.autograd.Function):
    """Per-position loss of logits ``(N, V)``; the forward computes the gradient too and saves it for backward."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, rows: _Rows, block_elements: int) -> torch.Tensor:  # type: ignore[override]
        grad = torch.empty_like(logits) if ctx.needs_input_grad[0] else None
        loss = _rows_loss_and_grad(logits, rows, grad, block_elements=block_elements)
        if grad is not None:
            ctx.save_for_backward(grad)  # released by the engine after backward (unless retain_graph)
        if V.validation_enabled() and bool(torch.isnan(loss).any()):
            raise ValueError("x0_logits: contains NaN (the loss of some position is NaN)")
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):  # type: ignore[override]
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype).unsqueeze(-1), None, None


# ---------------------------------------------------------------------------------------------------- public
def x0_head_loss(x0_logits: torch.Tensor, x0: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor | float,
                 kernel: Kernel, *, objective: Literal["gidd", "mdlm", "sedd", "m2s", "ctmc"] = "gidd",
                 weighting: Literal["elbo", "clip", "dynamic"] = "elbo", max_weight: float = 2.0) -> torch.Tensor:
    """Loss of an x0 head at the memory and time cost of a cross-entropy, per position ``(...)``.

    Computes D_t(x_t, x0; θ) between the true conditional rates and ``ReverseRate.from_x0_logits`` (Theorem 3.3)
    in GIDD's form  w_t(x_t, x0) [KL(q_t(·|x0) ‖ q_t(·|x_θ)) + ρ − log ρ − 1],  with an analytic gradient.

    Args:
        x0_logits: clean-token logits ``(..., S)`` (state dim last; the mask entry is ignored, MDLM's SUBS). Any
            float dtype; bf16/fp16/fp32 are computed in float32, float64 in float64.
        x0: clean tokens, int64 ``(...)``.  x_t: noisy tokens, int64 ``(...)``.  t: times in (0, 1), ``(...)`` or
            a float.
        kernel: :class:`UniformKernel`, :class:`MaskKernel` or :class:`HybridKernel` (fast path); other kernels
            fall back to :func:`unifusion.losses.native.gidd_loss` (ELBO only).
        objective: which published loss of the *x0 head* to evaluate: ``"gidd"``, ``"mdlm"`` (mask kernel only),
            or the x0-head SEDD / M2S / Neural-CTMC losses (the head converted by Theorem 3.5). With
            ``weighting="elbo"`` they are all the same number, D_t (Corollary 3.4); the argument documents intent
            and checks the kernel.
        weighting: ``"elbo"`` (w = R_t(·, x_t)/q_{t|0}(x_t|x0)), ``"clip"`` (w clipped to [0, ``max_weight``]) or
            ``"dynamic"`` (GIDD's dynamic weights clipped to [0, ``max_weight``]). Non-ELBO weights replace w for
            every objective alike.

    Returns float32 (float64 for float64 logits) losses ``(...)``; reduce them yourself. Memory: the gradient
    (``x0_logits``' shape and dtype) is computed in the forward pass and kept until backward; nothing else of
    size N×S is allocated (the backward pass returns it scaled by the incoming gradient).

    Example::

        loss = uf.losses.x0_head_loss(model(x_t), x0, x_t, t, kernel)       # (B, L)
        (loss * attention_mask).sum().div(attention_mask.sum()).backward()
    """
    kernel = _check_kernel(kernel)
    _check_weighting(weighting, max_weight)
    _check_objective(objective, kernel)
    logits = V.check_tensor("x0_logits", x0_logits)
    if not logits.dtype.is_floating_point:
        raise TypeError(f"x0_logits: expected a floating-point tensor, got dtype {logits.dtype}")
    S = kernel.num_states
    if logits.dim() == 0 or logits.shape[-1] != S:
        raise ValueError(f"x0_logits: expected shape (..., {S}) (x_t's shape + num_states), got {tuple(logits.shape)}")
    if not _is_fast_kernel(kernel):
        if weighting != "elbo":
            raise ValueError(f"weighting: only 'elbo' is defined for {type(kernel).__name__}, got {weighting!r}")
        return native.gidd_loss(logits, x0, x_t, t, kernel)
    dtype = V.compute_dtype(logits)
    rows, shape = _prepare_rows(kernel, tuple(logits.shape[:-1]), x0, x_t, t, dtype, logits.device,
                                weighting, float(max_weight))
    flat = logits.reshape(-1, S)
    loss = _X0HeadLossFunction.apply(flat, rows, _BLOCK_ELEMENTS)
    return loss.reshape(shape)


def gidd_loss(x0_logits: torch.Tensor, x0: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor | float,
              kernel: Kernel, weighting: Literal["elbo", "clip", "dynamic"] = "elbo",
              max_weight: float = 2.0) -> torch.Tensor:
    """:func:`unifusion.losses.native.gidd_loss` (same signature, same values) at cross-entropy cost; see
    :func:`x0_head_loss`."""
    return x0_head_loss(x0_logits, x0, x_t, t, kernel, objective="gidd", weighting=weighting,
                        max_weight=max_weight)


def mdlm_loss(x0_logits: torch.Tensor, x0: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor | float,
              kernel: MaskKernel) -> torch.Tensor:
    """:func:`unifusion.losses.native.mdlm_loss` (same signature, same values) at cross-entropy cost: on the mask
    kernel MDLM's weighted cross-entropy is D_t of the x0 head; see :func:`x0_head_loss`."""
    if not isinstance(kernel, MaskKernel):
        raise TypeError(f"kernel: mdlm_loss needs a MaskKernel, got {type(kernel).__name__}")
    return x0_head_loss(x0_logits, x0, x_t, t, kernel, objective="mdlm")

"""x0-head losses at the cost of a cross-entropy: analytic gradient, fused row passes, no N×V temporaries.

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

:func:`x0_head_loss`'s forward pass computes the loss and a few row statistics (max and Σ exp of the logits, Σ p e, and
the sums without the most likely token that keep 1 − p and the gradient there exact for a confident model) and keeps the
logits; its backward pass computes the gradient with the incoming per-position gradient folded in. The arithmetic is one
driver over three element passes (:mod:`unifusion.losses._x0_driver`) that ``torch.compile`` fuses into a few
cache-resident loops per row, so nothing of size N×V exists besides the logits and their gradient (eagerly the same
driver runs each pass on blocks of rows). The ``(N, V)`` passes run in float32 for bf16/fp16/fp32 logits (float64
for float64 logits), with the rounding of l − max compensated for float32 logits; every per-row quantity is float64
(float32 on MPS); x − log1p x uses a series below a cut-off, since its terms are ~x²/2 where x is small. Values and
gradients are within 1e-6 of the float64 reference for float32 and bf16 logits (tests/losses/test_losses_extreme.py
states the grid and the exceptions). The reference implementations are :mod:`unifusion.losses.native`.

The loss is read in three modules: this one (the public functions, their argument checks and the logit-free
per-position quantities of the kernel, the times and the weights: :func:`prepare_x0_rows`), the driver that runs
the passes over the logits, compiled or eager (:mod:`unifusion.losses._x0_driver`), and the equations of each pass
and of the per-row terms (:mod:`unifusion.losses._x0_math`).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch.autograd.function import once_differentiable

from .. import _validation as V
from .._math import safe_log
from ..kernels import HybridKernel, InterpolatingKernel, Kernel, MaskKernel, UniformKernel, check_kernel
from . import native
from ._x0_driver import X0Rows, run
from ._x0_math import RowStats, RowTensors
from .native import dynamic_weight

__all__ = ["x0_head_loss", "gidd_loss", "mdlm_loss", "X0_HEAD_OBJECTIVES", "check_objective"]

X0_HEAD_OBJECTIVES = ("gidd", "mdlm", "sedd", "m2s", "ctmc")


# ---------------------------------------------------------------------------------------------------- autograd
class _X0HeadLossFunction(torch.autograd.Function):
    """Per-position loss of logits ``(N, V)``. Forward computes the loss and the row statistics (max, Σ exp, Σ p e,
    …) and keeps the logits; backward computes the gradient with the incoming per-position gradient folded in (one
    pass over each row), so nothing of size N×V is allocated before backward and any reduction is exact."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, rows: X0Rows) -> torch.Tensor:
        loss, _, stats = run(logits, rows, need_stats=ctx.needs_input_grad[0])
        assert loss is not None
        if stats is not None:
            ctx.save_for_backward(logits, *stats)
            ctx.rows = rows
        # (a value check reads the loss back to the host: not inside a compiled region, where it would break the graph)
        if V.validation_enabled() and not torch.compiler.is_compiling() and bool(torch.isnan(loss).any()):
            # finite logits give a finite loss (every term is evaluated in log space), so a NaN comes from the input
            raise ValueError("x0_logits: contains NaN or ±inf (the loss of some position is NaN); the loss is finite "
                             "for every finite logit")
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        logits, *stats = ctx.saved_tensors
        _, grad, _ = run(logits, ctx.rows, need_loss=False, grad_scale=grad_loss, stats=RowStats(*stats))
        return grad, None


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
            fall back to :func:`unifusion.losses.native.reference_gidd_loss` (ELBO only).
        objective: which published loss of the *x0 head* to evaluate: ``"gidd"``, ``"mdlm"`` (mask kernel only),
            or the x0-head SEDD / M2S / Neural-CTMC losses (the head converted by Theorem 3.5). With
            ``weighting="elbo"`` they are all the same number, D_t (Corollary 3.4); the argument documents intent
            and checks the kernel.
        weighting: ``"elbo"`` (w = R_t(·, x_t)/q_{t|0}(x_t|x0)), ``"clip"`` (w clipped to [0, ``max_weight``]) or
            ``"dynamic"`` (GIDD's dynamic weights clipped to [0, ``max_weight``]). Non-ELBO weights replace w for
            every objective alike.

    Returns float32 (float64 for float64 logits) losses ``(...)``; reduce them yourself. Memory: the logits are kept
    for backward (as cross-entropy keeps its log-softmax) and backward allocates their gradient; nothing else of
    size N×S. Training-sized calls run ``torch.compile``-fused, small ones eagerly (see :mod:`unifusion.backend`).

    Example::

        loss = uf.losses.x0_head_loss(model(x_t), x0, x_t, t, kernel)       # (B, L)
        (loss * attention_mask).sum().div(attention_mask.sum()).backward()
    """
    kernel = check_kernel(kernel)
    native.check_weighting(weighting, max_weight)
    check_objective(objective, kernel)
    logits = V.check_tensor("x0_logits", x0_logits)
    if not logits.dtype.is_floating_point:
        raise TypeError(f"x0_logits: expected a floating-point tensor, got dtype {logits.dtype}")
    S = kernel.num_states
    if logits.dim() == 0 or logits.shape[-1] != S:
        raise ValueError(f"x0_logits: expected shape (..., {S}) (x_t's shape + num_states), got {tuple(logits.shape)}")
    if not has_fast_path(kernel):
        if weighting != "elbo":
            raise ValueError(f"weighting: only 'elbo' is defined for {type(kernel).__name__}, got {weighting!r}")
        return native.reference_gidd_loss(logits, x0, x_t, t, kernel)
    dtype = V.compute_dtype(logits)
    rows, shape = prepare_x0_rows(kernel, tuple(logits.shape[:-1]), x0, x_t, t, dtype, logits.device,
                                weighting, float(max_weight))
    flat = logits.reshape(-1, S)
    loss = _X0HeadLossFunction.apply(flat, rows)
    return loss.reshape(shape)


def gidd_loss(x0_logits: torch.Tensor, x0: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor | float,
              kernel: Kernel, weighting: Literal["elbo", "clip", "dynamic"] = "elbo",
              max_weight: float = 2.0) -> torch.Tensor:
    """:func:`unifusion.losses.native.reference_gidd_loss` (same signature, same values) at cross-entropy cost; see
    :func:`x0_head_loss`."""
    return x0_head_loss(x0_logits, x0, x_t, t, kernel, objective="gidd", weighting=weighting,
                        max_weight=max_weight)


def mdlm_loss(x0_logits: torch.Tensor, x0: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor | float,
              kernel: MaskKernel) -> torch.Tensor:
    """:func:`unifusion.losses.native.reference_mdlm_loss` (same signature, same values) at cross-entropy cost: on the
    mask kernel MDLM's weighted cross-entropy is D_t of the x0 head; see :func:`x0_head_loss`."""
    if not isinstance(kernel, MaskKernel):
        raise TypeError(f"kernel: mdlm_loss needs a MaskKernel, got {type(kernel).__name__}")
    return x0_head_loss(x0_logits, x0, x_t, t, kernel, objective="mdlm")


# ---------------------------------------------------------------------------------------------------- arguments
def has_fast_path(kernel: Kernel) -> bool:
    """Whether the fast x0-head loss handles ``kernel`` (uniform, mask and hybrid kernels)."""
    return isinstance(kernel, (UniformKernel, MaskKernel, HybridKernel))


def check_objective(objective: object, kernel: Kernel) -> None:
    """``ValueError`` for an unknown objective, ``TypeError`` for ``"mdlm"`` on a kernel other than the mask kernel."""
    if objective not in X0_HEAD_OBJECTIVES:
        raise ValueError(f"objective: expected one of {X0_HEAD_OBJECTIVES}, got {objective!r}")
    if objective == "mdlm" and not isinstance(kernel, MaskKernel):
        raise TypeError(f"kernel: objective='mdlm' needs a MaskKernel, got {type(kernel).__name__}")


def _clip(w: torch.Tensor, max_weight: float) -> torch.Tensor:
    """``w.clamp(0, max_weight)`` (the same numbers) with ``max_weight`` entering as a 0-d tensor times the float:
    a caller's ``torch.compile`` then traces it as a value, where a scalar bound of ``clamp`` would be specialised
    on (a recompilation for every new ``max_weight``)."""
    return torch.minimum(w.clamp_min(0.0), torch.ones((), dtype=w.dtype, device=w.device) * max_weight)


def prepare_x0_rows(kernel: Kernel, rows_shape: tuple[int, ...] | None, x0: object, x_t: object, t: object,
                    dtype: torch.dtype, device: torch.device, weighting: str, max_weight: float,
                    ) -> tuple[X0Rows, tuple[int, ...]]:
    """Validate ids and times (one host sync), broadcast them to the positions' shape (``rows_shape``: the leading
    shape of the logits, checked against it), and compute every logit-free quantity of a fast ``kernel``
    (:func:`has_fast_path`). Returns the rows, flattened to ``(N,)``, and the positions' shape."""
    with V.batched_checks():
        return _prepare(kernel, rows_shape, x0, x_t, t, dtype, device, weighting, max_weight)


def _prepare(kernel: Kernel, rows_shape: tuple[int, ...] | None, x0: object, x_t: object, t: object,
             dtype: torch.dtype, device: torch.device, weighting: str, max_weight: float,
             ) -> tuple[X0Rows, tuple[int, ...]]:
    S = kernel.num_states
    x0 = V.check_token_ids("x0", x0, S)
    x_t = V.check_token_ids("x_t", x_t, S)
    try:
        shape = tuple(torch.broadcast_shapes(x0.shape, x_t.shape))
    except RuntimeError:
        raise ValueError(f"x0: shape {tuple(x0.shape)} does not broadcast with x_t's {tuple(x_t.shape)}") from None
    if rows_shape is not None and tuple(rows_shape) != shape:
        raise ValueError(f"x0_logits: expected leading shape {shape} (that of x_t), got {tuple(rows_shape)}")
    # the per-row constants (α_t, m_t, rates, weights: chains of a dozen scalar ops near t → 0 or 1) and the kernel's
    # per-row arithmetic are float64 (float32 on MPS, which has no float64) whatever the logits; they are (N,), so
    # this costs nothing next to the (N, V) passes, which run in ``dtype``
    row_dtype = torch.float32 if device.type == "mps" else torch.float64
    t_ = V.check_time("t", t, device=device, dtype=row_dtype, shape=shape)
    try:
        t_ = torch.broadcast_to(t_, shape)
    except RuntimeError:
        raise ValueError(f"t: shape {tuple(t_.shape)} does not broadcast to x_t's shape {shape}") from None
    x0 = x0.to(device).expand(shape).reshape(-1)
    x_t = x_t.to(device).expand(shape).reshape(-1)
    t_ = t_.reshape(-1)

    assert isinstance(kernel, InterpolatingKernel)
    alpha, a, b = kernel.coefficients(t_)
    u = b / kernel.num_uniform_states
    m_x0 = kernel.noise_at(x0, a, b)
    m_xt = kernel.noise_at(x_t, a, b)
    v_mask, v_unif = kernel.rate_coefficients(t_)
    v = torch.where(kernel.is_mask(x_t), v_mask,
                    torch.where(kernel.in_uniform_support(x_t), v_unif, torch.zeros_like(v_unif)))
    q0_xt = torch.where(x_t == x0, alpha, torch.zeros_like(alpha)) + m_xt
    if weighting == "dynamic":
        w = _clip(dynamic_weight(kernel, x0, x_t, t_), max_weight)
    else:
        w = v / torch.where(q0_xt > 0, q0_xt, torch.ones_like(q0_xt))
        if weighting == "clip":
            w = _clip(w, max_weight)
    x0_is_mask, xt_is_mask = kernel.is_mask(x0), kernel.is_mask(x_t)

    zero = torch.zeros_like(alpha)
    log_alpha = torch.log(alpha)
    log_m_x0, log_m_xt = safe_log(m_x0), safe_log(m_xt)
    same = x_t == x0
    possible = same | (m_xt > 0)
    u_pos = u > 0
    alpha_over_u = alpha / torch.where(u_pos, u, torch.ones_like(u))
    active = v > 0
    # x_t impossible under x0 (true rates 0 by convention): the loss is the model's exit rate v (1/qθ(x_t) − 1)
    tensors = RowTensors(x0=x0, x_t=x_t, alpha=alpha, log_alpha=log_alpha, u=u, alpha_over_u=alpha_over_u,
                         m_x0=m_x0, m_xt=m_xt, log_m_x0=log_m_x0, log_m_xt=log_m_xt, same=same, possible=possible,
                         u_pos=u_pos, x0_is_mask=x0_is_mask, xt_is_mask=xt_is_mask,
                         w_active=torch.where(active, w, zero), v_active=torch.where(active & ~possible, v, zero),
                         A=torch.where(active & possible, w * alpha, zero))
    rows = X0Rows(tensors, uniform_noise=kernel.has_uniform_noise, mask_id=kernel.mask_id, dtype=dtype,
                  num_logits=len(x0) * S)
    return rows, shape

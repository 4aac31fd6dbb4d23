"""The logit-free half of the fast x0-head loss: per-position quantities of the kernel, the times and the weights.

:func:`prepare_x0_rows` checks the arguments shared by :func:`unifusion.losses.x0_head_loss` and
:func:`unifusion.losses.fused_linear_diffusion_loss` and computes, once per call, everything per position that does
not depend on the logits (α_t, the noise masses m_t(x0), m_t(x_t), the forward rate into x_t, the loss weight and
what follows from them) as one :class:`RowTensors` of ``(N,)`` tensors: the input of the per-row math in
:mod:`unifusion.losses._x0_row_terms`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .. import _validation as V
from .._math import safe_log
from ..kernels import HybridKernel, InterpolatingKernel, Kernel, MaskKernel, UniformKernel
from .native import dynamic_weight

__all__ = ["X0_HEAD_OBJECTIVES", "RowTensors", "X0Rows", "check_objective", "has_fast_path", "prepare_x0_rows"]

X0_HEAD_OBJECTIVES = ("gidd", "mdlm", "sedd", "m2s", "ctmc")


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


@dataclass(frozen=True)
class X0Rows:
    """The prepared rows of one call: :class:`RowTensors` and the static facts the loss passes need."""

    tensors: RowTensors
    uniform_noise: bool   # u > 0 on some row (uniform, hybrid with p_uniform > 0); False for the mask kernel
    mask_id: int | None
    dtype: torch.dtype    # compute dtype of the (N, V) passes: float32, or float64 for float64 inputs
    num_logits: int       # positions × states of the whole call: what unifusion.backend decides on

    def __getitem__(self, index: Any) -> X0Rows:
        """The rows ``index`` (a slice or an index tensor) of every tensor; the call's ``num_logits`` stays."""
        return X0Rows(RowTensors(*(v[index] for v in self.tensors)), self.uniform_noise, self.mask_id, self.dtype,
                      self.num_logits)


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

"""Output head + x0-head loss fused, so the N×V logits never exist (the idea of fused linear cross-entropy kernels).

For hidden states h ``(N, d)`` and an output matrix W ``(V, d)`` (optional bias b ``(V,)``, logit scale κ, final
soft-cap c as in gemma2/3):

    z = κ (h Wᵀ + b),   logits = c · tanh(z / c)  (or z),   L_n = x0_head_loss(logits_n, x0_n, x_t_n, t_n)

is evaluated over blocks of ``chunk_size`` positions: matmul → loss and analytic ∂L/∂logits of the block
(:mod:`unifusion.losses.fast`) → ∂/∂h of the block and accumulation of ∂/∂W. The forward pass computes only the
losses; the backward pass recomputes each block's logits with the incoming per-position gradient folded in, so any
reduction (masks, per-token weights) is exact; with the row statistics (max, Σ exp, Σ p e) saved by the forward
pass, the gradient is one pass over each recomputed row, written over the block. Memory beyond the inputs: one
``(chunk_size, V)`` block, plus the ``(V, d)`` gradient of W (float32 for low-precision weights).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch.autograd.function import once_differentiable

from .. import _validation as V
from ..kernels import Kernel
from ..rates import _check_kernel
from .fast import _check_objective, _check_weighting, _is_fast_kernel, _prepare_rows, _Rows

__all__ = ["fused_linear_diffusion_loss"]

# elements of one block of logits (128 MiB in float32). At V = 262,144, N = 1024, d = 640: 64 MiB blocks measured
# 0.26x the memory / 2.0x the time of materialised cross-entropy, 256 MiB blocks 0.38x / 1.48x (larger matmuls)
_CHUNK_ELEMENTS = 1 << 25


def _logits_buffer(hidden: torch.Tensor, weight: torch.Tensor, chunk: int) -> torch.Tensor:
    """One ``(min(chunk, N), V)`` block for the logits of every block of a pass."""
    rows = min(chunk, hidden.shape[0])
    return torch.empty(rows, weight.shape[0], dtype=torch.result_type(hidden, weight), device=hidden.device)


def _block_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale: float,
                  softcap: float | None, buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits of one block ``(n, V)`` and, when soft-capping, tanh(z/c) ``(n, V)`` for the chain rule.

    The matmul writes into ``buffer`` (≥ n rows, reused across blocks: a fresh (n, V) allocation per block costs
    page faults comparable to the matmul's own memory traffic)."""
    out = buffer[: h.shape[0]]
    z = torch.mm(h, weight.T, out=out) if bias is None else torch.addmm(bias, h, weight.T, out=out)
    if scale != 1.0:
        z.mul_(scale)
    if softcap is None:
        return z, None
    th = z.div_(softcap).tanh_()
    return th * softcap, th


class _FusedLinearX0Loss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,  # type: ignore[override]
                rows: _Rows, chunk: int, scale: float, softcap: float | None) -> torch.Tensor:
        N = hidden.shape[0]
        loss = torch.empty(N, dtype=rows.dtype, device=hidden.device)
        stats = tuple(torch.empty(N, dtype=rows.dtype, device=hidden.device) for _ in range(3))
        need_stats = any(ctx.needs_input_grad[:3])
        buffer = _logits_buffer(hidden, weight, chunk)
        for lo in range(0, N, chunk):
            hi = min(lo + chunk, N)
            logits, _ = _block_logits(hidden[lo:hi], weight, bias, scale, softcap, buffer)
            loss[lo:hi], _, blk_stats = rows[lo:hi].run(logits, need_stats=need_stats)
            if need_stats:
                for dst, src in zip(stats, blk_stats):
                    dst[lo:hi] = src
            del logits
        ctx.save_for_backward(hidden, weight, bias, *stats)
        ctx.rows, ctx.chunk, ctx.scale, ctx.softcap = rows, chunk, scale, softcap
        if V.validation_enabled() and bool(torch.isnan(loss).any()):
            raise ValueError("hidden: the loss of some position is NaN (NaN in hidden or lm_head_weight?)")
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):  # type: ignore[override]
        hidden, weight, bias, *stats = ctx.saved_tensors
        rows, chunk, scale, softcap = ctx.rows, ctx.chunk, ctx.scale, ctx.softcap
        grads = _Grads(hidden, weight, bias, ctx.needs_input_grad[:3])
        buffer = _logits_buffer(hidden, weight, chunk)
        for lo in range(0, hidden.shape[0], chunk):
            hi = min(lo + chunk, hidden.shape[0])
            logits, th = _block_logits(hidden[lo:hi], weight, bias, scale, softcap, buffer)
            # ∂/∂logits with the incoming gradient folded in: one pass, given the forward's row statistics
            _, g, _ = rows[lo:hi].run(logits, need_loss=False, grad_scale=grad_loss[lo:hi],
                                      stats=tuple(v[lo:hi] for v in stats), grad_into_logits=True)
            del logits
            grads.add_block(lo, hi, g, th, scale, softcap)
        return (*grads.result(), None, None, None, None)


class _Grads:
    """∂/∂hidden, ∂/∂W, ∂/∂b accumulated block by block from ∂/∂logits (float32 accumulation for bf16/fp16)."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 needs: tuple[bool, ...]) -> None:
        self.hidden, self.weight, self.bias = hidden, weight, bias
        acc = torch.float32 if weight.dtype in (torch.bfloat16, torch.float16) else weight.dtype
        self.acc = acc
        self.h = torch.empty_like(hidden) if needs[0] else None
        self.w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if needs[1] else None
        self.b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if needs[2] else None

    def add_block(self, lo: int, hi: int, g: torch.Tensor, th: torch.Tensor | None, scale: float,
                  softcap: float | None) -> None:
        """Chain rule through soft-cap and scale (in place on ``g``), then the three matmul-shaped updates."""
        if th is not None:  # d(c tanh(z/c))/dz = 1 − tanh²
            g.mul_(th.square_().neg_().add_(1.0))
        if scale != 1.0:
            g.mul_(scale)
        if self.h is not None:
            out = self.h[lo:hi]
            torch.mm(g, self.weight, out=out) if g.dtype == out.dtype else out.copy_(g @ self.weight)
        if self.w is not None:
            self.w.addmm_(g.T.to(self.acc), self.hidden[lo:hi].to(self.acc))
        if self.b is not None:
            self.b.add_(g.sum(0, dtype=self.acc))

    def result(self) -> tuple[torch.Tensor | None, ...]:
        w = None if self.w is None else self.w.to(self.weight.dtype)
        b = None if self.b is None else self.b.to(self.bias.dtype)
        return self.h, w, b


class _FusedLinearX0LossReduced(torch.autograd.Function):
    """Σ_n ω_n L_n with its gradients computed in the forward pass (three matmuls per block, as fused linear
    cross-entropy kernels do); backward only scales them by the incoming scalar gradient."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,  # type: ignore[override]
                rows: _Rows, chunk: int, scale: float, softcap: float | None,
                position_weight: torch.Tensor) -> torch.Tensor:
        needs = ctx.needs_input_grad[:3]
        grads = _Grads(hidden, weight, bias, needs) if any(needs) else None
        total = torch.zeros((), dtype=rows.dtype, device=hidden.device)
        buffer = _logits_buffer(hidden, weight, chunk)
        for lo in range(0, hidden.shape[0], chunk):
            hi = min(lo + chunk, hidden.shape[0])
            logits, th = _block_logits(hidden[lo:hi], weight, bias, scale, softcap, buffer)
            omega = position_weight[lo:hi]
            loss, g, _ = rows[lo:hi].run(logits, grad_scale=omega if grads is not None else None,
                                         grad_into_logits=True)
            total += torch.linalg.vecdot(loss, omega)
            if grads is not None:
                grads.add_block(lo, hi, g, th, scale, softcap)
            del logits, g
        if V.validation_enabled() and bool(torch.isnan(total)):
            raise ValueError("hidden: the loss is NaN (NaN in hidden or lm_head_weight?)")
        ctx.grads = None if grads is None else grads.result()
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_total: torch.Tensor):  # type: ignore[override]
        grads, ctx.grads = ctx.grads, None  # scaled in place and handed over: no second (V, d) buffer
        if grads is None:
            raise RuntimeError("fused_linear_diffusion_loss: a reduced loss can be backpropagated once (its gradients "
                               "are computed in the forward pass); use reduction='none' with retain_graph=True")
        out = tuple(None if x is None else x.mul_(grad_total.to(x.dtype)) for x in grads)
        return (*out, None, None, None, None, None)


def fused_linear_diffusion_loss(hidden: torch.Tensor, lm_head_weight: torch.Tensor, x0: torch.Tensor,
                                x_t: torch.Tensor, t: torch.Tensor | float, kernel: Kernel, *,
                                objective: Literal["gidd", "mdlm", "sedd", "m2s", "ctmc"] = "gidd",
                                weighting: Literal["elbo", "clip", "dynamic"] = "elbo", max_weight: float = 2.0,
                                lm_head_bias: torch.Tensor | None = None, logit_scale: float = 1.0,
                                final_logit_softcap: float | None = None, chunk_size: int | None = None,
                                reduction: Literal["none", "sum", "mean"] = "none",
                                position_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Per-position x0-head loss ``(...)`` of ``logits = head(hidden)`` without materialising the logits.

    Equals ``x0_head_loss(head(hidden), x0, x_t, t, kernel, objective=..., weighting=...)`` with
    head(h) = c · tanh(κ (h Wᵀ + b) / c) (soft-cap only when ``final_logit_softcap`` is given), and has gradients
    for ``hidden``, ``lm_head_weight`` and ``lm_head_bias``.

    Args:
        hidden: final hidden states ``(..., d)`` with leading shape that of ``x_t`` (e.g. ``(B, L, d)``).
        lm_head_weight: output embedding ``(S, d)``, S = ``kernel.num_states``.
        x0, x_t, t, kernel, objective, weighting, max_weight: as in :func:`~unifusion.losses.x0_head_loss`.
        lm_head_bias: optional ``(S,)``.  logit_scale: κ.  final_logit_softcap: c (gemma2/3) or ``None``.
        chunk_size: positions per block (default: 2²⁵ / S, i.e. 128 MiB float32 blocks; smaller saves memory,
            larger makes the matmuls more efficient).
        reduction: ``"none"`` (per-position losses), ``"sum"`` (Σ_n ω_n L_n) or ``"mean"`` (Σ_n ω_n L_n / Σ_n ω_n).
            A reduced loss gets its gradients in the forward pass (three matmuls per block instead of four, the
            way fused linear cross-entropy kernels work); backward scales them by the incoming scalar. Use it when
            the loss is reduced anyway, e.g. the padding mask as ``position_weight`` and ``"mean"``; with a global
            normaliser across ranks use ``"sum"`` and divide.
        position_weight: ω ``(...)`` (leading shape of ``x_t``; e.g. the padding mask), only with a reduction;
            ones when ``None``.

    Returns float32 losses ``(...)`` (float64 for float64 inputs), or their reduction (0-d). Per-position losses:
    backward recomputes each block's logits (one extra matmul) and is exact for any incoming per-position gradient.

    Example::

        h = model.hidden_states(x_t, t)                                        # (B, L, d)
        loss = uf.losses.fused_linear_diffusion_loss(h, model.lm_head_weight, x0, x_t, t, kernel)
        (loss * mask).sum().div(mask.sum()).backward()
        # the same value and gradients, three matmuls per block instead of four:
        uf.losses.fused_linear_diffusion_loss(h, model.lm_head_weight, x0, x_t, t, kernel, reduction="mean",
                                              position_weight=mask).backward()
    """
    kernel = _check_kernel(kernel)
    _check_weighting(weighting, max_weight)
    _check_objective(objective, kernel)
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"reduction: expected 'none', 'sum' or 'mean', got {reduction!r}")
    if position_weight is not None and reduction == "none":
        raise ValueError("position_weight: only used with reduction='sum' or 'mean' (weight per-position losses "
                         "yourself), got a tensor with reduction='none'")
    hidden = V.check_tensor("hidden", hidden)
    weight = V.check_tensor("lm_head_weight", lm_head_weight)
    for name, x in (("hidden", hidden), ("lm_head_weight", weight)):
        if not x.dtype.is_floating_point:
            raise TypeError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")
    S = kernel.num_states
    if weight.dim() != 2 or weight.shape[0] != S:
        raise ValueError(f"lm_head_weight: expected shape ({S}, d) (num_states rows), got {tuple(weight.shape)}")
    if hidden.dim() == 0 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden: expected shape (..., {weight.shape[1]}) (the head's input size), "
                         f"got {tuple(hidden.shape)}")
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden: expected the dtype of lm_head_weight ({weight.dtype}), got {hidden.dtype}")
    if lm_head_bias is not None:
        lm_head_bias = V.check_tensor("lm_head_bias", lm_head_bias)
        if tuple(lm_head_bias.shape) != (S,) or lm_head_bias.dtype != weight.dtype:
            raise ValueError(f"lm_head_bias: expected shape ({S},) and dtype {weight.dtype}, "
                             f"got {tuple(lm_head_bias.shape)} {lm_head_bias.dtype}")
    for name, val in (("logit_scale", logit_scale), ("final_logit_softcap", final_logit_softcap)):
        if val is None and name == "final_logit_softcap":
            continue
        if isinstance(val, bool) or not isinstance(val, (int, float)) or not val > 0:
            raise ValueError(f"{name}: expected a positive float, got {val!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size!r}")
    if not _is_fast_kernel(kernel):
        raise TypeError(f"kernel: fused_linear_diffusion_loss supports UniformKernel, MaskKernel and HybridKernel, "
                        f"got {type(kernel).__name__}")
    dtype = V.compute_dtype(hidden)
    rows, shape = _prepare_rows(kernel, tuple(hidden.shape[:-1]), x0, x_t, t, dtype, hidden.device,
                                weighting, float(max_weight))
    flat = hidden.reshape(-1, hidden.shape[-1])
    chunk = chunk_size if chunk_size is not None else max(1, _CHUNK_ELEMENTS // S)
    softcap = None if final_logit_softcap is None else float(final_logit_softcap)
    if reduction == "none":
        loss = _FusedLinearX0Loss.apply(flat, weight, lm_head_bias, rows, chunk, float(logit_scale), softcap)
        return loss.reshape(shape)
    if position_weight is None:
        omega = torch.ones(flat.shape[0], dtype=dtype, device=hidden.device)
    else:
        omega = V.check_tensor("position_weight", position_weight)
        if tuple(omega.shape) != shape:
            raise ValueError(f"position_weight: expected shape {shape} (that of x_t), got {tuple(omega.shape)}")
        omega = omega.to(device=hidden.device, dtype=dtype).reshape(-1)
    if reduction == "mean":
        omega = omega / omega.sum().clamp_min(torch.finfo(dtype).tiny)
    return _FusedLinearX0LossReduced.apply(flat, weight, lm_head_bias, rows, chunk, float(logit_scale), softcap,
                                           omega.contiguous())

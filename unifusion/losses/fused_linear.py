"""Output head + x0-head loss fused, so the N×V logits never exist (the idea of fused linear cross-entropy kernels).

For hidden states h ``(N, d)`` and an output matrix W ``(V, d)`` (optional bias b ``(V,)``, logit scale κ, final
soft-cap c as in gemma2/3) and position weights ω ``(N,)`` (ones by default):

    z = κ (h Wᵀ + b),   logits = c · tanh(z / c)  (or z),   out_n = ω_n L_n(logits_n, x0_n, x_t_n, t_n)

is evaluated over blocks of ``chunk_size`` positions: matmul → loss and analytic ∂L/∂logits of the block
(:mod:`unifusion.losses.fast`) → ∂/∂h of the block and accumulation of ∂/∂W. Three matmuls per block, in the
forward pass, as fused linear cross-entropy kernels do; the backward pass then only applies the incoming gradient
g ``(N,)`` of the per-position output:

    ∂/∂h_n = g_n H_n,     ∂/∂W = Σ_n g_n Δ_nᵀ h_n = c Σ_n Δ_nᵀ h_n + Σ_{n: g_n ≠ c} (g_n − c) Δ_nᵀ h_n,

with Δ_n = ω_n ∂L_n/∂z_n ``(V,)`` and H_n = Δ_n W computed in the forward pass, and c the most common value of g
over the positions whose loss depends on the logits. Every usual reduction (sum, mean, the padding mask as ω, a
global token count) gives g_n = c for all of them, so backward is a scaling; other positions (any other weighting)
get their block's logits recomputed and their correction added, so the gradients are exact for any g. A reduced
loss (``reduction="sum"/"mean"``) knows g_n = c ω_n ahead. Memory beyond the inputs: one ``(chunk_size, V)``
block and the ``(V, d)`` gradient of W (float32 for low-precision weights), held from forward to backward.

Inside a caller's ``torch.compile`` region, or when no gradient is needed, the forward pass computes only the losses
and the row statistics, and backward recomputes each block's logits with g folded in (four matmuls per block).
"""

from __future__ import annotations

import copy
from typing import Literal

import numpy as np
import torch
from torch.autograd.function import once_differentiable

from .. import _validation as V
from .._device import host_to_device
from ..kernels import Kernel, check_kernel
from ._x0_driver import X0Rows, run, stats_buffers
from ._x0_math import RowStats
from .fast import check_objective, has_fast_path, prepare_x0_rows
from .native import check_weighting

__all__ = ["fused_linear_diffusion_loss"]

# Memory budget of one block of logits, counted as float32 (4 bytes per logit; working buffers are about this size
# again). On the CPU, 2²⁵ logits (128 MiB; at V = 262,144, N = 1024, d = 640: 64 MiB blocks measured 0.26x the
# memory / 2.0x the time of materialised cross-entropy, 256 MiB blocks 0.38x / 1.48x). On a GPU the budget is
# larger, so that the block's three matmuls have enough rows for tensor cores (≥ 1024 rows at V = 262,144): the
# skinny 128-row GEMMs of a CPU-sized block would leave most of an H100 idle.
BLOCK_BYTES = {"cpu": 1 << 27, "cuda": 1 << 31}
_MIN_ROWS = 16  # never fewer rows than this (skinny GEMMs), whatever V


def default_chunk_size(num_rows: int, num_states: int, device: torch.device) -> int:
    """Rows per block: :data:`BLOCK_BYTES` of the device type (other accelerators use the CUDA budget; edit the dict
    or pass ``chunk_size`` to change it) divided by ``4 · V`` bytes per row, at least 16 rows, at most ``num_rows``.
    V = 262,144: 128 rows on the CPU (as in 0.1), 2,048 rows on CUDA; V = 49,152: 682 and 10,922."""
    budget = BLOCK_BYTES.get(device.type, BLOCK_BYTES["cuda"])
    return max(1, min(num_rows, max(_MIN_ROWS, budget // (4 * num_states))))


FP32_ACCUMULATION_MODES = ("addmm", "mm")
_FP32_ACCUMULATION: dict[tuple[str, int | None, torch.dtype], str | None] = {}


def fp32_accumulation_mode(device: torch.device, dtype: torch.dtype) -> str | None:
    """How ∂W ``(V, d)`` float32 is accumulated from ``dtype`` operands on ``device``, probed once per device and
    dtype on a 2×2 product against float32 arithmetic (one host read, the first time only):

    * ``"addmm"``: ``torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)`` — a tensor-core GEMM on the bf16/fp16
      operands that accumulates into the float32 ∂W in place (CUDA builds whose ``addmm.dtype_out`` takes a float32
      ``self`` with bf16/fp16 matrices, torch 2.14's among them);
    * ``"mm"``: ``acc.add_(torch.mm(a, b, out_dtype=torch.float32))`` — the same GEMM into a float32 temporary of
      ∂W's size, then one add (CUDA builds whose ``addmm.dtype_out`` wants ``self`` in the operands' dtype);
    * ``None``: neither exists (CPU builds, float32/float64 operands, older torch): the operands are cast to float32
      and ``acc.addmm_`` runs on them (on a GPU without tensor cores unless TF32 is on).
    """
    key = (device.type, device.index, dtype)
    if key not in _FP32_ACCUMULATION:
        probe = device.type != "cpu" and dtype in (torch.bfloat16, torch.float16)
        _FP32_ACCUMULATION[key] = _probe_fp32_accumulation(device, dtype) if probe else None
    return _FP32_ACCUMULATION[key]


def _probe_fp32_accumulation(device: torch.device, dtype: torch.dtype) -> str | None:
    """The first of :data:`FP32_ACCUMULATION_MODES` that runs on ``device`` and gives 0.5 + aᵀa exactly for a 2×2
    ``a`` in ``dtype`` (small integers: exact in every dtype involved), or ``None``."""
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0]], device=device, dtype=dtype)
    want = 0.5 + a.T.float().cpu() @ a.float().cpu()
    for mode in FP32_ACCUMULATION_MODES:
        acc = torch.full((2, 2), 0.5, device=device, dtype=torch.float32)
        try:
            _accumulate(mode, acc, a.T, a)
            if acc.dtype == torch.float32 and torch.equal(acc.cpu(), want):
                return mode
        except (RuntimeError, NotImplementedError, TypeError):
            pass
    return None


def accumulates_in_fp32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ∂W is accumulated in float32 straight from ``dtype`` operands on ``device`` (a GEMM with float32
    output on bf16/fp16 operands: tensor cores, no float32 copies of the operands); see
    :func:`fp32_accumulation_mode`."""
    return fp32_accumulation_mode(device, dtype) is not None


def _accumulate(mode: str | None, acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` ``(m, n)`` float32 and ``a`` ``(m, k)``, ``b`` ``(k, n)`` in ``mode``
    (:func:`fp32_accumulation_mode`)."""
    if mode == "addmm":
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    elif mode == "mm":
        acc.add_(torch.mm(a, b, out_dtype=acc.dtype))
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def _logits_buffer(hidden: torch.Tensor, weight: torch.Tensor, chunk: int) -> torch.Tensor:
    """One ``(min(chunk, N), V)`` block for the logits of every block of a pass."""
    rows = min(chunk, hidden.shape[0])
    dtype = torch.promote_types(hidden.dtype, weight.dtype)  # result_type's, as a dtype function torch.compile traces
    return torch.empty(rows, weight.shape[0], dtype=dtype, device=hidden.device)


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


def _graph_kept() -> bool:
    """Whether the running backward pass keeps the graph (``retain_graph=True``): then the saved gradients must not
    be scaled in place. Unknown (older torch): assume it does."""
    keep = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if keep is None else bool(keep())


class _Grads:
    """∂/∂hidden, ∂/∂W, ∂/∂b from blocks of ∂/∂logits (float32 accumulation of W and b for bf16/fp16)."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 needs: tuple[bool, ...]) -> None:
        self.weight, self.bias = weight, bias
        acc = torch.float32 if weight.dtype in (torch.bfloat16, torch.float16) else weight.dtype
        self.acc = acc
        self.h = torch.empty_like(hidden) if needs[0] else None
        self.w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if needs[1] else None
        self.b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if needs[2] else None

    def add_block(self, h: torch.Tensor, g: torch.Tensor, th: torch.Tensor | None, scale: float,
                  softcap: float | None, h_out: torch.Tensor | None) -> None:
        """Chain rule through soft-cap and scale (in place on ``g`` ``(n, V)``), then ∂/∂h of the block into
        ``h_out`` ``(n, d)`` (skipped when ``None``) and the accumulation of ∂/∂W and ∂/∂b (``h``: the block's
        hidden states)."""
        if th is not None:  # d(c tanh(z/c))/dz = 1 − tanh²
            g.mul_(th.square_().neg_().add_(1.0))
        if scale != 1.0:
            g.mul_(scale)
        if h_out is not None:
            torch.mm(g, self.weight, out=h_out) if g.dtype == h_out.dtype else h_out.copy_(g @ self.weight)
        if self.w is not None:
            # bf16/fp16 operands into the float32 accumulator where the device can (tensor cores, no float32
            # copies of g and h); float32 operands otherwise
            mixed = self.acc != g.dtype and g.dtype == h.dtype
            _accumulate(fp32_accumulation_mode(g.device, g.dtype) if mixed else None, self.w, g.T, h)
        if self.b is not None:
            self.b.add_(g.sum(0, dtype=self.acc))

    def scaled(self, c: torch.Tensor, in_place: bool) -> _Grads:
        """The sums c ∂/∂W and c ∂/∂b (``c`` a 0-d tensor) as a _Grads without ∂/∂h that later blocks can add to:
        scaled in place when the graph is not kept, copies otherwise (the saved sums stay as they are)."""
        out = copy.copy(self)
        out.h = None
        out.w, out.b = ((None if x is None else x.mul_(c) if in_place else x * c) for x in (self.w, self.b))
        return out

    def weight_and_bias(self) -> tuple[torch.Tensor | None, ...]:
        """∂/∂W and ∂/∂b in the parameters' dtypes."""
        w, b, bias = self.w, self.b, self.bias
        return (None if w is None else w.to(self.weight.dtype),
                None if b is None or bias is None else b.to(bias.dtype))


def _blocks(N: int, chunk: int):
    """``(lo, hi)`` of ⌈N / chunk⌉ blocks of rows, split evenly (each ≤ ``chunk``): no one-row remainder, for which
    the compiled loss would recompile (Dynamo specialises size 1)."""
    n = -(-N // chunk)
    return ((N * i // n, N * (i + 1) // n) for i in range(n))


class _FusedLinearX0Loss(torch.autograd.Function):
    """ω ⊙ L per position, or Σ_n ω_n L_n when ``reduced``.

    ``precompute``: gradients in the forward pass (three matmuls per block); backward scales them and, for
    per-position output, corrects the positions whose incoming gradient differs from the common one. Otherwise the
    forward keeps the row statistics and backward recomputes every block (four matmuls per block)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                rows: X0Rows, chunk: int, scale: float, softcap: float | None, omega: torch.Tensor,
                precompute: bool, reduced: bool) -> torch.Tensor:
        N = hidden.shape[0]
        needs = ctx.needs_input_grad[:3]
        grads = _Grads(hidden, weight, bias, needs) if precompute and any(needs) else None
        need_stats = not (precompute and reduced) and any(needs)  # for recomputing some or all blocks
        loss = torch.empty(N, dtype=rows.dtype, device=hidden.device)
        stats = stats_buffers(N, rows.tensors.alpha.dtype, hidden.device) if need_stats else ()
        buffer = _logits_buffer(hidden, weight, chunk)
        for lo, hi in _blocks(N, chunk):
            logits, th = _block_logits(hidden[lo:hi], weight, bias, scale, softcap, buffer)
            blk_loss, g, blk_stats = run(logits, rows[lo:hi], need_stats=need_stats,
                                         grad_scale=None if grads is None else omega[lo:hi], grad_into_logits=True)
            assert blk_loss is not None
            loss[lo:hi] = blk_loss
            for dst, src in zip(stats, blk_stats or ()):
                dst[lo:hi] = src
            if grads is not None:
                assert g is not None
                grads.add_block(hidden[lo:hi], g, th, scale, softcap,
                                None if grads.h is None else grads.h[lo:hi])
            del logits, g
        out = torch.linalg.vecdot(loss, omega) if reduced else loss.mul_(omega)
        if V.validation_enabled() and bool(torch.isnan(out).any()):
            raise ValueError("hidden: the loss of some position is NaN (NaN in hidden or lm_head_weight?)")
        ctx.save_for_backward(hidden, weight, bias, omega, *stats)
        ctx.rows, ctx.chunk, ctx.scale, ctx.softcap = rows, chunk, scale, softcap
        ctx.precompute, ctx.reduced, ctx.grads = precompute, reduced, grads
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        hidden, weight, bias, omega, *stats = ctx.saved_tensors
        none = (None,) * 7
        if not ctx.precompute:
            grads = _Grads(hidden, weight, bias, ctx.needs_input_grad[:3])
            _recompute(ctx, grads, hidden, weight, bias, stats, None, grad_out * omega, with_h=True)
            return (grads.h, *grads.weight_and_bias(), *none)
        grads = ctx.grads
        if grads is None:
            return (None, None, None, *none)
        in_place = not _graph_kept()
        if in_place:
            ctx.grads = None  # scaled in place and handed over: no second (V, d) buffer
        g = grad_out.to(ctx.rows.dtype)
        h = None if grads.h is None else _scale_rows(grads.h, g if g.dim() == 0 else g.unsqueeze(-1), in_place)
        if ctx.reduced:
            return (h, *grads.scaled(g, in_place).weight_and_bias(), *none)
        if grads.w is None and grads.b is None:  # e.g. a frozen output head: ∂/∂h is exact as it is
            return (h, None, None, *none)
        c, others = _common_value(g, _live(ctx.rows, omega))
        out = grads.scaled(c, in_place)
        if others.numel() > 0:  # the other positions' corrections, added to the scaled sums
            _recompute(ctx, out, hidden, weight, bias, stats, others, (g[others] - c) * omega[others],
                       with_h=False)
        return (h, *out.weight_and_bias(), *none)


def _scale_rows(H: torch.Tensor, g: torch.Tensor, in_place: bool) -> torch.Tensor:
    """g · H with the product in g's (float32/float64) precision and one rounding to H's dtype."""
    if H.dtype == g.dtype:
        return H.mul_(g) if in_place else H * g
    return (H.to(g.dtype) * g).to(H.dtype)


def _live(rows: X0Rows, omega: torch.Tensor) -> torch.Tensor:
    """Positions whose output ω L depends on the logits ``(N,)`` bool (a weight or an exit rate, and ω ≠ 0)."""
    return ((rows.tensors.A != 0) | (rows.tensors.v_active != 0)) & (omega != 0)


def _common_value(g: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The most common incoming gradient c over the live positions (0-d) and the live positions where g ≠ c
    (int64 indices). Reads (g, live) on the host in one transfer: the backward's one device sync (the index set has a
    data-dependent size); c and the indices go back without a second wait (a fill on the device, a non-blocking
    copy)."""
    host = torch.stack((g.detach(), live.to(g.dtype))).cpu().numpy()  # (2, N), the one sync
    g_host, live_host = host[0], host[1] != 0
    if not live_host.any():
        return torch.zeros((), dtype=g.dtype, device=g.device), torch.empty(0, dtype=torch.long, device=g.device)
    values, counts = np.unique(g_host[live_host], return_counts=True)
    c = values[counts.argmax()]
    others = np.flatnonzero(live_host & (g_host != c))
    # c is filled on the device (torch.tensor(c, device=...) would be a second, blocking host-to-device copy); the
    # indices are copied without blocking (host_to_device: pinned on CUDA)
    return (torch.full((), float(c), dtype=g.dtype, device=g.device),
            host_to_device(torch.from_numpy(others), g.device))


def _recompute(ctx, grads: _Grads, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               stats: list[torch.Tensor], index: torch.Tensor | None, grad_scale: torch.Tensor,
               with_h: bool) -> None:
    """Recompute the logits of the positions ``index`` (all when ``None``) in blocks and add
    ∂(Σ grad_scale · L)/∂(W, b) (and, with ``with_h``, write ∂/∂h) with the forward's row statistics: one pass over
    each recomputed row. ``grad_scale`` has one entry per recomputed position."""
    rows, chunk, scale, softcap = ctx.rows, ctx.chunk, ctx.scale, ctx.softcap
    count = hidden.shape[0] if index is None else index.numel()
    buffer = _logits_buffer(hidden[:count], weight, chunk)
    for lo, hi in _blocks(count, chunk):
        sel = slice(lo, hi) if index is None else index[lo:hi]
        h = hidden[sel]
        logits, th = _block_logits(h, weight, bias, scale, softcap, buffer)
        _, g, _ = run(logits, rows[sel], need_loss=False, grad_scale=grad_scale[lo:hi],
                      stats=RowStats(*(v[sel] for v in stats)), grad_into_logits=True)
        del logits
        assert g is not None
        grads.add_block(h, g, th, scale, softcap, grads.h[sel] if with_h and grads.h is not None else None)


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
        chunk_size: positions per block (default :func:`default_chunk_size`: 128 MiB of float32 logits per block on
            the CPU, 2 GiB on CUDA so the matmuls have ≥ 1024 rows at S = 262,144; smaller saves memory, larger makes
            the matmuls more efficient).
        reduction: ``"none"`` (per-position ω_n L_n), ``"sum"`` (Σ_n ω_n L_n) or ``"mean"``
            (Σ_n ω_n L_n / Σ_n ω_n).
        position_weight: ω ``(...)`` (leading shape of ``x_t``; e.g. the padding mask); ones when ``None``.
            Positions with ω = 0 cost no gradient work.

    Returns float32 losses ``(...)`` (float64 for float64 inputs), or their reduction (0-d).

    Gradients are computed in the forward pass when autograd needs them (three matmuls per block, as fused linear
    cross-entropy kernels do) and held until backward (a ``(S, d)`` buffer, the size of W's gradient). Backward reads
    the incoming per-position gradient g once (a device sync): where it takes one common value c over the positions
    that matter (``.sum()``, ``.mean()``, masked means with the mask as ω or by hand, a global token count), it is a
    scaling; positions with other values get their logits recomputed and a correction added, so any g is exact
    (at up to one extra matmul for those positions). ``retain_graph=True`` works. Inside a caller's
    ``torch.compile`` region the forward keeps only row statistics and backward recomputes every block (four
    matmuls per block, no sync).

    Example::

        h = model.hidden_states(x_t, t)                                        # (B, L, d)
        loss = uf.losses.fused_linear_diffusion_loss(h, model.lm_head_weight, x0, x_t, t, kernel,
                                                     position_weight=mask)    # (B, L), 0 where padded
        loss.sum().div(mask.sum()).backward()
        # the same value and gradients as one scalar:
        uf.losses.fused_linear_diffusion_loss(h, model.lm_head_weight, x0, x_t, t, kernel, reduction="mean",
                                              position_weight=mask).backward()
    """
    kernel = check_kernel(kernel)
    check_weighting(weighting, max_weight)
    check_objective(objective, kernel)
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"reduction: expected 'none', 'sum' or 'mean', got {reduction!r}")
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
    if not has_fast_path(kernel):
        raise TypeError(f"kernel: fused_linear_diffusion_loss supports UniformKernel, MaskKernel and HybridKernel, "
                        f"got {type(kernel).__name__}")
    dtype = V.compute_dtype(hidden)
    rows, shape = prepare_x0_rows(kernel, tuple(hidden.shape[:-1]), x0, x_t, t, dtype, hidden.device,
                                weighting, float(max_weight))
    flat = hidden.reshape(-1, hidden.shape[-1])
    chunk = chunk_size if chunk_size is not None else default_chunk_size(flat.shape[0], S, flat.device)
    softcap = None if final_logit_softcap is None else float(final_logit_softcap)
    if position_weight is None:
        omega = torch.ones(flat.shape[0], dtype=dtype, device=hidden.device)
    else:
        omega = V.check_tensor("position_weight", position_weight)
        if tuple(omega.shape) != shape:
            raise ValueError(f"position_weight: expected shape {shape} (that of x_t), got {tuple(omega.shape)}")
        omega = omega.to(device=hidden.device, dtype=dtype).reshape(-1)
    if reduction == "mean":
        omega = omega / omega.sum().clamp_min(torch.finfo(dtype).tiny)
    # gradients in the forward pass when autograd will want them; the caller's compiler traces the other way (no
    # host sync in backward)
    precompute = (torch.is_grad_enabled() and not torch.compiler.is_compiling()
                  and any(x is not None and x.requires_grad for x in (flat, weight, lm_head_bias)))
    out = _FusedLinearX0Loss.apply(flat, weight, lm_head_bias, rows, chunk, float(logit_scale), softcap,
                                   omega.contiguous(), precompute, reduction != "none")
    return out if reduction != "none" else out.reshape(shape)

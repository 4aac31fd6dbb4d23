"""Running the fast x0-head loss on a call's logits: compiled or eager (:mod:`unifusion.backend`), in blocks of rows.

:func:`run` is what :mod:`unifusion.losses.fast` and :mod:`unifusion.losses.fused_linear` call. It slices a mask
column at either end off the logits, asks :mod:`unifusion.backend` (through its private machinery) whether the call
runs compiled — a function of the setting and of the call's size only — and then runs the driver
:func:`unifusion.losses._x0_passes.loss_and_grad`:

* compiled: :func:`fused_loss_and_grad` (the driver on :class:`~unifusion.losses._x0_passes.FusedPasses`) through
  ``torch.compile``, one configuration per device, dtypes and flags. On the CPU Inductor keeps exp(l − max) between
  the row loops of a loss pass, so loss passes take blocks of :data:`COMPILED_CPU_BLOCK_ELEMENTS` logits that keep it
  in cache; a gradient pass from saved statistics (one loop per row) and everything on GPUs run on all rows at once
  (fewer calls: each costs ~0.3 ms of guards and set-up);
* eager: the driver on :class:`~unifusion.losses._x0_passes.BlockedPasses`.

Inside a caller's own ``torch.compile`` region the driver is traced inline on all rows, with no host sync, no
data-pointer test and no graph break.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import _compile
from ._x0_passes import BlockedPasses, FusedPasses, block_edges, loss_and_grad
from ._x0_row_terms import Config, RowStats
from ._x0_rows import RowTensors, X0Rows

__all__ = ["COMPILED_CPU_BLOCK_ELEMENTS", "fused_loss_and_grad", "run", "stats_buffers"]

COMPILED_CPU_BLOCK_ELEMENTS = 1 << 22
# recompute exp/log1p per pass instead of storing N×S intermediates (Inductor realises a buffer read > 4 times)
INDUCTOR_OPTIONS = {"realize_reads_threshold": 1000, "realize_opcount_threshold": 100000,
                    "realize_acc_reads_threshold": 1000, "realize_cpu_acc_reads_threshold": 1000,
                    "realize_cpu_opcount_threshold": 100000}

Result = tuple[torch.Tensor | None, torch.Tensor | None, RowStats | None]


def stats_buffers(num_rows: int, dtype: torch.dtype, device: torch.device) -> RowStats:
    """Empty ``(num_rows,)`` buffers in ``dtype`` (the rows' precision) for the row statistics."""
    return RowStats(*(torch.empty(num_rows, dtype=dtype, device=device) for _ in RowStats._fields))


def run(logits: torch.Tensor, rows: X0Rows, *, need_loss: bool = True, need_stats: bool = False,
        grad_scale: torch.Tensor | None = None, stats: RowStats | None = None,
        grad_into_logits: bool = False) -> Result:
    """(loss, gradient, row statistics) of ``logits`` ``(n, V)`` for ``rows`` on the backend the call chooses (by
    ``rows.num_logits``, the whole call's size): the loss if ``need_loss``; the gradient of Σ_n g_n L_n when
    ``grad_scale`` g ``(n,)`` is given (written over the logits with ``grad_into_logits``, which saves a block of
    memory); the statistics for a later gradient call when ``need_stats``; ``stats`` of an earlier call make the
    gradient one pass over each row.

    A mask state in the first or last column (where kernels usually put it) is left out by slicing the logits
    instead of masking that column in every pass; its gradient is 0.
    """
    need_grad = grad_scale is not None
    if grad_scale is not None:
        grad_scale = grad_scale.contiguous()
    config = Config(rows.uniform_noise, need_loss, need_grad, need_stats, rows.dtype)
    grad = None
    if need_grad:
        grad = logits if grad_into_logits else torch.empty_like(logits)
    tensors, mask_id = rows.tensors, rows.mask_id
    S = logits.shape[-1]
    if mask_id is not None and S > 1 and mask_id in (0, S - 1):
        lo = 1 if mask_id == 0 else 0
        # the mask id (now out of range) is flagged by x0_is_mask / xt_is_mask
        tensors = tensors._replace(x0=tensors.x0 - lo, x_t=tensors.x_t - lo)
        keep = slice(lo, lo + S - 1)
        loss, _, out_stats = _run(logits[:, keep], tensors, None, grad_scale, stats, config,
                                  None if grad is None else grad[:, keep], grad_into_logits, rows.num_logits)
        if grad is not None:
            grad[:, mask_id] = 0
        return loss, grad, out_stats
    return _run(logits, tensors, mask_id, grad_scale, stats, config, grad, grad_into_logits, rows.num_logits)


def fused_loss_and_grad(logits: torch.Tensor, rows: RowTensors, mask_id: int | None,
                        grad_scale: torch.Tensor | None, stats: RowStats | None, grad_out: torch.Tensor | None,
                        uniform_noise: bool, need_loss: bool, need_grad: bool, need_stats: bool, dtype: torch.dtype,
                        ) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None, RowStats | None]:
    """The driver on all rows at once (:class:`~unifusion.losses._x0_passes.FusedPasses`): what ``torch.compile``
    traces. The gradient goes into ``grad_out``, or over ``logits`` when ``grad_out`` is ``None``: the in-place case
    takes the logits once rather than as two arguments that alias (a compiled function given aliasing inputs gets a
    "synthetic base" from AOTAutograd, and Inductor's on-disk cache then hands a later process a graph for another
    view/base relation, which fails on its first call). The gradient's two columns per row in ``fix`` are put by the
    caller (inside a compiled function that scatter would cost a copy of the block)."""
    config = Config(uniform_noise, need_loss, need_grad, need_stats, dtype)
    return loss_and_grad(FusedPasses(logits, mask_id, dtype, grad_out), rows, stats, grad_scale, config)


def _run(logits: torch.Tensor, rows: RowTensors, mask_id: int | None, grad_scale: torch.Tensor | None,
         stats: RowStats | None, config: Config, grad_out: torch.Tensor | None, in_place: bool,
         num_logits: int) -> Result:
    """:func:`run` without the mask-column slicing; the gradient (if any) goes into ``grad_out`` (the logits
    themselves when ``in_place``)."""
    if torch.compiler.is_compiling():  # inside the caller's own compiled region: trace it inline, all rows at once
        return _compiled_blocks(fused_loss_and_grad, None, logits, rows, mask_id, grad_scale, stats, config, grad_out,
                                in_place)
    key = (logits.device.type, logits.dtype, mask_id is None, grad_scale is None, stats is None, in_place,
           logits.is_contiguous()) + tuple(config)
    block = None
    if logits.device.type == "cpu" and (stats is None or config.need_loss):
        block = COMPILED_CPU_BLOCK_ELEMENTS
    return _compile.run(
        fused_loss_and_grad, key,
        lambda fn: _compiled_blocks(fn, block, logits, rows, mask_id, grad_scale, stats, config, grad_out, in_place),
        lambda: _eager(logits, rows, mask_id, grad_scale, stats, config, grad_out),
        num_logits=num_logits, what=lambda: _describe(logits, mask_id, stats, config), options=INDUCTOR_OPTIONS)


def _describe(logits: torch.Tensor, mask_id: int | None, stats: RowStats | None, config: Config) -> str:
    """What a compiled configuration computes, for the one log record of its compilation."""
    parts = [name for name, need in (("loss", config.need_loss), ("gradient", config.need_grad),
                                     ("row statistics", config.need_stats)) if need]
    return (f"the fast x0-head loss ({logits.device.type}, {str(logits.dtype).removeprefix('torch.')} logits, "
            f"{'uniform noise' if config.uniform_noise else 'mask kernel'}"
            f"{', mask column' if mask_id is not None else ''}: {' + '.join(parts)}"
            f"{' from saved statistics' if stats is not None else ''})")


def _put(grad: torch.Tensor, index: torch.Tensor, value: torch.Tensor) -> None:
    """``grad[n, index[n, i]] = value[n, i]`` (what ``scatter_`` does, without the copy of ``grad`` that CPU
    ``scatter_`` makes)."""
    rows = torch.arange(grad.shape[0], device=grad.device).unsqueeze(-1).expand_as(index)
    grad.index_put_((rows, index), value)


def _compiled_blocks(fn: Callable, block_elements: int | None, logits: torch.Tensor, rows: RowTensors,
                     mask_id: int | None, grad_scale: torch.Tensor | None, stats: RowStats | None, config: Config,
                     grad_out: torch.Tensor | None, in_place: bool) -> Result:
    """``fn`` (:func:`fused_loss_and_grad`, compiled or traced inline) over blocks of at most ``block_elements``
    logits (all rows at once when ``None``), writing into full-size outputs (the gradient into ``grad_out``, which is
    ``logits`` itself when ``in_place``)."""
    N, S = logits.shape
    R = N if block_elements is None else max(1, min(N, block_elements // max(S, 1)))
    if R >= N:
        loss, fix, out_stats = fn(logits, rows, mask_id, grad_scale, stats, None if in_place else grad_out, *config)
        if grad_out is not None and fix is not None:
            _put(grad_out, *fix)
        return loss, grad_out, out_stats
    loss = torch.empty(N, dtype=config.dtype, device=logits.device) if config.need_loss else None
    out_stats = stats_buffers(N, rows.alpha.dtype, logits.device) if config.need_stats else None
    edges = block_edges(N, R)
    for a, b in zip(edges[:-1], edges[1:]):
        blk_loss, fix, blk_stats = fn(logits[a:b], RowTensors(*(v[a:b] for v in rows)), mask_id,
                                      None if grad_scale is None else grad_scale[a:b],
                                      None if stats is None else RowStats(*(v[a:b] for v in stats)),
                                      None if in_place or grad_out is None else grad_out[a:b], *config)
        if grad_out is not None and fix is not None:
            _put(grad_out[a:b], *fix)
        if loss is not None:
            loss[a:b] = blk_loss
        if out_stats is not None and blk_stats is not None:
            for dst, src in zip(out_stats, blk_stats):
                dst[a:b] = src
    return loss, grad_out, out_stats


@torch.no_grad()
def _eager(logits: torch.Tensor, rows: RowTensors, mask_id: int | None, grad_scale: torch.Tensor | None,
           stats: RowStats | None, config: Config, grad_out: torch.Tensor | None) -> Result:
    """The driver eagerly (:class:`~unifusion.losses._x0_passes.BlockedPasses`); the gradient into ``grad_out``."""
    loss, fix, out_stats = loss_and_grad(BlockedPasses(logits, mask_id, config.dtype, grad_out), rows, stats,
                                         grad_scale, config)
    if fix is None or grad_out is None:
        return loss, None, out_stats
    _put(grad_out, *fix)
    return loss, grad_out, out_stats

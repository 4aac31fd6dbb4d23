"""Running the fast x0-head loss on a call's logits: the driver over three element passes, compiled or eager.

:func:`run` is what :mod:`unifusion.losses.fast` and :mod:`unifusion.losses.fused_linear` call. It slices a mask
column at either end off the logits, asks :mod:`unifusion.backend` (through its private machinery) whether the call
runs compiled — a function of the setting and of the call's size only — and then runs the driver
:func:`loss_and_grad`:

* compiled: :func:`fused_loss_and_grad` (the driver on :class:`FusedPasses`) through ``torch.compile``, one
  configuration per device, dtypes and flags. On the CPU Inductor keeps exp(l − max) between the row loops of a loss
  pass, so loss passes take blocks of :data:`COMPILED_CPU_BLOCK_ELEMENTS` logits that keep it in cache; a gradient
  pass from saved statistics (one loop per row) and everything on GPUs run on all rows at once (fewer calls: each
  costs ~0.3 ms of guards and set-up);
* eager: the driver on :class:`BlockedPasses`.

Inside a caller's own ``torch.compile`` region the driver is traced inline on all rows, with no host sync, no
data-pointer test and no graph break.

:func:`loss_and_grad` is the orchestration, written once: pass 1 over the logits (row maximum, s'), the values at the
columns each row reads alone, k, pass 2 (uniform noise: the sums over the clean states), the per-row terms
(:func:`unifusion.losses._x0_math.row_terms`) and pass 3 (the gradient). It calls the passes through a
:class:`Passes` object:

* :class:`FusedPasses` runs each pass on all rows at once and keeps exp(l − M) for the next pass: the function
  ``torch.compile`` traces (one graph; Inductor fuses it into a few loops per row and recomputes what it does not
  store, so nothing of size N×V is written but the gradient);
* :class:`BlockedPasses` (eager) runs each pass on blocks of rows sized for that pass (:func:`eager_block_rows`),
  writing its row results into ``(N,)`` buffers, and the per-row math once over all rows: a batch costs the per-row
  ops once plus a few dozen ops per block, and its temporaries stay within a per-pass byte budget.

The arithmetic of each pass and of the per-row terms is in :mod:`unifusion.losses._x0_math`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .. import _compile
from ._x0_math import (
    Columns,
    Config,
    Noise,
    NoiseScale,
    RowStats,
    RowTensors,
    Softmax,
    column_ids,
    column_index,
    compute_logits,
    constants,
    exp_off_max,
    gather_columns,
    grad_block,
    need_c,
    noise_scale,
    noise_sums,
    row_terms,
    sum_off_max,
)

__all__ = ["COMPILED_CPU_BLOCK_ELEMENTS", "BlockedPasses", "FusedPasses", "Passes", "X0Rows", "block_edges",
           "eager_block_rows", "fused_loss_and_grad", "loss_and_grad", "run", "stats_buffers"]


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


# ---------------------------------------------------------------------------------------------------- running a call
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
    """The driver on all rows at once (:class:`FusedPasses`): what ``torch.compile``
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
    """The driver eagerly (:class:`BlockedPasses`); the gradient into ``grad_out``."""
    loss, fix, out_stats = loss_and_grad(BlockedPasses(logits, mask_id, config.dtype, grad_out), rows, stats,
                                         grad_scale, config)
    if fix is None or grad_out is None:
        return loss, None, out_stats
    _put(grad_out, *fix)
    return loss, grad_out, out_stats


# ---------------------------------------------------------------------------------------------------- the driver
Sums = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


class Passes(Protocol):
    """The element passes over the logits ``(N, S)`` of one call, in the order :func:`loss_and_grad` calls them."""

    consts: tuple[torch.Tensor, torch.Tensor]  # 0-d zero and one in the element dtype
    grad_dtype: torch.dtype

    def max_and_sum(self, rdt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Pass 1: the row maxima M (element dtype) and s' (``rdt``), each ``(N,)``."""

    def use_max(self, mx: torch.Tensor) -> None:
        """Instead of pass 1: the row maxima of an earlier call (rows' precision)."""

    def gather(self, index: Columns) -> Columns:
        """The logits at the columns ``index`` (element dtype, −inf at the mask column)."""

    def noise(self, x0: torch.Tensor, u_pos: torch.Tensor, scale: NoiseScale, need_loss: bool,
              need_c: bool) -> Sums:
        """Pass 2: :func:`~unifusion.losses._x0_math.noise_sums` of every row."""

    def grad(self, factors: torch.Tensor, u_pos: torch.Tensor, uniform_noise: bool) -> None:
        """Pass 3: write the gradient of every row (all columns but the two of ``fix``)."""


def loss_and_grad(passes: Passes, rows: RowTensors, stats: RowStats | None, grad_scale: torch.Tensor | None,
                  config: Config) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None,
                                           RowStats | None]:
    """Loss ``(N,)`` in ``config.dtype`` (if ``need_loss``), the gradient ``(N, S)`` in the logits' dtype (if
    ``need_grad``: written by ``passes``, all but two columns per row, whose ``(index, value)``, each ``(N, 2)``, are
    returned as ``fix`` for the caller to put) and, if ``need_stats``, the :class:`RowStats` a later gradient call
    starts from. ``grad_scale`` ``(N,)`` is g in ∂(Σ_n g_n L_n)/∂logits (ones when ``None``); with ``stats`` of an
    earlier call the gradient is one pass over each row (exp, divide, store).

    **Two precisions.** ``config.dtype`` (float32 for bf16/fp16/fp32 logits, float64 for float64 ones) is that of the
    ``(N, S)`` element passes; every per-row quantity (the logit-free ``rows``, the gathered logits at x0 and x_t,
    log s, the weights a, b of the gradient, the loss terms) is computed in the rows' dtype, float64 wherever the
    device has it (float32 on MPS). That costs nothing (``(N,)`` tensors) and removes every float32 rounding of a
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
    """
    rdt = rows.alpha.dtype  # per-row precision
    # ---- pass 1, softmax over clean states, unnormalised: P = exp(l − M), s = 1 + s'; P = 1 exactly at the maximum
    if stats is None:
        mx, s_off = passes.max_and_sum(rdt)
        softmax = Softmax(mx.to(rdt), s_off + 1.0, s_off)
    else:
        softmax = Softmax(stats.mx, stats.s, stats.s_off)
        passes.use_max(stats.mx)
    index = column_index(rows, config.need_grad)
    values = passes.gather(index)
    # ---- pass 2 (uniform noise): Σ_{y≠x0} (x_y − log1p x_y), Σ_{y≠x0} P_y e_y, T
    noise = Noise(None, None, None, None)
    if config.uniform_noise:
        scale = noise_scale(rows.alpha_over_u, softmax.s, config.need_loss, config.dtype)
        sums: Sums = (None, None, None)
        with_c = need_c(config, stats)
        if config.need_loss or with_c:
            sums = passes.noise(rows.x0, rows.u_pos, scale, config.need_loss, with_c)
        noise = Noise(scale.k, *sums)
    # ---- per row: the loss, the gradient's factors and its values at x0 and x_t
    terms = row_terms(rows, softmax, index, values, noise, stats, grad_scale, passes.consts, config)
    if terms.factors is None or terms.fix_index is None or terms.fix_value is None:
        return terms.loss, None, terms.stats
    # ---- pass 3: the gradient
    passes.grad(terms.factors, rows.u_pos, config.uniform_noise)
    return terms.loss, (terms.fix_index, terms.fix_value.to(passes.grad_dtype)), terms.stats


# ---------------------------------------------------------------------------------------------------- compiled
class FusedPasses:
    """The passes on all rows at once, each keeping d = l − M and P = e^d for the next: what ``torch.compile``
    traces into one graph (Inductor recomputes or stores them as its heuristics decide). The gradient is written
    into ``grad_out``, or over ``logits`` when ``grad_out`` is ``None`` (after every read of them)."""

    def __init__(self, logits: torch.Tensor, mask_id: int | None, dtype: torch.dtype,
                 grad_out: torch.Tensor | None) -> None:
        self.logits, self.dtype, self.grad_out, self.grad_dtype = logits, dtype, grad_out, logits.dtype
        self.consts = constants(dtype, logits.device)
        self.col = column_ids(logits.shape[-1], dtype, logits.device)
        self.l = compute_logits(logits, self.col, mask_id, dtype)

    def _exp_off(self, mx: torch.Tensor) -> None:
        self.d, self.d_lo, self.P = exp_off_max(self.logits.dtype, self.l, mx, self.dtype)
        self.below = self.d < 0

    def max_and_sum(self, rdt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        mx = self.l.amax(-1)
        self._exp_off(mx)
        return mx, sum_off_max(self.below, self.P, *self.consts, rdt)

    def use_max(self, mx: torch.Tensor) -> None:
        self._exp_off(mx.to(self.dtype))

    def gather(self, index: Columns) -> Columns:
        return gather_columns(self.l, index, None, self.dtype)

    def noise(self, x0: torch.Tensor, u_pos: torch.Tensor, scale: NoiseScale, need_loss: bool,
              need_c: bool) -> Sums:
        at_x0 = self.col == x0.to(self.col.dtype).unsqueeze(-1)
        return noise_sums(self.d, self.d_lo, self.P, at_x0, scale.k_e, scale.log_k, u_pos, *self.consts, need_loss,
                          need_c, self.dtype)

    def grad(self, factors: torch.Tensor, u_pos: torch.Tensor, uniform_noise: bool) -> None:
        grad = grad_block(self.below, self.P, factors, u_pos, uniform_noise, self.grad_dtype)
        (self.logits if self.grad_out is None else self.grad_out).copy_(grad)


# ---------------------------------------------------------------------------------------------------- eager
# On the CPU every pass takes blocks of EAGER_BLOCK_ELEMENTS logits (a few MB of temporaries that fit the caches; an
# op is a cheap call there). On an accelerator every op is a kernel launch: a batch costs ~420 per-row ops once plus,
# per block, ~14 (max and s'), ~60 (uniform noise: Σ (x − log1p x), Σ P e, T) and ~15 (the gradient) ops on
# (rows, S) tensors at bf16 logits (~25 in the first and last for float32 logits). So each pass takes as many rows as
# keep its temporaries (EAGER_PASS_WIDTH) within its byte budget (EAGER_ACCELERATOR_PASS_BYTES): 8.9 GiB of
# temporaries at most in a forward with uniform noise, 2.1 GiB in one without (the max pass alone) and 3.3 GiB beside
# the gradient in the backward. bf16 16,384 × 262,144 then takes 27 + 26 + 25 blocks, 2,654 launches (1,027 for the
# mask kernel), 16,384 × 49,152 849; tests/losses/test_launch_count.py counts them and measures the temporaries on
# the meta device.
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


def block_edges(N: int, rows_per_block: int) -> list[int]:
    """Row edges of ⌈N / rows_per_block⌉ blocks split evenly (256 rows at 85 per block: four of 64, not
    85 + 85 + 85 + 1): a one-row remainder would make a compiled function recompile for size 1 (Dynamo specialises
    sizes 0 and 1), a multi-second stall in the middle of a run."""
    num_blocks = max(1, -(-N // max(rows_per_block, 1)))
    return [N * i // num_blocks for i in range(num_blocks + 1)]


class BlockedPasses:
    """The passes eagerly, each on its own blocks of rows (:func:`eager_block_rows`), one after the other in the
    caller's thread; row results go into ``(N,)`` buffers and the gradient into ``grad_out`` (which may be the
    logits themselves: each block is written after its last read). Call under ``torch.no_grad()``."""

    def __init__(self, logits: torch.Tensor, mask_id: int | None, dtype: torch.dtype,
                 grad_out: torch.Tensor | None) -> None:
        self.logits, self.mask_id, self.dtype, self.grad_out = logits, mask_id, dtype, grad_out
        self.grad_dtype = logits.dtype
        self.consts = constants(dtype, logits.device)
        self.col = column_ids(logits.shape[-1], dtype, logits.device)
        self.mx: torch.Tensor | None = None  # the row maxima (element dtype), from pass 1 or saved statistics

    def each(self, pass_name: str, job: Callable[[int, int], None]) -> None:
        """``job(a, b)`` on the blocks [a, b) of rows of the pass ``pass_name``, in order."""
        N, S = self.logits.shape
        edges = block_edges(N, eager_block_rows(self.logits.device, S, self.logits.dtype, self.dtype, pass_name))
        for a, b in zip(edges[:-1], edges[1:]):
            job(a, b)

    def _exp_off(self, a: int, b: int, own_max: bool = False,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(M, d, d_lo, P) of the rows a … b − 1 (M from the block with ``own_max``, else that of pass 1)."""
        l = compute_logits(self.logits[a:b], self.col, self.mask_id, self.dtype)
        if own_max:
            mx_blk = l.amax(-1)
        else:
            assert self.mx is not None  # pass 1 or use_max ran first
            mx_blk = self.mx[a:b]
        return (mx_blk, *exp_off_max(self.logits.dtype, l, mx_blk, self.dtype))

    def max_and_sum(self, rdt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        N, device = self.logits.shape[0], self.logits.device
        mx = torch.empty(N, dtype=self.dtype, device=device)
        s_off = torch.empty(N, dtype=rdt, device=device)

        def job(a: int, b: int) -> None:
            mx_blk, d, _, P = self._exp_off(a, b, own_max=True)
            below = d < 0
            del d  # one (rows, S) temporary fewer at the peak
            mx[a:b] = mx_blk
            s_off[a:b] = sum_off_max(below, P, *self.consts, rdt)

        self.each("max", job)
        self.mx = mx
        return mx, s_off

    def use_max(self, mx: torch.Tensor) -> None:
        self.mx = mx.to(self.dtype)

    def gather(self, index: Columns) -> Columns:
        return gather_columns(self.logits, index, self.mask_id, self.dtype)

    def noise(self, x0: torch.Tensor, u_pos: torch.Tensor, scale: NoiseScale, need_loss: bool,
              need_c: bool) -> Sums:
        N, device = self.logits.shape[0], self.logits.device
        sums = tuple(torch.empty(N, dtype=self.dtype, device=device) if need else None
                     for need in (need_loss, need_c, need_c))
        x0_ids = x0.to(self.col.dtype)
        k_e, log_k = scale.k_e, scale.log_k

        def job(a: int, b: int) -> None:
            _, d, d_lo, P = self._exp_off(a, b)
            at_x0 = self.col == x0_ids[a:b].unsqueeze(-1)
            out = noise_sums(d, d_lo, P, at_x0, k_e[a:b], None if log_k is None else (log_k[0][a:b], log_k[1][a:b]),
                             u_pos[a:b], *self.consts, need_loss, need_c, self.dtype)
            for dst, src in zip(sums, out):
                if dst is not None and src is not None:
                    dst[a:b] = src

        self.each("noise", job)
        return sums[0], sums[1], sums[2]

    def grad(self, factors: torch.Tensor, u_pos: torch.Tensor, uniform_noise: bool) -> None:
        grad = self.grad_out
        assert grad is not None  # the eager runner always passes the gradient's buffer

        def job(a: int, b: int) -> None:
            _, d, _, P = self._exp_off(a, b)
            below = d < 0
            del d
            grad[a:b] = grad_block(below, P, factors[:, a:b], u_pos[a:b], uniform_noise, grad.dtype)

        self.each("grad", job)

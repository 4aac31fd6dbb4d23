"""Where a block model's blocks fall in a row, for any model kind: the arithmetic the estimators, the trainers and the
samplers share.

A block model with block size K (``Denoiser.block_size``) decodes a row block by block from the first column it
generates: blocks ``[s, s + K), [s + K, s + 2K), …`` where s is the row's **generated start** (the prompt's end, as
:func:`unifusion.samplers.generate` places it), the last block shorter when K does not divide the generated length.
The prompt before s is the clean prefix, whatever its length. A block-causal forward that cuts blocks at column
multiples of K (``adapt_ar_model(..., block_size=K)``) computes that partition for a row moved right by
``(−s) mod K`` invisible left pads (:func:`aligning_shifts`, :func:`shift_right`): what ``generate(...,
use_cache=False)`` does for a batch, and what :func:`unifusion.rl.sequence_logprob` does row by row.
"""

from __future__ import annotations

import torch
from einops import repeat

__all__ = ["aligning_shifts", "expand_block_times", "generated_start", "num_blocks", "shift_right"]


def num_blocks(length: int, block_size: int) -> int:
    """``nb = ⌈L / K⌉`` (the last block is shorter when K does not divide L)."""
    return -(-length // block_size)


def expand_block_times(t: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Per-block times ``(B, nb)`` → per-position times ``(B, L)`` (token i gets the time of block ``i // K``)."""
    return repeat(t, "b nb -> b (nb k)", k=block_size)[:, :length]  # each block's time on its K positions


def generated_start(generated: torch.Tensor) -> torch.Tensor:
    """``(B,)`` int64, the first column of each row's generated region (``generated`` ``(B, L)`` bool: the columns a
    decoder generated, e.g. the completion); ``L`` for a row without one."""
    L = generated.shape[-1]
    col = torch.arange(L, device=generated.device)
    return torch.where(generated, col, L).amin(-1)


def aligning_shifts(start: torch.Tensor, block_size: int) -> torch.Tensor:
    """``(B,)`` int64 ``(−start) mod K``: the invisible left pads that put each row's generated start on a column
    multiple of K (0 for a start already on one)."""
    return (-start) % block_size


def shift_right(x: torch.Tensor, shifts: torch.Tensor, width: int, fill: float | int | bool | torch.Tensor
                ) -> torch.Tensor:
    """Row b of ``x`` ``(B, L, ...)`` moved ``shifts[b]`` columns to the right in a ``(B, width, ...)`` tensor
    (``width ≥ L + max(shifts)``), ``fill`` (a scalar, or a tensor that broadcasts, e.g. ``(B, 1)``) before and after
    it."""
    B, L = x.shape[:2]
    col = torch.arange(width, device=x.device)[None, :] - shifts[:, None]  # (B, width) source column
    inside = (col >= 0) & (col < L)
    index = col.clamp(0, L - 1)
    if x.dim() > 2:
        index = index.reshape(B, width, *([1] * (x.dim() - 2))).expand(B, width, *x.shape[2:])
        inside = inside.reshape(index.shape[:2] + (1,) * (x.dim() - 2))
    moved = x.gather(1, index)
    value = fill.to(x.dtype) if isinstance(fill, torch.Tensor) else torch.full((), fill, dtype=x.dtype, device=x.device)
    return torch.where(inside, moved, value)

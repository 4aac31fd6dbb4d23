"""Where a block model's blocks fall in a row, for any model kind: the arithmetic the estimators, the trainers and the
samplers share.

A block model with block size K (``Denoiser.block_size``) decodes a row block by block. Its blocks are cut at
``o, o + K, o + 2K, …`` from the row's **block origin** o, which the model kind declares
(``Denoiser.block_origin``, :func:`origin_columns`):

* ``"prompt_end"``: o = s, the row's **generated start** (the prompt's end, as :func:`unifusion.samplers.generate`
  places it). The prompt before s is the clean prefix, whatever its length; the first block holds the first K
  generated tokens (unifusion's adapted ``DiffusionLM``).
* ``"sequence_start"``: o = the row's first real column (after its left padding). The block holding s,
  ``[b₀, b₀ + K)`` with ``b₀ = o + ⌊(s − o)/K⌋ K`` (:func:`first_block_start`), starts with the prompt's last
  ``(s − o) mod K`` tokens, kept fixed, and is decoded with the first generated ones (SDAR, LLaDA 2.x, Fast-dLLM v2).

The last block is shorter when the generated region does not end on a cut. A block-causal forward that cuts blocks
at column multiples of K (``adapt_ar_model(..., block_size=K)``, the released kinds' forward) computes that
partition for a row moved right by ``(−o) mod K`` invisible left pads (:func:`aligning_shifts`,
:func:`shift_right`): what ``generate(..., use_cache=False)`` does for a batch, and what
:func:`unifusion.rl.sequence_logprob` does row by row.
"""

from __future__ import annotations

from typing import cast

import torch
from einops import repeat

from .denoiser import BLOCK_ORIGINS, BlockOrigin

__all__ = ["aligning_shifts", "block_origin_of", "expand_block_times", "first_block_start", "generated_start",
           "num_blocks", "origin_columns", "shift_left", "shift_right"]


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


def block_origin_of(model: object) -> BlockOrigin:
    """The model's declared block origin (``Denoiser.block_origin``; ``"prompt_end"`` for an object that declares
    none, e.g. a decoding view). Any other value is a ``ValueError`` naming ``block_origin``."""
    origin = getattr(model, "block_origin", "prompt_end")
    if origin not in BLOCK_ORIGINS:
        raise ValueError(f"block_origin: {type(model).__name__} declares {origin!r}; expected one of {BLOCK_ORIGINS}")
    return cast(BlockOrigin, origin)


def origin_columns(origin: BlockOrigin, generated: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """``(B,)`` int64, the column each row's blocks are counted from (module docstring): its generated start
    (:func:`generated_start` of ``generated`` ``(B, L)`` bool) for ``"prompt_end"``; its first real column for
    ``"sequence_start"`` (the first True of ``valid`` ``(B, L)`` bool, False at left padding; 0 when ``valid`` is
    ``None``)."""
    if origin == "prompt_end":
        return generated_start(generated)
    if valid is None:
        return torch.zeros(generated.shape[0], dtype=torch.long, device=generated.device)
    return generated_start(valid.to(torch.bool))


def first_block_start(start: torch.Tensor, origin: torch.Tensor, block_size: int) -> torch.Tensor:
    """``b₀ = o + ⌊(s − o)/K⌋ K`` ``(B,)``: the first column of the block that holds each row's generated start s,
    for blocks counted from o (``s`` itself when ``o = s``)."""
    return origin + (start - origin).div(block_size, rounding_mode="floor") * block_size


def aligning_shifts(start: torch.Tensor, block_size: int) -> torch.Tensor:
    """``(B,)`` int64 ``(−start) mod K``: the invisible left pads that put each row's block origin ``start`` (its
    generated start, or its first real column: :func:`origin_columns`) on a column multiple of K (0 for one already
    there)."""
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


def shift_left(x: torch.Tensor, shifts: torch.Tensor, length: int) -> torch.Tensor:
    """The inverse of :func:`shift_right`: columns ``shifts[b] .. shifts[b] + length`` of row b of ``x``
    ``(B, width, ...)`` as ``(B, length, ...)`` (what a forward over the shifted rows computed for the original
    columns); ``x`` itself when ``width == length`` (no row moved)."""
    B, width = x.shape[:2]
    if width == length:
        return x
    index = torch.arange(length, device=x.device)[None, :] + shifts[:, None]
    if x.dim() > 2:
        index = index.reshape(B, length, *([1] * (x.dim() - 2))).expand(B, length, *x.shape[2:])
    return x.gather(1, index)

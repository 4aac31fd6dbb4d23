"""Categorical draws of the samplers (private): x_θ post-processing (temperature, top-k, top-p) into a workspace,
the two-level inverse-CDF draw, the draw straight from the logits (no (B, L, S) softmax), and random draws from one
generator or from one generator per row (:func:`draw_rows`).

Pure functions on tensors; nothing here reads a value back to the host.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeAlias

import torch

from .. import _compile

BLOCK_SIZE = 256
"""Vocabulary block size of the two-level inverse-CDF draw (about √V for LM vocabularies)."""

Generators: TypeAlias = torch.Generator | Sequence[torch.Generator] | None
"""A sampler's randomness: one ``torch.Generator`` (or ``None``: the default one) for the whole batch, or a sequence
of ``B`` generators, one per row (checked by :func:`unifusion.samplers._setup.check_generators`)."""


def draw_rows(draw: Callable[[tuple[int, ...], torch.Generator | None], torch.Tensor], shape: tuple[int, ...],
              generator: Generators) -> torch.Tensor:
    """``draw(shape, generator)`` for one generator; for a sequence of ``B = shape[0]`` generators, row b (dim 0) is
    ``draw((1, *shape[1:]), generators[b])``: each generator makes the draws a batch of one makes, in the same order,
    whatever rows are beside it (B draws instead of one; the single-generator path is unchanged)."""
    if generator is None or isinstance(generator, torch.Generator):
        return draw(shape, generator)
    return torch.cat([draw((1, *shape[1:]), g) for g in generator])


def _softmax_into(logits: torch.Tensor, out: torch.Tensor) -> None:
    if logits.dtype == out.dtype:
        torch._softmax(logits, -1, False, out=out)  # fused, writes the reused workspace
    else:
        out.copy_(logits)
        torch._softmax(out, -1, False, out=out)


def x0_weights(logits: torch.Tensor, out: torch.Tensor, *, mask_id: int | None, temperature: float = 1.0,
               top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """Unnormalised x_θ ``(B, L, S)`` into the workspace ``out``: softmax(logits / T), the mask state set to 0
    (MDLM's SUBS: clean tokens never take it), then top-k, then top-p (nucleus) filtering.

    Rows are left unnormalised (after filtering they sum to ≤ 1); the draws normalise by the row total. Ties at the
    k-th value, and at the nucleus boundary, are kept.
    """
    if temperature != 1.0:
        torch.div(logits, temperature, out=out)
        _softmax_into(out, out)
    else:
        _softmax_into(logits, out)
    if mask_id is not None:
        out[..., mask_id] = 0.0
    if top_k is not None and top_k < out.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1, sorted=False).values.amin(-1, keepdim=True)  # (B, L, 1)
        out.masked_fill_(out < kth, 0.0)
    if top_p is not None and top_p < 1.0:
        sorted_w, _ = torch.sort(out, dim=-1, descending=True)
        before = sorted_w.cumsum(-1) - sorted_w  # mass strictly before each token, (B, L, S)
        total = before[..., -1:] + sorted_w[..., -1:]
        count = (before < top_p * total).sum(-1, keepdim=True).clamp_min(1)  # smallest nucleus reaching top_p
        threshold = sorted_w.gather(-1, count - 1)
        out.masked_fill_(out < threshold, 0.0)
    return out




def _search(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Smallest index i with cdf[i] > u · cdf[-1] (inverse CDF; zero-weight entries are never chosen)."""
    total = cdf[..., -1:]
    v = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, v, right=True).clamp_max(cdf.shape[-1] - 1)


def sample_weights(weights: torch.Tensor, u: torch.Tensor, *, block_size: int = BLOCK_SIZE
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one index per row of non-negative ``weights`` ``(..., S)`` ∝ the weights, by two-level inverse CDF.

    ``u`` ``(..., 2)`` holds two independent uniforms per row: the first picks a block of ``block_size`` states ∝ its
    mass, the second a state inside it. Exact in exact arithmetic; in floating point no cumulative sum runs over more
    than ``max(S / block_size, block_size)`` terms. Rows with zero total return an arbitrary index.

    Returns ``(index (...) int64, row total (...))``.
    """
    S = weights.shape[-1]
    num_blocks = S // block_size
    tail = S - num_blocks * block_size
    parts = []
    if num_blocks:
        parts.append(weights[..., : num_blocks * block_size].unflatten(-1, (num_blocks, block_size)).sum(-1))
    if tail:
        parts.append(weights[..., num_blocks * block_size:].sum(-1, keepdim=True))
    block_mass = parts[0] if len(parts) == 1 else torch.cat(parts, -1)  # (..., nb)
    block_cdf = block_mass.cumsum(-1)
    block = _search(block_cdf, u[..., :1])  # (..., 1)
    return _draw_in_block(block, block_size, S, lambda idx: weights.gather(-1, idx), u[..., 1:2]), block_cdf[..., -1]


def _draw_in_block(block: torch.Tensor, block_size: int, S: int, weight_of: Callable[[torch.Tensor], torch.Tensor],
                   u: torch.Tensor) -> torch.Tensor:
    """Second level of the two-level draw: a state of the chosen ``block`` ``(..., 1)`` ∝ ``weight_of(ids)`` (ids
    ``(..., width)``, clamped into range; states past S weigh 0), by inverse CDF with ``u`` ``(..., 1)``. ``(...)``."""
    idx = block * block_size + torch.arange(min(block_size, S), device=block.device)  # (..., width)
    local = weight_of(idx.clamp_max(S - 1))
    local = torch.where(idx < S, local, torch.zeros_like(local))
    return idx.gather(-1, _search(local.cumsum(-1), u)).squeeze(-1)



COMPILE_MIN_STATES = 2048
"""Vocabularies from this size up may run :func:`block_log_mass` through ``torch.compile`` (when
:mod:`unifusion.backend` chooses the compiled implementation for the call); below it the pass is cheap next to any
model and a compilation is not."""


def block_log_mass(logits: torch.Tensor, mask_id: int | None, temperature: float, block_size: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """log Σ_{y in block} exp(l_y / T) per vocabulary block of ``block_size`` states, ``(..., ceil(S / block))``.

    The mask state (MDLM's SUBS) counts as −inf; the last block may be shorter. Computed as m + log Σ exp(l − m)
    with m the row max, so a block far below the max underflows to −inf: its mass relative to the row's is
    < e^−87 (float32) or e^−708 (float64), below the precision of any draw. Compiled, this is a max and one pass of
    exp over the logits, and nothing of size S is written.
    """
    S = logits.shape[-1]
    l = logits.to(dtype)
    if temperature != 1.0:
        l = l / temperature
    if mask_id is not None:
        l = torch.where(torch.arange(S, device=logits.device) == mask_id, -math.inf, l)
    m = l.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    num_full = S // block_size
    parts = []
    if num_full > 0:
        parts.append(torch.exp(l[..., : num_full * block_size] - m).unflatten(-1, (num_full, block_size)).sum(-1))
    if S - num_full * block_size > 0:
        parts.append(torch.exp(l[..., num_full * block_size:] - m).sum(-1, keepdim=True))
    mass = parts[0] if len(parts) == 1 else torch.cat(parts, -1)
    return torch.log(mass) + m


def _key(logits: torch.Tensor, mask_id: int | None, temperature: float, block_size: int, dtype: torch.dtype) -> tuple:
    """The compiled configuration of :func:`block_log_mass` for these arguments."""
    return (logits.device.type, logits.dtype, dtype, mask_id is None, temperature == 1.0, block_size)


def compiled_block_log_mass(logits: torch.Tensor, mask_id: int | None, temperature: float, block_size: int,
                            dtype: torch.dtype) -> Callable | None:
    """The compiled :func:`block_log_mass` for this configuration if a call on ``logits`` runs compiled (a vocabulary
    of at least :data:`COMPILE_MIN_STATES` and :mod:`unifusion.backend`'s choice for ``logits.numel()`` logits),
    else ``None``. Nothing compiles until the returned function is called."""
    if logits.shape[-1] < COMPILE_MIN_STATES or torch.compiler.is_compiling():
        return None
    if not _compile.chooses_compiled(logits.numel()):
        return None
    return _compile.compiled(block_log_mass, _key(logits, mask_id, temperature, block_size, dtype))


def draw_from_logits(logits: torch.Tensor, x_t: torch.Tensor, u: torch.Tensor, *, mask_id: int | None,
                     temperature: float, dtype: torch.dtype, block_size: int = BLOCK_SIZE
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """One draw z ~ x_θ = softmax(logits / T) (mask state excluded) per position and x_θ(x_t), without a softmax
    over the whole vocabulary: block masses from :func:`block_log_mass`, then the same two-level inverse CDF as
    :func:`sample_weights` (``u`` ``(..., 2)``: block, then state), exponentiating only the chosen block.

    Returns ``(z (B, L) int64, x_θ(x_t) (B, L) in dtype)``.
    """
    S = logits.shape[-1]
    if S >= COMPILE_MIN_STATES and not torch.compiler.is_compiling():
        log_mass = _compile.run(block_log_mass, _key(logits, mask_id, temperature, block_size, dtype),
                                lambda fn: fn(logits, mask_id, temperature, block_size, dtype),
                                lambda: block_log_mass(logits, mask_id, temperature, block_size, dtype),
                                num_logits=logits.numel(),
                                what=lambda: f"the samplers' block masses ({logits.device.type}, {logits.dtype}, "
                                             f"{'no mask' if mask_id is None else 'mask'}, block {block_size})")
    else:
        log_mass = block_log_mass(logits, mask_id, temperature, block_size, dtype)
    log_total = torch.logsumexp(log_mass, -1, keepdim=True)  # (B, L, 1)

    def x_theta(ids: torch.Tensor) -> torch.Tensor:  # x_θ at ``ids``, 0 at the mask state
        p = torch.exp(logits.gather(-1, ids).to(dtype) / temperature - log_total)
        return p if mask_id is None else torch.where(ids == mask_id, torch.zeros_like(p), p)

    block = _search(torch.exp(log_mass - log_total).cumsum(-1), u[..., :1])  # (B, L, 1)
    z = _draw_in_block(block, block_size, S, x_theta, u[..., 1:2])
    return z, x_theta(x_t.unsqueeze(-1)).squeeze(-1)

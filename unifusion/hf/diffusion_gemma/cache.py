"""The cached, step-by-step operations of DiffusionGemma decoding: prefill the prompt, denoise a canvas, commit it.

A sampler that decodes canvas by canvas calls them in this order (what ``DiffusionGemmaForBlockDiffusion.generate``
does, with the same calls, masks and position ids, so the logits are the reference's bit for bit)::

    state = prefill(model, prompt_ids, attention_mask=mask)     # encoder over the prompt → KV cache
    for each canvas:
        logits = denoise(model, state, canvas, self_conditioning_logits=previous)   # (B, K, V), cache read only
        ...                                                       # as many steps as the policy takes
        commit(model, state, clean_canvas)                        # encoder over the canvas → appended to the cache

``denoise`` of canvas c after committing canvases 0 … c − 1 computes what :meth:`DiffusionGemmaLM.forward` computes
for canvas c with those canvases as the clean prefix (cached = uncached, to float rounding): a sliding-window layer
sees the last ``W − 1`` cached tokens, a full layer all of them, and the canvas attends to itself bidirectionally.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ... import _validation as V
from .wrapped import WrappedDiffusionGemma

__all__ = ["CanvasState", "commit", "denoise", "prefill", "select_rows"]


@dataclass
class CanvasState:
    """What decoding carries between canvases.

    Attributes:
        cache: the transformers ``DynamicCache`` the encoder wrote (prompt and committed canvases).
        attention_mask: ``(B, n)`` bool over the cached columns (False on left padding).
        length: ``n``, columns cached so far; the next canvas has position ids ``n … n + K − 1``.
        decoder_masks: the decoder's attention masks for the next canvas (built once per canvas, as generation does).
        rows: the rows of the batch given to :func:`prefill` that the state holds, in order (all of them unless
            :func:`select_rows` dropped some).
        views: row subsets of this state built by :func:`select_rows` (``copy=True``) since the last commit.
    """

    cache: Any
    attention_mask: torch.Tensor
    length: int
    decoder_masks: dict[str, Any]
    rows: list[int] = field(default_factory=list)
    views: dict[tuple[int, ...], CanvasState] = field(default_factory=dict)

    def positions(self, canvas_length: int) -> torch.Tensor:
        """``(1, K)`` int32 position ids of the next canvas."""
        device = self.attention_mask.device
        return torch.arange(self.length, self.length + canvas_length, dtype=torch.int32, device=device)[None]


def _encode(model: WrappedDiffusionGemma, ids: torch.Tensor, state: CanvasState) -> None:
    """Encoder over ``ids (B, n)`` at the columns after ``state.length - n``, appended to the cache, then the decoder
    masks of the canvas after them."""
    hf = model.base_model
    B, n = ids.shape
    positions = torch.arange(state.length - n, state.length, dtype=torch.int32, device=ids.device)[None]
    shape_only = torch.empty((B, n, 0), dtype=model.dtype, device=ids.device)
    masks = hf.model.encoder.create_masks_for_generate(
        config=hf.config, inputs_embeds=shape_only, attention_mask=state.attention_mask, cache=state.cache,
        position_ids=positions)
    hf.model.encoder(input_ids=ids.clone(memory_format=torch.contiguous_format), attention_mask=masks,
                     cache=state.cache, position_ids=positions)
    _decoder_masks(model, state)


def _decoder_masks(model: WrappedDiffusionGemma, state: CanvasState) -> None:
    """The decoder masks of the next canvas (what generation builds once per canvas)."""
    hf, K = model.base_model, model.canvas_length
    B = state.attention_mask.shape[0]
    state.decoder_masks = hf.model.decoder.create_diffusion_decoder_attention_mask(
        config=hf.config, inputs_embeds=state.attention_mask.new_empty((B, K, 1), dtype=torch.long),
        cache=state.cache, decoder_attention_mask=F.pad(state.attention_mask, (0, K), value=True))
    state.views = {}


@torch.no_grad()
def prefill(model: WrappedDiffusionGemma, prompt_ids: torch.Tensor, *,
            attention_mask: torch.Tensor | None = None) -> CanvasState:
    """Encode the prompt ``(B, P)`` (left-padded where ``attention_mask`` is 0) into a fresh ``DynamicCache``."""
    from transformers import DynamicCache

    prompt_ids = V.check_token_batch("prompt_ids", prompt_ids, ("B", "P"))
    B, P = prompt_ids.shape
    if attention_mask is None:
        mask = torch.ones((B, P), dtype=torch.bool, device=prompt_ids.device)
    elif tuple(attention_mask.shape) != (B, P):
        raise ValueError(f"attention_mask: expected shape ({B}, {P}) like prompt_ids")
    else:
        mask = attention_mask.to(prompt_ids.device, torch.bool)
    state = CanvasState(cache=DynamicCache(config=model.text_config), attention_mask=mask, length=P,
                        decoder_masks={}, rows=list(range(B)))
    _encode(model, prompt_ids, state)
    return state


def denoise(model: WrappedDiffusionGemma, state: CanvasState, canvas: torch.Tensor, *,
            self_conditioning_logits: torch.Tensor | None = None) -> torch.Tensor:
    """The decoder's soft-capped float32 logits ``(B, K, V)`` for ``canvas (B, K)`` against the cache (read only),
    with the previous step's logits ``(B, K, V)`` as the self-conditioning signal (``None`` on a canvas's first
    step)."""
    K = canvas.shape[1]
    if self_conditioning_logits is not None:
        self_conditioning_logits = self_conditioning_logits.to(model.dtype)  # as generation feeds them back
    out = model.base_model(decoder_input_ids=canvas, self_conditioning_logits=self_conditioning_logits,
                           decoder_attention_mask=state.decoder_masks, cache=state.cache,
                           decoder_position_ids=state.positions(K))
    return out.logits


@torch.no_grad()
def commit(model: WrappedDiffusionGemma, state: CanvasState, canvas: torch.Tensor) -> None:
    """Append the clean ``canvas (B, K)`` to the cache (one encoder forward at its positions)."""
    B, K = canvas.shape
    state.attention_mask = F.pad(state.attention_mask, (0, K), value=True)
    state.length += K
    _encode(model, canvas, state)


def select_rows(model: WrappedDiffusionGemma, state: CanvasState, rows: list[int], *, copy_cache: bool = True
                ) -> CanvasState:
    """The state restricted to ``rows`` (ids of the rows given to :func:`prefill`, a subset of ``state.rows`` in
    its order). ``copy_cache=True``: a new state over a copy of the cache (kept in ``state.views`` until the next
    commit, so the rows still running in a canvas share one copy); ``False``: ``state`` itself shrinks (rows that
    will never run again)."""
    if rows == state.rows:
        return state
    key = tuple(rows)
    if copy_cache and key in state.views:
        return state.views[key]
    where = {r: i for i, r in enumerate(state.rows)}
    missing = [r for r in rows if r not in where]
    if missing:
        raise ValueError(f"rows: the state holds rows {state.rows}, not {missing}")
    index = torch.tensor([where[r] for r in rows], dtype=torch.long, device=state.attention_mask.device)
    cache = copy.deepcopy(state.cache) if copy_cache else state.cache
    cache.batch_select_indices(index)
    target = CanvasState(cache=cache, attention_mask=state.attention_mask[index], length=state.length,
                         decoder_masks={}, rows=list(rows)) if copy_cache else state
    if not copy_cache:
        state.attention_mask, state.rows = state.attention_mask[index], list(rows)
    _decoder_masks(model, target)
    if copy_cache:
        state.views[key] = target
    return target

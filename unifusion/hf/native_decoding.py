"""Fast-dLLM's approximate dual cache for the released bidirectional diffusion LMs (:mod:`unifusion.hf.native`): what
``generate(..., policy=..., cache_refresh=N)`` decodes through.

A bidirectional model's block of ``K`` positions attends to every other position — the prompt, the committed blocks
and the later (masked) blocks. Their keys and values change little while one block is decoded, so the cache keeps
them: at a block's first step and every ``refresh`` steps one full forward writes the keys and values of every
column outside the block's **window** (the block, and for a shifted kind the column before it, whose hidden state
predicts the block's first token); in between, only the window runs, attending to the cached columns and to itself.
``refresh=1`` is a full forward at every step: the uncached tokens exactly. Cached keys keep the rotary positions of
their columns (RoPE is applied before caching), so the order of the keys does not matter to attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = ["CachedWindow", "NativePrefixCache", "PrefixCachedLM"]


class PrefixCachedLM(Protocol):
    """What the cache reads of :class:`~unifusion.hf.native.NativeDiffusionLM` (which imports this module)."""

    mask_token_id: int | None
    hf_model: Any

    @property
    def shifted(self) -> bool: ...
    @property
    def dtype(self) -> torch.dtype: ...
    def position_ids(self, valid: torch.Tensor | None) -> torch.Tensor | None: ...
    def x0_sources(self, valid: torch.Tensor | None, batch_size: int, length: int,
                   device: torch.device) -> torch.Tensor | None: ...
    def backbone_hidden(self, x_t: torch.Tensor, valid: torch.Tensor | None, *, use_cache: bool = False) -> Any: ...
    def logits_from_hidden(self, h: torch.Tensor) -> torch.Tensor: ...


@dataclass
class CachedWindow:
    """The decoder's state between calls.

    Attributes:
        tokens: ``(B, L)`` the sequence as it stands (prompt, committed blocks, mask tokens after).
        valid: ``(B, L)`` bool, False at left padding; ``None`` without padding.
        start: the current block's first column.
        step: the current block's steps so far.
        cache: the cached keys and values (``None`` until a block's first step), of the rows ``rows``.
        rows: ``(B_c,)`` the rows the cache holds.
        key_valid: ``(B_c, n)`` bool, which cached columns are real.
    """

    tokens: torch.Tensor
    valid: torch.Tensor | None
    start: int
    step: int = 0
    cache: Any = None
    rows: torch.Tensor | None = None
    key_valid: torch.Tensor | None = None


class NativePrefixCache:
    """The approximate dual cache (module docstring) as a :class:`~unifusion.samplers.BlockDenoiser`.

    Args:
        model: the model (a :class:`~unifusion.hf.native.NativeDiffusionLM`).
        seq_len: L, the length the sampler generates.
        refresh: a full forward every ``refresh`` steps of a block (1: every step, exact).
    """

    def __init__(self, model: PrefixCachedLM, seq_len: int, refresh: int) -> None:
        if model.mask_token_id is None:
            raise ValueError("cache_refresh: the prefix cache fills later blocks with the mask token; the model has "
                             "none")
        self.model = model
        self.seq_len = seq_len
        self.refresh = refresh

    def start_blocks(self, prefix: torch.Tensor, prefix_mask: torch.Tensor) -> CachedWindow:
        B, P = prefix.shape
        assert self.model.mask_token_id is not None  # checked in __init__
        tokens = torch.full((B, self.seq_len), self.model.mask_token_id, dtype=torch.long, device=prefix.device)
        tokens[:, :P] = prefix
        valid = torch.cat([prefix_mask.bool(), prefix_mask.new_ones((B, self.seq_len - P), dtype=torch.bool)], 1)
        return CachedWindow(tokens=tokens, valid=valid, start=P)

    def _window(self, state: CachedWindow, K: int) -> tuple[int, int]:
        """``(lo, hi)``: the columns that run at a cached step (the block, and the column before it when shifted)."""
        lo = max(state.start - 1, 0) if self.model.shifted else state.start
        return lo, state.start + K

    @torch.no_grad()
    def denoise_block(self, state: CachedWindow, block: torch.Tensor, t: torch.Tensor, rows: torch.Tensor,
                      self_condition: torch.Tensor | None, positions: torch.Tensor | None = None) -> torch.Tensor:
        model, s = self.model, state.start
        Ba, K = block.shape
        x = state.tokens[rows]
        x[:, s:s + K] = block
        valid = None if state.valid is None else state.valid[rows]
        L = x.shape[1]
        lo, hi = self._window(state, K)
        refresh = state.step % self.refresh == 0 or state.cache is None or state.rows is None \
            or state.rows.shape[0] != Ba  # rows only shrink: a row that stopped at EOS forces a refresh
        state.step += 1
        sources = model.x0_sources(valid, Ba, L, x.device)
        if refresh:
            out = model.backbone_hidden(x, valid, use_cache=True)
            keep = torch.cat([torch.arange(lo, device=x.device), torch.arange(hi, L, device=x.device)])
            state.cache = _select_columns(out.cache, keep)
            state.rows = rows
            state.key_valid = (torch.ones((Ba, L), dtype=torch.bool, device=x.device) if valid is None
                               else valid)[:, keep]
            h, offset = out.last_hidden_state, 0
        else:
            assert state.key_valid is not None
            n = state.key_valid.shape[1]
            positions_full = model.position_ids(valid)
            pos = (torch.arange(lo, hi, device=x.device).expand(Ba, hi - lo) if positions_full is None
                   else positions_full[:, lo:hi])
            allowed = torch.cat([state.key_valid[:, None, :].expand(Ba, hi - lo, n),
                                 state.key_valid.new_ones((Ba, hi - lo, hi - lo))], -1)[:, None]
            out = model.hf_model.model(input_ids=x[:, lo:hi], position_ids=pos, cache=state.cache,
                                       attention_mask=_mask_for(model, allowed), use_cache=True)
            state.cache.crop(-(hi - lo))  # the cached columns stay as the last refresh wrote them
            h, offset = out.last_hidden_state, lo
        cols = torch.arange(s, s + K, device=x.device).expand(Ba, K)
        src = cols if sources is None else sources[:, s:s + K]
        picked = h.gather(1, (src - offset).unsqueeze(-1).expand(Ba, K, h.shape[-1]))
        return model.logits_from_hidden(picked)

    def commit_block(self, state: CachedWindow, block: torch.Tensor, rows: torch.Tensor) -> CachedWindow:
        K = block.shape[1]
        state.tokens[rows, state.start:state.start + K] = block
        state.start += K
        state.step = 0
        state.cache = None  # rebuilt by the next block's first step
        return state


def _select_columns(cache: Any, keep: torch.Tensor) -> Any:
    """A ``DynamicCache`` holding the columns ``keep`` of every layer of ``cache``."""
    from transformers import DynamicCache

    out = DynamicCache()
    for i, layer in enumerate(cache.layers):
        out.update(layer.keys.index_select(2, keep), layer.values.index_select(2, keep), i)
    return out


def _mask_for(model: PrefixCachedLM, allowed: torch.Tensor) -> torch.Tensor:
    """``allowed`` ``(B, 1, q, k)`` as the backbone's attention takes it: boolean for SDPA, additive for eager."""
    if str(getattr(model.hf_model.config, "_attn_implementation", "sdpa")) == "eager":
        blocked = torch.finfo(model.dtype).min
        return torch.zeros(allowed.shape, dtype=model.dtype, device=allowed.device).masked_fill_(~allowed, blocked)
    return allowed

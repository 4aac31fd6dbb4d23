"""Block-causal attention for the released block diffusion LMs (SDAR/TraDo, Fast-dLLM v2, LLaDA 2.x): the attention
patterns of their forward and their training stream, and the exact block KV cache they decode through.

A block kind of :class:`~unifusion.hf.native.NativeDiffusionLM` declares a block size ``K``
(:attr:`~unifusion.hf.native.NativeDiffusionLM.block_size`, from its ``config.json``); a row of ``L`` columns is cut
into blocks ``blk(c) = ⌊c / K⌋`` at column multiples of K (the last block shorter when K does not divide L).

**The forward** (:class:`BlockCausalPattern`, one stream): query ``i`` attends key ``j`` iff ``blk(j) ≤ blk(i)``
and ``j`` is real — bidirectional inside a block, causal across blocks — and every query attends itself (so a padded
query has a key). This is the released models' inference attention; with the tokens decided so far it is also the
uncached block decoder (a block sees the committed blocks before it and its own tokens).

**The training stream** (:class:`DoubledStreamPattern`, BD3-LM's ``[x_t | x_0]``, what SDAR's
``prepare_for_bd_training`` builds): one forward over ``2L`` positions, the noisy tokens then the clean ones, at the
same position ids. A noisy query of block b attends the noisy keys of block b and the clean keys of blocks ``< b``; a
clean query attends the clean keys of blocks ``≤`` its own. The outputs at the noisy positions are the x0
predictions: the prediction of a token of block b sees exactly ``x_0`` of the blocks before it and ``x_t`` of its
own block, so one forward gives every block's term of the block ELBO ``Σ_b ELBO(x_0 of block b | x_0 of blocks < b)``.
With ``clean = x_t`` the noisy outputs equal the one-stream forward's.

**Exact block KV cache** (:class:`NativeBlockCache`, ``model.block_decoder()``): the prompt is prefilled once with
block-causal attention, its blocks cut backward from its end (the ``(−P) mod K`` invisible left pads of
:mod:`unifusion.block_partition`, which ``generate(..., use_cache=False)`` adds); a denoising step runs only the
current block's ``K`` positions, bidirectionally among themselves and against every cached key, and drops its
entries again; a committed block runs once more, clean, and stays (its keys are those of the one-stream forward over
the committed tokens). So cached and uncached decoding compute the same logits and give the same tokens.
``merge_commits=True`` runs a committed block within the next block's first step (one call of ``2K`` positions: the
clean ones see the cache and their own block, the noisy ones see those too), one call fewer per block. Position ids
are the model's (:meth:`~unifusion.hf.native.NativeDiffusionLM.position_ids`) over the row behind the invisible pads,
so they equal the uncached path's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .ar.attention import AttentionPattern

__all__ = ["BlockCacheState", "BlockCachedLM", "BlockCausalPattern", "DoubledStreamPattern", "NativeBlockCache",
           "block_causal_allowed", "cache_rows", "mask_for"]


def block_causal_allowed(length: int, block_size: int, key_valid: torch.Tensor | None, *, offset: int = 0,
                         device: torch.device | str = "cpu") -> torch.Tensor:
    """The one-stream block-causal pattern ``(B, 1, L, L)`` bool (``(1, 1, L, L)`` without ``key_valid``): query
    ``i`` attends key ``j`` iff ``⌊(j + offset)/K⌋ ≤ ⌊(i + offset)/K⌋`` and ``key_valid[j]``, or ``j = i``.

    Args:
        length: L, the columns.
        block_size: K.
        key_valid: ``(B, L)`` bool, False at padding, or ``None`` (all real).
        offset: invisible columns before the first (blocks cut at multiples of K counting them).
        device: where the mask is built (that of ``key_valid`` when given).
    """
    dev = key_valid.device if key_valid is not None else torch.device(device)
    blk = (torch.arange(length, device=dev) + offset) // block_size
    allowed = blk[None, :] <= blk[:, None]
    eye = torch.eye(length, dtype=torch.bool, device=dev)
    if key_valid is None:
        return allowed[None, None]
    return ((allowed[None] & key_valid[:, None, :]) | eye[None])[:, None]


class BlockCausalPattern(AttentionPattern):
    """The one-stream block-causal pattern of a block kind's forward (module docstring), for
    :func:`~unifusion.hf.ar.attention.select_strategy`."""

    def __init__(self, batch_size: int, length: int, block_size: int, key_valid: torch.Tensor | None,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(batch_size, length, device)
        self.block_size = block_size
        self.key_valid = key_valid

    @property
    def is_full(self) -> bool:
        return self.key_valid is None and self.length <= self.block_size

    def mask_reason(self) -> str | None:
        return "block-causal attention"

    def allowed(self) -> torch.Tensor:
        allowed = block_causal_allowed(self.length, self.block_size, self.key_valid, device=self.device)
        return allowed.expand(self.batch_size, 1, self.length, self.length)


class DoubledStreamPattern(AttentionPattern):
    """The ``[x_t | x_0]`` training pattern over ``2L`` positions (module docstring): padded keys blocked in both
    halves, every query attends itself."""

    def __init__(self, batch_size: int, length: int, block_size: int, key_valid: torch.Tensor | None,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(batch_size, 2 * length, device)
        self.columns = length
        self.block_size = block_size
        self.key_valid = key_valid

    def mask_reason(self) -> str | None:
        return "the [x_t | x_0] block-diffusion training stream"

    def window_band(self, window: int) -> torch.Tensor:
        col = torch.arange(self.length, device=self.device) % self.columns  # both halves at the columns' positions
        return (col[None, :] - col[:, None]).abs() < window

    def allowed(self) -> torch.Tensor:
        L, K, n = self.columns, self.block_size, self.length
        q = torch.arange(n, device=self.device)
        clean = q >= L
        blk = (q % L) // K
        same = blk[None, :] == blk[:, None]
        earlier = blk[None, :] < blk[:, None]
        noisy_q, clean_k = ~clean[:, None], clean[None, :]
        allowed = (noisy_q & ~clean_k & same) | (noisy_q & clean_k & earlier) | (clean[:, None] & clean_k
                                                                                 & (same | earlier))
        if self.key_valid is None:
            return allowed[None, None].expand(self.batch_size, 1, n, n)
        valid = self.key_valid.repeat(1, 2)
        eye = torch.eye(n, dtype=torch.bool, device=self.device)
        return ((allowed[None] & valid[:, None, :]) | eye[None])[:, None]


class BlockCachedLM(Protocol):
    """What the block cache reads of a block kind of :class:`~unifusion.hf.native.NativeDiffusionLM` (which imports
    this module)."""

    mask_token_id: int | None
    hf_model: Any

    @property
    def block_size(self) -> int | None: ...
    @property
    def dtype(self) -> torch.dtype: ...
    def position_ids(self, valid: torch.Tensor | None) -> torch.Tensor | None: ...
    def logits_from_hidden(self, h: torch.Tensor) -> torch.Tensor: ...


def mask_for(model: BlockCachedLM, allowed: torch.Tensor) -> torch.Tensor:
    """``allowed`` ``(B, 1, q, k)`` bool as the backbone's attention takes a 4D mask: boolean for SDPA, additive (0 or
    the dtype's minimum) for eager attention."""
    if str(getattr(model.hf_model.config, "_attn_implementation", "sdpa")) == "eager":
        blocked = torch.finfo(model.dtype).min
        return torch.zeros(allowed.shape, dtype=model.dtype, device=allowed.device).masked_fill_(~allowed, blocked)
    return allowed


def cache_rows(cache: Any, rows: torch.Tensor) -> Any:
    """A new transformers ``DynamicCache`` holding batch rows ``rows`` of every layer of ``cache``."""
    from transformers import DynamicCache

    out = DynamicCache()
    for i, layer in enumerate(cache.layers):
        out.update(layer.keys.index_select(0, rows), layer.values.index_select(0, rows), i)
    return out


@dataclass
class BlockCacheState:
    """The block cache's state between calls.

    Attributes:
        cache: a transformers ``DynamicCache``: the prompt and the committed blocks of rows ``rows``.
        rows: ``(R,)`` int64, the batch rows the cache holds (ascending; finished rows are dropped).
        key_valid: ``(R, n)`` bool, which cached columns are real (False at left padding).
        next_pos: ``(B,)`` int64, the position id of the current block's first column.
        length: the columns committed so far (the current block starts there).
        pending: a committed block not in the cache yet ``(ids (R, K), position ids (R, K))`` (``merge_commits``).
        extra_forwards: ``(B,)`` int64, the prefill and commit calls each row took part in.
    """

    cache: Any
    rows: torch.Tensor
    key_valid: torch.Tensor
    next_pos: torch.Tensor
    length: int
    pending: tuple[torch.Tensor, torch.Tensor] | None = None
    extra_forwards: torch.Tensor | None = None

    def narrow(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (a subset of :attr:`rows`)."""
        if rows.shape[0] == self.rows.shape[0]:
            return
        idx = torch.searchsorted(self.rows, rows)
        self.cache = cache_rows(self.cache, idx)
        self.key_valid = self.key_valid[idx]
        if self.pending is not None:
            self.pending = (self.pending[0][idx], self.pending[1][idx])
        self.rows = rows


class NativeBlockCache:
    """The exact block KV cache of a block kind (module docstring), as a :class:`~unifusion.samplers.BlockDenoiser`
    (and ``HiddenStateBlockDenoiser``): ``generate(..., use_cache=True)`` on a block kind decodes through it.

    Args:
        model: a block kind of :class:`~unifusion.hf.native.NativeDiffusionLM` (``block_size`` set).
        merge_commits: run each committed block within the next block's first step (one call fewer per block, the
            same tokens).
    """

    def __init__(self, model: BlockCachedLM, *, merge_commits: bool = False) -> None:
        if model.block_size is None:
            raise ValueError(f"model: the block cache needs a block kind (block_size set), got "
                             f"{type(model).__name__} without blocks")
        if not isinstance(merge_commits, bool):
            raise TypeError(f"merge_commits: expected a bool, got {type(merge_commits).__name__}")
        self.model = model
        self.block_size = int(model.block_size)
        self.merge_commits = merge_commits

    @property
    def mask_token_id(self) -> int | None:
        return self.model.mask_token_id

    def logits_from_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """The model's output head ``(..., d)`` → ``(..., V)``."""
        return self.model.logits_from_hidden(h)

    def _call(self, ids: torch.Tensor, pos: torch.Tensor, allowed: torch.Tensor, cache: Any) -> torch.Tensor:
        """The backbone on ``ids`` ``(R, q)`` at position ids ``pos`` against ``cache`` (which it extends by ``q``),
        attention ``allowed`` ``(R, q, n + q)``: the final hidden states ``(R, q, d)``."""
        out = self.model.hf_model.model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True,
                                        attention_mask=mask_for(self.model, allowed[:, None]))
        return out.last_hidden_state

    @torch.no_grad()
    def start_blocks(self, prefix: torch.Tensor, prefix_mask: torch.Tensor) -> BlockCacheState:
        from transformers import DynamicCache

        B, P = prefix.shape
        dev = prefix.device
        K = self.block_size
        shift = -P % K
        valid = prefix_mask.to(torch.bool)
        row = torch.cat([valid.new_zeros((B, shift)), valid, valid.new_ones((B, 1))], 1)  # the row behind the pads
        pos = self.model.position_ids(row)
        pos = (torch.arange(shift + P + 1, device=dev).expand(B, -1) if pos is None else pos)[:, shift:]
        state = BlockCacheState(cache=DynamicCache(), rows=torch.arange(B, device=dev), key_valid=valid,
                                next_pos=pos[:, P].clone(), length=P,
                                extra_forwards=torch.full((B,), int(P > 0), dtype=torch.long, device=dev))
        if P:
            allowed = block_causal_allowed(P, K, valid, offset=shift)[:, 0]
            self._call(prefix, pos[:, :P], allowed, state.cache)
        return state

    @torch.no_grad()
    def denoise_block_hidden(self, state: BlockCacheState, block: torch.Tensor, t: torch.Tensor, rows: torch.Tensor,
                             self_condition: torch.Tensor | None) -> torch.Tensor:
        """The final hidden states ``(B_a, K, d)`` of the block's positions at this step."""
        if state.pending is not None and rows.shape[0] != state.rows.shape[0]:
            self._append(state)  # rows stopped since the commit: the block goes in by itself
        Ba, Kb = block.shape
        dev = block.device
        pos = state.next_pos[rows, None] + torch.arange(Kb, device=dev)
        if state.pending is not None:
            c_ids, c_pos = state.pending
            c = c_ids.shape[1]
            old = state.key_valid[:, :state.key_valid.shape[1] - c]
            clean_rows = torch.cat([old[:, None, :].expand(Ba, c, -1), old.new_ones((Ba, c, c)),
                                    old.new_zeros((Ba, c, Kb))], -1)
            noisy_rows = torch.cat([state.key_valid[:, None, :].expand(Ba, Kb, -1), old.new_ones((Ba, Kb, Kb))], -1)
            h = self._call(torch.cat([c_ids, block], 1), torch.cat([c_pos, pos], 1),
                           torch.cat([clean_rows, noisy_rows], 1), state.cache)[:, c:]
            state.pending = None
            state.cache.crop(-Kb)  # the committed block stays, the step's entries go
            return h
        if rows.shape[0] == state.rows.shape[0]:
            cache, valid = state.cache, state.key_valid
        else:
            idx = torch.searchsorted(state.rows, rows)
            cache, valid = cache_rows(state.cache, idx), state.key_valid[idx]
        allowed = torch.cat([valid[:, None, :].expand(Ba, Kb, -1), valid.new_ones((Ba, Kb, Kb))], -1)
        h = self._call(block, pos, allowed, cache)
        if cache is state.cache:
            cache.crop(-Kb)
        return h

    @torch.no_grad()
    def denoise_block(self, state: BlockCacheState, block: torch.Tensor, t: torch.Tensor, rows: torch.Tensor,
                      self_condition: torch.Tensor | None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """x0 logits ``(B_a, K, V)`` of the block (:class:`~unifusion.samplers.BlockDenoiser`)."""
        return self.model.logits_from_hidden(self.denoise_block_hidden(state, block, t, rows, self_condition))

    def commit_block(self, state: BlockCacheState, block: torch.Tensor, rows: torch.Tensor) -> BlockCacheState:
        """Record the finished block of ``rows``; its clean tokens enter the cache now, or with the next step
        (``merge_commits``)."""
        if state.pending is not None:
            self._append(state)
        state.narrow(rows)
        Ba, Kb = block.shape
        pos = state.next_pos[rows, None] + torch.arange(Kb, device=block.device)
        state.pending = (block, pos)
        state.key_valid = torch.cat([state.key_valid, state.key_valid.new_ones((Ba, Kb))], 1)
        if not self.merge_commits:
            self._append(state)
        state.next_pos = state.next_pos.index_add(0, rows, torch.full_like(rows, Kb))
        state.length += Kb
        return state

    @torch.no_grad()
    def _append(self, state: BlockCacheState) -> None:
        """Run the pending block's clean tokens into the cache (bidirectional within the block, against the cache)."""
        assert state.pending is not None
        ids, pos = state.pending
        R, c = ids.shape
        n = state.key_valid.shape[1]
        allowed = torch.cat([state.key_valid[:, None, :n - c].expand(R, c, -1), state.key_valid.new_ones((R, c, c))],
                            -1)
        self._call(ids, pos, allowed, state.cache)
        state.pending = None
        if state.extra_forwards is not None:
            state.extra_forwards.index_add_(0, state.rows, torch.ones_like(state.rows))

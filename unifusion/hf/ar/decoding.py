"""Block decoding of a :class:`~unifusion.hf.DiffusionLM`: the two cached :class:`~unifusion.samplers.BlockDenoiser`
adapters the model offers :func:`unifusion.samplers.generate` (:meth:`DiffusionLM.block_decoder
<unifusion.hf.DiffusionLM.block_decoder>`, :meth:`DiffusionLM.prefix_decoder
<unifusion.hf.DiffusionLM.prefix_decoder>`), which hands them to :class:`~unifusion.samplers.PolicySampler`, and the
uncached block forward (:class:`BlockForward`, :meth:`DiffusionLM.block_forward
<unifusion.hf.DiffusionLM.block_forward>`); and :class:`DecodingMethods`, the model's ``generate`` and those three
methods, which :class:`~unifusion.hf.DiffusionLM` mixes in.

**Exact: a block model** (``adapt_ar_model(..., block_size=K)``, :mod:`unifusion.hf.ar.blocks`) —
:class:`BlockCacheDecoder`. The KV cache holds the *clean stream* of the block layout: the prompt is prefilled once
(inputs ``[bos, prompt[:-1]]``, causal, position ids ``0 … P − 1``), each committed block is appended causally
(inputs ``[anchor, block[:-1]]``). A denoising step runs only the current block's ``K + 1`` noisy positions (the
anchor — the last committed token, bos before anything — and the block's ``x_t``) at position ids ``n … n + K``,
bidirectionally within the block and against every cached position, then drops its entries from the cache again. That
is the computation of the block-causal training forward for the block (``model(x_t, t, clean=x_0)``), so cached and
uncached decoding give the same tokens in float32 (logits within ~5e-5 on SmolLM2-135M). In bf16 the two round
differently (there: logits within 0.5, probabilities within 0.007), so a sampled token can differ at a near-tie and
the rows part from there.

Blocks start where the prompt ends: a prompt whose length is not a multiple of K is the clean prefix all the same.
The training forward cuts blocks at column multiples of K, so ``generate(..., use_cache=False)`` runs it behind
``−P mod K`` invisible left pads (position ids count real tokens): cached and uncached agree token for token for
every P. With ``positions`` (a mask policy's still-masked positions) the output head runs only there.

``merge_commits=True`` appends a committed block within the next block's first step instead (one call of ``2K + 1``
positions: the clean ones see the cache and each other causally and stay in it, the noisy ones see everything and
leave again), as Fast-dLLM v2 does, and prefills the prompt within the first block's first step the same way (one
call of ``P + K + 1`` positions): ``n_b`` fewer calls for ``n_b`` blocks, the same tokens. Should the running
rows change between a commit and the next step, the block goes in by itself first.

**Approximate: a fully bidirectional model** (no ``block_size``) — :class:`PrefixCacheDecoder`, Fast-dLLM's dual
cache. At a block's first step (and every ``refresh`` steps after it) the whole sequence runs once (the committed
prefix, the block, mask tokens after it); that step's logits are exact and the keys/values of every position outside
the block's ``K + 1`` are kept. The other steps run the ``K + 1`` positions against those kept entries, which were
computed from an older state of the block: **approximate** (the prefix and suffix do not see the block's newest
tokens). ``refresh=1`` recomputes at every step (the uncached computation). Mask kernels only.

Both handle left padding (a prefix mask: padded keys blocked, position ids counting real tokens, as
:func:`~unifusion.hf.shifted_layout` places them) and batches whose rows finish early (the cache is narrowed to the
running rows). Every cached call goes through :func:`unifusion.hf.ar.blocks.cached_forward`, which hands the mask over
as the model's attention takes it (SDPA's boolean, eager's additive or flex attention's ``BlockMask``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from einops import rearrange
from torch import nn

from ... import cpu_linears
from ...denoiser import DecodableModel
from ...samplers import generation
from .adapted import AdaptedLM
from .blocks import cached_forward
from .layout import shifted_layout

__all__ = ["BlockCacheDecoder", "BlockForward", "CacheState", "PrefixCacheDecoder"]


@dataclass
class CacheState:
    """What a cached decoder carries between calls (rows: the batch rows the cache holds, ascending).

    Attributes:
        cache: a transformers ``DynamicCache`` (or ``None`` before an approximate decoder's first refresh).
        rows: ``(R,)`` int64 batch rows the cache holds.
        key_valid: ``(R, n)`` bool, False at cached padding.
        key_pos: ``(R, n)`` position ids of the cached keys (for sliding windows).
        anchor: ``(B,)`` the input of the next block's anchor position (block caches).
        next_pos: ``(B,)`` the anchor's position id (block caches).
        tokens: ``(B, L)`` the committed tokens, mask ids after them (approximate caches).
        attention_mask: ``(B, L)`` bool, False at left padding, or ``None`` (approximate caches).
        length: columns committed so far (the current block starts there).
        step: denoising steps run in the current block.
        pending: a committed block not in the cache yet, ``(ids (R, K), position ids (R, K))`` of its clean inputs
            (block caches: it runs with the next denoising step).
        extra_forwards: ``(B,)`` int64, the backbone calls each row took part in outside the denoising steps (the
            prompt's prefill, a committed block appended by itself), which
            :class:`~unifusion.samplers.PolicySampler` adds to ``num_forwards``.
    """

    cache: Any
    rows: torch.Tensor
    key_valid: torch.Tensor
    key_pos: torch.Tensor
    anchor: torch.Tensor | None = None
    next_pos: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    length: int = 0
    step: int = 0
    pending: tuple[torch.Tensor, torch.Tensor] | None = None
    extra_forwards: torch.Tensor | None = None

    def select(self, rows: torch.Tensor) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """``(cache, key_valid, key_pos)`` of ``rows`` (a subset of :attr:`rows`, ascending); the cache itself when
        they are all of them, else a copy (the step's own entries then need no crop)."""
        if rows.shape[0] == self.rows.shape[0]:
            return self.cache, self.key_valid, self.key_pos
        idx = torch.searchsorted(self.rows, rows)
        return _cache_rows(self.cache, idx), self.key_valid[idx], self.key_pos[idx]

    def narrow(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (finished rows never come back)."""
        if rows.shape[0] == self.rows.shape[0]:
            return
        idx = torch.searchsorted(self.rows, rows)
        if self.cache is not None:
            self.cache = _cache_rows(self.cache, idx)
        self.rows, self.key_valid, self.key_pos = rows, self.key_valid[idx], self.key_pos[idx]


def _cache_rows(cache: Any, idx: torch.Tensor, columns: torch.Tensor | None = None) -> Any:
    """A new ``DynamicCache`` with batch rows ``idx`` (and key columns ``columns``) of ``cache``."""
    from transformers import DynamicCache

    data = []
    for layer in cache.layers:
        k, v = layer.keys[idx], layer.values[idx]  # (R, H, n, d)
        if columns is not None:
            k, v = k[:, :, columns], v[:, :, columns]
        data.append((k, v))
    return DynamicCache(ddp_cache_data=data)


def _forward(model: AdaptedLM, ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor,
             key_pos: torch.Tensor, cache: Any, t: torch.Tensor | None, clean: int = 0) -> torch.Tensor:
    """:func:`~unifusion.hf.ar.blocks.cached_forward` with the time ``t`` ``(B,)`` of the block at the positions after
    the first ``clean`` (which, like ``t=None``, are at time 0)."""
    t_pos = None
    if model.time_embedding is not None and t is not None:
        q = ids.shape[1]
        t_pos = t.float()[:, None].expand(-1, q)
        if clean:
            t_pos = torch.where(torch.arange(q, device=ids.device) < clean, 0.0, t_pos)
    return cached_forward(model, ids, positions, allowed, key_pos, cache, t_pos)


class _Decoder:
    """What both adapters share: the wrapped model's states (for the sampler's kernel check)."""

    def __init__(self, model: AdaptedLM) -> None:
        self.model = model

    @property
    def num_states(self) -> int:
        return int(self.model.num_states)

    @property
    def mask_token_id(self) -> int | None:
        return self.model.mask_token_id

    def logits_from_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """The model's output head on :meth:`denoise_block_hidden`'s hidden states ``(..., d)`` → ``(..., V)``."""
        return self.model.logits_from_hidden(h)

    @torch.no_grad()
    def denoise_block(self, state: CacheState, block: torch.Tensor, t: torch.Tensor, rows: torch.Tensor,
                      self_condition: torch.Tensor | None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """x0 logits ``(B_a, K, V)`` of the block (:class:`~unifusion.samplers.BlockDenoiser`): the output head on
        :meth:`denoise_block_hidden`, only at ``positions`` when given (0 elsewhere)."""
        return head_at(self.model, self.denoise_block_hidden(state, block, t, rows, self_condition), positions)

    def denoise_block_hidden(self, state: CacheState, block: torch.Tensor, t: torch.Tensor, rows: torch.Tensor,
                             self_condition: torch.Tensor | None) -> torch.Tensor:
        """The final hidden states ``(B_a, K, d)`` at the block's positions — the output head's input — of the step
        :meth:`denoise_block` runs (the same call, the same cache update): what a policy that reads hidden states
        (``MaskPolicy.reads_hidden``) gets."""
        raise NotImplementedError  # abstractmethod


class BlockCacheDecoder(_Decoder):
    """The exact KV-cache path of a block :class:`~unifusion.hf.DiffusionLM` (module docstring), as a
    :class:`~unifusion.samplers.BlockDenoiser`: prefill once, ``K + 1`` positions per denoising step, one forward per
    committed block.

    Args:
        model: the block model.
        merge_commits: append each committed block within the next block's first step (one call of ``2K + 1``
            positions instead of two calls of ``K`` and ``K + 1``) and prefill the prompt within the first step (one
            call of ``P + K + 1`` positions instead of ``P`` and ``K + 1``); the same tokens either way.
    """

    def __init__(self, model: AdaptedLM, *, merge_commits: bool = False) -> None:
        super().__init__(model)
        if not isinstance(merge_commits, bool):
            raise TypeError(f"merge_commits: expected a bool, got {type(merge_commits).__name__}")
        self.merge_commits = merge_commits

    @torch.no_grad()
    def start_blocks(self, prefix: torch.Tensor, prefix_mask: torch.Tensor) -> CacheState:
        from transformers import DynamicCache

        model = self.model
        B, P = prefix.shape
        dev = prefix.device
        bos = torch.full((B, 1), model.bos_token_id, dtype=torch.long, device=dev)
        pads = (~prefix_mask).sum(-1, keepdim=True)  # (B, 1) left pads
        col = torch.arange(P, device=dev)[None]
        # the clean stream over the prefix columns: bos just before the first real token, then prefix[:-1]
        ids = torch.where(col == pads, bos, torch.cat([bos, prefix[:, :-1]], 1)[:, :P])
        valid = col >= pads
        pos = (col - pads).clamp_min(0)
        state = CacheState(cache=DynamicCache(), rows=torch.arange(B, device=dev), key_valid=valid, key_pos=pos,
                           anchor=torch.where(pads[:, 0] < P, prefix[:, -1], bos[:, 0]) if P else bos[:, 0],
                           next_pos=(P - pads[:, 0]), length=P,
                           extra_forwards=torch.full((B,), int(P > 0 and not self.merge_commits),
                                                     dtype=torch.long, device=dev))
        if P and self.merge_commits:  # the prefill runs within the first denoising step
            state.pending = (ids, pos)
        elif P:
            causal = torch.ones(P, P, dtype=torch.bool, device=dev).tril()
            allowed = (causal[None] & valid[:, None, :]) | torch.eye(P, dtype=torch.bool, device=dev)[None]
            _forward(model, ids, pos, allowed, pos, state.cache, None)
        return state

    @torch.no_grad()
    def denoise_block_hidden(self, state: CacheState, block: torch.Tensor, t: torch.Tensor, rows: torch.Tensor,
                             self_condition: torch.Tensor | None) -> torch.Tensor:
        assert state.anchor is not None and state.next_pos is not None
        if state.pending is not None and rows.shape[0] != state.rows.shape[0]:
            self._append(state)  # rows stopped since the commit: the block goes in by itself
        Ba, K = block.shape
        dev = block.device
        ids = torch.cat([state.anchor[rows, None], block], 1)  # (Ba, K + 1): anchor, x_t of the block
        pos = state.next_pos[rows, None] + torch.arange(K + 1, device=dev)
        if state.pending is not None:  # the committed block's clean positions first, in the same call
            c_ids, c_pos = state.pending
            n, c = state.key_valid.shape[1], c_ids.shape[1]
            old = state.key_valid[:, :n - c]
            clean_rows = torch.cat([old[:, None, :].expand(Ba, c, -1), _causal_among(state.key_valid[:, n - c:]),
                                    old.new_zeros((Ba, c, K + 1))], -1)
            noisy_rows = torch.cat([state.key_valid[:, None, :].expand(Ba, K + 1, -1),
                                    old.new_ones((Ba, K + 1, K + 1))], -1)
            h = _forward(self.model, torch.cat([c_ids, ids], 1), torch.cat([c_pos, pos], 1),
                         torch.cat([clean_rows, noisy_rows], 1), torch.cat([state.key_pos, pos], 1), state.cache, t,
                         clean=c)[:, c:]
            state.pending = None
            state.cache.crop(-(K + 1))  # keep the clean positions, drop the step's
        else:
            cache, valid, kpos = state.select(rows)
            allowed = torch.cat([valid[:, None, :].expand(Ba, K + 1, -1), valid.new_ones((Ba, K + 1, K + 1))], -1)
            h = _forward(self.model, ids, pos, allowed, torch.cat([kpos, pos], 1), cache, t)
            if cache is state.cache:
                cache.crop(-(K + 1))  # the step's entries: the cache holds the clean stream only
        return h[:, :K]

    def commit_block(self, state: CacheState, block: torch.Tensor, rows: torch.Tensor) -> CacheState:
        """Record the finished block of ``rows``; its clean positions enter the cache with the next step."""
        assert state.anchor is not None and state.next_pos is not None
        if state.pending is not None:
            self._append(state)
        state.narrow(rows)
        Ba, K = block.shape
        ids = torch.cat([state.anchor[rows, None], block[:, :-1]], 1)  # (Ba, K): clean inputs of the block
        pos = state.next_pos[rows, None] + torch.arange(K, device=block.device)
        state.pending = (ids, pos)
        state.key_valid = torch.cat([state.key_valid, state.key_valid.new_ones((Ba, K))], 1)
        state.key_pos = torch.cat([state.key_pos, pos], 1)
        if not self.merge_commits:
            self._append(state)
        state.anchor = state.anchor.index_copy(0, rows, block[:, -1])
        state.next_pos = state.next_pos.index_add(0, rows, torch.full_like(rows, K))
        state.length += K
        return state

    @torch.no_grad()
    def _append(self, state: CacheState) -> None:
        """Run the pending block's clean positions into the cache by themselves (causal)."""
        assert state.pending is not None
        ids, pos = state.pending
        Ba, c = ids.shape
        n = state.key_valid.shape[1]
        allowed = torch.cat([state.key_valid[:, None, :n - c].expand(Ba, c, -1),
                             _causal_among(state.key_valid[:, n - c:])], -1)
        _forward(self.model, ids, pos, allowed, state.key_pos, state.cache, None)
        state.pending = None
        if state.extra_forwards is not None:
            state.extra_forwards.index_add_(0, state.rows, torch.ones_like(state.rows))


def _causal_among(valid: torch.Tensor) -> torch.Tensor:
    """``(B, c, c)`` bool: clean position i of a pending run sees the valid ones among ``0 … i`` (``valid`` ``(B, c)``,
    False at left padding) and always itself (a padded query attends somewhere; its output is never read)."""
    c = valid.shape[1]
    causal = torch.ones(c, c, dtype=torch.bool, device=valid.device).tril()
    return (causal[None] & valid[:, None, :]) | torch.eye(c, dtype=torch.bool, device=valid.device)[None]


def head_at(model: AdaptedLM, h: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """The output head on hidden states ``h`` ``(B, K, d)``; with ``positions`` ``(B, m)`` only there: logits
    ``(B, K, V)`` that are 0 at the other positions (the sampler reads none of them)."""
    if positions is None or positions.shape[1] == h.shape[1]:
        return model.logits_from_hidden(h)
    B, K = h.shape[:2]
    rows = (positions + K * torch.arange(B, device=h.device)[:, None]).flatten()  # (B·m,) rows of the (B·K, ·) views
    picked = model.logits_from_hidden(rearrange(h, "b k d -> (b k) d").index_select(0, rows))  # (B·m, V)
    logits = picked.new_zeros((B * K, picked.shape[-1])).index_copy_(0, rows, picked)
    return rearrange(logits, "(b k) v -> b k v", b=B)


class PrefixCacheDecoder(_Decoder):
    """Fast-dLLM's approximate dual cache for a fully bidirectional :class:`~unifusion.hf.DiffusionLM` (module
    docstring): a full forward at a block's first step and every ``refresh`` steps, ``K + 1`` positions in between.

    Args:
        model: the model (a mask kernel's: later blocks are mask tokens).
        seq_len: L, the length :meth:`~unifusion.samplers.PolicySampler.sample` generates.
        refresh: a full forward every ``refresh`` steps of a block (1: every step, exact).
    """

    def __init__(self, model: AdaptedLM, seq_len: int, refresh: int) -> None:
        super().__init__(model)
        if model.mask_token_id is None:
            raise ValueError("cache_refresh: the approximate prefix cache fills later blocks with the mask token; "
                             "this model has none (adapted with add_mask_token=False)")
        self.seq_len = seq_len
        self.refresh = refresh

    def start_blocks(self, prefix: torch.Tensor, prefix_mask: torch.Tensor) -> CacheState:
        B, P = prefix.shape
        dev = prefix.device
        mask_id = self.model.mask_token_id
        assert mask_id is not None  # checked in __init__
        tokens = torch.full((B, self.seq_len), mask_id, dtype=torch.long, device=dev)
        tokens[:, :P] = prefix
        mask = None
        if not bool(prefix_mask.all()):  # once per run
            mask = torch.cat([prefix_mask, prefix_mask.new_ones((B, self.seq_len - P))], 1)
        empty = torch.zeros((B, 0), dtype=torch.long, device=dev)
        return CacheState(cache=None, rows=torch.arange(B, device=dev), key_valid=empty.bool(), key_pos=empty,
                          tokens=tokens, attention_mask=mask, length=P)

    @torch.no_grad()
    def denoise_block_hidden(self, state: CacheState, block: torch.Tensor, t: torch.Tensor, rows: torch.Tensor,
                             self_condition: torch.Tensor | None) -> torch.Tensor:
        assert state.tokens is not None
        model, s = self.model, state.length
        Ba, K = block.shape
        x = state.tokens[rows]
        x[:, s:s + K] = block
        mask = None if state.attention_mask is None else state.attention_mask[rows]
        refresh = state.step % self.refresh == 0
        state.step += 1
        if refresh:
            kwargs = model.network_inputs(x, t, attention_mask=mask)
            kwargs["use_cache"] = True
            out = model.hf_model.base_model(**kwargs)
            h = out.last_hidden_state  # (Ba, L + 1, d)
            n = x.shape[1] + 1
            keep = torch.cat([torch.arange(s, device=x.device), torch.arange(s + K + 1, n, device=x.device)])
            pos = kwargs.get("position_ids")
            pos = torch.arange(n, device=x.device).expand(Ba, n) if pos is None else pos
            valid = _key_valid(mask, n)
            state.cache = _cache_rows(out.cache, torch.arange(Ba, device=x.device), keep)
            state.rows, state.key_pos = rows, pos[:, keep]
            state.key_valid = valid[:, keep] if valid is not None else torch.ones_like(state.key_pos, dtype=torch.bool)
            return h[:, s:s + K]
        layout = shifted_layout(x, model.bos_token_id, 1.0, attention_mask=mask)
        ids = layout.input_ids[:, s:s + K + 1]
        n = x.shape[1] + 1
        pos = (layout.position_ids if layout.position_ids is not None
               else torch.arange(n, device=x.device).expand(Ba, n))[:, s:s + K + 1]
        cache, valid, kpos = state.select(rows)
        allowed = torch.cat([valid[:, None, :].expand(Ba, K + 1, -1), valid.new_ones((Ba, K + 1, K + 1))], -1)
        h = _forward(model, ids, pos, allowed, torch.cat([kpos, pos], 1), cache, t)
        if cache is state.cache:
            cache.crop(-(K + 1))  # the kept entries stay as the last refresh wrote them
        return h[:, :K]

    def commit_block(self, state: CacheState, block: torch.Tensor, rows: torch.Tensor) -> CacheState:
        assert state.tokens is not None
        K = block.shape[1]
        state.tokens[rows, state.length:state.length + K] = block
        state.length += K
        state.step = 0
        state.cache = None  # rebuilt by the next block's first step
        return state


def _key_valid(mask: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """Which of the ``n = L + 1`` network positions of :func:`~unifusion.hf.shifted_layout` are real (left padding:
    the pads; bos sits just before the first real token)."""
    if mask is None:
        return None
    pads = (~mask).sum(-1, keepdim=True)
    return torch.arange(n, device=mask.device)[None] >= pads


class BlockForward:
    """A block model as an x0 callable: ``model(x_t, t, clean=x_t)`` — the training forward with the current tokens as
    the clean stream (each block sees only the clean tokens of earlier blocks, which are committed when it runs)."""

    def __init__(self, model: AdaptedLM) -> None:
        self.model = model
        self.num_states = model.num_states

    def __call__(self, x_t: torch.Tensor, t: torch.Tensor, attention_mask: torch.Tensor | None = None
                 ) -> torch.Tensor:
        return self.model(x_t, t, clean=x_t, attention_mask=attention_mask)

    def hidden_states(self, x_t: torch.Tensor, t: torch.Tensor, attention_mask: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """The final hidden states ``(B, L, d)`` of the same forward; ``logits_from_hidden`` of them is the call's
        logits (what a policy that reads hidden states gets on the uncached path)."""
        return self.model.hidden_states(x_t, t, clean=x_t, attention_mask=attention_mask)

    def logits_from_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """The model's output head ``(..., d)`` → ``(..., V)``."""
        return self.model.logits_from_hidden(h)


class _DecodingHost(AdaptedLM, DecodableModel, Protocol):
    """What :class:`DecodingMethods` reads of the model it is mixed into: an :class:`AdaptedLM` that
    :func:`unifusion.samplers.generate` decodes, in train or eval mode."""

    training: bool


class DecodingMethods:
    """How a :class:`~unifusion.hf.DiffusionLM` decodes: :meth:`generate` (transformers' call, through
    :func:`unifusion.samplers.generate`) and the decoders it offers there — :meth:`block_decoder` (exact, a block
    model), :meth:`prefix_decoder` (approximate, a fully bidirectional one), :meth:`block_forward` (uncached). A mixin
    of the model class, listed before the module base (module docstring)."""

    def generate(self: _DecodingHost, prompt_ids: torch.Tensor | None = None, *, max_new_tokens: int | None = None,
                 seq_len: int | None = None, policy: Any = None, num_steps: int | None = None,
                 block_size: int | None = None,
                 use_cache: bool = True, cache_refresh: int | None = None, merge_commits: bool = False,
                 attention_mask: torch.Tensor | None = None, eos_token_id: int | str | None = "auto",
                 pad_token_id: int | None = None, return_dict: bool = False, return_trace: bool = False,
                 num_return_sequences: int | None = None, kernel: Any = None, temperature: float | None = None,
                 top_p: float | None = None, top_k: int | None = None, eps: float = 1e-3,
                 generator: torch.Generator | Sequence[torch.Generator] | None = None,
                 progress: bool = False, generation_config: Any = None, max_length: int | None = None,
                 do_sample: bool | None = None, stop_strings: str | Sequence[str] | None = None,
                 tokenizer: Any = None, streamer: Any = None, packed_linears: bool | None = None,
                 **kwargs: Any) -> Any:
        """Continue ``prompt_ids``: ancestral sampling (:class:`~unifusion.BayesianSampler`, Algorithm 2) by default,
        block decoding with a decoding policy (:class:`~unifusion.samplers.PolicySampler`) when ``policy`` is given
        or the model is a block model (default :func:`~unifusion.samplers.policies.default_policy`).

        The prompt is a fixed prefix that never changes. With ``policy=None`` the ``N = num_steps`` posterior steps
        generate the positions after it, each a full-sequence call; with a policy it is decoded block by block
        through the decoders this model offers (:meth:`block_decoder`, :meth:`prefix_decoder`,
        :meth:`block_forward`).

        The arguments, the result and the rules for padding, EOS and the caches are those of
        :func:`unifusion.samplers.generate`, the one generate path, which this method calls with the model (and which
        lists them): ``(B, P)`` prompt ids in — also as transformers passes them, ``model.generate(**tokenizer(texts,
        return_tensors="pt", padding=True), max_new_tokens=...)`` (``input_ids``, ``attention_mask``; left or right
        padding) —, ``(B, P + max_new_tokens)`` ids out, or a :class:`~unifusion.samplers.PolicyOutput`
        (``return_dict_in_generate=True``, with ``scores`` / ``logits`` when ``output_scores`` / ``output_logits``
        ask). Defaults come from the model: :attr:`kernel` (else
        :func:`unifusion.hf.default_kernel`), :attr:`tokenizer` (EOS and pad ids, stop strings), :attr:`block_size`.

        **On the CPU** a block model decodes with its linear layers through oneDNN with prepacked weights
        (:func:`unifusion.cpu_linears.packed_linears` around the call): a cached block step multiplies ``K + 1`` to
        ``2K + 1`` rows by each weight, and on the project's 2-core AVX2 CPU the packed layout is 1.2–1.5× faster than
        torch's default matmul at 9–17 rows; at blocks of 32 the whole decode took 4.57 s against 5.13 s with two
        threads, the packing counted (with one thread the two are even). The tokens are the same (the sums differ at
        float32 rounding). A layer packs only once it has multiplied
        :data:`~unifusion.cpu_linears.GENERATE_PACK_AFTER_ROWS` rows in the call, so a short call (batch 1, a
        10-token answer in a few forwards) pays no reorder (about 0.3 s for SmolLM2-135M, more than such a call's
        whole decode can save), and a long or wide one packs after its first forwards; nothing stays on the model
        after the call, so training after it, or weights changed in any way between calls, need no care. For many
        calls, pack once around them: ``with uf.cpu_linears.packed_linears(model): ...`` (inside it this method
        packs nothing of its own; a weight changed through ``.data`` in the block needs
        :func:`~unifusion.cpu_linears.repack_linears`). ``packed_linears``: ``None`` (default) — so for a block
        model on the CPU in eval mode (``not model.training``) where this torch build has the operators; ``False``
        — never; ``True`` — also in training mode (a ``RuntimeError`` where the operators are missing).
        """
        if packed_linears is not None and not isinstance(packed_linears, bool):
            raise TypeError(f"packed_linears: expected None or a bool, got {type(packed_linears).__name__}")
        if packed_linears is None:
            packed_linears = (self.block_size is not None and self.device.type == "cpu" and not self.training
                              and cpu_linears.packing_available())
        assert isinstance(self, nn.Module)  # the host: the model module
        with cpu_linears.packed_linears(self, enabled=packed_linears, batch_hint=self.block_size or 16,
                                        pack_after_rows=cpu_linears.GENERATE_PACK_AFTER_ROWS):
            return generation.generate(
                self, prompt_ids, max_new_tokens=max_new_tokens, seq_len=seq_len, policy=policy, num_steps=num_steps,
                block_size=block_size, use_cache=use_cache, cache_refresh=cache_refresh, merge_commits=merge_commits,
                attention_mask=attention_mask, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                return_dict=return_dict, return_trace=return_trace, num_return_sequences=num_return_sequences,
                kernel=kernel, temperature=temperature, top_p=top_p, top_k=top_k, eps=eps,
                generator=generator, progress=progress, generation_config=generation_config, max_length=max_length,
                do_sample=do_sample, stop_strings=stop_strings, tokenizer=tokenizer, streamer=streamer, **kwargs)

    input_modalities = ("text",)
    output_modalities = ("text",)
    """What transformers' pipelines read of a generating model (text in, text out)."""

    @classmethod
    def can_generate(cls) -> bool:
        """``True``: :meth:`generate` takes transformers' call, so ``transformers.pipeline("text-generation",
        model=model, tokenizer=tok)`` runs it (transformers logs that the class is not in its list of causal LMs;
        the pipeline works all the same)."""
        return True

    def block_decoder(self: _DecodingHost, *, merge_commits: bool = False) -> BlockCacheDecoder:
        """The exact cached decoder of a block model (:class:`~unifusion.hf.ar.decoding.BlockCacheDecoder`, a
        :class:`~unifusion.samplers.BlockDenoiser`): what :meth:`generate` decodes through with ``use_cache=True``.
        ``merge_commits``: append each committed block within the next block's first step and prefill the prompt
        within the first one (one call fewer per block, the same tokens)."""
        if self.block_size is None:
            raise ValueError("block_decoder: needs a block model (adapt_ar_model(..., block_size=K)); a fully "
                             "bidirectional model offers prefix_decoder (approximate) instead")
        return BlockCacheDecoder(self, merge_commits=merge_commits)

    def prefix_decoder(self: _DecodingHost, seq_len: int, refresh: int) -> PrefixCacheDecoder:
        """Fast-dLLM's **approximate** dual cache for a fully bidirectional model
        (:class:`~unifusion.hf.ar.decoding.PrefixCacheDecoder`, a :class:`~unifusion.samplers.BlockDenoiser`) over
        sequences of ``seq_len`` tokens, recomputed every ``refresh`` steps of a block (``generate(...,
        cache_refresh=refresh)``)."""
        return PrefixCacheDecoder(self, seq_len, refresh)

    def block_forward(self: _DecodingHost) -> BlockForward:
        """A block model as an x0 callable ``(x_t, t, attention_mask=None) → logits``: the training forward with the
        current tokens as the clean stream (:class:`~unifusion.hf.ar.decoding.BlockForward`), what :meth:`generate`
        calls with ``use_cache=False``."""
        return BlockForward(self)

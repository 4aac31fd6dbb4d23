"""Block diffusion on a shifted AR model: block-causal training in one forward, and the KV-cache helpers.

A block model (``adapt_ar_model(..., block_size=K)``) cuts the L tokens into ``nb = ⌈L / K⌉`` blocks; block b is
tokens ``[bK, min((b+1)K, L))``. **Ragged rule**: when K does not divide L the *last* block is shorter
(``L − (nb − 1)K`` tokens); every other block has K tokens. With ``K ≥ L`` there is one block and the model is the
plain bidirectional :class:`~unifusion.hf.DiffusionLM` (the same code path, bit for bit).

**Which inputs each prediction sees.** The plain model runs ``[bos, y_0 … y_{L−1}]`` and its output at internal
position i predicts ``x_0[i]``. The block layout is one forward over two streams side by side, ``[clean | noisy]``:

* **clean stream**, ``C = (nb − 1)K`` positions: internal positions ``0 … C − 1`` with inputs
  ``[bos, x_0[0] … x_0[C − 2]]`` at position ids ``0 … C − 1``; clean → clean attention is causal (the AR model).
* **noisy stream**, per block ``k_b + 1`` positions (``L + nb`` in all): the *anchor* (input ``x_0[bK − 1]``, bos
  for b = 0) at position id ``bK``, then ``x_t[bK … bK + k_b − 1]`` at ids ``bK + 1 … bK + k_b``. The outputs at the
  first ``k_b`` of them predict tokens ``bK … bK + k_b − 1``; the last output is dropped (its input is still seen).
* **mask**: a noisy query of block b sees the clean positions with id ``< bK`` (inputs bos, ``x_0[< bK − 1]``), and
  the positions of its own block (anchor ``x_0[bK − 1]`` and ``x_t`` of the block) — causally at ``γ = 0``, causal plus
  Bernoulli(γ) extra entries for ``0 < γ < 1`` (drawn per sequence, block, query and key), all of them at ``γ = 1``.
  Nothing of later blocks, nothing noisy of other blocks; clean queries never see noisy keys.

So the prediction of token ``bK + j`` sees exactly ``x_0[< bK]`` and (at γ = 1) ``x_t`` of block b, including the
token's own noisy state. At ``K = 1``, ``γ = 0`` the anchor sees only the clean prefix: the AR model's prediction.

**Padding** (``attention_mask``) follows the plain model's rule (contiguous, right or left; bos just before the
first real token, position ids counting real tokens): padded keys are blocked, every query sees itself. Blocks are
cut at *column* multiples of K, so p left pads move a row's block boundaries to real positions ``≡ −p (mod K)``
(what lets generation start a block at any prompt's end); train with right padding to count blocks from each row's
first token.
**Sliding windows** apply on position ids: key j is visible from query i only if also ``|pos_i − pos_j| < w``.
**Time conditioning**: clean positions get the embedding of ``t = 0``, a block's noisy positions (anchor included)
that of the block's time.

**Attention implementations**: SDPA gets a dense boolean ``(B, 1, N, N)`` mask (``N = C + L + nb``), eager attention
its additive form, flex attention a ``BlockMask`` built by :func:`create_block_mask` from the layout's ``mask_mod``
(no dense pattern is made; skipped tiles cost nothing in the kernel). Flash attention takes no mask: a ``ValueError``.
On the CPU, Inductor's flex-attention template fails to compile once a second shape makes dynamo mark the sizes
dynamic (a C++ error naming ``cur_kvSplitSize``): with flex attention on the CPU, run the cache helpers (whose shapes
change every block) with ``torch._dynamo.config.automatic_dynamic_shapes = False``, or use SDPA there. On a CPU
below AVX512 (torch's capability ``AVX2``), the same template computes wrong outputs for some shapes (torch 2.14.1:
4 queries against 8 keys 1.86 off SDPA, NaN with an all-visible mask; ``tests/_cpu.py``): use SDPA or eager attention
on such a CPU.

**Cached decoding** (:func:`prefill`, :func:`denoise_block`, :func:`commit_block`): the cache holds the clean stream
exactly as training writes it, a denoising step runs a block's ``k + 1`` noisy positions against it, so cached and
uncached computations agree::

    state = prefill(model, prompt_ids)                     # cache of [bos, prompt[:-1]], anchor prompt[-1]
    logits = denoise_block(model, state, x_t_block, t)     # (B, k, V); the cache is left as it was
    state = commit_block(model, state, block_tokens)       # appends the block to the clean stream
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from einops import rearrange

from ... import _validation as V
from ..._device import rand
from ...block_partition import expand_block_times, num_blocks
from .adapted import AdaptedLM
from .attention import draws_bernoulli, mask_style

__all__ = ["BlockLayout", "BlockCache", "num_blocks", "block_layout", "check_block_size", "block_times",
           "expand_block_times", "draw_bernoulli", "block_attention_mask", "block_hidden_states", "block_logits",
           "cached_forward", "prefill", "denoise_block", "commit_block"]


def check_block_size(value: object, name: str = "block_size") -> int | None:
    """``None`` or a positive int (``TypeError``/``ValueError`` naming ``name`` otherwise)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected a positive int or None, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name}: expected a positive int or None, got {value}")
    return value


@dataclass(frozen=True)
class BlockLayout:
    """Where every position of the ``[clean | noisy]`` stream comes from (all ``(N,)`` int64 on one device).

    Attributes:
        length: L.  block_size: K.  num_blocks: nb.  num_clean: C = (nb − 1)K.
        internal: the internal position q (of ``[bos, y_0 … y_{L−1}]``) of each stream position.
        block: the block of each noisy position, −1 for clean ones.
        offset: offset inside its block (0 = anchor) for noisy positions, 0 for clean ones.
        predict: ``(L,)`` the stream position whose output predicts token i (``C + i + i // K``).
    """

    length: int
    block_size: int
    num_blocks: int
    num_clean: int
    internal: torch.Tensor
    block: torch.Tensor
    offset: torch.Tensor
    predict: torch.Tensor

    @property
    def size(self) -> int:
        """N = C + L + nb stream positions."""
        return self.num_clean + self.length + self.num_blocks


def block_layout(length: int, block_size: int, device: torch.device | str | None = None) -> BlockLayout:
    """The stream layout for L tokens in blocks of K (module docstring); vectorised, no loop over blocks."""
    L, K = length, block_size
    nb = num_blocks(L, K)
    C = (nb - 1) * K
    n = torch.arange(L + nb, device=device)
    blk = torch.clamp(n // (K + 1), max=nb - 1)  # every block but the last has K + 1 positions
    off = n - blk * (K + 1)
    i = torch.arange(L, device=device)
    return BlockLayout(
        length=L, block_size=K, num_blocks=nb, num_clean=C,
        internal=torch.cat([torch.arange(C, device=device), blk * K + off]),
        block=torch.cat([torch.full((C,), -1, device=device, dtype=torch.long), blk]),
        offset=torch.cat([torch.zeros(C, device=device, dtype=torch.long), off]),
        predict=C + i + i // K)


def block_times(t: object, batch_size: int, nb: int, device: torch.device) -> torch.Tensor:
    """Times of a block model call as ``(B, nb)``: a float or 0-d tensor, ``(B,)`` or ``(B, 1)`` (one per sequence,
    repeated over the blocks) or ``(B, nb)`` (one per block). Values are checked as :func:`check_time` does."""
    t_ = V.check_time("t", t, device=device, shape=(batch_size, nb))
    if t_.dim() == 2 and tuple(t_.shape) == (batch_size, nb):
        return t_
    if t_.numel() in (1, batch_size) and (t_.dim() < 2 or t_.shape[1] == 1):
        return t_.reshape(-1, 1).expand(batch_size, nb) if t_.numel() == batch_size else \
            t_.reshape(1, 1).expand(batch_size, nb)
    raise ValueError(f"t: a block model takes one time per sequence (a float, ({batch_size},) or ({batch_size}, 1)) "
                     f"or one per block ({batch_size}, {nb}), got shape {tuple(t_.shape)}")


# ----------------------------------------------------------------------------------------------------------
# the mask, from the layout


def _mask_mod(layout: BlockLayout, gamma: float | torch.Tensor, key_valid: torch.Tensor | None,
              extra: torch.Tensor | None, window: int | None, documents: torch.Tensor | None = None) -> Any:
    """``mask_mod(b, h, q, kv) -> bool`` of the block layout (module docstring); works on broadcast index tensors
    (the dense mask) and under flex attention's vmap (the ``BlockMask``). ``extra``: ``(B, nb, K+1, K+1)`` Bernoulli(γ)
    entries for ``0 < γ < 1`` or a tensor ``γ`` (:func:`~unifusion.hf.ar.attention.draws_bernoulli`)."""
    q_of, blk_of, off_of, K = layout.internal, layout.block, layout.offset, layout.block_size

    def mask_mod(b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
        bq, bk, qq, qk = blk_of[qi], blk_of[ki], q_of[qi], q_of[ki]
        to_clean = (bk < 0) & torch.where(bq < 0, qk <= qq, qk < bq * K)
        same = (bk >= 0) & (bq == bk)
        if extra is not None:
            same = same & ((qk <= qq) | extra[b, bq.clamp_min(0), off_of[qi], off_of[ki]])
        elif not isinstance(gamma, torch.Tensor) and gamma <= 0.0:
            same = same & (qk <= qq)
        allowed = to_clean | same
        if key_valid is not None:
            allowed = allowed & key_valid[b, ki]
        if documents is not None:  # packed rows: a position sees its own document only
            allowed = allowed & (documents[b, qi] == documents[b, ki])
        allowed = allowed | (qi == ki)
        if window is not None:
            allowed = allowed & ((qq - qk).abs() < window)
        return allowed

    return mask_mod


def draw_bernoulli(layout: BlockLayout, batch_size: int, gamma: float | torch.Tensor,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """The annealed mask's extra entries inside the blocks, ``(B, nb, K + 1, K + 1)`` bool ~ Bernoulli(γ): entry
    ``[b, blk, i, j]`` lets offset i of block blk see offset j (row b). ``γ`` may be a 0-d tensor (not read on the
    host: exactly no entry at 0, every entry at 1)."""
    K = layout.block_size
    shape = (batch_size, layout.num_blocks, K + 1, K + 1)
    return rand(shape, generator=generator, device=layout.internal.device) < gamma


def block_attention_mask(layout: BlockLayout, batch_size: int, gamma: float | torch.Tensor, *,
                         key_valid: torch.Tensor | None = None, window: int | None = None,
                         generator: torch.Generator | None = None, style: str = "bool",
                         dtype: torch.dtype = torch.float32, bernoulli: torch.Tensor | None = None,
                         documents: torch.Tensor | None = None) -> Any:
    """The block layout's attention mask: ``style="bool"`` a dense ``(B, 1, N, N)`` bool (True = attend),
    ``"additive"`` the same as ``dtype`` (0 / finfo.min), ``"block"`` a flex-attention ``BlockMask``.

    Args:
        layout: :func:`block_layout`.  batch_size: B.  gamma: γ in [0, 1], a float or a 0-d tensor (a tensor
            always draws the Bernoulli entries and builds the mask with them: no host read of its value).
        key_valid: ``(B, N)`` bool, False for padded stream positions.
        window: sliding window w on position ids, or ``None``.
        generator: for the Bernoulli(γ) entries (``0 < γ < 1`` or a tensor γ), on the layout's device.
        bernoulli: those entries drawn already (:func:`draw_bernoulli`), e.g. to share them between the full and
            the windowed layers' masks; ``generator`` is then unused.
    """
    device = layout.internal.device
    extra = None
    if draws_bernoulli(gamma):
        extra = bernoulli if bernoulli is not None else draw_bernoulli(layout, batch_size, gamma, generator)
    mod = _mask_mod(layout, gamma, key_valid, extra, window, documents)
    N = layout.size
    if style == "block":
        from torch.nn.attention.flex_attention import create_block_mask

        per_row = key_valid is not None or extra is not None or documents is not None
        return create_block_mask(mod, batch_size if per_row else None, None, N, N, device=device)
    i = torch.arange(N, device=device)
    b = torch.arange(batch_size, device=device)[:, None, None]
    A = mod(b, None, i[None, :, None], i[None, None, :])  # (B or 1, N, N)
    A = A.expand(batch_size, N, N)[:, None]  # (B, 1, N, N)
    if style == "additive":
        return torch.zeros(A.shape, dtype=dtype, device=device).masked_fill_(~A, torch.finfo(dtype).min)
    return A


# ----------------------------------------------------------------------------------------------------------
# the forward


def _internal(model: AdaptedLM, seq: torch.Tensor, attention_mask: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The plain model's internal sequence ``[bos, seq]`` ``(B, L + 1)`` (bos before the first real token under left
    padding), its key validity and position ids (``None`` without padding)."""
    B, L = seq.shape
    bos = torch.full((B, 1), model.bos_token_id, dtype=seq.dtype, device=seq.device)
    if attention_mask is None:
        return torch.cat([bos, seq], dim=1), None, None
    p = (attention_mask.long().cumsum(-1) == 0).sum(-1, keepdim=True)  # (B, 1) leading pads
    j = torch.arange(L + 1, device=seq.device)[None, :]
    ids = torch.where(j < p, torch.cat([seq, bos], 1), torch.where(j == p, bos, torch.cat([bos, seq], 1)))
    ones = torch.ones((B, 1), dtype=torch.bool, device=seq.device)
    valid = torch.where(j < p, False, torch.where(j == p, True, torch.cat([ones, attention_mask], 1)))
    return ids, valid, (valid.long().cumsum(-1) - 1).clamp_min(0)


def _embed(model: AdaptedLM, hf: Any, ids: torch.Tensor, t_pos: torch.Tensor | None) -> dict[str, Any]:
    """``input_ids=`` or, with time conditioning, ``inputs_embeds=`` (embedding + time embedding per position)."""
    if model.time_embedding is None:
        return {"input_ids": ids}
    assert t_pos is not None
    h = hf.get_input_embeddings()(ids)  # (B, n, d)
    e = rearrange(model.time_embedding(rearrange(t_pos, "b n -> (b n)")), "(b n) d -> b n d", b=t_pos.shape[0])
    return {"inputs_embeds": h + e.to(h.dtype)}


def _masks_for(model: AdaptedLM, pattern_fn: Any, window: int | None) -> Any:
    """The ``attention_mask=`` argument: one mask, or one per layer type when the family windows some layers."""
    if window is None:
        return pattern_fn(None)
    if model.family.window == "all_layers":
        return pattern_fn(window)
    return {"full_attention": pattern_fn(None), "sliding_attention": pattern_fn(window)}


def cached_forward(model: AdaptedLM, ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor,
                   key_pos: torch.Tensor, cache: Any, t_pos: torch.Tensor | None = None) -> torch.Tensor:
    """Run ``ids`` ``(B, q)`` at position ids ``positions`` ``(B, q)`` against ``cache`` (a transformers
    ``DynamicCache`` of n positions, which grows by q): query i sees key j where ``allowed[b, i, j]`` ``(B, q, n + q)``
    and, on sliding-window layers, where ``|positions[b, i] − key_pos[b, j]| < window`` (``key_pos`` ``(B, n + q)``:
    the position ids of the cached keys, then ``positions``). ``t_pos`` ``(B, q)``: per-position times of a
    time-conditioned model (``None``: time 0). The mask goes in the form the model's attention takes: dense boolean
    (SDPA), additive (eager) or a flex ``BlockMask``. Returns the final hidden states ``(B, q, d)``.

    The one way the cached decoders (these helpers and :mod:`unifusion.hf.ar.decoding`) run the backbone after a
    prefill.
    """
    hf = model.hf_model
    B, q = ids.shape
    if model.time_embedding is not None and t_pos is None:
        t_pos = torch.zeros((B, q), device=ids.device)
    style = mask_style(model.family, model.config, "a cached forward")
    dtype = hf.get_input_embeddings().weight.dtype

    def pattern(w: int | None) -> Any:
        A = allowed if w is None else allowed & ((positions[:, :, None] - key_pos[:, None, :]).abs() < w)
        if style == "additive":
            return torch.zeros((B, 1, *A.shape[1:]), dtype=dtype, device=A.device).masked_fill_(
                ~A[:, None], torch.finfo(dtype).min)
        if style == "block":
            from torch.nn.attention.flex_attention import create_block_mask

            P = A.contiguous()
            if P.device.type == "cpu" and not torch.compiler.is_compiling():
                torch._dynamo.mark_static(P)  # Inductor's CPU flex template fails on symbolic sizes of a capture
            return create_block_mask(lambda b, h, qi, ki: P[b, qi, ki], B, None, q, A.shape[-1], device=A.device)
        return A[:, None]  # (B, 1, q, n + q)

    out = hf.base_model(**_embed(model, hf, ids, t_pos), position_ids=positions,
                        attention_mask=_masks_for(model, pattern, model.family.sliding_window(model.config)),
                        cache=cache, use_cache=True)
    return out.last_hidden_state


def block_hidden_states(model: AdaptedLM, hf: Any, x_t: torch.Tensor, t: torch.Tensor | None, clean: torch.Tensor,
                        gamma: float | torch.Tensor, attention_mask: torch.Tensor | None = None,
                        generator: torch.Generator | None = None, document_ids: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """Final hidden states ``(B, L, d)`` of the noisy stream's prediction positions (one forward over
    ``[clean | noisy]``; module docstring). Inputs are assumed checked (``DiffusionLM.forward`` checks them).

    Args:
        model: the block :class:`~unifusion.hf.DiffusionLM`.  hf: its Hugging Face ``*ForCausalLM``.
        x_t: ``(B, L)`` noisy tokens.  t: ``(B, nb)`` block times or ``None`` (no time conditioning).
        clean: ``(B, L)`` clean tokens x_0.  gamma: γ, a float or a 0-d tensor.
        attention_mask: ``(B, L)`` bool or ``None``.
        document_ids: ``(B, L)`` int64 document of each token (packed rows), or ``None``: every stream position
            then sees only positions of its own document and BOS, and position ids restart at each document
            (:func:`unifusion.hf.ar.layout.document_positions`), so a document that starts at a block boundary is
            computed as it would be alone.
    """
    B, L = x_t.shape
    if model.block_size is None:
        raise ValueError("model: block_hidden_states runs a block model's layout; this model has block_size=None")
    K = int(model.block_size)
    lay = block_layout(L, K, x_t.device)
    cin, valid, pos = _internal(model, clean, attention_mask)
    nin, _, _ = _internal(model, x_t, attention_mask)
    q = lay.internal  # (N,)
    C = lay.num_clean
    noisy_q = q[C:]
    anchor = (lay.offset[C:] == 0)[None, :]
    ids = torch.cat([cin[:, :C], torch.where(anchor, cin[:, noisy_q], nin[:, noisy_q])], dim=1)  # (B, N)
    kwargs: dict[str, Any] = {"use_cache": False}
    kwargs["position_ids"] = (q[None, :] if pos is None else pos[:, q]).expand(B, -1)
    documents = None
    if document_ids is not None:  # packed rows: each document its own BOS, positions and keys
        ids, kwargs["position_ids"], documents = _documents(model, lay, ids, document_ids)
    t_pos = None
    if t is not None:
        t_pos = torch.cat([torch.zeros((B, C), dtype=t.dtype, device=t.device), t[:, lay.block[C:]]], dim=1)
    kwargs.update(_embed(model, hf, ids, t_pos))
    window = model.family.sliding_window(model.config)
    style = mask_style(model.family, model.config, "block-causal training")
    key_valid = None if valid is None else valid[:, q]
    if generator is not None and draws_bernoulli(gamma) and generator.device.type != x_t.device.type:
        raise ValueError(f"generator: is on {generator.device} but x_t is on {x_t.device}; the annealed mask is drawn "
                         f"on x_t's device, so pass torch.Generator(device={str(x_t.device)!r})")
    dtype = hf.get_input_embeddings().weight.dtype
    # drawn once: the windowed and the full layers see the same Bernoulli entries
    extra = draw_bernoulli(lay, B, gamma, generator) if draws_bernoulli(gamma) else None

    def pattern(w: int | None) -> Any:
        return block_attention_mask(lay, B, gamma, key_valid=key_valid, window=w, style=style, dtype=dtype,
                                    bernoulli=extra, documents=documents)

    kwargs["attention_mask"] = _masks_for(model, pattern, window)
    h = hf.base_model(**kwargs).last_hidden_state  # (B, N, d)
    return h[:, lay.predict]  # (B, L, d)


def _documents(model: AdaptedLM, lay: BlockLayout, ids: torch.Tensor, document_ids: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stream's input ids, position ids and document of each position for a right-padded packed row.

    Token ``j`` belongs to document ``doc[j]``; document d starts at column ``s_d``. A clean-stream position or an
    anchor at internal position ``q`` holds ``x_0[q − 1]``, except where ``q`` is a document start ``s_d`` (d ≥ 1):
    it then holds BOS — that document's own BOS, at position id 0 — in place of the previous document's last token,
    which nothing of that document reads there (its last block sees clean positions before its own start; the token's
    noisy copy stays in the noisy stream). A noisy token position holds ``x_t[q − 1]`` and belongs to its document.
    Position ids restart at every document (BOS 0, the document's tokens 1, 2, …), so a document that starts at a
    block boundary is computed exactly as it would be alone."""
    B = ids.shape[0]
    doc = document_ids.long()  # (B, L)
    L = doc.shape[1]
    col = torch.arange(L, device=doc.device)
    start = torch.ones_like(doc, dtype=torch.bool)
    start[:, 1:] = doc[:, 1:] != doc[:, :-1]
    first = torch.where(start, col, torch.zeros_like(col)).cummax(-1).values  # (B, L): s of each token's document
    q, C = lay.internal, lay.num_clean
    holds_clean = torch.ones_like(q, dtype=torch.bool)
    holds_clean[C:] = lay.offset[C:] == 0  # clean positions and anchors hold x_0[q − 1] (BOS at q = 0)
    # internal q as a BOS (q = 0, or a document start) or as the token q − 1
    is_bos = (q == 0)[None, :] | (holds_clean[None, :] & start.gather(1, q.clamp(0, L - 1).expand(B, -1))
                                  & (q < L)[None, :])
    token = (q - 1).clamp_min(0).expand(B, -1)  # the token a non-BOS position holds
    bos_doc = doc.gather(1, q.clamp(0, L - 1).expand(B, -1))  # the document a BOS at q opens
    documents = torch.where(is_bos, bos_doc, doc.gather(1, token))
    positions = torch.where(is_bos, 0, token - first.gather(1, token) + 1)
    ids = torch.where(is_bos, model.bos_token_id, ids)
    return ids, positions, documents


def block_logits(model: AdaptedLM, hf: Any, x_t: torch.Tensor, t: torch.Tensor | None, clean: torch.Tensor,
                 gamma: float | torch.Tensor, attention_mask: torch.Tensor | None = None,
                 generator: torch.Generator | None = None, document_ids: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """Logits ``(B, L, V)`` of :func:`block_hidden_states` (the output head on the L prediction positions only)."""
    h = block_hidden_states(model, hf, x_t, t, clean, gamma, attention_mask, generator, document_ids)
    return model.logits_from_hidden(h)


# ----------------------------------------------------------------------------------------------------------
# cached decoding: the clean stream in a KV cache, one block's noisy positions against it


@dataclass
class BlockCache:
    """State of cached block decoding.

    Attributes:
        cache: a transformers ``DynamicCache`` holding the clean stream's ``length`` positions (inputs
            ``[bos, x_0[0] … x_0[length − 2]]`` at position ids ``0 … length − 1``).
        anchor: ``(B,)`` the last committed token ``x_0[length − 1]`` (bos when nothing is committed): the input of
            the next block's anchor position.
        length: the number of committed clean tokens (the next block starts at token ``length``).
    """

    cache: Any
    anchor: torch.Tensor
    length: int


def _hf_of(model: AdaptedLM) -> Any:
    hf = model.hf_model
    return hf


def _check_ids(name: str, ids: object, model: AdaptedLM, batch: int | None = None) -> torch.Tensor:
    ids_ = V.check_token_ids(name, ids, model.vocab_size)
    if ids_.dim() != 2 or (batch is not None and ids_.shape[0] != batch):
        want = "(B, n)" if batch is None else f"({batch}, k)"
        raise ValueError(f"{name}: expected token ids of shape {want}, got {tuple(ids_.shape)}")
    V.check_model_device(model, name, ids_)
    return ids_


def _clean_forward(model: AdaptedLM, state: BlockCache, inputs: torch.Tensor) -> None:
    """Append ``inputs`` ``(B, n)`` to the clean stream in the cache, causally (the AR model's own mask)."""
    B, n = inputs.shape
    hf = _hf_of(model)
    pos = torch.arange(state.length, state.length + n, device=inputs.device)[None].expand(B, n)
    t0 = torch.zeros((B, n), device=inputs.device) if model.time_embedding is not None else None
    hf.base_model(**_embed(model, hf, inputs, t0), position_ids=pos, cache=state.cache, use_cache=True)


@torch.no_grad()
def prefill(model: AdaptedLM, clean_ids: torch.Tensor) -> BlockCache:
    """Write the clean prefix ``clean_ids`` ``(B, n)`` (``n ≥ 0``; e.g. the prompt) into a fresh ``DynamicCache``.

    The cache gets the ``n`` positions ``[bos, clean_ids[:, :-1]]`` (causal, position ids ``0 … n − 1``); the last
    token is the next block's anchor. Every row has the same prefix length (no padding). Returns a
    :class:`BlockCache`.
    """
    from transformers import DynamicCache

    ids = _check_ids("clean_ids", clean_ids, model)
    B, n = ids.shape
    bos = torch.full((B, 1), model.bos_token_id, dtype=torch.long, device=ids.device)
    state = BlockCache(cache=DynamicCache(), anchor=bos[:, 0], length=0)
    if n == 0:
        return state
    _clean_forward(model, state, torch.cat([bos, ids[:, :-1]], dim=1))
    return BlockCache(cache=state.cache, anchor=ids[:, -1], length=n)


@torch.no_grad()
def denoise_block(model: AdaptedLM, state: BlockCache, x_t_block: torch.Tensor, t: object = None, *,
                  bidirectional_prob: float = 1.0) -> torch.Tensor:
    """x0 logits ``(B, k, V)`` for the block of tokens ``length … length + k − 1`` from its noisy tokens
    ``x_t_block`` ``(B, k)``: one forward of the block's ``k + 1`` noisy positions (anchor, ``x_t_block``) at position
    ids ``length … length + k`` against the cached clean stream, within the block causally at γ = 0 and fully at
    γ = 1 (``0 < γ < 1`` is a training-time device, not taken here). The cache is left as it was.

    Equals the block's rows of ``model(x_t, t, clean=x_0)`` for the same tokens (a training forward).
    """
    x = _check_ids("x_t_block", x_t_block, model, batch=int(state.anchor.shape[0]))
    B, k = x.shape
    if bidirectional_prob not in (0.0, 1.0):
        raise ValueError(f"bidirectional_prob: expected 0 (causal) or 1 (bidirectional), got {bidirectional_prob!r}")
    n = state.length
    ids = torch.cat([state.anchor[:, None], x], dim=1)  # (B, k + 1)
    pos = torch.arange(n, n + k + 1, device=x.device)
    t_pos = None
    if model.time_embedding is not None:
        if t is None:
            raise ValueError("t: this model was adapted with time_conditioning=True and needs t, got None")
        t_pos = V.check_sequence_times("t", t, (B, k), device=x.device).reshape(B, 1).expand(B, k + 1)
    cached = int(state.cache.get_seq_length())
    allowed = torch.ones(B, k + 1, cached + k + 1, dtype=torch.bool, device=x.device)
    if bidirectional_prob == 0.0:
        allowed[:, :, cached:] = torch.ones(k + 1, k + 1, dtype=torch.bool, device=x.device).tril()
    keys = torch.cat([torch.arange(cached, device=x.device), pos])  # position ids of the keys (cache, then block)
    h = cached_forward(model, ids, pos[None].expand(B, -1), allowed, keys[None].expand(B, -1), state.cache, t_pos)
    state.cache.crop(-(k + 1))  # the block's keys were appended: drop them (a negative crop removes the last ones)
    return model.logits_from_hidden(h[:, :k])


@torch.no_grad()
def commit_block(model: AdaptedLM, state: BlockCache, tokens: torch.Tensor) -> BlockCache:
    """Append the decoded block ``tokens`` ``(B, k)`` to the clean stream: one causal forward of the inputs
    ``[anchor, tokens[:, :-1]]`` at position ids ``length … length + k − 1``. Returns the new :class:`BlockCache`
    (the same ``cache`` object, grown by k; ``anchor = tokens[:, -1]``)."""
    ids = _check_ids("tokens", tokens, model, batch=int(state.anchor.shape[0]))
    B, k = ids.shape
    if k == 0:
        return state
    _clean_forward(model, state, torch.cat([state.anchor[:, None], ids[:, :-1]], dim=1))
    return BlockCache(cache=state.cache, anchor=ids[:, -1], length=state.length + k)

"""Fast-dLLM v2's own decoder (``batch_sample`` of their ``generation_functions.py``, what their evaluation runs;
for one row, the ``generate`` of their model file up to its stopping rule), for :meth:`FastDLLMv2LM.generate_reference
<unifusion.hf.fast_dllm.model.FastDLLMv2LM.generate_reference>`; :class:`~unifusion.samplers.policies.FastDLLMv2Order`
reproduces it on prompts of more than K tokens.

Rows of lengths ``n_r`` (their prompts, right-filled with the mask token to the longest) are decoded over blocks of
``K`` columns at column multiples (the block of a prompt's end holds its last tokens and the first masks), through
the exact KV cache of the finished blocks (:class:`~unifusion.hf.native_block.NativeBlockCache`):

* **prefill**: when the shortest prompt ``n_min > K``, its whole blocks (the first ``⌊n_min / K⌋ K`` columns) go to
  the cache; if ``K`` divides ``n_min``, the rows of that length take their next token, the argmax of the logits at
  the last column (an AR step);
* **a block**: its masked columns are decoded sub-block by sub-block (``small_block_size`` columns each, left to
  right). A step runs the block against the cache, reads each column's prediction at the column before it inside the
  block (``cat([z_0, z_0 … z_{K−2}])``), takes the argmax x̂ and its probability ``p`` (the softmax over the whole
  vocabulary, the mask token included), and reveals, in the current sub-block, every masked position with
  ``p > threshold`` and the most confident masked one of each row; the sub-block repeats until no row has a mask
  in it. A row whose revealed tokens include ``stop_token_id`` is finished;
* **commit**: the finished block enters the cache, and its last column's argmax is the next block's first token
  (``pad_token_id`` for a finished row; rows still in their prompt keep their prompt token). A finished row's tokens
  after its first stop token (from its prompt's end) become ``pad_token_id``, and the row leaves the batch, its
  tokens up to the block's end (and the appended pad) its result;
* the run ends after ``⌊max_new_tokens / K⌋ + ⌊n_max / K⌋`` blocks or when every row is finished.

Their decoder's quirk is kept: a block's first token (the AR step) is never checked for the stop token. One case
differs: a row whose prompt ends at a block boundary other than ``n_min``'s finds a mask at the next block's first
column, which their decoder reads at that column itself (``cat([z_0, …])``) and this one at the column before it (the
model's x0 prediction, the previous block's last column).
"""

from __future__ import annotations

import torch

from ... import _validation as V
from ..native import NativeDiffusionLM

__all__ = ["fast_dllm_generate"]


def _commit_token(model: NativeDiffusionLM, hidden: torch.Tensor | None) -> torch.Tensor:
    """The argmax token ``(R, 1)`` of final hidden states ``(R, d)`` (their decoder's AR step)."""
    assert hidden is not None  # a block was cached before
    return model.logits_from_hidden(hidden).argmax(-1)[:, None]


@torch.no_grad()
def fast_dllm_generate(model: NativeDiffusionLM, prompt_ids: torch.Tensor, *, max_new_tokens: int,
                       attention_mask: torch.Tensor | None = None, small_block_size: int = 8,
                       threshold: float = 0.9, stop_token_id: int | None = None,
                       pad_token_id: int | None = None) -> list[torch.Tensor]:
    """Their decoder (module docstring) on ``model`` (a shifted block kind: a
    :class:`~unifusion.hf.fast_dllm.model.FastDLLMv2LM`), greedy: one int64 token tensor per row (prompt and
    generated tokens; rows end at different blocks).

    Args:
        model: the block kind (``block_size`` K, ``mask_token_id``, ``block_decoder()``).
        prompt_ids: ``(B, P)`` int64, right-padded.
        max_new_tokens: ``⌊max_new_tokens / K⌋`` blocks after the longest prompt's last whole block.
        attention_mask: ``(B, P)`` 1 = prompt token (right padding), or ``None`` (every row of length P).
        small_block_size: columns per sub-block (a divisor of K).
        threshold: reveal every masked position of the sub-block whose probability exceeds it (and the most
            confident one).
        stop_token_id: a row is finished once it reveals this token; ``None``: never.
        pad_token_id: what fills a finished row (default: the tokenizer's pad id, as their evaluation passes it, else
            the config's; the released config says 151645, their Qwen2.5 tokenizer 151643).
    """
    K = model.block_size
    mask = model.mask_token_id
    if K is None or mask is None:
        raise ValueError(f"model: Fast-dLLM v2's decoder needs a block kind with a mask token, got "
                         f"{type(model).__name__} (block_size {K}, mask_token_id {mask})")
    prompt_ids = V.check_token_batch("prompt_ids", prompt_ids)
    new = V.check_positive_int("max_new_tokens", max_new_tokens)
    sub = V.check_positive_int("small_block_size", small_block_size)
    if K % sub:
        raise ValueError(f"small_block_size: expected a divisor of the block size {K}, got {sub}")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
        raise TypeError(f"threshold: expected a float, got {type(threshold).__name__}")
    if pad_token_id is None:
        pad_token_id = getattr(model.tokenizer, "pad_token_id", None)
    if pad_token_id is None:
        pad_token_id = getattr(model.config, "pad_token_id", None)
    if pad_token_id is None:
        raise ValueError("pad_token_id: the config names none; pass the id that fills finished rows")
    B, P = prompt_ids.shape
    dev = prompt_ids.device
    if attention_mask is None:
        n = torch.full((B,), P, dtype=torch.long, device=dev)
    else:
        valid = V.check_tensor("attention_mask", attention_mask).to(dev, torch.bool)
        if tuple(valid.shape) != (B, P):
            raise ValueError(f"attention_mask: expected shape {(B, P)} like prompt_ids, got {tuple(valid.shape)}")
        n = valid.sum(-1)
        if not torch.equal(valid, torch.arange(P, device=dev)[None, :] < n[:, None]) or bool((n == 0).any()):
            raise ValueError("attention_mask: Fast-dLLM v2's decoder takes right-padded prompts of at least one token")
    x = torch.where(torch.arange(P, device=dev)[None, :] < n[:, None], prompt_ids, mask)
    stop = -1 if stop_token_id is None else int(stop_token_id)
    n_min, n_max = int(n.min()), int(n.max())
    decoder = model.block_decoder()
    assert decoder is not None  # a block kind
    prefix = n_min // K * K if n_min > K else 0
    state = decoder.start_blocks(x[:, :prefix], torch.ones((B, prefix), dtype=torch.bool, device=dev))
    if prefix and n_min % K == 0:
        at_min = n == n_min
        token = _commit_token(model, state.last_hidden)[at_min]
        if P <= n_min:
            x = torch.cat([x, token], 1)
        else:
            x[at_min, n_min] = token[:, 0]
    rows = torch.arange(B, device=dev)  # the batch rows still decoding (their decoder drops finished ones)
    block_of = n // K
    finished = torch.zeros(B, dtype=torch.bool, device=dev)
    results: dict[int, torch.Tensor] = {}
    x_t = x
    for b in range(n_min // K, new // K + n_max // K):
        if bool(finished.all()):
            break
        if bool((block_of == b).all()):
            x = torch.cat([x, x.new_full((x.shape[0], K - x.shape[1] % K), mask)], 1)
            x_init = x
        else:
            x_init = x[:, :(b + 1) * K]
        x_init[finished, -K:] = pad_token_id
        x_t = x_init.clone()
        t = torch.ones(rows.shape[0], device=dev)
        while True:
            masked = x_t[:, -K:] == mask
            if not bool(masked.any()):
                for r in torch.nonzero(finished & (n < (b + 1) * K))[:, 0].tolist():
                    at = int(torch.nonzero(x_t[r, int(n[r]):] == stop)[0, 0])
                    x_t[r, int(n[r]) + at + 1:] = pad_token_id
                if bool(finished.all()):
                    break
                state = decoder.commit_block(state, x_t[:, -K:], rows)
                token = _commit_token(model, state.last_hidden)
                token[finished] = pad_token_id
                x_t = torch.cat([x_t, token], 1)
                break
            for lo in range(0, K, sub):
                while True:
                    masked = x_t[:, -K:] == mask
                    if not bool(masked[:, lo:lo + sub].any()):
                        break
                    h = decoder.denoise_block_hidden(state, x_t[:, -K:], t, rows, None)  # shifted
                    z = model.logits_from_hidden(h[:, lo:lo + sub]).float()
                    probs = z.softmax(-1)
                    p, token = probs.max(-1)
                    p = torch.where(masked[:, lo:lo + sub], p, -torch.inf)
                    reveal = p > threshold
                    reveal[torch.arange(p.shape[0], device=dev), p.argmax(-1)] = True
                    reveal &= masked[:, lo:lo + sub]
                    cols = x_t[:, x_t.shape[1] - K + lo:x_t.shape[1] - K + lo + sub]
                    cols[reveal] = token[reveal]
                    finished |= ((token == stop) & reveal).any(-1)
        end = (b + 1) * K
        if x.shape[1] == x_t.shape[1]:
            x = x_t
        elif x_t.shape[1] > end:
            x[:, :end] = x_t[:, :-1]
            here = block_of == b
            if bool(here.all()):
                x = torch.cat([x, x_t[:, -1:]], 1)
            elif x.shape[1] <= end:
                x = x_t
            else:
                x[here, end] = x_t[here, end]
        block_of[block_of == b] = b + 1
        if bool(finished.any()):
            for r in torch.nonzero(finished)[:, 0].tolist():
                results[int(rows[r])] = x_t[r].clone()
            keep = ~finished
            rows, x, x_t, block_of, n, finished = rows[keep], x[keep], x_t[keep], block_of[keep], n[keep], \
                finished[keep]
            if rows.shape[0]:
                state.narrow(rows)
    for r in range(rows.shape[0]):
        results[int(rows[r])] = x_t[r].clone()
    return [results[r] for r in range(B)]

"""SDAR's own block decoder (its ``generate.py`` ``block_diffusion_generate``), for
:meth:`SDARLM.block_diffusion_generate <unifusion.hf.sdar.model.SDARLM.block_diffusion_generate>`, the reference
:class:`~unifusion.samplers.policies.SDAROrder` is tested against — blocks at column multiples of K from the row's
first column (the prompt's last partial block is decoded with the first generated tokens, the prompt's tokens in it
kept), its candidate draw, its confidence and its three remasking rules.

A prompt of length P and ``gen_length`` new tokens make ``n_b = ⌈(P + gen_length) / K⌉`` blocks. The prompt's full
blocks are prefilled into the exact block cache (:class:`~unifusion.hf.native_block.NativeBlockCache`); each later
block (mask tokens after the prompt's tokens) runs up to ``denoising_steps`` steps against the cache. At a step:

* **candidates**: logits / T (T = ``temperature``), then top-k and top-p filtering (−∞ outside), p = softmax;
  x̂ ~ Categorical(p) (``torch.multinomial`` with ``generator``), and the confidence is p(x̂) after filtering;
* **transfer** ``k_s`` tokens (``K`` split over the steps, remainder first): ``"sequential"`` the ``k_s`` first
  masked positions; ``"low_confidence_static"`` the ``k_s`` most confident masked positions;
  ``"low_confidence_dynamic"`` every masked position above ``confidence_threshold`` when they are at least ``k_s``,
  else the ``k_s`` most confident;
* a block without masks is committed to the cache (one more call), and decoding stops after a block when any row
  holds one of ``stopping_criteria_idx`` after the prompt (the rest stays masked).

Greedy is ``top_k=1``: x̂ is the argmax and its confidence 1, so ``"low_confidence_dynamic"`` transfers a whole block
in one step. The draws come from ``generator`` in the order SDAR draws from the global generator (one
``multinomial`` over the block's ``(B·K, V)`` probabilities per step), so a generator seeded like
``torch.manual_seed`` before their decoder gives their tokens.
"""

from __future__ import annotations

from typing import Literal

import torch

from ... import _validation as V
from ...samplers.policies.reference import SDAR_STRATEGIES, sdar_probs
from ..native_block import NativeBlockCache

__all__ = ["REMASKING", "block_diffusion_generate"]

REMASKING = SDAR_STRATEGIES
"""SDAR's ``remasking_strategy`` values reproduced here (its ``"entropy_bounded"`` branch reads an undefined
``transfer_index`` and is left out): :data:`~unifusion.samplers.policies.reference.SDAR_STRATEGIES`."""


def _transfer(strategy: str, masked: torch.Tensor, confidence: torch.Tensor, k: int,
              threshold: float) -> torch.Tensor:
    """Which block positions ``(B, K)`` take their candidate at a step that transfers ``k``."""
    B, K = masked.shape
    conf = torch.where(masked, confidence, -torch.inf)
    if strategy == "sequential":
        rank = masked.long().cumsum(-1)
        return masked & (rank <= k)
    top = torch.zeros_like(masked).scatter(-1, torch.topk(conf, k, dim=-1).indices, True)
    if strategy == "low_confidence_static":
        return top
    high = conf > threshold
    return torch.where((high.sum(-1, keepdim=True) >= k), high, top)


@torch.no_grad()
def block_diffusion_generate(model: object, prompt_ids: torch.Tensor, *, gen_length: int = 128,
                             denoising_steps: int | None = None, temperature: float = 1.0, top_k: int = 0,
                             top_p: float = 1.0,
                             remasking_strategy: Literal["low_confidence_dynamic", "low_confidence_static",
                                                         "sequential"] = "low_confidence_dynamic",
                             confidence_threshold: float = 0.85, stopping_criteria_idx: list[int] | None = None,
                             generator: torch.Generator | None = None) -> torch.Tensor:
    """SDAR's block decoder (module docstring) on a block kind ``model``: ``(B, n_b K)`` token ids, the prompt
    ``prompt_ids`` ``(B, P)`` (no padding: every row's prompt has P tokens) followed by the decoded blocks.

    Raises:
        ValueError: a model without blocks or mask token, an unknown ``remasking_strategy``, a prompt with the mask
            token, or out-of-range options (naming them).
    """
    K = getattr(model, "block_size", None)
    mask_id = getattr(model, "mask_token_id", None)
    if K is None or mask_id is None:
        raise ValueError(f"model: SDAR's decoder needs a block kind with a mask token, got {type(model).__name__} "
                         f"(block_size={K!r}, mask_token_id={mask_id!r})")
    if remasking_strategy not in REMASKING:
        raise ValueError(f"remasking_strategy: expected one of {REMASKING}, got {remasking_strategy!r}")
    steps = K if denoising_steps is None else denoising_steps
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= K:
        raise ValueError(f"denoising_steps: expected an int in [1, {K}] (the block size), got {steps!r}")
    if isinstance(gen_length, bool) or not isinstance(gen_length, int) or gen_length < 1:
        raise ValueError(f"gen_length: expected a positive int, got {gen_length!r}")
    if not (temperature > 0 and 0 < top_p <= 1 and top_k >= 0):
        raise ValueError(f"temperature, top_p, top_k: expected temperature > 0, 0 < top_p ≤ 1, top_k ≥ 0, got "
                         f"{temperature!r}, {top_p!r}, {top_k!r}")
    generator = V.check_generator(generator)
    prompt = V.check_token_batch("prompt_ids", prompt_ids)
    if bool((prompt == mask_id).any()):
        raise ValueError(f"prompt_ids: holds the mask token {mask_id}")
    decoder = NativeBlockCache(model, merge_commits=False)  # type: ignore[arg-type]
    B, P = prompt.shape
    nb = -(-(P + gen_length) // K)
    x = torch.full((B, nb * K), mask_id, dtype=torch.long, device=prompt.device)
    x[:, :P] = prompt
    prefilled = (P // K) * K
    state = decoder.start_blocks(x[:, :prefilled], torch.ones((B, prefilled), dtype=torch.bool, device=x.device))
    rows = torch.arange(B, device=x.device)
    t = torch.ones(B, device=x.device)
    split = torch.full((steps,), K // steps, dtype=torch.long)
    split[:K % steps] += 1
    stops = torch.tensor(stopping_criteria_idx or [], dtype=torch.long, device=x.device)
    for b in range(prefilled // K, nb):
        block = x[:, b * K:(b + 1) * K].clone()
        for s in range(steps + 1):
            masked = block == mask_id
            if not bool(masked.any()):
                break
            logits = decoder.denoise_block(state, block, t, rows, None)
            p = sdar_probs(logits.reshape(B * K, -1), temperature, top_k, top_p)
            cand = torch.multinomial(p, 1, generator=generator)
            conf = p.gather(-1, cand).view(B, K)
            chosen = _transfer(remasking_strategy, masked, conf, int(split[min(s, steps - 1)]), confidence_threshold)
            block = torch.where(chosen, cand.view(B, K), block)
        x[:, b * K:(b + 1) * K] = block
        if stops.numel() and bool(torch.isin(x[:, P:], stops).any()):
            break
        if b < nb - 1:
            state = decoder.commit_block(state, block, rows)
    return x

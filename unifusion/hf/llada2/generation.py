"""LLaDA 2's own samplers (dllm's ``pipelines/llada2/sampler.py`` for LLaDA 2.0 and ``pipelines/llada21/sampler.py``
for LLaDA 2.1), on :class:`~unifusion.hf.llada2.model.LLaDA2LM`'s block-causal forward.

Both decode a canvas of ``n_b = ⌈(P + N)/K⌉`` blocks of ``K`` (the model's block size) columns counted from column 0:
the prompt fills the first ``P`` columns, every other column starts as the mask token, and the blocks from the one
holding column ``P`` on (``⌊P/K⌋``: it may still hold the prompt's last tokens) are decoded in turn, each step a
forward over the canvas up to the block's end (position ids = columns, block-causal attention) whose last ``K`` rows
are the block's x0 logits. Per position the candidate ``z_j`` and its confidence ``c_j`` come from
``softmax(logits / T)`` over the whole vocabulary (the mask token included): the argmax at ``T = 0``, else a draw
after top-k / top-p filtering.

* **LLaDA 2.0** (:func:`llada2_generate`): ``S`` steps per block with the count schedule ``n_s`` (``K`` split evenly,
  the first ``K mod S`` steps one more). A step commits every masked position with ``c_j > τ`` when there are at
  least ``n_s`` of them, else the ``n_s`` most confident masked positions; a block ends when it has no mask left.
  With ``τ`` above every confidence this is low-confidence remasking; on a block-aligned prompt (``K | P``) it equals
  :func:`unifusion.samplers.generate` with ``ConfidenceThreshold(τ)`` whenever no step commits beyond its count.
* **LLaDA 2.1** (:func:`llada21_generate`): no schedule; a step commits the masked positions with ``c_j > τ``, or
  the ``n`` most confident (``num_to_transfer``), and also **edits**: every decided non-prompt position of the block
  whose candidate differs from its token and has ``c_j > τ_edit`` takes the candidate. Once the block has no mask,
  steps continue while they edit, for at most ``max_post_steps`` more. One prompt at a time (their sampler requires
  batch size 1: rows diverge); rows of a batch are decoded one after the other.

Both return the whole canvas ``(B, n_b K)`` as theirs do (it may run past ``P + N``). Sampling (``T > 0``) draws
with ``torch.multinomial`` from ``generator``, which gives their tokens for their global seed.
"""

from __future__ import annotations

import torch

from ...denoiser import Denoiser

__all__ = ["even_schedule", "llada21_generate", "llada2_generate"]


def even_schedule(block_size: int, steps: int) -> list[int]:
    """LLaDA 2.0's per-step commit counts: ``block_size`` split over ``steps`` steps, the first ``block_size mod
    steps`` steps one more (``[]`` for no steps)."""
    if steps <= 0:
        return []
    base, extra = divmod(block_size, steps)
    return [base + (s < extra) for s in range(steps)]


def _candidates(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidate ``(…,)`` int64 and its probability ``(…,)`` float32 per position of ``logits`` ``(…, V)``:
    argmax of the softmax at temperature 0, else a draw from ``softmax(logits / T)`` after top-k and top-p."""
    logits = logits.float()
    if temperature == 0.0:
        probs = torch.softmax(logits, -1)
        tokens = probs.argmax(-1)
        return tokens, probs.gather(-1, tokens[..., None])[..., 0]
    logits = logits / temperature
    if top_k is not None and top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0.0 < top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        past = torch.softmax(sorted_logits, -1).cumsum(-1) > top_p
        past[..., 1:] = past[..., :-1].clone()
        past[..., 0] = False
        logits = logits.masked_fill(torch.zeros_like(past).scatter_(-1, order, past), float("-inf"))
    probs = torch.softmax(logits, -1)
    tokens = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator).view(probs.shape[:-1])
    return tokens, probs.gather(-1, tokens[..., None])[..., 0]


def _top_confident(confidence: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``(B, K)`` bool: the ``count[b]`` positions of highest ``confidence`` in each row (``torch.topk``'s order)."""
    K = confidence.shape[-1]
    order = confidence.topk(K, dim=-1).indices
    keep = torch.arange(K, device=confidence.device)[None, :] < count[:, None]
    return torch.zeros_like(keep).scatter_(-1, order, keep)


def _check(model: Denoiser, prompt_ids: torch.Tensor, max_new_tokens: int) -> tuple[int, int, int]:
    """The block size K, the canvas's blocks ⌈(P + N)/K⌉ and the mask id; ``ValueError`` naming a bad argument."""
    K, mask = model.block_size, model.mask_token_id
    if K is None or mask is None:
        raise ValueError("model: LLaDA 2's samplers decode a block model with a mask token (block_size and "
                         f"mask_token_id set), got block_size={K!r}, mask_token_id={mask!r}")
    if not isinstance(prompt_ids, torch.Tensor) or prompt_ids.dim() != 2 or prompt_ids.dtype != torch.long:
        raise ValueError(f"prompt_ids: expected (B, P) int64 token ids of equal-length prompts, got "
                         f"{getattr(prompt_ids, 'shape', type(prompt_ids).__name__)}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected a positive int, got {max_new_tokens!r}")
    P = prompt_ids.shape[1]
    return K, -(-(P + max_new_tokens) // K), mask


def _canvas(model: Denoiser, prompt_ids: torch.Tensor, num_blocks: int, K: int, mask: int) -> torch.Tensor:
    """``(B, num_blocks · K)``: the prompt in the first columns, the mask token after it."""
    x = torch.full((prompt_ids.shape[0], num_blocks * K), mask, dtype=torch.long, device=model.device)
    x[:, :prompt_ids.shape[1]] = prompt_ids.to(model.device)
    return x


@torch.no_grad()
def llada2_generate(model: Denoiser, prompt_ids: torch.Tensor, *, max_new_tokens: int = 128, steps_per_block: int = 32,
                    threshold: float = 0.95, minimal_topk: int = 1, temperature: float = 0.0,
                    top_k: int | None = None, top_p: float | None = None, eos_early_stop: bool = False,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """LLaDA 2.0's block sampler (module docstring) on ``model`` (an :class:`~unifusion.hf.llada2.LLaDA2LM`).

    Args:
        model: the model; its :attr:`block_size` is the sampler's ``block_size``.
        prompt_ids: ``(B, P)`` int64, equal-length prompts (no padding, as theirs).
        max_new_tokens: N.
        steps_per_block: S (capped at ``N // minimal_topk``).
        threshold: τ.
        minimal_topk: their cap on the steps.
        temperature: T (0: greedy).
        top_k: top-k filtering when sampling.
        top_p: top-p filtering when sampling.
        eos_early_stop: stop decoding a block once it holds the EOS token (``model.config.eos_token_id``).
        generator: the draws when sampling.

    Returns:
        ``(B, ⌈(P + N)/K⌉ K)`` int64, the canvas.
    """
    K, num_blocks, mask = _check(model, prompt_ids, max_new_tokens)
    eos = getattr(model.config, "eos_token_id", None)
    steps = min(steps_per_block, max_new_tokens // minimal_topk if minimal_topk > 0 else steps_per_block)
    schedule = even_schedule(K, steps)
    x = _canvas(model, prompt_ids, num_blocks, K, mask)
    for b in range(prompt_ids.shape[1] // K, num_blocks):
        end = (b + 1) * K
        for n in schedule:
            block = x[:, end - K:end]
            active = block == mask
            if not bool(active.any()):
                break
            tokens, probs = _candidates(model(x[:, :end])[:, -K:], temperature, top_k, top_p, generator)
            confidence = torch.where(active, probs, float("-inf"))
            high = (confidence > threshold) & active
            top = _top_confident(confidence, active.sum(-1).clamp(max=n))
            commit = torch.where((high.sum(-1) >= n)[:, None], high, top)
            block[commit] = tokens[commit]
            if eos_early_stop and eos is not None and bool((block == eos).any()):
                break
    return x


@torch.no_grad()
def llada21_generate(model: Denoiser, prompt_ids: torch.Tensor, *, max_new_tokens: int = 128, threshold: float = 0.95,
                     editing_threshold: float = 0.9, max_post_steps: int = 16, num_to_transfer: int = 1,
                     temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                     eos_early_stop: bool = False, generator: torch.Generator | None = None) -> torch.Tensor:
    """LLaDA 2.1's block sampler with token editing (module docstring) on ``model``, one row at a time.

    Args:
        model: the model; its :attr:`block_size` is the sampler's ``block_size``.
        prompt_ids: ``(B, P)`` int64, equal-length prompts.
        max_new_tokens: N.
        threshold: τ, for masked positions.
        editing_threshold: τ_edit, for decided non-prompt positions.
        max_post_steps: the editing steps allowed once a block has no mask.
        num_to_transfer: n, the masked positions a step commits when fewer than n pass τ.
        temperature: T (0: greedy).
        top_k: top-k filtering when sampling.
        top_p: top-p filtering when sampling.
        eos_early_stop: stop after a fully decided block that holds the EOS token.
        generator: the draws when sampling.

    Returns:
        ``(B, ⌈(P + N)/K⌉ K)`` int64, the canvases.
    """
    K, num_blocks, mask = _check(model, prompt_ids, max_new_tokens)
    eos = getattr(model.config, "eos_token_id", None)
    P = prompt_ids.shape[1]
    x = _canvas(model, prompt_ids, num_blocks, K, mask)
    for row in x.split(1):
        for b in range(P // K, num_blocks):
            end = (b + 1) * K
            prompt_part = torch.arange(b * K, end, device=x.device)[None] < P
            post_steps = 0
            while True:
                block = row[:, end - K:end]
                old = block.clone()
                active = old == mask
                masked = int(active.sum())
                if masked == 0:
                    post_steps += 1
                if post_steps > max_post_steps:
                    break
                tokens, probs = _candidates(model(row[:, :end])[:, -K:], temperature, top_k, top_p, generator)
                commit = torch.zeros_like(active)
                if masked > 0:
                    confidence = torch.where(active, probs, float("-inf"))
                    high = (confidence > threshold) & active
                    commit = high if int(high.sum()) >= num_to_transfer else _top_confident(
                        confidence, torch.tensor([min(num_to_transfer, masked)], device=x.device))
                editable = ~active & ~prompt_part
                edit = (torch.where(editable, probs, float("-inf")) > editing_threshold) & editable & (tokens != old)
                change = commit | edit
                block[change] = tokens[change]
                if masked == 0 and not bool(edit.any()):
                    break
            if eos_early_stop and eos is not None:
                decided = row[0, P:end]
                if not bool((decided == mask).any()) and bool((decided == eos).any()):
                    break
    return x

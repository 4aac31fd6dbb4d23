"""LLaDA's own sampler (its ``generate.py``), for :meth:`LLaDALM.generate_reference
<unifusion.hf.llada.model.LLaDALM.generate_reference>`: the verified reference (Gumbel-max sampling in float64 with
the confidence read at temperature 1, classifier-free guidance, its random stream) that
``generate(policy=LLaDAOrder(remasking), cfg_scale=w)`` (:class:`~unifusion.samplers.policies.LLaDAOrder`) is
tested against.

The ``gen_length`` masks after the prompt are decoded in ``gen_length / block_length`` blocks, left to right, with
``steps / num_blocks`` full-sequence calls per block. At each call:

* **guidance** (``cfg_scale`` = w > 0): the batch runs twice, as it is and with every prompt position (every
  position that was not a mask at the start, padding included) masked; z = z_u + (w + 1)(z − z_u);
* **candidates**: x̂ = argmax of exp(z) / (−log u)^T, u ~ U[0, 1) in float64 over the whole ``(B, L, V)``
  logits (Gumbel-max at temperature T; T = 0 is the argmax of z);
* **confidence**: ``"low_confidence"``: softmax(z) at x̂ (temperature 1, the mask token included);
  ``"random"``: U[0, 1) per position; −∞ outside the current block's masked positions;
* **commit**: the ``k`` most confident, ``k`` the even split of the block's masked count over its steps (remainder
  first, LLaDA's ``get_num_transfer_tokens``).

The draws come from ``generator`` in the order LLaDA draws from the global generator (the Gumbel uniforms, then the
random confidences), so a generator seeded like ``torch.manual_seed`` before their ``generate`` gives their tokens.
"""

from __future__ import annotations

from typing import Literal

import torch

from ... import _validation as V
from ...denoiser import Denoiser
from ...samplers.policies.reference import LLADA_REMASKING

__all__ = ["REMASKING", "llada_generate"]

REMASKING = LLADA_REMASKING
"""LLaDA's ``remasking`` values (:data:`~unifusion.samplers.policies.reference.LLADA_REMASKING`)."""


def _even_split(count: torch.Tensor, steps: int) -> torch.Tensor:
    """``(B, steps)``: ``count`` ``(B,)`` split over ``steps``, the remainder on the first steps."""
    base, rest = count // steps, count % steps
    return base[:, None] + (torch.arange(steps, device=count.device) < rest[:, None]).long()


def llada_generate(model: Denoiser, prompt_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                   steps: int = 128, gen_length: int = 128, block_length: int = 128, temperature: float = 0.0,
                   cfg_scale: float = 0.0, remasking: Literal["low_confidence", "random"] = "low_confidence",
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """LLaDA's sampler (module docstring) on ``model`` (an unshifted x0 denoiser with a mask token: a
    :class:`~unifusion.hf.llada.model.LLaDALM`): ``(B, P + gen_length)`` token ids.

    Args:
        model: the denoiser, called as ``model(x, attention_mask=...)`` → x0 logits ``(B, L, V)``.
        prompt_ids: ``(B, P)`` int64, left-padded.
        attention_mask: ``(B, P)`` 1 = real token, or ``None``.
        steps: model calls in all (a multiple of the number of blocks).
        gen_length: tokens to generate (a multiple of ``block_length``).
        block_length: tokens per block.
        temperature: Gumbel-max temperature T ≥ 0 (0: greedy).
        cfg_scale: classifier-free guidance scale w ≥ 0 (0: none).
        remasking: ``"low_confidence"`` or ``"random"``.
        generator: randomness of the draws (``None``: the global generator, as LLaDA's code).
    """
    if remasking not in REMASKING:
        raise ValueError(f"remasking: expected one of {REMASKING}, got {remasking!r}")
    prompt_ids = V.check_token_batch("prompt_ids", prompt_ids)
    gen_length = V.check_positive_int("gen_length", gen_length)
    block_length = V.check_positive_int("block_length", block_length)
    steps = V.check_positive_int("steps", steps)
    generator = V.check_generator(generator)
    if gen_length % block_length:
        raise ValueError(f"block_length: must divide gen_length = {gen_length}, got {block_length}")
    num_blocks = gen_length // block_length
    if steps % num_blocks:
        raise ValueError(f"steps: must be a multiple of the number of blocks {num_blocks}, got {steps}")
    for name, value in (("temperature", temperature), ("cfg_scale", cfg_scale)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"{name}: expected a float >= 0, got {value!r}")
    mask_id = model.mask_token_id
    if mask_id is None:
        raise ValueError(f"model: LLaDA's sampler fills masked positions; {type(model).__name__} has no mask token")
    B, P = prompt_ids.shape
    x = torch.cat([prompt_ids, prompt_ids.new_full((B, gen_length), mask_id)], 1)
    if attention_mask is not None:
        attention_mask = V.check_tensor("attention_mask", attention_mask).to(x.device)
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((B, gen_length))], 1)
    prompt = x != mask_id
    per_block = steps // num_blocks
    for b in range(num_blocks):
        start, end = P + b * block_length, P + (b + 1) * block_length
        counts = _even_split((x[:, start:end] == mask_id).sum(-1), per_block)
        for i in range(per_block):
            masked = x == mask_id
            with torch.no_grad():
                if cfg_scale > 0:
                    unconditional = torch.where(prompt, mask_id, x)
                    both = model(torch.cat([x, unconditional]), attention_mask=None if attention_mask is None
                                 else attention_mask.repeat(2, 1))
                    logits, logits_u = both.chunk(2)
                    logits = logits_u + (cfg_scale + 1) * (logits - logits_u)
                else:
                    logits = model(x, attention_mask=attention_mask)
            noisy = logits
            if temperature > 0:
                u = torch.rand(logits.shape, dtype=torch.float64, device=x.device, generator=generator)
                noisy = logits.to(torch.float64).exp() / (-torch.log(u)) ** temperature
            candidate = noisy.argmax(-1)
            if remasking == "low_confidence":
                confidence = logits.softmax(-1).gather(-1, candidate[..., None])[..., 0]
            else:
                confidence = torch.rand((B, x.shape[1]), device=x.device, generator=generator)
            confidence[:, end:] = -torch.inf
            candidate = torch.where(masked, candidate, x)
            confidence = torch.where(masked, confidence, -torch.inf)
            order = confidence.argsort(dim=-1, descending=True, stable=True)  # the k most confident: rank < k
            columns = torch.arange(x.shape[1], device=x.device).expand_as(order)
            rank = torch.empty_like(order).scatter_(-1, order, columns)
            x = torch.where(rank < counts[:, i : i + 1], candidate, x)
    return x

"""Dream's own sampler (its ``diffusion_generate``), for :meth:`DreamLM.diffusion_generate
<unifusion.hf.dream.model.DreamLM.diffusion_generate>`: the verified reference that
``generate(policy=DreamOrder(alg, alg_temp=...))`` (:class:`~unifusion.samplers.policies.DreamOrder`) is tested
against.

The generated region (``max_new_tokens`` masks after the prompt) is decoded as one block in ``steps`` full-sequence
calls on the time grid t_k = 1 − k (1 − ε) / steps (k = 0 … steps). At step k, with s = t_{k+1}:

* ``alg="origin"``: each masked position is revealed with probability 1 − s/t (1 at the last step), its token drawn
  from x_θ (MDLM's ancestral step);
* ``alg="maskgit_plus"`` / ``"topk_margin"`` / ``"entropy"``: every masked position gets a candidate (the argmax at
  ``temperature=0``, else a draw) and a confidence — the candidate's probability, the top-two margin, or the negative
  entropy Σ p log p — and the ``n_k = ⌊m̄ (1 − s/t)⌋`` most confident are revealed (all at the last step), m̄ the mean
  count of masked positions per row; with ``alg_temp`` the n_k are drawn from ``softmax(confidence / alg_temp)``.

As in Dream's code, x_θ here is the softmax over the whole vocabulary (the mask token included), after temperature,
top-p and top-k; ``n_k`` is 0 on early steps of long runs (⌊·⌋): the schedule
:class:`~unifusion.samplers.policies.TimeGrid`, which the other policies take as ``schedule=``.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from ... import _validation as V
from ...denoiser import Denoiser
from ...samplers.policies.reference import DREAM_ALGORITHMS, dream_probs

__all__ = ["ALGORITHMS", "diffusion_generate"]

ALGORITHMS = DREAM_ALGORITHMS
"""Dream's ``alg`` values (:data:`~unifusion.samplers.policies.reference.DREAM_ALGORITHMS`)."""


def _candidates(logits: torch.Tensor, alg: str, temperature: float, top_p: float | None, top_k: int | None,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(confidence, token)`` ``(n,)`` of masked positions' logits ``(n, V)``."""
    probs = dream_probs(logits, temperature if temperature > 0 else None, top_p, top_k)
    if temperature > 0:
        token = torch.multinomial(probs, 1, generator=generator)[:, 0]
        confidence = probs.gather(-1, token[:, None])[:, 0]
    else:
        confidence, token = probs.max(-1)
    if alg == "topk_margin":
        top = probs.topk(2, -1).values
        confidence = top[:, 0] - top[:, 1]
    elif alg == "entropy":
        confidence = (probs * torch.log(probs + 1e-10)).sum(-1)
    return confidence, token


def diffusion_generate(model: Denoiser, prompt_ids: torch.Tensor, *, max_new_tokens: int, steps: int = 512,
                       alg: Literal["origin", "maskgit_plus", "topk_margin", "entropy"] = "origin",
                       attention_mask: torch.Tensor | None = None, eps: float = 1e-3, temperature: float = 0.0,
                       top_p: float | None = None, top_k: int | None = None, alg_temp: float | None = None,
                       generator: torch.Generator | None = None) -> torch.Tensor:
    """Dream's sampler (module docstring) on ``model`` (a shifted x0 denoiser with a mask token: a
    :class:`~unifusion.hf.dream.model.DreamLM`): ``(B, P + max_new_tokens)`` token ids.

    Args:
        model: the denoiser, called as ``model(x, attention_mask=...)`` → x0 logits ``(B, L, V)``.
        prompt_ids: ``(B, P)`` int64, left-padded.
        max_new_tokens: tokens to generate (≥ 1).
        steps: model calls (≥ 1).
        alg: ``"origin"``, ``"maskgit_plus"``, ``"topk_margin"`` or ``"entropy"``.
        attention_mask: ``(B, P)`` 1 = real token (left padding), or ``None``.
        eps: the grid's last time ε.
        temperature: ``0`` decodes greedily; ``T > 0`` draws from ``softmax(logits / T)``.
        top_p: nucleus truncation, or ``None``.
        top_k: top-k truncation, or ``None``.
        alg_temp: draw the revealed positions from ``softmax(confidence / alg_temp)`` instead of the top ones.
        generator: randomness of the draws.
    """
    if alg not in ALGORITHMS:
        raise ValueError(f"alg: expected one of {ALGORITHMS}, got {alg!r}")
    prompt_ids = V.check_token_batch("prompt_ids", prompt_ids)
    new = V.check_positive_int("max_new_tokens", max_new_tokens)
    steps = V.check_positive_int("steps", steps)
    generator = V.check_generator(generator)
    mask_id = model.mask_token_id
    if mask_id is None:
        raise ValueError(f"model: Dream's sampler reveals masked positions; {type(model).__name__} has no mask token")
    B, P = prompt_ids.shape
    x = F.pad(prompt_ids, (0, new), value=mask_id)
    if attention_mask is not None:
        attention_mask = F.pad(V.check_tensor("attention_mask", attention_mask).to(x.device, torch.long), (0, new),
                               value=1)
    times = torch.linspace(1, eps, steps + 1, device=x.device)
    for k in range(steps):
        masked = x == mask_id
        with torch.no_grad():
            logits = model(x, attention_mask=attention_mask)[masked].float()
        t, s = times[k], times[k + 1]
        last = k == steps - 1
        if alg == "origin":
            reveal = torch.rand(logits.shape[0], device=x.device, generator=generator) < (1.0 if last else 1 - s / t)
            tokens = torch.full((logits.shape[0],), mask_id, dtype=x.dtype, device=x.device)
            if bool(reveal.any()):
                tokens[reveal] = _candidates(logits[reveal], "origin", temperature, top_p, top_k, generator)[1]
            x[masked] = tokens
            continue
        confidence, tokens = _candidates(logits, alg, temperature, top_p, top_k, generator)
        mean_masked = masked.sum() / B
        count = int(mean_masked) if last else int(mean_masked * (1 - s / t))
        if count <= 0:
            continue
        full = torch.full(x.shape, -torch.inf, dtype=confidence.dtype, device=x.device)
        full[masked] = confidence
        if alg_temp:
            chosen = torch.multinomial((full / alg_temp).softmax(-1), count, generator=generator)
        else:
            chosen = full.topk(count, -1).indices
        proposal = torch.full_like(x, mask_id)
        proposal[masked] = tokens
        rows = torch.arange(B, device=x.device)[:, None].expand_as(chosen)
        x[rows, chosen] = proposal[rows, chosen]
    return x

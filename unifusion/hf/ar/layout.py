"""The network's input layout: which ids go in at which positions, their position ids, and the attention pattern over
them. :class:`DiffusionLM <unifusion.hf.DiffusionLM>` builds one per call, then hands the pattern to an attention
strategy (:mod:`unifusion.hf.ar.attention`).

**The shifted layout** (paper §3.2, "AR as the x0 model"). The network runs on ``[BOS, x_t^1, ..., x_t^L]`` (``n = L +
1`` positions) and output ``i`` predicts ``x_0^{i+1}``: the prediction for token ``i`` is read at the position of
token ``i − 1`` (BOS for the first), and the last position's output is dropped. With causal attention and a clean
input this is exactly the AR model's next-token prediction.

**Padding** (``attention_mask``, 1 = real token) must be contiguous: right padding or left padding. Padded keys are
blocked; padded queries see only themselves (so no row is empty and nothing is NaN). For left padding, BOS is placed
just before the first real token and position ids count real tokens only, so a padded row equals the unpadded one on
its real positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import AnnealedPattern, AttentionPattern

__all__ = ["Layout", "shifted_layout"]


@dataclass(frozen=True)
class Layout:
    """What the wrapped model runs on, for one call.

    Attributes:
        input_ids: ``(B, n)`` int64 ids of the network positions.
        position_ids: ``(B, n)`` position ids, or ``None`` for ``0 .. n − 1`` (the model's default).
        pattern: which key each query may attend.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor | None
    pattern: AttentionPattern


def shifted_layout(x_t: torch.Tensor, bos_token_id: int, gamma: float | torch.Tensor, *,
                   attention_mask: torch.Tensor | None = None, generator: torch.Generator | None = None) -> Layout:
    """The shifted layout ``[BOS, x_t]`` of checked tokens ``x_t`` ``(B, L)`` with the annealed pattern of ``γ = gamma``
    (a float or a 0-d tensor; :class:`~unifusion.hf.ar.attention.AnnealedPattern`), padded by ``attention_mask``
    ``(B, L)`` bool (contiguous)."""
    B, L = x_t.shape
    device = x_t.device
    bos = torch.full((B, 1), bos_token_id, dtype=x_t.dtype, device=device)
    if attention_mask is None:
        ids = torch.cat([bos, x_t], dim=1)  # (B, L+1)
        return Layout(ids, None, AnnealedPattern(B, L + 1, gamma, generator=generator, device=device))
    # p = number of leading pads; BOS goes at index p, real tokens follow, pads stay where they are.
    p = (attention_mask.long().cumsum(-1) == 0).sum(-1, keepdim=True)  # (B, 1)
    j = torch.arange(L + 1, device=device)[None, :]  # (1, L+1)
    shifted = torch.cat([bos, x_t], dim=1)
    unshifted = torch.cat([x_t, bos], dim=1)
    ids = torch.where(j < p, unshifted, torch.where(j == p, bos, shifted))
    ones = torch.ones((B, 1), dtype=torch.bool, device=device)
    valid_shifted = torch.cat([ones, attention_mask], dim=1)
    key_valid = torch.where(j < p, False, torch.where(j == p, True, valid_shifted))  # (B, L+1)
    position_ids = (key_valid.long().cumsum(-1) - 1).clamp_min(0)
    pattern = AnnealedPattern(B, L + 1, gamma, key_valid=key_valid, generator=generator, device=device)
    return Layout(ids, position_ids, pattern)

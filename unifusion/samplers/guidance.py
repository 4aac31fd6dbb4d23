"""Classifier-free guidance at the seam where a decoding policy gets its logits (LLaDA's ``cfg_scale``): the x0
callable that ``generate(cfg_scale=w)`` hands :class:`~unifusion.samplers.PolicySampler` on a fully bidirectional
model.

Each call runs the rows and their unconditional copies — every prompt column (padding included) set to the mask id —
in one batch of 2B rows, and returns z = z_u + (w + 1)(z − z_u), z the conditional logits and z_u the unconditional
ones (LLaDA's ``generate.py``; w = 0 gives z).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..denoiser import DecodableModel, X0Model

__all__ = ["ClassifierFreeGuidance", "check_cfg_scale", "guided_x0_model"]


def check_cfg_scale(cfg_scale: object) -> float:
    """``cfg_scale`` as a float w ≥ 0 (``TypeError``/``ValueError`` naming it otherwise)."""
    if isinstance(cfg_scale, bool) or not isinstance(cfg_scale, (int, float)):
        raise TypeError(f"cfg_scale: expected a float >= 0, got {type(cfg_scale).__name__}")
    if not (math.isfinite(cfg_scale) and cfg_scale >= 0):
        raise ValueError(f"cfg_scale: expected a finite float >= 0, got {cfg_scale}")
    return float(cfg_scale)


def guided_x0_model(model: DecodableModel, x0_model: X0Model | None, kernel: Any, policy: Any, scale: float,
                    prompt_columns: int) -> X0Model:
    """The full-sequence x0 callable with classifier-free guidance (:class:`ClassifierFreeGuidance`) for
    ``generate(cfg_scale=w)``: ``x0_model`` (``None`` on a cached path) under guidance ``scale`` with the first
    ``prompt_columns`` columns as the prompt; a ``ValueError`` naming ``cfg_scale`` where it does not apply."""
    why = None
    if model.block_size is not None:
        why = "a block model's blocks see only earlier blocks; guidance is for fully bidirectional models"
    elif x0_model is None:
        why = "the prefix cache (cache_refresh) runs K + 1 positions per call; guidance runs full-sequence calls"
    elif kernel.mask_id is None:
        why = "the unconditional call masks the prompt, and the kernel has no mask state"
    elif getattr(policy, "reads_hidden", False):
        why = f"{type(policy).__name__} reads the model's hidden states, which guidance does not combine"
    if why is not None:
        raise ValueError(f"cfg_scale: {why}")
    assert x0_model is not None
    return ClassifierFreeGuidance(x0_model, kernel.mask_id, prompt_columns, scale, model.num_states)


class ClassifierFreeGuidance:
    """Classifier-free guidance (LLaDA's ``cfg_scale``): the rows and their unconditional copies (every one of the
    first ``prompt_columns`` columns set to the mask id) in one call of 2B rows; z = z_u + (w + 1)(z − z_u)."""

    def __init__(self, model: X0Model, mask_id: int, prompt_columns: int, scale: float, num_states: int) -> None:
        self.model, self.mask_id, self.prompt_columns, self.scale = model, mask_id, prompt_columns, scale
        self.num_states = num_states

    def __call__(self, x_t: torch.Tensor, t: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        unconditional = x_t.clone()
        unconditional[:, :self.prompt_columns] = self.mask_id
        mask = kwargs.pop("attention_mask", None)
        if mask is not None:
            kwargs["attention_mask"] = torch.cat([mask, mask])
        both = self.model(torch.cat([x_t, unconditional]), None if t is None else torch.cat([t, t]), **kwargs)
        z, z_u = both.chunk(2)
        return z_u + (self.scale + 1) * (z - z_u)

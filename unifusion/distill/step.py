"""Distillation through a model: the certainty-forcing loss of masked views of teacher trajectories, and LoRA.

A view of a batch of :class:`~unifusion.distill.Trajectories` is the clean sequences ``x_0 = [prompt, completion]``
with the view's masked completion positions replaced by the mask token. On a block
:class:`~unifusion.hf.DiffusionLM` the view runs as block diffusion trains (``clean = x_0``: each block is predicted
from the clean blocks before it and its own noisy tokens), so the active block's prediction is the teacher's state
at the drawn step (:func:`~unifusion.distill.pseudo_trajectory_mask`); a plain model sees the whole view at once.
The loss is :func:`~unifusion.distill.certainty_forcing_loss` of the view's logits with the mask token's column left
out of the student's distribution (the library's mask-kernel convention), computed through the output head by
:func:`~unifusion.distill.fused_certainty_forcing_loss` (no ``(N, V)`` logits; ``fused=False`` materialises them).

:func:`complementary_pair_loss` is dParallel's training step: a view and its complement in one forward over
``2B`` rows, their two losses summed. The hidden states come from the model's layout functions
(:meth:`~unifusion.hf.DiffusionLM.hidden_states`, :func:`unifusion.hf.ar.blocks.block_hidden_states`), not from a
call of the module: under DDP / FSDP wrap-time hooks do not fire, so call this on the unwrapped model (or
synchronise gradients by hand).

Example (LoRA, a user's loop)::

    student = uf.distill.add_lora(model, r=8)
    opt = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=1e-4)
    for rows in batches:
        loss = uf.distill.distillation_loss(student, traj.select(rows), generator=g)
        loss.backward(); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch

from ..hf.ar import blocks
from ..hf.ar.model import DiffusionLM
from .fused import fused_certainty_forcing_loss
from .losses import certainty_forcing_loss
from .masks import DistillMask, draw_trajectory_steps, pseudo_trajectory_mask, random_block_mask, view_times
from .trajectories import Trajectories

__all__ = ["view_loss", "complementary_pair_loss", "distillation_loss", "add_lora"]


def _check_model(model: object) -> DiffusionLM:
    if not isinstance(model, DiffusionLM):
        raise TypeError(f"model: expected an adapted DiffusionLM (adapt_ar_model), got {type(model).__name__}")
    if model.mask_token_id is None:
        raise ValueError("model: distillation masks tokens; this model has no mask token (uniform noise only)")
    return model


def _hidden(model: DiffusionLM, x_t: torch.Tensor, x0: torch.Tensor, masked: torch.Tensor,
            attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Final hidden states ``(B, L, d)`` of the views ``x_t`` (block layout with ``clean = x0`` on a block model)."""
    K = model.block_size
    t = view_times(masked, block_size=K) if model.time_conditioning else None
    if K is None or K >= x0.shape[1]:
        return model.hidden_states(x_t, None if t is None else (t if t.dim() == 1 else t[:, 0]),
                                   attention_mask=attention_mask)
    mask = None if attention_mask is None else attention_mask.to(torch.bool)
    return blocks.block_hidden_states(model, model.hf_model, x_t, t, x0, 1.0, mask)


def view_loss(model: DiffusionLM, x0: torch.Tensor, masked: torch.Tensor, *,
              attention_mask: torch.Tensor | None = None, temperature: float = 0.5, entropy_weight: float = 2.0,
              fused: bool = True) -> torch.Tensor:
    """Certainty forcing of one view (0-d; module docstring).

    Args:
        model: the student, an adapted :class:`~unifusion.hf.DiffusionLM` with a mask token.
        x0: ``(B, L)`` clean sequences (the teacher's tokens are the targets).
        masked: ``(B, L)`` bool, the view's masked positions.
        attention_mask: ``(B, L)``, 1 at real tokens (left padding of the prompts).
        temperature: T > 0 of the entropy.  entropy_weight: λ >= 0 (:func:`~unifusion.distill.certainty_forcing_loss`).
        fused: through the output head in blocks (default) or on materialised logits.
    """
    model = _check_model(model)
    if not isinstance(x0, torch.Tensor) or x0.dim() != 2:
        raise ValueError("x0: expected a (B, L) tensor of token ids")
    if not isinstance(masked, torch.Tensor) or tuple(masked.shape) != tuple(x0.shape) or masked.dtype != torch.bool:
        raise ValueError(f"masked: expected a {tuple(x0.shape)} bool tensor like x0")
    mask_id = int(model.mask_token_id)  # type: ignore[arg-type]
    x_t = torch.where(masked, mask_id, x0)
    h = _hidden(model, x_t, x0, masked, attention_mask)
    if fused:
        return fused_certainty_forcing_loss(
            h, model.lm_head_weight, x0, masked, temperature=temperature, entropy_weight=entropy_weight,
            lm_head_bias=model.lm_head_bias, logit_scale=model.logit_scale,
            final_logit_softcap=model.final_logit_softcap, mask_id=mask_id)
    return certainty_forcing_loss(model.logits_from_hidden(h), x0, masked, temperature=temperature,
                                  entropy_weight=entropy_weight, mask_id=mask_id)


def complementary_pair_loss(model: DiffusionLM, x0: torch.Tensor, view: DistillMask, *,
                            attention_mask: torch.Tensor | None = None, temperature: float = 0.5,
                            entropy_weight: float = 2.0, fused: bool = True) -> torch.Tensor:
    """dParallel's step: the certainty forcing of ``view`` plus that of its complement (0-d), both views in one
    forward of ``2B`` rows.

    Args:
        x0: ``(B, L)`` clean sequences; ``view``'s masks cover their last ``C`` columns (the completion).
        view: a :class:`~unifusion.distill.DistillMask` ``(B, C)``.
        attention_mask: as in :func:`view_loss`.  temperature: T.  entropy_weight: λ.  fused: as in :func:`view_loss`.
    """
    model = _check_model(model)
    if not isinstance(view, DistillMask):
        raise TypeError(f"view: expected a DistillMask, got {type(view).__name__}")
    B, L = x0.shape
    if view.masked.dim() != 2 or view.masked.shape[0] != B or view.masked.shape[1] > L:
        raise ValueError(f"view: expected masks of shape ({B}, C) with C <= {L} (the completion columns), got "
                         f"{tuple(view.masked.shape)}")
    C = view.masked.shape[1]
    pad = torch.zeros((B, L - C), dtype=torch.bool, device=x0.device)
    first = torch.cat([pad, view.masked.to(x0.device)], 1)
    second = torch.cat([pad, view.complement().masked.to(x0.device)], 1)
    both_x0 = torch.cat([x0, x0])
    both_masked = torch.cat([first, second])
    mask_id = int(model.mask_token_id)  # type: ignore[arg-type]
    am = None if attention_mask is None else torch.cat([attention_mask, attention_mask])
    h = _hidden(model, torch.where(both_masked, mask_id, both_x0), both_x0, both_masked, am)
    total = torch.zeros((), device=h.device)
    for part in (slice(0, B), slice(B, 2 * B)):
        if fused:
            total = total + fused_certainty_forcing_loss(
                h[part], model.lm_head_weight, x0, both_masked[part], temperature=temperature,
                entropy_weight=entropy_weight, lm_head_bias=model.lm_head_bias, logit_scale=model.logit_scale,
                final_logit_softcap=model.final_logit_softcap, mask_id=mask_id)
        else:
            total = total + certainty_forcing_loss(model.logits_from_hidden(h[part]), x0, both_masked[part],
                                                   temperature=temperature, entropy_weight=entropy_weight,
                                                   mask_id=mask_id)
    return total


def distillation_loss(model: DiffusionLM, batch: Trajectories, *,
                      masks: Literal["trajectory", "random"] = "trajectory", ratio: float = 0.5,
                      per_block: bool = False, later_blocks: Literal["clean", "masked"] = "clean",
                      temperature: float = 0.5, entropy_weight: float = 2.0, fused: bool = True,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """One distillation step's loss on a batch of trajectories (0-d): draw a view — d3LLM's pseudo-trajectory
    mask at a uniformly drawn state (``masks="trajectory"``; ``per_block``: one state per block) or dParallel's
    random block mask at ``ratio`` (``"random"``) — and return :func:`complementary_pair_loss` of it."""
    model = _check_model(model)
    if not isinstance(batch, Trajectories):
        raise TypeError(f"batch: expected Trajectories, got {type(batch).__name__}")
    device = model.device
    steps = batch.commit_step.to(device)
    K = batch.block_size
    if masks == "trajectory":
        s = draw_trajectory_steps(steps, block_size=K, per_block=per_block, generator=generator)
        view = pseudo_trajectory_mask(steps, s, block_size=K, later_blocks=later_blocks)
    elif masks == "random":
        view = random_block_mask(torch.ones_like(steps, dtype=torch.bool), ratio, block_size=K,
                                 generator=generator, later_blocks=later_blocks)
    else:
        raise ValueError(f"masks: expected 'trajectory' or 'random', got {masks!r}")
    return complementary_pair_loss(model, batch.sequences.to(device), view,
                                   attention_mask=batch.attention_mask.to(device), temperature=temperature,
                                   entropy_weight=entropy_weight, fused=fused)


def add_lora(model: DiffusionLM, *, r: int = 8, lora_alpha: int = 16, lora_dropout: float = 0.0,
             target_modules: str | Sequence[str] = "all-linear", **lora_kwargs: Any) -> DiffusionLM:
    """LoRA adapters (peft) in the student's backbone, in place, and every other parameter frozen: distillation
    then trains (and changes) only the adapters. Returns ``model``. Merge before ``save_pretrained``
    (``model.hf_model.merge_and_unload()`` through peft) or save the adapters with peft."""
    model = _check_model(model)
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as err:  # pragma: no cover - peft is an optional dependency
        raise ImportError("add_lora needs peft (pip install peft)") from err
    config = LoraConfig(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                        target_modules=target_modules if isinstance(target_modules, str) else list(target_modules),
                        **lora_kwargs)
    inject_adapter_in_model(config, model.hf_model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"target_modules: no module of the backbone matched {target_modules!r}")
    return model

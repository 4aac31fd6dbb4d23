"""Distillation through a model: the certainty-forcing loss of masked views of teacher trajectories, and LoRA.

A view of a batch of :class:`~unifusion.distill.Trajectories` is the clean sequences ``x_0 = [prompt, completion]``
with the view's masked completion positions replaced by the mask token. The student is any
:class:`~unifusion.denoiser.Denoiser` with a mask token and final hidden states (an adapted
:class:`~unifusion.hf.DiffusionLM`, a released kind of :mod:`unifusion.hf.native`: LLaDA, Dream, LLaDA-MoE, SDAR,
Fast-dLLM v2, LLaDA 2): its ``hidden_states(x_t, t, attention_mask=..., **model.block_conditioning(x_0))``, row i the
state its head reads to predict token i. On a block model (:attr:`~unifusion.denoiser.Denoiser.block_size`) the view
runs as block diffusion trains (the clean stream of :meth:`~unifusion.denoiser.Denoiser.block_conditioning`: each
block is predicted from the clean blocks before it and its own noisy tokens), so the active block's prediction is the
teacher's state at the drawn step (:func:`~unifusion.distill.pseudo_trajectory_mask`); a model without blocks sees
the whole view at once. A shifted kind (Dream, Fast-dLLM v2: token i predicted at column i − 1) is scored as
:func:`~unifusion.diffusion_loss` scores it: its ``hidden_states`` already gives, at column i, the column its head
reads for token i.
The loss is :func:`~unifusion.distill.certainty_forcing_loss` of the view's logits with the mask token's column left
out of the student's distribution (the library's mask-kernel convention), computed through the output head by
:func:`~unifusion.distill.fused_certainty_forcing_loss` (no ``(N, V)`` logits; ``fused=False`` materialises them
with the model's ``logits_from_hidden``). The fused head reads ``lm_head_weight`` ``(V, d)`` and, where the model has
them, ``lm_head_bias``, ``logit_scale`` and ``final_logit_softcap`` (absent: no bias, 1, no cap).

:func:`complementary_pair_loss` is dParallel's training step: a view and its complement in one forward over
``2B`` rows, their two losses summed.

**Wrapped models.** The loss runs inside the module's call: ``model(x_t, t, attention_mask=..., head_fn=loss_of,
**block_conditioning)``, the forward's ``head_fn`` taking the output head's place (``head_fn(h)``, ``h`` what
``hidden_states`` gives). So ``model`` may be the DDP / FSDP2 / DeepSpeed / ``torch.compile`` wrapper a training
loop holds: its hooks fire (DDP's gradient all-reduce, FSDP2's gathering of the weights the fused head reads) as
they do for :func:`~unifusion.diffusion_loss`. The loss is a mean over the masked positions of the rows given, so
under data parallelism each rank's loss is its own rows' mean and the wrappers average the gradients over ranks.

Example (LoRA, a user's loop)::

    student = uf.distill.add_lora(model, r=8)
    opt = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=1e-4)
    for rows in batches:
        loss = uf.distill.distillation_loss(student, traj.select(rows), generator=g)
        loss.backward(); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

import torch

from ..block_partition import (
    aligning_shifts,
    block_origin_of,
    generated_start,
    origin_columns,
    shift_left,
    shift_right,
)
from ..denoiser import Denoiser, unwrap_model
from .fused import fused_certainty_forcing_loss
from .losses import certainty_forcing_loss
from .masks import DistillMask, draw_trajectory_steps, pseudo_trajectory_mask, random_block_mask, view_times
from .trajectories import Trajectories

__all__ = ["view_loss", "complementary_pair_loss", "distillation_loss", "add_lora"]

StudentT = TypeVar("StudentT", bound=Denoiser)


def _check_model(model: object) -> tuple[Callable[..., torch.Tensor], Denoiser]:
    """``(call, denoiser)``: ``model`` as the loss calls it (any DDP / FSDP / DeepSpeed / compile wrapper kept, so
    that its hooks fire) and the :class:`~unifusion.denoiser.Denoiser` inside it, which must have a mask token and a
    forward that takes ``head_fn``."""
    inner = unwrap_model(model)
    if not isinstance(inner, Denoiser) or not callable(model):
        raise TypeError(f"model: expected a unifusion Denoiser (an adapted DiffusionLM, a released kind such as "
                        f"LLaDALM), or a DDP / FSDP / DeepSpeed / compile wrapper around one, got "
                        f"{type(inner).__name__}")
    if inner.mask_token_id is None:
        raise ValueError("model: distillation masks tokens; this model has no mask token (uniform noise only)")
    if not _forward_takes_head_fn(type(inner)):
        raise TypeError(f"model: distillation runs its loss on the final hidden states inside the model's call "
                        f"(forward(..., head_fn=)); {type(inner).__name__}.forward takes no head_fn")
    return model, inner


@functools.cache
def _forward_takes_head_fn(model_cls: type[Denoiser]) -> bool:
    """Whether ``model_cls.forward`` names a ``head_fn`` parameter (read once per class)."""
    return "head_fn" in inspect.signature(model_cls.forward).parameters


def _run_head(call: Callable[..., torch.Tensor], model: Denoiser, x_t: torch.Tensor, x0: torch.Tensor,
              masked: torch.Tensor, attention_mask: torch.Tensor | None,
              loss_of: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``loss_of(h)`` of the views ``x_t``'s final hidden states ``h`` ``(B, L, d)``, row i read by the head for
    token i (the block layout of :meth:`~unifusion.denoiser.Denoiser.block_conditioning` with ``x0`` on a block
    model over several blocks), computed inside ``call`` (the forward's ``head_fn``). A ``"sequence_start"`` kind's
    rows run behind ``(−o) mod K`` invisible left pads (o: the row's first real column), so that its blocks are cut
    from its first real token as its decoder cut them (:mod:`unifusion.block_partition`)."""
    K = model.block_size
    L = x0.shape[1]
    shifts = None
    if K is not None and attention_mask is not None and block_origin_of(model) == "sequence_start":
        valid = attention_mask.to(x0.device, torch.bool)
        shifts = aligning_shifts(origin_columns("sequence_start", valid, valid), K)
        width = L + int(shifts.max())  # one host read
        if width == L:
            shifts = None
        else:
            fill = x0.gather(1, generated_start(valid).clamp_max(L - 1)[:, None])  # any valid id: no query sees it
            x_t, x0 = shift_right(x_t, shifts, width, fill), shift_right(x0, shifts, width, fill)
            masked, attention_mask = shift_right(masked, shifts, width, False), shift_right(valid, shifts, width,
                                                                                            False)
    head_fn = loss_of
    if shifts is not None:
        aligned = shifts

        def head_fn(h: torch.Tensor) -> torch.Tensor:
            return loss_of(shift_left(h, aligned, L))

    t = view_times(masked, block_size=K) if getattr(model, "time_conditioning", False) else None
    if K is None or K >= x0.shape[1]:
        return call(x_t, None if t is None else (t if t.dim() == 1 else t[:, 0]), attention_mask=attention_mask,
                    head_fn=head_fn)
    return call(x_t, t, attention_mask=attention_mask, head_fn=head_fn, **model.block_conditioning(x0))


def _head_loss(model: Denoiser, h: torch.Tensor, x0: torch.Tensor, masked: torch.Tensor, mask_id: int,
               temperature: float, entropy_weight: float, fused: bool) -> torch.Tensor:
    """Certainty forcing of hidden states ``h`` ``(B, L, d)`` through the model's head (module docstring)."""
    if not fused:
        return certainty_forcing_loss(model.logits_from_hidden(h), x0, masked, temperature=temperature,
                                      entropy_weight=entropy_weight, mask_id=mask_id)
    weight = getattr(model, "lm_head_weight", None)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"model: the fused head reads lm_head_weight (V, d); {type(model).__name__} has none "
                        "(pass fused=False: logits_from_hidden)")
    return fused_certainty_forcing_loss(
        h, weight, x0, masked, temperature=temperature, entropy_weight=entropy_weight,
        lm_head_bias=getattr(model, "lm_head_bias", None), logit_scale=getattr(model, "logit_scale", 1.0),
        final_logit_softcap=getattr(model, "final_logit_softcap", None), mask_id=mask_id)


def view_loss(model: Denoiser | torch.nn.Module, x0: torch.Tensor, masked: torch.Tensor, *,
              attention_mask: torch.Tensor | None = None, temperature: float = 0.5, entropy_weight: float = 2.0,
              fused: bool = True) -> torch.Tensor:
    """Certainty forcing of one view (0-d; module docstring).

    Args:
        model: the student, a :class:`~unifusion.denoiser.Denoiser` with a mask token whose forward takes
            ``head_fn``, or the DDP / FSDP / DeepSpeed / compile wrapper around it (module docstring).
        x0: ``(B, L)`` clean sequences (the teacher's tokens are the targets).
        masked: ``(B, L)`` bool, the view's masked positions.
        attention_mask: ``(B, L)``, 1 at real tokens (left padding of the prompts).
        temperature: T > 0 of the entropy.  entropy_weight: λ >= 0 (:func:`~unifusion.distill.certainty_forcing_loss`).
        fused: through the output head in blocks (default) or on materialised logits.
    """
    call, inner = _check_model(model)
    if not isinstance(x0, torch.Tensor) or x0.dim() != 2:
        raise ValueError("x0: expected a (B, L) tensor of token ids")
    if not isinstance(masked, torch.Tensor) or tuple(masked.shape) != tuple(x0.shape) or masked.dtype != torch.bool:
        raise ValueError(f"masked: expected a {tuple(x0.shape)} bool tensor like x0")
    mask_id = int(inner.mask_token_id)  # type: ignore[arg-type]

    def loss_of(h: torch.Tensor) -> torch.Tensor:
        return _head_loss(inner, h, x0, masked, mask_id, temperature, entropy_weight, fused)

    return _run_head(call, inner, torch.where(masked, mask_id, x0), x0, masked, attention_mask, loss_of)


def complementary_pair_loss(model: Denoiser | torch.nn.Module, x0: torch.Tensor, view: DistillMask, *,
                            attention_mask: torch.Tensor | None = None, temperature: float = 0.5,
                            entropy_weight: float = 2.0, fused: bool = True) -> torch.Tensor:
    """dParallel's step: the certainty forcing of ``view`` plus that of its complement (0-d), both views in one
    forward of ``2B`` rows.

    Args:
        model: the student or its wrapper, as in :func:`view_loss`.
        x0: ``(B, L)`` clean sequences; ``view``'s masks cover their last ``C`` columns (the completion).
        view: a :class:`~unifusion.distill.DistillMask` ``(B, C)``.
        attention_mask: as in :func:`view_loss`.  temperature: T.  entropy_weight: λ.  fused: as in :func:`view_loss`.
    """
    call, inner = _check_model(model)
    return _pair_loss(call, inner, x0, view, attention_mask, temperature, entropy_weight, fused)


def _pair_loss(call: Callable[..., torch.Tensor], inner: Denoiser, x0: torch.Tensor, view: DistillMask,
               attention_mask: torch.Tensor | None, temperature: float, entropy_weight: float,
               fused: bool) -> torch.Tensor:
    """:func:`complementary_pair_loss` of a checked model (:func:`_check_model`)."""
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
    mask_id = int(inner.mask_token_id)  # type: ignore[arg-type]
    am = None if attention_mask is None else torch.cat([attention_mask, attention_mask])

    def loss_of(h: torch.Tensor) -> torch.Tensor:
        total = torch.zeros((), device=h.device)
        for part in (slice(0, B), slice(B, 2 * B)):
            total = total + _head_loss(inner, h[part], x0, both_masked[part], mask_id, temperature, entropy_weight,
                                       fused)
        return total

    return _run_head(call, inner, torch.where(both_masked, mask_id, both_x0), both_x0, both_masked, am, loss_of)


def distillation_loss(model: Denoiser | torch.nn.Module, batch: Trajectories, *,
                      masks: Literal["trajectory", "random"] = "trajectory", ratio: float = 0.5,
                      per_block: bool = False, later_blocks: Literal["clean", "masked"] = "clean",
                      temperature: float = 0.5, entropy_weight: float = 2.0, fused: bool = True,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """One distillation step's loss on a batch of trajectories (0-d): draw a view — d3LLM's pseudo-trajectory
    mask at a uniformly drawn state (``masks="trajectory"``) or dParallel's random block mask at ``ratio``
    (``"random"``) — and return :func:`complementary_pair_loss` of it.

    ``per_block`` (trajectory masks, a block model only): one state per block, so that every block of a trajectory
    is scored in the forward instead of one. A block model predicts each block from the clean blocks before it
    (``block_conditioning``) and never from a later one, so each block's view is the decoder's state exactly as
    with one state per row; a model without blocks would see the earlier blocks masked, which the decoder never
    showed it (``ValueError``).

    ``model`` is the student or the wrapper a training loop holds (:func:`view_loss`)."""
    call, inner = _check_model(model)
    if not isinstance(batch, Trajectories):
        raise TypeError(f"batch: expected Trajectories, got {type(batch).__name__}")
    if per_block and masks != "trajectory":
        raise ValueError(f"per_block: one state per block is an option of the trajectory masks "
                         f"(masks='trajectory'), got masks={masks!r}")
    if per_block and inner.block_size is None:
        raise ValueError(f"per_block: one state per block needs a block model (its blocks predicted from the clean "
                         f"blocks before them); {type(inner).__name__} has none (block_size None)")
    device = inner.device
    steps = batch.commit_step.to(device)
    K = batch.block_size
    if inner.block_size is not None and batch.block_origin != block_origin_of(inner):
        raise ValueError(f"batch: recorded with blocks from the {batch.block_origin}, the model's start at the "
                         f"{block_origin_of(inner)} (Denoiser.block_origin)")
    lead = batch.block_leads.to(device)
    if masks == "trajectory":
        s = draw_trajectory_steps(steps, block_size=K, per_block=per_block, generator=generator, lead=lead)
        view = pseudo_trajectory_mask(steps, s, block_size=K, later_blocks=later_blocks, lead=lead)
    elif masks == "random":
        view = random_block_mask(torch.ones_like(steps, dtype=torch.bool), ratio, block_size=K,
                                 generator=generator, later_blocks=later_blocks, lead=lead)
    else:
        raise ValueError(f"masks: expected 'trajectory' or 'random', got {masks!r}")
    return _pair_loss(call, inner, batch.sequences.to(device), view, batch.attention_mask.to(device), temperature,
                      entropy_weight, fused)


def add_lora(model: StudentT, *, r: int = 8, lora_alpha: int = 16, lora_dropout: float = 0.0,
             target_modules: str | Sequence[str] = "all-linear", **lora_kwargs: Any) -> StudentT:
    """LoRA adapters (peft) in the student's backbone, in place, and every other parameter frozen: distillation
    then trains (and changes) only the adapters. Returns ``model``. The backbone is the model's ``hf_model`` (the
    transformers module of an adapted or released kind), else the model itself; ``model`` must be a
    ``torch.nn.Module``, not yet wrapped (DDP / FSDP2 wrap the student with its adapters). Merge before
    ``save_pretrained`` (``model.hf_model.merge_and_unload()`` through peft) or save the adapters with peft."""
    _, inner = _check_model(model)
    if inner is not model:
        raise TypeError(f"model: add LoRA to the student before wrapping it, got a {type(model).__name__} around "
                        f"{type(inner).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: LoRA needs a torch.nn.Module student, got {type(model).__name__}")
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as err:  # pragma: no cover - peft is an optional dependency
        raise ImportError("add_lora needs peft (pip install peft)") from err
    config = LoraConfig(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                        target_modules=target_modules if isinstance(target_modules, str) else list(target_modules),
                        **lora_kwargs)
    inject_adapter_in_model(config, getattr(model, "hf_model", model))
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"target_modules: no module of the backbone matched {target_modules!r}")
    return model

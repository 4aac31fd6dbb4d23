"""What the losses, samplers and evaluation know of a unifusion model: the :class:`Denoiser` base class.

A denoiser is an x0 predictor x_θ(· | x_t, t): called as ``model(x_t (B, L), t (B,), **options)`` it returns
clean-token logits ``(B, L, S)`` over the kernel's ``S = num_states`` states. Any callable with that signature can be
trained and sampled; a :class:`Denoiser` additionally declares its state space and mask token, so that
:func:`~unifusion.diffusion_loss`, the samplers and the evaluation functions can check the kernel against it and use
the options it understands (attention annealing, padding, the fused loss). The Hugging Face adapters
(:class:`unifusion.hf.DiffusionLM`) subclass it.

**The prompt rule.** Every function that conditions a model on a clean prompt — :func:`~unifusion.diffusion_loss`,
:func:`~unifusion.eval.nll_bound`, the harness — keeps the prompt clean in ``x_t`` and calls the model with
:func:`prompt_conditioning`'s keyword arguments: nothing for a model that reads its prompt from ``x_t`` (a
:class:`~unifusion.DiffusionLM`, any x0 callable), the prompt mask and the clean tokens for a model that encodes its
prompt separately (:attr:`Denoiser.conditions_on_prompt`, e.g. DiffusionGemma).

This module sits below every module that takes a model, so they test ``isinstance(model, Denoiser)`` without
importing the layer that defines the models.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ConvertedHead", "Denoiser", "prompt_conditioning", "unwrap_model"]


class Denoiser:
    """Base class of unifusion's x0 denoisers (a marker with a documented interface; it holds no state).

    Subclasses provide:

    * ``num_states`` (int): the state-space size S of the kernels the model is trained with (its logit columns);
    * ``mask_token_id`` (int or ``None``): the absorbing state of mask and hybrid kernels, ``None`` for a model that
      knows only uniform noise;
    * ``__call__(x_t, t, *, bidirectional_prob=1.0, attention_mask=None, generator=None)`` → x0 logits
      ``(B, L, S)``, and with ``x0=``, ``kernel=`` (and the loss options of
      :func:`~unifusion.losses.fused_linear_diffusion_loss`) the fused per-position loss ``(B, L)``.

    A model whose prediction needs to be told where the clean prompt ends and which clean tokens precede the noisy
    ones (an encoder-decoder such as DiffusionGemma, which encodes the clean prefix into a cache) sets
    :attr:`conditions_on_prompt`; :func:`~unifusion.diffusion_loss` then also passes ``prompt_mask=`` and ``x0=``.
    """

    conditions_on_prompt: bool = False
    """Whether calls take ``prompt_mask=`` (``(B, L)`` bool) and the clean tokens ``x0=`` besides ``x_t``."""


def unwrap_model(model: Any) -> Any:
    """The module inside DDP / FSDP / DeepSpeed (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers."""
    inner = model
    for _ in range(4):
        nxt = getattr(inner, "module", None) or getattr(inner, "_orig_mod", None)
        if nxt is None:
            break
        inner = nxt
    return inner


def prompt_conditioning(model: Any, x0: torch.Tensor, prompt_mask: torch.Tensor | None) -> dict[str, Any]:
    """The keyword arguments that condition ``model`` on the clean prompt ``x0[prompt_mask]``, for a call
    ``model(x_t, t, **prompt_conditioning(model, x0, prompt_mask))`` whose ``x_t`` holds the prompt clean.

    ``{}`` without a prompt, and for a model that reads its prompt from ``x_t`` (a :class:`~unifusion.DiffusionLM` or
    any x0 callable: the clean prompt tokens are simply there). ``{"prompt_mask": prompt_mask, "x0": x0}`` for a
    model (inside any DDP/FSDP/compile wrapper) that declares :attr:`Denoiser.conditions_on_prompt` — it encodes the
    prompt, and reads the clean prefix of each canvas, separately.

    Args:
        model: the model (or its wrapper) about to be called.
        x0: clean tokens ``(B, L)`` of the call's rows.
        prompt_mask: ``(B, L)`` bool, True on the prompt, or ``None``.

    A model that conditions on a prompt and is given none cannot predict: a ``ValueError`` naming ``prompt_mask``.
    """
    if not getattr(unwrap_model(model), "conditions_on_prompt", False):
        return {}
    if prompt_mask is None:
        raise ValueError(f"prompt_mask: {type(unwrap_model(model)).__name__} conditions on a clean prompt it encodes "
                         "separately; pass prompt_mask ((B, L) bool, True on the prompt)")
    return {"prompt_mask": prompt_mask, "x0": x0}


class ConvertedHead:
    """Base class of wrappers that call an x0 model and return another parameterization's head
    (:func:`unifusion.samplers.x0_model_as` builds them).

    Subclasses hold ``model`` (the x0 model they call), ``kernel`` (the kernel their conversions use) and
    ``parameterization`` (``"x0"``, ``"sedd"``, ``"m2s"`` or ``"ctmc"``), so that the checks of the samplers and
    evaluators can look through them to the model inside.
    """

    model: Any
    kernel: Any
    parameterization: str

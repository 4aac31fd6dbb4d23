"""What the losses, samplers and evaluation know of a unifusion model: the :class:`Denoiser` base class.

A denoiser is an x0 predictor x_θ(· | x_t, t): called as ``model(x_t (B, L), t (B,), **options)`` it returns
clean-token logits ``(B, L, S)`` over the kernel's ``S = num_states`` states. Any callable with that signature can be
trained and sampled; a :class:`Denoiser` additionally declares its state space and mask token, so that
:func:`~unifusion.diffusion_loss`, the samplers and the evaluation functions can check the kernel against it and use
the options it understands (attention annealing, padding, the fused loss). The Hugging Face adapters
(:class:`unifusion.hf.DiffusionLM`) subclass it.

This module sits below every module that takes a model, so they test ``isinstance(model, Denoiser)`` without
importing the layer that defines the models.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ConvertedHead", "Denoiser"]


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

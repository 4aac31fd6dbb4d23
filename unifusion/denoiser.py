"""What the losses, samplers and evaluation know of a unifusion model: the :class:`Denoiser` interface.

A denoiser is an x0 predictor x_θ(· | x_t, t): called as ``model(x_t (B, L), t (B,), **options)`` it returns
clean-token logits ``(B, L, S)`` over the kernel's ``S = num_states`` states. Any callable with that signature can be
trained and sampled; a :class:`Denoiser` additionally declares its state space and mask token, so that
:func:`~unifusion.diffusion_loss`, the samplers and the evaluation functions can check the kernel against it and use
the options it understands (attention annealing, padding, the fused loss). :class:`Denoiser` is an abstract base class
(``abc.ABC``): a model class states what it provides by subclassing it, and cannot be instantiated while an abstract
member is missing; mypy checks the signatures. The Hugging Face adapters (:class:`unifusion.hf.DiffusionLM`) and the
native diffusion LMs of :mod:`unifusion.hf.registry` (:class:`~unifusion.hf.diffusion_gemma.DiffusionGemmaLM`)
subclass it.

**The prompt rule.** Every function that conditions a model on a clean prompt — :func:`~unifusion.diffusion_loss`,
:func:`~unifusion.eval.nll_bound`, the harness — keeps the prompt clean in ``x_t`` and calls the model with
:func:`prompt_conditioning`'s keyword arguments: nothing for a model that reads its prompt from ``x_t`` (a
:class:`~unifusion.DiffusionLM`, any x0 callable), the prompt mask and the clean tokens for a model that encodes its
prompt separately (:attr:`Denoiser.conditions_on_prompt`, e.g. DiffusionGemma).

This module sits below every module that takes a model, so they test ``isinstance(model, Denoiser)`` without
importing the layer that defines the models.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Any, Literal

import torch

__all__ = ["ConvertedHead", "Denoiser", "prompt_conditioning", "unwrap_model"]


class Denoiser(ABC):
    """The interface of unifusion's x0 denoisers (an abstract base class; it holds no state).

    Subclasses provide (abstract: a subclass missing one cannot be instantiated):

    * :attr:`num_states` (int): the state-space size S of the kernels the model is trained with (its logit columns);
    * :attr:`device`: where ``x_t`` must live;
    * :meth:`forward` ``(x_t, t, *, bidirectional_prob=1.0, attention_mask=None, generator=None, ...)`` → x0 logits
      ``(B, L, S)``, and with ``x0=``, ``kernel=`` (and the loss options of
      :func:`~unifusion.losses.fused_linear_diffusion_loss`) the fused per-position loss ``(B, L)`` (:meth:`loss`
      names that call); the model is called as ``model(x_t, t, ...)`` (``torch.nn.Module.__call__``);
    * :meth:`logits_from_hidden`: the output head on final hidden states (the fused loss runs it chunk by chunk);
    * :meth:`generate`: continue prompts (each model's own options and result);
    * :meth:`save_pretrained` / :meth:`from_pretrained`: a checkpoint folder with the kernel recorded.

    and set the instance attributes :attr:`mask_token_id` (the absorbing state of mask and hybrid kernels, ``None``
    for a model that knows only uniform noise) and :attr:`kernel` (the kernel it was trained with, when known).

    A model whose prediction needs to be told where the clean prompt ends and which clean tokens precede the noisy
    ones (an encoder-decoder such as DiffusionGemma, which encodes the clean prefix into a cache) sets
    :attr:`conditions_on_prompt`; :func:`prompt_conditioning` then gives it ``prompt_mask=`` and ``x0=``.
    """

    conditions_on_prompt: bool = False
    """Whether calls take ``prompt_mask=`` (``(B, L)`` bool) and the clean tokens ``x0=`` besides ``x_t``."""

    mask_token_id: int | None
    """The absorbing (mask) state of mask and hybrid kernels, ``None`` for a model that knows only uniform noise."""

    kernel: Any
    """The forward kernel the model was trained with, when known (``None`` otherwise)."""

    @property
    @abstractmethod
    def num_states(self) -> int:
        """The kernels' state-space size S (the logit columns)."""

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where ``x_t`` must live (the weights' device)."""

    @abstractmethod
    def forward(self, x_t: torch.Tensor, t: Any = None, *, bidirectional_prob: float = 1.0,
                attention_mask: torch.Tensor | None = None, generator: torch.Generator | None = None,
                x0: torch.Tensor | None = None, kernel: Any = None,
                objective: Literal["gidd", "mdlm", "sedd", "m2s", "ctmc"] = "gidd",
                weighting: Literal["elbo", "clip", "dynamic"] = "elbo", max_weight: float = 2.0,
                reduction: Literal["none", "sum", "mean"] = "none",
                position_weight: torch.Tensor | None = None) -> torch.Tensor:
        """x0 logits ``(B, L, S)`` of ``x_t`` at times ``t`` (``(B,)``, or what the model takes), attention annealed
        to ``bidirectional_prob`` where the model anneals, padding per ``attention_mask``; with ``x0`` and ``kernel``
        the fused loss ``(B, L)`` (``objective``, ``weighting``, ``max_weight``, ``reduction``, ``position_weight``
        as :func:`~unifusion.losses.fused_linear_diffusion_loss` takes them). Subclasses add their own options."""

    @abstractmethod
    def logits_from_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """The output head on final hidden states ``(..., d)`` → logits ``(..., S)``."""

    @abstractmethod
    def generate(self, prompt_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """Continue ``prompt_ids`` ``(B, P)``: ``(B, P + new)`` token ids (or the model's output record)."""

    @abstractmethod
    def save_pretrained(self, save_directory: str | os.PathLike[str], tokenizer: Any = None, *,
                        kernel: Any = None) -> None:
        """Write a checkpoint folder that :meth:`from_pretrained` reads back, with the kernel recorded."""

    @classmethod
    @abstractmethod
    def from_pretrained(cls, directory: str | os.PathLike[str], *, dtype: torch.dtype | str | None = None,
                        device: torch.device | str | None = None, load_tokenizer: bool = True) -> Denoiser:
        """Load a folder written by :meth:`save_pretrained` (in ``dtype``, on ``device``, with the tokenizer saved
        beside it unless ``load_tokenizer=False``), in eval mode, the recorded kernel as :attr:`kernel`."""

    def loss(self, x_t: torch.Tensor, t: Any, x0: torch.Tensor, kernel: Any, **kwargs: Any) -> torch.Tensor:
        """The fused per-position loss ``(B, L)``: ``self(x_t, t, x0=x0, kernel=kernel, **kwargs)`` (under DDP/FSDP
        call the wrapper that way instead, so its hooks fire)."""
        return self(x_t, t, x0=x0, kernel=kernel, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``forward`` (a ``torch.nn.Module`` subclass listed before :class:`Denoiser` calls it through its hooks)."""
        return self.forward(*args, **kwargs)


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

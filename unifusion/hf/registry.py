"""Native diffusion LMs of transformers, wrapped as unifusion denoisers: one registry keyed by ``config.model_type``.

An autoregressive model is *adapted* (:func:`unifusion.adapt_ar_model`); a model that already is a diffusion LM is
*wrapped*: :func:`wrap_diffusion_lm` looks its ``config.model_type`` up here and returns the registered wrapper, an
x0 :class:`~unifusion.denoiser.Denoiser` with its kernel. DiffusionGemma (``"diffusion_gemma"``) is registered; a
third party registers another family with :func:`register_diffusion_lm`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from ..denoiser import Denoiser

__all__ = ["register_diffusion_lm", "supported_diffusion_lms", "wrap_diffusion_lm"]

Wrapper = Callable[..., Denoiser]


def _wrap_diffusion_gemma(model: Any, **kwargs: Any) -> Denoiser:
    from transformers import DiffusionGemmaForBlockDiffusion

    from .diffusion_gemma import DiffusionGemmaLM

    if not isinstance(model, DiffusionGemmaForBlockDiffusion):
        raise TypeError(f"model: expected a DiffusionGemmaForBlockDiffusion (the model with its output head), got "
                        f"{type(model).__name__}")
    if getattr(model.config.get_text_config(), "use_bidirectional_attention", None) == "all":
        raise ValueError("model: use_bidirectional_attention='all' makes the encoder bidirectional, so a canvas's "
                         "clean prefix depends on how it was split into encoder calls; only causal encoders "
                         "(None or 'vision') are supported")
    return DiffusionGemmaLM(model, **kwargs)


_REGISTRY: dict[str, Wrapper] = {"diffusion_gemma": _wrap_diffusion_gemma}


def supported_diffusion_lms() -> list[str]:
    """The ``config.model_type`` values :func:`wrap_diffusion_lm` wraps, sorted."""
    return sorted(_REGISTRY)


def register_diffusion_lm(model_type: str, wrapper: Wrapper) -> None:
    """Register ``wrapper(model, **kwargs) -> Denoiser`` for models whose ``config.model_type`` is ``model_type``
    (replacing an earlier entry with a warning)."""
    if not isinstance(model_type, str) or not model_type:
        raise TypeError(f"model_type: expected a non-empty str, got {model_type!r}")
    if not callable(wrapper):
        raise TypeError(f"wrapper: expected a callable (model, **kwargs) -> Denoiser, got {type(wrapper).__name__}")
    if model_type in _REGISTRY:
        warnings.warn(f"register_diffusion_lm: replacing the wrapper of {model_type!r}", stacklevel=2)
    _REGISTRY[model_type] = wrapper


def wrap_diffusion_lm(model: Any, **kwargs: Any) -> Denoiser:
    """Wrap a transformers diffusion LM as a unifusion x0 denoiser, chosen by ``model.config.model_type``.

    Args:
        model: e.g. a ``DiffusionGemmaForBlockDiffusion``. It is wrapped, not copied.
        **kwargs: passed to the family's wrapper (DiffusionGemma: ``tokenizer=``, ``kernel=``).

    Returns:
        The wrapper (for DiffusionGemma a :class:`~unifusion.hf.diffusion_gemma.DiffusionGemmaLM` under
        ``UniformKernel(V)``). A model that is already a :class:`~unifusion.denoiser.Denoiser` is returned as it is,
        with a warning.

    Raises:
        ValueError: the model type is not registered (the message lists the supported ones); an AR model is
            adapted with :func:`unifusion.adapt_ar_model` instead.
    """
    if isinstance(model, Denoiser):
        warnings.warn("wrap_diffusion_lm: the model is already a unifusion denoiser; returning it unchanged",
                      stacklevel=2)
        return model
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in _REGISTRY:
        raise ValueError(f"model: wrap_diffusion_lm supports the diffusion LMs {supported_diffusion_lms()}, got "
                         f"{type(model).__name__} with config.model_type={model_type!r}; adapt an autoregressive "
                         "model with unifusion.adapt_ar_model instead")
    return _REGISTRY[model_type](model, **kwargs)

"""Native diffusion LMs of transformers, wrapped as unifusion denoisers: one registry keyed by ``config.model_type``.

An autoregressive model is *adapted* (:func:`unifusion.adapt_ar_model`, the kind in :mod:`unifusion.hf.ar`); a model
that already is a diffusion LM is *wrapped*: :func:`wrap_diffusion_lm` looks its ``config.model_type`` up here and
returns the registered wrapper, an x0 :class:`~unifusion.denoiser.Denoiser` with its kernel. A checkpoint folder of a
registered kind (its ``config.json`` names the ``model_type``) loads with :func:`load_registered`, which is how
:func:`unifusion.hf.load_diffusion_model`, the command line and the lm-eval harness (``pretrained=DIR``) read it.

This module names no model kind: each kind registers itself, the way peft's tuners do. ``unifusion.hf`` imports its
built-in kinds (the subpackages of ``unifusion/hf/``), whose ``__init__`` calls :func:`register_diffusion_lm`; a
third party calls it from its own package.

**Adding a model kind** (a native dLLM such as LLaDA 2, SDAR or Dream) is one folder and one registration:

1. ``unifusion/hf/<kind>/model.py``: the wrapper class, a :class:`~unifusion.denoiser.DenoiserModule` subclass (what
   it implements: docs/architecture.md, "The model interface"), and a function ``wrap(model, **kwargs)`` that checks
   the transformers model and builds the wrapper; further concepts of the kind (its layout, its cache, its
   ``generate``) are further modules of the folder.
2. ``unifusion/hf/<kind>/__init__.py``: re-export the public names and register the kind by its
   ``config.model_type``: ``register_diffusion_lm("<model_type>", wrap, loader=Wrapper.from_pretrained)``.
3. ``unifusion/hf/__init__.py``: import the kind (``from . import <kind>``, which runs the registration) and
   re-export its public names; docs/architecture.md: add ``hf/<kind>/`` to layer 4 (``tests/test_imports.py`` then
   checks that it imports no other kind and nothing above it), and docs/api/hf.md its modules.

A kind imports from the layers below ``hf`` and from this module, never from another kind: the kinds are
independent of each other.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..denoiser import Denoiser

__all__ = ["load_diffusion_lm", "load_registered", "registered_model_type", "register_diffusion_lm",
           "supported_diffusion_lms", "wrap_diffusion_lm"]

Wrapper = Callable[..., Denoiser]
Loader = Callable[..., Denoiser]


_REGISTRY: dict[str, Wrapper] = {}  # filled by the model kinds' __init__ (module docstring)
_LOADERS: dict[str, Loader] = {}


def supported_diffusion_lms() -> list[str]:
    """The ``config.model_type`` values :func:`wrap_diffusion_lm` wraps, sorted."""
    return sorted(_REGISTRY)


def register_diffusion_lm(model_type: str, wrapper: Wrapper, *, loader: Loader | None = None) -> None:
    """Register ``wrapper(model, **kwargs) -> Denoiser`` for models whose ``config.model_type`` is ``model_type``
    (replacing an earlier entry with a warning), and optionally ``loader(directory, *, dtype=None, device=None) ->
    Denoiser`` for its checkpoint folders (:func:`load_registered`)."""
    if not isinstance(model_type, str) or not model_type:
        raise TypeError(f"model_type: expected a non-empty str, got {model_type!r}")
    if not callable(wrapper):
        raise TypeError(f"wrapper: expected a callable (model, **kwargs) -> Denoiser, got {type(wrapper).__name__}")
    if loader is not None and not callable(loader):
        raise TypeError(f"loader: expected a callable (directory, **kwargs) -> Denoiser, got {type(loader).__name__}")
    if model_type in _REGISTRY:
        warnings.warn(f"register_diffusion_lm: replacing the wrapper of {model_type!r}", stacklevel=2)
    _REGISTRY[model_type] = wrapper
    _LOADERS.pop(model_type, None)
    if loader is not None:
        _LOADERS[model_type] = loader


def registered_model_type(directory: str | os.PathLike[str]) -> str | None:
    """The ``model_type`` of the checkpoint folder's ``config.json`` when a loader is registered for it, else
    ``None`` (not a folder, no ``config.json``, or another model type such as an AR model or a saved DiffusionLM)."""
    config = Path(directory) / "config.json"
    if not config.is_file():
        return None
    try:
        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return model_type if model_type in _LOADERS else None


def load_registered(directory: str | os.PathLike[str], **kwargs: Any) -> Denoiser:
    """Load a checkpoint folder of a registered kind (a transformers checkpoint of it, or one its wrapper's
    ``save_pretrained`` wrote) with its loader; ``kwargs`` (``dtype=``, ``device=``, ...) go to it. ``ValueError`` if
    no loader takes the folder."""
    model_type = registered_model_type(directory)
    if model_type is None:
        raise ValueError(f"directory: {str(directory)!r} is not a checkpoint folder of a registered diffusion LM "
                         f"(config.json with model_type in {sorted(_LOADERS)})")
    return _LOADERS[model_type](directory, **kwargs)


def load_diffusion_lm(directory: str | os.PathLike[str], *, dtype: torch.dtype | str | None = None,
                      device: torch.device | str | None = None, **kwargs: Any) -> Denoiser:
    """Load a released diffusion LM's checkpoint folder (its own ``config.json``
    and safetensors shards, no ``trust_remote_code``) as the unifusion model of its kind, chosen by the
    ``config.json``'s ``model_type``.

    Args:
        directory: the checkpoint folder (theirs, or one the model's ``save_pretrained`` wrote).
        dtype: floating dtype of the weights (``torch.bfloat16`` or ``"bfloat16"``); default the saved one.
        device: where to put the model; default the CPU.
        **kwargs: passed to the kind's loader (``load_tokenizer=False``, ...).

    Returns:
        The kind's model (a :class:`~unifusion.denoiser.Denoiser`) in eval mode, with its kernel.

    Raises:
        ValueError: the folder is missing or holds no ``config.json``, or its ``model_type`` is not a registered kind
            (the message lists the known ones); what the kind's loader raises (weights that do not match the config,
            a mask id that contradicts it).
    """
    path = Path(directory)
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(f"directory: {str(directory)!r} is not a checkpoint folder (no config.json); known diffusion "
                         f"LM model types: {sorted(_LOADERS)}")
    try:
        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError) as err:
        raise ValueError(f"directory: {str(config)!r} is not a readable config ({err})") from None
    if model_type not in _LOADERS:
        raise ValueError(f"directory: {str(directory)!r} has model_type {model_type!r}, not a known diffusion LM; "
                         f"known model types: {sorted(_LOADERS)} (adapt an autoregressive model with "
                         "unifusion.adapt_ar_model)")
    return _LOADERS[model_type](path, dtype=dtype, device=device, **kwargs)


def wrap_diffusion_lm(model: torch.nn.Module, **kwargs: Any) -> Denoiser:
    """Wrap a transformers diffusion LM as a unifusion x0 denoiser, chosen by ``model.config.model_type``.

    Args:
        model: a transformers model of a registered kind (:func:`supported_diffusion_lms`). It is wrapped, not
            copied.
        **kwargs: passed to the kind's wrapper (e.g. ``tokenizer=``, ``kernel=``).

    Returns:
        The kind's wrapper, with its kernel. A model that is already a :class:`~unifusion.denoiser.Denoiser` is
        returned as it is, with a warning.

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

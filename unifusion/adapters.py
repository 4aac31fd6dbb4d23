"""Deprecated: the Hugging Face adapter lives in :mod:`unifusion.hf` (kept for one release).

``from unifusion.adapters import DiffusionLM`` still works and warns (``DeprecationWarning``) with the new path:
``from unifusion.hf import DiffusionLM``.
"""

from __future__ import annotations

import warnings
from typing import Any

from . import hf

_MOVED: dict[str, tuple[Any, str]] = {
    "DiffusionLM": (hf, "unifusion.hf"),
    "adapt_ar_model": (hf, "unifusion.hf"),
    "anneal_schedule": (hf, "unifusion.hf"),
    "annealed_attention_mask": (hf, "unifusion.hf"),
    "TimeEmbedding": (hf, "unifusion.hf"),
    "CONFIG_NAME": (hf, "unifusion.hf"),
    "WEIGHTS_NAME": (hf, "unifusion.hf"),
}


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, public = _MOVED[name]
    warnings.warn(f"unifusion.adapters.{name} is deprecated and will be removed in the next release; use "
                  f"{public}.{name} (from {public} import {name})", DeprecationWarning, stacklevel=2)
    return getattr(module, name)


def __dir__() -> list[str]:
    return sorted(_MOVED)

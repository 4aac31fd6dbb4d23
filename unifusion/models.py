"""Deprecated: the model loaders live in :mod:`unifusion.hf` (kept for one release).

``from unifusion.models import load_smollm2`` still works and warns (``DeprecationWarning``) with the new path:
``from unifusion.hf import load_smollm2``.
"""

from __future__ import annotations

import warnings
from typing import Any

from . import hf
from .hf import embedded

_MOVED: dict[str, tuple[Any, str]] = {
    "load_smollm2": (hf, "unifusion.hf"),
    "load_smollm2_tokenizer": (hf, "unifusion.hf"),
    "smollm2_gguf_path": (hf, "unifusion.hf"),
    "load_causal_lm": (hf, "unifusion.hf"),
    "load_diffusion_model": (hf, "unifusion.hf"),
    "dtype_from_name": (hf, "unifusion.hf"),
    "KERNEL_NAMES": (hf, "unifusion.hf"),
    "kernel_config": (hf, "unifusion.hf"),
    "kernel_from_config": (hf, "unifusion.hf"),
    "default_kernel": (hf, "unifusion.hf"),
    "SMOLLM2_PACKAGE": (embedded, "unifusion.hf.embedded"),
    "SMOLLM2_GGUF": (embedded, "unifusion.hf.embedded"),
}


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, public = _MOVED[name]
    warnings.warn(f"unifusion.models.{name} is deprecated and will be removed in the next release; use "
                  f"{public}.{name} (from {public} import {name})", DeprecationWarning, stacklevel=2)
    return getattr(module, name)


def __dir__() -> list[str]:
    return sorted(_MOVED)

"""Module attributes kept for one release after a move: each old name resolves to the object of its new home, with
a ``DeprecationWarning`` naming that home (the deprecated modules :mod:`unifusion.adapters` and
:mod:`unifusion.models` use it)."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["moved_names"]


def moved_names(old_module: str, homes: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module's ``(__getattr__, __dir__)`` for names moved out of ``old_module``: ``homes`` maps each old name to
    the module that now defines it (imported when the name is first asked for)."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {old_module!r} has no attribute {name!r}")
        warnings.warn(f"{old_module}.{name} is deprecated and will be removed in the next release; use "
                      f"{home}.{name} (from {home} import {name})", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(home), name)

    def __dir__() -> list[str]:
        return sorted(homes)

    return __getattr__, __dir__

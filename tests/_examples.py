"""Load a script of examples/ as a module (the tests call its functions and ``main`` in their own process)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str) -> ModuleType:
    """``examples/<name>.py`` executed afresh as the module ``_example_<name>``: with examples/ on ``sys.path`` while it
    runs (the scripts import each other's loaders) and registered in ``sys.modules`` (a dataclass resolves its
    annotations through it)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        spec = importlib.util.spec_from_file_location(f"_example_{name}", EXAMPLES / f"{name}.py")
        if spec is None or spec.loader is None:
            raise FileNotFoundError(EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(EXAMPLES))

"""``benchmarks/_surface.py`` (the surface half of ``benchmarks/api_fingerprint.py``): two versions of a small
synthetic package, written to disk and walked as the script walks ``unifusion``, compare to their renames (names and
parameters, a class with its members), additions, removals and changes, and the surface survives a safetensors file.
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest
from safetensors.torch import load_file, save_file

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "_surface.py"

OLD = {
    "__init__.py": """
        from .core import Box, Plan, combine_a, gone, keep, loss
        __all__ = ["Box", "Plan", "combine_a", "gone", "keep", "loss"]
        """,
    "core.py": """
        from __future__ import annotations
        import dataclasses
        __all__ = ["Box", "Plan", "combine_a", "gone", "keep", "loss"]

        def loss(logp: float, old: float, *, beta: float = 0.0, eps: float = 0.2) -> float:
            return 0.0

        def combine_a(plan: Plan, log_probs: list) -> list:
            return []

        @dataclasses.dataclass
        class Plan:
            x: int
            beta: float = 1.0

        def keep(a, b=1):
            return a

        def gone(z):
            return z

        class Box:
            def size(self) -> int:
                return 0
        """,
    "_hidden.py": """
        __all__ = ["secret"]
        secret = 1
        """,
}

NEW = {
    "__init__.py": """
        from .core import Crate, Plan, combine_b, fresh, keep, loss
        __all__ = ["Crate", "Plan", "combine_b", "fresh", "keep", "loss"]
        """,
    "core.py": """
        from __future__ import annotations
        import dataclasses
        __all__ = ["Crate", "Plan", "combine_b", "fresh", "keep", "loss"]

        def loss(logps: float, old: float, *, kl_coef: float = 0.0, eps: float = 0.2) -> float:
            return 0.0

        def combine_b(plan: Plan, logps: list) -> list:
            return []

        @dataclasses.dataclass
        class Plan:
            x: int
            eubo_beta: float = 1.0

        def keep(a, b=2):
            return a

        def fresh(z, w):
            return z

        class Crate:
            def size(self) -> int:
                return 0
        """,
    "_hidden.py": """
        __all__ = ["secret", "more"]
        secret, more = 1, 2
        """,
}


@pytest.fixture(scope="module")
def surface_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("surface_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _surface_of(surface_module: ModuleType, root: Path, files: dict[str, str]) -> dict[str, str]:
    """The surface of package ``fpdemo`` with ``files``, imported from ``root`` and removed from sys.modules after."""
    package = root / "fpdemo"
    package.mkdir(parents=True)
    for name, text in files.items():
        (package / name).write_text(textwrap.dedent(text))
    sys.path.insert(0, str(root))
    try:
        return surface_module.surface(importlib.import_module("fpdemo"))
    finally:
        sys.path.remove(str(root))
        for name in [n for n in sys.modules if n == "fpdemo" or n.startswith("fpdemo.")]:
            del sys.modules[name]


def test_compare_names_renames_and_lists_the_rest(surface_module, tmp_path):
    before = _surface_of(surface_module, tmp_path / "old", OLD)
    after = _surface_of(surface_module, tmp_path / "new", NEW)
    assert not any("_hidden" in path or "secret" in path for path in before), "a private module was walked"
    assert surface_module.compare_surfaces(before, before) == []
    assert surface_module.compare_surfaces(before, after) == [
        "renamed: fpdemo.Box → Crate (1 member along)  (also: fpdemo.core.Box)",
        "renamed: fpdemo.Plan(beta → eubo_beta)  (also: fpdemo.core.Plan)",
        "renamed: fpdemo.combine_a → combine_b(log_probs → logps)  (also: fpdemo.core.combine_a)",
        "renamed: fpdemo.loss(logp → logps, beta → kl_coef)  (also: fpdemo.core.loss)",
        "renamed: fpdemo.Plan.beta → eubo_beta",
        "removed: fpdemo.gone  function(z)  (also: fpdemo.core.gone)",
        "added: fpdemo.fresh  function(z, w)  (also: fpdemo.core.fresh)",
        "changed: fpdemo.keep  (also: fpdemo.core.keep)",
        "    ~ parameter b: ['POSITIONAL_OR_KEYWORD', None, '1'] → ['POSITIONAL_OR_KEYWORD', None, '2']",
    ]


def test_surface_survives_a_safetensors_file(surface_module, tmp_path):
    entries = _surface_of(surface_module, tmp_path / "new", NEW)
    tensors = surface_module.to_tensors(entries)
    assert all(key.startswith("surface:") for key in tensors)
    save_file(tensors, tmp_path / "s.safetensors")
    assert surface_module.from_tensors(load_file(tmp_path / "s.safetensors")) == entries

"""No shims: the names moved before the first release live only at their new homes (docs/changelog.md lists the
moves). The old paths ``unifusion.adapters``, ``unifusion.models``, the front door's moved names, the callable
``unifusion.validation`` module, ``backend.wait_for_compilation``, ``losses.native``'s former names and
``cli.make_kernel`` are gone; no source file of the package raises a ``DeprecationWarning``, and the library itself
raises none when used."""

from __future__ import annotations

import ast
import importlib
import os
import pkgutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import unifusion

ROOT = Path(unifusion.__file__).parent

GONE_MODULES = ["unifusion.adapters", "unifusion.models", "unifusion._deprecation"]
GONE_NAMES = {
    "unifusion": ["set_validation", "validation_enabled", "set_backend", "get_backend", "compile_stats",
                  "wait_for_compilation", "anneal_schedule", "InterpolatingKernel", "DiffusionLossOutput",
                  "LinearSchedule", "adapters", "models"],
    "unifusion.backend": ["wait_for_compilation"],
    "unifusion.losses.native": ["gidd_loss", "mdlm_loss", "x0_log_probs"],
    "unifusion.cli": ["make_kernel"],
}


def test_the_moved_modules_are_gone() -> None:
    """Read from the package's own folder (an editable install of another checkout may still map the old names)."""
    present = {info.name for info in pkgutil.iter_modules(unifusion.__path__)}
    assert not present & {name.split(".")[-1] for name in GONE_MODULES}, present


HF_MOVED = {"adapt": "ar", "adapted": "ar", "attention": "ar", "blocks": "ar", "decoding": "ar", "families": "ar",
            "layout": "ar", "model": "ar", "time_embedding": "ar", "io": "ar",
            "diffusion_gemma_cache": "diffusion_gemma", "diffusion_gemma_generation": "diffusion_gemma",
            "diffusion_gemma_layout": "diffusion_gemma"}
"""unifusion.hf's flat modules, moved into its model kinds (``unifusion.hf.blocks`` → ``unifusion.hf.ar.blocks``,
``unifusion.hf.diffusion_gemma_cache`` → ``unifusion.hf.diffusion_gemma.cache``); docs/changelog.md lists them."""


def test_the_flat_hf_modules_are_gone() -> None:
    import unifusion.hf

    present = {info.name: info.ispkg for info in pkgutil.iter_modules(unifusion.hf.__path__)}
    assert present == {"ar": True, "diffusion_gemma": True, "llada": True, "dream": True, "lladamoe": True,
                       "sdar": True, "fast_dllm": True, "llada2": True,
                       "backbone": False, "checkpoint": False, "embedded": False, "loading": False, "registry": False,
                       "native": False, "native_checkpoint": False, "native_decoding": False, "native_block": False}
    for name, kind in HF_MOVED.items():
        assert not hasattr(unifusion.hf, name), f"unifusion.hf.{name}"
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"unifusion.hf.{name}")
        new = name.removeprefix("diffusion_gemma_")
        assert importlib.import_module(f"unifusion.hf.{kind}.{new}").__name__ == f"unifusion.hf.{kind}.{new}"


@pytest.mark.parametrize("module", sorted(GONE_NAMES))
def test_the_moved_names_are_gone(module: str) -> None:
    mod = importlib.import_module(module)
    for name in GONE_NAMES[module]:
        assert not hasattr(mod, name), f"{module}.{name}"
    assert not callable(unifusion.validation)  # a module again, not a module that is also a context manager
    assert type(unifusion.validation) is type(unifusion)


def test_no_source_file_of_the_package_raises_a_deprecation_warning() -> None:
    """Grep-style: no ``DeprecationWarning`` (or ``FutureWarning``, ``PendingDeprecationWarning``) named anywhere in
    the package's code, and no module-level ``__getattr__`` (the device of moved-name shims)."""
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id in ("DeprecationWarning", "PendingDeprecationWarning",
                                                          "FutureWarning"):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.id}")
        offenders += [f"{path.relative_to(ROOT)}:{node.lineno}: module __getattr__" for node in tree.body
                      if isinstance(node, ast.FunctionDef) and node.name == "__getattr__"]
    assert not offenders, offenders


def _package_imports() -> list[tuple[str, str]]:
    """``(file, module)`` for every import of a module of the package, resolved to its dotted name."""
    found = []
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        package = parts if parts[-1] == "__init__" else parts[:-1]
        package = [p for p in package if p != "__init__"]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                source = ".".join(base + ([node.module] if node.module else []))
                found += [(str(path), f"{source}.{a.name}") for a in node.names] + [(str(path), source)]
            elif isinstance(node, ast.Import):
                found += [(str(path), a.name) for a in node.names]
    return found


def test_the_package_never_imports_the_removed_modules() -> None:
    offenders = [(f, m) for f, m in _package_imports()
                 if m in GONE_MODULES or any(m.startswith(old + ".") for old in GONE_MODULES)]
    assert not offenders, offenders


def test_the_library_raises_no_deprecation_warning_of_its_own() -> None:
    """A fresh interpreter with DeprecationWarning as an error: import the package, adapt a tiny model, run forward,
    the fused loss, diffusion_loss, save/load and generate."""
    script = textwrap.dedent("""
        import tempfile, warnings
        warnings.simplefilter("error", DeprecationWarning)
        import torch
        import unifusion as uf
        from _hf_tiny import tiny_model

        model = uf.adapt_ar_model(tiny_model("llama"))
        x = torch.randint(4, 128, (2, 6), generator=torch.Generator().manual_seed(0))
        t = torch.tensor([0.3, 0.7])
        kernel = uf.hf.default_kernel(model)[0]
        with torch.no_grad():
            assert model(x, t, bidirectional_prob=uf.hf.anneal_schedule(1, 2)).shape == (2, 6, 129)
            model.loss(x, t, x, kernel)
        uf.diffusion_loss(model, x, kernel, step=1, anneal_steps=2).mean().backward()
        with tempfile.TemporaryDirectory() as folder:
            model.save_pretrained(folder, kernel=kernel)
            model = uf.hf.DiffusionLM.from_pretrained(folder)
        out = model.generate(x[:, :2], max_new_tokens=3, num_steps=2, generator=torch.Generator().manual_seed(0))
        assert out.shape == (2, 5)
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent.parent), str(ROOT.parent),
                                                       os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]

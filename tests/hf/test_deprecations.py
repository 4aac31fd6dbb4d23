"""The deprecated import paths ``unifusion.adapters`` and ``unifusion.models`` (kept for one release): each moved name
still resolves, to the very object of its new home, with a ``DeprecationWarning`` naming that home; the library itself
never goes through them."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import unifusion
import unifusion.hf as hf

ROOT = Path(unifusion.__file__).parent

MOVED = {
    "unifusion.adapters": ["DiffusionLM", "adapt_ar_model", "anneal_schedule", "annealed_attention_mask",
                           "TimeEmbedding", "CONFIG_NAME", "WEIGHTS_NAME"],
    "unifusion.models": ["load_smollm2", "load_smollm2_tokenizer", "smollm2_gguf_path", "load_causal_lm",
                         "load_diffusion_model", "dtype_from_name", "KERNEL_NAMES", "kernel_config",
                         "kernel_from_config", "default_kernel"],
}


@pytest.mark.parametrize("module", sorted(MOVED))
def test_moved_names_warn_and_resolve_to_their_new_home(module: str) -> None:
    old = importlib.import_module(module)
    for name in MOVED[module]:
        with pytest.warns(DeprecationWarning, match=rf"{module}\.{name} is deprecated .*use unifusion\.hf\.{name}"):
            value = getattr(old, name)
        assert value is getattr(hf, name), name
    assert sorted(MOVED[module]) == [n for n in dir(old) if n in MOVED[module]]
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        old.nothing_here  # noqa: B018


def test_the_old_paths_work_as_imports_and_attributes() -> None:
    with pytest.warns(DeprecationWarning, match=r"use unifusion\.hf\.DiffusionLM"):
        from unifusion.adapters import DiffusionLM
    assert DiffusionLM is hf.DiffusionLM
    with pytest.warns(DeprecationWarning, match=r"use unifusion\.hf\.embedded\.SMOLLM2_GGUF"):
        assert unifusion.models.SMOLLM2_GGUF == hf.embedded.SMOLLM2_GGUF
    with pytest.warns(DeprecationWarning, match=r"use unifusion\.hf\.default_kernel"):
        assert unifusion.models.default_kernel is hf.default_kernel  # the package attribute, as uf.models.X
    with pytest.raises(AttributeError, match="no attribute 'not_a_module'"):
        unifusion.not_a_module  # noqa: B018


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


def test_the_package_never_imports_the_deprecated_modules() -> None:
    offenders = [(f, m) for f, m in _package_imports()
                 if m in MOVED or any(m.startswith(old + ".") for old in MOVED)]
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

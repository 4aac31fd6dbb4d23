"""The package ships ``py.typed``: ``mypy`` (configured in pyproject.toml, no blanket ignores) must agree with it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_config_has_no_blanket_ignores():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert config["files"] == ["unifusion"]
    assert not config.get("ignore_errors") and not config.get("ignore_missing_imports")
    for override in config.get("overrides", []):
        assert not override.get("ignore_errors"), override
        modules = override["module"] if isinstance(override["module"], list) else [override["module"]]
        assert not any(m.startswith("unifusion") for m in modules), "unifusion's own modules must be checked"


def test_dev_extra_pins_the_checkers():
    """The ``dev`` extra installs exactly the mypy and ruff releases the project is checked with: with
    ``warn_unused_ignores`` on, another mypy release may find an ignore unused (or an error new) and fail a fresh
    install's check."""
    tomllib = pytest.importorskip("tomllib")
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    pins = {req.split("==")[0]: req.split("==")[1] for req in dev if "==" in req}
    assert {"mypy", "ruff"} <= pins.keys(), dev
    assert all(v.count(".") == 2 and v.replace(".", "").isdigit() for v in (pins["mypy"], pins["ruff"])), pins
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["warn_unused_ignores"] is True


def test_mypy_is_clean(tmp_path):
    """mypy agrees with the package and with tests/_protocol_checks.py (each wrapper satisfies the protocol its helper
    modules read it through); a control file in the same run, a wrapper given where the other kind's protocol is
    expected, is its one error (the protocols are checked member by member, not read as ``Any``)."""
    control = tmp_path / "protocol_control.py"
    control.write_text("from unifusion.hf import DiffusionLM\n"
                       "from unifusion.hf.diffusion_gemma.wrapped import WrappedDiffusionGemma\n\n\n"
                       "def wrong(model: DiffusionLM) -> WrappedDiffusionGemma:\n"
                       "    return model\n")
    proc = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"), "unifusion",
                           "tests/_protocol_checks.py", str(control)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    errors = [line for line in proc.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert errors[0].startswith(f"{control}:6: error: Incompatible return value type"), errors
    assert '"WrappedDiffusionGemma"' in errors[0] and "Found 1 error in 1 file" in proc.stdout, proc.stdout[-2000:]


# -- a model is typed by its role -------------------------------------------------------------------------------------

PACKAGE = ROOT / "unifusion"

# ``module:qualified.name`` of a model-named value still annotated ``Any``, each with its reason (the test fails when an
# entry no longer occurs, so the list cannot outlive its reason).
MODEL_ANY_ALLOWED: dict[str, str] = {
    "unifusion.hf.diffusion_gemma.model:DiffusionGemmaLM.base_model": (
        "transformers' DiffusionGemmaForBlockDiffusion: its submodules (model.encoder, model.decoder, lm_head) are "
        "reached through nn.Module.__getattr__, which types them Tensor | Module"),
    "unifusion.hf.diffusion_gemma.wrapped:WrappedDiffusionGemma.base_model": (
        "the same model as DiffusionGemmaLM.base_model, as the protocol its helper modules read declares it"),
    "unifusion.hf.native:NativeDiffusionLM.hf_model": (
        "transformers' *ForCausalLM (Llama, Qwen2): its submodules (model, lm_head) are reached through "
        "nn.Module.__getattr__, which types them Tensor | Module"),
    "unifusion.hf.native_block:BlockCachedLM.hf_model": (
        "the transformers *ForCausalLM of a block kind (Qwen3, Qwen2, ...): its decoder (.model) is reached through "
        "nn.Module.__getattr__, which types it Tensor | Module"),
    "unifusion.hf.native_decoding:PrefixCachedLM.hf_model": (
        "the same model as NativeDiffusionLM.hf_model, as the protocol the cache reads declares it"),
}


def _is_model_name(name: str) -> bool:
    """``model`` and the roles spelled ``*_model`` (``judge_model``, ``ar_model``, ``ref_model``, ``hf_model``...)."""
    return name == "model" or name.endswith("_model")


def _mentions_any(annotation: ast.expr | None) -> bool:
    """Whether an annotation is ``Any`` or a union with ``Any`` in it (``Any | None``, ``Optional[Any]``)."""
    if annotation is None:
        return False
    if isinstance(annotation, ast.Name):
        return annotation.id == "Any"
    if isinstance(annotation, ast.Attribute):
        return annotation.attr == "Any"
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        return _mentions_any(annotation.left) or _mentions_any(annotation.right)
    if isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value) in ("Optional", "typing.Optional",
                                                                                    "Union", "typing.Union"):
        items = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
        return any(_mentions_any(item) for item in items)
    return False


def _models_typed_any(module: str, tree: ast.Module) -> set[str]:
    """``module:scope.name`` of every parameter and annotated name (attribute, variable) called ``model`` or
    ``*_model`` whose annotation is ``Any``."""
    found: set[str] = set()

    def visit(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{scope}.{child.name}" if scope else child.name
                if not isinstance(child, ast.ClassDef):
                    a = child.args
                    for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
                        if arg is not None and _is_model_name(arg.arg) and _mentions_any(arg.annotation):
                            found.add(f"{module}:{inner}({arg.arg})")
                visit(child, inner)
            elif isinstance(child, ast.AnnAssign) and _mentions_any(child.annotation):
                target = child.target
                name = target.id if isinstance(target, ast.Name) else (
                    target.attr if isinstance(target, ast.Attribute) else None)
                if name is not None and _is_model_name(name):
                    found.add(f"{module}:{scope}.{name}" if scope else f"{module}:{name}")
            else:
                visit(child, scope)

    visit(tree, "")
    return found


def _package_models_typed_any() -> set[str]:
    found: set[str] = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found |= _models_typed_any(module, ast.parse(path.read_text(encoding="utf-8")))
    return found


def test_no_model_is_typed_any():
    """A model is typed by its role (``unifusion.denoiser``: ``Denoiser``, ``DenoiserModule``, ``X0Model``,
    ``BlockDenoiser``, ``CausalLM``; ``torch.nn.Module`` for a wrapper or a Hugging Face model), never ``Any``."""
    # the scan finds each form (parameters of functions and methods, keyword-only, attributes, unions with Any) and
    # passes the typed ones
    toy = ast.parse(
        "from typing import Any, Optional\n"
        "def f(model: Any, x: Any, judge_model: 'X0Model') -> None: ...\n"
        "def g(*, ref_model: Any | None = None, model: Denoiser) -> None:\n"
        "    x0_model: Optional[Any] = None\n"
        "class C:\n"
        "    model: Any\n"
        "    def __init__(self, hf_model: typing.Any, other: Any) -> None:\n"
        "        self.base_model: Any = hf_model\n"
        "        self.kernel: Any = None\n")
    assert _models_typed_any("toy", toy) == {"toy:f(model)", "toy:g(ref_model)", "toy:g.x0_model", "toy:C.model",
                                             "toy:C.__init__(hf_model)", "toy:C.__init__.base_model"}
    found = _package_models_typed_any()
    new = sorted(found - set(MODEL_ANY_ALLOWED))
    assert not new, "models annotated Any (type them by role, unifusion.denoiser):\n" + "\n".join(new)
    gone = sorted(set(MODEL_ANY_ALLOWED) - found)
    assert not gone, "no longer annotated Any, remove from MODEL_ANY_ALLOWED:\n" + "\n".join(gone)

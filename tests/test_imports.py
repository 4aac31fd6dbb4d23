"""The package's layers talk through public names, and its import graph has no circle.

* No module imports one that (directly or through others) imports it back. Every ``import``/``from ... import``
  counts, also those inside functions (a local import only hides a circle until the two modules are refactored).
  Edges into packages (``unifusion``, ``unifusion.eval``, ...) are left out: their ``__init__`` only re-exports, and
  ``import unifusion as uf`` in a script-like module does not make a layer circle.
* No private name crosses a module boundary: no ``from x import _name`` of a unifusion module, no ``module._name`` of
  a unifusion module, no ``obj._name`` (``obj`` not ``self``/``cls``) of a private member that a class of another
  unifusion module defines. Private *modules* (``_validation``, ``_math``, ...) may be imported within the package:
  their names are the package's internal API.
* No ``sys.modules`` look-ups: a lower layer never reaches an upper one behind the import graph's back.
* No module imports a private *module* of another subpackage (``unifusion.hf.ar.model`` importing
  ``unifusion.samplers._setup``): a private module is the internal API of the package that holds it (and of that
  package's subpackages); the top level's private modules (``unifusion._validation``, ...) serve the whole library.
  Another subpackage uses the public names its package re-exports.
* No library module hides an edge to another subpackage in a function-local import: the edge is at the top of the
  module, where the import graph (and a reader) sees it. The command line (``cli``, ``_cli_*``, ``demo``) imports its
  subcommands' layers lazily, to start fast.
* docs/architecture.md's layers are the import graph's: every module is in one layer and imports nothing above it.
  Each model kind of ``hf/`` (``hf/ar/``, ``hf/diffusion_gemma/``) is a unit of its own, and the kinds import nothing
  of each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import unifusion

ROOT = Path(unifusion.__file__).parent

# Offences tolerated for now, each with its reason (empty: none). The test fails when an entry no longer occurs, so
# the list cannot outlive its reason.
KNOWN_OFFENCES: set[str] = set()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _parsed() -> dict[str, tuple[Path, ast.Module]]:
    return {_module_name(p): (p, ast.parse(p.read_text(encoding="utf-8"))) for p in sorted(ROOT.rglob("*.py"))}


def _source(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` reads from, as an absolute name."""
    if not node.level:
        return node.module or ""
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _import_graph(modules: dict[str, tuple[Path, ast.Module]]) -> dict[str, set[str]]:
    packages = {name for name, (p, _) in modules.items() if p.name == "__init__.py"}
    graph: dict[str, set[str]] = {}
    for name, (path, tree) in modules.items():
        targets: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _source(name, path, node)
                for alias in node.names:
                    full = f"{source}.{alias.name}"
                    targets.add(full if full in modules else source)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[name] = {t for t in targets if t in modules and t not in packages and t != name}
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)) is not None:
            return found
    return None


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _class_members(tree: ast.Module) -> set[str]:
    """Private members the module's classes define: methods, class attributes and ``self._x = ...`` assignments."""
    members: set[str] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                members.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(
                    node.value, ast.Name) and node.value.id == "self":
                members.add(node.attr)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                members.update(t.id for t in targets if isinstance(t, ast.Name))
    return {m for m in members if _private(m)}


def _module_aliases(name: str, path: Path, tree: ast.Module, modules: dict[str, tuple[Path, ast.Module]]
                    ) -> dict[str, str]:
    """Local names bound to unifusion modules (``from . import _validation as V``, ``import unifusion.rates as r``)."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _source(name, path, node)
            for alias in node.names:
                if f"{source}.{alias.name}" in modules:
                    aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules and alias.asname:
                    aliases[alias.asname] = alias.name
    return aliases


def _offences(modules: dict[str, tuple[Path, ast.Module]]) -> set[str]:
    owners: dict[str, set[str]] = {}  # private class member -> the modules whose classes define it
    for name, (_, tree) in modules.items():
        for member in _class_members(tree):
            owners.setdefault(member, set()).add(name)
    found: set[str] = set()
    for name, (path, tree) in modules.items():
        aliases = _module_aliases(name, path, tree, modules)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _source(name, path, node)
                if source == "unifusion" or source.startswith("unifusion."):
                    found.update(f"{name} imports {alias.name} from {source}" for alias in node.names
                                 if _private(alias.name) and f"{source}.{alias.name}" not in modules)
            elif isinstance(node, ast.Attribute):
                value = node.value
                if isinstance(value, ast.Name) and value.id == "sys" and node.attr == "modules":
                    found.add(f"{name} looks up sys.modules")
                if not _private(node.attr) or (isinstance(value, ast.Name) and value.id in ("self", "cls")):
                    continue
                if isinstance(value, ast.Name) and value.id in aliases:
                    found.add(f"{name} reads {node.attr} of {aliases[value.id]}")
                elif node.attr in owners and name not in owners[node.attr]:
                    found.add(f"{name} reaches {ast.unparse(node)} ({', '.join(sorted(owners[node.attr]))})")
    return found


def test_no_import_circle():
    graph = _import_graph(_parsed())
    # the graph is read: local imports count, relative imports resolve
    assert "unifusion.hf.loading" in graph["unifusion.demo"] and "unifusion.kernels" in graph["unifusion.losses.native"]
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # and a circle would be found
    cycle = _find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_no_private_name_crosses_a_module_boundary():
    # the scan finds each kind of offence (checked on three small modules), and not the allowed forms
    toy = {"unifusion._helpers": "def check(x): return x\n_SECRET = 1\n",
           "unifusion.low": "class Box:\n    def __init__(self):\n        self._cache = {}\n    def _fill(self): ...\n",
           "unifusion.high": ("import sys\nfrom . import _helpers as H\nfrom ._helpers import check, _SECRET\n"
                              "def use(box):\n    box._fill(); sys.modules['x']\n    return H._SECRET, H.check(1)\n")}
    assert _offences({k: (Path(k.rpartition(".")[2] + ".py"), ast.parse(v)) for k, v in toy.items()}) == {
        "unifusion.high imports _SECRET from unifusion._helpers", "unifusion.high reads _SECRET of unifusion._helpers",
        "unifusion.high reaches box._fill (unifusion.low)", "unifusion.high looks up sys.modules"}
    offences = _offences(_parsed())
    new = sorted(offences - KNOWN_OFFENCES)
    assert not new, "private names across modules (make the seam public):\n" + "\n".join(new)
    gone = sorted(KNOWN_OFFENCES - offences)
    assert not gone, "no longer occurs, remove from KNOWN_OFFENCES:\n" + "\n".join(gone)


def _import_targets(name: str, path: Path, node: ast.AST, modules: dict[str, tuple[Path, ast.Module]]) -> list[str]:
    """The modules an import node of module ``name`` names (``from p import m`` → ``p.m`` when that is a module,
    else ``p``); ``[]`` for any other node."""
    if isinstance(node, ast.ImportFrom):
        source = _source(name, path, node)
        return [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    return []


def _private_module_imports(modules: dict[str, tuple[Path, ast.Module]]) -> set[str]:
    """``"importer imports the private module M"`` for each import of a private module whose package neither is nor
    contains the importer's package."""
    found: set[str] = set()
    for name, (path, tree) in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            for target in _import_targets(name, path, node, modules):
                package, _, last = target.rpartition(".")
                if target in modules and _private(last) and not (here == package or here.startswith(package + ".")):
                    found.add(f"{name} imports the private module {target}")
    return found


def test_no_module_imports_a_private_module_of_another_subpackage():
    toy = {"unifusion.a.__init__": "", "unifusion.a._inner": "X = 1\n", "unifusion.a.b.__init__": "",
           "unifusion.a.b.deep": "from .. import _inner\n", "unifusion.c.__init__": "",
           "unifusion.c.user": "from ..a import _inner\nfrom ..a._inner import X\nimport unifusion.a._inner\n",
           "unifusion._top": "", "unifusion.c.top_user": "from .. import _top\n"}
    parsed = {k.removesuffix(".__init__"): (Path("__init__.py" if k.endswith("__init__") else k.rpartition(".")[2]
                                                 + ".py"), ast.parse(v)) for k, v in toy.items()}
    assert _private_module_imports(parsed) == {"unifusion.c.user imports the private module unifusion.a._inner"}
    modules = _parsed()
    # the scan reads the package's private modules: the fast loss's driver and equations are imported by the losses'
    # own modules (fast, fused_linear) and by nothing outside unifusion.losses
    graph = _import_graph(modules)
    private_losses = {"unifusion.losses._x0_driver", "unifusion.losses._x0_math"}
    assert "unifusion.losses._x0_driver" in graph["unifusion.losses.fast"]
    assert "unifusion.losses._x0_math" in graph["unifusion.losses._x0_driver"]
    assert {name for name, targets in graph.items() if targets & private_losses} == {
        "unifusion.losses.fast", "unifusion.losses.fused_linear", "unifusion.losses._x0_driver"}
    offences = sorted(_private_module_imports(modules))
    assert not offences, "private modules of another subpackage (re-export a public name instead):\n" + \
        "\n".join(offences)


LAZY = ("unifusion.cli", "unifusion._cli_", "unifusion.demo", "unifusion.__main__")
"""The command line, whose subcommands import their layers when they run."""


def _subpackage(name: str) -> str:
    return ".".join(name.split(".")[:2])


def test_no_library_module_hides_an_edge_to_another_subpackage_in_a_function():
    modules = _parsed()
    hidden = []
    for name, (path, tree) in modules.items():
        if name.startswith(LAZY):
            continue
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom):
                    source = _source(name, path, node)
                    targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source
                               for a in node.names]
                elif isinstance(node, ast.Import):
                    targets = [alias.name for alias in node.names]
                else:
                    continue
                hidden += [f"{name}:{node.lineno} -> {t}" for t in targets
                           if (t == "unifusion" or t.startswith("unifusion.")) and _subpackage(t) != _subpackage(name)]
    assert not hidden, "function-local imports of another subpackage (hoist them):\n" + "\n".join(sorted(hidden))


ARCHITECTURE = ROOT.parent / "docs" / "architecture.md"


def _layers() -> dict[str, int]:
    """docs/architecture.md's ``layer N  unit unit ...`` lines: top-level module or subpackage (``name/``) → N."""
    layers: dict[str, int] = {}
    for line in ARCHITECTURE.read_text(encoding="utf-8").splitlines():
        words = line.split()
        if len(words) > 2 and words[0] == "layer" and words[1].isdigit():
            for unit in words[2:]:
                assert unit not in layers, f"{unit} is in two layers of docs/architecture.md"
                layers[unit] = int(words[1])
    return layers


def _unit(module: str) -> str | None:
    """The layer unit of a unifusion module: ``losses/`` for unifusion.losses and everything in it, ``kernels`` for
    unifusion.kernels, a model kind of ``hf/`` on its own (``hf/ar/`` for unifusion.hf.ar and everything in it; the
    shared modules at hf's top are ``hf/``); ``None`` for the package itself (the front door, above every layer)."""
    parts = module.split(".")
    if len(parts) == 1:
        return None
    if parts[1] == "hf" and len(parts) > 2 and f"unifusion.hf.{parts[2]}" in _PACKAGES:
        return f"hf/{parts[2]}/"
    return parts[1] + "/" if f"unifusion.{parts[1]}" in _PACKAGES else parts[1]


_PACKAGES = {_module_name(p) for p in ROOT.rglob("__init__.py")}
MODEL_KINDS = sorted(p for p in _PACKAGES if p.count(".") == 2 and p.startswith("unifusion.hf."))
"""The subpackages of unifusion.hf: one model kind each (docs/architecture.md, layer 4)."""


def test_docs_architecture_shows_the_layering_the_imports_have():
    """Every module sits in one layer of docs/architecture.md and imports only from its layer or those below it
    (every import counts: also into a subpackage's ``__init__`` and inside functions)."""
    layers = _layers()
    modules = _parsed()
    units = {u for u in map(_unit, modules) if u is not None}
    assert units == set(layers), ("docs/architecture.md's layers and the package differ: missing "
                                  f"{sorted(units - set(layers))}, not in the package {sorted(set(layers) - units)}")
    upward = []
    for name, (path, tree) in modules.items():
        here = _unit(name)
        if here is None:
            continue
        for node in ast.walk(tree):
            for target in _import_targets(name, path, node, modules):
                there = _unit(target) if target.split(".")[0] == "unifusion" else None
                if there is not None and layers[there] > layers[here]:
                    upward.append(f"{name}:{node.lineno} ({here}, layer {layers[here]}) imports {target} "
                                  f"({there}, layer {layers[there]})")
    assert not upward, "imports that run up docs/architecture.md's layers:\n" + "\n".join(sorted(upward))


def test_the_model_kinds_of_hf_import_nothing_of_each_other():
    """A model kind of ``hf/`` (``hf/ar/``, ``hf/diffusion_gemma/``, ...) is one folder: it imports the layers below
    ``hf`` and hf's shared modules (the registry), never another kind — not even its public names — and the shared
    registry names no kind (each kind registers itself)."""
    assert {"unifusion.hf.ar", "unifusion.hf.diffusion_gemma"} <= set(MODEL_KINDS)
    modules = _parsed()
    crossing = []
    for name, (path, tree) in modules.items():
        kind = _unit(name)
        for node in ast.walk(tree):
            for target in _import_targets(name, path, node, modules):
                there = _unit(target) if target.split(".")[0] == "unifusion" else None
                if kind in ("hf/", None) or there in ("hf/", None) or kind == there:
                    continue
                if kind.startswith("hf/") and there.startswith("hf/"):
                    crossing.append(f"{name}:{node.lineno} ({kind}) imports {target} ({there})")
    assert not crossing, "model kinds importing each other:\n" + "\n".join(sorted(crossing))
    graph = _import_graph(modules)
    assert "unifusion.hf.registry" in graph["unifusion.hf.diffusion_gemma"]  # the kind registers itself ...
    assert not {t for t in graph["unifusion.hf.registry"] if _unit(t) != "hf/" and t.startswith("unifusion.hf")}
    registry_source = (ROOT / "hf" / "registry.py").read_text(encoding="utf-8")
    assert "DiffusionGemma" not in registry_source  # ... and the registry names no kind

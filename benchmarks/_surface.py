"""The public surface of a package as text entries, and the comparison of two surfaces that names renames as such.

:func:`surface` walks the package with ``pkgutil`` (the package and every module or subpackage with an ``__all__``;
modules whose dotted path has a part starting with ``_`` are private and skipped) and describes each exported name,
keyed ``<module>.<name>``: its kind and, for callables and classes, ``inspect.signature`` (parameter names, kinds,
annotations as written, defaults as ``repr``; a class: its constructor and bases). A class's public members defined in
the package's classes of its MRO (methods, class/static methods, properties, attributes with their annotation and
value) are keyed ``<module>.<Class>.<member>`` under the class's first export path (fewest dots, then alphabetical).
Each description is JSON text; :func:`to_tensors` / :func:`from_tensors` store it as uint8 tensors keyed
``surface:<path>`` so a surface travels in the same safetensors file as numbers.

:func:`compare_surfaces` lists entries removed, added and changed. A removed and an added entry under the same
parent whose descriptions are equal but for the name and parameter names pair into ``renamed: parent.old → new``; a
changed entry whose description differs only in parameter names prints ``renamed: path(old → new, ...)``; a renamed
class takes its unchanged members along. The same object exported under several paths prints once with the other
paths after ``also:``. The defining module (``origin``) groups those paths and is not compared.
"""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import re
from collections import defaultdict
from types import ModuleType
from typing import Any

import torch

PREFIX = "surface:"
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_PLAIN = (str, int, float, bool, bytes, type(None))
_ABSENT = object()  # a member only annotated, or a member without an annotation


def public_modules(package: ModuleType) -> list[ModuleType]:
    """The package and its modules with an ``__all__`` and no private part, fewest dots first, then by name."""
    names = [package.__name__] + [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]
    names = [n for n in names if not any(part.startswith("_") for part in n.split("."))]
    modules = [importlib.import_module(n) for n in sorted(names, key=lambda n: (n.count("."), n))]
    return [m for m in modules if isinstance(getattr(m, "__all__", None), (list, tuple))]


def _repr(value: object) -> str:
    return _ADDRESS.sub("", repr(value))


def _annotation(annotation: object) -> str | None:
    if annotation is inspect.Parameter.empty or annotation is _ABSENT:
        return None
    return annotation if isinstance(annotation, str) else _ADDRESS.sub("", inspect.formatannotation(annotation))


def _signature(obj: object) -> dict[str, Any] | None:
    try:
        sig = inspect.signature(obj)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    params = [[p.name, p.kind.name, _annotation(p.annotation), None if p.default is p.empty else _repr(p.default)]
              for p in sig.parameters.values()]
    return {"params": params, "returns": _annotation(sig.return_annotation)}


def _value(value: object) -> str | None:
    """``repr`` of plain data (and typing constructs); ``None`` for other objects (only their type is described)."""
    def plain(v: object) -> bool:
        if isinstance(v, _PLAIN):
            return True
        if isinstance(v, (tuple, list, set, frozenset)):
            return all(plain(x) for x in v)
        if isinstance(v, dict):
            return all(plain(k) and plain(x) for k, x in v.items())
        return False

    if isinstance(value, (set, frozenset)) and plain(value):
        return f"{type(value).__name__}({sorted(value, key=repr)!r})"
    if plain(value) or type(value).__module__ in ("typing", "types", "typing_extensions"):
        return _repr(value)
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return f"dict with keys {sorted(value)!r}"
    return None


def _origin(obj: object) -> str | None:
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{module}.{name}" if isinstance(module, str) and isinstance(name, str) else None


def describe(obj: object) -> dict[str, Any]:
    """The kind of an exported object and what a caller sees of it (module docstring)."""
    if inspect.ismodule(obj):
        return {"kind": "module", "origin": obj.__name__}
    if inspect.isclass(obj):
        return {"kind": "class", "bases": [_origin(b) for b in obj.__bases__], "signature": _signature(obj),
                "origin": _origin(obj)}
    if callable(obj):
        kind = "function" if inspect.isfunction(obj) or inspect.isbuiltin(obj) else f"callable {type(obj).__name__}"
        return {"kind": kind, "signature": _signature(obj), "origin": _origin(obj)}
    return {"kind": "value", "type": _origin(type(obj)), "value": _value(obj)}


def describe_member(raw: object, annotation: object, origin: str) -> dict[str, Any]:
    """A class member as found in its defining class's ``__dict__`` (``raw``; ``_ABSENT`` for a name that is only
    annotated) with its annotation there; ``origin``: ``<module>.<Class>.<name>`` of that class."""
    return {**_member(raw, annotation), "origin": origin}


def _member(raw: object, annotation: object) -> dict[str, Any]:
    if isinstance(raw, (staticmethod, classmethod)):
        return {"kind": type(raw).__name__, "signature": _signature(raw.__func__)}
    if isinstance(raw, property):
        return {"kind": "property", "returns": _annotation(inspect.signature(raw.fget).return_annotation)
                if raw.fget is not None else None, "settable": raw.fset is not None}
    if inspect.isfunction(raw):
        return {"kind": "method", "signature": _signature(raw)}
    if inspect.isclass(raw):
        return {"kind": "class", "bases": [_origin(b) for b in raw.__bases__], "signature": _signature(raw)}
    return {"kind": "attribute", "annotation": _annotation(annotation),
            "value": None if raw is _ABSENT else _value(raw), "type": None if raw is _ABSENT else _origin(type(raw))}


def _members(cls: type, package: str) -> dict[str, dict[str, Any]]:
    """Public members defined in the package's classes of ``cls``'s MRO (the most derived definition wins)."""
    found: dict[str, dict[str, Any]] = {}
    for klass in reversed(cls.__mro__):
        if not klass.__module__.split(".")[0] == package:
            continue
        annotations = inspect.get_annotations(klass)
        for name in sorted(set(vars(klass)) | set(annotations)):
            if not name.startswith("_"):
                raw = vars(klass).get(name, _ABSENT)
                found[name] = describe_member(raw, annotations.get(name, _ABSENT),
                                              f"{_origin(klass)}.{name}")
    return found


def surface(package: ModuleType) -> dict[str, str]:
    """``{path: JSON description}`` for every exported name of the package's public modules and the members of each
    exported class (module docstring)."""
    out: dict[str, str] = {}
    seen: set[int] = set()
    root = package.__name__.split(".")[0]
    for module in public_modules(package):
        for name in module.__all__:
            path = f"{module.__name__}.{name}"
            if not hasattr(module, name):
                out[path] = json.dumps({"kind": "missing"})
                continue
            obj = getattr(module, name)
            out[path] = json.dumps(describe(obj), ensure_ascii=False)
            if inspect.isclass(obj) and id(obj) not in seen:
                seen.add(id(obj))
                for member, desc in _members(obj, root).items():
                    out[f"{path}.{member}"] = json.dumps(desc, ensure_ascii=False)
    return out


def to_tensors(entries: dict[str, str]) -> dict[str, torch.Tensor]:
    """Each description as a uint8 tensor of its UTF-8 text, keyed ``surface:<path>``."""
    return {PREFIX + path: torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)
            for path, text in entries.items()}


def from_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """The ``surface:`` entries of a loaded file back as ``{path: JSON text}``."""
    return {key[len(PREFIX):]: bytes(t.tolist()).decode("utf-8") for key, t in tensors.items()
            if key.startswith(PREFIX)}


# ------------------------------------------------------------------------------------------------------------------
# Comparison


def _compared(desc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in desc.items() if k != "origin"}


def _names(desc: dict[str, Any]) -> list[str]:
    sig = desc.get("signature")
    return [p[0] for p in sig["params"]] if sig else []


def _without_names(desc: dict[str, Any]) -> dict[str, Any]:
    sig = desc.get("signature")
    if not sig:
        return _compared(desc)
    return {**_compared(desc), "signature": {**sig, "params": [[None, *p[1:]] for p in sig["params"]]}}


def _renamed_params(old: dict[str, Any], new: dict[str, Any]) -> list[str] | None:
    """``["a → b", ...]`` when the two differ in parameter names only, else ``None``."""
    if _without_names(old) != _without_names(new):
        return None
    return [f"{a} → {b}" for a, b in zip(_names(old), _names(new)) if a != b]


def _compact(desc: dict[str, Any]) -> str:
    """One line: the kind and the call without annotations (``kind(a, /, b=1, *, c=None)``), or the value."""
    sig = desc.get("signature")
    if desc["kind"] in ("attribute", "value"):
        shown = [desc.get("annotation") or desc.get("type") or "", desc.get("value")]
        return f"{desc['kind']} " + " = ".join(s for s in shown if s)
    if desc["kind"] == "property":
        return f"property -> {desc.get('returns')}" + (" (settable)" if desc.get("settable") else "")
    if not sig:
        return desc["kind"]
    parts: list[str] = []
    star = False
    for i, (name, kind, _, default) in enumerate(sig["params"]):
        if kind == "VAR_POSITIONAL":
            star, name = True, "*" + name
        elif kind == "VAR_KEYWORD":
            name = "**" + name
        elif kind == "KEYWORD_ONLY" and not star:
            star = True
            parts.append("*")
        parts.append(name if default is None else f"{name}={default}")
        nxt = sig["params"][i + 1][1] if i + 1 < len(sig["params"]) else None
        if kind == "POSITIONAL_ONLY" and nxt != "POSITIONAL_ONLY":
            parts.append("/")
    return f"{desc['kind']}({', '.join(parts)})"


def _changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between two descriptions of one path, a line each."""
    lines = [f"{k}: {old.get(k)!r} → {new.get(k)!r}" for k in sorted(set(old) | set(new))
             if k not in ("signature", "origin") and old.get(k) != new.get(k)]
    a, b = old.get("signature") or {"params": [], "returns": None}, new.get("signature") or {"params": [],
                                                                                             "returns": None}
    pa, pb = {p[0]: p for p in a["params"]}, {p[0]: p for p in b["params"]}
    for name in pa:
        if name not in pb:
            lines.append(f"- parameter {name} ({pa[name][1]}, default {pa[name][3]})")
    for name in pb:
        if name not in pa:
            lines.append(f"+ parameter {name} ({pb[name][1]}, default {pb[name][3]})")
        elif pa[name] != pb[name]:
            lines.append(f"~ parameter {name}: {pa[name][1:]} → {pb[name][1:]}")
    common_a, common_b = [n for n in pa if n in pb], [n for n in pb if n in pa]
    if common_a != common_b:
        lines.append(f"parameter order: {common_a} → {common_b}")
    if a["returns"] != b["returns"]:
        lines.append(f"returns: {a['returns']} → {b['returns']}")
    return lines


def _order(path: str) -> tuple[int, str]:
    return path.count("."), path


def compare_surfaces(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """The differences of two surfaces (``{path: JSON}``) as printable lines: ``renamed:``, ``removed:``, ``added:``
    and ``changed:`` entries (module docstring); ``[]`` when they are equal."""
    old = {k: json.loads(v) for k, v in before.items()}
    new = {k: json.loads(v) for k, v in after.items()}
    items: list[tuple[tuple[Any, ...], str, str, list[str]]] = []  # (group key, path, line, detail lines)

    def add(group: tuple[Any, ...], path: str, line: str, detail: list[str] | None = None) -> None:
        items.append((group, path, line, detail or []))

    for path in sorted(set(old) & set(new), key=_order):
        a, b = old[path], new[path]
        if _compared(a) == _compared(b):
            continue
        name, texts = path.rsplit(".", 1)[-1], (json.dumps(a, sort_keys=True), json.dumps(b, sort_keys=True))
        renamed = _renamed_params(a, b)
        if renamed:
            add(("renamed", name, *texts), path, f"renamed: {path}({', '.join(renamed)})")
        else:
            add(("changed", name, *texts), path, f"changed: {path}", _changes(a, b))

    removed = sorted(set(old) - set(new), key=_order)
    added = sorted(set(new) - set(old), key=_order)
    parent = {p: p.rsplit(".", 1)[0] for p in removed + added}
    matches: dict[str, list[str]] = {r: [a for a in added if parent[a] == parent[r]
                                         and _renamed_params(old[r], new[a]) is not None] for r in removed}
    pairs: dict[str, str] = {}
    for r, candidates in matches.items():
        if len(candidates) == 1 and sum(candidates[0] in c for c in matches.values()) == 1:
            pairs[r] = candidates[0]
    # a renamed class takes its members along when they are unchanged
    carried: set[str] = set()
    for r, a in pairs.items():
        if old[r]["kind"] == "class":
            for member in removed:
                if member.startswith(r + "."):
                    twin = a + member[len(r):]
                    if twin in new and _compared(new[twin]) == _compared(old[member]):
                        carried.update((member, twin))
    for r, a in pairs.items():
        if r in carried:
            continue
        renamed = _renamed_params(old[r], new[a]) or []
        old_name, new_name = r.rsplit(".", 1)[-1], a.rsplit(".", 1)[-1]
        moved = sum(m.startswith(r + ".") for m in carried)
        line = f"renamed: {parent[r]}.{old_name} → {new_name}" + (f"({', '.join(renamed)})" if renamed else "")
        line += f" ({moved} member{'s' if moved > 1 else ''} along)" if moved else ""
        group = ("renamed", old_name, new_name, json.dumps(old[r], sort_keys=True), json.dumps(new[a], sort_keys=True))
        add(group, r, line)
    for path in removed:
        if path not in pairs and path not in carried:
            add(("removed", path.rsplit(".", 1)[-1], json.dumps(old[path], sort_keys=True)), path,
                f"removed: {path}  {_compact(old[path])}")
    for path in added:
        if path not in pairs.values() and path not in carried:
            add(("added", path.rsplit(".", 1)[-1], json.dumps(new[path], sort_keys=True)), path,
                f"added: {path}  {_compact(new[path])}")

    grouped: dict[tuple[Any, ...], list[tuple[str, str, list[str]]]] = defaultdict(list)
    for group, path, line, detail in items:
        grouped[group].append((path, line, detail))
    lines: list[str] = []
    rank = {"renamed": 0, "removed": 1, "added": 2, "changed": 3}
    for _group, entries in sorted(grouped.items(), key=lambda g: (rank[g[0][0]], _order(g[1][0][0]))):
        entries.sort(key=lambda e: _order(e[0]))
        path, line, detail = entries[0]
        also = [e[0] for e in entries[1:]]
        lines.append(line + (f"  (also: {', '.join(also)})" if also else ""))
        lines.extend("    " + d for d in detail)
    return lines

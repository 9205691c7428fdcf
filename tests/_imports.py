"""torchdebug's import graph read from its source with ``ast``: what the layering and session-shape tests walk.

Every import counts: module level, inside functions and under ``TYPE_CHECKING``; relative imports are
resolved against the importing module's package.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import torchdebug

ROOT = Path(torchdebug.__file__).parent


def module_name(f: Path) -> str:
    """The dotted name of a source file under ``ROOT`` (a package's ``__init__.py``: the package)."""
    parts = list(f.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(f: Path) -> list[tuple[str, list[str]]]:
    """Each import statement of ``f`` as (the module it names, the dotted names a from-import takes from
    it: ``from . import sentinel`` in ``torchdebug.nonfinite.replay`` -> ``("torchdebug.nonfinite",
    ["torchdebug.nonfinite.sentinel"])``); ``import a, b`` gives one entry per module."""
    name = module_name(f)
    package = name if f.stem == "__init__" else name.rpartition(".")[0]
    out: list[tuple[str, list[str]]] = []
    for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            out.append((base, [f"{base}.{a.name}" for a in node.names]))
        elif isinstance(node, ast.Import):
            out.extend((a.name, []) for a in node.names)
    return out


def assert_no_circle(edges: Mapping[str, Iterable[str]]) -> None:
    """Raise ``AssertionError`` naming the first import circle (``a -> b -> a``) in ``edges``."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError("import circle: " + " -> ".join([*path[path.index(node) :], node]))
        if node in done:
            return
        for nxt in sorted(edges.get(node, ())):
            visit(nxt, [*path, node])
        done.add(node)

    for node in sorted(edges):
        visit(node, [])

"""The package's layering (docs/architecture.md): data flows one way and no capability imports in a circle."""

from __future__ import annotations

import ast
from pathlib import Path

import torchdebug

ROOT = Path(torchdebug.__file__).parent
# the public surface and entry points may import any layer; they are not part of a layer themselves
SURFACE = {
    "torchdebug",
    "torchdebug.__main__",
    "torchdebug.cli",
    "torchdebug._demo_cli",
    "torchdebug.demo",
    "torchdebug.demos",
}


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and (ROOT / parts[1]).is_dir():
        return parts[1]
    return "core"  # the small shared core: _config, _errors, events, stats, _frames, _trees, _robust


def _imports() -> dict[str, set[str]]:
    """layer -> the layers its modules import (module-level and function-level imports alike)."""
    edges: dict[str, set[str]] = {}
    for f in ROOT.rglob("*.py"):
        parts = list(f.relative_to(ROOT.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        module = ".".join(parts)
        if module in SURFACE:
            continue
        package = module if is_pkg else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    targets = [".".join(base + ([node.module] if node.module else []))]
                else:
                    targets = [node.module or ""]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for t in targets:
                if t == "torchdebug" or t.startswith("torchdebug."):
                    src, dst = _layer(module), _layer(t)
                    if t != "torchdebug" and src != dst:
                        edges.setdefault(src, set()).add(dst)
                    if t == "torchdebug":
                        edges.setdefault(src, set()).add("<surface>")
    return edges


def test_layers_found() -> None:
    # the map in docs/architecture.md: a capability per folder beside the small core
    assert {"compat", "health", "memory", "nonfinite", "perf", "session", "sinks", "store", "views"} <= set(
        _imports()
    )


def test_store_knows_no_view_and_no_engine() -> None:
    assert _imports()["store"] == {"core"}


def test_views_read_the_store_only() -> None:
    assert _imports()["views"] <= {"core", "store"}


def test_sinks_consume_the_store_only() -> None:
    # the tracker sinks are consumers of a run's records, like the views (docs/architecture.md)
    assert _imports()["sinks"] <= {"core", "store", "views"}
    assert "sinks" not in _imports()["views"] and "sinks" not in _imports()["store"]


def test_no_layer_imports_the_public_surface() -> None:
    assert [k for k, v in _imports().items() if "<surface>" in v] == []


def test_no_circle_between_layers() -> None:
    edges = _imports()
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

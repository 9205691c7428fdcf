"""The session core's shape (docs/architecture.md, "The step state"): small classes, no import circle
among the modules of session/ and nonfinite/ (function-level and TYPE_CHECKING imports count too),
instruments and the sentinel typed with the session's narrow view, not ``Any``."""

from __future__ import annotations

import ast
from pathlib import Path

import torchdebug

ROOT = Path(torchdebug.__file__).parent
PACKAGES = ("session", "nonfinite")
MAX_CLASS_LINES = 600


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).glob("*.py")):
            mods[f"torchdebug.{pkg}" if f.stem == "__init__" else f"torchdebug.{pkg}.{f.stem}"] = f
    return mods


def _edges() -> dict[str, set[str]]:
    """module -> the modules of session/ and nonfinite/ it imports, anywhere in its text (a package's
    own ``__init__`` is not an edge: importing a submodule always runs its package first)."""
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, f in mods.items():
        package = name if f.stem == "__init__" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(
                        parts[: len(parts) - node.level + 1] + ([node.module] if node.module else [])
                    )
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for t in targets:
                if t in mods and t != name and not (f.stem != "__init__" and t == package):
                    edges[name].add(t)
    return edges


def test_the_import_graph_is_read_from_the_source() -> None:
    edges = _edges()
    # known edges, so the parser above cannot silently see nothing
    assert "torchdebug.nonfinite.sentinel" in edges["torchdebug.session.monitor"]
    assert "torchdebug.nonfinite.replay" in edges["torchdebug.nonfinite.sentinel"]
    assert "torchdebug.session.protocol" in edges["torchdebug.session.driver"]


def test_no_import_circle_in_the_session_core() -> None:
    edges = _edges()
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError("import circle: " + " -> ".join([*path[path.index(node) :], node]))
        if node in done:
            return
        for nxt in sorted(edges[node]):
            visit(nxt, [*path, node])
        done.add(node)

    for node in sorted(edges):
        visit(node, [])


def test_no_class_of_the_session_core_is_over_600_lines() -> None:
    sizes = {}
    for name, f in _modules().items():
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                sizes[f"{name}.{node.name}"] = node.end_lineno - node.lineno + 1  # type: ignore[operator]
    assert "torchdebug.session.monitor.Monitor" in sizes and "torchdebug.nonfinite.sentinel.Sentinel" in sizes
    assert {k: n for k, n in sizes.items() if n > MAX_CLASS_LINES} == {}


def test_the_session_is_handed_over_typed() -> None:
    # instruments, the sentinel and the session's own parts receive SessionView / Session, never Any
    untyped = []
    for name, f in _modules().items():
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for arg in node.args.args + node.args.kwonlyargs:
                    if arg.arg == "mon" and (arg.annotation is None or ast.unparse(arg.annotation) == "Any"):
                        untyped.append(f"{name}.{node.name}")
    assert untyped == []

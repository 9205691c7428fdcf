"""The package's layering (docs/architecture.md): data flows one way and no capability imports in a circle."""

from __future__ import annotations

from tests._imports import ROOT, assert_no_circle, imports, module_name

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
    # the small shared core: _config, _errors, events, stats, _verdict, _frames, _trees, _robust
    return "core"


def _imports() -> dict[str, set[str]]:
    """layer -> the layers its modules import (module-level and function-level imports alike)."""
    edges: dict[str, set[str]] = {}
    for f in ROOT.rglob("*.py"):
        module = module_name(f)
        if module in SURFACE:
            continue
        for t, _ in imports(f):
            if t == "torchdebug":
                edges.setdefault(_layer(module), set()).add("<surface>")
            elif t.startswith("torchdebug.") and _layer(module) != _layer(t):
                edges.setdefault(_layer(module), set()).add(_layer(t))
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
    assert_no_circle(_imports())

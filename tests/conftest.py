"""Shared pytest options and fixtures (append-only: each owner adds their own block)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


# -- report goldens (tests/test_report.py) -----------------------------------------------------------
def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--overwrite-golden",
        action="store_true",
        default=False,
        help="rewrite tests/golden/* from the current output instead of comparing",
    )


# -- views: run folders written by the real watch() (healthy, diverged, failed, many NaN steps) --------


@pytest.fixture(scope="session")
def watched_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """``{"healthy", "diverged", "failed", "warned": run folder}``, built once per session (~10 s)."""
    import warnings

    from tests.fixtures import watched_runs as W

    root = tmp_path_factory.mktemp("watched")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a healthy run warns about nothing
        out: dict[str, object] = {"healthy": W.healthy_run(root)}
    out["diverged"] = W.diverged_run(root)
    out["failed"] = W.failed_run(root)
    out["warned"] = W.many_nan_run(root)
    return out


# -- one headless Chromium per test module (the browser tests of the dashboard, report and ranks) ------
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """A launched headless Chromium (playwright); skips without fastapi, playwright or the browser."""
    pytest.importorskip("fastapi")
    sync_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no browser at {CHROMIUM} (install it: bash scripts/ensure_browser.sh)")
    with sync_api.sync_playwright() as p:
        try:
            b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        except Exception as e:  # a broken install must not fail the suite
            pytest.skip(f"chromium at {CHROMIUM} cannot be launched: {str(e).splitlines()[0]}")
        yield b
        b.close()


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``[n, elements]``: calls so far of the flatten with which ``torchdebug._tensors`` copies tensors
    (torch's ``flatten_dense_tensors``: the gradient measure's copy of every small gradient, the
    update ratio's snapshot of the weights), and the elements they copied."""
    from torchdebug import _tensors

    calls = [0, 0]
    orig = _tensors._flatten

    def counted(tensors: list[Any]) -> Any:
        calls[0] += 1
        calls[1] += sum(t.numel() for t in tensors)
        return orig(tensors)

    monkeypatch.setattr(_tensors, "_flatten", counted)
    return calls

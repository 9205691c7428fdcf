"""Shared pytest options and fixtures (append-only: each owner adds their own block)."""

from __future__ import annotations

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

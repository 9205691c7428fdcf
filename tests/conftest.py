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

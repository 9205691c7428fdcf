"""The core install is complete as users see it: what `make demo` installs imports without warnings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+; the check is the same on every version

ROOT = Path(__file__).resolve().parents[1]


def _core_dependencies() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    out = {}
    for spec in project["dependencies"]:
        name = spec.split(">")[0].split("<")[0].split("=")[0].split("[")[0].strip().lower()
        out[name] = spec
    return out


def test_numpy_is_a_core_dependency_with_a_range() -> None:
    # issue 13, item 13: without numpy, `import torch` in the fresh `make demo` venv printed
    # "UserWarning: Failed to initialize NumPy: No module named 'numpy'" before anything else
    deps = _core_dependencies()
    assert deps["numpy"] == "numpy>=1.24"
    assert set(deps) == {"torch", "psutil", "numpy"}


def test_importing_torchdebug_warns_nothing() -> None:
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", "import torchdebug, torchdebug.demo"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr

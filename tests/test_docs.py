"""The docs site builds with ``mkdocs build --strict``, and every python block of the Getting-started page runs."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# the pages whose code a new user copies first: every ```python block on them must run as written
GETTING_STARTED = ["index.md"]


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """(line number, code) of each fenced ```python block, in page order."""
    text = page.read_text(encoding="utf-8")
    blocks = []
    for m in re.finditer(r"^```python\n(.*?)^```$", text, re.S | re.M):
        blocks.append((text.count("\n", 0, m.start()) + 2, m.group(1)))
    return blocks


@pytest.mark.parametrize("page", GETTING_STARTED)
def test_every_python_block_of_the_getting_started_pages_runs(
    page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocks = python_blocks(DOCS / page)
    assert len(blocks) >= 5, "the page's examples were not found"
    monkeypatch.chdir(tmp_path)  # runs/ lands here
    namespace: dict = {"__name__": "__docs__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        for line, code in blocks:  # one namespace per page: later blocks build on earlier ones
            exec(compile(code, f"{DOCS / page}:{line}", "exec"), namespace)
    printed = out.getvalue()
    # what the comments in the page promise
    assert "nan born in input of Sequential (step 12)" in printed
    assert "<Monitor closed: step 20, 1 anomaly, 0 warnings, run runs/sequential-" in printed
    assert "<Run sequential: finished, 20 steps, 1 anomaly, runs/sequential-" in printed


@pytest.mark.slow
def test_docs_build_strict(tmp_path: Path) -> None:
    mkdocs = shutil.which("mkdocs", path=os.path.dirname(sys.executable)) or shutil.which("mkdocs")
    if mkdocs is None:
        pytest.skip("mkdocs is not installed: pip install -e '.[docs]'")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    site = tmp_path / "site"
    config = (site / "configuration" / "index.html").read_text(encoding="utf-8")
    assert "TORCHDEBUG_ANNOUNCE" in config and "slowdown_factor" in config  # generated from DebugConfig
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    assert "locate_nonfinite" in api and "NonFiniteError" in api

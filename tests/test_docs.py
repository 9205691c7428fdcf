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


@pytest.mark.slow  # four short training loops and a replay: ~10 s on the 2-core VM
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
    assert not re.search(r":(?:class|func|meth|attr|mod|exc):<code>", api)  # no raw Sphinx role
    for page in site.rglob("*.html"):  # no font (or anything) fetched from Google when a page opens
        assert "fonts.googleapis" not in page.read_text(encoding="utf-8"), page


def _hooks():
    import importlib.util

    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "scripts" / "mkdocs_hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_optional_pages_join_the_nav_only_when_their_files_exist(tmp_path: Path) -> None:
    hooks = _hooks()
    base = [
        {"Getting started": "index.md"},
        {"Integrations": "integrations.md"},
        {"Configuration reference": "configuration.md"},
        {"API reference": "api.md"},
    ]
    config = {"docs_dir": str(tmp_path), "nav": list(base)}
    assert hooks.on_config(config)["nav"] == base  # neither file: the strict build has no dead entry
    (tmp_path / "trackers.md").write_text("# Trackers\n")
    (tmp_path / "compatibility.md").write_text("# Compatibility\n")
    config = {"docs_dir": str(tmp_path), "nav": list(base)}
    assert [next(iter(item)) for item in hooks.on_config(config)["nav"]] == [
        "Getting started",
        "Integrations",
        "Trackers",
        "Configuration reference",
        "Compatibility",
        "API reference",
    ]


def test_configuration_reference_lists_every_option() -> None:
    import dataclasses

    from torchdebug import DebugConfig

    page = _hooks().configuration_page()
    fields = dataclasses.fields(DebugConfig)
    assert f"## Every option ({len(fields)})" in page
    for f in fields:
        assert f"| `{f.name}` |" in page
    assert "| `announce` | `True` | True or False | `TORCHDEBUG_ANNOUNCE` |" in page
    assert "| `policy` | `'raise'` | one of 'raise', 'warn', 'skip' | `TORCHDEBUG_POLICY` |" in page
    # what a new user sets first leads; the seed-era switches come last
    table = page[page.index("## Every option") :]
    rows = [line.split("`")[1] for line in table.splitlines() if line.startswith("| `")]
    rows = [r for r in rows if r in {f.name for f in fields}]
    assert rows[:3] == ["policy", "run_dir", "run_name"]
    assert (
        page.index("### Start here") < page.index("### Everything else") < page.index("### Seed-era switches")
    )
    assert rows.index("debug_lr_scheduling") > rows.index("hang_timeout")


def test_sphinx_roles_are_stripped_from_the_rendered_pages() -> None:
    strip = _hooks().strip_roles
    assert strip("One pure function (:func:<code>judge</code>)") == "One pure function (<code>judge</code>)"
    assert strip("a :class:<code>~torch.Tensor</code>") == "a <code>Tensor</code>"
    assert (
        strip(":meth:<code>Run.series</code> and <code>x</code>")
        == "<code>Run.series</code> and <code>x</code>"
    )

"""The command line and ``import torchdebug`` start without torch: reading a run folder needs SQLite and JSON only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from torchdebug.store import create_run


@pytest.fixture
def runs_root(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    w = create_run(root=root, name="tiny")
    for step in range(3):
        w.log_scalars(step, {"loss": 1.0 / (step + 1)})
    w.close("finished")
    return root


def _modules_after(code: str) -> tuple[int, str]:
    """Run ``code`` in a fresh interpreter; returns (exit code, last stdout line)."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.returncode, done.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["runs"], ["show", "RUN"], ["report", "RUN"], ["serve", "--help"], ["demo", "--help"]],
    ids=["help", "runs", "show", "report", "serve-help", "demo-help"],
)
def test_reading_commands_do_not_import_torch(argv: list[str], runs_root: Path) -> None:
    (run,) = runs_root.iterdir()
    args = [str(run) if a == "RUN" else a for a in argv]
    if argv == ["runs"]:
        args = ["runs", "--runs", str(runs_root)]
    code = (
        "import contextlib, io, sys\n"
        "from torchdebug.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    code = main({args!r})\n"
        "print(code, 'torch' in sys.modules)"
    )
    assert _modules_after(code)[1] == "0 False"


def test_import_is_lazy_until_a_name_is_used() -> None:
    code = (
        "import sys, torchdebug as td\n"
        "before = 'torch' in sys.modules\n"
        "err = td.TorchDebugError, td.__version__, td.open_run  # no torch needed for these\n"
        "middle = 'torch' in sys.modules\n"
        "td.watch\n"
        "print(before, middle, 'torch' in sys.modules, 'torch.distributed.tensor' in sys.modules)"
    )
    # watch brings torch, but not torch.distributed.tensor (~0.5 s): DTensor is looked up only once
    # the user's code imported it
    assert _modules_after(code)[1] == "False False True False"


def test_unknown_attribute_is_an_attribute_error() -> None:
    import torchdebug as td

    with pytest.raises(AttributeError, match="module 'torchdebug' has no attribute 'wacth'"):
        td.wacth  # noqa: B018
    assert "watch" in dir(td) and "Anomaly" in dir(td)


def test_the_dashboard_app_is_built_without_torch(runs_root: Path) -> None:
    code = (
        "import sys\n"
        "from torchdebug.views.server._app import create_app\n"
        f"create_app({str(runs_root)!r})\n"
        "print('torch' in sys.modules)"
    )
    assert _modules_after(code)[1] == "False"

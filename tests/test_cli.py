"""Tests of the torchdebug command line: exit codes, one-line errors, runs/show output, command plugins."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from torchdebug._errors import RunStoreError
from torchdebug._version import __version__
from torchdebug.cli import _COMMAND_MODULES, build_parser, main
from torchdebug.events import Anomaly
from torchdebug.store import create_run


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torchdebug", *args], capture_output=True, text=True, timeout=60, cwd=cwd
    )


@pytest.fixture
def runs_dir(tmp_path: Path) -> Path:
    """./runs with one finished run "golden" (4 steps, hand-picked) and one still marked running."""
    root = tmp_path / "runs"
    w = create_run(root=root, name="golden", config={"lr": 0.5, "mode": "full"})
    loss = [2.0, 1.5, 1.25, math.nan]
    for step in range(4):
        w.log_scalars(step, {"loss": loss[step], "grad_norm": 4.0 / (step + 1), "zeta": float(step)})
    w.log_anomaly(
        3, Anomaly(phase="forward", module="fc2", op="aten.addmm", location="train.py:42", kind="nan", step=3)
    )
    w.log_anomaly(2, {"phase": "backward", "module": "fc1", "kind": "inf"})
    w.log_event(1, "loss_spike", "warning", "x")
    w.log_event(2, "loss_spike", "warning", "y")
    w.log_event(3, "nonfinite_gradients", "error", "z")
    w.close()
    live = create_run(root=root, name="live")
    live.log_scalar("loss", 0, 1.0)
    live.flush()
    yield root
    live.close()


# -- exit codes, through the real entry points -------------------------------------------------------


def test_version_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"torchdebug {__version__}\n"
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "runs" in out and "show" in out and "--debug" in out


def test_usage_error_exits_2_with_one_line() -> None:
    done = _cli("frobnicate")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith(
        "torchdebug: error: argument <command>: invalid choice: 'frobnicate' (choose from"
    )
    assert done.stderr.endswith(") (see 'torchdebug --help')\n")
    assert done.stdout == ""


@pytest.mark.parametrize(
    ("args", "line"),
    [
        ([], "torchdebug: error: choose a command: "),
        (
            ["show"],
            "torchdebug show: error: the following arguments are required: RUN (see 'torchdebug show --help')",
        ),
        (
            ["runs", "--colour"],
            "torchdebug: error: unrecognized arguments: --colour (see 'torchdebug --help')",
        ),
        (
            ["show", "x", "--rank", "one"],
            "torchdebug show: error: argument --rank: expected an integer >= 0, got 'one'",
        ),
    ],
    ids=["no-command", "missing-argument", "unknown-option", "bad-option-value"],
)
def test_usage_errors_in_process(args: list[str], line: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith(line), captured.err
    assert captured.out == ""


def test_failure_exits_1_with_one_line_and_debug_shows_traceback(tmp_path: Path) -> None:
    (tmp_path / "notarun").mkdir()
    done = _cli("show", "notarun", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.startswith("torchdebug: error: notarun is not a torchdebug run (no meta.json)")
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    done = _cli("show", "notarun", "--debug", cwd=tmp_path)
    assert done.returncode == 1
    assert "Traceback (most recent call last)" in done.stderr and "RunStoreError" in done.stderr


def test_the_error_line_escapes_control_characters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = "no\x1b[2Jrun\nhere"  # an escape sequence that would clear the screen, and a newline
    assert main(["show", str(tmp_path / bad)]) == 1
    err = capsys.readouterr().err
    assert "\x1b" not in err and err.count("\n") == 1
    assert "no\\x1b[2Jrun here" in err, err


def test_console_script_runs() -> None:
    script = Path(sys.executable).parent / "torchdebug"
    if not script.exists():
        pytest.skip("the torchdebug console script is not installed next to this interpreter")
    done = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, f"torchdebug {__version__}\n"), done.stderr


def test_command_discovery_imports_no_heavy_dependency() -> None:
    assert _COMMAND_MODULES == [
        "torchdebug.views.runs_cli",
        "torchdebug._demo_cli",
        "torchdebug.views.report._cli",
        "torchdebug.views._compare_cli",
        "torchdebug.sinks._cli",
        "torchdebug.views.server._cli",
        "torchdebug.integrations._run_cli",
    ]
    code = (
        "import sys; from torchdebug.cli import build_parser; build_parser(); "
        "print(sorted(m for m in ('fastapi', 'uvicorn', 'matplotlib', 'plotly', 'tensorboard', 'lightning', 'transformers', 'wandb', 'mlflow') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, "[]"), done.stderr


# the golden run's verdict: two NaN/Inf steps (3 and 2, logged in that order: the earliest step's is
# named), then its rule events counted by kind (the nonfinite_gradients error is the same incident)
GOLDEN_VERDICT = (
    "finished, 2 steps with non-finite values, first at step 2: inf in backward of fc1; "
    "also 1 nonfinite_gradients, 2 loss_spike"
)


# -- runs --------------------------------------------------------------------------------------------


def test_runs_table(
    runs_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(runs_dir.parent)
    assert main(["runs"]) == 0  # DIR defaults to ./runs
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["NAME", "STATUS", "VERDICT", "STEPS", "ANOMALIES", "CREATED", "PATH"]
    rows = [line.split() for line in out[1:]]
    # golden finished with 2 NaN/Inf steps: its verdict is an error, never a green "finished"
    assert [(r[0], r[1], r[2], r[3], r[4]) for r in rows] == [
        ("golden", "finished", "error", "4", "2"),
        ("live", "running", "running", "1", "0"),
    ]
    assert rows[0][-1].startswith("runs/golden-")


def test_runs_colours_by_the_verdict(
    runs_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert main(["runs", str(runs_dir)]) == 0
    golden = capsys.readouterr().out.splitlines()[1]
    # status and verdict red (SGR 31), not the green (32) a finished status alone would get
    assert "\x1b[31mfinished" in golden and "\x1b[31merror" in golden and "\x1b[32m" not in golden


def test_runs_json_and_empty_and_missing(
    runs_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["runs", str(runs_dir), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(d["name"], d["status"], d["steps"], d["anomalies"], d["verdict"]["level"]) for d in data] == [
        ("golden", "finished", 4, 2, "error"),
        ("live", "running", 1, 0, "running"),
    ]
    assert data[0]["verdict"]["text"] == GOLDEN_VERDICT
    (tmp_path / "empty").mkdir()
    assert main(["runs", str(tmp_path / "empty")]) == 0
    assert capsys.readouterr().out == f"no runs in {tmp_path / 'empty'}\n"
    assert main(["runs", str(tmp_path / "nowhere")]) == 1
    err = capsys.readouterr().err
    assert (
        err
        == f"torchdebug: error: {tmp_path / 'nowhere'} does not exist; runs are written under ./runs by default, pass their folder: torchdebug runs --runs DIR\n"
    )


def test_runs_lists_an_unreadable_run(runs_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    [golden] = runs_dir.glob("golden-*")
    (golden / "rank0.sqlite").write_bytes(b"not a database at all" * 10)
    assert main(["runs", str(runs_dir)]) == 0
    out = capsys.readouterr().out
    assert "unreadable" in out and "is not a SQLite database" in out


# -- show --------------------------------------------------------------------------------------------


def test_show_text(runs_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    [golden] = runs_dir.glob("golden-*")
    assert main(["show", str(golden)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    # the verdict first: two anomalies (steps 3 and 2, logged in that order): the earliest step's is named
    assert lines[0] == GOLDEN_VERDICT
    assert lines[1].startswith("run        golden  (id ")
    assert "status     finished" in lines
    assert "steps      4 (last step 3)" in lines
    # only options that differ from DebugConfig's defaults ("lr" is not an option: shown as is)
    assert "config     lr=0.5  mode=full  (torchdebug show --json for all 2 options)" in lines
    i = lines.index("metrics (3), last value")
    # loss and grad_norm are "main" metrics and come first; then the rest alphabetically.
    # grad_norm at step 3 = 4 / (3 + 1) = 1; loss at step 3 is NaN.
    assert [ln.split() for ln in lines[i + 1 : i + 4]] == [
        ["loss", "nan", "at", "step", "3"],
        ["grad_norm", "1", "at", "step", "3"],
        ["zeta", "3", "at", "step", "3"],
    ]
    i = lines.index("anomalies (2)")
    assert lines[i + 1] == "  nan born in forward of fc2: aten.addmm at train.py:42 (step 3)"
    assert lines[i + 2] == "  step 2: inf in backward of fc1"
    i = lines.index("events (3)")
    assert lines[i + 1 : i + 3] == ["  loss_spike  2", "  nonfinite_gradients  1"]


def test_show_by_name_json_and_errors(
    runs_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["show", "golden", "--root", str(runs_dir), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["name"] == "golden" and data["steps"] == 4 and data["anomalies"] == 2
    assert data["last_values"]["loss"] == {"step": 3, "value": "nan"}
    assert data["events"] == {"loss_spike": 2, "nonfinite_gradients": 1}
    monkeypatch.chdir(runs_dir.parent)
    assert main(["show", "live"]) == 0  # looked up under ./runs
    assert "status     running" in capsys.readouterr().out
    assert main(["show", "golden", "--rank", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("torchdebug: error: runs/golden-") and err.endswith(
        "has no rank 1 (ranks present: [0])\n"
    )
    assert main(["show", "nope"]) == 1
    assert capsys.readouterr().err == (
        "torchdebug: error: nope does not exist (no such folder, and no run named 'nope' under runs)\n"
    )
    with pytest.raises(RunStoreError):  # --debug lets the exception through, anywhere on the line
        main(["show", "nope", "--debug"])


# -- command plugins ---------------------------------------------------------------------------------


@pytest.fixture
def plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "tdplug_ok.py").write_text(
        textwrap.dedent(
            """
            from torchdebug import RunStoreError

            def register(subparsers):
                p = subparsers.add_parser("hello", help="say hello")
                p.add_argument("who")
                p.set_defaults(func=lambda args: print(f"hello {args.who}") or 0)
                subparsers.add_parser("three").set_defaults(func=lambda args: 3)
                subparsers.add_parser("fail").set_defaults(func=_fail)
                subparsers.add_parser("boom").set_defaults(func=_boom)

            def _fail(args):
                raise RunStoreError("runs/x is not a torchdebug run (no meta.json)")

            def _boom(args):
                raise RuntimeError("unexpected\\nsecond line")
            """
        )
    )
    (tmp_path / "tdplug_broken.py").write_text(
        "import tdplug_no_such_dependency\n\ndef register(s):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))


def test_plugins_add_commands(plugins: None, capsys: pytest.CaptureFixture[str]) -> None:
    mods = ["tdplug_ok", "tdplug_not_written_yet", "tdplug_pkg_not_written.sub._cli"]
    assert main(["hello", "world"], modules=mods) == 0
    assert capsys.readouterr().out == "hello world\n"
    assert main(["three"], modules=mods) == 3
    assert main(["fail"], modules=mods) == 1
    assert capsys.readouterr().err == "torchdebug: error: runs/x is not a torchdebug run (no meta.json)\n"
    assert main(["boom"], modules=mods) == 4  # torchdebug itself failed: told apart from 1
    assert capsys.readouterr().err == (
        "torchdebug: error: internal error RuntimeError: unexpected second line "
        "(rerun with --debug for the traceback and report it)\n"
    )
    with pytest.raises(RuntimeError, match="unexpected"):
        main(["boom", "--debug"], modules=mods)


def test_a_broken_plugin_is_reported_not_hidden(plugins: None, capsys: pytest.CaptureFixture[str]) -> None:
    # Its own dependency is missing: that is not "module not written yet", so it must not pass silently.
    with pytest.raises(ModuleNotFoundError, match="tdplug_no_such_dependency"):
        build_parser(["tdplug_ok", "tdplug_broken"])
    assert main(["hello", "you"], modules=["tdplug_broken", "tdplug_ok"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "hello you\n"
    assert captured.err == (
        "torchdebug: warning: commands from tdplug_broken are unavailable "
        "(No module named 'tdplug_no_such_dependency'); rerun with --debug\n"
    )
    with pytest.raises(ModuleNotFoundError):
        main(["hello", "you", "--debug"], modules=["tdplug_broken", "tdplug_ok"])

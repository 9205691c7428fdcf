"""Command-line habits: one spelling of the runs folder (older ones hidden), --rank wherever a rank is
read, exit codes that tell a found NaN from a failure, severity colour on a terminal and NO_COLOR."""

from __future__ import annotations

import argparse
import io
import os
import warnings
from pathlib import Path

import pytest

import torchdebug as td
from torchdebug._term import style, use_colour
from torchdebug.cli import build_parser, int_in_range, main
from torchdebug.integrations._run_cli import _raised_inside_torchdebug
from torchdebug.store import create_run

SCRIPT = os.path.join(os.path.dirname(__file__), "fixtures", "nanogpt_script.py")


@pytest.fixture
def two_ranks(tmp_path: Path) -> Path:
    """runs/pair-<time>/ with rank 0 (3 steps, loss 1.0) and rank 1 (5 steps, loss 2.0)."""
    root = tmp_path / "runs"
    w0 = create_run(root=root, name="pair", world_size=2)
    w1 = create_run(root=root, rank=1, world_size=2, path=w0.path)
    for step in range(3):
        w0.log_scalar("loss", step, 1.0)
    for step in range(5):
        w1.log_scalar("loss", step, 2.0)
    w1.close("finished")
    w0.close("finished")
    return root


# -- one spelling of the runs folder -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["runs", "--runs", "R"], ("R", None)),
        (["runs", "R"], (None, "R")),  # the older positional, still read
        (["show", "x", "--runs", "R"], ("R",)),
        (["show", "x", "--root", "R"], ("R",)),
        (["report", "x", "--runs", "R"], ("R",)),
        (["export", "x", "--runs", "R", "--tensorboard", "tb"], ("R",)),
        (["serve", "--runs", "R"], ("R", None)),
        (["serve", "R"], (None, "R")),
        (["run", "--runs", "R", "train.py"], ("R",)),
        (["run", "--run-dir", "R", "train.py"], ("R",)),
        (["demo", "--runs", "R"], ("R",)),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_runs_folder_has_one_spelling_and_the_old_ones_still_work(argv: list[str], expected: tuple) -> None:
    args = build_parser().parse_args(argv)
    got = (
        (args.runs,) if len(expected) == 1 else (args.runs, getattr(args, "dir", getattr(args, "path", None)))
    )
    assert got == expected


@pytest.mark.parametrize(
    ("command", "usage"),
    [
        ("runs", "usage: torchdebug runs [-h] [--runs DIR] [--json]"),
        ("show", "usage: torchdebug show [-h] [--runs DIR] [--rank RANK] [--json] RUN"),
        (
            "report",
            "usage: torchdebug report [-h] [--runs DIR] [--rank RANK] [-o FILE] [--format {text,json,html,png}] run",
        ),
        ("run", "usage: torchdebug run [-h] [--policy {raise,warn,skip}] [--runs DIR] script ..."),
    ],
)
def test_usage_shows_runs_and_hides_the_old_spellings(
    command: str, usage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert " ".join(out.split("\n\n")[0].split()) == usage
    assert "--root" not in out and "--run-dir" not in out


def test_runs_folder_defaults_to_the_environment(
    two_ranks: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TORCHDEBUG_RUN_DIR", str(two_ranks))
    assert main(["runs"]) == 0
    assert "pair" in capsys.readouterr().out
    assert main(["show", "pair"]) == 0  # a name, looked up under $TORCHDEBUG_RUN_DIR
    assert "showing rank 0" in capsys.readouterr().out


# -- --rank wherever a rank's data is read ------------------------------------------------------------


def test_report_and_show_read_the_rank_asked_for(two_ranks: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "pair", "--runs", str(two_ranks), "--rank", "1", "--format", "json"]) == 0
    import json

    doc = json.loads(capsys.readouterr().out)
    text = json.dumps(doc)
    assert '"rank": 1' in text
    assert main(["show", "pair", "--runs", str(two_ranks), "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert "showing rank 1" in out and "steps      5 (last step 4)" in out  # rank 1 wrote 5 steps
    assert main(["show", "pair", "--runs", str(two_ranks)]) == 0
    assert "steps      3 (last step 2)" in capsys.readouterr().out  # rank 0 wrote 3
    assert main(["report", "pair", "--runs", str(two_ranks), "--rank", "7"]) == 1
    assert "rank" in capsys.readouterr().err


# -- exit codes of `torchdebug run` ------------------------------------------------------------------


def test_run_exits_3_when_it_found_a_nan_also_when_training_went_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = main(
            ["run", "--policy", "skip", "--runs", str(tmp_path), SCRIPT, "--iters", "5", "--bad-iter", "2"]
        )
    assert code == 3  # the script finished (the bad update was skipped), but a NaN was found
    assert "watched GPT with AdamW: 5 steps, 1 anomalies" in capsys.readouterr().err
    assert any("nan born in forward" in str(w.message) for w in caught)


def test_run_exits_1_when_the_script_itself_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "broken.py"
    script.write_text("raise ValueError('the data path is wrong')\n")
    assert main(["run", "--runs", str(tmp_path / "runs"), str(script)]) == 1
    assert "ValueError: the data path is wrong" in capsys.readouterr().err


def test_an_error_raised_in_torchdebugs_own_code_is_told_apart() -> None:
    def caught(fn: object) -> BaseException:
        try:
            fn()  # type: ignore[operator]
        except BaseException as e:
            return e
        raise AssertionError("did not raise")

    # innermost frame in torchdebug/cli.py: torchdebug's own code (exit 4)
    assert _raised_inside_torchdebug(caught(lambda: int_in_range(0)("x"))) is True
    assert isinstance(caught(lambda: int_in_range(0)("x")), argparse.ArgumentTypeError)
    # the script's own error, and torchdebug's documented errors (bad input: the user's to fix), are not
    assert _raised_inside_torchdebug(caught(lambda: int("x"))) is False
    assert _raised_inside_torchdebug(caught(lambda: td.DebugConfig(policy="never"))) is False


def test_help_documents_the_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "3 a NaN/Inf was found; 4 torchdebug itself failed" in out


# -- colour ------------------------------------------------------------------------------------------


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("stream", "env", "expected"),
    [
        (_Tty(), {}, True),
        (_Tty(), {"NO_COLOR": "1"}, False),
        (_Tty(), {"NO_COLOR": ""}, True),  # no-color.org: an empty value does not count
        (_Tty(), {"TERM": "dumb"}, False),
        (io.StringIO(), {}, False),  # a pipe or a file
        (io.StringIO(), {"FORCE_COLOR": "1"}, True),
        (_Tty(), {"NO_COLOR": "1", "FORCE_COLOR": "1"}, False),  # NO_COLOR wins
    ],
    ids=["tty", "no-color", "empty-no-color", "dumb", "pipe", "force", "both"],
)
def test_colour_only_on_a_terminal_and_never_under_no_color(
    stream: io.StringIO, env: dict, expected: bool
) -> None:
    assert use_colour(stream, env) is expected


def test_style_colours_by_severity() -> None:
    assert style("failed", "failed", True) == "\x1b[31mfailed\x1b[0m"
    assert style("running", "running", True) == "\x1b[33mrunning\x1b[0m"
    assert style("finished", "finished", True) == "\x1b[32mfinished\x1b[0m"
    assert style("finished", "finished", False) == "finished"
    assert style("weird", "no-such-severity", True) == "weird"


def test_runs_table_is_coloured_unless_no_color(
    two_ranks: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert main(["runs", "--runs", str(two_ranks)]) == 0
    assert "\x1b[32mfinished\x1b[0m" in capsys.readouterr().out
    monkeypatch.setenv("NO_COLOR", "1")
    assert main(["runs", "--runs", str(two_ranks)]) == 0
    assert "\x1b[" not in capsys.readouterr().out

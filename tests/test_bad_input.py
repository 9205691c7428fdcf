"""Bad configuration and arguments give a clear error naming the option or file (issue 13, items 11-12)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

import torchdebug as td
from torchdebug._config import DebugConfig
from torchdebug._errors import ConfigError
from torchdebug.cli import main


# -- item 11: config values and files -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "message"),
    [
        # float(10**400) raises OverflowError: was not caught
        ({"explode_abs": 10**400}, "explode_abs=<an integer of 401 digits> is too large for a float"),
        # repr() of an int of over 4300 digits raises ValueError: the message must not
        ({"peak_flops": -(10**5000)}, "peak_flops=-<an integer of 5001 digits> is too large for a float"),
        # was accepted, then switched the memory instrument off (deque(maxlen=10**30) overflows)
        (
            {"leak_window": 10**30},
            "leak_window=<an integer of 31 digits> is out of range; expected an integer >= 2 and <= 1000",
        ),
        (
            {"loss_plateau_window": 10_001},
            "loss_plateau_window=10001 is out of range; expected an integer >= 2 and <= 10000",
        ),
        ({"frames": 10**6}, "frames=1000000 is out of range; expected an integer >= 0 and <= 10000"),
        # every other integer fits 64 bits (SQLite, C sizes)
        (
            {"rank": 2**63},
            "rank=9223372036854775808 is too large: integer options fit 64 bits (<= 2**63 - 1)",
        ),
        ({"run_name": 10**5000}, "run_name=<an integer of 5001 digits> (int) is not valid"),
    ],
    ids=[
        "huge-int-float",
        "huge-negative-int-float",
        "leak-window",
        "plateau-window",
        "frames",
        "rank",
        "huge-int-str",
    ],
)
def test_absurd_values_raise_config_error_naming_the_option(options: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        DebugConfig(**options)
    assert str(err.value).startswith(message), str(err.value)


def test_the_upper_bounds_themselves_are_accepted() -> None:
    cfg = DebugConfig(leak_window=1000, loss_plateau_window=10_000, frames=10_000, rank=2**63 - 1)
    assert (cfg.leak_window, cfg.loss_plateau_window, cfg.frames, cfg.rank) == (
        1000,
        10_000,
        10_000,
        2**63 - 1,
    )
    assert DebugConfig(explode_abs=10**300).explode_abs == 1e300  # a large int that is a float is fine


@pytest.mark.parametrize("suffix", [".json", ".toml", ".yaml"])
def test_a_huge_int_in_a_file_names_file_and_option(tmp_path: Path, suffix: str) -> None:
    if suffix == ".yaml":
        pytest.importorskip("yaml")
    path = tmp_path / f"cfg{suffix}"
    number = "1" + "0" * 400
    path.write_text(
        {".json": f'{{"explode_abs": {number}}}', ".toml": f"explode_abs = {number}\n"}.get(
            suffix, f"explode_abs: {number}\n"
        )
    )
    with pytest.raises(ConfigError) as err:
        DebugConfig.from_file(path)
    text = str(err.value)
    if suffix == ".yaml":  # YAML reads 1e400 as the float inf
        assert text.startswith(f"{path}: explode_abs="), text
    else:
        assert (
            text
            == f"{path}: explode_abs=<an integer of 401 digits> is too large for a float; expected a finite number > 0"
        )


def test_a_non_utf8_config_file_names_the_file(tmp_path: Path) -> None:
    # was: UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff ... (no file name)
    path = tmp_path / "cfg.json"
    path.write_bytes(b'{"policy": "\xff"}')
    with pytest.raises(ConfigError) as err:
        DebugConfig.from_file(path)
    assert str(err.value) == f"{path}: not UTF-8 text (byte 0xff at offset 12); save the config file as UTF-8"


def test_an_empty_json_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "cfg.json"
    path.write_text("")
    with pytest.raises(ConfigError) as err:
        DebugConfig.from_file(path)
    assert str(err.value) == f"{path}: cannot parse JSON: Expecting value: line 1 column 1 (char 0)"


def test_environment_text_is_named_and_cut() -> None:
    with pytest.raises(ConfigError) as err:
        DebugConfig.from_env({"TORCHDEBUG_LEAK_WINDOW": "1" * 5000})
    assert str(err.value) == (
        f"TORCHDEBUG_LEAK_WINDOW={'1' * 40!r}... (5000 characters) cannot be read; "
        "expected an integer >= 2 and <= 1000"
    )
    with pytest.raises(ConfigError, match=r"^TORCHDEBUG_LEAK_WINDOW='abc' cannot be read"):
        DebugConfig.from_env({"TORCHDEBUG_LEAK_WINDOW": "abc"})


def test_a_bad_rank_variable_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # was: ValueError: invalid literal for int() with base 10: 'x'
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ConfigError, match=r"^environment variable RANK='x' is not an integer"):
        td.watch(nn.Linear(2, 2), run=False)
    td.watch(nn.Linear(2, 2), run=False, config={"rank": 0})  # the fix the message names


# -- item 12: command-line arguments ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["serve", "--port", "99999"],
            "torchdebug serve: error: argument --port: expected an integer in 0..65535, got '99999'",
        ),
        (
            ["serve", "--port", "-1"],
            "torchdebug serve: error: argument --port: expected an integer in 0..65535, got '-1'",
        ),
        (
            ["demo", "--steps", "0"],
            "torchdebug demo: error: argument --steps: expected an integer >= 1, got '0'",
        ),
        (
            ["demo", "--steps", "many"],
            "torchdebug demo: error: argument --steps: expected an integer >= 1, got 'many'",
        ),
    ],
    ids=["port-too-big", "port-negative", "steps-zero", "steps-text"],
)
def test_out_of_range_arguments_are_usage_errors(
    args: list[str],
    line: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)  # `serve` would look for ./runs; a usage error must come first
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.err == line + f" (see 'torchdebug {args[0]} --help')\n"
    assert captured.out == ""


def test_port_out_of_range_exits_2_from_the_console(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "torchdebug", "serve", "--port", "99999"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 2 and "argument --port" in done.stderr

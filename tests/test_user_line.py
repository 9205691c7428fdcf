"""watch says where its run folder is, once; its warnings point at the user's line, not torchdebug's."""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import torchdebug as td


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _loop(mon: td.Monitor, model: nn.Module, opt: torch.optim.Optimizer, steps: int, bad: int | None) -> None:
    for step in range(steps):
        x = torch.ones(2, 3)
        if step == bad:
            x[0, 0] = math.nan
        loss = model(x).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        mon.step()


# -- the run folder, said once ---------------------------------------------------------------------


def test_watch_says_its_run_folder_once_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, opt = _model()
    with td.watch(model, opt, run=tmp_path) as mon:
        _loop(mon, model, opt, 3, bad=None)
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"torchdebug: recording to {mon.run_dir}\n")
    assert mon.run_dir is not None and mon.run_dir.parent == tmp_path


@pytest.mark.parametrize("how", ["argument", "config", "environment", "no-run-folder"])
def test_the_line_can_be_turned_off_and_is_absent_without_a_run_folder(
    how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    model, opt = _model()
    kwargs: dict = {"run": tmp_path}
    if how == "argument":
        kwargs["announce"] = False
    elif how == "config":
        kwargs["config"] = td.DebugConfig(announce=False)
    elif how == "environment":
        monkeypatch.setenv("TORCHDEBUG_ANNOUNCE", "0")
    else:
        kwargs["run"] = False
    with td.watch(model, opt, **kwargs) as mon:
        _loop(mon, model, opt, 2, bad=None)
    assert capsys.readouterr() == ("", "")
    assert (mon.run_dir is None) is (how == "no-run-folder")


# -- warnings point at the user's line -------------------------------------------------------------


def test_policy_warn_points_at_the_users_line(tmp_path: Path) -> None:
    model, opt = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with td.watch(model, opt, policy="warn", run=False) as mon:
            _loop(mon, model, opt, 3, bad=1)
    nan = [w for w in caught if "nan born in input" in str(w.message)]
    assert len(nan) == 1  # warned once
    assert nan[0].filename == __file__
    assert nan[0].category is td.TorchDebugWarning
    # the line is in _loop (the opt.step() whose pre-hook checks the step), not in torchdebug
    lines = _loop.__code__.co_firstlineno, _loop.__code__.co_firstlineno + 10
    assert lines[0] < nan[0].lineno <= lines[1]


def test_failed_replay_warning_points_at_the_users_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import torchdebug.nonfinite.replay as replay  # the rare path: the replay of a failing step

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("replay machinery broke")

    monkeypatch.setattr(replay, "replay_capture", broken)
    model, opt = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(td.NonFiniteError) as info, td.watch(model, opt, run=False) as mon:
            _loop(mon, model, opt, 3, bad=1)
    (w,) = [w for w in caught if "replay of the failing step failed" in str(w.message)]
    assert w.filename == __file__
    assert "the replay failed" in str(info.value)  # the symptom is still reported


def test_instrument_failure_warning_points_at_the_users_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchdebug.perf.timing import TimingInstrument

    def broken(self: object, *args: object) -> None:
        raise RuntimeError("timer broke")

    monkeypatch.setattr(TimingInstrument, "on_step_end", broken)
    model, opt = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with td.watch(model, opt, run=False) as mon:
            _loop(mon, model, opt, 2, bad=None)
    (w,) = [w for w in caught if "instrument 'timing' failed" in str(w.message)]
    assert w.filename == __file__


def test_a_warning_from_a_thread_without_user_frames_points_at_the_main_threads_line() -> None:
    import threading

    from torchdebug._frames import warn_at_user

    # the thread runs torchdebug's own function directly: nothing of the user on its stack (as on an
    # autograd device thread); the main thread is in start() or join() below, the user's lines
    t = threading.Thread(target=warn_at_user, args=(td.TorchDebugWarning("from a thread"),))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.start()  # USER-LINE
        t.join()  # USER-LINE
    (w,) = [w for w in caught if "from a thread" in str(w.message)]
    assert w.filename == __file__
    source = Path(__file__).read_text().splitlines()
    assert source[w.lineno - 1].endswith("# USER-LINE")


def test_a_warning_from_code_without_a_file_points_at_that_code() -> None:
    import subprocess
    import sys

    # `python -` reading the script from stdin: its frames are "<stdin>", no file frame at all
    script = (
        "import warnings\n"
        "from torchdebug import TorchDebugWarning\n"
        "from torchdebug._frames import warn_at_user\n"
        "warnings.simplefilter('always')\n"
        "warn_at_user(TorchDebugWarning('from stdin'))\n"
    )
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, "-"], input=script, capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.startswith("<stdin>:5: TorchDebugWarning: from stdin"), done.stderr

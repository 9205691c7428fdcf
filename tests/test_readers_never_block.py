"""Readers open regular files only, with a size cap, and never wait: a FIFO, a device or a huge file in
a run folder makes that run unreadable (or read from its database), never `runs` or the dashboard."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.runs import write_small_run
from torchdebug import RunStoreError

_DEEP = "[" * 200_000 + "]" * 200_000


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _zero(path: Path) -> None:
    path.unlink()
    path.symlink_to("/dev/zero")


# (what is done to a copy of a closed run, the status `runs` lists it with, its error or None)
_ODD = {
    "meta_fifo": (lambda r: _fifo(r / "meta.json"), "unreadable", "meta.json is not a regular file (a FIFO)"),
    "summary_fifo": (lambda r: _fifo(r / "summary.json"), "finished", None),  # read from its database
    "summary_zero": (lambda r: _zero(r / "summary.json"), "finished", None),
    "summary_deep": (lambda r: (r / "summary.json").write_text(_DEEP), "finished", None),
    "db_fifo": (
        lambda r: _fifo(r / "rank0.sqlite"),
        "unreadable",
        "rank0.sqlite is not a regular file (a FIFO)",
    ),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Path:
    template = write_small_run(tmp_path_factory.mktemp("template"), name="good")
    assert (template / "summary.json").is_file()  # a closed run: `runs` reads it, not the database
    root = tmp_path_factory.mktemp("served")
    good = root / "good"
    shutil.copytree(template, good)
    for name, (damage, _, _) in _ODD.items():
        shutil.copytree(good, root / name)
        damage(root / name)
    return root


def _unblock(root: Path) -> None:
    """Open every FIFO's writing end once, so a reader stuck on one returns (the test then fails)."""
    for p in root.glob("*/*"):
        if p.is_fifo():
            try:
                os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass


def _within(seconds: float, root: Path, fn: Any) -> Any:
    """``fn()``'s result; a reader blocked past ``seconds`` fails the test (a watchdog, not a timing)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the test thread
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        _unblock(root)
        t.join(10)
        pytest.fail(f"a reader blocked for over {seconds} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_list_runs_lists_every_run_and_never_waits_on_an_odd_file(served: Path) -> None:
    from torchdebug.store import list_runs

    infos = {i.path.name: i for i in _within(60, served, lambda: list_runs(served))}
    assert sorted(infos) == sorted(["good", *_ODD])
    assert infos["good"].status == "finished" and infos["good"].steps == 8
    for name, (_, status, error) in _ODD.items():
        assert infos[name].status == status, name
        if error is None:
            assert infos[name].steps == 8 and infos[name].anomalies == 1, name
        else:
            assert error in (infos[name].error or ""), (name, infos[name].error)


def test_the_runs_command_answers(served: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "torchdebug", "runs", str(served)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")},
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for name in ["good", *_ODD]:
        assert any(name in line for line in lines), name


def test_the_dashboard_lists_the_runs_and_keeps_answering(served: Path) -> None:
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from torchdebug.views.server import create_app

    def poll() -> list[Any]:
        with TestClient(create_app(served, warm=0), base_url="http://127.0.0.1") as client:
            got = []
            for _ in range(50):  # the dashboard polls: each poll answers
                r = client.get("/api/runs")
                assert r.status_code == 200
                got = r.json()["runs"]
            for name in _ODD:
                assert client.get(f"/api/runs/{name}").status_code < 500
            return got

    listed = {r["id"]: r for r in _within(120, served, poll)}
    assert sorted(listed) == sorted(["good", *_ODD])
    assert listed["meta_fifo"]["status"] == "unreadable"


def test_a_summary_over_the_size_cap_is_not_read(tmp_path: Path) -> None:
    from torchdebug.store import _validate

    big = tmp_path / "summary.json"
    big.write_bytes(b" " * 2048)
    assert _validate.read_file(big, cap=2048) == b" " * 2048
    with pytest.raises(RunStoreError) as ei:
        _validate.read_file(big, cap=2047)
    assert str(ei.value) == f"{big} holds more than 2047 bytes, more than such a file ever holds; refused"

"""Store hardening (issue 13): records lost to a full disk are counted and shown, one writer per rank,
readers that never write into the run they read, and runs whose files lead outside their folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from torchdebug._errors import RunStoreError
from torchdebug.store import create_run, open_run

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="flock, rlimits and SIGKILL are POSIX-only")


# -- item 5: one writer per rank -----------------------------------------------------------------


def test_a_second_writer_in_the_same_process_is_refused(tmp_path: Path) -> None:
    w = create_run(root=tmp_path, name="one")
    w.log_scalar("loss", 0, 1.0)
    with pytest.raises(RunStoreError, match=r"rank0\.sqlite is already open for writing \(pid \d+ on .*\)"):
        create_run(path=w.path)
    w.log_scalar("loss", 1, 0.5)
    w.close()
    # Released on close: a resume by the same rank works, and the lock file is gone.
    again = create_run(path=w.path)
    again.log_scalar("loss", 2, 0.25)
    again.close()
    assert sorted(p.name for p in w.path.iterdir()) == ["meta.json", "rank0.sqlite"]
    with open_run(w.path) as run:
        assert run.series("loss").steps == [0, 1, 2]  # each step once: the refused writer wrote nothing
        assert run.status == "finished"


_SECOND_WRITER = """
import sys
from torchdebug._errors import RunStoreError
from torchdebug.store import create_run
try:
    create_run(path=sys.argv[1], world_size=2)
except RunStoreError as e:
    print("REFUSED", e)
    sys.exit(3)
print("OPENED")
"""

_HOLD_THEN_DIE = """
import os, signal, sys
from torchdebug.store import create_run
w = create_run(path=sys.argv[1], rank=1, world_size=2)
w.log_scalar("loss", 0, 1.0)
w.flush()
print("HOLDING", flush=True)
sys.stdin.readline()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_second_writer_in_another_process_is_refused_and_a_dead_one_releases(tmp_path: Path) -> None:
    w = create_run(root=tmp_path, name="two", world_size=2)
    done = subprocess.run(
        [sys.executable, "-c", _SECOND_WRITER, str(w.path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 3, done.stderr
    assert "rank0.sqlite is already open for writing" in done.stdout
    w.close()
    meta = json.loads((w.path / "meta.json").read_text())
    assert meta["status"] == "finished"  # not overwritten by the refused writer

    # Rank 1 held by another process, which is then killed: the kernel drops its lock.
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD_THEN_DIE, str(w.path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "HOLDING"
        with pytest.raises(RunStoreError, match=r"rank1\.sqlite is already open for writing"):
            create_run(path=w.path, rank=1, world_size=2)
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()
    r1 = create_run(path=w.path, rank=1, world_size=2)  # the dead writer's lock is gone
    r1.log_scalar("loss", 1, 0.5)
    r1.close()
    with open_run(w.path, rank=1) as run:
        assert run.series("loss").steps == [0, 1]

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
    assert sorted(p.name for p in w.path.iterdir()) == ["meta.json", "rank0.sqlite", "summary.json"]
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


# -- item 4: a full disk or file-size limit loses records loudly, never silently ----------------------

# Logs 600 steps of 3 metrics (+ an event every 30 steps: 1820 records) under a file-size limit set
# after the run exists; SIGXFSZ ignored, so a write past the limit fails with EFBIG like a full disk.
_FULL_DISK = """
import json, resource, signal, sys, warnings
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
from torchdebug.store import create_run
w = create_run(root=sys.argv[1], name="full", flush_interval=0.01)
limit = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for step in range(600):
        w.log_scalars(step, {"loss": 1.0 / (step + 1), "grad_norm": float(step), "lr": 0.1})
        if step % 30 == 0:
            w.log_event(step, "tick", "info", "x" * 200)
        sum(range(20000))  # a little work per step, so the writer thread commits many small batches
    w.close()
print(json.dumps({"path": str(w.path), "warnings": [str(c.message) for c in caught],
                  "lost": w.lost, "from": w.lost_from_step}))
"""


def _run_full(tmp_path: Path, limit: int) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(tmp_path), str(limit)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr  # training went on to the end
    return json.loads(done.stdout)


def test_a_file_size_limit_loses_records_counted_warned_once_and_shown(tmp_path: Path, capsys) -> None:
    out = _run_full(tmp_path, 200_000)  # the schema fills ~100 kB of WAL; 1820 records need far more
    run_dir = Path(out["path"])
    db = run_dir / "rank0.sqlite"
    [warning] = out["warnings"]  # once, with the file and the error
    assert warning.startswith(f"torchdebug: writing {db} failed (disk I/O error); ")
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["status"] == "finished" and meta["write_error"] == "disk I/O error"
    assert (meta["lost"], meta["lost_from_step"]) == (out["lost"], out["from"])
    with open_run(run_dir) as run:
        per_step = {s: 0 for s in range(600)}
        for name in ("loss", "grad_norm", "lr"):
            if name in run.metric_names():
                for s in run.series(name).steps:
                    per_step[s] += 1
        events = [e["step"] for e in run.events()]
        for s in events:
            per_step[s] += 1
        stored = sum(per_step.values())
        summary = run.summary()
    # Every record is either stored or counted as lost: 600 steps x 3 metrics + 20 events.
    assert stored + meta["lost"] == 600 * 3 + 20
    assert meta["lost"] > 0
    # The first step missing any record is the step the run says it lost records from.
    expected = {s: 3 + (s % 30 == 0) for s in range(600)}
    first_missing = min(s for s in range(600) if per_step[s] < expected[s])
    assert meta["lost_from_step"] == first_missing
    assert (summary["lost"], summary["lost_from_step"]) == (meta["lost"], first_missing)
    assert not list(run_dir.glob(".*.tmp"))

    from torchdebug.cli import main

    line = f"{meta['lost']} records were lost from step {first_missing} on (write failed: disk I/O error)"
    assert main(["show", str(run_dir)]) == 0
    shown = capsys.readouterr().out
    assert "status     finished, INCOMPLETE: records were lost" in shown
    assert f"lost       {line}: this run is incomplete" in shown
    assert main(["runs", str(tmp_path)]) == 0
    listed = capsys.readouterr().out
    assert "finished, incomplete" in listed and line in listed
    assert main(["report", str(run_dir)]) == 0
    assert f"LOST     {line}: this run is incomplete" in capsys.readouterr().out

    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from torchdebug.views.server import create_app

    with TestClient(create_app(tmp_path, warm=0), base_url="http://127.0.0.1") as client:
        [info] = client.get("/api/runs").json()["runs"]
        assert (info["status"], info["lost"], info["lost_from_step"]) == (
            "finished",
            meta["lost"],
            first_missing,
        )
        assert f"incomplete: {meta['lost']} records lost" in client.get("/").text
        page = client.get(f"/runs/{run_dir.name}").text
        assert f"records lost from step {first_missing}: run incomplete" in page
        assert client.get(f"/api/runs/{run_dir.name}").json()["summary"]["lost"] == meta["lost"]


def test_when_nothing_can_be_written_the_run_never_reads_finished(tmp_path: Path) -> None:
    out = _run_full(tmp_path, 300)  # smaller than meta.json: not even the end can be recorded
    run_dir = Path(out["path"])
    assert out["lost"] == 600 * 3 + 20 and out["from"] == 0
    first, end = out["warnings"]
    assert first.startswith(f"torchdebug: writing {run_dir / 'rank0.sqlite'} failed")
    assert end.startswith(f"torchdebug: cannot record how the run ended in {run_dir / 'meta.json'}")
    assert sorted(p.name for p in run_dir.iterdir() if not p.name.startswith("rank0.sqlite")) == ["meta.json"]
    assert json.loads((run_dir / "meta.json").read_text())["status"] == "running"  # the old file, whole
    with open_run(run_dir) as run:
        assert run.status == "crashed"  # its process is gone: never "finished"


# -- item 6: readers never write into the run they read ----------------------------------------------

# Steps 0-49 are checkpointed into rank0.sqlite, steps 50-79 and one event live only in the -wal;
# then the process is killed, leaving rank0.sqlite, -wal, -shm and an unlocked rank0.lock.
_KILLED = """
import os, signal, sys
from torchdebug.store import create_run
w = create_run(root=sys.argv[1], name="killed")
if sys.argv[2] == "checkpoint":
    for s in range(50):
        w.log_scalar("loss", s, float(s))
    w.flush()
    w._core.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
for s in range(50 if sys.argv[2] == "checkpoint" else 0, 80):
    w.log_scalar("loss", s, float(s))
w.log_event(79, "last", "info", "before the kill")
w.flush()
print(w.path, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _killed_run(root: Path, how: str = "checkpoint") -> Path:
    done = subprocess.run(
        [sys.executable, "-c", _KILLED, str(root), how], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == -9, done.stderr
    path = Path(done.stdout.strip())
    assert sorted(p.name for p in path.iterdir()) == [
        "meta.json",
        "rank0.lock",
        "rank0.sqlite",
        "rank0.sqlite-shm",
        "rank0.sqlite-wal",
    ]
    return path


def _state(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Bytes and mtime of every file: a reader must change neither, nor add a file."""
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


def test_the_first_show_of_a_killed_run_writes_nothing(tmp_path: Path, capsys) -> None:
    from torchdebug.cli import main
    from torchdebug.store import list_runs

    run_dir = _killed_run(tmp_path)
    before = _state(run_dir)
    assert main(["show", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "status     crashed" in out and "steps      80 (last step 79)" in out
    with open_run(run_dir) as run:
        assert run.series("loss").steps == list(range(80))  # the -wal was read, from memory
        assert [e["kind"] for e in run.events()] == ["last"]
        assert run.read_note is None
    assert [i.status for i in list_runs(tmp_path)] == ["crashed"]
    assert main(["report", str(run_dir)]) == 0
    assert _state(run_dir) == before  # -shm included: not rebuilt


def test_a_copy_without_its_wal_says_what_is_missing(tmp_path: Path, capsys) -> None:
    from torchdebug.cli import main

    # Nothing checkpointed yet: the schema itself is in the -wal that was not copied.
    src = _killed_run(tmp_path / "src", how="all-in-wal")
    copy = tmp_path / "copy" / src.name
    copy.mkdir(parents=True)
    for name in ("meta.json", "rank0.sqlite"):
        (copy / name).write_bytes((src / name).read_bytes())
    before = _state(copy)
    with pytest.raises(RunStoreError, match=r"rank0\.sqlite-wal is missing \(copied without it\?\)") as info:
        open_run(copy)
    assert "not a torchdebug run database" not in str(info.value) and "delete" not in str(info.value)
    assert main(["show", str(copy)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "copy rank0.sqlite-wal beside it" in err
    assert _state(copy) == before  # no -wal/-shm created by the reader

    # Checkpointed part copied, -wal left behind: read what is there and say the rest may be missing.
    src = _killed_run(tmp_path / "src2")
    copy = tmp_path / "copy2" / src.name
    copy.mkdir(parents=True)
    for name in ("meta.json", "rank0.sqlite"):
        (copy / name).write_bytes((src / name).read_bytes())
    before = _state(copy)
    with open_run(copy) as run:
        assert run.series("loss").steps == list(range(50))
        assert "rank0.sqlite-wal" in (run.read_note or "") and "missing" in run.read_note
    assert _state(copy) == before

    # -wal copied but not -shm: every record is read (from a private copy); nothing is created here.
    (copy / "rank0.sqlite-wal").write_bytes((src / "rank0.sqlite-wal").read_bytes())
    before = _state(copy)
    with open_run(copy) as run:
        assert run.series("loss").steps == list(range(80)) and run.read_note is None
    assert _state(copy) == before


_READ_ONLY_READER = """
import json, sys
from torchdebug.store import open_run
from torchdebug.cli import main
with open_run(sys.argv[1]) as run:
    print(json.dumps({"steps": run.series("loss").steps[-1] + 1, "status": run.status, "note": run.read_note}))
sys.exit(main(["show", sys.argv[1]]))
"""


@pytest.mark.parametrize("shm", ["readable", "unreadable"])
def test_a_crashed_run_on_read_only_media_opens_and_is_never_called_corrupt(tmp_path: Path, shm: str) -> None:
    import os
    import shutil

    run_dir = _killed_run(tmp_path)
    cmd = [sys.executable, "-c", _READ_ONLY_READER, str(run_dir)]
    if os.geteuid() == 0:  # root ignores file modes: drop the capabilities that let it
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: file modes cannot make the folder read-only")
        cmd = [setpriv, "--bounding-set=-dac_override,-dac_read_search,-fowner", *cmd]
    for p in run_dir.iterdir():
        p.chmod(0o000 if (shm == "unreadable" and p.name.endswith("-shm")) else 0o444)
    run_dir.chmod(0o555)
    try:
        before = {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir()}
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        after = {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir()}
    finally:
        run_dir.chmod(0o755)
        for p in run_dir.iterdir():
            p.chmod(0o644)
    assert done.returncode == 0, done.stderr
    assert "corrupt" not in done.stdout + done.stderr and "delete" not in done.stdout + done.stderr
    first = json.loads(done.stdout.splitlines()[0])
    assert first["status"] == "crashed"
    if shm == "readable":  # the -wal is read into memory through the read-only -shm
        assert (first["steps"], first["note"]) == (80, None)
    else:  # immutable read of the checkpointed file; the note says what could not be read
        assert first["steps"] == 50
        assert first["note"].startswith("read without rank0.sqlite-wal")
        assert "partial    read without rank0.sqlite-wal" in done.stdout
    assert after == before


# -- item 10: text from a run is escaped before it reaches a terminal ---------------------------------

_EVIL = "\x1b[2J\x1b]0;pwned\x07\r"  # clear screen, set the window title, bell, carriage return


def test_names_and_messages_are_escaped_and_long_names_cut(tmp_path: Path, capsys) -> None:
    from torchdebug.cli import main

    long_metric = "m" * 200
    w = create_run(root=tmp_path, name=f"run{_EVIL}", config={"note": f"x{_EVIL}", "lr": 0.5})
    w.log_scalars(0, {"loss": 1.0, f"grad{_EVIL}": 2.0, long_metric: 3.0})
    w.log_anomaly(0, {"phase": "forward", "module": f"fc{_EVIL}", "kind": "nan", "summary": f"boom{_EVIL}"})
    w.log_event(0, f"kind{_EVIL}", "warning", f"message{_EVIL}\nsecond line")
    w.close()
    outputs = {}
    for cmd in (["runs", str(tmp_path)], ["show", str(w.path)], ["report", str(w.path)]):
        assert main(cmd) == 0
        outputs[cmd[0]] = capsys.readouterr().out
    for name, out in outputs.items():
        assert not any(c in out for c in "\x1b\x07\r"), name
        assert "\\x1b[2J\\x1b]0;pwned\\x07\\x0d" in out, name
    assert (
        "second line" in outputs["report"] and "\\x0asecond line" in outputs["report"]
    )  # one line per event
    assert "  boom\\x1b[2J" in outputs["show"]  # the anomaly's summary
    # Long names are cut in tables, whole in JSON.
    assert "m" * 57 + "..." in outputs["show"] and "m" * 58 not in outputs["show"]
    assert "m" * 57 + "..." in outputs["report"] and "m" * 58 not in outputs["report"]
    row = outputs["runs"].splitlines()[1]
    assert row.startswith("run\\x1b[2J\\x1b]0;pwned\\x07\\x0d  finished")
    assert main(["show", str(w.path), "--json"]) == 0
    assert long_metric in json.loads(capsys.readouterr().out)["last_values"]

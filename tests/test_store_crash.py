"""Crash safety of the run store, for real: a writer process killed with SIGKILL, or ending without close()."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from torchdebug.store import list_runs, open_run

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL is POSIX-only")

# Logs one step every ~2 ms with a known pattern (a = step / 2, b = -step, an event every 50 steps)
# and prints "<step> <time.time()>" after queuing it, so the test knows what was queued when.
_TRAINER = """
import sys, time
from torchdebug.store import create_run
w = create_run(root=sys.argv[1], name="crash")
print("PATH", w.path, flush=True)
step = 0
while True:
    w.log_scalars(step, {"a": step / 2, "b": -step})
    if step % 50 == 0:
        w.log_event(step, "tick", "info", f"step {step}")
    print(step, time.time(), flush=True)
    step += 1
    time.sleep(0.002)
"""


def _hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir() if p.is_file()}


@pytest.mark.timeout(60)
def test_sigkill_mid_run_keeps_everything_queued_a_second_before(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _TRAINER, str(tmp_path)], stdout=subprocess.PIPE, text=True, bufsize=1
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    live_counts: list[int] = []
    live = None
    try:
        deadline = time.monotonic() + 45
        # Let it log for 2.5 s after its first step, so more than a second's worth is at stake.
        # From 1 s on, read the run from this process while the other one writes it (WAL).
        while time.monotonic() < deadline:
            steps = [ln for ln in list(lines) if not ln.startswith("PATH")]
            elapsed = time.time() - float(steps[0].split()[1]) if steps else 0.0
            if elapsed > 1.0:
                if live is None:
                    live = open_run(lines[0].split(maxsplit=1)[1].strip())
                    assert live.status == "running"
                names = live.metric_names()
                live_counts.append(len(live.series("a")) if names else 0)
            if elapsed > 2.5:
                break
            time.sleep(0.05)
        kill_time = time.time()
        proc.send_signal(signal.SIGKILL)
    finally:
        if live is not None:
            live.close()
        proc.kill()
        proc.wait(timeout=10)
        reader.join(timeout=10)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    run_dir = Path(lines[0].split(maxsplit=1)[1].strip())
    # (the kill may cut the last line short: only whole lines were printed before it)
    queued = [(int(s), float(t)) for s, t in (ln.split() for ln in lines[1:] if ln.endswith("\n"))]
    # Every step printed (i.e. queued) more than 1 s before the kill must be in the database.
    must_have = max(s for s, t in queued if t <= kill_time - 1.0)
    # ~1.5 s of steps at 2-10 ms each (the machine may be busy): the test really exercised the writer.
    assert must_have >= 100
    # The live reader saw the run grow while it was being written.
    assert live_counts[0] > 0 and live_counts[-1] > live_counts[0]

    before = _hashes(run_dir)
    with open_run(run_dir) as run:
        assert run._conn.execute("PRAGMA quick_check").fetchone() == ("ok",)
        assert run.status == "crashed"  # meta.json says running, but the pid is dead
        a, b = run.series("a"), run.series("b")
        last = a.steps[-1]
        assert last >= must_have
        assert a.steps == list(range(last + 1))  # no holes: batches commit whole or not at all
        assert a.values == [s / 2 for s in a.steps]
        assert b.steps[: must_have + 1] == list(range(must_have + 1))
        assert b.values == [-float(s) for s in b.steps]
        ticks = [e["step"] for e in run.events(kind="tick")]
        assert ticks[: must_have // 50 + 1] == list(range(0, must_have + 1, 50))
    # The reader wrote nothing: not the database, its WAL, nor the -shm index (read-only, in memory).
    assert _hashes(run_dir) == before
    assert [i.status for i in list_runs(tmp_path)] == ["crashed"]


_EXIT_WITHOUT_CLOSE = """
import sys
from torchdebug.store import create_run
w = create_run(root=sys.argv[1], name="exit")
for step in range(10):
    w.log_scalar("loss", step, 1.0 / (step + 1))
w.log_event(9, "last", "info", "about to exit")
if sys.argv[2] == "raise":
    raise RuntimeError("training blew up")
"""


@pytest.mark.parametrize(("how", "status", "code"), [("return", "finished", 0), ("raise", "failed", 1)])
def test_exiting_process_finishes_its_run(tmp_path: Path, how: str, status: str, code: int) -> None:
    # No close(): the atexit hook commits the queue and records how the process ended.
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_WITHOUT_CLOSE, str(tmp_path), how],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == code, done.stderr
    [run_dir] = [p for p in tmp_path.iterdir() if p.is_dir()]
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["status"] == status and meta["ended"]
    with open_run(run_dir) as run:
        assert run.status == status
        assert run.series("loss").steps == list(range(10))
        assert [e["kind"] for e in run.events()] == ["last"]

"""Tests of the run store: folder and meta, round trips, downsampling, queue drops, errors, readers."""

from __future__ import annotations

import datetime as dt
import gc
import hashlib
import json
import math
import os
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from torchdebug._errors import RunStoreError, SchemaVersionError
from torchdebug.events import Anomaly, RuleEvent
from torchdebug.stats import analyze_tensor
from torchdebug.store import SCHEMA_VERSION, Run, RunInfo, RunWriter, Series, create_run, list_runs, open_run
from torchdebug.store._schema import MIGRATIONS
from torchdebug.store.writer import _make_run_dir

NAN, INF = math.nan, math.inf


def _snapshot(folder: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``folder`` (to prove a reader changed nothing)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _rw(db: Path) -> sqlite3.Connection:
    return sqlite3.connect(db, isolation_level=None)


@pytest.fixture
def writer(tmp_path: Path):
    w = create_run(root=tmp_path / "runs", name="t", config={"lr": 0.5, "layers": [2, 3]})
    yield w
    w.close()


# -- the run folder ----------------------------------------------------------------------------------


def test_create_run_folder_meta_and_database(tmp_path: Path) -> None:
    before = dt.datetime.now().astimezone().replace(microsecond=0)
    w = create_run(root=tmp_path / "runs", name="mnist", config={"lr": 0.001})
    try:
        assert isinstance(w, RunWriter)
        assert w.path.parent == tmp_path / "runs"
        assert re.fullmatch(r"mnist-\d{8}-\d{6}", w.path.name)
        stamp = dt.datetime.strptime(w.path.name[len("mnist-") :], "%Y%m%d-%H%M%S")
        assert abs((stamp - before.replace(tzinfo=None)).total_seconds()) <= 2
        meta = json.loads((w.path / "meta.json").read_text())
        assert set(meta) >= {
            "run_id", "name", "created", "status", "ended", "torch", "python", "host", "pid",
            "config", "rank", "world_size", "schema_version",
        }  # fmt: skip
        assert meta["name"] == "mnist"
        assert meta["status"] == "running" and meta["ended"] is None
        assert meta["pid"] == os.getpid()
        assert meta["config"] == {"lr": 0.001}
        assert (meta["rank"], meta["world_size"], meta["schema_version"]) == (0, 1, SCHEMA_VERSION)
        assert meta["torch"] == torch.__version__
        assert w.run_id == meta["run_id"] and len(meta["run_id"]) == 32
        db = w.path / "rank0.sqlite"
        conn = _rw(db)
        # While the writer runs the database is in WAL mode and carries its schema version twice.
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == "1"
        conn.close()
    finally:
        w.close()
    meta = json.loads((w.path / "meta.json").read_text())
    assert meta["status"] == "finished"
    assert meta["ended"] is not None


def test_run_folder_names_are_made_unique(tmp_path: Path) -> None:
    when = dt.datetime(2025, 1, 2, 3, 4, 5)
    a = _make_run_dir(tmp_path, "demo", when)
    b = _make_run_dir(tmp_path, "demo", when)
    c = _make_run_dir(tmp_path, "a b/../c", when)
    assert (a.name, b.name) == ("demo-20250102-030405", "demo-20250102-030405-2")
    assert c.name == "a_b_.._c-20250102-030405"  # unsafe characters replaced, stays under root
    assert c.parent == tmp_path


def test_two_runs_created_back_to_back_get_distinct_folders(tmp_path: Path) -> None:
    w1 = create_run(root=tmp_path, name="same")
    w2 = create_run(root=tmp_path, name="same")
    assert w1.path != w2.path
    w1.close()
    w2.close()
    assert [i.path for i in list_runs(tmp_path)] == sorted([w1.path, w2.path], key=lambda p: p.name)


# -- round trips -------------------------------------------------------------------------------------


def test_scalars_round_trip_with_nan_and_inf(writer: RunWriter) -> None:
    values = [1.5, NAN, INF, -INF, 0.0, -2.25]
    for step, v in enumerate(values):
        writer.log_scalar("loss", step, v)
    writer.log_scalars(6, {"loss": 3, "lr": 0.125})  # an int value is stored as float 3.0
    writer.flush()
    with open_run(writer.path) as run:
        s = run.series("loss")
        assert isinstance(s, Series) and s.name == "loss" and not s.downsampled
        assert s.steps == [0, 1, 2, 3, 4, 5, 6]
        assert s.values[0] == 1.5 and math.isnan(s.values[1])
        assert s.values[2:] == [INF, -INF, 0.0, -2.25, 3.0]
        assert all(isinstance(t, float) for t in s.wall_times)
        assert s.wall_times == sorted(s.wall_times)
        assert run.metric_names() == ["loss", "lr"]
        assert run.series("loss", since_step=5).steps == [5, 6]
        assert run.last_values() == {"loss": (6, 3.0), "lr": (6, 0.125)}
        at1 = run.at_step(1)["scalars"]
        assert list(at1) == ["loss"] and math.isnan(at1["loss"])
        assert run.at_step(2)["scalars"] == {"loss": INF}
        assert len(s) == 7


def test_series_downsampling_keeps_min_and_max_per_bucket(writer: RunWriter) -> None:
    # values = step, except a dip at 123 and a spike at 537.
    for step in range(1000):
        v = -1e6 if step == 123 else 1e6 if step == 537 else float(step)
        writer.log_scalar("x", step, v)
    writer.flush()
    with open_run(writer.path) as run:
        s = run.series("x", max_points=20)
        # 20 points -> 10 buckets over span 1000: bucket = step * 10 // 1000 = step // 100.
        # Every bucket keeps its lowest (first step) and highest (last step), except bucket 1 whose
        # lowest is the dip at 123 and bucket 5 whose highest is the spike at 537.
        expected = []
        for b in range(10):
            lo, hi = 100 * b, 100 * b + 99
            expected += [123 if b == 1 else lo, 537 if b == 5 else hi]
        assert s.downsampled
        assert s.steps == sorted(expected)
        assert -1e6 in s.values and 1e6 in s.values
        assert len(s) == 20
        # Fewer points than max_points: returned as they are.
        full = run.series("x", since_step=990, max_points=20)
        assert full.steps == list(range(990, 1000)) and not full.downsampled


def test_downsampling_keeps_a_nan(writer: RunWriter) -> None:
    for step in range(100):
        writer.log_scalar("loss", step, NAN if step == 42 else 1.0 + step)
    writer.flush()
    with open_run(writer.path) as run:
        s = run.series("loss", max_points=10)
        # 5 buckets of 20 steps; bucket 2 (steps 40..59) keeps the NaN at 42 as its "lowest".
        assert 42 in s.steps
        assert math.isnan(s.values[s.steps.index(42)])
        assert s.steps == [0, 19, 20, 39, 42, 59, 60, 79, 80, 99]


def test_series_bad_arguments(writer: RunWriter) -> None:
    writer.log_scalar("loss", 0, 1.0)
    writer.flush()
    with open_run(writer.path) as run:
        with pytest.raises(KeyError, match=r"no metric 'acc'.*known: loss"):
            run.series("acc")
        with pytest.raises(ValueError, match="max_points must be >= 2"):
            run.series("loss", max_points=1)
        with pytest.raises(TypeError, match="since_step"):
            run.series("loss", since_step="3")  # type: ignore[arg-type]


def test_anomalies_events_stats_memory_timings_segments_round_trip(writer: RunWriter) -> None:
    anomaly = Anomaly(phase="backward", module="fc", op="aten.log", location="m.py:3", kind="nan", step=4)
    writer.log_anomaly(None, anomaly)  # step taken from the anomaly
    writer.log_anomaly(7, {"phase": "forward", "module": "", "kind": "inf", "magnitude": INF})
    writer.log_event(4, "loss_spike", "warning", "loss 8x", {"ratio": 8.0})
    writer.log_event(None, "note", "info", "started")
    writer.log_rule_event(RuleEvent("exploding_gradients", 4, "big", "error", ("fc",), {"ratio": 32.0}))
    t = torch.tensor([1.0, float("nan"), -3.0])
    writer.log_tensor_stats(4, "fc.weight.grad", analyze_tensor(t))
    writer.log_tensor_stats(5, "fc.weight.grad", {"max": 2.0})
    writer.log_memory(4, {"rss": 3 * 2**30, "cuda_allocated": 0})
    writer.log_timing(4, {"forward": 0.25, "backward": 0.5, "step": 1})
    writer.log_scalar("loss", 9, 1.0)
    seg1 = writer.start_segment("cleared")  # starts one past the highest step logged: 10
    seg2 = writer.start_segment("again", step=12)
    writer.flush()
    with open_run(writer.path) as run:
        an = run.anomalies()
        assert [a["step"] for a in an] == [4, 7]
        assert an[0]["summary"] == anomaly.summary() and an[0]["op"] == "aten.log"
        assert an[1]["magnitude"] == "inf"  # JSON has no Inf: stored as the string events.plain uses
        assert run._rows("SELECT phase, module, kind FROM anomalies ORDER BY id") == [
            ("backward", "fc", "nan"),
            ("forward", "", "inf"),
        ]
        ev = run.events()
        assert [(e["step"], e["kind"], e["severity"]) for e in ev] == [
            (4, "loss_spike", "warning"),
            (None, "note", "info"),
            (4, "exploding_gradients", "error"),
        ]
        assert ev[0]["data"] == {"ratio": 8.0} and ev[1]["data"] is None
        assert ev[2]["data"] == {"modules": ["fc"], "evidence": {"ratio": 32.0}}
        assert [e["message"] for e in run.events(kind="loss_spike")] == ["loss 8x"]
        ts = run.tensor_stats(name="fc.weight.grad")
        assert [x["step"] for x in ts] == [4, 5]
        assert ts[0]["stats"]["nan_count"] == 1 and ts[0]["stats"]["min"] == -3.0
        assert run.tensor_stats(step=5) == [ts[1]]
        mem = run.memory()
        assert len(mem) == 1 and mem[0]["rss"] == 3 * 2**30 and type(mem[0]["rss"]) is int
        tim = run.timings()
        # "step" is the sample's step index; the step's duration, logged as "step", reads as "total".
        assert tim == [
            {"step": 4, "wall_time": tim[0]["wall_time"], "forward": 0.25, "backward": 0.5, "total": 1.0}
        ]
        assert (seg1, seg2) == (1, 2)
        assert [(g["id"], g["start_step"], g["label"]) for g in run.segments()] == [
            (1, 10, "cleared"),
            (2, 12, "again"),
        ]
        at4 = run.at_step(4)
        assert at4["step"] == 4 and at4["scalars"] == {}
        assert [a["kind"] for a in at4["anomalies"]] == ["nan"]
        assert [e["kind"] for e in at4["events"]] == ["loss_spike", "exploding_gradients"]
        assert [x["name"] for x in at4["tensor_stats"]] == ["fc.weight.grad"]
        assert at4["memory"]["rss"] == 3 * 2**30 and at4["timings"]["forward"] == 0.25
        summ = run.summary()
        assert summ["anomalies"] == 2 and summ["metrics"] == 1 and summ["segments"] == 2
        assert summ["events"] == {"exploding_gradients": 1, "loss_spike": 1, "note": 1}
        assert (summ["steps"], summ["last_step"], summ["dropped"]) == (1, 9, 0)
        assert summ["status"] == "running"


def test_timing_samples_over_steps_keep_their_step_index(writer: RunWriter) -> None:
    # The timing instrument logs the contract's keys, "step" included, every step.
    for step in range(3):
        writer.log_timing(step, {"forward": 0.125, "backward": 0.25, "step": 0.5 + step})
        writer.log_memory(step, {"rss": 1000 + step})
    writer.flush()
    with open_run(writer.path) as run:
        assert [(t["step"], t["total"], t["forward"]) for t in run.timings()] == [
            (0, 0.5, 0.125),
            (1, 1.5, 0.125),
            (2, 2.5, 0.125),
        ]
        assert [(m["step"], m["rss"]) for m in run.memory()] == [(0, 1000), (1, 1001), (2, 1002)]
        assert run.at_step(1)["timings"]["total"] == 1.5


def test_an_unserializable_document_does_not_sink_its_batch(writer: RunWriter) -> None:
    cyclic: dict = {"max": 1.0}
    cyclic["self"] = cyclic
    writer.log_tensor_stats(0, "w", cyclic)  # JSON-encoded later, on the writer thread
    writer.log_scalar("loss", 0, 0.5)  # same batch
    writer.flush()
    with open_run(writer.path) as run:
        assert run.series("loss").values == [0.5]
        [row] = run.tensor_stats()
        # The writer stored a shallow snapshot, whose "self" is the original dict: one more level.
        assert row["stats"]["unserializable"] == "{'max': 1.0, 'self': {'max': 1.0, 'self': {...}}}"


def test_background_thread_commits_without_flush(tmp_path: Path) -> None:
    w = create_run(root=tmp_path, name="bg", flush_interval=0.2)
    w.log_scalar("loss", 0, 1.0)
    deadline = time.monotonic() + 5.0
    with open_run(w.path) as run:
        while not run.metric_names() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert run.series("loss").values == [1.0]  # committed by the thread's timer, no flush()
    w.close()


# -- bounded queue -----------------------------------------------------------------------------------


def test_full_queue_drops_oldest_low_priority_and_keeps_anomalies(tmp_path: Path) -> None:
    # A flush interval of an hour and a batch size above the queue keep the writer thread asleep
    # until flush(), so the queue fills deterministically.
    w = create_run(root=tmp_path, name="q", max_queue=10, batch_size=1000, flush_interval=3600)
    for step in range(25):
        w.log_scalar("loss", step, float(step))
        if step % 10 == 0:
            w.log_anomaly(step, {"kind": "nan", "phase": "forward", "module": "fc"})
            w.log_event(step, "spike", "warning", f"at {step}")
    assert w.dropped == 15  # 25 scalars into a queue of 10: the 15 oldest go
    w.flush()
    with open_run(w.path) as run:
        assert run.series("loss").steps == list(range(15, 25))
        assert [a["step"] for a in run.anomalies()] == [0, 10, 20]  # never dropped
        assert [e["step"] for e in run.events()] == [0, 10, 20]
        assert run.summary()["dropped"] == 15
    w.close()
    assert json.loads((w.path / "meta.json").read_text())["dropped"] == 15


def test_log_scalars_drops_oldest_values_when_the_queue_overflows(tmp_path: Path) -> None:
    w = create_run(root=tmp_path, name="q2", max_queue=10, batch_size=1000, flush_interval=3600)
    for step in range(5):
        w.log_scalars(step, {"a": step, "b": step, "c": step, "d": step})
    # 20 values into a queue of 10: the 10 oldest go (steps 0 and 1, and a, b of step 2).
    assert w.dropped == 10
    w.flush()
    with open_run(w.path) as run:
        assert {m: run.series(m).steps for m in "abcd"} == {
            "a": [3, 4],
            "b": [3, 4],
            "c": [2, 3, 4],
            "d": [2, 3, 4],
        }
    w.close()


def test_a_failed_background_write_is_reported_by_flush_and_the_writer_recovers(tmp_path: Path) -> None:
    w = create_run(root=tmp_path, name="busy", flush_interval=3600, batch_size=1000)
    w._core.conn.execute("PRAGMA busy_timeout = 50")  # fail fast instead of waiting 30 s for the lock
    blocker = _rw(w.db_path)
    blocker.execute("BEGIN IMMEDIATE")  # another process holding the write lock
    w.log_scalar("loss", 0, 1.0)
    with pytest.raises(RunStoreError, match=r"writing .*rank0\.sqlite failed: database is locked"):
        w.flush()
    blocker.execute("ROLLBACK")
    blocker.close()
    w.log_scalar("loss", 1, 2.0)
    w.flush()  # the error was reported once; the writer goes on
    w.close()
    with open_run(w.path) as run:
        assert run.series("loss").steps == [1]  # step 0 went with the failed batch


def test_a_rolled_back_batch_does_not_leave_stale_metric_ids(tmp_path: Path) -> None:
    w = create_run(root=tmp_path, name="rollback", flush_interval=3600, batch_size=1000)
    other = _rw(w.db_path)  # a second writer (not supported) takes segment id 1 behind our back
    other.execute("INSERT INTO segments(id, start_step, wall_time, label) VALUES (1, 0, 0.0, 'other')")
    other.close()
    w.log_scalar("new_metric", 0, 1.0)  # inserted into `metrics` inside the batch that fails below
    w.start_segment("mine")  # id 1 again: the batch's transaction fails after the metric row
    with pytest.raises(RunStoreError, match=r"UNIQUE constraint failed: segments\.id"):
        w.flush()
    w.log_scalar("new_metric", 1, 2.0)
    w.close()
    with open_run(w.path) as run:
        # The metric's name row was rolled back with its batch; the writer must register it again
        # rather than reuse the id it had assigned inside that transaction.
        assert run.metric_names() == ["new_metric"]
        assert run.series("new_metric").steps == [1]


# -- bad input ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "exc", "pattern"),
    [
        (lambda w: w.log_scalar(1, 0, 1.0), TypeError, "name must be a str"),
        (lambda w: w.log_scalar("", 0, 1.0), ValueError, "name must be a non-empty str"),
        (lambda w: w.log_scalar("x", "0", 1.0), TypeError, "step must be an int"),
        (lambda w: w.log_scalar("x", 1.5, 1.0), TypeError, "step must be an int"),
        (lambda w: w.log_scalar("x", True, 1.0), TypeError, "step must be an int"),
        (lambda w: w.log_scalar("x", -1, 1.0), ValueError, "step must be >= 0"),
        (lambda w: w.log_scalar("x", 0, "1.0"), TypeError, "value must be a real number, got str"),
        (lambda w: w.log_scalar("x", 0, None), TypeError, "value must be a real number"),
        (lambda w: w.log_scalar("x", 0, torch.tensor(1.0)), TypeError, r"value must .*Tensor.*\.item\(\)"),
        (lambda w: w.log_scalars(0, [("x", 1.0)]), TypeError, "values must be a dict"),
        (lambda w: w.log_scalars(0, {"x": "a"}), TypeError, r"values\['x'\] must be a real number"),
        (lambda w: w.log_scalars(0, {3: 1.0}), TypeError, "values key must be a str"),
        (lambda w: w.log_anomaly(0, 5), TypeError, "anomaly must be a dict"),
        (lambda w: w.log_anomaly("s", {}), TypeError, "step must be an int"),
        (lambda w: w.log_event(0, 3, "info", "m"), TypeError, "kind must be a str"),
        (lambda w: w.log_event(0, "k", "loud", "m"), ValueError, "severity must be one of"),
        (lambda w: w.log_event(0, "k", "info", 7), TypeError, "message must be a str"),
        (lambda w: w.log_event(0, "k", "info", "m", [1]), TypeError, "data must be a dict"),
        (lambda w: w.log_tensor_stats(0, "n", 3), TypeError, "stats must be a dict"),
        (lambda w: w.log_tensor_stats(0, None, {}), TypeError, "name must be a str"),
        (lambda w: w.log_memory(0, {"rss": "big"}), TypeError, r"sample\['rss'\] must be a real number"),
        (lambda w: w.log_memory(0, 5), TypeError, "sample must be a dict"),
        (lambda w: w.log_timing(0.5, {}), TypeError, "step must be an int"),
        (lambda w: w.log_timing(0, {"fwd": []}), TypeError, r"seconds\['fwd'\] must be a real number"),
        (lambda w: w.log_memory(0, {"step": 1}), ValueError, "sample may not have a key 'step'"),
        (lambda w: w.log_timing(0, {"wall_time": 1.0}), ValueError, "seconds may not have a key 'wall_time'"),
        (lambda w: w.log_timing(0, {"step": 1.0, "total": 1.0}), ValueError, "may not have a key 'total'"),
        (lambda w: w.log_rule_event({"kind": "x"}), TypeError, "event must be a torchdebug RuleEvent"),
        (lambda w: w.start_segment(3), TypeError, "label must be a str"),
        (lambda w: w.close("done"), ValueError, "status must be one of"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_log_rejects_bad_input(writer: RunWriter, call, exc, pattern) -> None:
    with pytest.raises(exc, match=pattern):
        call(writer)


def test_numpy_like_numbers_are_accepted(writer: RunWriter) -> None:
    np = pytest.importorskip("numpy")
    writer.log_scalar("x", np.int64(3), np.float32(0.5))
    writer.log_memory(3, {"rss": np.int64(7)})
    writer.flush()
    with open_run(writer.path) as run:
        assert run.series("x").steps == [3] and run.series("x").values == [0.5]
        assert run.memory()[0]["rss"] == 7 and type(run.memory()[0]["rss"]) is int


@pytest.mark.parametrize(
    ("kwargs", "exc", "pattern"),
    [
        ({"rank": 2, "world_size": 2}, ValueError, r"rank must be in \[0, 2\)"),
        ({"rank": 1, "world_size": 2}, ValueError, "pass path="),
        ({"world_size": 0}, ValueError, "world_size must be >= 1"),
        ({"config": [1]}, TypeError, "config must be a dict"),
        ({"name": 3}, TypeError, "name must be a str"),
        ({"max_queue": 0}, ValueError, "max_queue must be >= 1"),
        ({"flush_interval": 0}, ValueError, "flush_interval must be a positive"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_create_run_rejects_bad_arguments(tmp_path: Path, kwargs, exc, pattern) -> None:
    with pytest.raises(exc, match=pattern):
        create_run(root=tmp_path, **kwargs)
    assert not any(tmp_path.iterdir())  # nothing half-created


# -- lifecycle ---------------------------------------------------------------------------------------


def test_close_is_idempotent_and_writer_refuses_logs_after(tmp_path: Path) -> None:
    w = create_run(root=tmp_path, name="c")
    w.log_scalar("loss", 0, 1.0)
    w.close("failed")
    w.close()  # no effect: the first status stays
    assert w.closed
    meta = json.loads((w.path / "meta.json").read_text())
    assert meta["status"] == "failed"
    with pytest.raises(RunStoreError, match="closed"):
        w.log_scalar("loss", 1, 1.0)
    w.flush()  # harmless after close
    with open_run(w.path) as run:
        assert run.status == "failed" and run.series("loss").values == [1.0]
        assert run._db_meta()["status"] == "failed"
    # A closed run is left in rollback-journal mode with no WAL files beside it.
    assert sorted(p.name for p in w.path.iterdir()) == ["meta.json", "rank0.sqlite"]


def test_context_manager_marks_failed_on_exception(tmp_path: Path) -> None:
    with pytest.raises(ZeroDivisionError), create_run(root=tmp_path, name="cm") as w:
        w.log_scalar("loss", 0, 1.0)
        _ = 1 / 0
    with open_run(w.path) as run:
        assert run.status == "failed"


def test_garbage_collected_writer_finishes_its_run(tmp_path: Path) -> None:
    w = create_run(root=tmp_path, name="gc")
    w.log_scalar("loss", 0, 2.0)
    path = w.path
    del w
    gc.collect()
    with open_run(path) as run:
        assert run.status == "finished" and run.series("loss").values == [2.0]


# -- ranks -------------------------------------------------------------------------------------------


def test_ranks_share_one_folder(tmp_path: Path) -> None:
    w0 = create_run(root=tmp_path, name="ddp", rank=0, world_size=2)
    w1 = create_run(name="ddp", rank=1, world_size=2, path=w0.path)
    w0.log_scalar("loss", 0, 1.0)
    w1.log_scalar("loss", 0, 2.0)
    w1.close()
    with open_run(w0.path) as run, run.open_rank(1) as r1:
        # Each rank's status is its own process's: rank 1 has finished, rank 0 still runs.
        assert (run.status, r1.status) == ("running", "finished")
    w0.close()
    with open_run(w0.path) as run:
        assert run.ranks == [0, 1] and run.rank == 0
        assert run.series("loss").values == [1.0]
        with run.open_rank(1) as r1:
            assert r1.series("loss").values == [2.0] and r1.rank == 1
        with pytest.raises(RunStoreError, match=r"no rank 3 \(ranks present: \[0, 1\]\)"):
            run.open_rank(3)
    with open_run(w0.path, rank=1) as r1:
        assert r1.series("loss").values == [2.0]
    with pytest.raises(RunStoreError, match="no rank 5"):
        open_run(w0.path, rank=5)
    with pytest.raises(ValueError, match="world_size 3 differs"):
        create_run(rank=2, world_size=3, path=w0.path)


def test_joining_a_folder_that_is_not_a_run(tmp_path: Path) -> None:
    with pytest.raises(RunStoreError, match=r"no meta\.json"):
        create_run(rank=1, world_size=2, path=tmp_path)


# -- reader errors, and never writing ----------------------------------------------------------------


@pytest.fixture
def finished_run(tmp_path: Path) -> Path:
    w = create_run(root=tmp_path / "runs", name="done")
    for step in range(2000):
        w.log_scalars(step, {"loss": 1.0 / (step + 1), "acc": step / 2000})
    w.log_anomaly(3, {"kind": "nan", "phase": "forward", "module": "fc"})
    w.close()
    return w.path


def test_reading_a_finished_run_changes_no_file(finished_run: Path) -> None:
    before = _snapshot(finished_run)
    with open_run(finished_run) as run:
        run.summary()
        run.series("loss", max_points=100)
        run.at_step(3)
        assert run.status == "finished"
    list_runs(finished_run.parent)
    assert _snapshot(finished_run) == before  # same files, same bytes: no -wal/-shm created


@pytest.mark.parametrize("what", ["missing", "file", "not_a_run", "bad_meta"])
def test_open_run_rejects_what_is_not_a_run(tmp_path: Path, what: str) -> None:
    target = tmp_path / "x"
    if what == "file":
        target.write_text("hello")
    elif what == "not_a_run":
        target.mkdir()
        (target / "notes.txt").write_text("hi")
    elif what == "bad_meta":
        target.mkdir()
        (target / "meta.json").write_text("{not json")
    before = _snapshot(tmp_path)
    messages = {
        "missing": "does not exist",
        "file": r"not a torchdebug run \(not a folder\)",
        "not_a_run": r"not a torchdebug run \(no meta.json\)",
        "bad_meta": "meta.json is corrupt",
    }
    with pytest.raises(RunStoreError, match=messages[what]) as info:
        open_run(target)
    assert str(target) in str(info.value)
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("damage", ["garbage", "truncated", "scribbled", "empty", "foreign_sqlite"])
def test_open_run_rejects_a_corrupt_database_without_touching_it(finished_run: Path, damage: str) -> None:
    db = finished_run / "rank0.sqlite"
    data = db.read_bytes()
    assert len(data) > 8 * 4096  # the run fills several pages, so half the file is missing pages
    if damage == "garbage":
        db.write_bytes(bytes(range(256)) * 64)
    elif damage == "truncated":
        db.write_bytes(data[: len(data) // 2])
    elif damage == "scribbled":  # header intact, ten B-tree pages overwritten
        db.write_bytes(data[: 2 * 4096] + b"\xab" * (10 * 4096) + data[12 * 4096 :])
    elif damage == "empty":
        db.write_bytes(b"")
    else:
        db.unlink()
        conn = _rw(db)
        conn.execute("CREATE TABLE songs (title TEXT)")
        conn.close()
    before = _snapshot(finished_run)
    with pytest.raises(RunStoreError) as info, open_run(finished_run) as run:
        run.series("loss")
    assert str(db) in str(info.value)
    assert re.search("corrupt|not a SQLite database|truncated|not a torchdebug run database", str(info.value))
    assert _snapshot(finished_run) == before
    [row] = list_runs(finished_run.parent)
    assert row.status == "unreadable" and str(db) in (row.error or "")
    assert _snapshot(finished_run) == before


def test_newer_schema_is_refused_by_reader_and_writer(finished_run: Path) -> None:
    db = finished_run / "rank0.sqlite"
    conn = _rw(db)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(
        SchemaVersionError, match="newer torchdebug: upgrade with pip install -U torchdebug"
    ) as info:
        open_run(finished_run)
    assert isinstance(info.value, RunStoreError) and str(db) in str(info.value)
    before = _snapshot(finished_run)
    with pytest.raises(SchemaVersionError, match="schema version 2"):
        create_run(path=finished_run)  # rank 0 re-opening its run must not touch a newer file
    assert _snapshot(finished_run) == before  # meta.json untouched too


def test_newer_schema_in_meta_json_is_refused(finished_run: Path) -> None:
    meta = json.loads((finished_run / "meta.json").read_text())
    meta["schema_version"] = SCHEMA_VERSION + 5
    (finished_run / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(SchemaVersionError, match="pip install -U torchdebug"):
        open_run(finished_run)


def test_migrations_build_the_schema_from_an_empty_file(finished_run: Path) -> None:
    assert sorted(MIGRATIONS) == list(range(SCHEMA_VERSION))  # one step per version, from 0
    (finished_run / "rank0.sqlite").unlink()
    (finished_run / "rank0.sqlite").write_bytes(b"")  # version 0: nothing yet
    w = create_run(path=finished_run)
    w.log_scalar("loss", 0, 1.0)
    w.close()
    with open_run(finished_run) as run:
        assert run.schema_version == SCHEMA_VERSION and run.series("loss").values == [1.0]


def test_writer_refuses_a_foreign_sqlite_file(finished_run: Path) -> None:
    db = finished_run / "rank0.sqlite"
    db.unlink()
    conn = _rw(db)
    conn.execute("CREATE TABLE songs (title TEXT)")
    conn.close()
    before = _snapshot(finished_run)
    with pytest.raises(RunStoreError, match="not a torchdebug run store"):
        create_run(path=finished_run)
    assert _snapshot(finished_run) == before


# -- reading while writing ---------------------------------------------------------------------------


def test_reader_works_while_the_writer_writes(tmp_path: Path) -> None:
    w = create_run(root=tmp_path, name="live")
    for step in range(100):
        w.log_scalar("loss", step, float(step))
    w.flush()
    run = open_run(w.path)
    assert run.status == "running"
    assert len(run.series("loss")) == 100
    # Hold a read transaction open (a snapshot) while the writer commits more: WAL lets both proceed.
    cur = run._conn.execute("SELECT step FROM scalars ORDER BY step")
    first = cur.fetchone()
    for step in range(100, 300):
        w.log_scalar("loss", step, float(step))
    w.flush()  # returns although a reader is mid-query
    assert first == (0,)
    cur.close()
    assert len(run.series("loss")) == 300  # a new query sees the new commits
    assert run.summary()["steps"] == 300
    w.close()  # the reader still has the file open: the run stays in WAL mode, which is fine
    assert run.status == "finished"
    assert run.series("loss").values[-1] == 299.0
    run.close()
    with open_run(w.path) as again:
        assert len(again.series("loss")) == 300


# -- list_runs ---------------------------------------------------------------------------------------


def test_list_runs(tmp_path: Path) -> None:
    a = create_run(root=tmp_path, name="a")
    a.log_scalars(0, {"loss": 1.0})
    a.log_scalars(1, {"loss": 0.5})
    a.log_anomaly(1, {"kind": "nan"})
    a.close()
    b = create_run(root=tmp_path, name="b")  # still running
    b.flush()
    (tmp_path / "not-a-run").mkdir()
    (tmp_path / "stray.txt").write_text("x")
    infos = list_runs(tmp_path)
    assert all(isinstance(i, RunInfo) for i in infos)
    assert [(i.name, i.status, i.steps, i.anomalies) for i in infos] == [
        ("a", "finished", 2, 1),
        ("b", "running", 0, 0),
    ]
    assert infos[0].path == a.path and infos[0].run_id == a.run_id and infos[0].created
    assert infos[0].to_dict()["path"] == str(a.path)
    b.close()
    assert list_runs(tmp_path / "not-a-run") == []
    with pytest.raises(RunStoreError, match="not a folder of runs"):
        list_runs(tmp_path / "nowhere")


def test_run_object_api(finished_run: Path) -> None:
    run = open_run(str(finished_run))
    assert isinstance(run, Run)
    assert run.name == "done" and run.run_id == run.meta["run_id"]
    assert str(run.series("loss", max_points=4)).startswith("loss: 4 points, steps 0..1999")
    run.close()
    with pytest.raises(RunStoreError, match="closed"):
        run.metric_names()


# -- cost and indexes --------------------------------------------------------------------------------


def test_log_scalar_costs_well_under_20_microseconds(tmp_path: Path) -> None:
    w = create_run(root=tmp_path, name="cost")
    n = 20_000
    t0 = time.perf_counter()
    for step in range(n):
        w.log_scalar("loss", step, 0.5)
    per_call = (time.perf_counter() - t0) / n
    w.close()
    assert per_call < 20e-6, f"{per_call * 1e6:.2f} µs per call"  # measured ~0.4 µs on 2 CPU cores


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT step, value FROM scalars WHERE metric_id = 1 AND step >= 5 ORDER BY step",  # metric X over steps
        "SELECT metric_id, value FROM scalars WHERE step = 5",  # everything at step N
        "SELECT data FROM anomalies WHERE step = 5",
        "SELECT data FROM events WHERE step = 5",
        "SELECT data FROM events WHERE kind = 'spike'",
        "SELECT data FROM tensor_stats WHERE step = 5",
        "SELECT data FROM tensor_stats WHERE name = 'w' ORDER BY step",
        "SELECT value FROM memory WHERE step = 5",
        "SELECT seconds FROM timings WHERE step = 5",
    ],
)
def test_queries_use_indexes(finished_run: Path, sql: str) -> None:
    with open_run(finished_run) as run:
        plan = " | ".join(row[-1] for row in run._rows("EXPLAIN QUERY PLAN " + sql))
    assert "USING" in plan and "INDEX" in plan and "TEMP B-TREE" not in plan, plan


@pytest.mark.parametrize(
    ("pid", "opened", "status"),
    [
        ("self", "now", "running"),  # this live process wrote it
        (
            "self",
            "2001-01-01T00:00:00+00:00",
            "crashed",
        ),  # the pid is alive but was reused: started after the run
        ("dead", "now", "crashed"),
    ],
)
def test_status_of_a_run_marked_running(finished_run: Path, pid: str, opened: str, status: str) -> None:
    meta = json.loads((finished_run / "meta.json").read_text())
    if pid == "self":
        meta["pid"] = os.getpid()
    else:
        child = subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
        )
        meta["pid"] = int(child.stdout)  # exited and reaped: no such process now
    # "opened" is when the writing process attached (for a new run, its creation time).
    meta["opened"] = (
        dt.datetime.now().astimezone().isoformat(timespec="seconds") if opened == "now" else opened
    )
    meta["status"] = "running"
    (finished_run / "meta.json").write_text(json.dumps(meta))
    with open_run(finished_run) as run:
        assert run.status == status

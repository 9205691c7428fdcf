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
        assert conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == str(
            SCHEMA_VERSION
        )
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
    assert sorted(p.name for p in w.path.iterdir()) == ["meta.json", "rank0.sqlite", "summary.json"]


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
    with pytest.raises(SchemaVersionError, match=f"schema version {SCHEMA_VERSION + 1}"):
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


def test_log_scalar_is_three_python_calls_and_no_io_on_the_callers_thread(tmp_path: Path) -> None:
    # its cost (about 0.4 µs measured on 2 CPU cores) is counted, not timed: the training thread runs
    # log_scalar, _put_low and _new_step (a new step each call) and never SQLite; the writer thread
    # (not traced: setprofile is per thread) commits
    import torchdebug.store.writer as writer_module

    w = create_run(root=tmp_path, name="cost")
    src = str(Path(writer_module.__file__).parent.parent)
    calls: list[str] = []
    sqlite_calls: list[str] = []

    def prof(frame, event, arg) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(src):
            calls.append(frame.f_code.co_name)
        elif event == "c_call" and type(getattr(arg, "__self__", None)) in (
            sqlite3.Connection,
            sqlite3.Cursor,
        ):
            sqlite_calls.append(arg.__name__)

    n = 1000
    sys.setprofile(prof)
    try:
        for step in range(n):
            w.log_scalar("loss", step, 0.5)
    finally:
        sys.setprofile(None)
    w.close()
    assert calls == ["log_scalar", "_new_step", "_put_low"] * n
    assert sqlite_calls == []
    with open_run(w.path) as run:
        assert run.series("loss").steps == list(range(n))


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


# -- rollups (schema v2): per-bucket summaries that answer downsampled reads --------------------------

# Columns of a metric_rollup row, as the tests read them back.
_ROLLUP_COLS = (
    "count, nan_count, first_step, last_step, sum, min_value, min_step, max_value, max_step, nan_step"
)


def _rollups(path: Path, metric: str, level: int) -> dict[int, tuple]:
    """{bucket: (count, nan_count, first, last, sum, min, min_step, max, max_step, nan_step)} of one level."""
    with open_run(path) as run:
        rows = run._rows(
            f"SELECT bucket, {_ROLLUP_COLS} FROM metric_rollup r JOIN metrics m ON m.id = r.metric_id "
            "WHERE m.name = ? AND r.level = ? ORDER BY bucket",
            (metric, level),
        )
    return {r[0]: r[1:] for r in rows}


def _expected_steps(
    points: list[tuple[int, float]], lo: int, hi: int, nb: int, width: int | None
) -> list[int]:
    """Reference envelope in plain Python: the steps series(max_points=2 * nb) must keep.

    A point's bucket is step // width (aligned buckets: rollups), or ((step - lo) * nb) // span when
    width is None (equal buckets: raw rows). Each bucket keeps its earliest NaN, else its lowest
    value, and its highest non-NaN value. Test data has no tied values.
    """
    span = hi - lo + 1
    buckets: dict[int, list[tuple[int, float]]] = {}
    for step, v in points:
        if lo <= step <= hi:
            b = step // width if width else (step - lo) * nb // span
            buckets.setdefault(b, []).append((step, v))
    keep: set[int] = set()
    for pts in buckets.values():
        nans = [s for s, v in pts if math.isnan(v)]
        reals = [(v, s) for s, v in pts if not math.isnan(v)]
        keep.add(min(nans) if nans else min(reals)[1])
        if reals:
            keep.add(max(reals)[1])
    return sorted(keep)


def _same_values(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


def test_rollup_rows_worked_out_by_hand(tmp_path: Path) -> None:
    # Three commits (flush_interval is an hour: only flush() commits), split inside buckets, so the
    # SQL upsert merges partial rows and the writer's Python merge builds the coarser levels.
    w = create_run(root=tmp_path, name="roll", flush_interval=3600)

    def x(s: int) -> float:  # s / 2, except NaN at 3, 7, 35, +Inf at 20, -Inf at 33
        return NAN if s in (3, 7, 35) else INF if s == 20 else -INF if s == 33 else s / 2

    for lo, hi, ys in ((0, 10, {0: NAN, 1: NAN}), (11, 25, {2: 4.0, 3: NAN}), (26, 39, {4: NAN})):
        for s in range(lo, hi + 1):
            w.log_scalar("x", s, x(s))
        for s, v in ys.items():
            w.log_scalar("y", s, v)
        w.flush()
    # z: one batch; level 16 buckets 0 (all NaN) and 1 (2.0) merge in Python into level 64 bucket 0.
    # v: the same the other way round (a value, then a bucket of NaN).
    w.log_scalars(0, {"v": 3.0})
    for s in range(16):
        w.log_scalars(s, {"z": NAN})
        w.log_scalars(16 + s, {"v": NAN})
    w.log_scalars(16, {"z": 2.0})
    w.close()
    # x at level 16:
    #  bucket 0, steps 0..15: NaN at 3, 7; sum = (0+...+15 - 3 - 7) / 2 = (120 - 10) / 2 = 55.0;
    #    min 0.0 at 0, max 7.5 at 15, earliest NaN at 3.
    #  bucket 1, steps 16..31: +Inf at 20 is the max and makes the sum +Inf; min 8.0 at 16; no NaN.
    #  bucket 2, steps 32..39 (8 rows): -Inf at 33 is the min and the sum; NaN at 35; max 19.5 at 39.
    assert _rollups(w.path, "x", 16) == {
        0: (16, 2, 0, 15, 55.0, 0.0, 0, 7.5, 15, 3),
        1: (16, 0, 16, 31, INF, 8.0, 16, INF, 20, None),
        2: (8, 1, 32, 39, -INF, -INF, 33, 19.5, 39, 35),
    }
    # x at level 32: bucket 0 = steps 0..31 (NaN at 3, 7; +Inf at 20 is the max and the sum), and
    # bucket 1 = steps 32..39, the same rows as bucket 2 of level 16.
    assert _rollups(w.path, "x", 32) == {
        0: (32, 2, 0, 31, INF, 0.0, 0, INF, 20, 3),
        1: (8, 1, 32, 39, -INF, -INF, 33, 19.5, 39, 35),
    }
    # Every coarser level has one bucket 0 holding all 40 rows: 3 NaN, min -Inf at 33, max +Inf at 20,
    # and sum +Inf + -Inf = NaN, which SQLite stores as NULL.
    for level in (64, 128, 256, 512, 1024, 2048, 4096):
        assert _rollups(w.path, "x", level) == {0: (40, 3, 0, 39, None, -INF, 33, INF, 20, 3)}
    # y: commit 1 brings NaN, NaN (no value: sum and min/max NULL); commit 2 brings 4.0 and NaN;
    # commit 3 only NaN. 5 rows, 4 NaN, the earliest at 0; sum, min and max are the one value 4.0.
    assert _rollups(w.path, "y", 16) == {0: (5, 4, 0, 4, 4.0, 4.0, 2, 4.0, 2, 0)}
    # z at 64: 16 NaN (steps 0..15) + 2.0 at 16. v at 64: 3.0 at 0 + 16 NaN (steps 16..31).
    assert _rollups(w.path, "z", 16) == {
        0: (16, 16, 0, 15, None, None, None, None, None, 0),
        1: (1, 0, 16, 16, 2.0, 2.0, 16, 2.0, 16, None),
    }
    assert _rollups(w.path, "z", 64) == {0: (17, 16, 0, 16, 2.0, 2.0, 16, 2.0, 16, 0)}
    assert _rollups(w.path, "v", 64) == {0: (17, 16, 0, 31, 3.0, 3.0, 0, 3.0, 0, 16)}
    # The rollup's points carry the wall time of the raw row they came from.
    with open_run(w.path) as run:
        s = run.series("x")
        (min_wall, max_wall), *_ = run._rows(
            "SELECT min_wall, max_wall FROM metric_rollup WHERE level = 64 AND metric_id = "
            "(SELECT id FROM metrics WHERE name = 'x')"
        )
        assert (min_wall, max_wall) == (s.wall_times[33], s.wall_times[20])


def test_choose_width_picks_the_finest_level_that_fits() -> None:
    from torchdebug.store._rollup import choose_width

    # 100,000 steps, 1000 buckets: level 64 has 99,999 // 64 + 1 = 1563 buckets, too many;
    # level 128 has 99,999 // 128 + 1 = 782.
    assert choose_width(0, 99_999, 1000) == (128, 1)
    # Off-edge range: 1,000..99,999 at 128 has 781 - 7 + 1 = 775 buckets; at 64, 1562 - 15 + 1 = 1548.
    assert choose_width(1000, 99_999, 1000) == (128, 1)
    # 10,000 steps, 1000 buckets: 16 * 1000 > 10,000, buckets would be narrower than the finest level.
    assert choose_width(0, 9_999, 1000) is None
    # 20,000 steps, 2 buckets: 4096 has 5; merging k = 2 gives 19,999 // 8192 + 1 = 3, k = 3 gives 2.
    assert choose_width(0, 19_999, 2) == (4096, 3)


def test_downsampling_from_rollups_equals_the_raw_envelope_of_the_same_buckets(tmp_path: Path) -> None:
    import random
    import shutil

    n = 20_000
    values = [v / 1000 for v in random.Random(0).sample(range(n), n)]  # distinct: no ties
    for step, v in ((5000, NAN), (9000, INF), (13000, -INF), (17000, NAN)):
        values[step] = v
    w = create_run(root=tmp_path, name="big", max_queue=n + 1)
    for step, v in enumerate(values):
        w.log_scalar("m", step, v)
    w.close()
    points = list(enumerate(values))
    with open_run(w.path) as run:
        assert run.has_rollups
        mid = run._metric_id("m")
        # max_points=200: at most 100 buckets over steps 0..19,999. Level 128 has 19,999 // 128 + 1
        # = 157 buckets, too many; level 256 has 19,999 // 256 + 1 = 79: read as they are.
        s = run.series("m", max_points=200)
        raw = run._raw_downsample(mid, 0, 0, n - 1, 100, width=256)
        assert s.downsampled and len(s) <= 200
        assert s.steps == [r[0] for r in raw] == _expected_steps(points, 0, n - 1, 100, 256)
        assert _same_values(s.values, [_nan_of(r[1]) for r in raw])
        assert s.wall_times == [r[2] for r in raw]
        assert _same_values(s.values, [values[k] for k in s.steps])
        # NaN, +Inf and -Inf each sit alone in their bucket: all three survive.
        for step in (5000, 9000, 13000, 17000):
            assert step in s.steps
        # since_step off a bucket edge: steps 1007..1023 of rollup bucket 3 are read raw and merged
        # with the rollup rows. Level 256 again: 19,999 // 256 - 1007 // 256 + 1 = 78 - 3 + 1 = 76.
        t = run.series("m", since_step=1007, max_points=200)
        raw = run._raw_downsample(mid, 1007, 1007, n - 1, 100, width=256)
        assert t.steps == [r[0] for r in raw] == _expected_steps(points, 1007, n - 1, 100, 256)
        assert t.steps[0] >= 1007 and t.wall_times == [r[2] for r in raw]
        # max_points=4: 2 buckets. Even level 4096 has 5 (19,999 // 4096 = 4), so 3 of its rows are
        # merged per bucket: width 12,288, buckets 0 (0..12,287) and 1 (12,288..19,999).
        u = run.series("m", max_points=4)
        raw = run._raw_downsample(mid, 0, 0, n - 1, 2, width=3 * 4096)
        assert u.steps == [r[0] for r in raw] == _expected_steps(points, 0, n - 1, 2, 3 * 4096)
        assert len(u) == 4 and math.isnan(u.values[0]) and u.steps[0] == 5000  # the earliest NaN
        # Equal-width raw buckets (old databases, short ranges) keep other extremes.
        assert _expected_steps(points, 0, n - 1, 100, None) != s.steps

    # The answer comes from the rollups: zero every raw value of a copy; downsampled reads of
    # ranges that start on a bucket edge do not change, full reads do.
    copy = tmp_path / "copy" / w.path.name
    shutil.copytree(w.path, copy)
    conn = _rw(copy / "rank0.sqlite")
    conn.execute("UPDATE scalars SET value = 0.0")
    conn.close()
    with open_run(copy) as run:
        again = run.series("m", max_points=200)
        assert again.steps == s.steps and _same_values(again.values, s.values)
        assert set(run.series("m").values) == {0.0}


def test_nan_and_inf_survive_downsampling_on_both_paths(tmp_path: Path) -> None:
    # 10,000 steps of 1.0 except: -Inf at 100 and NaN at 110 (one bucket), -Inf alone at 3000,
    # +Inf at 5000, and NaN on every step 7000..7423.
    special = {100: -INF, 110: NAN, 3000: -INF, 5000: INF} | {s: NAN for s in range(7000, 7424)}
    w = create_run(root=tmp_path, name="nan", max_queue=20_000)
    for step in range(10_000):
        w.log_scalar("loss", step, special.get(step, 1.0))
    w.close()
    with open_run(w.path) as run:
        mid = run._metric_id("loss")
        # Rollups: 10,000 points > 8192; max_points=100 -> at most 50 buckets; level 256 has 40.
        # Bucket 27 (6912..7167): 1.0s, NaN from 7000. Bucket 28 (7168..7423): all NaN.
        roll = run.series("loss", max_points=100)
        # The same from since_step=1, off a bucket edge: steps 1..255 are read raw and regrouped.
        head = run.series("loss", since_step=1, max_points=100)
        # Raw rows, same data: 50 equal buckets of 200 steps. Buckets 35 (7000..7199) and 36
        # (7200..7399) are all NaN; bucket 37 (7400..7599) has NaN up to 7423.
        raw_rows = run._raw_downsample(mid, 0, 0, 9999, 50)
        raw = Series("loss", [r[0] for r in raw_rows], [_nan_of(r[1]) for r in raw_rows])
        for s, nan_steps in (
            (roll, [110, 7000, 7168]),
            (head, [110, 7000, 7168]),
            (raw, [110, 7000, 7200, 7400]),
        ):
            got = dict(zip(s.steps, s.values))
            assert len(s) <= 100
            # A bucket holding a NaN shows its earliest NaN, even when it also holds -Inf (NaN is its
            # lowest; that -Inf is not shown). An all-NaN bucket shows one NaN and no "highest".
            assert [k for k, v in got.items() if math.isnan(v)] == nan_steps
            assert 100 not in got
            assert got[3000] == -INF and got[5000] == INF
            assert {v for v in s.values if not math.isnan(v)} == {-INF, INF, 1.0}


def _nan_of(v: float | None) -> float:
    return math.nan if v is None else v


def _write_v1_run(folder: Path, n: int) -> list[tuple[int, float]]:
    """A run folder as torchdebug wrote it before rollups (schema v1), by hand; returns its points."""
    folder.mkdir(parents=True)
    meta = {
        "run_id": "0" * 32,
        "name": "old",
        "created": "2026-01-01T00:00:00+00:00",
        "status": "finished",
        "ended": "2026-01-01T01:00:00+00:00",
        "rank": 0,
        "world_size": 1,
        "schema_version": 1,
    }
    (folder / "meta.json").write_text(json.dumps(meta))
    conn = _rw(folder / "rank0.sqlite")
    conn.execute("BEGIN")  # one commit, not one per row
    MIGRATIONS[0](conn)  # the v1 tables, exactly as v1 created them
    conn.execute("PRAGMA user_version = 1")
    conn.execute("INSERT INTO meta(key, value) VALUES ('schema_version', '1')")
    conn.execute("INSERT INTO metrics(id, name) VALUES (1, 'loss')")
    points = [(s, NAN if s == 4321 else float(s)) for s in range(n)]  # value = step: no ties
    conn.executemany(
        "INSERT INTO scalars(metric_id, step, value, wall_time) VALUES (1, ?, ?, ?)",
        [(s, v, 1000.0 + s) for s, v in points],
    )
    conn.execute("COMMIT")
    conn.close()
    return points


def test_an_old_schema_database_reads_raw_and_a_writer_migrates_it(tmp_path: Path) -> None:
    folder = tmp_path / "old-20260101-000000"
    points = _write_v1_run(folder, 10_000)
    before = _snapshot(folder)
    with open_run(folder) as run:
        assert run.schema_version == 1 and not run.has_rollups
        s = run.series("loss", max_points=100)
        # Raw path: 50 equal buckets of 200 steps; value = step, so each keeps its first and last
        # step, except bucket 21 (4200..4399) whose lowest is the NaN at 4321.
        expected = sorted(
            {4321 if b == 21 else 200 * b for b in range(50)} | {200 * b + 199 for b in range(50)}
        )
        assert s.downsampled and s.steps == expected == _expected_steps(points, 0, 9999, 50, None)
        assert math.isnan(s.values[s.steps.index(4321)]) and s.wall_times[0] == 1000.0
        assert len(run.series("loss")) == 10_000
    assert _snapshot(folder) == before  # the reader migrated nothing

    # A writer re-opening the run (a resume) migrates it to v2 and builds rollups of the old rows.
    w = create_run(path=folder)
    w.log_scalar("loss", 10_000, -1.0)
    w.close()
    with open_run(folder) as run:
        assert run.schema_version == SCHEMA_VERSION and run.has_rollups
        # level 16: 10,001 rows in 626 buckets (0..625); NaN at 4321 lands in bucket 4321 // 16 = 270.
        rows16 = _rollups(folder, "loss", 16)
        assert len(rows16) == 626 and sum(r[0] for r in rows16.values()) == 10_001
        assert rows16[270] == (
            16,
            1,
            4320,
            4335,
            sum(range(4320, 4336)) - 4321.0,
            4320.0,
            4320,
            4335.0,
            4335,
            4321,
        )
        assert rows16[625] == (1, 0, 10_000, 10_000, -1.0, -1.0, 10_000, -1.0, 10_000, None)
        s = run.series("loss", max_points=100)  # 10,001 points > 8192: rollups, level 256 (40 buckets)
        points.append((10_000, -1.0))
        assert s.steps == _expected_steps(points, 0, 10_000, 50, 256)
        assert math.isnan(s.values[s.steps.index(4321)]) and s.values[-1] == -1.0


# A step every ~0.5 ms. (A loop with no sleep at all starves the writer thread: sqlite3 releases the
# GIL around every row it inserts and must win it back from the busy logging thread each time.)
_KILLED_WRITER = """
import sys, time
from torchdebug.store import create_run
w = create_run(root=sys.argv[1], name="killed", flush_interval=0.01)
print(w.path, flush=True)
step = 0
while True:
    w.log_scalars(step, {"a": step / 2, "b": float("nan") if step % 7 == 0 else -step})
    step += 1
    time.sleep(0.0005)
"""


@pytest.mark.timeout(60)
def test_rollups_and_raw_rows_agree_after_sigkill(tmp_path: Path) -> None:
    # Rollups commit in the raw rows' transaction: a process killed mid-write leaves both or neither.
    import signal

    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        path = Path(proc.stdout.readline().strip())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until a thousand steps are committed
            time.sleep(0.2)
            with open_run(path) as run:
                if run.metric_names() and len(run.series("a")) > 1000:
                    break
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()
    with open_run(path) as run:
        for level in (16, 4096):
            # Per (metric, bucket): rollup count and NaN count == the raw rows' own.
            raw = run._rows(
                "SELECT metric_id, step / ?, count(*), sum(value IS NULL) FROM scalars GROUP BY 1, 2 ORDER BY 1, 2",
                (level,),
            )
            rolled = run._rows(
                "SELECT metric_id, bucket, count, nan_count FROM metric_rollup WHERE level = ? ORDER BY 1, 2",
                (level,),
            )
            assert raw == rolled and len(raw) >= 2


def test_rollup_reads_use_the_primary_key(finished_run: Path) -> None:
    with open_run(finished_run) as run:
        plan = " | ".join(
            row[-1]
            for row in run._rows(
                "EXPLAIN QUERY PLAN SELECT count FROM metric_rollup WHERE metric_id = 1 AND level = 64 AND bucket >= 3"
            )
        )
    assert "USING PRIMARY KEY (metric_id=? AND level=? AND bucket>?)" in plan, plan

"""Reports of a compacted run: the numbers equal those of the same records kept whole, worked out by
hand; the figures come from rollups and keep every spike."""

from __future__ import annotations

import math
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from torchdebug.store import _aggregate, create_run, open_run
from torchdebug.views.report import build_report, collect_data, collect_views
from torchdebug.views.report._data import _pivot

# keep_recent=0 over 5000 steps: the chunk [0, 4096) is compacted (4999 - 0 >= 0 + 4096), the rest stays.
STEPS = 5000
SPIKE, NAN_AT, INF_AT, SLOW, EVENT, ANOMALY = 1234, 2500, 3000, 1500, 2000, 3500


def _write(root: Path, keep_recent: int | None) -> Path:
    # commits only at the flushes below: both runs fold the same batches, so their sums match to the bit
    w = create_run(root=root, name="r", keep_recent=keep_recent, commit_steps=STEPS)
    for s in range(STEPS):
        loss = 500.0 if s == SPIKE else math.nan if s == NAN_AT else 1.0 + (s % 5) / 4
        grad = math.inf if s == INF_AT else 2.0 + (s % 3)
        w.log_scalars(s, {"loss": loss, "grad_norm": grad})
        if s % 10 == 0:
            w.log_scalars(s, {"grad_norm/fc.weight": s / 1000})
        t = {"data": 0.001, "forward": 0.494 if s == SLOW else 0.002, "backward": 0.004, "optimizer": 0.001}
        t["other"] = 0.0
        if s % 2 == 0:  # odd steps log no "step": their step time is the sum of their phases
            t["step"] = 0.5 if s == SLOW else 0.008
        w.log_timing(s, t)
        if s % 50 == 0:
            w.log_memory(s, {"rss": 1000 + s, "frag": math.nan if s == NAN_AT else s / 5000})
        if s == EVENT:
            w.log_event(s, "loss_spike", "warning", "loss rose")
        if s == ANOMALY:
            w.log_anomaly(s, {"phase": "forward", "module": "fc", "kind": "nan"})
        if s % 1000 == 999:
            w.flush()
    w.close()
    assert w.dropped == 0
    return w.path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("compacted")
    return _write(root / "whole", None), _write(root / "compacted", 0)


def _plain(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in d.items() if k not in ("id", "wall_time")} for d in docs]


def test_the_run_is_compacted(runs: tuple[Path, Path]) -> None:
    whole, compacted = runs
    with open_run(whole) as a, open_run(compacted) as b:
        assert a._compaction()[0] == 0 and b._compaction()[0] == 4096
        # raw loss rows left in [0, 4096): +-32 steps around the event (2000) and the anomaly (3500)
        assert (
            b._rows(
                "SELECT count(*) FROM scalars s JOIN metrics m ON m.id = s.metric_id "
                "WHERE m.name = 'loss' AND step < 4096"
            )[0][0]
            == 2 * 65
        )
        # the +Inf at 3000 is near nothing: its bucket's finite part was kept before its rows went
        assert b._rows("SELECT kind, count, bad FROM finite_rollup")[0] == ("metric", 4095, 1)


def test_report_numbers_equal_the_whole_run_and_the_hand_count(runs: tuple[Path, Path]) -> None:
    whole, compacted = runs
    with open_run(whole) as a, open_run(compacted) as b:
        ra, rb = build_report(a), build_report(b)
    assert rb["summary"] == ra["summary"] and rb["summary"]["total_debug_operations"] == STEPS
    loss = rb["metrics"]["loss"]
    # 5000 points, NaN at 2500; finite min 1.0, max the spike; last step 4999: 1 + 4/4
    assert loss == {"points": 5000, "last_step": 4999, "last": 2.0, "min": 1.0, "max": 500.0, "nonfinite": 1}
    assert rb["metrics"] == ra["metrics"]
    assert rb["metrics"]["grad_norm/fc.weight"] == {
        "points": 500,
        "last_step": 4990,
        "last": 4.99,
        "min": 0.0,
        "max": 4.99,
        "nonfinite": 0,
    }
    grad = rb["gradient_analysis"]
    # 2 + s % 3 over 0..4999: residues 0/1/2 occur 1667/1667/1666 times, so the sum is
    # 2 * 5000 + 1667 + 2 * 1666 = 14999; step 3000 (residue 0, value 2) is +Inf instead: 14997 / 4999
    assert grad["average_gradient_norm"] == pytest.approx(14997 / 4999, rel=1e-12)
    assert (grad["max_gradient_norm"], grad["nonfinite_gradient_steps"]) == (4.0, 1)
    assert grad["average_gradient_norm"] == pytest.approx(ra["gradient_analysis"]["average_gradient_norm"])
    perf = rb["performance_analysis"]
    # every step 8 ms (logged, or 1 + 2 + 4 + 1 + 0 ms summed) but step 1500: 0.5 s
    assert perf["timed_steps"] == 5000
    assert (perf["min_execution_time"], perf["max_execution_time"]) == (pytest.approx(0.008), 0.5)
    assert perf["average_execution_time"] == pytest.approx((4999 * 0.008 + 0.5) / 5000, rel=1e-12)
    assert perf == pytest.approx(ra["performance_analysis"], rel=1e-12)
    phases = rb["operation_breakdown"]["time_by_phase"]
    # forward: 4999 steps of 2 ms and one of 494 ms; other: 0 at every step
    assert phases["forward"] == pytest.approx(4999 * 0.002 + 0.494, rel=1e-12)
    assert phases == pytest.approx(
        {"data": 5.0, "forward": 10.492, "backward": 20.0, "optimizer": 5.0, "other": 0.0}
    )
    assert phases == pytest.approx(ra["operation_breakdown"]["time_by_phase"], rel=1e-12)
    # RSS 1000 + s at s = 0, 50, ..., 4950: 100 samples, mean 1000 + 2475, max 5950
    assert rb["memory_analysis"] == ra["memory_analysis"]
    assert rb["memory_analysis"]["samples"] == 100
    assert (rb["memory_analysis"]["average_memory_usage"], rb["memory_analysis"]["max_memory_usage"]) == (
        3475,
        5950,
    )
    assert _plain(rb["anomalies"]) == _plain(ra["anomalies"]) and [a["step"] for a in rb["anomalies"]] == [
        ANOMALY
    ]
    assert _plain(rb["events"]) == _plain(ra["events"]) and [e["step"] for e in rb["events"]] == [EVENT]
    assert rb["verdict"] == ra["verdict"]


def test_compacted_buckets_keep_the_whole_runs_min_max_mean_last(runs: tuple[Path, Path]) -> None:
    whole, compacted = runs
    cols = "level, bucket, count, nan_count, sum, min_value, min_step, max_value, max_step, last_step, last_value"
    with open_run(whole) as a, open_run(compacted) as b:
        for table, key in (("metric_rollup", "metric_id"), ("timing_rollup", "phase")):
            sql = f"SELECT {key}, {cols} FROM {table} WHERE level >= 256 AND bucket * level < 4096 ORDER BY 1, 2, 3"
            kept, truth = b._rows(sql), a._rows(sql)
            assert kept == truth and len(kept) > 0
        # the loss bucket [1024, 1280) at level 256: the spike is its max, 1.0 its min; its mean is the
        # sum of 1 + (s % 5) / 4 over the other 255 steps plus 500, over 256; its last step is 1279
        count, total, lo, hi, hi_step, last = b._rows(
            "SELECT count, sum, min_value, max_value, max_step, last_value FROM metric_rollup r "
            "JOIN metrics m ON m.id = r.metric_id WHERE m.name = 'loss' AND level = 256 AND bucket = 4"
        )[0]
        assert (count, lo, hi, hi_step, last) == (256, 1.0, 500.0, SPIKE, 1.0 + (1279 % 5) / 4)
        assert total == pytest.approx(sum(1.0 + (s % 5) / 4 for s in range(1024, 1280) if s != SPIKE) + 500.0)


def test_figures_of_a_compacted_run_show_every_spike(runs: tuple[Path, Path]) -> None:
    _, compacted = runs
    with open_run(compacted) as run:
        # 6370 timing rows: few, but the compacted span keeps only some samples, so rollups answer
        assert _aggregate.sample_count(run, "timings") < _aggregate.PIVOT_ROWS
        data = collect_data(run, max_points=200)
        total = data["timings"]["total"]
        assert 0 < len(total["steps"]) <= 200 and total["steps"] == sorted(total["steps"])
        assert total["values"][total["steps"].index(SLOW)] == 0.5  # the slow step (compacted span)
        # 100 chart buckets over 5000 steps, no finer than 256 steps in a compacted span: level 256,
        # 16 buckets below 4096 with a low and a high point each (the kept samples would give 128)
        assert len([s for s in total["steps"] if s < 4096]) <= 2 * 16
        assert min(total["values"]) == pytest.approx(0.008)
        loss = data["series"]["loss"]
        assert loss["values"][loss["steps"].index(SPIKE)] == 500.0
        assert math.isnan(loss["values"][loss["steps"].index(NAN_AT)])
        views = collect_views(run, max_points=200)
        step_fig = next(f for f in views["figures"] if f["id"] == "step_time")
        assert "slowest 500 ms at step 1500" in step_fig["summary"]


def test_figures_since_a_step_read_the_samples(runs: tuple[Path, Path]) -> None:
    _, compacted = runs
    with open_run(compacted) as run:
        data = collect_data(run, max_points=2000, since_step=4900)
        # 100 steps of raw samples: every one, the step time of odd steps summed from the phases
        assert data["timings"]["total"]["steps"] == list(range(4900, 5000))
        assert data["timings"]["total"]["values"] == pytest.approx([0.008] * 100)
        assert data["memory"]["rss"] == {"steps": [4900, 4950], "values": [5900, 5950]}


def test_long_sample_tables_are_bucketed_as_the_python_envelope(runs: tuple[Path, Path]) -> None:
    _, compacted = runs
    with open_run(compacted) as run:
        got = _aggregate.sample_series(run, "memory", max_points=20)
        # 100 samples at s = 0, 50, ..., 4950 in 10 buckets of 495 steps: each keeps its lowest and
        # highest point (10 samples each), and frag's NaN at 2500 stays beside its bucket's extremes
        assert got["rss"]["steps"] == [s for b in range(10) for s in (b * 500, b * 500 + 450)]
        assert [s for s, v in zip(got["frag"]["steps"], got["frag"]["values"]) if v != v] == [NAN_AT]
        ref = _pivot(run.memory(), 20)  # the envelope of every sample, in Python
        assert got["rss"] == ref["rss"]
        assert got["frag"]["steps"] == ref["frag"]["steps"]
        assert got["frag"]["values"][:5] == ref["frag"]["values"][:5]


@pytest.mark.slow  # writes 100,000 steps through the real writer: 15 - 40 s on the shared VM
def test_a_long_run_stays_small_and_its_report_reads_rollups(tmp_path: Path) -> None:
    steps = 100_000
    w = create_run(root=tmp_path, name="long")
    for s in range(steps):
        w.log_scalars(s, {"loss": 1000.0 if s == 50_003 else 1.0, "grad_norm": 0.5, "lr/0": 1e-3})
        w.log_timing(s, {"forward": 0.002, "backward": 0.004, "step": 0.5 if s == 60_001 else 0.008})
        if s % 2000 == 1999:
            w.flush()
    w.close()
    assert w.dropped == 0
    size = sum(f.stat().st_size for f in w.path.iterdir())
    # the last 20,000 steps whole (~0.6 KB/step here), the 77,824 compacted steps in rollups (~0.1 KB)
    assert size < 25e6, size
    with open_run(w.path) as run:
        scanned = []
        run._conn.set_trace_callback(scanned.append)
        rep = build_report(run)
        views = collect_views(run)
        run._conn.set_trace_callback(None)
        assert run._compaction()[0] == 77_824  # 19 chunks of 4096: 99,999 - 20,000 >= 77,824 + 4096 fails
    assert rep["summary"]["total_debug_operations"] == steps
    assert rep["metrics"]["loss"] == {
        "points": steps,
        "last_step": steps - 1,
        "last": 1.0,
        "min": 1.0,
        "max": 1000.0,
        "nonfinite": 0,
    }
    perf = rep["performance_analysis"]
    assert (perf["timed_steps"], perf["max_execution_time"]) == (steps, 0.5)
    assert perf["average_execution_time"] == pytest.approx((99_999 * 0.008 + 0.5) / steps, rel=1e-12)
    assert rep["operation_breakdown"]["time_by_phase"]["backward"] == pytest.approx(steps * 0.004, rel=1e-12)
    total = next(f for f in views["figures"] if f["id"] == "step_time")
    assert "slowest 500 ms at step 60001" in total["summary"]
    # no query of the report or the page reads the timing samples (one index count decides) or a
    # metric's rows in full (the raw read of Run.series without max_points)
    assert [q for q in scanned if "FROM timings" in q] == ["SELECT count(*) FROM timings WHERE step >= 0"]
    assert not [q for q in scanned if "SELECT step, value, wall_time FROM scalars" in q]


def test_a_v3_file_reports_from_its_samples_and_a_writer_rolls_them_up(tmp_path: Path) -> None:
    w = create_run(root=tmp_path, name="old", keep_recent=None)
    for s in range(300):
        t = {"data": 0.001, "forward": 0.002, "backward": 0.004, "optimizer": 0.001, "other": 0.0}
        if s % 3:  # every third step logs no "step": its step time is the sum of its phases
            t["step"] = 0.5 if s == 200 else 0.008
        w.log_timing(s, t)
        w.log_scalars(s, {"loss": 1.0})
    w.close()
    db = w.path / "rank0.sqlite"
    conn = sqlite3.connect(db, isolation_level=None)
    rollups = conn.execute("SELECT * FROM timing_rollup ORDER BY phase, level, bucket").fetchall()
    # as a v3 writer left it: no timing rollups, schema 3
    conn.execute("DROP TABLE timing_rollup")
    conn.execute("DROP TABLE finite_rollup")
    conn.execute("PRAGMA user_version = 3")
    conn.execute("UPDATE meta SET value = '3' WHERE key = 'schema_version'")
    conn.close()
    with open_run(w.path) as run:
        assert run.schema_version == 3
        perf = build_report(run)["performance_analysis"]
        # 299 steps of 8 ms (logged, or 1 + 2 + 4 + 1 + 0 summed) and step 200's 0.5 s
        assert perf["timed_steps"] == 300 and perf["max_execution_time"] == 0.5
        assert perf["average_execution_time"] == pytest.approx((299 * 0.008 + 0.5) / 300, rel=1e-12)
    create_run(path=w.path).close()  # a resume migrates the file and rolls up the rows it holds
    conn = sqlite3.connect(db)
    assert conn.execute("SELECT * FROM timing_rollup ORDER BY phase, level, bucket").fetchall() == rollups
    conn.close()

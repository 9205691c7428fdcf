"""Long runs: older per-step rows are compacted into rollups, full resolution stays at the end and
around events and anomalies, every spike stays on the charts, and `runs` reads a closed run's summary."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from torchdebug.store import _compact, create_run, list_runs, open_run

pytestmark = pytest.mark.slow  # the fixture writes 14,388 steps through the real writer (~10 s)

# keep_recent=2000 over 14,388 steps: chunks of 4096 are compacted while 14387 - 2000 >= start + 4096,
# i.e. [0, 4096), [4096, 8192), [8192, 12288): compacted_to = 12288.
STEPS = 3 * 4096 + 2000 + 100
EVENT, ANOMALY, SPIKE, SLOW = 5000, 9000, 3001, 7003


@pytest.fixture(scope="module")
def long_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    w = create_run(root=tmp_path_factory.mktemp("long"), name="long", keep_recent=2000)
    for s in range(STEPS):
        w.log_scalars(s, {"loss": 1000.0 if s == SPIKE else 1.0 + (s % 7) / 8, "lr": 0.125})
        w.log_timing(s, {"forward": 0.25, "step": 2.0 if s == SLOW else 0.5})
        if s % 50 == 0:
            w.log_memory(s, {"rss": 1000 + s})
        if s == EVENT:
            w.log_event(s, "loss_spike", "warning", "loss rose")
        if s == ANOMALY:
            w.log_anomaly(s, {"phase": "forward", "module": "fc", "kind": "nan"})
        if s % 1000 == 0:
            w.flush()
    w.close()
    assert w.dropped == 0
    return w.path


def test_old_rows_are_compacted_except_near_events_and_anomalies(long_run: Path) -> None:
    with open_run(long_run) as run:
        assert run._compaction() == (12288, 12288 - 2 * 65)  # every compacted step but the kept windows
        rows = run._rows("SELECT DISTINCT step FROM scalars WHERE step < 12288 ORDER BY step")
        kept = [r[0] for r in rows]
        # +-32 steps around the event (5000) and the anomaly (9000): 65 steps each
        assert kept == list(range(EVENT - 32, EVENT + 33)) + list(range(ANOMALY - 32, ANOMALY + 33))
        assert run.steps() == STEPS  # compacted steps still count
        assert run.series("loss", since_step=12288).steps == list(range(12288, STEPS))  # the end is whole
        assert len(run.memory()) == len(range(0, STEPS, 50))  # never compacted
        assert len(run.events()) == 1 and len(run.anomalies()) == 1
        # finer rollup levels are gone from the compacted span; 256 and up stay
        levels = {
            r[0] for r in run._rows("SELECT DISTINCT level FROM metric_rollup WHERE bucket * level < 12288")
        }
        assert min(levels) == _compact.KEEP_LEVEL


def test_every_spike_stays_on_the_chart_and_the_mean_and_last_are_kept(long_run: Path) -> None:
    with open_run(long_run) as run:
        chart = run.series("loss", max_points=200)
        assert chart.downsampled and len(chart) <= 200
        assert chart.values[chart.steps.index(SPIKE)] == 1000.0
        full = run.series("loss")  # a full read: compacted buckets' low and high points, then raw
        assert full.downsampled and full.values[full.steps.index(SPIKE)] == 1000.0
        assert full.steps[-2000:] == list(range(STEPS - 2000, STEPS))
        # rollup of bucket [3072, 3328) at level 256: sum/count is the mean, last is step 3327's value
        count, total, last_step, last = run._rows(
            "SELECT count, sum, last_step, last_value FROM metric_rollup r JOIN metrics m ON m.id = r.metric_id "
            "WHERE m.name = 'loss' AND level = 256 AND bucket = 12"
        )[0]
        assert (count, last_step, last) == (256, 3327, 1.0 + (3327 % 7) / 8)
        # 256 values 1 + (s % 7) / 8, one of them (3001) replaced by 1000
        expected = sum(1.0 + (s % 7) / 8 for s in range(3072, 3328))
        assert total == pytest.approx(expected)


def test_timings_keep_each_buckets_last_and_slowest_sample(long_run: Path) -> None:
    with open_run(long_run) as run:
        steps = sorted({t["step"] for t in run.timings() if t["step"] < 4096})
        # one chunk: 64 buckets of 64 steps, each keeps its last step (64b + 63) and its slowest:
        # every step takes 0.5 s there, and among ties the first (64b) counts as the slowest
        assert steps == sorted([b * 64 for b in range(64)] + [b * 64 + 63 for b in range(64)])
        slow = [t for t in run.timings() if 6976 <= t["step"] < 7040]
        # the bucket [6976, 7040): its slowest (7003, 2 s) and its last (7039)
        assert [(t["step"], t["total"]) for t in slow] == [(7003, 2.0), (7039, 0.5)]


def test_runs_reads_a_closed_runs_summary_not_its_database(long_run: Path, tmp_path: Path) -> None:
    summary = json.loads((long_run / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["anomalies"] == 1
    (info,) = list_runs(long_run.parent)
    assert (info.status, info.steps, info.anomalies) == ("finished", STEPS, 1)
    # the summary is what is read: a doctored count shows ...
    summary["steps"] = 7
    (long_run / "summary.json").write_text(json.dumps(summary))
    assert list_runs(long_run.parent)[0].steps == 7
    # ... until the database changes after it (its mtime no longer matches): then the database answers
    db = long_run / "rank0.sqlite"
    st = db.stat()
    os.utime(db, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert list_runs(long_run.parent)[0].steps == STEPS
    summary["steps"] = STEPS
    (long_run / "summary.json").write_text(json.dumps(summary))
    os.utime(db, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_keep_recent_is_validated(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep_recent must be an int >= 0 or None"):
        create_run(root=tmp_path, keep_recent=-1)
    assert list(tmp_path.iterdir()) == []

"""Tests of what one writer commit costs in SQL: fixed statement shapes, a counted statement list,
and rollups of a batch equal to rollups written one row at a time."""

from __future__ import annotations

import math
import re
import sqlite3
from pathlib import Path

import pytest

from torchdebug.store import _batch, _rollup, create_run, open_run

NAN, INF = math.nan, math.inf


def _values_groups(sql: str) -> int:
    """Rows in one multi-row ``INSERT ... VALUES (...), (...)`` statement as the trace callback shows
    it, numbers bound in (0 for other statements)."""
    head = sql.split(" ON CONFLICT", 1)[0]
    return head.split(" VALUES ", 1)[1].count("), (") + 1 if " VALUES " in head else 0


def _traced_commit(w, log) -> list[str]:
    """The SQL statements the writer thread runs for the records ``log()`` queues, in one commit."""
    seen: list[str] = []
    w._core.conn.set_trace_callback(seen.append)  # runs on the writer thread, inside its commit
    try:
        log()
        w.flush()
    finally:
        w._core.conn.set_trace_callback(None)
    return seen


def _log_steps(w, steps: range) -> None:
    for s in steps:
        w.log_scalars(s, {"loss": (s % 7) * 0.25, "lr": 0.5})
        w.log_timing(s, {"forward": 0.25, "backward": 0.5, "step": 1.0})


def test_a_32_step_commit_runs_a_counted_list_of_statements(tmp_path: Path) -> None:
    # commit_steps and the clock out of the way: the flush is the only commit
    w = create_run(root=tmp_path, name="c", commit_steps=10_000, flush_interval=3600.0)
    try:
        _log_steps(w, range(32))
        w.flush()  # the first commit names the metrics; the traced one below adds no name
        seen = _traced_commit(w, lambda: _log_steps(w, range(32, 64)))
    finally:
        w.close()
    kinds = [re.match(r"\s*(\w+(?: INTO \w+)?)", s).group(1) for s in seen]  # type: ignore[union-attr]
    # scalars: 32 steps x 2 metrics = 64 rows: 2 statements of 32.
    # metric rollups: per metric, level 16 holds steps 32..63 in buckets 2 and 3, level 32 in
    # bucket 1, each of the 7 levels 64..4096 in one bucket: 2 + 1 + 7 = 10; 2 metrics = 20 rows:
    # 8 + 8 + 4 x 1 = 6 statements.
    # timings: 32 samples x 3 phases = 96 rows: 3 statements of 32.
    # timing rollups: 3 keys (forward, backward, step) x 7 levels (64..4096), one bucket each = 21
    # rows: 8 + 8 + 5 x 1 = 7 statements.
    assert kinds == (
        ["BEGIN"]
        + ["INSERT INTO scalars"] * 2
        + ["INSERT INTO metric_rollup"] * 6
        + ["INSERT INTO timings"] * 3
        + ["INSERT INTO timing_rollup"] * 7
        + ["COMMIT"]
    )
    rows = [_values_groups(s) for s in seen]
    assert rows == [0, 32, 32, 8, 8, 1, 1, 1, 1, 32, 32, 32, 8, 8, 1, 1, 1, 1, 1, 0]


@pytest.mark.parametrize("n, shapes", [(0, []), (1, [1]), (45, [32, 8, 1, 1, 1, 1, 1]), (64, [32, 32])])
def test_batch_insert_takes_only_three_statement_shapes(n: int, shapes: list[int]) -> None:
    conn = sqlite3.connect(":memory:", isolation_level=None)
    conn.execute("CREATE TABLE t (a INTEGER, b REAL)")
    seen: list[str] = []
    conn.set_trace_callback(seen.append)
    _batch.insert(conn, "INSERT INTO t(a, b)", ((i, i / 4) for i in range(n)))
    conn.set_trace_callback(None)
    assert [_values_groups(s) for s in seen] == shapes
    assert conn.execute("SELECT a, b FROM t ORDER BY rowid").fetchall() == [(i, i / 4) for i in range(n)]
    # a width whose 32 rows pass SQLite's 999 parameters: 8 rows a statement (8 x 40 = 320)
    conn.execute(f"CREATE TABLE w ({', '.join(f'c{i}' for i in range(40))})")
    seen.clear()
    conn.set_trace_callback(seen.append)
    _batch.insert(conn, f"INSERT INTO w({', '.join(f'c{i}' for i in range(40))})", [tuple(range(40))] * 17)
    conn.set_trace_callback(None)
    assert [_values_groups(s) for s in seen] == [8, 8, 1]
    conn.close()


def _table(db: Path, sql: str) -> list[tuple[object, ...]]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


def test_rollups_of_one_commit_equal_rollups_written_row_by_row(tmp_path: Path) -> None:
    # 70 steps of a metric in one commit; the reference merges the same raw rows into an empty
    # table one point per statement, in logged order (the UPSERT's own merge rule). Values are
    # multiples of 1/4 so every sum is exact in any order; NaN, +Inf and -Inf are in it.
    w = create_run(root=tmp_path, name="r", commit_steps=10_000, flush_interval=3600.0)
    try:
        for s in range(70):
            v = NAN if s in (5, 40) else INF if s == 33 else -INF if s == 66 else (s % 7) * 0.25
            w.log_scalar("loss", s, v)
            w.log_timing(s, {"forward": (s % 3) * 0.25, "backward": 0.5})
    finally:
        w.close()
    db = w.path / "rank0.sqlite"
    raw = _table(db, "SELECT metric_id, step, value, wall_time FROM scalars ORDER BY rowid")
    samples: list[tuple[int, float, list[tuple[str, float]]]] = []
    for step, wall, phase, sec in _table(
        db, "SELECT step, wall_time, phase, seconds FROM timings ORDER BY id"
    ):
        if not samples or samples[-1][0] != step:
            samples.append((step, wall, []))
        samples[-1][2].append((phase, sec))
    ref = sqlite3.connect(":memory:", isolation_level=None)
    ref.execute(_rollup.CREATE)
    for statement in _rollup.ADD_LAST:
        ref.execute(statement)
    ref.execute(_rollup.TIMING_CREATE)
    for row in raw:
        _rollup.write(ref, [row])
    for sample in samples:
        _rollup.write_timings(ref, [sample])
    for table in ("metric_rollup", "timing_rollup"):
        order = f"SELECT * FROM {table} ORDER BY 1, level, bucket"
        got = _table(db, order)
        assert got == ref.execute(order).fetchall()
        assert len(got) == (5 + 3 + 2 + 1 * 6 if table == "metric_rollup" else 3 * (2 + 1 * 6))
    # by hand, loss at level 16, bucket 0 (steps 0..15): s % 7 over the 15 non-NaN steps sums to
    # 0+1+2+3+4+6+0+1+2+3+4+5+6+0+1 = 38, x 0.25 = 9.5; min 0.0 first at step 0, max 1.5 first at
    # step 6, the NaN at step 5, the last point step 15 (15 % 7 = 1: 0.25)
    (row,) = _table(
        db,
        "SELECT count, nan_count, first_step, last_step, sum, min_value, min_step, max_value, max_step, "
        "nan_step, last_value FROM metric_rollup WHERE level = 16 AND bucket = 0",
    )
    assert row == (16, 1, 0, 15, 9.5, 0.0, 0, 1.5, 6, 5, 0.25)
    ref.close()
    with open_run(w.path) as run:
        assert run.series("loss").values[:8] == [
            0.0,
            0.25,
            0.5,
            0.75,
            1.0,
            pytest.approx(NAN, nan_ok=True),
            1.5,
            0.0,
        ]
        t = run.timings()
        assert [(d["step"], d["forward"], d["backward"]) for d in t[:4]] == [
            (0, 0.0, 0.5),
            (1, 0.25, 0.5),
            (2, 0.5, 0.5),
            (3, 0.0, 0.5),
        ]

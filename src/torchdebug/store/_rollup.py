"""Metric rollups: per-bucket min/max/count/NaN summaries that make downsampled reads cheap.

The writer folds every batch of scalars into ``metric_rollup`` rows, one per (metric, level,
bucket), where ``level`` is a bucket width in steps (``LEVELS``) and ``bucket = step // level``.
A row keeps the bucket's count, NaN count, first and last step, sum of the non-NaN values, and
three real points: the lowest and the highest non-NaN value and the earliest NaN, each with its
step and wall time. The reader turns each row of one level into a chart bucket's lowest and
highest point (see reader.py), so a 100k-step metric is read as ~800 rows instead of 100k.

Invariants: rollup rows are written in the same transaction as the raw rows they summarize, so
``sum(count)`` over any level equals the number of raw rows of that metric. A value of NaN never
enters min/max/sum (SQLite would store it as NULL); it is counted in ``nan_count`` and its point
is kept in ``nan_step``/``nan_wall``. +-Inf are real floats: min/max keep them, and a sum that
meets both +Inf and -Inf becomes NaN, i.e. NULL.
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Iterable, Iterator

from . import _batch

#: Bucket widths in steps, finest first: powers of 2, so for any chart of ``nb`` buckets one level
#: has between nb/2 and nb buckets over the range and is read as it is, one rollup row per chart
#: bucket, with no regrouping. The finest level costs one rollup row per 16 raw rows; all levels
#: together about one per 8 (fewer when a commit holds many steps of a metric).
LEVELS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
_SHIFTS = tuple(level.bit_length() - 1 for level in LEVELS)  # bucket = step >> shift
_FINEST_SHIFT = _SHIFTS[0]
_NAN = math.nan  # bound for NULL (see _aggregated)

CREATE = """
CREATE TABLE metric_rollup (
    metric_id INTEGER NOT NULL REFERENCES metrics(id),
    level INTEGER NOT NULL,     -- bucket width in steps
    bucket INTEGER NOT NULL,    -- step // level
    count INTEGER NOT NULL,     -- raw rows, NaN included
    nan_count INTEGER NOT NULL,
    first_step INTEGER NOT NULL,
    last_step INTEGER NOT NULL,
    sum REAL,                   -- of non-NaN values; NULL when only NaN, or +Inf met -Inf
    min_value REAL, min_step INTEGER, min_wall REAL,   -- NULL when every value is NaN
    max_value REAL, max_step INTEGER, max_wall REAL,
    nan_step INTEGER, nan_wall REAL,                   -- the earliest NaN; NULL when none
    PRIMARY KEY (metric_id, level, bucket)
) WITHOUT ROWID
"""

#: v3 adds the last point of each bucket (compacted spans keep min, max, mean and last):
#: ``last_value`` (NULL: NaN, or a row written before v3), ``last_wall``.
ADD_LAST = (
    "ALTER TABLE metric_rollup ADD COLUMN last_value REAL",
    "ALTER TABLE metric_rollup ADD COLUMN last_wall REAL",
)

# Merge a batch's partial row into the stored one. In an UPDATE every column on the right-hand side
# is the row's old value, so the *_step/*_wall columns compare against the old min/max. Ties keep
# the stored point (the first logged). `x < NULL` is NULL (false), hence the IS NULL arms.
UPSERT = """
INSERT INTO metric_rollup(metric_id, level, bucket, count, nan_count, first_step, last_step, sum,
    min_value, min_step, min_wall, max_value, max_step, max_wall, nan_step, nan_wall, last_value, last_wall)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (metric_id, level, bucket) DO UPDATE SET
    last_value = CASE WHEN excluded.last_step >= last_step THEN excluded.last_value ELSE last_value END,
    last_wall = CASE WHEN excluded.last_step >= last_step THEN excluded.last_wall ELSE last_wall END,
    count = count + excluded.count,
    nan_count = nan_count + excluded.nan_count,
    first_step = min(first_step, excluded.first_step),
    last_step = max(last_step, excluded.last_step),
    sum = CASE WHEN excluded.count = excluded.nan_count THEN sum  -- the batch brought only NaN
               WHEN count = nan_count THEN excluded.sum           -- the row held only NaN
               ELSE sum + excluded.sum END,                       -- NULL (NaN) stays NULL
    min_value = CASE WHEN excluded.min_value < min_value OR min_value IS NULL
                     THEN excluded.min_value ELSE min_value END,
    min_step = CASE WHEN excluded.min_value < min_value OR min_value IS NULL
                    THEN excluded.min_step ELSE min_step END,
    min_wall = CASE WHEN excluded.min_value < min_value OR min_value IS NULL
                    THEN excluded.min_wall ELSE min_wall END,
    max_value = CASE WHEN excluded.max_value > max_value OR max_value IS NULL
                     THEN excluded.max_value ELSE max_value END,
    max_step = CASE WHEN excluded.max_value > max_value OR max_value IS NULL
                    THEN excluded.max_step ELSE max_step END,
    max_wall = CASE WHEN excluded.max_value > max_value OR max_value IS NULL
                    THEN excluded.max_wall ELSE max_wall END,
    nan_step = CASE WHEN excluded.nan_step < nan_step OR nan_step IS NULL
                    THEN excluded.nan_step ELSE nan_step END,
    nan_wall = CASE WHEN excluded.nan_step < nan_step OR nan_step IS NULL
                    THEN excluded.nan_wall ELSE nan_wall END
"""


def _split(sql: str) -> tuple[str, str]:
    """An upsert's ``INSERT INTO t(...)`` and its ``ON CONFLICT`` clause, for multi-row statements."""
    head, rest = sql.split("\nVALUES ", 1)
    return head.strip(), rest.split("\n", 1)[1].strip()


_HEAD, _TAIL = _split(UPSERT)

# One aggregate, as a list for in-place updates:
# [count, nan_count, first_step, last_step, sum, min_value, min_step, min_wall,
#  max_value, max_step, max_wall, nan_step, nan_wall, last_value, last_wall]
_Agg = list


def _merge(into: _Agg, a: _Agg) -> None:
    """Fold aggregate ``a`` into ``into`` with the same rules as ``UPSERT``."""
    if a[0] > a[1]:  # `a` has non-NaN values, so a sum (maybe NaN from +Inf + -Inf)
        into[4] = a[4] if into[0] == into[1] else into[4] + a[4]
    into[0] += a[0]
    into[1] += a[1]
    if a[2] < into[2]:
        into[2] = a[2]
    if a[3] >= into[3]:
        into[3] = a[3]
        into[13:15] = a[13:15]
    if a[5] is not None and (into[5] is None or a[5] < into[5]):
        into[5:8] = a[5:8]
    if a[8] is not None and (into[8] is None or a[8] > into[8]):
        into[8:11] = a[8:11]
    if a[11] is not None and (into[11] is None or a[11] < into[11]):
        into[11:13] = a[11:13]


def _aggregated(
    rows: Iterable[tuple[int | str, int, float | None, float]], levels: tuple[int, ...] = LEVELS
) -> Iterator[tuple[object, ...]]:
    """Rollup rows (``UPSERT`` parameters) of every level for raw rows ``(metric_id, step, value, wall)``,
    one level at a time, each row made as it is consumed: a commit of many metrics keeps two levels'
    aggregates alive, not every level and every output row (fewer live objects for the garbage
    collector to walk, whichever thread it runs on).

    ``levels``: the bucket widths, powers of 2, finest first (``LEVELS``; timings use ``TIMING_LEVELS``).

    ``value`` NaN or None (a NaN read back from SQLite) counts as NaN. Cost: about 1 µs per raw row
    (one dict update at the finest level; coarser levels are merged from the finest aggregates).
    """
    finest: dict[tuple[int | str, int], _Agg] = {}
    get = finest.get
    shifts = _SHIFTS if levels is LEVELS else tuple(level.bit_length() - 1 for level in levels)
    shift = shifts[0]
    for mid, step, v, wall in rows:
        key = (mid, step >> shift)
        a = get(key)
        if v is None or v != v:  # NaN
            if a is None:
                finest[key] = _point(step, None, wall)
                continue
            if step >= a[3]:
                a[13] = None
                a[14] = wall
            a[0] += 1
            a[1] += 1
            if a[11] is None or step < a[11]:
                a[11] = step
                a[12] = wall
        else:
            if a is None:
                finest[key] = _point(step, v, wall)
                continue
            if step >= a[3]:
                a[13] = v
                a[14] = wall
            a[0] += 1
            a[4] = v if a[4] is None else a[4] + v
            if a[5] is None or v < a[5]:
                a[5] = v
                a[6] = step
                a[7] = wall
            if a[8] is None or v > a[8]:
                a[8] = v
                a[9] = step
                a[10] = wall
        if step < a[2]:
            a[2] = step
        elif step > a[3]:
            a[3] = step
    level_aggs = finest
    prev_shift = shift
    # Each aggregate's parameters, made once and reused by every coarser level it reaches unmerged: a
    # commit of a few dozen steps is one bucket from level 64 on, so most levels reuse them. Keyed by
    # id(): every aggregate is made in the pass above and `finest` keeps them all alive until the end.
    params: dict[int, tuple[object, ...]] = {}
    for level, sh in zip(levels, shifts):
        if sh != prev_shift:
            coarser: dict[tuple[int | str, int], _Agg] = {}
            down = sh - prev_shift
            for (mid, b), a in level_aggs.items():
                k = (mid, b >> down)
                c = coarser.get(k)
                if c is None:
                    coarser[k] = a  # merged into in place below: the finer level is already written
                else:
                    _merge(c, a)
                    params.pop(id(c), None)
            level_aggs = coarser
            prev_shift = sh
        for (mid, b), a in level_aggs.items():
            p = params.get(id(a))
            if p is None:
                # a bound NaN is stored as NULL, as a bound None is; sqlite3 binds a float directly but
                # sends None through its adapter lookup (~3,300 instructions a value: 2 a row, 14% of
                # the writer thread on the deep MLP)
                p = params[id(a)] = tuple([_NAN if x is None else x for x in a])
            yield (mid, level, b, *p)


def write(conn: sqlite3.Connection, rows: Iterable[tuple[int, int, float | None, float]]) -> None:
    """Fold raw rows into ``metric_rollup`` inside the caller's transaction (multi-row upserts,
    ``_batch.insert``).

    Cost: one upsert (~3.5 µs) per (metric, level, bucket) the rows touch, so at least one per metric
    and level per commit: a commit holding one step of 1000 metrics spends ~35 ms here (the raw
    rows take ~2 ms); a commit holding many steps of few metrics adds ~0.8 µs per raw row.
    """
    _batch.insert(conn, _HEAD, _aggregated(rows), _TAIL)


def write_points(conn: sqlite3.Connection, rows: Iterable[tuple[int, int, float | None, float]]) -> None:
    """Fold raw rows into ``metric_rollup`` one upsert per row and level, with no aggregation first:
    for rows that are one point per metric (a detail step's per-parameter numbers), the same upserts
    :func:`write` makes, built as one list per call. The ``UPSERT``
    merges each into the stored bucket, so two points of a metric in one call are still right."""
    _batch.insert(conn, _HEAD, _point_rows(rows), _TAIL)


def _point_rows(rows: Iterable[tuple[int, int, float | None, float]]) -> Iterator[tuple[object, ...]]:
    for mid, step, v, wall in rows:
        agg = [_NAN if x is None else x for x in _point(step, None if v is None or v != v else v, wall)]
        for level, shift in zip(LEVELS, _SHIFTS):
            yield (mid, level, step >> shift, *agg)


def _point(step: int, v: float | None, wall: float) -> _Agg:
    """The aggregate of one raw point (``v`` None: a NaN): the fields in the order of ``UPSERT``."""
    if v is None:
        return [1, 1, step, step, None, None, None, None, None, None, None, step, wall, None, wall]
    return [1, 0, step, step, v, v, step, wall, v, step, wall, None, None, v, wall]


def backfill(conn: sqlite3.Connection, chunk: int = 200_000) -> None:
    """Build the rollups of every raw row already in ``scalars`` (migration from schema v1).

    Runs inside the caller's transaction. Cost: about 1.5 s per million raw rows (7 s for 5M), once.
    """
    cur = conn.execute("SELECT metric_id, step, value, wall_time FROM scalars ORDER BY rowid")
    while True:
        rows = cur.fetchmany(chunk)
        if not rows:
            return
        write(conn, rows)


def choose_width(
    lo: int, hi: int, buckets: int, min_level: int | None = None, levels: tuple[int, ...] = LEVELS
) -> tuple[int, int] | None:
    """How to read steps ``lo..hi`` as at most ``buckets`` chart buckets: ``(level, k)`` or None.

    Chart buckets are ``step // (k * level)``. ``k == 1``: the finest level with at most ``buckets``
    buckets over the range, read row for row. Only when even the coarsest level has too many (over
    ~4M steps at 1000 buckets) are ``k`` consecutive rows of it merged. None: the chart asks for
    buckets narrower than the finest level (``16 * buckets > steps``), so raw rows serve it better.
    ``min_level``: no level below it (a compacted span keeps no finer rollups); never None then.
    ``levels``: the table's levels (``LEVELS``, or ``TIMING_LEVELS`` for timings).
    """
    if min_level is None and levels[0] * buckets > hi - lo + 1:
        return None
    for level in levels:
        if min_level is not None and level < min_level:
            continue
        if hi // level - lo // level + 1 <= buckets:
            return level, 1
    level = LEVELS[-1]
    k = max(1, (hi // level - lo // level + 1) // buckets)
    while hi // (k * level) - lo // (k * level) + 1 > buckets:
        k += 1
    return level, k


# -- timing rollups (schema v4) ---------------------------------------------------------------------
# The same per-bucket summary for timing samples, keyed by phase instead of metric id. The key
# "step" holds each sample's step time: its logged "step" phase, else the sum of its STEP_PHASES
# (as the reports and the step-time chart define it), so a report of any length reads one row per
# 4096 steps instead of every sample.

#: Timing rollup levels: from 64 steps (a chart that needs finer buckets reads at most ~100k
#: samples, pivoted in Python); the 16 and 32 levels would double the writer's upserts.
TIMING_LEVELS = LEVELS[2:]
#: The phases whose sum is a sample's step time when it has no "step" phase.
STEP_PHASES = ("data", "forward", "backward", "optimizer", "other")

TIMING_CREATE = (
    CREATE.replace("metric_rollup", "timing_rollup")
    .replace("metric_id INTEGER NOT NULL REFERENCES metrics(id)", "phase TEXT NOT NULL")
    .replace("PRIMARY KEY (metric_id,", "PRIMARY KEY (phase,")
    .replace(
        "    PRIMARY KEY (phase,",
        "    last_value REAL, last_wall REAL,                   -- the bucket's last point\n    PRIMARY KEY (phase,",
    )
)
#: The finite part of a compacted 4096-step bucket whose min or max is +-Inf (rollups keep no Inf
#: count, and their sum, min and max then say nothing of the finite values), written by compaction
#: from the raw rows before they go: ``kind`` "metric" (``key``: metric id) or "timing" (phase).
FINITE_CREATE = """
CREATE TABLE finite_rollup (
    kind TEXT NOT NULL,
    key NOT NULL,
    bucket INTEGER NOT NULL,    -- step // 4096
    count INTEGER NOT NULL,     -- finite values
    bad INTEGER NOT NULL,       -- NaN and +-Inf values
    sum REAL, min_value REAL, max_value REAL,  -- of the finite values; NULL when none
    PRIMARY KEY (kind, key, bucket)
) WITHOUT ROWID
"""

TIMING_UPSERT = UPSERT.replace("metric_rollup", "timing_rollup").replace("metric_id", "phase")
_TIMING_HEAD, _TIMING_TAIL = _split(TIMING_UPSERT)


def timing_rows(
    samples: Iterable[tuple[int, float, list[tuple[str, float]]]],
) -> list[tuple[str, int, float, float]]:
    """``(phase, step, seconds, wall)`` rows to roll up for timing samples ``(step, wall, items)``:
    every phase but "step", and the sample's step time under "step" (see above)."""
    out: list[tuple[str, int, float, float]] = []
    for step, wall, items in samples:
        total = None
        parts = []
        for k, v in items:
            if k == "step":
                total = v
            else:
                out.append((k, step, v, wall))
                if k in STEP_PHASES:
                    parts.append(v)
        if total is None and parts:
            total = math.fsum(parts)
        if total is not None:
            out.append(("step", step, total, wall))
    return out


def write_timings(
    conn: sqlite3.Connection, samples: Iterable[tuple[int, float, list[tuple[str, float]]]]
) -> None:
    """Fold timing samples into ``timing_rollup`` inside the caller's transaction.

    Cost, on the writer thread: about 5 µs per 6-phase sample (building the rows ~2 µs, aggregating
    ~3 µs, 0.2 upserts). Writing benchmarks/store_scale.py's default-level mix costs ~85 µs of CPU
    per step in all, ~12 µs of it for timing rollups (medians of 4 runs of 20k steps, loaded VM).
    """
    _batch.insert(conn, _TIMING_HEAD, _aggregated(timing_rows(samples), TIMING_LEVELS), _TIMING_TAIL)


def backfill_timings(conn: sqlite3.Connection, chunk: int = 200_000) -> None:
    """Build ``timing_rollup`` from the timing rows already stored (migration to schema v4)."""
    cur = conn.execute("SELECT step, wall_time, phase, seconds FROM timings ORDER BY step, wall_time, id")
    pending: list[tuple[int, float, list[tuple[str, float]]]] = []
    last: tuple[int, float] | None = None
    while True:
        rows = cur.fetchmany(chunk)
        for step, wall, phase, seconds in rows:
            if (step, wall) != last:
                pending.append((step, wall, []))
                last = (step, wall)
            pending[-1][2].append((phase, float("nan") if seconds is None else seconds))
        if not rows or len(pending) > chunk // 8:
            done = pending if not rows else pending[:-1]  # the last sample may go on in the next chunk
            write_timings(conn, done)
            pending = pending[len(done) :]
        if not rows:
            return

"""Whole-run aggregates and screen-sized sample series, answered in SQL for runs of any length.

A report of a 1,000,000-step run must not read a million rows into Python. Here:

- ``metric_stats``: per metric the number of points, the last point, the finite min / max / sum
  and the count of NaN/Inf points, from the coarsest rollup level (one row per 4096 steps); a
  bucket holding +-Inf (rollups count no Inf) from its raw rows, or once compacted from
  ``finite_rollup``.
- ``timing_stats``: per timing phase the count, sum, min, max of the finite seconds and the count of
  NaN/Inf ones, and the same for the step time (the ``"step"`` phase, else the sum of a sample's
  phases), from ``timing_rollup`` in the same way.
- ``memory_stats``: the same per memory key (memory samples are never compacted).
- ``timing_series``: timing charts of a long range from ``timing_rollup``.
- ``sample_series``: timing or memory samples bucketed to about ``max_points`` per key in one
  Python pass over an ordered read, each bucket's lowest and highest finite point plus every
  NaN/Inf point.

Everything takes an open ``Run`` and reads it through ``Run._rows``.
"""

from __future__ import annotations

import math
from typing import Any

from .._errors import RunStoreError
from . import _compact, _rollup, _vectors

# A finite number: NaN is stored as NULL (abs(NULL) < x is NULL, so not finite), +-Inf fail the test.
_FIN = "abs({0}) < 9e999"
STEP_PHASES = _rollup.STEP_PHASES


_NUMBER = "typeof({0}) NOT IN ('real', 'integer', 'null')"  # SQL: a value no aggregate can hold


def _altered(run: Any, what: str, v: Any, where: str) -> RunStoreError:
    return RunStoreError(
        f"{run.db_path}: {what} holds {type(v).__name__} {v!r:.40} where a number belongs ({where}); "
        "the run's database was altered"
    )


def _numbers(run: Any, what: str, where: str, values: tuple[Any, ...]) -> None:
    """RunStoreError naming the file when a value read for an aggregate is not a number (a text or a
    blob written into the database by something else): what a report cannot sum or compare."""
    for v in values:
        if v is not None and type(v) is not int and type(v) is not float:
            raise _altered(run, what, v, where)


def empty_stats() -> dict[str, Any]:
    """``{"count", "bad", "sum", "min", "max"}`` of nothing."""
    return {"count": 0, "bad": 0, "sum": 0.0, "min": None, "max": None}


def _fold(into: dict[str, Any], count: Any, bad: Any, total: Any, lo: Any, hi: Any) -> None:
    """Add one partial aggregate (finite count, NaN/Inf count, finite sum, min, max) to ``into``."""
    into["count"] += int(count or 0)
    into["bad"] += int(bad or 0)
    if count:
        into["sum"] += total
    if lo is not None and (into["min"] is None or lo < into["min"]):
        into["min"] = lo
    if hi is not None and (into["max"] is None or hi > into["max"]):
        into["max"] = hi


def _raw_parts(column: str) -> str:
    """The five aggregate columns of ``_fold`` over a raw value column."""
    fin = _FIN.format(column)
    return (
        f"count(CASE WHEN {fin} THEN 1 END), count(CASE WHEN {fin} THEN NULL ELSE 1 END), "
        f"sum(CASE WHEN {fin} THEN {column} END), min(CASE WHEN {fin} THEN {column} END), "
        f"max(CASE WHEN {fin} THEN {column} END)"
    )


def _keys(run: Any, table: str) -> str:
    """An ``IN (...)`` list of a rollup table's keys, so a query by level seeks its primary key
    ``(key, level, bucket)`` per key instead of scanning every level's rows (26 ms -> 9 ms at 1M
    steps). Metric ids come from ``metrics``; phases by a skip-scan, one index seek each."""
    if table == "metric_rollup":
        return "metric_id IN (SELECT id FROM metrics)"
    phases: list[str] = []
    while True:
        got = run._rows(
            "SELECT phase FROM timing_rollup WHERE phase > ? ORDER BY phase LIMIT 1",
            (phases[-1] if phases else "",),
        )
        if not got:
            break
        phases.append(got[0][0])
    return "phase IN (" + ", ".join("'" + p.replace("'", "''") + "'" for p in phases) + ")"


def _rollup_stats(
    run: Any, kind: str, table: str, key_col: str, raw: str, keys: dict[Any, str]
) -> dict[str, dict[str, Any]]:
    """``{"points", **empty_stats()}`` per key of a rollup table, from its coarsest level. A bucket
    holding +-Inf (rollups count no Inf, and their sum is then Inf) is read from the raw rows, or,
    once compacted, from ``finite_rollup`` (``kind``: "metric" | "timing"). ``raw``: SQL selecting
    ``_raw_parts`` of one key's rows in ``[?, ?)``, with parameters (key, lo, hi)."""
    top = _rollup.LEVELS[-1]
    compacted = run._compaction()[0]
    out: dict[str, dict[str, Any]] = {}
    dirty: list[tuple[Any, int]] = []
    for key, bucket, count, nan, total, lo, hi in run._rows(
        f"SELECT {key_col}, bucket, count, nan_count, sum, min_value, max_value FROM {table} "
        f"WHERE {_keys(run, table)} AND level = ?",
        (top,),
    ):
        where = f"its bucket of steps {bucket * top}-{bucket * top + top - 1}"
        _numbers(run, f"{table} of {keys.get(key, key)!r}", where, (count, nan, total, lo, hi))
        s = out.setdefault(keys.get(key, key), {"points": 0, **empty_stats()})
        s["points"] += int(count)
        if (lo is not None and math.isinf(lo)) or (hi is not None and math.isinf(hi)):
            dirty.append((key, bucket))
            continue
        _fold(s, count - nan, nan, total, lo, hi)
    for key, bucket in dirty:
        lo_step = bucket * top
        got = []
        if lo_step < compacted and run.schema_version >= 4:
            got = run._rows(
                "SELECT count, bad, sum, min_value, max_value FROM finite_rollup "
                "WHERE kind = ? AND key = ? AND bucket = ?",
                (kind, key, bucket),
            )
        if not got:  # not compacted: every raw row is there (else only the rows kept: a lower bound)
            got = run._rows(raw, (key, lo_step, lo_step + top))
        _fold(out[keys.get(key, key)], *got[0])
    return out


def metric_stats(run: Any) -> dict[str, dict[str, Any]]:
    """Per metric: ``points`` (rows logged), ``last_step``, ``last``, ``count`` / ``sum`` / ``min`` /
    ``max`` of the finite values and ``bad`` (NaN/Inf points), over the whole run.

    Exact for every run, compacted or not (a compacted bucket holding +-Inf is read from
    ``finite_rollup``; a v3 file compacted before that table existed: from the raw rows left).

    Cost: one rollup row per 4096 steps per metric, plus the raw rows of any bucket holding +-Inf.
    """
    names = {int(mid): name for mid, name in run._rows("SELECT id, name FROM metrics")}
    # the aggregates would read a text as 0: an altered database fails as a full read of it would
    # (one pass over the raw rows left, ~0.3 µs each)
    for name, step, v in run._rows(
        "SELECT m.name, s.step, s.value FROM scalars s JOIN metrics m ON m.id = s.metric_id "
        "WHERE typeof(s.value) NOT IN ('real', 'integer', 'null') LIMIT 1"
    ):
        raise RunStoreError(
            f"{run.db_path}: metric {name!r} holds {type(v).__name__} {v!r:.40} where a number belongs "
            f"(step {step}); the run's database was altered"
        )
    out = {name: {"points": 0, **empty_stats()} for name in names.values()}
    if not run.has_rollups:  # written before rollups: the raw rows are all there
        for mid, n, *parts in run._rows(
            f"SELECT metric_id, count(*), {_raw_parts('value')} FROM scalars GROUP BY metric_id"
        ):
            out[names[mid]]["points"] = int(n)
            _fold(out[names[mid]], *parts)
    else:
        raw = f"SELECT {_raw_parts('value')} FROM scalars WHERE metric_id = ? AND step >= ? AND step < ?"
        out.update(_rollup_stats(run, "metric", "metric_rollup", "metric_id", raw, names))
    # per-parameter vectors (schema v5) have no rollups: their rows folded with numpy, one per vector
    for name, v in _vectors.stats(run, names).items():
        out[name]["points"] += v["points"]
        _fold(out[name], v["count"], v["bad"], v["sum"], v["min"], v["max"])
    last = dict(run.last_values())
    if run.has_rollups:
        # a metric whose last rows were compacted (it stopped before the run did): the rollup's last
        for mid, last_step, value in run._rows(
            "SELECT metric_id, max(last_step), last_value FROM metric_rollup "
            f"WHERE {_keys(run, 'metric_rollup')} AND level = ? GROUP BY metric_id",
            (_rollup.LEVELS[-1],),
        ):
            name = names[mid]
            if name not in last or last[name][0] < last_step:
                last[name] = (last_step, float("nan") if value is None else value)
    for name, s in out.items():
        s["last_step"], s["last"] = last.get(name, (None, None))
    return out


def compacted_to(run: Any) -> int:
    """Steps below this are compacted (0: none are, or the file predates compaction)."""
    return int(run._compaction()[0]) if run.has_rollups else 0


def has_timing_rollups(run: Any) -> bool:
    """True when the file keeps timing rollups (schema v4 and later)."""
    return bool(run.schema_version >= 4)


def timing_stats(run: Any) -> dict[str, dict[str, Any]]:
    """Per timing phase as logged and ``"step_time"``: ``count`` / ``sum`` / ``min`` / ``max`` of the
    finite seconds and ``bad`` (NaN/Inf samples).

    ``"step_time"`` is a sample's ``"step"`` phase, or the sum of its ``STEP_PHASES`` when it has
    none. Exact for any run with timing rollups (schema v4), compacted or not. An older file gives
    the statistics of the samples it holds (a v3 file that was compacted holds each 64-step
    bucket's last and slowest sample).

    Cost: one rollup row per phase and 4096 steps; an older file: one pass over its timing rows.
    """
    if has_timing_rollups(run):
        raw = f"SELECT {_raw_parts('seconds')} FROM timings WHERE phase = ? AND step >= ? AND step < ?"
        out = _rollup_stats(run, "timing", "timing_rollup", "phase", raw, {})
        for v in out.values():
            v.pop("points", None)
        out["step_time"] = out.pop("step", empty_stats())  # the rollups' "step" is the step time
        return out
    out = {}
    for phase, *parts in run._rows(f"SELECT phase, {_raw_parts('seconds')} FROM timings GROUP BY phase"):
        _fold(out.setdefault(phase, empty_stats()), *parts)
    step_time = dict(out.get("step", empty_stats()))
    # samples (one log_timing call: one step and wall time) without a "step" phase: their phases' sum
    marks = ", ".join("?" for _ in STEP_PHASES)
    row = run._rows(
        f"""SELECT {_raw_parts("t")} FROM (
                SELECT sum(CASE WHEN phase IN ({marks}) THEN seconds END) AS t,
                       count(CASE WHEN phase IN ({marks}) THEN 1 END) AS n
                FROM timings GROUP BY step, wall_time
                HAVING count(CASE WHEN phase = 'step' THEN 1 END) = 0 AND n > 0)""",
        (*STEP_PHASES, *STEP_PHASES),
    )
    if row:
        _fold(step_time, *row[0])
    out = {("total" if k == "step" else k): v for k, v in out.items()}
    out["step_time"] = step_time
    return out


def _merge_rows(rows: list[tuple[Any, ...]], k: int) -> list[tuple[Any, ...]]:
    """Rollup rows ``(phase, bucket, nan_count, nan_step, min_step, min, max_step, max)`` of one level,
    ordered by phase and bucket, merged ``k`` at a time (``bucket // k``)."""
    out: list[list[Any]] = []
    for phase, bucket, nc, ns, lo_s, lo_v, hi_s, hi_v in rows:
        b = bucket // k
        if not out or out[-1][0] != phase or out[-1][1] != b:
            out.append([phase, b, nc, ns, lo_s, lo_v, hi_s, hi_v])
            continue
        m = out[-1]
        if nc and not m[2]:
            m[3] = ns
        m[2] += nc
        if lo_v is not None and (m[5] is None or lo_v < m[5]):
            m[4], m[5] = lo_s, lo_v
        if hi_v is not None and (m[7] is None or hi_v > m[7]):
            m[6], m[7] = hi_s, hi_v
    return [tuple(m) for m in out]


def timing_series(run: Any, max_points: int, since_step: int = 0) -> dict[str, dict[str, list[Any]]] | None:
    """``{phase: {"steps", "values"}}`` of the timing rollups from ``since_step`` on, each chart
    bucket's lowest and highest point and its earliest NaN (``"step"`` returned as ``"total"``, the
    step time); None when the file has no timing rollups or the range is too short for them (read
    the samples then). Cost: one rollup row per phase and chart bucket.
    """
    if not has_timing_rollups(run):
        return None
    top = _rollup.LEVELS[-1]
    keys = _keys(run, "timing_rollup")
    lo, hi = run._rows(
        f"SELECT min(first_step), max(last_step) FROM timing_rollup WHERE {keys} AND level = ? AND bucket >= ?",
        (top, since_step // top),
    )[0]
    if lo is None:
        return {}
    lo = max(lo, since_step)
    compacted = run._compaction()[0]
    width = _rollup.choose_width(
        lo,
        hi,
        max_points // 2,
        min_level=_compact.KEEP_LEVEL if lo < compacted else None,
        levels=_rollup.TIMING_LEVELS,
    )
    if width is None:
        return None
    level, k = width
    rows = run._rows(
        "SELECT phase, bucket, nan_count, nan_step, min_step, min_value, max_step, max_value "
        f"FROM timing_rollup WHERE {keys} AND level = ? AND bucket >= ? AND bucket <= ? ORDER BY phase, bucket",
        (level, lo // level, hi // level),
    )
    if k > 1:  # over ~4M steps: merge k rows of the coarsest level per chart bucket
        rows = _merge_rows(rows, k)
    nan = float("nan")
    out: dict[str, dict[str, list[Any]]] = {}
    for phase, _, nan_count, nan_step, lo_step, lo_v, hi_step, hi_v in rows:
        d = out.get(phase)
        if d is None:
            d = out["total" if phase == "step" else phase] = out[phase] = {"steps": [], "values": []}
        pts = [(nan_step, nan)] if nan_count else []
        if lo_v is not None:
            pts += [(lo_step, lo_v)] if lo_step == hi_step else [(lo_step, lo_v), (hi_step, hi_v)]
        if len(pts) > 1:
            pts.sort(key=lambda p: p[0])
        for step, v in pts:
            if step >= since_step:
                d["steps"].append(step)
                d["values"].append(v)
    out.pop("step", None)
    return out


def memory_stats(run: Any) -> dict[str, dict[str, Any]]:
    """Per memory key: ``count`` / ``sum`` / ``min`` / ``max`` of the finite values and ``bad``
    (NaN/Inf), over every sample (memory samples are never compacted). Cost: one pass in SQL."""
    out: dict[str, dict[str, Any]] = {}
    for key, odd, *parts in run._rows(
        f"SELECT key, count(CASE WHEN {_NUMBER.format('value')} THEN 1 END), {_raw_parts('value')} "
        "FROM memory GROUP BY key"
    ):
        if odd:  # counted in the same pass; the rare path names the first
            step, v = run._rows(
                f"SELECT step, value FROM memory WHERE key = ? AND {_NUMBER.format('value')} "
                "ORDER BY step LIMIT 1",
                (key,),
            )[0]
            raise _altered(run, f"memory {key!r}", v, f"step {step}")
        _fold(out.setdefault(key, empty_stats()), *parts)
    return out


def memory_samples(run: Any) -> int:
    """Memory samples (one ``log_memory`` call each: one step and wall time). Cost: one SQL pass."""
    return int(run._rows("SELECT count(*) FROM (SELECT 1 FROM memory GROUP BY step, wall_time)")[0][0])


_SAMPLE_TABLES = {"timings": ("phase", "seconds"), "memory": ("key", "value")}
#: Up to this many rows (all keys together) a caller may pivot the samples in Python (exact, as
#: before); above it ``sample_series`` keeps only each bucket's extremes (or the timing rollups answer).
PIVOT_ROWS = 20_000


def sample_count(run: Any, table: str, since_step: int = 0) -> int:
    """Rows of ``table`` ("timings" | "memory") from ``since_step`` on. Cost: an index count."""
    if table not in _SAMPLE_TABLES:
        raise ValueError(f"table must be one of {sorted(_SAMPLE_TABLES)}, got {table!r}")
    return int(run._rows(f"SELECT count(*) FROM {table} WHERE step >= ?", (since_step,))[0][0])


def sample_series(
    run: Any, table: str, max_points: int, since_step: int = 0
) -> dict[str, dict[str, list[Any]]]:
    """``{key: {"steps", "values"}}`` of ``table`` ("timings" | "memory") from ``since_step`` on, cut
    into ``max_points // 2`` equal step ranges over the table's steps; each range keeps each key's
    lowest and highest finite point, and every NaN/Inf point stays (as ``views.report`` envelopes
    do). Timing phase ``"step"`` is returned as ``"total"``. NaN reads as ``float("nan")``.

    Raises:
        RunStoreError: a value that is not a number (the database was altered).

    Cost: one ordered read of the rows and one Python pass (about 2 µs per row: 80 ms for the
    40,000 memory rows of a 1M-step run; grouping in SQL sorts and took 3x longer).
    """
    if table not in _SAMPLE_TABLES:
        raise ValueError(f"table must be one of {sorted(_SAMPLE_TABLES)}, got {table!r}")
    if max_points < 2:
        raise ValueError(f"max_points must be >= 2 (a min and a max per bucket), got {max_points}")
    key, value = _SAMPLE_TABLES[table]
    rows = run._rows(
        f"SELECT {key}, step, {value} FROM {table} WHERE step >= ? ORDER BY step, id", (since_step,)
    )
    if not rows:
        return {}
    lo, span, nb = rows[0][1], rows[-1][1] - rows[0][1] + 1, max_points // 2
    isfinite = math.isfinite
    # per key: the open bucket, its lowest and highest finite point, the points it closed with
    state: dict[str, list[Any]] = {}
    for k, step, v in rows:
        if v is None:
            v = math.nan
        elif type(v) is not float and type(v) is not int:
            raise RunStoreError(
                f"{run.db_path}: {table} {k!r} at step {step} holds {type(v).__name__} {v!r:.40} where a "
                "number belongs; the run's database was altered"
            )
        b = (step - lo) * nb // span
        st = state.get(k)
        if st is None:
            st = state[k] = [b, None, None, [], []]  # bucket, low, high, its NaN/Inf, points kept
        elif st[0] != b:
            _close(st)
            st[0] = b
        if not isfinite(v):
            st[3].append((step, v))
        else:
            if st[1] is None or v < st[1][1]:
                st[1] = (step, v)
            if st[2] is None or v > st[2][1]:
                st[2] = (step, v)
    out: dict[str, dict[str, list[Any]]] = {}
    rename = {"step": "total"} if table == "timings" else {}
    for k, st in state.items():
        _close(st)
        pts = st[4]
        out[rename.get(k, k)] = {"steps": [p[0] for p in pts], "values": [p[1] for p in pts]}
    return out


def _close(st: list[Any]) -> None:
    """Keep a bucket's lowest and highest point and its NaN/Inf points, in step order."""
    low, high, bad, pts = st[1], st[2], st[3], st[4]
    keep = bad if low is None else [*bad, low] if low[0] == high[0] else [*bad, low, high]
    if len(keep) > 1:
        keep.sort(key=lambda p: p[0])
    pts += keep
    st[1] = st[2] = None
    st[3] = []

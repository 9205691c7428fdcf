"""Compaction: a long run keeps full resolution where it matters and rollups everywhere else.

The writer thread calls ``maybe_compact`` after its commits. Once the run is ``RECENT`` steps past
the last compacted chunk, the next ``CHUNK`` steps (aligned to the coarsest rollup level, so every
bucket is whole) are compacted in one transaction:

- ``scalars``: raw rows are deleted, except within ``NEAR`` steps of an event or an anomaly. The
  rollups keep every bucket's min, max (spikes), sum/count (mean), last and earliest NaN.
- ``metric_rollup`` and ``timing_rollup``: levels below ``KEEP_LEVEL`` are deleted (a chart of a
  compacted span reads buckets of at least ``KEEP_LEVEL`` steps; 1M steps at 2000 points need 1024).
- ``timings``: per 64-step bucket the last step's sample and the slowest step's sample stay, plus
  every sample near an event or anomaly; ``timing_rollup`` (schema v4) keeps every phase's and the
  step time's count, sum, min, max and last per bucket, so step-time figures stay exact.
- ``finite_rollup``: for a chunk's metric or phase whose min or max is +-Inf, the count, sum, min and
  max of its finite values and its count of NaN/Inf (rollups count no Inf), from the raw rows before
  they go: a report's finite mean/min/max and NaN/Inf count stay exact.
- ``vectors`` (per-parameter numbers of detail steps, schema v5): the last row of each
  ``KEEP_LEVEL`` bucket per vector stays, plus every row near an event or anomaly.
- ``anomalies``, ``events``, ``segments``, ``memory`` (one sample per ``memory_every`` steps) and
  ``tensor_stats`` (detail steps) are never compacted.

The meta table records ``compacted_to`` (steps below it are compacted) and ``compacted_steps``
(steps whose raw rows are all gone: ``Run.steps()`` adds them back). Freed pages are reused by later
inserts, so the file stops growing instead of shrinking.

Cost: one chunk every ``CHUNK`` steps, a few indexed range deletes: ~0.1 s per 4096 steps of the
default record mix, on the writer thread.
"""

from __future__ import annotations

import sqlite3

from . import _rollup, _vectors

#: Steps at the end of a run kept whole (the dashboard's live window and the reports' recent view).
RECENT = 20_000
#: Steps compacted at once; a multiple of every rollup level so buckets are never split.
CHUNK = _rollup.LEVELS[-1]
#: Raw rows within this many steps of an event or anomaly stay.
NEAR = 32
#: Finest rollup level kept in compacted spans.
KEEP_LEVEL = 256
#: Timing samples: one bucket of this many steps keeps its last and its slowest sample.
TIMING_BUCKET = 64


def _meta_int(conn: sqlite3.Connection, key: str) -> int:
    row = conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
    try:
        return int(row[0]) if row else 0
    except (TypeError, ValueError):
        return 0


def compacted_to(conn: sqlite3.Connection) -> int:
    """Steps below this are compacted (0: nothing is)."""
    return _meta_int(conn, "compacted_to")


def compacted_steps(conn: sqlite3.Connection) -> int:
    """Steps none of whose raw rows are left (``Run.steps()`` adds them to the raw count)."""
    return _meta_int(conn, "compacted_steps")


def maybe_compact(conn: sqlite3.Connection, last_step: int, recent: int = RECENT) -> int:
    """Compact every whole chunk that is ``recent`` steps behind ``last_step``; returns chunks done.

    Runs its own transactions (call it outside one). A failure rolls the chunk back and is raised.
    """
    done = 0
    start = compacted_to(conn)
    while last_step - recent >= start + CHUNK:
        _compact_chunk(conn, start, start + CHUNK)
        start += CHUNK
        done += 1
    return done


_KEPT = """EXISTS (SELECT 1 FROM events e WHERE e.step BETWEEN {t}.step - :near AND {t}.step + :near)
     OR EXISTS (SELECT 1 FROM anomalies a WHERE a.step BETWEEN {t}.step - :near AND {t}.step + :near)"""


_STEPS = "SELECT count(DISTINCT step) FROM scalars WHERE step >= :lo AND step < :hi"
_STEPS_V5 = (
    "SELECT count(*) FROM (SELECT step FROM scalars WHERE step >= :lo AND step < :hi "
    "UNION SELECT step FROM vectors WHERE step >= :lo AND step < :hi)"
)


def _has_vectors(conn: sqlite3.Connection) -> bool:
    """True from schema v5 on (a writer always migrates first; a test may compact an older file)."""
    return conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'vectors'").fetchone() is not None


def _compact_chunk(conn: sqlite3.Connection, lo: int, hi: int) -> None:
    p = {"lo": lo, "hi": hi, "near": NEAR, "keep": KEEP_LEVEL, "tb": TIMING_BUCKET, "top": CHUNK}
    conn.execute("BEGIN IMMEDIATE")
    try:
        # before the raw rows go: the finite part of each bucket whose extreme is +-Inf
        for kind, table, key, raw, value in (
            ("metric", "metric_rollup", "metric_id", "scalars", "value"),
            ("timing", "timing_rollup", "phase", "timings", "seconds"),
        ):
            fin = f"abs({value}) < 9e999"  # NaN reads as NULL: not finite either
            conn.execute(
                f"""INSERT OR REPLACE INTO finite_rollup
                    SELECT '{kind}', {key}, :lo / :top, count(CASE WHEN {fin} THEN 1 END),
                           count(CASE WHEN {fin} THEN NULL ELSE 1 END), sum(CASE WHEN {fin} THEN {value} END),
                           min(CASE WHEN {fin} THEN {value} END), max(CASE WHEN {fin} THEN {value} END)
                    FROM {raw} WHERE step >= :lo AND step < :hi AND {key} IN (
                        SELECT {key} FROM {table} WHERE level = :top AND bucket = :lo / :top
                        AND (abs(min_value) >= 9e999 OR abs(max_value) >= 9e999))
                    GROUP BY {key}""",
                p,
            )
        vectors = _has_vectors(conn)
        count_steps = _STEPS_V5 if vectors else _STEPS
        before = conn.execute(count_steps, p).fetchone()[0]
        conn.execute(
            f"DELETE FROM scalars WHERE step >= :lo AND step < :hi AND NOT ({_KEPT.format(t='scalars')})", p
        )
        if vectors:  # per-parameter vectors: one row per KEEP_LEVEL steps stays, and those near events
            _vectors.compact(conn, lo, hi, KEEP_LEVEL, _KEPT.format(t="vectors"), NEAR)
        after = conn.execute(count_steps, p).fetchone()[0]
        for table in ("metric_rollup", "timing_rollup"):
            conn.execute(
                f"DELETE FROM {table} WHERE level < :keep AND bucket * level >= :lo "
                "AND (bucket + 1) * level <= :hi",
                p,
            )
        # the slowest step of each timing bucket (SQLite's bare columns: the row of the max)
        conn.execute(
            f"""DELETE FROM timings WHERE step >= :lo AND step < :hi
                AND step % :tb != :tb - 1
                AND step NOT IN (
                    SELECT step FROM (
                        SELECT max(seconds), step FROM timings
                        WHERE phase = 'step' AND step >= :lo AND step < :hi GROUP BY step / :tb))
                AND NOT ({_KEPT.format(t="timings")})""",
            p,
        )
        steps = _meta_int(conn, "compacted_steps") + int(before) - int(after)
        conn.executemany(
            "INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)",
            [("compacted_to", str(hi)), ("compacted_steps", str(steps))],
        )
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise

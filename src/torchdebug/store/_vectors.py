"""Per-parameter vectors (schema v5): one blob per names list and step, packed by the writer, folded by readers.

A detail step logs a few thousand numbers (``grad_norm/<param>``, ``update_ratio/<param>``,
``weight_norm/<param>``). Stored as rows they cost one ``scalars`` row and nine rollup upserts per
value, ~115,000 instructions and ~50 bytes per parameter tensor per step. Here a ``log_vector``
record is one ``vectors`` row: its values packed little-endian, float32 when every value survives
the round trip exactly (float32 parameters' norms do), else float64, so nothing logged is changed.
Each name is still a row of ``metrics``; ``vector_members`` says where its values are. Readers
unpack the rows of one vector at a time (numpy, one call per row) and never build per-value SQL.

Schema v6 compresses a row losslessly when that makes it shorter than its float32 bytes: one
``CODEC_SHUFFLED_ZLIB`` byte, then zlib (level 1) of the values' bytes grouped by significance (the
sign-and-exponent bytes of every value first: norms of one model share them, so they compress to
almost nothing). A row's length says its form: ``4 * n`` raw float32, ``8 * n`` raw float64,
shorter compressed (the inflated length then says float32 or float64). ~40% fewer bytes on a deep
MLP's norms; SQLite puts one uncompressed 514-value row on a page of its own (two do not fit in 4
KiB), three compressed ones share one. Cost: ~20 µs a row, on the writer thread.

Compaction keeps, in a compacted chunk, the last row of each ``KEEP_LEVEL`` bucket per vector and
every row near an event or anomaly: the per-parameter history of old spans at a coarser cadence.
"""

from __future__ import annotations

import json
import sqlite3
import sys
import zlib
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np

_F8 = np.dtype("<f8")
_F4 = np.dtype("<f4")
_SWAP = sys.byteorder != "little"  # the array module packs in the host's byte order
#: Rows of fewer values are checked and shuffled without numpy (its per-call cost outweighs the work).
_SMALL = 64


#: The first byte of a compressed row: zlib of the values' bytes, byte-shuffled (see the module doc).
CODEC_SHUFFLED_ZLIB = 1


def pack(values: Sequence[float]) -> bytes:
    """``values`` as little-endian float32 bytes when that is exact (NaN and +-Inf included), else
    float64; compressed when that is shorter than ``4 * len(values)`` bytes (lossless either way).

    Cost, on the writer thread: ~65,000 instructions for 10 values (~175,000 with numpy and zlib's
    default window), ~600,000 for 514 (mostly zlib).
    """
    n = len(values)
    f = array("f", values) if n < _SMALL else None  # (beyond float32's range: inf, so not exact)
    if f is not None and f.tolist() == list(values):  # exact (a NaN compares unequal: numpy decides)
        if _SWAP:
            f.byteswap()
        data = f.tobytes()
    else:
        a = np.asarray(values, dtype=_F8)
        with np.errstate(over="ignore"):  # beyond float32's range: inf, so not exact
            f4 = a.astype(_F4)
        raw = f4 if np.array_equal(f4.astype(_F8), a, equal_nan=True) else a
        data = raw.tobytes()
    if n < 8:  # the codec byte and zlib's 11 bytes of framing outweigh what it saves
        return data
    size = len(data) // n
    if n < _SMALL:
        shuffled = b"".join([data[k::size] for k in range(size)])  # byte k of every value, k = 0..
        # a window and hash tables sized to the row: zlib's default sets up ~256 KiB (~60,000
        # instructions) to compress a few hundred bytes; any zlib reader inflates either
        z = zlib.compressobj(1, zlib.DEFLATED, 9, 1)
        small = bytes((CODEC_SHUFFLED_ZLIB,)) + z.compress(shuffled) + z.flush()
    else:
        shuffled = raw.view(np.uint8).reshape(n, size).T.tobytes()
        small = bytes((CODEC_SHUFFLED_ZLIB,)) + zlib.compress(shuffled, 1)
    return small if len(small) < 4 * n else data


def unpack(data: bytes, n: int) -> np.ndarray:
    """The ``n`` float64 values of one packed row (its length says raw float32, raw float64 or compressed)."""
    if n == 0:
        return np.zeros(0, dtype=_F8)
    if len(data) < 4 * n:  # compressed: a codec byte, then the shuffled bytes deflated
        if data[0] != CODEC_SHUFFLED_ZLIB:
            raise ValueError(f"unknown vector codec {data[0]}")
        shuffled = np.frombuffer(zlib.decompress(data[1:]), dtype=np.uint8)
        size = len(shuffled) // n
        dtype = _F4 if size == 4 else _F8
        return shuffled.reshape(size, n).T.copy().view(dtype).reshape(n).astype(_F8)
    dtype = _F4 if len(data) == 4 * n else _F8
    return np.frombuffer(data, dtype=dtype, count=n).astype(_F8)


def names_key(names: Sequence[str]) -> str:
    """The ``vector_names.names`` text of a names list."""
    return json.dumps(list(names))


def has_vectors(run: Any) -> bool:
    return bool(run.schema_version >= 5)


def _names(run: Any) -> dict[int, int]:
    """``{names_id: number of names}`` of every vector."""
    return {int(i): len(json.loads(t)) for i, t in run._rows("SELECT id, names FROM vector_names")}


def members(run: Any, metric_id: int) -> list[tuple[int, int, int]]:
    """``[(names_id, position, length)]`` of the vectors holding metric ``metric_id`` (none before v5)."""
    if not has_vectors(run):
        return []
    got = run._rows("SELECT names_id, position FROM vector_members WHERE metric_id = ?", (metric_id,))
    if not got:
        return []
    lengths = _names(run)
    return [(int(v), int(p), lengths[int(v)]) for v, p in got]


def series_rows(
    run: Any, where: list[tuple[int, int, int]], since: int, hi: int | None = None
) -> list[tuple[int, float, float]]:
    """``(step, value, wall_time)`` of one metric from its vectors, steps >= ``since`` (<= ``hi``).
    Cost: one indexed range read per vector and one unpack per row (~1 µs)."""
    out: list[tuple[int, float, float]] = []
    for vid, pos, n in where:
        sql = "SELECT step, data, wall_time FROM vectors WHERE names_id = ? AND step >= ?"
        params: tuple[Any, ...] = (vid, since)
        if hi is not None:
            sql += " AND step <= ?"
            params += (hi,)
        for step, data, wall in run._rows(sql + " ORDER BY step, rowid", params):
            out.append((step, float(unpack(data, n)[pos]), wall))
    if len(where) > 1:
        out.sort(key=lambda r: r[0])
    return out


def downsample(rows: list[tuple[int, float, float]], lo: int, hi: int, nb: int) -> list[tuple[Any, ...]]:
    """``nb`` equal buckets over ``[lo, hi]``, each keeping its lowest point (its earliest NaN when it
    holds one) and its highest non-NaN point, as ``Run.series`` does for raw rows."""
    span = hi - lo + 1
    low: dict[int, tuple[Any, ...]] = {}
    high: dict[int, tuple[Any, ...]] = {}
    for r in rows:
        b = (r[0] - lo) * nb // span
        v = r[1]
        cur = low.get(b)
        if v != v:
            if cur is None or cur[1] == cur[1] or r[0] < cur[0]:
                low[b] = r
        elif cur is None or (cur[1] == cur[1] and v < cur[1]):
            low[b] = r
        if v == v:
            h = high.get(b)
            if h is None or v > h[1]:
                high[b] = r
    kept = {id(r): r for r in (*low.values(), *high.values())}
    return sorted(kept.values(), key=lambda r: (r[0], r[2]))


def last_values(run: Any, ids: dict[int, str]) -> dict[str, tuple[int, float]]:
    """``{metric: (step, value)}`` of every vector member at its vector's last row."""
    if not has_vectors(run):
        return {}
    out: dict[str, tuple[int, float]] = {}
    lengths = _names(run)
    last = {
        int(vid): (step, data)
        for vid, step, data in run._rows(
            "SELECT names_id, max(step), data FROM vectors GROUP BY names_id"  # bare data: the max's row
        )
    }
    for mid, vid, pos in run._rows("SELECT metric_id, names_id, position FROM vector_members"):
        got = last.get(int(vid))
        name = ids.get(int(mid))
        if got is None or name is None:
            continue
        step, data = got
        if name not in out or out[name][0] < step:
            out[name] = (step, float(unpack(data, lengths[int(vid)])[pos]))
    return out


def at_step(run: Any, step: int) -> dict[str, float]:
    """``{metric: value}`` of every vector row at ``step``."""
    if not has_vectors(run):
        return {}
    out: dict[str, float] = {}
    for names, data in run._rows(
        "SELECT n.names, v.data FROM vectors v JOIN vector_names n ON n.id = v.names_id "
        "WHERE v.step = ? ORDER BY v.rowid",
        (step,),
    ):
        keys = json.loads(names)
        out.update(zip(keys, unpack(data, len(keys)).tolist()))
    return out


def stats(run: Any, ids: dict[int, str]) -> dict[str, dict[str, Any]]:
    """``metric_stats`` fields of every vector member (``points``, ``count``, ``bad``, ``sum``, ``min``,
    ``max``) over the rows kept. Cost: one pass over the vectors, one numpy fold per vector."""
    if not has_vectors(run):
        return {}
    out: dict[str, dict[str, Any]] = {}
    lengths = _names(run)
    where: dict[int, list[tuple[int, str]]] = {}
    for mid, vid, pos in run._rows("SELECT metric_id, names_id, position FROM vector_members"):
        if int(mid) in ids:
            where.setdefault(int(vid), []).append((int(pos), ids[int(mid)]))
    for vid, keys in where.items():
        n = lengths[vid]
        rows = [unpack(d, n) for (d,) in run._rows("SELECT data FROM vectors WHERE names_id = ?", (vid,))]
        if not rows:
            continue
        a = np.stack(rows)  # (rows, n)
        fin = np.isfinite(a)
        cnt = fin.sum(axis=0)
        total = np.where(fin, a, 0.0).sum(axis=0)
        lo = np.where(fin, a, np.inf).min(axis=0)
        hi = np.where(fin, a, -np.inf).max(axis=0)
        for pos, name in keys:
            s = out.setdefault(
                name, {"points": 0, "count": 0, "bad": 0, "sum": 0.0, "min": None, "max": None}
            )
            c = int(cnt[pos])
            s["points"] += len(rows)
            s["bad"] += len(rows) - c
            if c:
                s["count"] += c
                s["sum"] += float(total[pos])
                lo_v, hi_v = float(lo[pos]), float(hi[pos])
                s["min"] = lo_v if s["min"] is None else min(s["min"], lo_v)
                s["max"] = hi_v if s["max"] is None else max(s["max"], hi_v)
    return out


def compact(conn: sqlite3.Connection, lo: int, hi: int, keep: int, kept_near: str, near: int) -> None:
    """Delete the vector rows of steps ``[lo, hi)`` but the last of each ``keep``-step bucket per vector
    and those near an event or anomaly (``kept_near``: the SQL test, on table ``vectors``)."""
    conn.execute(
        f"""DELETE FROM vectors WHERE step >= :lo AND step < :hi
            AND rowid NOT IN (
                SELECT r FROM (
                    SELECT max(step), rowid AS r FROM vectors
                    WHERE step >= :lo AND step < :hi GROUP BY names_id, step / :keep))
            AND NOT ({kept_near})""",
        {"lo": lo, "hi": hi, "keep": keep, "near": near},
    )

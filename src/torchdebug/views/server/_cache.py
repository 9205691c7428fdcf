"""Dashboard caches: per-metric downsampled series grown incrementally, and whole views per run version."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..report._format import envelope

# Why: reading one metric of a 100k-step run from SQLite costs ~70-90 ms (each row is a table lookup
# off the (metric_id, step) index), so 50 metrics cost seconds. A series is read once, downsampled,
# and afterwards only the steps after the last one seen are read (an index probe, ~0.1 ms when
# nothing is new). Invariant: an entry holds min/max envelopes of every point up to ``last_step``;
# enveloping it again after appending keeps every bucket's extremes and every NaN/Inf.
# Known limitation: a value logged for a step at or before ``last_step`` after it was read (the same
# metric logged twice in one step) is not picked up until the cache entry is evicted.

_MAX_ENTRIES = 4096


@dataclass
class _Entry:
    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    walls: list[float] = field(default_factory=list)
    last_step: int = -1
    downsampled: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


def run_version(path: Path) -> tuple[Any, ...]:
    """Changes whenever a run's files change: (size, mtime) of meta.json, each rank database + WAL
    and each rank's flight record (the hang verdict)."""
    out: list[Any] = []
    for p in sorted(path.iterdir()):
        if p.name == "meta.json" or ".sqlite" in p.name or p.name.startswith("flight_rank"):
            st = p.stat()
            out.append((p.name, st.st_size, st.st_mtime_ns))
    return tuple(out)


class SeriesCache:
    """Downsampled series per (run database, metric, max_points), updated by reading only new steps."""

    def __init__(self, max_entries: int = _MAX_ENTRIES) -> None:
        self._entries: OrderedDict[tuple[str, str, int], _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._max = max_entries

    def _entry(self, key: tuple[str, str, int]) -> _Entry:
        with self._lock:
            e = self._entries.get(key)
            if e is None:
                e = self._entries[key] = _Entry()
                while len(self._entries) > self._max:
                    self._entries.popitem(last=False)
            else:
                self._entries.move_to_end(key)
            return e

    def series(
        self, run: Any, name: str, max_points: int
    ) -> tuple[list[int], list[float], list[float], bool]:
        """(steps, values, wall_times, downsampled) of ``name`` with at most about ``max_points`` points.

        Raises KeyError for an unknown metric (from the store).
        """
        key = (str(run.db_path), name, max_points)
        e = self._entry(key)
        with e.lock:
            first = e.last_step < 0
            new = run.series(name, since_step=e.last_step + 1, max_points=max_points if first else None)
            if new.steps:
                e.steps += new.steps
                e.values += new.values
                e.walls += new.wall_times
                e.last_step = new.steps[-1]
                e.downsampled = e.downsampled or new.downsampled
                if len(e.steps) > max_points:
                    e.steps, e.values, e.walls = _envelope3(e.steps, e.values, e.walls, max_points)
                    e.downsampled = True
            return list(e.steps), list(e.values), list(e.walls), e.downsampled


def _envelope3(
    steps: list[int], values: list[float], walls: list[float], max_points: int
) -> tuple[list, list, list]:
    """``envelope`` carrying wall times along (steps are unique within a kept set)."""
    wall_of = dict(zip(steps, walls))
    ds, dv = envelope(steps, values, max_points)
    return ds, dv, [wall_of[s] for s in ds]


class CachedRun:
    """A store ``Run`` whose downsampled ``series`` go through a ``SeriesCache``; all else delegates."""

    def __init__(self, run: Any, cache: SeriesCache) -> None:
        self._run = run
        self._cache = cache

    def series(self, name: str, since_step: int | None = None, max_points: int | None = None) -> Any:
        if since_step is not None or max_points is None:
            return self._run.series(name, since_step=since_step, max_points=max_points)
        from ...store import Series

        steps, values, walls, ds = self._cache.series(self._run, name, max_points)
        return Series(name=name, steps=steps, values=values, wall_times=walls, downsampled=ds)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._run, attr)


class ViewsCache:
    """Whole computed payloads (dashboard views, report.json) per (run folder, kind), valid while the
    run's files are unchanged: a finished run is computed once."""

    def __init__(self, max_entries: int = 64) -> None:
        self._entries: OrderedDict[tuple[str, str], tuple[tuple[Any, ...], Any]] = OrderedDict()
        self._lock = threading.Lock()
        self._max = max_entries

    def get(self, path: Path, kind: str, compute: Callable[[], Any]) -> Any:
        key = (str(path), kind)
        version = run_version(path)
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None and hit[0] == version:
                self._entries.move_to_end(key)
                return hit[1]
        value = compute()
        with self._lock:
            self._entries[key] = (version, value)
            while len(self._entries) > self._max:
                self._entries.popitem(last=False)
        return value

"""The run writer: a run folder, its meta.json, and batched SQLite writes from a background thread."""

from __future__ import annotations

import atexit
import contextlib
import datetime as _dt
import json
import math
import numbers
import os
import platform
import re
import shutil
import socket
import sqlite3
import sys
import threading
import time
import uuid
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .._errors import RunStoreError, TorchDebugWarning
from .._version import __version__
from ..events import SEVERITIES, RuleEvent, plain
from . import _batch, _compact, _rollup, _validate, _vectors
from ._schema import SCHEMA_VERSION, acquire_writer_lock, open_for_writing, release_writer_lock

STATUSES = ("running", "finished", "failed")
#: Seconds between two commits at the least when steps, not the clock, wake the writer thread.
_MIN_COMMIT_GAP = 0.25
_CLOSE_STATUSES = ("finished", "failed")
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def _torch_version() -> str | None:
    """torch's version without importing torch (the store and CLI must not pay for that import)."""
    mod = sys.modules.get("torch")
    if mod is not None:
        return str(getattr(mod, "__version__", None))
    try:
        from importlib.metadata import version

        return version("torch")
    except Exception:
        return None


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON so readers see the old or the new file, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:  # a full disk: the old file stays whole and no temp file is left behind
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _record_step(rec: tuple[Any, ...]) -> int | None:
    """The step of a queued record (scalars and segments carry it second, the rest first)."""
    return rec[2] if rec[0] in ("s", "g", "v") else rec[1]


def _expanded(low: deque[tuple[Any, ...]]) -> deque[tuple[Any, ...]]:
    """``low`` with each vector record (``log_vector``) as one scalar record per value."""
    if not any([rec[0] == "v" for rec in low]):
        return low
    out: deque[tuple[Any, ...]] = deque()
    for rec in low:
        if rec[0] == "v":
            _, names, step, values, wall = rec
            out.extend([("s", n, step, v, wall) for n, v in zip(names, values)])
        else:
            out.append(rec)
    return out


def _bad_type(arg: str, want: str, value: Any) -> TypeError:
    hint = ""
    if type(value).__module__.startswith("torch"):
        hint = " (a tensor: convert once per step with .item() or .tolist(), not per value)"
    return TypeError(f"{arg} must be {want}, got {type(value).__name__}{hint}")


def _check_step(step: Any, arg: str = "step") -> int:
    if type(step) is int:
        if step < 0:
            raise ValueError(f"{arg} must be >= 0, got {step}")
        return step
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise _bad_type(arg, "an int (the optimizer step)", step)
    return _check_step(int(step), arg)


def _check_optional_step(step: Any) -> int | None:
    return None if step is None else _check_step(step)


def _check_value(value: Any, arg: str = "value") -> float:
    if isinstance(value, numbers.Real):  # int, float, bool, numpy scalars
        return float(value)
    raise _bad_type(arg, "a real number", value)


def _check_name(name: Any, arg: str = "name") -> str:
    if not isinstance(name, str):
        raise _bad_type(arg, "a str", name)
    if not name:
        raise ValueError(f"{arg} must be a non-empty str")
    return name


def _as_dict(obj: Any, arg: str) -> dict[str, Any]:
    """A shallow snapshot of a mapping or of ``obj.to_dict()`` (events.Anomaly, stats.TensorStats)."""
    if isinstance(obj, Mapping):
        return dict(obj)
    to_dict = getattr(obj, "to_dict", None)
    if callable(to_dict):
        d = to_dict()
        if isinstance(d, Mapping):
            return dict(d)
    raise _bad_type(arg, "a dict (or an object with .to_dict())", obj)


def _numbers_dict(
    values: Any, arg: str, *, ints: bool, reserved: tuple[str, ...]
) -> list[tuple[str, int | float]]:
    """Validate ``{name: number}``; ints stay ints when ``ints`` (bytes are stored as int).

    ``reserved`` keys are refused: the reader returns each sample as one flat dict whose ``step`` and
    ``wall_time`` keys are the sample's own, so a value may not take those names.
    """
    if not isinstance(values, Mapping):
        raise _bad_type(arg, "a dict of {name: number}", values)
    out: list[tuple[str, int | float]] = []
    for k, v in values.items():
        if not isinstance(k, str):
            raise _bad_type(f"{arg} key", "a str", k)
        if k in reserved:
            raise ValueError(
                f"{arg} may not have a key {k!r}: the reader returns {reserved} as the sample's own fields"
            )
        if ints and isinstance(v, numbers.Integral) and not isinstance(v, bool):
            out.append((k, int(v)))
        else:
            out.append((k, _check_value(v, f"{arg}[{k!r}]")))
    return out


def _plain_floats(values: Any, reserved: tuple[str, ...]) -> list[tuple[str, int | float]] | None:
    """``values`` as ``_numbers_dict(values, ..., ints=False)`` gives it when it is a plain dict of str
    -> float with no reserved key (the hot path); None otherwise (validate with ``_numbers_dict``)."""
    if type(values) is not dict:
        return None
    out: list[tuple[str, int | float]] = []
    for k, v in values.items():
        if type(k) is not str or type(v) is not float or k in reserved:
            return None
        out.append((k, v))
    return out


def _json(obj: Any) -> str:
    """Strict JSON of a record's document; never raises (a bad document must not sink its batch)."""
    try:
        # plain() turns NaN/Inf into strings so the document is strict JSON that any reader parses.
        return json.dumps(plain(obj), sort_keys=True, default=str, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:  # e.g. a numpy NaN, a cycle
        return json.dumps({"unserializable": repr(obj)[:2000], "error": str(e)})


class _Core:
    """State shared by a ``RunWriter`` and its background thread; it never references the writer,
    so a writer that is garbage collected can still be finalized."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        db_path: Path,
        meta_path: Path | None,
        meta: dict[str, Any],
        max_queue: int,
        batch_size: int,
        flush_interval: float,
        lock_fd: int | None = None,
        keep_recent: int | None = _compact.RECENT,
        commit_steps: int = 32,
    ) -> None:
        self.conn = conn
        self.commit_steps = commit_steps
        self.last_commit = time.monotonic()  # the writer thread's last wake-up
        self.keep_recent = keep_recent  # steps kept whole at the end; None: never compact
        self.compacted_to = _compact.compacted_to(conn)
        self.max_step = -1
        self.lock_fd = lock_fd  # this rank's writer lock, held until close() (or process death)
        self.db_path = db_path
        self.meta_path = meta_path  # None for ranks > 0: rank 0 owns meta.json
        self.meta = meta
        self.max_queue = max_queue
        self.batch_size = batch_size
        self.flush_interval = flush_interval
        self.lock = threading.Lock()
        self.flushed = threading.Condition(self.lock)
        self.low: deque[tuple[Any, ...]] = deque()  # metrics, tensor stats, memory, timings
        self.high: deque[tuple[Any, ...]] = deque()  # anomalies, events, segments: never dropped
        self.dropped = 0
        # Records of batches that failed to commit (disk full, file-size limit, I/O error): gone,
        # counted, and recorded in the meta table and meta.json as soon as anything can be written.
        self.lost = 0
        self.lost_from: int | None = None  # the lowest step among them
        self.write_error: str | None = None  # the first failure
        self.persisted_lost: tuple[int, int | None] = (0, None)
        self.warn_pending: str | None = None  # warned on the training thread (warnings are per thread)
        self.closed = False
        self.stopping = False
        self.flush_requested = 0
        self.flush_done = 0
        self.error: BaseException | None = None
        self.wake = threading.Event()
        self.pid = os.getpid()
        self.metric_ids: dict[str, int] = dict(conn.execute("SELECT name, id FROM metrics"))
        # id(names list) -> (the list, its length, its vector_names id); the list is kept alive here
        self.vector_ids: dict[int, tuple[Sequence[str], int, int]] = {}
        self.next_segment = conn.execute("SELECT COALESCE(MAX(id), 0) + 1 FROM segments").fetchone()[0]
        self.persisted_dropped = -1
        # Called on this thread with each batch after its write (committed or lost): the records as
        # queued, for consumers such as the tracker sinks. Each must be cheap and must not raise.
        self.listeners: list[Callable[[Sequence[tuple[Any, ...]], Sequence[tuple[Any, ...]]], None]] = []
        self.thread = threading.Thread(
            target=self._run, name=f"torchdebug-store-rank{meta['rank']}", daemon=True
        )
        self.thread.start()

    # -- background thread -------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self.wake.wait(self.flush_interval)
            self.wake.clear()
            self.last_commit = time.monotonic()
            with self.lock:
                target = self.flush_requested
                low, self.low = self.low, deque()
                high, self.high = self.high, deque()
                dropped = self.dropped
                lost = (self.lost, self.lost_from)
                stopping = self.stopping
            try:
                self._write(low, high, dropped, lost)
                self._compact()
            except BaseException as e:  # keep the thread alive: training must not die with the store
                self._lose(low, high, e)
                # The rolled-back batch may have named new metrics: forget ids that were not kept.
                with contextlib.suppress(sqlite3.Error):
                    self.metric_ids = dict(self.conn.execute("SELECT name, id FROM metrics"))
                self.vector_ids.clear()
            if (low or high) and self.listeners:
                low = _expanded(low)  # the listeners read one "s" record per value
                for listener in list(self.listeners):
                    try:
                        listener(low, high)
                    except Exception:  # a consumer's bug must not stop the store: it hears no more
                        with contextlib.suppress(ValueError):
                            self.listeners.remove(listener)
            with self.lock:
                self.flush_done = target
                self.flushed.notify_all()
            if stopping:
                return

    def _compact(self) -> None:
        """Compact whole chunks that fell ``keep_recent`` steps behind (see _compact.py); never raises
        into the batch: a failed compaction rolls back, leaves every row as it was and stops."""
        if self.keep_recent is None or self.max_step - self.keep_recent < self.compacted_to + _compact.CHUNK:
            return
        try:
            _compact.maybe_compact(self.conn, self.max_step, self.keep_recent)
            self.compacted_to = _compact.compacted_to(self.conn)
        except sqlite3.Error:
            self.keep_recent = None  # the rows stay whole; the file just grows as before

    def _lose(self, low: deque[tuple[Any, ...]], high: deque[tuple[Any, ...]], error: BaseException) -> None:
        """Count a failed batch's records as lost (their lowest step too) and arm the one warning."""
        steps = [s for s in map(_record_step, low) if s is not None]
        steps += [s for s in map(_record_step, high) if s is not None]
        with self.lock:
            self.error = error
            n = len(low) + len(high)
            self.lost += n
            if steps and (self.lost_from is None or min(steps) < self.lost_from):
                self.lost_from = min(steps)
            if self.write_error is None:
                self.write_error = str(error) or type(error).__name__
                at = f" from step {self.lost_from}" if self.lost_from is not None else ""
                self.warn_pending = (
                    f"torchdebug: writing {self.db_path} failed ({self.write_error}); {n} records lost{at}. "
                    "Training goes on; later records are retried and every lost one is counted "
                    "(torchdebug show says how many). Free disk space or raise the file-size limit."
                )

    def warn(self) -> None:
        """Emit the pending write-failure warning (once per writer), on the calling thread."""
        with self.lock:
            msg, self.warn_pending = self.warn_pending, None
        if msg is not None:
            warnings.warn(TorchDebugWarning(msg), stacklevel=4)

    def _write(
        self,
        low: deque[tuple[Any, ...]],
        high: deque[tuple[Any, ...]],
        dropped: int,
        lost: tuple[int, int | None] = (0, None),
    ) -> None:
        if not low and not high and dropped == self.persisted_dropped and lost == self.persisted_lost:
            return
        scalars: list[tuple[Any, ...]] = []
        stats: list[tuple[Any, ...]] = []
        memory: list[tuple[Any, ...]] = []
        timings: list[tuple[Any, ...]] = []
        vectors: list[tuple[Any, ...]] = []
        timing_samples: list[tuple[int, float, list[tuple[str, float]]]] = []
        for rec in low:
            tag = rec[0]
            if tag == "s":
                scalars.append(rec)
            elif tag == "v":
                vectors.append(rec)
            elif tag == "t":
                stats.append((rec[1], rec[4], rec[2], _json(rec[3])))
            elif tag == "m":
                memory.extend((rec[1], rec[3], k, v) for k, v in rec[2])
            else:
                timings.extend((rec[1], rec[3], k, v) for k, v in rec[2])
                timing_samples.append((rec[1], rec[3], rec[2]))
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            if scalars or vectors:
                ids = self.metric_ids
                for rec in scalars:
                    if rec[1] not in ids:
                        cur = conn.execute("INSERT INTO metrics(name) VALUES (?)", (rec[1],))
                        ids[rec[1]] = int(cur.lastrowid or 0)
                rows = [(ids[n], s, v, w) for _, n, s, v, w in scalars]
                top = max([r[1] for r in rows] + [rec[2] for rec in vectors])
                if top > self.max_step:
                    self.max_step = top
                if rows:
                    # multi-row statements: one bind and one step per statement, not per row
                    _batch.insert(conn, "INSERT INTO scalars(metric_id, step, value, wall_time)", rows)
                    # Same transaction as the raw rows: a crash keeps both or neither, so rollups never
                    # disagree with the rows they summarize. Cost: ~1 µs per row here, off the training thread.
                    _rollup.write(conn, rows)
                if vectors:
                    # one row per vector, its values packed (see _vectors.py): the cost of a detail
                    # step no longer grows with the parameter tensors but by one numpy pack per vector
                    conn.executemany(
                        "INSERT INTO vectors(names_id, step, wall_time, data) VALUES (?, ?, ?, ?)",
                        [
                            (self._vector_id(names), step, wall, _vectors.pack(values))
                            for _, names, step, values, wall in vectors
                            if names
                        ],
                    )
            if stats:
                conn.executemany(
                    "INSERT INTO tensor_stats(step, wall_time, name, data) VALUES (?, ?, ?, ?)", stats
                )
            if memory:
                _batch.insert(conn, "INSERT INTO memory(step, wall_time, key, value)", memory)
            if timings:
                _batch.insert(conn, "INSERT INTO timings(step, wall_time, phase, seconds)", timings)
                # rolled up in the same transaction, as scalars are (one upsert per phase and bucket)
                _rollup.write_timings(conn, timing_samples)
            for rec in high:
                tag = rec[0]
                if tag == "a":
                    conn.execute(
                        "INSERT INTO anomalies(step, wall_time, phase, module, kind, data) "
                        "VALUES (?, ?, ?, ?, ?, ?)",
                        rec[1:],
                    )
                elif tag == "e":
                    conn.execute(
                        "INSERT INTO events(step, wall_time, kind, severity, message, data) "
                        "VALUES (?, ?, ?, ?, ?, ?)",
                        rec[1:],
                    )
                else:
                    conn.execute(
                        "INSERT INTO segments(id, start_step, wall_time, label) VALUES (?, ?, ?, ?)", rec[1:]
                    )
            if dropped != self.persisted_dropped:
                conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('dropped', ?)", (str(dropped),))
            if lost != self.persisted_lost:  # the disk came back: say what the failed batches lost
                conn.executemany(
                    "INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)",
                    [
                        ("lost", json.dumps(lost[0])),
                        ("lost_from_step", json.dumps(lost[1])),
                        ("write_error", json.dumps(self.write_error)),
                    ],
                )
            conn.execute("COMMIT")  # inside the try: a COMMIT that fails (disk full) must roll back too
        except BaseException:
            if conn.in_transaction:  # SQLite rolls back by itself on some errors (disk full, I/O)
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            raise
        self.persisted_dropped = dropped
        self.persisted_lost = lost

    def _vector_id(self, names: Sequence[str]) -> int:
        """The ``vector_names`` id of a names list, adding it (and its metrics) on first sight.

        Cached by the list object (``log_vector`` asks for the same list every step), so a detail
        step pays one dict probe per vector, not one per name. Inside the batch's transaction.
        """
        got = self.vector_ids.get(id(names))
        if got is not None and got[0] is names and got[1] == len(names):
            return got[2]
        conn = self.conn
        key = _vectors.names_key(names)
        row = conn.execute("SELECT id FROM vector_names WHERE names = ?", (key,)).fetchone()
        if row is not None:
            vid = int(row[0])
        else:
            vid = int(conn.execute("INSERT INTO vector_names(names) VALUES (?)", (key,)).lastrowid or 0)
            ids = self.metric_ids
            for n in names:
                if n not in ids:
                    ids[n] = int(conn.execute("INSERT INTO metrics(name) VALUES (?)", (n,)).lastrowid or 0)
            conn.executemany(
                "INSERT OR IGNORE INTO vector_members(metric_id, names_id, position) VALUES (?, ?, ?)",
                [(ids[n], vid, i) for i, n in enumerate(names)],
            )
        self.vector_ids[id(names)] = (names, len(names), vid)
        return vid

    # -- called from the training thread -----------------------------------------------------------

    def flush(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.flush_requested += 1
            target = self.flush_requested
            self.wake.set()
            while self.flush_done < target and self.thread.is_alive():
                self.flushed.wait(1.0)
            error, self.error = self.error, None
            if error is not None:
                self.warn_pending = None  # the exception below is the report
        self.warn()
        if error is not None:
            raise RunStoreError(f"writing {self.db_path} failed: {error}") from error

    def close(self, status: str) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            self.stopping = True
            self.flush_requested += 1
            self.wake.set()
        _LIVE.discard(self)
        if os.getpid() != self.pid:  # a forked child inherited us; the parent owns the files
            return
        self.thread.join()
        ended = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
        final: dict[str, Any] = {"status": status, "ended": ended, "dropped": self.dropped}
        if self.lost or self.write_error is not None:
            final.update(lost=self.lost, lost_from_step=self.lost_from, write_error=self.write_error)
        conn = self.conn
        end_error: BaseException | None = None
        summary: dict[str, Any] | None = None
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(
                "INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)",
                [(k, json.dumps(v)) for k, v in final.items()],
            )
            conn.execute("COMMIT")
            summary = _summary(conn) if self.meta_path is not None else None
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            # A finished run is left in rollback-journal mode: a read-only reader of a WAL file with no
            # -wal/-shm beside it would have to create them, and readers must never write the folder.
            # While another connection is open this fails fast and the run simply stays in WAL mode.
            conn.execute("PRAGMA busy_timeout = 200")
            with contextlib.suppress(sqlite3.OperationalError):
                conn.execute("PRAGMA journal_mode=DELETE")
        except sqlite3.Error as e:
            end_error = e
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
        finally:
            conn.close()
            release_writer_lock(self.db_path.parent, self.meta["rank"], self.lock_fd)
        where = str(self.db_path)
        if self.meta_path is not None and summary is not None and end_error is None:
            # What `torchdebug runs` shows, without opening the database (see reader.list_runs);
            # it names the database's size and mtime, so a file changed since is opened instead.
            with contextlib.suppress(OSError):
                st = os.stat(self.db_path)
                summary.update(db_size=st.st_size, db_mtime_ns=st.st_mtime_ns)
                write_json_atomic(self.meta_path.with_name(SUMMARY_FILE), summary)
        if self.meta_path is not None:  # even if the database failed: meta.json says how the run ended
            self.meta.update(final)
            try:
                write_json_atomic(self.meta_path, self.meta)
                end_error = None  # rank 0's readers take the status from meta.json
            except OSError as e:
                end_error, where = e, str(self.meta_path)
        self.warn()
        if end_error is not None:
            # Never raised into training. meta.json (or the database) still says "running", so the
            # run reads as "crashed", never as a whole "finished" run.
            warnings.warn(
                TorchDebugWarning(
                    f"torchdebug: cannot record how the run ended in {where} ({end_error}); it will read "
                    "as crashed. Free disk space to keep later runs whole."
                ),
                stacklevel=3,
            )


#: The small file rank 0's writer leaves at close: the run's counts for ``list_runs``.
SUMMARY_FILE = "summary.json"


def _summary(conn: sqlite3.Connection) -> dict[str, Any]:
    """Counts of a closed rank database (steps, last step, anomalies): a few index scans."""
    raw = conn.execute(
        "SELECT count(*) FROM (SELECT step FROM scalars UNION SELECT step FROM vectors)"
    ).fetchone()[0]
    last = conn.execute(
        "SELECT max(s) FROM (SELECT max(step) AS s FROM scalars UNION ALL SELECT max(step) FROM vectors "
        "UNION ALL SELECT max(step) FROM anomalies UNION ALL SELECT max(step) FROM events)"
    ).fetchone()[0]
    return {
        "steps": int(raw) + _compact.compacted_steps(conn),
        "last_step": last,
        "anomalies": int(conn.execute("SELECT count(*) FROM anomalies").fetchone()[0]),
    }


# Writers not yet closed. At interpreter exit each is closed: "failed" when an uncaught exception
# is ending the process (the interpreter sets sys.last_value / sys.last_exc before atexit runs).
_LIVE: set[_Core] = set()


@atexit.register
def _close_live_writers() -> None:
    failed = getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None
    for core in list(_LIVE):
        with contextlib.suppress(Exception):
            core.close("failed" if failed else "finished")


class RunWriter:
    """Writes one rank of a run; every ``log_*`` only queues a tuple (about 1 µs), a daemon thread commits.

    Build it with ``create_run``. Low-priority records (metrics, tensor stats, memory, timings) sit in a
    bounded queue: when it is full the oldest is dropped and counted in ``dropped``. Anomalies, events
    and segments are never dropped. The thread commits every ``commit_steps`` steps (default 32), at
    the latest every ``flush_interval`` seconds (default 2),
    when ``batch_size`` low-priority records wait, on ``flush()`` and on ``close()``; so a killed process
    loses at most the last ~2 s.

    A batch that cannot be written (disk full, file-size limit, I/O error) is lost, never raised into
    training: its records are counted in ``lost`` (lowest step in ``lost_from_step``), one
    ``TorchDebugWarning`` names the file and the error, later batches are retried, and the count is
    stored in the meta table and meta.json as soon as anything can be written, so ``show``, the report
    and the dashboard say the run is incomplete. When not even meta.json can be written, it keeps
    saying "running" and the run reads as "crashed", never "finished".

    Each commit also folds its metric values into per-bucket rollups (``_rollup.py``), in the same
    transaction, so downsampled reads of long runs stay fast.

    One writer per rank database: the writer holds ``rank<k>.lock`` (``flock``) until ``close()``
    or its process dies, and a second writer of the same rank is refused with ``RunStoreError``.

    Known limitations: the lock is advisory and local (``flock``; not enforced on Windows or on
    network filesystems without ``flock``); a forked child must create its own writer. A thread that logs in a tight loop doing nothing else starves
    the writer thread (sqlite3 releases the GIL around every row and must win it back), so its
    records commit only at ``flush()``/``close()``; a training step's own work leaves room.
    """

    def __init__(self, core: _Core, path: Path) -> None:
        self._core = core
        self.path = path
        self.db_path = core.db_path
        self.run_id: str = core.meta["run_id"]
        self.name: str = core.meta["name"]
        self.rank: int = core.meta["rank"]
        self._last_step = -1
        self._wake_step = core.commit_steps  # the step whose first record wakes the writer thread
        self._vector_names: tuple[int, int] | None = None  # the names list log_vector checked last
        # Closes the run if the writer is garbage collected without close(); exit is handled by atexit.
        self._finalizer = weakref.finalize(self, core.close, "finished")
        self._finalizer.atexit = False

    def __repr__(self) -> str:
        state = "closed" if self._core.closed else "open"
        return f"RunWriter({str(self.path)!r}, rank={self.rank}, {state}, dropped={self._core.dropped})"

    @property
    def meta(self) -> dict[str, Any]:
        """A copy of the run's meta data (what meta.json holds)."""
        return dict(self._core.meta)

    @property
    def dropped(self) -> int:
        """Low-priority records dropped because the queue was full."""
        return self._core.dropped

    @property
    def lost(self) -> int:
        """Records lost because their batch could not be written (disk full, file-size limit, I/O)."""
        return self._core.lost

    @property
    def lost_from_step(self) -> int | None:
        """The lowest step among the lost records (None when nothing was lost)."""
        return self._core.lost_from

    @property
    def closed(self) -> bool:
        return self._core.closed

    def add_listener(
        self, listener: Callable[[Sequence[tuple[Any, ...]], Sequence[tuple[Any, ...]]], None]
    ) -> None:
        """Call ``listener(low, high)`` on the writer thread with each batch, after its write.

        The store's consumers (the tracker sinks) see exactly what the run folder gets, in the order
        queued, without a step on the training thread. ``low`` holds metrics, tensor stats, memory and
        timings, ``high`` anomalies, events and segments, as tuples (the queue's own format):

        - ``("s", name, step, value, wall_time)``
        - ``("t", step, name, stats_dict, wall_time)``
        - ``("m", step, [(key, bytes), ...], wall_time)``; ``("T", step, [(phase, seconds), ...], wall_time)``
        - ``("a", step, wall_time, phase, module, kind, json_document)``
        - ``("e", step, wall_time, kind, severity, message, json_data_or_None)``
        - ``("g", segment_id, start_step, wall_time, label)``

        A batch that could not be written is still passed on (the records were meant for the run);
        dropped low-priority records are not. The listener must return at once (hand the batch to
        its own thread) and must not raise; one that raises is removed. Close or flush the writer
        before reading what the listener got.
        """
        self._core.listeners.append(listener)

    def remove_listener(self, listener: Callable[..., None]) -> None:
        """Stop calling ``listener`` (no error when it was not added)."""
        with contextlib.suppress(ValueError):
            self._core.listeners.remove(listener)

    def _put_low(self, rec: tuple[Any, ...]) -> None:
        core = self._core
        if core.warn_pending is not None:
            core.warn()
        with core.lock:
            if core.closed:
                raise RunStoreError(f"the run writer for {self.path} is closed")
            low = core.low
            if len(low) >= core.max_queue:
                low.popleft()  # the oldest sample goes: recent values matter most when debugging
                core.dropped += 1
            low.append(rec)
            n = len(low)
        if n == core.batch_size:
            core.wake.set()

    def _put_low_many(self, recs: list[tuple[Any, ...]]) -> None:
        core = self._core
        if core.warn_pending is not None:
            core.warn()
        with core.lock:  # one lock round trip for a whole step's metrics
            if core.closed:
                raise RunStoreError(f"the run writer for {self.path} is closed")
            low = core.low
            before = len(low)
            low.extend(recs)
            excess = len(low) - core.max_queue
            for _ in range(max(excess, 0)):
                low.popleft()
            if excess > 0:
                core.dropped += excess
            n = len(low)
        if before < core.batch_size <= n:
            core.wake.set()

    def _put_high(self, rec: tuple[Any, ...]) -> None:
        core = self._core
        if core.warn_pending is not None:
            core.warn()
        with core.lock:
            if core.closed:
                raise RunStoreError(f"the run writer for {self.path} is closed")
            core.high.append(rec)

    def log_scalar(self, name: str, step: int, value: float) -> None:
        """Queue one metric value (low priority).

        Args:
            name: metric name, e.g. ``"loss"`` or ``"grad_norm/fc.weight"``.
            step: optimizer step (int >= 0).
            value: a real number; NaN and +-Inf are kept as such.

        Raises:
            TypeError: name not a str, step not an int, value not a real number (e.g. a tensor).
            RunStoreError: the writer is closed.

        Example: ``w.log_scalar("loss", 3, 0.25)``. Cost: about 1 µs, no I/O.
        """
        if type(name) is not str or not name:
            name = _check_name(name)
        if type(step) is not int or step < 0:
            step = _check_step(step)
        if type(value) is not float:
            value = _check_value(value)
        if step > self._last_step:
            self._new_step(step)
        self._put_low(("s", name, step, value, time.time()))

    def log_scalars(self, step: int, values: Mapping[str, float]) -> None:
        """Queue several metrics of one step: ``w.log_scalars(3, {"loss": 0.25, "lr": 1e-3})``.

        Raises TypeError naming the bad key or value. Cost: about 1 µs per value.
        """
        if type(step) is not int or step < 0:
            step = _check_step(step)
        if type(values) is not dict and not isinstance(values, Mapping):
            raise _bad_type("values", "a dict of {name: number}", values)
        wall = time.time()
        recs = []
        for name, value in values.items():
            if type(name) is not str or not name:
                name = _check_name(name, "values key")
            if type(value) is not float:
                value = _check_value(value, f"values[{name!r}]")
            recs.append(("s", name, step, value, wall))
        if step > self._last_step:
            self._new_step(step)
        self._put_low_many(recs)

    def log_vector(self, step: int, names: Sequence[str], values: Sequence[float]) -> None:
        """Queue one value per name at one step, as one record (read back as ordinary metrics):
        ``w.log_vector(3, ["grad_norm/fc.weight", "grad_norm/fc.bias"], [0.5, 0.1])``.

        For the per-parameter numbers of a detail step: one queue entry instead of one per value, so
        the training thread builds no Python object per value (``names`` is kept, not copied: pass the
        same list every step). Raises TypeError for a non-str name, a non-real value or unequal
        lengths. Cost: about 0.05 µs per value (a C-level type check).
        """
        if type(step) is not int or step < 0:
            step = _check_step(step)
        if len(names) != len(values):
            raise TypeError(f"log_vector: {len(names)} names but {len(values)} values")
        key = (id(names), len(names))
        if self._vector_names != key:  # checked once per names list
            for n in names:
                if type(n) is not str or not n:
                    _check_name(n, "names entry")
            self._vector_names = key
        if not set(map(type, values)) <= {float}:  # a C loop; the general check names the culprit
            values = [
                x if type(x) is float else _check_value(x, f"values[{i}]") for i, x in enumerate(values)
            ]
        if step > self._last_step:
            self._new_step(step)
        self._put_low(("v", names, step, values, time.time()))

    def log_anomaly(self, step: int | None, anomaly: Mapping[str, Any] | Any) -> None:
        """Record an anomaly (never dropped): a dict or an ``events.Anomaly``.

        Its ``phase``, ``module`` and ``kind`` keys become queryable columns; the whole document is
        stored as JSON. ``step=None`` takes the document's own ``step``. Cost: one JSON encoding.

        Example: ``w.log_anomaly(7, {"phase": "forward", "module": "fc", "kind": "nan"})``.
        """
        doc = _as_dict(anomaly, "anomaly")
        if step is None and doc.get("step") is not None:
            step = doc["step"]
        step = _check_optional_step(step)
        doc["step"] = step
        cols = [doc.get(k) if isinstance(doc.get(k), str) else None for k in ("phase", "module", "kind")]
        self._note_step(step)
        self._put_high(("a", step, time.time(), *cols, _json(doc)))

    def log_event(
        self,
        step: int | None,
        kind: str,
        severity: str,
        message: str,
        data: Mapping[str, Any] | None = None,
    ) -> None:
        """Record an event or log message (never dropped).

        Args:
            step: optimizer step or None (outside any step).
            kind: short snake_case name, e.g. ``"exploding_gradients"``.
            severity: ``"info" | "warning" | "error"``.
            message: one human line.
            data: optional JSON-ready evidence.

        Raises: TypeError for wrong types; ValueError for an unknown severity.
        Example: ``w.log_event(5, "loss_spike", "warning", "loss x12 over its mean", {"ratio": 12.0})``.
        """
        step = _check_optional_step(step)
        kind = _check_name(kind, "kind")
        if not isinstance(severity, str):
            raise _bad_type("severity", "a str", severity)
        if severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {severity!r}")
        if not isinstance(message, str):
            raise _bad_type("message", "a str", message)
        payload = None if data is None else _json(_as_dict(data, "data"))
        self._note_step(step)
        self._put_high(("e", step, time.time(), kind, severity, message, payload))

    def log_rule_event(self, event: RuleEvent) -> None:
        """Record an ``events.RuleEvent`` as an event (its modules and evidence go into ``data``)."""
        if not isinstance(event, RuleEvent):
            raise _bad_type("event", "a torchdebug RuleEvent", event)
        data = {"modules": list(event.modules), "evidence": dict(event.evidence)}
        self.log_event(event.step, event.kind, event.severity, event.message, data)

    def log_tensor_stats(self, step: int, name: str, stats: Mapping[str, Any] | Any) -> None:
        """Queue statistics of one tensor (low priority): a dict or a ``TensorStats``.

        Example: ``w.log_tensor_stats(3, "fc.weight.grad", analyze_tensor(p.grad))``.
        Cost: a shallow copy; the JSON encoding happens on the writer thread.
        """
        step = _check_step(step)
        name = _check_name(name)
        doc = _as_dict(stats, "stats")
        self._note_step(step)
        self._put_low(("t", step, name, doc, time.time()))

    def log_memory(self, step: int, sample: Mapping[str, int | float]) -> None:
        """Queue one memory sample (low priority): ``{"rss": bytes, "cuda_allocated": bytes, ...}``.

        Integers stay integers (bytes). Raises TypeError for a non-number value, ValueError for the
        keys ``"step"`` and ``"wall_time"`` (the sample's own fields when read back).
        """
        step = _check_step(step)
        items = _numbers_dict(sample, "sample", ints=True, reserved=("step", "wall_time"))
        self._note_step(step)
        self._put_low(("m", step, items, time.time()))

    def log_timing(self, step: int, seconds: Mapping[str, float]) -> None:
        """Queue one step's timing breakdown in seconds (low priority).

        The key ``"step"`` (the whole step's seconds) is read back as ``"total"`` by ``Run.timings()``,
        whose ``"step"`` is the step index; so ``"total"`` may not be logged alongside it.

        Example: ``w.log_timing(3, {"data": 0.01, "forward": 0.02, "backward": 0.04, "step": 0.08})``.
        Raises TypeError for a non-number, ValueError for the key ``"wall_time"``.
        """
        if type(step) is not int or step < 0:
            step = _check_step(step)
        # "step" (the whole step's seconds) is allowed and read back as "total"; so "total" is not.
        reserved = ("wall_time", "total") if "step" in seconds else ("wall_time",)
        items = _plain_floats(seconds, reserved)  # every step: the common case checked in a few type tests
        if items is None:
            items = _numbers_dict(seconds, "seconds", ints=False, reserved=reserved)
        self._note_step(step)
        self._put_low(("T", step, items, time.time()))

    def start_segment(self, label: str = "", step: int | None = None) -> int:
        """Start a new history segment (a dashboard "clear"); nothing is deleted. Returns its id.

        ``step`` defaults to one past the highest step logged so far by this writer.
        """
        if not isinstance(label, str):
            raise _bad_type("label", "a str", label)
        start = self._last_step + 1 if step is None else _check_step(step)
        core = self._core
        with core.lock:
            seg_id = core.next_segment
            core.next_segment += 1
        self._put_high(("g", seg_id, start, time.time(), label))
        return seg_id

    def _note_step(self, step: int | None) -> None:
        if step is not None and step > self._last_step:
            self._new_step(step)

    def _new_step(self, step: int) -> None:
        """A record of a step past every one logged so far: every ``commit_steps`` steps the writer
        thread is woken to commit, so commits follow the steps (one per ``commit_steps``, whatever
        the host's speed) and ``flush_interval`` only bounds how late a slow loop's records land."""
        self._last_step = step
        if step >= self._wake_step:
            self._wake_step = step + self._core.commit_steps
            core = self._core
            # not more often than every _MIN_COMMIT_GAP: a loop logging one value per step as fast
            # as it can would otherwise commit 32 rows at a time and fight the writer for the GIL
            if time.monotonic() - core.last_commit >= _MIN_COMMIT_GAP:
                core.wake.set()

    def flush(self) -> None:
        """Block until everything queued before this call is committed.

        Raises:
            RunStoreError: a background write failed since the last flush (the message says why).
        """
        self._core.flush()

    def close(self, status: str = "finished") -> None:
        """Commit what is queued, record ``status`` ("finished" | "failed") and end time; idempotent.

        Also runs at interpreter exit ("failed" if an uncaught exception ends the process) and when
        the writer is garbage collected.
        """
        if status not in _CLOSE_STATUSES:
            raise ValueError(f"status must be one of {_CLOSE_STATUSES}, got {status!r}")
        self._finalizer.detach()
        self._core.close(status)

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close("failed" if exc_type is not None else "finished")


def _folder_name(name: str) -> str:
    safe = _NAME_UNSAFE.sub("_", name).strip("._") or "run"
    return safe[:80]


def _make_run_dir(root: Path, name: str, when: _dt.datetime) -> Path:
    """Create ``root/<name>-<yyyymmdd-hhmmss>`` atomically, adding ``-2``, ``-3`` ... if it exists."""
    root.mkdir(parents=True, exist_ok=True)
    base = f"{_folder_name(name)}-{when.strftime('%Y%m%d-%H%M%S')}"
    for i in range(1, 10_000):
        path = root / (base if i == 1 else f"{base}-{i}")
        try:
            path.mkdir()  # atomic: two processes starting in the same second get different folders
        except FileExistsError:
            continue
        return path
    raise RunStoreError(f"cannot find a free run folder name for {base!r} under {root}")


def create_run(
    root: str | os.PathLike[str] = "runs",
    name: str | None = None,
    config: Mapping[str, Any] | None = None,
    rank: int = 0,
    world_size: int = 1,
    *,
    path: str | os.PathLike[str] | None = None,
    max_queue: int = 100_000,
    batch_size: int = 10_000,
    flush_interval: float = 2.0,
    keep_recent: int | None = _compact.RECENT,
    commit_steps: int = 32,
) -> RunWriter:
    """Create a run folder (rank 0) or join one (rank > 0) and return its ``RunWriter``.

    Args:
        root: parent folder of runs; created if missing.
        name: run name (default ``"run"``); the folder is ``<root>/<name>-<yyyymmdd-hhmmss>``,
            with ``-2``, ``-3`` ... appended when that folder already exists.
        config: JSON-ready settings stored in meta.json.
        rank, world_size: this process's rank; each rank writes ``rank<k>.sqlite``.
        path: an existing run folder to write into (required for rank > 0: rank 0's ``writer.path``,
            e.g. shared with ``torch.distributed.broadcast_object_list``).
        max_queue: low-priority records kept in memory before the oldest are dropped.
        batch_size: low-priority records that wake the writer thread before its timer.
        flush_interval: the most seconds between commits (a killed process loses at most these).
        commit_steps: steps between commits: the writer thread commits when a record of a step this
            many past the last wake-up arrives (at most every 0.25 s), so a loop commits once per
            ``commit_steps`` steps, or less often when they take under 0.25 s (a commit of 32 steps
            of the 10-tensor MLP's records: ~8.3 M instructions on the writer thread).
        keep_recent: steps at the end of the run kept at full resolution (default 20,000); older
            per-step rows are compacted into rollups except near events and anomalies (see the
            architecture doc's run store contract). None: never compact.

    Returns:
        The writer; ``writer.path`` is the run folder.

    Raises:
        TypeError / ValueError: bad arguments. RunStoreError: the folder or database cannot be written.
        SchemaVersionError: ``path`` holds a database from a newer torchdebug.

    Example::

        w = create_run(root="runs", name="mnist", config={"lr": 1e-3})
        w.log_scalar("loss", 0, 2.3)
        w.close()

    Cost: creates a folder, a SQLite file and one daemon thread (a few ms).
    """
    if name is None:
        name = "run"
    name = _check_name(name)
    if config is None:
        config = {}
    if not isinstance(config, Mapping):
        raise _bad_type("config", "a dict", config)
    for arg, v in (("rank", rank), ("world_size", world_size), ("max_queue", max_queue)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise _bad_type(arg, "an int", v)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if max_queue < 1:
        raise ValueError(f"max_queue must be >= 1, got {max_queue}")
    if (
        not isinstance(flush_interval, (int, float))
        or not math.isfinite(flush_interval)
        or flush_interval <= 0
    ):
        raise ValueError(f"flush_interval must be a positive number of seconds, got {flush_interval!r}")
    if isinstance(commit_steps, bool) or not isinstance(commit_steps, int) or commit_steps < 1:
        raise ValueError(f"commit_steps must be an int >= 1, got {commit_steps!r}")
    if keep_recent is not None and (
        isinstance(keep_recent, bool) or not isinstance(keep_recent, int) or keep_recent < 0
    ):
        raise ValueError(f"keep_recent must be an int >= 0 or None, got {keep_recent!r}")

    now = _dt.datetime.now().astimezone()
    meta_path: Path | None
    if path is None:
        if rank != 0:
            raise ValueError(
                f"rank {rank} must join rank 0's run: pass path=<rank 0's writer.path> "
                "(e.g. shared with torch.distributed.broadcast_object_list)"
            )
        run_dir = _make_run_dir(Path(root), name, now)
        meta = {
            "run_id": uuid.uuid4().hex,
            "name": name,
            "created": now.isoformat(timespec="seconds"),
            "status": "running",
            "ended": None,
            "torch": _torch_version(),
            "python": platform.python_version(),
            "torchdebug": __version__,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "config": plain(dict(config)),
            "rank": rank,
            "world_size": world_size,
            "schema_version": SCHEMA_VERSION,
        }
        meta_path = run_dir / "meta.json"
    else:
        run_dir = Path(path)
        meta_file = run_dir / "meta.json"
        try:
            shared = _validate.meta(meta_file.read_bytes(), str(meta_file))
        except FileNotFoundError:
            raise RunStoreError(
                f"{run_dir} is not a torchdebug run (no meta.json); let rank 0 create it first"
            ) from None
        except OSError as e:
            raise RunStoreError(f"cannot read {meta_file}: {e}") from e
        if shared.get("world_size", world_size) != world_size:
            raise ValueError(f"world_size {world_size} differs from the run's {shared.get('world_size')}")
        meta = dict(shared, rank=rank, pid=os.getpid(), host=socket.gethostname(), status="running")
        meta.update(ended=None)
        # Rank 0 owns meta.json; a rank 0 writer re-opening its own run (a resume) takes it back.
        meta_path = meta_file if rank == 0 else None
    # When this process attached: the reader's pid-reuse check compares it with the process start.
    meta["opened"] = now.isoformat(timespec="seconds")

    db_path = run_dir / f"rank{rank}.sqlite"
    lock_fd = None
    try:
        lock_fd = acquire_writer_lock(run_dir, rank)  # before any write: a second writer changes nothing
        conn = open_for_writing(db_path)
    except BaseException:
        release_writer_lock(run_dir, rank, lock_fd)
        if path is None:  # a folder we just made holds nothing worth keeping
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(
            "INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)",
            [
                (k, json.dumps(meta[k]))
                for k in (
                    "run_id",
                    "name",
                    "created",
                    "opened",
                    "status",
                    "ended",
                    "host",
                    "pid",
                    "rank",
                    "world_size",
                )
            ],
        )
        conn.execute("COMMIT")
    except sqlite3.Error as e:
        conn.close()
        release_writer_lock(run_dir, rank, lock_fd)
        raise RunStoreError(f"cannot write {db_path}: {e}") from e
    # meta.json last: a folder is listed as a run only once its database exists.
    if meta_path is not None:
        try:
            write_json_atomic(meta_path, meta)
        except OSError as e:
            conn.close()
            release_writer_lock(run_dir, rank, lock_fd)
            if path is None:
                shutil.rmtree(run_dir, ignore_errors=True)
            raise RunStoreError(f"cannot write {meta_path}: {e}") from e
    core = _Core(
        conn,
        db_path,
        meta_path,
        meta,
        max_queue,
        batch_size,
        float(flush_interval),
        lock_fd,
        keep_recent,
        commit_steps,
    )
    _LIVE.add(core)
    return RunWriter(core, run_dir)

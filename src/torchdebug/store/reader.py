"""The run reader: open a run folder read-only and query its metrics, anomalies, events and samples."""

from __future__ import annotations

import datetime as _dt
import os
import re
import socket
import sqlite3
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .._errors import RunStoreError, SchemaVersionError
from . import _compact, _rollup, _validate, _vectors
from ._schema import SCHEMA_VERSION, describe, open_for_reading
from .writer import SUMMARY_FILE

_RANK_FILE = re.compile(r"^rank(\d+)\.sqlite$")
# A timing sample's "step" key is its index; the step's duration, logged as "step", reads as "total".
_TIMING_RENAME = {"step": "total"}
# Up to this many points a downsampled read buckets the raw rows (<= ~7 ms) into exactly equal
# buckets, as before rollups existed; above it, rollups answer in ~1 ms with aligned buckets.
_RAW_DOWNSAMPLE_ROWS = 8192
_NOT_A_RUN_HINT = "pass a run folder such as runs/demo-20250101-120000 (list them with: torchdebug runs)"


# Steps beyond this are clamped in queries: no run gets there, and SQLite integers stop at 2**63 - 1.
_MAX_STEP = 2**62


class _NotANumber(ValueError):
    pass


def _nan(v: Any) -> Any:
    # SQLite stores a bound NaN as NULL; the writer never stores None, so NULL reads back as NaN.
    if v is None:
        return float("nan")
    if type(v) is not float and (type(v) is not int):
        raise _NotANumber(f"holds {type(v).__name__} {v!r:.40} where a number belongs")
    return v


@dataclass
class Series:
    """One metric over steps. ``downsampled`` is True when buckets were reduced to their min and max."""

    name: str
    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    wall_times: list[float] = field(default_factory=list)
    downsampled: bool = False

    def __len__(self) -> int:
        return len(self.steps)

    def __str__(self) -> str:
        if not self.steps:
            return f"{self.name}: no points"
        tail = " (min/max downsampled)" if self.downsampled else ""
        return (
            f"{self.name}: {len(self)} points, steps {self.steps[0]}..{self.steps[-1]}, "
            f"last {self.values[-1]:.6g}{tail}"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; NaN/Inf values are rendered as the strings "nan", "inf", "-inf"."""
        from ..events import plain

        return plain(asdict(self))


@dataclass(frozen=True)
class RunInfo:
    """One line of ``list_runs``: where a run is and how far it got."""

    path: Path
    name: str
    status: str  # running | finished | failed | crashed | unreadable
    created: str | None
    steps: int
    anomalies: int
    run_id: str | None = None
    error: str | None = None  # why an "unreadable" run could not be read
    lost: int = 0  # records that could not be written (disk full ...): the run is incomplete
    lost_from_step: int | None = None
    write_error: str | None = None  # why they were lost

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["path"] = str(self.path)
        return d


def _pid_alive(pid: int, created: str | None) -> bool:
    """Is ``pid`` a live process that started no later than ``created`` (guards against pid reuse)?"""
    try:
        import psutil
    except ImportError:  # psutil is a core dependency; this keeps a broken install readable
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        if created:
            started = _dt.datetime.fromisoformat(created).timestamp()
            if proc.create_time() > started + 2.0:  # 2 s slack: run created after its process started
                return False
        return True
    except (psutil.NoSuchProcess, ValueError):
        return False
    except psutil.AccessDenied:
        return True


def _read_meta(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise RunStoreError(f"{path} does not exist; {_NOT_A_RUN_HINT}")
    if not path.is_dir():
        raise RunStoreError(f"{path} is not a torchdebug run (not a folder); {_NOT_A_RUN_HINT}")
    meta_file = path / "meta.json"
    if not meta_file.exists():
        raise RunStoreError(f"{path} is not a torchdebug run (no meta.json); {_NOT_A_RUN_HINT}")
    meta = _validate.meta(_validate.read_file(meta_file, _validate.META_CAP), str(meta_file))
    version = meta.get("schema_version")
    if isinstance(version, int) and version > SCHEMA_VERSION:
        raise SchemaVersionError(
            f"{path} has schema version {version} but this torchdebug reads up to {SCHEMA_VERSION}; "
            "it was written by a newer torchdebug: upgrade with pip install -U torchdebug"
        )
    return meta


_RUN_FILE = re.compile(r"^(meta\.json|rank\d+\.sqlite(-wal|-shm)?)$")


def outside_root(run_dir: Path, root: Path, resolved: Path | None = None) -> str | None:
    """Why ``run_dir`` may not be served from ``root``, or None: it, or one of its files, resolves
    (through symlinks) outside. A served folder shows only what is inside it.

    ``resolved``: ``root.resolve()``, passed when ``run_dir`` is known to be a plain folder (not a
    link) directly under ``root`` (``list_runs``): no path is resolved then but the links inside.

    Example: ``outside_root(Path("runs/a"), Path("runs"))`` -> None for an ordinary run folder.
    """
    real_root = resolved if resolved is not None else root.resolve()
    real = real_root / run_dir.name if resolved is not None else run_dir.resolve()
    if real.parent != real_root:
        return f"{run_dir} leads outside {root} (to {real}); refused"
    try:
        with os.scandir(run_dir) as it:
            links = [Path(e.path) for e in it if _RUN_FILE.match(e.name) and e.is_symlink()]
    except OSError:
        return None  # opening it will say why
    for f in links:  # a plain file cannot lead elsewhere: only links are resolved
        if f.resolve().parent != real:
            return f"{f} links outside its run folder; refused"
    return None


def _ranks(path: Path) -> list[int]:
    found = (_RANK_FILE.match(p.name) for p in path.iterdir())
    return sorted(int(m.group(1)) for m in found if m)


class Run:
    """A run opened read-only; one rank's database at a time (``run.rank``, ``run.open_rank(k)``).

    Safe while the writer is still writing (SQLite WAL: every query sees a consistent snapshot).
    Use as a context manager or call ``close()`` to release the file.
    """

    def __init__(self, path: Path, meta: dict[str, Any], rank: int) -> None:
        self.path = path
        self.meta = meta
        self.rank = rank
        self.db_path = path / f"rank{rank}.sqlite"
        self._conn, self.schema_version, self.read_note = open_for_reading(self.db_path)
        # read_note: None, or what this read could not see (e.g. a -wal on read-only media)
        # One query at a time on the shared connection: a dashboard may call from several threads.
        self._lock = threading.Lock()

    # -- identity ----------------------------------------------------------------------------------

    @property
    def run_id(self) -> str | None:
        return self.meta.get("run_id")

    @property
    def name(self) -> str:
        return str(self.meta.get("name") or self.path.name)

    @property
    def created(self) -> str | None:
        return self.meta.get("created")

    @property
    def ranks(self) -> list[int]:
        """Ranks with a database in the run folder."""
        return _ranks(self.path)

    @property
    def status(self) -> str:
        """running | finished | failed | crashed: "crashed" is a "running" run whose process is gone.

        Re-reads meta.json, so a live run's status is current. A run written on another host is
        reported as meta.json says (its process cannot be checked from here).
        """
        meta = self.meta
        meta_file = self.path / "meta.json"
        try:
            meta = self.meta = _validate.meta(
                _validate.read_file(meta_file, _validate.META_CAP), str(meta_file)
            )
        except (OSError, RunStoreError):
            pass  # mid-replace or damaged since it was opened: the meta.json read at open stands
        if self.rank != meta.get("rank", 0):
            meta = self._db_meta()  # another rank: its own process, recorded in its own database
        status = str(meta.get("status", "unknown"))
        if status == "running" and meta.get("host") == socket.gethostname():
            pid = meta.get("pid")
            started = meta.get("opened") or meta.get("created")
            if isinstance(pid, int) and not _pid_alive(pid, started if isinstance(started, str) else None):
                return "crashed"
        return status

    def open_rank(self, rank: int) -> Run:
        """Open another rank's database of this run.

        Raises:
            RunStoreError: no database for that rank (the message lists the ranks present).
        """
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"rank must be an int, got {type(rank).__name__}")
        if rank not in self.ranks:
            raise RunStoreError(f"{self.path} has no rank {rank} (ranks present: {self.ranks})")
        return Run(self.path, self.meta, rank)

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        try:
            s = self.summary()
        except Exception:  # closed or unreadable: the identity is still worth showing
            return f"<Run {self.path} rank {self.rank}>"
        n = s["anomalies"]
        ranks = f" rank {self.rank} of {len(s['ranks'])}," if len(s["ranks"]) > 1 else ""
        return (
            f"<Run {self.name}: {s['status']},{ranks} {s['steps']} steps, "
            f"{n} anomal{'y' if n == 1 else 'ies'}, {self.path}>"
        )

    def _repr_html_(self) -> str:
        """The run in a notebook: its verdict first (the sentence ``torchdebug show`` leads with, in
        its level's colour), then status, steps, the first anomaly, the events by kind, the folder.

        Cost: the verdict reads the anomaly and event tables whole (a few ms for thousands).
        """
        from .._verdict import COLOURS
        from ..events import html_table

        s = self.summary()
        said = self.verdict()
        first = self._rows("SELECT data FROM anomalies ORDER BY id LIMIT 1")
        anomalies: Any = s["anomalies"]
        if first:
            doc = _validate.anomaly(first[0][0], f"{self.db_path}: first anomaly")
            anomalies = f"{s['anomalies']}, first: {doc.get('summary') or doc.get('kind', 'anomaly')}"
        events = ", ".join(f"{k} {n}" for k, n in sorted(s["events"].items())) or "none"
        rows: list[tuple[str, Any]] = [
            ("verdict", said["text"]),
            ("status", s["status"] + (", incomplete: records were lost" if s["lost"] else "")),
            ("steps", s["steps"]),
            ("anomalies", anomalies),
            ("events", events),
            ("rank", f"{self.rank} of ranks {', '.join(map(str, s['ranks']))}"),
            ("folder", self.path),
        ]
        return html_table(f"torchdebug run {self.name}", COLOURS[said["level"]], rows, "torchdebug-run")

    # -- pandas ------------------------------------------------------------------------------------

    def metrics_frame(self, names: list[str] | None = None) -> Any:
        """Every metric as a pandas DataFrame: one row per step (the index, ``step``), one column per
        metric (sorted names), NaN where a metric was not logged at that step. A metric logged
        twice at one step keeps its last value.

        Args:
            names: only these metrics (default: all of ``metric_names()``).

        Raises:
            ImportError: pandas is not installed (the message names the fix).
            KeyError: an unknown metric name.

        Example: ``run.metrics_frame()["loss"].rolling(50).mean()``.
        Cost: one indexed scan per metric (about 0.5 µs per point).
        """
        pd = _pandas("metrics_frame")
        columns = {}
        for name in self.metric_names() if names is None else list(names):
            series = self.series(name)
            columns[name] = pd.Series(series.values, index=series.steps, dtype="float64")
            columns[name] = columns[name][~columns[name].index.duplicated(keep="last")]
        frame = pd.DataFrame(columns) if columns else pd.DataFrame(index=pd.Index([], dtype="int64"))
        frame.index.name = "step"
        return frame.sort_index()

    def events_frame(self) -> Any:
        """Rule events and log messages as a pandas DataFrame, in the order logged: columns
        ``step``, ``severity``, ``kind``, ``message``, ``modules`` (a comma-separated string),
        ``wall_time``.

        Raises:
            ImportError: pandas is not installed (the message names the fix).
        """
        pd = _pandas("events_frame")
        rows = [
            {
                "step": e["step"],
                "severity": e["severity"],
                "kind": e["kind"],
                "message": e["message"],
                "modules": ", ".join(map(str, (e["data"] or {}).get("modules") or ())),
                "wall_time": e["wall_time"],
            }
            for e in self.events()
        ]
        columns = ["step", "severity", "kind", "message", "modules", "wall_time"]
        frame = pd.DataFrame(rows, columns=columns)
        frame["step"] = frame["step"].astype("Int64")  # None for events outside a step
        return frame

    def anomalies_frame(self) -> Any:
        """Anomalies as a pandas DataFrame, in the order logged: ``step``, ``kind``, ``phase``,
        ``module``, ``parameter``, ``op``, ``location``, ``rank``, ``symptom``, ``detected_by``,
        ``summary``. An anomaly seen in a parameter (no replay) names the module that owns it;
        ``op`` and ``location`` are missing (NaN) where no replay traced them.

        Raises:
            ImportError: pandas is not installed (the message names the fix).
        """
        pd = _pandas("anomalies_frame")
        columns = [
            "step", "kind", "phase", "module", "parameter", "op", "location", "rank", "symptom",
            "detected_by", "summary",
        ]  # fmt: skip

        def row(a: dict[str, Any]) -> dict[str, Any]:
            r = {c: a.get(c) for c in columns}
            parameter = a.get("parameter")
            if not r["module"] and isinstance(parameter, str) and "." in parameter:
                r["module"] = parameter.rsplit(".", 1)[0]  # the module that owns the parameter
            return r

        frame = pd.DataFrame([row(a) for a in self.anomalies()], columns=columns)
        frame["step"] = frame["step"].astype("Int64")
        return frame

    # -- queries -----------------------------------------------------------------------------------

    def _rows(self, sql: str, params: tuple[Any, ...] | dict[str, Any] = ()) -> list[tuple[Any, ...]]:
        try:
            with self._lock:
                return self._conn.execute(sql, params).fetchall()
        except OverflowError as e:  # a step past SQLite's 64-bit integers
            raise ValueError(f"a step or count out of range: {e}") from None
        except sqlite3.ProgrammingError as e:
            raise RunStoreError(f"{self.db_path}: {e} (was the run closed?)") from e
        except (sqlite3.DatabaseError, UnicodeDecodeError) as e:
            raise RunStoreError(
                f"{self.db_path} is corrupt ({describe(e)}); the run cannot be read, restore it from a backup"
            ) from e

    def _db_meta(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in self._rows("SELECT key, value FROM meta"):
            try:
                out[k] = _validate.load(v, f"{self.db_path} meta table key {k!r}")
            except RunStoreError:
                out[k] = v  # a bare string; the known keys are checked below
        _validate.check_fields(out, _validate.META_FIELDS, f"{self.db_path} meta table")
        return out

    def metric_names(self) -> list[str]:
        """Names of all logged metrics, sorted."""
        rows = self._rows("SELECT id, name FROM metrics ORDER BY name")
        for mid, name in rows:
            if not isinstance(name, str):
                raise RunStoreError(
                    f"{self.db_path}: metrics row {mid} holds {name!r:.40} where a name belongs; the run's "
                    "database is corrupt or was altered, restore it from a backup"
                )
        return [name for _, name in rows]

    def _metric_id(self, name: str) -> int:
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        row = self._rows("SELECT id FROM metrics WHERE name = ?", (name,))
        if not row:
            known = ", ".join(self.metric_names()[:20]) or "none"
            raise KeyError(f"no metric {name!r} in {self.path} (known: {known})")
        return int(row[0][0])

    def series(self, name: str, since_step: int | None = None, max_points: int | None = None) -> Series:
        """One metric over steps, ordered by step.

        Args:
            name: metric name (see ``metric_names()``).
            since_step: only steps >= this.
            max_points: at most this many points. When the metric has more, steps are cut into at
                most ``max_points // 2`` buckets and each keeps its lowest and highest point, so
                spikes survive; a bucket holding a NaN keeps its earliest NaN as its lowest point, so
                NaN survives too, and +-Inf are ordinary extremes. Otherwise every raw point.

        Raises:
            KeyError: unknown metric (the message lists known ones). ValueError: max_points < 2.

        Buckets: up to 8192 points, for databases written before rollups (schema v1), and when
        the buckets would be narrower than 16 steps, the range ``[lo, hi]`` is cut into exactly
        ``max_points // 2`` equal parts (raw rows, bucketed in SQL). Otherwise buckets are aligned:
        ``step // width``, the width being the finest rollup level (16, 32, ... 4096 steps) that
        fits, so there are about ``max_points // 4`` to ``max_points // 2`` of them (never more).

        Example: ``run.series("loss", max_points=500).values``.
        Cost: a full read is one indexed range scan (about 0.5 µs per point). A downsampled read of
        a long range reads one rollup row per bucket (about 1 ms for 1000 buckets, whatever the
        number of steps); raw bucketing costs about 0.6 - 1 µs per point.
        """
        mid = self._metric_id(name)
        if since_step is not None and (isinstance(since_step, bool) or not isinstance(since_step, int)):
            raise TypeError(f"since_step must be an int or None, got {type(since_step).__name__}")
        # The writer refuses negative steps; a step past _MAX_STEP selects nothing, as it would anyway.
        since = 0 if since_step is None else min(max(since_step, 0), _MAX_STEP)
        if max_points is not None and (isinstance(max_points, bool) or not isinstance(max_points, int)):
            raise TypeError(f"max_points must be an int, got {type(max_points).__name__}")
        if max_points is not None and max_points < 2:
            raise ValueError(f"max_points must be >= 2 (a min and a max per bucket), got {max_points}")
        where = _vectors.members(self, mid)
        if where:  # a per-parameter number of detail steps (schema v5): its vectors' blobs
            return self._vector_series(name, mid, where, since, max_points)
        rows: list[tuple[Any, ...]] | None = None
        downsampled = False
        compacted = self._compacted_to() if self.has_rollups else 0
        if max_points is not None:
            n, lo, hi = self._extent(mid, since)
            if n > max_points:
                downsampled = True
                nb = max_points // 2
                width = None
                if since < compacted and lo is not None:
                    # the raw rows of a compacted span are gone: its rollups (>= KEEP_LEVEL) answer
                    width = _rollup.choose_width(lo, hi, nb, min_level=_compact.KEEP_LEVEL)
                elif self.has_rollups and n > _RAW_DOWNSAMPLE_ROWS:
                    width = _rollup.choose_width(lo, hi, nb)
                if width is not None:
                    rows = self._rollup_downsample(mid, since, hi, *width)
                else:
                    rows = self._raw_downsample(mid, since, lo, hi, nb)
        if rows is None and since < compacted:
            # A full read of a compacted run: each compacted bucket's lowest and highest point, then
            # every raw row from the compacted edge on.
            downsampled = True
            rows = self._rollup_downsample(mid, since, compacted - 1, _compact.KEEP_LEVEL, 1)
            rows += self._rows(
                "SELECT step, value, wall_time FROM scalars WHERE metric_id = ? AND step >= ? ORDER BY step, rowid",
                (mid, compacted),
            )
        if rows is None:
            rows = self._rows(
                "SELECT step, value, wall_time FROM scalars WHERE metric_id = ? AND step >= ? ORDER BY step, rowid",
                (mid, since),
            )
        try:
            values = [_nan(r[1]) for r in rows]
        except _NotANumber as e:
            raise RunStoreError(
                f"{self.db_path}: metric {name!r} {e}; the run's database was altered"
            ) from None
        return Series(
            name=name,
            steps=[r[0] for r in rows],
            values=values,
            wall_times=[r[2] for r in rows],
            downsampled=downsampled,
        )

    def _vector_series(
        self, name: str, mid: int, where: list[tuple[int, int, int]], since: int, max_points: int | None
    ) -> Series:
        """``series`` of a vector member: its values unpacked from each row (plus any scalar rows of the
        same name), bucketed in Python when over ``max_points``. A compacted span keeps one row per
        ``KEEP_LEVEL`` steps (see _vectors.py), so a read reaching into it is marked downsampled."""
        rows = _vectors.series_rows(self, where, since)
        own = self._rows(
            "SELECT step, value, wall_time FROM scalars WHERE metric_id = ? AND step >= ? ORDER BY step, rowid",
            (mid, since),
        )
        if own:
            try:
                rows = sorted(rows + [(st, _nan(v), w) for st, v, w in own], key=lambda r: r[0])
            except _NotANumber as e:
                raise RunStoreError(
                    f"{self.db_path}: metric {name!r} {e}; the run's database was altered"
                ) from None
        downsampled = since < self._compacted_to()
        if max_points is not None and len(rows) > max_points:
            rows = _vectors.downsample(rows, rows[0][0], rows[-1][0], max_points // 2)
            downsampled = True
        return Series(
            name=name,
            steps=[r[0] for r in rows],
            values=[r[1] for r in rows],
            wall_times=[r[2] for r in rows],
            downsampled=downsampled,
        )

    def _compaction(self) -> tuple[int, int]:
        """(compacted_to, compacted_steps) from the meta table: steps below the first are compacted,
        and the second counts the steps none of whose raw rows are left (see store/_compact.py)."""
        got = dict(self._rows("SELECT key, value FROM meta WHERE key IN ('compacted_to', 'compacted_steps')"))
        out = []
        for key in ("compacted_to", "compacted_steps"):
            try:
                out.append(max(0, int(got.get(key, 0))))
            except (TypeError, ValueError):
                raise RunStoreError(
                    f"{self.db_path}: meta table key {key!r} holds {got.get(key)!r:.40} where a step count "
                    "belongs; the run's database was altered, restore it from a backup"
                ) from None
        return out[0], out[1]

    def _compacted_to(self) -> int:
        return self._compaction()[0]

    @property
    def has_rollups(self) -> bool:
        """True when the database holds metric rollups (schema v2 and later): fast downsampled reads."""
        return self.schema_version >= 2

    def _extent(self, mid: int, since: int) -> tuple[int, Any, Any]:
        """(rows, lowest step, highest step) of a metric from ``since`` on; steps are None when empty.

        With rollups: the coarsest level's rows after ``since``'s bucket, plus an index count of the
        raw rows of that partial bucket (< 4096 steps), instead of counting every raw row
        (a 100k-row count costs ~3 ms, 50 metrics ~150 ms).
        """
        if not self.has_rollups:
            n, lo, hi = self._rows(
                "SELECT count(*), min(step), max(step) FROM scalars WHERE metric_id = ? AND step >= ?",
                (mid, since),
            )[0]
            return int(n), lo, hi
        top = _rollup.LEVELS[-1]
        head_end = -(-since // top) * top  # since rounded up to a bucket edge
        n, lo, hi = self._rows(
            "SELECT sum(count), min(first_step), max(last_step) FROM metric_rollup "
            "WHERE metric_id = ? AND level = ? AND bucket >= ?",
            (mid, top, head_end // top),
        )[0]
        n = n or 0
        if head_end > since:
            hn, hlo, hhi = self._rows(
                "SELECT count(*), min(step), max(step) FROM scalars WHERE metric_id = ? AND step >= ? AND step < ?",
                (mid, since, head_end),
            )[0]
            if hn:
                n, lo, hi = n + hn, hlo, hi if hi is not None else hhi
        return int(n), lo, hi

    def _raw_downsample(
        self, mid: int, since: int, lo: int, hi: int, nb: int, width: int | None = None
    ) -> list[tuple[Any, ...]]:
        """Bucket the raw rows in SQL: each bucket keeps its lowest and highest row.

        ``width=None``: ``nb`` equal buckets, (step - lo) * nb // (hi - lo + 1). ``width=W``: aligned
        buckets step // W, the buckets ``_rollup_downsample`` reads (tests compare the two).
        """
        bucket = "step / :width" if width else "((step - :lo) * :nb) / :span"
        # SQLite's min()/max() with bare columns return the columns of the row holding the extreme,
        # in one pass per aggregate (3x faster than window functions at 1M points). The low side is
        # max() of a key: -value for numbers (-Inf moved to -DBL_MAX, so it ranks below NaN), and for
        # a NaN (stored as NULL) a text, which SQLite ranks above every number, zero-padded so that
        # the earliest NaN wins. So a bucket holding a NaN always shows its first NaN; the bare
        # `value` still reads NULL, i.e. NaN. The high side skips NaN. UNION drops the duplicate when
        # lowest and highest are one row. Among tied values any one of the tied rows is kept.
        sql = f"""
            WITH s AS (
                SELECT step, value, wall_time, {bucket} AS b
                FROM scalars WHERE metric_id = :mid AND step >= :since AND step <= :hi
            )
            SELECT step, value, wall_time FROM (
                SELECT max(CASE WHEN value IS NULL THEN printf('%019d', 999999999999999999 - step)
                                WHEN value = -9e999 THEN 1.7976931348623157e308 ELSE -value END),
                       step, value, wall_time
                FROM s GROUP BY b)
            UNION
            SELECT step, value, wall_time FROM (
                SELECT max(value), step, value, wall_time FROM s WHERE value IS NOT NULL GROUP BY b)
            ORDER BY step, wall_time
        """
        params = {
            "mid": mid,
            "since": since,
            "lo": lo,
            "hi": hi,
            "nb": nb,
            "span": hi - lo + 1,
            "width": width,
        }
        return self._rows(sql, params)

    def _rollup_downsample(self, mid: int, since: int, hi: int, level: int, k: int) -> list[tuple[Any, ...]]:
        """The lowest and highest point of each bucket ``step // (k * level)`` from the rollups.

        The same points as ``_raw_downsample(..., width=k * level)`` (among tied values, possibly
        another of the tied rows). Rows of the partial rollup bucket before ``since`` are read raw
        (< ``level`` steps).
        """
        params = {"mid": mid, "since": since, "hi": hi, "level": level, "k": k, "width": k * level}
        params["head_end"] = head_end = -(-since // level) * level
        # Each rollup row's lowest point is its earliest NaN if it has one, else its min; its
        # highest is its max when it has a real value. UNION drops the duplicate of a one-point row.
        low = """CASE WHEN nan_count > 0 THEN nan_step ELSE min_step END AS step,
                 CASE WHEN nan_count > 0 THEN NULL ELSE min_value END AS value,
                 CASE WHEN nan_count > 0 THEN nan_wall ELSE min_wall END AS wall_time"""
        rollup_rows = """metric_rollup WHERE metric_id = :mid AND level = :level
                         AND bucket >= :head_end / :level AND bucket <= :hi / :level"""
        if k == 1 and head_end == since:
            # One rollup row per chart bucket: no regrouping (the common case; ~1 ms per 1000 rows).
            sql = f"""
                SELECT {low} FROM {rollup_rows}
                UNION
                SELECT max_step, max_value, max_wall FROM {rollup_rows} AND max_value IS NOT NULL
                ORDER BY step, wall_time
            """
            return self._rows(sql, params)
        # Regroup: k rollup rows per chart bucket, and/or the raw rows of the partial head bucket.
        # The low key is the raw path's (earliest NaN, then -Inf, then the lowest value).
        sql = f"""
            WITH r AS (
                SELECT step / :width AS b, value IS NULL AS nan_count, value AS min_value,
                       step AS min_step, wall_time AS min_wall, value AS max_value, step AS max_step,
                       wall_time AS max_wall, step AS nan_step, wall_time AS nan_wall
                FROM scalars WHERE metric_id = :mid AND step >= :since AND step < :head_end AND step <= :hi
                UNION ALL
                SELECT bucket / :k, nan_count, min_value, min_step, min_wall, max_value, max_step,
                       max_wall, nan_step, nan_wall
                FROM {rollup_rows}
            )
            SELECT step, value, wall_time FROM (
                SELECT max(CASE WHEN nan_count > 0 THEN printf('%019d', 999999999999999999 - nan_step)
                                WHEN min_value = -9e999 THEN 1.7976931348623157e308 ELSE -min_value END),
                       {low}
                FROM r GROUP BY b)
            UNION
            SELECT step, value, wall_time FROM (
                SELECT max(max_value), max_step AS step, max_value AS value, max_wall AS wall_time
                FROM r WHERE max_value IS NOT NULL GROUP BY b)
            ORDER BY step, wall_time
        """
        return self._rows(sql, params)

    def last_values(self) -> dict[str, tuple[int, float]]:
        """``{metric: (step, value)}`` of each metric's latest step. Cost: one index probe per metric."""
        rows = self._rows(
            """SELECT m.name, s.step, s.value FROM metrics m JOIN scalars s ON s.rowid = (
                   SELECT rowid FROM scalars WHERE metric_id = m.id ORDER BY step DESC, rowid DESC LIMIT 1)
               ORDER BY m.name"""
        )
        try:
            out = {name: (step, _nan(value)) for name, step, value in rows}
        except _NotANumber as e:
            raise RunStoreError(f"{self.db_path}: a metric {e}; the run's database was altered") from None
        if _vectors.has_vectors(self):
            ids = {int(i): n for i, n in self._rows("SELECT id, name FROM metrics")}
            for name, got in _vectors.last_values(self, ids).items():
                if name not in out or out[name][0] < got[0]:
                    out[name] = got
            out = dict(sorted(out.items()))
        return out

    def _anomaly_rows(self, where: str, params: tuple[Any, ...]) -> list[dict[str, Any]]:
        out = []
        for rid, step, wall, data in self._rows(
            f"SELECT id, step, wall_time, data FROM anomalies {where} ORDER BY id", params
        ):
            doc = _validate.anomaly(data, f"{self.db_path}: anomalies row {rid}")
            doc.update(id=rid, step=step, wall_time=wall)
            out.append(doc)
        return out

    def anomalies(self) -> list[dict[str, Any]]:
        """Every anomaly document, in the order logged, with ``id``, ``step`` and ``wall_time`` added."""
        return self._anomaly_rows("", ())

    def _event_rows(self, where: str, params: tuple[Any, ...]) -> list[dict[str, Any]]:
        cols = ("id", "step", "wall_time", "kind", "severity", "message", "data")
        out = []
        for row in self._rows(f"SELECT {', '.join(cols)} FROM events {where} ORDER BY id", params):
            d = dict(zip(cols, row))
            where = f"{self.db_path}: events row {d['id']}"
            for key in ("kind", "severity", "message"):
                if not isinstance(d[key], str):
                    raise RunStoreError(f"{where}: {key!r} must be text, found {d[key]!r:.40}")
            if d["data"] is not None:
                d["data"] = _validate.document(d["data"], where, _validate.EVENT_DATA_FIELDS)
            out.append(d)
        return out

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        """Events and log messages in the order logged, optionally only one ``kind``."""
        if kind is None:
            return self._event_rows("", ())
        return self._event_rows("WHERE kind = ?", (kind,))

    def tensor_stats(self, step: int | None = None, name: str | None = None) -> list[dict[str, Any]]:
        """Tensor statistics as ``{"step", "name", "wall_time", "stats": {...}}``, filtered by step/name."""
        clauses: list[str] = []
        params: list[Any] = []
        if step is not None:
            clauses.append("step = ?")
            params.append(max(min(int(step), _MAX_STEP), -_MAX_STEP))
        if name is not None:
            clauses.append("name = ?")
            params.append(name)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        at = f"{self.db_path}: tensor_stats at step"
        return [
            {
                "step": s,
                "name": n,
                "wall_time": w,
                "stats": _validate.document(d, f"{at} {s} {n!r}", _validate.TENSOR_STATS_FIELDS),
            }
            for s, n, w, d in self._rows(
                f"SELECT step, name, wall_time, data FROM tensor_stats {where} ORDER BY step, id",
                tuple(params),
            )
        ]

    def _samples(
        self,
        table: str,
        key: str,
        value: str,
        where: str,
        params: tuple[Any, ...],
        rename: dict[str, str] | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Pivot long rows back into one dict per logged sample: ``{"step", "wall_time", key: value...}``.

        Rows of one sample share (step, wall_time): one ``log_*`` call stamps them with one time.
        """
        rename = rename or {}
        current: dict[str, Any] | None = None
        last: tuple[int, float] | None = None
        for step, wall, k, v in self._rows(
            f"SELECT step, wall_time, {key}, {value} FROM {table} {where} ORDER BY step, id", params
        ):
            if (step, wall) != last:
                if current is not None:
                    yield current
                current = {"step": step, "wall_time": wall}
                last = (step, wall)
            assert current is not None
            try:
                current[rename.get(k, k)] = _nan(v)
            except _NotANumber as e:
                raise RunStoreError(f"{self.db_path}: {table} {k!r} at step {step} {e}") from None
        if current is not None:
            yield current

    def memory(self) -> list[dict[str, Any]]:
        """Memory samples ``{"step", "wall_time", "rss": bytes, ...}`` by step (bytes are ints)."""
        return list(self._samples("memory", "key", "value", "", ()))

    def timings(self) -> list[dict[str, Any]]:
        """Timing samples ``{"step", "wall_time", "forward": s, ..., "total": s}`` by step (seconds).

        ``"step"`` is the step index; the whole step's seconds, logged under ``"step"``, is ``"total"``.
        A compacted span holds each 64-step bucket's last and slowest sample and the samples near an
        event or anomaly (see store/_compact.py); its exact step time, per-phase totals and extremes
        are in the timing rollups (``torchdebug.store._aggregate.timing_stats``).
        Cost: every sample pivoted in Python (about 2 µs per row); reports read aggregates instead.
        """
        return list(self._samples("timings", "phase", "seconds", "", (), _TIMING_RENAME))

    def segments(self) -> list[dict[str, Any]]:
        """History segments (dashboard "clear"s): ``{"id", "start_step", "wall_time", "label"}``."""
        cols = ("id", "start_step", "wall_time", "label")
        return [dict(zip(cols, r)) for r in self._rows(f"SELECT {', '.join(cols)} FROM segments ORDER BY id")]

    def at_step(self, step: int) -> dict[str, Any]:
        """Everything recorded at one step: scalars, anomalies, events, tensor stats, memory, timings.

        Example: ``run.at_step(7)["scalars"]["loss"]``. Cost: one indexed lookup per table.
        """
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an int, got {type(step).__name__}")
        q = max(min(step, _MAX_STEP), -_MAX_STEP)  # beyond SQLite's integers: no such step anyway
        rows = self._rows(
            "SELECT m.name, s.value FROM scalars s JOIN metrics m ON m.id = s.metric_id "
            "WHERE s.step = ? ORDER BY s.rowid",
            (q,),
        )
        try:
            scalars = {n: _nan(v) for n, v in rows}
        except _NotANumber as e:
            raise RunStoreError(f"{self.db_path}: a metric at step {step} {e}") from None
        scalars.update(_vectors.at_step(self, q))
        mem = list(self._samples("memory", "key", "value", "WHERE step = ?", (q,)))
        tim = list(self._samples("timings", "phase", "seconds", "WHERE step = ?", (q,), _TIMING_RENAME))
        return {
            "step": step,
            "scalars": scalars,
            "anomalies": self._anomaly_rows("WHERE step = ?", (q,)),
            "events": self._event_rows("WHERE step = ?", (q,)),
            "tensor_stats": self.tensor_stats(step=q),
            "memory": mem[-1] if mem else None,
            "timings": tim[-1] if tim else None,
        }

    def steps(self) -> int:
        """Number of distinct steps with at least one metric (compacted steps included). Cost: one
        index scan of the raw rows left."""
        union = " UNION SELECT step FROM vectors" if _vectors.has_vectors(self) else ""
        raw = int(self._rows(f"SELECT count(*) FROM (SELECT DISTINCT step FROM scalars{union})")[0][0])
        return raw + (self._compaction()[1] if self.has_rollups else 0)

    def summary(self) -> dict[str, Any]:
        """Counts for a quick look: steps, last step, metrics, anomalies, events by kind, status, dropped."""
        last = self._rows(
            "SELECT max(s) FROM (SELECT max(step) AS s FROM scalars UNION ALL SELECT max(step) FROM anomalies "
            "UNION ALL SELECT max(step) FROM events"
            + (" UNION ALL SELECT max(step) FROM vectors)" if _vectors.has_vectors(self) else ")")
        )[0][0]
        db_meta = self._db_meta()
        lost = self._lost(db_meta)
        return {
            "run_id": self.run_id,
            "name": self.name,
            "path": str(self.path),
            "rank": self.rank,
            "ranks": self.ranks,
            "status": self.status,
            "created": self.meta.get("created"),
            "ended": self.meta.get("ended"),
            "steps": self.steps(),
            "last_step": last,
            "metrics": int(self._rows("SELECT count(*) FROM metrics")[0][0]),
            "anomalies": int(self._rows("SELECT count(*) FROM anomalies")[0][0]),
            "events": dict(self._rows("SELECT kind, count(*) FROM events GROUP BY kind ORDER BY kind")),
            "segments": int(self._rows("SELECT count(*) FROM segments")[0][0]),
            "dropped": db_meta.get("dropped") or 0,
            "read_note": self.read_note,
            **lost,
            "schema_version": self.schema_version,
        }

    def verdict(self) -> dict[str, Any]:
        """The run's verdict: the sentence ``torchdebug show``, the reports and the dashboard lead
        with, its level (ok | running | warning | error) and its findings ranked by severity.

        Returns the core's ``judge`` dict (``"text"``, ``"level"``, ``"findings"``, ``"groups"``,
        ``"anomaly_steps"``, ``"divergences"``); ``str()`` of it is the sentence.

        Example: ``str(open_run(path).verdict()) == "finished: 2000 steps, no anomalies"``.
        Cost: one read of the anomaly and event tables (a few ms for thousands of records).
        """
        from .._verdict import verdict

        return verdict(self)

    def _lost(self, db_meta: dict[str, Any]) -> dict[str, Any]:
        """``lost``, ``lost_from_step``, ``write_error``: records the writer could not store.

        The writer records them in the meta table when a later batch commits, and in meta.json when
        it closes; either may have failed on a full disk, so the larger count wins.
        """
        sources = [db_meta]
        if self.rank == self.meta.get("rank", 0):
            sources.append(self.meta)
        best: dict[str, Any] = {"lost": 0, "lost_from_step": None, "write_error": None}
        for src in sources:
            n = src.get("lost")
            if type(n) is int and n > best["lost"]:
                frm, err = src.get("lost_from_step"), src.get("write_error")
                best = {
                    "lost": n,
                    "lost_from_step": frm if type(frm) is int else None,
                    "write_error": err if isinstance(err, str) else None,
                }
        return best


def _pandas(what: str) -> Any:
    """pandas, or an ImportError that names the fix (pandas is optional: the store needs only sqlite3)."""
    try:
        import pandas
    except ImportError:
        raise ImportError(
            f"Run.{what}() needs pandas: pip install pandas (or pip install 'torchdebug[pandas]')"
        ) from None
    return pandas


def open_run(path: str | os.PathLike[str], rank: int | None = None) -> Run:
    """Open a run folder read-only.

    Args:
        path: the run folder (holds meta.json and rank<k>.sqlite).
        rank: which rank's database to query (default: meta.json's rank, i.e. 0, or the lowest present).

    Returns:
        A ``Run``; close it (or use ``with``) when done.

    Raises:
        RunStoreError: missing path, not a run folder, unknown rank, corrupt or truncated database.
        SchemaVersionError: written by a newer torchdebug.

    Never writes the folder: SQLite is opened with ``mode=ro``.

    Example::

        with open_run("runs/demo-20250101-120000") as run:
            print(run.summary(), run.series("loss").values[-1])
    """
    p = Path(path)
    meta = _read_meta(p)
    ranks = _ranks(p)
    if not ranks:
        raise RunStoreError(f"{p} has no rank database (rank<k>.sqlite); the run folder is incomplete")
    if rank is None:
        rank = meta.get("rank", 0) if meta.get("rank", 0) in ranks else ranks[0]
    elif isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"rank must be an int, got {type(rank).__name__}")
    elif rank not in ranks:
        raise RunStoreError(f"{p} has no rank {rank} (ranks present: {ranks})")
    return Run(p, meta, rank)


def _quick_info(path: Path) -> RunInfo | None:
    """A closed run's line from meta.json and the summary its writer left (no database opened), or
    None when that cannot stand for the database: a running run, no or a malformed summary, a
    database whose size or mtime changed since, a -wal beside it, anything unexpected (the caller
    then opens the run, which says what is wrong). Cost: two small reads and two stats (~0.1 ms)."""
    folder = os.fspath(path)
    try:
        meta_file = os.path.join(folder, "meta.json")
        meta = _validate.meta(_validate.read_file(meta_file, _validate.META_CAP), meta_file)
        status = meta.get("status")
        version = meta.get("schema_version")
        if (
            status not in ("finished", "failed")
            or meta.get("rank", 0) != 0
            or (isinstance(version, int) and version > SCHEMA_VERSION)
        ):
            return None
        summary = os.path.join(folder, SUMMARY_FILE)
        doc = _validate.load(_validate.read_file(summary, _validate.SUMMARY_CAP), summary)
        db = os.path.join(folder, "rank0.sqlite")
        st = os.stat(db)
        if (
            not isinstance(doc, dict)
            or doc.get("db_size") != st.st_size
            or doc.get("db_mtime_ns") != st.st_mtime_ns
            or os.path.lexists(db + "-wal")
            or not all(type(doc.get(k)) is int and doc[k] >= 0 for k in ("steps", "anomalies"))
        ):
            return None
    except Exception:  # a shortcut only: whatever is odd, the database says it
        return None
    lost = meta.get("lost")
    frm, err = meta.get("lost_from_step"), meta.get("write_error")
    return RunInfo(
        path,
        str(meta.get("name") or path.name),
        str(status),
        meta.get("created"),
        doc["steps"],
        doc["anomalies"],
        meta.get("run_id"),
        lost=lost if type(lost) is int and lost > 0 else 0,
        lost_from_step=frm if type(frm) is int else None,
        write_error=err if isinstance(err, str) else None,
    )


def list_runs(root: str | os.PathLike[str] = "runs") -> list[RunInfo]:
    """Every run directly under ``root``, oldest first; unreadable runs are listed with their error.

    Raises:
        RunStoreError: ``root`` does not exist or is not a folder.

    A folder that leads outside ``root`` through a symlink is neither opened nor listed; a run whose
    meta.json or database links outside its folder is listed as unreadable, and not opened.

    Example: ``[r.name for r in list_runs("runs")]``. Cost: a closed run is read from its meta.json
    and the summary.json its writer left (about 0.3 ms); a running, crashed or changed run opens its
    rank-0 database.
    """
    base = Path(root)
    if not base.is_dir():
        raise RunStoreError(f"{base} is not a folder of runs (it does not exist or is a file)")
    infos: list[RunInfo] = []
    real_base = base.resolve()
    with os.scandir(base) as it:
        entries = sorted(it, key=lambda e: e.name)
    for entry in entries:
        p = Path(entry.path)
        # DirEntry answers from the directory listing: only a symlink needs resolving
        link = entry.is_symlink()
        if link and p.resolve().parent != real_base:
            continue
        why = None
        if link or not entry.is_dir(follow_symlinks=False):
            if not (p / "meta.json").is_file():
                continue
            why = outside_root(p, base)
        else:  # a plain folder: one listing says whether it is a run and whether a file of it is a link
            try:
                with os.scandir(entry.path) as it:
                    names = {e.name: e.is_symlink() for e in it}
            except OSError:
                continue
            if "meta.json" not in names:
                continue
            if any(linked and _RUN_FILE.match(name) for name, linked in names.items()):
                why = outside_root(p, base, resolved=real_base)
        if why is not None:
            infos.append(RunInfo(p, p.name, "unreadable", None, 0, 0, None, why))
            continue
        quick = _quick_info(p)
        if quick is not None:
            infos.append(quick)
            continue
        try:
            with open_run(p) as run:
                s = run.summary()
                infos.append(
                    RunInfo(
                        p,
                        run.name,
                        s["status"],
                        run.created,
                        s["steps"],
                        s["anomalies"],
                        run.run_id,
                        lost=s["lost"],
                        lost_from_step=s["lost_from_step"],
                        write_error=s["write_error"],
                    )
                )
        except RunStoreError as e:
            infos.append(RunInfo(p, p.name, "unreadable", None, 0, 0, None, str(e)))
        except Exception as e:  # a malformed run fails alone, whatever is wrong with it
            infos.append(RunInfo(p, p.name, "unreadable", None, 0, 0, None, f"{type(e).__name__}: {e}"))
    infos.sort(key=lambda i: (i.created or "", str(i.path)))
    return infos


def resolve_run(run: str, root: str | os.PathLike[str] = "runs") -> Path:
    """A run folder from a path, or from a name under ``root`` (the newest ``<name>-<timestamp>``).

    Raises:
        RunStoreError: nothing matches (the message says where it looked).
    """
    p = Path(run)
    if p.exists():
        return p
    base = Path(root)
    if base.is_dir() and os.sep not in run:
        if (base / run).exists():
            return base / run
        # Folder names end in -yyyymmdd-hhmmss, so the lexically last match is the newest run.
        matches = sorted(
            c for c in base.iterdir() if c.name.startswith(run + "-") and (c / "meta.json").is_file()
        )
        if matches:
            return matches[-1]
    raise RunStoreError(f"{run} does not exist (no such folder, and no run named {run!r} under {base})")

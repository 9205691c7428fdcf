"""The run database's schema, its version, migrations, and how writers and readers open the file."""

from __future__ import annotations

import os
import re
import shutil
import socket
import sqlite3
import tempfile
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path

from .._errors import RunStoreError, SchemaVersionError
from . import _rollup
from ._validate import regular

#: Version of the database layout this torchdebug writes. Stored in ``PRAGMA user_version`` and in the
#: ``meta`` table. Bump it, and add a step to ``MIGRATIONS``, whenever a table or column changes.
SCHEMA_VERSION = 6

# Invariant of v1: SQLite stores a bound NaN as NULL, and every value column is NOT NULL in spirit
# (the writer refuses None), so a NULL value always means NaN. +-Inf are stored as real floats.
_V1 = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE metrics (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE);
CREATE TABLE scalars (
    metric_id INTEGER NOT NULL REFERENCES metrics(id),
    step INTEGER NOT NULL,
    value REAL,
    wall_time REAL NOT NULL
);
CREATE INDEX scalars_by_metric ON scalars(metric_id, step);
CREATE INDEX scalars_by_step ON scalars(step);
CREATE TABLE anomalies (
    id INTEGER PRIMARY KEY,
    step INTEGER,
    wall_time REAL NOT NULL,
    phase TEXT,
    module TEXT,
    kind TEXT,
    data TEXT NOT NULL
);
CREATE INDEX anomalies_by_step ON anomalies(step);
CREATE TABLE events (
    id INTEGER PRIMARY KEY,
    step INTEGER,
    wall_time REAL NOT NULL,
    kind TEXT NOT NULL,
    severity TEXT NOT NULL,
    message TEXT NOT NULL,
    data TEXT
);
CREATE INDEX events_by_step ON events(step);
CREATE INDEX events_by_kind ON events(kind, step);
CREATE TABLE tensor_stats (
    id INTEGER PRIMARY KEY,
    step INTEGER NOT NULL,
    wall_time REAL NOT NULL,
    name TEXT NOT NULL,
    data TEXT NOT NULL
);
CREATE INDEX tensor_stats_by_step ON tensor_stats(step, name);
CREATE INDEX tensor_stats_by_name ON tensor_stats(name, step);
CREATE TABLE memory (
    id INTEGER PRIMARY KEY,
    step INTEGER NOT NULL,
    wall_time REAL NOT NULL,
    key TEXT NOT NULL,
    value  -- no type affinity: bytes stay INTEGER, fractions stay REAL
);
CREATE INDEX memory_by_step ON memory(step);
CREATE TABLE timings (
    id INTEGER PRIMARY KEY,
    step INTEGER NOT NULL,
    wall_time REAL NOT NULL,
    phase TEXT NOT NULL,
    seconds REAL
);
CREATE INDEX timings_by_step ON timings(step);
CREATE TABLE segments (
    id INTEGER PRIMARY KEY,
    start_step INTEGER NOT NULL,
    wall_time REAL NOT NULL,
    label TEXT NOT NULL
);
"""


def _create_v1(conn: sqlite3.Connection) -> None:
    # Statement by statement: executescript() would COMMIT the caller's BEGIN IMMEDIATE first.
    for statement in _V1.split(";"):
        if statement.strip():
            conn.execute(statement)


def _add_rollups_v2(conn: sqlite3.Connection) -> None:
    # v2: per-bucket metric summaries (see _rollup.py), built here for the raw rows a v1 writer left
    # (a resumed run); a reader of a v1 file never migrates it and reads raw rows instead.
    conn.execute(_rollup.CREATE)
    _add_last_v3(conn)  # the upsert writes the v3 columns
    _rollup.backfill(conn)


def _add_last_v3(conn: sqlite3.Connection) -> None:
    # v3: each rollup row keeps its bucket's last point; long runs are compacted (see _compact.py),
    # so a reader of v2 must not read a compacted file as if every raw row were there.
    have = {row[1] for row in conn.execute("PRAGMA table_info(metric_rollup)")}
    for statement in _rollup.ADD_LAST:
        if statement.split()[-2] not in have:  # "ALTER TABLE ... ADD COLUMN <name> REAL"
            conn.execute(statement)


def _add_timing_rollups_v4(conn: sqlite3.Connection) -> None:
    # v4: timing samples get the same per-bucket rollups as metrics (the key "step" holds each
    # sample's step time), so reports of long runs read them instead of every sample; built here
    # for the timing rows a v3 writer left (a file it compacted has only its kept samples). And
    # compaction keeps the finite part of a bucket holding +-Inf (finite_rollup).
    conn.execute(_rollup.TIMING_CREATE)
    conn.execute(_rollup.FINITE_CREATE)
    _rollup.backfill_timings(conn)


#: v5: a detail step's per-parameter numbers (``RunWriter.log_vector``) as one row per names list
#: and step, its values packed in a blob, instead of one ``scalars`` row and nine rollup upserts per
#: value. Each name is still a row of ``metrics`` (so ``metric_names()`` and the readers' lookups are
#: unchanged); ``vector_members`` says which vector and position holds it. Such metrics have no
#: ``metric_rollup`` rows: readers fold the blobs (see reader.py and _aggregate.py).
VECTORS_CREATE = (
    """CREATE TABLE IF NOT EXISTS vector_names (
    id INTEGER PRIMARY KEY,
    names TEXT NOT NULL         -- JSON list of metric names, in the order of each row's values
)""",
    """CREATE TABLE IF NOT EXISTS vector_members (
    metric_id INTEGER PRIMARY KEY REFERENCES metrics(id),
    names_id INTEGER NOT NULL REFERENCES vector_names(id),
    position INTEGER NOT NULL
)""",
    """CREATE TABLE IF NOT EXISTS vectors (
    names_id INTEGER NOT NULL REFERENCES vector_names(id),
    step INTEGER NOT NULL,
    wall_time REAL NOT NULL,
    data BLOB NOT NULL          -- little-endian float32 when exact, else float64; v6: maybe compressed
)""",
    "CREATE INDEX IF NOT EXISTS vectors_by_names ON vectors(names_id, step)",
    "CREATE INDEX IF NOT EXISTS vectors_by_step ON vectors(step)",
)


def _add_vectors_v5(conn: sqlite3.Connection) -> None:
    # v5: new tables only (IF NOT EXISTS: a file whose version number was set back keeps them); the
    # per-parameter rows a v4 writer left stay in ``scalars`` and read as before.
    for statement in VECTORS_CREATE:
        conn.execute(statement)


def _compressed_vectors_v6(conn: sqlite3.Connection) -> None:
    # v6: a ``vectors`` row may be compressed (see _vectors.py: a row shorter than its float32 bytes);
    # no table changes, the rows a v5 writer left read as before. The bump keeps a v5 reader, which
    # would take a compressed row for raw floats, off these files.
    return None


#: ``MIGRATIONS[v]`` upgrades a database from version ``v`` to ``v + 1`` inside the caller's
#: transaction. Version 0 is an empty file, so creating a database is migrating it from 0.
MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {
    0: _create_v1,
    1: _add_rollups_v2,
    2: _add_last_v3,
    3: _add_timing_rollups_v4,
    4: _add_vectors_v5,
    5: _compressed_vectors_v6,
}

_UPGRADE = "it was written by a newer torchdebug: upgrade with pip install -U torchdebug"


def newer_version_error(path: Path, version: int) -> SchemaVersionError:
    """The error for a database whose schema version this torchdebug does not know."""
    return SchemaVersionError(
        f"{path} has schema version {version} but this torchdebug reads up to {SCHEMA_VERSION}; {_UPGRADE}"
    )


def open_for_writing(path: Path) -> sqlite3.Connection:
    """Open (creating or migrating) a rank database for the writer thread.

    Returns a connection in autocommit mode (we issue ``BEGIN IMMEDIATE`` ourselves), WAL journal,
    ``synchronous=NORMAL`` (a killed process loses nothing committed; only a power cut can drop the
    last transactions), usable from another thread.

    Raises:
        SchemaVersionError: the file was written by a newer torchdebug.
        RunStoreError: the file is not a SQLite database or cannot be written.
    """
    try:
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30.0)
    except sqlite3.Error as e:
        raise RunStoreError(f"cannot create run database {path}: {e}; check the folder is writable") from e
    try:
        # Refuse a newer or foreign file before anything writes to it (switching to WAL rewrites
        # the header), so a refused file is left byte for byte as it was.
        _check_writable_version(conn, path)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        migrate(conn, path)
    except sqlite3.DatabaseError as e:
        conn.close()
        raise RunStoreError(
            f"cannot write run database {path}: {e}; move the file away or pick a new run folder"
        ) from e
    except RunStoreError:
        conn.close()
        raise
    return conn


def _check_writable_version(conn: sqlite3.Connection, path: Path) -> None:
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise newer_version_error(path, version)
    if version == 0 and conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
        raise RunStoreError(f"{path} is a SQLite database but not a torchdebug run store; move it away")


def migrate(conn: sqlite3.Connection, path: Path) -> int:
    """Bring ``conn``'s database up to ``SCHEMA_VERSION`` in one write transaction; returns the old version.

    Raises:
        SchemaVersionError: the database is newer than this torchdebug.
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        _check_writable_version(conn, path)  # again, under the write lock
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        for v in range(version, SCHEMA_VERSION):
            MIGRATIONS[v](conn)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute(
            "INSERT OR REPLACE INTO meta(key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
        )
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
    return version


def lock_path(run_dir: Path, rank: int) -> Path:
    """The lock file a rank's writer holds while it is open (``rank<k>.lock``; removed on close)."""
    return run_dir / f"rank{rank}.lock"


def acquire_writer_lock(run_dir: Path, rank: int) -> int | None:
    """Take rank ``rank``'s writer lock (``flock``) or refuse: one writer per rank database.

    The kernel drops the lock when the process dies, so a killed writer never leaves a stale lock
    (its empty file stays; the next writer takes it). Returns the descriptor to keep open, None where
    ``flock`` does not exist (Windows) or the filesystem refuses it: then nothing is checked.

    Raises:
        RunStoreError: another writer (this process or another) holds the lock; it names the holder.
    """
    try:
        import fcntl
    except ImportError:
        return None
    path = lock_path(run_dir, rank)
    tries = 0
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return None  # read-only folder: opening the database will say so
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            tries += 1
            if tries < 5:  # a reader's writer_is_open() probe holds it for microseconds
                os.close(fd)
                time.sleep(0.02)
                continue
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise RunStoreError(
                f"{run_dir / f'rank{rank}.sqlite'} is already open for writing ({holder}); a rank has one "
                f"writer: close the other writer first, or write a new run (create_run without path=)"
            ) from None
        except OSError:  # a filesystem without flock
            os.close(fd)
            return None
        # A writer closing between our open() and flock() unlinked the file we locked: lock the new one.
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
            return fd
        os.close(fd)


def release_writer_lock(run_dir: Path, rank: int, fd: int | None) -> None:
    """Remove and release a lock taken by ``acquire_writer_lock`` (unlink first, then unlock)."""
    if fd is None:
        return
    import fcntl

    try:
        os.unlink(lock_path(run_dir, rank))
    except OSError:
        pass
    # Unlock explicitly: a forked child (a DataLoader worker) shares the descriptor and would keep it.
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def writer_is_open(run_dir: Path, rank: int) -> bool:
    """True when a live writer holds rank ``rank``'s lock (checked without writing anything)."""
    try:
        import fcntl
    except ImportError:
        return False
    try:
        fd = os.open(lock_path(run_dir, rank), os.O_RDONLY | os.O_NONBLOCK)  # a FIFO: no wait
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # closing drops the shared lock we may have taken
    return False


def describe(error: BaseException | None) -> str:
    """A SQLite failure in words. Text that is not UTF-8 inside the file (a flipped byte in the
    schema, or in a name) surfaces as Python's bare ``'utf-8' codec can't decode ...``: say what it is."""
    if isinstance(error, UnicodeDecodeError):
        return f"database disk image is malformed: bytes that are not UTF-8 text at offset {error.start} of a text"
    return str(error)


_MAGIC = b"SQLite format 3\x00"


def _check_file(path: Path) -> bytes:
    """Cheap structural checks that catch garbage and truncated files before SQLite sees them.

    Returns the 100-byte header. Never advises deleting: a file that fails here cannot be opened at all.
    """
    with regular(path) as fd:  # a FIFO or a device is refused, never waited on
        size = os.fstat(fd).st_size
        header = os.read(fd, 100)
    if len(header) < 100 or header[:16] != _MAGIC:
        raise RunStoreError(
            f"{path} is not a SQLite database (corrupt or overwritten); the run cannot be read, "
            "restore it from a backup"
        )
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    pages = int.from_bytes(header[28:32], "big")
    wal = Path(str(path) + "-wal")
    has_wal = wal.exists() and wal.stat().st_size > 0
    # In WAL mode the header's page count may lag behind pages still in the -wal file, so the size
    # check is only sound when there is no WAL content.
    if not has_wal and (size % page_size or size < pages * page_size):
        raise RunStoreError(
            f"{path} is truncated ({size} bytes, header says {pages * page_size}); the run cannot be read, "
            "restore it from a backup"
        )
    return header


class _ReadConnection(sqlite3.Connection):
    """A reader's connection; ``close()`` also removes the private copy it may read (see below)."""

    scratch: str | None = None

    def close(self) -> None:
        super().close()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None


def _connect(path: Path, query: str) -> _ReadConnection:
    uri = "file:" + urllib.parse.quote(os.fspath(path.resolve())) + "?" + query
    conn = sqlite3.connect(uri, uri=True, check_same_thread=False, timeout=30.0, factory=_ReadConnection)
    assert isinstance(conn, _ReadConnection)
    return conn


def _read_mode(path: Path, header: bytes) -> str:
    """How to open ``path`` without writing a byte into its folder (a live run: only into the -shm its
    writer made, as WAL readers do): a URI query, or "copy" (read a private copy of the database and
    its -wal)."""
    wal, shm = Path(str(path) + "-wal"), Path(str(path) + "-shm")
    m = _RANK_DB.match(path.name)
    live = m is not None and writer_is_open(path.parent, int(m.group(1)))
    if header[18] != 2:  # rollback journal: every closed run (the writer checkpointed everything)
        if not live and (wal.exists() or shm.exists()):
            # A stray -wal/-shm beside a closed database (a copy, a tool, random bytes): mode=ro would
            # replay it and build a -shm, i.e. write into the run. Nothing newer than the file can be
            # in it (close() checkpoints before leaving WAL mode), so read the file alone.
            return "immutable=1"
        return "mode=ro"  # a read creates no file
    if live:
        return "mode=ro"  # a live writer owns the -shm index; readers share it as SQLite intends
    if wal.exists() and shm.exists():
        # A killed writer: read the WAL into memory and leave the stale -shm alone (plain mode=ro
        # would rebuild it, i.e. write into the run).
        return "mode=ro&readonly_shm=1"
    if wal.exists():
        return "copy"  # a -wal without its -shm (a copy): SQLite can only read it by making one
    # WAL mode but no -wal: nothing newer than the file exists here; opening normally would create
    # -wal and -shm beside it.
    return "immutable=1"


_RANK_DB = re.compile(r"^rank(\d+)\.sqlite$")


def _open_copy(path: Path) -> _ReadConnection:
    """Read a private copy of a database and its -wal (cost: one copy of the file)."""
    scratch = tempfile.mkdtemp(prefix="torchdebug-read-")
    try:
        copy = Path(scratch) / path.name
        shutil.copyfile(path, copy)
        shutil.copyfile(str(path) + "-wal", str(copy) + "-wal")
        conn = _connect(copy, "mode=ro")
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    conn.scratch = scratch
    return conn


def _probe(conn: sqlite3.Connection, path: Path, wal_missing: bool) -> int:
    """The schema version, after checking the file is a torchdebug database this reader knows."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise newer_version_error(path, version)
    if version == 0:
        if wal_missing:
            raise RunStoreError(
                f"{path} has no tables yet: it is in WAL mode and its {path.name}-wal is missing (copied "
                f"without it?); the run's records are in that file: copy {path.name}-wal beside it"
            )
        raise RunStoreError(f"{path} is not a torchdebug run database (no schema version)")
    conn.execute("SELECT count(*) FROM metrics").fetchone()
    return version


def open_for_reading(path: Path) -> tuple[sqlite3.Connection, int, str | None]:
    """Open a rank database for reading; returns the connection, its schema version and a note.

    Never writes into a closed run's folder, not even SQLite's scratch files: a closed run is opened
    ``mode=ro``; a live run's WAL is shared with its writer (its -wal and -shm opened read-write, as
    WAL mode needs: readers keep their read marks in the -shm; no file is created); a killed writer's WAL is read with
    ``readonly_shm`` (its -shm is not rebuilt); a -wal without its -shm is read from a private copy
    (cost: one copy of the file); a WAL-mode file without a -wal is read ``immutable``. When the
    folder cannot be opened that way (read-only media), an ``immutable`` read is tried, and the note
    says what it could not read.

    Raises:
        RunStoreError: missing, not SQLite, truncated, corrupt, or not a torchdebug database; the
            message says what is missing and never advises deleting a file SQLite can open.
        SchemaVersionError: written by a newer torchdebug.
    """
    if not path.exists():
        raise RunStoreError(f"{path} does not exist; is the run folder complete?")
    header = _check_file(path)
    how, note = _read_mode(path, header), None
    wal = Path(str(path) + "-wal")
    wal_missing = header[18] == 2 and not wal.exists()
    first_error: Exception | None = None
    conn: _ReadConnection | None = None
    try:
        conn = _open_copy(path) if how == "copy" else _connect(path, how)
        version = _probe(conn, path, wal_missing)
        if wal_missing and conn.execute("SELECT value FROM meta WHERE key = 'status'").fetchone() == (
            '"running"',
        ):
            # A writer that never closed leaves its last records in the -wal: a copy without it lacks them.
            note = (
                f"{wal.name} is missing (copied without it?): records the writer had not yet moved into "
                f"{path.name} may be missing; copy {wal.name} beside it to read them"
            )
        return conn, version, note
    except RunStoreError:
        if conn is not None:
            conn.close()
        raise
    except (sqlite3.Error, OSError, UnicodeDecodeError) as e:
        if conn is not None:
            conn.close()
        first_error = e
    # Read-only media, a lock we may not take, a -shm we may not read: the file itself may be fine.
    try:
        conn = _connect(path, "immutable=1")
        ok = conn.execute("PRAGMA quick_check").fetchone()[0]
        if ok != "ok":
            raise sqlite3.DatabaseError(f"quick_check: {ok}")
        version = _probe(conn, path, wal_missing)
    except RunStoreError:
        if conn is not None:
            conn.close()
        raise
    except (sqlite3.Error, UnicodeDecodeError) as e:
        if conn is not None:
            conn.close()
        raise RunStoreError(
            f"{path} is corrupt ({describe(first_error)}; an immutable read fails too: {describe(e)}); the run "
            "cannot be read, restore it from a backup"
        ) from e
    if wal.exists() and wal.stat().st_size > 0:
        note = (
            f"read without {wal.name} ({describe(first_error)}): records of the last seconds before the writer "
            "stopped may be missing; copy the run folder to writable storage to read them"
        )
    return conn, version, note

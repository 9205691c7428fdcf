"""The run database's schema, its version, migrations, and how writers and readers open the file."""

from __future__ import annotations

import os
import socket
import sqlite3
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path

from .._errors import RunStoreError, SchemaVersionError
from . import _rollup

#: Version of the database layout this torchdebug writes. Stored in ``PRAGMA user_version`` and in the
#: ``meta`` table. Bump it, and add a step to ``MIGRATIONS``, whenever a table or column changes.
SCHEMA_VERSION = 2

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
    _rollup.backfill(conn)


#: ``MIGRATIONS[v]`` upgrades a database from version ``v`` to ``v + 1`` inside the caller's
#: transaction. Version 0 is an empty file, so creating a database is migrating it from 0.
MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {0: _create_v1, 1: _add_rollups_v2}

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
        fd = os.open(lock_path(run_dir, rank), os.O_RDONLY)
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


_MAGIC = b"SQLite format 3\x00"


def _check_file(path: Path) -> None:
    """Cheap structural checks that catch garbage and truncated files before SQLite sees them."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        header = f.read(100)
    if len(header) < 100 or header[:16] != _MAGIC:
        raise RunStoreError(
            f"{path} is not a SQLite database (corrupt or overwritten); the run cannot be read, "
            "restore it from a backup or delete the run folder"
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
            "restore it from a backup or delete the run folder"
        )


def open_for_reading(path: Path) -> tuple[sqlite3.Connection, int]:
    """Open a rank database read-only (``mode=ro``); returns the connection and its schema version.

    Never writes the database or its WAL. (For a run whose writer was killed, SQLite rebuilds the
    ``-shm`` index file next to it; that file is scratch space, not data.)

    Raises:
        RunStoreError: missing, not SQLite, truncated, corrupt, or not a torchdebug database.
        SchemaVersionError: written by a newer torchdebug.
    """
    if not path.is_file():
        raise RunStoreError(f"{path} does not exist; is the run folder complete?")
    _check_file(path)
    uri = "file:" + urllib.parse.quote(os.fspath(path.resolve())) + "?mode=ro"
    try:
        conn = sqlite3.connect(uri, uri=True, check_same_thread=False, timeout=30.0)
    except sqlite3.Error as e:
        raise RunStoreError(f"cannot open {path} read-only: {e}; check file permissions") from e
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise newer_version_error(path, version)
        if version == 0:
            raise RunStoreError(f"{path} is not a torchdebug run database (no schema version)")
        conn.execute("SELECT count(*) FROM metrics").fetchone()
    except sqlite3.DatabaseError as e:
        conn.close()
        raise RunStoreError(
            f"{path} is corrupt ({e}); the run cannot be read, restore it from a backup or delete it"
        ) from e
    except RunStoreError:
        conn.close()
        raise
    return conn, version

"""Multi-row statements: a batch's rows written with a few ``INSERT ... VALUES (...), (...)`` calls.

``executemany`` steps one statement per row: a bind, a ``sqlite3_step`` with the GIL released and
taken back, a reset (~5,000 instructions a row besides the insert itself, and a GIL hand-over
to the training thread each time). One statement of many rows binds them all in C and steps once:
a 32-step commit of a small model's 384 scalar and timing rows takes ~35% fewer instructions.

Statements hold ``ROWS`` rows (32, 8 or 1; at most ``MAX_PARAMS`` parameters, SQLite before 3.32
allows 999), so a table gets three distinct statements, all compiled in the run's first commit and
kept in the connection's statement cache. Shapes that vary with the batch (every power of two up
to 128) were compiled anew whenever a commit's row count met a new one: ~1 M instructions for a
32-row rollup upsert, 16% of the writer thread on the 10-tensor MLP.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Sequence
from typing import Any

#: Bound parameters in one statement at most (SQLITE_MAX_VARIABLE_NUMBER before SQLite 3.32).
MAX_PARAMS = 999
#: Rows per statement, largest first: the only shapes a table's statements take.
ROWS = (32, 8, 1)

_SQL: dict[tuple[str, int, int, str], str] = {}


def _sql(head: str, width: int, rows: int, tail: str) -> str:
    key = (head, width, rows, tail)
    sql = _SQL.get(key)
    if sql is None:
        one = "(" + ", ".join(["?"] * width) + ")"
        sql = _SQL[key] = f"{head} VALUES {', '.join([one] * rows)} {tail}".rstrip()
    return sql


def insert(conn: sqlite3.Connection, head: str, rows: Iterable[Sequence[Any]], tail: str = "") -> None:
    """Write ``rows`` (tuples of one width) with ``head VALUES (...), (...) tail``, in row order.

    ``head``: ``"INSERT INTO t(a, b)"``; ``tail``: e.g. an ``ON CONFLICT ... DO UPDATE`` clause (each
    row of a statement is merged in turn, as with one statement per row). ``rows`` may be a
    generator: at most one statement's rows are held at a time. Inside the caller's transaction.
    Statements: one per ``ROWS[0]`` rows, then the rest in statements of 8 rows and of 1.
    """
    most = 0
    part: list[Any] = []  # the next statement's parameters, flat
    width = k = 0
    for r in rows:
        if not most:
            width = len(r)
            most = next(n for n in ROWS if n * width <= MAX_PARAMS)
        part.extend(r)
        k += 1
        if k == most:
            conn.execute(_sql(head, width, k, tail), part)
            part, k = [], 0
    for n in ROWS:  # the rest: the fewest statements of the fixed shapes
        while k >= n:
            conn.execute(_sql(head, width, n, tail), part[: n * width])
            del part[: n * width]
            k -= n

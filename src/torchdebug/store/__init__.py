"""The run store: a run folder with meta.json and one SQLite database per rank (writer and reader).

Writer (training side, never blocks): ``create_run(...) -> RunWriter``. Reader (reports, dashboard,
CLI; read-only, works while the writer writes): ``open_run(path) -> Run``, ``list_runs(root)``.
See docs/architecture.md, "Run store contract".
"""

from __future__ import annotations

from ._schema import SCHEMA_VERSION
from .reader import Run, RunInfo, Series, list_runs, open_run
from .writer import RunWriter, create_run

__all__ = ["SCHEMA_VERSION", "Run", "RunInfo", "RunWriter", "Series", "create_run", "list_runs", "open_run"]

"""The run store: a run folder with meta.json and one SQLite database per rank (writer and reader).

Writer (training side, never blocks): ``create_run(...) -> RunWriter``. Reader (reports, dashboard,
CLI; read-only, works while the writer writes): ``open_run(path) -> Run``, ``list_runs(root)``.
``rank_overview(run)`` reads every rank of a run at once. What a run means for a user (the verdict,
the text of ``show``) is built in ``torchdebug.views``. See docs/architecture.md, "Run store contract".
"""

from __future__ import annotations

from ._schema import SCHEMA_VERSION
from .ranks import rank_overview
from .reader import Run, RunInfo, Series, list_runs, open_run, resolve_run
from .writer import RunWriter, create_run

__all__ = [
    "SCHEMA_VERSION",
    "Run",
    "RunInfo",
    "RunWriter",
    "Series",
    "create_run",
    "list_runs",
    "open_run",
    "rank_overview",
    "resolve_run",
]

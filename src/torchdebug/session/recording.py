"""Where a watch session records: its run folder (the run store's writer) and the trackers of
``report_to``, opened as the session starts and closed as it ends. A member of
:class:`~torchdebug.session.monitor.Monitor` (``mon.recording``); what it needs of the session (the
config, the rank, the step) is handed in."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._config import DebugConfig
from .._errors import RunStoreError, TorchDebugWarning
from .._frames import warn_at_user
from . import distributed as _distributed


class Recording:
    """The session's run writer and trackers (see above).

    Args:
        run: ``watch``'s ``run``: None (a new run folder under ``config.run_dir``), a folder, an open
            run writer, or False (no store).
        sink_objects: the sink objects given in ``report_to`` (the names are in the config).
    """

    def __init__(self, run: Any, sink_objects: list[Any]) -> None:
        self.run = run
        self.sink_objects = sink_objects
        self.writer: Any = None  # the run writer (the session's, or one the caller opened), or None
        self.run_dir: Path | None = None
        self.owns_writer = False  # the session opened the writer (and closes it)
        self.hub: Any = None  # the sinks' hub (report_to), fed by the run writer's thread

    def open(self, config: DebugConfig, name: str, rank: int, world_size: int, has_pg: bool) -> None:
        """Open the run folder (``name``: the run's name unless the config gives one); a folder that
        cannot be created is a warning, and the session records nothing."""
        run = self.run
        if run is False or (run is None and not config.store):
            return
        if run is not None and hasattr(run, "log_scalars"):
            self.writer = run
        else:
            try:
                from ..store import create_run
            except ImportError:
                return
            root = os.fspath(run) if run is not None else config.run_dir
            try:
                self.writer = _distributed.create_run_for(
                    create_run, root, config.run_name or name, config.to_dict(), rank, world_size, has_pg
                )
            except (OSError, RunStoreError) as exc:
                # recording is a convenience: training goes on without a run folder
                warn_at_user(
                    TorchDebugWarning(
                        f"torchdebug: cannot create a run under {root!r} ({exc}); recording is off for this "
                        "session. Pass run=<writable folder> or run=False."
                    )
                )
                return
            self.owns_writer = True
        self.run_dir = Path(self.writer.path) if getattr(self.writer, "path", None) is not None else None

    def open_sinks(self, config: DebugConfig, name: str, rank: int) -> None:
        """Start the trackers of ``report_to`` / ``tensorboard``: they hear the run writer's batches."""
        if not (config.report_to or config.tensorboard or self.sink_objects) or rank != 0:
            return  # rank 0 reports the run; the other ranks' records stay in their run files
        if self.writer is None or not hasattr(self.writer, "add_listener"):
            warn_at_user(
                TorchDebugWarning("torchdebug: no run folder, so report_to sends nothing this session")
            )
            return
        from ..sinks import RunInfo, SinkHub, build_sinks

        info = RunInfo(
            name=str(getattr(self.writer, "name", None) or name),
            run_id=getattr(self.writer, "run_id", None),
            path=self.run_dir,
            config=config.to_dict(),
        )
        hub = SinkHub(build_sinks(config.report_to, self.sink_objects, config.tensorboard), info)
        self.writer.add_listener(hub.feed)
        self.hub = hub
        if hub.pending:
            hub.warn(stacklevel=5)  # a tracker that could not start

    def close(self, status: str, last_step: int | None) -> None:
        """The session ends: the run folder and the trackers get its status (never raises)."""
        if self.writer is not None and self.owns_writer:
            with contextlib.suppress(Exception):
                self.writer.close(status=status)
        if self.hub is not None:
            hub, self.hub = self.hub, None
            if not self.owns_writer:
                with contextlib.suppress(Exception):
                    self.writer.flush()  # the listener has what was logged
                self.writer.remove_listener(hub.feed)
            with contextlib.suppress(Exception):
                lost = getattr(self.writer, "lost", 0)  # records the store could not write
                hub.close(status, last_step, lost)

    def flush(self) -> None:
        """Flush the run store (before raising: what led to the error is on disk)."""
        if self.writer is not None:
            with contextlib.suppress(Exception):
                self.writer.flush()

    def log_scalars(self, step: int, values: Mapping[str, float]) -> None:
        if self.writer is not None:
            self.writer.log_scalars(step, dict(values))


__all__ = ["Recording"]

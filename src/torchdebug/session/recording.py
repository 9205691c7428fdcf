"""Where a watch session records: its run folder (the run store's writer) and the trackers of
``report_to``, opened as the session starts and closed as it ends. A base class of
:class:`~torchdebug.session.monitor.Monitor`; the attributes it uses are the session's."""

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
    """The session's run writer and trackers (see above)."""

    # the session's attributes these methods use (set in Monitor.__init__)
    config: DebugConfig
    model: Any
    rank: int
    world_size: int
    global_step: int
    writer: Any
    run_dir: Path | None
    _has_pg: bool
    _run_arg: Any
    _owns_writer: bool
    _hub: Any
    _sink_objects: list[Any]

    def warn_once(self, key: str, message: str) -> None:
        raise NotImplementedError

    def _open_store(self) -> None:
        run = self._run_arg
        self._owns_writer = False
        if run is False or (run is None and not self.config.store):
            return
        if run is not None and hasattr(run, "log_scalars"):
            self.writer = run
        else:
            try:
                from ..store import create_run
            except ImportError:
                return
            root = os.fspath(run) if run is not None else self.config.run_dir
            name = self.config.run_name or type(self.model).__name__.lower()
            cfg = self.config.to_dict()
            try:
                self.writer = _distributed.create_run_for(
                    create_run, root, name, cfg, self.rank, self.world_size, self._has_pg
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
            self._owns_writer = True
        self.run_dir = Path(self.writer.path) if getattr(self.writer, "path", None) is not None else None

    def _open_sinks(self) -> None:
        """Start the trackers of ``report_to`` / ``tensorboard``: they hear the run writer's batches."""
        cfg = self.config
        if not (cfg.report_to or cfg.tensorboard or self._sink_objects) or self.rank != 0:
            return  # rank 0 reports the run; the other ranks' records stay in their run files
        if self.writer is None or not hasattr(self.writer, "add_listener"):
            self.warn_once("sinks", "torchdebug: no run folder, so report_to sends nothing this session")
            return
        from ..sinks import RunInfo, SinkHub, build_sinks

        info = RunInfo(
            name=str(getattr(self.writer, "name", None) or type(self.model).__name__.lower()),
            run_id=getattr(self.writer, "run_id", None),
            path=self.run_dir,
            config=cfg.to_dict(),
        )
        hub = SinkHub(build_sinks(cfg.report_to, self._sink_objects, cfg.tensorboard), info)
        self.writer.add_listener(hub.feed)
        self._hub = hub
        if hub.pending:
            hub.warn(stacklevel=5)  # a tracker that could not start

    def _close_store(self, status: str) -> None:
        """The session ends: the run folder and the trackers get its status (never raises)."""
        if self.writer is not None and self._owns_writer:
            with contextlib.suppress(Exception):
                self.writer.close(status=status)
        if self._hub is not None:
            hub, self._hub = self._hub, None
            if not self._owns_writer:
                with contextlib.suppress(Exception):
                    self.writer.flush()  # the listener has what was logged
                self.writer.remove_listener(hub.feed)
            with contextlib.suppress(Exception):
                lost = getattr(self.writer, "lost", 0)  # records the store could not write
                hub.close(status, self.global_step - 1 if self.global_step else None, lost)

    def flush_store(self) -> None:
        """Flush the run store (before raising: what led to the error is on disk)."""
        if self.writer is not None:
            with contextlib.suppress(Exception):
                self.writer.flush()

    def log_scalars(self, values: Mapping[str, float], step: int | None = None) -> None:
        if self.writer is not None:
            self.writer.log_scalars(self.global_step if step is None else step, dict(values))

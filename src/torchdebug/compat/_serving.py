"""What ``td.serve()`` accepts as a live session: a ``Monitor``, or the seed's ``TrainingDebugger`` seen as one."""

from __future__ import annotations

from typing import Any

from .._config import DebugLevel


class TrainingDebuggerSession:
    """A ``TrainingDebugger`` seen through the live-session surface the dashboard's seed endpoints read.

    ``training_summary()`` is the debugger's ``get_training_summary()``; ``anomalies`` its NaN/Inf
    records; ``events`` the rule events of the operations still in its (bounded) history;
    ``set_level`` and ``clear`` act on the debugger (``clear`` is ``clear_debug_history``). It has
    no run folder: the run pages list nothing, the seed endpoints answer from the debugger.
    """

    run_dir = None

    def __init__(self, debugger: Any) -> None:
        self.debugger = debugger

    @property
    def global_step(self) -> int:
        return int(self.debugger.total_steps)

    @property
    def anomalies(self) -> list[Any]:
        return list(self.debugger.anomalies)

    @property
    def events(self) -> list[Any]:
        # list() of a deque is one C call under the GIL: a step appending meanwhile cannot break it
        return [e for info in list(self.debugger.debug_history) for e in list(info.events)]

    @property
    def diffusion_debugger(self) -> Any:
        return getattr(self.debugger, "diffusion_debugger", None)

    def training_summary(self) -> dict[str, Any]:
        return dict(self.debugger.get_training_summary())

    def set_level(self, level: DebugLevel | str) -> DebugLevel:
        return self.debugger.set_level(level)  # type: ignore[no-any-return]

    def clear(self) -> None:
        self.debugger.clear_debug_history()


__all__ = ["TrainingDebuggerSession"]

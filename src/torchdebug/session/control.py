"""Live control of a watch session: the dashboard's level switch, ``reconfigure`` (and the seed-era
runtime switches over it), the history segments of ``clear``, and how a session reads in a notebook.

A member of :class:`~torchdebug.session.monitor.Monitor` (``mon.controls``). A switch asked for from
any thread (the dashboard's) is held here and taken by the session at the end of the next step, on
the training thread; what it needs of the session (the config, the writer, the step) is handed in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .._config import DebugConfig, DebugLevel
from .._verdict import COLOURS, judge
from ..events import Anomaly, RuleEvent, html_table, rule_counts, training_summary


class Controls:
    """The live switches asked for and not yet applied, and the history segment (see above)."""

    def __init__(self) -> None:
        self.pending_level: DebugLevel | None = None  # set_level() from any thread, applied in step()
        self.pending_changes: dict[str, Any] = {}  # reconfigure() from any thread, applied in step()
        self.level_overrides: list[str] = []  # every level asked for, in order
        self.segment_start = 0  # the step the current history segment (dashboard "clear") began

    def set_level(self, level: str | DebugLevel, writer: Any, step: int) -> DebugLevel:
        """Hold a level switch for the end of the next step, recorded as a ``level_change`` event.
        Raises ``ValueError`` for an unknown level, listing the allowed."""
        lv = DebugLevel(level) if not isinstance(level, DebugLevel) else level
        self.pending_level = lv
        self.level_overrides.append(lv.value)
        if writer is not None:
            writer.log_event(
                step, "level_change", "info", f"debug level set to {lv.value}", {"level": lv.value}
            )
        return lv

    def reconfigure(
        self, config: DebugConfig, changes: dict[str, Any], writer: Any, step: int
    ) -> DebugConfig:
        """Hold option changes for the end of the next step (validated now: ``ConfigError`` naming the
        option), recorded as a ``config_change`` event; returns the config the session will run with."""
        new = config.replace(**{**self.pending_changes, **changes})
        self.pending_changes.update(changes)
        if writer is not None:
            with contextlib.suppress(Exception):
                writer.log_event(
                    step,
                    "config_change",
                    "info",
                    "options changed: " + ", ".join(f"{k}={v!r}" for k, v in sorted(changes.items())),
                    {"changes": {k: getattr(v, "value", v) for k, v in changes.items()}},
                )
        return new

    def take(self) -> tuple[DebugLevel | None, dict[str, Any]]:
        """The level and the changes held (None, {}: nothing), no longer held."""
        level, self.pending_level = self.pending_level, None
        changes, self.pending_changes = self.pending_changes, {}
        return level, changes

    def new_segment(self, writer: Any, step: int) -> None:
        """A new history segment begins at ``step`` (the dashboard's "clear"); nothing stored is deleted."""
        if writer is not None and hasattr(writer, "start_segment"):
            writer.start_segment(f"cleared at step {step}", step=step)
        self.segment_start = step

    def summary(self, step: int, anomalous_steps: int, kinds: Iterable[str]) -> dict[str, Any]:
        """The seed-era training summary of the segment so far (``kinds``: its rule events' kinds)."""
        explosions, vanishing, loss = rule_counts(kinds)
        return training_summary(
            max(step - self.segment_start, 0), anomalous_steps, explosions, vanishing, loss
        )


def describe(
    status: str, step: int, anomalies: list[Anomaly], events: Iterable[RuleEvent], run_dir: Path | None
) -> str:
    """A session in one line (its ``repr``): status, step, anomalies, warnings, run folder."""
    n, warned = len(anomalies), [e for e in events if e.severity != "info"]
    where = f", run {run_dir}" if run_dir is not None else ""
    return (
        f"<Monitor {status}: step {step}, {n} anomal{'y' if n == 1 else 'ies'}, "
        f"{len(warned)} warning{'' if len(warned) == 1 else 's'}{where}>"
    )


def describe_html(
    model: str,
    said: dict[str, Any],
    status: str,
    step: int,
    anomalies: list[Anomaly],
    events: Iterable[RuleEvent],
    run_dir: Path | None,
) -> str:
    """The session in a notebook: its verdict (``said``: :func:`verdict`'s), status, step, the first
    anomaly, the warnings so far, the run folder."""
    n, warned = len(anomalies), [e for e in events if e.severity != "info"]
    rows: list[tuple[str, Any]] = [
        ("verdict", said["text"]),
        ("status", status),
        ("step", step),
        ("anomalies", n if n == 0 else f"{n}, first: {anomalies[0].summary()}"),
        (
            "warnings",
            len(warned) if not warned else f"{len(warned)}: {', '.join(sorted({e.kind for e in warned}))}",
        ),
        ("run folder", run_dir if run_dir is not None else "none"),
    ]
    return html_table(f"torchdebug watch of {model}", COLOURS[said["level"]], rows, "torchdebug-monitor")


def verdict(status: str, step: int, anomalies: list[Anomaly], events: Iterable[RuleEvent]) -> dict[str, Any]:
    """A session's verdict, ranked as ``torchdebug show`` ranks a run's (the same function,
    ``torchdebug._verdict.judge``, over the session's anomalies and rule events).

    Returns:
        ``judge``'s dict: ``"text"`` (one sentence: ``"running: step 12, no anomalies so far"``,
        ``"finished: 30 steps, no anomalies"``, ``"failed at step 6: nan born in ..."``),
        ``"level"`` (ok | running | warning | error) and ``"findings"`` ranked.

    Example:
        >>> import torch, torchdebug as td
        >>> model = torch.nn.Linear(2, 1)
        >>> with td.watch(model, run=False, announce=False) as mon:
        ...     for _ in range(2):
        ...         model(torch.ones(1, 2)).sum().backward()
        ...         _ = mon.step()
        >>> mon.verdict()["text"]
        'finished: 2 steps, no anomalies'
    """

    found = [{**a.to_dict(), "step": a.step} for a in anomalies]
    said = [
        {
            "kind": e.kind,
            "severity": e.severity,
            "message": e.message,
            "step": e.step,
            "data": {"modules": list(e.modules), "evidence": dict(e.evidence)},
        }
        for e in events
    ]
    last = step - 1 if step else None
    return judge(status, steps=step, last_step=last, anomalies=found, events=said)


__all__ = ["Controls", "describe", "describe_html", "verdict"]

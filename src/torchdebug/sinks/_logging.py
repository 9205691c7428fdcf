"""The ``logging`` sink: findings and the verdict as records of the ``torchdebug`` logger."""

from __future__ import annotations

import logging

from ._hub import Sink
from ._records import Finding, RunEnd, RunInfo, Scalars

LOGGER_NAME = "torchdebug"
_LEVELS = {"info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class LoggingSink(Sink):
    """Logs to ``logging.getLogger("torchdebug")`` (or ``logger=``), so a service routes findings
    with its own handlers.

    One record per episode (one incident: the same origin or rule, ``_episodes.py``), not per step
    of it; the verdict at the end counts them all. The logger gets a ``NullHandler`` when it has
    none, so without a handler of yours nothing reaches stderr through logging's last-resort
    handler (a handler on the root logger, ``logging.basicConfig``, still gets every record).

    Levels: an anomaly is ERROR (the message is the full block), a rule event at its severity
    (INFO / WARNING / ERROR), the run's end INFO (ERROR when it failed), each step's scalars DEBUG
    (built only when DEBUG is enabled). Every record carries ``record.torchdebug``, a dict with
    ``record`` (``anomaly`` | ``event`` | ``scalars`` | ``end``), ``step`` and the fields (the anomaly's
    ``kind``/``phase``/``module``/``op``/``line``/``headline``; ``status``, ``verdict``,
    ``run_folder``), for a JSON formatter.

    Example::

        logging.getLogger("torchdebug").addHandler(my_handler)
        with td.watch(model, opt, report_to=["logging"]) as mon: ...
    """

    name = "logging"

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self.logger = logger if logger is not None else logging.getLogger(LOGGER_NAME)
        if not self.logger.handlers:  # a library's logger: silent unless the user configured logging
            self.logger.addHandler(logging.NullHandler())

    def open(self, run: RunInfo) -> None:
        self.run = run

    def scalars(self, rec: Scalars) -> None:
        if self.logger.isEnabledFor(logging.DEBUG):
            text = ", ".join(f"{k.removeprefix('torchdebug/')}={v:.6g}" for k, v in rec.values.items())
            extra = {"record": "scalars", "step": rec.step, "values": dict(rec.values)}
            self.logger.debug("step %s: %s", rec.step, text, extra={"torchdebug": extra})

    def finding(self, rec: Finding) -> None:
        fields = {
            "record": rec.kind,
            "step": rec.step,
            "kind": rec.name,
            "headline": rec.headline,
            "episode": rec.episode,
        }
        if rec.kind == "anomaly":
            fields.update(rec.where())
        else:
            fields["severity"] = rec.severity
        self.logger.log(
            _LEVELS.get(rec.severity, logging.WARNING), "%s", rec.text(), extra={"torchdebug": fields}
        )

    def finish(self, end: RunEnd) -> None:
        fields = {
            "record": "end",
            "step": end.last_step,
            "status": end.status,
            "verdict": end.verdict,
            "run_folder": str(end.path) if end.path is not None else None,
        }
        where = f" (run folder {end.path})" if end.path is not None else ""
        level = logging.ERROR if end.status == "failed" else logging.INFO
        self.logger.log(level, "torchdebug run %s%s", end.verdict, where, extra={"torchdebug": fields})

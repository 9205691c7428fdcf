"""The Weights & Biases sink: scalars against ``torchdebug/step``, an alert per episode (one incident:
the same origin or rule) and for a failed run, a table of episodes and the verdict in the run summary. Needs ``pip install 'torchdebug[wandb]'``."""

from __future__ import annotations

from typing import Any

from ._episodes import EpisodeEnd, episode_title
from ._hub import Sink
from ._records import (
    FINDING_COLUMNS,
    FINDINGS,
    RUN_FOLDER,
    STATUS,
    STEP,
    VERDICT,
    Finding,
    RunEnd,
    RunInfo,
    Scalars,
)

WANDB_EXTRA = "pip install 'torchdebug[wandb]'"
#: seconds W&B waits before it sends another alert with the same title (an incident that recurs)
ALERT_WAIT_S = 600
#: the findings table: one row per episode, its first record's columns, then how many and the last step
TABLE_COLUMNS = (*FINDING_COLUMNS, "count", "last_step")


def import_wandb() -> Any:
    try:
        import wandb
    except ImportError as e:
        raise ImportError(f"the W&B sink needs wandb: {WANDB_EXTRA}") from e
    return wandb


class WandbSink(Sink):
    """Sends the run to W&B: into ``wandb.run`` when one is open (or ``run=``), else a run it opens
    (``wandb.init(name=<run name>)``; ``WANDB_PROJECT``, ``WANDB_MODE`` ... apply) and finishes.

    What lands where: every scalar under ``torchdebug/...`` with ``torchdebug/step`` as its x axis
    (``define_metric``), so torchdebug's steps never move your own ``wandb.log`` step; an alert
    (``wandb.alert``, level ERROR) per anomaly episode (196 NaN steps of one origin: one alert) with
    a title that names the incident, not the step (``torchdebug: nan in act (LogAct)``, so W&B
    folds a recurrence within ``ALERT_WAIT_S``), and one when the run failed; at the end a
    ``torchdebug/findings`` table, one row per episode (step, record, kind, severity, headline,
    phase, module, op, line of its first record, then count and last_step) and summary fields ``torchdebug/status``, ``torchdebug/verdict``, ``torchdebug/run_folder``,
    ``torchdebug/first_anomaly/headline`` (``.../phase``, ``.../module``, ``.../op``, ``.../line``).

    Cost: one ``run.log`` per step on the sink's thread (W&B queues it to its own service).
    """

    name = "wandb"

    def __init__(self, run: Any = None, **init_kwargs: Any) -> None:
        self.run = run
        self.init_kwargs = init_kwargs
        self._owns = False
        self._wandb: Any = None
        self._rows: dict[int, list[Any]] = {}  # episode -> row
        self._first: str | None = None

    setup_hint = "log in with `wandb login` (or set WANDB_API_KEY; WANDB_MODE=offline writes locally)"

    def open(self, run: RunInfo) -> None:
        wandb = self._wandb = import_wandb()
        if self.run is None:
            self.run = wandb.run
        if self.run is None:
            kwargs = {"name": run.name, **self.init_kwargs}
            self.run = wandb.init(**kwargs)
            self._owns = True
        self.run.define_metric(STEP, hidden=True)
        self.run.define_metric("torchdebug/*", step_metric=STEP)

    def scalars(self, rec: Scalars) -> None:
        self.run.log({**rec.values, STEP: rec.step})

    def finding(self, rec: Finding) -> None:
        self._rows[rec.episode or -len(self._rows) - 1] = [*rec.row(), 1, rec.step]
        if rec.kind == "anomaly":
            if self._first is None:
                self._first = rec.headline
                for k, v in rec.first_anomaly_fields().items():
                    self.run.summary[k] = v
            self.run.alert(
                title=episode_title(rec),
                text=rec.text(),
                level=self._wandb.AlertLevel.ERROR,
                wait_duration=ALERT_WAIT_S,
            )

    def episode_end(self, end: EpisodeEnd) -> None:
        row = self._rows.get(end.number)
        if row is not None:
            row[-2:] = [end.count, end.last_step]

    def finish(self, end: RunEnd) -> None:
        wandb, run = self._wandb, self.run
        run.log({FINDINGS: wandb.Table(columns=list(TABLE_COLUMNS), data=list(self._rows.values()))})
        run.summary[STATUS] = end.status
        run.summary[VERDICT] = end.verdict
        if end.path is not None:
            run.summary[RUN_FOLDER] = str(end.path)
        if end.status == "failed":
            where = f"\nrun folder: {end.path}" if end.path is not None else ""
            run.alert(
                title="torchdebug: the run failed", text=end.verdict + where, level=wandb.AlertLevel.ERROR
            )

    def release(self, end: RunEnd) -> None:
        if self._owns and self.run is not None:
            self.run.finish(exit_code=1 if end.status == "failed" else 0)

"""The MLflow sink: metrics, tags for the status and the first anomaly, one JSON artifact per anomaly
episode (one incident: the same origin). Needs ``pip install 'torchdebug[mlflow]'`` (mlflow-skinny; the full ``mlflow`` works too)."""

from __future__ import annotations

import re
import time
from typing import Any

from ._episodes import EpisodeEnd
from ._hub import Sink
from ._records import RUN_FOLDER, STATUS, VERDICT, Finding, RunEnd, RunInfo, Scalars

MLFLOW_EXTRA = "pip install 'torchdebug[mlflow]'"
_BATCH = 1000  # MLflow's limit of metrics per log_batch call
_UNSAFE = re.compile(r"[^/\w.\- ]")  # what MLflow accepts in a metric or tag name


def import_mlflow() -> Any:
    try:
        import mlflow
    except ImportError as e:
        raise ImportError(f"the MLflow sink needs mlflow: {MLFLOW_EXTRA}") from e
    return mlflow


CONNECT_TIMEOUT = 5.0  # seconds the sink's thread waits for the tracking server to accept


def _reachable(uri: str) -> None:
    """RuntimeError when an http(s) tracking server does not accept a connection within
    ``CONNECT_TIMEOUT`` (MLflow's own client would retry with backoff for minutes). Through a proxy,
    or for a local store, nothing is probed."""
    import socket
    import urllib.parse
    import urllib.request

    parts = urllib.parse.urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    if urllib.request.getproxies().get(parts.scheme) and not urllib.request.proxy_bypass(parts.hostname):
        return
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=CONNECT_TIMEOUT).close()
    except OSError as exc:
        raise RuntimeError(
            f"MLflow tracking server {uri} did not answer a connection within {CONNECT_TIMEOUT:g} s "
            f"({exc.strerror or exc}); check MLFLOW_TRACKING_URI and that the server runs"
        ) from None


def _key(name: str) -> str:
    return _UNSAFE.sub("_", name)


def _local_store_hint() -> str:
    """The second fix, only when it applies: mlflow-skinny (the ``[mlflow]`` extra) has no local
    SQLite store, MLflow 3's default tracking URI; the full ``mlflow`` package has one."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("mlflow")
    except PackageNotFoundError:
        return (
            ", or pip install mlflow (the full package) for MLflow 3's local SQLite store: "
            "torchdebug[mlflow] installs mlflow-skinny, which has none"
        )
    return ""


class MlflowSink(Sink):
    """Sends the run to MLflow: into the active run when there is one (or ``run_id=``), else a run it
    starts (``mlflow.start_run(run_name=<run name>)`` in the tracking URI and experiment the MLflow
    environment names) and ends with the run's status.

    What lands where: every scalar as a metric ``torchdebug/...`` at its step; tags
    ``torchdebug/status``, ``torchdebug/verdict``, ``torchdebug/run_folder`` and, at the first anomaly,
    ``torchdebug/first_anomaly/headline``, ``.../phase``, ``.../module``, ``.../op``, ``.../line``; the first
    anomaly document of each episode (196 NaN steps of one origin: one) as the artifact
    ``torchdebug/anomaly-step<N>.json``; one entry per episode (its first record, ``count``,
    ``last_step``) in ``torchdebug/findings.json`` at the end.

    Cost: one ``log_batch`` call per batch of records (every 32 steps, at the latest every 2 s) on the sink's thread.
    """

    name = "mlflow"

    def __init__(self, run_id: str | None = None, *, client: Any = None) -> None:
        self.run_id = run_id
        self.client = client
        self._started = False
        self._mlflow: Any = None
        self._pending: list[Any] = []
        self._findings: dict[int, dict[str, Any]] = {}  # episode -> entry
        self._first = False
        self._name = "run"

    def open(self, run: RunInfo) -> None:
        """The owner thread: the active MLflow run, if any (no network; the run is started in
        :meth:`start`, on the sink's thread, so an unreachable server never holds up training)."""
        mlflow = self._mlflow = import_mlflow()
        self._name = run.name
        if self.run_id is None:
            active = mlflow.active_run()
            if active is not None:
                self.run_id = active.info.run_id

    def start(self) -> None:
        """The sink's thread: reach the server (``CONNECT_TIMEOUT``), then start a run when there is
        none, as ``mlflow.start_run`` would (the experiment and tags it resolves)."""
        mlflow = self._mlflow
        uri = mlflow.get_tracking_uri()
        _reachable(uri)
        try:
            if self.client is None:
                self.client = mlflow.MlflowClient()
            if self.run_id is None:
                from mlflow.tracking.context.registry import resolve_tags
                from mlflow.tracking.fluent import _get_experiment_id

                created = self.client.create_run(
                    _get_experiment_id(), run_name=self._name, tags=resolve_tags({})
                )
                self.run_id = created.info.run_id
                self._started = True
        except Exception as exc:  # e.g. mlflow-skinny has no local SQLite store (MLflow 3's default)
            raise RuntimeError(
                f"MLflow could not start a run at {uri!r} ({exc}); set "
                f"MLFLOW_TRACKING_URI to your tracking server{_local_store_hint()}"
            ) from exc

    def scalars(self, rec: Scalars) -> None:
        from mlflow.entities import Metric

        ms = int((rec.wall_time if rec.wall_time is not None else time.time()) * 1000)
        self._pending += [Metric(_key(k), float(v), ms, rec.step) for k, v in rec.values.items()]

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        for i in range(0, len(pending), _BATCH):
            self.client.log_batch(self.run_id, metrics=pending[i : i + _BATCH])

    def finding(self, rec: Finding) -> None:
        entry = {"step": rec.step, "record": rec.kind, "headline": rec.headline, **dict(rec.doc)}
        self._findings[rec.episode or -len(self._findings) - 1] = {**entry, "count": 1, "last_step": rec.step}
        if rec.kind != "anomaly":
            return
        if not self._first:
            self._first = True
            self._tags(rec.first_anomaly_fields())
        self.client.log_dict(self.run_id, dict(rec.doc), f"torchdebug/anomaly-step{rec.step}.json")

    def episode_end(self, end: EpisodeEnd) -> None:
        entry = self._findings.get(end.number)
        if entry is not None:
            entry.update(count=end.count, last_step=end.last_step)

    def _tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(_key(k), v[:5000]) for k, v in tags.items()])

    def finish(self, end: RunEnd) -> None:
        self.flush()
        tags = {STATUS: end.status, VERDICT: end.verdict}
        if end.path is not None:
            tags[RUN_FOLDER] = str(end.path)
        self._tags(tags)
        if self._findings:
            findings = {"findings": list(self._findings.values())}
            self.client.log_dict(self.run_id, findings, "torchdebug/findings.json")

    def release(self, end: RunEnd) -> None:
        if not self._started:
            return
        status = "FAILED" if end.status == "failed" else "FINISHED"
        self.client.set_terminated(self.run_id, status=status)  # the run start() created

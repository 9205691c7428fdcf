"""What the framework callbacks forward to the framework's own loggers: the step's scalars under the
trackers' ``torchdebug/...`` names, the step's findings, and the verdict (see ``torchdebug.sinks``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..events import Anomaly, RuleEvent
from ..sinks import Finding, RunEnd
from ..sinks._records import Tally, event_tag, metric_tag

if TYPE_CHECKING:
    from ..session.monitor import Monitor

#: the marker metric logged (1.0) at an anomaly's step; a rule event's is ``torchdebug/events/<kind>``
ANOMALY_MARK = "torchdebug/anomaly"


def tagged(scalars: dict[str, float]) -> dict[str, float]:
    """A step's stored scalars under their tracker names: ``loss`` -> ``torchdebug/loss``."""
    return {metric_tag(k): v for k, v in scalars.items()}


def anomaly_finding(a: Anomaly) -> Finding:
    return Finding("anomaly", a.step, a.to_dict())


def event_finding(e: RuleEvent) -> Finding:
    data = {"modules": list(e.modules), "evidence": dict(e.evidence)}
    doc = {"kind": e.kind, "severity": e.severity, "message": e.message, "data": data}
    return Finding("event", e.step, doc)


def step_findings(record: Any) -> list[Finding]:
    """The findings of one ``StepRecord``: its rule events, then its anomaly."""
    out = [event_finding(e) for e in record.events]
    if record.anomaly is not None:
        out.append(anomaly_finding(record.anomaly))
    return out


def marks(findings: list[Finding]) -> dict[str, float]:
    """Marker metrics for loggers that take only numbers: 1.0 under ``torchdebug/anomaly`` and
    ``torchdebug/events/<kind>``."""
    return {(ANOMALY_MARK if f.kind == "anomaly" else event_tag(f.name)): 1.0 for f in findings}


def run_end(mon: Monitor, status: str) -> RunEnd:
    """How the session ended, from what it kept in memory (anomalies, rule events)."""
    tally = Tally()
    found = [event_finding(e) for e in mon.events] + [anomaly_finding(a) for a in mon.anomalies]
    found.sort(key=lambda f: -1 if f.step is None else f.step)
    for f in found:
        tally.see(f)
    last = mon.global_step - 1 if mon.global_step else None
    if last is not None and (tally.last_step is None or last > tally.last_step):
        tally.last_step = last
    tally.steps = mon.global_step  # every completed step stores its metrics (loss, gradient norm ...)
    tally.lost = int(getattr(mon.writer, "lost", 0) or 0)  # no writer (store=False): nothing lost
    return tally.end(status, mon.run_dir)

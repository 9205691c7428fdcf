"""A run's verdict: its status and the most important finding in one sentence, and repeated anomalies grouped.

One pure function (:func:`judge`) over what the store reads back, so ``torchdebug show``, the text,
JSON and HTML reports and the dashboard all say the same thing. :func:`verdict` reads a ``Run`` and
calls it.

Order of importance: a NaN/Inf (the first one's origin), then a loss divergence that did not
recover, then other error or warning rule events; a run with none of them is ``ok``. The level is
what a view colours: ``ok`` (green) only for a finished run with no anomaly, no divergence and no
warning; ``running`` while the writer is open.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

LEVELS = ("ok", "running", "warning", "error")
DIVERGENCE = "divergence"
DIVERGENCE_END = "divergence_end"
SPIKE_REPORT = "spike_report"  # the loss-spike forensics' report (session/rollback.py)
# Anomaly.summary()'s trailing "(step 7)" or "(step 7, born on rank 1 of 2)": the step goes, the rank stays
_WHEN = re.compile(r" \(step -?\d+(?:, ([^)]*))?\)$")


def _num(x: Any) -> str:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return str(x)
    return f"{x:.3g}"


def anomaly_text(a: Mapping[str, Any]) -> str:
    """An anomaly's one-line origin without its trailing ``(step N)``:
    ``nan born in forward of fc2 (Linear): aten.addmm at train.py:42``."""
    text = a.get("summary")
    if not isinstance(text, str) or not text:
        where = a.get("parameter") or a.get("module") or "?"
        text = f"{a.get('kind', 'anomaly')} in {a.get('phase', '?')} of {where}"
        if a.get("op"):
            text += f": {a['op']}"
    return _WHEN.sub(lambda m: f" ({m.group(1)})" if m.group(1) else "", text)


def _hashable(x: Any) -> Any:
    """A field as a dict key: plain values as they are, anything else (a document altered by hand) as its repr."""
    return x if x is None or isinstance(x, (str, int, float, bool)) else repr(x)


def group_key(a: Mapping[str, Any]) -> tuple[Any, ...]:
    """What makes two anomalies "the same": their traced origin (phase, module, parameter, op, line)
    when there is one, else their symptom (what was non-finite) and phase."""
    return tuple(_hashable(x) for x in _group_fields(a))


def _group_fields(a: Mapping[str, Any]) -> tuple[Any, ...]:
    if a.get("module") is not None or a.get("op") or a.get("location"):
        return (
            "origin",
            a.get("kind"),
            a.get("phase"),
            a.get("module"),
            a.get("parameter"),
            a.get("op"),
            a.get("location"),
        )
    return ("symptom", a.get("kind"), a.get("phase"), a.get("symptom"), a.get("reproducible"))


def group_anomalies(anomalies: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Anomalies with the same origin or symptom folded into one group, in order of first appearance.

    Each group: ``{"anomaly": the first document, "count", "first_step", "last_step", "steps": the
    distinct steps (sorted)}``.

    Example: 788 NaN steps born at the same op -> one group with ``count == 788``.
    """
    groups: dict[tuple[Any, ...], dict[str, Any]] = {}
    for a in anomalies:
        key = group_key(a)
        step = a.get("step") if isinstance(a.get("step"), int) else None
        g = groups.get(key)
        if g is None:
            g = groups[key] = {
                "anomaly": dict(a),
                "count": 0,
                "first_step": step,
                "last_step": step,
                "steps": set(),
            }
        g["count"] += 1
        if step is not None:
            g["steps"].add(step)
            g["first_step"] = step if g["first_step"] is None else min(g["first_step"], step)
            g["last_step"] = step if g["last_step"] is None else max(g["last_step"], step)
    out = []
    for g in groups.values():
        g["steps"] = sorted(g["steps"])
        out.append(g)
    return out


def divergences(events: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Loss divergence episodes from the rule events: ``{"step", "before", "after", "metric",
    "recovered_step" (None: did not recover)}``, in order."""
    out: list[dict[str, Any]] = []
    for e in events:
        kind = e.get("kind")
        if kind not in (DIVERGENCE, DIVERGENCE_END):
            continue
        raw = e.get("data")
        data: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
        inner = data.get("evidence")
        ev: Mapping[str, Any] = inner if isinstance(inner, Mapping) else data
        if kind == DIVERGENCE:
            step = ev.get("since_step", e.get("step"))
            out.append(
                {
                    "step": step,
                    "metric": ev.get("metric", "loss"),
                    "before": ev.get("before"),
                    "after": ev.get("after"),
                    "recovered_step": None,
                }
            )
        elif out and out[-1]["recovered_step"] is None:
            out[-1]["recovered_step"] = e.get("step")
    return out


def _divergence_text(d: Mapping[str, Any]) -> str:
    change = f"{d['metric']} {_num(d['before'])} -> {_num(d['after'])}"
    if d["recovered_step"] is None:
        return f"diverged at step {d['step']}: {change} and did not recover"
    return f"diverged at step {d['step']} ({change}), recovered by step {d['recovered_step']}"


def lead_event(loud: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The warning or error event a verdict leads with: the first error, else the first warning; a
    loss spike's report at that step comes first (its cause, ``batch: rows 3, 17``, explains the
    gradient explosion or the loss jump the rules saw at that step, and their advice does not)."""
    e = next((x for x in loud if x.get("severity") == "error"), loud[0])
    if e.get("kind") == SPIKE_REPORT or e.get("severity") == "error":
        return e
    return next((x for x in loud if x.get("kind") == SPIKE_REPORT and x.get("step") == e.get("step")), e)


def judge(
    status: str,
    *,
    steps: int,
    last_step: int | None,
    anomalies: Sequence[Mapping[str, Any]],
    events: Sequence[Mapping[str, Any]],
    lost: int = 0,
    anomaly_steps: int | None = None,
    loud_events: int | None = None,
) -> dict[str, Any]:
    """The verdict of a run from what the store holds (pure: same input, same sentence).

    Args:
        status: ``meta.json``'s status (``running | finished | failed``, or ``unreadable``...).
        steps: distinct steps with metrics; ``last_step``: the last step recorded (None: none).
        anomalies, events: ``run.anomalies()`` / ``run.events()``.
        lost: records the writer could not store (the run is incomplete).
        anomaly_steps, loud_events: when ``anomalies`` / ``events`` are a bounded sample (the
            trackers' tally of a live run), the exact number of distinct steps with an anomaly and of
            warning/error events other than divergences; None: counted from the lists.

    Returns:
        ``{"status", "level": ok|running|warning|error, "text": one sentence, "groups":
        group_anomalies(anomalies), "anomaly_steps": distinct steps with an anomaly,
        "divergences": divergences(events)}``.

    Example:
        >>> judge("finished", steps=2000, last_step=1999, anomalies=[], events=[])["text"]
        'finished: 2000 steps, no anomalies'
    """
    groups = group_anomalies(anomalies)
    bad_steps = sorted({a["step"] for a in anomalies if isinstance(a.get("step"), int)})
    n_bad = len(bad_steps) if anomaly_steps is None else anomaly_steps
    divs = divergences(events)
    open_divs = [d for d in divs if d["recovered_step"] is None]
    loud = [
        e
        for e in events
        if e.get("severity") in ("warning", "error") and e.get("kind") not in (DIVERGENCE, DIVERGENCE_END)
    ]
    errors = [e for e in loud if e.get("severity") == "error"]
    n_loud = len(loud) if loud_events is None else loud_events

    findings: list[str] = []  # the most important first
    level = "ok"
    nan_first: str | None = None  # "at step 6: nan born in ..." (the failure's own sentence)
    if anomalies:
        # the earliest step's anomaly (the first logged among equals): where the trouble began
        first = min(anomalies, key=lambda a: a["step"] if isinstance(a.get("step"), int) else math.inf)
        origin = anomaly_text(first)
        first_step = first.get("step")
        nan_first = origin if first_step is None else f"at step {first_step}: {origin}"
        if n_bad > 1:
            findings.append(f"{n_bad} steps with non-finite values, first at step {first_step}: {origin}")
        else:
            findings.append(f"non-finite values {nan_first}")
        level = "error"
    if divs:
        findings.append(_divergence_text((open_divs or divs)[0]))
        level = "error" if level == "error" else "warning"
    if not findings and loud:
        e = lead_event(loud)
        more = f" (and {n_loud - 1} more)" if n_loud > 1 else ""
        findings.append(f"{e.get('kind')} at step {e.get('step')}: {e.get('message')}{more}")
        level = "error" if errors else "warning"

    if status == "failed":
        level = "error"
        if nan_first is not None and (n_bad <= 1 or not nan_first.startswith("at step")):
            text = f"failed {nan_first}" if nan_first.startswith("at step") else f"failed: {nan_first}"
            rest = findings[1:]
        else:
            text = "failed" + (f" at step {last_step}" if last_step is not None else "")
            rest = findings or ["the training raised an exception (no NaN/Inf recorded)"]
            text += ": " + rest[0]
            rest = rest[1:]
        text += "".join(f"; {r}" for r in rest)
    elif status == "running":
        level = "running" if level == "ok" else level
        at = last_step if last_step is not None else 0
        text = f"running: step {at}, " + ("; ".join(findings) if findings else "no anomalies so far")
    elif findings:
        lead = "" if findings[0][0].isdigit() else "but "
        text = f"{status}, {lead}" + "; ".join(findings)
    else:
        text = f"{status}: {steps} steps, no anomalies"
        if status != "finished":  # unreadable or unknown: not a clean bill of health
            level = "warning"
    if lost:
        text += f"; incomplete: {lost} records lost"
        level = "error" if level == "error" else "warning"
    return {
        "status": status,
        "level": level,
        "text": text,
        "groups": groups,
        "anomaly_steps": n_bad,
        "divergences": divs,
    }


def verdict(run: Any) -> dict[str, Any]:
    """:func:`judge` over an open ``Run`` (its meta status, summary, anomalies and events).

    Example: ``verdict(open_run(path))["text"] == "finished: 2000 steps, no anomalies"``.
    Cost: one read of the anomaly and event tables and the store's summary counts.
    """
    s = run.summary()
    return judge(
        str(s["status"]),
        steps=int(s["steps"]),
        last_step=s["last_step"],
        anomalies=run.anomalies(),
        events=run.events(),
        lost=int(s.get("lost") or 0),
    )


__all__ = [
    "LEVELS",
    "anomaly_text",
    "divergences",
    "group_anomalies",
    "group_key",
    "judge",
    "lead_event",
    "verdict",
]

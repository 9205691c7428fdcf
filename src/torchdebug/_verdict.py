"""A run's verdict: its status and the most important finding in one sentence, and repeated anomalies grouped.

One pure function (`judge`) over what the store reads back, so ``torchdebug show`` and ``runs``,
the text, JSON and HTML reports, the dashboard, the trackers and the notebook reprs (a stored
``Run``'s, a live ``Monitor``'s, the verdict's own) all say the same thing. `verdict` reads a
``Run`` and calls it. It lives in the core, beside the records it reads, so the store (which knows
no view) and every view import the same function; ``torchdebug.views.verdict`` re-exports it.

Findings are ranked by severity and consequence, not by time (`RANKS`): a NaN/Inf (the first
one's origin), a loss divergence that did not recover, an error event (out of memory, a hang), a
loss spike that was rolled back or explained, a divergence that recovered, a training-health warning
(exploding gradients, ...), and last a throughput or resource hint (``input_bound``,
``slowdown``...). The sentence names the most important finding of each of the first classes
present, then counts the rest by kind (``also 6 input_bound, 1 update_ratio``). The level is what a
view colours: ``ok`` (green) only for a finished run with no finding a user must act on (no anomaly,
no divergence, no warning or error event; info events are not findings); ``running`` while the
writer is open.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .events import SEVERITY_COLOURS, html_table

LEVELS = ("ok", "running", "warning", "error")
#: What each level is coloured in a notebook: the reports' green, amber and red from
#: ``events.SEVERITY_COLOURS`` (a run still going with nothing found is green: nothing to act on yet).
COLOURS = {level: SEVERITY_COLOURS["ok" if level == "running" else level] for level in LEVELS}
DIVERGENCE = "divergence"
DIVERGENCE_END = "divergence_end"
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


#: A finding's class, most important first: what ruined the run, then what it recovered from, then
#: what slowed it. `RANKS` maps an event kind to its class; a kind not named there ranks by
#: its severity (``error``: ERROR_EVENT, ``warning``: HEALTH).
NONFINITE, OPEN_DIVERGENCE, ERROR_EVENT, SPIKE, RECOVERED, HEALTH, HINT = range(7)
RANKS: dict[str, int] = {
    # the same incident as a NaN/Inf record, seen by another rule: counted with it, never ahead of it
    "nonfinite_gradients": NONFINITE,
    "clip_nonfinite": NONFINITE,
    "lr_nonfinite": NONFINITE,
    # a spike rolled back changed the run; a spike report (on_spike="warn") explains a spike and leads
    # the health warnings (_FIRST_IN_CLASS): its cause, not the gradient rule's generic advice
    "rollback": SPIKE,
    "rollback_unavailable": SPIKE,
    # throughput and resource hints: worth knowing, never ahead of what went wrong with the training
    "input_bound": HINT,
    "slowdown": HINT,
    "straggler": HINT,
    "snapshot_cost": HINT,
    "device_mix": HINT,
    "flops_not_counted": HINT,
    "module_memory_not_measured": HINT,
    "profile": HINT,
}
# within a class these kinds come first (then by step): the cause before its echoes
_FIRST_IN_CLASS = ("spike_report", "rollback", "gradient_explosion", "loss_spike", "vanishing_gradient")
# a sentence names at most this many findings (each of a different class above HEALTH) before "also"
_SAID = 2

Found = tuple[int, str, str, Any, int, str]  # (rank, kind, level, step, count, text)


def event_rank(kind: Any, severity: Any) -> int:
    """The class of a warning or error rule event (a lower number is more important).

    Example: ``event_rank("input_bound", "warning") == HINT``, ``event_rank("hang", "error") == ERROR_EVENT``.
    """
    if isinstance(kind, str) and kind in RANKS:
        return RANKS[kind]
    return ERROR_EVENT if severity == "error" else HEALTH


def _event_order(e: Mapping[str, Any]) -> tuple[int, int, float]:
    kind = e.get("kind")
    first = _FIRST_IN_CLASS.index(kind) if kind in _FIRST_IN_CLASS else len(_FIRST_IN_CLASS)
    step = e.get("step")
    return (event_rank(kind, e.get("severity")), first, step if isinstance(step, int) else math.inf)


def _event_text(e: Mapping[str, Any]) -> str:
    at = f" at step {e.get('step')}" if e.get("step") is not None else ""
    message = "; ".join(str(e.get("message")).splitlines())  # one line (a hang's carries its verdict below)
    return f"{e.get('kind')}{at}: {message}"


def _findings(
    anomalies: Sequence[Mapping[str, Any]],
    n_bad: int,
    divs: list[dict[str, Any]],
    loud: list[Mapping[str, Any]],
    counts: Mapping[str, int],
) -> list[Found]:
    """Every finding, the most important first (stable within a class: the order given)."""
    found: list[Found] = []
    if anomalies:
        # the earliest step's anomaly (the first logged among equals): where the trouble began
        first = min(anomalies, key=lambda a: a["step"] if isinstance(a.get("step"), int) else math.inf)
        origin = anomaly_text(first)
        step = first.get("step")
        if n_bad > 1:
            text = f"{n_bad} steps with non-finite values, first at step {step}: {origin}"
        else:
            text = "non-finite values " + (origin if step is None else f"at step {step}: {origin}")
        found.append((NONFINITE, str(first.get("kind", "nan")), "error", step, max(n_bad, 1), text))
    for d in divs:
        rank = OPEN_DIVERGENCE if d["recovered_step"] is None else RECOVERED
        found.append((rank, DIVERGENCE, "warning", d["step"], 1, _divergence_text(d)))
    for e in loud:
        kind = str(e.get("kind"))
        level = "error" if e.get("severity") == "error" else "warning"
        found.append(
            (
                event_rank(kind, e.get("severity")),
                kind,
                level,
                e.get("step"),
                counts.get(kind, 1),
                _event_text(e),
            )
        )
    found.sort(key=lambda f: f[0])
    return found


def _clauses(found: list[Found], counts: Mapping[str, int]) -> list[str]:
    """The sentence's clauses: the first finding of each class above the health warnings (at most
    ``_SAID``), or the most important warning or hint alone; then the rest counted by kind."""
    said: list[Found] = []
    for f in found:
        if not said or (f[0] < HEALTH and f[0] != said[-1][0] and len(said) < _SAID):
            said.append(f)
    rest = {k: n - sum(f[1] == k for f in said) for k, n in counts.items()}
    rest = {k: n for k, n in rest.items() if n > 0}
    out = [f[5] for f in said]
    if rest:
        order = {f[1]: i for i, f in reversed(list(enumerate(found)))}
        kinds = sorted(rest, key=lambda k: (order.get(k, len(order)), k))
        out.append("also " + ", ".join(f"{rest[k]} {k}" for k in kinds))
    return out


class RunVerdict(dict[str, Any]):
    """What `judge` returns: a plain dict (JSON-ready, compared and indexed as before) that also
    reads as its sentence: ``str(v)`` is ``v["text"]`` and a notebook shows the sentence in its
    level's colour above the ranked findings."""

    #: findings listed in the notebook view; the rest are counted in one row
    SHOWN = 8

    def __str__(self) -> str:
        return str(self.get("text", ""))

    def _repr_html_(self) -> str:
        """The verdict in a notebook: the sentence (coloured by level), then each finding ranked."""
        rows: list[tuple[str, Any]] = []
        for f in self.get("findings", [])[: self.SHOWN]:
            label = str(f["kind"]) + (f" x{f['count']}" if f.get("count", 1) > 1 else "")
            rows.append((label, f["text"]))
        more = len(self.get("findings", [])) - self.SHOWN
        if more > 0:
            rows.append(("more", f"{more} more finding{'s' if more != 1 else ''}"))
        return html_table(
            str(self), COLOURS.get(str(self.get("level")), COLOURS["warning"]), rows, "torchdebug-verdict"
        )


def judge(
    status: str,
    *,
    steps: int,
    last_step: int | None,
    anomalies: Sequence[Mapping[str, Any]],
    events: Sequence[Mapping[str, Any]],
    lost: int = 0,
    anomaly_steps: int | None = None,
    event_counts: Mapping[str, int] | None = None,
) -> RunVerdict:
    """The verdict of a run from what the store holds (pure: same input, same sentence).

    Args:
        status: ``meta.json``'s status (``running | finished | failed``, or ``unreadable``...).
        steps: distinct steps with metrics; ``last_step``: the last step recorded (None: none).
        anomalies, events: ``run.anomalies()`` / ``run.events()``.
        lost: records the writer could not store (the run is incomplete).
        anomaly_steps, event_counts: when ``anomalies`` / ``events`` are a bounded sample (the
            trackers' tally of a live run keeps each kind's first events), the exact number of
            distinct steps with an anomaly and of warning/error events by kind (divergences apart);
            None: counted from the lists.

    Returns:
        ``{"status", "level": ok|running|warning|error, "text": one sentence, "findings": every
        warning/error finding ranked (``rank``, ``kind``, ``level``, ``step``, ``count``, ``text``;
        the sentence leads with the first), "groups": group_anomalies(anomalies), "anomaly_steps":
        distinct steps with an anomaly, "divergences": divergences(events)}``.

    Example:
        >>> judge("finished", steps=2000, last_step=1999, anomalies=[], events=[])["text"]
        'finished: 2000 steps, no anomalies'
    """
    groups = group_anomalies(anomalies)
    bad_steps = {a["step"] for a in anomalies if isinstance(a.get("step"), int)}
    n_bad = len(bad_steps) if anomaly_steps is None else anomaly_steps
    divs = divergences(events)
    loud = sorted(
        (
            e
            for e in events
            if e.get("severity") in ("warning", "error") and e.get("kind") not in (DIVERGENCE, DIVERGENCE_END)
        ),
        key=_event_order,
    )
    counts: dict[str, int] = {}
    if event_counts is None:
        for e in loud:
            counts[str(e.get("kind"))] = counts.get(str(e.get("kind")), 0) + 1
    else:
        counts = {str(k): int(n) for k, n in event_counts.items() if n}
    found = _findings(anomalies, n_bad, divs, loud, counts)
    findings = _clauses(found, counts)
    level = "ok"
    if found:
        level = "error" if any(f[2] == "error" for f in found) else "warning"

    if status == "failed":
        level = "error"
        nan = found[0] if found and found[0][0] == NONFINITE else None
        if nan is not None and nan[4] <= 1:  # the failure's own sentence: "failed at step 6: nan born in ..."
            text = "failed " + nan[5].removeprefix("non-finite values ")
            if not text.startswith("failed at step"):
                text = text.replace("failed ", "failed: ", 1)
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
        if status != "finished":  # crashed, unreadable or unknown: not a clean bill of health
            level = "error" if status == "crashed" else "warning"
    if lost:
        text += f"; incomplete: {lost} records lost"
        level = "error" if level == "error" else "warning"
    return RunVerdict(
        {
            "status": status,
            "level": level,
            "text": text,
            "findings": [
                {"rank": f[0], "kind": f[1], "level": f[2], "step": f[3], "count": f[4], "text": f[5]}
                for f in found
            ],
            "groups": groups,
            "anomaly_steps": n_bad,
            "divergences": divs,
        }
    )


def verdict(run: Any) -> RunVerdict:
    """`judge` over an open ``Run`` (its meta status, summary, anomalies and events).

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
    "COLOURS",
    "LEVELS",
    "RANKS",
    "RunVerdict",
    "anomaly_text",
    "divergences",
    "event_rank",
    "group_anomalies",
    "group_key",
    "judge",
    "verdict",
]

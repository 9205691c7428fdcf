"""The loss spikes of a run, as stored: ``spike_report`` and ``rollback`` events, read by every view."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

KINDS = ("spike_report", "rollback")


def spike_rows(events: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per stored spike report or rollback, in step order: ``step``, ``kind``, ``cause``
    (reports), ``what`` (the rows, parameters or modules named) and ``message``."""
    out: list[dict[str, Any]] = []
    for e in events:
        if e.get("kind") not in KINDS:
            continue
        data = e.get("data")
        data = data if isinstance(data, Mapping) else {}
        ev = data.get("evidence")
        ev = ev if isinstance(ev, Mapping) else {}
        row: dict[str, Any] = {
            "step": e.get("step"),
            "kind": e.get("kind"),
            "message": str(e.get("message", "")),
        }
        if e.get("kind") == "spike_report":
            row["cause"] = str(ev.get("cause", "?"))
            named = [f"row {r.get('index')}" for r in ev.get("rows") or [] if isinstance(r, Mapping)]
            named += [str(p) for p in ev.get("params") or []]
            named += [str(m) or "<root>" for m in ev.get("modules") or []]
            row["what"] = ", ".join(named[:5]) + (", ..." if len(named) > 5 else "")
            row["loss"], row["median"] = ev.get("loss"), ev.get("median")
        else:
            row["cause"] = str(ev.get("cause", ""))
            row["what"] = f"to step {ev.get('to_step')}, {ev.get('batches_skipped')} batches skipped"
        out.append(row)
    return sorted(
        out, key=lambda r: (r["step"] if isinstance(r["step"], int) else -1, r["kind"] != "spike_report")
    )


def spike_lines(events: Sequence[Mapping[str, Any]]) -> list[str]:
    """``show`` and the text report: ``loss spikes (N)`` and a line per report or rollback; [] if none."""
    rows = spike_rows(events)
    if not rows:
        return []
    n = sum(r["kind"] == "spike_report" for r in rows)
    out = [f"loss spikes ({n})"]
    for r in rows:
        if r["kind"] == "spike_report":
            prefix = "cause " + r["cause"] + ": "
            out.append(f"  step {r['step']}  {prefix}{r['message'].removeprefix(prefix)}")
        else:
            out.append(f"  step {r['step']}  {r['message']}")
    return out

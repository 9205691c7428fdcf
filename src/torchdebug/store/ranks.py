"""All ranks of a run at once: per-rank columns, anomalies with their rank, hangs and stragglers."""

from __future__ import annotations

import math
import statistics
from typing import Any

from . import _aggregate


def _median(values: list[Any]) -> float | None:
    vals = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return statistics.median(vals) if vals else None


def _max(values: list[Any]) -> int | None:
    vals = [int(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return max(vals) if vals else None


def rank_overview(run: Any) -> dict[str, Any]:
    """Every rank's database of ``run`` read once (each opened read-only and closed again).

    Returns ``{"ranks", "world_size", "per_rank", "anomalies", "hangs", "stragglers"}``:

    - ``per_rank``: one row per rank: ``rank``, ``status``, ``steps``, ``last_step``,
      ``step_time_s`` and ``data_wait_s`` (medians over the timed steps), ``rss_max`` and
      ``cuda_max`` (bytes), ``grad_norm`` (last value), ``anomalies`` and ``hangs`` (counts).
    - ``anomalies``: each anomaly once (the same one is recorded by every rank), with ``rank`` the
      rank where it was born and ``recorded_by`` the ranks whose store holds it.
    - ``hangs``: hang watchdog records (``rank``, ``step``, ``phase``, ``last_step``, ``where``,
      ``message``); ``stragglers``: straggler episodes, each once (``rank``, ``ratio``, ``step``,
      ``kind`` compute or data, ``phase``, ``message``, ``recorded_by``).

    Example: ``rank_overview(open_run(path))["per_rank"][1]["step_time_s"]``.
    Cost: per rank, the step and data seconds of its timing samples and an SQL aggregate of its
    memory samples.
    """
    rows: list[dict[str, Any]] = []
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    hangs: list[dict[str, Any]] = []
    stragglers: list[dict[str, Any]] = []
    seen: dict[tuple[Any, Any], dict[str, Any]] = {}
    for k in run.ranks:
        r = run if k == run.rank else run.open_rank(k)
        try:
            # one column each in SQL, not every sample pivoted (a long run holds millions of rows;
            # a compacted span keeps each 64-step bucket's last and slowest sample)
            step_s = [v for (v,) in r._rows("SELECT seconds FROM timings WHERE phase = 'step'")]
            data_s = [v for (v,) in r._rows("SELECT seconds FROM timings WHERE phase = 'data'")]
            mem = _aggregate.memory_stats(r)
            anomalies = r.anomalies()
            hang_events = r.events("hang")
            last = r.last_values()
            rows.append(
                {
                    "rank": k,
                    "status": r.status,
                    "steps": r.steps(),
                    "last_step": max((s for s, _ in last.values()), default=None),
                    "step_time_s": _median(step_s),
                    "data_wait_s": _median(data_s),
                    "rss_max": _max([mem.get("rss", {}).get("max")]),
                    "cuda_max": _max([mem.get("cuda_allocated", {}).get("max")]),
                    "grad_norm": last["grad_norm"][1] if "grad_norm" in last else None,
                    "anomalies": len(anomalies),
                    "hangs": len(hang_events),
                }
            )
            for a in anomalies:
                key = (a.get("step"), a.get("summary"), a.get("rank"))
                doc = merged.setdefault(key, {**a, "recorded_by": []})
                doc["recorded_by"].append(k)
            for e in hang_events:
                d = e.get("data") or {}
                hangs.append(
                    {
                        "rank": d.get("rank", k),
                        "step": e.get("step"),
                        "phase": d.get("phase"),
                        "last_step": d.get("last_step"),
                        "where": d.get("where"),
                        "message": e.get("message"),
                    }
                )
            for e in r.events("straggler"):
                ev = (e.get("data") or {}).get("evidence") or {}
                episode = (ev.get("rank"), e.get("step"))  # every rank records the same decision
                if episode in seen:
                    seen[episode]["recorded_by"].append(k)
                    continue
                seen[episode] = {
                    "rank": ev.get("rank"),
                    "ratio": ev.get("ratio"),
                    "step": e.get("step"),
                    "kind": ev.get("kind"),
                    "phase": ev.get("phase"),
                    "message": e.get("message"),
                    "recorded_by": [k],
                }
                stragglers.append(seen[episode])
        finally:
            if r is not run:
                r.close()
    return {
        "ranks": list(run.ranks),
        "world_size": run.meta.get("world_size", 1),
        "per_rank": rows,
        "anomalies": sorted(merged.values(), key=lambda a: (a.get("step") is None, a.get("step") or 0)),
        "hangs": hangs,
        "stragglers": stragglers,
    }


__all__ = ["rank_overview"]

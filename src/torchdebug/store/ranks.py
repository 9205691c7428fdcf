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
      ``message``); ``stragglers``: straggler events (``rank``, ``ratio``, ``step``, ``message``).

    Example: ``rank_overview(open_run(path))["per_rank"][1]["step_time_s"]``.
    Cost: per rank, the step and data seconds of its timing samples and an SQL aggregate of its
    memory samples.
    """
    rows: list[dict[str, Any]] = []
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    hangs: list[dict[str, Any]] = []
    stragglers: list[dict[str, Any]] = []
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
                stragglers.append(
                    {
                        "rank": ev.get("rank"),
                        "ratio": ev.get("ratio"),
                        "step": e.get("step"),
                        "message": e.get("message"),
                    }
                )
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


def _fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f} ms"


def _fmt_b(v: int | None) -> str:
    return "-" if v is None else f"{v / 2**20:.1f} MiB"


def _fmt_n(v: float | str | None) -> str:
    if isinstance(v, str):  # a JSON-safe copy spells non-finite values: "nan", "inf"
        return v
    return "-" if v is None else f"{v:.4g}"


RANK_COLUMNS = (
    "rank",
    "status",
    "steps",
    "step time",
    "data wait",
    "max RSS",
    "max CUDA",
    "grad norm",
    "anomalies",
    "hangs",
)


def overview_cells(ov: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row of text cells per rank, in ``RANK_COLUMNS`` order (``show``, the reports, the dashboard):
    step time and data wait in ms (1 decimal), memory in MiB (1 decimal), grad norm 4 significant
    digits, ``-`` where nothing was recorded."""
    return [
        (
            str(r["rank"]),
            str(r["status"]),
            str(r["steps"]),
            _fmt_s(r["step_time_s"]),
            _fmt_s(r["data_wait_s"]),
            _fmt_b(r["rss_max"]),
            _fmt_b(r["cuda_max"]),
            _fmt_n(r["grad_norm"]),
            str(r["anomalies"]),
            str(r["hangs"]),
        )
        for r in ov["per_rank"]
    ]


def overview_lines(ov: dict[str, Any]) -> list[str]:
    """The overview as text lines (``torchdebug show`` and the text report)."""
    head = RANK_COLUMNS
    table = [head, *overview_cells(ov)]
    widths = [max(len(row[c]) for row in table) for c in range(len(head))]
    out = [f"ranks ({len(ov['ranks'])} of world size {ov['world_size']})"]
    out += ["  " + "  ".join(cell.ljust(widths[c]) for c, cell in enumerate(row)).rstrip() for row in table]
    out.append(f"anomalies, all ranks ({len(ov['anomalies'])})")
    for a in ov["anomalies"]:
        by = ", ".join(map(str, a["recorded_by"]))
        # a summary written on several ranks ends "(step 7, born on rank 1 of 2)": no prefix then
        named = isinstance(a.get("world_size"), int) and a["world_size"] > 1
        prefix = "" if named else f"rank {a.get('rank')}: "
        out.append(f"  {prefix}{a.get('summary')}  (recorded by rank {by})")
    if not ov["anomalies"]:
        out.append("  none")
    if ov["stragglers"]:
        out.append(f"stragglers ({len(ov['stragglers'])})")
        out += [f"  step {s['step']}: {s['message']}" for s in ov["stragglers"]]
    if ov["hangs"]:
        out.append(f"hangs ({len(ov['hangs'])})")
        out += [f"  step {h['step']}: {h['message']}" for h in ov["hangs"]]
    return out

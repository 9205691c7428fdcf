"""Reading a run for reports: the JSON summary (``build_report``) and the chart data (``collect_data``)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from ...store import _aggregate
from ..verdict import anomaly_text, judge
from ._format import envelope, event_category, is_finite

# meta.json keys shown as the run's identity; "path" is left out on purpose (absolute, machine-bound).
META_KEYS = (
    "run_id",
    "name",
    "status",
    "created",
    "ended",
    "torch",
    "python",
    "torchdebug",
    "host",
    "pid",
    "rank",
    "world_size",
    "schema_version",
)
TIMING_PHASES = ("data", "forward", "backward", "optimizer", "other")


def step_seconds(sample: Mapping[str, Any]) -> float | None:
    """A step's duration in seconds: the sample's ``"total"`` (the ``"step"`` time the instrument
    logged; ``Run.timings()`` reads it back as ``"total"`` since ``"step"`` is the index), else the sum
    of its phases (data + forward + backward + optimizer + other). None when it has neither.
    """
    total = sample.get("total")
    if total is not None:
        return float(total)
    vals = [sample[p] for p in TIMING_PHASES if p in sample]
    return math.fsum(vals) if vals else None


def _stats(values: Iterable[Any]) -> tuple[float | None, float | None, float | None, int, int]:
    """(mean, max, min, finite count, non-finite count) over real numbers; NaN/Inf only counted."""
    total = 0.0
    lo = hi = None
    n = bad = 0
    finite = math.isfinite
    for v in values:
        if v is None:  # key absent from this sample
            continue
        if not finite(v):
            bad += 1
            continue
        total += v
        n += 1
        lo = v if lo is None or v < lo else lo
        hi = v if hi is None or v > hi else hi
    return (total / n if n else None), hi, lo, n, bad


def _as_int(x: float | None) -> int | None:
    return None if x is None else round(x)


def _config(meta: Mapping[str, Any]) -> Mapping[str, Any]:
    cfg = meta.get("config")
    return cfg if isinstance(cfg, Mapping) else {}


def metric_table(run: Any, stats: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """Per metric: points, last step, last value, finite min/max and the count of NaN/Inf points.

    Cost: SQL aggregates over the rollups (one row per 4096 steps per metric), not the points: a few
    ms per metric whatever the run's length (see ``torchdebug.store._aggregate.metric_stats``).
    """
    if stats is None:
        stats = _aggregate.metric_stats(run)
    return {
        name: {
            "points": s["points"],
            "last_step": s["last_step"],
            "last": s["last"],
            "min": s["min"],
            "max": s["max"],
            "nonfinite": s["bad"],
        }
        for name, s in sorted(stats.items())
    }


def _agg_stats(s: Mapping[str, Any]) -> tuple[float | None, float | None, float | None, int, int]:
    """``_stats``'s tuple from an SQL aggregate ``{"count", "bad", "sum", "min", "max"}``."""
    n = int(s["count"])
    return (s["sum"] / n if n else None), s["max"], s["min"], n, int(s["bad"])


_NO_STATS = (None, None, None, 0, 0)


def build_report(
    run: Any,
    *,
    metrics: bool = True,
    timings: list[dict[str, Any]] | None = None,
    memory: list[dict[str, Any]] | None = None,
    summary: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON summary of a run, with the keys of the seed system's ``create_debug_report``.

    Args:
        run: an open ``torchdebug.store.Run`` (see ``torchdebug.store.open_run``).
        metrics: include the per-metric last/min/max table.
        timings, memory: samples to summarize instead of the run's (``run.timings()`` /
            ``run.memory()``, or a filtered list); by default the run's are aggregated in SQL.
        summary: ``run.summary()`` when the caller already read it.

    Returns:
        A dict (NaN/Inf kept as floats; ``json_safe`` turns them into strings):

        - ``summary``: ``total_debug_operations`` (steps with metrics), ``anomalies_detected``
          (anomaly records), ``memory_leaks_detected`` / ``performance_issues_detected`` (rule events
          whose kind falls in the memory / performance category, see ``event_category``),
          ``debug_mode`` / ``debug_level`` (from the config in meta.json, None when absent).
        - ``performance_analysis``: average / max / min step time in seconds (``step_seconds``).
        - ``memory_analysis``: average / max RSS and CUDA-allocated bytes (int) over memory samples.
        - ``gradient_analysis``: average / max of the finite total ``grad_norm`` values,
          ``nonfinite_gradient_steps`` (NaN/Inf ``grad_norm`` points) and ``gradient_anomalies``
          (rule events in the gradient category; not the seed's fixed "> 10" threshold).
        - ``operation_breakdown``: ``time_by_phase`` (total seconds per timing phase: data, forward,
          backward, optimizer, other), ``events_by_kind`` and ``anomalies_by_phase`` (counts).
        - ``anomalies`` (full documents), ``events`` (rule events), ``segments``, ``metrics`` (when
          asked), ``run`` (meta.json identity fields) and ``config``.
        - ``records_lost`` (only when the writer could not store some records: disk full ...):
          ``count``, ``from_step``, ``error``; the run is incomplete.
        - ``ranks`` (only for a run with several ranks): ``torchdebug.store.rank_overview``.
        - ``hang_verdict`` (only when a rank's hang watchdog wrote a flight record):
          ``torchdebug.session.hangs.HangVerdict.to_dict()``, the line is its ``text``.
        - ``verdict``: ``status``, ``level`` (ok | running | warning | error), ``text`` (the one
          sentence every view leads with), ``anomaly_steps`` and ``groups`` (repeated anomalies
          folded by origin or symptom: ``summary``, ``count``, ``first_step``, ``last_step``), see
          ``torchdebug.views.verdict.judge``.

    Raises:
        RunStoreError: the run's database cannot be read.

    Example: ``build_report(open_run("runs/demo-20250101-120000"))["summary"]["anomalies_detected"]``.
    Cost: bounded whatever the run's length (0.1 - 0.3 s at 1,000,000 steps): SQL aggregates over
    the metric and timing rollups (one row per 4096 steps) and the memory samples; anomaly and
    event documents are read whole.
    """
    lost = run.summary() if summary is None else summary
    meta = dict(run.meta)
    meta["status"] = lost["status"]
    cfg = _config(meta)
    anomalies = run.anomalies()
    events = run.events()
    categories = Counter(event_category(str(e["kind"])) for e in events)

    time_by_phase: dict[str, float] = {}
    if timings is None and memory is None:  # SQL aggregates: bounded whatever the run's length
        tstats = _aggregate.timing_stats(run)
        step_t = _agg_stats(tstats["step_time"])
        for phase in TIMING_PHASES:
            if tstats.get(phase, {}).get("count"):
                time_by_phase[phase] = tstats[phase]["sum"]
        mstats = _aggregate.memory_stats(run)
        rss = _agg_stats(mstats["rss"]) if "rss" in mstats else _NO_STATS
        gpu = _agg_stats(mstats["cuda_allocated"]) if "cuda_allocated" in mstats else _NO_STATS
        n_memory = _aggregate.memory_samples(run)
    else:  # the caller's samples (a filtered or synthetic list)
        timings = run.timings() if timings is None else timings
        memory = run.memory() if memory is None else memory
        step_t = _stats(step_seconds(t) for t in timings)
        for phase in TIMING_PHASES:
            vals = [t[phase] for t in timings if is_finite(t.get(phase))]
            if vals:
                time_by_phase[phase] = math.fsum(vals)
        rss = _stats(m.get("rss") for m in memory)
        gpu = _stats(m.get("cuda_allocated") for m in memory)
        n_memory = len(memory)
    per_metric = _aggregate.metric_stats(run)
    grad = _agg_stats(per_metric["grad_norm"]) if "grad_norm" in per_metric else _NO_STATS
    report: dict[str, Any] = {
        "summary": {
            "total_debug_operations": lost["steps"],
            "anomalies_detected": len(anomalies),
            "memory_leaks_detected": categories["memory"],
            "performance_issues_detected": categories["performance"],
            "debug_mode": cfg.get("mode"),
            "debug_level": cfg.get("level"),
        },
        "performance_analysis": {
            "average_execution_time": step_t[0],
            "max_execution_time": step_t[1],
            "min_execution_time": step_t[2],
            "timed_steps": step_t[3],
        },
        "memory_analysis": {
            "average_memory_usage": _as_int(rss[0]),
            "max_memory_usage": _as_int(rss[1]),
            "average_gpu_memory": _as_int(gpu[0]),
            "max_gpu_memory": _as_int(gpu[1]),
            "samples": n_memory,
        },
        "gradient_analysis": {
            "average_gradient_norm": grad[0],
            "max_gradient_norm": grad[1],
            "nonfinite_gradient_steps": grad[4],
            "gradient_anomalies": categories["gradient"],
        },
        "operation_breakdown": {
            "time_by_phase": time_by_phase,
            "events_by_kind": dict(sorted(Counter(str(e["kind"]) for e in events).items())),
            "anomalies_by_phase": dict(sorted(Counter(str(a.get("phase")) for a in anomalies).items())),
        },
        "anomalies": anomalies,
        "events": events,
        "segments": run.segments(),
        "run": {k: meta.get(k) for k in META_KEYS},
        "config": dict(cfg),
    }
    if metrics:
        report["metrics"] = metric_table(run, per_metric)
    v = judge(
        str(meta["status"]),
        steps=report["summary"]["total_debug_operations"],
        last_step=lost["last_step"],
        anomalies=anomalies,
        events=events,
        lost=int(lost.get("lost") or 0),
    )
    report["verdict"] = {
        "status": v["status"],
        "level": v["level"],
        "text": v["text"],
        "anomaly_steps": v["anomaly_steps"],
        # every finding ranked (the sentence leads with the first): kind, level, step, count, text
        "findings": v["findings"],
        "groups": [
            {
                "summary": anomaly_text(g["anomaly"]),
                "count": g["count"],
                "first_step": g["first_step"],
                "last_step": g["last_step"],
            }
            for g in v["groups"]
        ],
    }
    if lost.get("lost"):  # only then: a whole run's report is unchanged
        report["records_lost"] = {
            "count": lost["lost"],
            "from_step": lost["lost_from_step"],
            "error": lost["write_error"],
        }
    if len(getattr(run, "ranks", [])) > 1:  # several ranks: per-rank columns, anomalies with their rank
        from ...store.ranks import rank_overview

        report["ranks"] = rank_overview(run)
        from ..hangs import verdict_of_run

        hang = verdict_of_run(run.path, run.meta.get("world_size"))  # the ranks' flight records
        if hang is not None:
            report["hang_verdict"] = hang.to_dict()
    return report


def _pivot(samples: list[dict[str, Any]], max_points: int | None) -> dict[str, dict[str, list[Any]]]:
    """``[{"step", k: v}]`` samples -> ``{k: {"steps", "values"}}``, each min/max-envelope downsampled."""
    keys: dict[str, None] = {}
    for s in samples:
        for k in s:
            if k not in ("step", "wall_time"):
                keys[k] = None
    out: dict[str, dict[str, list[Any]]] = {}
    for k in keys:
        steps = [s["step"] for s in samples if k in s]
        vals = [s[k] for s in samples if k in s]
        ds, dv = envelope(steps, vals, max_points)
        out[k] = {"steps": ds, "values": dv}
    return out


def _with_total(timings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Timing samples each with a ``"total"`` duration when one can be had (see ``step_seconds``)."""
    out = []
    for t in timings:
        total = step_seconds(t)
        out.append(t if total is None or "total" in t else {**t, "total": total})
    return out


def _tensor_nonfinite(run: Any) -> dict[str, list[Any]]:
    """Per step with tensor stats: the summed NaN and +-Inf counts over every tensor recorded then."""
    nan: dict[int, int] = {}
    inf: dict[int, int] = {}
    for row in run.tensor_stats():
        st = row["stats"]
        step = row["step"]
        nan[step] = nan.get(step, 0) + int(st.get("nan_count") or 0)
        inf[step] = inf.get(step, 0) + int(st.get("posinf_count") or 0) + int(st.get("neginf_count") or 0)
    steps = sorted(nan)
    return {"steps": steps, "nan": [nan[s] for s in steps], "inf": [inf[s] for s in steps]}


def _samples_for_chart(
    run: Any, table: str, given: list[dict[str, Any]] | None, max_points: int, since_step: int | None
) -> dict[str, dict[str, list[Any]]]:
    """Chart data of timing or memory samples: the caller's list or a short table pivoted in Python
    (every point up to ``max_points``); a long or compacted one read from the timing rollups, else
    bucketed in one pass (``_aggregate.timing_series`` / ``sample_series``)."""
    since = since_step or 0
    if given is None:
        long = _aggregate.sample_count(run, table, since) > _aggregate.PIVOT_ROWS
        # a compacted span keeps only some timing samples: its rollups hold every step's extremes
        if table == "timings" and (long or since < _aggregate.compacted_to(run)):
            got = _aggregate.timing_series(run, max_points, since)
            if got is not None:
                return got
        if long:
            return _aggregate.sample_series(run, table, max_points, since)
    if given is None:
        given = run.timings() if table == "timings" else run.memory()
        if since:
            given = [t for t in given if t["step"] >= since]
    return _pivot(_with_total(given) if table == "timings" else given, max_points)


def collect_data(
    run: Any,
    max_points: int = 2000,
    since_step: int | None = None,
    *,
    timings: list[dict[str, Any]] | None = None,
    memory: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Everything the charts need, downsampled to about ``max_points`` per series (min/max envelopes).

    Returns ``{"series": {name: {"steps", "values"}}, "memory": {...}, "timings": {... "total"},
    "tensor_nonfinite": {"steps", "nan", "inf"}, "anomalies": [...], "events": [...]}``; values keep
    NaN/Inf as floats.

    ``timings`` / ``memory``: samples to chart instead of the run's (already filtered to
    ``since_step`` by the caller).

    Example: ``collect_data(open_run(path), max_points=500)["series"]["loss"]["values"]``.
    Cost: one downsampled query per metric (about 1 ms from the rollups); timing and memory samples
    are pivoted in Python up to 20,000 rows; beyond, timings read their rollups (one row per phase
    and chart bucket) and memory samples are bucketed in one pass (about 60 ms per 40k rows).
    """
    series = {}
    for name in run.metric_names():
        s = run.series(name, since_step=since_step, max_points=max_points)
        series[name] = {"steps": s.steps, "values": s.values}
    return {
        "series": series,
        "memory": _samples_for_chart(run, "memory", memory, max_points, since_step),
        "timings": _samples_for_chart(run, "timings", timings, max_points, since_step),
        "tensor_nonfinite": _tensor_nonfinite(run),
        "anomalies": run.anomalies(),
        "events": run.events(),
    }

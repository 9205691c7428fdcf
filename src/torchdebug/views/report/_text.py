"""Plain-text report, the answer first: the verdict, the anomaly cards, then the summary, rule events and a metric table."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..._term import printable
from ...events import module_label
from ..verdict import group_anomalies
from ._format import anomaly_rows, fmt_bytes, fmt_num, fmt_seconds, natural_key

_RULE = "-" * 78
_MAX_METRIC = 60  # metric names longer than this are cut in the table


def _anomaly_card(a: Mapping[str, Any]) -> list[str]:
    lines = [f"* {a.get('summary') or a.get('kind')}"]
    rows = [
        ("hint", a.get("hint")),  # the answer first, then the evidence
        *anomaly_rows(a),
        ("step", a.get("step")),
        ("noticed", a.get("symptom")),
    ]
    lines += [f"    {k:<10}{v}" for k, v in rows if v not in (None, "")]
    frames = a.get("frames") or []
    if frames:
        lines.append("    last module calls before it:")
        for f in frames:
            bad = "  <- non-finite" if f.get("output_nonfinite") else ""
            where = module_label(str(f.get("module") or ""), f.get("module_type") or None)
            lines.append(
                f"      {f.get('phase', ''):<8} {where:<32} |out| in "
                f"[{fmt_num(f.get('output_abs_min'))}, {fmt_num(f.get('output_abs_max'))}]{bad}"
            )
    return lines


def _lost_lines(lost: Mapping[str, Any] | None) -> list[str]:
    if not lost:
        return []
    at = f" from step {lost.get('from_step')} on" if lost.get("from_step") is not None else ""
    why = f" (write failed: {lost.get('error')})" if lost.get("error") else ""
    return [f"LOST     {lost.get('count')} records were lost{at}{why}: this run is incomplete"]


def render_text(report: Mapping[str, Any]) -> str:
    """The text report from ``build_report``'s dict (deterministic: same run, same text).

    Example: ``print(render_text(build_report(run)))``.
    """
    run, s = report["run"], report["summary"]
    perf, mem, grad = report["performance_analysis"], report["memory_analysis"], report["gradient_analysis"]
    verdict = report.get("verdict") or {}
    out = [
        f"{verdict.get('text') or run.get('status')}",
        f"torchdebug report: {run.get('name')}",
        f"run id   {run.get('run_id')}",
        f"status   {run.get('status')}",
        *_lost_lines(report.get("records_lost")),
        f"created  {run.get('created')}   ended {run.get('ended') or '-'}",
        f"mode     {s.get('debug_mode') or '-'}   level {s.get('debug_level') or '-'}",
    ]
    summary = [
        _RULE,
        "Summary",
        f"  steps                {s['total_debug_operations']}",
        f"  anomalies            {s['anomalies_detected']}",
        f"  gradient events      {grad['gradient_anomalies']}",
        f"  memory events        {s['memory_leaks_detected']}",
        f"  performance events   {s['performance_issues_detected']}",
        f"  step time            mean {fmt_seconds(perf['average_execution_time'])}, "
        f"min {fmt_seconds(perf['min_execution_time'])}, max {fmt_seconds(perf['max_execution_time'])}",
        f"  RSS                  mean {fmt_bytes(mem['average_memory_usage'])}, max {fmt_bytes(mem['max_memory_usage'])}",
        f"  CUDA allocated       mean {fmt_bytes(mem['average_gpu_memory'])}, max {fmt_bytes(mem['max_gpu_memory'])}",
        f"  grad norm            mean {fmt_num(grad['average_gradient_norm'])}, max {fmt_num(grad['max_gradient_norm'])}, "
        # the recorded norms only: a step that raised on its NaN wrote none (the anomaly above says it)
        f"NaN/Inf in {grad['nonfinite_gradient_steps']} recorded norm{'' if grad['nonfinite_gradient_steps'] == 1 else 's'}",
    ]
    tbp = report["operation_breakdown"]["time_by_phase"]
    if tbp:
        total = sum(tbp.values()) or 1.0
        summary.append("  time by phase        " + ", ".join(f"{k} {v / total:.0%}" for k, v in tbp.items()))
    groups = group_anomalies(report["anomalies"])
    n = len(report["anomalies"])
    grouped = f", {len(groups)} group{'s' if len(groups) != 1 else ''} by origin" if len(groups) < n else ""
    out += [_RULE, f"Anomalies ({n}{grouped})"]
    if not report["anomalies"]:
        out.append("  none: no NaN/Inf was born in this run")
    for g in groups:
        card = _anomaly_card(g["anomaly"])
        if g["count"] > 1:
            card.insert(
                1,
                f"    {'repeated':<10}{g['count']}x on {len(g['steps'])} steps, "
                f"first {g['first_step']}, last {g['last_step']}",
            )
        out += ["  " + line for line in card]
    out += summary  # the numbers after the answer
    from ..spikes import spike_lines

    spikes = spike_lines(report["events"])
    if spikes:
        out += [_RULE, spikes[0].replace("loss spikes", "Loss spikes"), *spikes[1:]]
    out += [_RULE, f"Rule events ({len(report['events'])})"]
    if not report["events"]:
        out.append("  none")
    for e in report["events"]:
        data = e.get("data") or {}
        mods = data.get("modules") if isinstance(data, Mapping) else None
        where = f" [{', '.join(map(str, mods))}]" if mods else ""
        out.append(
            f"  step {fmt_num(e.get('step')):>6}  {e.get('severity', ''):<7} {e.get('kind')}{where}: {e.get('message')}"
        )
    if report.get("ranks"):
        from ..ranks import overview_lines

        out += [_RULE, *overview_lines(report["ranks"])]
        if report.get("hang_verdict"):
            out.append(f"hang verdict: {report['hang_verdict']['text']}")
    if report.get("segments"):
        out += [_RULE, "History segments"]
        out += [f"  #{g['id']} from step {g['start_step']}: {g['label'] or '-'}" for g in report["segments"]]
    metrics = report.get("metrics")
    if metrics is not None:
        out += [_RULE, "Metrics"]
        labels = {n: printable(n, _MAX_METRIC) for n in metrics}
        width = max([len(n) for n in labels.values()] + [6])
        out.append(
            f"  {'metric':<{width}}  {'points':>6}  {'last':>10}  {'min':>10}  {'max':>10}  {'NaN/Inf':>7}"
        )
        for name in sorted(metrics, key=natural_key):
            m = metrics[name]
            out.append(
                f"  {labels[name]:<{width}}  {m['points']:>6}  {fmt_num(m['last']):>10}  {fmt_num(m['min']):>10}  "
                f"{fmt_num(m['max']):>10}  {m['nonfinite']:>7}"
            )
    # Everything above may hold text from the run: escape what a terminal would obey (ESC, CR, BEL).
    return "\n".join(printable(line) for line in out) + "\n"

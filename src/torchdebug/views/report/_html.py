"""HTML rendering: the self-contained report page, its fragments (cards, events, metadata) and the chart JS."""

from __future__ import annotations

import html
import json
import math
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

from ...events import module_label
from ..verdict import group_anomalies
from ._format import anomaly_rows, fmt_bytes, fmt_num, fmt_seconds, json_safe
from ._rankview import render_ranks

_CSS = """
:root { color-scheme: light dark; --fg:#1d2330; --muted:#5b6475; --line:#dde1e8; --grid:#e8ebf0; --bg:#f6f7f9;
        --card:#fff; --bad:#c62828; --warn:#b45309; --ok:#2e7d32; --run:#1976d2; --head:#1d2330; --hint:#fff8e1;
        --link:#0b57d0; }
@media (prefers-color-scheme: dark) {
  :root { --fg:#e3e6ec; --muted:#a0a8b8; --line:#3a4150; --grid:#2c3240; --bg:#14171d; --card:#1c2028;
          --bad:#ef5350; --warn:#f0a030; --ok:#66bb6a; --run:#64b5f6; --head:#0c0e12; --hint:#3a3320;
          --link:#8ab4f8; }
}
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: var(--fg);
       background: var(--bg); margin: 0; }
a { color: var(--link); }
header { background: var(--head); color: #fff; padding: 12px 24px; display: flex; flex-wrap: wrap; gap: 6px 16px;
         align-items: baseline; }
header h1 { font-size: 18px; margin: 0; font-weight: 600; overflow-wrap: anywhere; }
header a { color: #9ecbff; }
main { padding: 12px 24px; max-width: 1500px; margin: 0 auto; }
section { margin-bottom: 22px; }
h2 { font-size: 16px; margin: 18px 0 8px; }
.badge { display: inline-block; padding: 1px 8px; border-radius: 10px; font-size: 12px; background: #607d8b; color: #fff; }
.badge.running { background: var(--run); } .badge.ok { background: #2e7d32; } .badge.warning { background: #b45309; }
.badge.error { background: #c62828; }
.verdict-cell.error { color: var(--bad); } .verdict-cell.warning { color: var(--warn); }
.verdict { margin: 12px 0 4px; padding: 10px 14px; border-radius: 6px; background: var(--card);
           border: 1px solid var(--line); border-left: 6px solid #607d8b; font-size: 16px; overflow-wrap: anywhere; }
.verdict.ok { border-left-color: var(--ok); } .verdict.running { border-left-color: var(--run); }
.verdict.warning { border-left-color: var(--warn); } .verdict.error { border-left-color: var(--bad); }
.verdict b { font-weight: 600; }
.verdict a.to-card { font-size: 13px; margin-left: 8px; white-space: nowrap; }
.card:target { outline: 2px solid var(--link); }
.card.event { border-left-color: var(--warn); }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(min(100%, 560px), 1fr)); gap: 12px; }
.chart { background: var(--card); border: 1px solid var(--line); border-radius: 6px; padding: 8px 10px; margin: 0;
         min-width: 0; }
.chart.wide { grid-column: 1 / -1; }
.chart.is-empty { background: none; border: none; padding: 0 2px; grid-column: 1 / -1; }
.chart.is-empty .empty { padding: 0; }
.chart-head { display: flex; flex-wrap: wrap; justify-content: space-between; gap: 4px 12px; }
.chart-title { font-size: 14px; margin: 0; }
.chart-summary { margin: 2px 0 4px; color: var(--muted); font-size: 12px; overflow-wrap: anywhere; }
.chart-tools { display: flex; gap: 10px; align-items: center; font-size: 12px; color: var(--muted); }
.chart-tools select, .chart-tools button { font: inherit; color: var(--fg); background: var(--card);
         border: 1px solid var(--line); border-radius: 4px; }
.plot { position: relative; width: 100%; }
.plot svg { display: block; overflow: hidden; }
.plot .tick { font-size: 11px; fill: var(--muted); }
.plot .axis-title { font-size: 12px; fill: var(--fg); }
.plot .grid { stroke: var(--grid); stroke-width: 1; }
.plot .frame { fill: none; stroke: var(--line); }
.plot .lane { fill: var(--grid); fill-opacity: 0.35; stroke: var(--line); }
.plot .cross { stroke: var(--muted); stroke-dasharray: 3,3; }
.plot .zoomband { fill: var(--muted); fill-opacity: 0.15; }
.tip { position: absolute; pointer-events: none; background: var(--card); border: 1px solid var(--line);
       border-radius: 4px; padding: 4px 8px; font-size: 12px; box-shadow: 0 2px 6px rgba(0,0,0,.2);
       max-width: 360px; z-index: 2; }
.tip div { white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
.legend { font-size: 12px; }
.legend summary { font-size: 12px; }
.legend-items { display: flex; flex-wrap: wrap; gap: 2px 10px; max-height: 120px; overflow: auto; }
.legend-item { border: none; background: none; color: var(--fg); font: inherit; cursor: pointer; padding: 1px 2px;
               overflow-wrap: anywhere; text-align: left; }
.legend-item.off { opacity: .4; text-decoration: line-through; }
.swatch { display: inline-block; width: 10px; height: 10px; border-radius: 2px; margin-right: 4px; vertical-align: -1px; }
.empty { color: var(--muted); padding: 8px 0; margin: 0; }
.kv { display: grid; grid-template-columns: max-content 1fr; gap: 2px 14px; }
.kv dt { color: var(--muted); } .kv dd { margin: 0; font-family: ui-monospace, Menlo, monospace; word-break: break-all; }
.tiles { display: flex; flex-wrap: wrap; gap: 10px; }
.tile { background: var(--card); border: 1px solid var(--line); border-radius: 6px; padding: 8px 14px; min-width: 150px; }
.tile b { display: block; font-size: 20px; } .tile span { color: var(--muted); font-size: 12px; }
.tile.bad b { color: var(--bad); }
.card { background: var(--card); border: 1px solid var(--line); border-left: 4px solid var(--bad);
        border-radius: 6px; padding: 10px 14px; margin-bottom: 10px; overflow-wrap: anywhere; }
.card h3 { font-size: 14px; margin: 0 0 6px; font-family: ui-monospace, Menlo, monospace; }
.card .repeat { color: var(--bad); font-weight: 600; margin: 0 0 6px; }
.card .hint { background: var(--hint); border-radius: 4px; padding: 4px 8px; margin: 6px 0; }
table { border-collapse: collapse; width: 100%; background: var(--card); }
th, td { text-align: left; padding: 3px 8px; border-bottom: 1px solid var(--line); vertical-align: top; }
th { color: var(--muted); font-weight: 600; }
td.num { text-align: right; font-family: ui-monospace, Menlo, monospace; }
tr.sev-error td:first-child { color: var(--bad); font-weight: 600; }
tr.sev-warning td:first-child { color: var(--warn); font-weight: 600; }
code, pre { font-family: ui-monospace, Menlo, monospace; font-size: 12px; }
pre { background: var(--bg); padding: 8px; overflow: auto; max-height: 320px; }
details summary { cursor: pointer; color: var(--muted); }
#rank-select a.rank { padding: 1px 8px; border: 1px solid var(--line); border-radius: 10px; }
#rank-select a.rank.current { background: var(--head); color: #fff; }
.table-wrap { overflow-x: auto; }
"""


def charts_js() -> str:
    """The chart renderer (``static/tdcharts.js``, ~30 KB) shipped inside the package: no network."""
    return (resources.files(__package__) / "static" / "tdcharts.js").read_text(encoding="utf-8")


_WIDE = {"layers", "nonfinite"}


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _script_json(obj: Any) -> str:
    """JSON for inlining inside <script>: NaN-free and unable to close the script tag."""
    text = json.dumps(json_safe(obj), separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _rng(lo: Any, hi: Any) -> str:
    return "-" if lo is None or hi is None else f"[{fmt_num(lo)}, {fmt_num(hi)}]"


def lead_event(
    verdict: Mapping[str, Any], events: Sequence[Mapping[str, Any]]
) -> tuple[int, Mapping[str, Any]] | None:
    """The rule event the verdict names when no anomaly leads it, with its 1-based row number in
    ``render_events``: the one whose ``KIND at step N`` the sentence quotes, else the first
    divergence, error, then warning; None when no event is worth a card."""
    text = str(verdict.get("text", ""))
    numbered = list(enumerate(events, 1))
    for n, ev in numbered:
        if (
            ev.get("severity") in ("warning", "error")
            and f"{ev.get('kind')} at step {ev.get('step')}" in text
        ):
            return n, ev
    for pick in (
        lambda e: e.get("kind") == "divergence",
        lambda e: e.get("severity") == "error",
        lambda e: e.get("severity") == "warning",
    ):
        for n, ev in numbered:
            if pick(ev):
                return n, ev
    return None


def answer_target(
    anomalies: Sequence[Mapping[str, Any]],
    events: Sequence[Mapping[str, Any]] = (),
    verdict: Mapping[str, Any] | None = None,
) -> str | None:
    """The anchor of the card that holds the verdict's answer: the group of the earliest anomaly
    (``card-N``, as ``render_cards`` numbers them), else the card of the rule event the verdict names
    (``answer-event``, ``lead_event``); None when there is nothing to point at (a healthy run)."""
    if anomalies:
        groups = group_anomalies(anomalies)

        def first(g: Mapping[str, Any]) -> float:
            s = g.get("first_step")
            return s if isinstance(s, int) else math.inf

        best = min(range(len(groups)), key=lambda i: (first(groups[i]), i))
        return f"card-{best + 1}"
    if lead_event(verdict or {}, events) is not None:
        return "answer-event"
    return None


def render_event_card(verdict: Mapping[str, Any], events: Sequence[Mapping[str, Any]]) -> str:
    """The card of the rule event the verdict names (``lead_event``): kind, step, message, modules
    and evidence, with a link to its row in the rule-event table; "" when there is none."""
    lead = lead_event(verdict, events)
    if lead is None:
        return ""
    n, ev = lead
    raw = ev.get("data")
    data: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
    inner = data.get("evidence")
    evidence: Mapping[str, Any] = inner if isinstance(inner, Mapping) else {}
    rows = [
        ("step", ev.get("step")),
        ("severity", ev.get("severity")),
        ("modules", ", ".join(map(str, data.get("modules") or []))),
        *((k, fmt_num(v)) for k, v in evidence.items() if not isinstance(v, (Mapping, list))),
    ]
    kv = "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in rows if v not in (None, ""))
    return (
        f'<div class="card event" id="answer-event"><h3>{_e(ev.get("kind"))} at step {_e(ev.get("step"))}</h3>'
        f'<div class="hint">{_e(ev.get("message"))}</div><dl class="kv">{kv}</dl>'
        f'<a href="#event-{n}">its row among the rule events</a></div>'
    )


def render_verdict(verdict: Mapping[str, Any], target: str | None = None) -> str:
    """The run's one-sentence verdict (``torchdebug.views.verdict.judge``), coloured by its level;
    ``target``: the anchor of the card below that explains it (``answer_target``), linked."""
    level = str(verdict.get("level", "warning"))
    link = f' <a class="to-card" href="#{_e(target)}">details</a>' if target else ""
    return f'<p class="verdict {_e(level)}" role="status"><b>{_e(verdict.get("text", ""))}</b>{link}</p>'


def render_cards(anomalies: Sequence[Mapping[str, Any]]) -> str:
    """Anomaly cards, one per group of anomalies with the same origin or symptom
    (``group_anomalies``): summary, how often and when, phase, module, op, line, hint, tensor and
    the frames before the first one."""
    if not anomalies:
        return '<p class="empty">No anomaly recorded: no NaN/Inf was born in this run.</p>'
    groups = group_anomalies(anomalies)
    out = []
    if len(groups) < len(anomalies):
        out.append(
            f'<p class="empty">{len(anomalies)} anomalies in {len(groups)} '
            f"group{'s' if len(groups) != 1 else ''} (same origin or symptom).</p>"
        )
    for n, g in enumerate(groups, 1):
        a = g["anomaly"]
        rows = [
            *anomaly_rows(a),
            (
                "step",
                a.get("step")
                if not a.get("micro_step")
                else f"{a.get('step')} (micro-step {a['micro_step']})",
            ),
            ("noticed", a.get("symptom")),
            ("detected by", a.get("detected_by")),
        ]
        kv = "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in rows if v not in (None, ""))
        parts = [f'<div class="card anomaly" id="card-{n}"><h3>{_e(a.get("summary") or a.get("kind"))}</h3>']
        if a.get("hint"):  # the answer first: what to do, then the evidence
            parts.append(f'<div class="hint">hint: {_e(a["hint"])}</div>')
        if g["count"] > 1:
            n_steps = len(g["steps"])
            parts.append(
                f'<p class="repeat">{g["count"]}× on {n_steps} step{"s" if n_steps != 1 else ""}, '
                f"first at step {_e(g['first_step'])}, last at step {_e(g['last_step'])}</p>"
            )
        parts.append(f'<dl class="kv">{kv}</dl>')
        stats = [("output", a.get("tensor"))] + [
            (f"input[{i}]", t) for i, t in enumerate(a.get("inputs") or []) if isinstance(t, Mapping)
        ]
        stat_rows = "".join(
            f"<tr><td>{_e(label)}</td><td><code>{_e(t.get('name') or '')}</code></td>"
            f"<td><code>{_e(t.get('shape'))}</code></td><td>{_e(t.get('dtype'))}</td>"
            f'<td class="num">{_e(t.get("nan_count", 0))}</td><td class="num">{_e(t.get("posinf_count", 0))}</td>'
            f'<td class="num">{_e(t.get("neginf_count", 0))}</td><td><code>{_e(_rng(t.get("min"), t.get("max")))}</code></td></tr>'
            for label, t in stats
            if isinstance(t, Mapping)
        )
        if stat_rows:
            parts.append(
                '<div class="table-wrap"><table class="stats"><tr><th>tensor</th><th>name</th><th>shape</th>'
                "<th>dtype</th><th>NaN</th><th>+Inf</th><th>-Inf</th><th>finite range</th></tr>"
                f"{stat_rows}</table></div>"
            )
        frames = a.get("frames") or []
        if frames:
            body = "".join(
                f"<tr><td>{_e(f.get('phase'))}</td><td>{_e(module_label(str(f.get('module') or ''), f.get('module_type') or None))}</td>"
                f"<td>{_e(_rng(f.get('input_abs_min'), f.get('input_abs_max')))}</td>"
                f"<td>{_e(_rng(f.get('output_abs_min'), f.get('output_abs_max')))}</td>"
                f"<td>{'non-finite' if f.get('output_nonfinite') else ''}</td></tr>"
                for f in frames
            )
            parts.append(
                "<details open><summary>last module calls before it</summary><table><tr><th>phase</th>"
                f"<th>module</th><th>|in|</th><th>|out|</th><th></th></tr>{body}</table></details>"
            )
        stack = a.get("stack") or []
        if stack:
            parts.append(
                f"<details><summary>stack</summary><pre>{_e(chr(10).join(map(str, stack)))}</pre></details>"
            )
        related = a.get("related")
        if isinstance(related, Mapping):
            parts.append(
                f"<div>related: <code>{_e(related.get('summary') or related.get('kind'))}</code></div>"
            )
        parts.append("</div>")
        out.append("".join(parts))
    return "".join(out)


def render_spikes(events: Sequence[Mapping[str, Any]]) -> str:
    """Loss spikes (``spike_report`` and ``rollback`` events) as a table: step, what, cause, named, message."""
    from ..spikes import spike_rows

    rows = [
        f'<tr class="sev-warning"><td class="num">{_e(fmt_num(r["step"]))}</td><td>{_e(r["kind"])}</td>'
        f"<td>{_e(r['cause'])}</td><td>{_e(r['what'])}</td><td>{_e(r['message'])}</td></tr>"
        for r in spike_rows(events)
    ]
    if not rows:
        return ""
    return (
        '<h3>Loss spikes</h3><table class="spikes"><tr><th>step</th><th>kind</th><th>cause</th>'
        "<th>named</th><th>message</th></tr>" + "".join(rows) + "</table><h3>All rule events</h3>"
    )


def render_events(events: Sequence[Mapping[str, Any]]) -> str:
    """Rule events as a table: severity, step, kind, modules, message, evidence (plain numbers and
    text; nested evidence, a spike report's, is left to the loss-spike table above it)."""
    if not events:
        return '<p class="empty">No rule fired.</p>'
    rows = []
    for n, ev in enumerate(events, 1):
        data = ev.get("data") or {}
        modules = ", ".join(map(str, data.get("modules") or [])) if isinstance(data, Mapping) else ""
        evidence = data.get("evidence") if isinstance(data, Mapping) else None
        ev_text = (
            ", ".join(f"{k}={fmt_num(v)}" for k, v in evidence.items() if not isinstance(v, (Mapping, list)))
            if isinstance(evidence, Mapping)
            else ""
        )
        sev = str(ev.get("severity", ""))
        rows.append(
            f'<tr class="sev-{_e(sev)}" id="event-{n}"><td>{_e(sev)}</td><td class="num">{_e(fmt_num(ev.get("step")))}</td>'
            f"<td>{_e(ev.get('kind'))}</td><td>{_e(modules)}</td><td>{_e(ev.get('message'))}</td>"
            f"<td><code>{_e(ev_text)}</code></td></tr>"
        )
    return (
        render_spikes(events)
        + "<table><tr><th>severity</th><th>step</th><th>kind</th><th>modules</th><th>message</th><th>evidence</th></tr>"
        + "".join(rows)
        + "</table>"
    )


def render_summary(report: Mapping[str, Any]) -> str:
    """Headline tiles from ``build_report``: steps, anomalies, events, time, memory, gradient norm."""
    s, perf, mem, grad = (
        report[k] for k in ("summary", "performance_analysis", "memory_analysis", "gradient_analysis")
    )
    tiles = [
        ("steps", fmt_num(s["total_debug_operations"]), False),
        ("anomalies", fmt_num(s["anomalies_detected"]), s["anomalies_detected"] > 0),
        ("gradient events", fmt_num(grad["gradient_anomalies"]), grad["gradient_anomalies"] > 0),
        ("memory events", fmt_num(s["memory_leaks_detected"]), s["memory_leaks_detected"] > 0),
        (
            "performance events",
            fmt_num(s["performance_issues_detected"]),
            s["performance_issues_detected"] > 0,
        ),
        ("mean step time", fmt_seconds(perf["average_execution_time"]), False),
        ("max RSS", fmt_bytes(mem["max_memory_usage"]), False),
        ("max CUDA allocated", fmt_bytes(mem["max_gpu_memory"]), False),
        ("max ‖g‖", fmt_num(grad["max_gradient_norm"]), False),
    ]
    lost = report.get("records_lost")
    if lost:  # first: the run is incomplete
        at = f" from step {lost.get('from_step')}" if lost.get("from_step") is not None else ""
        tiles.insert(0, (f"records lost{at}: run incomplete", fmt_num(lost.get("count")), True))
    return (
        '<div class="tiles">'
        + "".join(
            f'<div class="tile{" bad" if bad else ""}"><b>{_e(v)}</b><span>{_e(k)}</span></div>'
            for k, v, bad in tiles
        )
        + "</div>"
    )


def render_meta(meta: Mapping[str, Any]) -> str:
    """Run metadata and its config, as key/value lists."""
    keys = (
        "run_id",
        "name",
        "status",
        "created",
        "ended",
        "torch",
        "python",
        "host",
        "pid",
        "rank",
        "world_size",
        "schema_version",
    )
    kv = "".join(f"<dt>{_e(k)}</dt><dd>{_e(meta[k])}</dd>" for k in keys if meta.get(k) is not None)
    config = meta.get("config") or {}
    cfg = "".join(
        f"<dt>{_e(k)}</dt><dd>{_e(json.dumps(json_safe(v)) if isinstance(v, (dict, list)) else v)}</dd>"
        for k, v in sorted(config.items())
    )
    return (
        f'<dl class="kv">{kv}</dl><details><summary>Config ({len(config)} options)</summary>'
        f'<dl class="kv">{cfg or "<dt>-</dt><dd>none recorded</dd>"}</dl></details>'
    )


def fragments(views: Mapping[str, Any]) -> dict[str, str]:
    """The page's server-rendered parts, keyed as the live dashboard swaps them: ``<key>_html``."""
    return {
        "verdict_html": render_verdict(
            views["verdict"], answer_target(views["anomalies"], views["events"], views["verdict"])
        ),
        "summary_html": render_summary(views["report"]),
        "cards_html": render_cards(views["anomalies"])
        + ("" if views["anomalies"] else render_event_card(views["verdict"], views["events"])),
        "events_html": render_events(views["events"]),
        "meta_html": render_meta(views["meta"]),
        "ranks_html": render_ranks(views["report"].get("ranks"), views["report"].get("hang_verdict")),
    }


def render_page(
    views: Mapping[str, Any],
    *,
    charts_src: str | None = None,
    live_url: str | None = None,
    nav: str = "",
    rank_select: str = "",
    live_state: Mapping[str, Any] | None = None,
) -> str:
    """The whole page for one run, the answer first: the verdict (linked to its card), the anomaly
    groups (or the card of the rule event the verdict names), then the summary tiles, the charts,
    the rule events and the run's metadata.

    Args:
        views: from ``collect_views`` (meta, verdict, report, figures, anomalies, events).
        charts_src: a same-origin URL of ``tdcharts.js`` (the dashboard serves it); None inlines it
            (the self-contained report).
        live_url: when given, the page polls this JSON URL every 2 s for the steps after the last
            one it holds and appends them (dashboard).
        nav: extra header HTML (the dashboard's link back to the run list).
        rank_select: the dashboard's rank selector (``_rankview.render_rank_selector``), shown above
            the summary of a run of several ranks.
        live_state: ``{"last_step", "frag"}`` the page starts from (its first poll asks only for
            what came after).

    Returns:
        The HTML text. It loads nothing from the network.
    """
    meta = views["meta"]
    frag = fragments(views)
    status = str(meta.get("status", "unknown"))
    level = str(views["verdict"].get("level", ""))
    charts = "".join(
        f'<figure class="chart{" wide" if f["id"] in _WIDE else ""}" id="chart-{_e(f["id"])}">'
        f'<figcaption><h3 class="chart-title">{_e(f["title"])}</h3>'
        f'<p class="chart-summary">{_e(f.get("summary") or f.get("empty") or "")}</p></figcaption></figure>'
        for f in views["figures"]
    )
    script = (
        f"<script>{charts_js()}</script>"
        if charts_src is None
        else f'<script src="{_e(charts_src)}"></script>'
    )
    figs = _script_json(views["figures"])
    boot = f"tdCharts.draw({figs});"
    if live_url is not None:
        state = dict(live_state or {})
        boot = (
            f"var tdFigs = {figs}; tdCharts.draw(tdFigs);"
            f"tdCharts.live({_script_json(live_url)}, new URLSearchParams(location.search).get('token'), 2000,"
            f" {{figures: tdFigs, last_step: {_script_json(state.get('last_step'))},"
            f" frag: {_script_json(state.get('frag', ''))}}});"
        )
    title = f"torchdebug: {meta.get('name') or meta.get('run_id') or 'run'}"
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="color-scheme" content="light dark">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><title>{_e(title)}</title>'
        f"<style>{_CSS}</style></head><body>"
        f'<header>{nav}<h1>{_e(title)}</h1><span id="status" class="badge {_e(status)} {_e(level)}">{_e(status)}</span>'
        f'<small id="updated"></small></header><main>'
        f'<div id="verdict">{frag["verdict_html"]}</div>'
        + (f"<section>{rank_select}</section>" if rank_select else "")
        + f'<section><h2>Anomalies</h2><div id="cards">{frag["cards_html"]}</div></section>'
        + f'<section><h2>Summary</h2><div id="summary">{frag["summary_html"]}</div></section>'
        + f'<section><h2>Charts</h2><div class="grid">{charts}</div></section>'
        + f'<section><h2>Rule events</h2><div id="events" class="table-wrap">{frag["events_html"]}</div></section>'
        + (
            f'<section><h2>Ranks</h2><div id="ranks" class="table-wrap">{frag["ranks_html"]}</div></section>'
            if frag["ranks_html"]
            else ""
        )
        + f'<section><h2>Run</h2><div id="meta">{frag["meta_html"]}</div></section>'
        f"</main>{script}<script>{boot}</script></body></html>\n"
    )

"""HTML rendering: the self-contained report page, its fragments (cards, events, metadata) and the chart JS."""

from __future__ import annotations

import html
import json
from collections.abc import Mapping, Sequence
from typing import Any

from ...events import module_label
from ._format import anomaly_rows, fmt_bytes, fmt_num, fmt_seconds, json_safe
from ._rankview import render_ranks

_CSS = """
:root { --fg:#1d2330; --muted:#5b6475; --line:#dde1e8; --bg:#f6f7f9; --card:#fff; --bad:#c62828; --warn:#ef6c00; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: var(--fg);
       background: var(--bg); margin: 0; }
header { background: #1d2330; color: #fff; padding: 14px 24px; display: flex; gap: 16px; align-items: baseline; }
header h1 { font-size: 18px; margin: 0; font-weight: 600; }
header a { color: #9ecbff; }
main { padding: 16px 24px; max-width: 1500px; margin: 0 auto; }
section { margin-bottom: 22px; }
h2 { font-size: 16px; margin: 18px 0 8px; }
.badge { display: inline-block; padding: 1px 8px; border-radius: 10px; font-size: 12px; background: #607d8b; color: #fff; }
.badge.running { background: #1976d2; } .badge.finished { background: #2e7d32; } .badge.failed { background: var(--bad); }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(620px, 1fr)); gap: 12px; }
.chart { background: var(--card); border: 1px solid var(--line); border-radius: 6px; min-height: 120px; padding: 4px; }
.chart.wide { grid-column: 1 / -1; }
.empty { color: var(--muted); padding: 12px; margin: 0; }
.kv { display: grid; grid-template-columns: max-content 1fr; gap: 2px 14px; }
.kv dt { color: var(--muted); } .kv dd { margin: 0; font-family: ui-monospace, Menlo, monospace; word-break: break-all; }
.tiles { display: flex; flex-wrap: wrap; gap: 10px; }
.tile { background: var(--card); border: 1px solid var(--line); border-radius: 6px; padding: 8px 14px; min-width: 150px; }
.tile b { display: block; font-size: 20px; } .tile span { color: var(--muted); font-size: 12px; }
.tile.bad b { color: var(--bad); }
.card { background: var(--card); border: 1px solid var(--line); border-left: 4px solid var(--bad);
        border-radius: 6px; padding: 10px 14px; margin-bottom: 10px; }
.card h3 { font-size: 14px; margin: 0 0 6px; font-family: ui-monospace, Menlo, monospace; }
.card .hint { background: #fff8e1; border-radius: 4px; padding: 4px 8px; margin: 6px 0; }
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
#rank-select a.rank.current { background: #1d2330; color: #fff; }
"""

# Chart drawing shared by the static report and the live dashboard: the figures are prebuilt dicts
# (see _figures.py), so the browser only hands them to plotly.js. Plotly.react diffs, so the live
# page can redraw every poll without flicker.
_JS = """
function tdDraw(figs) {
  for (const f of figs) {
    const el = document.getElementById('chart-' + f.id);
    if (!el) continue;
    if (!f.data.length) {
      if (el.dataset.drawn) { Plotly.purge(el); delete el.dataset.drawn; }
      el.innerHTML = '';
      const p = document.createElement('p'); p.className = 'empty'; p.textContent = f.title + ': ' + f.empty;
      el.appendChild(p);
      continue;
    }
    if (!el.dataset.drawn) { el.innerHTML = ''; el.dataset.drawn = '1'; }
    Plotly.react(el, f.data, f.layout, {responsive: true, displaylogo: false});
  }
}
function tdLive(url, token, everyMs) {
  const headers = token ? {'Authorization': 'Bearer ' + token} : {};
  async function poll() {
    try {
      const r = await fetch(url, {headers: headers, cache: 'no-store'});
      if (r.ok) {
        const v = await r.json();
        tdDraw(v.figures);
        for (const key of ['summary', 'ranks', 'cards', 'events', 'meta']) {
          const el = document.getElementById(key);
          if (el && el.dataset.html !== v[key + '_html']) { el.innerHTML = v[key + '_html']; el.dataset.html = v[key + '_html']; }
        }
        const st = document.getElementById('status');
        st.textContent = v.status; st.className = 'badge ' + v.status;
        document.getElementById('updated').textContent = 'updated ' + new Date().toLocaleTimeString();
        if (v.status !== 'running') return;  // a finished run no longer changes
      }
    } catch (e) { document.getElementById('updated').textContent = 'connection lost, retrying'; }
    setTimeout(poll, everyMs);
  }
  poll();
}
"""

_WIDE = {"layers", "nonfinite"}


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _script_json(obj: Any) -> str:
    """JSON for inlining inside <script>: NaN-free and unable to close the script tag."""
    text = json.dumps(json_safe(obj), separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _rng(lo: Any, hi: Any) -> str:
    return "-" if lo is None or hi is None else f"[{fmt_num(lo)}, {fmt_num(hi)}]"


def render_cards(anomalies: Sequence[Mapping[str, Any]]) -> str:
    """Anomaly cards: summary, phase, module, op, line, step, hint, tensor and the frames before it."""
    if not anomalies:
        return '<p class="empty">No anomaly recorded: no NaN/Inf was born in this run.</p>'
    out = []
    for a in anomalies:
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
        parts = [
            f'<div class="card anomaly"><h3>{_e(a.get("summary") or a.get("kind"))}</h3><dl class="kv">{kv}</dl>'
        ]
        if a.get("hint"):
            parts.append(f'<div class="hint">hint: {_e(a["hint"])}</div>')
        t = a.get("tensor")
        if isinstance(t, Mapping):
            parts.append(
                f"<div>output: <code>{_e(t.get('name') or '')} {_e(t.get('shape'))} {_e(t.get('dtype'))} "
                f"NaN×{_e(t.get('nan_count', 0))} +Inf×{_e(t.get('posinf_count', 0))} "
                f"-Inf×{_e(t.get('neginf_count', 0))} finite∈{_e(_rng(t.get('min'), t.get('max')))}</code></div>"
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


def render_events(events: Sequence[Mapping[str, Any]]) -> str:
    """Rule events as a table: severity, step, kind, modules, message, evidence."""
    if not events:
        return '<p class="empty">No rule fired.</p>'
    rows = []
    for ev in events:
        data = ev.get("data") or {}
        modules = ", ".join(map(str, data.get("modules") or [])) if isinstance(data, Mapping) else ""
        evidence = data.get("evidence") if isinstance(data, Mapping) else None
        ev_text = (
            ", ".join(f"{k}={fmt_num(v)}" for k, v in evidence.items())
            if isinstance(evidence, Mapping)
            else ""
        )
        sev = str(ev.get("severity", ""))
        rows.append(
            f'<tr class="sev-{_e(sev)}"><td>{_e(sev)}</td><td class="num">{_e(fmt_num(ev.get("step")))}</td>'
            f"<td>{_e(ev.get('kind'))}</td><td>{_e(modules)}</td><td>{_e(ev.get('message'))}</td>"
            f"<td><code>{_e(ev_text)}</code></td></tr>"
        )
    return (
        "<table><tr><th>severity</th><th>step</th><th>kind</th><th>modules</th><th>message</th><th>evidence</th></tr>"
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
    return f'<dl class="kv">{kv}</dl><h2>Config</h2><dl class="kv">{cfg or "<dt>-</dt><dd>none recorded</dd>"}</dl>'


def fragments(views: Mapping[str, Any]) -> dict[str, str]:
    """The page's server-rendered parts, keyed as the live dashboard swaps them: ``<key>_html``."""
    return {
        "summary_html": render_summary(views["report"]),
        "cards_html": render_cards(views["anomalies"]),
        "events_html": render_events(views["events"]),
        "meta_html": render_meta(views["meta"]),
        "ranks_html": render_ranks(views["report"].get("ranks")),  # "" for one rank
    }


def render_page(
    views: Mapping[str, Any],
    *,
    plotly_js: str | None = None,
    plotly_src: str | None = None,
    live_url: str | None = None,
    nav: str = "",
    rank_select: str = "",
) -> str:
    """The whole page for one run.

    Args:
        views: from ``collect_views`` (meta, report, figures, anomalies, events).
        plotly_js: plotly.js source to inline (the self-contained report).
        plotly_src: a same-origin URL of plotly.js (the dashboard serves its own copy).
        live_url: when given, the page polls this JSON URL every 2 s and redraws (dashboard).
        nav: extra header HTML (the dashboard's link back to the run list).
        rank_select: the dashboard's rank selector (``_rankview.render_rank_selector``), shown above
            the summary of a run of several ranks.

    Returns:
        The HTML text. It loads nothing from the network.
    """
    if (plotly_js is None) == (plotly_src is None):
        raise ValueError("pass exactly one of plotly_js (inline) or plotly_src (served URL)")
    meta = views["meta"]
    frag = fragments(views)
    status = str(meta.get("status", "unknown"))
    charts = "".join(
        f'<div class="chart{" wide" if f["id"] in _WIDE else ""}" id="chart-{_e(f["id"])}"></div>'
        for f in views["figures"]
    )
    plotly_tag = (
        f"<script>{plotly_js}</script>"
        if plotly_js is not None
        else f'<script src="{_e(plotly_src)}"></script>'
    )
    boot = f"tdDraw({_script_json(views['figures'])});"
    if live_url is not None:
        boot += f"tdLive({_script_json(live_url)}, new URLSearchParams(location.search).get('token'), 2000);"
    title = f"torchdebug: {meta.get('name') or meta.get('run_id') or 'run'}"
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><title>{_e(title)}</title>'
        f"<style>{_CSS}</style>{plotly_tag}</head><body>"
        f'<header>{nav}<h1>{_e(title)}</h1><span id="status" class="badge {_e(status)}">{_e(status)}</span>'
        f'<small id="updated"></small></header><main>'
        + (f"<section>{rank_select}</section>" if rank_select else "")
        + f'<section><h2>Summary</h2><div id="summary">{frag["summary_html"]}</div></section>'
        + (
            f'<section><h2>Ranks</h2><div id="ranks">{frag["ranks_html"]}</div></section>'
            if frag["ranks_html"]
            else ""
        )
        + f'<section><h2>Anomalies</h2><div id="cards">{frag["cards_html"]}</div></section>'
        + f'<section><h2>Charts</h2><div class="grid">{charts}</div></section>'
        f'<section><h2>Rule events</h2><div id="events">{frag["events_html"]}</div></section>'
        f'<section><h2>Run</h2><div id="meta">{frag["meta_html"]}</div></section>'
        f"</main><script>{_JS}\n{boot}</script></body></html>\n"
    )

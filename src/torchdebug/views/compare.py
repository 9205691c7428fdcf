"""Two runs side by side (``torchdebug compare A B``): their verdicts, where they part, what differs, charts overlaid.

Pure over what the store reads back, like the report: ``compare_runs`` returns plain data,
``render_compare_text`` and ``render_compare_html`` draw it. Where the runs *part*: the first step
from which the gap between their values (``|log a - log b|``, or ``|a - b|`` when a value is not
positive) exceeds three times the larger of the two runs' own step-to-step jitter (the median of
``|log v[t] - log v[t-1]|``) and stays above it for the next two common steps: a crossing is not a
parting, and two runs with the same seed, data and code are identical until something changes.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from .report._format import fmt_num, is_finite, json_safe, natural_key
from .verdict import verdict as run_verdict

#: the metrics whose parting ``compare_runs`` looks for, in order
PART_METRICS = ("loss", "grad_norm")
NOISE_TIMES = 3.0  # a gap is beyond noise above this many jitters
HOLD = 2  # ... and stays beyond it for this many more common steps
_ENV_KEYS = ("torch", "torchdebug", "python", "host", "world_size")


def _gap(a: float, b: float) -> float:
    if a > 0 and b > 0:
        return abs(math.log(a) - math.log(b))
    return abs(a - b)


def _jitter(values: Sequence[float]) -> float:
    """Median step-to-step change of a series (in log where positive): its own noise."""
    d = sorted(_gap(x, y) for x, y in itertools.pairwise(values))
    return d[len(d) // 2] if d else 0.0


def parting(
    steps_a: Sequence[int], values_a: Sequence[float], steps_b: Sequence[int], values_b: Sequence[float]
) -> dict[str, Any] | None:
    """The first common step where two series part beyond noise (see the module docstring).

    Returns ``{"step", "a", "b", "gap", "noise", "common"}`` or None (they never part, or share no
    finite step). A step where one run is not finite and the other is counts as parted.

    Example: two runs identical until step 100 whose losses differ 300x from step 101 on part at
    step 101.
    """
    b_at = {s: v for s, v in zip(steps_b, values_b)}
    common = [(s, v, b_at[s]) for s, v in zip(steps_a, values_a) if s in b_at]
    if not common:
        return None
    fa = [a for _, a, _ in common if is_finite(a)]
    fb = [b for _, _, b in common if is_finite(b)]
    noise = max(_jitter(fa), _jitter(fb))
    limit = NOISE_TIMES * noise

    def apart(a: float, b: float) -> bool:
        if is_finite(a) != is_finite(b):
            return True
        if not is_finite(a):
            return False  # both NaN/Inf: no gap to measure
        return _gap(a, b) > limit

    flags = [apart(a, b) for _, a, b in common]
    for i, (s, a, b) in enumerate(common):
        if all(flags[i : i + HOLD + 1]):
            gap = _gap(a, b) if is_finite(a) and is_finite(b) else math.inf
            return {"step": s, "a": a, "b": b, "gap": gap, "noise": noise, "common": len(common)}
    return None


def _differences(a: Mapping[str, Any], b: Mapping[str, Any], keys: Sequence[str]) -> list[dict[str, Any]]:
    return [{"key": k, "a": a.get(k), "b": b.get(k)} for k in keys if a.get(k) != b.get(k)]


def _first_values(run: Any, prefix: str) -> dict[str, Any]:
    return {n: run.series(n) for n in run.metric_names() if n.startswith(prefix)}


def _hyper_changes(run_a: Any, run_b: Any) -> list[dict[str, Any]]:
    """Per learning-rate series the first common step where the two runs' values differ."""
    sa, sb = _first_values(run_a, "lr/"), _first_values(run_b, "lr/")
    out = []
    for name in sorted(set(sa) | set(sb), key=natural_key):
        if name not in sa or name not in sb:
            out.append({"name": name, "step": None, "a": name in sa, "b": name in sb})
            continue
        b_at = dict(zip(sb[name].steps, sb[name].values))
        for s, v in zip(sa[name].steps, sa[name].values):
            if s in b_at and v != b_at[s] and not (math.isnan(v) and math.isnan(b_at[s])):
                out.append({"name": name, "step": s, "a": v, "b": b_at[s]})
                break
    return out


def compare_runs(run_a: Any, run_b: Any) -> dict[str, Any]:
    """Compare two open runs (``open_run``).

    Returns ``{"a", "b": {"name", "path", "status", "verdict"}, "parting": {metric: parting(...) or
    None, for metric in PART_METRICS both runs hold}, "config": [{"key", "a", "b"}] (watch()'s
    options that differ), "environment": [...] (torch, python, host ...), "learning_rates": [{"name",
    "step", "a", "b"}] (the first step each LR differs), "series": {metric: {"a": {"steps",
    "values"}, "b": ...}} (for the overlaid charts)}``.

    Cost: reads both runs' loss, gradient-norm and learning-rate series whole.
    """
    out: dict[str, Any] = {}
    for key, run in (("a", run_a), ("b", run_b)):
        out[key] = {
            "name": run.name,
            "path": str(run.path),
            "status": run.status,
            "verdict": run_verdict(run),
        }
    names_a, names_b = set(run_a.metric_names()), set(run_b.metric_names())
    out["parting"] = {}
    out["series"] = {}
    for metric in (*PART_METRICS, *sorted((names_a & names_b) - set(PART_METRICS), key=natural_key)):
        if metric not in names_a or metric not in names_b:
            continue
        if metric not in PART_METRICS and not metric.startswith("lr/"):
            continue
        sa, sb = run_a.series(metric), run_b.series(metric)
        out["series"][metric] = {
            "a": {"steps": list(sa.steps), "values": list(sa.values)},
            "b": {"steps": list(sb.steps), "values": list(sb.values)},
        }
        if metric in PART_METRICS:
            out["parting"][metric] = parting(sa.steps, sa.values, sb.steps, sb.values)
    ca, cb = run_a.meta.get("config") or {}, run_b.meta.get("config") or {}
    out["config"] = _differences(ca, cb, sorted(set(ca) | set(cb)))
    out["config_options"] = len(set(ca) | set(cb))
    out["environment"] = _differences(run_a.meta, run_b.meta, _ENV_KEYS)
    out["learning_rates"] = _hyper_changes(run_a, run_b)
    return out


def _v(x: Any) -> str:
    if isinstance(x, float):
        return fmt_num(x)
    if isinstance(x, (dict, list)):
        return json.dumps(json_safe(x), sort_keys=True)
    return "-" if x is None else str(x)


def _part_line(metric: str, p: Mapping[str, Any] | None) -> str:
    if p is None:
        return f"{metric}: A and B never part beyond noise"
    gap = "one not finite" if p["gap"] == math.inf else f"gap {fmt_num(p['gap'])}"
    return (
        f"{metric}: A and B part at step {p['step']} (A {_v(p['a'])}, B {_v(p['b'])}; {gap} > "
        f"{NOISE_TIMES:g} x noise {fmt_num(p['noise'])})"
    )


def compare_lines(c: Mapping[str, Any]) -> list[str]:
    """The comparison as text lines (what ``torchdebug compare`` prints)."""
    from .._term import printable

    out = [
        f"A  {printable(c['a']['name'])}  {printable(c['a']['path'])}",
        f"B  {printable(c['b']['name'])}  {printable(c['b']['path'])}",
        "",
        f"A  {printable(c['a']['verdict']['text'])}",
        f"B  {printable(c['b']['verdict']['text'])}",
        "",
    ]
    if c["parting"]:
        out += ["where they part:"] + [f"  {_part_line(m, p)}" for m, p in c["parting"].items()]
    else:
        out.append("where they part: no loss or gradient norm recorded in both runs")
    for lr in c["learning_rates"]:
        if lr["step"] is None:
            have = "A" if lr["a"] else "B"
            out.append(f"  {lr['name']}: only in {have}")
        else:
            out.append(
                f"  {lr['name']}: first differs at step {lr['step']} (A {_v(lr['a'])}, B {_v(lr['b'])})"
            )
    n = len(c["config"])
    out.append("")
    out.append(
        f"config: {n} of {c['config_options']} options differ:"
        if n
        else f"config: the same {c['config_options']} options"
    )
    out += [
        f"  {printable(d['key'])}: A {printable(_v(d['a']))}, B {printable(_v(d['b']))}" for d in c["config"]
    ]
    if c["environment"]:
        out.append("environment differs:")
        out += [
            f"  {d['key']}: A {printable(_v(d['a']))}, B {printable(_v(d['b']))}" for d in c["environment"]
        ]
    else:
        out.append("environment: the same (" + ", ".join(_ENV_KEYS) + ")")
    return out


def render_compare_text(c: Mapping[str, Any]) -> str:
    """``compare_lines`` joined, ending in a newline."""
    return "\n".join(compare_lines(c)) + "\n"


_A, _B = "#1f77b4", "#ff7f0e"


def _overlay(metric: str, c: Mapping[str, Any], title: str, log: bool) -> dict[str, Any]:
    from .report._figures import _layout, _line

    s = c["series"].get(metric)
    if s is None:
        return {
            "id": metric,
            "title": title,
            "summary": "",
            "data": [],
            "layout": _layout(""),
            "empty": "not in both runs",
        }
    y2 = metric.startswith("lr/")
    traces = [
        _line(f"A {metric}", s["a"], line={"color": _A}),
        _line(f"B {metric}", s["b"], line={"color": _B, **({"dash": "dot"} if y2 else {})}),
    ]
    p = c["parting"].get(metric)
    summary = _part_line(metric, p) if metric in PART_METRICS else ""
    if p is not None:
        traces.append(
            {
                "type": "scatter",
                "mode": "markers",
                "name": "they part",
                "x": [p["step"]],
                "y": [0],
                "text": [f"A and B part at step {p['step']}"],
                "yaxis": "y3",
                "marker": {"symbol": "diamond", "size": 10, "color": "#e377c2"},
            }
        )
    layout = _layout(metric, log=log, toggles=("log", "smooth"))
    fid = "cmp-" + "".join(ch if ch.isalnum() else "-" for ch in metric)
    return {"id": fid, "title": title, "summary": summary, "data": traces, "layout": layout, "empty": ""}


def compare_figures(c: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The overlaid charts: loss, gradient norm (log), and each learning rate both runs hold."""
    figs = [
        _overlay("loss", c, "Loss: A and B", log=True),  # two runs apart by orders of magnitude
        _overlay("grad_norm", c, "Total gradient norm: A and B", log=True),
    ]
    figs += [
        _overlay(m, c, f"Learning rate {m}: A and B", log=True) for m in c["series"] if m.startswith("lr/")
    ]
    return [f for f in figs if f["data"]]


def render_compare_html(c: Mapping[str, Any]) -> str:
    """A self-contained HTML page of the comparison (the report's styles and chart renderer, inlined;
    it loads nothing from the network)."""
    from .report._html import _CSS, _e, _script_json, charts_js, render_verdict

    figs = compare_figures(c)
    charts = "".join(
        f'<figure class="chart wide" id="chart-{_e(f["id"])}"><figcaption><h3 class="chart-title">'
        f'{_e(f["title"])}</h3><p class="chart-summary">{_e(f["summary"])}</p></figcaption></figure>'
        for f in figs
    )

    def rows(items: Sequence[Mapping[str, Any]]) -> str:
        return "".join(
            f"<tr><td>{_e(d['key'])}</td><td><code>{_e(_v(d['a']))}</code></td><td><code>{_e(_v(d['b']))}</code></td></tr>"
            for d in items
        )

    head = "<tr><th></th><th>A</th><th>B</th></tr>"
    parts = "".join(f"<li>{_e(_part_line(m, p))}</li>" for m, p in c["parting"].items())
    lrs = "".join(
        f"<li>{_e(lr['name'])}: first differs at step {_e(lr['step'])} (A {_e(_v(lr['a']))}, B {_e(_v(lr['b']))})</li>"
        for lr in c["learning_rates"]
        if lr["step"] is not None
    )
    cfg = (
        f'<table id="config">{head}{rows(c["config"])}</table>'
        if c["config"]
        else f'<p class="empty">The same {c["config_options"]} options.</p>'
    )
    env = (
        f'<table id="environment">{head}{rows(c["environment"])}</table>'
        if c["environment"]
        else f'<p class="empty">The same {", ".join(_ENV_KEYS)}.</p>'
    )
    title = f"torchdebug: {c['a']['name']} vs {c['b']['name']}"
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="color-scheme" content="light dark">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><title>{_e(title)}</title>'
        f"<style>{_CSS}</style></head><body><header><h1>{_e(title)}</h1></header><main>"
        f'<section id="verdicts"><h2>A: {_e(c["a"]["name"])}</h2>{render_verdict(c["a"]["verdict"])}'
        f"<h2>B: {_e(c['b']['name'])}</h2>{render_verdict(c['b']['verdict'])}</section>"
        f'<section><h2>Where they part</h2><ul id="parting">{parts or "<li>no loss or gradient norm in both runs</li>"}{lrs}</ul></section>'
        f'<section><h2>Charts</h2><div class="grid">{charts}</div></section>'
        f"<section><h2>Config</h2>{cfg}</section><section><h2>Environment</h2>{env}</section>"
        f"</main><script>{charts_js()}</script><script>tdCharts.draw({_script_json(figs)});</script></body></html>\n"
    )


__all__ = [
    "PART_METRICS",
    "compare_figures",
    "compare_lines",
    "compare_runs",
    "parting",
    "render_compare_html",
    "render_compare_text",
]

"""Chart specs (plain JSON for tdcharts.js) built from collected run data; shared by the HTML report and the dashboard."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from ._format import event_category, fmt_num, is_finite, natural_key, nonfinite_label

# Figures are plain dicts ({"data": [...traces], "layout": {...}}) drawn by static/tdcharts.js. A trace
# is {"type": "scatter" | "heatmap", "mode": "lines" | "markers" | "lines+markers", "name", "x", "y",
# "yaxis": "y2" (right axis) | "y3" (markers on the lane under the plot, one row per trace; a chart
# of markers alone is all lane), "line", "marker", "text", "stackgroup"}; the heatmap's {"x", "y"
# (row names), "z"}. A layout's yaxis may say "robust": true: the axis starts with outliers left out
# (a toggle shows them), so one spike does not flatten the curve.

Points = Mapping[str, Sequence[Any]]  # {"steps": [...], "values": [...]}

_MARK_AXIS = "y3"  # markers on the lane under the plot area (events, NaN points), never at a data height
_HEAT_COLUMNS = 200  # heatmap columns (step buckets); each cell is the bucket's max
_ZERO_LOG = -12.0  # log10 floor shown for an exactly-zero gradient norm
_MAX_LINES = 24  # per-parameter line charts show at most this many parameters (largest last value)

_COLORS = {
    "nan": "#d62728",
    "inf": "#9467bd",
    "-inf": "#8c564b",
    "anomaly": "#d62728",
    "skipped": "#ff7f0e",
    "event": "#e377c2",
}
# learning-rate lines: no red (NaN markers and anomalies are red), none of the marker colours
_LR_COLORS = ("#2ca02c", "#17becf", "#bcbd22", "#7f7f7f")


def _line(name: str, pts: Points, **extra: Any) -> dict[str, Any]:
    """A line trace; non-finite values become gaps (None) and are drawn separately by ``_nonfinite``."""
    # 6 significant digits: what a hover shows, at half the JSON of a float's full repr
    vals = [float(f"{v:.6g}") if is_finite(v) else None for v in pts["values"]]
    trace: dict[str, Any] = {
        "type": "scatter",
        "mode": "lines",
        "name": name,
        "x": list(pts["steps"]),
        "y": vals,
    }
    trace.update(extra)
    return trace


def _nonfinite(name: str, pts: Points) -> list[dict[str, Any]]:
    """Marker traces for the NaN / +Inf / -Inf points of a series (plotly would silently drop them)."""
    by_kind: dict[str, list[int]] = {}
    for s, v in zip(pts["steps"], pts["values"]):
        label = nonfinite_label(v) if isinstance(v, float) else None
        if label is not None:
            by_kind.setdefault(label, []).append(s)
    out = []
    for kind, steps in by_kind.items():
        out.append(
            {
                "type": "scatter",
                "mode": "markers",
                "name": f"{name} {kind.upper() if kind == 'nan' else kind}",
                "x": steps,
                "y": [0] * len(steps),  # on the lane: the row is the trace's, not a value
                "text": [kind] * len(steps),
                "yaxis": _MARK_AXIS,
                "marker": {"symbol": "x", "size": 9, "color": _COLORS[kind]},
                "hovertemplate": f"{name} = {kind} at step %{{x}}<extra></extra>",
            }
        )
    return out


def _markers(name: str, steps: list[int], texts: list[str], color: str, symbol: str) -> dict:
    return {
        "type": "scatter",
        "mode": "markers",
        "name": name,
        "x": steps,
        "y": [0] * len(steps),  # on the lane: the row is the trace's, not a value
        "text": texts,
        "yaxis": _MARK_AXIS,
        "marker": {"symbol": symbol, "size": 10, "color": color},
        "hovertemplate": "step %{x}: %{text}<extra></extra>",
    }


def _layout(
    ytitle: str, *, log: bool = False, toggles: tuple[str, ...] = (), height: int = 280, **extra: Any
) -> dict[str, Any]:
    """The chart's axes for ``tdcharts.js``: ``yaxis`` (title, linear|log), an optional ``yaxis2``
    (right side), ``toggles`` (``"log"``: a log-scale switch, ``"smooth"``: EMA smoothing) and height.
    Traces on ``yaxis: "y3"`` are markers at a fixed height in [0, 1] of the plot area."""
    layout: dict[str, Any] = {
        "yaxis": {"title": ytitle, "type": "log" if log else "linear"},
        "toggles": list(toggles),
        "height": height,
    }
    layout.update(extra)
    return layout


def _fig(
    fid: str, title: str, data: list[dict[str, Any]], layout: dict[str, Any], empty: str, summary: str = ""
) -> dict:
    """A chart: ``summary`` is its one-line text alternative (shown under the title, read by screen readers)."""
    return {
        "id": fid,
        "title": title,
        "summary": summary if data else "",
        "data": data,
        "layout": layout,
        "empty": empty if not data else "",
    }


def _finite_points(pts: Points) -> list[tuple[int, float]]:
    return [(s, float(v)) for s, v in zip(pts["steps"], pts["values"]) if is_finite(v)]


def _nonfinite_count(pts: Points) -> int:
    return sum(1 for v in pts["values"] if isinstance(v, float) and not math.isfinite(v))


def describe(name: str, pts: Points, unit: str = "") -> str:
    """``loss 2.3 at step 0 -> 0.018 at step 1999 (min 0.017 at step 1500, max 17.6 at step 1300); 3 NaN/Inf``.

    The series' first and last finite points, its extremes, and how many points were not finite.
    """
    fin = _finite_points(pts)
    bad = _nonfinite_count(pts)
    tail = f"; {bad} NaN/Inf points" if bad else ""
    if not fin:
        return f"{name}: no finite values{tail}"
    (s0, v0), (s1, v1) = fin[0], fin[-1]
    lo = min(fin, key=lambda p: p[1])
    hi = max(fin, key=lambda p: p[1])
    u = f" {unit}" if unit else ""
    if len(fin) == 1:
        return f"{name} {fmt_num(v0)}{u} at step {s0}{tail}"
    if lo[1] == hi[1]:
        return f"{name} {fmt_num(v0)}{u} throughout (steps {s0} to {s1}){tail}"
    return (
        f"{name} {fmt_num(v0)}{u} at step {s0} -> {fmt_num(v1)}{u} at step {s1} "
        f"(min {fmt_num(lo[1])} at step {lo[0]}, max {fmt_num(hi[1])} at step {hi[0]}){tail}"
    )


def _with_prefix(series: Mapping[str, Points], prefix: str) -> list[str]:
    return sorted((n for n in series if n.startswith(prefix)), key=natural_key)


def _anomaly_markers(anomalies: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    steps = [a["step"] for a in anomalies if isinstance(a.get("step"), int)]
    texts = [  # short: a run may hold hundreds of anomalies, each marker carries its text
        f"{a.get('kind', 'anomaly')} in {a.get('module') or a.get('parameter') or a.get('symptom') or '?'}"
        for a in anomalies
        if isinstance(a.get("step"), int)
    ]
    if not steps:
        return []
    return [_markers("anomaly", steps, texts, _COLORS["anomaly"], "x-thin-open")]


def _event_markers(events: Sequence[Mapping[str, Any]], category: str) -> list[dict[str, Any]]:
    chosen = [
        e for e in events if isinstance(e.get("step"), int) and event_category(str(e["kind"])) == category
    ]
    if not chosen:
        return []
    return [
        _markers(
            f"{category} events",
            [e["step"] for e in chosen],
            [f"{e['kind']}: {e.get('message', '')}" for e in chosen],
            _COLORS["event"],
            "diamond",
        )
    ]


def loss_figure(data: Mapping[str, Any]) -> dict[str, Any]:
    """Loss (left axis, log toggle, smoothing) and learning rate per param group (right axis), with
    NaN/Inf loss markers, anomalies and loss rule events (divergence, spikes)."""
    series = data["series"]
    traces: list[dict[str, Any]] = []
    parts = []
    if "loss" in series:
        traces.append(_line("loss", series["loss"]))
        traces += _nonfinite("loss", series["loss"])
        parts.append(describe("loss", series["loss"]))
    lr_names = _with_prefix(series, "lr/")
    for i, name in enumerate(lr_names):
        color = _LR_COLORS[i % len(_LR_COLORS)]
        traces.append(_line(name, series[name], yaxis="y2", line={"dash": "dot", "color": color}))
    if lr_names:
        parts.append(describe("learning rate" if len(lr_names) == 1 else lr_names[0], series[lr_names[0]]))
    traces += _anomaly_markers(data["anomalies"])
    traces += _event_markers(data["events"], "loss")
    layout = _layout(
        "loss",
        toggles=("outliers", "log", "smooth"),
        yaxis2={"title": "learning rate", "type": "linear"} if lr_names else None,
    )
    layout["yaxis"]["robust"] = True  # one spike must not flatten the rest of the curve
    return _fig("loss", "Loss and learning rate", traces, layout, "no loss or lr recorded", "; ".join(parts))


def grad_norm_figure(data: Mapping[str, Any]) -> dict[str, Any]:
    """Total gradient norm (log) with skipped steps, anomalies, gradient rule events and NaN/Inf markers."""
    series = data["series"]
    traces: list[dict[str, Any]] = []
    parts = []
    if "grad_norm" in series:
        traces.append(_line("grad_norm", series["grad_norm"]))
        traces += _nonfinite("grad_norm", series["grad_norm"])
        parts.append(describe("gradient norm", series["grad_norm"]))
    for name in _model_totals(series):  # several models: each one's total beside the sum
        traces.append(_line(f"‖g‖ of {name[len('grad_norm/') :]}", series[name]))
    if "amp_scale" in series:
        traces.append(_line("amp_scale", series["amp_scale"], yaxis="y2", line={"dash": "dot"}))
    if "skipped" in series:
        sk = series["skipped"]
        steps = [s for s, v in zip(sk["steps"], sk["values"]) if is_finite(v) and v > 0]
        if steps:
            traces.append(
                _markers("skipped step", steps, ["skipped"] * len(steps), _COLORS["skipped"], "triangle-down")
            )
            parts.append(f"{len(steps)} skipped steps")
    traces += _anomaly_markers(data["anomalies"])
    traces += _event_markers(data["events"], "gradient")
    layout = _layout(
        "‖g‖₂",
        log=True,
        toggles=("log", "smooth"),
        yaxis2={"title": "AMP scale", "type": "log"} if "amp_scale" in series else None,
    )
    return _fig(
        "grad_norm", "Total gradient norm", traces, layout, "no gradient norms recorded", "; ".join(parts)
    )


def _any_bad(values: Sequence[Any]) -> bool:
    """A count series that ever left zero (or was not finite)."""
    return any(not is_finite(v) or v > 0 for v in values)


def nonfinite_figure(data: Mapping[str, Any]) -> dict[str, Any]:
    """NaN/Inf counts, only when there are any: params with non-finite grads, tensor-stat NaN/Inf
    totals, every metric's non-finite points, and the anomalies (a run that raised at its first NaN
    has no NaN in its metrics, but it has the anomaly). A run with none of them gets no chart, one
    line of text: "none in this run"."""
    series = data["series"]
    traces: list[dict[str, Any]] = []
    parts = []
    gn = series.get("grad_nonfinite")
    if gn is not None and _any_bad(gn["values"]):
        traces.append(_line("params with non-finite grad", gn, mode="lines+markers", line={"shape": "hv"}))
        bad = [s for s, v in zip(gn["steps"], gn["values"]) if not is_finite(v) or v > 0]
        parts.append(f"{len(bad)} steps with non-finite gradients, first at step {bad[0]}")
    tn = data.get("tensor_nonfinite") or {}
    if tn.get("steps") and (_any_bad(tn["nan"]) or _any_bad(tn["inf"])):
        traces.append(
            _line("NaN values (tensor stats)", {"steps": tn["steps"], "values": tn["nan"]}, mode="markers")
        )
        traces.append(
            _line("Inf values (tensor stats)", {"steps": tn["steps"], "values": tn["inf"]}, mode="markers")
        )
    # Every other metric's non-finite points, one marker trace per metric that has any.
    metrics = []
    for name in sorted(series, key=natural_key):
        marks = _nonfinite(name, series[name])
        if marks:
            metrics.append(name)
        traces += marks
    if metrics:
        shown = ", ".join(metrics[:3]) + (f" and {len(metrics) - 3} more" if len(metrics) > 3 else "")
        parts.append(f"non-finite values in {shown}")
    anomalies = [a for a in data["anomalies"] if isinstance(a.get("step"), int)]
    if anomalies:
        bad_steps = sorted({a["step"] for a in anomalies})
        parts.insert(
            0,
            f"{len(anomalies)} NaN/Inf anomal{'y' if len(anomalies) == 1 else 'ies'} on "
            f"{len(bad_steps)} step{'s' if len(bad_steps) != 1 else ''}, first at step {bad_steps[0]}",
        )
        if not traces:  # the run stopped (or skipped) before any recorded number held the NaN/Inf
            parts.append("no recorded metric holds a NaN/Inf")
        traces += _anomaly_markers(anomalies)
    return _fig(
        "nonfinite",
        "NaN / Inf counts",
        traces,
        _layout("count"),
        "none in this run",
        "; ".join(parts),
    )


def _bucket_max(
    steps: Sequence[int], values: Sequence[float], lo: int, width: float, ncols: int
) -> tuple[list[float | None], list[int]]:
    """Per column the max log10 of finite values, and the columns holding a non-finite value."""
    cells: list[float | None] = [None] * ncols
    bad: list[int] = []
    for s, v in zip(steps, values):
        c = min(ncols - 1, int((s - lo) / width))
        if not is_finite(v):
            bad.append(c)
            continue
        lv = round(math.log10(v), 3) if v > 0 else _ZERO_LOG  # a colour: 3 decimals are plenty
        cur = cells[c]
        cells[c] = lv if cur is None or lv > cur else cur
    return cells, sorted(set(bad))


def _model_totals(series: Mapping[str, Points]) -> list[str]:
    """``grad_norm/G``-style names: a model's total norm, recorded beside its parameters' when
    several models are watched (a name that is the prefix of another one's, up to a dot)."""
    names = _with_prefix(series, "grad_norm/")
    return [n for n in names if any(m.startswith(n + ".") for m in names)]


def _parameter_rows(series: Mapping[str, Points]) -> list[str]:
    """Per-parameter gradient-norm names with points. Models' totals are left out: they are
    recorded every step while parameters are recorded every ``detail_every`` steps, and one row per
    step among rows of every tenth step would leave nine blank columns in ten (a GAN's heatmap);
    the totals are lines in the gradient-norm chart instead."""
    totals = set(_model_totals(series))
    return [n for n in _with_prefix(series, "grad_norm/") if series[n]["steps"] and n not in totals]


def layer_heatmap_figure(data: Mapping[str, Any]) -> dict[str, Any]:
    """Per-layer gradient norm heatmap: rows = parameters, columns = step buckets, cell = max log10 ‖g‖."""
    series = data["series"]
    names = _parameter_rows(series)
    if not names:
        return _fig("layers", "Per-layer gradient norm", [], _layout(""), "no per-layer norms")
    all_steps = [s for n in names for s in series[n]["steps"]]
    distinct = sorted(set(all_steps))
    lo, hi = distinct[0], distinct[-1]
    if len(distinct) <= _HEAT_COLUMNS:
        # few detail steps (every detail_every): one column per recorded step, no empty columns
        xs: list[float] = [float(x) for x in distinct]
        col = {st: i for i, st in enumerate(distinct)}
        ncols, width = len(distinct), 1.0
    else:
        ncols = _HEAT_COLUMNS
        width = (hi - lo + 1) / ncols
        xs = [round(lo + c * width, 3) for c in range(ncols)]  # each column's first step
        col = {}
    rows = [n[len("grad_norm/") :] for n in names]
    z: list[list[float | None]] = []
    bad_x: list[float] = []
    bad_y: list[str] = []
    for n, row in zip(names, rows):
        steps = series[n]["steps"]
        if col:  # map each step to its column index, then bucket with width 1 from 0
            steps = [col[st] for st in steps]
            cells, bad = _bucket_max(steps, series[n]["values"], 0, 1.0, ncols)
        else:
            cells, bad = _bucket_max(steps, series[n]["values"], lo, width, ncols)
        z.append(cells)
        bad_x += [xs[c] for c in bad]
        bad_y += [row] * len(bad)
    traces: list[dict[str, Any]] = [
        {
            "type": "heatmap",
            "name": "log10 ‖g‖",
            "x": xs,
            "y": rows,
            "z": z,
            "colorscale": "Viridis",
            "colorbar": {"title": {"text": "log10 ‖g‖"}},
            "hovertemplate": "%{y}<br>step ≈ %{x}<br>log10 ‖g‖ = %{z:.2f}<extra></extra>",
        }
    ]
    if bad_x:
        traces.append(
            {
                "type": "scatter",
                "mode": "markers",
                "name": "non-finite grad",
                "x": bad_x,
                "y": bad_y,
                "marker": {"symbol": "x", "size": 10, "color": _COLORS["nan"]},
                "hovertemplate": "%{y}: NaN/Inf near step %{x}<extra></extra>",
            }
        )
    layout = _layout("", height=min(max(160, 60 + 16 * len(rows)), 900))
    hot = [(max((v for v in row if v is not None), default=None), n) for row, n in zip(z, rows)]
    hot_known = [h for h in hot if h[0] is not None]
    summary = f"{len(rows)} parameters over {len(xs)} step columns (max per column, log10 ‖g‖)"
    if hot_known:
        top = max(hot_known)
        summary += f"; largest in {top[1]} (10^{top[0]:.2f})"
    if bad_x:
        summary += f"; {len(bad_x)} non-finite cells"
    return _fig("layers", "Per-layer gradient norm (max per column)", traces, layout, "", summary)


def _largest_last(series: Mapping[str, Points], names: list[str]) -> list[str]:
    """At most ``_MAX_LINES`` names, those with the largest last finite value, in natural order."""
    if len(names) <= _MAX_LINES:
        return names

    def last(n: str) -> float:
        fin = [v for v in series[n]["values"] if is_finite(v)]
        return fin[-1] if fin else math.inf  # a parameter with only NaN/Inf is always shown

    keep = set(sorted(names, key=last, reverse=True)[:_MAX_LINES])
    return [n for n in names if n in keep]


def _last_finite(pts: Points) -> float | None:
    fin = [v for v in pts["values"] if is_finite(v)]
    return float(fin[-1]) if fin else None


def update_ratio_figure(data: Mapping[str, Any]) -> dict[str, Any]:
    """Update/weight ratio per parameter (log y); healthy training sits near 1e-3."""
    series = data["series"]
    names = _largest_last(series, _with_prefix(series, "update_ratio/"))
    traces: list[dict[str, Any]] = []
    for n in names:
        traces.append(_line(n[len("update_ratio/") :], series[n]))
        traces += _nonfinite(n, series[n])
    title = "Update / weight ratio per parameter"
    if len(names) < len(_with_prefix(series, "update_ratio/")):
        title += f" (top {_MAX_LINES} by last value)"
    layout = _layout("‖Δw‖ / ‖w‖", log=True, toggles=("log", "smooth"))
    last = [(v, n) for n in names for v in [_last_finite(series[n])] if v is not None]
    summary = f"{len(names)} parameters" + (
        f"; last ratios from {fmt_num(min(last)[0])} ({min(last)[1][len('update_ratio/') :]}) to "
        f"{fmt_num(max(last)[0])} ({max(last)[1][len('update_ratio/') :]}); healthy training sits near 1e-3"
        if last
        else ""
    )
    return _fig("update_ratio", title, traces, layout, "no update ratios recorded", summary)


def memory_figure(data: Mapping[str, Any]) -> dict[str, Any]:
    """Memory timeline in MiB: RSS, CUDA allocated / reserved / peak."""
    traces: list[dict[str, Any]] = []
    mem = data["memory"]
    for key in (
        "rss",
        "cuda_allocated",
        "cuda_reserved",
        "cuda_peak",
        *sorted(k for k in mem if not k.startswith(("rss", "cuda_"))),
    ):
        if key not in mem:
            continue
        pts = mem[key]
        mib = [v / 2**20 if is_finite(v) else v for v in pts["values"]]
        traces.append(_line(key, {"steps": pts["steps"], "values": mib}))
    summary = "; ".join(describe(t["name"], {"steps": t["x"], "values": t["y"]}, "MiB") for t in traces[:2])
    return _fig("memory", "Memory", traces, _layout("MiB"), "no memory samples recorded", summary)


_PHASES = ("data", "forward", "backward", "optimizer", "other")


def step_time_figure(data: Mapping[str, Any]) -> dict[str, Any]:
    """Step-time breakdown, stacked: data, forward, backward, optimizer, other (ms)."""
    t = data["timings"]
    traces: list[dict[str, Any]] = []
    for phase in _PHASES:
        if phase in t:
            ms = [v * 1e3 if is_finite(v) else v for v in t[phase]["values"]]
            traces.append(
                _line(
                    phase, {"steps": t[phase]["steps"], "values": ms}, stackgroup="time", line={"width": 0.5}
                )
            )
    if "total" in t:  # the outline of the stack, so spikes read off directly in the hover
        ms = [v * 1e3 if is_finite(v) else v for v in t["total"]["values"]]
        traces.append(
            _line(
                "step total", {"steps": t["total"]["steps"], "values": ms}, line={"color": "#333", "width": 1}
            )
        )
    summary = ""
    if "total" in t:
        fin = _finite_points({"steps": t["total"]["steps"], "values": t["total"]["values"]})
        if fin:
            med = sorted(v for _, v in fin)[len(fin) // 2]
            worst = max(fin, key=lambda p: p[1])
            summary = f"median step {fmt_num(med * 1e3)} ms; slowest {fmt_num(worst[1] * 1e3)} ms at step {worst[0]}"
    return _fig("step_time", "Step time breakdown", traces, _layout("ms"), "no timings recorded", summary)


def throughput_figure(data: Mapping[str, Any]) -> dict[str, Any]:
    """Samples per second when recorded, else steps per second from the step time."""
    t = data["timings"]
    if "samples_per_s" in t:
        traces = [_line("samples/s", t["samples_per_s"])]
        ytitle = "samples / s"
    elif "total" in t:
        pts = t["total"]
        rate = [1.0 / v if is_finite(v) and v > 0 else None for v in pts["values"]]
        traces = [_line("steps/s", {"steps": pts["steps"], "values": rate})]
        ytitle = "steps / s"
    else:
        traces, ytitle = [], ""
    summary = describe(ytitle, {"steps": traces[0]["x"], "values": traces[0]["y"]}) if traces else ""
    return _fig("throughput", "Throughput", traces, _layout(ytitle), "no timings recorded", summary)


def build_figures(data: Mapping[str, Any]) -> list[dict[str, Any]]:
    """All dashboard/report charts, in display order, from collected data (see ``collect_data``).

    Returns a list of ``{"id", "title", "data", "layout", "empty"}``; ``empty`` names why a chart
    has no traces. Every value is JSON-ready (NaN/Inf points are gaps plus their own marker traces).
    """
    return [
        loss_figure(data),
        grad_norm_figure(data),
        nonfinite_figure(data),
        layer_heatmap_figure(data),
        update_ratio_figure(data),
        memory_figure(data),
        step_time_figure(data),
        throughput_figure(data),
    ]

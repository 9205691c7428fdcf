"""Chart specs (plain plotly figure dicts, JSON-ready) built from collected run data; shared by HTML and dashboard."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from ._format import event_category, is_finite, natural_key, nonfinite_label

# Figures are plain dicts ({"data": [...], "layout": {...}}) rather than plotly.graph_objects: building
# graph objects validates every point in Python, which costs seconds on 100k-step runs; the browser's
# plotly.js takes the same dicts directly.

Points = Mapping[str, Sequence[Any]]  # {"steps": [...], "values": [...]}

_MARK_AXIS = "y3"  # hidden overlay axis on [0, 1] that carries event/NaN markers at fixed heights
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


def _line(name: str, pts: Points, **extra: Any) -> dict[str, Any]:
    """A line trace; non-finite values become gaps (None) and are drawn separately by ``_nonfinite``."""
    vals = [v if is_finite(v) else None for v in pts["values"]]
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
    height = {"nan": 0.96, "inf": 0.9, "-inf": 0.84}
    out = []
    for kind, steps in by_kind.items():
        out.append(
            {
                "type": "scatter",
                "mode": "markers",
                "name": f"{name} {kind.upper() if kind == 'nan' else kind}",
                "x": steps,
                "y": [height[kind]] * len(steps),
                "yaxis": _MARK_AXIS,
                "marker": {"symbol": "x", "size": 9, "color": _COLORS[kind]},
                "hovertemplate": f"{name} = {kind} at step %{{x}}<extra></extra>",
            }
        )
    return out


def _markers(name: str, steps: list[int], texts: list[str], height: float, color: str, symbol: str) -> dict:
    return {
        "type": "scatter",
        "mode": "markers",
        "name": name,
        "x": steps,
        "y": [height] * len(steps),
        "text": texts,
        "yaxis": _MARK_AXIS,
        "marker": {"symbol": symbol, "size": 10, "color": color},
        "hovertemplate": "step %{x}: %{text}<extra></extra>",
    }


def _layout(title: str, ytitle: str, *, log: bool = False, **extra: Any) -> dict[str, Any]:
    layout: dict[str, Any] = {
        "title": {"text": title},
        "xaxis": {"title": {"text": "step"}},
        "yaxis": {"title": {"text": ytitle}, "type": "log" if log else "linear"},
        _MARK_AXIS.replace("y", "yaxis"): {
            "overlaying": "y",
            "range": [0, 1],
            "visible": False,
            "fixedrange": True,
        },
        "margin": {"l": 60, "r": 30, "t": 40, "b": 40},
        "height": 340,
        "legend": {"orientation": "h", "y": -0.25},
        "hovermode": "closest",
    }
    layout.update(extra)
    return layout


def _fig(fid: str, title: str, data: list[dict[str, Any]], layout: dict[str, Any], empty: str) -> dict:
    return {"id": fid, "title": title, "data": data, "layout": layout, "empty": empty if not data else ""}


def _with_prefix(series: Mapping[str, Points], prefix: str) -> list[str]:
    return sorted((n for n in series if n.startswith(prefix)), key=natural_key)


def _anomaly_markers(anomalies: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    steps = [a["step"] for a in anomalies if isinstance(a.get("step"), int)]
    texts = [
        str(a.get("summary", a.get("kind", "anomaly"))) for a in anomalies if isinstance(a.get("step"), int)
    ]
    if not steps:
        return []
    return [_markers("anomaly", steps, texts, 1.0, _COLORS["anomaly"], "x-thin-open")]


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
            0.78,
            _COLORS["event"],
            "diamond",
        )
    ]


def loss_figure(data: Mapping[str, Any]) -> dict[str, Any]:
    """Loss (left axis) and learning rate per param group (right axis, log), with NaN/Inf loss markers."""
    series = data["series"]
    traces: list[dict[str, Any]] = []
    if "loss" in series:
        traces.append(_line("loss", series["loss"]))
        traces += _nonfinite("loss", series["loss"])
    for name in _with_prefix(series, "lr/"):
        traces.append(_line(name, series[name], yaxis="y2", line={"dash": "dot"}))
    traces += _anomaly_markers(data["anomalies"])
    traces += _event_markers(data["events"], "loss")
    lr_axis: dict[str, Any] = {
        "title": {"text": "learning rate"},
        "overlaying": "y",
        "side": "right",
        "tickformat": ".2~e",  # 1e-3 and 2.5e-4 read as such, not as repeated "0.001"
    }
    lrs = [v for n in _with_prefix(series, "lr/") for v in series[n]["values"] if is_finite(v)]
    if lrs and max(lrs) == min(lrs):
        # plotly autoranges a constant series to [c-1, c+1] (negative learning rates): pin it
        c = lrs[0]
        lr_axis["range"] = [0, 2 * c] if c > 0 else [-1, 1]
    # linear with exponent ticks: a log axis draws odd ticks for the common constant lr
    layout = _layout("Loss and learning rate", "loss", yaxis2=lr_axis)
    return _fig("loss", "Loss and learning rate", traces, layout, "no loss or lr recorded")


def grad_norm_figure(data: Mapping[str, Any]) -> dict[str, Any]:
    """Total gradient norm (log) with skipped steps, anomalies, gradient rule events and NaN/Inf markers."""
    series = data["series"]
    traces: list[dict[str, Any]] = []
    if "grad_norm" in series:
        traces.append(_line("grad_norm", series["grad_norm"]))
        traces += _nonfinite("grad_norm", series["grad_norm"])
    if "amp_scale" in series:
        traces.append(_line("amp_scale", series["amp_scale"], yaxis="y2", line={"dash": "dot"}))
    if "skipped" in series:
        sk = series["skipped"]
        steps = [s for s, v in zip(sk["steps"], sk["values"]) if is_finite(v) and v > 0]
        if steps:
            traces.append(
                _markers(
                    "skipped step", steps, ["skipped"] * len(steps), 0.72, _COLORS["skipped"], "triangle-down"
                )
            )
    traces += _anomaly_markers(data["anomalies"])
    traces += _event_markers(data["events"], "gradient")
    layout = _layout(
        "Total gradient norm",
        "‖g‖₂",
        log=True,
        yaxis2={"title": {"text": "AMP scale"}, "overlaying": "y", "side": "right", "type": "log"},
    )
    return _fig("grad_norm", "Total gradient norm", traces, layout, "no gradient norms recorded")


def nonfinite_figure(data: Mapping[str, Any]) -> dict[str, Any]:
    """NaN/Inf counts as their own series: params with non-finite grads, tensor-stat NaN/Inf totals."""
    series = data["series"]
    traces: list[dict[str, Any]] = []
    if "grad_nonfinite" in series:
        traces.append(
            _line(
                "params with non-finite grad",
                series["grad_nonfinite"],
                mode="lines+markers",
                line={"shape": "hv"},
            )
        )
    tn = data.get("tensor_nonfinite") or {}
    if tn.get("steps"):
        traces.append(
            _line("NaN values (tensor stats)", {"steps": tn["steps"], "values": tn["nan"]}, mode="markers")
        )
        traces.append(
            _line("Inf values (tensor stats)", {"steps": tn["steps"], "values": tn["inf"]}, mode="markers")
        )
    # Every other metric's non-finite points, one marker trace per metric that has any.
    for name in sorted(series, key=natural_key):
        traces += _nonfinite(name, series[name])
    if traces:  # anomaly markers alone would draw an empty-looking chart: say "none seen" instead
        traces += _anomaly_markers(data["anomalies"])
    return _fig(
        "nonfinite", "NaN / Inf counts", traces, _layout("NaN / Inf counts", "count"), "no NaN/Inf seen"
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
        lv = math.log10(v) if v > 0 else _ZERO_LOG
        cur = cells[c]
        cells[c] = lv if cur is None or lv > cur else cur
    return cells, sorted(set(bad))


def layer_heatmap_figure(data: Mapping[str, Any]) -> dict[str, Any]:
    """Per-layer gradient norm heatmap: rows = parameters, columns = step buckets, cell = max log10 ‖g‖."""
    series = data["series"]
    names = _with_prefix(series, "grad_norm/")
    if not names:
        return _fig(
            "layers",
            "Per-layer gradient norm",
            [],
            _layout("Per-layer gradient norm", ""),
            "no per-layer norms",
        )
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
        xs = [round(lo + (c + 0.5) * width - 0.5, 3) for c in range(ncols)]
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
    layout = {
        "title": {"text": "Per-layer gradient norm (max per bucket)"},
        "xaxis": {"title": {"text": "step"}},
        "yaxis": {"automargin": True, "autorange": "reversed"},
        "margin": {"l": 60, "r": 30, "t": 40, "b": 40},
        "height": max(300, 60 + 18 * len(rows)),
        "showlegend": False,
    }
    return _fig("layers", "Per-layer gradient norm", traces, layout, "")


def _largest_last(series: Mapping[str, Points], names: list[str]) -> list[str]:
    """At most ``_MAX_LINES`` names, those with the largest last finite value, in natural order."""
    if len(names) <= _MAX_LINES:
        return names

    def last(n: str) -> float:
        fin = [v for v in series[n]["values"] if is_finite(v)]
        return fin[-1] if fin else math.inf  # a parameter with only NaN/Inf is always shown

    keep = set(sorted(names, key=last, reverse=True)[:_MAX_LINES])
    return [n for n in names if n in keep]


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
    layout = _layout(title, "‖Δw‖ / ‖w‖", log=True)
    return _fig("update_ratio", title, traces, layout, "no update ratios recorded")


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
    return _fig("memory", "Memory", traces, _layout("Memory", "MiB"), "no memory samples recorded")


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
    return _fig(
        "step_time",
        "Step time breakdown",
        traces,
        _layout("Step time breakdown", "ms"),
        "no timings recorded",
    )


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
    return _fig("throughput", "Throughput", traces, _layout("Throughput", ytitle), "no timings recorded")


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

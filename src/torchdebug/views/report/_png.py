"""The seed's 2x2 ``debug_analysis.png`` (step time, memory, gradient norm, anomalies) via matplotlib Agg."""

from __future__ import annotations

import io
import math
from collections.abc import Mapping
from typing import Any

from ._format import is_finite


def _finite(pts: Mapping[str, Any], scale: float = 1.0) -> tuple[list[int], list[float]]:
    """Steps and scaled values with every NaN/Inf turned into a NaN gap (matplotlib breaks the line there)."""
    ys = [v * scale if is_finite(v) else math.nan for v in pts["values"]]
    return list(pts["steps"]), ys


def render_png(data: Mapping[str, Any], title: str, dpi: int = 150) -> bytes:
    """PNG bytes of the 2x2 analysis figure from ``collect_data``'s dict.

    Non-finite gradient norms are drawn as red crosses on the top edge (a line plot would drop them).
    Uses ``matplotlib.figure.Figure`` with the Agg canvas directly: no pyplot, no global state, safe
    from any thread. Cost: about 0.3 s.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 10))
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2)
    fig.suptitle(f"PyTorch Debug Analysis: {title}", fontsize=16)
    timings, memory, series = data["timings"], data["memory"], data["series"]

    ax = axes[0, 0]
    if "total" in timings:
        ax.plot(*_finite(timings["total"]), "b-", label="step")
    for phase, color in (("forward", "tab:green"), ("backward", "tab:orange"), ("data", "tab:gray")):
        if phase in timings:
            ax.plot(*_finite(timings[phase]), color=color, lw=0.8, label=phase)
    ax.set(title="Execution Time", xlabel="step", ylabel="Time (seconds)")

    ax = axes[0, 1]
    mib = 1.0 / 2**20
    for key, style in (
        ("rss", "g-"),
        ("cuda_allocated", "r-"),
        ("cuda_reserved", "m--"),
        ("cuda_peak", "k:"),
    ):
        if key in memory:
            ax.plot(*_finite(memory[key], mib), style, label=key)
    ax.set(title="Memory Usage", xlabel="step", ylabel="Memory (MiB)")

    ax = axes[1, 0]
    if "grad_norm" in series:
        g = series["grad_norm"]
        xs, ys = _finite(g)
        ax.plot(xs, ys, color="orange", label="grad_norm")
        fin = [v for v in ys if is_finite(v)]
        if fin and min(fin) > 0:
            ax.set_yscale("log")
        bad = [s for s, v in zip(g["steps"], g["values"]) if not is_finite(v)]
        if bad:
            # x in data units, y in axes units: crosses sit on the top edge whatever the scale.
            ax.scatter(
                bad,
                [0.97] * len(bad),
                transform=ax.get_xaxis_transform(),
                marker="x",
                color="red",
                label="NaN/Inf",
            )
    ax.set(title="Gradient Norm", xlabel="step", ylabel="Gradient Norm")

    ax = axes[1, 1]
    an = [a["step"] for a in data["anomalies"] if isinstance(a.get("step"), int)]
    if an:
        ax.scatter(an, [1.0] * len(an), color="red", alpha=0.8, marker="x", s=80, label="anomaly")
    for sev, y, color in (
        ("error", 0.75, "darkred"),
        ("warning", 0.5, "darkorange"),
        ("info", 0.25, "steelblue"),
    ):
        ev = [
            e["step"] for e in data["events"] if e.get("severity") == sev and isinstance(e.get("step"), int)
        ]
        if ev:
            ax.scatter(ev, [y] * len(ev), color=color, alpha=0.8, label=f"{sev} event")
    ax.set(title="Anomaly Detection", xlabel="step", ylabel="Anomalies / events", ylim=(0, 1.15))

    for ax in axes.flat:
        ax.grid(True)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()

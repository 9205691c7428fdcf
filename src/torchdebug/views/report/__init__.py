"""Reports of a stored run: JSON summary, text, self-contained HTML with charts, and the seed's PNG.

Everything here reads the run store only, so it works on a run folder copied from another machine.

The HTML report inlines its own small chart renderer (``static/tdcharts.js``, about 30 KB), so it is
one file that opens with no network; a 2000-step run's report weighs a few hundred KB.

Known limitations:
- Charts show at most ``max_points`` points per series: min/max envelopes, so spikes and NaN/Inf stay.
- Per-parameter update-ratio lines are capped at 24 parameters (largest last value); the heatmap has
  every parameter.
- The live dashboard appends new steps to what it drew and asks for a whole re-downsampled copy every
  30 s: until then a chart's one-line summary describes the run as it was at the last full copy, and
  per-layer heatmap columns added in between hold one recorded step each, not a bucket of steps.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ._data import build_report, collect_data, metric_table
from ._figures import build_figures
from ._format import event_category, json_safe
from ._html import fragments, render_page
from ._text import render_text

FORMATS = ("text", "json", "html", "png")
REPORT_EXTRA = "pip install 'torchdebug[report]'"


@contextmanager
def _opened(run: Any) -> Iterator[Any]:
    """Yield an open Run for a Run or a run folder path (closing only what we opened)."""
    if isinstance(run, (str, os.PathLike)):
        from ...store import open_run

        r = open_run(run)
        try:
            yield r
        finally:
            r.close()
    else:
        yield run


def collect_views(run: Any, max_points: int = 2000, since_step: int | None = None) -> dict[str, Any]:
    """What a report page shows: meta, verdict, summary report (no metric table), figures, anomalies, events.

    ``since_step``: the figures hold only the steps from there on (the dashboard appends them to
    what it drew); the verdict, summary, anomalies and events are always the whole run's.

    Example: ``collect_views(open_run(path))["figures"][0]["id"] == "loss"``.
    Cost: one downsampled query per metric, SQL aggregates and bucketed timing and memory samples:
    bounded whatever the run's length (about 0.5 s at 1,000,000 steps).
    """
    summary = run.summary()
    report = build_report(run, metrics=False, summary=summary)
    data = collect_data(run, max_points=max_points, since_step=since_step)
    if since_step is not None:
        for key in ("anomalies", "events"):
            data[key] = [x for x in data[key] if isinstance(x.get("step"), int) and x["step"] >= since_step]
        tn = data["tensor_nonfinite"]
        keep = [i for i, s in enumerate(tn["steps"]) if s >= since_step]
        data["tensor_nonfinite"] = {k: [tn[k][i] for i in keep] for k in ("steps", "nan", "inf")}
    meta = dict(run.meta)
    meta["status"] = report["run"]["status"]
    return {
        "meta": meta,
        "status": meta["status"],
        "verdict": report["verdict"],
        "last_step": summary["last_step"],
        "report": report,
        "figures": build_figures(data),
        "anomalies": report["anomalies"],
        "events": report["events"],
    }


def render_report(run: Any, format: str = "text", path: str | os.PathLike[str] | None = None) -> str | bytes:
    """Render a run's report.

    Args:
        run: an open ``Run`` or the path of a run folder.
        format: ``"text"`` | ``"json"`` | ``"html"`` (one self-contained file) | ``"png"`` (the
            seed's 2x2 debug_analysis figure, bytes).
        path: also write the result there.

    Returns:
        str for text/json/html, bytes for png.

    Raises:
        ValueError: unknown format (lists the allowed ones).
        ImportError: png without matplotlib (names ``pip install 'torchdebug[report]'``).
        RunStoreError: the run cannot be read.

    Example: ``print(render_report("runs/demo-20250101-120000"))``.
    Cost: bounded whatever the run's length (SQL aggregates over rollups; charts of at most 2000
    points per series): under 1 s at 1,000,000 steps; html inlines a 30 KB chart renderer.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    out: str | bytes
    with _opened(run) as r:
        if format == "text":
            out = render_text(build_report(r))
        elif format == "json":
            out = json.dumps(json_safe(build_report(r)), indent=2, sort_keys=True, allow_nan=False) + "\n"
        elif format == "html":
            out = render_page(collect_views(r))
        else:
            try:
                import matplotlib  # noqa: F401
            except ImportError as e:
                raise ImportError(f"the PNG report needs matplotlib: {REPORT_EXTRA}") from e
            from ..verdict import verdict
            from ._png import render_png

            out = render_png(collect_data(r), title=r.name, verdict=verdict(r))
    if path is not None:
        p = Path(path)
        if isinstance(out, bytes):
            p.write_bytes(out)
        else:
            p.write_text(out, encoding="utf-8")
    return out


__all__ = [
    "FORMATS",
    "build_figures",
    "build_report",
    "collect_data",
    "collect_views",
    "event_category",
    "fragments",
    "json_safe",
    "metric_table",
    "render_page",
    "render_report",
    "render_text",
]


def report(run: Any, format: str = "text", path: str | os.PathLike[str] | None = None) -> str | bytes:
    """A run's report: ``td.report(td.open_run(folder))``, ``td.report(folder, "html", path="r.html")``.

    The same as :func:`render_report` (see there for the arguments, what it returns and raises);
    the report layer reads the store, never the other way round.

    Example: ``print(td.report("runs/demo-20261121-004704"))``.
    """
    return render_report(run, format=format, path=path)

"""Number formatting, JSON-safe values, min/max envelope downsampling and rule-event categories."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ...events import module_label

# Rule-event categories used by the summary counters (report and seed endpoints). The instruments
# name their events in snake_case; we classify by substrings so new kinds land somewhere sensible.
# A kind matches the first category whose pattern it contains; anything else is "other".
_CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("memory", ("memory", "leak", "oom", "fragment")),
    ("loss", ("loss", "diverg")),
    ("gradient", ("grad", "explod", "vanish", "dead", "update_ratio", "clip", "nonfinite", "overflow")),
    ("performance", ("slow", "bound", "throughput", "stall", "sync", "recompil", "time", "straggler")),
)


def event_category(kind: str) -> str:
    """Category of a rule-event kind: ``memory | loss | gradient | performance | other``.

    Example: ``event_category("exploding_gradients") == "gradient"``.
    """
    k = kind.lower()
    for name, needles in _CATEGORIES:
        if any(n in k for n in needles):
            return name
    return "other"


def is_finite(x: Any) -> bool:
    """True for a real finite number (None and strings are not)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def nonfinite_label(x: float) -> str | None:
    """``"nan" | "inf" | "-inf"`` for a non-finite float, else None."""
    if not isinstance(x, float) or math.isfinite(x):
        return None
    if math.isnan(x):
        return "nan"
    return "inf" if x > 0 else "-inf"


def json_value(x: Any) -> Any:
    """A float made JSON-safe: NaN/Inf become the strings ``"nan"``/``"inf"``/``"-inf"`` (never dropped)."""
    label = nonfinite_label(x) if isinstance(x, float) else None
    return label if label is not None else x


def json_safe(obj: Any) -> Any:
    """Deep copy of ``obj`` with every non-finite float replaced by its string label."""
    if isinstance(obj, float):
        return json_value(obj)
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def rank_label(a: Mapping[str, Any]) -> str | None:
    """``"1 of 2"`` for an anomaly of a multi-rank run (the rank of birth); a bare non-zero rank from a
    document without ``world_size``; None for one process (no rank row)."""
    rank, world = a.get("rank"), a.get("world_size")
    if isinstance(world, int) and world > 1:
        return f"{rank} of {world}"
    return str(rank) if rank else None


def anomaly_rows(a: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The rows every anomaly card starts with: phase, module (labelled), parameter, op, line; then
    where the origin's Inf became NaN and whether the replay reproduced it, when the document says."""
    module = a.get("module")
    rows = [
        ("phase", a.get("phase")),
        (
            "module",
            "no traced origin"
            if module is None and "module" in a
            else module_label(str(module or ""), str(a.get("module_type") or "") or None),
        ),
        ("parameter", a.get("parameter")),
        ("op", a.get("op")),
        ("line", a.get("location")),
        ("rank", rank_label(a)),
    ]
    noticed = a.get("noticed")
    if isinstance(noticed, Mapping) and noticed.get("site"):
        rows.append(("became", f"{noticed.get('kind')} in {noticed.get('site')}"))
    if a.get("reproducible") is False:
        rows.append(("reproducible", "no: finite when the step was replayed twice"))
    rows.append(("cause", cause_text(a)))
    return rows


def cause_text(a: Mapping[str, Any]) -> str | None:
    """``compiler: replayed through the compiled model ...``: whose fault and its evidence (None:
    the document does not say, as in runs written before the verdict existed)."""
    c = a.get("cause")
    if not isinstance(c, Mapping) or not c.get("verdict"):
        return None
    return f"{c['verdict']}: {c.get('evidence') or ''}".rstrip(": ")


def fmt_num(x: Any) -> str:
    """Compact rendering of a number; non-finite values spelled out."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        label = nonfinite_label(x)
        if label is not None:
            return label.upper() if label == "nan" else label.replace("inf", "Inf")
        return f"{x:.4g}"
    return str(x)


def fmt_bytes(n: Any) -> str:
    """Bytes as a human size (binary units)."""
    if not is_finite(n):
        return fmt_num(n)
    v = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(v) < 1024 or unit == "TiB":
            return f"{int(v)} B" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    raise AssertionError("unreachable")


def fmt_seconds(s: Any) -> str:
    """Seconds rendered in s/ms/µs."""
    if not is_finite(s):
        return fmt_num(s)
    v = float(s)
    if abs(v) >= 1:
        return f"{v:.3g} s"
    if abs(v) >= 1e-3:
        return f"{v * 1e3:.3g} ms"
    return f"{v * 1e6:.3g} µs"


def natural_key(name: str) -> tuple[Any, ...]:
    """Sort key putting ``layers.2`` before ``layers.10``."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def envelope(
    steps: Sequence[int], values: Sequence[float], max_points: int | None
) -> tuple[list[int], list[float]]:
    """Downsample to about ``max_points`` points keeping each bucket's min and max (and every NaN/Inf).

    Steps (sorted) are cut into ``max_points // 2`` equal step ranges, as the store does; each range
    keeps its lowest and highest finite point, in step order, plus every non-finite point, so a
    one-step explosion is never averaged away. Points that are themselves an envelope can be
    enveloped again (the dashboard appends new steps and re-buckets). Cost: one pass.

    Example: ``envelope(range(6), [1.0, 9.0, 2.0, 3.0, 0.0, 4.0], 4) == ([0, 1, 4, 5], [1.0, 9.0, 0.0, 4.0])``.
    """
    n = len(steps)
    if max_points is None or n <= max_points or max_points < 2:
        return list(steps), list(values)
    nb = max_points // 2
    lo, span = steps[0], steps[-1] - steps[0] + 1
    finite = math.isfinite  # values are numbers here (store floats, int bytes); hot loop
    out_s: list[int] = []
    out_v: list[float] = []
    i = 0
    while i < n:
        b = (steps[i] - lo) * nb // span
        keep: list[int] = []
        imin = imax = -1
        while i < n and (steps[i] - lo) * nb // span == b:
            v = values[i]
            if not finite(v):
                keep.append(i)
            else:
                if imin < 0 or v < values[imin]:
                    imin = i
                if imax < 0 or v > values[imax]:
                    imax = i
            i += 1
        if imin >= 0:
            keep += [imin] if imin == imax else [imin, imax]
        for j in sorted(keep):
            out_s.append(steps[j])
            out_v.append(values[j])
    return out_s, out_v

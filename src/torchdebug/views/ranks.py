"""Every rank of a run as text: the overview table of ``store.ranks.rank_overview`` (``show``, the reports, the dashboard)."""

from __future__ import annotations

from typing import Any


def _fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f} ms"


def _fmt_b(v: int | None) -> str:
    return "-" if v is None else f"{v / 2**20:.1f} MiB"


def _fmt_n(v: float | str | None) -> str:
    if isinstance(v, str):  # a JSON-safe copy spells non-finite values: "nan", "inf"
        return v
    return "-" if v is None else f"{v:.4g}"


RANK_COLUMNS = (
    "rank",
    "status",
    "steps",
    "step time",
    "data wait",
    "max RSS",
    "max CUDA",
    "grad norm",
    "anomalies",
    "hangs",
)


def overview_cells(ov: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row of text cells per rank, in ``RANK_COLUMNS`` order (``show``, the reports, the dashboard):
    step time and data wait in ms (1 decimal), memory in MiB (1 decimal), grad norm 4 significant
    digits, ``-`` where nothing was recorded."""
    return [
        (
            str(r["rank"]),
            str(r["status"]),
            str(r["steps"]),
            _fmt_s(r["step_time_s"]),
            _fmt_s(r["data_wait_s"]),
            _fmt_b(r["rss_max"]),
            _fmt_b(r["cuda_max"]),
            _fmt_n(r["grad_norm"]),
            str(r["anomalies"]),
            str(r["hangs"]),
        )
        for r in ov["per_rank"]
    ]


def overview_lines(ov: dict[str, Any]) -> list[str]:
    """The overview as text lines (``torchdebug show`` and the text report)."""
    head = RANK_COLUMNS
    table = [head, *overview_cells(ov)]
    widths = [max(len(row[c]) for row in table) for c in range(len(head))]
    out = [f"ranks ({len(ov['ranks'])} of world size {ov['world_size']})"]
    out += ["  " + "  ".join(cell.ljust(widths[c]) for c, cell in enumerate(row)).rstrip() for row in table]
    out.append(f"anomalies, all ranks ({len(ov['anomalies'])})")
    for a in ov["anomalies"]:
        by = ", ".join(map(str, a["recorded_by"]))
        # a summary written on several ranks ends "(step 7, born on rank 1 of 2)": no prefix then
        named = isinstance(a.get("world_size"), int) and a["world_size"] > 1
        prefix = "" if named else f"rank {a.get('rank')}: "
        out.append(f"  {prefix}{a.get('summary')}  (recorded by rank {by})")
    if not ov["anomalies"]:
        out.append("  none")
    if ov["stragglers"]:
        out.append(f"stragglers ({len(ov['stragglers'])})")
        out += [f"  step {s['step']}: {s['message']}" for s in ov["stragglers"]]
    if ov["hangs"]:
        out.append(f"hangs ({len(ov['hangs'])})")
        # each rank's own line; the verdict across ranks (the message's second line) is printed first
        out += [f"  step {h['step']}: {str(h['message']).partition(chr(10))[0]}" for h in ov["hangs"]]
    return out

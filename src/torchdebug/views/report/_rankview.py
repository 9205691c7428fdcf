"""HTML for a run of several ranks: the per-rank table, anomalies with their rank, stragglers and hangs,
and the dashboard's rank selector (links that reopen the page with ``?rank=K``)."""

from __future__ import annotations

import html
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..ranks import RANK_COLUMNS, overview_cells
from ._format import fmt_num

_NUMERIC = {"steps", "step time", "data wait", "max RSS", "max CUDA", "grad norm", "anomalies", "hangs"}


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _table(table_id: str, head: Sequence[str], rows: Sequence[Sequence[Any]], numeric: set[str]) -> str:
    th = "".join(f"<th>{_e(h)}</th>" for h in head)
    num = ' class="num"'
    body = "".join(
        "<tr>"
        + "".join(f"<td{num if h in numeric else ''}>{_e(c)}</td>" for h, c in zip(head, row, strict=True))
        + "</tr>"
        for row in rows
    )
    return f'<table id="{table_id}"><tr>{th}</tr>{body}</table>'


def render_ranks(ov: Mapping[str, Any] | None, hang: Mapping[str, Any] | None = None) -> str:
    """The "Ranks" section's body from ``rank_overview`` (``build_report(run)["ranks"]``); ``""`` for
    a run of one rank (``ov`` None): the page then has no such section. ``hang``: the hang verdict
    across ranks (``build_report(run)["hang_verdict"]``), shown first as ``#rank-hang-verdict``.

    Tables (ids for scripts and tests): ``#rank-table`` (one row per rank: ``RANK_COLUMNS``, cells
    as ``torchdebug show`` prints them), ``#rank-anomalies`` (rank of birth, step, summary, recorded
    by), ``#rank-stragglers`` and ``#rank-hangs`` (only when there are some).
    """
    if not ov or len(ov.get("ranks") or []) < 2:
        return ""
    parts = [
        f"<p>{len(ov['ranks'])} of world size {_e(ov.get('world_size'))} ranks recorded.</p>",
        *(
            [f'<p id="rank-hang-verdict"><strong>hang verdict:</strong> {_e(hang.get("text"))}</p>']
            if hang
            else []
        ),
        _table("rank-table", RANK_COLUMNS, overview_cells(dict(ov)), _NUMERIC),
    ]
    anomalies = ov.get("anomalies") or []
    if anomalies:
        rows = [
            (
                a.get("rank"),
                fmt_num(a.get("step")),
                a.get("summary") or a.get("kind"),
                ", ".join(map(str, a.get("recorded_by") or [])),
            )
            for a in anomalies
        ]
        parts.append("<h3>Anomalies, all ranks</h3>")
        parts.append(
            _table("rank-anomalies", ("born on rank", "step", "anomaly", "recorded by"), rows, {"step"})
        )
    stragglers = ov.get("stragglers") or []
    if stragglers:
        rows = [
            (s.get("rank"), fmt_num(s.get("step")), fmt_num(s.get("ratio")), s.get("message"))
            for s in stragglers
        ]
        parts.append("<h3>Stragglers</h3>")
        parts.append(_table("rank-stragglers", ("rank", "step", "ratio", "message"), rows, {"step", "ratio"}))
    hangs = ov.get("hangs") or []
    if hangs:
        hang_rows: list[tuple[Any, ...]] = [
            (
                h.get("rank"),
                fmt_num(h.get("step")),
                h.get("phase"),
                fmt_num(h.get("last_step")),
                h.get("where"),
                str(h.get("message") or "").split("\n")[0],  # its verdict line is shown once, above
            )
            for h in hangs
        ]
        parts.append("<h3>Hangs</h3>")
        parts.append(
            _table(
                "rank-hangs",
                ("rank", "step", "phase", "last completed step", "where", "message"),
                hang_rows,
                {"step", "last completed step"},
            )
        )
    return "".join(parts)


def render_rank_selector(ranks: Sequence[int], current: int, href: Callable[[int], str]) -> str:
    """``charts of rank [0] 1``: one link per rank (``href(k)``), the shown one marked ``aria-current``;
    ``""`` for fewer than two ranks."""
    if len(ranks) < 2:
        return ""
    mark = ' aria-current="page"'
    links = "".join(
        f'<a class="rank{" current" if k == current else ""}" href="{_e(href(k))}"'
        f"{mark if k == current else ''}>rank {k}</a> "
        for k in ranks
    )
    return f'<nav id="rank-select">charts, cards and events of {links}</nav>'

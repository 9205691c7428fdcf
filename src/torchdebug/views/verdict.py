"""The run's verdict for the views: the core's pure verdict (``torchdebug._verdict``) re-exported,
and `verdict_of`, which opens a run folder through the store.

Every view, tracker and notebook repr calls the same `judge`; it lives in the core so the store's
``Run._repr_html_`` can lead with it without importing a view.
"""

from __future__ import annotations

from typing import Any

from .._verdict import (
    COLOURS,
    DIVERGENCE,
    DIVERGENCE_END,
    LEVELS,
    RANKS,
    RunVerdict,
    anomaly_text,
    divergences,
    event_rank,
    group_anomalies,
    group_key,
    judge,
    verdict,
)


def verdict_of(path: Any) -> RunVerdict:
    """`verdict` of the run folder ``path`` (opened read-only and closed again), or, when it
    cannot be read, ``{"status": "unreadable", "level": "error", "text": "unreadable: <why>"}``.

    What ``torchdebug runs`` colours each run by. Cost: one read of the run's anomaly and event
    tables (a few ms for thousands of records).
    """
    from ..store import open_run

    try:
        with open_run(path) as run:
            return verdict(run)
    except Exception as e:  # a malformed run fails alone, whatever is wrong with it
        return RunVerdict({"status": "unreadable", "level": "error", "text": f"unreadable: {e}"})


__all__ = [
    "COLOURS",
    "DIVERGENCE",
    "DIVERGENCE_END",
    "LEVELS",
    "RANKS",
    "RunVerdict",
    "anomaly_text",
    "divergences",
    "event_rank",
    "group_anomalies",
    "group_key",
    "judge",
    "verdict",
    "verdict_of",
]

"""The hang verdict across ranks, read from the run folder's flight records alone.

Each rank's ``flight_rank{K}.json`` (written by :mod:`torchdebug.session.hangs` when its hang
watchdog fires, on ``SIGUSR1`` and when it leaves ``watch()``) holds its phase, its line and its Flight Recorder
entries; :func:`match` compares them by process group and sequence number and returns one
:class:`HangVerdict`: a rank that never entered a collective the others did, or ranks that called
different collectives at the same sequence number. Files are read as every run reader reads them:
regular files only, capped, never blocking.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .._errors import RunStoreError
from ..store._validate import read_file

_MAX_RECORD_BYTES = 64 * 2**20  # a record keeps at most 256 entries with their frames: far below


def read_records(run_dir: str | os.PathLike[str]) -> dict[int, dict[str, Any]]:
    """Every rank's flight record in ``run_dir`` (``{rank: record}``; unreadable files are left out)."""
    out: dict[int, dict[str, Any]] = {}
    for p in sorted(Path(run_dir).glob("flight_rank*.json")):
        try:
            rec = json.loads(read_file(p, _MAX_RECORD_BYTES))
            out[int(rec["rank"])] = rec
        except (OSError, RunStoreError, ValueError, KeyError, TypeError):
            continue
    return out


@dataclass
class HangVerdict:
    """The hang verdict across ranks: ``kind`` is ``"missing"`` (``ranks`` never entered collective
    ``seq`` of ``group`` that the ``waiting`` ranks called), ``"mismatch"`` (the ranks called different
    collectives at ``seq``), ``"agree"`` (the records match: the hang is not in a collective they
    saw) or ``"unknown"`` (fewer than two ranks' records); ``text`` is the one line."""

    kind: str
    text: str
    group: str | None = None
    seq: int | None = None
    op: str | None = None
    ranks: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    calls: dict[int, str] = field(default_factory=dict)  # rank -> "op sizes dtype at file:line"

    def __str__(self) -> str:
        return self.text

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["calls"] = {str(k): v for k, v in self.calls.items()}
        return d


def _group_name(group: str) -> str:
    return "the default group" if group == "default" else f"group {group!r}"


def _ranks(rs: list[int]) -> str:
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


def _signature(e: dict[str, Any]) -> tuple[str, str, str]:
    return (e["op"], json.dumps(e["sizes"]), json.dumps(e["dtypes"]))


def _call(e: dict[str, Any]) -> str:
    dtypes = ",".join(map(str, e["dtypes"])) or "?"
    return f"{e['op']} {json.dumps(e['sizes'])} {dtypes} at {e['where']}"


def _when(rec: dict[str, Any]) -> str:
    """``in backward`` (a phase of a step), ``after step 2`` (between steps) or ``before any step``."""
    if rec.get("phase") not in (None, "data"):
        return f"in {rec['phase']}"
    return f"after step {rec['last_step']}" if rec.get("last_step") is not None else "before any step"


def _state(rec: dict[str, Any]) -> str:
    """Where a rank is, in words: ``it is at train.py:88 in evaluate (after step 2)`` / ``it left
    watch() after step 1 at train.py:40 in main``."""
    if rec.get("reason") == "exit":
        return f"it left watch() {_when({**rec, 'phase': None})} at {rec.get('where')}"
    return f"it is at {rec.get('where')} ({_when(rec)})"


def _silent(silent: list[int], blind: list[int]) -> str:
    missing = [r for r in silent if r not in blind]
    out = f"; {_ranks(missing)} wrote no flight record" if missing else ""
    if blind:
        out += f"; {_ranks(blind)} recorded no collectives (no Flight Recorder dump)"
    return out


def match(records: dict[int, dict[str, Any]], world: int | None = None) -> HangVerdict:
    """The hang verdict from every rank's flight record (``{rank: record}``, see :func:`capture`).

    Per process group (the default group first), the collectives are compared by sequence number
    over the window every rank's ring still holds; the first number where a rank has no entry while
    another has one, or where the ranks' entries differ in op, sizes or dtypes, is the verdict.
    ``world``: the ranks expected (``range(world)``); a rank without a record is named as such.
    """
    blind = sorted(r for r, rec in records.items() if rec.get("error"))  # no Flight Recorder there
    ranks = sorted(r for r in records if r not in blind)
    expected = list(range(world)) if world else sorted(records)
    silent = [r for r in expected if r not in ranks]  # no record, or one without collectives
    if len(ranks) < 2:
        names = f"only {_ranks(ranks)}" if ranks else "no rank"
        text = f"no hang verdict: {names} wrote a flight record with collectives"
        return HangVerdict("unknown", text, ranks=silent)
    per: dict[str, dict[int, dict[int, dict[str, Any]]]] = {}
    for r in ranks:
        for e in records[r].get("entries") or []:  # oldest first
            if not e.get("p2p"):
                mine = per.setdefault(e["group"], {q: {} for q in ranks})[r]
                if mine and e["seq"] <= max(mine):
                    mine.clear()  # the group was destroyed and created again: its numbers restart
                mine[e["seq"]] = e
    for group in sorted(per, key=lambda g: (g != "default", g)):
        seqs = per[group]
        last = {r: max(s, default=0) for r, s in seqs.items()}
        start = max(min(s, default=0) for s in seqs.values())  # the window every ring still holds
        for seq in range(max(start, 1), max(last.values()) + 1):
            have = {r: seqs[r][seq] for r in ranks if seq in seqs[r]}
            absent = [r for r in ranks if seq not in seqs[r] and last[r] < seq]
            if absent and have:
                e = next(iter(have.values()))
                waiting = sorted(have)
                if len(absent) == 1:
                    where = _state(records[absent[0]])
                else:
                    where = "; ".join(f"rank {r}: {_state(records[r])}" for r in absent)
                waits = ", ".join(
                    f"{_ranks([r])} waits {_when(records[r])} at {have[r]['where']}" for r in waiting
                )
                text = (
                    f"{_ranks(absent)} never entered {e['op']} #{seq} of {_group_name(group)}: "
                    f"{where}; {waits}"
                )
                if silent:
                    text += _silent(silent, blind)
                return HangVerdict(
                    "missing", text, group, seq, e["op"], absent, waiting, {r: _call(have[r]) for r in have}
                )
            sigs = {_signature(e) for e in have.values()}
            if len(sigs) > 1:
                calls: dict[int, str] = {q: _call(have[q]) for q in sorted(have)}
                text = f"ranks disagree at collective #{seq} of {_group_name(group)}: " + "; ".join(
                    f"rank {r} calls {c}" for r, c in calls.items()
                )
                if silent:
                    text += _silent(silent, blind)
                ops = sorted({e["op"] for e in have.values()})
                return HangVerdict("mismatch", text, group, seq, "/".join(ops), sorted(have), [], calls)
    states = "; ".join(f"rank {r}: {_state(records[r])}" for r in ranks)
    text = f"the ranks' collectives match in every group: the hang is outside them ({states})"
    if silent:
        text += _silent(silent, blind)
    return HangVerdict("agree", text, ranks=silent)


def verdict_of_run(run_dir: str | os.PathLike[str], world: int | None = None) -> HangVerdict | None:
    """:func:`match` over the flight records in ``run_dir``; ``None`` when no rank hung (no record
    with ``reason`` ``"hang"`` or ``"signal"``: records written at exit alone are no hang; a rank that
    wrote one on ``SIGUSR1`` and then finished replaced it at exit)."""
    records = read_records(run_dir)
    if not any(rec.get("reason") in ("hang", "signal") for rec in records.values()):
        return None
    return match(records, world)


__all__ = ["HangVerdict", "match", "read_records", "verdict_of_run"]

"""Which rank, which collective, which line: the hang verdict across ranks.

Each rank writes a *flight record* (``flight_rank{K}.json`` in the run folder) when its hang
watchdog fires and when it leaves ``watch()``: its phase, the line its main thread is at, and its
Flight Recorder entries (``torch._C._distributed_c10d._dump_fr_trace()``: per process group, the
collectives with their sequence number, op, sizes and the Python frames that called them; torch
2.13 records gloo collectives on CPU without any setting, NCCL ones too). :func:`match` reads the
records of all ranks (the files alone, no live process) and returns one :class:`HangVerdict`:

- a rank that never entered a collective the others did (a skipped call, a rank that ran fewer
  batches, a rank that left the loop): ``rank 1 never entered all_reduce #9 of the default group: it
  is at train.py:88 in evaluate; rank 0 waits in backward at train.py:120``;
- ranks that called different collectives (op, sizes or dtypes) at the same sequence number (a
  rank-divergent branch): ``ranks disagree at collective #9 of the default group: rank 0 calls
  all_reduce [[1]] Float at train.py:90; rank 1 calls broadcast [[1]] Float at train.py:93``.

The matcher is our own: the stock analyzer (``python -m torch.distributed.flight_recorder.fr_trace``)
raises ``KeyError: ('0', 0)`` on gloo dumps of torch 2.13, whose default group is keyed ``''`` in
``pg_config``. The Flight Recorder's ``state`` is not used: gloo leaves every entry "scheduled".
Gloo aborts the process at once when the ranks all-reduce tensors of different sizes ("Received
data size doesn't match expected size"): such a mismatch kills the job before any watchdog fires.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

FLIGHT_FILE = "flight_rank{rank}.json"
# a record keeps the ring's last 256 entries (of 2000 by default): the hang is at the end of every
# rank's sequence
_MAX_ENTRIES = 256
_SKIP_DIRS = (f"{os.sep}torch{os.sep}", f"{os.sep}torchdebug{os.sep}", f"{os.sep}multiprocessing{os.sep}")
_SKIP_FILES = ("threading.py", "<string>")


def _user_frame(frames: list[tuple[str, int, str]]) -> str:
    """``file.py:LINE in NAME`` of the innermost frame outside torch, torchdebug and the stdlib's
    process/thread plumbing (``frames`` innermost first); the innermost frame when all are inside."""
    for filename, line, name in frames:
        if any(d in filename for d in _SKIP_DIRS) or Path(filename).name in _SKIP_FILES:
            continue
        return f"{Path(filename).name}:{line} in {name}"
    if frames:
        filename, line, name = frames[0]
        return f"{Path(filename).name}:{line} in {name}"
    return "an unknown line"


def normalize(dump: dict[str, Any]) -> list[dict[str, Any]]:
    """A Flight Recorder dump (the unpickled dict) as plain JSON entries, oldest first: ``group``
    (``"default"`` for the default group, else its description or name), ``seq`` (the collective
    sequence number of its group, 1-based), ``op`` (``all_reduce``, without the backend prefix),
    ``sizes`` (input sizes), ``dtypes``, ``p2p``, ``where`` (the calling user line)."""
    out = []
    for e in (dump.get("entries") or [])[-_MAX_ENTRIES:]:
        pg = e.get("process_group") or ("", "")
        name, desc = (str(pg[0]), str(pg[1])) if len(pg) >= 2 else (str(pg), "")
        group = "default" if desc == "default_pg" else (desc or name or "?")
        op = str(e.get("profiling_name") or "?").split(":")[-1]
        frames = [
            (str(f.get("filename", "")), int(f.get("line", 0)), str(f.get("name", "")))
            for f in e.get("frames") or []
        ]
        out.append(
            {
                "group": group,
                "seq": int(e.get("collective_seq_id") or 0),
                "op": op,
                "sizes": e.get("input_sizes") or [],
                "dtypes": e.get("input_dtypes") or [],
                "p2p": bool(e.get("is_p2p")),
                "where": _user_frame(frames),
            }
        )
    return out


def flight_entries(frames: bool = True) -> tuple[list[dict[str, Any]], str | None]:
    """This process's Flight Recorder entries (:func:`normalize`) and ``None``, or ``[]`` and why not.
    ``frames=False`` leaves out the calling lines (``where``: "an unknown line"): reading them
    symbolizes every entry's stack, 2 s for a full ring on a busy CPU
    (``benchmarks/flight_record_cost.py``)."""
    try:
        import torch

        dump_fr = torch._C._distributed_c10d._dump_fr_trace  # type: ignore[attr-defined]
        raw = dump_fr(includeStackTraces=frames)  # a pickle torch wrote in this process
        return normalize(pickle.loads(raw)), None
    except Exception as exc:  # no Flight Recorder in this build, or none enabled
        return [], f"no Flight Recorder dump ({type(exc).__name__}: {exc})"


def capture(rank: int, reason: str, phase: str, last_step: int | None, main: int | None) -> dict[str, Any]:
    """This rank's flight record: ``reason`` (``"hang"``: the watchdog fired, ``"exit"``: it left
    ``watch()``: its entries without their calling lines, a fast exit), ``phase``, ``last_step``, ``where`` (the user line its thread ``main`` is at, innermost
    frame outside torch and torchdebug), ``entries`` and ``error`` (:func:`flight_entries`)."""
    where = "an unknown line"
    frame = sys._current_frames().get(main) if main is not None else None
    if frame is not None:
        fs = traceback.extract_stack(frame)
        where = _user_frame([(f.filename, f.lineno or 0, f.name) for f in reversed(fs)])
    entries, error = flight_entries(frames=reason != "exit")  # a rank that left is named by its own line
    return {
        "rank": rank,
        "reason": reason,
        "phase": phase,
        "last_step": last_step,
        "where": where,
        "entries": entries,
        "error": error,
    }


def write_record(run_dir: str | os.PathLike[str], record: dict[str, Any]) -> Path:
    """Write ``record`` to ``run_dir/flight_rank{K}.json`` (replaced whole: a reader never sees half)."""
    path = Path(run_dir) / FLIGHT_FILE.format(rank=record["rank"])
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)
    return path


def read_records(run_dir: str | os.PathLike[str]) -> dict[int, dict[str, Any]]:
    """Every rank's flight record in ``run_dir`` (``{rank: record}``; unreadable files are left out)."""
    out: dict[int, dict[str, Any]] = {}
    for p in sorted(Path(run_dir).glob("flight_rank*.json")):
        try:
            rec = json.loads(p.read_text())
            out[int(rec["rank"])] = rec
        except (OSError, ValueError, KeyError, TypeError):
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
    with ``reason == "hang"``: records written at exit alone are no hang)."""
    records = read_records(run_dir)
    if not any(rec.get("reason") == "hang" for rec in records.values()):
        return None
    return match(records, world)


__all__ = [
    "FLIGHT_FILE",
    "HangVerdict",
    "capture",
    "match",
    "normalize",
    "read_records",
    "verdict_of_run",
    "write_record",
]

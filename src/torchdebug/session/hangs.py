"""Which rank, which collective, which line: the hang verdict across ranks.

Each rank writes a *flight record* (``flight_rank{K}.json`` in the run folder) when its hang
watchdog fires and when it leaves ``watch()``: its phase, the line its main thread is at, and its
Flight Recorder entries (``torch._C._distributed_c10d._dump_fr_trace()``: per process group, the
collectives with their sequence number, op, sizes and the Python frames that called them; torch
2.13 records gloo collectives on CPU without any setting, NCCL ones too). :func:`torchdebug.views.hangs.match` reads
the records of all ranks (the files alone, no live process) and returns one ``HangVerdict``:

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


__all__ = ["FLIGHT_FILE", "capture", "normalize", "write_record"]

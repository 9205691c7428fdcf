"""Which rank, which collective, which line: the hang verdict across ranks.

Each rank writes a *flight record* (``flight_rank{K}.json`` in the run folder) when its hang
watchdog fires, when it gets ``SIGUSR1`` (:class:`FlightSignal`) and when it leaves ``watch()``: its phase, the line its main thread is at, and its
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

import contextlib
import json
import os
import pickle
import select
import signal
import sys
import threading
import time
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
    """This rank's flight record: ``reason`` (``"hang"``: the watchdog fired, ``"signal"``: it got
    ``SIGUSR1``, ``"exit"``: it left
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


_STOP = 0  # the byte that wakes the watchdog to stop (no signal has number 0)


def write_flight(
    run_dir: Any, rank: int, reason: str, phase: str, last_step: int | None, main: int | None
) -> None:
    """This rank's flight record into the run folder; never raises (a record that fails must not take
    the job down)."""
    try:
        write_record(run_dir, capture(rank, reason, phase, last_step, main))
    except Exception as exc:
        print(f"torchdebug: the flight record could not be written ({exc!r})", file=sys.stderr)


def verdict_across_ranks(run_dir: Any, world: int, timeout: float, stop: threading.Event) -> Any:
    """The verdict across ranks (``views.hangs``) once every rank wrote its flight record, waiting up
    to ``timeout`` (at most 30 s) for the others' watchdogs; from the records there by then. Runs on
    the watchdog's thread (the job waits anyway); None when matching fails."""
    from ..views.hangs import match, read_records

    deadline = time.monotonic() + min(float(timeout), 30.0)
    records = read_records(run_dir)
    while len(records) < world and time.monotonic() < deadline and not stop.is_set():
        time.sleep(0.1)
        records = read_records(run_dir)
    try:
        return match(records, world)
    except Exception as exc:  # a verdict that fails must not take the watchdog down
        print(f"torchdebug: no hang verdict ({exc!r})", file=sys.stderr)
        return None


class FlightSignal:
    """``SIGUSR1`` asks a rank for its flight record now: the watchdog thread writes it, training goes on.

    ``listen=False``: only the watchdog's wake-up to stop. Installed from the main thread only (``signal.signal`` works only
    there; elsewhere :attr:`installed` is False and nothing changes). The handler the user had is
    called after ours when it is a function (``SIG_DFL`` would end the process: not called; ``SIG_IGN``
    neither); :meth:`close` puts it back unless the user replaced ours meanwhile.

    A rank stuck in a collective waits inside C++, where Python runs no signal handler until the wait
    returns; so the signal reaches the watchdog through ``signal.set_wakeup_fd`` (written by the C-level
    handler at once, on any thread) when no one else (an asyncio loop) holds the wakeup fd, and only
    through the Python handler otherwise (then a rank blocked in C++ answers when its wait ends).
    """

    def __init__(self, listen: bool = True) -> None:
        self._r, self._w = os.pipe()  # the watchdog's wake-up: signal numbers, or _STOP
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self.installed = False
        self._wakeup = False  # our pipe is the process's wakeup fd
        self._prev: Any = None
        main = threading.current_thread() is threading.main_thread()
        if not (listen and main and hasattr(signal, "SIGUSR1")):
            return
        try:
            self._prev = signal.signal(signal.SIGUSR1, self._on_signal)
        except (ValueError, OSError):
            return
        self.installed = True
        old = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
        if old != -1:  # someone else's (an asyncio loop): theirs stays; the Python handler wakes us
            signal.set_wakeup_fd(old)
        else:
            self._wakeup = True

    def _on_signal(self, signum: int, frame: Any) -> None:
        if not self._wakeup:  # else the C-level handler already wrote the number into the pipe
            self._send(signum)
        if callable(self._prev):
            self._prev(signum, frame)

    def _send(self, byte: int) -> None:
        with contextlib.suppress(OSError):
            os.write(self._w, bytes([byte]))

    def wait(self, timeout: float) -> tuple[bool, bool]:
        """Wait up to ``timeout`` s: ``(asked, stop)``: ``SIGUSR1`` came, :meth:`stop` was called."""
        ready, _, _ = select.select([self._r], [], [], timeout)
        got = b""
        while ready:
            try:
                chunk = os.read(self._r, 512)
            except (BlockingIOError, InterruptedError):
                break
            if not chunk:
                break
            got += chunk
        return (signal.SIGUSR1 in got if hasattr(signal, "SIGUSR1") else False), _STOP in got

    def stop(self) -> None:
        """Wake the watchdog to stop (any thread)."""
        self._send(_STOP)

    def close(self) -> None:
        """Put back the wakeup fd and the user's handler (main thread; elsewhere the handler stays and
        keeps calling the user's), then close the pipe."""
        if self.installed:
            if threading.current_thread() is not threading.main_thread():
                return  # the pipe stays open: the handler (and the wakeup fd) still write to it
            if self._wakeup:
                cur = signal.set_wakeup_fd(-1)
                if cur != self._w:  # set meanwhile by someone else: theirs stays
                    signal.set_wakeup_fd(cur)
            if signal.getsignal(signal.SIGUSR1) == self._on_signal:
                signal.signal(signal.SIGUSR1, self._prev if self._prev is not None else signal.SIG_DFL)
            self.installed = False
        for fd in (self._r, self._w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._r = self._w = -1


__all__ = ["FLIGHT_FILE", "FlightSignal", "capture", "normalize", "write_record"]

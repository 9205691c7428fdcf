"""The sink interface and the hub that feeds sinks off the training thread, dropping any that fail.

Threads: ``SinkHub.feed`` runs on the run writer's thread (``RunWriter.add_listener``) and only
decodes the batch and appends it to each sink's queue; each sink has its own daemon thread that
calls the tracker library, so a slow tracker holds up neither training nor the other sinks.
``open`` and ``release`` run on the thread that owns the session (the training thread), where
trackers keep per-thread state (MLflow's active run).
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .._errors import ConfigError, TorchDebugWarning
from ._episodes import EpisodeEnd, Episodes, Item
from ._records import Finding, Histogram, Record, RunEnd, RunInfo, Scalars, Tally, decode_high, decode_low

#: records a sink may fall behind before it is switched off (about the store's own queue)
MAX_BEHIND = 100_000
#: seconds the session's exit waits for the sinks to send what is left
CLOSE_TIMEOUT = 15.0


class Sink:
    """One tracker that receives a run's records. Subclass and override what the tracker shows.

    Call order: ``open`` (the owner thread, at session start: find the tracker's run), then
    on the sink's thread ``start`` (connect), ``scalars`` / ``histogram`` / ``finding`` for each record in order and
    ``flush`` after each batch, ``finish`` once with how the run ended; then ``release`` on the
    owner thread (end what ``open`` opened). A method that raises switches the sink off with one
    ``TorchDebugWarning``; the run folder keeps everything.
    """

    name = "sink"
    setup_hint = ""  # what a user sets up for the tracker, said when it cannot start

    def open(self, run: RunInfo) -> None:
        """Find or open the tracker's run (the owner thread). Must not wait on the network: a tracker
        that needs a server connects in ``start``."""

    def start(self) -> None:
        """Connect (the sink's thread, before its first record): a server that cannot be reached
        switches the sink off here, while training goes on."""

    def scalars(self, rec: Scalars) -> None:
        """One step's values under their ``torchdebug/...`` names."""

    def histogram(self, rec: Histogram) -> None:
        """Summary statistics of one tensor (only TensorBoard draws them)."""

    def finding(self, rec: Finding) -> None:
        """The first anomaly or rule event of an episode (one incident: the same origin or rule, see
        ``_episodes.py``); ``rec.episode`` is its number."""

    def repeat(self, rec: Finding) -> None:
        """A later record of an open episode (``rec.episode``); most trackers need nothing of it."""

    def episode_end(self, end: EpisodeEnd) -> None:
        """An episode closed: ``end.count`` records, ``end.first`` its origin, ``end.summary()``."""

    def flush(self) -> None:
        """After each batch of records."""

    def finish(self, end: RunEnd) -> None:
        """The run's status, verdict and folder (the sink's thread, after every record)."""

    def release(self, end: RunEnd) -> None:
        """Close what ``open`` opened (the owner thread, after ``finish``)."""

    def write(self, records: Iterable[Item]) -> None:
        """Dispatch records to ``scalars`` / ``histogram`` / ``finding`` / ``repeat`` / ``episode_end``."""
        for rec in records:
            if isinstance(rec, Scalars):
                self.scalars(rec)
            elif isinstance(rec, Finding):
                if rec.repeat:
                    self.repeat(rec)
                else:
                    self.finding(rec)
            elif isinstance(rec, Histogram):
                self.histogram(rec)
            elif isinstance(rec, EpisodeEnd):
                self.episode_end(rec)


class _Worker:
    """One sink's queue and thread."""

    def __init__(self, hub: SinkHub, sink: Sink) -> None:
        self.hub = hub
        self.sink = sink
        self.cond = threading.Condition()
        self.queue: deque[list[Item]] = deque()
        self.behind = 0
        self.end: RunEnd | None = None
        self.off = False
        self.thread = threading.Thread(target=self._run, name=f"torchdebug-sink-{sink.name}", daemon=True)
        self.thread.start()

    def put(self, records: list[Item]) -> None:
        with self.cond:
            if self.off or self.end is not None:
                return
            self.behind += len(records)
            if self.behind > MAX_BEHIND:
                self.off = True
                self.queue.clear()
                self.hub.note(
                    self.sink,
                    f"fell more than {MAX_BEHIND} records behind (the tracker is slower than training)",
                )
            else:
                self.queue.append(records)
            self.cond.notify()

    def close(self, end: RunEnd) -> None:
        with self.cond:
            self.end = end
            self.cond.notify()

    def _run(self) -> None:
        sink = self.sink
        try:
            sink.start()
        except Exception as exc:
            self._switch_off(f"could not start: {exc!r}")
            return
        while True:
            with self.cond:
                while not self.queue and self.end is None and not self.off:
                    self.cond.wait()
                if self.off:
                    return
                batch = self.queue.popleft() if self.queue else None
                end = self.end if batch is None else None
            try:
                if batch is not None:
                    sink.write(batch)
                    sink.flush()
                    with self.cond:
                        self.behind -= len(batch)
                    continue
                if end is not None:
                    sink.finish(end)
                return
            except Exception as exc:
                self._switch_off(f"failed: {exc!r}")
                return

    def _switch_off(self, why: str) -> None:
        """The sink failed: drop what it still had queued and say so once (on the training thread)."""
        with self.cond:
            self.off = True
            self.queue.clear()
        self.hub.note(self.sink, why)


class SinkHub:
    """Feeds a run's records to its sinks, each on its own thread (see the module docstring).

    Args:
        sinks: the sinks; ``open`` is called on each now (the calling thread). One that fails to open
            is left out with a warning; an ImportError (its library is missing) propagates.
        run: the run being reported.

    Use ``feed`` as the run writer's listener, ``put`` for records from elsewhere (a framework
    callback), ``warn`` on the owner thread to raise the pending warnings, and ``close(status)`` at
    the end (it waits up to ``CLOSE_TIMEOUT`` seconds in all for the sinks to finish).
    """

    def __init__(self, sinks: Sequence[Sink], run: RunInfo) -> None:
        self.run = run
        self.tally = Tally()
        self.episodes = Episodes()
        self._lock = threading.Lock()
        self._messages: list[str] = []
        self._noted: set[int] = set()
        self.pending = False  # a warning waits for the owner thread (warnings are per thread)
        self.sinks: list[Sink] = []
        for sink in sinks:
            try:
                sink.open(run)
            except ImportError:
                raise
            except Exception as exc:
                self.note(sink, f"could not start: {exc!r}")
                continue
            self.sinks.append(sink)
        self._workers = [_Worker(self, s) for s in self.sinks]
        self._closed = False

    def note(self, sink: Sink, why: str) -> None:
        """Switch a sink off with one warning (raised later on the owner thread)."""
        with self._lock:
            if id(sink) in self._noted:
                return
            self._noted.add(id(sink))
            where = f"; the run folder {self.run.path} keeps everything" if self.run.path else ""
            self._messages.append(f"torchdebug: the {sink.name!r} sink {why} and was switched off{where}")
            self.pending = True

    def warn(self, stacklevel: int = 3) -> None:
        """Raise the pending sink warnings as ``TorchDebugWarning`` (one per sink), on this thread."""
        with self._lock:
            messages, self._messages = self._messages, []
            self.pending = False
        for m in messages:
            warnings.warn(TorchDebugWarning(m), stacklevel=stacklevel)

    def feed(self, low: Sequence[tuple[Any, ...]], high: Sequence[tuple[Any, ...]]) -> None:
        """The run writer's listener: decode a batch and queue it for every sink (the writer thread)."""
        try:
            records = decode_low(low)
            if high:
                records += decode_high(high)
        except Exception as exc:  # a record this version cannot read: say so, do not stop the store
            for w in self._workers:
                with w.cond:
                    w.off = True
                    w.cond.notify()
                self.note(w.sink, f"could not read a batch of records ({exc!r})")
            return
        if records:
            self.put(records)

    def put(self, records: list[Record]) -> None:
        """Queue records for every sink (one producer thread at a time; returns at once)."""
        for rec in records:
            self.tally.see(rec)  # for the verdict
        items = self.episodes.see(records)  # one incident, one alert: before any sink sees them
        for w in self._workers:
            w.put(items)

    def close(
        self, status: str, last_step: int | None = None, lost: int = 0, steps: int | None = None
    ) -> RunEnd:
        """Send how the run ended, wait for the sinks (``CLOSE_TIMEOUT`` in all), release them, warn.

        ``last_step``: the session's last step, when no record reached this far; ``lost``: records
        the run writer could not store (the verdict then says the run is incomplete, as ``show`` does);
        ``steps``: the steps that stored metrics, when the scalars went another way (a framework's
        own ``log_metrics``: the hub saw findings only, and would count 0 steps).
        """
        tally = self.tally
        if last_step is not None and (tally.last_step is None or last_step > tally.last_step):
            tally.last_step = last_step
        if steps is not None:
            tally.steps = max(tally.steps, steps)
        tally.lost = max(tally.lost, lost)
        end = tally.end(status, self.run.path)
        if self._closed:
            return end
        self._closed = True
        ends = self.episodes.close()
        for w in self._workers:
            if ends:
                w.put(ends)
            w.close(end)
        deadline = time.monotonic() + CLOSE_TIMEOUT
        for w in self._workers:
            w.thread.join(max(deadline - time.monotonic(), 0.0))
            if w.thread.is_alive():
                with w.cond:
                    w.off = True
                self.note(w.sink, f"did not finish within {CLOSE_TIMEOUT:g} s")
        for w in self._workers:
            try:
                w.sink.release(end)
            except Exception as exc:
                self.note(w.sink, f"failed at the end: {exc!r}")
        self.warn(stacklevel=4)
        return end


def deliver(
    sinks: Sequence[Sink], run: RunInfo, records: Iterable[Record], status: str, lost: int = 0
) -> RunEnd:
    """Send records to sinks here and now (``torchdebug export``): errors propagate; a sink that
    cannot start (no login, no tracking server) raises ConfigError naming the fix. ``lost``: the
    records the run's writer could not store (``Run.summary()["lost"]``)."""
    tally = Tally()
    tally.lost = lost
    episodes = Episodes()
    opened: list[Sink] = []
    try:
        for s in sinks:
            try:
                s.open(run)
                opened.append(s)
                s.start()
            except ImportError:
                raise
            except Exception as exc:  # a login, a server, a URI: the user's setup, not our bug
                hint = f"; {s.setup_hint}" if s.setup_hint and s.setup_hint not in str(exc) else ""
                raise ConfigError(f"the {s.name!r} tracker could not start: {exc}{hint}") from exc
        batch: list[Record] = []
        for rec in records:
            tally.see(rec)
            batch.append(rec)
            if len(batch) >= 1000:
                items = episodes.see(batch)
                for s in opened:
                    s.write(items)
                batch = []
        items = episodes.see(batch) + episodes.close()
        for s in opened:
            s.write(items)
            s.flush()
        end = tally.end(status, run.path)
        for s in opened:
            s.finish(end)
    except BaseException:
        end = tally.end("failed", run.path)
        for s in opened:
            with contextlib.suppress(Exception):
                s.release(end)
        raise
    for s in opened:
        s.release(end)
    return end


def run_info(run: Any) -> RunInfo:
    """The ``RunInfo`` of a stored run (``torchdebug.store.Run``)."""
    meta = getattr(run, "meta", {}) or {}
    cfg = meta.get("config")
    return RunInfo(
        name=str(getattr(run, "name", None) or meta.get("name") or "run"),
        run_id=getattr(run, "run_id", None),
        path=Path(run.path) if getattr(run, "path", None) is not None else None,
        config=cfg if isinstance(cfg, dict) else {},
    )

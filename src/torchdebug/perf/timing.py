"""Timing instruments: per-step breakdown (data, forward, backward, optimizer, other), throughput, rules, per-module time."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from .._installs import Installs
from .._robust import RunningMedian
from .._step import SessionView
from .._trees import tensor_leaves
from ..events import RuleEvent, module_label, not_under_compile
from ._gradhooks import when_all_grads

PHASES = ("data", "forward", "backward", "optimizer", "other", "step")

# perf/'s one host clock (seconds): every CPU mark and DataLoader batch time below, profile()'s data
# and wall times. Looked up when a clock is built (an instrument's install, a ModuleTimer, a profile):
# a test replaces it with a clock it advances by hand and asserts exact spans. Only read, never waited on.
host_clock: Callable[[], float] = time.perf_counter


def batch_size_and_tokens(args: Any, kwargs: Any = None) -> tuple[int | None, int | None]:
    """Batch size (dim 0 of the first tensor argument) and, for an integer (B, T) tensor, tokens B*T.

    Example:
        >>> batch_size_and_tokens((torch.zeros(4, 7, dtype=torch.long),))
        (4, 28)
    """
    first = args[0] if type(args) is tuple and args else None
    if isinstance(first, torch.Tensor) and first.dim() != 0:
        leaves: Any = (first,)  # every forward: the first leaf is the first argument, no walk
    else:
        leaves = tensor_leaves((args, kwargs or {}))
    for t in leaves:
        if t.dim() == 0:
            continue
        b = int(t.shape[0])
        tokens = (
            b * int(t.shape[1]) if t.dim() == 2 and not t.is_floating_point() and not t.is_complex() else None
        )
        return b, tokens
    return None, None


class _Clock:
    """Marks on the host (``host_clock``) and, on CUDA, CUDA events read one step later (no extra sync)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        # several marks a step: on the host the builtin clock itself (no Python frame per mark)
        self.mark: Callable[[], Any] = self._event if cuda else host_clock

    @staticmethod
    def _event() -> Any:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def ready(self, mark: Any) -> bool:
        return True if not self.cuda else bool(mark.query())

    def elapsed(self, a: Any, b: Any) -> float:
        if self.cuda:
            return float(a.elapsed_time(b)) / 1000.0  # ms -> s
        return float(b - a)


class _StepMarks:
    """One step's marks. On the host each phase's seconds are summed as it is marked (``host_clock``
    differences, no pair kept); on CUDA the phases' event pairs are kept in ``spans`` and read once the
    events completed."""

    __slots__ = (
        "backs",
        "backward",
        "cpu",
        "data",
        "end",
        "forward",
        "loader",
        "loader_calls",
        "machine",
        "optimizer",
        "samples",
        "spans",
        "start",
        "step",
        "tokens",
        "wait",
    )

    def __init__(self, start: Any = None, step: int = 0, cuda: bool = False) -> None:
        self.start = start  # end of the previous step
        self.spans: dict[str, list[tuple[Any, Any]]] | None = (
            {"data": [], "forward": [], "backward": [], "optimizer": []} if cuda else None
        )
        self.data = self.forward = self.backward = self.optimizer = 0.0  # host: seconds
        self.backs = 0  # backward spans marked
        self.end: Any = None
        self.samples = self.tokens = 0
        self.step = step
        self.cpu = math.nan  # this process's CPU seconds over the step (host clock only)
        self.wait = math.nan  # the training thread's seconds waiting for a CPU (Linux run-queue delay)
        self.loader = 0.0  # seconds inside DataLoader iterators' __next__ during the step
        self.loader_calls = 0
        self.machine: MachineReading | None = (
            None  # the contention counters at the step's end (on a schedule)
        )


class RunQueueClock:
    """Seconds the calling thread has spent ready to run but waiting for a CPU (the kernel's run-queue
    delay, ``/proc/thread-self/schedstat``'s second field): time a busy machine took from it.

    ``read()`` returns NaN where the file does not exist (not Linux, no schedstats). Open it on the
    thread to measure. Cost: one ``pread`` of a small proc file, about 3 µs.
    """

    def __init__(self, path: str = "/proc/thread-self/schedstat") -> None:
        import os

        try:
            self._fd: int | None = os.open(path, os.O_RDONLY)
        except OSError:
            self._fd = None

    def read(self) -> float:
        # read_both()'s work for one field, not a call to it: the slowdown rule reads this every step,
        # and the ordinary step's Python call budget (tests/test_step_path.py) has no room for another
        import os

        if self._fd is None:
            return math.nan
        try:
            return int(os.pread(self._fd, 128, 0).split()[1]) / 1e9
        except (OSError, ValueError, IndexError):
            return math.nan

    def read_both(self) -> tuple[float, float]:
        """(seconds on a CPU, seconds waiting for one) of the thread so far; NaN where unknown."""
        import os

        if self._fd is None:
            return math.nan, math.nan
        try:
            fields = os.pread(self._fd, 128, 0).split()
            return int(fields[0]) / 1e9, int(fields[1]) / 1e9
        except (OSError, ValueError, IndexError):
            return math.nan, math.nan

    def close(self) -> None:
        import os

        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class MachineReading(NamedTuple):
    """The machine's contention counters at one moment (cumulative; NaN: not readable here).

    ``wall``: the timing clock's mark when read (seconds). ``wait``: seconds this process's threads
    have spent ready to run but waiting for a CPU, summed over its live threads (the kernel's
    run-queue delay). ``pressure``: seconds in which some task of the machine waited for a CPU
    (Linux PSI, ``/proc/pressure/cpu``, "some"). ``steal`` and ``ticks``: the CPUs' time taken by
    the hypervisor, and all their time, in clock ticks (``/proc/stat``).
    """

    wall: float
    wait: float = math.nan
    pressure: float = math.nan
    steal: float = math.nan
    ticks: float = math.nan


# what ContentionReader.sources names, said in a slowdown event's evidence ("contention_read")
CONTENTION_SOURCES = {
    "wait": "this process's threads' wait for a CPU (/proc/self/task/*/schedstat)",
    "pressure": "CPU pressure (/proc/pressure/cpu)",
    "steal": "steal time (/proc/stat)",
}


class ContentionReader:
    """Reads :class:`MachineReading` from ``/proc`` (or ``root``, a folder laid out like it): the
    run-queue delay of each of this process's threads (``self/task/*/schedstat``), CPU pressure
    (``pressure/cpu``) and steal (``stat``). Where a file is missing (macOS, a kernel without PSI,
    a container) its field is NaN and :attr:`sources` does not name it.

    Cost: one ``pread`` per thread and two more, about 10 µs for a few threads: the timing
    instrument reads it on a schedule (every ``contention_every_s`` of steps), not every step.

    Example:
        >>> r = ContentionReader("/nonexistent").read(1.0)
        >>> (r.wall, math.isnan(r.wait))
        (1.0, True)
    """

    def __init__(self, root: str = "/proc") -> None:
        import os

        self.root = root
        self._tasks = os.path.join(root, "self", "task")
        # the machine's two files stay open (pread at 0 re-reads them); threads come and go: their
        # files are opened at each reading
        self._pressure = self._stat = -1
        try:
            self._pressure = os.open(os.path.join(root, "pressure", "cpu"), os.O_RDONLY)
        except OSError:
            pass
        try:
            self._stat = os.open(os.path.join(root, "stat"), os.O_RDONLY)
        except OSError:
            pass
        first = self.read(0.0)
        self.sources = tuple(
            k
            for k, v in (("wait", first.wait), ("pressure", first.pressure), ("steal", first.steal))
            if v == v
        )

    def read(self, wall: float) -> MachineReading:
        """The counters now, ``wall`` the caller's clock. One Python call, no helpers: it runs
        inside the step (on a schedule) and the ordinary step's call budget is pinned."""
        import os

        wait = pressure = steal = ticks = math.nan
        try:
            total = 0
            for tid in os.listdir(self._tasks):
                try:
                    fd = os.open(f"{self._tasks}/{tid}/schedstat", os.O_RDONLY)
                except OSError:  # the thread ended since the listing
                    continue
                try:
                    total += int(os.pread(fd, 128, 0).split()[1])
                finally:
                    os.close(fd)
            wait = total / 1e9
        except (OSError, ValueError, IndexError):
            pass
        try:  # "some avg10=.. avg60=.. avg300=.. total=<µs>\nfull ..."
            line = os.pread(self._pressure, 256, 0).split(b"\n", 1)[0]
            pressure = int(line.rsplit(b"total=", 1)[1]) / 1e6
        except (OSError, ValueError, IndexError):
            pass
        try:  # "cpu  user nice system idle iowait irq softirq steal guest guest_nice\ncpu0 ..."
            fields = os.pread(self._stat, 256, 0).split(b"\n", 1)[0].split()[1:9]
            steal, ticks = float(fields[7]), float(sum(map(int, fields)))
        except (OSError, ValueError, IndexError):
            pass
        return MachineReading(wall, wait, pressure, steal, ticks)

    def close(self) -> None:
        """Close the machine's files (idempotent)."""
        import os

        for fd in (self._pressure, self._stat):
            if fd >= 0:
                os.close(fd)
        self._pressure = self._stat = -1


def machine_load() -> tuple[float, int]:
    """(load average over the last minute, CPU count): how busy the machine is, for the slowdown rule.

    Raises OSError where there is no load average (Windows)."""
    import os

    return os.getloadavg()[0], os.cpu_count() or 1


@dataclass(frozen=True)
class StepTiming:
    """One step's time split, in seconds; ``other`` is the rest (loss, user code, the monitor's transfer)."""

    step: int
    data: float
    forward: float
    backward: float
    optimizer: float
    other: float
    total: float
    samples: int = 0
    tokens: int = 0
    # this process's CPU seconds (all its threads) over the step; NaN where not measured (CUDA)
    cpu: float = math.nan
    # seconds the training thread was ready to run but waited for a CPU (Linux); NaN: not measured
    wait: float = math.nan
    # seconds spent inside DataLoader iterators' __next__, and how many batches they gave, this step
    loader: float = 0.0
    loader_calls: int = 0
    # the machine's contention counters read at this step's end; None on the steps between readings
    machine: MachineReading | None = None

    @property
    def samples_per_s(self) -> float | None:
        return self.samples / self.total if self.samples and self.total > 0 else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.total if self.tokens and self.total > 0 else None

    def as_log(self) -> dict[str, float]:
        return {
            "data": self.data,
            "forward": self.forward,
            "backward": self.backward,
            "optimizer": self.optimizer,
            "other": self.other,
            "step": self.total,
        }

    def __str__(self) -> str:
        parts = [f"{k} {v * 1e3:.1f} ms" for k, v in self.as_log().items()]
        if self.samples_per_s:
            parts.append(f"{self.samples_per_s:.1f} samples/s")
        if self.tokens_per_s:
            parts.append(f"{self.tokens_per_s:.0f} tokens/s")
        return f"step {self.step}: " + ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "step": self.step,
            **self.as_log(),
            "samples": self.samples,
            "tokens": self.tokens,
        }
        d["samples_per_s"] = self.samples_per_s
        d["tokens_per_s"] = self.tokens_per_s
        return d


_RULE_PHASES = ("data", "forward", "backward", "optimizer", "other")


class SlowdownRule:
    """Sustained slowdown: the median step time of the last ``recent`` steps stands well above the
    median of the ``window`` steps before them. Pure: fed with :class:`StepTiming`, returns events.

    Slow means both ``recent median > factor * baseline median`` and ``recent median - baseline
    median >= max(min_s, mads * 1.4826 MAD of the baseline)``: a median over ``recent`` steps ignores
    a few slow steps (a gc pause, the debugger's own leak census, scheduler noise) and the MAD test
    ignores jitter the run always had. A step joins the baseline once it leaves the recent window;
    inside an episode the baseline is frozen, so a slowdown that lasts does not become the norm and
    fire again. Sustained means in time too: the median must stay slow for ``min_duration_s`` of
    steps (a second of machine load on 1 ms steps is a burst, not a slowdown). One ``slowdown`` event when an episode starts (naming the phase whose median grew
    most), one ``slowdown_end`` info event when it ends, with its length in steps.

    This process's work or a busy machine, from the machine's readings: when some steps carry a
    :class:`MachineReading` (``StepTiming.machine``: this process's threads' summed wait for a CPU,
    CPU pressure, steal; the timing instrument reads them on a schedule), the rule compares the
    slow steps' span of readings with the span before them. The share of a step lost to waiting
    (the threads' wait per second of wall time plus the steal share, at most 1) gives the time lost
    per step; the rest is the step's own part. When the time lost grew by at least half of the rise
    and the own part did not grow ``factor`` times with at least its share of the rise (half its
    share of the step before, and at least a tenth), the ``slowdown`` is information (severity
    ``info``) with the numbers read; otherwise a ``warning``, which also says the numbers ("the
    machine is busy too" when both grew). The threads' summed wait, not the training thread's, is
    what counts: with torch's intra-op threads (OpenMP) a worker waiting for a CPU leaves the
    training thread spinning at the barrier, on a CPU (word_language_model's LSTM beside 13 busy
    processes on 2 CPUs: 7 ms of CPU a step became up to 1034 ms for the same work), so neither the CPU
    time nor the training thread's own wait tells the work from the machine.

    Without readings (not Linux, CUDA, too few before the slow steps): when the steps carry the
    training thread's wait for a CPU (``StepTiming.wait``) and this process's CPU time
    (``StepTiming.cpu``), the rule splits the rise of the median step the same way with them: a
    wait that grew by at least half of the rise while the CPU time did not grow ``factor`` times
    (or the step's own part did not carry its share) is information; any other slowdown, and any
    where the wait is not measured, is a ``warning`` (saying so when a reader found nothing).

    Known limitations:
        - A machine that stays saturated while the work grows: with every thread waiting most of the
          time before and after, the own part cannot be told from the wait, and the slowdown reads
          as contention (information).
        - The wait counted is this process's threads'; DataLoader worker processes are other
          processes: a step slowed by its own workers crowding the CPUs reads as contention.
        - CPU pressure is the machine's (or the container's, where ``/proc`` is the container's):
          said, never decisive.

    Args:
        factor: how many times the baseline a slow median is (> 1).
        recent: steps in the judged window (odd; the median needs ``recent // 2 + 1`` slow steps).
        window: steps in the baseline. min_baseline: baseline steps needed before judging.
        min_s: smallest rise in seconds that counts (sub-millisecond steps jitter by more than 1.5x).
        mads: robust sigmas of the baseline a rise must exceed.
        min_duration_s: seconds of slow steps (after the median turned) before it is an episode.
        load: the machine's (load average over 1 minute, CPU count), said with a contended slowdown;
            None: not said.
        read: what the timing instrument's :class:`ContentionReader` can read (its ``sources``);
            ``()``: nothing, said in a warning; None: no reader (the rule used on its own).

    Example:
        >>> rule = SlowdownRule(recent=3, min_baseline=5, min_duration_s=0.1)
        >>> fast = [StepTiming(s, 0.0, 0.01, 0.01, 0.0, 0.0, 0.02) for s in range(10)]
        >>> slow = [StepTiming(s, 0.0, 0.05, 0.01, 0.0, 0.0, 0.06) for s in range(10, 14)]
        >>> [(e.kind, e.step, e.evidence["phase"]) for t in fast + slow for e in rule.update(t)]
        [('slowdown', 12, 'forward')]
    """

    def __init__(
        self,
        factor: float = 1.5,
        recent: int = 9,
        window: int = 100,
        min_baseline: int = 10,
        min_s: float = 0.002,
        mads: float = 5.0,
        min_duration_s: float = 0.5,
        load: Callable[[], tuple[float, int]] | None = None,
        read: tuple[str, ...] | None = None,
    ) -> None:
        if factor <= 1:
            raise ValueError(f"factor must be > 1, got {factor}")
        if recent < 1 or window < 1:
            raise ValueError(f"recent and window must be >= 1, got {recent}, {window}")
        self.factor, self.min_s, self.mads = float(factor), float(min_s), float(mads)
        self.min_baseline = int(min_baseline)
        self.min_duration_s = float(min_duration_s)
        self.load = load
        self.read = read
        # (step, MachineReading) of the steps that carry one, enough to span the baseline
        self._machine = deque[tuple[int, MachineReading]](maxlen=int(window) + int(recent) + 2)
        self._after = -1  # the last step of the previous episode: readings before it are not "before"
        # the (first, last) readings of the span before the last episode judged by readings
        self._before_span: tuple[tuple[int, MachineReading], tuple[int, MachineReading]] | None = None
        self._cpu = deque[float](maxlen=int(window))  # the baseline steps' CPU seconds
        self._wait = deque[float](maxlen=int(window))  # and their seconds waiting for a CPU
        self._totals = deque[float](maxlen=int(window))  # and their wall seconds (paired with _wait)
        self._pending: tuple[int, float] | None = None  # (step the median turned, slow seconds since)
        # no reading since the slow steps began (the schedule's 0.25 s is more than a short episode):
        # the rule asks the instrument for one at the next step's end and judges a step later, once
        self.wants_reading = False
        self._asked = False
        self.recent: deque[StepTiming] = deque(maxlen=int(recent))
        self._recent_totals = deque[float](maxlen=int(recent))  # their wall seconds
        self.baseline = RunningMedian(int(window))
        self._pushed = 0  # len(self.baseline), counted: no Python call per step
        # the baseline's steps: their phases are read only when an episode starts
        self._base = deque[StepTiming](maxlen=int(window))
        self.start: int | None = None  # first step of the current episode
        self.count = 0  # episodes

    def _phases(self) -> dict[str, list[float]]:
        """Each phase's finite seconds over the baseline's steps (NaN/Inf would poison a median)."""
        return {k: [x for r in self._base if math.isfinite(x := float(getattr(r, k)))] for k in _RULE_PHASES}

    def _load_text(self, evidence: dict[str, Any]) -> str:
        if self.load is None:
            return ""
        try:
            avg, cpus = self.load()
        except OSError:  # no load average on this platform
            return ""
        evidence.update(load_1min=avg, cpus=cpus)
        return f" (load average {avg:.1f} on {cpus} CPUs)"

    def _judge(self, med: float, base: float, said: str, evidence: dict[str, Any]) -> tuple[str, str]:
        """The episode's severity and message: ``info`` when waiting for a CPU explains the slowdown
        and this process's own work did not grow, else ``warning`` (see the class docstring)."""
        judged = self._judge_machine(med, base, said, evidence)
        if judged is not None:
            return judged
        recent = self.recent
        wait_now = [r.wait for r in recent if math.isfinite(r.wait)]
        if len(wait_now) < len(recent) or len(self._wait) < self.min_baseline:
            if self.read == ():  # a reader was there and found nothing to read
                evidence["contention_read"] = []
                said += (
                    "; whether other processes took the CPUs is not known here (none of "
                    "/proc/self/task/*/schedstat, /proc/pressure/cpu, /proc/stat could be read)"
                )
            return "warning", said  # the wait for a CPU not measured (not Linux, CUDA)
        rise = med - base
        wait_med, wait_base = _median(wait_now), _median(list(self._wait))
        # the step without its wait for a CPU: the time the process itself took
        own = _median([r.total - r.wait for r in recent])
        own_base = _median([b - w for b, w in zip(self._totals, self._wait, strict=False)])
        evidence.update(wait_s=wait_med, wait_median_s=wait_base, own_s=own, own_median_s=own_base)
        cpu_now = [r.cpu for r in recent if math.isfinite(r.cpu)]
        cpu = ""
        if len(cpu_now) == len(recent) and len(self._cpu) >= self.min_baseline:
            cpu_med, cpu_base = _median(cpu_now), _median(list(self._cpu))
            evidence.update(cpu_s=cpu_med, cpu_median_s=cpu_base)
            cpu = f"it used {cpu_med * 1e3:.1f} ms of CPU a step ({cpu_base * 1e3:.1f} ms before)"
            work = cpu_med > self.factor * cpu_base and cpu_med - cpu_base >= self.min_s
        else:
            work = own > self.factor * own_base and own - own_base >= self.min_s
        # A contended CPU also stretches the same work's CPU time (cache and SMT sibling sharing,
        # switches, OpenMP workers spinning while the main thread waits: up to 1.8x measured on a
        # loaded 2-core VM, benchmarks/rule_margins.py), so more CPU time alone is no proof. The work
        # grew when the step's own part (wall minus wait) also carries its share of the rise: at a
        # steady share of the CPUs, work k times larger makes the own part and the wait both k times
        # larger, so the own part's share of the rise equals its share of the step before.
        work = work and own - own_base >= max(0.5 * own_base / base, 0.1) * rise
        waited = wait_med - wait_base >= 0.5 * rise
        queue = f"waited {wait_med * 1e3:.1f} ms a step for a CPU ({wait_base * 1e3:.1f} ms before)"
        if waited and not work:
            said = (
                f"steps took {med / base:.1f}x longer since about step {self.start} (median "
                f"{med * 1e3:.1f} ms, {base * 1e3:.1f} ms before) because the training thread {queue}"
                f"{'; ' + cpu if cpu else ''}: other processes are taking the machine's CPUs"
                f"{self._load_text(evidence)}, not this training's own work"
            )
            return "info", said
        if waited:
            said += f"; {cpu + ' and ' if cpu else 'it '}{queue}: the machine is busy too{self._load_text(evidence)}"
        return "warning", said

    def _spans(
        self, start: int | None = None
    ) -> tuple[tuple[int, int, MachineReading, MachineReading], ...] | None:
        """(first step, last step, reading before, reading after) of the slow steps (from ``start``,
        else the episode's) and of the steps before them, from the readings kept; None where they do
        not give both spans."""
        if start is None:
            start = self.start if self.start is not None else 0
        xs = [x for x in self._machine if x[0] > self._after]
        # a reading is taken at the end of its step: the one at step start - 1 opens the slow steps
        before = [x for x in xs if x[0] <= start - 1]
        if len(before) >= 2:
            c, d = before[0], before[-1]
            self._before_span = (c, d)
        elif self._before_span is not None and xs:
            # an episode soon after the last one: the span before that one, whose steps the baseline
            # also holds (it is not fed during an episode)
            c, d = self._before_span
        else:
            return None
        b = xs[-1]
        a = next((x for x in xs if x[0] >= start - 1), b)
        if a is b:  # one reading since the slow steps began: the span opens with the last one before
            a = before[-1] if before else d
        if b[0] <= a[0]:
            return None
        return (a[0] + 1, b[0], a[1], b[1]), (c[0] + 1, d[0], c[1], d[1])

    def _judge_machine(
        self, med: float, base: float, said: str, evidence: dict[str, Any]
    ) -> tuple[str, str] | None:
        """The verdict from the machine's readings (:class:`MachineReading`), over the slow steps
        against the steps before; None where the readings do not span both, or the threads' wait
        was not read. See the class docstring."""
        spans = self._spans()
        if spans is None:
            return None
        rates: list[tuple[float, float, float]] = []  # (threads' wait, pressure, steal) per second
        for _, _, x, y in spans:
            dw, dt = y.wall - x.wall, y.ticks - x.ticks
            if dw <= 0:
                return None
            rates.append(
                (
                    max(0.0, y.wait - x.wait) / dw,  # a thread that ended takes its count with it
                    (y.pressure - x.pressure) / dw,
                    (y.steal - x.steal) / dt if dt > 0 else math.nan,
                )
            )
        (w_now, p_now, s_now), (w_before, p_before, s_before) = rates
        if not (math.isfinite(w_now) and math.isfinite(w_before)):
            return None
        (a, b, _, _), (c, d, _, _) = spans
        # the share of a step lost to waiting for a CPU (any of this process's threads, or the
        # hypervisor's steal), capped at the whole step: the threads' waits overlap
        lost_now = min(1.0, w_now + (s_now if math.isfinite(s_now) else 0.0))
        lost_before = min(1.0, w_before + (s_before if math.isfinite(s_before) else 0.0))
        rise = med - base
        lost = lost_now * med - lost_before * base  # the added time lost to waiting, about
        own, own_base = med * (1.0 - lost_now), base * (1.0 - lost_before)
        evidence.update(
            threads_wait_share=w_now,
            threads_wait_share_before=w_before,
            cpu_pressure=p_now,
            cpu_pressure_before=p_before,
            steal_share=s_now,
            steal_share_before=s_before,
            measured_steps=[a, b],
            before_steps=[c, d],
            contention_read=[CONTENTION_SOURCES.get(k, k) for k in self.read or ()],
        )
        facts = (
            f"over steps {a}-{b} this process's threads waited for a CPU {w_now:.0%} of the time "
            f"(summed over its threads; {w_before:.0%} over steps {c}-{d})"
        )
        if math.isfinite(p_now) and math.isfinite(p_before):
            facts += f", CPU pressure {p_now:.0%} (some task waiting for a CPU; {p_before:.0%} before)"
        if math.isfinite(s_now) and math.isfinite(s_before) and max(s_now, s_before) >= 0.005:
            facts += f", steal {s_now:.0%} of the CPUs' time ({s_before:.0%} before)"
        cpu_now = [r.cpu for r in self.recent if math.isfinite(r.cpu)]
        if len(cpu_now) == len(self.recent) and len(self._cpu) >= self.min_baseline:
            cpu_med, cpu_base = _median(cpu_now), _median(list(self._cpu))
            evidence.update(cpu_s=cpu_med, cpu_median_s=cpu_base)
            facts += f"; it used {cpu_med * 1e3:.1f} ms of CPU a step ({cpu_base * 1e3:.1f} ms before)"
        # the rest of a step can shrink (fewer spins, fewer cache misses): the wait can cover more
        # than the rise. Summed over threads the wait can exceed the wall time: then capped, and the
        # rest of a step is not known (not said)
        part = (
            "all of the added time"
            if lost >= rise
            else f"about {max(0.0, lost) / rise:.0%} of the added time"
        )
        rest = (
            f" (the rest of a step: about {own_base * 1e3:.1f} -> {own * 1e3:.1f} ms)"
            if lost_now < 1.0 and lost_before < 1.0
            else ""
        )
        # Contended: the time lost to waiting grew by at least half the rise. Its own work grew: the
        # rest of the step grew factor x and carries its share of the rise (see _judge). Neither
        # the CPU time nor the training thread's own wait decides here: with torch's intra-op
        # threads a worker waiting for a CPU leaves the others spinning at the barrier, on a CPU
        contended = lost >= 0.5 * rise
        work = own > self.factor * own_base and own - own_base >= max(
            self.min_s, max(0.5 * own_base / base, 0.1) * rise
        )
        if contended and not work:
            said = (
                f"steps took {med / base:.1f}x longer since about step {self.start} (median "
                f"{med * 1e3:.1f} ms, {base * 1e3:.1f} ms before) while the machine's CPUs were "
                f"contended{self._load_text(evidence)}: {facts}; waiting for a CPU accounts for {part}"
                f"{rest}"
            )
            return "info", said
        if contended:
            return "warning", f"{said}; {facts}: the machine is busy too{self._load_text(evidence)}"
        return "warning", f"{said}; {facts}: waiting for a CPU accounts for {part}"

    def update(self, t: StepTiming) -> list[RuleEvent]:
        """Feed one step's timing; the episode's start or end event, or nothing."""
        if len(self.recent) == self.recent.maxlen and self.start is None and self._pending is None:
            old = self.recent[0]  # leaves the recent window: part of the normal from now on
            if self.baseline.push(old.total):
                self._pushed = min(self._pushed + 1, self.baseline.window)
            self._base.append(old)  # its phases, read when an episode starts
            if math.isfinite(old.cpu):
                self._cpu.append(old.cpu)
            if math.isfinite(old.wait):
                self._wait.append(old.wait)
                self._totals.append(old.total)
        self.recent.append(t)
        self._recent_totals.append(t.total)
        if t.machine is not None:
            self._machine.append((t.step, t.machine))
        if len(self.recent) < (self.recent.maxlen or 1) or self._pushed < self.min_baseline:
            return []
        totals = sorted(self._recent_totals)  # (``_median``, inlined: every step)
        n = len(totals)
        med = totals[n // 2] if n % 2 else 0.5 * (totals[n // 2 - 1] + totals[n // 2])
        base = self.baseline.median()
        # the baseline's sigma only when the median is slow by the factor (the median computed once)
        slow = med > self.factor * base and med - base >= max(
            self.min_s, self.mads * self.baseline._sigma_at(base)
        )
        if slow and self.start is None:
            turned, slow_s = self._pending or (t.step, 0.0)
            slow_s += t.total
            if slow_s < self.min_duration_s:  # sustained in time too: a burst of machine load is not
                self._pending = (turned, slow_s)
                return []
            if self.read and not self._asked and self._spans(turned - len(self.recent) // 2) is None:
                self._asked = self.wants_reading = True  # a reading at this step's successor's end
                self._pending = (turned, slow_s)
                return []
            self._pending, self._asked = None, False
            self.start = turned - len(self.recent) // 2  # the median turned: about half the window ago
            self.count += 1
            grown = {
                k: _median([getattr(r, k) for r in self.recent]) - (_median(m) if m else math.nan)
                for k, m in self._phases().items()
            }
            phase = max(grown, key=lambda k: grown[k])
            now = _median([getattr(r, phase) for r in self.recent])
            said = (
                f"steps got slower since about step {self.start}: median step time "
                f"{med * 1e3:.1f} ms over the last {len(self.recent)} steps, {med / base:.1f}x the "
                f"median {base * 1e3:.1f} ms before; {phase} grew most "
                f"({(now - grown[phase]) * 1e3:.1f} -> {now * 1e3:.1f} ms)"
            )
            evidence: dict[str, Any] = {
                "step_s": med,
                "median_s": base,
                "factor": self.factor,
                "phase": phase,
                "since": self.start,
                **{f"{k}_grown_s": v for k, v in grown.items()},
                **t.as_log(),
            }
            severity, said = self._judge(med, base, said, evidence)
            return [
                RuleEvent(kind="slowdown", step=t.step, message=said, severity=severity, evidence=evidence)
            ]
        if not slow:
            self._pending, self._asked = None, False
        if not slow and self.start is not None:
            start, self.start = self.start, None
            self._after = t.step
            return [
                RuleEvent(
                    kind="slowdown_end",
                    step=t.step,
                    message=(
                        f"step time back to {med * 1e3:.1f} ms (median {base * 1e3:.1f} ms before) after "
                        f"a slowdown of {t.step - start} steps"
                    ),
                    severity="info",
                    evidence={"since": start, "steps": t.step - start, "step_s": med, "median_s": base},
                )
            ]
        return []


class TimingInstrument:
    """Step time breakdown every step, throughput, and the "input_bound" and "slowdown" rules.

    Phases: data wait (from the end of the previous ``mon.step()``, or of the previous micro-step's
    backward, to the model's first forward), forward (the model's root forward), backward
    (``loss.backward()``), optimizer (its ``step``), other (the rest: loss, user code, the monitor).
    On CPU the marks are ``host_clock`` (``time.perf_counter``); on CUDA they are CUDA events, recorded only and read
    with ``elapsed_time`` at a later step once they have completed, so timing adds no sync (the
    breakdown of step N is logged when it is ready, usually at step N+1).

    Throughput: samples from dim 0 of the first tensor argument of each micro-step's forward; tokens
    from ``config.tokens_per_step`` or, for an integer (B, T) input, B*T.

    Rules: "input_bound" when the median share of the step spent waiting for a DataLoader batch
    (timed inside its iterator's ``__next__``; a loop without a DataLoader, such as an actor-critic's
    rollout or a distillation teacher's forward before the watched model's, is never input-bound)
    over the last ``window`` steps exceeds ``config.input_bound_fraction``; "slowdown" (:class:`SlowdownRule`) when the median step time of
    the last ``2 * patience - 1`` steps stays above ``config.slowdown_factor`` x the median of the
    steps before and above their jitter (a few slow steps, such as a gc pause, are not a slowdown;
    nor is a rise under ``min_slowdown_s``, the jitter of sub-millisecond steps); it names the phase
    that grew, and "slowdown_end" (info) says how long it lasted. Each rule fires once per episode. The first ``warmup``
    steps (lazy init, allocator warm-up) are not fed to the rules. A slowdown that waiting for a CPU
    explains is a busy machine, said as information, not a warning: ``contention`` (default a
    :class:`ContentionReader` on ``/proc``) is read at the end of steps 0, 1, 2, 4, 8, ... and every
    ``contention_every_s`` (this process's threads' wait for a CPU, CPU pressure, steal); where it
    cannot read, the training thread's wait (``wait_clock``, the kernel's run-queue delay on Linux)
    and the CPU time a step used (``cpu_clock``) decide. ``load``: the machine's load average, said.

    Attributes:
        history: the last ``window`` :class:`StepTiming`.

    Known limitations:
        - "forward" is the root module's forward; the loss computed outside it counts as "other",
          and data loaded inside the forward counts as forward.
        - On CUDA a step's breakdown is logged once its events completed (usually one step later);
          the last steps are flushed at exit with one synchronize.
    """

    name = "timing"

    def __init__(
        self,
        *,
        window: int = 20,
        warmup: int = 2,
        patience: int = 5,
        min_slowdown_s: float = 0.002,
        cpu_clock: Callable[[], float] = time.process_time,
        wait_clock: Callable[[], float] | None = None,
        load: Callable[[], tuple[float, int]] | None = machine_load,
        contention: ContentionReader | None = None,
        contention_every_s: float = 0.25,
    ) -> None:
        self.window = window
        # the machine's contention counters (this process's threads' wait for a CPU, CPU pressure,
        # steal), read at a step's end once every contention_every_s (None: a ContentionReader on
        # /proc opened at install). About 10-40 µs a reading: 0.25 s apart, under 0.02% of the time
        self.contention = contention
        self.contention_every_s = float(contention_every_s)
        self._read_machine: Callable[[float], MachineReading] | None = None
        self._own_reader: ContentionReader | None = None  # opened at install, closed at exit
        self._machine_at = -math.inf
        # this process's CPU seconds (all threads): the slowdown rule tells its own work from a busy
        # machine. One clock_gettime(CLOCK_PROCESS_CPUTIME_ID) per step, about 1 µs.
        self.cpu_clock = cpu_clock
        # the training thread's wait for a CPU (None: a RunQueueClock opened at install, on that thread)
        self.wait_clock = wait_clock
        self._run_queue: RunQueueClock | None = None
        self.load = load
        self._cpu_start = math.nan
        self._wait_start = math.nan
        self._loader_s = 0.0  # DataLoader time and batches since the step began (see _watch_loaders)
        self._loader_calls = 0
        self._loaders_watched = False
        self.min_slowdown_s = min_slowdown_s
        self.warmup = warmup
        self.history: deque[StepTiming] = deque(maxlen=window)
        self._data_share = RunningMedian(window)
        self._patience = patience
        self._slowdown = SlowdownRule(recent=2 * patience - 1, min_s=min_slowdown_s, load=load)
        self._input_bound_on = False
        self._pending: deque[_StepMarks] = deque()
        self._cur = _StepMarks()
        self._clock = _Clock(False)
        self._open: dict[str, Any] = {}
        self._last_mark: Any = None
        self._tokens_per_step: int | None = None
        self._uncommitted: tuple[int | None, int | None] = (None, None)
        # the instruments' ``costly_step`` methods, found again when the instrument list changes
        self._costly_of: list[Any] = []
        self._costly: list[Callable[[int], bool]] = []

    # ---- protocol
    def install(self, mon: SessionView) -> None:
        cuda = any(p.is_cuda for p in mon.model.parameters()) and torch.cuda.is_available()
        self._clock = _Clock(cuda)
        reader = None
        if self._own_reader is not None:  # installed again (a level change)
            self._own_reader.close()
            self._own_reader = None
        if not cuda:  # on CUDA the step's time is the device's: the host's contention says little
            reader = self.contention
            if reader is None:
                reader = self._own_reader = ContentionReader()
        self._read_machine = reader.read if reader is not None and reader.sources else None
        self._machine_at = -math.inf
        self._slowdown = SlowdownRule(
            factor=mon.config.slowdown_factor,
            recent=2 * self._patience - 1,
            min_s=self.min_slowdown_s,
            load=self.load,
            read=reader.sources if reader is not None else None,
        )
        tps = getattr(mon.config, "tokens_per_step", None)
        self._tokens_per_step = int(tps) if tps else None
        self._watch_loaders(mon)
        if self.wait_clock is None and not cuda:
            self._run_queue = RunQueueClock()
            self.wait_clock = self._run_queue.read
        self._begin(mon.global_step)

    def _watch_loaders(self, mon: SessionView) -> None:
        """Time every DataLoader batch (``_BaseDataLoaderIter.__next__``, the one method every
        DataLoader iterator shares; restored when the session ends): the input_bound rule then says
        "waiting for data" only about a DataLoader, not about an actor-critic's rollout or a
        distillation teacher's forward that runs before the watched model's. Cost: two perf_counter
        reads per batch."""
        installs = getattr(mon, "installs", None)
        if installs is None or self._loaders_watched:  # installed again (a level change): once
            return
        self._loaders_watched = True
        from torch.utils.data.dataloader import _BaseDataLoaderIter

        original = _BaseDataLoaderIter.__next__
        clock = host_clock
        me = self

        def __next__(it: Any) -> Any:
            t0 = clock()
            try:
                return original(it)
            finally:
                me._loader_s += clock() - t0
                me._loader_calls += 1

        installs.patch(_BaseDataLoaderIter, "__next__", __next__)

    def _begin(self, step: int) -> None:
        m = self._clock.mark()
        self._cur = _StepMarks(m, step, self._clock.cuda)
        self._last_mark = m
        if not self._clock.cuda:  # on CUDA the host's CPU time says little about the step's work
            self._cpu_start = self.cpu_clock()
            if self.wait_clock is not None:
                self._wait_start = self.wait_clock()

    def on_forward_start(self, mon: SessionView, module: nn.Module, args: Any, kwargs: Any) -> None:
        m = self._clock.mark()
        if self._uncommitted == (None, None):
            cur = self._cur
            if cur.spans is None:
                cur.data += m - self._last_mark
            else:
                cur.spans["data"].append((self._last_mark, m))
        # else: the previous forward of this micro-step never reached backward (it failed and is
        # being retried): the time since is wasted work ("other"), not data wait
        self._open["forward"] = m
        # counted when the micro-step reaches its backward (or the step ends without one): an
        # attempt that failed in forward (an OOM before a retry) is not throughput
        self._uncommitted = batch_size_and_tokens(args, kwargs)

    def on_forward_end(self, mon: SessionView, module: nn.Module, output: Any) -> None:
        start = self._open.pop("forward", None)
        if start is not None:
            cur, m = self._cur, self._clock.mark()
            if cur.spans is None:
                cur.forward += m - start
            else:
                cur.spans["forward"].append((start, m))

    def on_backward_start(self, mon: SessionView, loss: Any) -> None:
        self._open["backward"] = self._clock.mark()

    def _commit(self) -> None:
        b, tok = self._uncommitted
        if b is not None:
            self._cur.samples += b
        if tok is not None:
            self._cur.tokens += tok
        self._uncommitted = (None, None)

    def on_backward_end(self, mon: SessionView) -> None:
        cur = self._cur
        b, tok = self._uncommitted  # (``_commit``, inlined: every backward)
        if b is not None:
            cur.samples += b
        if tok is not None:
            cur.tokens += tok
        self._uncommitted = (None, None)
        start = self._open.pop("backward", None)
        if start is not None:
            m = self._clock.mark()
            cur.backs += 1
            if cur.spans is None:
                cur.backward += m - start
            else:
                cur.spans["backward"].append((start, m))
            self._last_mark = m  # the next micro-step's data wait starts here

    def before_optimizer_step(self, mon: SessionView) -> None:
        self._open["optimizer"] = self._clock.mark()

    def after_optimizer_step(self, mon: SessionView) -> None:
        start = self._open.pop("optimizer", None)
        if start is not None:
            cur, m = self._cur, self._clock.mark()
            if cur.spans is None:
                cur.optimizer += m - start
            else:
                cur.spans["optimizer"].append((start, m))

    def on_step_end(self, mon: SessionView, record: Any, values: Mapping[str, float]) -> None:
        cur = self._cur
        if not cur.backs:
            self._commit()  # a step without backward (evaluation under watch): its forward counts
        self._uncommitted = (None, None)
        end = cur.end = self._clock.mark()
        cuda = self._clock.cuda
        if not cuda:
            # each clock read once: this step's end is the next one's start
            cpu = self.cpu_clock()
            cur.cpu, self._cpu_start = cpu - self._cpu_start, cpu
            if self.wait_clock is not None:
                wait = self.wait_clock()
                cur.wait, self._wait_start = wait - self._wait_start, wait
        cur.loader, cur.loader_calls = self._loader_s, self._loader_calls
        self._loader_s, self._loader_calls = 0.0, 0
        cur.step = int(getattr(record, "step", cur.step))
        if self._tokens_per_step:
            cur.tokens = self._tokens_per_step
        self._open.clear()
        if not cuda:
            read = self._read_machine
            # on a schedule: every contention_every_s, and at steps 0, 1, 2, 4, 8, ... so that a short
            # run of fast steps has readings before its slow ones too (one pread per thread, two more)
            if read is not None and (
                end - self._machine_at >= self.contention_every_s
                or not cur.step & (cur.step - 1)
                or self._slowdown.wants_reading  # the rule's slow steps carry no reading yet
            ):
                self._machine_at, self._slowdown.wants_reading = end, False
                cur.machine = read(end)
        # the next step starts at this one's end mark (``_begin``'s work, without reading the clocks again)
        self._cur = _StepMarks(end, cur.step + 1, cuda)
        self._last_mark = end
        if cuda:  # CUDA events: read once they completed, usually a step later
            self._pending.append(cur)
            self._drain(mon)
        else:
            self._finish(mon, cur)

    def on_exit(self, mon: SessionView) -> None:
        if self._clock.cuda and self._pending:
            self._pending[-1].end.synchronize()  # once, at exit: log the last steps too
        self._drain(mon)
        if self._run_queue is not None:
            self._run_queue.close()
            self.wait_clock = None
        if self._own_reader is not None:
            self._own_reader.close()
            self._own_reader = None
        self._read_machine = None

    # ---- reading the marks
    def _drain(self, mon: SessionView) -> None:
        pending, clock = self._pending, self._clock
        while pending and (not clock.cuda or clock.ready(pending[0].end)):
            self._finish(mon, pending.popleft())

    def _finish(self, mon: SessionView, m: _StepMarks) -> None:
        spans = m.spans
        if spans is not None:  # CUDA events
            el = self._clock.elapsed
            data = sum([el(a, b) for a, b in spans["data"]])
            forward = sum([el(a, b) for a, b in spans["forward"]])
            backward = sum([el(a, b) for a, b in spans["backward"]])
            optimizer = sum([el(a, b) for a, b in spans["optimizer"]])
            total = el(m.start, m.end)
        else:  # host_clock marks: summed as they were marked
            data, forward, backward, optimizer = m.data, m.forward, m.backward, m.optimizer
            total = m.end - m.start
        other = max(0.0, total - sum((data, forward, backward, optimizer)))
        t = StepTiming(
            step=m.step,
            data=data,
            forward=forward,
            backward=backward,
            optimizer=optimizer,
            other=other,
            total=total,
            samples=m.samples,
            tokens=m.tokens,
            cpu=m.cpu,
            wait=m.wait,
            loader=m.loader,
            loader_calls=m.loader_calls,
            machine=m.machine,
        )
        self.history.append(t)
        writer = mon.writer
        if writer is not None:
            # (``t.as_log()``, inlined: every step)
            writer.log_timing(
                t.step,
                {
                    "data": data,
                    "forward": forward,
                    "backward": backward,
                    "optimizer": optimizer,
                    "other": other,
                    "step": total,
                },
            )
            thr = {}
            if total > 0:  # (``samples_per_s`` and ``tokens_per_s``, inlined: every step)
                if t.samples:
                    thr["throughput/samples_per_s"] = t.samples / total
                if t.tokens:
                    thr["throughput/tokens_per_s"] = t.tokens / total
            if thr:
                writer.log_scalars(t.step, thr)
        self._rules(mon, t)

    def _rules(self, mon: SessionView, t: StepTiming) -> None:
        if t.step < self.warmup or t.total <= 0:
            return
        cfg = mon.config
        # waiting for data: the DataLoader's own time (at most the data span); a step that took no
        # DataLoader batch spent its time before the forward on the user's own work (a rollout)
        share = min(t.loader, t.data) / t.total if t.loader_calls else 0.0
        self._data_share.push(share)
        frac = float(getattr(cfg, "input_bound_fraction", 0.3))
        med_share = self._data_share.median()
        if self._data_share.n >= min(5, self.window):
            if med_share > frac and not self._input_bound_on:
                self._input_bound_on = True
                mon.emit(
                    RuleEvent(
                        kind="input_bound",
                        step=t.step,
                        message=(
                            f"waiting for the DataLoader takes {med_share:.0%} of each step (median of the "
                            f"last {len(self._data_share)} steps, threshold {frac:.0%}): the GPU/CPU idles "
                            "while batches load; use more DataLoader workers, pin_memory, prefetching or "
                            "faster decoding"
                        ),
                        evidence={
                            "data_share_median": med_share,
                            "threshold": frac,
                            "data_s": t.data,
                            "step_s": t.total,
                        },
                    )
                )
            elif med_share <= frac:
                self._input_bound_on = False
        if self._costly_of != mon.instruments:  # (a C-level comparison by identity)
            self._costly_of = list(mon.instruments)
            self._costly = [f for i in mon.instruments if (f := getattr(i, "costly_step", None)) is not None]
        for costly in self._costly:
            if costly(t.step):
                return  # the debugger's own expensive step (a leak census): not the user's slowdown
        for event in self._slowdown.update(t):
            mon.emit(event)


# --------------------------------------------------------------------------------------------------
# per-module time


@dataclass(frozen=True)
class ModuleTimeRow:
    """Inclusive forward and backward time of one module (children included), median over measured steps."""

    module: str
    module_type: str
    forward_s: float
    backward_s: float | None
    calls: int

    @property
    def total_s(self) -> float:
        return self.forward_s + (self.backward_s or 0.0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "module": self.module,
            "module_type": self.module_type,
            "forward_s": self.forward_s,
            "backward_s": self.backward_s,
            "calls": self.calls,
            "total_s": self.total_s,
        }


@dataclass(frozen=True)
class ModuleTimeTable:
    """Per-module time, ranked by forward + backward; ``str()`` renders it, ``to_dict()`` is JSON-ready."""

    rows: tuple[ModuleTimeRow, ...]
    steps: tuple[int, ...]

    def row(self, module: str) -> ModuleTimeRow:
        for r in self.rows:
            if r.module == module:
                return r
        raise KeyError(module)

    def __str__(self) -> str:
        head = f"{'module':<36} {'forward ms':>11} {'backward ms':>12} {'calls':>6}"
        lines = [
            f"per-module time (median of steps {list(self.steps)}; inclusive of children)",
            head,
            "-" * len(head),
        ]
        for r in self.rows:
            bwd = "-" if r.backward_s is None else f"{r.backward_s * 1e3:.3f}"
            lines.append(
                f"{module_label(r.module, r.module_type)[:36]:<36} {r.forward_s * 1e3:>11.3f} {bwd:>12} {r.calls:>6}"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"steps": list(self.steps), "rows": [r.to_dict() for r in self.rows]}


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


class ModuleTimer:
    """Forward and backward time per module of ``model`` while active (hooks; usable without watch).

    Forward: pre/post hooks around each module call (inclusive of children). Backward: from the
    moment the gradient of the module's output is ready (its backward begins) to the moment the
    gradients of its inputs and parameters are all computed (``register_multi_grad_hook``). On
    CUDA the marks are CUDA events, read (with one synchronize) by :meth:`collect`.

    Cost: two hooks per module call and two multi-grad hooks per module per forward: opt-in, a few steps.

    Known limitation: the backward of a ``torch.autograd.grad()`` call (a gradient penalty) is not
    timed, only that of ``backward()``: torch cannot tell which leaf gradients such a call computes.

    Example:
        >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        >>> with ModuleTimer(m) as tm:
        ...     m(torch.ones(2, 4, requires_grad=True)).sum().backward()
        >>> times = tm.collect()
        >>> sorted(times) == ["", "0", "1"] and times["0"][0] > 0
        True
    """

    def __init__(self, model: nn.Module, cuda: bool | None = None, installs: Installs | None = None) -> None:
        self.model = model
        self.installs = installs if installs is not None else Installs()
        self.names = {id(m): n for n, m in model.named_modules()}
        self.types = {n: type(m).__name__ for n, m in model.named_modules()}
        use_cuda = cuda if cuda is not None else any(p.is_cuda for p in model.parameters())
        self._clock = _Clock(bool(use_cuda) and torch.cuda.is_available())
        self._handles: list[Any] = []
        self._grad_handles: list[Any] = []
        self._fwd_open: dict[int, list[Any]] = {}
        self._fwd: dict[str, list[tuple[Any, Any]]] = {}
        self._bwd_start: dict[tuple[str, int], Any] = {}
        self._bwd: dict[str, list[tuple[Any, Any]]] = {}
        self.active = False

    def _pre(self, module: nn.Module, args: Any) -> None:
        self._fwd_open.setdefault(id(module), []).append(self._clock.mark())

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        stack = self._fwd_open.get(id(module))
        if not stack:
            return
        start = stack.pop()
        name = self.names.get(id(module), "")
        self._fwd.setdefault(name, []).append((start, self._clock.mark()))
        if not torch.is_grad_enabled():
            return
        outs = [t for t in tensor_leaves(output) if t.requires_grad]
        if not outs:
            return
        ends = [t for t in tensor_leaves(args) if t.requires_grad]
        ends += [p for p in module.parameters() if p.requires_grad]
        clock = self._clock

        # keyed by graph task: a torch.autograd.grad() call (not timed) leaves no start behind for backward
        def begin(grads: Any, name: str = name) -> None:
            self._bwd_start.setdefault((name, torch._C._current_graph_task_id()), clock.mark())

        def finish(name: str = name) -> None:
            st = self._bwd_start.pop((name, torch._C._current_graph_task_id()), None)
            if st is not None:
                self._bwd.setdefault(name, []).append((st, clock.mark()))

        reg = torch.autograd.graph.register_multi_grad_hook
        self._grad_handles.append(reg(outs, begin, mode="any"))
        if ends:
            self._grad_handles.append(when_all_grads(ends, finish))  # autograd.grad(): not timed

    def start(self) -> None:
        """Install the hooks (idempotent)."""
        if self.active:
            return
        add = self.installs.hook
        for m in self.model.modules():
            self._handles.append(add(m.register_forward_pre_hook(self._pre)))
            self._handles.append(add(m.register_forward_hook(self._post, always_call=True)))
        self.active = True

    def stop(self) -> None:
        """Remove every hook, including gradient hooks still pending (idempotent)."""
        for h in self._handles:
            self.installs.remove(h)
        for h in self._grad_handles:
            h.remove()
        self._handles.clear()
        self._grad_handles.clear()
        self._fwd_open.clear()
        self._bwd_start.clear()
        self.active = False

    def clear_grad_hooks(self) -> None:
        """Remove the gradient hooks of past forwards (after their backward ran)."""
        for h in self._grad_handles:
            h.remove()
        self._grad_handles.clear()
        self._bwd_start.clear()

    def collect(self) -> dict[str, tuple[float, float | None, int]]:
        """Read and reset: ``{module: (forward_s, backward_s or None, calls)}`` summed over calls."""
        if self._clock.cuda:
            torch.cuda.synchronize()  # opt-in mode: one sync per measured step to read its events
        el = self._clock.elapsed
        out: dict[str, tuple[float, float | None, int]] = {}
        for name, spans in self._fwd.items():
            b = self._bwd.get(name)
            out[name] = (
                sum(el(a, c) for a, c in spans),
                sum(el(a, c) for a, c in b) if b else None,
                len(spans),
            )
        self._fwd.clear()
        self._bwd.clear()
        return out

    def __enter__(self) -> ModuleTimer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ModuleTimeInstrument:
    """Per-module forward/backward time on steps 1..``steps`` (step 0 is warm-up), as a ranked table.

    The table (median per module over the measured steps) is kept in ``table`` and logged as a
    "module_time" event. Cost: see :class:`ModuleTimer`; nothing after the measured steps.
    """

    name = "module_time"

    def __init__(self, steps: int = 3, skip: int = 1) -> None:
        self.steps = steps
        self.skip = skip
        self.table: ModuleTimeTable | None = None
        self._timer: ModuleTimer | None = None
        self._samples: list[dict[str, tuple[float, float | None, int]]] = []
        self._measured: list[int] = []

    def install(self, mon: SessionView) -> None:
        self._timer = ModuleTimer(mon.model, installs=getattr(mon, "installs", None))

    def remove(self, mon: SessionView) -> None:
        if self._timer is not None:
            self._timer.stop()

    def on_forward_start(self, mon: SessionView, module: nn.Module, args: Any, kwargs: Any) -> None:
        step = mon.global_step
        t = self._timer
        if t is None or t.active or not (self.skip <= step < self.skip + self.steps):
            return
        if getattr(mon, "compiled", False):
            self._timer = None  # stands down for the session, said once
            mon.emit(
                not_under_compile(
                    "module_time_not_measured", step, "per-module time", "use td.profile on the eager model"
                )
            )
            return
        t.start()
        # the root's pre-hook was registered during its own call, too late to fire for it
        t._pre(module, args)

    def on_backward_end(self, mon: SessionView) -> None:
        if self._timer is not None and self._timer.active:
            self._timer.clear_grad_hooks()

    def on_step_end(self, mon: SessionView, record: Any, values: Mapping[str, float]) -> None:
        t = self._timer
        if t is None or not t.active:
            return
        t.stop()
        self._samples.append(t.collect())
        self._measured.append(int(getattr(record, "step", mon.global_step)))
        if len(self._samples) < self.steps:
            return
        names = sorted({n for s in self._samples for n in s})
        rows = []
        for n in names:
            got = [s[n] for s in self._samples if n in s]
            bwd = [g[1] for g in got if g[1] is not None]
            rows.append(
                ModuleTimeRow(
                    module=n,
                    module_type=t.types.get(n, ""),
                    forward_s=_median([g[0] for g in got]),
                    backward_s=_median(bwd) if bwd else None,
                    calls=max(g[2] for g in got),
                )
            )
        rows.sort(key=lambda r: (-r.total_s, r.module))
        self.table = ModuleTimeTable(rows=tuple(rows), steps=tuple(self._measured))
        if mon.writer is not None:
            top = [r for r in rows if r.module][:1]
            msg = "per-module time measured" + (
                f"; slowest module {module_label(top[0].module, top[0].module_type)} {top[0].total_s * 1e3:.2f} ms"
                if top
                else ""
            )
            mon.writer.log_event(int(record.step), "module_time", "info", msg, self.table.to_dict())

    def on_exception(self, mon: SessionView, exc: BaseException) -> None:
        if self._timer is not None:
            self._timer.stop()


__all__ = [
    "PHASES",
    "ModuleTimeInstrument",
    "ModuleTimeRow",
    "ModuleTimeTable",
    "ModuleTimer",
    "SlowdownRule",
    "StepTiming",
    "TimingInstrument",
    "batch_size_and_tokens",
]

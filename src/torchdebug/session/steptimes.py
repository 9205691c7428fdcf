"""Each rank's step times for the straggler rule (health.stragglers): the data wait, the forwards, each
backward up to the first parameter's gradient, the rest of the backward (under DDP: waiting for the
other ranks), the previous step, the training thread's time on and waiting for a CPU. The distributed
coordinator holds one and carries its numbers in the step's all-reduce.

Under DDP the forwards and backwards are host wall times. Under FSDP2 every layer's all-gather and
reduce-scatter make the fast ranks wait inside their own forward and backward, so their wall times
equal the slow rank's; there the forwards and backwards are the training thread's *runnable* time
(on a CPU or waiting for one, ``/proc/thread-self/schedstat``): a rank blocked in a collective is not
runnable, the rank that keeps the others waiting is, so the straggler's phase stands out. The rest
(the time blocked) is the ``wait``."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from ..events import RuleEvent
from ..health.stragglers import RankTimes, StragglerRule
from ..perf.timing import RunQueueClock

# the order of :meth:`StepClock.times` and of the rows the coordinator gives them
FIELDS = ("forward", "data", "backward", "wait", "step", "cpu", "cpu_wait")


class _GpuMarks:
    """The forwards' and backwards' compute on the GPU: CUDA events recorded on the current stream in
    the clock's hooks (``cudaEventRecord``, a few us of host time each, no sync). A step's events are
    read with the next step's times, in the vector of its transfer: the step's one host read already
    waited for the stream past them, so ``query()`` (no sync) finds them done and ``elapsed_time``
    does not block. Spans still running (a step that read nothing) leave that step on host times."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, Any]] = []  # this step's ("f"orward | "b"ackward | "g"rad, event)
        self._last: list[tuple[str, Any]] = []  # the previous step's, read with this step

    def mark(self, kind: str) -> None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        self.marks.append((kind, ev))

    def read(self) -> tuple[float, float] | None:
        """The previous step's (forward, backward) GPU seconds, or None when it has no complete spans."""
        last = self._last
        if not last or not all(ev.query() for _, ev in last):  # query: no sync
            return None
        fwd = bwd = 0.0
        ends = 0
        for (k, a), (k2, b) in itertools.pairwise(last):  # a pair per micro-step phase, not per module
            if k == "f" and k2 == "b":
                fwd += a.elapsed_time(b) / 1e3  # ms -> s
            elif k == "b" and k2 == "g":
                bwd += a.elapsed_time(b) / 1e3
                ends += 1
        if ends < sum(k == "b" for k, _ in last):
            return None  # a backward without its gradient mark (no hook): host times for that step
        return fwd, bwd

    def step_end(self) -> None:
        self._last, self.marks = self.marks, []


class StepClock:
    """The times of the step now running. ``first`` is the session's first trainable parameter: a
    post-accumulate-grad hook on it (one Python call per backward) marks the end of this rank's own
    backward compute, since in a chain of layers its gradient comes last. On a GPU the same marks
    record CUDA events too (:class:`_GpuMarks`): the forwards and backwards are then the GPU's, read a
    step late (``timed_by="cuda"``). ``on=False`` (one rank): no hook, no schedstat reads.

    ``root``: FSDP2's root module. Then the forwards and backwards are the thread's runnable time, and
    the step's first forward begins at a forward pre-hook put before FSDP2's own (one Python call per
    forward), so that a fast rank's wait in the root's all-gather counts as waiting in its forward, not
    as its data time; no gradient hook."""

    def __init__(self, first: Any, on: bool, root: Any = None) -> None:
        self.step_start = time.perf_counter()
        self.timed_by = "runnable" if on and root is not None else "wall"
        # a model on a GPU, outside FSDP2: compute from CUDA events (under FSDP2 the compute stream
        # waits for every all-gather too, so its events are as equal across ranks as wall times)
        self._gpu: _GpuMarks | None = None
        if self.timed_by == "wall" and on and getattr(first, "is_cuda", False) and torch.cuda.is_available():
            self._gpu, self.timed_by = _GpuMarks(), "cuda"
        self._r_micro = math.nan  # runnable seconds when the current micro-step's phase began
        self.t_forward: float | None = None  # the step's first forward began
        self._fwd = self._bwd = self._wait = 0.0
        self._t_micro: float | None = None  # the current micro-step's forward (then backward) began
        self._t_grad: float | None = None  # the first parameter's gradient was accumulated
        self._prev = 0.0
        # the training thread's run-queue delay (opened here, on that thread): one pread a step, ~3 us
        self._runq = RunQueueClock() if on else None
        self._runq_start = self._runq.read_both() if self._runq is not None else (math.nan, math.nan)
        self._hook: Any = None
        if self.timed_by == "runnable":
            # prepend: before FSDP2's pre-forward, whose all-gather is where a fast rank waits first
            self._hook = root.register_forward_pre_hook(self._on_root, prepend=True)
        elif on and first is not None and hasattr(first, "register_post_accumulate_grad_hook"):
            try:
                self._hook = first.register_post_accumulate_grad_hook(self._on_grad)
            except RuntimeError:
                self._hook = None  # e.g. a parameter whose gradient a wrapper assigns: no backward split

    def forward_start(self) -> None:
        """A micro-step's first forward began."""
        if self.timed_by == "runnable" and self._t_micro is not None:
            return  # marked already, by the pre-hook before FSDP2's
        now = time.perf_counter()
        if self.t_forward is None:
            self.t_forward = now
        self._t_micro = now
        if self.timed_by == "runnable":
            self._r_micro = self._runnable()
        elif self._gpu is not None:
            self._gpu.mark("f")

    def _on_root(self, _module: Any, _args: Any) -> None:
        if self._t_micro is None and torch.is_grad_enabled():  # no-grad forwards are no micro-step
            self.forward_start()

    def _runnable(self) -> float:
        """The thread's seconds on a CPU or waiting for one so far: one schedstat pread (~3 us);
        ``time.thread_time()`` (on a CPU only) where there is no schedstat."""
        run, wait = self._runq.read_both() if self._runq is not None else (math.nan, math.nan)
        return run + wait if math.isfinite(run + wait) else time.thread_time()

    def _own(self, now: float, began: float) -> float:
        """Runnable mode: the phase that began at ``began`` ended ``now``: its runnable seconds (the
        rank's own), and the rest is added to the wait."""
        r = self._runnable()
        own = r - self._r_micro
        self._wait += max(now - began - own, 0.0)
        self._r_micro = r
        return own

    def backward_start(self, after_forward: bool) -> None:
        now = time.perf_counter()
        if self._t_micro is not None and after_forward:
            if self.timed_by == "runnable":
                self._fwd += self._own(now, self._t_micro)
            else:
                self._fwd += now - self._t_micro
        elif self.timed_by == "runnable":
            self._r_micro = self._runnable()
        if self._gpu is not None:
            self._gpu.mark("b")
        self._t_micro, self._t_grad = now, None

    def _on_grad(self, _param: Any) -> None:
        self._t_grad = time.perf_counter()
        if self._gpu is not None:
            self._gpu.mark("g")  # on the stream the backward ran on: the autograd engine set it current

    def backward_end(self, in_backward: bool) -> None:
        if self._t_micro is None or not in_backward:
            return
        now = time.perf_counter()
        if self.timed_by == "runnable":
            self._bwd += self._own(now, self._t_micro)
            self._t_micro = None
            return
        grad = self._t_grad if self._t_grad is not None and self._t_grad >= self._t_micro else now
        self._bwd += grad - self._t_micro
        self._wait += now - grad
        self._t_micro = None

    def times(self, now: float) -> tuple[float, ...]:
        """This step's times so far (seconds), in the order of :data:`FIELDS`; the CPU times are -1
        where unknown (no schedstat): never NaN, which would read as a non-finite flag in a SUM."""
        t_fwd = self.t_forward if self.t_forward is not None else now
        cpu, q = -1.0, -1.0
        if self._runq is not None:
            run, wait = self._runq.read_both()
            run, wait = run - self._runq_start[0], wait - self._runq_start[1]
            if math.isfinite(run) and math.isfinite(wait):
                cpu, q = run, wait
        fwd, bwd = self._fwd, self._bwd
        gpu = self._gpu.read() if self._gpu is not None else None
        if gpu is not None:  # the previous step's compute, a step late, as ``step`` is
            fwd, bwd = gpu
        return (fwd, max(t_fwd - self.step_start, 0.0), bwd, self._wait, self._prev, cpu, q)

    def step_end(self, now: float) -> float:
        """The step ended: its wall time; the clock starts the next."""
        took = now - self.step_start
        self._prev, self.step_start = took, now
        if self._runq is not None:
            self._runq_start = self._runq.read_both()
        self.t_forward = self._t_micro = self._t_grad = None
        self._fwd = self._bwd = self._wait = 0.0
        if self._gpu is not None:
            self._gpu.step_end()
        return took

    def remove(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._runq is not None:
            self._runq.close()


def straggler_event(
    rule: StragglerRule, row: Callable[[str], list[float]], step: int, timed_by: str = "wall"
) -> RuleEvent | None:
    """Feed ``rule`` every rank's times (``row(field)``: one per rank, from the all-reduced vector);
    a ``straggler`` event when an episode starts. A busy host is information: the rank's own work is
    not the cause. ``timed_by``: :attr:`StepClock.timed_by`, what the forwards and backwards measure
    (``"wall"`` host time, ``"runnable"`` the thread's time on or waiting for a CPU, ``"cuda"`` CUDA
    events, the previous step's), in the evidence."""
    found = rule.update(RankTimes(**{f: row(f) for f in FIELDS}))
    if found is None:
        return None
    severity = "info" if found.kind == "contended" else "warning"
    evidence = {**found.evidence(), "timed_by": timed_by}
    return RuleEvent("straggler", step, found.message(), severity, evidence=evidence)

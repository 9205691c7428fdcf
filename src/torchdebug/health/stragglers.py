"""Which rank is slow, in which phase, and what it costs the job: the straggler rule's pure logic.

The distributed coordinator feeds it, once per step, every rank's times from the step's all-reduced
vector (the same numbers on every rank, so every rank takes the same decision). Per rank and step:

- ``data``: from the end of the previous step until the first forward began (waiting for a batch,
  host work between steps);
- ``forward``: the forwards and losses of the step's micro-steps;
- ``backward``: from each backward's start until the gradient of the session's first parameter was
  accumulated (under DDP: this rank's own backward compute, before it waits for the others in the
  gradient all-reduce);
- ``wait``: the rest of each backward (under DDP: waiting in the gradient all-reduce);
- ``step``: the previous step's wall time on that rank;
- ``cpu``, ``cpu_wait``: the rank's training thread's time on a CPU over the step, and the time it was
  ready to run but waited for one (Linux schedstat; negative where unknown).

A rank whose work (data + forward + backward) has a median over the last ``window`` steps at least
``factor`` times the median of the other ranks' medians, for ``patience`` steps in a row, and whose
gap is at least 10% of the step's median wall time (a gap that costs the job little is not worth a
warning), starts an episode: one :class:`Straggler` finding, the phase where its excess lies (forward or backward: a
compute straggler; data: a data/host straggler) and what the step would cost if it matched the
others. When the slow rank used no more CPU than the others (less than ``factor`` times their median)
and its extra wait for a CPU accounts for at least half of its gap, the finding is
``kind="contended"``: other processes on its host took the CPU, its own work is not larger (the
caller reports that as information, not a warning). A rank that does more work keeps its phase's
kind, also on a loaded host. ``patience`` steps below the factor end the episode.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PHASES = ("data", "forward", "backward")
_MIN_SAVING = 0.1  # a gap counts when matching the others would save at least this share of a step
_PHASE_WORDS = {
    "data": "waiting for data (host work before the forward)",
    "forward": "forward",
    "backward": "backward",
}


@dataclass(frozen=True)
class RankTimes:
    """One step's times, one entry per rank (seconds)."""

    data: Sequence[float]
    forward: Sequence[float]
    backward: Sequence[float]
    wait: Sequence[float]
    step: Sequence[float]
    cpu: Sequence[float] = ()
    cpu_wait: Sequence[float] = ()

    def work(self, r: int) -> float:
        return self.data[r] + self.forward[r] + self.backward[r]


@dataclass(frozen=True)
class Straggler:
    """The finding: ``rank`` is slow by ``ratio`` (its median work over the others' median), its
    excess lies in ``phase`` (``kind``: ``"compute"`` for forward/backward, ``"data"`` for data), and
    the step's median wall time ``step_s`` would be ``step_if_matched_s`` if it matched the others.
    ``kind`` ``"contended"``: the rank waited ``cpu_wait_s`` a step for a CPU more than the others."""

    rank: int
    ratio: float
    kind: str
    phase: str
    work_s: float
    others_s: float
    excess_s: float  # in ``phase``: this rank's median minus the other ranks' median
    step_s: float
    step_if_matched_s: float
    window: int
    by_rank: dict[str, list[float]] = field(default_factory=dict)  # phase -> median per rank
    cpu_wait_s: float = 0.0  # the rank's median wait for a CPU above the others' (kind "contended")

    @property
    def speedup(self) -> float:
        return self.step_s / self.step_if_matched_s if self.step_if_matched_s > 0 else math.inf

    def message(self) -> str:
        ratio = f"{self.ratio:.1f}x" if math.isfinite(self.ratio) else "far more than"
        kind = {
            "compute": "a compute straggler",
            "data": "a data/host straggler",
            "contended": "its host is busy with other processes",
        }[self.kind]
        s = (
            f"rank {self.rank} is the straggler: its step work takes {ratio} the other ranks' median "
            f"({self.work_s * 1e3:.1f} ms vs {self.others_s * 1e3:.1f} ms over the last {self.window} steps); "
            f"{kind}, {self.excess_s * 1e3:.1f} ms slower in {_PHASE_WORDS[self.phase]}"
        )
        if self.kind == "contended":
            s += f" (its training thread waited {self.cpu_wait_s * 1e3:.1f} ms a step for a CPU)"
        if self.step_s > 0 and self.step_if_matched_s > 0:
            s += (
                f"; if it matched the other ranks a step would take about {self.step_if_matched_s * 1e3:.0f} ms "
                f"instead of {self.step_s * 1e3:.0f} ms ({self.speedup:.1f}x faster)"
            )
        return s

    def evidence(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "ratio": self.ratio,
            "kind": self.kind,
            "phase": self.phase,
            "busy_s": self.work_s,
            "others_busy_s": self.others_s,
            "busy_s_by_rank": self.by_rank.get("work", []),
            "excess_s": self.excess_s,
            "step_s": self.step_s,
            "step_if_matched_s": self.step_if_matched_s,
            "speedup": self.speedup,
            "median_s_by_rank": {k: v for k, v in self.by_rank.items() if k != "work"},
            "cpu_wait_s": self.cpu_wait_s,
            "window": self.window,
        }


class StragglerRule:
    """Feed it :meth:`update` once per step with every rank's :class:`RankTimes`; it returns a
    :class:`Straggler` when an episode starts, else None. Pure host arithmetic over ``window`` steps."""

    def __init__(
        self, world: int, factor: float = 1.5, window: int = 20, min_steps: int = 5, patience: int = 5
    ):
        self.world, self.factor = world, float(factor)
        self.min_steps, self.patience = min_steps, patience
        self._steps: deque[RankTimes] = deque(maxlen=window)
        self._above = 0
        self._below = 0
        self.straggling: int | None = None  # the rank of the episode in progress

    def update(self, times: RankTimes) -> Straggler | None:
        self._steps.append(times)
        if self.world < 2 or len(self._steps) < self.min_steps:
            return None
        steps = list(self._steps)
        work = [statistics.median(t.work(r) for t in steps) for r in range(self.world)]
        slow = max(range(self.world), key=lambda r: (work[r], -r))
        others = statistics.median(work[r] for r in range(self.world) if r != slow)
        ratio = work[slow] / others if others > 0 else math.inf
        step_s = statistics.median(max(t.step) for t in steps)
        saved = max(work[slow] - others, 0.0)  # what a step would save if it matched the others
        if ratio >= self.factor and saved >= _MIN_SAVING * step_s:
            self._above, self._below = self._above + 1, 0
        else:
            self._above, self._below = 0, self._below + 1
        if self.straggling is not None:
            if self._below >= self.patience:
                self.straggling = None  # episode over: the next one is a new finding
            return None
        if self._above < self.patience:
            return None
        self.straggling = slow
        by_rank = {"work": work}
        excess = {}
        for phase in PHASES:
            med = [statistics.median(getattr(t, phase)[r] for t in steps) for r in range(self.world)]
            by_rank[phase] = med
            excess[phase] = med[slow] - statistics.median(med[r] for r in range(self.world) if r != slow)
        by_rank["wait"] = [statistics.median(t.wait[r] for t in steps) for r in range(self.world)]
        phase = max(PHASES, key=lambda p: excess[p])
        kind = "data" if phase == "data" else "compute"
        cpu_wait = 0.0
        if all(len(t.cpu_wait) == len(t.cpu) == self.world for t in steps):
            med_q = [statistics.median(t.cpu_wait[r] for t in steps) for r in range(self.world)]
            med_c = [statistics.median(t.cpu[r] for t in steps) for r in range(self.world)]
            if all(math.isfinite(q) and q >= 0 for q in med_q + med_c):  # -1: unknown on that rank
                by_rank["cpu"], by_rank["cpu_wait"] = med_c, med_q
                cpu_wait = med_q[slow] - statistics.median(med_q[r] for r in range(self.world) if r != slow)
                more_work = med_c[slow] >= self.factor * statistics.median(
                    med_c[r] for r in range(self.world) if r != slow
                )
                if not more_work and cpu_wait >= 0.5 * saved:
                    kind = "contended"
        return Straggler(
            rank=slow,
            ratio=ratio,
            kind=kind,
            phase=phase,
            work_s=work[slow],
            others_s=others,
            excess_s=excess[phase],
            step_s=step_s,
            step_if_matched_s=max(step_s - saved, 0.0) if step_s > saved else 0.0,
            window=len(steps),
            by_rank=by_rank,
            cpu_wait_s=max(cpu_wait, 0.0),
        )


__all__ = ["PHASES", "RankTimes", "Straggler", "StragglerRule"]

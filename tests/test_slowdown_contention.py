"""The slowdown rule on a real loop with injected clocks and a fake ``/proc``: a machine that other
processes load is information, a slowdown of the training's own work is a warning, also on a loaded
machine.

The actor-critic recipe (tests/fixtures/recipe_models.py) runs for real under ``td.watch``; the
timing instrument's wall clock, this process's CPU clock and the training thread's run-queue clock
are replaced by :class:`Clocks`, which the loop advances by a modelled step before each
``mon.step()``, and its :class:`ContentionReader` reads a folder laid out like ``/proc`` that the
clocks rewrite each step: two threads' ``schedstat`` (the training thread and torch's intra-op
worker), ``pressure/cpu`` and ``stat``. The models are what a loaded 2-core VM showed
(benchmarks/rule_margins.py, the word-language-model LSTM beside 13 busy-looping processes): the
same work's CPU time grew while the threads waited for a CPU, and with two intra-op threads the
worker waited while the training thread spun at OpenMP's barrier, on a CPU.
"""

from __future__ import annotations

import contextlib
import math
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

import torchdebug as td
from tests.fixtures import recipe_models as R
from torchdebug.perf.timing import ContentionReader, MachineReading, SlowdownRule, StepTiming

CFG = {"detail_every": 5}
HZ, CPUS = 100, 2  # /proc/stat's clock ticks a second, and the fake machine's CPUs


@dataclass(frozen=True)
class Step:
    """One modelled step, in seconds."""

    wall: float
    cpu: float  # this process's CPU time (all threads)
    wait: float  # the training thread's wait for a CPU
    worker: float = 0.0  # the intra-op worker thread's wait for a CPU
    pressure: float = 0.0  # time in which some task of the machine waited for a CPU
    steal: float = 0.0  # share of the CPUs' time the hypervisor took


class Clocks:
    """Cumulative wall, CPU and run-queue seconds, and a fake ``/proc`` under ``root`` that says the
    same, advanced by the test one step at a time."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.wall, self.cpu, self.wait = 1000.0, 100.0, 10.0
        self.worker, self.pressure, self.steal, self.ticks = 3.0, 50.0, 0.0, 0.0
        (root / "self" / "task" / "100").mkdir(parents=True)
        (root / "self" / "task" / "101").mkdir()
        (root / "pressure").mkdir()
        self._write()

    def advance(self, step: Step) -> None:
        self.wall += step.wall
        self.cpu += step.cpu
        self.wait += step.wait
        self.worker += step.worker
        self.pressure += step.pressure
        self.ticks += step.wall * HZ * CPUS
        self.steal += step.steal * step.wall * HZ * CPUS
        self._write()

    def _write(self) -> None:
        task = self.root / "self" / "task"
        (task / "100" / "schedstat").write_text(f"{round(self.cpu * 1e9)} {round(self.wait * 1e9)} 7\n")
        (task / "101" / "schedstat").write_text(f"0 {round(self.worker * 1e9)} 3\n")
        (self.root / "pressure" / "cpu").write_text(
            f"some avg10=0.00 avg60=0.00 avg300=0.00 total={round(self.pressure * 1e6)}\n"
            "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
        )
        steal, ticks = round(self.steal), round(self.ticks)
        (self.root / "stat").write_text(f"cpu  {ticks - steal} 0 0 0 0 0 0 {steal} 0 0\ncpu0 0 0 0 0\n")


def _run(
    tmp: Path, model_of: Callable[[int], Step], steps: int = 100, every_s: float | None = None
) -> list[tuple[str, int, str, str]]:
    """The actor-critic recipe for ``steps`` steps with each step's clocks from ``model_of(step)``;
    its slowdown events, as (kind, step, severity, message). ``every_s``: the readings' schedule."""
    clocks = Clocks(tmp / "proc")
    sessions = []

    @contextlib.contextmanager
    def wrap(model: nn.Module, opt: torch.optim.Optimizer) -> Iterator[Callable[[float], None]]:
        with td.watch(model, opt, run=False, config=CFG) as mon:
            sessions.append(mon)
            (timing,) = [i for i in mon.instruments if i.name == "timing"]
            # the host marks, the process's CPU seconds, the thread's run-queue seconds, the machine
            timing._clock.mark = lambda: clocks.wall
            timing.cpu_clock = lambda: clocks.cpu
            timing.wait_clock = lambda: clocks.wait
            reader = ContentionReader(str(clocks.root))
            assert reader.sources == ("wait", "pressure", "steal")
            timing._read_machine = reader.read
            timing._slowdown.read = reader.sources
            timing._slowdown.load = lambda: (7.9, 2)
            if every_s is not None:
                timing.contention_every_s = every_s

            def on_step(loss: float) -> None:
                clocks.advance(model_of(mon.global_step))
                mon.step()

            yield on_step

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        R.actor_critic_run(steps, wrap)
    (mon,) = sessions
    assert [str(w.message) for w in said if "slowdown" not in str(w.message)] == []
    assert len(mon.records) == steps
    return [(e.kind, e.step, e.severity, e.message) for e in mon.events if e.kind.startswith("slowdown")]


# Readings are taken at the end of steps 0, 1, 2, 4, 8, ... and 0.25 s (of the fake wall) after the
# previous one; the rule sees those of step 2 on (steps 0-1 are warm-up). The median of 9 steps turns
# 4 steps after the slow steps begin at 40; the episode starts once 0.5 s of slow steps passed.


def contended(step: int) -> Step:
    """20 ms steps (15 ms of CPU, 5 ms waiting for one; some task waits 25% of the time); steps
    40-79: other processes take the CPUs: the thread waits 65 ms a step, the same work takes 1.7x
    the CPU time (25.5 ms), some task waits all the time."""
    if 40 <= step < 80:
        return Step(0.0905, 0.0255, 0.065, pressure=0.0905)
    return Step(0.020, 0.015, 0.005, pressure=0.005)


def spinning(step: int) -> Step:
    """3 ms steps using 6 ms of CPU (two intra-op threads); steps 40-79: 18 ms, of which the worker
    waits 11.5 ms for a CPU while the training thread spins at the barrier (22 ms of CPU a step) and
    waits only 4.5 ms itself: its own wait explains under a third of the rise."""
    if 40 <= step < 80:
        return Step(0.018, 0.022, 0.0045, worker=0.0115, pressure=0.018)
    return Step(0.003, 0.006, 0.0)


def saturated(step: int) -> Step:
    """A machine busy throughout: 10 ms steps in which the two threads wait 12 ms for a CPU between
    them (more than the wall time: they wait at once), spinning 18 ms of CPU; steps 40-79: more
    load, 40 ms steps, 44 ms of waits, 70 ms of CPU."""
    if 40 <= step < 80:
        return Step(0.040, 0.070, 0.022, worker=0.022, pressure=0.040)
    return Step(0.010, 0.018, 0.006, worker=0.006, pressure=0.010)


def stolen(step: int) -> Step:
    """20 ms steps of CPU; steps 40-79: the hypervisor takes half of the CPUs' time: 40 ms steps of
    the same 20 ms of CPU, and no task waits in the guest's run queue."""
    if 40 <= step < 80:
        return Step(0.040, 0.020, 0.0, steal=0.5)
    return Step(0.020, 0.020, 0.0)


@pytest.mark.parametrize(
    "model_of, fires, said",
    [
        pytest.param(
            contended,
            # 0.5 s of 90.5 ms steps from step 44: 6 steps (44-49). Readings before step 40: 2, 4, 8,
            # 16, 29 (13 x 20 ms >= 0.25 s after 16), 32; after: 41 (7 x 20 + 2 x 90.5 ms >= 0.25 s),
            # 44, 47 (3 x 90.5 ms). Waits: 65/90.5 = 72% of the slow steps, 5/20 = 25% before; lost per step
            # 65 - 5 = 60 of the 70.5 ms rise (85%); the rest of a step 20 - 5 = 15 -> 25.5 ms
            49,
            "steps took 4.5x longer since about step 40 (median 90.5 ms, 20.0 ms before) while the "
            "machine's CPUs were contended (load average 7.9 on 2 CPUs): over steps 42-47 this "
            "process's threads waited for a CPU 72% of the time (summed over its threads; 25% over "
            "steps 3-32), CPU pressure 100% (some task waiting for a CPU; 25% before); it used 25.5 ms "
            "of CPU a step (15.0 ms before); waiting for a CPU accounts for about 85% of the added "
            "time (the rest of a step: about 15.0 -> 25.5 ms)",
            id="other-processes",
        ),
        pytest.param(
            spinning,
            # 0.5 s of 18 ms steps from step 44: 28 steps (44-71). Readings before 40: 2, 4, 8, 16, 32
            # (3 ms steps: 0.25 s never passes); after: 52 (0.021 + 13 x 0.018 >= 0.25 s), 64. Waits:
            # (4.5 + 11.5)/18 = 89% of the slow steps, 0% before; lost 16 ms, more than the 15 ms
            # rise (all of it): the rest of a step 3 -> 18 x (1 - 0.889) = 2.0 ms
            71,
            "steps took 6.0x longer since about step 40 (median 18.0 ms, 3.0 ms before) while the "
            "machine's CPUs were contended (load average 7.9 on 2 CPUs): over steps 53-64 this "
            "process's threads waited for a CPU 89% of the time (summed over its threads; 0% over "
            "steps 3-32), CPU pressure 100% (some task waiting for a CPU; 0% before); it used 22.0 ms "
            "of CPU a step (6.0 ms before); waiting for a CPU accounts for all of the added time "
            "(the rest of a step: about 3.0 -> 2.0 ms)",
            id="intra-op-worker-waits",
        ),
        pytest.param(
            saturated,
            # 0.5 s of 40 ms steps from step 44: 13 steps (44-56). Readings before 40: 2, 4, 8, 16, 32;
            # after: 44 (7 x 10 + 5 x 40 ms >= 0.25 s), 51 (7 x 40 ms). The waits exceed the wall
            # time before and after (120%, 110%): the whole step counts as lost, 40 - 10 = 30 ms,
            # all of the rise; the rest of a step is not known, so not said
            56,
            "steps took 4.0x longer since about step 40 (median 40.0 ms, 10.0 ms before) while the "
            "machine's CPUs were contended (load average 7.9 on 2 CPUs): over steps 45-51 this "
            "process's threads waited for a CPU 110% of the time (summed over its threads; 120% over "
            "steps 3-32), CPU pressure 100% (some task waiting for a CPU; 100% before); it used 70.0 ms "
            "of CPU a step (18.0 ms before); waiting for a CPU accounts for all of the added time",
            id="saturated-machine",
        ),
        pytest.param(
            stolen,
            # 0.5 s of 40 ms steps from step 44: 13 steps (44-56). Readings before 40: 2, 4, 8, 16, 29,
            # 32; after: 42 (7 x 20 + 3 x 40 ms >= 0.25 s), 49, 56 (7 x 40 ms); steal 50% of the slow steps' ticks: half the 40 ms step lost, 20 ms = the whole rise
            56,
            "steps took 2.0x longer since about step 40 (median 40.0 ms, 20.0 ms before) while the "
            "machine's CPUs were contended (load average 7.9 on 2 CPUs): over steps 43-56 this "
            "process's threads waited for a CPU 0% of the time (summed over its threads; 0% over "
            "steps 3-32), CPU pressure 0% (some task waiting for a CPU; 0% before), steal 50% of the "
            "CPUs' time (0% before); it used 20.0 ms of CPU a step (20.0 ms before); waiting for a "
            "CPU accounts for all of the added time (the rest of a step: about 20.0 -> 20.0 ms)",
            id="hypervisor-steal",
        ),
    ],
)
def test_a_contended_machine_is_information_not_a_warning(
    tmp_path: Path, model_of: Callable[[int], Step], fires: int, said: str
) -> None:
    events = _run(tmp_path, model_of)
    # back to the old steps at 80: the median turns at 84
    assert [(k, s, sev) for k, s, sev, _ in events] == [
        ("slowdown", fires, "info"),
        ("slowdown_end", 84, "info"),
    ]
    assert events[0][3] == said


@pytest.mark.parametrize(
    "load, fires, tail",
    [
        pytest.param(
            2.0,
            52,
            # readings 2, 4, 8, 16, 25, 32, 40 (8 x 30 + 60 ms), 45, 50 (5 x 60 ms). The thread waits
            # twice its CPU time before and after: 2/3 of the time both; lost
            # 40 - 20 = 20 ms of the 30 ms rise (half or more: contended), and the rest of a step
            # doubled (10 -> 20 ms, 1/3 of the rise >= 0.5 x 10/30): its own work grew too
            "; over steps 41-50 this process's threads waited for a CPU 67% of the time (summed over its "
            "threads; 67% over steps 3-32), CPU pressure 100% (some task waiting for a CPU; 100% before); "
            "it used 20.0 ms of CPU a step (10.0 ms before): the machine is busy too (load average 7.9 on 2 CPUs)",
            id="loaded-machine",
        ),
        pytest.param(
            0.0,
            64,
            # readings 2, 4, 8, 16, 32, 47 (7 x 10 + 8 x 24 ms), 58 (11 x 24 ms), 64
            "; over steps 48-64 this process's threads waited for a CPU 0% of the time (summed over its "
            "threads; 0% over steps 3-32), CPU pressure 0% (some task waiting for a CPU; 0% before); it "
            "used 24.0 ms of CPU a step (10.0 ms before): waiting for a CPU accounts for about 0% of the "
            "added time",
            id="quiet-machine",
        ),
    ],
)
def test_own_work_that_grows_is_a_warning(tmp_path: Path, load: float, fires: int, tail: str) -> None:
    # from step 40 each step runs a CPU loop that doubles its CPU time, 10 -> 20 ms (no sleep).
    # Loaded: the thread gets a third of a CPU throughout (it waits `load` x its CPU time, and some
    # task always waits); quiet: nothing waits, and 4 ms more CPU so that no step sum lands on 0.5 s
    def scan(step: int) -> Step:
        cpu = 0.020 if step >= 40 else 0.010
        wait = load * cpu
        quiet = 0.004 if load == 0.0 and step >= 40 else 0.0
        wall = cpu + wait + quiet
        return Step(wall, cpu + quiet, wait, pressure=wall if load else 0.0)

    events = _run(tmp_path, scan)
    # the median turns at 44; 0.5 s of steps from there: 9 steps of 60 ms (44-52), or 21 of 24 ms
    assert [(k, s, sev) for k, s, sev, _ in events] == [("slowdown", fires, "warning")]
    said = events[0][3]
    assert said.startswith("steps got slower since about step 40: median step time")
    assert "other grew most" in said  # the injected clocks leave every mark of a step equal
    assert said.endswith(tail)


def test_the_reader_sums_the_threads_and_reads_pressure_and_steal(tmp_path: Path) -> None:
    clocks = Clocks(tmp_path)
    clocks.advance(Step(1.0, 0.5, 0.25, worker=0.125, pressure=0.5, steal=0.25))
    got = ContentionReader(str(tmp_path)).read(7.0)
    # waits 10.25 + 3.125 s (the two threads); pressure 50.5 s; ticks 1.0 x 100 x 2 = 200, steal 50
    assert got == MachineReading(7.0, 13.375, 50.5, 50.0, 200.0)
    # a kernel without PSI nor steal accounting, and a thread that ended between list and read
    (tmp_path / "pressure" / "cpu").unlink()
    (tmp_path / "stat").write_text("intr 1 2 3\n")
    (tmp_path / "self" / "task" / "101" / "schedstat").unlink()
    partial = ContentionReader(str(tmp_path))
    assert partial.sources == ("wait",)
    got = partial.read(8.0)
    assert (got.wall, got.wait) == (8.0, 10.25) and math.isnan(got.pressure) and math.isnan(got.ticks)
    assert ContentionReader(str(tmp_path / "missing")).sources == ()


def test_where_nothing_could_be_read_the_warning_says_so() -> None:
    # 20 ms steps, 60 ms from step 20; no CPU time, no wait, no reading: a warning that says what it
    # could not read. 0.5 s of 60 ms steps from the turn at 24: 9 steps (24-32)
    rule = SlowdownRule(recent=9, read=())
    steps = [
        StepTiming(s, 0.0, 0.06 if s >= 20 else 0.02, 0.0, 0.0, 0.0, 0.06 if s >= 20 else 0.02)
        for s in range(40)
    ]
    events = [e for t in steps for e in rule.update(t)]
    assert [(e.kind, e.step, e.severity) for e in events] == [("slowdown", 32, "warning")]
    assert events[0].message.endswith(
        "; whether other processes took the CPUs is not known here (none of /proc/self/task/*/schedstat, "
        "/proc/pressure/cpu, /proc/stat could be read)"
    )
    assert events[0].evidence["contention_read"] == []


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_the_reader_reads_this_machine() -> None:
    reader = ContentionReader()
    assert "wait" in reader.sources  # schedstat: every Linux kernel with CONFIG_SCHED_INFO
    first = reader.read(0.0)
    sum(range(10**6))
    second = reader.read(1.0)
    for k in reader.sources:
        assert math.isfinite(getattr(first, k)) and getattr(second, k) >= 0
    if "pressure" in reader.sources:
        assert second.pressure >= first.pressure


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_watched_run_reads_the_machine_on_its_schedule_and_closes_the_reader() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with td.watch(model, opt, run=False) as mon:
        (timing,) = [i for i in mon.instruments if i.name == "timing"]
        reader = timing._own_reader
        assert reader is not None and "wait" in reader.sources
        for _ in range(6):
            opt.zero_grad()
            nn.functional.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 1)).backward()
            opt.step()
            mon.step()
        read = {t.step for t in timing.history if t.machine is not None}
    # steps 0, 1, 2 and 4 always; 3 and 5 too where a step took 0.25 s (a loaded machine)
    assert {0, 1, 2, 4} <= read <= set(range(6))
    assert timing._own_reader is None and timing._read_machine is None
    assert (reader._pressure, reader._stat) == (-1, -1)  # its files closed at exit


def spinning_between_readings(step: int) -> Step:
    """``spinning``'s slow steps at 140-179, where no reading of the schedule falls: with readings
    at steps 0, 1, 2, 4, ... 128, 256 only, the slow steps carry none when the rule would judge."""
    return spinning(step - 100) if 140 <= step < 180 else spinning(0)


def test_slow_steps_without_a_reading_get_one_before_the_verdict(tmp_path: Path) -> None:
    events = _run(tmp_path, spinning_between_readings, steps=220, every_s=math.inf)
    # 0.5 s of 18 ms steps from the median's turn (step 144) pass at step 171: the rule asks for a
    # reading then, the instrument takes it at step 172's end, and the verdict comes with it:
    # contention, as for ``spinning`` with readings in place (the thread's own wait alone: a warning)
    assert [(k, s, sev) for k, s, sev, _ in events] == [
        ("slowdown", 172, "info"),
        ("slowdown_end", 184, "info"),
    ]
    # the span from the reading at 128 to the one asked for at 172: 11 fast steps (3 ms, no wait) and
    # 33 slow ones (18 ms, 4.5 + 11.5 ms waited): 528 of 627 ms = 84%
    assert (
        "over steps 129-172 this process's threads waited for a CPU 84% of the time (summed over its "
        "threads; 0% over steps 3-128)"
    ) in events[0][3]


def spinning_twice(step: int) -> Step:
    """``spinning``'s slow steps at 40-79 and again at 86-125, just after the first episode ends."""
    return spinning(step - 46) if 86 <= step < 126 else spinning(step if step < 86 else 0)


def test_an_episode_soon_after_the_last_is_judged_against_the_steps_before_that_one(tmp_path: Path) -> None:
    events = _run(tmp_path, spinning_twice, steps=140)
    # the first episode ends at 84; the second has no reading between them to stand for "before":
    # the span before the first episode (steps 3-32) does, as the baseline's steps are from then too
    assert [(k, s, sev) for k, s, sev, _ in events] == [
        ("slowdown", 71, "info"),
        ("slowdown_end", 84, "info"),
        ("slowdown", 117, "info"),
        ("slowdown_end", 130, "info"),
    ]
    # slow steps of 18 ms of which the threads wait 4.5 + 11.5 ms: 16/18 = 89%
    assert (
        "over steps 98-111 this process's threads waited for a CPU 89% of the time (summed over its "
        "threads; 0% over steps 3-32)"
    ) in events[2][3]

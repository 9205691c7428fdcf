"""Timing: step breakdown against a loader that sleeps a known time, throughput, rules, per-module time."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchdebug.session.monitor as tdm
from tests.fixtures.memory_models import HandClock, Ticking, TickingSGD, sleepy_batches, sleepy_loader
from torchdebug._errors import TorchDebugWarning
from torchdebug.perf import timing
from torchdebug.perf.timing import ModuleTimer, batch_size_and_tokens
from torchdebug.store import open_run

# timing + module_time only (no gradient rules), so the only warnings are the ones under test
PERF = {"mode": "profiling", "level": "basic", "enable_performance_profiling": True}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def _timing(mon):
    return next(i for i in mon.instruments if i.name == "timing")


@pytest.fixture
def clock(monkeypatch) -> HandClock:
    """The timing instruments' host clock, moved by hand: every span is exact, whatever the load."""
    hand = HandClock()
    monkeypatch.setattr(timing, "host_clock", hand)
    return hand


def test_each_phase_of_a_step_is_the_time_spent_in_it_and_a_slow_loader_is_input_bound(tmp_path, clock):
    # a step on the hand clock: the DataLoader waits 1/16 s per batch, the model's forward 1/128 s and
    # its backward 1/64 s, the loss outside the forward 1/256 s, the optimizer 1/128 s: 25/256 s in all
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), Ticking(clock, 1 / 128, 1 / 64), nn.ReLU(), nn.Linear(16, 1))
    # a plain SGD built first: torch then hooks SGD.step as well, and TickingSGD.step's super().step()
    # runs torch's hook wrapper a second time, nested: still one optimizer phase of 1/128 s a step
    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    opt = TickingSGD(model.parameters(), clock, 1 / 128)
    with (
        pytest.warns(TorchDebugWarning, match="input_bound"),
        tdm.watch(model, opt, config={**PERF, "run_dir": str(tmp_path)}) as mon,
    ):
        for x in sleepy_loader(10, 1 / 16, sleep=clock.advance):
            out = model(x)
            clock.advance(1 / 256)  # the loss: the user's own code, "other"
            loss = out.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step()
        hist = list(_timing(mon).history)
        events = [e for e in mon.events if e.kind in ("input_bound", "slowdown")]
    phases = {"data": 1 / 16, "forward": 1 / 128, "backward": 1 / 64, "optimizer": 1 / 128, "other": 1 / 256}
    total = 25 / 256  # 16 + 2 + 4 + 2 + 1 (/256 s)
    # step 0's data wait is its first batch too: from the session's start to the first forward
    assert [t.as_log() for t in hist] == [{**phases, "step": total}] * 10
    assert [(t.step, t.loader, t.loader_calls) for t in hist] == [(s, 1 / 16, 1) for s in range(10)]
    assert [t.samples for t in hist] == [4] * 10
    assert hist[0].samples_per_s == 4 / total
    # the DataLoader's share, 16/25 = 64% > 30%, from step 2 (after the warm-up) on; the median of
    # 5 steps first stands at step 6; said once per episode, not every step
    (ev,) = events
    assert (ev.kind, ev.step, ev.evidence["data_share_median"]) == ("input_bound", 6, (1 / 16) / total)
    assert (ev.evidence["data_s"], ev.evidence["step_s"], ev.evidence["threshold"]) == (1 / 16, total, 0.3)
    assert ev.message.startswith("waiting for the DataLoader takes 64% of each step (median of the last 5")
    rows = open_run(mon.run_dir).timings()
    assert [r["step"] for r in rows] == list(range(10))
    assert {k: rows[3][k] for k in phases} == phases


@pytest.mark.parametrize("loop", ["rollout", "teacher"])
def test_time_before_the_forward_without_a_dataloader_is_not_input_bound(tmp_path, loop):
    # an actor-critic's environment rollout, a distillation teacher's forward: the same 50 ms before
    # the watched model's forward as the sleeping loader above, but no DataLoader gives the batch
    model = _mlp()
    teacher = nn.Sequential(nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 8))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with tdm.watch(model, opt, config={**PERF, "run_dir": str(tmp_path)}) as mon:
        for x in sleepy_batches(10, 0.05 if loop == "rollout" else 0.0):
            if loop == "teacher":
                with torch.no_grad():
                    for _ in range(200):  # the teacher's forward, unwatched
                        x = teacher(x).tanh()
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step()
        hist = list(_timing(mon).history)
        kinds = [e.kind for e in mon.events]
    assert "input_bound" not in kinds
    assert [t.loader_calls for t in hist] == [0] * 10
    # the time is still shown as the span before the forward (the report's "data" phase)
    assert all(t.data > 0 for t in hist[1:])


def test_a_dataloader_batch_is_timed_and_counted(tmp_path):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with tdm.watch(model, opt, config={**PERF, "run_dir": str(tmp_path)}) as mon:
        for x in sleepy_loader(3, 0.0):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
        hist = list(_timing(mon).history)
    # one batch a step; the one past the end (StopIteration) comes after the last mon.step()
    assert [t.loader_calls for t in hist] == [1, 1, 1]
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    assert _BaseDataLoaderIter.__next__.__qualname__ == "_BaseDataLoaderIter.__next__"  # restored


class _NoWait:
    """A run-queue clock for a thread that never waits for a CPU: the slowdown is the loop's own."""

    def read(self) -> float:
        return 0.0

    def close(self) -> None:
        pass


class _NoMachine:
    """A contention reader that can read nothing (macOS, a container): with the wall clock faked,
    real /proc counters would not match it; the rule judges by the thread's wait alone."""

    sources = ()

    def read(self, wall: float) -> timing.MachineReading:
        return timing.MachineReading(wall)

    def close(self) -> None:
        pass


def test_a_fast_loop_whose_steps_jitter_by_half_is_neither_input_bound_nor_slow(tmp_path, clock, monkeypatch):
    monkeypatch.setattr(timing, "RunQueueClock", _NoWait)
    monkeypatch.setattr(timing, "ContentionReader", _NoMachine)
    torch.manual_seed(0)
    tick = Ticking(clock, 1 / 1024)
    model = nn.Sequential(nn.Linear(8, 16), tick, nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    xs = torch.randn(40, 4, 8)
    with tdm.watch(model, opt, config={**PERF, "run_dir": str(tmp_path)}) as mon:
        for step, x in enumerate(xs):
            tick.forward_s = (1, 2, 3)[step % 3] / 1024  # steps of 1, 2, 3 (/1024 s) in turn
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
        hist = list(_timing(mon).history)
        events = [e for e in mon.events if e.kind in ("input_bound", "slowdown")]
    assert [t.total for t in hist] == [(1, 2, 3)[s % 3] / 1024 for s in range(20, 40)]
    # any 9 steps in a row hold three of each: their median is 2/1024 s, the baseline's too (1x);
    # no DataLoader: no share of the step waits for one
    assert events == []


def test_slowdown_rule_fires_when_steps_stay_slow(tmp_path, clock, monkeypatch):
    monkeypatch.setattr(timing, "RunQueueClock", _NoWait)
    monkeypatch.setattr(timing, "ContentionReader", _NoMachine)
    torch.manual_seed(0)
    tick = Ticking(clock, 1 / 1024)
    model = nn.Sequential(nn.Linear(8, 1), tick)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with (
        pytest.warns(TorchDebugWarning, match="slowdown"),
        tdm.watch(model, opt, config={**PERF, "run_dir": str(tmp_path)}) as mon,
    ):
        for step in range(60):
            # steps of 1/1024 s become steps of 33/1024 s (about 1 ms -> 32 ms), all in the forward
            tick.forward_s = (33 if 22 <= step < 50 else 1) / 1024
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
        slow = [e for e in mon.events if e.kind == "slowdown"]
        ended = [e for e in mon.events if e.kind == "slowdown_end"]
    # patience 5: the median of the last 9 steps turns slow at step 26 (steps 22-26 slow: 5 of 9);
    # "since" is the window's middle, 26 - 4 = 22. Then it must stay slow for 0.5 s of steps:
    # 16 steps of 33/1024 s (16 * 33 / 1024 = 0.516 s; 15 make 0.483 s), steps 26-41: said at 41.
    (ev,) = slow
    said = ev.evidence
    assert (ev.step, ev.severity, said["since"], said["phase"]) == (41, "warning", 22, "forward")
    assert (said["step_s"], said["median_s"], said["forward"]) == (33 / 1024, 1 / 1024, 33 / 1024)
    assert ev.message == (
        "steps got slower since about step 22: median step time 32.2 ms over the last 9 steps, 33.0x the "
        "median 1.0 ms before; forward grew most (1.0 -> 32.2 ms)"
    )
    rows = {r["step"]: r["total"] for r in open_run(mon.run_dir).timings()}
    assert [rows[s] for s in range(26, 42)] == [33 / 1024] * 16
    # back to fast at step 50: the median of 9 turns fast at step 54 (50-54 fast); one episode,
    # 54 - 22 = 32 steps long
    (end,) = ended
    assert (end.step, end.severity, end.evidence["steps"]) == (54, "info", 32)


def test_tokens_and_accumulated_samples(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 8), nn.Flatten(), nn.Linear(8 * 16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with tdm.watch(model, opt, config={**PERF, "run_dir": str(tmp_path)}) as mon:
        for _ in range(3):
            for _micro in range(2):
                ids = torch.randint(0, 50, (4, 16))  # (B, T) integer input: 4*16 = 64 tokens
                model(ids).mean().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
        hist = list(_timing(mon).history)
    assert [(t.samples, t.tokens) for t in hist] == [(8, 128)] * 3  # two micro-steps per step
    assert hist[-1].tokens_per_s == pytest.approx(128 / hist[-1].total)
    assert batch_size_and_tokens((torch.zeros(3, 5),)) == (3, None)  # float input: no tokens
    assert batch_size_and_tokens((), {"x": torch.zeros(2, 7, dtype=torch.long)}) == (2, 14)
    assert batch_size_and_tokens(("text",)) == (None, None)


def test_module_timer_attributes_forward_and_backward_time(clock):
    torch.manual_seed(0)
    # module "1" takes 1/128 s in its forward and 1/64 s in its backward on the hand clock
    model = nn.Sequential(nn.Linear(4, 4), Ticking(clock, 1 / 128, 1 / 64), nn.Linear(4, 1))
    with ModuleTimer(model) as tm:
        model(torch.randn(2, 4)).sum().backward()
    t = tm.collect()
    # (forward s, backward s, calls), inclusive of children: the root's spans hold module 1's; the
    # Linears take no time on this clock
    assert t == {"": (1 / 128, 1 / 64, 1), "0": (0.0, 0.0, 1), "1": (1 / 128, 1 / 64, 1), "2": (0.0, 0.0, 1)}
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_module_time_instrument_measures_steps_1_to_3(tmp_path):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    cfg = {**PERF, "per_module_time": True, "run_dir": str(tmp_path)}
    with tdm.watch(model, opt, config=cfg) as mon:
        for _ in range(6):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
        inst = next(i for i in mon.instruments if i.name == "module_time")
        run_dir = mon.run_dir
    table = inst.table
    assert table is not None and table.steps == (1, 2, 3)
    assert {r.module for r in table.rows} == {"", "0", "1", "2"}
    assert table.row("").forward_s >= table.row("0").forward_s
    assert all(r.backward_s is not None and r.backward_s >= 0 for r in table.rows)
    assert "per-module time" in str(table)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules() if m is not model)
    ev = open_run(run_dir).events(kind="module_time")
    assert len(ev) == 1 and ev[0]["step"] == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_events_are_read_without_losing_steps(tmp_path):
    model = _mlp().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with tdm.watch(model, opt, config={**PERF, "run_dir": str(tmp_path)}) as mon:
        for _ in range(6):
            model(torch.randn(4, 8, device="cuda")).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
        inst = _timing(mon)
        assert inst._clock.cuda
    hist = list(inst.history)  # the last steps are flushed at exit
    assert [t.step for t in hist] == list(range(6))
    assert all(t.forward > 0 and t.backward > 0 and t.total >= t.forward + t.backward for t in hist)

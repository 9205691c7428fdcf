"""The straggler verdict: which rank is slow, in which phase (data, forward, backward), and what it costs.

The rule's arithmetic on hand-made times first; then 2 gloo ranks (DDP and FSDP2) with a delay
injected on rank 1 in data loading (a sleep), in the forward or in the backward (a busy-wait op; under
DDP the forward sleeps), and a zero-delay control that must stay silent. Asserts name the rank and the
phase, never a duration beyond "the injected delay is named"."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import torchdebug as td
from torchdebug.health.stragglers import RankTimes, StragglerRule
from torchdebug.session.steptimes import StepClock
from torchdebug.store import open_run

from .test_distributed import _batch, _local, run_pairs, wrapped_net

TIMEOUT = pytest.mark.timeout(240)
DELAY_S = 0.08  # injected on rank 1: far above a step of the tiny model, even on a loaded machine
STEPS = 14


def _times(data=(0.001, 0.001), fwd=(0.01, 0.01), bwd=(0.01, 0.01), wait=(0.0, 0.0), step=(0.03, 0.03)):
    return RankTimes(data=data, forward=fwd, backward=bwd, wait=wait, step=step)


# -- the rule ---------------------------------------------------------------------------------------
def test_a_backward_straggler_is_named_once_with_its_phase_and_cost():
    rule = StragglerRule(world=2, factor=1.5)
    # rank 1's backward takes 50 ms where rank 0's takes 10; rank 0 waits 40 ms in the all-reduce;
    # both ranks' steps take 70 ms
    t = _times(bwd=(0.01, 0.05), wait=(0.04, 0.0), step=(0.07, 0.07))
    found = [rule.update(t) for _ in range(12)]
    hits = [(i, f) for i, f in enumerate(found) if f is not None]
    # 5 steps before the rule looks, then 5 in a row above the factor: the 9th step (index 8)
    assert [i for i, _ in hits] == [8]
    f = hits[0][1]
    assert (f.rank, f.kind, f.phase) == (1, "compute", "backward")
    # work = data + forward + backward: 61 ms vs 21 ms
    assert f.work_s == pytest.approx(0.061) and f.others_s == pytest.approx(0.021)
    assert f.ratio == pytest.approx(0.061 / 0.021)
    assert f.excess_s == pytest.approx(0.04)
    # matched: 70 ms - (61 - 21) ms = 30 ms, 70 / 30 = 2.33x
    assert f.step_if_matched_s == pytest.approx(0.03) and f.speedup == pytest.approx(7 / 3)
    assert f.message() == (
        "rank 1 is the straggler: its step work takes 2.9x the other ranks' median (61.0 ms vs 21.0 ms "
        "over the last 9 steps); a compute straggler, 40.0 ms slower in backward; if it matched the other "
        "ranks a step would take about 30 ms instead of 70 ms (2.3x faster)"
    )
    ev = f.evidence()
    assert ev["median_s_by_rank"]["wait"] == [0.04, 0.0] and ev["busy_s_by_rank"] == pytest.approx(
        [0.021, 0.061]
    )


def test_a_data_straggler_is_a_data_host_straggler():
    rule = StragglerRule(world=2)
    t = _times(data=(0.001, 0.041), wait=(0.04, 0.0), step=(0.065, 0.065))
    (f,) = [f for f in (rule.update(t) for _ in range(10)) if f is not None]
    assert (f.rank, f.kind, f.phase) == (1, "data", "data")
    assert "a data/host straggler, 40.0 ms slower in waiting for data" in f.message()


def test_the_slow_rank_among_four_is_named_against_the_median_of_the_others():
    rule = StragglerRule(world=4)
    t = _times(
        data=(0.001,) * 4,
        fwd=(0.01, 0.012, 0.03, 0.011),
        bwd=(0.01,) * 4,
        wait=(0.0,) * 4,
        step=(0.05,) * 4,
    )
    (f,) = [f for f in (rule.update(t) for _ in range(10)) if f is not None]
    # the others' work: 21, 23, 22 ms: their median 22 ms; rank 2's 41 ms
    assert (f.rank, f.phase) == (2, "forward") and f.others_s == pytest.approx(0.022)


def test_equal_ranks_and_a_small_gap_stay_silent_and_an_episode_ends_before_the_next():
    rule = StragglerRule(world=2)
    assert all(rule.update(_times()) is None for _ in range(30))
    # 1.3x: below the factor
    assert all(rule.update(_times(fwd=(0.01, 0.016))) is None for _ in range(30))
    slow = _times(fwd=(0.01, 0.05), step=(0.07, 0.07))
    first = [rule.update(slow) for _ in range(30)]
    assert sum(f is not None for f in first) == 1  # one finding per episode, not one per step
    back = [rule.update(_times()) for _ in range(30)]  # the window refills with equal steps: it ends
    assert all(f is None for f in back) and rule.straggling is None
    again = [rule.update(slow) for _ in range(30)]
    assert sum(f is not None for f in again) == 1  # a new episode, a new finding


def test_a_rank_that_waits_for_a_cpu_is_a_contended_host_not_a_straggler_of_its_own():
    rule = StragglerRule(world=2)
    # rank 0's work is 40 ms longer, and its thread waited 35 ms a step for a CPU (rank 1: 1 ms), with
    # the same 20 ms on a CPU as rank 1
    t = RankTimes(
        data=(0.001, 0.001),
        forward=(0.05, 0.01),
        backward=(0.01, 0.01),
        wait=(0.0, 0.04),
        step=(0.07, 0.07),
        cpu=(0.02, 0.02),
        cpu_wait=(0.036, 0.001),
    )
    (f,) = [f for f in (rule.update(t) for _ in range(10)) if f is not None]
    assert (f.rank, f.kind, f.phase) == (0, "contended", "forward") and f.cpu_wait_s == pytest.approx(0.035)
    assert (
        "its host is busy with other processes, 40.0 ms slower in forward (its training thread waited 35.0 ms"
        in (f.message())
    )
    # unknown on a rank (-1): judged on the times alone
    rule = StragglerRule(world=2)
    t2 = RankTimes(t.data, t.forward, t.backward, t.wait, t.step, cpu=t.cpu, cpu_wait=(0.036, -1.0))
    (f,) = [f for f in (rule.update(t2) for _ in range(10)) if f is not None]
    assert f.kind == "compute"
    # more work on a loaded host (30 ms on a CPU against 10 ms, and waits for one): still its own work
    rule = StragglerRule(world=2)
    t3 = RankTimes(t.data, t.forward, t.backward, t.wait, t.step, cpu=(0.03, 0.01), cpu_wait=(0.036, 0.001))
    (f,) = [f for f in (rule.update(t3) for _ in range(10)) if f is not None]
    assert f.kind == "compute"


def test_a_gap_that_costs_the_step_little_is_not_a_straggler():
    # rank 1 does 2x the work of rank 0, but the work is 2 ms of a 200 ms step (the rest is, say, the
    # optimizer and logging on both): matching would save 1 ms of 200, under the 10% that counts
    rule = StragglerRule(world=2)
    t = _times(data=(0.0, 0.0), fwd=(0.001, 0.002), bwd=(0.0, 0.0), step=(0.2, 0.2))
    assert all(rule.update(t) is None for _ in range(30))


def test_the_runnable_clock_marks_the_forward_before_an_earlier_prepended_pre_hook():
    # FSDP2 puts its pre-forward (the root's all-gather, where a fast rank waits) first; the clock's
    # mark must come before it, so that wait counts as the forward's, never as the rank's data time
    net = nn.Linear(2, 2)
    seen: list[bool] = []
    clock = StepClock(None, True, root=None)
    assert clock.timed_by == "wall"  # without a root: host wall times, as under DDP
    clock.remove()
    net.register_forward_pre_hook(lambda m, args: seen.append(clock.t_forward is not None), prepend=True)
    clock = StepClock(None, True, root=net)
    assert clock.timed_by == "runnable"
    with torch.no_grad():
        net(torch.ones(1, 2))  # no micro-step: an evaluation forward
    assert seen == [False] and clock.t_forward is None
    loss = net(torch.ones(1, 2)).sum()
    assert seen == [False, True]
    clock.forward_start()  # the session's own mark, after FSDP2's: it keeps the earlier one
    first = clock.t_forward
    clock.backward_start(after_forward=True)
    loss.backward()
    clock.backward_end(in_backward=True)
    assert clock.t_forward == first
    fwd, _data, bwd, wait, *_ = clock.times(time.perf_counter())
    assert fwd >= 0 and bwd >= 0 and wait >= 0
    clock.step_end(time.perf_counter())
    clock.remove()
    net(torch.ones(1, 2))
    assert seen == [False, True, False]  # the clock's hook is off: nothing marked the forward


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the CUDA-event timing")
def test_on_a_gpu_the_compute_comes_from_cuda_events_read_a_step_late_without_a_sync():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)).cuda()
    clock = StepClock(next(net.parameters()), True)
    assert clock.timed_by == "cuda"
    x = torch.randn(512, 256, device="cuda")
    got = []
    for _ in range(3):
        clock.forward_start()
        loss = net(x).square().mean()
        clock.backward_start(after_forward=True)
        loss.backward()
        clock.backward_end(in_backward=True)
        torch.cuda.set_sync_debug_mode("error")  # reading the events must not synchronize
        try:
            got.append(clock.times(time.perf_counter()))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        loss.item()  # the step's one host read (the coordinator's transfer)
        clock.step_end(time.perf_counter())
    clock.remove()
    # the first step has no previous one: its host times; the next ones carry the GPU's spans of the
    # step before (a forward and a backward of real kernels: both longer than zero)
    assert all(t[0] > 0 and t[2] > 0 for t in got[1:])


# -- two ranks -------------------------------------------------------------------------------------
def _spin(seconds: float) -> None:
    """Busy work of ``seconds`` of this thread's CPU time: a fixed amount of compute, which a loaded
    machine stretches in wall time as it stretches the other ranks' own work."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class _BusyBackward(torch.autograd.Function):
    """Identity whose backward busy-waits ``seconds`` (an op that is slow on one rank)."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        _spin(ctx.seconds)
        return g, None


def _straggler_scenario(rank: int, out: Path, name: str, sc: dict) -> dict:
    net, model = wrapped_net(bool(sc.get("fsdp")))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    delay = sc.get("delay", DELAY_S) if rank == 1 else 0.0
    where = sc.get("where")
    if where == "backward":  # fc1's output's gradient is slow: between fc2's gradients and fc1's
        net.fc1.register_forward_hook(lambda m, args, out: _BusyBackward.apply(out, delay))
    if where == "forward_spin":  # fc1's forward busy-waits (compute, where Net.delay_s sleeps)
        net.fc1.register_forward_pre_hook(lambda m, args: _spin(delay))
    cfg = td.DebugConfig(run_dir=str(out / "runs" / name))
    with td.watch(model, opt, config=cfg) as mon:
        run_dir = str(mon.run_dir)
        for step in range(STEPS):
            x, y = _batch(rank, step, None)
            if where == "data":
                time.sleep(delay)  # the batch arrives late on rank 1
            net.delay_s = delay if where == "forward" else 0.0
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step()
    with open_run(run_dir, rank=rank) as rec:
        events = rec.events("straggler")
    return {
        "run_dir": run_dir,
        "events": [
            {
                "step": e["step"],
                "severity": e["severity"],
                "message": e["message"],
                "evidence": e["data"]["evidence"],
            }
            for e in events
        ],
        "params": [_local(p).tolist() for p in model.parameters()],
    }


SCENARIOS = {
    "control": {"where": None},
    "data": {"where": "data"},
    "forward": {"where": "forward"},
    "backward": {"where": "backward"},
    "fsdp_control": {"where": None, "fsdp": True},
    # FSDP2's per-layer hooks make the tiny model's own work several times DDP's, and a loaded host's
    # run-queue waits stretch it further (its runnable time), where a sleep stays as long: a longer one
    "fsdp_data": {"where": "data", "fsdp": True, "delay": 0.2},
    "fsdp_forward": {"where": "forward_spin", "fsdp": True},
    "fsdp_backward": {"where": "backward", "fsdp": True},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    return run_pairs(_straggler_scenario, SCENARIOS, tmp_path_factory.mktemp("stragglers"))


@TIMEOUT
@pytest.mark.parametrize(
    ("scenario", "kind", "phase", "timed_by"),
    [
        ("data", "data", "data", "wall"),
        ("forward", "compute", "forward", "wall"),
        ("backward", "compute", "backward", "wall"),
        # FSDP2: the fast rank waits in every layer's all-gather and reduce-scatter, inside its own
        # forward and backward; its thread is blocked there, not runnable, so its runnable time is small
        ("fsdp_data", "data", "data", "runnable"),
        ("fsdp_forward", "compute", "forward", "runnable"),
        ("fsdp_backward", "compute", "backward", "runnable"),
    ],
)
def test_the_delayed_rank_and_phase_are_named_on_every_rank_once(runs, scenario, kind, phase, timed_by):
    r0, r1 = runs[scenario]
    for r in (r0, r1):
        (ev,) = r["events"]  # one episode, recorded by both ranks
        assert ev["severity"] == "warning"
        e = ev["evidence"]
        assert (e["rank"], e["kind"], e["phase"], e["timed_by"]) == (1, kind, phase, timed_by)
        assert ev["message"].startswith("rank 1 is the straggler: its step work takes ")
        assert e["speedup"] > 1.0
    assert r0["events"] == r1["events"]  # the same decision and the same numbers on both ranks


@TIMEOUT
@pytest.mark.parametrize("scenario", ["control", "fsdp_control"])
def test_equal_ranks_make_no_straggler_warning(runs, scenario):
    # on a machine loaded by other processes one rank may wait for a CPU: that is said as information
    # (kind "contended"), never as a warning about the rank's own work
    for r in runs[scenario]:
        assert [e for e in r["events"] if e["evidence"]["kind"] != "contended"] == []
        assert all(e["severity"] == "info" for e in r["events"])


@TIMEOUT
def test_show_lists_the_episode_once_with_the_ranks_that_recorded_it(runs, capsys):
    from torchdebug.cli import main

    assert main(["show", runs["backward"][0]["run_dir"], "--json"]) == 0
    ov = json.loads(capsys.readouterr().out)["all_ranks"]
    (s,) = ov["stragglers"]
    assert (s["rank"], s["kind"], s["phase"], s["recorded_by"]) == (1, "compute", "backward", [0, 1])

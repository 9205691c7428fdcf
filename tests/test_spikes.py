"""Loss-spike forensics and rollback: one injected cause per scenario, so the verdict's truth is known."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchdebug as td
from torchdebug import LossSpikeError, TorchDebugWarning
from torchdebug.health.spikes import Evidence, SpikeReport, attribute
from torchdebug.store import open_run

D_IN, D_OUT, BATCH = 8, 4, 32
SPIKE = 40


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D_IN, 16)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(16, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def data(steps: int, corrupt: dict[int, dict[int, float]] | None = None, seed: int = 1) -> list[Any]:
    """A seeded regression stream y = x @ W + noise; ``corrupt[step][row] = factor`` scales a row's labels."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(D_IN, D_OUT, generator=g)
    out = []
    for step in range(steps):
        x = torch.randn(BATCH, D_IN, generator=g)
        y = x @ w + 0.1 * torch.randn(BATCH, D_OUT, generator=g)
        for row, factor in (corrupt or {}).get(step, {}).items():
            y[row] = y[row] * factor
        out.append((x, y))
    return out


def train(
    mon: Any,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batches: list[Any],
    before: Callable[[int], None] | None = None,
) -> list[float]:
    losses = []
    for step, (x, y) in enumerate(batches):
        if before is not None:
            before(step)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        mon.step()
        losses.append(loss.item())
    return losses


def watched(model: nn.Module, opt: torch.optim.Optimizer, tmp_path: Any = None, **options: Any) -> Any:
    # step timing and memory rules off: a shared CPU's hiccups are not what these tests are about
    cfg = {"level": "intermediate", "log_performance": False, "log_memory": False, **options}
    return td.watch(model, opt, run=tmp_path if tmp_path is not None else False, config=cfg)


def spikes_of(mon: Any) -> list[tuple[int, str]]:
    return [(r.step, r.cause) for r in mon.spikes]


# --------------------------------------------------------------------------- one scenario per cause


def test_a_few_corrupted_rows_are_named(tmp_path) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    batches = data(SPIKE + 5, {SPIKE: {3: 100.0, 17: 60.0}})
    with pytest.warns(TorchDebugWarning), watched(model, opt, tmp_path) as mon:
        train(mon, model, opt, batches)
    assert spikes_of(mon) == [(SPIKE, "batch")]
    report = mon.spikes[0]
    # the two rows whose labels were scaled 100x and 60x, largest loss first; every other row is ~1
    assert [r.index for r in report.rows] == [3, 17]
    assert all(r.times_median > 100 for r in report.rows)
    assert report.evidence["sigmas_without_rows"] <= 10.0
    assert "rows 3 (" in report.message and "17 (" in report.message
    # the report is in the run folder, and reads back whole
    run = open_run(mon.run_dir)
    stored = run.events(kind="spike_report")
    assert len(stored) == 1 and stored[0]["step"] == SPIKE
    back = SpikeReport.from_dict(stored[0]["data"]["evidence"])
    assert back == SpikeReport.from_dict(report.to_dict())
    # every view shows it: show, the text report, the HTML report (and the dashboard's fragment)
    shown = subprocess.run(
        [sys.executable, "-m", "torchdebug", "show", str(mon.run_dir)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert f"loss spikes (1)\n  step {SPIKE}  cause batch: 2 of 32 rows carry it: rows 3 (" in shown
    text = td.report(mon.run_dir, format="text")
    assert "Loss spikes (1)" in text and f"step {SPIKE}  cause batch" in text
    from torchdebug.views.report._html import render_events

    html = render_events(run.events())
    assert "<h3>Loss spikes</h3>" in html and "row 3, row 17" in html


def test_a_scheduler_jumping_30x_is_the_learning_rate() -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def schedule(step: int) -> None:  # 30x for three steps from SPIKE - 1, then back
        opt.param_groups[0]["lr"] = 1.5 if SPIKE - 1 <= step < SPIKE + 2 else 0.05

    with pytest.warns(TorchDebugWarning), watched(model, opt) as mon:
        train(mon, model, opt, data(SPIKE + 6), before=schedule)
    assert mon.spikes, "no spike"
    report = mon.spikes[0]
    assert report.cause == "learning_rate"
    # the lr of the update at step SPIKE - 1 was 0.6 (0.02 before): the loss of SPIKE shows it
    assert report.began == SPIKE - 1
    assert "0.05 -> 1.5 (30x)" in report.message


def test_adam_whose_second_moment_collapsed_names_the_parameter() -> None:
    torch.manual_seed(0)

    class Gated(Net):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Parameter(torch.zeros(D_OUT))
            self.on = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # off: the gate's gradient is exactly zero (Adam's moments stay 0 and the gate stays 0);
            # on at SPIKE - 1: the gate is still 0, so the loss does not move, and its gradient is
            # small, but Adam's update is (1 - b1) g / sqrt(1 - b2) g (bias-corrected: ~2.9 lr per
            # element) because v never saw a gradient: the gate jumps by ~0.14, the output by ~2.9
            return super().forward(x) + self.gate * (20.0 if self.on else 0.0)

    model = Gated()
    opt = torch.optim.Adam(model.parameters(), lr=0.05, betas=(0.5, 0.99))

    def gate(step: int) -> None:
        model.on = step >= SPIKE - 1

    with pytest.warns(TorchDebugWarning), watched(model, opt) as mon:
        train(mon, model, opt, data(SPIKE + 4), before=gate)
    assert mon.spikes, "no spike"
    report = mon.spikes[0]
    assert (report.step, report.cause, report.params) == (SPIKE, "optimizer_state", ("gate",)), str(report)
    assert report.evidence["collapsed"]["gate"] >= 2.0


def test_one_layers_lr_group_multiplied_names_the_layer() -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(
        [{"params": model.fc1.parameters()}, {"params": model.fc2.parameters()}], lr=0.05, momentum=0.5
    )

    def boost(step: int) -> None:  # fc2's group x40 from SPIKE - 1 on
        opt.param_groups[1]["lr"] = 2.0 if step >= SPIKE - 1 else 0.05

    with pytest.warns(TorchDebugWarning), watched(model, opt) as mon:
        train(mon, model, opt, data(SPIKE + 3), before=boost)
    assert mon.spikes, "no spike"
    report = mon.spikes[0]
    assert report.cause == "layer", str(report)
    assert report.modules == ("fc2",)
    assert report.began == SPIKE - 1


@pytest.mark.parametrize("schedule", ["constant", "warmup", "cosine"])
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_healthy_runs_give_no_spike_report(schedule: str, opt_name: str) -> None:
    torch.manual_seed(0)
    model = Net()
    base = 0.05 if opt_name == "sgd" else 3e-3
    opt = (
        torch.optim.SGD(model.parameters(), lr=base)
        if opt_name == "sgd"
        else torch.optim.Adam(model.parameters(), lr=base)
    )
    steps = 150

    def lr(step: int) -> None:
        if schedule == "warmup":  # linear warm-up over 30 steps
            opt.param_groups[0]["lr"] = base * min(1.0, (step + 1) / 30)
        elif schedule == "cosine":
            opt.param_groups[0]["lr"] = base * 0.5 * (1 + math.cos(math.pi * step / steps))

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails
        with watched(model, opt, on_spike="rollback", snapshot_every=10) as mon:
            train(mon, model, opt, data(steps, seed=7), before=lr)
    assert mon.spikes == [] and mon.rollbacks == []


# --------------------------------------------------------------------------- on_spike


def test_rollback_restores_the_snapshot_bitwise_and_training_goes_on() -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    batches = data(SPIKE + 10, {SPIKE: {3: 300.0, 5: 300.0}})
    saved: dict[int, list[torch.Tensor]] = {}
    with pytest.warns(TorchDebugWarning), watched(model, opt, on_spike="rollback", snapshot_every=10) as mon:
        guard = next(i for i in mon.instruments if i.name == "spikes")
        take = guard.ring.take

        def spy(m: Any, label: int) -> Any:  # what the model held at each snapshot
            saved[label] = [p.detach().clone() for p in model.parameters()]
            return take(m, label)

        guard.ring.take = spy
        restored: list[list[torch.Tensor]] = []
        losses = []
        for step, (x, y) in enumerate(batches):
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step()
            losses.append(loss.item())
            if step == SPIKE:
                restored.append([p.detach().clone() for p in model.parameters()])
    assert spikes_of(mon) == [(SPIKE, "batch")]
    [rb] = mon.rollbacks
    # snapshots before steps 0, 10, 20, 30, 40 (every 10); the newest taken before step SPIKE - 1
    # began is the one before step 30: steps 30..40 are undone, 11 batches skipped
    assert (rb.step, rb.to_step, rb.batches_skipped) == (SPIKE, 30, 11)
    assert all(torch.equal(a, b) for a, b in zip(restored[0], saved[30]))
    assert rb.loss_before == pytest.approx(losses[SPIKE]) and rb.loss_after == pytest.approx(
        losses[SPIKE + 1]
    )
    pre = sorted(losses[SPIKE - 10 : SPIKE])[5]
    assert rb.loss_after < 3 * pre  # back at its pre-spike level, and training goes on
    assert losses[-1] < 3 * pre
    assert any(e.kind == "rollback" and e.evidence["batches_skipped"] == 11 for e in mon.events)
    assert not guard.ring.slots  # the host copies are let go with the session
    # the snapshot's cost, said once, at the first one holding Adam's state (step 10): the parameters
    # (fc1 8x16 + 16, fc2 16x4 + 4 = 212 float32) and exp_avg, exp_avg_sq (2 x 212 float32) and the
    # 4 float32 step counters: (3 * 212 + 4) * 4 = 2560 bytes
    [cost] = [e for e in mon.events if e.kind == "snapshot_cost"]
    assert (cost.step, cost.severity, cost.evidence["bytes"]) == (10, "info", 2560)


def test_rollback_lowers_the_lr_for_a_while_and_stops_after_max_rollbacks() -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    bad = {s: {1: 300.0} for s in (30, 36, 42)}
    seen: list[float] = []
    cfg = {"on_spike": "rollback", "snapshot_every": 5, "max_rollbacks": 2}
    cfg |= {"rollback_lr_scale": 0.5, "rollback_lr_steps": 2}
    with (
        pytest.warns(TorchDebugWarning),
        pytest.raises(LossSpikeError, match="after 2 rollbacks") as err,
        watched(model, opt, **cfg) as mon,
    ):
        opt.register_step_pre_hook(lambda o, a, k: seen.append(o.param_groups[0]["lr"]))
        train(mon, model, opt, data(50, bad))
    assert [r.step for r in mon.rollbacks] == [30, 36]
    assert err.value.report.step == 42 and err.value.report.cause == "batch"
    # the updates at steps 31 and 32 ran at half the lr (the hook runs after the session's pre-hook)
    assert seen[29:34] == [0.05, 0.05, 0.025, 0.025, 0.05]
    assert opt.param_groups[0]["lr"] == 0.05


def test_on_spike_raise_stops_before_the_update_and_off_reports_nothing() -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    batches = data(SPIKE + 2, {SPIKE: {3: 100.0}})
    before: dict[str, torch.Tensor] = {}
    reached = -1
    with (
        pytest.warns(TorchDebugWarning),
        pytest.raises(LossSpikeError, match="on_spike='raise'") as err,
        watched(model, opt, on_spike="raise") as mon,
    ):
        for step, (x, y) in enumerate(batches):
            reached = step
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()  # raises from its pre-hook at the spike: the update never runs
            mon.step()
    assert reached == SPIKE
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert err.value.report.cause == "batch" and err.value.report.step == SPIKE
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.warns(TorchDebugWarning), watched(model, opt, on_spike="off") as mon:
        train(mon, model, opt, batches)
    assert mon.spikes == [] and not any(i.name == "spikes" for i in mon.instruments)


def test_bad_option_names_the_allowed_values() -> None:
    with pytest.raises(ValueError, match="'warn', 'rollback', 'raise', 'off'"):
        td.watch(Net(), on_spike="undo")


# --------------------------------------------------------------------------- the pure verdict


def test_unknown_carries_the_evidence_it_looked_at() -> None:
    ev = Evidence(step=50, loss=9.0, median=1.0, sigma=0.1, mads=10.0, rows_note="no captured micro-step")
    ev.lrs = [(s, (0.1,)) for s in range(40, 50)]
    ev.group_sizes = [100]
    report = attribute(ev)
    assert report.cause == "unknown"
    assert report.evidence["batch_why"] == "no captured micro-step"
    assert "no learning rate rose 2x" in report.evidence["learning_rate_why"]
    assert report.sigmas == pytest.approx(80.0)  # (9 - 1) / 0.1


def test_a_layer_whose_gradient_norm_rose_first_is_named_with_its_step() -> None:
    ev = Evidence(step=50, loss=9.0, median=1.0, sigma=0.1, mads=10.0, rows=[9.0] * 8, reduction="mean")
    ev.lrs = [(s, (0.1,)) for s in range(30, 50)]
    ev.group_sizes = [100]
    # per-layer gradient norms: every layer ~1 until step 46, where "blocks.2" goes to 40 (40x its
    # median of 1.0); the others only follow at the spike step 50
    ev.grads = [
        (s, 1.0, {"blocks.0": 1.0, "blocks.1": 1.0, "blocks.2": 40.0 if s >= 46 else 1.0, "head": 1.0})
        for s in range(30, 50)
    ]
    report = attribute(ev)
    # the batch check looked first: all 8 rows equal, none is an outlier
    assert "no row is more than 10 sigmas" in report.evidence["batch_why"]
    assert (report.cause, report.modules, report.began) == ("layer", ("blocks.2",), 46)
    assert "gradient norm 1 -> 40 (40x its median) from step 46" in report.message


def test_rows_that_are_many_are_not_a_few_rows() -> None:
    # 9 of 32 rows at 50, the rest at 1: loss (23 + 450) / 32 = 14.78. Without the 8 highest the mean
    # is (23 + 50) / 24 = 3.04, still (3.04 - 1) / 0.1 = 20 sigmas: all 9 must go, more than 32 // 4
    rows = [1.0] * 23 + [50.0] * 9
    ev = Evidence(step=50, loss=14.78, median=1.0, sigma=0.1, mads=10.0, rows=rows, reduction="mean")
    report = attribute(ev)
    assert report.cause == "unknown"
    assert report.evidence["batch_why"] == "9 of 32 rows carry it: the whole batch, not a few rows"
    ev.rows = [1.0] * 24 + [50.0] * 8  # 8 of 32 is still a few
    assert attribute(ev).cause == "batch" and [r.index for r in attribute(ev).rows] == list(range(24, 32))


def test_a_spike_before_the_loss_recovered_from_the_last_is_the_same_incident() -> None:
    # rows as a few bad rows would make them: 2 of 32 at 50, the rest at 1 (a batch, alone)
    rows = [1.0] * 30 + [50.0] * 2
    ev = Evidence(step=47, loss=4.06, median=1.0, sigma=0.1, mads=10.0, rows=rows, reduction="mean")
    assert attribute(ev).cause == "batch"
    # ... but the loss had not come back from an optimizer_state spike at step 40 (median 0.9 then):
    # the rows measure the model that spike left, so no batch is blamed, and it is that incident
    ev.notes["unrecovered"] = {"step": 40, "cause": "optimizer_state", "median": 0.9}
    report = attribute(ev)
    assert (report.cause, report.began, report.rows) == ("optimizer_state", 40, ())
    assert report.message == (
        "the same incident as the spike at step 40 (cause optimizer_state): the loss had not come back "
        "to its median 0.9 since"
    )
    assert report.evidence["batch_why"].startswith("the loss had not come back to its median 0.9 since the")


def test_under_sync_async_the_spike_is_judged_a_step_late_and_still_rolled_back() -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)  # takes the device flag
    batches = data(SPIKE + 6, {SPIKE: {3: 300.0, 5: 300.0}})
    with (
        pytest.warns(TorchDebugWarning),
        watched(model, opt, sync="async", on_spike="rollback", snapshot_every=10) as mon,
    ):
        losses = train(mon, model, opt, batches)
    assert spikes_of(mon) == [(SPIKE, "batch")]
    assert mon.spikes[0].evidence["weights"] == "after the step's update"
    assert sorted(r.index for r in mon.spikes[0].rows) == [3, 5]  # both labels x300
    [rb] = mon.rollbacks
    assert (rb.step, rb.to_step, rb.batches_skipped) == (SPIKE, 30, 11)
    pre = sorted(losses[SPIKE - 10 : SPIKE])[5]
    assert losses[-1] < 3 * pre


def test_a_snapshot_restores_parameters_buffers_optimizer_scaler_and_rng_bitwise() -> None:
    from torchdebug.session.rollback import SnapshotRing

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)

    def step() -> None:
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    class Session:  # what the ring reads of a session
        def __init__(self) -> None:
            self.model, self.optimizer, self.scaler, self._uses_cuda = model, opt, scaler, False

    for _ in range(3):
        step()
    ring, mon = SnapshotRing(), Session()
    ring.take(mon, 3)
    state = {k: v.clone() for k, v in model.state_dict().items()}  # parameters and BatchNorm buffers
    moments = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
    scale, rng = scaler.get_scale(), torch.get_rng_state()
    for _ in range(4):
        step()
    scaler.update(7.0)  # a scale the snapshot did not have
    ring.restore(mon, ring.before(4))
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    for p, saved in zip(model.parameters(), moments):
        assert opt.state[p].keys() == saved.keys()
        assert all(torch.equal(opt.state[p][k], saved[k]) for k in saved)
    assert scaler.get_scale() == scale == 1024.0
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_layer_whose_update_ratio_jumped_on_the_last_detail_check_is_named() -> None:
    ev = Evidence(step=47, loss=9.0, median=1.0, sigma=0.1, mads=10.0, rows=[9.0] * 8, reduction="mean")
    ev.lrs = [(s, (0.1,)) for s in range(30, 47)]
    ev.group_sizes = [100]
    # detail checks every 5 steps: "mlp.fc" ~1e-3 at 20..40, then 0.2 at 45 (200x); the others stay
    ev.ratios = [
        (s, {"attn": 1e-3, "mlp.fc": 0.2 if s == 45 else 1e-3, "head": 2e-3, "emb": 1e-3})
        for s in range(20, 50, 5)
    ]
    report = attribute(ev)
    assert (report.cause, report.modules, report.began) == ("layer", ("mlp.fc",), 45)
    assert "update/weight ratio mlp.fc 0.001 -> 0.2" in report.message
    assert "after the check at step 40" in report.message


def test_under_sync_async_raise_reaches_the_loop() -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    batches = data(SPIKE + 4, {SPIKE: {3: 300.0}})
    reached = -1
    with (
        pytest.warns(TorchDebugWarning),
        pytest.raises(LossSpikeError) as err,
        watched(model, opt, sync="async", on_spike="raise") as mon,
    ):
        for step, (x, y) in enumerate(batches):
            reached = step
            loss = F.mse_loss(model(x), y)  # the step before is judged as this forward begins
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step()
    assert err.value.report.step == SPIKE and reached == SPIKE + 1
    assert err.value.report.cause == "batch"


class _Ring:
    """What the snapshot ring reads of a session: its model, every optimizer, the scaler."""

    def __init__(self, model: nn.Module, optimizers: list[Any], scaler: Any = None) -> None:
        self.model, self.optimizers, self.scaler, self._uses_cuda = model, optimizers, scaler, False
        self.optimizer = optimizers[0]


def _two_models() -> tuple[nn.Module, list[torch.optim.Optimizer], Callable[[], None]]:
    torch.manual_seed(0)
    g, d = nn.Linear(4, 4), nn.Linear(4, 1)
    og = torch.optim.Adam(g.parameters(), lr=1e-2)
    od = torch.optim.AdamW(d.parameters(), lr=1e-2)

    def step() -> None:
        loss = d(g(torch.randn(8, 4))).pow(2).mean()
        og.zero_grad()
        od.zero_grad()
        loss.backward()
        og.step()
        od.step()

    return nn.ModuleDict({"G": g, "D": d}), [og, od], step


def _opt_state(opts: list[torch.optim.Optimizer]) -> list[dict[str, torch.Tensor]]:
    return [
        {k: v.clone() for k, v in o.state[p].items()}
        for o in opts
        for g in o.param_groups
        for p in g["params"]
    ]


def test_a_rollback_restores_every_optimizer_of_the_session() -> None:
    from torchdebug.session.rollback import SnapshotRing

    model, opts, step = _two_models()
    for _ in range(3):
        step()
    ring, mon = SnapshotRing(), _Ring(model, opts)
    ring.take(mon, 3)
    params = {k: v.clone() for k, v in model.state_dict().items()}
    moments = _opt_state(opts)
    for _ in range(4):
        step()
    ring.restore(mon, ring.before(4))
    assert all(torch.equal(v, params[k]) for k, v in model.state_dict().items())
    now = _opt_state(opts)
    # both optimizers: exp_avg, exp_avg_sq and step of each of their 4 parameters, as at the snapshot
    assert [sorted(s) for s in now] == [["exp_avg", "exp_avg_sq", "step"]] * 4
    assert all(torch.equal(a[k], b[k]) for a, b in zip(now, moments) for k in a)


def test_a_param_group_added_after_the_snapshot_refuses_the_rollback_and_changes_nothing() -> None:
    from torchdebug.session.rollback import RollbackRefused, SnapshotRing

    model, opts, step = _two_models()
    step()
    ring, mon = SnapshotRing(), _Ring(model, opts)
    ring.take(mon, 1)
    extra = nn.Parameter(torch.ones(3))
    opts[1].add_param_group({"params": [extra], "lr": 1e-3})
    for _ in range(2):
        step()
    params = {k: v.clone() for k, v in model.state_dict().items()}
    moments = _opt_state(opts[:1])
    with pytest.raises(RollbackRefused) as ei:
        ring.restore(mon, ring.before(2))
    assert str(ei.value) == (
        "optimizer 2 of 2 (AdamW) has 2 param groups where the snapshot before step 1 had 1: a param "
        "group added since cannot be rolled back with the rest"
    )
    assert all(torch.equal(v, params[k]) for k, v in model.state_dict().items())  # nothing restored
    assert all(torch.equal(a[k], b[k]) for a, b in zip(_opt_state(opts[:1]), moments) for k in a)


def test_a_scaler_unknown_at_the_snapshot_refuses_the_rollback() -> None:
    from torchdebug.session.rollback import RollbackRefused, SnapshotRing

    model, opts, step = _two_models()
    step()
    ring = SnapshotRing()
    ring.take(_Ring(model, opts), 1)  # no GradScaler then (adopted later, at its first step)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with pytest.raises(RollbackRefused, match=r"the GradScaler was not known .* pass scaler= to watch\(\)"):
        ring.restore(_Ring(model, opts, scaler), ring.before(2))


def test_a_refused_rollback_is_said_and_training_goes_on() -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    batches = data(SPIKE + 5, {SPIKE: {3: 300.0, 5: 300.0}})

    def before(step: int) -> None:
        if step == SPIKE - 2:  # a group added after the last snapshot (step 30)
            opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))], "lr": 1e-3})

    with (
        pytest.warns(TorchDebugWarning) as said,
        watched(model, opt, on_spike="rollback", snapshot_every=10) as mon,
    ):
        train(mon, model, opt, batches, before)
    assert spikes_of(mon) == [(SPIKE, "batch")] and mon.rollbacks == []
    [ev] = [e for e in mon.events if e.kind == "rollback_unavailable"]
    assert ev.step == SPIKE and ev.message.startswith(
        "rollback refused: optimizer 1 of 1 (Adam) has 2 param groups where the snapshot before step 30 had 1"
    )
    assert any("rollback refused" in str(w.message) for w in said)
    assert len(mon.records) == SPIKE + 5


@dataclasses.dataclass
class RegressionOutput:
    """What a Hugging Face model returns (its ``ModelOutput`` is a dataclass): the loss it computed."""

    loss: torch.Tensor | None
    logits: torch.Tensor


class SelfLossNet(Net):
    """``model(x, labels=y).loss``: the loss is computed inside the forward, as Hugging Face models do."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> RegressionOutput:  # type: ignore[override]
        pred = super().forward(x)
        return RegressionOutput(F.mse_loss(pred, labels) if labels is not None else None, pred)


def test_rows_are_named_when_the_model_computes_the_loss_itself() -> None:
    torch.manual_seed(0)
    model = SelfLossNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    batches = data(SPIKE + 3, {SPIKE: {3: 100.0, 17: 60.0}})
    with pytest.warns(TorchDebugWarning), watched(model, opt) as mon:
        for x, y in batches:
            loss = model(x, labels=y).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step()
    assert spikes_of(mon) == [(SPIKE, "batch")]
    report = mon.spikes[0]
    # one forward per row on the row's inputs and labels: the two scaled rows, the largest first
    assert [r.index for r in report.rows] == [3, 17]
    assert report.evidence["rows"]["count"] == BATCH


def test_a_loss_the_replay_cannot_split_says_why() -> None:
    from torchdebug.nonfinite.locate import StepCapture
    from torchdebug.nonfinite.rows import row_losses

    model = Net()
    x = torch.randn(4, D_IN)
    cap = StepCapture.take((x,), {}, False)
    cap.outputs = model(x)
    cap.loss = cap.outputs.sum() * 2  # made after the forward, but no torch call was recorded
    cap.tape_complete = True
    assert row_losses(model, cap)[3] == (
        "the loss is neither one of the model's outputs nor made by torch calls after its forward"
    )
    cap.tape_complete = False
    assert row_losses(model, cap)[3] == "the loss code was not recorded"
    cap.untaped = "trace_loss is off (config.trace_loss=False)"  # what the sentinel says when it is
    assert row_losses(model, cap)[3] == (
        "the loss code was not recorded: trace_loss is off (config.trace_loss=False)"
    )

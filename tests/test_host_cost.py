"""What keeps a step's host cost low gives the same answers as the dearer way: one total per gradient
check (per-parameter numbers on demand), the parameter probe on a schedule with an exact check when
a step goes bad, and the detail steps' per-parameter numbers queued as one store record."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

import torchdebug as td
from tests.fixtures.host_reads import HostReads
from torchdebug._tensors import SMALL, Plan
from torchdebug.nonfinite.edits import _factor_bad
from torchdebug.store import Run, create_run, open_run
from torchdebug.store._aggregate import metric_stats

SENTINEL_ONLY = td.DebugConfig(mode="anomaly_detection")


def _mixed() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(5, 3, generator=g),
        torch.randn(SMALL + 1, generator=g),  # big: reduced alone
        torch.zeros(0),
        torch.randn(7, generator=g, dtype=torch.float64),
        torch.randn(SMALL, generator=g),
    ]


@pytest.mark.parametrize("square", [False, True], ids=["sums", "norms"])
def test_reduce_total_and_per_tensor_numbers_equal_one_call_per_tensor(square: bool) -> None:
    ts = _mixed()
    red = Plan(ts).reduce(ts, square=square)
    if square:
        ref = [float(torch.linalg.vector_norm(t.double())) for t in ts]
        total = sum(x * x for x in ref)
    else:
        ref = [float(t.double().sum()) for t in ts]
        total = sum(ref)
    assert float(red.total) == pytest.approx(total, rel=1e-4, abs=1e-2)
    ts[0].fill_(math.nan)  # the per-tensor numbers come from the copy taken at reduce(), not the tensors
    assert red.per().tolist() == pytest.approx(ref, rel=1e-4, abs=1e-3)


def _stacks() -> list[torch.Tensor]:
    # 20 tensors of shape (3, 2) (stacked: STACKED = 16 of one shape), 16 float64 ones of shape (4,)
    # (stacked apart: another dtype), 15 of shape (5,) (too few: flattened with the rest), interleaved
    g = torch.Generator().manual_seed(1)
    ts: list[torch.Tensor] = []
    for i in range(20):
        ts.append(torch.randn(3, 2, generator=g))
        if i < 16:
            ts.append(torch.randn(4, generator=g, dtype=torch.float64))
        if i < 15:
            ts.append(torch.randn(5, generator=g))
    ts.append(torch.randn(SMALL + 3, generator=g))  # big: reduced alone
    ts.append(torch.zeros(0))
    return ts


@pytest.mark.parametrize("square", [False, True], ids=["sums", "norms"])
def test_stacked_shapes_give_the_same_numbers_as_one_call_per_tensor(square: bool) -> None:
    ts = _stacks()
    plan = Plan(ts)
    assert [k for _, k in plan.stacks] == [20, 16]  # the (5,) tensors are 15: flattened
    if square:
        ref = [float(torch.linalg.vector_norm(t.double())) for t in ts]
        total = sum(x * x for x in ref)
    else:
        ref = [float(t.double().sum()) for t in ts]
        total = sum(ref)
    red = plan.reduce(ts, square=square)
    assert float(red.total) == pytest.approx(total, rel=1e-4, abs=1e-2)
    eager = (plan.norms(ts) if square else plan.sums(ts)).tolist()
    ts[0].fill_(math.nan)  # the per-tensor numbers come from the copies taken at reduce()
    assert red.per().tolist() == pytest.approx(ref, rel=1e-4, abs=1e-3)
    assert eager == pytest.approx(ref, rel=1e-4, abs=1e-3)


def test_the_per_parameter_norms_are_read_only_when_asked() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with td.watch(model, opt, run=False, config=td.DebugConfig(detail_every=100)) as mon:
        for _ in range(2):  # step 1: an ordinary step, one read
            opt.zero_grad()
            model(torch.randn(3, 4)).pow(2).sum().backward()
            ref = [float(torch.linalg.vector_norm(p.grad.double())) for p in model.parameters()]
            opt.step()
            with HostReads() as reads:
                rec = mon.step()
        assert reads.count == 0  # read as the update started
        with HostReads() as reads:
            per = mon.grad_norms_host  # asked for: read now, once
            again = mon.grad_norms_host
        assert reads.count == 1 and per is again
    assert per == pytest.approx(ref, rel=1e-5)
    assert rec.grad_norm == pytest.approx(math.sqrt(sum(x * x for x in ref)), rel=1e-5)


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx)).sum()


def test_a_nan_the_forward_never_reads_is_found_by_the_scheduled_probe() -> None:
    # the update of step 3 makes row 9 of the embedding NaN; the batches use rows 0-3 only, so the
    # loss and gradients stay finite: the probe after step 10's update (detail_every=10) finds it,
    # blamed on the updates since the last probe (step 0's): steps 1..10
    torch.manual_seed(0)
    model = Embed()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def poison(o: object, args: object, kwargs: object) -> None:
        if mon.global_step == 3:
            with torch.no_grad():
                model.emb.weight[9, 0] = math.nan

    opt.register_step_post_hook(poison)
    with pytest.raises(td.NonFiniteError) as ei, td.watch(model, opt, run=False, config=SENTINEL_ONLY) as mon:
        for _ in range(15):
            opt.zero_grad()
            model(torch.tensor([0, 1, 2, 3])).backward()
            opt.step()
            mon.step()
    a = ei.value.anomaly
    assert (a.step, a.phase, a.parameter) == (10, "optimizer", "emb.weight")
    assert "between steps 1 and 10" in a.hint
    assert mon.global_step == 11  # raised at step 11's read


def test_a_write_outside_the_step_is_not_blamed_on_the_update() -> None:
    # a NaN written into a weight between two steps (not by the update): step 3's loss is NaN, the
    # exact check finds the weight, but it changed after the update, so the replay names it
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(td.NonFiniteError) as ei, td.watch(model, opt, run=False, config=SENTINEL_ONLY) as mon:
        for i in range(5):
            if i == 3:
                with torch.no_grad():
                    model[2].weight[0, 1] = math.nan
            opt.zero_grad()
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            mon.step()
    a = ei.value.anomaly
    assert (a.step, a.phase, a.module) == (3, "parameter", "2")


@pytest.mark.parametrize(
    ("total", "max_norm", "bad"),
    [(1.0, 1.0, False), (math.inf, 1.0, False), (math.nan, 1.0, True), (0.5, math.nan, True),
     (0.0, 1e38, False), (math.inf, math.inf, True), (2.0, math.inf, False)],
)  # fmt: skip
def test_the_clip_factor_worked_out_on_the_host_matches_torch(
    total: float, max_norm: float, bad: bool
) -> None:
    coef = torch.clamp(max_norm / (torch.tensor(total) + 1e-6), max=1.0)  # clip_grad_norm_'s factor
    assert _factor_bad(total, max_norm) == bad == (not bool(torch.isfinite(coef)))


def _whole_run(run: Run) -> list[tuple]:
    """What the reports read of every metric: its whole-run aggregates, last point and step view."""
    stats = metric_stats(run)
    return [
        (n, sorted((k, str(v)) for k, v in stats[n].items()), str(run.at_step(10)["scalars"].get(n)))
        for n in sorted(stats)
    ]


def test_log_vector_stores_what_log_scalars_stores(tmp_path: Path) -> None:
    names = ["grad_norm/a", "grad_norm/b", "grad_norm/c"]
    data = {0: [1.0, math.nan, math.inf], 10: [0.5, 2.0, -1.0], 20: [3.0, 0.25, math.nan]}
    got = {}
    for how in ("scalars", "vector"):
        w = create_run(root=tmp_path / how, name="r", config={})
        heard: list[tuple] = []
        w.add_listener(lambda low, high, heard=heard: heard.extend(r for r in low if r[0] == "s"))
        for step, values in data.items():
            if how == "scalars":
                w.log_scalars(step, dict(zip(names, values)))
            else:
                w.log_vector(step, names, values)
            w.flush()  # one commit per step, as a detail step's numbers usually arrive
        w.close()
        run = open_run(w.path)
        got[how] = (
            {n: (run.series(n).steps, [str(x) for x in run.series(n).values]) for n in names},
            _whole_run(run),
            sorted((r[1], r[2], str(r[3])) for r in heard),
        )
        run.close()
    assert got["vector"][0] == got["scalars"][0]
    assert got["vector"][0]["grad_norm/b"] == ([0, 10, 20], ["nan", "2.0", "0.25"])
    assert got["vector"][1] == got["scalars"][1]  # the whole-run aggregates and the step view
    assert got["vector"][2] == got["scalars"][2]  # the sinks hear one scalar record per value


def test_log_vector_checks_its_input(tmp_path: Path) -> None:
    w = create_run(root=tmp_path, name="r", config={})
    try:
        with pytest.raises(TypeError, match="2 names but 1 values"):
            w.log_vector(0, ["a", "b"], [1.0])
        with pytest.raises(TypeError, match="names entry"):
            w.log_vector(0, ["a", 3], [1.0, 2.0])  # type: ignore[list-item]
        with pytest.raises(TypeError, match=r"values\[1\]"):
            w.log_vector(0, ["a", "b"], [1.0, "x"])  # type: ignore[list-item]
        w.log_vector(1, ["a", "b"], [1, 2.5])  # an int is a real number: stored as 1.0
    finally:
        w.close()
    run = open_run(w.path)
    assert run.series("a").values == [1.0] and run.series("b").values == [2.5]
    run.close()


def test_the_spike_guard_reads_its_historys_per_parameter_norms_only_when_asked() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    refs: list[list[float]] = []
    counts = []
    with td.watch(model, opt, run=False, config=td.DebugConfig(detail_every=100)) as mon:
        guard = next(i for i in mon.instruments if i.name == "spikes")
        for _ in range(3):  # step 0 is a detail step (its norms are read with it), 1 and 2 ordinary
            opt.zero_grad()
            model(torch.randn(3, 4)).pow(2).sum().backward()
            refs.append([float(torch.linalg.vector_norm(p.grad.double())) for p in model.parameters()])
            opt.step()
            with HostReads() as reads:
                mon.step()
            counts.append(reads.count)
        steps = [s for s, _, _, _ in guard.history]
        with HostReads() as reads:
            got = [later() for _, _, _, later in guard.history]
    # each step's one read ran as its update started; step 0, a detail step, reads again at its end
    # (its update's parameter probe and ratios: 2 reads on a detail step, tests/test_host_reads.py)
    assert counts == [1, 0, 0]
    assert reads.count == 2  # steps 1 and 2, read now; step 0's came with its detail read
    assert steps == [0, 1, 2]
    for norms, ref in zip(got, refs):
        assert norms == pytest.approx(ref, rel=1e-5)

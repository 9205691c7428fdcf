"""The hot path's host cost: torchdebug's blocking reads per step, and the whole-list reductions
(``torchdebug._tensors.Plan``) that replaced one torch call per parameter tensor give the same answers."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import torchdebug as td
from tests.fixtures.host_reads import HostReads
from tests.fixtures.launch_models import GPT2, WORKLOADS, train_step
from torchdebug._tensors import SMALL, Plan

SENTINEL_ONLY = td.DebugConfig(mode="anomaly_detection")


def _reads_per_step(config: td.DebugConfig, steps: int) -> list[int]:
    """torchdebug's reads in each step of a GPT-2-shaped loop (2 blocks, tied embeddings, AdamW
    foreach, clip_grad_norm_ every step, zero_grad between the loss and backward)."""
    w = WORKLOADS["gpt2"]
    torch.manual_seed(0)
    model = GPT2(n_layer=2)
    opt = w.optimizer(model)
    g = torch.Generator().manual_seed(0)
    batch = w.batch(g)
    counts = []
    with td.watch(model, opt, run=False, config=config) as mon:
        for _ in range(steps):
            with HostReads() as reads:
                train_step(w, model, opt, batch)
                mon.step()
            counts.append(reads.count)
    return counts


def test_default_watch_reads_once_per_ordinary_step_and_twice_on_detail_steps() -> None:
    # detail_every=10: steps 0 and 10 also read the update/weight ratios, which exist only after the
    # optimizer step (a second read at mon.step()); every other step reads once, at the update
    counts = _reads_per_step(td.DebugConfig(), 12)
    assert counts == [2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 1]


def test_sentinel_alone_reads_once_per_step_and_mode_none_never() -> None:
    assert _reads_per_step(SENTINEL_ONLY, 11) == [1] * 11
    assert _reads_per_step(td.DebugConfig(mode="none"), 3) == [0, 0, 0]


def test_the_reads_are_counted_where_torchdebug_makes_them() -> None:
    # the counter itself: torchdebug's read is seen, the user's own .item() is not
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with td.watch(model, opt, run=False, config=SENTINEL_ONLY) as mon, HostReads() as reads:
        loss = model(torch.ones(2, 3)).sum()
        loss.backward()
        assert loss.item() == loss.detach().tolist()  # two reads of the user's, not counted
        opt.step()
        mon.step()
    assert reads.count == 1 and reads.sites == ["torchdebug.session.transfer:read:tolist"]


# -- the whole-list reductions ---------------------------------------------------------------------
def _mixed() -> list[torch.Tensor]:
    # small (<= SMALL elements, reduced together), big (alone), empty, in a shuffled order
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(5, 3, generator=g),
        torch.randn(SMALL + 1, generator=g),  # big
        torch.zeros(0),
        torch.randn(7, generator=g, dtype=torch.float64),
        torch.randn(200, 200, generator=g),  # 40,000 > SMALL: big
        torch.randn(SMALL, generator=g),  # exactly SMALL: small
    ]


def test_plan_norms_and_sums_match_one_call_per_tensor() -> None:
    ts = _mixed()
    plan = Plan.build(ts)
    assert plan is not None and plan.small == [0, 3, 5] and plan.big == [1, 4] and plan.empty == 1
    ref_norms = torch.stack([torch.linalg.vector_norm(t.double()).float() for t in ts])
    ref_sums = torch.stack([t.double().sum().float() for t in ts])
    torch.testing.assert_close(plan.norms(ts), ref_norms, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(plan.sums(ts), ref_sums, rtol=1e-4, atol=1e-3)


def test_plan_update_norms_are_the_change_and_the_weights_now_with_one_copy(copies: list[int]) -> None:
    ts = _mixed()
    plan = Plan.build(ts)
    assert plan is not None
    before = [t.clone() for t in ts]
    snap = plan.snapshot(ts)  # one copy: the small tensors first (list order), then the big ones
    assert copies == [1, sum(t.numel() for t in ts)]
    small = [0, 2, 3, 5]  # 15 | 0 | 7 | SMALL elements; big: 1, 4 (SMALL + 1, 40,000)
    # (float64: torch.cat promotes to the float64 tensor's dtype)
    assert torch.equal(snap, torch.cat([ts[i].reshape(-1).double() for i in [*small, 1, 4]]))
    g = torch.Generator().manual_seed(1)
    for t in ts:
        t.add_(torch.randn(t.shape, generator=g, dtype=t.dtype), alpha=0.01)  # the "update"
    delta, weight = plan.update_norms(snap, ts)
    # one more copy, of the small tensors only: 15 + 0 + 7 + SMALL elements
    assert copies == [2, sum(t.numel() for t in ts) + 22 + SMALL]
    ref_delta = torch.stack([torch.linalg.vector_norm((a - b).double()).float() for a, b in zip(ts, before)])
    ref_weight = torch.stack([torch.linalg.vector_norm(t.double()).float() for t in ts])
    torch.testing.assert_close(delta, ref_delta, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(weight, ref_weight, rtol=1e-5, atol=1e-6)
    assert delta[2].item() == weight[2].item() == 0.0  # the empty tensor


@pytest.mark.parametrize("k", [0, 1, 3, 4, 5], ids=["small", "big", "float64", "big-2d", "small-edge"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_plan_update_norms_flag_exactly_the_non_finite_tensor(k: int, value: float) -> None:
    ts = _mixed()
    plan = Plan.build(ts)
    assert plan is not None
    snap = plan.snapshot(ts)
    ts[k].view(-1)[2] = value  # the update wrote a NaN/Inf into tensor k
    delta, weight = (x.tolist() for x in plan.update_norms(snap, ts))
    assert [i for i, x in enumerate(delta) if not math.isfinite(x)] == [k]
    assert [i for i, x in enumerate(weight) if not math.isfinite(x)] == [k]


@pytest.mark.parametrize("k", [0, 1, 3, 4, 5], ids=["small", "big", "float64", "big-2d", "small-edge"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_plan_flags_exactly_the_non_finite_tensor(k: int, value: float) -> None:
    ts = _mixed()
    ts[k].view(-1)[2] = value
    plan = Plan.build(ts)
    assert plan is not None
    norms, sums = plan.norms(ts).tolist(), plan.sums(ts).tolist()
    assert [i for i, x in enumerate(norms) if not math.isfinite(x)] == [k]
    assert [i for i, x in enumerate(sums) if not math.isfinite(x)] == [k]
    assert math.isnan(sums[k]) == math.isnan(value)  # a sum keeps the kind: the NaN/Inf reported


def test_plan_is_none_where_the_general_path_must_run() -> None:
    assert Plan.build([]) is None
    assert Plan.build([torch.ones(2), torch.ones(2, dtype=torch.complex64)]) is None
    assert Plan.build([torch.ones(2), torch.ones(2, dtype=torch.long)]) is None
    assert Plan.build([torch.ones(2).to_sparse()]) is None


class Mixed(nn.Module):
    """Parameters on both sides of SMALL: fc.weight 256 x 256 = 65,536 elements (big), the rest small."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 256)
        self.fc = nn.Linear(256, 256)
        self.norm = nn.LayerNorm(256)
        self.out = nn.Linear(256, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(torch.relu(self.fc(self.inp(x)))))


@pytest.mark.parametrize("name", ["fc.weight", "norm.bias", "out.weight"])
def test_an_update_that_makes_one_parameter_nan_names_it(name: str) -> None:
    # the parameter probe after each update (the plan's sums) flags it; the exact check names it
    torch.manual_seed(0)
    model = Mixed()
    param = model.get_parameter(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def poison(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if mon.global_step == 2:
            with torch.no_grad():
                param.view(-1)[3] = math.nan  # the update itself made it non-finite

    opt.register_step_post_hook(poison)
    with pytest.raises(td.NonFiniteError) as ei, td.watch(model, opt, run=False, config=SENTINEL_ONLY) as mon:
        for _ in range(4):
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            mon.step()
    a = ei.value.anomaly
    # probed after step 2's update, read with step 3's transfer, named with the step of the update
    assert (a.step, a.phase, a.parameter, a.module, a.kind) == (
        2,
        "optimizer",
        name,
        name.rpartition(".")[0],
        "nan",
    )


@pytest.mark.parametrize("name", ["fc.weight", "inp.bias"])
def test_a_gradient_edited_in_place_after_backward_is_named(name: str) -> None:
    # the edit check compares the gradients and their versions in one pass; the edited one is probed
    torch.manual_seed(0)
    model = Mixed()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        pytest.raises(td.NonFiniteError) as ei,
        td.watch(model, opt, run=False, config=td.DebugConfig()) as mon,
    ):
        for i in range(4):
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            if i == 1:
                model.get_parameter(name).grad.view(-1)[0] = math.inf  # an in-place edit: version bumps
            opt.step()
            mon.step()
    a = ei.value.anomaly
    assert (a.step, a.phase, a.parameter, a.kind) == (1, "gradient_edit", name, "inf")
    assert mon.counters["replays"] == 0  # backward() was measured finite: nothing to replay


def test_norms_read_in_one_go_equal_the_reference_and_the_clip_shares_are_worked_out_on_read() -> None:
    torch.manual_seed(0)
    model = Mixed()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with td.watch(model, opt, run=False, config=td.DebugConfig()) as mon:
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(4, 8)).pow(2).sum().backward()
            ref = [float(torch.linalg.vector_norm(p.grad.double())) for p in model.parameters()]
            total = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))  # clips nothing
            opt.step()
            rec = mon.step()
        health = next(i for i in mon.instruments if type(i).__name__ == "GradientHealth")
        assert mon.grad_norms_host == pytest.approx(ref, rel=1e-5)
        assert rec.grad_norm == pytest.approx(math.sqrt(sum(x * x for x in ref)), rel=1e-5)
        assert rec.grad_norm == pytest.approx(total, rel=1e-5)
        shares = health.last_clip["shares"]
    # the largest shares of the squared norm, largest first, as many as TOP_K (3) allow
    sq = {n: x * x for n, x in zip(mon.param_names, ref)}
    top = sorted(sq, key=lambda n: -sq[n])[:3]
    assert list(shares) == top
    assert shares[top[0]] == pytest.approx(sq[top[0]] / sum(sq.values()), rel=1e-4)
    assert not any(k.startswith(("_gnorm", "health.ratio")) for k in rec.values)  # no key per parameter


@pytest.mark.parametrize(
    ("items", "sizes", "values"),
    [
        # an ordinary step: 0-d items only (one stack), a loss, a gradient total, a bool flag and a
        # count promoted to floats as cat promotes them
        (
            [
                ("_loss", torch.tensor(1.5)),
                ("_mtot", torch.tensor(-2.0)),
                ("_mbad", torch.tensor(True)),
                ("n", torch.tensor(3)),
            ],
            [1, 1, 1, 1],
            [1.5, -2.0, 1.0, 3.0],
        ),
        # a detail step: a 1-d item among the 0-d ones (cat)
        (
            [
                ("_loss", torch.tensor(0.25)),
                ("_gnorm", torch.tensor([3.0, 4.0])),
                ("_mbad", torch.tensor(False)),
            ],
            [1, 2, 1],
            [0.25, 3.0, 4.0, 0.0],
        ),
        ([("_loss", torch.tensor(7.0))], [1], [7.0]),  # one item: a view, no copy
        ([("_mbad", torch.tensor(True)), ("_mbad", torch.tensor(False))], [1, 1], [1.0, 0.0]),  # flags only
    ],
    ids=["zero-d", "with-a-vector", "one", "flags-only"],
)
def test_the_reads_items_flatten_in_order_with_floats(
    items: list[tuple[str, torch.Tensor]], sizes: list[int], values: list[float]
) -> None:
    from torchdebug._tensors import flat_items

    got_sizes, flat = flat_items(items)
    assert got_sizes == sizes
    assert flat.is_floating_point() and flat.dim() == 1
    assert flat.tolist() == values

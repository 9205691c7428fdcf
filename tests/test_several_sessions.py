"""Two watch() sessions in one process are independent: each sees its own model's backward, its own
optimizer's update, and a replay in one never disturbs torch's hook tables while they are iterated."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

import torchdebug as td
from tests.fixtures import models as fx
from tests.fixtures.models import origin_line

SENTINEL_ONLY = td.DebugConfig(mode="anomaly_detection")
K = 2  # the step whose input to the second model is all zeros: 0/0 in its forward


def _two_sessions(policy: str) -> tuple[td.Monitor, td.Monitor, list[torch.Tensor]]:
    torch.manual_seed(0)
    a, b = fx.MLP(), fx.ZeroDivNet()
    oa = torch.optim.SGD(a.parameters(), lr=0.01)
    ob = torch.optim.SGD(b.parameters(), lr=0.01)
    with (
        td.watch(a, oa, run=False, config=SENTINEL_ONLY, policy=policy) as ma,
        td.watch(b, ob, run=False, config=SENTINEL_ONLY, policy=policy) as mb,
    ):
        for i in range(5):
            oa.zero_grad()
            a(torch.randn(4, 8)).pow(2).mean().backward()
            oa.step()
            ma.step()
            ob.zero_grad()
            b(torch.zeros(3, 4) if i == K else torch.randn(3, 4)).pow(2).mean().backward()
            ob.step()
            mb.step()
    return ma, mb, list(a.parameters())


@pytest.mark.parametrize("policy", ["skip", "warn"])
def test_a_nan_in_the_second_session_stays_there(policy: str) -> None:
    with pytest.warns(td.TorchDebugWarning) as said:
        ma, mb, a_params = _two_sessions(policy)
    assert any("nan born in forward of ZeroDivNet: aten.div" in str(w.message) for w in said)
    first = mb.anomalies[0]
    assert (first.step, first.phase, first.op, first.location) == (
        K,
        "forward",
        "aten.div",
        origin_line("div"),
    )
    # skip: the bad update never ran; warn: it ran, so the second model's weights are NaN from then on
    # (said as such, as with one session)
    assert [x.step for x in mb.anomalies] == ([K] if policy == "skip" else [K, K + 1, K + 2])
    assert ma.anomalies == [] and ma.counters["replays"] == 0
    assert [r.skipped for r in ma.records] == [False] * 5
    assert all(r.loss is not None and r.loss == r.loss for r in ma.records)  # its own, finite losses
    assert all(torch.isfinite(p).all() for p in a_params)


def test_raise_names_the_origin_in_the_second_session() -> None:
    with pytest.raises(td.NonFiniteError) as ei:
        _two_sessions("raise")
    x = ei.value.anomaly
    assert (x.step, x.phase, x.module_type, x.op, x.location) == (
        K,
        "forward",
        "ZeroDivNet",
        "aten.div",
        origin_line("div"),
    )


def test_a_replay_under_a_hook_registered_after_watch_does_not_break_the_update() -> None:
    # torch iterates its global optimizer hooks while ours runs; a replay there used to add the
    # tracer's hooks to that very table, so a user's hook after ours made opt.step() raise
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    torch.manual_seed(0)
    model = fx.ZeroDivNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen: list[int] = []
    handle: Any = None
    try:
        with (
            pytest.warns(td.TorchDebugWarning) as said,
            td.watch(model, opt, run=False, config=SENTINEL_ONLY, policy="skip") as mon,
        ):
            handle = register_optimizer_step_pre_hook(lambda o, a, k: seen.append(mon.global_step))
            for i in range(4):
                opt.zero_grad()
                model(torch.zeros(3, 4) if i == K else torch.randn(3, 4)).pow(2).mean().backward()
                opt.step()
                mon.step()
    finally:
        with contextlib.suppress(Exception):
            handle.remove()
    assert seen == [0, 1, 2, 3]  # the user's hook ran at every update, the bad one included
    assert [a.step for a in mon.anomalies] == [K]
    assert any("nan born in forward of ZeroDivNet" in str(w.message) for w in said)

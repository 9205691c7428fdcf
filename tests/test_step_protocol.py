"""The step protocol as an instrument sees it: which boundary, in which order, with what already read."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import torchdebug as td


class Recorder:
    """An instrument that logs each boundary and whether the step's transfer has run by then."""

    name = "recorder"

    def __init__(self) -> None:
        self.log: list[tuple[str, int, bool]] = []

    def _note(self, mon: Any, what: str) -> None:
        self.log.append((what, mon.global_step, mon.transfer.synced))

    def on_forward_start(self, mon: Any, module: Any, args: Any, kwargs: Any) -> None:
        self._note(mon, "forward_start")

    def on_forward_end(self, mon: Any, module: Any, output: Any) -> None:
        self._note(mon, "forward_end")

    def on_backward_start(self, mon: Any, loss: Any) -> None:
        self._note(mon, "backward_start")

    def on_backward_end(self, mon: Any) -> None:
        self._note(mon, "backward_end")

    def collect(self, mon: Any) -> dict[str, torch.Tensor]:
        self._note(mon, "collect")
        return {}

    def before_optimizer_step(self, mon: Any) -> None:
        self._note(mon, "before_update")

    def after_optimizer_step(self, mon: Any) -> None:
        self._note(mon, "after_update")

    def on_step_end(self, mon: Any, record: Any, values: Any) -> None:
        self.log.append(("step_end", mon.global_step, "loss" in values))


def _setup() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return model, opt, torch.randn(8, 4), torch.randn(8, 1)


MICRO = [
    ("forward_start", 0, False),
    ("forward_end", 0, False),
    ("backward_start", 0, False),
    ("backward_end", 0, False),
]


def test_plain_loop_with_accumulation_gives_each_boundary_once_in_order(tmp_path: Any) -> None:
    model, opt, x, y = _setup()
    rec = Recorder()
    with td.watch(model, opt, run=False) as mon:
        mon.instruments.append(rec)
        for _ in range(2):
            for half in (x[:4], x[4:]):  # two micro-steps per update
                nn.functional.mse_loss(model(half), y[:4]).backward()
            opt.step()
            opt.zero_grad()
            mon.step()
    one = [
        *MICRO,
        *MICRO,
        ("collect", 0, False),  # inside the transfer that runs as the update starts
        ("before_update", 0, True),  # the verdict is in before any instrument sees the update
        ("after_update", 0, True),
        ("collect", 0, True),  # mon.step(): numbers made after the update (one more read on detail steps)
        ("step_end", 0, True),
    ]
    second = [(what, 1, synced) for what, _, synced in one]
    # at exit, one more read: the last update's parameter probe
    assert rec.log == [*one, *second, ("collect", 2, False)]
    assert mon.global_step == 2 and [r.micro_steps for r in mon.records] == [2, 2]


def test_a_framework_driver_owns_the_update_boundaries() -> None:
    model, opt, x, y = _setup()
    rec = Recorder()
    with td.watch(model, opt, run=False) as mon:
        mon.driver = "test"  # the optimizer hooks stand down: this loop announces the update itself
        mon.instruments.append(rec)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()  # not a boundary now
        assert [w for w, _, _ in rec.log] == [
            "forward_start",
            "forward_end",
            "backward_start",
            "backward_end",
        ]
        mon.update_starting(opt)
        mon.update_done(opt)
        mon.step()
    assert [w for w, _, _ in rec.log][4:] == [
        "collect",
        "before_update",
        "after_update",
        "collect",
        "step_end",
        "collect",  # at exit: the last update's parameter probe
    ]


def test_a_nan_is_judged_before_the_instruments_see_the_update() -> None:
    model, opt, x, y = _setup()
    rec = Recorder()
    with td.watch(model, opt, run=False, policy="warn") as mon:
        mon.instruments.append(rec)
        x_bad = x.clone()
        x_bad[0, 0] = float("nan")
        nn.functional.mse_loss(model(x_bad), y).backward()
        seen: dict[str, Any] = {}
        rec.before_optimizer_step = lambda m: seen.update(anomaly=m.sentinel.step_anomaly)  # type: ignore[method-assign]
        with pytest.warns(td.TorchDebugWarning, match="nan born in input"):
            opt.step()
        mon.step()
    a = seen["anomaly"]
    assert (a.phase, a.step) == ("input", 0)
    assert mon.counters["anomaly_steps"] == 1

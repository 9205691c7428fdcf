"""A learning rate lowered on purpose (a cosine or linear decay's tail) is not "too low"."""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from torchdebug.health.instrument import UpdateRatioRule
from torchdebug.session.monitor import watch


def test_the_rule_knows_a_schedule_lowered_the_rate() -> None:
    # cosine from 0.1 to 0 over 100 steps; the update/weight ratio follows the rate: 1e-3 x lr / 0.1,
    # so it drops under 1e-5 once lr < 1e-3 (the last ~10 steps of the cosine)
    rule = UpdateRatioRule(1e-5, 1e-1, patience=2)
    said = []
    for step in range(100):
        lr = 0.05 * (1 + math.cos(math.pi * step / 100))
        rule.see_lr([lr])
        if (e := rule.update(step, {"fc.weight": 1e-2 * lr}, {"fc.weight": 2})) is not None:
            said.append(e)
    assert said == [] and rule.scheduled_down
    # the same small updates at a constant rate: said once, with what to check
    flat = UpdateRatioRule(1e-5, 1e-1, patience=2)
    for step in range(5):
        flat.see_lr([1e-4])
        e = flat.update(step, {"fc.weight": 1e-6}, {"fc.weight": 2})
        if step == 1:
            assert e is not None and e.message.endswith(
                "each update moved them by less than 1e-05 of their norm at 2 detail checks in a row. Check "
                "first that their learning rate is the one intended and that they get a gradient"
            )
    # too-large updates are said whatever the schedule did
    assert rule.update(100, {"fc.weight": 0.5}, {"fc.weight": 2}) is None  # patience 2
    big = rule.update(101, {"fc.weight": 0.5}, {"fc.weight": 2})
    assert big is not None and "each update was larger than 0.1x the weight itself" in big.message


def _loop(sched: str) -> list[str]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05 if sched != "tiny" else 1e-7)
    steps, decay = 120, 60  # the decay reaches its floor (1e-5 of the peak) at step 60 and stays there
    if sched == "cosine":
        scheduler: object = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: max(1e-5, 0.5 * (1 + math.cos(math.pi * min(s, decay) / decay)))
        )
    elif sched == "linear":
        scheduler = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 1e-5, total_iters=decay)
    else:
        scheduler = None
    x, y = torch.randn(256, 16), torch.randn(256, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with watch(model, opt, run=False, config={"detail_every": 4}) as mon:
            for step in range(steps):
                i = (step * 32) % 256
                loss = F.mse_loss(model(x[i : i + 32]), y[i : i + 32])
                opt.zero_grad()
                loss.backward()
                opt.step()
                if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
                    scheduler.step()
                mon.step()
    # a load burst from other processes on a shared machine may be said (slowdown); nothing else
    assert [
        str(w.message)
        for w in caught
        if "update_ratio" not in str(w.message) and "slowdown" not in str(w.message)
    ] == []
    return [e.message for e in mon.events if e.kind == "update_ratio"]


def test_the_tail_of_a_real_decay_is_healthy() -> None:
    # cosine and linear decay of a real MLP's rate to 1e-5 of its peak, then 60 steps at that floor:
    # updates of ~1e-8 of the weights, by design
    assert _loop("cosine") == []
    assert _loop("linear") == []
    # a rate that is tiny from the start: said
    (said,) = _loop("tiny")
    assert said.endswith(
        "Check first that their learning rate is the one intended and that they get a gradient"
    )

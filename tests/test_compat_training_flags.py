"""Seed 000's training flags each start the instrument that records what they name (none is ignored)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchdebug as td
from torchdebug.store import open_run


@pytest.mark.parametrize("flag", ["debug_lr_scheduling", "debug_early_stopping", "debug_validation"])
def test_flag_alone_starts_training_health_and_the_sentinel(flag: str) -> None:
    cfg = td.DebugConfig(mode="none", **{flag: True})
    details = {"step_details"} if flag != "debug_early_stopping" else set()  # what the flag names
    assert cfg.instruments() == frozenset({"nonfinite", "gradients"} | details)


def test_debug_lr_scheduling_alone_records_the_schedule(tmp_path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    cfg = {"mode": "none", "debug_lr_scheduling": True, "run_dir": str(tmp_path)}
    with td.watch(model, opt, config=cfg) as mon:
        for _ in range(5):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
            mon.step()
            sched.step()
    # the LR is read at mon.step(), before sched.step(): 0.1 for steps 0-2, 0.05 from step 3
    changes = [(e.step, e.kind) for e in mon.events if e.kind == "lr_change"]
    assert changes == [(3, "lr_change")]
    with open_run(mon.run_dir) as run:
        assert run.series("lr/0").values == pytest.approx([0.1, 0.1, 0.1, 0.05, 0.05])


def test_debug_validation_alone_records_observed_values(tmp_path) -> None:
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"mode": "none", "debug_validation": True, "run_dir": str(tmp_path)}
    with td.watch(model, opt, config=cfg) as mon:
        for val in (0.9, 0.7):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
            mon.observe("val_loss", val)
            mon.step()
    with open_run(mon.run_dir) as run:
        s = run.series("observe/val_loss")
        assert (list(s.steps), list(s.values)) == ([0, 1], pytest.approx([0.9, 0.7]))

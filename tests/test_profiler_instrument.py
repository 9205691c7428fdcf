"""The profiler instrument inside watch(): a bounded trace and a summary land in the run folder."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import torchdebug as td
from tests.fixtures import models as fx


def test_profiling_mode_profiles_three_steps_and_stores_trace_and_summary(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = fx.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with td.watch(model, opt, run=tmp_path, config=td.DebugConfig(mode="profiling")) as mon:
        for _ in range(7):
            model(torch.randn(8, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
    prof = next(i for i in mon.instruments if i.name == "profiler")
    assert prof.summary.steps == 3  # wait 1 + warmup 1, then 3 active steps
    assert any(o.name == "aten::addmm" and o.calls == 6 for o in prof.summary.top_ops)  # 2 Linear x 3 steps
    trace = json.loads((mon.run_dir / "profile-trace.json").read_text())
    assert trace["traceEvents"]
    assert "aten::addmm" in (mon.run_dir / "profile-summary.txt").read_text()
    (event,) = td.open_run(mon.run_dir).events(kind="profile")
    assert event["severity"] == "info" and event["step"] == 4  # emitted at the end of the 5th step

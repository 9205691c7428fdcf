"""Seed-era summaries: counted from the kinds the real rules emit; one source per response."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

import torchdebug as td  # noqa: E402
from tests.fixtures import health_models as hm  # noqa: E402
from torchdebug._errors import TorchDebugWarning  # noqa: E402
from torchdebug.events import rule_counts  # noqa: E402
from torchdebug.health.instrument import LossPlateauRule, LossSpikeRule, VanishingRule  # noqa: E402
from torchdebug.views.server import serve  # noqa: E402

CFG = {"mode": "gradient_checking", "detail_every": 5, "policy": "warn"}
FAULT_STEP, STEPS = 40, 43


def _exploding_run(mon: Any, model: hm.ExplodingNet, opt: torch.optim.Optimizer) -> None:
    def fault(step: int) -> None:
        model.fault = step == FAULT_STEP

    hm.train(mon, model, opt, STEPS, before_step=fault)


def test_rule_counts_counts_the_kinds_the_rules_emit() -> None:
    vanish = VanishingRule(threshold=1e-8, patience=1).update(0, {"fc": 0.0})
    spike = None
    rule = LossSpikeRule(mads=3.0, warmup=5)
    for step, loss in enumerate([1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 1.0, 500.0]):
        spike = rule.update(step, loss) or spike
    plateau = None
    flat = LossPlateauRule(window=4, rel=1e-3)
    for step in range(12):
        plateau = flat.update(step, 1.0) or plateau
    assert vanish is not None and spike is not None and plateau is not None
    assert rule_counts([vanish.kind, spike.kind, plateau.kind, "memory_leak"]) == (0, 1, 2)
    assert rule_counts(["exploding_gradients", "explode"]) == (0, 0, 0)  # not kinds the engine emits


def test_stored_run_of_a_real_exploding_model(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = hm.ExplodingNet(blowup=1e4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.warns(TorchDebugWarning), td.watch(model, opt, config=CFG, run=tmp_path) as mon:
        _exploding_run(mon, model, opt)
    kinds = [e.kind for e in mon.events]
    assert kinds.count("gradient_explosion") == 1
    live = mon.training_summary()
    assert live["gradient_explosions"] == 1
    assert live["gradient_explosion_rate"] == 1 / STEPS
    with serve(tmp_path, port=0) as h, httpx.Client(base_url=h.url, timeout=30) as c:
        ts = c.get("/training-logs/debug/training/summary").json()
        s = c.get("/training-logs/debug/summary").json()
    assert ts == live  # the stored run and the finished live session agree exactly
    assert ts["total_steps"] == STEPS and ts["gradient_explosions"] == 1
    assert s["training_debugger"]["gradient_explosion_rate"] == 1 / STEPS


def test_live_summary_is_one_source_per_response(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = hm.ExplodingNet(blowup=1e4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def poison(step: int) -> None:
        if step == 11:  # a NaN weight before the last step: one anomaly (policy warn)
            with torch.no_grad():
                model.out.bias[0] = math.nan

    with pytest.warns(TorchDebugWarning), td.watch(model, opt, config=CFG, run=tmp_path) as mon:
        hm.train(mon, model, opt, 12, before_step=poison)
        with serve(mon, port=0) as h, httpx.Client(base_url=h.url, timeout=30) as c:
            s = c.get("/training-logs/debug/summary").json()
            ts = c.get("/training-logs/debug/training/summary").json()
        live_anomalies, live_events = len(mon.anomalies), len(mon.events)
    assert live_anomalies == 1
    assert s["general_debugger"] == {"total_anomalies": live_anomalies, "debug_history_length": live_events}
    assert s["training_debugger"]["total_anomalies"] == ts["anomaly_steps"]
    assert ts["total_steps"] == 12


def test_serving_the_seeds_training_debugger(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = hm.ExplodingNet(blowup=1e4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    dbg = td.TrainingDebugger(td.DebugLevel.ADVANCED)
    with serve(dbg, port=0) as h, httpx.Client(base_url=h.url, timeout=30) as c:
        for step, (x, y) in enumerate(hm.batches(STEPS)):  # the seed's loop (explosions are logged)
            model.fault = step == FAULT_STEP
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            info = dbg.monitor_training_step(model, loss, step)
            if not info["gradient_explosion"]:
                opt.step()
        ts = c.get("/training-logs/debug/training/summary")
        s = c.get("/training-logs/debug/summary")
        assert ts.status_code == 200 and s.status_code == 200
        assert ts.json() == dbg.get_training_summary()
        assert ts.json()["total_steps"] == STEPS and ts.json()["gradient_explosions"] == 1
        assert s.json()["training_debugger"]["gradient_explosion_rate"] == 1 / STEPS
        assert s.json()["general_debugger"] == {"total_anomalies": 0, "debug_history_length": 1}
        assert c.post("/training-logs/debug/level/expert").json()["level"] == "expert"
        assert dbg.level is td.DebugLevel.EXPERT
        assert c.post("/training-logs/debug/clear").json()["step"] == 0
        assert c.get("/training-logs/debug/training/summary").json()["total_steps"] == 0
        assert c.get("/api/runs").json() == {"runs": []}


@pytest.mark.parametrize("obj", [td.PyTorchDebugger(), object()], ids=["PyTorchDebugger", "object"])
def test_serve_refuses_what_it_cannot_summarize(obj: Any) -> None:
    with pytest.raises(TypeError, match=re.escape("pass a td.watch() Monitor, a TrainingDebugger")):
        serve(obj, port=0)


def test_serve_refuses_a_manager_naming_its_run_folder() -> None:
    with pytest.raises(TypeError, match=re.escape("manager.training_logger.path")):
        serve(td.PyTorchDebugManager(), port=0)

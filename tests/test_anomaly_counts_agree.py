"""One definition of anomaly counts: a live session, its stored run, its REST summaries and the seed's
``TrainingDebugger`` count the same anomalous steps for the same losses and gradients."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchdebug as td
from torchdebug.compat import TrainingDebugger
from torchdebug.events import is_anomalous
from torchdebug.store import open_run

pytest.importorskip("fastapi")  # the dashboard extra: its summaries are one of the paths compared

from torchdebug.views.server import serve
from torchdebug.views.server._app import training_summary_from_run

SPIKES = (25, 29, 33, 37, 41)  # loss (and gradients) x1000 at these steps: 5 warning-level episodes
STEPS = 45


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 6, generator=g), torch.randn(16, 1, generator=g)) for _ in range(STEPS)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


def test_is_anomalous_is_one_rule() -> None:
    assert is_anomalous(object()) and is_anomalous(None, ["warning"]) and is_anomalous(None, ["error"])
    assert not is_anomalous(None, ["info", "info"]) and not is_anomalous(None)


def test_every_summary_path_counts_the_same_steps(tmp_path: Path) -> None:
    cfg = td.DebugConfig(level="advanced", run_dir=str(tmp_path))
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    with pytest.warns(td.TorchDebugWarning), td.watch(model, opt, policy="warn", config=cfg) as mon:
        for i, (x, y) in enumerate(_batches()):
            loss = F.mse_loss(model(x), y) * (1000.0 if i in SPIKES else 1.0)
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step()
        live = mon.training_summary()
        with serve(mon, port=0) as h, httpx.Client(base_url=h.url) as c:
            rest = c.get("/training-logs/debug/summary").json()["training_debugger"]
            rest_training = c.get("/training-logs/debug/training/summary").json()
        run_dir = mon.run_dir
    with open_run(run_dir) as run:
        stored = training_summary_from_run(run)

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    dbg = TrainingDebugger(cfg)
    for i, (x, y) in enumerate(_batches()):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y) * (1000.0 if i in SPIKES else 1.0)
        loss.backward()
        dbg.monitor_training_step(model, loss, i)
        opt.step()
    seed = dbg.get_training_summary()

    assert live["total_steps"] == stored["total_steps"] == seed["total_steps"] == STEPS
    assert live["anomaly_steps"] == len(SPIKES), live
    assert stored["anomaly_steps"] == seed["anomaly_steps"] == rest_training["anomaly_steps"] == len(SPIKES)
    assert rest["total_anomalies"] == len(SPIKES) and rest["anomaly_rate"] == pytest.approx(5 / 45)
    assert live == rest_training

"""Seed 001's manager loop with ``setup_training_logging``: a NaN batch is phase input in the run folder,
and the reports of the run are the numbers the loop produced."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

import torchdebug as td
from torchdebug import DebugConfig, DebugLevel, DebugMode, PyTorchDebugManager
from torchdebug.store import open_run
from torchdebug.views.report import render_report
from torchdebug.views.report._data import build_report


def _loader(nan_at: int | None = None, n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = [(torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]
    if nan_at is not None:
        out[nan_at][0][1, 4] = float("nan")
    return out


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))


CONFIGS = {
    "anomaly-detection-basic": DebugConfig(enable_anomaly_detection=True, level=DebugLevel.BASIC),
    "anomaly-detection-advanced": DebugConfig(enable_anomaly_detection=True, level=DebugLevel.ADVANCED),
    "anomaly-mode-expert": DebugConfig(
        mode=DebugMode.ANOMALY_DETECTION, level=DebugLevel.EXPERT, enable_anomaly_detection=True
    ),
    "plain": DebugConfig(),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_nan_input_batch_is_phase_input_and_reaches_the_run(name: str, tmp_path: Path) -> None:
    config = CONFIGS[name].replace(run_dir=str(tmp_path))
    debug_manager = PyTorchDebugManager(config)
    debug_manager.setup_training_logging("debug_experiment")
    model = _model()
    optimizer = torch.optim.Adam(model.parameters())
    loss_fn = nn.CrossEntropyLoss()
    seen = []
    with pytest.warns(td.TorchDebugWarning, match="input"):  # warn mode: said once, training goes on
        for batch_idx, (data, target) in enumerate(_loader(nan_at=1)):
            before = [p.detach().clone() for p in model.parameters()]
            metrics = debug_manager.debug_training_step(
                model, optimizer, loss_fn, data, target, epoch=0, batch=batch_idx
            )
            seen.append(metrics)
            if batch_idx == 1:
                assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    run_dir = debug_manager.training_logger.path
    debug_manager.close()
    assert [m["skipped"] for m in seen] == [False, True, False, False]
    a = seen[1]["anomaly"]
    assert a is not None and (a.phase, a.module, a.op, a.step) == ("input", "", None, 1)
    with open_run(run_dir) as run:
        (stored,) = run.anomalies()
        assert (stored["phase"], stored["step"]) == ("input", 1)


def test_report_of_a_manager_run_holds_the_loop_numbers(tmp_path: Path) -> None:
    debug_manager = PyTorchDebugManager(DebugConfig(run_dir=str(tmp_path)))
    debug_manager.setup_training_logging("debug_experiment")
    model = _model()
    optimizer = torch.optim.Adam(model.parameters())
    loss_fn = nn.CrossEntropyLoss()
    seen = [
        debug_manager.debug_training_step(model, optimizer, loss_fn, data, target, epoch=0, batch=i)
        for i, (data, target) in enumerate(_loader())
    ]
    run_dir = debug_manager.training_logger.path
    debug_manager.close()
    norms = [m["gradient_norm"] for m in seen]
    times = [m["execution_time"] for m in seen]
    with open_run(run_dir) as run:
        rep = build_report(run)
        assert run.series("grad_norm").values == pytest.approx(norms)
        assert run.series("gradient_norm").values == pytest.approx(norms)  # the seed's name too
    g, p = rep["gradient_analysis"], rep["performance_analysis"]
    assert g["average_gradient_norm"] == pytest.approx(sum(norms) / 4)
    assert g["max_gradient_norm"] == pytest.approx(max(norms))
    assert p["timed_steps"] == 4
    assert p["average_execution_time"] == pytest.approx(sum(times) / 4)
    assert p["max_execution_time"] == pytest.approx(max(times))
    assert rep["memory_analysis"]["samples"] == 4 and rep["memory_analysis"]["average_memory_usage"] > 0
    phases = rep["operation_breakdown"]["time_by_phase"]
    assert set(phases) >= {"forward", "backward", "optimizer"}
    assert math.fsum(phases.values()) == pytest.approx(sum(times), rel=1e-6)
    text = render_report(run_dir, "text")
    assert isinstance(text, str) and "grad norm            mean None" not in text

"""Seed 003 (Video-OpusClip debugging integration), from its own usage examples."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchdebug as td
from torchdebug import (
    AutogradAnomalyDetector,
    GradientDebugger,
    ModelDebugger,
    PyTorchDebugConfig,
    PyTorchDebugManager,
    PyTorchMemoryDebugger,
    TrainingDebugger,
)


class LogNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(10, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.log(self.fc(x)))  # log of negatives: NaN born in forward, module ""


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 1))


def test_autograd_anomaly_detection() -> None:
    config = PyTorchDebugConfig(enable_autograd_anomaly=True)
    torch.manual_seed(0)
    model = LogNet()
    anomaly_detector = AutogradAnomalyDetector(config, model=model)
    with pytest.raises(td.NonFiniteError) as err, anomaly_detector.detect_anomaly():
        loss = model(torch.randn(8, 10)).sum()
        loss.backward()
    assert (err.value.anomaly.phase, err.value.anomaly.op) == ("forward", "aten.log")
    assert torch.is_anomaly_enabled() is False  # torch's own mode never switched on


def test_gradient_debugging() -> None:
    model = _mlp()
    gradient_debugger = GradientDebugger(PyTorchDebugConfig(gradient_clip_threshold=1.0))
    F.mse_loss(model(torch.randn(8, 10)), torch.randn(8, 1)).backward()
    gradient_info = gradient_debugger.check_gradients(model, 0)
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    assert gradient_info.total_norm == pytest.approx(expected, rel=1e-6) and gradient_info.nonfinite == ()
    flow_analysis = gradient_debugger.analyze_gradient_flow(model)
    assert [layer.name for layer in flow_analysis.layers] == ["0", "2"]
    before = gradient_debugger.clip_gradients(model, max_norm=1e-3)
    assert before == pytest.approx(expected, rel=1e-6)
    assert torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item() == pytest.approx(
        1e-3, rel=1e-3
    )


def test_memory_debugging() -> None:
    memory_debugger = PyTorchMemoryDebugger()
    tensor = torch.zeros(256, 256)
    memory_debugger.track_tensor(tensor, "my_tensor")
    snapshot = memory_debugger.take_memory_snapshot("checkpoint")
    assert snapshot["label"] == "checkpoint"
    assert snapshot["tracked"]["my_tensor"]["bytes"] == 256 * 256 * 4
    freed = memory_debugger.clear_memory()
    assert isinstance(freed, dict)


def test_model_debugging() -> None:
    model_debugger = ModelDebugger()
    model = _mlp()
    inspection = model_debugger.inspect_model(model, input_shape=(32, 10))
    assert list(inspection.output_shape) == [32, 1]
    validation = model_debugger._validate_model_inputs(model, (32, 10))
    assert validation["valid"] is True and validation["problems"] == []
    bad = model_debugger._validate_model_inputs(model, (32, 7))
    assert bad["valid"] is False and bad["problems"]


def test_training_debugging_step_skips_a_nan_update() -> None:
    training_debugger = TrainingDebugger(PyTorchDebugConfig(anomaly_detection_mode="detect"))
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs, targets = torch.randn(8, 10), torch.randn(8, 1)
    debug_info = training_debugger.debug_training_step(model, optimizer, nn.MSELoss(), inputs, targets, 0)
    assert debug_info["skipped"] is False and math.isfinite(debug_info["loss"])
    inputs[2, 3] = math.nan
    before = [p.detach().clone() for p in model.parameters()]
    debug_info = training_debugger.debug_training_step(model, optimizer, nn.MSELoss(), inputs, targets, 1)
    assert debug_info["skipped"] is True and debug_info["anomaly"].phase == "input"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_integration_with_existing_code() -> None:
    debug_manager = PyTorchDebugManager(PyTorchDebugConfig(anomaly_detection_mode="detect"))
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    dataloader = [(torch.randn(8, 10, generator=g), torch.randn(8, 1, generator=g)) for _ in range(3)]
    for epoch in range(2):
        for inputs, targets in dataloader:
            with debug_manager.anomaly_detector.detect_anomaly(model):
                outputs = model(inputs)
                loss = F.mse_loss(outputs, targets)
                loss.backward()
            gradient_info = debug_manager.gradient_debugger.check_gradients(model)
            assert gradient_info.nonfinite == ()
            optimizer.step()
            optimizer.zero_grad()
        debug_manager.memory_debugger.take_memory_snapshot(f"epoch_{epoch}")
    report = debug_manager.generate_comprehensive_report()
    assert [s["label"] for s in report["memory_snapshots"]] == ["epoch_0", "epoch_1"]
    assert report["detector_anomalies"] == []

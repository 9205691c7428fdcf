"""Seed 001 (PyTorch Debugging Tools documentation), from its own usage examples."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import torchdebug as td
from torchdebug import DebugConfig, DebugLevel, DebugMode, PyTorchDebugManager


def _setup() -> tuple[nn.Module, torch.optim.Optimizer, nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 10))
    optimizer = torch.optim.Adam(model.parameters())
    loss_fn = nn.CrossEntropyLoss()
    data_batch = torch.randn(32, 784)
    target_batch = torch.randint(0, 10, (32,))
    return model, optimizer, loss_fn, data_batch, target_batch


def test_basic_usage() -> None:
    config = DebugConfig(
        mode=DebugMode.FULL_DEBUG,
        level=DebugLevel.ADVANCED,
        enable_anomaly_detection=True,
        enable_gradient_checking=True,
        enable_memory_profiling=True,
        enable_performance_profiling=True,
    )
    debug_manager = PyTorchDebugManager(config)
    model, optimizer, loss_fn, data_batch, target_batch = _setup()
    reference = nn.Sequential(nn.Linear(784, 10))
    reference.load_state_dict(model.state_dict())
    ref_loss = loss_fn(reference(data_batch), target_batch)
    ref_loss.backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), math.inf).item()

    metrics = debug_manager.debug_training_step(model, optimizer, loss_fn, data_batch, target_batch)
    assert metrics["loss"] == pytest.approx(ref_loss.item(), rel=1e-6)
    assert metrics["gradient_norm"] == pytest.approx(ref_norm, rel=1e-5)
    assert metrics["execution_time"] > 0 and metrics["skipped"] is False
    assert f"Loss: {metrics['loss']:.4f}"  # the seed's prints format
    assert not torch.equal(model[0].weight, reference[0].weight)  # Adam stepped


def test_advanced_usage_with_custom_configuration(tmp_path: Path) -> None:
    out = tmp_path / "custom_debug_outputs"
    config = DebugConfig(
        mode=DebugMode.ANOMALY_DETECTION,
        level=DebugLevel.EXPERT,
        enable_anomaly_detection=True,
        anomaly_detection_mode="raise",
        log_gradients=True,
        log_activations=True,
        log_weights=True,
        save_debug_info=True,
        debug_output_dir=str(out),
    )
    debug_manager = PyTorchDebugManager(config)
    model, *_ = _setup()
    input_data = torch.randn(1, 784)
    inference_result = debug_manager.debug_model_inference(model, input_data)
    assert inference_result["execution_time"] > 0
    assert isinstance(inference_result["cpu_memory"], int) and inference_result["cpu_memory"] > 0  # bytes
    assert torch.equal(inference_result["output"], model(input_data).detach())
    rows = [json.loads(line) for line in (out / "debug_info.jsonl").read_text().splitlines()]
    assert [r["operation"] for r in rows] == ["inference"]
    bad = input_data.clone()
    bad[0, 5] = math.nan
    with pytest.raises(td.NonFiniteError) as err:  # anomaly_detection_mode="raise"
        debug_manager.debug_model_inference(model, bad)
    assert err.value.anomaly.phase == "input"


def test_integration_with_training_loop_and_comprehensive_report(tmp_path: Path) -> None:
    config = DebugConfig(run_dir=str(tmp_path))
    debug_manager = PyTorchDebugManager(config)
    debug_manager.setup_training_logging("debug_experiment")
    model, optimizer, loss_fn, _, _ = _setup()
    g = torch.Generator().manual_seed(1)
    train_loader = [
        (torch.randn(8, 784, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(3)
    ]
    for epoch in range(2):
        for batch_idx, (data, target) in enumerate(train_loader):
            metrics = debug_manager.debug_training_step(
                model, optimizer, loss_fn, data, target, epoch=epoch, batch=batch_idx
            )
            assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["gradient_norm"])
    run_dir = debug_manager.training_logger.path
    report = debug_manager.create_comprehensive_report()
    debug_manager.close()
    assert report["summary"]["total_debug_operations"] == 6
    assert report["operation_breakdown"] == {"training_step": 6}
    assert report["run_dir"] == str(run_dir)
    with td.open_run(run_dir) as run:
        assert run.series("loss").steps == [0, 1, 2, 3, 4, 5]


def test_custom_debug_context() -> None:
    debugger = PyTorchDebugManager(DebugConfig()).debugger
    model, *_ = _setup()
    with debugger.debug_context("custom_operation", "my_model") as debug_info:
        model(torch.randn(4, 784))
    # filled when the block ends (the seed printed inside the block, where it is still 0)
    assert debug_info.execution_time > 0 and isinstance(debug_info.memory_usage, int)
    assert debugger.debug_history[-1] is debug_info and debug_info.operation == "custom_operation"


def test_debug_optimization_step_and_status_flags() -> None:
    dbg = td.PyTorchDebugger(DebugConfig(mode="gradient_checking"))
    assert (dbg.gradient_checking_active, dbg.memory_profiling_active, dbg.performance_profiling_active) == (
        True,
        False,
        False,
    )
    model, optimizer, loss_fn, x, y = _setup()
    loss_fn(model(x), y).backward()
    param_norm = dbg.debug_optimization_step(optimizer, model, epoch=0, batch=0)
    expected = torch.linalg.vector_norm(torch.cat([p.detach().flatten() for p in model.parameters()])).item()
    assert param_norm == pytest.approx(expected, rel=1e-6)
    before = [p.detach().clone() for p in model.parameters()]
    model[0].bias.grad[3] = math.nan
    with pytest.warns(td.TorchDebugWarning, match="non-finite gradient of 0.bias"):
        dbg.debug_optimization_step(optimizer, model)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the update was skipped
    metrics = dbg.debug_metrics
    assert [m.operation for m in metrics] == ["optimization_step", "optimization_step"]
    assert metrics[1].gradient_anomalies == [metrics[1].anomaly.summary()]
    assert metrics[0].mode is DebugMode.GRADIENT_CHECKING and metrics[0].gradient_anomalies == []

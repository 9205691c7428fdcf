"""Seed 003's comprehensive report, seed 004's input/behaviour checks called the seed's way, seed 000's
profiler settings (memory and FLOPs)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchdebug as td
from torchdebug.compat import PyTorchDebugManager
from torchdebug.perf.profiling import profile_model_performance


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 1))


def test_comprehensive_report_counts_every_part() -> None:
    """Seed 003's "Integration with Existing Code" loop, with two NaN batches caught."""
    debug_manager = PyTorchDebugManager()
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    dataloader = [(torch.randn(8, 10, generator=g), torch.randn(8, 1, generator=g)) for _ in range(8)]
    dataloader[2][0][0, 0] = math.nan
    dataloader[5][0][3, 7] = math.nan
    caught = 0
    for inputs, targets in dataloader:
        try:
            with debug_manager.anomaly_detector.detect_anomaly():
                outputs = model(inputs)
                loss = F.mse_loss(outputs, targets)
                loss.backward()
        except td.NonFiniteError:
            optimizer.zero_grad()
            caught += 1
        gradient_info = debug_manager.gradient_debugger.check_gradients(model)
        assert gradient_info.nonfinite == ()
        optimizer.step()
        optimizer.zero_grad()
    debug_manager.memory_debugger.take_memory_snapshot("epoch_0")
    report = debug_manager.generate_comprehensive_report()
    assert caught == 2
    s = report["summary"]
    # 8 detector blocks + 8 gradient checks + 1 memory snapshot
    assert s["total_debug_operations"] == 17
    assert s["operations_by_part"] == {
        "debugger": 0,
        "anomaly_detector": 8,
        "gradient_debugger": 8,
        "training_debugger": 0,
        "memory_debugger": 1,
    }
    assert s["anomalies_detected"] == 2 and s["anomalies_by_part"]["anomaly_detector"] == 2
    assert [a["phase"] for a in report["detector_anomalies"]] == ["input", "input"]
    # 10*16 + 16 + 16*1 + 1 = 193 parameters, float32
    assert report["model_info"] == {
        "class": "Sequential",
        "modules": 4,
        "parameters": 193,
        "trainable_parameters": 193,
        "parameter_bytes": 772,
        "buffer_bytes": 0,
        "devices": ["cpu"],
        "dtypes": ["float32"],
    }
    assert report["cuda"]["available"] is torch.cuda.is_available()
    assert "performance_analysis" in report["profiling"] and report["profiling"]["last_profile"] is None
    json.dumps(report)


def test_validate_model_input_the_seed_way_keeps_the_seed_checks() -> None:
    ok = torch.randn(4, 8)
    assert td.validate_model_input(ok) is True
    with pytest.raises(ValueError, match=r"input values reach 1500, above the allowed range \[-1000, 1000\]"):
        td.validate_model_input(torch.full((2, 3), 1500.0))
    with pytest.raises(ValueError, match="must be 2-dimensional"):
        td.validate_model_input(torch.zeros(2, 3, 4))
    # the keyword API: only the checks passed (beside NaN/Inf)
    assert td.validate_model_input(torch.full((2, 3, 4), 1500.0), dtype=torch.float32) is True
    assert td.validate_model_input(torch.full((2, 3), 1500.0), value_range=(-1e4, 1e4)) is True
    assert td.validate_model_input(torch.zeros(2, 3, 4), ndim=3) is True


def test_detect_model_anomalies_the_seed_way_checks_zero_one() -> None:
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    logits = nn.Linear(4, 3)
    with torch.no_grad():
        logits.weight.mul_(50)
    (problem,) = td.detect_model_anomalies(logits, x)
    assert problem.startswith("Model output outside expected range [0, 1]")
    assert td.detect_model_anomalies(nn.Sequential(logits, nn.Softmax(dim=1)), x) == []
    assert td.detect_model_anomalies(logits, x, output_range=None) == []


def test_profile_model_performance_records_memory_and_flops(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    g = torch.Generator().manual_seed(0)
    loader = [(torch.randn(8, 32, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(6)]
    summary = profile_model_performance(model, loader, 3, loss_fn=nn.CrossEntropyLoss(), run_dir=tmp_path)
    # per step: forward addmm 2*8*32*64 + 2*8*64*4 = 36864; backward: weight grads 32768 + 4096 and the
    # second layer's input grad 4096 (the first layer's input needs none) = 40960; 77824 x 3 steps
    assert summary.flops == 233472
    assert summary.peak_op_memory_bytes is not None and summary.peak_op_memory_bytes > 0
    trace = json.loads(Path(summary.trace_path or "").read_text())
    assert any(e.get("name") == "[memory]" for e in trace["traceEvents"])
    assert "FLOPs 233,472" in str(summary)

"""Seed 003's manager report and memory debugger, from the seed's own loop: true values in every section."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchdebug as td
from torchdebug.compat import PyTorchDebugManager, PyTorchMemoryDebugger


def test_report_after_the_seeds_integration_loop() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 1))
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    dataloader = [(torch.randn(8, 10, generator=g), torch.randn(8, 1, generator=g)) for _ in range(4)]
    loss_fn, num_epochs = F.mse_loss, 2

    # the expected norms: the same loop without torchdebug (the seed never zeroes the gradients)
    expected = []
    for _ in range(num_epochs):
        for inputs, targets in dataloader:
            loss_fn(reference(inputs), targets).backward()
            expected.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), math.inf).item())
            ref_optimizer.step()

    # seed 003, "Integration with Existing Code", verbatim
    debug_manager = PyTorchDebugManager()

    for epoch in range(num_epochs):
        for batch_idx, (inputs, targets) in enumerate(dataloader):  # noqa: B007 (verbatim)
            with debug_manager.anomaly_detector.detect_anomaly():
                outputs = model(inputs)
                loss = loss_fn(outputs, targets)
                loss.backward()

            gradient_info = debug_manager.gradient_debugger.check_gradients(model)
            optimizer.step()

        # Memory snapshot every epoch
        debug_manager.memory_debugger.take_memory_snapshot(f"epoch_{epoch}")

    # Generate final report
    report = debug_manager.generate_comprehensive_report()

    assert gradient_info.nonfinite == ()
    grad = report["gradient_analysis"]
    assert grad["gradient_checks"] == 8 and grad["gradient_anomalies"] == 0
    assert grad["average_gradient_norm"] == pytest.approx(sum(expected) / 8, rel=1e-5)
    assert grad["max_gradient_norm"] == pytest.approx(max(expected), rel=1e-5)
    snaps = list(debug_manager.memory_debugger.snapshots)
    mem = report["memory_analysis"]
    # one interval between the two snapshots (the debugger itself ran no operation)
    assert mem["average_memory_usage"] == float(snaps[1]["rss"] - snaps[0]["rss"]) == mem["max_memory_usage"]
    assert mem["snapshots"] == 2 and mem["memory_leaks"] == []
    assert (mem["first_rss"], mem["last_rss"]) == (snaps[0]["rss"], snaps[1]["rss"])
    assert mem["peak_rss"] == max(snaps[0]["rss"], snaps[1]["rss"])
    assert report["operation_breakdown"] == {
        "detect_anomaly": 8,
        "check_gradients": 8,
        "take_memory_snapshot": 2,
    }
    assert report["summary"]["total_debug_operations"] == 18


def test_memory_debugger_warns_of_a_steady_leak() -> None:
    memory_debugger = PyTorchMemoryDebugger()
    leaked = []
    with pytest.warns(td.TorchDebugWarning) as caught:
        for i in range(120):
            leaked.append(torch.ones(2**18))  # 1 MiB a snapshot, kept alive: 120 MiB
            memory_debugger.take_memory_snapshot(f"batch_{i}")
    messages = [str(w.message) for w in caught if issubclass(w.category, td.TorchDebugWarning)]
    # one warning per full window of 50 snapshots: at the 50th and the 100th
    assert [m.split(":")[1] for m in messages] == [
        " possible memory leak at snapshot 'batch_49'",
        " possible memory leak at snapshot 'batch_99'",
    ]
    assert all("heap_in_use grew" in m and "over the last 50 snapshots" in m for m in messages)
    snaps = list(memory_debugger.snapshots)
    assert [i for i, s in enumerate(snaps) if s["memory_leaks"]] == [49, 99]
    assert len(memory_debugger.memory_leaks) == sum(len(s["memory_leaks"]) for s in snaps)


def test_memory_debugger_is_quiet_without_growth() -> None:
    memory_debugger = PyTorchMemoryDebugger()
    for i in range(120):  # a warning here fails the test (warnings are errors)
        scratch = torch.ones(2**18)
        memory_debugger.take_memory_snapshot(f"batch_{i}")
        del scratch
    assert list(memory_debugger.memory_leaks) == []
    assert len(memory_debugger.snapshots) == 120


def test_memory_snapshot_frequency_takes_snapshots_in_the_managers_steps() -> None:
    from torchdebug.compat import PyTorchDebugConfig

    # seed 003, "Debug memory issues"
    config = PyTorchDebugConfig(
        enable_memory_debugging=True, track_tensor_memory=True, memory_snapshot_frequency=10
    )
    debug_manager = PyTorchDebugManager(config)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        x, y = torch.randn(8, 10, generator=g), torch.randn(8, 1, generator=g)
        debug_manager.debug_training_step(model, optimizer, F.mse_loss, x, y)
    assert [s["label"] for s in debug_manager.memory_debugger.snapshots] == ["step_0", "step_10", "step_20"]
    report = debug_manager.generate_comprehensive_report()
    assert report["memory_analysis"]["snapshots"] == 3
    assert report["operation_breakdown"] == {"training_step": 30, "take_memory_snapshot": 3}


def test_no_snapshots_without_memory_debugging() -> None:
    from torchdebug.compat import PyTorchDebugConfig

    debug_manager = PyTorchDebugManager(
        PyTorchDebugConfig(enable_memory_debugging=False, memory_snapshot_frequency=1)
    )
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(3):
        debug_manager.debug_training_step(model, optimizer, F.mse_loss, torch.randn(2, 4), torch.randn(2, 1))
    assert len(debug_manager.memory_debugger.snapshots) == 0

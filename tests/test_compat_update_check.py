"""Seed 003's ``debug_training_step`` judges the update before it lands: a NaN in Adam's state never
reaches the weights, and the anomaly names ``Adam.step`` as ``watch`` does."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import torchdebug as td
from torchdebug import PyTorchDebugManager, TrainingDebugger


def _setup() -> tuple[nn.Module, torch.optim.Optimizer, nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2))
    return (
        model,
        torch.optim.Adam(model.parameters(), lr=1e-3),
        nn.MSELoss(),
        torch.randn(8, 4),
        torch.randn(8, 2),
    )


def _poison(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    optimizer.state[model[0].weight]["exp_avg"][0, 0] = float("nan")


def test_training_debugger_skips_an_update_from_a_nan_state() -> None:
    model, optimizer, loss_fn, inputs, targets = _setup()
    training_debugger = TrainingDebugger()  # mode "warn", the default
    debug_info = training_debugger.debug_training_step(model, optimizer, loss_fn, inputs, targets, 0)
    assert debug_info["skipped"] is False and debug_info["anomaly"] is None
    _poison(optimizer, model)
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # seed 003, "Training Debugging"
        debug_info = training_debugger.debug_training_step(model, optimizer, loss_fn, inputs, targets, 1)
    a = debug_info["anomaly"]
    assert debug_info["skipped"] is True
    assert (a.phase, a.op, a.kind, a.parameter, a.step, a.module) == (
        "optimizer",
        "Adam.step",
        "nan",
        "0.weight",
        1,
        "0",
    )
    assert a.symptom == "nan in optimizer state 'exp_avg' of 0.weight before the update; update skipped"
    assert all(torch.equal(x, y) for x, y in zip(before, model.parameters()))  # the update never landed
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert training_debugger.anomalies == [a]
    assert [str(w.message) for w in caught if issubclass(w.category, td.TorchDebugWarning)] == [
        f"torchdebug: {a.summary()} ({a.symptom})"
    ]


def test_training_debugger_raises_before_the_update_in_raise_mode() -> None:
    model, optimizer, loss_fn, inputs, targets = _setup()
    training_debugger = TrainingDebugger({"anomaly_detection_mode": "raise"})
    training_debugger.debug_training_step(model, optimizer, loss_fn, inputs, targets, 0)
    _poison(optimizer, model)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(td.NonFiniteError) as err:
        training_debugger.debug_training_step(model, optimizer, loss_fn, inputs, targets, 1)
    assert (err.value.anomaly.op, err.value.anomaly.parameter) == ("Adam.step", "0.weight")
    assert all(torch.equal(x, y) for x, y in zip(before, model.parameters()))


def test_watch_names_the_same_update() -> None:
    """The reference: watch names Adam.step for the same fault (it sees it after the update)."""
    model, optimizer, loss_fn, inputs, targets = _setup()
    with td.watch(model, optimizer, run=False) as mon:
        for i in range(2):
            optimizer.zero_grad()
            loss_fn(model(inputs), targets).backward()
            if i == 1:
                _poison(optimizer, model)
            optimizer.step()
    assert [(a.op, a.phase, a.parameter) for a in mon.anomalies] == [("Adam.step", "optimizer", "0.weight")]


def test_manager_step_skips_an_update_from_a_nan_state() -> None:
    model, optimizer, loss_fn, data_batch, target_batch = _setup()
    debug_manager = PyTorchDebugManager({"enable_anomaly_detection": False})
    assert (
        debug_manager.debug_training_step(model, optimizer, loss_fn, data_batch, target_batch)["skipped"]
        is False
    )
    _poison(optimizer, model)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(td.TorchDebugWarning, match="Adam.step"):
        metrics = debug_manager.debug_training_step(model, optimizer, loss_fn, data_batch, target_batch)
    assert metrics["skipped"] is True and metrics["anomaly"].op == "Adam.step"
    assert all(torch.equal(x, y) for x, y in zip(before, model.parameters()))


def test_a_healthy_state_updates() -> None:
    model, optimizer, loss_fn, inputs, targets = _setup()
    training_debugger = TrainingDebugger()
    for step in range(3):
        before = [p.detach().clone() for p in model.parameters()]
        out = training_debugger.debug_training_step(model, optimizer, loss_fn, inputs, targets, step)
        assert out["skipped"] is False
        assert not torch.equal(before[0], model[0].weight)

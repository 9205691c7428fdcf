"""Seed 001's ``debug_backward_pass`` flags a zero gradient norm ("Zero gradient norm detected")."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchdebug import PyTorchDebugger


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, 10))


def test_zero_gradients_are_flagged(caplog: pytest.LogCaptureFixture) -> None:
    model, debugger = _model(), PyTorchDebugger()
    loss = (model(torch.randn(32, 784)) * 0.0).sum()  # every gradient exactly 0
    with caplog.at_level(logging.WARNING, logger="torchdebug.compat"):
        gradient_norm = debugger.debug_backward_pass(loss, model)
    info = debugger.debug_history[-1]
    assert gradient_norm == 0.0 and info.anomaly_detected
    (event,) = info.events
    assert (event.kind, event.severity, event.step) == ("vanishing_gradient", "warning", 0)
    assert event.message == (
        "zero gradient norm: every gradient of the 2 trainable parameters is exactly 0 (a zero loss, "
        "dead activations, or a loss that does not depend on them)"
    )
    assert [r.getMessage() for r in caplog.records] == [str(event)]
    report = debugger.create_debug_report()
    assert report["gradient_analysis"]["gradient_anomalies"] == 1
    assert report["summary"]["anomalies_detected"] == 1


def test_a_loss_that_never_reaches_the_model_is_flagged() -> None:
    model, debugger = _model(), PyTorchDebugger()
    other = torch.ones(3, requires_grad=True)
    debugger.debug_backward_pass((other * 2.0).sum(), model)  # the model's .grad stay None
    (event,) = debugger.debug_history[-1].events
    assert event.message == (
        "zero gradient norm: none of the 2 trainable parameters received a gradient (.grad is None: "
        "is the loss detached from the model?)"
    )


def test_healthy_and_frozen_models_are_not_flagged() -> None:
    model, debugger = _model(), PyTorchDebugger()
    x, y = torch.randn(32, 784), torch.randint(0, 10, (32,))
    norm = debugger.debug_backward_pass(F.cross_entropy(model(x), y), model)
    assert norm > 0 and debugger.debug_history[-1].events == []
    frozen = _model().requires_grad_(False)
    w = torch.ones(1, requires_grad=True)
    debugger.debug_backward_pass((frozen(x).sum() * w).sum(), frozen)  # nothing of it should learn
    assert debugger.debug_history[-1].events == [] and not debugger.debug_history[-1].anomaly_detected

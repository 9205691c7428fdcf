"""Seed 004's ``error_system`` and ``training_logger`` are called, as the seed's integration promised."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import torchdebug as td
from torchdebug import DebugMode, PyTorchDebugger


class ErrorTracker:
    def __init__(self) -> None:
        self.errors: list[dict[str, Any]] = []

    def track_error(self, error: Exception, severity: Any, category: Any, context: dict[str, Any]) -> None:
        self.errors.append({"error": error, "severity": severity, "category": category, "context": context})


class ErrorHandlingDebuggingSystem:
    """The seed's error system, as much of it as the facade calls."""

    def __init__(self) -> None:
        self.error_tracker = ErrorTracker()


class TrainingLogger:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict[str, Any]]] = []

    def log_training_event(self, event_type: str, message: str, level: Any = None, **data: Any) -> None:
        self.events.append((event_type, message, data))


def _setup() -> tuple[nn.Module, torch.optim.Optimizer, nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return (
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        nn.MSELoss(),
        torch.randn(8, 4),
        torch.randn(8, 2),
    )


def test_the_collaborators_hear_of_each_block_and_each_error() -> None:
    model, optimizer, criterion, data, target = _setup()
    error_system = ErrorHandlingDebuggingSystem()
    training_logger = TrainingLogger()
    debugger = PyTorchDebugger(
        error_system=error_system, training_logger=training_logger, debug_mode=DebugMode.FULL_DEBUG
    )

    def robust_training_step(model, data, target, optimizer, criterion, debugger):  # type: ignore[no-untyped-def]
        """Seed 004's, as written (its ErrorSeverity/ErrorCategory enums as strings)."""
        try:
            with debugger.debug_context("training_step"):
                optimizer.zero_grad()
                output = model(data)
                loss = criterion(output, target)
                loss.backward()
                optimizer.step()
                return loss.item()
        except Exception as e:
            debugger.error_system.error_tracker.track_error(
                error=e, severity="ERROR", category="MODEL", context={"operation": "training_step"}
            )
            optimizer.zero_grad()
            return None

    assert math.isfinite(robust_training_step(model, data, target, optimizer, criterion, debugger))
    bad = data.clone()
    bad[0, 0] = math.nan
    assert robust_training_step(model, bad, target, optimizer, criterion, debugger) is None
    # a NaN raised out of the block: tracked once, by the seed's own except branch
    (tracked,) = error_system.error_tracker.errors
    assert isinstance(tracked["error"], td.NonFiniteError) and tracked["error"].anomaly.phase == "input"
    assert tracked["severity"] == "ERROR"

    # a NaN recorded without raising (warn mode, a forward pass): the facade tracks it
    with pytest.warns(td.TorchDebugWarning):
        debugger.debug_forward_pass(model, bad)
    assert len(error_system.error_tracker.errors) == 2
    ours = error_system.error_tracker.errors[1]
    assert isinstance(ours["error"], td.NonFiniteError) and ours["error"].anomaly.phase == "input"
    assert (ours["severity"], ours["category"]) == ("warning", "model")
    assert ours["context"] == {"operation": "forward_pass", "epoch": 0, "batch": 0}

    kinds = [(e, m.split(" in ")[0]) for e, m, _ in training_logger.events]
    assert kinds == [
        ("debug_operation", "training_step completed"),
        ("debug_operation", "training_step failed"),
        ("debug_operation", "forward_pass completed"),
    ]
    infos = [d["debug_info"] for _, _, d in training_logger.events]
    assert [i["operation"] for i in infos] == ["training_step", "training_step", "forward_pass"]
    assert [i["anomaly_detected"] for i in infos] == [False, True, True]


def test_a_failing_collaborator_is_warned_about_once_and_dropped() -> None:
    class Broken:
        def log_training_event(self, event_type: str, message: str) -> None:
            raise RuntimeError("logger down")

    debugger = PyTorchDebugger({"enable_anomaly_detection": False}, training_logger=Broken())
    with pytest.warns(td.TorchDebugWarning, match="logger down"), debugger.debug_context("a"):
        pass
    assert debugger.training_logger is None
    with debugger.debug_context("b"):  # no second warning (warnings are errors here)
        pass
    assert len(debugger.debug_history) == 2

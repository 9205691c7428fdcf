"""Seed 004 (debugging and optimization system), from its own usage examples."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

import torchdebug as td

# -- input validation: seed 004's validate_model_input --------------------------------------------------


def test_validate_model_input_true_for_clean_data() -> None:
    data = torch.randn(8, 16)
    assert td.validate_model_input(data) is True
    # the seed's three checks, each now a parameter: finite, |x| <= 1000, 2-dimensional
    assert td.validate_model_input(data, value_range=(-1000, 1000), ndim=2) is True


def test_validate_model_input_names_nan_and_inf_with_the_first_index() -> None:
    data = torch.zeros(3, 4)
    data[1, 2] = math.nan
    data[2, 0] = math.inf
    data[2, 3] = math.nan
    with pytest.raises(
        ValueError, match=re.escape("input has 2 NaN and 1 Inf values (first at index (1, 2))")
    ):
        td.validate_model_input(data)


@pytest.mark.parametrize(
    ("value", "bounds", "message"),
    [
        (1500.0, (-1000, 1000), "input values reach 1500, above the allowed range [-1000, 1000]"),
        (-3.0, (0, 1), "input values reach -3, below the allowed range [0, 1]"),
    ],
    ids=["above", "below"],
)
def test_validate_model_input_range_is_configurable(
    value: float, bounds: tuple[float, float], message: str
) -> None:
    data = torch.full((2, 2), 0.5)
    data[0, 1] = value
    with pytest.raises(ValueError, match=re.escape(message)):
        td.validate_model_input(data, value_range=bounds)
    assert td.validate_model_input(data, value_range=(-1e4, 1e4)) is True  # 1000 was only the seed's example


def test_validate_model_input_metadata_checks_run_before_any_kernel() -> None:
    meta = torch.empty(3, 4, 5, device="meta")  # no data: any kernel reading it would fail
    with pytest.raises(
        ValueError, match=re.escape("input must be 2-dimensional, got shape (3, 4, 5) (3 dims)")
    ):
        td.validate_model_input(meta, ndim=2)
    with pytest.raises(ValueError, match=re.escape("input has dtype torch.float32; expected torch.int64")):
        td.validate_model_input(meta, dtype=torch.int64)
    with pytest.raises(
        ValueError, match=re.escape("tokens is on cpu; expected cuda (move it with .to('cuda'))")
    ):
        td.validate_model_input(torch.zeros(2, dtype=torch.long), device="cuda", name="tokens")
    assert td.validate_model_input(torch.zeros(2, 3, dtype=torch.long), ndim=(2, 3), dtype=torch.long) is True


def test_validate_model_input_refuses_non_tensors() -> None:
    with pytest.raises(TypeError, match="needs a tensor, got list"):
        td.validate_model_input([1.0, 2.0])  # type: ignore[arg-type]


# -- behaviour checks: debug_model_inference / detect_model_anomalies ---------------------------------


def _linear(weight_scale: float, bias: list[float]) -> nn.Linear:
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    with torch.no_grad():
        lin.weight.mul_(weight_scale)
        lin.bias.copy_(torch.tensor(bias))
    return lin


@pytest.mark.parametrize(
    ("model", "problem"),
    [
        (_linear(0.0, [1.0, 2.0, 3.0]), "constant predictions: all 32 samples get the same output"),
        (_linear(0.0, [0.0, 0.0, 0.0]), "uniform predictions: every output value is 0"),
        (_linear(0.01, [0.0, 0.0, 10.0]), "one class always: the argmax is class 2 for all 32 samples"),
    ],
    ids=["constant", "uniform", "one-class"],
)
def test_debug_model_inference_flags_degenerate_predictions(model: nn.Module, problem: str) -> None:
    mgr = td.PyTorchDebugManager(td.DebugConfig())
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
    result = mgr.debug_model_inference(model, x)
    assert len(result["prediction_problems"]) == 1
    assert result["prediction_problems"][0].startswith(problem)
    (event,) = mgr.debugger.debug_history[-1].events
    assert event.severity == "warning" and event.message == result["prediction_problems"][0]


def test_debug_model_inference_healthy_model_has_no_problems() -> None:
    mgr = td.PyTorchDebugManager(td.DebugConfig())
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
    result = mgr.debug_model_inference(_linear(1.0, [0.0, 0.0, 0.0]), x)
    assert result["prediction_problems"] == [] and result["anomaly_detected"] is False
    # the seed's single-sample inference has nothing to compare: never flagged
    assert mgr.debug_model_inference(_linear(0.0, [1.0, 2.0, 3.0]), x[:1])["prediction_problems"] == []


def test_detect_model_anomalies_as_in_the_seed() -> None:
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(2))
    healthy = nn.Sequential(_linear(1.0, [0.0, 0.0, 0.0]), nn.Softmax(dim=1))
    assert td.detect_model_anomalies(healthy, x, output_range=(0.0, 1.0)) == []
    logits = _linear(1.0, [0.0, 0.0, 0.0])
    out_of_range = td.detect_model_anomalies(logits, x * 100, output_range=(0.0, 1.0))
    assert len(out_of_range) == 1 and out_of_range[0].startswith("Model output outside expected range [0, 1]")
    broken = _linear(1.0, [math.nan, 0.0, 0.0])
    assert td.detect_model_anomalies(broken, x) == ["Model output contains NaN values (16)"]
    assert td.detect_model_anomalies(_linear(0.0, [0.0, 0.0, 0.0]), x) == [
        "uniform predictions: every output value is 0 (std 0)"
    ]

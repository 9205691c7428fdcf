"""Seed 003's backward-only detector block names the op that made the loss's NaN, read from the graph.

``with detector.detect_anomaly(): loss.backward()`` with the forward outside the block: the trace
never saw the forward, so the op comes from the loss's autograd graph (each node keeps its saved
inputs, or result); module and line stay unknown and the anomaly says so.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import torchdebug as td
from torchdebug.compat import AutogradAnomalyDetector
from torchdebug.nonfinite.graph_origin import graph_origin


class LogAct(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)  # negative inputs: NaN


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), LogAct(), nn.Linear(4, 1))


def test_backward_only_block_names_aten_log() -> None:
    model = _model()
    inputs = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    anomaly_detector = AutogradAnomalyDetector()  # mode "raise", as torch's detect_anomaly
    outputs = model(inputs)
    loss = outputs.mean()
    # seed 003, "Autograd Anomaly Detection": with anomaly_detector.detect_anomaly(): loss.backward()
    with pytest.raises(td.NonFiniteError) as err, anomaly_detector.detect_anomaly():
        loss.backward()  # ORIGIN:backward
    a = err.value.anomaly
    assert (a.phase, a.op, a.kind, a.module, a.location) == ("forward", "aten.log", "nan", None, None)
    assert a.summary() == "nan born in forward of an untraced module: aten.log"
    assert a.hint.startswith(
        "aten.log made nan from finite inputs (read from the loss's autograd graph, LogBackward0); the "
        "forward ran before the traced block, so its module and line are unknown"
    )
    assert a.noticed is not None and a.noticed.op == "loss"
    # the loss was noticed where backward() started (the seed's line)
    line = _line_of("# ORIGIN:backward")
    assert a.noticed.location is not None
    assert a.noticed.location.endswith(f"test_compat_detector_backward_only.py:{line}")
    with torch.no_grad():  # the input of the log: finite, with negative values
        pre = model[0](inputs)
    assert a.inputs[0].min == pytest.approx(pre.min().item())


def _line_of(text: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if text in line)


@pytest.mark.parametrize(
    ("make", "op", "kind"),
    [
        pytest.param(lambda x: torch.log(x - 10.0), "aten.log", "nan", id="log-saves-its-input"),
        pytest.param(lambda x: torch.sqrt(x - 10.0), "aten.sqrt", "nan", id="sqrt-saves-its-result"),
        pytest.param(lambda x: x / (x * 0.0), "aten.div", "inf", id="div-by-0"),  # 2 / 0
        pytest.param(lambda x: torch.exp(x * 1000.0), "aten.exp", "inf", id="exp-overflow"),
    ],
)
def test_graph_origin_finds_the_first_op(make: object, op: str, kind: str) -> None:
    w = torch.ones(3, requires_grad=True)
    out = make(w * 2.0)  # type: ignore[operator]
    loss = (out * 3.0).sum()
    found = graph_origin(loss)
    assert found is not None and found.op == op
    assert (math.isnan if kind == "nan" else math.isinf)(found.result.sum().item())
    assert all(bool(torch.isfinite(t).all()) for t in found.inputs)


def test_the_earliest_origin_wins_and_a_nan_batch_has_none() -> None:
    w = torch.ones(3, requires_grad=True)
    first = torch.log(w - 2.0)  # made first
    second = torch.sqrt(w - 5.0)
    assert graph_origin((first + second).sum()).op == "aten.log"  # type: ignore[union-attr]
    x = torch.tensor([math.nan, 1.0, 1.0])
    assert graph_origin((w * x).sum()) is None  # the NaN came with the input: no op made it

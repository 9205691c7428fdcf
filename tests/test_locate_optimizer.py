"""A multi-tensor optimizer update (``foreach=True``, ``_foreach_*`` ops) that makes one parameter or
its state non-finite: ``locate_nonfinite`` names that parameter, not the first of the list."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchdebug as td


class Gated(nn.Module):
    """Two linears and a gate that is the LAST parameter of the list (fc1.weight ... gate)."""

    def __init__(self, gate_scale: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 1)
        self.gate = nn.Parameter(torch.ones(3))
        self.gate_scale = gate_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the gate's sum is added to both rows and the loss is their mean: its gradient is gate_scale
        return self.fc2(torch.tanh(self.fc1(x))).squeeze(-1) + (self.gate * self.gate_scale).sum()


def _locate(model: nn.Module, opt: torch.optim.Optimizer, with_opt: bool) -> td.Anomaly:
    x = torch.randn(2, 4)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).mean()
        loss.backward()
        opt.step()
        return loss

    a = td.locate_nonfinite(step, model=model, optimizer=opt if with_opt else None)
    assert a is not None
    return a


@pytest.mark.parametrize("with_opt", [True, False], ids=["optimizer-given", "optimizer-found"])
@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "for-loop"])
def test_update_zero_over_zero_names_the_parameter_that_went_bad(foreach: bool, with_opt: bool) -> None:
    torch.manual_seed(0)
    model = Gated(gate_scale=0.0)
    # Adam with eps=0: the gate's gradient is exactly 0, so m = v = 0 and its update is 0 / (sqrt(0) + 0)
    opt = torch.optim.Adam(model.parameters(), lr=0.1, eps=0.0, foreach=foreach)
    a = _locate(model, opt, with_opt)
    op = "aten._foreach_addcdiv_" if foreach else "aten.addcdiv_"
    assert (a.phase, a.parameter, a.module, a.op, a.kind) == ("optimizer", "gate", "", op, "nan"), str(a)
    assert a.symptom == f"nan in the optimizer update of gate, made by {op}"
    # the gate's denominator sqrt(v) + eps is 0 in all 3 of its elements
    assert a.hint == (
        "the update makes 0/0: the denominator holds exact zeros (all 3 values are exactly 0); an "
        "Adam-type update divides by sqrt(exp_avg_sq) + eps, which is 0 where a gradient was 0 and eps "
        "is 0: set eps > 0"
    )


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "for-loop"])
def test_update_overflowing_the_state_names_the_state_and_its_parameter(foreach: bool) -> None:
    torch.manual_seed(0)
    # the gate's gradient is 1e21 (the loss 6e21 is finite): exp_avg_sq = (1 - 0.999) * (1e21)^2 = 1e39
    # > 3.4e38 overflows to +Inf in whichever order addcmul_ multiplies; the update m / sqrt(inf) = 0
    # leaves the gate finite: only its state went bad
    model = Gated(gate_scale=1e21)
    opt = torch.optim.Adam(model.parameters(), lr=0.1, foreach=foreach)
    a = _locate(model, opt, with_opt=False)
    assert (a.phase, a.parameter, a.kind) == ("optimizer", "gate", "inf"), str(a)
    assert a.symptom.startswith("inf in the optimizer update of exp_avg_sq of gate, made by aten."), a.symptom


def test_session_names_the_parameter_a_foreach_update_made_nonfinite() -> None:
    torch.manual_seed(0)
    model = Gated(gate_scale=0.0)
    opt = torch.optim.Adam(model.parameters(), lr=0.1, eps=0.0, foreach=True)
    x = torch.randn(2, 4)
    with pytest.raises(td.NonFiniteError) as ei, td.watch(model, opt, run=False) as mon:
        for _ in range(2):
            opt.zero_grad()
            model(x).mean().backward()
            opt.step()
            mon.step()
    a = ei.value.anomaly
    # gate is the 5th of 5 parameters; the four before it stay finite (their gradients are nonzero)
    assert (a.phase, a.parameter, a.step) == ("optimizer", "gate", 0), str(a)
    assert a.hint.startswith("the optimizer update made gate non-finite:"), a.hint

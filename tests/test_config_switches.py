"""Each seed flag alone does what ``config.instruments()`` claims."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchdebug as td
from torchdebug._errors import NonFiniteError
from torchdebug.health.standalone import ActivationInstrument, WeightInstrument
from torchdebug.store import open_run

STEPS, EVERY = 5, 2  # detail steps 0, 2, 4


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)


def _train(mon: td.Monitor, model: nn.Module, opt: torch.optim.Optimizer, steps: int = STEPS) -> None:
    for step in range(steps):
        x, y = _data(step)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        mon.step()


@pytest.mark.parametrize("flag", ["debug_forward_pass", "log_activations", "activation_stats"])
def test_activation_flags_alone_record_activations(flag: str, tmp_path: Path) -> None:
    cfg = td.DebugConfig(mode="none", detail_every=EVERY, **{flag: True})
    # debug_forward_pass also records the forward's shapes, devices and loss (step_details)
    assert cfg.instruments() == {"activations"} | (
        {"step_details"} if flag == "debug_forward_pass" else set()
    )
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x0, _ = _data(0)
    with torch.no_grad():
        h0 = model[0](x0)  # the first layer's output at step 0, before any update
    with td.watch(model, opt, config=cfg, run=tmp_path) as mon:
        assert [type(i) for i in mon.instruments if type(i).__name__ != "StepDetails"] == [
            ActivationInstrument
        ]
        _train(mon, model, opt)
    with open_run(mon.run_dir) as run:
        names = run.metric_names()
        for mod in ("0", "1", "2"):
            assert run.series(f"act_mean/{mod}").steps == [0, 2, 4]
        assert run.series("dead_units/1").steps == [0, 2, 4]
        assert run.series("act_mean/0").values[0] == pytest.approx(h0.mean().item(), rel=1e-6)
        assert run.series("act_std/0").values[0] == pytest.approx(h0.std().item(), rel=1e-6)
        assert run.series("act_zero/1").values[0] == pytest.approx((h0.relu() == 0).float().mean().item())
    assert not any(n.startswith(("grad_norm/", "weight_norm/")) for n in names)
    assert not any(m._forward_hooks for m in model.modules())  # hooks removed on exit


def test_log_weights_alone_records_weights_and_gradients(tmp_path: Path) -> None:
    cfg = td.DebugConfig(mode="none", detail_every=EVERY, log_weights=True)
    assert cfg.instruments() == {"gradient_details", "nonfinite"}
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)  # update/weight ratios stay within [1e-5, 0.1]
    with td.watch(model, opt, config=cfg, run=tmp_path) as mon:
        assert [type(i) for i in mon.instruments] == [WeightInstrument]
        x, y = _data(0)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        g0 = model[0].weight.grad.norm().item()
        w_before = model[0].weight.detach().clone()
        opt.step()
        w_after = model[0].weight.detach().clone()
        mon.step()
        _train(mon, model, opt, STEPS - 1)  # steps 1..4
    with open_run(mon.run_dir) as run:
        for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
            for series in ("grad_norm", "weight_norm", "update_ratio"):
                assert run.series(f"{series}/{name}").steps == [0, 2, 4], (series, name)
        assert run.series("grad_norm/0.weight").values[0] == pytest.approx(g0, rel=1e-6)
        assert run.series("weight_norm/0.weight").values[0] == pytest.approx(w_after.norm().item(), rel=1e-6)
        ratio = ((w_after - w_before).norm() / w_after.norm()).item()
        assert run.series("update_ratio/0.weight").values[0] == pytest.approx(ratio, rel=1e-5)


def test_with_gradients_on_one_instrument_records_everything(tmp_path: Path) -> None:
    cfg = td.DebugConfig(
        mode="none", detail_every=EVERY, log_gradients=True, log_weights=True, log_activations=True
    )
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with td.watch(model, opt, config=cfg, run=False) as mon:
        # no second set of hooks; the loss-spike guard rides with the gradient health's loss rules
        assert [type(i).__name__ for i in mon.instruments] == ["GradientHealth", "SpikeGuard"]
        health = mon.instruments[0]
        assert health.details and health.activations


@pytest.mark.parametrize(
    "flag", ["debug_gradient_norms", "debug_backward_pass", "log_gradients", "log_weights"]
)
def test_gradient_flags_alone_never_let_a_nan_gradient_through(flag: str) -> None:
    cfg = td.DebugConfig(mode="none", **{flag: True})
    assert "nonfinite" in cfg.instruments()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with td.watch(model, opt, config=cfg, run=False) as mon:
        _train(mon, model, opt, 2)
        x, y = _data(2)
        x[3, 1] = float("nan")  # one bad input element: every gradient turns NaN
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        with pytest.raises(NonFiniteError) as err:
            opt.step()  # policy "raise": stopped before the update
    assert err.value.anomaly.phase == "input"
    assert all(torch.isfinite(p).all() for p in model.parameters())

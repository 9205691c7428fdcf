"""Tests of check_gradients, analyze_gradient_flow and analyze_model_parameters against torch references."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from torchdebug.health.gradients import (
    GradientFlow,
    GradientReport,
    analyze_gradient_flow,
    analyze_model_parameters,
    check_gradients,
)


class SyncCounter(TorchDispatchMode):
    """Counts host transfers: aten._local_scalar_dense (item/float/int/bool) and Tensor.tolist calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__()
        self.scalar = 0
        self.tolist = 0
        original = torch.Tensor.tolist

        def counting_tolist(t: torch.Tensor) -> object:
            self.tolist += 1
            return original(t)

        monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._local_scalar_dense.default:
            self.scalar += 1
        return func(*args, **(kwargs or {}))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


def backward(model: nn.Module, x: torch.Tensor | None = None) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 6, generator=g) if x is None else x
    model(x).pow(2).sum().backward()


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf], ids=["L2", "L1", "Linf"])
def test_norms_match_vector_norm_and_clip_grad_norm(norm_type: float) -> None:
    model = mlp()
    backward(model)
    report = check_gradients(model, norm_type=norm_type)
    for name, p in model.named_parameters():
        expected = torch.linalg.vector_norm(p.grad, norm_type).item()
        assert report[name].norm == pytest.approx(expected, rel=1e-6)
        assert report[name].max_abs == pytest.approx(p.grad.abs().max().item(), rel=1e-6)
        assert report[name].zero_fraction == pytest.approx((p.grad == 0).float().mean().item())
    # reference total: what clip_grad_norm_ returns (max_norm huge: the clip coefficient clamps to 1)
    expected_total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e30, norm_type=norm_type).item()
    assert report.total_norm == pytest.approx(expected_total, rel=1e-6)
    assert report.norm_type == norm_type


def test_hand_worked_values() -> None:
    net = nn.Linear(3, 1)
    net(torch.ones(2, 3)).sum().backward()
    # dW = sum over the batch of x = [2, 2, 2] -> |dW| = 2*sqrt(3); db = 2 -> total sqrt(12 + 4) = 4
    report = check_gradients(net)
    assert report.total_norm == pytest.approx(4.0)
    assert report["weight"].norm == pytest.approx(2 * math.sqrt(3))
    assert report["bias"].max_abs == pytest.approx(2.0)
    net.weight.grad = torch.tensor([[0.0, 3.0, -4.0]])
    # |[0, 3, -4]|_2 = 5, max 4, one zero of three; L1 = 7
    r2 = check_gradients(net)
    assert (r2["weight"].norm, r2["weight"].max_abs, r2["weight"].zero_fraction) == (
        5.0,
        4.0,
        pytest.approx(1 / 3),
    )
    assert check_gradients(net, norm_type=1)["weight"].norm == 7.0
    assert check_gradients(net, norm_type="inf").total_norm == 4.0  # max(4, |db| = 2)


def test_one_host_transfer_whatever_the_parameter_count(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(10)])  # 20 parameters
    backward(model, torch.randn(2, 4))
    counter = SyncCounter(monkeypatch)
    with counter:
        check_gradients(model)
    assert (counter.tolist, counter.scalar) == (1, 0)


def test_nonfinite_first_and_listed() -> None:
    model = mlp()
    backward(model)
    model[2].weight.grad[0, 0] = float("nan")
    model[2].weight.grad[1, 1] = float("inf")
    report = check_gradients(model)
    assert report.nonfinite == ("2.weight",)
    assert report["2.weight"].nonfinite == 2 and report["2.weight"].status == "nonfinite"
    assert math.isnan(report.total_norm)
    assert not report.ok and report.has_nonfinite
    text = str(report)
    table = text.splitlines()
    assert table[3].startswith("2.weight")  # header, column names, rule, then NaN/Inf first
    assert "NaN/Inf: 2.weight" in text


def test_ranked_by_norm_and_json() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    for p, v in zip(net.parameters(), (1.0, 3.0, 2.0, 4.0)):
        p.grad = torch.full_like(p, v)
    # norms: 0.weight 1*2=2, 0.bias 3*sqrt2=4.24, 1.weight 2*2=4, 1.bias 4*sqrt2=5.66
    report = check_gradients(net)
    assert [p.name for p in report.ranked()] == ["1.bias", "0.bias", "1.weight", "0.weight"]
    lines = str(report).splitlines()
    assert [ln.split()[0] for ln in lines[3:]] == ["1.bias", "0.bias", "1.weight", "0.weight"]
    d = json.loads(json.dumps(report.to_dict()))
    assert d["params"][0]["name"] == "0.weight" and d["total_norm"] == pytest.approx(
        math.sqrt(4 + 18 + 16 + 32)
    )


def test_parameters_without_grad_are_listed_not_crashed_on() -> None:
    model = mlp()
    model[4].weight.requires_grad_(False)
    backward(model)
    model[0].bias.grad = None
    report = check_gradients(model)
    assert report.no_grad == ("0.bias",)
    assert report.frozen == ("4.weight",)
    assert report["0.bias"].norm is None and report["0.bias"].status == "no grad"
    assert "1 without grad, 1 frozen" in str(report)
    empty = check_gradients(nn.ReLU())
    assert empty.total_norm == 0.0 and empty.params == ()
    assert check_gradients(nn.Linear(2, 2)).no_grad == ("weight", "bias")


def test_exploding_and_vanishing_thresholds() -> None:
    net = nn.Sequential(*[nn.Linear(3, 3, bias=False) for _ in range(5)])
    values = [1.0, 1.0, 1.0, 5e3, 1e-5]  # each 3x3 grad filled with v: norm 3v, RMS v
    for p, v in zip(net.parameters(), values):
        p.grad = torch.full_like(p, v)
    report = check_gradients(net)
    # median RMS 1; 5e3 is 5000x the median (> explode_rel 1e3) though its norm 1.5e4 ... above explode_abs too
    assert report.exploding == ("3.weight",)
    # 1e-5 is 1e5x below the median RMS (> vanish_rel 1e3) though its norm 3e-5 is above vanish_abs 1e-7
    assert report.vanishing == ("4.weight",)
    assert report.thresholds["explode_abs"] == 1e4
    # relative only: raise the absolute bound so only the outlier rule can fire
    rel = check_gradients(net, explode_abs=1e9)
    assert rel.exploding == ("3.weight",)
    # absolute only: too few parameters for a median (needs 3)
    one = nn.Linear(2, 1, bias=False)
    one.weight.grad = torch.tensor([[3e4, 4e4]])  # norm 5e4 > 1e4
    assert check_gradients(one).exploding == ("weight",)
    one.weight.grad = torch.zeros(1, 2)
    assert check_gradients(one).vanishing == ("weight",)


def test_bad_arguments_raise() -> None:
    with pytest.raises(TypeError, match=r"nn\.Module"):
        check_gradients(torch.zeros(2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="norm_type"):
        check_gradients(nn.Linear(1, 1), norm_type="two")
    with pytest.raises(ValueError, match="explode_abs"):
        check_gradients(nn.Linear(1, 1), explode_abs=0)


def test_analyze_model_parameters_includes_buffers_and_shows_nan() -> None:
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    stats = analyze_model_parameters(model)
    assert sorted(stats) == [
        "0.bias",
        "0.weight",
        "1.bias",
        "1.num_batches_tracked",
        "1.running_mean",
        "1.running_var",
        "1.weight",
    ]
    assert stats["0.weight"].nan_count == 1 and stats["0.weight"].has_nan
    assert stats["1.running_var"].mean == pytest.approx(1.0)  # BatchNorm starts with variance 1
    assert not stats["0.bias"].has_nan


class Reversed(nn.Module):
    """Registers a, b, unused but calls b before a; ``unused`` never gets a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 1)
        self.b = nn.Linear(2, 2)
        self.unused = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(self.b(x))


def test_gradient_flow_orders_and_marks_missing_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Reversed()
    for p, v in zip(model.parameters(), (1.0, -2.0, 0.5, 3.0)):
        p.grad = torch.full_like(p, v)
    # a: weight 2 elements of |1| + bias 1 of |2| -> mean |g| = (2*1 + 2)/3 = 4/3, max 2
    # b: weight 4 of 0.5 + bias 2 of 3 -> mean = (2 + 6)/6 = 4/3, max 3
    flow = analyze_gradient_flow(model)
    assert isinstance(flow, GradientFlow)
    assert flow.order == "registration"
    assert [lay.name for lay in flow.layers] == ["a", "b", "unused"]
    assert flow["a"].mean_abs == pytest.approx(4 / 3) and flow["a"].max_abs == 2.0
    assert flow["b"].mean_abs == pytest.approx(4 / 3) and flow["b"].max_abs == 3.0
    assert flow.no_gradient == ["unused"]
    assert "no gradient" in str(flow)

    counter = SyncCounter(monkeypatch)
    with counter:
        traced = analyze_gradient_flow(model, torch.zeros(1, 2))
    assert (counter.tolist, counter.scalar) == (1, 0)
    assert traced.order == "execution"
    assert [(lay.name, lay.called) for lay in traced.layers] == [("b", True), ("a", True), ("unused", False)]
    assert not any(m._forward_pre_hooks for m in model.modules())
    assert model.training  # restored after the eval-mode trace

    explicit = analyze_gradient_flow(model, order=["b", "a"])
    assert [lay.name for lay in explicit.layers] == ["b", "a", "unused"]
    with pytest.raises(ValueError, match="unknown modules"):
        analyze_gradient_flow(model, order=["nope"])
    assert json.loads(json.dumps(flow.to_dict()))["layers"][2]["has_grad"] is False


def test_gradient_flow_real_backward_matches_reference() -> None:
    model = mlp()
    backward(model)
    flow = analyze_gradient_flow(model)
    for lay in flow.layers:
        mod = model.get_submodule(lay.name)
        g = torch.cat([p.grad.flatten() for p in mod.parameters()])
        assert lay.mean_abs == pytest.approx(g.abs().mean().item(), rel=1e-6)
        assert lay.max_abs == pytest.approx(g.abs().max().item(), rel=1e-6)


def test_report_types_exported_by_module() -> None:
    assert GradientReport.__name__ == "GradientReport"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_one_transfer_and_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    model = mlp().cuda().half()  # fp16 grads: norms accumulate in float32
    model(torch.randn(5, 6, device="cuda", dtype=torch.half)).float().pow(2).sum().backward()
    counter = SyncCounter(monkeypatch)
    with counter:
        report = check_gradients(model)
    assert (counter.tolist, counter.scalar) == (1, 0)
    for name, p in model.named_parameters():
        assert report[name].norm == pytest.approx(torch.linalg.vector_norm(p.grad.float()).item(), rel=1e-3)

"""Seed 004 (debugging and optimization system), from its own usage examples."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from torch import nn

import torchdebug as td

# torch.compile imports torch._inductor, whose own import warns about torch.jit (torch's, not ours)
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

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


# -- the optimization half: OptimizationMode, optimize_model, PyTorchOptimizer, compare_modes -------------

import torch.nn.functional as F  # noqa: E402

from torchdebug import DebugMode, OptimizationMode, PyTorchDebugger, PyTorchOptimizer  # noqa: E402
from torchdebug.compat import debug_operation, optimize_model  # noqa: E402

FAST_COMPILE = {"backend": "aot_eager"}  # the real torch.compile path; inductor's C++ build takes ~70 s here


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(3))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _loader(n: int = 4, nan_at: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
        if i == nan_at:
            x[0, 0] = math.nan
        out.append((x, y))
    return out


def test_optimize_model_as_in_the_seed() -> None:
    debugger = PyTorchDebugger(error_system=None, training_logger=None, debug_mode=DebugMode.FULL_DEBUG)
    model = _net()
    optimized_model = debugger.optimize_model(
        model=model, optimization_mode=OptimizationMode.FULL_OPTIMIZATION
    )
    assert optimized_model is not model
    metrics = debugger.optimization_metrics[-1]
    assert metrics.mode.value == "full_optimization" and metrics.amp_enabled is True
    assert metrics.applied == [
        "activation checkpointing of 3 repeated blocks",
        "autocast bfloat16 on cpu",
        "torch.compile (backend inductor)",
    ]
    assert metrics.speedup_factor is None  # applying measures nothing; compare_modes does
    assert debugger.optimize_model(model, OptimizationMode.NONE) is model
    assert debugger.get_debug_summary()["total_optimizations"] == 2
    with pytest.raises(ValueError, match="unknown optimization mode 'turbo'; use one of none, amp"):
        debugger.optimize_model(model, "turbo")


def test_amp_and_memory_efficient_models_compute_the_same_thing() -> None:
    debugger = PyTorchDebugger()
    x, y = _loader(1)[0]
    base = _net()
    expected = base(x)
    amp = debugger.optimize_model(_net(), OptimizationMode.AMP)
    out = amp(x)
    assert out.dtype is torch.float32 and torch.allclose(out, expected, rtol=0.05, atol=0.05)
    ckpt = _net()
    assert debugger.optimize_model(ckpt, OptimizationMode.MEMORY_EFFICIENT) is ckpt  # changed in place
    F.mse_loss(ckpt(x), y).backward()
    F.mse_loss(base(x), y).backward()
    for (n, a), b in zip(ckpt.named_parameters(), base.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7), n  # recomputed, not approximated


def test_compare_modes_same_batches_and_seeds() -> None:
    cmp = td.compare_modes(
        _net(),
        F.mse_loss,
        _loader(4),
        modes=["none", "amp", "compilation", "memory_efficient"],
        compile_options=FAST_COMPILE,
    )
    none, amp, comp, mem = (cmp[m] for m in ("none", "amp", "compilation", "memory_efficient"))
    assert [r.error for r in (none, amp, comp, mem)] == [None] * 4
    assert none.speedup == 1.0 and none.loss_rel_diff == 0.0 and none.grad_rel_diff == 0.0
    assert mem.loss_rel_diff == 0.0 and mem.grad_rel_diff is not None and mem.grad_rel_diff < 1e-5
    assert mem.peak_bytes is not None and none.peak_bytes is not None and mem.peak_bytes < none.peak_bytes
    assert amp.loss_rel_diff is not None and 0 < amp.loss_rel_diff < 0.05 and amp.first_divergence is None
    assert comp.compile_s is not None and comp.compile_s > 0 and comp.peak_bytes is None
    assert comp.grad_rel_diff is not None and comp.grad_rel_diff < 1e-5
    assert all(len(r.step_times) == 4 and r.nonfinite_steps == [] for r in (none, amp, comp, mem))
    assert none.median_s is not None and none.throughput == pytest.approx(32 / none.median_s)
    text = str(cmp)
    assert text.splitlines()[0].split()[:3] == ["mode", "median", "ms"]
    assert [line.split()[0] for line in text.splitlines()[1:5]] == [
        "none",
        "amp",
        "compilation",
        "memory_efficient",
    ]
    d = cmp.to_dict()
    assert json.loads(json.dumps(d)) == d and d["baseline"] == "none"


def test_compare_modes_reports_nan_steps_and_failing_modes() -> None:
    cmp = td.compare_modes(
        _net(),
        F.mse_loss,
        _loader(4, nan_at=2),
        modes=["none", "compilation"],
        compile_options={"backend": "nope"},
    )
    assert cmp["none"].nonfinite_steps == [2, 3]  # the NaN batch poisons the weights from step 2 on
    assert cmp["compilation"].error is not None and "nope" in cmp["compilation"].error
    assert "error:" in str(cmp)


def test_optimize_training_loop_and_benchmark_as_in_the_seed() -> None:
    debugger = PyTorchDebugger()
    model = _net()
    before = [p.detach().clone() for p in model.parameters()]
    train_loader = _loader(4)
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    criterion = nn.MSELoss()
    optimizer = PyTorchOptimizer(debugger)
    result = optimizer.optimize_training_loop(
        model=model,
        dataloader=train_loader,
        optimizer=sgd,
        criterion=criterion,
        epochs=2,
        optimization_mode=OptimizationMode.AMP,
    )
    assert result["total_time"] > 0 and result["steps"] == 8
    speed = result["optimization_metrics"]["speedup_factor"]
    ab = result["optimization_metrics"]["comparison"]["results"]
    assert speed == pytest.approx(ab["none"]["median_s"] / ab["amp"]["median_s"])
    assert f"Speedup factor: {speed:.2f}x"
    assert not any(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the model trained
    assert debugger.optimization_metrics[-1].speedup_factor == speed

    benchmark_results = optimizer.benchmark_optimizations(
        model=_net(), dataloader=train_loader, optimizer=sgd, criterion=criterion, epochs=1,
        compile_options=FAST_COMPILE,
    )  # fmt: skip
    assert list(benchmark_results) == [m.value for m in OptimizationMode]
    for mode, res in benchmark_results.items():
        assert "error" not in res, (mode, res)
        assert res["total_time"] > 0 and res["steps"] == 4


def test_the_seeds_rebound_optimizer_name_gets_a_clear_error() -> None:
    optimizer = PyTorchOptimizer(PyTorchDebugger())
    with pytest.raises(TypeError, match="got the PyTorchOptimizer itself"):
        optimizer.optimize_training_loop(
            model=_net(), dataloader=_loader(2), optimizer=optimizer, criterion=nn.MSELoss(), epochs=1,
            optimization_mode=OptimizationMode.AMP,
        )  # fmt: skip


def test_optimize_model_decorator() -> None:
    @optimize_model(optimization_mode=OptimizationMode.AMP)
    def inference_step(model: nn.Module, data: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(data)

    model = _net()
    x = _loader(1)[0][0]
    out = inference_step(model, x)
    inference_step(model, x)
    assert out.dtype is torch.float32 and torch.allclose(out, model(x).detach(), rtol=0.05, atol=0.05)
    assert [m.mode for m in inference_step.optimization_metrics] == [OptimizationMode.AMP]  # once per model


class _Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


@pytest.mark.parametrize("explicit", [True, False], ids=["model=", "first-module-argument"])
def test_debug_operation_names_modules(explicit: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _Log())
    kwargs = {"model": model} if explicit else {}

    @debug_operation(debug_mode=DebugMode.ANOMALY_DETECTION, **kwargs)
    def training_step(model: nn.Module, data: torch.Tensor) -> torch.Tensor:
        return model(data).sum()

    with pytest.warns(td.TorchDebugWarning, match="aten.log"):
        training_step(model, -torch.ones(2, 4) * 10)
    (anomaly,) = training_step.debugger.anomalies
    assert (anomaly.phase, anomaly.module, anomaly.module_type, anomaly.op) == (
        "forward",
        "1",
        "_Log",
        "aten.log",
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("x", lambda o, t: o.sum()), r"model must be a torch.nn.Module, got str"),
        ((torch.nn.Linear(2, 1), "mse"), r"loss_fn must be callable \(outputs, target\) -> loss, got str"),
    ],
    ids=["model-str", "loss-str"],
)
def test_compare_modes_names_a_wrong_type(args: tuple, message: str) -> None:
    batches = [(torch.randn(2, 2), torch.randn(2, 1))] * 4
    with pytest.raises(TypeError, match=message):
        td.compare_modes(*args, batches)

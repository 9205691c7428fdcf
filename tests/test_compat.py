"""Seed-era facades (torchdebug.compat) on tiny real models: exact numbers, anomalies, restored state."""

from __future__ import annotations

import asyncio
import copy
import json
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchdebug as td
from tests.fixtures import models as fx
from tests.fixtures.models import origin_line
from torchdebug.compat import (
    AutogradAnomalyDetector,
    DebugInfo,
    GradientDebugger,
    ModelDebugger,
    PyTorchDebugConfig,
    PyTorchDebugger,
    PyTorchDebugManager,
    TensorInfo,
    TrainingDebugger,
    check_gradient_anomalies,
    check_gradient_anomalies_async,
    check_tensor_anomalies,
    check_tensor_anomalies_async,
    debug_context,
    debug_operation,
)

SEED_001_REPORT_KEYS = {
    "summary",
    "performance_analysis",
    "memory_analysis",
    "gradient_analysis",
    "operation_breakdown",
}
SEED_002_SUMMARY_KEYS = {
    "total_steps",
    "anomaly_steps",
    "gradient_explosions",
    "gradient_vanishing",
    "loss_anomalies",
    "anomaly_rate",
    "loss_anomaly_rate",
    "gradient_explosion_rate",
    "gradient_vanishing_rate",
}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # configs built from None read TORCHDEBUG_*; keep the developer's environment out of the tests
    for var in [v for v in os.environ if v.startswith("TORCHDEBUG_")]:
        monkeypatch.delenv(var)


def broken_net() -> nn.Module:
    """DeepLogNet whose blocks.1.act takes log of negative values: NaN born in forward (ORIGIN:log)."""
    torch.manual_seed(0)
    m = fx.DeepLogNet()
    m.blocks[1].act.shift = -5.0  # relu(x) - 5 < 0 everywhere reachable
    return m


def step_of(model: nn.Module, x: torch.Tensor) -> None:
    model(x).pow(2).mean().backward()


def assert_restored(model: nn.Module, apply_before: object) -> None:
    """No hooks on any module, no torch-function/dispatch mode, Function.apply and anomaly mode as before."""
    for name, mod in model.named_modules():
        assert not mod._forward_hooks, name
        assert not mod._forward_pre_hooks, name
    assert torch._C._len_torch_function_stack() == 0
    assert torch._C._len_torch_dispatch_stack() == 0
    assert torch.autograd.function.Function.__dict__["apply"] is apply_before
    assert not torch.is_anomaly_enabled()
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    assert not _global_optimizer_pre_hooks and not _global_optimizer_post_hooks


@pytest.fixture
def apply_before() -> Iterator[object]:
    yield torch.autograd.function.Function.__dict__["apply"]


# -- AutogradAnomalyDetector ---------------------------------------------------------------------------


def test_detector_raise_names_module_op_and_line(apply_before: object) -> None:
    model, x = broken_net(), torch.randn(4, 8)
    det = AutogradAnomalyDetector(mode="raise", model=model)
    with pytest.raises(td.NonFiniteError) as info, det.detect_anomaly():
        step_of(model, x)
    a = info.value.anomaly
    assert (a.phase, a.module, a.module_type, a.op, a.kind) == (
        "forward",
        "blocks.1.act",
        "LogAct",
        "aten.log",
        "nan",
    )
    assert a.location == origin_line("log")
    assert det.anomalies == [a]
    assert_restored(model, apply_before)


def test_detector_default_mode_without_config_is_raise() -> None:
    assert AutogradAnomalyDetector().mode == "raise"  # as torch.autograd.detect_anomaly raises
    assert AutogradAnomalyDetector(td.DebugConfig(anomaly_detection_mode="warn")).mode == "warn"


def test_detector_warn_warns_and_records(apply_before: object) -> None:
    model, x = broken_net(), torch.randn(4, 8)
    det = AutogradAnomalyDetector(mode="warn", model=model)
    with (
        pytest.warns(td.TorchDebugWarning, match=r"blocks\.1\.act \(LogAct\): aten\.log"),
        det.detect_anomaly(),
    ):
        step_of(model, x)
    assert [a.module for a in det.anomalies] == ["blocks.1.act"]
    assert_restored(model, apply_before)


def test_detector_detect_records_only(apply_before: object) -> None:
    model, x = broken_net(), torch.randn(4, 8)
    det = AutogradAnomalyDetector(mode="detect")
    with det.detect_anomaly(model):  # no warning: filterwarnings=error would fail the test
        step_of(model, x)
    (a,) = det.anomalies
    assert (a.module, a.op, a.location) == ("blocks.1.act", "aten.log", origin_line("log"))
    # a healthy block adds nothing
    with det.detect_anomaly(model):
        step_of(fx.MLP(), torch.randn(2, 8))
    assert len(det.anomalies) == 1
    assert_restored(model, apply_before)


def test_detector_without_model_still_names_op_and_line() -> None:
    model, x = broken_net(), torch.randn(4, 8)
    det = AutogradAnomalyDetector(mode="detect")
    with det.detect_anomaly():
        step_of(model, x)
    (a,) = det.anomalies
    assert (a.module, a.op, a.location) == ("", "aten.log", origin_line("log"))


def test_detector_error_after_nan_raises_nonfinite_chained(apply_before: object) -> None:
    model, x = broken_net(), torch.randn(4, 8)
    det = AutogradAnomalyDetector(mode="raise", model=model)
    with pytest.raises(td.NonFiniteError) as info, det.detect_anomaly():
        model(x)  # forward only: no backward() stops the block, its end does
        raise KeyError("user bug after the NaN")
    assert isinstance(info.value.__cause__, KeyError)
    assert_restored(model, apply_before)
    # with a backward the NaN stops the block there (as torch's detect_anomaly): the user's line never runs
    reached = []
    with pytest.raises(td.NonFiniteError) as info, det.detect_anomaly():
        step_of(model, x)
        reached.append(True)
    assert reached == [] and info.value.__cause__ is None
    assert_restored(model, apply_before)
    # detect mode: the user's error goes through, the anomaly is kept
    det = AutogradAnomalyDetector(mode="detect", model=model)
    with pytest.raises(KeyError, match="user bug"), det.detect_anomaly():
        step_of(model, x)
        raise KeyError("user bug")
    assert len(det.anomalies) == 1
    assert_restored(model, apply_before)


def test_detector_error_without_nan_propagates_and_cleans_up(apply_before: object) -> None:
    model = fx.MLP()
    det = AutogradAnomalyDetector(mode="raise", model=model)
    with pytest.raises(ValueError, match="plain"), det.detect_anomaly():
        model(torch.randn(2, 8))
        raise ValueError("plain")
    assert det.anomalies == []
    assert_restored(model, apply_before)


def test_detector_nested_blocks_report_once() -> None:
    model, x = broken_net(), torch.randn(4, 8)
    det = AutogradAnomalyDetector(mode="detect", model=model)
    with det.detect_anomaly(), det.detect_anomaly():
        step_of(model, x)
    assert len(det.anomalies) == 1


def test_detector_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="detect, warn, raise"):
        AutogradAnomalyDetector(mode="loud")
    with pytest.raises(TypeError, match=r"nn\.Module"):
        AutogradAnomalyDetector(model="net")  # type: ignore[arg-type]


# -- PyTorchDebugger -------------------------------------------------------------------------------


def test_debugger_accepts_every_seed_constructor_shape() -> None:
    cfg = td.DebugConfig(level="advanced", anomaly_detection_mode="raise")
    assert PyTorchDebugger(cfg).config is cfg  # seed 001
    assert PyTorchDebugger(cfg).mode_on_anomaly == "raise"
    assert PyTorchDebugger(td.DebugLevel.EXPERT).level is td.DebugLevel.EXPERT  # seed 002
    assert PyTorchDebugger("extreme").level is td.DebugLevel.EXPERT  # seed 002's name of the deepest
    seed4 = PyTorchDebugger(
        error_system="errors", training_logger="logger", debug_mode=td.DebugMode.FULL_DEBUG
    )
    assert (seed4.error_system, seed4.training_logger, seed4.debug_mode) == (
        "errors",
        "logger",
        td.DebugMode.FULL_DEBUG,
    )
    assert seed4.anomaly_detection_active  # the seed wrapped its blocks in detect_anomaly
    assert not PyTorchDebugger().anomaly_detection_active  # tracing costs 2-4x: opt-in
    seed3 = PyTorchDebugger(PyTorchDebugConfig(enable_autograd_anomaly=True, anomaly_detection_mode="detect"))
    assert seed3.anomaly_detection_active and seed3.mode_on_anomaly == "detect"
    with pytest.raises(td.ConfigError):
        PyTorchDebugger({"no_such_option": 1})


def test_autograd_anomaly_detection_uses_config_mode(apply_before: object) -> None:
    model, x = broken_net(), torch.randn(4, 8)
    dbg = PyTorchDebugger(td.DebugConfig(anomaly_detection_mode="raise"))
    with pytest.raises(td.NonFiniteError, match=r"blocks\.1\.act"), dbg.autograd_anomaly_detection(model):
        step_of(model, x)
    assert len(dbg.anomalies) == 1
    assert_restored(model, apply_before)


def test_module_debug_context_stops_in_backward_and_warns_without_one(apply_before: object) -> None:
    model, x = broken_net(), torch.randn(4, 8)
    # a backward that ends with the NaN raises there in the default warn mode (seed 002's block ran
    # under torch.autograd.detect_anomaly, which raises in backward)
    with (
        pytest.raises(td.NonFiniteError, match=r"aten\.log"),
        debug_context(td.DebugLevel.BASIC, model=model) as dbg,
    ):
        step_of(model, x)
    assert isinstance(dbg, PyTorchDebugger) and dbg.level is td.DebugLevel.BASIC
    assert dbg.anomalies[0].module == "blocks.1.act"
    assert_restored(model, apply_before)
    # forward only: warned when the block ends
    with (
        pytest.warns(td.TorchDebugWarning, match=r"aten\.log"),
        debug_context(td.DebugLevel.BASIC, model=model) as dbg,
    ):
        model(x)
    assert [a.module for a in dbg.anomalies] == ["blocks.1.act"]
    assert_restored(model, apply_before)


def test_debug_context_fills_info_and_keeps_failed_blocks() -> None:
    dbg = PyTorchDebugger(history_size=2)
    with dbg.debug_context("alloc", "mlp", epoch=1, batch=2) as info:
        keep = torch.zeros(1 << 16)
    assert isinstance(info, DebugInfo) and keep.numel() == 1 << 16
    assert (info.operation, info.model_name, info.epoch, info.batch) == ("alloc", "mlp", 1, 2)
    assert info.execution_time > 0 and isinstance(info.memory_usage, int) and info.gpu_memory == 0
    assert not info.anomaly_detected and info.rss > 0
    with pytest.raises(RuntimeError, match="boom"), dbg.debug_context("fails"):
        raise RuntimeError("boom")
    failed = dbg.debug_history[-1]
    assert failed.operation == "fails" and failed.anomaly_detected and "boom" in (failed.error or "")
    with dbg.debug_context("third"):
        pass
    assert [i.operation for i in dbg.debug_history] == ["fails", "third"]  # bounded: oldest dropped
    json.dumps(failed.to_dict())


def test_traced_debug_context_sets_the_anomaly_on_the_record(apply_before: object) -> None:
    model, x = broken_net(), torch.randn(4, 8)
    dbg = PyTorchDebugger(td.DebugConfig(enable_anomaly_detection=True, anomaly_detection_mode="warn"))
    with pytest.raises(td.NonFiniteError), dbg.debug_context("step", model=model) as info:
        step_of(model, x)  # raises out of backward() (warn mode too: the seed's detect_anomaly did)
    assert info.anomaly_detected and info.anomaly is not None and info.anomaly.op == "aten.log"
    assert dbg.anomalies == [info.anomaly]
    assert_restored(model, apply_before)


def test_analyze_tensor_and_parameters_keep_seed_names() -> None:
    dbg = PyTorchDebugger()
    t = dbg.analyze_tensor(torch.tensor([1.0, 2.0, 6.0, float("nan")]), "x")
    assert isinstance(t, TensorInfo) and isinstance(t, td.TensorStats)
    assert t.has_nan and not t.has_inf and t.mean_value == 3.0  # (1 + 2 + 6) / 3 over finite values
    net = nn.Linear(2, 1)
    with torch.no_grad():
        net.bias.fill_(float("inf"))
    params = dbg.analyze_model_parameters(net)
    assert sorted(params) == ["bias", "weight"]
    assert params["bias"].has_inf and not params["weight"].has_inf


def linear_with_grads() -> nn.Linear:
    """Linear(3, 1) after sum over 2 rows of ones: dW = [2, 2, 2] (norm 2*sqrt(3)), db = 2; total 4."""
    net = nn.Linear(3, 1)
    net(torch.ones(2, 3)).sum().backward()
    return net


def test_explosion_and_vanishing_with_explicit_thresholds() -> None:
    dbg = PyTorchDebugger()
    net = linear_with_grads()
    assert dbg.check_gradient_explosion(net, threshold=3.0) == ["weight"]  # 3.46 > 3 > 2
    assert dbg.check_gradient_explosion(net, threshold=10.0) == []
    assert dbg.check_gradient_vanishing(net, threshold=2.5) == ["bias"]  # 2 < 2.5 < 3.46
    assert dbg.check_gradient_vanishing(net) == []
    net.bias.grad[0] = float("nan")
    assert dbg.check_gradient_explosion(net, threshold=10.0) == ["bias"]  # NaN/Inf need the same attention


def test_check_gradients_seed_004_dict() -> None:
    dbg = PyTorchDebugger()
    net = linear_with_grads()
    info = dbg.check_gradients(net, loss=torch.tensor(0.5))
    assert info["gradient_norm"] == pytest.approx(4.0)  # sqrt(3 * 2**2 + 2**2)
    assert info["gradient_anomalies"] == [] and info["loss"] == 0.5
    assert info["parameter_stats"]["bias"]["norm"] == pytest.approx(2.0)
    net.weight.grad[0, 1] = float("inf")
    info = dbg.check_gradients(net, loss=torch.tensor(float("nan")))
    assert info["gradient_anomalies"][0].startswith("NaN/Inf loss")
    assert info["gradient_anomalies"][1] == "NaN/Inf gradient in weight (1 non-finite elements)"
    assert math.isinf(info["gradient_norm"])


def test_forward_and_backward_pass_numbers() -> None:
    torch.manual_seed(0)
    model, x, y = fx.MLP(), torch.randn(5, 8), torch.randn(5, 4)
    dbg = PyTorchDebugger()
    out = dbg.debug_forward_pass(model, x, epoch=3)
    assert torch.equal(out, model(x))
    norm = dbg.debug_backward_pass(F.mse_loss(out, y), model, epoch=3)
    grads = [p.grad for p in model.parameters()]
    assert norm == pytest.approx(
        float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))), rel=1e-6
    )
    fwd, bwd = dbg.debug_history
    assert (fwd.operation, bwd.operation, bwd.epoch, bwd.gradient_norm) == (
        "forward_pass",
        "backward_pass",
        3,
        norm,
    )
    assert not fwd.anomaly_detected and not bwd.anomaly_detected


def test_forward_pass_nan_is_replayed_to_its_origin() -> None:
    model, x = broken_net(), torch.randn(4, 8)
    dbg = PyTorchDebugger(td.DebugConfig(anomaly_detection_mode="raise"))
    with pytest.raises(td.NonFiniteError) as info:
        dbg.debug_forward_pass(model, x)
    assert (info.value.anomaly.module, info.value.anomaly.location) == ("blocks.1.act", origin_line("log"))
    assert dbg.debug_history[-1].anomaly is info.value.anomaly
    for p in model.parameters():
        assert p.grad is None  # the replay's backward left no gradients behind


def test_backward_pass_nan_gradient_is_recorded_per_mode() -> None:
    torch.manual_seed(0)
    model = fx.MLP()
    x = torch.randn(2, 8)
    x[0, 0] = float("nan")
    dbg = PyTorchDebugger()  # default anomaly_detection_mode "warn"
    with pytest.warns(td.TorchDebugWarning, match="non-finite loss"):
        norm = dbg.debug_backward_pass(model(x).sum(), model)
    assert math.isnan(norm)
    a = dbg.anomalies[0]
    assert a.detected_by == "sentinel (no replay)" and "locate_nonfinite" in a.hint


def test_memory_performance_and_summary() -> None:
    dbg = PyTorchDebugger()
    cpu, gpu = dbg.debug_memory_usage(epoch=0, batch=1)
    assert cpu > 0 and gpu == 0
    assert dbg.memory_history[-1]["cpu_memory"] == cpu
    with dbg.debug_context("train"):
        pass
    assert dbg.debug_performance("train") == dbg.debug_history[-1].execution_time
    assert dbg.debug_performance("never ran") == 0.0
    prof = dbg.profile_memory("batch_0")
    assert prof["label"] == "batch_0" and prof["rss"] > 0 and prof["memory_leaks"] == []
    assert 0.0 <= prof["cpu_memory"] <= 100.0
    summary = dbg.get_debug_summary()
    assert summary["total_operations"] == 2 and summary["total_anomalies"] == 0
    dbg.clear_debug_history()
    assert dbg.get_debug_summary()["total_operations"] == 0


def test_create_debug_report_has_seed_keys_and_counts() -> None:
    torch.manual_seed(0)
    model, x, y = fx.MLP(), torch.randn(4, 8), torch.randn(4, 4)
    dbg = PyTorchDebugger()
    empty = dbg.create_debug_report()
    assert set(empty) >= SEED_001_REPORT_KEYS
    assert empty["performance_analysis"]["average_execution_time"] is None
    out = dbg.debug_forward_pass(model, x)
    norm = dbg.debug_backward_pass(F.mse_loss(out, y), model)
    rep = dbg.create_debug_report()
    assert set(rep) == SEED_001_REPORT_KEYS | {"anomalies"}
    assert rep["summary"]["total_debug_operations"] == 2 and rep["summary"]["anomalies_detected"] == 0
    assert rep["summary"]["debug_mode"] == "full_debug"
    assert rep["operation_breakdown"] == {"forward_pass": 1, "backward_pass": 1}
    assert rep["gradient_analysis"] == {
        "average_gradient_norm": norm,
        "max_gradient_norm": norm,
        "gradient_anomalies": 0,
    }
    json.dumps(rep, allow_nan=False)


def test_create_debug_plots_writes_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    dbg = PyTorchDebugger({"debug_output_dir": str(tmp_path / "out")})
    assert dbg.create_debug_plots() is None  # nothing recorded yet, as in the seed
    model = fx.MLP()
    dbg.debug_backward_pass(model(torch.randn(2, 8)).sum(), model)
    path = dbg.create_debug_plots()
    assert path == tmp_path / "out" / "debug_analysis.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_debug_operation_decorator_records_each_call() -> None:
    @debug_operation(td.DebugMode.NONE)
    def add(a: int, b: int) -> int:
        return a + b

    assert add(2, 3) == 5
    assert [i.operation for i in add.debugger.debug_history] == ["add"]  # type: ignore[attr-defined]


# -- PyTorchDebugManager ------------------------------------------------------------------------------


def sgd_setup() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = fx.MLP()
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(6, 8), torch.randn(6, 4)


def test_manager_training_step_numbers_match_a_hand_computation(apply_before: object) -> None:
    model, opt, x, y = sgd_setup()
    ref = copy.deepcopy(model)
    mgr = PyTorchDebugManager(td.DebugConfig(store=False))
    m = mgr.debug_training_step(model, opt, F.mse_loss, x, y, epoch=0, batch=0)

    ref_loss = F.mse_loss(ref(x), y)
    ref_loss.backward()
    before = [p.detach().clone() for p in ref.parameters()]
    grads = [p.grad for p in ref.parameters()]
    # clip_grad_norm_ with an infinite max_norm clips nothing and returns the total L2 norm
    ref_total = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf")))
    flat = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])))
    assert m["loss"] == pytest.approx(float(ref_loss.detach()), rel=1e-6)
    assert m["gradient_norm"] == pytest.approx(ref_total, rel=1e-6)
    assert m["gradient_norm"] == pytest.approx(flat, rel=1e-6)
    # param_norm: the parameters entering the update
    assert m["param_norm"] == pytest.approx(
        float(torch.linalg.vector_norm(torch.cat([p.flatten() for p in before]))), rel=1e-6
    )
    # the update ran: SGD p <- p - 0.1 * grad
    for p, b, g in zip(model.parameters(), before, grads):
        torch.testing.assert_close(p.detach(), b - 0.1 * g)
    assert m["cpu_memory"] > 0 and m["gpu_memory"] == 0 and m["execution_time"] > 0
    assert (m["skipped"], m["anomaly"]) == (False, None)
    assert mgr.debugger.debug_history[-1].gradient_norm == m["gradient_norm"]
    assert_restored(model, apply_before)


def test_manager_nan_step_raises_before_the_update() -> None:
    model = broken_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    mgr = PyTorchDebugManager(td.DebugConfig(anomaly_detection_mode="raise", store=False))
    with pytest.raises(td.NonFiniteError) as info:
        mgr.debug_training_step(model, opt, lambda out, t: out.pow(2).mean(), torch.randn(4, 8), None)
    a = info.value.anomaly
    assert (a.module, a.op, a.location, a.step) == ("blocks.1.act", "aten.log", origin_line("log"), 0)
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)


def test_manager_nan_step_warns_skips_and_logs_to_the_run_store(tmp_path: Path) -> None:
    model, opt, x, y = sgd_setup()
    mgr = PyTorchDebugManager(td.DebugConfig(anomaly_detection_mode="warn"))
    writer = mgr.setup_training_logging("exp", root=str(tmp_path))
    good = mgr.debug_training_step(model, opt, F.mse_loss, x, y)
    before = [p.detach().clone() for p in model.parameters()]
    bad_x = x.clone()
    bad_x[1, 2] = float("nan")
    with pytest.warns(td.TorchDebugWarning, match="nan born in input"):
        bad = mgr.debug_training_step(model, opt, F.mse_loss, bad_x, y, batch=1)
    assert bad["skipped"] and bad["anomaly"].phase == "input" and math.isnan(bad["loss"])
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)  # the NaN step did not reach the weights
    path = writer.path
    mgr.close()
    run = td.open_run(path)
    try:
        series = run.series("loss")
        assert series.steps == [0, 1] and series.values[0] == good["loss"] and math.isnan(series.values[1])
        assert [a["phase"] for a in run.anomalies()] == ["input"]
    finally:
        run.close()
    report = mgr.create_comprehensive_report()
    assert report["summary"]["anomalies_detected"] == 1 and report["run_dir"] is None
    json.dumps(report)


def test_manager_inference_and_seed_003_attributes() -> None:
    model, _, x, _ = sgd_setup()
    mgr = PyTorchDebugManager()
    res = mgr.debug_model_inference(model, x)
    with torch.no_grad():
        assert torch.equal(res["output"], model(x))
    assert not res["output"].requires_grad and not res["anomaly_detected"] and res["execution_time"] > 0
    assert isinstance(mgr.anomaly_detector, AutogradAnomalyDetector)
    assert isinstance(mgr.gradient_debugger, GradientDebugger)
    assert isinstance(mgr.training_debugger, TrainingDebugger)
    assert isinstance(mgr.memory_debugger, td.compat.PyTorchMemoryDebugger)
    assert mgr.generate_comprehensive_report()["operation_breakdown"] == {"inference": 1}


# -- TrainingDebugger -------------------------------------------------------------------------------


def test_training_debugger_summary_with_one_nan_step() -> None:
    torch.manual_seed(0)
    model = fx.MLP()
    dbg = TrainingDebugger(td.DebugLevel.ADVANCED)
    infos = []
    for step in range(5):
        model.zero_grad()
        x = torch.randn(4, 8)
        if step == 2:
            x[0, 0] = float("nan")
        loss = model(x).pow(2).mean()
        loss.backward()
        if step == 2:
            with pytest.warns(td.TorchDebugWarning, match="non-finite loss"):
                infos.append(dbg.monitor_training_step(model, loss, step))
        else:
            infos.append(dbg.monitor_training_step(model, loss, step))
    summary = dbg.get_training_summary()
    assert set(summary) == SEED_002_SUMMARY_KEYS
    # 5 steps, one with a NaN loss (and NaN gradients): 1/5 = 0.2
    assert summary == {
        "total_steps": 5,
        "anomaly_steps": 1,
        "gradient_explosions": 0,
        "gradient_vanishing": 0,
        "loss_anomalies": 1,
        "anomaly_rate": 0.2,
        "loss_anomaly_rate": 0.2,
        "gradient_explosion_rate": 0.0,
        "gradient_vanishing_rate": 0.0,
    }
    bad = infos[2]
    assert bad["loss_anomaly"] and bad["nonfinite_gradients"] == [
        "fc1.weight",
        "fc1.bias",
        "fc2.weight",
        "fc2.bias",
    ]
    assert bad["anomaly"].step == 2 and infos[1]["anomaly"] is None
    assert infos[0]["gradient_norm"] == pytest.approx(dbg.debug_history[0].gradient_norm)
    dbg.clear_debug_history()
    assert dbg.get_training_summary()["total_steps"] == 0


def test_training_debugger_explosion_is_relative_not_a_fixed_threshold() -> None:
    torch.manual_seed(0)
    model = fx.MLP()
    dbg = TrainingDebugger(td.DebugConfig(explode_warmup=3))
    x = torch.randn(4, 8)
    flags = []
    for step in range(6):
        model.zero_grad()
        scale = 1e-4 if step < 5 else 1e-1  # norms ~1e-4, then 1000x: still far below explode_abs (1e4)
        loss = model(x).pow(2).mean() * scale
        loss.backward()
        flags.append(dbg.monitor_training_step(model, loss, step)["gradient_explosion"])
    assert flags == [False] * 5 + [True]
    s = dbg.get_training_summary()
    assert (s["gradient_explosions"], s["anomaly_steps"], s["gradient_explosion_rate"]) == (1, 1, 1 / 6)


def test_training_debugger_full_step_locates_and_skips() -> None:
    model, opt, x, y = sgd_setup()
    dbg = TrainingDebugger(td.DebugConfig(anomaly_detection_mode="raise"))
    ok = dbg.debug_training_step(model, opt, F.mse_loss, x, y, step=0)
    assert not ok["skipped"] and ok["anomaly"] is None
    broken = broken_net()
    opt2 = torch.optim.SGD(broken.parameters(), lr=0.1)
    with pytest.raises(td.NonFiniteError) as info:
        dbg.debug_training_step(broken, opt2, lambda out, t: out.sum(), torch.randn(4, 8), None, step=7)
    assert (info.value.anomaly.module, info.value.anomaly.step) == ("blocks.1.act", 7)


# -- GradientDebugger / ModelDebugger / PyTorchDebugConfig ------------------------------------------


def test_gradient_debugger_check_flow_and_clip() -> None:
    gd = GradientDebugger()
    net = linear_with_grads()
    rep = gd.check_gradients(net, step=4)
    assert rep.total_norm == pytest.approx(4.0) and gd.history[-1]["step"] == 4
    assert [layer.name for layer in gd.analyze_gradient_flow(net).layers] == [""]
    assert gd.clip_gradients(net, max_norm=1.0) == pytest.approx(4.0)  # the norm before clipping
    clipped = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in net.parameters()]))
    assert float(clipped) == pytest.approx(1.0, rel=1e-5)
    assert gd.clip_history[-1]["clipped"]
    with pytest.raises(ValueError, match="max_norm"):
        gd.clip_gradients(net, max_norm=0)


def test_model_debugger_validates_inputs() -> None:
    md = ModelDebugger()
    ok = md._validate_model_inputs(fx.MLP(), (2, 8))
    assert ok["valid"] and ok["output_shape"] == [2, 4] and ok["problems"] == []
    bad = md._validate_model_inputs(fx.MLP(), (2, 5))
    assert not bad["valid"] and bad["problems"]
    assert md.inspect_model(fx.MLP(), (3, 8)).total_params == 8 * 16 + 16 + 16 * 4 + 4


def test_seed_003_config_maps_onto_debug_config() -> None:
    cfg = PyTorchDebugConfig(
        enable_autograd_anomaly=True,
        gradient_norm_threshold=1e3,
        gradient_clip_threshold=1.0,
        memory_snapshot_frequency=10,
        track_tensor_memory=True,
    ).to_debug_config()
    assert (cfg.mode, cfg.explode_abs, cfg.clip_on_spike, cfg.memory_every) == (
        td.DebugMode.NONE,
        1e3,
        1.0,
        10,
    )
    assert cfg.instruments() == {"nonfinite", "gradients", "memory", "module_memory"}
    quiet = PyTorchDebugConfig(
        enable_gradient_debugging=False, enable_memory_debugging=False
    ).to_debug_config()
    assert quiet.instruments() == frozenset()
    with pytest.raises(td.ConfigError, match="memory_every"):
        PyTorchDebugConfig(memory_snapshot_frequency=0)
    with pytest.raises(td.ConfigError, match="anomaly_detection_mode"):
        PyTorchDebugConfig(anomaly_detection_mode="loud")


# -- tensor / gradient checks, plain and async ----------------------------------------------------------


def test_check_tensor_anomalies_plain_and_async() -> None:
    t = torch.tensor([1.0, float("nan"), float("inf"), 3.0, float("nan")])
    plain = check_tensor_anomalies(t, "loss")
    assert asyncio.run(check_tensor_anomalies_async(t, "loss")) == plain
    assert (plain["has_nan"], plain["has_inf"], plain["nan_count"], plain["posinf_count"]) == (
        True,
        True,
        2,
        1,
    )
    assert (plain["name"], plain["mean"], plain["min"], plain["max"]) == ("loss", 2.0, 1.0, 3.0)


def test_check_gradient_anomalies_plain_and_async() -> None:
    torch.manual_seed(0)
    model = fx.MLP()
    model(torch.randn(2, 8)).sum().backward()
    ok = asyncio.run(check_gradient_anomalies_async(model))
    ref = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert (ok["params_with_nan_grad"], ok["params_with_inf_grad"], ok["params_with_grad"]) == (0, 0, 4)
    assert ok["total_norm"] == pytest.approx(float(ref), rel=1e-6)
    model.fc1.bias.grad[3] = float("nan")
    model.fc2.weight.grad[0, 0] = float("-inf")
    bad = check_gradient_anomalies(model)
    assert (bad["nan_params"], bad["inf_params"]) == (["fc1.bias"], ["fc2.weight"])
    assert (bad["params_with_nan_grad"], bad["params_with_inf_grad"]) == (1, 1) and math.isnan(
        bad["total_norm"]
    )
    assert check_gradient_anomalies(nn.Linear(2, 2))["params_with_grad"] == 0


def test_profile_memory_usage_counts_parameter_gradient_and_buffer_bytes() -> None:
    model = fx.MLP()  # 8*16 + 16 + 16*4 + 4 = 212 float32 parameters = 848 bytes
    dbg = PyTorchDebugger()
    assert dbg.profile_memory_usage(model) == {"parameters": 848, "gradients": 0, "buffers": 0, "total": 848}
    model(torch.randn(2, 8)).sum().backward()
    bn = nn.BatchNorm1d(4)  # running_mean, running_var: 4 float32 each; num_batches_tracked: one int64
    assert dbg.profile_memory_usage(model)["total"] == 848 + 848
    assert dbg.profile_memory_usage(bn)["buffers"] == 4 * 4 + 4 * 4 + 8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_manager_training_step_on_cuda_matches_reference() -> None:
    model, _, x, y = sgd_setup()
    model, x, y = model.cuda(), x.cuda(), y.cuda()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    m = PyTorchDebugManager(td.DebugConfig(store=False)).debug_training_step(model, opt, F.mse_loss, x, y)
    F.mse_loss(ref(x), y).backward()
    assert m["gradient_norm"] == pytest.approx(
        float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e30)), rel=1e-5
    )
    assert m["gpu_memory"] > 0


def test_profiling_and_resources_delegate_to_the_engine(tmp_path: Path) -> None:
    dbg = PyTorchDebugger()
    summary = dbg.profile_model_performance(nn.Linear(4, 1), [torch.ones(2, 4)] * 4, num_batches=1)
    assert summary.steps == 1
    res = dbg.monitor_resources(cpu_threshold=101, memory_threshold=101, interval=0.0)
    assert res["warnings"] == [] and res["rss"] > 0


def test_create_debug_plots_without_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    dbg = PyTorchDebugger()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an environment without it looks like
    with pytest.raises(ImportError, match=r"pip install 'torchdebug\[report\]'"):
        dbg.create_debug_plots()

"""Seed options are either mapped onto the engine or refused, never accepted and ignored."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchdebug as td
from torchdebug.store import open_run


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def _train(mon: td.Monitor, model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        mon.step()


# -- frequencies -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seed", "engine"),
    [("gradient_checking_frequency", "detail_every"), ("memory_profiling_frequency", "memory_every")],
)
def test_seed_frequencies_are_the_engine_schedules(seed: str, engine: str) -> None:
    cfg = td.DebugConfig(**{seed: 3})
    assert (getattr(cfg, seed), getattr(cfg, engine)) == (3, 3)
    cfg = td.DebugConfig(**{engine: 4})
    assert (getattr(cfg, seed), getattr(cfg, engine)) == (4, 4)
    cfg.__setattr__(seed, 7)
    assert (getattr(cfg, seed), getattr(cfg, engine)) == (7, 7)  # one schedule, two names
    assert td.DebugConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(td.ConfigError, match=f"{seed}=2 and {engine}=5 name the same schedule"):
        td.DebugConfig(**{seed: 2, engine: 5})


def test_gradient_checking_frequency_drives_the_detail_steps(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = td.DebugConfig(mode="gradient_checking", gradient_checking_frequency=3)
    with td.watch(model, opt, config=cfg, run=tmp_path) as mon:
        _train(mon, model, opt, 7)
    with open_run(mon.run_dir) as run:
        assert run.series("grad_norm/0.weight").steps == [0, 3, 6]


def test_memory_profiling_frequency_drives_the_memory_samples(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = td.DebugConfig(mode="memory_profiling", level="basic", memory_profiling_frequency=2)
    with td.watch(model, opt, config=cfg, run=tmp_path) as mon:
        _train(mon, model, opt, 5)
    with open_run(mon.run_dir) as run:
        assert [m["step"] for m in run.memory()] == [0, 2, 4]


def test_performance_profiling_frequency_is_refused_with_the_reason() -> None:
    assert td.DebugConfig(performance_profiling_frequency=10).performance_profiling_frequency == 10
    with pytest.raises(td.ConfigError, match="step timing runs on every step"):
        td.DebugConfig(performance_profiling_frequency=5)


# -- log_memory / log_performance --------------------------------------------------------------------


def test_log_memory_and_log_performance_false_switch_their_instruments_off() -> None:
    full = td.DebugConfig(mode="full_debug", level="expert")
    assert {"memory", "module_memory", "timing", "flops", "module_time", "profiler"} <= full.instruments()
    quiet = full.replace(log_memory=False, log_performance=False)
    assert quiet.instruments() == {"nonfinite", "gradients", "gradient_details", "activations"}
    with pytest.raises(td.ConfigError, match="log_memory=False contradicts enable_memory_profiling=True"):
        td.DebugConfig(log_memory=False, enable_memory_profiling=True)
    with pytest.raises(td.ConfigError, match="log_performance=False contradicts flops=True"):
        td.DebugConfig(log_performance=False, flops=True)


def test_seed_001_production_config_runs_no_memory_or_timing_it_did_not_ask_for() -> None:
    # the seed's "Production Debugging" example: memory and performance profiling, logged, not saved
    cfg = td.DebugConfig(
        mode=td.DebugMode.MEMORY_PROFILING,
        level=td.DebugLevel.INTERMEDIATE,
        enable_memory_profiling=True,
        enable_performance_profiling=True,
        log_memory=True,
        log_performance=True,
        save_debug_info=False,
    )
    assert cfg.instruments() == {"nonfinite", "memory", "timing"}


# -- save_debug_info + debug_output_dir, the facades' log_* switches -----------------------------------


def test_save_debug_info_writes_each_operation_as_json(tmp_path: Path) -> None:
    out = tmp_path / "custom_debug_outputs"
    dbg = td.PyTorchDebugger(td.DebugConfig(save_debug_info=True, debug_output_dir=str(out)))
    model = _model()
    x = torch.randn(2, 4)
    dbg.debug_forward_pass(model, x)
    dbg.debug_backward_pass(model(x).sum(), model)
    lines = (out / "debug_info.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["operation"] for r in rows] == ["forward_pass", "backward_pass"]
    assert rows[1]["gradient_norm"] == pytest.approx(dbg.debug_history[1].gradient_norm)
    assert rows[0]["model_name"] == "Sequential"
    quiet = td.PyTorchDebugger(td.DebugConfig(debug_output_dir=str(tmp_path / "never")))
    quiet.debug_forward_pass(model, x)
    assert not (tmp_path / "never").exists()  # save_debug_info is opt-in


def test_unwritable_debug_output_dir_warns_once_and_training_goes_on(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    dbg = td.PyTorchDebugger(td.DebugConfig(save_debug_info=True, debug_output_dir=str(blocker / "out")))
    with pytest.warns(td.TorchDebugWarning, match=re.escape("cannot save debug info")):
        dbg.debug_forward_pass(_model(), torch.randn(2, 4))
    dbg.debug_forward_pass(_model(), torch.randn(2, 4))  # no second warning (warnings are errors)
    assert len(dbg.debug_history) == 2 and dbg.config.save_debug_info is False


def test_facade_log_switches_record_activations_gradients_and_weights() -> None:
    model = _model()
    x = torch.randn(5, 4)
    cfg = td.DebugConfig(log_activations=True, log_gradients=True, log_weights=True)
    dbg = td.PyTorchDebugger(cfg)
    out = dbg.debug_forward_pass(model, x)
    act = dbg.debug_history[-1].details["activations"]
    assert sorted(act) == ["0", "1", "2"]
    with torch.no_grad():
        h = model[0](x)
    assert act["0"]["mean"] == pytest.approx(h.mean().item(), rel=1e-6)
    assert act["1"]["zero"] == pytest.approx((h.relu() == 0).float().mean().item())
    assert "dead" in act["1"] and "dead" not in act["0"]  # dead-unit fraction for ReLU outputs only
    dbg.debug_backward_pass(out.sum(), model)
    details = dbg.debug_history[-1].details
    for name, p in model.named_parameters():
        assert details["gradients"][name] == pytest.approx(p.grad.norm().item(), rel=1e-6)
        assert details["weights"][name] == pytest.approx(p.detach().norm().item(), rel=1e-6)
    plain = td.PyTorchDebugger(td.DebugConfig())
    plain.debug_forward_pass(model, x)
    assert plain.debug_history[-1].details == {}
    assert not any(m._forward_hooks for m in model.modules())


def test_manager_training_step_honours_the_log_switches() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mgr = td.PyTorchDebugManager(td.DebugConfig(log_activations=True, log_gradients=True, log_weights=True))
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    mgr.debug_training_step(model, opt, nn.MSELoss(), x, y)
    details = mgr.debugger.debug_history[-1].details
    assert sorted(details) == ["activations", "gradients", "weights"]
    assert sorted(details["gradients"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert details["weights"]["2.bias"] == pytest.approx(model[2].bias.detach().norm().item(), rel=1e-6)

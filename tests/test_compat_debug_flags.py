"""Seed 000 (SEO engine's debugging flags), from its own usage examples: flags, runtime control, placement."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchdebug as td
from torchdebug.store import open_run

SEED_FLAGS = [
    "enable_autograd_anomaly",
    "enable_autograd_profiler",
    "enable_tensorboard_profiler",
    "debug_memory_usage",
    "debug_gradient_norms",
    "debug_forward_pass",
    "debug_backward_pass",
    "debug_device_placement",
    "debug_mixed_precision",
    "debug_data_loading",
    "debug_validation",
    "debug_early_stopping",
    "debug_lr_scheduling",
]


def _step(mon: td.Monitor, model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()
    mon.step()


def test_the_seed_config_class_fields_all_exist_and_default_off() -> None:
    cfg = td.DebugConfig()
    assert all(getattr(cfg, f) is False for f in SEED_FLAGS)


def test_runtime_control_switches_instruments_at_a_step_boundary(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with td.watch(model, opt, config=td.DebugConfig(mode="none", memory_every=1), run=tmp_path) as mon:
        assert mon.get_debugging_status()["instruments"] == []
        for s in range(2):
            _step(mon, model, opt, s)
        # the seed: engine.enable_debugging(['memory_usage', 'gradient_norms'])
        status = mon.enable_debugging(["memory_usage", "gradient_norms"])
        assert status["memory_usage"] and status["gradient_norms"] and not status["forward_pass"]
        assert status["instruments"] == ["gradients", "memory", "nonfinite"]
        assert status["pending"] and status["running"] == []  # applied in the next mon.step()
        _step(mon, model, opt, 2)  # step 2 ends: instruments switched on for step 3
        assert mon.get_debugging_status()["running"] == ["gradients", "memory"]
        _step(mon, model, opt, 3)
        _step(mon, model, opt, 4)
        status = mon.disable_debugging()  # the seed: engine.disable_debugging()
        assert status["instruments"] == [] and not any(status[k] for k in ("memory_usage", "gradient_norms"))
        _step(mon, model, opt, 5)  # step 5 ends: everything off from step 6
        assert mon.get_debugging_status() == {**status, "pending": False, "running": []}
        _step(mon, model, opt, 6)
        with pytest.raises(ValueError, match="unknown debugging option 'gpu_magic'; allowed: memory_usage"):
            mon.enable_debugging(["gpu_magic"])
    with open_run(mon.run_dir) as run:
        assert run.series("grad_norm").steps == [3, 4, 5]
        assert [m["step"] for m in run.memory()] == [3, 4, 5]
        changes = run.events("config_change")
        assert [e["step"] for e in changes] == [2, 5]
        assert changes[0]["data"]["changes"] == {"debug_memory_usage": True, "debug_gradient_norms": True}


def test_enable_debugging_with_no_names_turns_on_all_ten() -> None:
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with td.watch(model, opt, config=td.DebugConfig(mode="none"), run=False) as mon:
        status = mon.enable_debugging()
    on = [k for k, v in status.items() if v is True and k != "pending"]
    assert on == [
        "memory_usage",
        "gradient_norms",
        "forward_pass",
        "backward_pass",
        "device_placement",
        "mixed_precision",
        "data_loading",
        "validation",
        "early_stopping",
        "lr_scheduling",
    ]


def test_device_placement_on_one_device(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 1), nn.BatchNorm1d(1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = td.DebugConfig(mode="none", debug_device_placement=True)
    with td.watch(model, opt, config=cfg, run=tmp_path) as mon:
        _step(mon, model, opt, 0)
        _step(mon, model, opt, 1)
    (event,) = [e for e in mon.events if e.kind.startswith("device")]
    assert (event.kind, event.step, event.severity) == ("device_placement", 0, "info")
    ev = event.evidence
    assert ev["parameters"] == {"cpu": {"count": 4, "names": ["0.weight", "0.bias", "1.weight", "1.bias"]}}
    assert ev["buffers"] == {
        "cpu": {"count": 3, "names": ["1.running_mean", "1.running_var", "1.num_batches_tracked"]}
    }
    assert ev["inputs"] == {"cpu": {"count": 1, "names": ["input[0]"]}}
    assert (ev["cuda"] is None) == (not torch.cuda.is_available())


class _Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)
        self.register_buffer("table", torch.empty(2, device="meta"))  # a buffer left on another device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_device_mix_is_flagged_with_the_devices_and_names() -> None:
    model = _Mixed()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = td.DebugConfig(mode="none", debug_device_placement=True)
    with (
        pytest.warns(td.TorchDebugWarning, match="device_mix"),
        td.watch(model, opt, config=cfg, run=False) as mon,
    ):
        _step(mon, model, opt, 0)
    (mix,) = [e for e in mon.events if e.kind == "device_mix"]
    assert mix.evidence["devices"] == ["cpu", "meta"]
    assert mix.evidence["buffers"] == {"meta": {"count": 1, "names": ["table"]}}
    assert "Move the model and its inputs to one device" in mix.message

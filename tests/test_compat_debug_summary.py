"""Seed 004's summary prints and resource check, run as the seed wrote them."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest

import torchdebug.perf.profiling as profiling
from torchdebug import PyTorchDebugger
from torchdebug.compat._seed004 import SEED_GPU_MEMORY_WARN_BYTES


def test_summary_before_any_operation_prints_nan() -> None:
    debugger = PyTorchDebugger()
    # seed 004, "Debug Summary", verbatim
    summary = debugger.get_debug_summary()

    lines = [
        "Debug Summary:",
        f"  Total operations: {summary['total_operations']}",
        f"  Average execution time: {summary['avg_execution_time']:.4f}s",
        f"  Maximum execution time: {summary['max_execution_time']:.4f}s",
        f"  Average memory usage: {summary['avg_memory_usage']:.2f}MB",
        f"  Total optimizations: {summary['total_optimizations']}",
    ]
    assert lines[1:] == [
        "  Total operations: 0",
        "  Average execution time: nans",
        "  Maximum execution time: 0.0000s",
        "  Average memory usage: nanMB",
        "  Total optimizations: 0",
    ]
    assert math.isnan(summary["avg_execution_time"]) and math.isnan(summary["avg_memory_usage"])


def test_summary_after_one_operation_is_its_numbers() -> None:
    debugger = PyTorchDebugger({"enable_anomaly_detection": False})
    with debugger.debug_context("op"):
        pass
    info = debugger.debug_history[-1]
    summary = debugger.get_debug_summary()
    assert summary["avg_execution_time"] == info.execution_time == summary["max_execution_time"]
    assert summary["avg_memory_usage"] == float(info.memory_usage)


def _gpu(allocated: int) -> list[dict[str, int]]:
    return [{"device": 0, "allocated": allocated, "reserved": allocated, "total": 80 * 2**30}]


@pytest.mark.parametrize(
    ("allocated", "warned"),
    [
        pytest.param(8000 * 2**20, False, id="at-8000-MiB"),  # the seed's "> 8000" MB: not above
        pytest.param(8000 * 2**20 + 1, True, id="one-byte-above"),
        pytest.param(9 * 2**30, True, id="9-GiB"),
    ],
)
def test_monitor_resources_warns_above_the_seeds_gpu_threshold(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, allocated: int, warned: bool
) -> None:
    # the allocator's reading injected: the logic runs on CPU; the CUDA path is _gpu_readings
    monkeypatch.setattr(profiling, "_gpu_readings", lambda: _gpu(allocated))
    debugger = PyTorchDebugger()
    with caplog.at_level(logging.WARNING, logger="torchdebug.compat"):
        out: dict[str, Any] = debugger.monitor_resources(
            cpu_threshold=101, memory_threshold=101, interval=0.0
        )
    assert SEED_GPU_MEMORY_WARN_BYTES == 8000 * 1024 * 1024
    assert out["gpus"] == _gpu(allocated)
    expected = (
        [f"GPU 0 allocated {allocated} bytes ({allocated / 2**20:.1f} MiB), above {8000 * 2**20} bytes"]
        if warned
        else []
    )
    assert out["warnings"] == expected
    assert [r.getMessage() for r in caplog.records] == expected


def test_monitor_resources_threshold_can_be_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(profiling, "_gpu_readings", lambda: _gpu(2**30))
    out = PyTorchDebugger().monitor_resources(
        cpu_threshold=101, memory_threshold=101, gpu_memory_threshold_bytes=2**29, interval=0.0
    )
    assert out["warnings"] == [f"GPU 0 allocated {2**30} bytes (1024.0 MiB), above {2**29} bytes"]
    out = PyTorchDebugger().monitor_resources(
        cpu_threshold=101, memory_threshold=101, gpu_memory_threshold_bytes=None, interval=0.0
    )
    assert out["warnings"] == []


def test_monitor_resources_reads_no_gpu_without_cuda() -> None:
    out = PyTorchDebugger().monitor_resources(cpu_threshold=101, memory_threshold=101, interval=0.0)
    import torch

    assert len(out["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)

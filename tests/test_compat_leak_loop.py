"""Seed 004's leak loop: ``profile_memory`` before and after each batch finds a steady 1 MiB/batch leak."""

from __future__ import annotations

import torch

from torchdebug.compat import PyTorchDebugger

MIB = 1 << 20


def test_before_after_loop_finds_a_leak_within_100_batches() -> None:
    debugger = PyTorchDebugger()
    kept: list[torch.Tensor] = []  # the leak: 1 MiB kept per batch

    def train_batch() -> None:
        kept.append(torch.ones(MIB // 4))  # 262144 float32 = 1 MiB

    found_at = None
    memory_snapshots = []
    for batch in range(100):  # the seed's detect_memory_leaks(), as written
        memory_before = debugger.profile_memory(f"before_batch_{batch}")
        train_batch()
        memory_after = debugger.profile_memory(f"after_batch_{batch}")
        memory_increase = memory_after["cpu_memory"] - memory_before["cpu_memory"]
        assert isinstance(memory_increase, float)
        memory_snapshots.append(memory_after)
        if memory_after["memory_leaks"] and found_at is None:
            found_at = batch
    assert found_at is not None and found_at < 100
    # the window is config.leak_window = 50 samples; every 2nd call's sample is one per batch, so the
    # leak is seen once 50 batches were sampled (batch 49), not earlier than the window allows
    assert found_at >= 24
    leak = [line for line in memory_snapshots[-1]["memory_leaks"] if line.startswith("heap_in_use")]
    assert leak, memory_snapshots[-1]["memory_leaks"]


def test_healthy_before_after_loop_reports_no_leak() -> None:
    debugger = PyTorchDebugger()
    for batch in range(60):
        debugger.profile_memory(f"before_batch_{batch}")
        t = torch.ones(MIB // 4)  # allocated and freed each batch: no growth
        del t
        after = debugger.profile_memory(f"after_batch_{batch}")
        assert after["memory_leaks"] == [], (batch, after["memory_leaks"])

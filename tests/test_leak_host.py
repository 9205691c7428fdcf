"""A leak of host memory that no tensor holds (Python objects kept by the loop) is named host_only,
with a growth rate that is a growth; a healthy loop's RSS noise is not a leak."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import torchdebug as td

LEAK = 1 << 20  # bytes kept a step: far above the leak test's 64 KiB floor


def _loop(tmp_path, keep: list | None, steps: int = 240):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with td.watch(model, opt, run=str(tmp_path)) as mon:
            for _ in range(steps):
                loss = model(torch.randn(4, 8)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                if keep is not None:
                    keep.append(bytearray(b"\1" * LEAK))  # touched: resident, not only reserved
                mon.step()
    return mon, [str(w.message) for w in said]


def test_python_objects_kept_every_step_are_a_host_only_leak_that_grows(tmp_path) -> None:
    kept: list[bytearray] = []
    mon, said = _loop(tmp_path, kept)
    leaks = [e for e in mon.events if e.kind == "memory_leak"]
    assert len(leaks) == 1, said
    ev = leaks[0].evidence
    assert ev["category"] == "host_only"
    assert ev["series"] in ("rss", "heap_in_use")
    # about the 1 MiB kept a step (the allocator rounds; other steps' garbage comes and goes)
    assert 0.5 * LEAK <= ev["bytes_per_step"] <= 2 * LEAK
    assert sum("memory_leak" in m for m in said) == 1


def test_a_healthy_loop_has_no_leak(tmp_path) -> None:
    mon, said = _loop(tmp_path, None)
    assert [e for e in mon.events if e.kind == "memory_leak"] == []
    assert said == []

"""Leaks found in time: with default settings a >= 64 KiB/step leak is reported within 300 steps of its start."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

import torchdebug.session.monitor as tdm
from torchdebug._config import DebugConfig
from torchdebug._errors import TorchDebugWarning
from torchdebug.memory.instrument import LeakDetector


@pytest.fixture
def one_thread():
    """One intra-op thread: on a loaded 2-core machine OpenMP's second thread stalls steps by tens of
    ms, a real slowdown the slowdown rule would rightly report; these tests are about leaks."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_default_leak_window_spans_200_steps():
    cfg = DebugConfig()
    # 50 samples, one every 4 steps: the leak test looks at the last 200 steps
    assert (cfg.leak_window, cfg.leak_every, cfg.leak_warmup) == (50, 4, 5)
    assert cfg.leak_window * cfg.leak_every == 200


@pytest.mark.parametrize(("start", "expected"), [(50, 216), (500, 640)], ids=["early", "late"])
def test_detector_finds_a_threshold_leak_in_time(start, expected):
    # exactly 64 KiB/step from step `start`, sampled every 4 steps (the default schedule), flat before.
    # The window holds 50 samples: 1225 pairs, the median is the 613th smallest slope. Pairs of two
    # samples on the leak's line (steps >= start) have slope exactly 65536, every other pair less; k
    # such samples give k(k-1)/2 such pairs: k = 36 is the first with >= 613 (630; k = 35 gives 595), and
    # then 35 of 49 changes are increases (0.71 >= 0.6).
    # late: the sample at step 500 is the line's start; the 36th is at 500 + 4 * 35 = 640 (140 steps).
    # early: the first full window comes later: the 5 warm-up samples (steps 0-16) are skipped, the
    # 50th counted sample is at step 20 + 4 * 49 = 216; it holds 42 leak samples (52-216): fires.
    det = LeakDetector(window=50, warmup=5, min_bytes_per_step=65536)
    first = None
    for step in range(0, 800, 4):
        hit = det.add(step, {"heap_in_use": 10_000_000 + 65536 * max(0, step - start)})
        if hit and first is None:
            first = step
            assert hit[0].series == "heap_in_use"
            assert hit[0].recent_slope == pytest.approx(65536)
    assert first == expected


def _eval_leak_run(tmp_path, steps: int, leak_at: int | None, opt_cls=torch.optim.SGD, lr=0.01):
    """A plain loop under the default watch; from ``leak_at`` on it keeps each step's evaluation
    output with its graph (the classic ``preds.append(model(x_val))`` without ``no_grad``).

    Kept per step: the Tanh output the graph saved, (256, 64) float32 = 65536 bytes, the (256, 1)
    output (1 KiB) and a few autograd nodes: just above the 64 KiB/step floor.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    opt = opt_cls(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(0)
    x_val = torch.randn(256, 16, generator=g)
    preds = []
    line = None
    with tdm.watch(model, opt, config={"run_dir": str(tmp_path)}) as mon:
        for step in range(steps):
            out = model(x_val)  # evaluation every step, kept from `leak_at` on (same work either way)
            if leak_at is not None and step >= leak_at:
                preds.append(out)
                line = sys._getframe().f_lineno - 3
            x, y = torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step()
        inst = next(i for i in mon.instruments if i.name == "memory")
        events = [e for e in mon.events if e.kind == "memory_leak"]
    return inst, events, line


def test_eval_outputs_kept_with_graph_reported_within_300_steps(tmp_path, one_thread):
    with pytest.warns(TorchDebugWarning, match="memory_leak"):
        inst, events, line = _eval_leak_run(tmp_path, 500, leak_at=50)
    # the first full window at step 216 (see the detector test), 2 steps of verdict (capture one
    # step, judge one step later) and allocator noise in the samples.
    # One episode, one report: after the report the window refills (200 steps, ~step 420) and
    # still sees the growth, but the series is inside its episode: no second report by step 500
    assert len(events) == 1
    rep = inst.leaks[0]
    assert 218 <= rep.step <= 50 + 300
    assert rep.series == "heap_in_use"
    assert rep.category == "autograd_history"
    assert 65536 <= rep.bytes_per_step <= 1.2 * 65536
    assert rep.site.startswith("2 (Linear)")  # the graph's head: the last Linear made the output
    assert rep.site.endswith(f"test_leak_latency.py:{line}")
    assert any(t.shape == (256, 64) and t.has_history for t in rep.tensors)


def test_healthy_run_with_warmup_growth_raises_no_leak(tmp_path, one_thread):
    # Adam creates its state at the first step, the allocator caches, the store's SQLite page cache
    # fills: warm-up growth, then flat. 400 steps = two full windows after the warm-up.
    inst, events, _ = _eval_leak_run(tmp_path, 400, leak_at=None, opt_cls=torch.optim.Adam, lr=1e-3)
    assert events == []
    assert inst.leaks == []
    assert len(inst.samples) == 50  # 100 samples taken (every 4 steps), the window keeps 50

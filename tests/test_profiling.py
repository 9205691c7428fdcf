"""profile(): summary of ops and modules, data-loading share, bounded trace files; seed-era helpers."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
from torch import nn

from tests.fixtures.memory_models import HandClock, sleepy_batches
from torchdebug.perf import timing
from torchdebug.perf.profiling import (
    _union_length,
    debug_performance,
    monitor_resources,
    profile,
    profile_model_performance,
)


@pytest.fixture
def clock(monkeypatch) -> HandClock:
    """perf/'s host clock, moved by hand: the data and wall times are exact, whatever the load."""
    hand = HandClock()
    monkeypatch.setattr(timing, "host_clock", hand)
    return hand


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Sequential(nn.Linear(32, 32), nn.Tanh()), nn.Linear(32, 1)
    )


def _step_fn(model, clock: HandClock | None = None):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(x):
        if clock is not None:
            clock.advance(1 / 16)  # the step's compute, on the hand clock
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    return step


def test_profile_summary_data_share_modules_and_trace(tmp_path, clock):
    model = _model()
    batches = sleepy_batches(6, 1 / 16, sleep=clock.advance)
    s = profile(model, _step_fn(model, clock), batches, steps=4, run_dir=tmp_path)
    assert s.steps == 4
    # the four profiled steps each waited 1/16 s in the iterator and computed 1/16 s on the hand clock
    assert (s.data_s, s.wall_s, s.data_fraction) == (4 / 16, 8 / 16, 0.5)
    # the idle share sets the profiler's op ranges (real time) against the wall: the union it takes
    # is pinned below on known ranges; here only its bounds
    assert 0 <= s.cpu_idle_fraction <= 1 and s.gpu_idle_fraction is None
    names = {o.name for o in s.top_ops}
    assert "aten::addmm" in names
    mods = {m.module: m for m in s.top_modules}
    assert set(mods) == {"", "0", "1", "2", "2.0", "2.1", "3"}
    assert all(m.calls == 4 for m in mods.values())
    # self times partition the root's range: children are subtracted once, from their parent
    assert sum(m.self_s for m in mods.values()) == pytest.approx(mods[""].total_s, rel=1e-6)
    assert mods["2"].total_s >= mods["2.0"].total_s + mods["2.1"].total_s
    trace = json.loads((tmp_path / "profile-trace.json").read_text())
    assert any(e.get("name") == "module::2.0" for e in trace["traceEvents"])
    assert s.trace_path.endswith("profile-trace.json") and s.trace_note == ""
    text = str(s)
    assert "profiled 4 steps" in text and "data loading" in text
    assert json.loads(json.dumps(s.to_dict()))["steps"] == 4


def test_trace_is_kept_under_budget(tmp_path):
    model = _model()
    budget = 6000
    s = profile(
        model, _step_fn(model), sleepy_batches(6, 0.0), steps=3, run_dir=tmp_path, trace_budget_bytes=budget
    )
    assert s.trace_path.endswith(".json.gz") and not (tmp_path / "profile-trace.json").exists()
    assert s.trace_bytes == (tmp_path / "profile-trace.json.gz").stat().st_size <= budget
    assert "gzip-compressed" in s.trace_note and "truncated" in s.trace_note
    trace = json.loads(gzip.decompress((tmp_path / "profile-trace.json.gz").read_bytes()))
    assert trace["traceEvents"] and all("args" not in e for e in trace["traceEvents"])


def test_short_iterator_and_bad_arguments():
    model = _model()
    s = profile(model, _step_fn(model), sleepy_batches(3, 0.0), steps=4)
    assert s.steps == 1 and "ran out after 3 of 6" in s.notes[0]
    assert s.trace_path is None
    with pytest.raises(ValueError, match="steps >= 1"):
        profile(model, _step_fn(model), [], steps=0)


def test_the_union_of_op_ranges_counts_overlaps_once():
    # [0, 4) and [2, 6) overlap in [2, 4): 6; [3, 5) inside them; [8, 9) apart: 6 + 1 = 7
    assert _union_length([(8.0, 9.0), (0.0, 4.0), (3.0, 5.0), (2.0, 6.0)]) == 7.0
    assert _union_length([]) == 0.0


def test_seed_helpers(clock):
    with debug_performance("nap", slow_threshold_s=1 / 128) as rec:
        clock.advance(1 / 64)
    assert (rec.elapsed_s, rec.slow) == (1 / 64, True)
    with debug_performance("quick") as rec:
        pass
    assert (rec.elapsed_s, rec.slow) == (0.0, False) and "quick" in str(rec)
    model = _model()
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(5)]
    s = profile_model_performance(model, data, num_batches=3, loss_fn=nn.functional.mse_loss)
    assert s.steps == 3
    assert model[0].weight.grad is not None  # the loss_fn path runs backward
    r = monitor_resources(cpu_threshold=101, memory_threshold=0, interval=0.0)
    assert set(r) == {"cpu_percent", "memory_percent", "rss", "gpus", "warnings"}
    assert r["rss"] > 0
    assert len(r["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert len(r["warnings"]) == 1 and r["warnings"][0].startswith("system memory use")

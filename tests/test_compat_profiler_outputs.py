"""Seed 000's profiler: TensorBoard profiler-plugin output for ``enable_tensorboard_profiler`` and
Python stacks through ``profile_model_performance`` (``with_stack=True``, as the seed configured it)."""

from __future__ import annotations

import gzip
import json
import os
import re
import socket
from pathlib import Path
from typing import Any

import torch
from torch import nn

import torchdebug as td
from torchdebug.perf.profiling import profile_model_performance


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def _events(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]  # type: ignore[no-any-return]


def test_tensorboard_profiler_writes_the_plugins_trace(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = td.DebugConfig(mode="none", enable_tensorboard_profiler=True)
    g = torch.Generator().manual_seed(0)
    with td.watch(model, opt, config=cfg, run=tmp_path) as mon:
        for _ in range(6):  # wait 1, warm-up 1, 3 profiled steps
            opt.zero_grad()
            model(torch.randn(8, 4, generator=g)).pow(2).mean().backward()
            opt.step()
            mon.step()
    (trace,) = (Path(mon.run_dir) / "tb_profiler").iterdir()
    # torch.profiler.tensorboard_trace_handler's name, <host>_<pid>.<ns>.pt.trace.json.gz, as the
    # plugin (torch-tb-profiler 0.4.3, consts.WORKER_PATTERN) splits it into worker and span
    plugin = re.compile(r"^(.*?)(\.\d+)?\.pt\.trace\.json(?:\.gz)?$")
    m = plugin.match(trace.name)
    assert m is not None and trace.name.endswith(".gz")
    assert m.group(1) == f"{socket.gethostname()}_{os.getpid()}"
    assert m.group(2) is not None and int(m.group(2)[1:]) > 0  # the span: time.time_ns()
    events = _events(trace)
    names = {e.get("name") for e in events}
    assert {"ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"} <= names  # the 3 profiled steps
    assert "aten::addmm" in names
    # Python stacks: this test's own frames as python_function events
    assert any(
        e.get("cat") == "python_function" and "test_compat_profiler_outputs.py" in e["name"] for e in events
    )
    assert (Path(mon.run_dir) / "profile-summary.txt").exists()


def test_profile_model_performance_carries_python_stacks(tmp_path: Path) -> None:
    model = _model()
    g = torch.Generator().manual_seed(0)
    loader = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(5)]
    summary = profile_model_performance(
        model, loader, num_batches=3, loss_fn=nn.functional.mse_loss, run_dir=tmp_path
    )
    assert summary.steps == 3
    (trace,) = tmp_path.glob("profile-trace.json*")
    events = _events(trace)
    py = [e for e in events if e.get("cat") == "python_function"]
    assert any("test_compat_profiler_outputs.py" in e["name"] for e in py)
    plain = tmp_path / "plain"
    profile_model_performance(
        model, loader, num_batches=3, loss_fn=nn.functional.mse_loss, run_dir=plain, with_stack=False
    )
    (trace,) = plain.glob("profile-trace.json*")
    assert not [e for e in _events(trace) if e.get("cat") == "python_function"]

"""A facade's ``debug_context`` block is charged with the user's work, not torchdebug's start-up.

Counted, not timed: the blocks run in a fresh process with the facade's clock replaced by the number
of modules imported so far, so a block's "execution time" is the number of modules imported inside
it. torchdebug's lazy imports (the tracer's first use imports ``torch._dynamo``: hundreds of modules)
must happen before the first block's clock starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Seed 001's "Custom Debug Context" snippet (verbatim inside the loop) under its "Advanced
# Debugging" config, four blocks; then seed 004's training block, twice, under a guard (no tracing).
SCRIPT = r"""
import json, sys
import torch
from torch import nn
import torchdebug.compat._debugger as impl
from torchdebug import DebugConfig, DebugLevel, DebugMode, PyTorchDebugManager, PyTorchDebugger

impl._clock = lambda: float(len(sys.modules))  # a block's "time": modules imported inside it

config = DebugConfig(
    mode=DebugMode.FULL_DEBUG,
    level=DebugLevel.EXPERT,
    enable_anomaly_detection=True,
    enable_gradient_checking=True,
    enable_memory_profiling=True,
    enable_performance_profiling=True,
    log_gradients=True,
    log_activations=True,
    log_weights=True,
    save_debug_info=True,
    debug_output_dir=sys.argv[1],
)
debug_manager = PyTorchDebugManager(config)
model = nn.Sequential(nn.Linear(784, 10))
input_data = torch.randn(1, 784)
for _ in range(4):
    with debug_manager.debugger.debug_context("custom_operation", "my_model") as debug_info:
        # Your custom operation here
        result = model(input_data)
report = debug_manager.debugger.create_debug_report()

guarded = PyTorchDebugger()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
criterion = nn.CrossEntropyLoss()
data, target = torch.randn(8, 784), torch.randint(0, 10, (8,))
# one plain step first: torch's own first optimizer.step() imports a profiler module (not ours)
criterion(model(data), target).backward()
optimizer.step()
for _ in range(2):
    with guarded.debug_context("training_step"):
        optimizer.zero_grad()
        output = model(data)
        loss = criterion(output, target)
        loss.backward()
        optimizer.step()
print(json.dumps({
    "traced": [i.execution_time for i in debug_manager.debugger.debug_history],
    "max": report["performance_analysis"]["max_execution_time"],
    "guarded": [i.execution_time for i in guarded.debug_history],
}))
"""


def test_first_block_imports_nothing(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # 0 modules imported inside each block: the first block is charged like the later ones
    assert out["traced"] == [0.0, 0.0, 0.0, 0.0]
    assert out["max"] == 0.0
    assert out["guarded"] == [0.0, 0.0]


def test_the_counting_clock_sees_a_block_that_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    """The counting clock is a real measure: a block that imports a new module reads 1 or more."""
    import torchdebug.compat._debugger as impl
    from torchdebug import PyTorchDebugger

    monkeypatch.setattr(impl, "_clock", lambda: float(len(sys.modules)))
    monkeypatch.delitem(sys.modules, "colorsys", raising=False)
    dbg = PyTorchDebugger({"enable_anomaly_detection": False})
    with dbg.debug_context("import"):
        import colorsys  # noqa: F401
    assert dbg.debug_history[-1].execution_time >= 1.0

"""``torchdebug demo <scenario>``: seed 003's quick-start scenarios, each a minute or less on CPU.

The default scenario, ``autograd`` (a small GPT until a padding bug makes a NaN), is
``torchdebug.demo``; the command line (``torchdebug._demo_cli``) picks between the two modules.

- ``gradient``: a layer whose gradient is amplified mid-run; the explosion rule names it;
- ``memory``: a model that keeps every activation with its graph; the leak test finds it;
- ``training``: the seed-era ``PyTorchDebugManager`` loop logging into a run folder, a NaN batch skipped;
- ``comprehensive``: every instrument at ``full_debug``/``expert`` on a small MLP, then the report.

Each ends with the run folder and the command that shows its report.
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SCENARIOS = ("gradient", "memory", "training", "comprehensive")


class _Amplify(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


class _GradientNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.mid = nn.Linear(64, 64)
        self.out = nn.Linear(64, 1)
        self.fault = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.fault:
            h = _Amplify.apply(h, 1e4)  # a backward-only blow-up right after `inp`
        return self.out(torch.tanh(self.mid(torch.tanh(h))))


class _LeakyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 1024)
        self.fc2 = nn.Linear(1024, 1)
        self.kept: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        self.kept.append(h)  # the leak: every activation kept, with its autograd graph
        return self.fc2(h)


def _batches(
    steps: int, seed: int, d_in: int = 16, batch: int = 64
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(d_in, 1, generator=g)
    out = []
    for _ in range(steps):
        x = torch.randn(batch, d_in, generator=g)
        out.append((x, x @ w + 0.1 * torch.randn(batch, 1, generator=g)))
    return out


def _finish(out: Any, run_dir: Any, t0: float, noticed: list[str]) -> int:
    if noticed:
        print("\nWhat torchdebug noticed:", file=out)
        for line in noticed[:8]:
            print(f"  {line}", file=out)
    print(f"\ndone in {time.perf_counter() - t0:.1f} s", file=out)
    if run_dir is not None:
        print(f"run folder: {run_dir}", file=out)
        print(f"  torchdebug report {run_dir}", file=out)
        print(f"  torchdebug report {run_dir} --format html -o report.html", file=out)
    return 0


def _watched(
    model: nn.Module, config: Any, run_dir: str, steps: int, seed: int, before: Any, out: Any
) -> Any:
    import torchdebug as td

    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", td.TorchDebugWarning)
        with td.watch(model, opt, config=config, run=run_dir) as mon:
            for step, (x, y) in enumerate(_batches(steps, seed)):
                before(step)
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                opt.step()
                mon.step()
    return mon, [str(w.message) for w in caught]


def run_scenario(name: str, *, run_dir: str = "runs", seed: int = 0, out: Any = None) -> int:
    """Run one quick-start scenario; returns the exit code (0).

    Raises:
        ValueError: an unknown scenario (lists them).
    """
    out = out or sys.stdout
    if name not in SCENARIOS:
        raise ValueError(f"unknown demo {name!r}; choose one of {', '.join(SCENARIOS)}")
    import torchdebug as td

    torch.manual_seed(seed)
    t0 = time.perf_counter()
    if name == "gradient":
        print(
            "torchdebug demo gradient: 60 steps; from step 45 the gradient of `inp` is amplified 1e4x",
            file=out,
        )
        net = _GradientNet()

        def fault(step: int) -> None:
            net.fault = step >= 45

        cfg = td.DebugConfig(mode=td.DebugMode.GRADIENT_CHECKING, run_name="demo-gradient", policy="warn")
        mon, noticed = _watched(net, cfg, run_dir, 60, seed, fault, out)
        return _finish(out, mon.run_dir, t0, noticed)
    if name == "memory":
        print(
            "torchdebug demo memory: 40 steps of a model that keeps every activation with its graph", file=out
        )
        model: nn.Module = _LeakyNet()
        cfg = td.DebugConfig(
            mode=td.DebugMode.MEMORY_PROFILING,
            level=td.DebugLevel.BASIC,
            memory_every=1,
            leak_window=10,
            run_name="demo-memory",
        )
        mon, noticed = _watched(model, cfg, run_dir, 40, seed, lambda step: None, out)
        return _finish(out, mon.run_dir, t0, noticed)
    if name == "training":
        print(
            "torchdebug demo training: the seed-era PyTorchDebugManager loop, a NaN batch at step 12",
            file=out,
        )
        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        mgr = td.PyTorchDebugManager(td.DebugConfig(run_dir=run_dir, anomaly_detection_mode="warn"))
        mgr.setup_training_logging("demo-training")
        path = mgr.training_logger.path
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", td.TorchDebugWarning)
            for step, (x, y) in enumerate(_batches(20, seed)):
                if step == 12:
                    x[3, 5] = math.nan
                m = mgr.debug_training_step(model, opt, nn.MSELoss(), x, y, epoch=0, batch=step)
                if m["skipped"]:
                    print(f"  step {step}: update skipped: {m['anomaly'].summary()}", file=out)
        summary = mgr.create_comprehensive_report()["summary"]
        mgr.close()
        print(
            f"  {summary['total_debug_operations']} steps, {summary['anomalies_detected']} with an anomaly",
            file=out,
        )
        return _finish(out, path, t0, [str(w.message) for w in caught])
    print("torchdebug demo comprehensive: full_debug at expert depth on a small MLP, 30 steps", file=out)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    cfg = td.DebugConfig(
        mode=td.DebugMode.FULL_DEBUG,
        level=td.DebugLevel.ADVANCED,
        detail_every=5,
        memory_every=5,
        run_name="demo-comprehensive",
    )
    mon, noticed = _watched(model, cfg, run_dir, 30, seed, lambda step: None, out)
    print(
        f"  instruments: {', '.join(sorted(getattr(i, 'name', type(i).__name__) for i in mon.instruments))}",
        file=out,
    )
    return _finish(out, mon.run_dir, t0, noticed)


__all__ = ["SCENARIOS", "run_scenario"]

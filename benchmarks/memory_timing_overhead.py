"""Per-step cost of the opt-in memory/time modes against a plain training step, measured in the same run.

Modes (each is what the instrument does on a step it measures; they run on a few steps only):
module_memory (saved-tensor hook + module stack + the per-module table), module_time (forward
pre/post hooks + multi-grad hooks per module, one read per step), flops_step (FlopCounterMode +
op recorder over forward and backward, then the report). Also the always-on pieces per call:
memory_sample() and a LeakDetector.add() over a full window, and the leak test's detection
latency under the default watch: a loop that, from step 50 (or 500) on, keeps each step's
evaluation output with its graph (64 KiB and 170 KiB a step), and the step the "memory_leak" event names.

Workloads: MLP 784-1024-1024-10 batch 256 (few, big modules) and a 24-block residual MLP of width
128 batch 32 (many small modules: the worst case for per-module hooks). Modes are interleaved in
chunks so machine noise hits them alike; printed: median ms/step and the median of per-repeat
ratios to the plain step of the same repeat.

    python benchmarks/memory_timing_overhead.py [--repeats 5] [--chunk 5] [--only mlp,deep24]
        [--latency-only]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import torchdebug.session.monitor as tdm
from torchdebug._config import DebugConfig
from torchdebug.memory.analysis import SavedTensorTracker, memory_sample, module_memory_table
from torchdebug.memory.instrument import LeakDetector
from torchdebug.perf.flops import _FlopSession
from torchdebug.perf.timing import ModuleTimer


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(self.norm(x)))


def workloads() -> dict[str, tuple[nn.Module, torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    mlp = nn.Sequential(
        nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )
    deep = nn.Sequential(*[Block(128) for _ in range(24)], nn.Linear(128, 10))
    return {
        "mlp": (mlp, torch.randn(256, 784), torch.randn(256, 10)),
        "deep24": (deep, torch.randn(32, 128), torch.randn(32, 10)),
    }


def make_modes(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, Callable[[], None]]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def plain() -> None:
        loss = F.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def module_memory() -> None:
        with SavedTensorTracker(model) as tr:
            out = model(x)
        loss = F.mse_loss(out, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        module_memory_table(model, opt, tr.by_module, saved_total_bytes=tr.total)

    def module_time() -> None:
        with ModuleTimer(model) as tm:
            loss = F.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            tm.clear_grad_hooks()
        opt.step()
        tm.collect()

    def flops_step() -> None:
        s = _FlopSession(model)
        s.start()
        out = model(x)
        s.forward_end()
        loss = F.mse_loss(out, y)
        opt.zero_grad(set_to_none=True)
        s.backward_start()
        loss.backward()
        s.stop("backward")
        opt.step()
        s.report()

    return {
        "plain": plain,
        "module_memory": module_memory,
        "module_time": module_time,
        "flops_step": flops_step,
    }


def bench(name: str, repeats: int, chunk: int) -> None:
    model, x, y = workloads()[name]
    modes = make_modes(model, x, y)
    for fn in modes.values():  # warm-up: lazy init, allocator
        for _ in range(3):
            fn()
    per: dict[str, list[float]] = {k: [] for k in modes}
    for _ in range(repeats):
        for k, fn in modes.items():
            t0 = time.perf_counter()
            for _ in range(chunk):
                fn()
            per[k].append((time.perf_counter() - t0) / chunk)
    n_mod = sum(1 for _ in model.modules())
    print(f"\n{name} ({n_mod} modules, {sum(p.numel() for p in model.parameters()):,} parameters)")
    print(f"  {'mode':<14} {'ms/step':>9} {'x plain':>8}")
    for k, ts in per.items():
        ratio = statistics.median(t / p for t, p in zip(ts, per["plain"]))
        print(f"  {k:<14} {statistics.median(ts) * 1e3:>9.3f} {ratio:>8.2f}")


def micro() -> None:
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        memory_sample()
    sample_us = (time.perf_counter() - t0) / n * 1e6
    det = LeakDetector(window=50, warmup=0, min_bytes_per_step=65536)
    for s in range(50):
        det.add(s, {"rss": 1 << 30, "heap_in_use": 1 << 28})
    t0 = time.perf_counter()
    wiggle = [0, 8192, 4096, 12288, 0, 4096, -4096, 8192, 0, -8192, 4096]  # flat with allocator noise
    for s in range(50, 50 + n):
        det.add(s, {"rss": (1 << 30) + wiggle[s % len(wiggle)], "heap_in_use": 1 << 28})
    det_us = (time.perf_counter() - t0) / n * 1e6
    grow = LeakDetector(window=50, warmup=0, min_bytes_per_step=65536)
    t0 = time.perf_counter()
    for s in range(200):
        grow.add(s, {"rss": (1 << 30) + s * (1 << 20)})
    grow_us = (time.perf_counter() - t0) / 200 * 1e6
    print("\nalways-on pieces (per call)")
    print(f"  memory_sample()                     {sample_us:8.1f} us")
    print(f"  LeakDetector.add, healthy, window 50 {det_us:7.1f} us")
    print(f"  LeakDetector.add, growing, window 50 {grow_us:7.1f} us  (Theil–Sen runs)")


def leak_latency(hidden: int, start: int = 50, steps: int = 600) -> tuple[int | None, float | None, str]:
    """Steps from the leak's start to the memory_leak event under the default watch, and its bytes/step.

    The leak: each step's evaluation output kept with its graph; the graph holds the (64, hidden)
    float32 Tanh output: 64 * hidden * 4 bytes a step (hidden 256: 64 KiB; 680: 170 KiB).
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, hidden), nn.Tanh(), nn.Linear(hidden, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    x_val = torch.randn(64, 16, generator=g)
    kept = []
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tdm.watch(model, opt, config={"run_dir": d}) as mon:
            for step in range(steps):
                out = model(x_val)
                if step >= start:
                    kept.append(out)
                x, y = torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g)
                loss = F.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                mon.step()
                leaks = next(i for i in mon.instruments if i.name == "memory").leaks
                if leaks:
                    return leaks[0].step - start, leaks[0].bytes_per_step, leaks[0].series
    return None, None, ""


def latency() -> None:
    cfg = DebugConfig()
    print(
        f"\nleak detection latency, default watch (memory_every={cfg.memory_every}, leak_every="
        f"{cfg.leak_every}, leak_window={cfg.leak_window} samples = "
        f"{cfg.leak_every * cfg.leak_window} steps)"
    )
    print(f"  {'leak from':>9} {'kept/step':>10} {'reported after':>15} {'measured':>12}  series")
    for start in (50, 500):
        for hidden in (256, 680):
            after, per_step, series = leak_latency(hidden, start=start, steps=start + 400)
            size = f"{64 * hidden * 4 / 1024:.0f} KiB"
            got = f"{after} steps" if after is not None else "not found"
            rate = f"{per_step / 1024:.1f} KiB" if per_step is not None else "-"
            print(f"  {start:>9} {size:>10} {got:>15} {rate:>12}  {series}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=5)
    ap.add_argument("--only", default="mlp,deep24")
    ap.add_argument("--latency-only", action="store_true", help="only the leak detection latency")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU")
    if not args.latency_only:
        for name in args.only.split(","):
            bench(name, args.repeats, args.chunk)
        micro()
    latency()


if __name__ == "__main__":
    main()

"""Cost of the seed facades' step blocks: a training step inside ``PyTorchDebugger.debug_context``.

Prints, per workload, the process CPU time of a plain step and the ratio of the same step inside
``debug_context`` (the step guard: a watch session per block, one gradient probe and host read per
backward), with ``model=`` given and discovered, and inside the facade's record alone (what the block
cost before the guard). One thread, blocks interleaved, medians of ``--repeats`` blocks.

    python benchmarks/seed_blocks.py [--repeats 7] [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from torchdebug.compat import PyTorchDebugger


def _workloads() -> dict[str, tuple[nn.Module, torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    wide = nn.Sequential(
        *[nn.Sequential(nn.Linear(512, 512), nn.GELU()) for _ in range(8)], nn.Linear(512, 10)
    )
    return {
        "mlp": (mlp, torch.randn(64, 784), torch.randint(0, 10, (64,))),
        "deep": (wide, torch.randn(64, 512), torch.randint(0, 10, (64,))),
    }


def _measure(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, repeats: int, steps: int
) -> dict[str, float]:
    """Median seconds per step of each variant (interleaved blocks of ``steps`` steps)."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    dbg = PyTorchDebugger()
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    def guard() -> None:
        with dbg.debug_context("step"):
            step()

    def guard_model() -> None:
        with dbg.debug_context("step", model=model):
            step()

    def record_only() -> None:
        with dbg._context("step"):
            step()

    variants: dict[str, Callable[[], None]] = {
        "plain": step,
        "guard": guard,
        "guard_model": guard_model,
        "record": record_only,
    }
    for fn in variants.values():  # warm-up
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for k, fn in variants.items():  # interleaved
            t0 = time.process_time()
            for _ in range(steps):
                fn()
            times[k].append((time.process_time() - t0) / steps)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'workload':<9} {'plain ms':>9} {'guard':>8} {'guard+model':>12} {'record only':>12}")
    for name, (model, x, y) in _workloads().items():
        med = _measure(model, x, y, args.repeats, args.steps)
        base = med["plain"]
        print(
            f"{name:<9} {base * 1e3:>9.2f} {med['guard'] / base:>7.3f}x {med['guard_model'] / base:>11.3f}x "
            f"{med['record'] / base:>11.3f}x"
        )


if __name__ == "__main__":
    main()

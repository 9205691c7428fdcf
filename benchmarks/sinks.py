"""CPU cost per step of each tracker sink (report_to) on a launch-bound workload, against plain and watch.

Workload: an MLP 8-16-2, batch 16, SGD, one thread: a step is a few hundred µs of Python and kernel
launches, so what torchdebug adds per step is not hidden behind big kernels. Variants, interleaved
in rounds (each round runs every variant once, in a rotating order): the plain loop; ``watch`` with
the default instruments and the run store; and ``watch(report_to=[X])`` for each sink X
(TensorBoard, W&B offline, MLflow with a local file store, logging to a handler that drops records).

Each variant opens its session (not timed: ``wandb.init`` alone takes about a second), runs
``--steps`` steps, and closes it, which drains the sinks; the CPU time of the steps plus the close
(``time.process_time``: every thread of this process, so the writer's and the sinks' threads count)
divided by the steps is the variant's CPU per step. Printed: the medians over ``--rounds``, the
sink's added CPU per step against ``watch``, and the median wall time of a step inside the loop (the
training thread: sinks run on their own threads). W&B hands records to its own service process,
whose CPU is not counted here.

    python benchmarks/sinks.py [--steps 400] [--rounds 5] [--only tensorboard,wandb,mlflow,logging]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import torchdebug as td

SINKS = ("tensorboard", "wandb", "mlflow", "logging")


def make() -> tuple[nn.Module, torch.optim.Optimizer, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [(torch.randn(16, 8), torch.randn(16, 2)) for _ in range(32)]
    return model, opt, data


def steps(
    model: nn.Module, opt: torch.optim.Optimizer, data: list[Any], n: int, mon: Any = None
) -> list[float]:
    walls = []
    for i in range(n):
        t = time.perf_counter()
        x, y = data[i % len(data)]
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if mon is not None:
            mon.step()
        walls.append(time.perf_counter() - t)
    return walls


def one(variant: str, n: int, root: Path) -> tuple[float, float]:
    """(CPU seconds per step including the close, median wall seconds of a step) of one variant."""
    model, opt, data = make()
    if variant == "plain":
        steps(model, opt, data, 20)  # warm-up
        c0 = time.process_time()
        walls = steps(model, opt, data, n)
        return (time.process_time() - c0) / n, statistics.median(walls)
    report_to = [] if variant == "watch" else [variant]
    mon = td.watch(model, opt, run=root / "runs", report_to=report_to or None)
    mon.__enter__()
    try:
        steps(model, opt, data, 20, mon)  # warm-up (first detail step, first batch of each sink)
        c0 = time.process_time()
        walls = steps(model, opt, data, n, mon)
    except BaseException:
        mon.__exit__(None, None, None)
        raise
    mon.__exit__(None, None, None)  # drains the sinks: their work on these steps is counted
    return (time.process_time() - c0) / n, statistics.median(walls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", default=",".join(SINKS))
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", td.TorchDebugWarning)  # the shared machine's load trips the slowdown rule
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.environ.update(
            WANDB_MODE="offline",
            WANDB_DIR=str(root),
            WANDB_SILENT="true",
            WANDB_CONSOLE="off",
            MLFLOW_TRACKING_URI=(root / "mlruns").as_uri(),
            MLFLOW_ALLOW_FILE_STORE="true",
        )
        sink_logger = logging.getLogger("torchdebug")
        sink_logger.addHandler(logging.NullHandler())
        sink_logger.propagate = False
        variants = ["plain", "watch", *[s for s in args.only.split(",") if s]]
        cpu: dict[str, list[float]] = {v: [] for v in variants}
        wall: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(args.rounds):
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            for v in order:
                c, w = one(v, args.steps, root)
                cpu[v].append(c)
                wall[v].append(w)
    med = {v: statistics.median(cpu[v]) for v in variants}
    print(f"torch {torch.__version__}, 1 thread, {args.steps} steps x {args.rounds} rounds (medians)")
    print(f"{'variant':<14}{'CPU/step':>12}{'x plain':>9}{'added vs watch':>16}{'wall/step (loop)':>18}")
    for v in variants:
        added = "" if v in ("plain", "watch") else f"{(med[v] - med['watch']) * 1e6:+.0f} us"
        print(
            f"{v:<14}{med[v] * 1e6:>9.0f} us{med[v] / med['plain']:>8.2f}x{added:>16}"
            f"{statistics.median(wall[v]) * 1e6:>15.0f} us"
        )


if __name__ == "__main__":
    main()

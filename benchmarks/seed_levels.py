"""Cost of each debug level on the seeds' own training loops, in CPU time and in instructions.

The seeds promised overhead bands per level (seed 000: memory debugging 1-5%, "other debugging"
<1%; seed 002: basic ~1-2%, advanced ~5-10%, extreme ~15-25%). This script runs the seeds' own
loops plain and under ``td.watch`` at each level (mode ``full_debug``, the default; the run store
on, as users get it) and prints the cost per step:

- ``--measure cpu``: process CPU time per step (all threads, incl. the store's writer), medians of
  ``--repeats`` blocks, variants interleaved, one torch thread;
- ``--measure instructions``: instructions per step under valgrind (``cachegrind``, no cache
  simulation): ``(I(N2) - I(N1)) / (N2 - N1)`` from two fresh processes, so start-up drops out.

Loops: ``seed001`` (its "Basic Usage": Linear(784, 10), batch 32, Adam, cross-entropy) and
``seed003`` (its "Integration with Existing Code" loop on an MLP 10-16-1, batch 8, SGD, MSE). Both
are tiny, launch-bound CPU steps (tens of microseconds of work), the worst case for a fixed per-step
cost; a step of real size divides the same added cost by its own time.

    python benchmarks/seed_levels.py --measure cpu [--repeats 5] [--steps 200]
    python benchmarks/seed_levels.py --measure instructions [--steps 16,36] [--jobs 2]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LEVELS = ("basic", "intermediate", "advanced", "expert")
VARIANTS = ("plain", *LEVELS)
LOOPS = ("seed001", "seed003")


def _loop(name: str) -> tuple[Any, Any, Callable[[int], None]]:
    """(model, optimizer, step(i)) of one seed's loop, seeded."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    if name == "seed001":
        model: nn.Module = nn.Sequential(nn.Linear(784, 10))
        optimizer: torch.optim.Optimizer = torch.optim.Adam(model.parameters())
        batches = [
            (torch.randn(32, 784, generator=g), torch.randint(0, 10, (32,), generator=g)) for _ in range(4)
        ]
        loss_fn: Callable[..., torch.Tensor] = F.cross_entropy
    else:
        model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        batches = [(torch.randn(8, 10, generator=g), torch.randn(8, 1, generator=g)) for _ in range(4)]
        loss_fn = F.mse_loss

    def step(i: int) -> None:
        x, y = batches[i % 4]
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()

    return model, optimizer, step


def _run(loop: str, variant: str, steps: int, timed: int = 0) -> float:
    """Run ``steps`` steps; with ``timed`` the CPU seconds of the last ``timed`` of them."""
    import torch

    import torchdebug as td

    torch.set_num_threads(1)
    model, optimizer, step = _loop(loop)
    cut = steps - timed
    t0 = 0.0
    if variant == "plain":
        for i in range(steps):
            if i == cut:
                t0 = time.process_time()
            step(i)
        return time.process_time() - t0
    with (
        tempfile.TemporaryDirectory() as d,
        td.watch(model, optimizer, run=d, config=td.DebugConfig(level=variant)) as mon,
    ):
        for i in range(steps):
            if i == cut:
                t0 = time.process_time()
            step(i)
            mon.step()
        spent = time.process_time() - t0
    return spent


def measure_cpu(loops: list[str], repeats: int, steps: int, warm: int) -> None:
    warnings.simplefilter("ignore")
    per: dict[tuple[str, str], list[float]] = {}
    for _ in range(repeats):
        for loop in loops:
            for v in VARIANTS:  # interleaved: each repeat runs every variant once
                per.setdefault((loop, v), []).append(_run(loop, v, warm + steps, steps) / steps)
    print(f"CPU time per step (process_time, all threads), median of {repeats} blocks of {steps} steps")
    for loop in loops:
        plain = statistics.median(per[(loop, "plain")])
        print(f"\n{loop}\n| variant | µs/step | ratio | added µs/step |\n|---|---|---|---|")
        for v in VARIANTS:
            m = statistics.median(per[(loop, v)])
            added = "-" if v == "plain" else f"{(m - plain) * 1e6:+.0f}"
            print(f"| {v} | {m * 1e6:.0f} | {m / plain:.2f}x | {added} |")


def count(loop: str, variant: str, steps: int) -> int:
    """Instructions executed by a fresh process running ``steps`` steps (valgrind's ``I refs``)."""
    cmd = [
        "valgrind",
        "--tool=cachegrind",
        "--cache-sim=no",
        "--cachegrind-out-file=/dev/null",
        sys.executable,
        __file__,
        "--child",
        loop,
        variant,
        str(steps),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0", PYTHONPATH=str(ROOT / "src"))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    m = re.search(r"I\s+refs:\s+([\d,]+)", out.stderr)
    if m is None:
        raise RuntimeError(f"no instruction count in valgrind's output:\n{out.stderr[-2000:]}")
    return int(m.group(1).replace(",", ""))


def measure_instructions(loops: list[str], n1: int, n2: int, jobs: int) -> None:
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed: apt-get install valgrind")
    work = [(lp, v, n) for lp in loops for v in VARIANTS for n in (n1, n2)]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        got = dict(zip(work, pool.map(lambda j: count(*j), work)))
    print(f"instructions per step: (I({n2}) - I({n1})) / {n2 - n1}, fresh processes under valgrind, 1 thread")
    for lp in loops:
        per = {v: (got[(lp, v, n2)] - got[(lp, v, n1)]) / (n2 - n1) for v in VARIANTS}
        plain = per["plain"]
        print(f"\n{lp}\n| variant | instructions/step | ratio | added/step |\n|---|---|---|---|")
        for v in VARIANTS:
            added = "-" if v == "plain" else f"{per[v] - plain:+,.0f}"
            print(f"| {v} | {per[v]:,.0f} | {per[v] / plain:.2f}x | {added} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measure", choices=("cpu", "instructions"), default="cpu")
    ap.add_argument("--only", default=",".join(LOOPS), help="loops, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", default=None, help="cpu: timed steps [200]; instructions: N1,N2 [16,36]")
    ap.add_argument("--warm", type=int, default=20, help="cpu: untimed steps first")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--child", nargs=3, metavar=("LOOP", "VARIANT", "STEPS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        warnings.simplefilter("ignore")
        _run(args.child[0], args.child[1], int(args.child[2]))
        return
    loops = [x for x in args.only.split(",") if x]
    if args.measure == "cpu":
        measure_cpu(loops, args.repeats, int(args.steps or 200), args.warm)
    else:
        n1, n2 = (int(x) for x in (args.steps or "16,36").split(","))
        measure_instructions(loops, n1, n2, args.jobs)


if __name__ == "__main__":
    main()

"""Each rule's margin on long healthy runs of tiny real models: how far a healthy run stays from firing.

Trains the healthy cases of tests/fixtures/divergence_models.py (a word_language_model-style
Transformer, an MLP and a CNN under SGD, SGD with momentum and Adam) and two with a cosine decay to
1e-5 of the rate, each for ``--steps`` steps under ``td.watch`` (no run folder), and prints per run:

- ``level``: the divergence rule's largest (recent median - baseline median) / its threshold
  (fires above 1);
- ``start``: the largest recent median / first loss, over the rule's 20x (fires at 1);
- ``growth``: the largest robust growth rate (x a step, 4-step windows) of the loss and of the
  gradient norm, over the growth rule's 3x (fires at 1, with 100x growth to a new high too);
- ``ratio``: the smallest and largest update/weight ratio of a matrix (every 10 steps) against the
  band [1e-5, 0.1] (below 1 at either end is inside);
- ``slow``: the largest median of 9 steps' own time (wall time minus the wait for a CPU, the
  kernel's run-queue delay) over the median of the steps before, over the slowdown rule's 1.5x;
- ``warned``: the warning events torchdebug raised on the run (a healthy run: none).

    PYTHONPATH=src:. python benchmarks/rule_margins.py [--steps 600]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fixtures.divergence_models import HEALTHY, Case

import torchdebug as td
from torchdebug.health.divergence import GROWTH_RATE, repeated_median
from torchdebug.perf.timing import RunQueueClock

RECENT, WINDOW, START = 25, 200, 20.0  # DivergenceRule's defaults
SLOW_RECENT, SLOW_FACTOR = 9, 1.5  # SlowdownRule's


def level_margin(losses: list[float]) -> float:
    """max (recent median - baseline median) / threshold, as DivergenceRule computes them."""
    start = statistics.median(losses[:RECENT])
    best = 0.0
    for i in range(2 * RECENT - 1, len(losses)):
        recent = losses[i - RECENT + 1 : i + 1]
        base = losses[max(0, i - RECENT + 1 - WINDOW) : i - RECENT + 1]
        med = statistics.median(base)
        sigma = 1.4826 * statistics.median(abs(v - med) for v in base)
        thr = max(10 * sigma, abs(med), 0.5 * max(start - med, 0.0), 1e-12)
        best = max(best, (statistics.median(recent) - med) / thr)
    return best


def start_margin(losses: list[float]) -> float:
    return max(statistics.median(losses[i - RECENT + 1 : i + 1]) for i in range(RECENT - 1, len(losses))) / (
        START * losses[0]
    )


def growth_margin(values: list[float]) -> float:
    best = 0.0
    for i in range(3, len(values)):
        pts = [(s, math.log10(v)) for s, v in enumerate(values[i - 3 : i + 1]) if v > 0]
        if len(pts) == 4:
            best = max(best, 10 ** repeated_median(pts) / GROWTH_RATE)
    return best


def slow_margin(own: list[float]) -> float:
    best = 0.0
    for i in range(SLOW_RECENT + 10, len(own)):
        recent = statistics.median(own[i - SLOW_RECENT + 1 : i + 1])
        base = statistics.median(own[max(0, i - SLOW_RECENT + 1 - 100) : i - SLOW_RECENT + 1])
        best = max(best, recent / base / SLOW_FACTOR)
    return best


def run(case: Case, steps: int, cosine: bool) -> dict[str, object]:
    torch.manual_seed(0)
    model = case.model()
    opt = case.optimizer(list(model.parameters()))
    sched = (
        torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: max(1e-5, 0.5 * (1 + math.cos(math.pi * min(s, steps // 2) / (steps // 2))))
        )
        if cosine
        else None
    )
    data = case.batches()
    mats = [p for p in model.parameters() if p.dim() >= 2]
    losses: list[float] = []
    norms: list[float] = []
    ratios: list[float] = []
    own: list[float] = []
    queue = RunQueueClock()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with td.watch(model, opt, run=False, config={"detail_every": 10}) as mon:
            for i in range(steps):
                t0, w0 = time.perf_counter(), queue.read()
                opt.zero_grad()
                loss = case.loss(model, data[i % len(data)])
                loss.backward()
                norm = nn.utils.clip_grad_norm_(model.parameters(), case.clip or math.inf)
                before = [p.detach().clone() for p in mats] if i % 10 == 0 else None
                opt.step()
                if sched is not None:
                    sched.step()
                mon.step()
                if before is not None:
                    ratios += [float((p - b).norm() / b.norm()) for p, b in zip(mats, before) if b.norm() > 0]
                losses.append(float(loss))
                norms.append(float(norm))
                own.append(time.perf_counter() - t0 - (queue.read() - w0))
    queue.close()
    warned = sorted({e.kind for e in mon.events if e.severity != "info"})
    live = [r for r in ratios if r > 0]
    return {
        "level": level_margin(losses),
        "start": start_margin(losses),
        "growth": max(growth_margin(losses), growth_margin(norms)),
        "ratio_lo": 1e-5 / min(live) if live else math.nan,
        "ratio_hi": max(live) / 0.1 if live else math.nan,
        "slow": slow_margin(own) if not math.isnan(own[0]) else math.nan,
        "warned": ",".join(warned) or "-",
        "python_warnings": len(caught),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=600)
    args = ap.parse_args()
    cases = [(c, False) for c in HEALTHY] + [
        (c, True) for c in HEALTHY if c.name in ("mlp sgd 0.1", "cnn adam 1e-3")
    ]
    print(f"{args.steps} steps each; a margin below 1 is inside the rule (healthy), 1 fires")
    head = (
        f"{'run':<36}{'level':>7}{'start':>7}{'growth':>8}{'ratio lo':>10}{'ratio hi':>10}{'slow':>7}  warned"
    )
    print(head)
    print("-" * len(head))
    for case, cosine in cases:
        r = run(case, args.steps, cosine)
        name = case.name + (" cosine" if cosine else "")
        print(
            f"{name:<36}{r['level']:>7.2f}{r['start']:>7.2f}{r['growth']:>8.2f}{r['ratio_lo']:>10.2g}"
            f"{r['ratio_hi']:>10.2g}{r['slow']:>7.2f}  {r['warned']}"
        )


if __name__ == "__main__":
    main()

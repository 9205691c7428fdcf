"""Each rule's margin on long healthy runs of real models: how far a healthy run stays from firing.

Runs under ``td.watch`` (no run folder; ``detail_every`` 10):

- every standard recipe of tests/fixtures/recipe_models.py, ``--steps`` steps each: ResNet-18 as
  torchvision writes it under SGD lr 0.1 momentum 0.9 (``--resnet-width`` channels at the stem, 64 is
  torchvision's; ``--resnet-steps`` steps, a ResNet step costs ~10 of the others), pytorch/examples
  word_language_model's LSTM (SGD lr 20, clip 0.25, truncated BPTT), a small GPT under AdamW with
  warm-up then cosine, the same GPT at a constant AdamW lr 1e-3, and an actor-critic whose loss is
  negative or near zero;
- with ``--cases`` (or ``--all``: every one), healthy cases of tests/fixtures/divergence_models.py
  (a word_language_model-style Transformer, an MLP and a CNN under SGD, SGD with momentum and Adam),
  two of them with a cosine decay to 1e-5 of the rate;

and prints per run (a margin below 1 is inside the rule, 1 fires):

- ``level``: the loss divergence rule's largest (recent median - baseline median) / its threshold;
- ``start``: the from-start checks' closest call: the largest median of 10 losses over 4x the first
  loss within the first 50 steps (the early jump's bar, whether or not the loss jumped at once) and
  over 20x within the first 200 ("-": the loss changed sign, the rule does not judge it);
- ``growth``: the largest robust growth rate (x a step, 4-step windows) of the loss and of the
  gradient norm, over the growth rule's 3x;
- ``gshift``: the gradient-norm level rule's largest log10 shift over its threshold;
- ``spike``: the loss spike rule's margin: the largest min(z-score / 10 robust sigmas, rise / half
  the running median); ``z``: the z-score part alone (the rule before it asked for the rise);
- ``ratio lo`` / ``ratio hi``: 1e-5 over the smallest, and the largest over 1, of the update/weight
  ratio of a matrix (every 10 steps; the low end is not judged once a schedule lowered the rate);
- ``slow``: the largest median of 9 steps' wall time over the median of the 100 steps before, over
  the slowdown rule's 1.5x (at 1 or more the step time rose: on a loaded machine, the load);
  ``work``: over those slow windows, the largest median CPU time of this process a step over the
  median before, over 1.5x (said in the rule's event, not what decides: a contended CPU stretches the
  same work's CPU time, and with torch's intra-op threads a worker waiting for a CPU leaves the
  others spinning, on a CPU; the rule decides by its threads' wait for a CPU, read from /proc);
  ``slow said``: the slowdown events the rule raised, ``i`` information (waiting for a CPU accounts
  for the rise), ``w`` warning;
- ``warned``: the warning events torchdebug raised on the run (a healthy run: none).

The header prints the machine's load average: the numbers are taken on whatever machine runs it,
loaded or not (the slowdown rule's subject).

    PYTHONPATH=src:. python benchmarks/rule_margins.py [--steps 200] [--resnet-steps 60] [--cases]
        [--all] [--only NAME]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fixtures import recipe_models as R
from tests.fixtures.divergence_models import HEALTHY, Case

import torchdebug as td
from torchdebug._robust import RunningMedian
from torchdebug.health.divergence import GROWTH_RATE, repeated_median

RECENT, WINDOW = 25, 200  # DivergenceRule's and NormShiftRule's windows
START, START_RECENT, START_HORIZON = 20.0, 10, 200  # the from-start check
EARLY, EARLY_HORIZON = 4.0, 50  # its early jump
SHIFT = 1.0  # NormShiftRule: log10(10x)
SPIKE_MADS, SPIKE_WARMUP, SPIKE_FLOOR, SPIKE_RISE = 10.0, 20, 1e-2, 0.5  # LossSpikeRule's defaults
RATIO_LO, RATIO_HI = 1e-5, 1.0  # UpdateRatioRule's defaults
SLOW_RECENT, SLOW_FACTOR = 9, 1.5  # SlowdownRule's


def level_margin(losses: list[float]) -> float:
    """max (recent median - baseline median) / threshold, as DivergenceRule computes them."""
    if len(losses) < 2 * RECENT:
        return math.nan
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
    """max median of START_RECENT losses / (START x first), over the first START_HORIZON losses."""
    head = losses[:START_HORIZON]
    if any(v <= 0 for v in head) or len(head) < START_RECENT:
        return math.nan  # a loss that changes sign: not judged
    meds = [statistics.median(head[i - START_RECENT + 1 : i + 1]) for i in range(START_RECENT - 1, len(head))]
    early = max(meds[: EARLY_HORIZON - START_RECENT + 1]) / (EARLY * head[0])
    return max(early, max(meds) / (START * head[0]))


def growth_margin(values: list[float]) -> float:
    best = 0.0
    for i in range(3, len(values)):
        pts = [(s, math.log10(v)) for s, v in enumerate(values[i - 3 : i + 1]) if v > 0]
        if len(pts) == 4:
            best = max(best, 10 ** repeated_median(pts) / GROWTH_RATE)
    return best


def shift_margin(norms: list[float]) -> float:
    """max log10 shift of the recent median norm over NormShiftRule's threshold."""
    logs = [math.log10(v) for v in norms if 0 < v < math.inf]
    best = 0.0
    for i in range(2 * RECENT - 1, len(logs)):
        base = logs[max(0, i - RECENT + 1 - WINDOW) : i - RECENT + 1]
        med = statistics.median(base)
        sigma = 1.4826 * statistics.median(abs(v - med) for v in base)
        best = max(best, (statistics.median(logs[i - RECENT + 1 : i + 1]) - med) / max(SHIFT, 10 * sigma))
    return best


def spike_margin(losses: list[float]) -> tuple[float, float]:
    """LossSpikeRule fires when a loss is both 10 robust sigmas and 0.5 x |median| above its running
    median: the largest of min(z / 10, rise / (0.5 |median|)) over the run, and the largest z / 10
    alone (what the rule said before it asked for the rise)."""
    hist = RunningMedian(200)
    best = z_only = 0.0
    for v in losses:
        if len(hist) >= SPIKE_WARMUP:
            med = hist.median()
            z = hist._zscore_at(med, v, rel_floor=SPIKE_FLOOR, abs_floor=1e-12) / SPIKE_MADS
            rise = (v - med) / (SPIKE_RISE * abs(med)) if med else math.inf
            best, z_only = max(best, min(z, rise)), max(z_only, z)
        hist.push(v)
    return best, z_only


def slow_margin(wall: list[float], cpu: list[float]) -> tuple[float, float]:
    """(largest wall-time ratio of 9 steps over the 100 before / 1.5, and over the windows at 1.5x or
    more the largest CPU-time ratio / 1.5)"""
    slow = work = 0.0
    for i in range(SLOW_RECENT + 10, len(wall)):
        now, before = (
            slice(i - SLOW_RECENT + 1, i + 1),
            slice(max(0, i - SLOW_RECENT + 1 - 100), i - SLOW_RECENT + 1),
        )
        ratio = statistics.median(wall[now]) / statistics.median(wall[before]) / SLOW_FACTOR
        slow = max(slow, ratio)
        if ratio >= 1:
            work = max(work, statistics.median(cpu[now]) / statistics.median(cpu[before]) / SLOW_FACTOR)
    return slow, work


class Recorder:
    """A ``wrap`` for the recipe loops: ``td.watch`` plus what the margins need, measured beside it
    (the loss and the gradient norm as torchdebug read them, update ratios every 10 steps around the
    optimizer's step, each step's wall time and this process's CPU time)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.ratios: list[tuple[float, bool]] = []  # (ratio, the lr was lowered on purpose then)
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.slow_said = ""  # the slowdown events' severities: i (info), w (warning)
        self.events: list[str] = []
        self.python_warnings = 0

    @contextlib.contextmanager
    def __call__(self, model: nn.Module, opt: torch.optim.Optimizer) -> Iterator[Callable[[float], None]]:
        mats = [p for p in model.parameters() if p.dim() >= 2]
        before: list[torch.Tensor] = []
        lr_peak = [0.0]
        calls = [0]

        def pre(o: object, args: object, kwargs: object) -> None:
            if calls[0] % 10 == 0:
                before[:] = [p.detach().clone() for p in mats]

        def post(o: object, args: object, kwargs: object) -> None:
            lr = max(g["lr"] for g in opt.param_groups)
            lr_peak[0] = max(lr_peak[0], lr)
            if before:
                low = lr <= 0.5 * lr_peak[0]
                self.ratios += [
                    (float((p.detach() - b).norm() / b.norm()), low)
                    for p, b in zip(mats, before)
                    if b.norm() > 0
                ]
                before.clear()
            calls[0] += 1

        handles = [opt.register_step_pre_hook(pre), opt.register_step_post_hook(post)]
        mark = [time.perf_counter(), time.process_time()]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with td.watch(model, opt, run=False, config={"detail_every": 10}) as mon:

                    def on_step(loss: float) -> None:
                        record = mon.step()
                        now, cpu = time.perf_counter(), time.process_time()
                        self.wall.append(now - mark[0])
                        self.cpu.append(cpu - mark[1])
                        mark[:] = [now, cpu]
                        self.losses.append(record.loss if record.loss is not None else loss)
                        self.norms.append(record.grad_norm if record.grad_norm is not None else math.nan)

                    yield on_step
            finally:
                for h in handles:
                    h.remove()
        self.slow_said = "".join(e.severity[0] for e in mon.events if e.kind == "slowdown") or "-"
        self.events = sorted({f"{e.kind}@{e.step}" for e in mon.events if e.severity != "info"})
        self.python_warnings = len(caught)

    def margins(self) -> dict[str, object]:
        live = [(r, low) for r, low in self.ratios if r > 0]
        judged_lo = [r for r, low in live if not low]
        return {
            "level": level_margin(self.losses),
            "start": start_margin(self.losses),
            "growth": max(growth_margin(self.losses), growth_margin(self.norms)),
            "gshift": shift_margin(self.norms),
            "spike": spike_margin(self.losses)[0],
            "spike_z": spike_margin(self.losses)[1],
            "ratio_lo": RATIO_LO / min(judged_lo) if judged_lo else math.nan,
            "ratio_hi": max(r for r, _ in live) / RATIO_HI if live else math.nan,
            "slow": slow_margin(self.wall, self.cpu),
            "slow_said": self.slow_said,
            "warned": ",".join(self.events) or "-",
        }


def case_run(case: Case, cosine: bool) -> Callable[[int, R.Wrap], object]:
    """A divergence_models case as a recipe loop (zero_grad, forward, backward, clip, step, schedule)."""

    def run(steps: int, wrap: R.Wrap) -> None:
        torch.manual_seed(0)
        model = case.model()
        opt = case.optimizer(list(model.parameters()))
        half = max(1, steps // 2)
        sched = (
            torch.optim.lr_scheduler.LambdaLR(
                opt, lambda s: max(1e-5, 0.5 * (1 + math.cos(math.pi * min(s, half) / half)))
            )
            if cosine
            else None
        )
        data = case.batches()
        with wrap(model, opt) as on_step:
            for i in range(steps):
                opt.zero_grad()
                loss = case.loss(model, data[i % len(data)])
                loss.backward()
                if case.clip is not None:
                    nn.utils.clip_grad_norm_(model.parameters(), case.clip)
                opt.step()
                if sched is not None:
                    sched.step()
                on_step(float(loss.detach()))

    return run


Run = Callable[[int, R.Wrap], object]


def recipes(
    cases: bool, all_cases: bool, resnet_width: int, resnet_steps: int, steps: int
) -> list[tuple[str, int, Run]]:
    """(name, steps, run): every recipe of recipe_models, then (``cases``) divergence_models cases."""
    out: list[tuple[str, int, Run]] = [
        (
            f"resnet18 w{resnet_width} sgd 0.1 m0.9",
            resnet_steps,
            lambda n, wrap: R.resnet_run(n, wrap, width=resnet_width),
        ),
        ("word LM lstm sgd 20 clip 0.25", steps, lambda n, wrap: R.word_lm_run(n, wrap, bptt=20, batch=10)),
        ("gpt adamw 1e-3 warmup+cosine", steps, R.gpt_run),
        ("gpt adamw 1e-3 constant", steps, lambda n, wrap: R.gpt_run(n, wrap, schedule=False)),
        ("actor-critic adam 1e-2", steps, R.actor_critic_run),
    ]
    if not (cases or all_cases):
        return out
    out += [
        (c.name + " cosine", steps, case_run(c, True))
        for c in HEALTHY
        if c.name in ("mlp sgd 0.1", "cnn adam 1e-3")
    ]
    picked = HEALTHY if all_cases else [c for c in HEALTHY if c.name in _SOME]
    return out + [(c.name, steps, case_run(c, False)) for c in picked]


_SOME = ("transformer sgd lr1", "mlp sgd 0.1", "cnn sgd 0.05 momentum", "transformer adam 1e-3")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="steps of each recipe but ResNet-18")
    ap.add_argument("--resnet-steps", type=int, default=60, help="steps of ResNet-18")
    ap.add_argument("--cases", action="store_true", help="also six divergence_models cases")
    ap.add_argument("--all", action="store_true", help="also every healthy case of divergence_models")
    ap.add_argument("--only", default="", help="only the runs whose name contains this")
    ap.add_argument(
        "--resnet-width", type=int, default=8, help="ResNet-18's stem channels (64: torchvision's)"
    )
    args = ap.parse_args()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan
    print(
        f"load average {load:.1f} on {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; a margin below 1 is inside the rule (healthy), 1 fires"
    )
    head = (
        f"{'run':<34}{'steps':>6}{'level':>7}{'start':>7}{'growth':>8}{'gshift':>8}{'spike':>7}{'z':>6}"
        f"{'ratio lo':>10}{'ratio hi':>10}{'slow':>7}{'work':>7}{'slow said':>10}{'secs':>6}  warned"
    )
    print(head)
    print("-" * len(head))
    began = time.perf_counter()
    for name, steps, run in recipes(args.cases, args.all, args.resnet_width, args.resnet_steps, args.steps):
        if args.only and args.only not in name:
            continue
        t0 = time.perf_counter()
        rec = Recorder()
        run(steps, rec)
        r = rec.margins()
        slow, work = r["slow"]  # type: ignore[misc]
        print(
            f"{name:<34}{steps:>6}{r['level']:>7.2f}{_num(r['start']):>7}{r['growth']:>8.2f}{r['gshift']:>8.2f}"
            f"{r['spike']:>7.2f}{r['spike_z']:>6.2f}{r['ratio_lo']:>10.2g}{r['ratio_hi']:>10.2g}"
            f"{slow:>7.2f}{work:>7.2f}{r['slow_said']:>10}{time.perf_counter() - t0:>6.0f}  {r['warned']}",
            flush=True,
        )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan
    print(f"{time.perf_counter() - began:.0f} s in all; load average {load:.1f} at the end")


def _num(x: object) -> str:
    return "-" if isinstance(x, float) and math.isnan(x) else f"{x:.2f}"


if __name__ == "__main__":
    main()

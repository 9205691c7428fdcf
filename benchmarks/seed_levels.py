"""Cost of each debug level on the seeds' own training loops, in CPU time and in instructions.

The seeds promised overhead bands per level (seed 000: memory debugging 1-5%, "other debugging"
<1%; seed 002: basic ~1-2%, advanced ~5-10%, extreme ~15-25%). This script runs the seeds' own
loops plain and under ``td.watch`` at each level (mode ``full_debug``, the default; the run store
on, as users get it) and prints the cost per step:

- ``--measure cpu``: process CPU time per step (all threads, incl. the store's writer), medians of
  ``--repeats`` blocks, variants interleaved, one torch thread;
- ``--measure instructions``: instructions per step under valgrind's ``callgrind`` with
  instrumentation off except for a window of steps ``[N1, N2)`` (default ``[16, 26)``: warm, one
  detail step, step 20, inside), switched by client requests from a small C shim (``gcc`` and
  valgrind's headers). One process per loop runs every variant in turn (a fresh model, optimizer
  and session each), each window dumped apart: torch is imported once under valgrind, and start-up
  and imports are never counted. Callgrind's client-request dump covers the calling thread only, so
  these are the TRAINING THREAD's instructions: the run store's writer thread is left out (for the
  whole process, ``benchmarks/host_instructions.py`` counts it). Instructions do not move with the
  machine's load; CPU time does.

Variants: ``plain`` (no torchdebug); the four levels under ``td.watch`` (mode ``full_debug``);
``memory`` (``mode="memory_profiling"``, seed 000's "memory debugging") and ``anomaly``
(``mode="anomaly_detection"``: the NaN/Inf sentinel alone, what replaces seed 000's
``detect_anomaly``), both at the default level. The expert level's profiler records steps 2-4 once
(wait 1, warm-up 1, 3 active): a one-time cost outside the default window.

Loops: ``seed001`` (its "Basic Usage": Linear(784, 10), batch 32, Adam, cross-entropy) and
``seed003`` (its "Integration with Existing Code" loop on an MLP 10-16-1, batch 8, SGD, MSE), and
the launch-bound proxies of ``tests/fixtures/launch_models.py`` (``mlp4``, ``deep_mlp``, ``gpt2``;
gpt2 takes minutes a variant under valgrind). All are small, launch-bound CPU steps, the worst case
for a fixed per-step cost; a step of real size divides the same added cost by its own time.

    python benchmarks/seed_levels.py --measure cpu [--repeats 5] [--steps 200]
    python benchmarks/seed_levels.py --measure instructions [--only seed001,seed003,mlp4,deep_mlp]
                                     [--variants plain,basic,...] [--steps 16,26] [--jobs 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import _callgrind

ROOT = Path(__file__).resolve().parents[1]
LEVELS = ("basic", "intermediate", "advanced", "expert")
MODES = {"memory": "memory_profiling", "anomaly": "anomaly_detection"}
VARIANTS = ("plain", *LEVELS, *MODES)
LOOPS = ("seed001", "seed003")
PROXIES = ("mlp4", "deep_mlp", "gpt2")


def _loop(name: str) -> tuple[Any, Any, Callable[[int], None]]:
    """(model, optimizer, step(i)) of one seed's loop, seeded."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    if name in PROXIES:
        sys.path.insert(0, str(ROOT))
        from tests.fixtures.launch_models import WORKLOADS, train_step

        w = WORKLOADS[name]
        proxy_batches = [w.batch(g) for _ in range(4)]
        torch.manual_seed(0)
        proxy = w.build()
        proxy_opt = w.optimizer(proxy)

        def proxy_step(i: int) -> None:
            train_step(w, proxy, proxy_opt, proxy_batches[i % 4])

        return proxy, proxy_opt, proxy_step
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


def _config(variant: str) -> Any:
    import torchdebug as td

    if variant in MODES:
        return td.DebugConfig(mode=MODES[variant])  # type: ignore[arg-type]
    return td.DebugConfig(level=variant)  # type: ignore[arg-type]


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
        td.watch(model, optimizer, run=d, config=_config(variant)) as mon,
    ):
        for i in range(steps):
            if i == cut:
                t0 = time.process_time()
            step(i)
            mon.step()
        spent = time.process_time() - t0
    return spent


def _window(loop: str, variant: str, n1: int, n2: int, lib: Any) -> None:
    """Run ``n2`` steps, instrumenting steps ``[n1, n2)`` only (the writer flushed at both ends),
    then dump that window's counts under the variant's name."""
    import torch

    import torchdebug as td

    torch.set_num_threads(1)
    model, optimizer, step = _loop(loop)
    lib.td_zero()
    if variant == "plain":
        for i in range(n2):
            if i == n1:
                lib.td_window_start()
            step(i)
        lib.td_window_stop()
    else:
        with (
            tempfile.TemporaryDirectory() as d,
            td.watch(model, optimizer, run=d, config=_config(variant)) as mon,
        ):
            writer = getattr(mon, "writer", None)
            for i in range(n2):
                if i == n1:
                    if writer is not None:
                        writer.flush()  # the steps before the window are written before it opens
                    lib.td_window_start()
                step(i)
                mon.step()
            if writer is not None:
                writer.flush()  # the window's records written and committed inside it
            lib.td_window_stop()
    lib.td_dump(variant.encode())


def _child(loop: str, variants: list[str], n1: int, n2: int, shim: str) -> None:
    import ctypes

    lib = ctypes.CDLL(shim)
    lib.td_dump.argtypes = [ctypes.c_char_p]
    for v in variants:
        _window(loop, v, n1, n2, lib)


def measure_cpu(loops: list[str], variants: list[str], repeats: int, steps: int, warm: int) -> None:
    warnings.simplefilter("ignore")
    per: dict[tuple[str, str], list[float]] = {}
    for _ in range(repeats):
        for loop in loops:
            for v in variants:  # interleaved: each repeat runs every variant once
                per.setdefault((loop, v), []).append(_run(loop, v, warm + steps, steps) / steps)
    print(f"CPU time per step (process_time, all threads), median of {repeats} blocks of {steps} steps")
    for loop in loops:
        plain = statistics.median(per[(loop, "plain")])
        print(f"\n{loop}\n| variant | µs/step | ratio | added µs/step |\n|---|---|---|---|")
        for v in variants:
            m = statistics.median(per[(loop, v)])
            added = "-" if v == "plain" else f"{(m - plain) * 1e6:+.0f}"
            print(f"| {v} | {m * 1e6:.0f} | {m / plain:.2f}x | {added} |")


def count(loop: str, variants: list[str], n1: int, n2: int, shim: Path) -> dict[str, dict[str, int]]:
    """Instructions in each variant's window ``[n1, n2)``: ``{variant: {total, main, others}}``."""
    dumps = _callgrind.run(__file__, ["--child", loop, ",".join(variants), f"{n1},{n2},{shim}"], loop)
    got = {v: {"total": 0, "main": 0} for v in variants}
    for d in dumps:
        if d.trigger is None or d.trigger not in got:
            continue  # the dump at exit (nothing instrumented since the last window)
        c = got[d.trigger]
        c["total"] += d.instructions
        if d.thread == 1:
            c["main"] += d.instructions
    for c in got.values():
        c["others"] = c["total"] - c["main"]
    return got


def measure_instructions(loops: list[str], variants: list[str], n1: int, n2: int, jobs: int) -> None:
    _callgrind.require_valgrind()
    shim = _callgrind.shim()
    n = n2 - n1
    got: dict[str, dict[str, dict[str, int]]] = {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(count, lp, variants, n1, n2, shim): lp for lp in loops}
        for f in as_completed(futures):  # each loop as it lands: minutes under valgrind
            lp = futures[f]
            got[lp] = f.result()
            print(
                f"# {lp}: " + ", ".join(f"{v} {c['main'] / n:,.0f}" for v, c in got[lp].items()), flush=True
            )
    print(
        f"\ninstructions per step over steps [{n1}, {n2}), the training thread only (the run store's "
        "writer thread is not counted); callgrind, 1 torch thread"
    )
    for lp in loops:
        plain = got[lp]["plain"]["main"] / n
        print(f"\n{lp}\n| variant | instructions/step | ratio | added/step |\n|---|---|---|---|")
        for v in variants:
            per = got[lp][v]["main"] / n
            added = "-" if v == "plain" else f"{per - plain:+,.0f}"
            print(f"| {v} | {per:,.0f} | {per / plain:.3f}x | {added} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measure", choices=("cpu", "instructions"), default="cpu")
    ap.add_argument(
        "--only", default=",".join(LOOPS), help=f"loops, comma-separated ({', '.join(LOOPS + PROXIES)})"
    )
    ap.add_argument("--variants", default=",".join(VARIANTS), help="variants, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--steps", default=None, help="cpu: timed steps [200]; instructions: window N1,N2 [16,26]"
    )
    ap.add_argument("--warm", type=int, default=20, help="cpu: untimed steps first")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--child", nargs=3, metavar=("LOOP", "VARIANT", "STEPS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        warnings.simplefilter("ignore")
        a, b, shim = args.child[2].split(",", 2)
        _child(args.child[0], args.child[1].split(","), int(a), int(b), shim)
        return
    loops = [x for x in args.only.split(",") if x]
    variants = [x for x in args.variants.split(",") if x]
    if "plain" not in variants:
        variants.insert(0, "plain")  # every ratio is to plain
    unknown = sorted(set(loops) - set(LOOPS + PROXIES)) + sorted(set(variants) - set(VARIANTS))
    if unknown:
        sys.exit(f"unknown loops/variants {unknown}; loops: {LOOPS + PROXIES}, variants: {VARIANTS}")
    if args.measure == "cpu":
        measure_cpu(loops, variants, args.repeats, int(args.steps or 200), args.warm)
    else:
        n1, n2 = (int(x) for x in (args.steps or "16,26").split(","))
        measure_instructions(loops, variants, n1, n2, args.jobs)


if __name__ == "__main__":
    main()

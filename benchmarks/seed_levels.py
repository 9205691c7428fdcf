"""Cost of each debug level on the seeds' own training loops, in CPU time and in instructions.

The seeds promised overhead bands per level (seed 000: memory debugging 1-5%, "other debugging"
<1%; seed 002: basic ~1-2%, advanced ~5-10%, extreme ~15-25%). This script runs the seeds' own
loops plain and under ``td.watch`` at each level (mode ``full_debug``, the default; the run store
on, as users get it) and prints the cost per step.

Both measures count the same thing: steps ``[N1, N2)`` of one session, with the run store's writer
flushed at both ends (the window's records written and committed inside it), on the training
thread. The session's start (``watch()`` to its first records committed) and its exit are counted
apart: a user whose blocks are short pays them per block. Each process first runs every variant
once, untimed, so torchdebug's lazy imports (paid once per process) are in neither.

- ``--measure cpu``: CPU time per step of the training thread (``time.thread_time``), of the writer
  thread (its CPU-time clock) and of the whole process, and the start and exit in process CPU
  time; medians of ``--repeats`` blocks, each watched block paired with a plain block run just
  before it (a pair sees the same load; the ratio is the median of the pairs', with their range),
  the variants' order rotated, one torch thread. Window ``[--warm, --warm + --steps)``, by default
  ``[20, 220)``; CPU time moves with the machine's load.
- ``--measure instructions``: instructions per step under valgrind's ``callgrind`` with
  instrumentation off except for the window (default ``[20, 70)``), switched by client requests
  from a small C shim (``benchmarks/_callgrind.py``: ``gcc`` and valgrind's headers). One process
  per loop runs every variant in turn (a fresh model, optimizer and session each), each window
  dumped apart: torch is imported once under valgrind. Callgrind's client-request dump covers the
  calling thread only, so these are the training thread's instructions: the writer thread is left
  out (for the whole process, ``benchmarks/host_instructions.py`` counts it). Instructions do not
  move with the machine's load.

The default windows hold whole periods of the schedules (a detail step every 10 steps, a memory
sample every 50), so each scheduled cost is counted at its own rate.

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

    python benchmarks/seed_levels.py --measure cpu [--only seed001,seed003,gpt2] [--repeats 5]
                                     [--steps 200 | --steps N1,N2]
    python benchmarks/seed_levels.py --measure instructions [--only seed001,seed003,mlp4,deep_mlp]
                                     [--variants plain,basic,...] [--steps 20,70] [--jobs 2]
"""

from __future__ import annotations

import argparse
import os
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


def _thread_cpu(thread: Any) -> float:
    """CPU seconds of a live thread (Linux: its CPU-time clock); 0.0 when it cannot be read."""
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (AttributeError, OSError, TypeError):
        return 0.0


def _cpu_block(loop: str, variant: str, n1: int, n2: int) -> dict[str, float]:
    """Run ``n2`` steps and time steps ``[n1, n2)`` as the instruction window counts them (the
    writer flushed at both ends): the training thread's CPU (``main``), the writer thread's
    (``writer``) and the whole process's (``proc``); and apart, the session's ``start``
    (``watch()`` to its first records committed) and ``exit``, in process CPU (every thread)."""
    import torch

    import torchdebug as td

    torch.set_num_threads(1)
    model, optimizer, step = _loop(loop)
    if variant == "plain":
        for i in range(n2):
            if i == n1:
                p0, m0 = time.process_time(), time.thread_time()
            step(i)
        proc, main = time.process_time() - p0, time.thread_time() - m0
        return {"main": main, "writer": 0.0, "proc": proc, "start": 0.0, "exit": 0.0}
    with tempfile.TemporaryDirectory() as d:
        s0 = time.process_time()
        session = td.watch(model, optimizer, run=d, config=_config(variant))
        mon = session.__enter__()
        try:
            writer = getattr(mon, "writer", None)
            thread = writer._core.thread if writer is not None else None
            if writer is not None:
                writer.flush()  # the session's start written and committed: part of its start
            start = time.process_time() - s0
            for i in range(n2):
                if i == n1:
                    if writer is not None:
                        writer.flush()  # the steps before the window are written before it opens
                    p0, m0, w0 = time.process_time(), time.thread_time(), _thread_cpu(thread)
                step(i)
                mon.step()
            if writer is not None:
                writer.flush()  # the window's records written and committed inside it
            proc, main = time.process_time() - p0, time.thread_time() - m0
            wt = _thread_cpu(thread) - w0 if thread is not None else 0.0
        finally:
            e0 = time.process_time()
            session.__exit__(None, None, None)
            end = time.process_time() - e0
    return {"main": main, "writer": wt, "proc": proc, "start": start, "exit": end}


def _window(loop: str, variant: str, n1: int, n2: int, lib: Any) -> None:
    """Run ``n2`` steps, instrumenting steps ``[n1, n2)`` only (the writer flushed at both ends),
    and dump that window's counts under the variant's name; the session's start (``watch()`` to
    its first records committed) and exit are counted and dumped apart (``VARIANT:start``,
    ``VARIANT:exit``)."""
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
        lib.td_dump(variant.encode())
        return
    with tempfile.TemporaryDirectory() as d:
        lib.td_window_start()
        session = td.watch(model, optimizer, run=d, config=_config(variant))
        mon = session.__enter__()
        writer = getattr(mon, "writer", None)
        try:
            if writer is not None:
                writer.flush()  # the session's start written and committed: part of its start
            lib.td_window_stop()
            lib.td_dump(f"{variant}:start".encode())
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
        finally:
            lib.td_window_start()
            session.__exit__(None, None, None)
            lib.td_window_stop()
            lib.td_dump(f"{variant}:exit".encode())


def _child(loop: str, variants: list[str], n1: int, n2: int, shim: str) -> None:
    import ctypes

    lib = ctypes.CDLL(shim)
    lib.td_dump.argtypes = [ctypes.c_char_p]
    for v in variants:
        _cpu_block(loop, v, 1, 3)  # uninstrumented: torchdebug's lazy imports happen here, not counted
    for v in variants:
        _window(loop, v, n1, n2, lib)


def _load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def measure_cpu(loops: list[str], variants: list[str], repeats: int, n1: int, n2: int) -> None:
    warnings.simplefilter("ignore")
    print(f"{_load()} at the start", flush=True)
    first = time.process_time()
    _cpu_block(loops[0], "basic", 1, 3)  # the process's first session: torchdebug's lazy imports
    first = time.process_time() - first
    for loop in loops:
        for v in variants:
            _cpu_block(loop, v, 1, 3)  # each loop and variant once untimed: torch's first calls
    watched = [v for v in variants if v != "plain"]
    plain: dict[str, list[dict[str, float]]] = {lp: [] for lp in loops}
    per: dict[tuple[str, str], list[dict[str, float]]] = {}
    for r in range(repeats):
        for loop in loops:
            k = r % len(watched)  # the order rotated: no variant always runs first
            for v in watched[k:] + watched[:k]:
                # each watched block paired with a plain block just before it: the ratio of the pair
                # is taken under the same load, which moves both
                p, w = _cpu_block(loop, "plain", n1, n2), _cpu_block(loop, v, n1, n2)
                plain[loop].append(p)
                per.setdefault((loop, v), []).append(
                    {**w, "main_ratio": w["main"] / p["main"], "proc_ratio": w["proc"] / p["proc"]}
                )
    n = n2 - n1
    print(
        f"{_load()} at the end\nCPU time per step over steps [{n1}, {n2}) (writer flushed at both ends), "
        f"medians of {repeats} blocks, 1 torch thread; each ratio the median of {repeats} pairs (the "
        "watched block and a plain block just before it), with the pairs' range; the training thread "
        "(what the instruction count counts), the writer thread and the whole process apart; the "
        "session's start and exit apart, in process CPU (every thread). The process's first session "
        f"(torchdebug's lazy imports): {first * 1e3:.0f} ms"
    )
    for loop in loops:
        med = {k: statistics.median(b[k] for b in plain[loop]) / n for k in ("main", "proc")}
        print(
            f"\n{loop}\n| variant | training thread µs/step | ratio (range) | writer µs/step "
            "| process µs/step | ratio (range) | start ms | exit ms |\n|---|---|---|---|---|---|---|---|"
        )
        print(f"| plain | {med['main'] * 1e6:.0f} | 1 | - | {med['proc'] * 1e6:.0f} | 1 | - | - |")
        for v in watched:
            bs = per[(loop, v)]
            m = {k: statistics.median(b[k] for b in bs) for k in bs[0]}
            rm, rp = [b["main_ratio"] for b in bs], [b["proc_ratio"] for b in bs]
            print(
                f"| {v} | {m['main'] / n * 1e6:.0f} | {m['main_ratio']:.3f}x ({min(rm):.2f}-{max(rm):.2f}) | "
                f"{m['writer'] / n * 1e6:.0f} | {m['proc'] / n * 1e6:.0f} | "
                f"{m['proc_ratio']:.3f}x ({min(rp):.2f}-{max(rp):.2f}) | "
                f"{m['start'] * 1e3:.1f} | {m['exit'] * 1e3:.1f} |"
            )


def count(loop: str, variants: list[str], n1: int, n2: int, shim: Path) -> dict[str, int]:
    """The training thread's instructions in each dump: ``{VARIANT: window, VARIANT:start: the
    session's start, VARIANT:exit: its exit}``."""
    dumps = _callgrind.run(__file__, ["--child", loop, ",".join(variants), f"{n1},{n2},{shim}"], loop)
    got: dict[str, int] = {}
    for d in dumps:
        if d.trigger is not None and d.thread == 1:  # not the dump at exit (nothing instrumented since)
            got[d.trigger] = got.get(d.trigger, 0) + d.instructions
    return got


def measure_instructions(loops: list[str], variants: list[str], n1: int, n2: int, jobs: int) -> None:
    _callgrind.require_valgrind()
    shim = _callgrind.shim()
    n = n2 - n1
    got: dict[str, dict[str, int]] = {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(count, lp, variants, n1, n2, shim): lp for lp in loops}
        for f in as_completed(futures):  # each loop as it lands: minutes under valgrind
            lp = futures[f]
            got[lp] = f.result()
            print(f"# {lp}: " + ", ".join(f"{v} {got[lp][v] / n:,.0f}" for v in variants), flush=True)
    print(
        f"\ninstructions per step over steps [{n1}, {n2}) (writer flushed at both ends), the training "
        "thread only (the run store's writer thread is not counted); the session's start and exit "
        "apart (the training thread's instructions); callgrind, 1 torch thread"
    )
    for lp in loops:
        plain = got[lp]["plain"] / n
        print(
            f"\n{lp}\n| variant | instructions/step | ratio | added/step | start | exit |\n"
            "|---|---|---|---|---|---|"
        )
        for v in variants:
            per = got[lp][v] / n
            added = "-" if v == "plain" else f"{per - plain:+,.0f}"
            session = "- | -" if v == "plain" else f"{got[lp][v + ':start']:,} | {got[lp][v + ':exit']:,}"
            print(f"| {v} | {per:,.0f} | {per / plain:.3f}x | {added} | {session} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measure", choices=("cpu", "instructions"), default="cpu")
    ap.add_argument(
        "--only", default=",".join(LOOPS), help=f"loops, comma-separated ({', '.join(LOOPS + PROXIES)})"
    )
    ap.add_argument("--variants", default=",".join(VARIANTS), help="variants, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--steps",
        default=None,
        help="the window: N1,N2, or (cpu) the number of steps after --warm [cpu 200; instructions 20,70]",
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
        steps = [int(x) for x in (args.steps or "200").split(",")]
        n1, n2 = steps if len(steps) == 2 else (args.warm, args.warm + steps[0])
        measure_cpu(loops, variants, args.repeats, n1, n2)
    else:
        n1, n2 = (int(x) for x in (args.steps or "20,70").split(","))
        measure_instructions(loops, variants, n1, n2, args.jobs)


if __name__ == "__main__":
    main()

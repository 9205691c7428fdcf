"""torchdebug's own host cost on launch-bound workloads (the fair CPU proxy for a GPU step).

On a GPU the compute is 10-100x faster than on a CPU and the host (Python, kernel launches, syncs)
bounds a step, so torchdebug's host work is what users pay. The proxy: real training shapes at tiny
widths on one thread (``torch.set_num_threads(1)``), measured in process CPU time
(``time.process_time``: the work done, which other processes' load on a shared machine does not
inflate), plain and watched blocks interleaved, medians.

Workloads (``tests/fixtures/launch_models.py``): ``gpt2`` (12 blocks, tied embeddings, width 32,
148 parameter tensors, AdamW(foreach=True), clip_grad_norm_), ``deep_mlp`` (256 x (Linear 16->16,
Tanh) + head, 514 tensors, AdamW), ``mlp4`` (10 tensors), and with ``--many`` ``many5000`` (5,000
tensors). Variants on one model and optimizer: ``plain``; ``watch`` (the default ``td.watch``:
sentinel, gradient health, memory, timing, the run store); ``sentinel`` (``mode="anomaly_detection"``);
``none`` (``mode="none"``).

Printed per workload and variant: CPU ms per step with the detail steps counted as often as they
occur: the median of each kind of step (ordinary; detail; detail with a memory sample), weighted by
how often it occurs in a long run (1 - 1/``detail_every``, 1/``detail_every`` - 1/``memory_every``,
1/``memory_every``), so a step slowed by another process does not move the figure the way it moves a
mean; the ratio to plain, the added microseconds per step and per parameter tensor; for ``watch``
also the median of its ordinary and of its detail steps. Blocks are ``--chunk`` steps, short (10) so
that the variants alternate many times while the machine's load drifts; each watched block is a
fresh session (entered and left outside the timing), whose first step is a detail step with a memory
sample. Then the blocking device-to-host reads torchdebug makes on an ordinary step and on a detail
step (``tests/fixtures/host_reads.py``: calls of ``Tensor.item/tolist/cpu/numpy/
__bool__/__float__/__int__/__index__`` whose first frame outside torch is torchdebug's).

``--boundaries``: instead of whole steps, torchdebug's own CPU time per step inside each step-protocol
method of the session (``Monitor.forward_started`` ... ``step``, the sentinel and instruments they call
included; not the loss tape's calls, the global patches' wrappers or the run store's thread), medians
of interleaved sessions: far less blurred by a shared machine's load than a whole step, and the
per-tensor slope between workloads is read from it directly.

``--rss N``: the 5,000-tensor model under the default watch for N steps (one session), RSS every
``N // 20`` steps, and the growth after the first 10%.

    python benchmarks/host_cost.py [--quick] [--only gpt2,deep_mlp,mlp4] [--many] [--repeats 15]
                                   [--chunk 10] [--rss 5000] [--boundaries]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fixtures.host_reads import HostReads
from tests.fixtures.launch_models import WORKLOADS, Workload, train_step

import torchdebug as td
from torchdebug.store import create_run

VARIANTS = ("plain", "watch", "sentinel", "none")
CONFIGS = {
    "watch": td.DebugConfig(),
    "sentinel": td.DebugConfig(mode="anomaly_detection"),
    "none": td.DebugConfig(mode="none"),
}


@contextmanager
def quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.TorchDebugWarning)
        yield


def _block(w: Workload, model: Any, opt: Any, batches: list, steps: int, mon: Any = None) -> list[float]:
    """CPU seconds of each step."""
    out = []
    for i in range(steps):
        c0 = time.process_time()
        train_step(w, model, opt, batches[i % len(batches)])
        if mon is not None:
            mon.step()
        out.append(time.process_time() - c0)
    return out


def bench(w: Workload, repeats: int, chunk: int, writer: Any) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    batches = [w.batch(g) for _ in range(4)]
    torch.manual_seed(0)
    model = w.build()
    opt = w.optimizer(model)
    n_tensors = sum(1 for p in model.parameters() if p.requires_grad)
    every = CONFIGS["watch"].detail_every
    mem_every = CONFIGS["watch"].memory_every
    # per variant and kind of step (0 ordinary, 1 detail, 2 detail + memory sample): CPU seconds
    kinds: dict[str, tuple[list[float], list[float], list[float]]] = {v: ([], [], []) for v in VARIANTS}
    with quiet():
        _block(w, model, opt, batches, 5)  # warm-up
        for v in VARIANTS[1:]:
            with td.watch(model, opt, run=writer, config=CONFIGS[v]) as mon:
                _block(w, model, opt, batches, 5, mon)
        for _ in range(repeats):
            for v in VARIANTS:
                if v == "plain":
                    t = _block(w, model, opt, batches, chunk)
                else:
                    with td.watch(model, opt, run=writer, config=CONFIGS[v]) as mon:
                        t = _block(w, model, opt, batches, chunk, mon)
                for j, x in enumerate(t):
                    kinds[v][_kind(j, every, mem_every)].append(x)
    weights = (1 - 1 / every, 1 / every - 1 / mem_every, 1 / mem_every)  # as often as they occur
    med = {
        # a kind a short block never shows (detail without memory) counts as the next dearer kind
        v: sum(statistics.median(k[i] or k[2] or k[0]) * weights[i] for i in range(3))
        for v, k in kinds.items()
    }
    plain = med["plain"]
    ordinary, detail = kinds["watch"][0], kinds["watch"][1] + kinds["watch"][2]
    return {
        "workload": w.name,
        "tensors": n_tensors,
        "ms": {v: med[v] * 1e3 for v in VARIANTS},
        "ratio": {v: med[v] / plain for v in VARIANTS},
        "added_us": {v: (med[v] - plain) * 1e6 for v in VARIANTS},
        "ordinary_ratio": statistics.median(ordinary) / plain,
        "detail_ratio": statistics.median(detail) / plain,
        "reads": count_reads(w, model, opt, batches, writer),
        "calls": count_calls(w, model, opt, batches, writer),
    }


def _kind(j: int, every: int, mem_every: int) -> int:
    """Step j of a session: 0 ordinary, 1 a detail step, 2 a detail step with a memory sample."""
    return 2 if j % mem_every == 0 else (1 if j % every == 0 else 0)


def count_reads(w: Workload, model: Any, opt: Any, batches: list, writer: Any) -> dict[str, int]:
    """torchdebug's blocking reads on an ordinary step (step 1) and a detail step (step 10), default watch."""
    every = CONFIGS["watch"].detail_every
    got: dict[str, int] = {}
    with quiet(), td.watch(model, opt, run=writer, config=CONFIGS["watch"]) as mon:
        for i in range(every + 1):
            with HostReads() as reads:
                train_step(w, model, opt, batches[i % len(batches)])
                mon.step()
            if i == 1:
                got["ordinary"] = reads.count
            if i == every:
                got["detail"] = reads.count
    return got


def count_calls(w: Workload, model: Any, opt: Any, batches: list, writer: Any) -> dict[str, int]:
    """Function calls torchdebug makes on an ordinary and a detail step of the default watch: Python
    frames of torchdebug's code plus the C functions those frames call (``sys.setprofile`` events).
    Deterministic, unlike time on a shared machine: it says whether host work grows with the model."""
    every = CONFIGS["watch"].detail_every
    got: dict[str, int] = {}
    n = 0

    def prof(frame: Any, event: str, arg: Any) -> None:
        nonlocal n
        if event in ("call", "c_call") and str(frame.f_globals.get("__name__", "")).startswith("torchdebug"):
            n += 1

    with quiet(), td.watch(model, opt, run=writer, config=CONFIGS["watch"]) as mon:
        for i in range(every + 1):
            n = 0
            sys.setprofile(prof)
            try:
                train_step(w, model, opt, batches[i % len(batches)])
                mon.step()
            finally:
                sys.setprofile(None)
            if i == 1:
                got["ordinary"] = n
            if i == every:
                got["detail"] = n
    return got


BOUNDARIES = (
    "forward_started",
    "forward_done",
    "backward_started",
    "backward_done",
    "clip_starting",
    "clip_done",
    "update_starting",
    "update_done",
    "step",
)


def boundaries(w: Workload, repeats: int, chunk: int, writer: Any) -> str:
    """torchdebug's CPU time per step inside each step-protocol method (see the module docstring)."""
    import collections

    from torchdebug.session import monitor

    acc: collections.Counter[str] = collections.Counter()
    originals = {n: getattr(monitor.Monitor, n) for n in BOUNDARIES}

    def timed(name: str, orig: Any) -> Any:
        def method(*a: Any, **k: Any) -> Any:
            t = time.process_time()
            try:
                return orig(*a, **k)
            finally:
                acc[name] += time.process_time() - t

        return method

    g = torch.Generator().manual_seed(0)
    batches = [w.batch(g) for _ in range(4)]
    torch.manual_seed(0)
    model = w.build()
    opt = w.optimizer(model)
    per: dict[str, list[dict[str, float]]] = {"sentinel": [], "watch": []}
    try:
        for n, orig in originals.items():
            setattr(monitor.Monitor, n, timed(n, orig))
        with quiet():
            for rep in range(repeats):
                for v in list(per) if rep % 2 == 0 else list(reversed(per)):
                    with td.watch(model, opt, run=writer, config=CONFIGS[v]) as mon:
                        _block(w, model, opt, batches, 2, mon)
                        acc.clear()
                        _block(w, model, opt, batches, chunk, mon)
                        per[v].append({k: x / chunk for k, x in acc.items()})
    finally:
        for n, orig in originals.items():
            setattr(monitor.Monitor, n, orig)
    n_tensors = sum(1 for p in model.parameters() if p.requires_grad)
    lines = [f"{w.name} ({n_tensors} parameter tensors): torchdebug's own CPU us per step (medians)"]
    for v, rows in per.items():
        parts = {n: statistics.median([r.get(n, 0.0) for r in rows]) * 1e6 for n in BOUNDARIES}
        own = sum(parts.values())
        detail = ", ".join(f"{n} {x:.0f}" for n, x in parts.items() if x >= 1)
        lines.append(f"  {v:<9} {own:8.0f} us ({own / n_tensors:.2f} us/tensor): {detail}")
    return "\n".join(lines)


def rss_run(steps: int, writer: Any) -> None:
    import psutil

    w = WORKLOADS["many5000"]
    g = torch.Generator().manual_seed(0)
    batches = [w.batch(g) for _ in range(4)]
    torch.manual_seed(0)
    model = w.build()
    opt = w.optimizer(model)
    proc = psutil.Process()
    every = max(steps // 20, 1)
    samples: list[tuple[int, int]] = []
    with quiet(), td.watch(model, opt, run=writer, config=CONFIGS["watch"]) as mon:
        for i in range(steps):
            train_step(w, model, opt, batches[i % len(batches)])
            mon.step()
            if (i + 1) % every == 0:
                samples.append((i + 1, proc.memory_info().rss))
                print(f"  step {i + 1:6d}  rss {samples[-1][1] / 2**20:8.1f} MiB", flush=True)
    warm = next((s for s in samples if s[0] >= steps // 10), samples[0])
    last = samples[-1]
    grow = last[1] - warm[1]
    per = grow / max(last[0] - warm[0], 1)
    print(
        f"many5000, {steps} steps: RSS {warm[1] / 2**20:.1f} MiB at step {warm[0]} -> "
        f"{last[1] / 2**20:.1f} MiB at step {last[0]}: {grow / 2**20:+.1f} MiB ({per / 1024:+.2f} KiB/step)"
    )


def table(r: dict[str, Any]) -> str:
    lines = [
        f"{r['workload']} ({r['tensors']} parameter tensors)",
        "| variant | CPU ms/step | ratio | added us/step | added us/tensor |",
        "|---|---|---|---|---|",
    ]
    for v in VARIANTS:
        added = r["added_us"][v]
        lines.append(
            f"| {v} | {r['ms'][v]:.3f} | {r['ratio'][v]:.3f}x | "
            + ("-" if v == "plain" else f"{added:+.0f}")
            + " | "
            + ("-" if v == "plain" else f"{added / r['tensors']:+.2f}")
            + " |"
        )
    lines.append(
        f"watch: ordinary steps {r['ordinary_ratio']:.3f}x, detail steps {r['detail_ratio']:.3f}x (medians); "
        f"torchdebug's blocking reads: {r['reads'].get('ordinary')} on an ordinary step, "
        f"{r['reads'].get('detail')} on a detail step; torchdebug's function calls (Python frames and "
        f"the C calls they make): {r['calls'].get('ordinary')} on an ordinary step, "
        f"{r['calls'].get('detail')} on a detail step"
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 repeat, 50-step blocks, mlp4 + gpt2")
    ap.add_argument("--only", default="gpt2,deep_mlp,mlp4")
    ap.add_argument("--many", action="store_true", help="also the 5,000-tensor model")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--chunk", type=int, default=10, help="steps per block")
    ap.add_argument("--rss", type=int, default=0, help="RSS over this many steps of the 5,000-tensor model")
    ap.add_argument("--boundaries", action="store_true", help="torchdebug's CPU time per boundary instead")
    args = ap.parse_args()
    torch.set_num_threads(1)
    names = [n for n in args.only.split(",") if n]
    if args.quick:
        args.repeats, args.chunk, names = 2, 10, ["mlp4", "gpt2"]
    if args.many:
        names.append("many5000")
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")
    load = os.getloadavg()
    print(
        f"torch {torch.__version__}, Python {sys.version.split()[0]}, 1 thread, "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, {args.repeats} repeats x {args.chunk} steps"
    )
    with tempfile.TemporaryDirectory() as tmp:
        writer = create_run(root=tmp, name="host_cost", config={})
        try:
            for n in names:
                repeats = args.repeats if n != "many5000" else max(args.repeats // 4, 2)
                if args.boundaries:
                    print(boundaries(WORKLOADS[n], repeats, args.chunk, writer), flush=True)
                    continue
                print(table(bench(WORKLOADS[n], repeats, args.chunk, writer)), flush=True)
                print()
            if args.rss:
                rss_run(args.rss, writer)
        finally:
            writer.close()


if __name__ == "__main__":
    main()

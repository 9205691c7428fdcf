"""What users pay for the default ``watch``, run store included, in CPU time and store bytes.

Per workload, blocks of ``--steps`` steps alternate between ``plain`` (no torchdebug) and ``watch``
(the default ``torchdebug.watch``, a fresh run folder per block, as users get it); each watched
block ends with ``writer.flush()`` inside the timing, so the commits of its steps are counted (the
session's ``__exit__`` is not: it closes the run once per run, not per step). Printed per variant:

- block mean: process CPU (every thread) per step over whole blocks, every step and commit counted;
- median: the median step's process CPU (what the older figures quoted; drops the commit steps);
- main thread: the training thread's own CPU per step (``time.thread_time``): what a GPU loop's
  host thread pays, since the writer thread runs beside it (and takes the GIL while in Python);
- writer thread: the store's thread CPU per step (its CPU clock), also as a share of the plain step;
- store bytes per step: the rank database's size after the run is closed, less that of a 10-step
  run (the empty tables' pages), over the steps between (SQLite grows in 4 KiB pages: use long blocks).

Workloads: ``tests/fixtures/launch_models.py`` (``gpt2``, ``deep_mlp``, ``mlp4``), ``many2000``
(2,000 parameter tensors) and ``mlp_heavy`` (MLP 784-1024-1024-10, batch 128: compute-heavier).
One torch thread. On a shared machine process CPU still moves with other processes' load (caches,
frequency): the spread of the plain block means (min-max over blocks) is printed as the noise.

    python benchmarks/store_cost.py [--only gpt2,deep_mlp,mlp4,many2000,mlp_heavy] [--blocks 5] [--steps 50]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fixtures.launch_models import WORKLOADS, Workload, many_tensors, train_step

import torchdebug as td


def _heavy() -> nn.Module:
    return nn.Sequential(
        nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


def _heavy_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(128, 784, generator=g), torch.randint(0, 10, (128,), generator=g)


EXTRA = {
    "many2000": Workload(
        "many2000", lambda: many_tensors(2000), WORKLOADS["many5000"].batch, F.cross_entropy
    ),
    "mlp_heavy": Workload("mlp_heavy", _heavy, _heavy_batch, F.cross_entropy),
}


def _thread_cpu(thread: Any) -> float:
    """CPU seconds of a live thread (Linux: its CPU-time clock); 0.0 when it cannot be read."""
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (AttributeError, OSError, TypeError):
        return 0.0


def _block(w: Workload, model: Any, opt: Any, batches: list, steps: int, root: str | None) -> dict[str, Any]:
    per_step: list[float] = []
    if root is None:
        p0, m0 = time.process_time(), time.thread_time()
        for i in range(steps):
            c = time.process_time()
            train_step(w, model, opt, batches[i % len(batches)])
            per_step.append(time.process_time() - c)
        return {
            "proc": time.process_time() - p0,
            "main": time.thread_time() - m0,
            "writer": 0.0,
            "steps": per_step,
        }
    with td.watch(model, opt, run=root) as mon:
        writer = mon.writer
        thread = writer._core.thread
        writer.flush()  # the session's start written before the timing
        p0, m0, t0 = time.process_time(), time.thread_time(), _thread_cpu(thread)
        for i in range(steps):
            c = time.process_time()
            train_step(w, model, opt, batches[i % len(batches)])
            mon.step()
            per_step.append(time.process_time() - c)
        writer.flush()  # the block's records committed inside the timing
        out = {
            "proc": time.process_time() - p0,
            "main": time.thread_time() - m0,
            "writer": _thread_cpu(thread) - t0,
            "steps": per_step,
        }
        db = Path(writer.db_path)
    out["db"] = db  # measured after close (the WAL checkpointed into the file)
    return out


def bench(w: Workload, blocks: int, steps: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    batches = [w.batch(g) for _ in range(4)]
    torch.manual_seed(0)
    model = w.build()
    opt = w.optimizer(model)
    tensors = sum(1 for p in model.parameters() if p.requires_grad)
    got: dict[str, list[dict[str, Any]]] = {"plain": [], "watch": []}
    sizes = []
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _block(w, model, opt, batches, 5, None)  # warm-up
        _block(w, model, opt, batches, 5, tmp)
        short = _block(w, model, opt, batches, 10, tmp)  # the fixed size of a run folder, subtracted
        for _ in range(blocks):
            for v in ("plain", "watch"):
                r = _block(w, model, opt, batches, steps, tmp if v == "watch" else None)
                got[v].append(r)
                if v == "watch":
                    sizes.append((r["db"].stat().st_size - short["db"].stat().st_size) / (steps - 10))
    out: dict[str, Any] = {"workload": w.name, "tensors": tensors}
    for v, rs in got.items():
        n = steps * len(rs)
        out[v] = {
            "mean": sum(r["proc"] for r in rs) / n,
            "median": statistics.median(x for r in rs for x in r["steps"]),
            "main": sum(r["main"] for r in rs) / n,
            "writer": sum(r["writer"] for r in rs) / n,
            "blocks": [r["proc"] / steps for r in rs],
        }
    out["bytes"] = statistics.median(sizes)
    return out


def table(r: dict[str, Any]) -> str:
    p, wt = r["plain"], r["watch"]
    lo, hi = min(p["blocks"]), max(p["blocks"])
    return "\n".join(
        [
            f"{r['workload']} ({r['tensors']} parameter tensors)",
            "| variant | block mean ms/step | ratio | median ms/step | ratio | main thread ms/step | ratio "
            "| writer thread ms/step (of plain) | store bytes/step |",
            "|---|---|---|---|---|---|---|---|---|",
            f"| plain | {p['mean'] * 1e3:.3f} | 1.000x | {p['median'] * 1e3:.3f} | 1.000x | "
            f"{p['main'] * 1e3:.3f} | 1.000x | - | - |",
            f"| watch (store on) | {wt['mean'] * 1e3:.3f} | {wt['mean'] / p['mean']:.3f}x | "
            f"{wt['median'] * 1e3:.3f} | {wt['median'] / p['median']:.3f}x | {wt['main'] * 1e3:.3f} | "
            f"{wt['main'] / p['main']:.3f}x | {wt['writer'] * 1e3:.3f} ({wt['writer'] / p['mean']:.1%}) | "
            f"{r['bytes']:,.0f} |",
            f"noise: plain block means {lo * 1e3:.3f}-{hi * 1e3:.3f} ms/step ({(hi - lo) / p['mean']:.1%} spread)",
        ]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="gpt2,deep_mlp,mlp4,many2000,mlp_heavy")
    ap.add_argument("--blocks", type=int, default=5, help="blocks per variant, interleaved")
    ap.add_argument("--steps", type=int, default=60, help="steps per block (one session per watched block)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    everything = {**WORKLOADS, **EXTRA}
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in everything]
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; choose from {', '.join(everything)}")
    load = os.getloadavg()
    print(
        f"torch {torch.__version__}, Python {sys.version.split()[0]}, 1 torch thread, {os.cpu_count()} CPUs, "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {args.blocks} blocks x {args.steps} steps"
    )
    for n in names:
        print(table(bench(everything[n], args.blocks, args.steps)), "\n", flush=True)
    load = os.getloadavg()
    print(f"load average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()

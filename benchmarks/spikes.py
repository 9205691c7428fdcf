"""Cost of loss-spike forensics and rollback snapshots against a plain training step, in the same run.

Workloads: the overhead benchmark's MLP, GPT and CNN (benchmarks/overhead.py), trained with AdamW
(its state is two tensors per parameter, the snapshot's largest part). Measured as process CPU time
with one thread (``torch.set_num_threads(1)``, ``time.process_time``), blocks interleaved, medians:

- plain: a step without torchdebug (the mean step of each block: a snapshot step counts in it);
- snapshot: one ``SnapshotRing.take`` (parameters, buffers, optimizer state, RNG) into reused host
  buffers, and its size; its cost per step at ``snapshot_every`` = 1, 10, 50 (the default), 100 is
  that time / interval / the plain step;
- watch(on_spike="off" | "warn" | "rollback"): the session with the spike guard off, watching
  (forensics run only on a spike), and rolling back (snapshots every 50 steps); the ratio of each to
  plain, and warn/rollback against off (the guard's own cost).

    python benchmarks/spikes.py [--repeats 5] [--chunk 50] [--only mlp,gpt,cnn] [--snapshot-only]

``--snapshot-only``: the plain step and the snapshot only (the watch variants need chunks of at least
``snapshot_every`` steps to count the snapshots fairly, long on the bigger workloads).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from overhead import run_chunk, workloads

import torchdebug as td
from torchdebug.session.rollback import SnapshotRing

INTERVALS = (1, 10, 50, 100)


def steps(model: Any, opt: Any, batches: list, loss_fn: Any, n: int, mon: Any = None) -> list[float]:
    """Each step's process CPU time (the overhead benchmark's loop)."""
    cpu: list[float] = []
    run_chunk(model, opt, batches, loss_fn, n, "cpu", mon, cpu=cpu)
    return cpu


def bench(name: str, spec: tuple, args: argparse.Namespace) -> None:
    make, batch, loss_fn = spec
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = [batch() for _ in range(8)]
    steps(model, opt, batches, loss_fn, 3)  # warm-up: the optimizer's state exists

    class _Mon:  # what SnapshotRing reads of a session
        def __init__(self) -> None:
            self.model, self.optimizer, self.scaler, self._uses_cuda = model, opt, None, False

    ring, fake = SnapshotRing(), _Mon()
    ring.take(fake, 0)
    ring.take(fake, 1)  # both slots allocated: later takes reuse the oldest slot's buffers
    plain: list[float] = []
    snap: list[float] = []
    variants: dict[str, list[float]] = {"off": [], "warn": [], "rollback": []}
    base = {"run": False, "config": {"log_performance": False, "log_memory": False}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(args.repeats):
            plain.append(statistics.mean(steps(model, opt, batches, loss_fn, args.chunk)))
            for _ in range(5):
                c0 = time.process_time()
                ring.take(fake, 2)
                snap.append(time.process_time() - c0)
            for mode, got in variants.items() if not args.snapshot_only else ():
                cfg = {**base["config"], "on_spike": mode, "snapshot_every": 50}
                with td.watch(model, opt, run=False, config=cfg) as mon:
                    got.append(statistics.mean(steps(model, opt, batches, loss_fn, args.chunk, mon)))
    p, s = statistics.median(plain), statistics.median(snap)
    nbytes = ring.slots[-1].nbytes
    print(f"{name}: plain step {p * 1e3:.2f} ms; one snapshot {s * 1e3:.2f} ms, {nbytes / 2**20:.1f} MiB")
    print("  snapshot cost per step: " + ", ".join(f"every {n}: {100 * s / n / p:.2f}%" for n in INTERVALS))
    if args.snapshot_only:
        return
    off = statistics.median(variants["off"])
    for mode, got in variants.items():
        m = statistics.median(got)
        extra = "" if mode == "off" else f", vs off {m / off:.3f}x"
        print(f"  watch on_spike={mode}: {m * 1e3:.2f} ms/step, {m / p:.3f}x plain{extra}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=50)
    ap.add_argument("--only", default="mlp,gpt,cnn")
    ap.add_argument("--snapshot-only", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for name, spec in workloads("cpu").items():
        if name in args.only.split(","):
            bench(name, spec, args)


if __name__ == "__main__":
    main()

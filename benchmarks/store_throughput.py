"""Run store throughput: rows/s from log_scalar to committed, and the training-thread cost per call.

Usage: python benchmarks/store_throughput.py [--rows 400000] [--calls 200000] [--points 1000000]
Targets: >= 50,000 rows/s end to end, < 20 µs per log_scalar call. Also times reading one metric
of --points points, in full and downsampled to 1000 points (min/max per bucket, in SQL).
"""

from __future__ import annotations

import argparse
import platform
import sqlite3
import tempfile
import time

from torchdebug.store import create_run, open_run

METRICS = ("loss", "grad_norm", "lr", "scale", "step_time", "tokens_per_s", "gpu_mem", "acc")


def end_to_end(root: str, rows: int) -> tuple[float, int]:
    """Log ``rows`` metric values (8 per step) and flush; returns (rows/s, rows found by a reader)."""
    w = create_run(root=root, name="bench-e2e", max_queue=rows + 1)
    t0 = time.perf_counter()
    steps = rows // len(METRICS)
    for step in range(steps):
        for i, name in enumerate(METRICS):
            w.log_scalar(name, step, step * 0.001 + i)
    w.flush()  # everything committed when this returns
    elapsed = time.perf_counter() - t0
    w.close()
    with open_run(w.path) as run:
        found = sum(len(run.series(m)) for m in run.metric_names())
    return steps * len(METRICS) / elapsed, found


def per_call(root: str, calls: int) -> tuple[float, float, int]:
    """Mean and p99 cost of one log_scalar on the calling thread, with the writer thread running.

    Also returns how many samples the bounded queue dropped (logging faster than SQLite commits).
    """
    w = create_run(root=root, name="bench-call")
    samples = []
    batch = 1000
    for b in range(calls // batch):
        t0 = time.perf_counter()
        for i in range(batch):
            w.log_scalar("loss", b * batch + i, 0.5)
        samples.append((time.perf_counter() - t0) / batch)
    dropped = w.dropped
    w.close()
    samples.sort()
    mean = sum(samples) / len(samples)
    return mean * 1e6, samples[int(len(samples) * 0.99)] * 1e6, dropped


def read_series(root: str, points: int) -> tuple[float, float]:
    """Seconds to read one metric of ``points`` points in full, and downsampled to 1000 points."""
    w = create_run(root=root, name="bench-read", max_queue=points + 1)
    for step in range(points):
        w.log_scalar("loss", step, (step % 997) * 0.001)
    w.close()
    with open_run(w.path) as run:
        t0 = time.perf_counter()
        full = run.series("loss")
        t1 = time.perf_counter()
        small = run.series("loss", max_points=1000)
        t2 = time.perf_counter()
    assert len(full) == points and len(small) <= 1000
    return t1 - t0, t2 - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=400_000)
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--points", type=int, default=1_000_000)
    args = ap.parse_args()
    print(f"python {platform.python_version()}, sqlite {sqlite3.sqlite_version}, {platform.machine()}")
    with tempfile.TemporaryDirectory() as root:
        rate, found = end_to_end(root, args.rows)
        expected = args.rows // len(METRICS) * len(METRICS)
        assert found == expected, f"reader found {found} rows, expected {expected}"
        print(f"end to end (log_scalar -> committed): {rate:,.0f} rows/s  ({found:,} rows)  target >= 50,000")
        mean, p99, dropped = per_call(root, args.calls)
        print(
            f"log_scalar on the training thread: mean {mean:.2f} µs/call, "
            f"p99 of 1000-call batches {p99:.2f} µs  target < 20  (queue drops: {dropped:,})"
        )
        full, small = read_series(root, args.points)
        print(f"series() of {args.points:,} points: {full:.2f} s in full, {small:.2f} s downsampled to 1000")


if __name__ == "__main__":
    main()

"""CPU time of the command line and of ``import torchdebug``, against ``import torch``, each in a fresh process.

Usage: python benchmarks/cli_import.py [--repeats 7] [--runs 10]

Budgets: ``torchdebug runs`` on a folder of --runs runs <= 0.3 s CPU (it reads SQLite and JSON and
never imports torch); ``import torchdebug`` (and its first use, ``td.watch``) adds <= 0.3 s CPU to
``import torch``. CPU time is the child's user+system time (``resource.getrusage(RUSAGE_CHILDREN)``
around each run), so other processes on a shared machine do not count; every case runs --repeats
times, interleaved with the others, and the median is printed.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from torchdebug.store import create_run


def child_cpu(argv: list[str], env: dict[str, str]) -> float:
    """User+system CPU seconds of one child process running ``argv`` (it must exit 0)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def make_runs(root: Path, n: int) -> Path:
    """``n`` finished runs of 200 steps with 4 metrics each, written by the real store."""
    first = None
    for i in range(n):
        w = create_run(root=root, name=f"run{i}")
        for step in range(200):
            w.log_scalars(step, {"loss": 1.0 / (step + 1), "grad_norm": 0.5, "lr": 1e-3, "step_time": 0.01})
        w.close("finished")
        first = first or w.path
    assert first is not None
    return Path(first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    py = sys.executable
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "runs"
        run = make_runs(root, args.runs)
        cli = [py, "-m", "torchdebug"]
        cases = {
            "python -c pass": [py, "-c", "pass"],
            "import torch": [py, "-c", "import torch"],
            "import torch, torchdebug": [py, "-c", "import torch, torchdebug"],
            "import torch, torchdebug; td.watch": [py, "-c", "import torch, torchdebug as td; td.watch"],
            "torchdebug --help": [*cli, "--help"],
            f"torchdebug runs ({args.runs} runs)": [*cli, "runs", "--runs", str(root)],
            "torchdebug show RUN": [*cli, "show", str(run)],
            "torchdebug report RUN (text)": [*cli, "report", str(run)],
        }
        times: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(args.repeats):
            for name, argv in cases.items():  # interleaved: a burst of load hits every case alike
                times[name].append(child_cpu(argv, env))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} cpus; "
        f"median of {args.repeats} fresh processes, CPU seconds (user+system)"
    )
    print(f"{'case':<40} {'CPU s':>7} {'spread':>13}")
    for k, v in times.items():
        print(f"{k:<40} {med[k]:7.3f} {min(v):6.3f}-{max(v):.3f}")
    torch_s = med["import torch"]
    print()
    print(
        f"import torchdebug adds          {med['import torch, torchdebug'] - torch_s:+.3f} s to import torch (budget 0.3)"
    )
    print(
        f"... and its first use (watch)  {med['import torch, torchdebug; td.watch'] - torch_s:+.3f} s (budget 0.3)"
    )
    print(f"torchdebug runs                 {med[f'torchdebug runs ({args.runs} runs)']:.3f} s (budget 0.3)")


if __name__ == "__main__":
    main()

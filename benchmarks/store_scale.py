"""Week-long runs: the size of a long run folder and how fast every reader opens it.

Writes a synthetic run of N steps through the real writer at the default level's record mix (per
step: 5 metrics and a 6-phase timing; every 10th step 13 more metrics; every 50th a memory sample;
an event every 10,000 steps, 3 anomalies, and loss spikes with no event near them), checks the
report's numbers against what was logged and that every spike is still on the loss chart, then
times each reader in fresh processes (the median of 3: wall time, CPU time, peak RSS): ``show``,
the JSON / text / HTML reports, a cold dashboard ``/views``, and ``runs`` over 500 run folders.

    python benchmarks/store_scale.py            # 1,000,000 steps (make bench)
    python benchmarks/store_scale.py --steps 100000
    python benchmarks/store_scale.py --run /tmp/week-...   # time the readers of a run written before
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DETAIL = [f"grad_norm/{i}.weight" for i in range(4)] + [f"update_ratio/{i}.weight" for i in range(4)]
DETAIL += [f"weight_norm/{i}.weight" for i in range(4)] + ["throughput/samples_per_s"]


def spikes(steps: int) -> list[int]:
    """Steps whose loss is 1000 (no event near them: only the rollups can keep them)."""
    return [
        s for s in (steps // 7 + 3, steps // 3 + 5, steps // 2 + 11, steps - 3 * steps // 10) if s < steps
    ]


def write_run(root: Path, steps: int) -> Path:
    from torchdebug.store import create_run

    w = create_run(root=root, name="week", config={"level": "intermediate"})
    spike = set(spikes(steps))
    events = set(range(5_000, steps, 10_000))
    anomalies = {steps // 4, steps // 2, steps - 100}
    for s in range(steps):
        loss = 1000.0 if s in spike else 2.0 / (1 + s * 1e-4) + 0.01 * math.sin(s)
        w.log_scalars(
            s, {"loss": loss, "grad_nonfinite": 0.0, "grad_norm": 1.0, "skipped": 0.0, "lr/0": 1e-3}
        )
        w.log_timing(
            s,
            {
                "data": 1e-3,
                "forward": 2e-3,
                "backward": 4e-3,
                "optimizer": 1e-3,
                "other": 1e-4,
                "step": 8.1e-3,
            },
        )
        if s % 10 == 0:
            w.log_scalars(s, {k: 0.5 for k in DETAIL})
        if s % 50 == 0:
            w.log_memory(s, {"rss": 2**30 + s, "heap_in_use": 2**29})
        if s in events:
            w.log_event(s, "slowdown", "warning", "steps got slower", {"evidence": {"ratio": 1.6}})
        if s in anomalies:
            w.log_anomaly(s, {"phase": "forward", "module": "fc", "kind": "nan", "step": s})
        if s % 2_000 == 0:
            w.flush()  # a tight loop would outrun the writer and drop low-priority records
    w.close()
    assert w.dropped == 0, w.dropped
    return w.path


_READERS = {
    "show": "from torchdebug.cli import main; main(['show', RUN])",
    "report json": "from torchdebug.cli import main; main(['report', RUN, '--format', 'json', '-o', OUT + '.json'])",
    "report text": "from torchdebug.cli import main; main(['report', RUN, '--format', 'text', '-o', OUT + '.txt'])",
    "report html": "from torchdebug.cli import main; main(['report', RUN, '--format', 'html', '-o', OUT + '.html'])",
    "dashboard /views (cold)": (
        "from fastapi.testclient import TestClient; from torchdebug.views.server import create_app; "
        "import pathlib; p = pathlib.Path(RUN); "
        "c = TestClient(create_app(p.parent, warm=0), base_url='http://127.0.0.1'); "
        "import time; t, c0 = time.perf_counter(), time.process_time(); "
        "r = c.get(f'/api/runs/{p.name}/views'); assert r.status_code == 200, r.text[:200]; "
        "T, C = time.perf_counter() - t, time.process_time() - c0"
    ),
    "runs (500 folders)": "from torchdebug.cli import main; main(['runs', ROOT500])",
}

_PROBE = """
import resource, sys, time, io, contextlib
RUN, OUT, ROOT500 = sys.argv[1], sys.argv[2], sys.argv[3]
import torchdebug.store  # the import is not the reader's time
T = C = None
t0, c0 = time.perf_counter(), time.process_time()
with contextlib.redirect_stdout(io.StringIO()):
    exec(sys.argv[4])
wall = T if T is not None else time.perf_counter() - t0
cpu = C if C is not None else time.process_time() - c0
print(wall, cpu, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def _env() -> dict[str, str]:
    """The probes' environment: bytecode caches allowed, as in an installed package (with
    PYTHONDONTWRITEBYTECODE every probe would compile torchdebug's sources again, ~0.3 s)."""
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def time_reader(code: str, run: Path, out: str, root500: Path, repeat: int = 3) -> tuple[float, float, int]:
    """Median wall time, median CPU time and peak RSS of ``repeat`` fresh processes running ``code``
    (on a shared machine the wall time waits for a core; the CPU time does not)."""
    walls, cpus, rss = [], [], 0
    for _ in range(repeat):
        done = subprocess.run(
            [sys.executable, "-c", _PROBE, str(run), out, str(root500), code],
            capture_output=True,
            text=True,
            check=True,
            env=_env(),
        )
        wall, cpu, peak = done.stdout.split()[-3:]
        walls.append(float(wall))
        cpus.append(float(cpu))
        rss = max(rss, int(peak))
    return statistics.median(walls), statistics.median(cpus), rss


def warm_bytecode() -> None:
    """Import every reader once so later probes load cached bytecode, as an installed package does."""
    code = "import torchdebug.cli, torchdebug.views.report, torchdebug.views.server, torchdebug.sinks"
    subprocess.run([sys.executable, "-c", code], check=True, env=_env())


def five_hundred(root: Path, template: Path) -> Path:
    """500 closed run folders (copies of one small run: `runs` reads each folder's summary)."""
    many = root / "many"
    many.mkdir()
    for i in range(500):
        dst = many / f"run-{i:03d}"
        shutil.copytree(template, dst)
    return many


def check_report(run: Path, steps: int) -> None:
    """The report's numbers over the compacted run against what write_run logged."""
    from torchdebug.store import open_run
    from torchdebug.views.report import build_report

    with open_run(run) as r:
        chart = r.series("loss", max_points=2000)
        missing = [s for s in spikes(steps) if s not in chart.steps]
        print(f"loss chart: {len(chart)} points, every spike kept: {not missing} {missing or ''}")
        rep = build_report(r)
    perf, loss = rep["performance_analysis"], rep["metrics"]["loss"]
    print(
        f"report: {rep['summary']['total_debug_operations']:,} steps, {perf['timed_steps']:,} timed, "
        f"mean step {perf['average_execution_time'] * 1e3:.4f} ms (logged 8.1), loss points "
        f"{loss['points']:,}, loss max {loss['max']:g}, {len(rep['anomalies'])} anomalies, "
        f"{len(rep['events'])} events, memory samples {rep['memory_analysis']['samples']:,}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument(
        "--run", type=Path, help="time the readers on this run folder, written before by this script"
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.run is None:
            t = time.perf_counter()
            run = write_run(root / "big", args.steps)
            print(f"{args.steps:,} steps written in {time.perf_counter() - t:.1f} s")
        else:
            run = args.run
        size = sum(f.stat().st_size for f in run.iterdir())
        small = write_run(root / "small", 200)
        root500 = five_hundred(root, small)
        print(f"run folder {size / 1e6:.1f} MB, {size / args.steps:.0f} bytes/step")
        check_report(run, args.steps)
        results = {}
        warm_bytecode()
        for name, code in _READERS.items():
            wall, cpu, rss = time_reader(code, run, str(root / "out"), root500)
            results[name] = (wall, cpu, rss)
            print(f"{name:26s} {wall:6.2f} s wall  {cpu:6.2f} s CPU  peak RSS {rss / 2**20:6.0f} MiB")
        print(json.dumps({"steps": args.steps, "bytes": size, "readers": results}))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()

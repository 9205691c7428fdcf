"""Dashboard/report speed on a big run: /api/runs/{id}/metrics latency and HTML report render time.

Builds a run of STEPS steps x METRICS metrics through the real store writer once (into a temp dir,
or --root to keep it), serves it with the real uvicorn server on a loopback port and times requests.

    python benchmarks/dashboard_api.py                 # 100k steps x 50 metrics (build takes ~1 min)
    python benchmarks/dashboard_api.py --steps 10000   # quicker
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path


def build_run(root: Path, steps: int, metrics: int) -> Path:
    """Write ``steps`` x ``metrics`` scalars plus memory and timing samples per step; returns the folder."""
    from torchdebug.store import create_run

    per_layer = max(0, (metrics - 4) // 2)
    w = create_run(
        root=root, name="big", config={"mode": "full_debug", "level": "basic"}, max_queue=10_000_000
    )
    names = [f"grad_norm/layers.{i}.weight" for i in range(per_layer)]
    names += [f"update_ratio/layers.{i}.weight" for i in range(metrics - 4 - per_layer)]
    for s in range(steps):
        v = {
            "loss": 2.0 / (1 + s / 1000) + 0.01 * math.sin(s),
            "grad_norm": 1.0 + (50.0 if s % 9973 == 0 else 0.0),
        }
        v["lr/0"] = 1e-3
        v["skipped"] = 0.0
        for i, n in enumerate(names):
            v[n] = (i + 1) * 1e-3 * (1 + 0.1 * math.cos(s + i))
        if s == steps // 2:
            v["loss"] = math.nan
        w.log_scalars(s, v)
        w.log_memory(s, {"rss": 500 * 2**20 + s, "cuda_allocated": 2**30})
        w.log_timing(
            s, {"data": 0.001, "forward": 0.002, "backward": 0.004, "optimizer": 0.001, "step": 0.008}
        )
    w.log_anomaly(
        steps // 2,
        {"phase": "forward", "module": "layers.3", "kind": "nan", "op": "aten.log", "step": steps // 2},
    )
    w.close()
    assert w.dropped == 0, f"{w.dropped} records dropped while building"
    return w.path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--metrics", type=int, default=50)
    ap.add_argument("--root", type=Path, help="keep the built run here (reused if present)")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    import httpx

    from torchdebug.views.report import render_report
    from torchdebug.views.server import serve

    tmp = tempfile.TemporaryDirectory()
    root = args.root or Path(tmp.name)
    existing = sorted(root.glob("big-*")) if root.exists() else []
    t0 = time.perf_counter()
    path = existing[-1] if existing else build_run(root, args.steps, args.metrics)
    print(
        f"run {path.name}: {args.steps} steps x {args.metrics} metrics, built/found in {time.perf_counter() - t0:.1f} s"
    )

    # warm=0: no background precompute, so the first request shows the cold cost (every metric read
    # from SQLite once); later requests only read steps newer than the cached ones.
    handle = serve(path.parent, host="127.0.0.1", port=0, warm=0)
    cold_ms: float | None = None
    try:
        with httpx.Client(base_url=handle.url, timeout=60) as c:
            rid = path.name
            for label, url in (
                ("metrics (all 50, default max_points)", f"/api/runs/{rid}/metrics"),
                ("metrics (loss,grad_norm)", f"/api/runs/{rid}/metrics?names=loss,grad_norm"),
                (
                    "metrics (since last 1000 steps)",
                    f"/api/runs/{rid}/metrics?since_step={args.steps - 1000}",
                ),
                ("views (dashboard redraw)", f"/api/runs/{rid}/views"),
            ):
                times = []
                for _ in range(args.repeat):
                    t = time.perf_counter()
                    r = c.get(url)
                    times.append(time.perf_counter() - t)
                    r.raise_for_status()
                if cold_ms is None:
                    cold_ms = times[0] * 1e3
                print(
                    f"GET {label:<40} first {times[0] * 1e3:7.1f} ms   median {statistics.median(times[1:] or times) * 1e3:7.1f} ms"
                    f"   ({len(r.content) / 1e3:.0f} kB)"
                )
    finally:
        handle.stop()
    from torchdebug.store import open_run

    with open_run(path) as run:
        how = "rollups" if run.has_rollups else "raw rows (database written before rollups)"
    print(
        f"COLD /metrics (first request, all metrics, server cache empty): {cold_ms:.1f} ms  target < 200 ms  [{how}]"
    )
    t = time.perf_counter()
    html = render_report(path, "html")
    print(f"HTML report: {time.perf_counter() - t:.2f} s ({len(html) / 1e6:.1f} MB)")
    tmp.cleanup()


if __name__ == "__main__":
    main()

"""What the views weigh: HTML report size and dashboard bytes on the wire, for the demo run and a long run.

Builds (into a temp dir, or --root to keep them) the demo run as ``torchdebug demo`` writes it
(policy "raise": stops at the bad step; policy "warn": every step after it is non-finite), and a
long synthetic run (--long-steps x 50 metrics through the real writer). For each: the report file's
bytes (and gzipped), anomaly records vs the groups the page shows; then serves them with the real
dashboard and counts the bytes a browser downloads (gzip accepted): the page, its chart script, a
live poll (steps after the last one) and, for comparison, the full views payload.

    python benchmarks/view_weight.py
    python benchmarks/view_weight.py --demo-steps 300 --long-steps 20000 --root /tmp/vw
    python benchmarks/view_weight.py --root /tmp/vw --reuse     # measure again without rebuilding
"""

from __future__ import annotations

import argparse
import gzip
import io
import sys
import tempfile
from pathlib import Path

REPORT_BUDGET = 1_000_000
PAGE_BUDGET = 1_500_000


def build_demo(root: Path, steps: int, policy: str) -> Path:
    from torchdebug.demo import run_demo
    from torchdebug.store import list_runs

    before = {i.path for i in list_runs(root)} if root.exists() else set()
    run_demo(steps=steps, bad_step=min(200, steps // 2), policy=policy, run_dir=str(root), out=io.StringIO())
    [new] = [i.path for i in list_runs(root) if i.path not in before]
    return Path(new)


def report_row(run: Path) -> tuple[int, int, int, int]:
    from torchdebug.store import open_run
    from torchdebug.views.report import render_report
    from torchdebug.views.verdict import group_anomalies

    html = render_report(run, "html")
    assert isinstance(html, str)
    raw = html.encode()
    with open_run(run) as r:
        anomalies = r.anomalies()
    return len(raw), len(gzip.compress(raw)), len(anomalies), len(group_anomalies(anomalies))


def wire_bytes(runs: dict[str, Path], root: Path) -> dict[str, dict[str, int]]:
    import httpx

    from torchdebug.views.server import serve

    out: dict[str, dict[str, int]] = {}
    with (
        serve(root, port=0) as h,
        httpx.Client(base_url=h.url, headers={"Accept-Encoding": "gzip"}, timeout=300) as c,
    ):
        for name, run in runs.items():
            page = c.get(f"/runs/{run.name}")
            script = c.get("/static/tdcharts.js")
            again = c.get("/static/tdcharts.js", headers={"If-None-Match": script.headers["etag"]})
            full = c.get(f"/api/runs/{run.name}/views")
            last = full.json()["last_step"]
            poll = c.get(
                f"/api/runs/{run.name}/views", params={"since_step": last, "frag": full.json()["frag"]}
            )
            out[name] = {
                "page": page.num_bytes_downloaded,
                "script": script.num_bytes_downloaded,
                "script_cached": again.status_code,
                "poll": poll.num_bytes_downloaded,
                "full_views": full.num_bytes_downloaded,
                "full_views_raw": len(full.content),
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=None, help="keep the runs here (default: a temp dir)")
    ap.add_argument("--demo-steps", type=int, default=300)
    ap.add_argument("--long-steps", type=int, default=20_000)
    ap.add_argument("--reuse", action="store_true", help="measure the runs already under --root")
    args = ap.parse_args()
    tmp = None
    if args.root is None:
        tmp = tempfile.TemporaryDirectory()
        args.root = Path(tmp.name)
    root: Path = args.root
    root.mkdir(parents=True, exist_ok=True)

    import warnings

    warnings.simplefilter("ignore")  # the demo's own warnings (NaN, slowdowns on a busy machine)
    from dashboard_api import build_run  # benchmarks/ is on sys.path when run as a script

    if args.reuse:  # oldest first: demo raise, demo warn, the long run
        demos = sorted(root.glob("demo-*"))
        runs = {"demo (raise)": demos[0], "demo (warn)": demos[1], "long run": next(root.glob("big-*"))}
    else:
        runs = {
            "demo (raise)": build_demo(root, args.demo_steps, "raise"),
            "demo (warn)": build_demo(root, args.demo_steps, "warn"),
            f"long ({args.long_steps} steps x 50 metrics)": build_run(root, args.long_steps, 50),
        }
    sys.stdout.reconfigure(line_buffering=True)
    print(f"{'run':<34} {'report':>10} {'gzipped':>9} {'anomalies':>9} {'cards':>6}")
    for name, run in runs.items():
        size, gz, n, groups = report_row(run)
        flag = "" if size <= REPORT_BUDGET else "  OVER BUDGET"
        print(f"{name:<34} {size / 1e3:>8.1f}KB {gz / 1e3:>7.1f}KB {n:>9} {groups:>6}{flag}")
    print(
        f"\nDashboard bytes on the wire (gzip), budget {PAGE_BUDGET / 1e6:.1f} MB for a page and its assets"
    )
    print(f"{'run':<34} {'page':>9} {'script':>9} {'total':>9} {'live poll':>10} {'full views':>11}")
    for name, w in wire_bytes(runs, root).items():
        total = w["page"] + w["script"]
        print(
            f"{name:<34} {w['page'] / 1e3:>7.1f}KB {w['script'] / 1e3:>7.1f}KB {total / 1e3:>7.1f}KB "
            f"{w['poll'] / 1e3:>8.1f}KB {w['full_views'] / 1e3:>9.1f}KB"
            + ("" if w["script_cached"] == 304 else "  (script not revalidated with 304!)")
        )
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()

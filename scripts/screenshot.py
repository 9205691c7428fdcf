"""Refresh docs/report.png: the HTML report of a real `torchdebug demo` run, shot in headless Chromium.

Usage: python scripts/screenshot.py [--out docs/report.png] [--width 1100] [--height 1420]
Needs the report and dev extras (plotly, playwright) and a Chromium (bash scripts/ensure_browser.sh,
or CHROMIUM=/path/to/chromium). The demo runs in a temporary folder; only the PNG is kept.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "report.png"))
    ap.add_argument("--width", type=int, default=1100)
    ap.add_argument(
        "--height",
        type=int,
        default=1420,
        help="the top of the page, in its order: the verdict, its anomaly card, the tiles, the first chart",
    )
    args = ap.parse_args()

    import torch
    from playwright.sync_api import sync_playwright

    import torchdebug as td
    from torchdebug.demo import run_demo

    torch.set_num_threads(1)  # the demo model is tiny: one thread, no spin-waiting on a busy machine
    chromium = os.environ.get("CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    with tempfile.TemporaryDirectory() as tmp:
        run_demo(run_dir=os.path.join(tmp, "runs"), out=io.StringIO())  # the README's demo, as is
        (run,) = td.list_runs(os.path.join(tmp, "runs"))
        html = Path(tmp) / "report.html"
        td.render_report(run.path, "html", path=html)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=ARGS)
            page = browser.new_page(viewport={"width": args.width, "height": args.height})
            page.goto(html.as_uri(), wait_until="load")
            page.wait_for_timeout(500)  # the charts draw after load
            page.screenshot(path=args.out, full_page=False)
            browser.close()
    print(f"wrote {args.out} ({Path(args.out).stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()

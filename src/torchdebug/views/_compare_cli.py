"""``torchdebug compare RUN_A RUN_B`` (registered by cli.py): text, JSON or a self-contained HTML page."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``compare`` subcommand (cheap: the store is opened when it runs)."""
    from ..cli import add_runs_option

    p = subparsers.add_parser(
        "compare",
        help="compare two runs: verdicts, where they part, config and environment, charts overlaid",
        description=(
            "Compare two stored runs: both verdicts, the first step where their losses or gradient "
            "norms part beyond noise, the first step each learning rate differs, the watch() options "
            "and environment that differ. -o FILE.html writes the charts overlaid."
        ),
    )
    p.add_argument("run_a", metavar="RUN_A", help="run folder, or a run name looked up under --runs")
    p.add_argument("run_b", metavar="RUN_B", help="run folder, or a run name looked up under --runs")
    add_runs_option(p, what="where to look the runs up by name")
    p.add_argument("-o", "--output", metavar="FILE", help="write to FILE (.html: the page; .json; else text)")
    p.add_argument("--format", choices=("text", "json", "html"), help="default: FILE's suffix, else text")
    p.set_defaults(func=_compare)


def _compare(args: argparse.Namespace) -> int:
    from ..cli import default_runs_dir
    from ..store import open_run, resolve_run
    from .compare import compare_runs, render_compare_html, render_compare_text
    from .report._format import json_safe

    fmt = args.format
    if fmt is None:
        suffix = Path(args.output).suffix.lower() if args.output else ""
        fmt = {".html": "html", ".htm": "html", ".json": "json"}.get(suffix, "text")
    root = args.runs or default_runs_dir()
    with open_run(resolve_run(args.run_a, root)) as a, open_run(resolve_run(args.run_b, root)) as b:
        c = compare_runs(a, b)
    if fmt == "html":
        out = render_compare_html(c)
    elif fmt == "json":
        c = {k: v for k, v in c.items() if k != "series"}
        out = json.dumps(json_safe(c), indent=2, sort_keys=True, allow_nan=False) + "\n"
    else:
        out = render_compare_text(c)
    if args.output:
        Path(args.output).write_text(out, encoding="utf-8")
        print(f"wrote {fmt} comparison to {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(out)
    return 0

"""``torchdebug report RUN`` (registered by cli.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_FORMATS = ("text", "json", "html", "png")
_SUFFIX = {".txt": "text", ".json": "json", ".html": "html", ".htm": "html", ".png": "png"}


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``report`` subcommand (cheap: heavy imports happen when it runs)."""
    p = subparsers.add_parser(
        "report",
        help="write a report of a run (text, json, self-contained html, png)",
        description="Write a report of a stored run. The format defaults to the output file's suffix, else text.",
    )
    from ...cli import add_runs_option, int_in_range

    p.add_argument("run", help="run folder (runs/demo-20250101-120000), or a run name looked up under --runs")
    add_runs_option(p, what="where to look RUN up by name")
    p.add_argument("--rank", type=int_in_range(0), default=None, help="which rank's database (default 0)")
    p.add_argument(
        "-o", "--output", metavar="FILE", help="write to FILE instead of stdout (png needs a file)"
    )
    p.add_argument(
        "--format", choices=_FORMATS, help="text | json | html | png (default: from FILE's suffix, else text)"
    )
    p.set_defaults(func=_report)


def _resolve(args: argparse.Namespace) -> Path:
    from ...cli import default_runs_dir
    from ...store import resolve_run

    return resolve_run(args.run, args.runs or default_runs_dir())


def _report(args: argparse.Namespace) -> int:
    from ...store import open_run
    from . import render_report

    fmt = args.format
    if fmt is None and args.output:
        suffix = Path(args.output).suffix.lower()
        fmt = _SUFFIX.get(suffix, "text" if not suffix else None)
        if fmt is None:  # a .pdf written as text would be a file no PDF reader opens
            print(
                f"torchdebug: error: no report format writes {suffix} files ({args.output}): name it "
                ".txt, .json, .html or .png, or add --format; for a PDF, open the HTML report in a "
                "browser and print it",
                file=sys.stderr,
            )
            return 2  # a usage error: a bad value, nothing written
    fmt = fmt or "text"
    if fmt == "png" and not args.output:
        raise ValueError("a PNG report needs an output file: add -o debug_analysis.png")
    with open_run(_resolve(args), rank=args.rank) as run:
        out = render_report(run, fmt, path=args.output)
    if args.output:
        print(f"wrote {fmt} report to {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(out if isinstance(out, str) else "")
    return 0

"""The ``torchdebug run`` subcommand; cheap to register (torch is imported when it runs)."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "run",
        help="run an unmodified training script under watch (finds its model and optimizer)",
        description=(
            "Run SCRIPT as `python SCRIPT ARGS...` with the NaN/Inf sentinel on: the model is the module "
            "owning the parameters of the first torch.optim optimizer the script creates; a step ends "
            "after each step of that optimizer. Prints the origin of the first NaN/Inf and the run folder."
        ),
    )
    p.add_argument("--policy", default="raise", choices=("raise", "warn", "skip"))
    p.add_argument("--run-dir", default=None, help="runs root (default: the config's run_dir, ./runs)")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    p.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    import traceback

    from .._errors import NonFiniteError
    from .script import FALLBACK, run_script

    kwargs: dict[str, Any] = {"policy": args.policy}
    if args.run_dir is not None:
        kwargs["run"] = args.run_dir
    session, error = run_script(args.script, list(args.args), **kwargs)
    mon = session.monitor
    for note in session.notes:
        print(f"torchdebug run: {note}; {FALLBACK}", file=sys.stderr)
    if isinstance(error, NonFiniteError):
        print(str(error), file=sys.stderr)
    elif error is not None:
        traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
    if mon is not None:
        where = f"; run folder {mon.run_dir}" if mon.run_dir is not None else ""
        print(
            f"torchdebug run: watched {type(mon.model).__name__} with {type(mon.optimizer).__name__}: "
            f"{mon.global_step} steps, {len(mon.anomalies)} anomalies{where}",
            file=sys.stderr,
        )
    return 1 if error is not None else 0

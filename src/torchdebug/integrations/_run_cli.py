"""The ``torchdebug run`` subcommand; cheap to register (torch is imported when it runs).

Exit codes (documented in ``torchdebug run --help`` and docs/cli.md): 0 the script finished and
no NaN/Inf was found; 1 the script itself failed (raised, or exited non-zero); 3 a NaN/Inf was
found (under ``raise`` the script was stopped; under ``warn``/``skip`` it went on and the anomalies
were recorded); 4 torchdebug itself failed. 2 is a usage error, from argparse.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

_EPILOG = (
    "exit codes: 0 finished, no NaN/Inf; 1 the script itself failed; 2 usage error; "
    "3 a NaN/Inf was found; 4 torchdebug itself failed (rerun with --debug and report it)"
)


def register(subparsers: Any) -> None:
    from ..cli import add_runs_option

    p = subparsers.add_parser(
        "run",
        help="run an unmodified training script under watch (finds its model and optimizer)",
        description=(
            "Run SCRIPT as `python SCRIPT ARGS...` with the NaN/Inf sentinel on: the model is the module "
            "owning the parameters of the first torch.optim optimizer the script creates; a step ends "
            "after each step of that optimizer. Prints the origin of the first NaN/Inf and the run folder."
        ),
        epilog=_EPILOG,
    )
    p.add_argument("--policy", default="raise", choices=("raise", "warn", "skip"))
    add_runs_option(p, "--run-dir", what="folder for the run")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    p.set_defaults(func=_cli)


def _raised_inside_torchdebug(error: BaseException) -> bool:
    """True when the innermost frame of ``error``'s traceback is torchdebug's own code (a bug in it),
    not the script's or a library's; torchdebug's documented errors (``TorchDebugError``) are not."""
    from .._errors import TorchDebugError

    if isinstance(error, TorchDebugError):
        return False
    tb = error.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    return os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(package)


def _cli(args: argparse.Namespace) -> int:
    import traceback

    from .._errors import NonFiniteError
    from .._term import style, use_colour
    from ..cli import EXIT_FAILED, EXIT_INTERNAL, EXIT_NONFINITE, EXIT_OK
    from .script import FALLBACK, run_script

    kwargs: dict[str, Any] = {"policy": args.policy}
    if args.runs is not None:
        kwargs["run"] = args.runs
    session, error = run_script(args.script, list(args.args), **kwargs)
    mon = session.monitor
    colour = use_colour(sys.stderr)
    for note in session.notes:
        print(f"torchdebug run: {note}; {FALLBACK}", file=sys.stderr)
    if isinstance(error, NonFiniteError):
        print(style(str(error), "error", colour), file=sys.stderr)
    elif error is not None:
        traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
    found = isinstance(error, NonFiniteError) or (mon is not None and bool(mon.anomalies))
    if mon is not None:
        where = f"; run folder {mon.run_dir}" if mon.run_dir is not None else ""
        anomalies = f"{len(mon.anomalies)} anomalies"
        models = " and ".join(mon.roots) if mon.roots is not None else type(mon.model).__name__
        opts = " and ".join(type(o).__name__ for o in mon.optimizers) or type(mon.optimizer).__name__
        print(
            f"torchdebug run: watched {models} with {opts}: "
            f"{mon.global_step} steps, {style(anomalies, 'error' if found else 'ok', colour)}{where}",
            file=sys.stderr,
        )
    if found:
        return EXIT_NONFINITE
    if error is None:
        return EXIT_OK
    if _raised_inside_torchdebug(error):
        print(
            "torchdebug run: torchdebug itself failed (the traceback above): please report it",
            file=sys.stderr,
        )
        return EXIT_INTERNAL
    return EXIT_FAILED

"""The ``torchdebug`` command line: argument parsing, subcommand discovery, exit codes and error lines.

Exit codes (every command; ``torchdebug --help`` lists them):

- 0: done (for ``run``: the script finished and no NaN/Inf was found);
- 1: failed: a run folder that cannot be read, a missing extra, a bad file, a setup problem
  (``ConfigError``: e.g. ``export --to wandb`` without a login, ``--to mlflow`` without a tracking
  server; ``serve`` on a port another program holds) (for ``run``: the training script itself
  raised or exited non-zero);
- 2: usage error (an unknown option, a bad value: ``report -o x.pdf``, no format writes a PDF);
- 3: ``run`` only: a NaN/Inf was found (``policy="raise"`` stopped the script; under ``warn`` or
  ``skip`` it went on and the anomalies were recorded);
- 4: torchdebug itself failed (an internal error: a bug to report, with ``--debug``'s traceback).

A failure prints ONE line to stderr, ``torchdebug: error: <what went wrong and what to do>``;
``--debug`` shows the traceback instead.

The runs folder has one spelling everywhere: ``--runs DIR`` (default ``$TORCHDEBUG_RUN_DIR``, else
``./runs``), added by :func:`add_runs_option`; the older spellings (``--root``, ``--run-dir``, a
positional ``DIR``) still work and are hidden from the help.

Adding a subcommand (no edit of this file needed): create a module named in ``_COMMAND_MODULES``
that exposes ``register(subparsers) -> None``. ``register`` adds its parsers with
``subparsers.add_parser(name, help=...)`` and sets ``parser.set_defaults(func=run)`` where
``run(args) -> int`` returns the exit code. Rules:

- ``register`` must be cheap: import heavy dependencies (fastapi, matplotlib ...) inside ``run``,
  not at module level, so ``torchdebug --help`` stays fast and works without optional extras.
- Report expected failures by raising ``torchdebug.RunStoreError``/``ConfigError`` (or ``ValueError``,
  ``OSError``) with a message naming the fix; ``main`` turns them into the one-line error and exit 1.
- A missing optional extra: inside ``run``, raise ``ImportError("torchdebug serve needs fastapi:
  pip install 'torchdebug[dashboard]'")``; it becomes the one-line error, exit 1.
- A module listed here that does not exist (yet) is skipped silently. A module that fails to import or
  register for any other reason is skipped with a one-line warning on stderr (the other commands keep
  working); with ``--debug`` its traceback is shown instead.

Example::

    # torchdebug/report/_cli.py
    def register(subparsers):
        p = subparsers.add_parser("report", help="write a report of a run")
        p.add_argument("run")
        p.set_defaults(func=_run)

    def _run(args) -> int:
        from .html import write_html   # heavy imports here
        ...
        return 0
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from ._term import printable
from ._version import __version__

PROG = "torchdebug"

#: Exit codes; see the module docstring.
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NONFINITE = 3
EXIT_INTERNAL = 4

_EXIT_CODES = (
    "exit codes: 0 done; 1 failed (unreadable run, missing extra, a setup problem: a busy port, a "
    "tracker without its login or URI; for 'run': the script itself failed); 2 usage error (a bad "
    "option or value, a report name like x.pdf); 3 'run' found a NaN/Inf; 4 torchdebug itself "
    "failed (a bug: rerun with --debug and report it). NO_COLOR=1 turns colour off."
)

#: Modules that add subcommands through ``register(subparsers)``, in ``--help`` order.
_COMMAND_MODULES = [
    "torchdebug.views.runs_cli",
    "torchdebug._demo_cli",
    "torchdebug.views.report._cli",
    "torchdebug.views._compare_cli",
    "torchdebug.sinks._cli",
    "torchdebug.views.server._cli",
    "torchdebug.integrations._run_cli",
]


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (plus the hint) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def int_in_range(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse ``type=``: an integer in ``low..high``; anything else is a usage error (exit 2).

    argparse names the option: ``argument --port: expected an integer in 0..65535, got '99999'``.

    Example:
        >>> int_in_range(0, 65535)("6007")
        6007
    """
    expected = f"an integer in {low}..{high}" if high is not None else f"an integer >= {low}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text[:40]!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text[:40]!r}")
        return value

    parse.__name__ = expected  # argparse's fallback message names the type by it
    return parse


def default_runs_dir() -> str:
    """The runs folder when ``--runs`` is not given: ``$TORCHDEBUG_RUN_DIR`` (as ``DebugConfig.run_dir``
    reads it), else ``runs``."""
    import os

    return os.environ.get("TORCHDEBUG_RUN_DIR") or "runs"


def add_runs_option(
    parser: argparse.ArgumentParser, *legacy: str, what: str = "folder of run folders"
) -> None:
    """Add ``--runs DIR`` (dest ``runs``) and the hidden older spellings ``legacy`` (e.g. ``--root``).

    The default is left None so a command can tell "not given" from "given"; read the folder with
    ``args.runs or default_runs_dir()``.
    """
    parser.add_argument(
        "--runs",
        dest="runs",
        default=None,
        metavar="DIR",
        help=f"{what} (default $TORCHDEBUG_RUN_DIR, else ./runs)",
    )
    for flag in legacy:
        parser.add_argument(flag, dest="runs", default=None, help=argparse.SUPPRESS)


def _missing_module(err: ModuleNotFoundError, module: str) -> bool:
    """True when ``err`` is about ``module`` itself (or a parent package of it), not something it imports."""
    if not err.name:
        return False
    return module == err.name or (module.startswith(err.name + ".") and err.name != "torchdebug")


def build_parser(
    modules: Sequence[str] | None = None,
    *,
    on_error: Callable[[str, BaseException], None] | None = None,
) -> argparse.ArgumentParser:
    """The full parser: global options plus every subcommand found in ``modules``.

    Args:
        modules: command modules (default ``_COMMAND_MODULES``).
        on_error: called with (module, exception) when a command module fails to import or register;
            the other commands stay available. Without it the exception propagates.

    A ModuleNotFoundError for the command module itself (not yet written) is always skipped silently.
    """
    parser = _Parser(
        prog=PROG,
        description="torchdebug: explain PyTorch training failures from a run folder.",
        epilog=f"Run '{PROG} <command> --help' for a command's options. {_EXIT_CODES}",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    subparsers = parser.add_subparsers(dest="command", metavar="<command>", parser_class=_Parser)
    for module in _COMMAND_MODULES if modules is None else modules:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if _missing_module(e, module):
                continue
            if on_error is None:
                raise
            on_error(module, e)
            continue
        except Exception as e:
            if on_error is None:
                raise
            on_error(module, e)
            continue
        try:
            mod.register(subparsers)
        except Exception as e:
            if on_error is None:
                raise
            on_error(module, e)
    return parser


def _warn_broken(module: str, exc: BaseException) -> None:
    print(
        f"{PROG}: warning: commands from {module} are unavailable ({_one_line(exc)}); rerun with --debug",
        file=sys.stderr,
    )


def _one_line(exc: BaseException) -> str:
    """The error as one terminal-safe line: whitespace collapsed, control characters escaped (a path or
    name from the command line or a run folder may hold an escape sequence)."""
    text = str(exc) if str(exc) else type(exc).__name__
    if isinstance(exc, KeyError) and len(exc.args) == 1 and isinstance(exc.args[0], str):
        text = exc.args[0]  # str(KeyError) adds quotes
    return printable(" ".join(text.split()))


def main(argv: Sequence[str] | None = None, *, modules: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 failure, 2 usage error, 3 ``run`` found a
    NaN/Inf, 4 internal error).

    Args:
        argv: arguments without the program name (default ``sys.argv[1:]``).
        modules: command modules to load instead of ``_COMMAND_MODULES`` (for embedding and tests).

    Example: ``main(["runs", "runs/"])``; the console script ``torchdebug`` calls ``sys.exit(main())``.
    """
    from ._errors import TorchDebugError

    args_list = list(sys.argv[1:] if argv is None else argv)
    # --debug is global but accepted anywhere (``torchdebug show RUN --debug``): take it out before
    # parsing so subcommands need not declare it; a literal "--debug" after "--" is left alone.
    end = args_list.index("--") if "--" in args_list else len(args_list)
    debug = "--debug" in args_list[:end]
    args_list = [a for a in args_list[:end] if a != "--debug"] + args_list[end:]
    try:
        parser = build_parser(modules, on_error=None if debug else _warn_broken)
        args = parser.parse_args(args_list)
    except SystemExit as e:  # --help, --version, usage errors
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    func = getattr(args, "func", None)
    if func is None:
        commands = ", ".join(sorted(_subcommands(parser)))
        print(f"{PROG}: error: choose a command: {commands} (see '{PROG} --help')", file=sys.stderr)
        return 2
    try:
        code = func(args)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `torchdebug runs | head`
        return 0
    except (TorchDebugError, OSError, ValueError, KeyError, ImportError) as e:
        if debug:
            raise
        print(f"{PROG}: error: {_one_line(e)}", file=sys.stderr)
        return 1
    except Exception as e:
        if debug:
            raise
        print(
            f"{PROG}: error: internal error {type(e).__name__}: {_one_line(e)} "
            f"(rerun with --debug for the traceback and report it)",
            file=sys.stderr,
        )
        return EXIT_INTERNAL
    return int(code or 0)


def _subcommands(parser: argparse.ArgumentParser) -> list[str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices)
    return []


if __name__ == "__main__":
    sys.exit(main())

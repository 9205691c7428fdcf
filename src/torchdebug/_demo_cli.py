"""``torchdebug demo [SCENARIO]``: registers the command cheaply; torch is imported when it runs.

The GPT demo (the default, also called ``autograd``) lives in ``torchdebug.demo``, the seed-era
scenarios in ``torchdebug.demos``; this module picks one, so the two never import each other.
"""

from __future__ import annotations

import argparse
from typing import Any

#: The scenarios ``torchdebug demo`` takes; ``autograd`` is the GPT demo (the default).
SCENARIOS = ("autograd", "gradient", "memory", "training", "comprehensive")
#: The GPT demo's defaults: a bad batch early, so the answer comes in a few seconds.
DEFAULT_STEPS = 60
DEFAULT_BAD_STEP = 20


def register(subparsers: Any) -> None:
    """Add ``demo`` to the torchdebug command line."""
    from .cli import add_runs_option, int_in_range

    p = subparsers.add_parser("demo", help="train a small GPT until a bad batch makes a NaN, and explain it")
    p.add_argument(
        "scenario",
        nargs="?",
        default=None,
        choices=list(SCENARIOS),
        help="a quick-start scenario (default: this GPT demo, also called 'autograd')",
    )
    p.add_argument(
        "--steps",
        type=int_in_range(1),
        default=DEFAULT_STEPS,
        help=f"training steps (default {DEFAULT_STEPS})",
    )
    p.add_argument(
        "--bad-step",
        type=_bad_step,
        default=DEFAULT_BAD_STEP,
        help=f"step in [0, steps) whose batch holds an all-padding sequence, or 'none' (default {DEFAULT_BAD_STEP})",
    )
    p.add_argument(
        "--policy",
        choices=["raise", "warn", "skip"],
        default="raise",
        help="what the sentinel does: raise (stop), warn (go on), skip (skip the update)",
    )
    add_runs_option(p, what="folder for the run")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_run, demo_parser=p)


def _bad_step(text: str) -> int | None:
    """``--bad-step``: a step >= 0 or ``none``; the upper bound (``--steps``) is checked in ``_run``."""
    if text.strip().lower() == "none":
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a step >= 0 or 'none' (no bad batch), got {text[:40]!r}")
    return value


def _run(args: argparse.Namespace) -> int:
    bad = args.bad_step
    if bad is not None and bad >= args.steps and args.scenario in (None, "autograd"):
        try:  # the parser's own usage line and exit code 2, as for a bad value of any other option
            args.demo_parser.error(
                f"argument --bad-step: expected a step in [0, {args.steps}) (--steps {args.steps}) or "
                f"'none' (no bad batch), got {bad}"
            )
        except SystemExit as usage:
            return int(usage.code or 2)
    import torch

    from .cli import default_runs_dir

    runs = args.runs or default_runs_dir()
    # The demos' models are tiny: one thread is as fast on a quiet machine, and on a busy one it
    # avoids threads spin-waiting for each other (20 GPT steps: 2 s with one thread, 30 s with two
    # at a load average of 14 on the 2-core VM).
    torch.set_num_threads(1)
    if args.scenario not in (None, "autograd"):
        from .demos import run_scenario

        return run_scenario(args.scenario, run_dir=runs, seed=args.seed)
    from .demo import run_demo

    return run_demo(steps=args.steps, bad_step=bad, policy=args.policy, run_dir=runs, seed=args.seed)

"""``torchdebug export RUN --to tensorboard|wandb|mlflow|logging`` (registered by cli.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .._config import REPORT_TO_NAMES


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``export`` subcommand (cheap: the tracker libraries are imported when it runs)."""
    e = subparsers.add_parser(
        "export",
        help="send a run to a tracker (TensorBoard, W&B, MLflow, logging)",
        description=(
            "Send a stored run's scalars, anomalies, rule events and verdict to a tracker, under the "
            "same torchdebug/... names as watch(report_to=...). W&B and MLflow read their usual "
            "environment (WANDB_PROJECT, WANDB_MODE, MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME ...)."
        ),
    )
    from ..cli import add_runs_option, int_in_range

    e.add_argument("run", help="run folder, or a run name looked up under --runs")
    add_runs_option(e, what="where to look RUN up by name")
    e.add_argument("--rank", type=int_in_range(0), default=None, help="which rank's database (default 0)")
    e.add_argument("--to", choices=REPORT_TO_NAMES, help="the tracker (default: tensorboard)")
    e.add_argument(
        "--logdir",
        metavar="DIR",
        help="TensorBoard log directory to write (default: tensorboard/<run folder name>)",
    )
    e.add_argument("--tensorboard", metavar="DIR", help="same as --to tensorboard --logdir DIR")
    e.add_argument("--project", help="W&B project (default: WANDB_PROJECT, else W&B's default)")
    e.add_argument("--run-id", help="MLflow: add to this existing run instead of starting one")
    e.set_defaults(func=_export)


def _export(args: argparse.Namespace) -> int:
    from ..cli import default_runs_dir
    from ..store import open_run, resolve_run

    to = args.to or "tensorboard"
    if args.tensorboard and to != "tensorboard":
        raise ValueError(f"--tensorboard DIR writes TensorBoard; drop it or --to {to}")
    path = resolve_run(args.run, args.runs or default_runs_dir())
    with open_run(path, rank=args.rank) as run:
        return _send(args, run, path, to)


def _send(args: argparse.Namespace, run: object, path: Path, to: str) -> int:
    from . import export_run

    if to == "tensorboard":
        from ._tensorboard import export_tensorboard

        # never into the run folder: readers leave a run as it is
        logdir = args.tensorboard or args.logdir or str(Path("tensorboard") / path.resolve().name)
        counts = export_tensorboard(run, logdir)
        print(
            f"wrote {counts['scalars']} scalars, {counts['histograms']} histograms and {counts['texts']} texts "
            f"to {logdir} (view: tensorboard --logdir {logdir})",
            file=sys.stderr,
        )
        return 0
    options: dict[str, object] = {}
    if to == "wandb" and args.project:
        options["project"] = args.project
    if to == "mlflow" and args.run_id:
        options["run_id"] = args.run_id
    end = export_run(run, to, **options)
    print(f"sent {args.run} to {to}: {end.verdict}", file=sys.stderr)
    return 0

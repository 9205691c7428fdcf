"""Sinks: a run's records sent to the trackers people already read (TensorBoard, W&B, MLflow, logging).

A consumer of the run store, like the views: live, a ``SinkHub`` listens to the run writer's thread
(``watch(..., report_to=[...])``); after the fact, ``export_run`` reads a run folder. Both send the
same records under the same ``torchdebug/...`` names (see ``_records.py``). Each tracker library is
imported only when its sink is used.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from .._config import REPORT_TO_NAMES
from .._errors import ConfigError
from ._hub import Sink, SinkHub, deliver, run_info
from ._logging import LoggingSink
from ._mlflow import MlflowSink
from ._records import Finding, Histogram, RunEnd, RunInfo, Scalars, run_records
from ._tensorboard import TensorBoardSink, export_tensorboard
from ._wandb import WandbSink

EXTRAS = {
    "tensorboard": ("tensorboard", "pip install 'torchdebug[tensorboard]'"),
    "wandb": ("wandb", "pip install 'torchdebug[wandb]'"),
    "mlflow": ("mlflow", "pip install 'torchdebug[mlflow]'"),
}


def installed(name: str) -> bool:
    """True when the library of sink ``name`` can be imported (``logging`` always)."""
    spec = EXTRAS.get(name)
    if spec is None:
        return True
    if spec[0] in sys.modules:
        return sys.modules[spec[0]] is not None  # None: imports of it are blocked
    return importlib.util.find_spec(spec[0]) is not None


def require(name: str) -> None:
    """Raise ImportError naming the extra when sink ``name``'s library is missing."""
    if not installed(name):
        module, extra = EXTRAS[name]
        raise ImportError(f"report_to={name!r} needs the {module} package: {extra}")


def resolve_names(names: Iterable[str]) -> list[str]:
    """``report_to`` names with ``"all"`` expanded to every sink whose library is installed, in
    ``REPORT_TO_NAMES`` order; a named sink whose library is missing raises ImportError."""
    names = list(names)
    out: list[str] = []
    for n in REPORT_TO_NAMES:
        if n in names:
            require(n)
            out.append(n)
        elif "all" in names and installed(n):
            out.append(n)
    return out


def make_sink(name: str, *, tensorboard_dir: str | os.PathLike[str] | None = None, **options: Any) -> Sink:
    """The sink called ``name`` (one of ``REPORT_TO_NAMES``) with its options.

    Raises:
        ConfigError: an unknown name (lists the allowed ones). ImportError: its library is missing.
    """
    if name not in REPORT_TO_NAMES:
        raise ConfigError(f"unknown sink {name!r}; expected one of {', '.join(map(repr, REPORT_TO_NAMES))}")
    require(name)
    if name == "tensorboard":
        return TensorBoardSink(tensorboard_dir, **options)
    if name == "wandb":
        return WandbSink(**options)
    if name == "mlflow":
        return MlflowSink(**options)

    return LoggingSink(**options)


def as_sink(obj: Any) -> Sink:
    """A ``Sink`` as is; an open TensorBoard ``SummaryWriter`` becomes a ``TensorBoardSink`` on it."""
    if isinstance(obj, Sink):
        return obj
    if callable(getattr(obj, "add_scalar", None)) and callable(getattr(obj, "add_text", None)):
        return TensorBoardSink(writer=obj)
    raise TypeError(
        f"report_to items must be names ({', '.join(REPORT_TO_NAMES)}, 'all', 'none'), torchdebug sinks "
        f"or a SummaryWriter; got {type(obj).__name__}"
    )


def export_run(run_or_path: Any, to: str, **options: Any) -> RunEnd:
    """Send a finished run to a tracker after the fact (``torchdebug export RUN --to NAME``).

    Args:
        run_or_path: a run folder or an open ``torchdebug.store.Run``.
        to: ``"tensorboard"`` (``options``: ``logdir``), ``"wandb"`` (``wandb.init`` keyword
            arguments, e.g. ``project``), ``"mlflow"`` (``run_id`` to add to an existing run) or
            ``"logging"``.

    Returns:
        How the run ended (``status``, ``verdict``, counts), as sent.

    Raises:
        ConfigError: an unknown tracker, or one that cannot start (no login, no tracking server:
            the message names the fix). ImportError: its library is missing (names the extra).
        RunStoreError: the run cannot be read.

    Example: ``export_run("runs/mlp-20250101-120000", "mlflow")``. Cost: reads every stored point once.
    """
    from ..store import open_run

    logdir = options.pop("logdir", None)
    sink = make_sink(to, tensorboard_dir=logdir, **options)
    run = open_run(run_or_path) if isinstance(run_or_path, (str, os.PathLike)) else run_or_path
    try:
        lost = int(run.summary()["lost"] or 0)
        return deliver([sink], run_info(run), run_records(run), run.status, lost)
    finally:
        if run is not run_or_path:
            run.close()


def build_sinks(names: Sequence[str], objects: Sequence[Any], tensorboard: bool | str) -> list[Sink]:
    """The sinks of a session: those named (``"all"`` expanded), the objects given, and TensorBoard
    when ``tensorboard`` is True or a directory (``watch(tensorboard=...)``)."""
    wanted = resolve_names(names)
    if tensorboard and "tensorboard" not in wanted:
        require("tensorboard")
        wanted.insert(0, "tensorboard")
    tb_dir = tensorboard if isinstance(tensorboard, str) else None
    sinks = [make_sink(n, tensorboard_dir=tb_dir) for n in wanted]
    return sinks + [as_sink(o) for o in objects]


__all__ = [
    "REPORT_TO_NAMES",
    "Finding",
    "Histogram",
    "LoggingSink",
    "MlflowSink",
    "RunEnd",
    "RunInfo",
    "Scalars",
    "Sink",
    "SinkHub",
    "TensorBoardSink",
    "WandbSink",
    "build_sinks",
    "export_run",
    "export_tensorboard",
    "make_sink",
]

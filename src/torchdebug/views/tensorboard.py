"""TensorBoard: export a stored run (``export_tensorboard``) and the live ``TensorBoardInstrument``.

Both write with ``torch.utils.tensorboard.SummaryWriter`` (needs ``pip install 'torchdebug[tensorboard]'``).

Tags written:

- every stored metric under its own name (``loss``, ``grad_norm``, ``lr/0``, ``grad_norm/<param>`` ...);
  NaN/Inf values are written as such (TensorBoard keeps them);
- ``memory/<key>`` in bytes, ``time/<phase>`` in seconds, ``throughput/samples_per_s``;
- ``histograms/<tensor>`` from tensor statistics on the detailed schedule, with
  ``nonfinite/<tensor>/nan`` and ``nonfinite/<tensor>/inf`` counts as scalars;
- ``anomalies`` and ``events/<kind>`` as text.

Known limitations: the store keeps summary statistics, not values, so a histogram has one bucket
spanning the tensor's finite [min, max] with exact count, sum and sum of squares: TensorBoard's
distribution view shows the true range and moments, not the shape inside it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .report._format import anomaly_rows

TENSORBOARD_EXTRA = "pip install 'torchdebug[tensorboard]'"


def _summary_writer(logdir: str | os.PathLike[str], flush_secs: int = 10) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # torch raises ImportError when the tensorboard package is missing
        raise ImportError(f"TensorBoard export needs the tensorboard package: {TENSORBOARD_EXTRA}") from e
    return SummaryWriter(log_dir=os.fspath(logdir), flush_secs=flush_secs)


def anomaly_markdown(a: Mapping[str, Any]) -> str:
    """An anomaly document as TensorBoard markdown: summary line, then phase/module/op/line/hint."""
    rows = [
        *anomaly_rows(a),
        ("hint", a.get("hint")),
    ]
    body = "  \n".join(f"**{k}**: `{v}`" for k, v in rows if v not in (None, ""))
    return f"**{a.get('summary') or a.get('kind')}**  \n{body}"


def _event_markdown(severity: str, kind: str, message: str, modules: Any) -> str:
    where = f" [{', '.join(map(str, modules))}]" if modules else ""
    return f"**{severity}** `{kind}`{where}: {message}"


def _histogram(writer: Any, tag: str, stats: Mapping[str, Any], step: int, wall: float | None) -> bool:
    """One-bucket histogram from summary stats; False when the stats hold no finite value."""
    raw = (stats.get("min"), stats.get("max"), stats.get("mean"))
    numel = int(stats.get("numel") or 0)
    bad = sum(int(stats.get(k) or 0) for k in ("nan_count", "posinf_count", "neginf_count"))
    n = numel - bad
    if n <= 0 or not all(isinstance(x, (int, float)) and math.isfinite(x) for x in raw):
        return False
    lo, hi, mean = (float(x) for x in raw)  # type: ignore[arg-type]  # checked just above
    std = stats.get("std")
    var = std * std if isinstance(std, (int, float)) and math.isfinite(std) else 0.0
    # std is the unbiased estimate (torch.std): sum of squares = (n - 1) var + n mean^2.
    sum_squares = (n - 1) * var + n * mean * mean
    writer.add_histogram_raw(
        tag,
        min=lo,
        max=hi,
        num=n,
        sum=mean * n,
        sum_squares=sum_squares,
        bucket_limits=[hi],
        bucket_counts=[n],
        global_step=step,
        walltime=wall,
    )
    return True


def export_tensorboard(run_or_path: Any, logdir: str | os.PathLike[str]) -> dict[str, int]:
    """Write a stored run to TensorBoard event files in ``logdir``.

    Args:
        run_or_path: an open ``torchdebug.store.Run`` or a run folder path.
        logdir: TensorBoard log directory (created).

    Returns:
        Counts written: ``{"scalars", "histograms", "texts"}``.

    Raises:
        ImportError: tensorboard is not installed (names ``pip install 'torchdebug[tensorboard]'``).
        RunStoreError: the run cannot be read.

    Example: ``export_tensorboard("runs/demo-20250101-120000", "tb/demo")`` then
    ``tensorboard --logdir tb``. Cost: reads every stored point once.
    """
    from ..store import open_run

    run = open_run(run_or_path) if isinstance(run_or_path, (str, os.PathLike)) else run_or_path
    counts = {"scalars": 0, "histograms": 0, "texts": 0}
    writer = _summary_writer(logdir)
    try:
        for name in run.metric_names():
            s = run.series(name)
            for step, value, wall in zip(s.steps, s.values, s.wall_times):
                writer.add_scalar(name, value, step, walltime=wall)
            counts["scalars"] += len(s.steps)
        for sample in run.memory():
            for key, value in sample.items():
                if key not in ("step", "wall_time"):
                    writer.add_scalar(f"memory/{key}", value, sample["step"], walltime=sample["wall_time"])
                    counts["scalars"] += 1
        for sample in run.timings():
            for key, value in sample.items():
                if key not in ("step", "wall_time"):
                    tag = "throughput/samples_per_s" if key == "samples_per_s" else f"time/{key}"
                    writer.add_scalar(tag, value, sample["step"], walltime=sample["wall_time"])
                    counts["scalars"] += 1
        for row in run.tensor_stats():
            st, step, wall, name = row["stats"], row["step"], row["wall_time"], row["name"]
            counts["histograms"] += _histogram(writer, f"histograms/{name}", st, step, wall)
            writer.add_scalar(f"nonfinite/{name}/nan", int(st.get("nan_count") or 0), step, walltime=wall)
            inf = int(st.get("posinf_count") or 0) + int(st.get("neginf_count") or 0)
            writer.add_scalar(f"nonfinite/{name}/inf", inf, step, walltime=wall)
            counts["scalars"] += 2
        for a in run.anomalies():
            writer.add_text("anomalies", anomaly_markdown(a), a.get("step") or 0, walltime=a.get("wall_time"))
            counts["texts"] += 1
        for e in run.events():
            data = e.get("data") or {}
            mods = data.get("modules") if isinstance(data, Mapping) else None
            text = _event_markdown(e["severity"], e["kind"], e["message"], mods)
            writer.add_text(f"events/{e['kind']}", text, e.get("step") or 0, walltime=e["wall_time"])
            counts["texts"] += 1
    finally:
        writer.close()
        if run is not run_or_path:
            run.close()
    return counts


class TensorBoardInstrument:
    """Live TensorBoard logging: each step's values, anomalies and rule events as they happen.

    ``watch(..., tensorboard=True)`` adds it writing to ``<run folder>/tensorboard`` (or
    ``runs/tensorboard`` without a run store); ``tensorboard="dir"`` picks the directory.
    It only reads the numbers the monitor already moved to the host: no extra device sync.

    Args:
        logdir: the log directory; None means the default above.
        flush_secs: how often SummaryWriter flushes to disk.

    Raises:
        ImportError (at install): tensorboard missing (names ``pip install 'torchdebug[tensorboard]'``).

    Example::

        with td.watch(model, optimizer, instruments=[TensorBoardInstrument("tb/run1")]) as mon: ...

    Cost: a few µs per scalar (protobuf encoding; file writes happen on SummaryWriter's thread).
    """

    name = "tensorboard"

    def __init__(self, logdir: str | os.PathLike[str] | None = None, flush_secs: int = 10) -> None:
        self.logdir = None if logdir is None else Path(logdir)
        self.flush_secs = flush_secs
        self.writer: Any = None

    def install(self, mon: Any) -> None:
        configured = getattr(getattr(mon, "config", None), "tensorboard", None)
        if self.logdir is None and isinstance(configured, (str, os.PathLike)):
            self.logdir = Path(configured)  # watch(..., tensorboard="dir")
        if self.logdir is None:
            store = getattr(mon, "writer", None)
            self.logdir = (
                Path(store.path) / "tensorboard" if store is not None else Path("runs") / "tensorboard"
            )
        self.writer = _summary_writer(self.logdir, self.flush_secs)

    def on_step_end(self, mon: Any, record: Any, values: Mapping[str, float]) -> None:
        w = self.writer
        if w is None:
            return
        step = record.step
        written = set()
        for name, value in values.items():
            w.add_scalar(name, value, step)
            written.add(name)
        if record.loss is not None and "loss" not in written:
            w.add_scalar("loss", record.loss, step)
        if record.grad_norm is not None and "grad_norm" not in written:
            w.add_scalar("grad_norm", record.grad_norm, step)
        for i, lr in enumerate(record.lr):
            if f"lr/{i}" not in written:
                w.add_scalar(f"lr/{i}", lr, step)
        if record.skipped and "skipped" not in written:
            w.add_scalar("skipped", 1.0, step)
        if record.anomaly is not None:
            w.add_text("anomalies", anomaly_markdown(record.anomaly.to_dict()), step)
        for e in record.events:
            w.add_text(f"events/{e.kind}", _event_markdown(e.severity, e.kind, e.message, e.modules), step)

    def remove(self, mon: Any) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    on_exit = remove

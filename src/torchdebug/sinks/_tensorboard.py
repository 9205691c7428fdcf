"""The TensorBoard sink (live and ``torchdebug export --to tensorboard``) through ``SummaryWriter``.

Needs ``pip install 'torchdebug[tensorboard]'``. Known limitation: the store keeps summary statistics,
not values, so a histogram has one bucket spanning the tensor's finite [min, max] with exact count,
sum and sum of squares: TensorBoard's distribution view shows the true range and moments, not the
shape inside it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ._episodes import EpisodeEnd
from ._hub import Sink, deliver, run_info
from ._records import (
    ANOMALIES,
    EPISODES,
    FIRST_ANOMALY_TEXT,
    VERDICT,
    Finding,
    Histogram,
    RunEnd,
    RunInfo,
    Scalars,
    event_tag,
    histogram_tag,
    run_records,
)

TENSORBOARD_EXTRA = "pip install 'torchdebug[tensorboard]'"


def summary_writer(logdir: str | os.PathLike[str], flush_secs: int = 10) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # torch raises ImportError when the tensorboard package is missing
        raise ImportError(f"the TensorBoard sink needs the tensorboard package: {TENSORBOARD_EXTRA}") from e
    return SummaryWriter(log_dir=os.fspath(logdir), flush_secs=flush_secs)


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


class TensorBoardSink(Sink):
    """Writes the run to TensorBoard: scalars, histograms, the anomaly block and rule events as text
    (the first record of each episode: one incident, one text; the run's first anomaly also alone
    under ``torchdebug/first_anomaly``, and an episode of several records summed up under
    ``torchdebug/episodes``), and the verdict (``torchdebug/verdict``) with the run folder at the end.

    Args:
        logdir: the log directory; None: ``<run folder>/tensorboard`` (``runs/tensorboard`` without one).
        writer: an open ``SummaryWriter`` to write into instead (yours: flushed, not closed, at the end).
        flush_secs: how often a writer the sink opens flushes to disk.

    Example: ``td.watch(model, opt, report_to=[td.TensorBoardSink(writer=my_writer)])``.
    Cost: a few µs per scalar (protobuf encoding) on the sink's thread.
    """

    name = "tensorboard"

    def __init__(
        self, logdir: str | os.PathLike[str] | None = None, *, writer: Any = None, flush_secs: int = 10
    ) -> None:
        self.logdir = None if logdir is None else Path(logdir)
        self.writer = writer
        self._owns = writer is None
        self.flush_secs = flush_secs
        self.counts = {"scalars": 0, "histograms": 0, "texts": 0}
        self._first = False

    def open(self, run: RunInfo) -> None:
        if self.writer is None:
            if self.logdir is None:
                self.logdir = (run.path if run.path is not None else Path("runs")) / "tensorboard"
            self.writer = summary_writer(self.logdir, self.flush_secs)

    def scalars(self, rec: Scalars) -> None:
        add = self.writer.add_scalar
        for tag, value in rec.values.items():
            add(tag, value, rec.step, walltime=rec.wall_time)
        self.counts["scalars"] += len(rec.values)

    def histogram(self, rec: Histogram) -> None:
        self.counts["histograms"] += _histogram(
            self.writer, histogram_tag(rec.name), rec.stats, rec.step, rec.wall_time
        )

    def finding(self, rec: Finding) -> None:
        tag = ANOMALIES if rec.kind == "anomaly" else event_tag(rec.name)
        text = rec.markdown()
        self.writer.add_text(tag, text, rec.step or 0, walltime=rec.wall_time)
        self.counts["texts"] += 1
        if rec.kind == "anomaly" and not self._first:
            # TensorBoard keeps a sample of 100 texts per tag: the first anomaly (the origin with its
            # hint) also gets a tag of its own, so no later one can push it out
            self._first = True
            self.writer.add_text(FIRST_ANOMALY_TEXT, text, rec.step or 0, walltime=rec.wall_time)
            self.counts["texts"] += 1

    def episode_end(self, end: EpisodeEnd) -> None:
        if end.count > 1:  # an incident of one record is said by its text already
            self.writer.add_text(EPISODES, end.summary(), end.last_step or 0)
            self.counts["texts"] += 1

    def finish(self, end: RunEnd) -> None:
        folder = f"  \nrun folder: `{end.path}`" if end.path is not None else ""
        self.writer.add_text(VERDICT, f"**{end.verdict}**{folder}", end.last_step or 0)
        self.counts["texts"] += 1
        self.writer.flush()

    def release(self, end: RunEnd) -> None:
        if self.writer is not None and self._owns:
            self.writer.close()


def export_tensorboard(run_or_path: Any, logdir: str | os.PathLike[str]) -> dict[str, int]:
    """Write a stored run to TensorBoard event files in ``logdir``, under the same ``torchdebug/...``
    names as the live sink.

    Args:
        run_or_path: an open ``torchdebug.store.Run`` or a run folder path.
        logdir: TensorBoard log directory (created).

    Returns:
        Counts written: ``{"scalars", "histograms", "texts"}`` (the verdict is one of the texts).

    Raises:
        ImportError: tensorboard is not installed (names ``pip install 'torchdebug[tensorboard]'``).
        RunStoreError: the run cannot be read.

    Example: ``export_tensorboard("runs/demo-20250101-120000", "tb/demo")`` then
    ``tensorboard --logdir tb``. Cost: reads every stored point once.
    """
    from ..store import open_run

    run = open_run(run_or_path) if isinstance(run_or_path, (str, os.PathLike)) else run_or_path
    try:
        sink = TensorBoardSink(logdir)
        deliver([sink], run_info(run), run_records(run), run.status, int(run.summary()["lost"] or 0))
    finally:
        if run is not run_or_path:
            run.close()
    return sink.counts

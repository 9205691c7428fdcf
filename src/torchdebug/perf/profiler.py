"""The ``profiler`` instrument: torch.profiler over a few steps of a watched loop, trace and summary stored."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, schedule

from .._step import SessionView
from ..events import RuleEvent
from .profiling import DEFAULT_TRACE_BUDGET, _bound_trace, _ModuleRanges, _summarise, _warnings_not_errors

TB_PROFILER_DIR = "tb_profiler"  # under the run folder, with enable_tensorboard_profiler


class ProfilerInstrument:
    """Profiles steps ``wait+warmup .. wait+warmup+active`` of the session once, then switches itself off.

    Writes ``profile-trace.json`` (Chrome/Perfetto; gzip-compressed and trimmed past
    ``trace_budget_bytes``) and ``profile-summary.txt`` into the run folder, and records an info event
    ``profile`` with the top ops and modules by self time. With ``enable_tensorboard_profiler`` the
    profiled steps also carry Python stacks and go to ``<run>/tb_profiler/`` in the format of
    ``torch.profiler.tensorboard_trace_handler`` (gzip), which TensorBoard's profiler plugin reads.

    Cost: the profiled steps run 1.2-3x slower; the others are untouched.
    """

    name = "profiler"

    def __init__(self, wait: int = 1, warmup: int = 1, active: int = 3, top: int = 10) -> None:
        self.wait, self.warmup, self.active, self.top = wait, warmup, active, top
        self._stack: contextlib.ExitStack | None = None
        self._prof: Any = None
        self._seen = 0
        self._t_active: float | None = None
        self._trace: dict[str, Any] = {}
        self.summary: Any = None

    def install(self, mon: SessionView) -> None:
        cuda = torch.cuda.is_available() and any(p.is_cuda for p in mon.model.parameters())
        self._cuda = cuda
        run_dir = Path(mon.run_dir) if mon.run_dir is not None else None

        tensorboard = bool(getattr(mon.config, "enable_tensorboard_profiler", False))

        def on_ready(prof: Any) -> None:
            if run_dir is None:
                return
            path = run_dir / "profile-trace.json"
            prof.export_chrome_trace(str(path))  # a profile exports once: the copies are made from it
            if tensorboard:
                self._trace["tensorboard_dir"] = str(_tensorboard_copy(path, run_dir / TB_PROFILER_DIR))
            final, note = _bound_trace(path, DEFAULT_TRACE_BUDGET)
            self._trace.update(path=str(final), bytes=final.stat().st_size, note=note)

        self._stack = contextlib.ExitStack()
        if not mon.compiled:
            # per-module ranges: under torch.compile the hooks see nothing and their removal after the
            # window would make Dynamo recompile; the profiler itself still records the compiled ops
            self._stack.enter_context(_ModuleRanges(mon.model))
        with _warnings_not_errors():
            self._prof = self._stack.enter_context(
                torch.profiler.profile(
                    activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
                    schedule=schedule(wait=self.wait, warmup=self.warmup, active=self.active, repeat=1),
                    on_trace_ready=on_ready,
                    record_shapes=True,
                    profile_memory=True,  # seed 000's profiler: allocations and FLOPs in the trace
                    with_flops=True,
                    with_stack=tensorboard,  # seed 000's TensorBoard profile carried Python stacks
                )
            )

    def on_step_end(self, mon: SessionView, record: Any, values: dict[str, float]) -> None:
        if self._prof is None:
            return
        if self._seen == self.wait + self.warmup - 1:
            self._t_active = time.perf_counter()
        self._seen += 1
        with _warnings_not_errors():
            self._prof.step()
        if self._seen < self.wait + self.warmup + self.active:
            return
        wall = time.perf_counter() - (self._t_active or time.perf_counter())
        self._finish()
        self.summary = _summarise(self._prof, self.active, wall, 0.0, self._cuda, self.top, self._trace, [])
        self._prof = None
        if mon.run_dir is not None:
            (Path(mon.run_dir) / "profile-summary.txt").write_text(str(self.summary) + "\n")
        ops = ", ".join(f"{o.name} {o.self_cpu_s * 1e3:.1f} ms" for o in self.summary.top_ops[:3])
        mon.emit(
            RuleEvent(
                "profile",
                mon.global_step,
                f"profiled {self.active} steps; top ops by self time: {ops}",
                "info",
                evidence=self.summary.to_dict(),
            )
        )

    def _finish(self) -> None:
        if self._stack is not None:
            stack, self._stack = self._stack, None
            with _warnings_not_errors():
                stack.close()

    def remove(self, mon: SessionView) -> None:
        self._finish()
        self._prof = None


def _tensorboard_copy(trace: Path, out_dir: Path) -> Path:
    """A gzip copy of ``trace`` named as ``torch.profiler.tensorboard_trace_handler`` names its files
    (``<host>_<pid>.<ns>.pt.trace.json.gz``), which TensorBoard's profiler plugin reads; returns the folder."""
    import gzip
    import os
    import shutil
    import socket

    out_dir.mkdir(parents=True, exist_ok=True)
    dest = out_dir / f"{socket.gethostname()}_{os.getpid()}.{time.time_ns()}.pt.trace.json.gz"
    with trace.open("rb") as src, gzip.open(dest, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return out_dir

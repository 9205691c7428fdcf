"""Seed-era ``PyTorchDebugger`` (its record keeping, step blocks and reports) and ``debug_context``.

The class is assembled from three parts: this file (configuration, ``debug_context`` and the
traced/guarded step blocks, summaries and reports), :mod:`._passes` (seed 001/002's debugging
calls) and :mod:`._seed004` (seed 004's gradient, memory and optimisation calls).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from torch import nn

from .._config import DebugLevel, DebugMode
from .._errors import NonFiniteError
from .._robust import RunningMedian
from ..events import Anomaly, plain
from ..health.instrument import ExplosionRule
from ..memory.analysis import memory_sample
from . import _guard, _tracing
from ._common import (
    HISTORY_SIZE,
    MAX_ANOMALIES,
    DebugInfo,
    anomaly_operations,
    call_accepting,
    handle_anomaly,
    resolve_config,
)
from ._guard import step_guard
from ._passes import DebuggingCalls, _activation_capture, _trainable
from ._seed004 import OptimizationCalls
from ._tracing import AutogradAnomalyDetector, stop_for, traced, tracing_active

REPORT_EXTRA = "pip install 'torchdebug[report]'"
log = logging.getLogger("torchdebug.compat")

# A slow operation: slower than slowdown_factor x its running median, after this many samples.
_SLOW_MIN_SAMPLES = 5
_SLOW_WINDOW = 50
# The clock of DebugInfo.execution_time (a test counts with its own: no assertion on wall time).
_clock = time.perf_counter
# Timer and scheduler jitter: an operation at most this much slower than its median is never slow.
_SLOW_MIN_EXCESS_S = 0.01

__all__ = [
    "AutogradAnomalyDetector",
    "PyTorchDebugger",
    "_activation_capture",
    "_trainable",
    "debug_context",
    "debug_operation",
    "log",
    "traced",
    "tracing_active",
]


class PyTorchDebugger(DebuggingCalls, OptimizationCalls):
    """The seed-era debugger (seeds 001, 002, 004) as a thin layer over torchdebug's engine.

    Args:
        config: any of the seeds' shapes: a ``DebugConfig`` (001), a ``DebugLevel`` or level name
            (002), a ``PyTorchDebugConfig`` (003), a mapping, a config file path, or None.
        error_system, training_logger: seed 004's collaborators. A NaN/Inf that an operation
            records without raising (modes warn/detect) goes to
            ``error_system.error_tracker.track_error(error=NonFiniteError, context={...})`` (what is
            raised, the seed's own ``except`` branch tracks, as its ``robust_training_step`` does);
            when any operation ends,
            ``training_logger.log_training_event("debug_operation", message, debug_info={...})``.
            Only the keyword arguments their methods accept are passed; one that fails is warned
            about once and not called again (debugging never breaks training).
        debug_mode: seed 004's keyword; ``ANOMALY_DETECTION`` and ``FULL_DEBUG`` also switch on
            op-level tracing of ``debug_context`` blocks (what the seed did with detect_anomaly).
        history_size: how many ``DebugInfo`` records ``debug_history`` keeps (oldest dropped).

    What a NaN/Inf does is ``config.anomaly_detection_mode`` (``"warn"`` by default, or
    ``"raise"``): the anomaly is kept in ``.anomalies`` and on the operation's ``DebugInfo``; the
    debug_* methods warn or raise, and a ``debug_context`` block that runs a step raises out of
    ``backward()`` in both modes (see there), so the update never uses it.
    ``debug_context`` blocks are traced op by op when ``enable_anomaly_detection`` or
    ``enable_autograd_anomaly`` is set (costly: see ``AutogradAnomalyDetector``), else watched by
    the engine's sentinel; the debug_* methods check their outputs and gradients with fused
    reductions and one host transfer each, and replay a failing forward under the tracer to name
    its origin.

    Example::

        dbg = PyTorchDebugger(DebugConfig(anomaly_detection_mode="raise"))
        out = dbg.debug_forward_pass(model, x)
        norm = dbg.debug_backward_pass(loss_fn(out, y), model)
        print(dbg.create_debug_report()["gradient_analysis"])

    Known limitations: memory numbers are bytes and times seconds (the seeds printed MB).
    """

    def __init__(
        self,
        config: Any = None,
        *,
        error_system: Any = None,
        training_logger: Any = None,
        debug_mode: DebugMode | str | None = None,
        history_size: int = HISTORY_SIZE,
    ) -> None:
        cfg, mode = resolve_config(config)
        if debug_mode is not None:
            try:
                dm = DebugMode(debug_mode)
            except ValueError:
                allowed = ", ".join(m.value for m in DebugMode)
                raise ValueError(
                    f"debug_mode={debug_mode!r} is not a DebugMode; use one of {allowed}"
                ) from None
            trace = dm in (DebugMode.ANOMALY_DETECTION, DebugMode.FULL_DEBUG)
            cfg = cfg.replace(mode=dm, enable_anomaly_detection=cfg.enable_anomaly_detection or trace)
        self.config, self.mode_on_anomaly = cfg, mode
        if not isinstance(history_size, int) or isinstance(history_size, bool) or history_size < 1:
            raise ValueError(f"history_size must be an int >= 1, got {history_size!r}")
        self.error_system = error_system
        self.training_logger = training_logger
        self.logger = log
        self.debug_history: deque[DebugInfo] = deque(maxlen=history_size)
        self.memory_history: deque[dict[str, Any]] = deque(maxlen=history_size)
        self.performance_history: deque[dict[str, Any]] = deque(maxlen=history_size)
        self.anomalies: list[Anomaly] = []
        self._times: dict[str, RunningMedian] = {}
        self._explosion = self._new_explosion_rule()
        self._leaks: Any = None
        self._profiles = 0
        self.optimization_metrics: list[Any] = []  # OptimizationMetrics, one per optimize_model call

    # -- configuration -------------------------------------------------------------------------------
    @property
    def level(self) -> DebugLevel:
        return self.config.level

    @property
    def debug_mode(self) -> DebugMode:
        return self.config.mode

    @property
    def anomaly_detection_active(self) -> bool:
        """True when ``debug_context`` blocks are traced op by op (seed 001's flag)."""
        return bool(self.config.enable_anomaly_detection or self.config.enable_autograd_anomaly)

    @property
    def gradient_checking_active(self) -> bool:
        """True when the config runs gradient checks (``"gradients"`` in ``config.instruments()``)."""
        return "gradients" in self.config.instruments()

    @property
    def memory_profiling_active(self) -> bool:
        """True when the config runs memory profiling (``"memory"`` in ``config.instruments()``)."""
        return "memory" in self.config.instruments()

    @property
    def performance_profiling_active(self) -> bool:
        """True when the config runs step timing (``"timing"`` in ``config.instruments()``)."""
        return "timing" in self.config.instruments()

    def set_level(self, level: DebugLevel | str) -> DebugLevel:
        """Change the debug level (seed 002's ``POST /debug/level``)."""
        self.config = self.config.replace(level=DebugLevel(level))
        return self.config.level

    def _new_explosion_rule(self) -> ExplosionRule:
        c = self.config
        return ExplosionRule(mads=c.explode_mads, abs_threshold=c.explode_abs, warmup=c.explode_warmup)

    # -- anomaly detection ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def autograd_anomaly_detection(self, model: nn.Module | None = None) -> Iterator[PyTorchDebugger]:
        """Trace the block op by op; a NaN/Inf stops the step, and is recorded, warned or raised.

        Seed 001/002's ``with debugger.autograd_anomaly_detection():`` (yields the debugger). As
        ``torch.autograd.detect_anomaly`` did in both of seed 001's modes, a ``backward()`` in the
        block that ends with a NaN/Inf found raises ``NonFiniteError`` there, before any update
        (modes "warn" and "raise"; mode "detect" drops the gradients instead). A NaN/Inf found
        without a backward is warned or raised per the mode when the block ends. Everything is
        restored when the block ends, also on exceptions; torch's anomaly mode is left as it was.

        Args:
            model: to name modules as in ``model.named_modules()`` (the op and line are named anyway).

        Raises:
            NonFiniteError: see above; ``.anomaly`` names phase, module, op and line.

        Cost: op-level tracing, every op's outputs read on the host (see ``AutogradAnomalyDetector``).
        """
        with traced(model, self.config.frames, self.mode_on_anomaly, self.anomalies, stop=self._stop):
            yield self

    @property
    def _stop(self) -> str:
        return stop_for(self.mode_on_anomaly, raise_on_warn=True)

    @contextlib.contextmanager
    def debug_context(
        self,
        operation: str,
        model_name: str = "unknown",
        epoch: int = 0,
        batch: int = 0,
        *,
        model: nn.Module | None = None,
    ) -> Iterator[DebugInfo]:
        """Time one operation and measure its memory; a NaN/Inf never reaches the weights through it.

        Yields the ``DebugInfo`` filled when the block ends; the record lands in ``debug_history``
        also when the block raises (then ``anomaly_detected`` is True and ``error`` holds the
        exception's repr).

        A block that runs a training step (forward, ``backward()``, ``optimizer.step()``, as seed
        004's ``robust_training_step``) is stopped as ``torch.autograd.detect_anomaly`` stopped it
        in the seeds: when a ``backward()`` ends with a NaN/Inf in the loss or a gradient,
        ``NonFiniteError`` is raised out of that ``backward()`` (modes "warn" and "raise": the
        seeds' warn mode switched on detect_anomaly too), so ``optimizer.step()`` never runs, the
        weights stay finite and the caller's ``except`` recovery runs. ``.anomaly`` names the origin
        (the step is replayed under the tracer; a NaN/Inf in the batch is phase ``input``). Mode
        "detect" records it and the update is skipped (the gradients are dropped).

        With anomaly detection on (see the class) the block is traced op by op; otherwise the
        engine's sentinel watches it: a watch session on ``model`` (default: the first module the
        block calls) that checks the gradients with one fused probe and one host read per
        ``backward()``.

        Example::

            try:
                with dbg.debug_context("training_step"):
                    optimizer.zero_grad()
                    loss_fn(model(x), y).backward()   # NonFiniteError here on a NaN/Inf
                    optimizer.step()
            except td.NonFiniteError as err:
                print(err.anomaly)                    # the weights are as before the step

        Cost: two memory samples (a /proc read, CUDA allocator counters; no device sync), a watch
        session per block (a walk of the model's modules when it starts) and one fused gradient
        probe plus one host read per ``backward()``; the replay only after a NaN/Inf.
        """
        with self._context(operation, model_name, epoch, batch, model=model, guard=True) as info:
            yield info

    @contextlib.contextmanager
    def _context(
        self,
        operation: str,
        model_name: str = "unknown",
        epoch: int = 0,
        batch: int = 0,
        *,
        model: nn.Module | None = None,
        guard: bool = False,
    ) -> Iterator[DebugInfo]:
        """``debug_context``; ``guard=False`` (the facade's own calls, which check and skip the update
        themselves): a traced block leaves a NaN/Inf found at a backward's end to the caller."""
        info = DebugInfo(
            timestamp=datetime.now(),
            mode=self.config.mode,
            level=self.config.level,
            operation=operation,
            model_name=model_name,
            epoch=epoch,
            batch=batch,
        )
        # torchdebug's own start-up (lazy imports, the tracer's first use) before the clock and the
        # memory sample start: the block is charged with the user's work and the per-block cost only
        if self.anomaly_detection_active:
            _tracing.warm_up()
        elif guard:
            _guard.warm_up()
        before = memory_sample()
        t0 = _clock()
        found: list[Anomaly] = []
        block: Any
        if self.anomaly_detection_active:
            stop = self._stop if guard else None
            block = traced(model, self.config.frames, self.mode_on_anomaly, self.anomalies, stop=stop)
        elif guard:
            block = step_guard(model, self.config, self._stop, self.anomalies)
        else:
            block = contextlib.nullcontext(found)
        try:
            with block as found:
                yield info
        except BaseException as exc:
            info.anomaly_detected = True
            info.error = repr(exc)
            if isinstance(exc, NonFiniteError) and info.anomaly is None:
                info.anomaly = exc.anomaly
                if len(self.anomalies) < MAX_ANOMALIES and not any(exc.anomaly is a for a in self.anomalies):
                    self.anomalies.append(exc.anomaly)
            log.info("operation %r failed: %r", operation, exc)
            raise
        finally:
            info.execution_time = _clock() - t0
            after = memory_sample()
            info.rss = after["rss"]
            info.memory_usage = after["rss"] - before["rss"]
            info.gpu_memory = after.get("cuda_allocated", 0) - before.get("cuda_allocated", 0)
            if found and info.anomaly is None:
                info.anomaly = found[0]
            if info.anomaly is not None:
                info.anomaly_detected = True
            self._note_time(info)
            self.debug_history.append(info)
            self._tell_collaborators(info)
            if self.config.save_debug_info:
                self._save_debug_info(info)

    def _tell_collaborators(self, info: DebugInfo) -> None:
        """Seed 004's error system and training logger hear of each block (see the class)."""
        if info.anomaly is not None and info.error is None and self.error_system is not None:
            # a NaN/Inf recorded and not raised (warn/detect modes): the caller's except branch, which
            # tracks what is raised (seed 004's robust_training_step), never sees it
            tracker = getattr(self.error_system, "error_tracker", None)
            fn = getattr(tracker, "track_error", None)
            if fn is not None and not call_accepting(
                fn,
                error=NonFiniteError(info.anomaly),
                severity="warning",
                category="model",
                context={"operation": info.operation, "epoch": info.epoch, "batch": info.batch},
            ):
                self.error_system = None
        fn = getattr(self.training_logger, "log_training_event", None)
        if fn is not None:
            text = (
                f"{info.operation} {'failed' if info.error else 'completed'} in {info.execution_time:.4g} s"
            )
            if not call_accepting(fn, "debug_operation", text, debug_info=info.to_dict()):
                self.training_logger = None

    def _save_debug_info(self, info: DebugInfo) -> None:
        """Append ``info`` as one JSON line to ``<debug_output_dir>/debug_info.jsonl`` (seed 001's save).

        An unwritable folder warns once and switches saving off: debugging never breaks training.
        """
        import json
        import warnings

        from .._errors import TorchDebugWarning

        path = Path(self.config.debug_output_dir) / "debug_info.jsonl"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(info.to_dict(), sort_keys=True) + "\n")
        except OSError as exc:
            self.config = self.config.replace(save_debug_info=False)
            warnings.warn(
                TorchDebugWarning(f"torchdebug: cannot save debug info to {path} ({exc}); saving is off"),
                stacklevel=4,
            )

    def _note_time(self, info: DebugInfo) -> None:
        """Flag an operation slower than ``slowdown_factor`` x its running median (robust, per operation)."""
        hist = self._times.setdefault(info.operation, RunningMedian(_SLOW_WINDOW))
        if len(hist) >= _SLOW_MIN_SAMPLES and info.error is None:
            med = hist.median()
            limit = max(self.config.slowdown_factor * med, med + _SLOW_MIN_EXCESS_S)
            if info.execution_time > limit:
                info.performance_issue_detected = True
                log.info(
                    "slow operation %r: %.4g s vs running median %.4g s",
                    info.operation,
                    info.execution_time,
                    med,
                )
        hist.push(info.execution_time)

    def _report(self, info: DebugInfo, anomaly: Anomaly) -> None:
        info.anomaly = anomaly
        info.anomaly_detected = True
        log.info("%s", anomaly.summary())
        handle_anomaly(anomaly, self.mode_on_anomaly, self.anomalies, stacklevel=5)

    # -- summaries and reports ----------------------------------------------------------------------------
    def get_debug_summary(self) -> dict[str, Any]:
        """Counts and times over ``debug_history`` (seed 002/004 keys; seconds and bytes).

        Before any operation the averages are ``nan`` (what the seed's ``np.mean([])`` gave), so
        the seed's ``f"{summary['avg_execution_time']:.4f}"`` prints ``nan`` instead of failing.
        """
        hist = list(self.debug_history)
        times = [i.execution_time for i in hist]
        return {
            "total_operations": len(hist),
            "debug_history_length": len(hist),
            "total_anomalies": len(self.anomalies),
            "anomaly_operations": anomaly_operations(hist),
            "avg_execution_time": _mean_or_nan(times),
            "max_execution_time": max(times, default=0.0),
            "avg_memory_usage": _mean_or_nan([float(i.memory_usage) for i in hist]),
            "level": self.config.level.value,
            "mode": self.config.mode.value,
            "total_optimizations": len(self.optimization_metrics),
        }

    def create_debug_report(self) -> dict[str, Any]:
        """Seed 001's report: ``summary``, ``performance_analysis``, ``memory_analysis``,
        ``gradient_analysis``, ``operation_breakdown`` (JSON-ready; averages None when empty).

        ``gradient_analysis.gradient_anomalies`` counts operations whose gradient norm was non-finite
        or fired a gradient rule (not the seed's fixed "norm > 10"). Averages and maxima of gradient
        norms are over finite values.
        """
        hist = list(self.debug_history)
        times = [i.execution_time for i in hist]
        mem = [float(i.memory_usage) for i in hist]
        gpu = [float(i.gpu_memory) for i in hist]
        norms = [i.gradient_norm for i in hist if i.gradient_norm is not None]
        finite = [n for n in norms if math.isfinite(n)]
        breakdown: dict[str, int] = {}
        for i in hist:
            breakdown[i.operation] = breakdown.get(i.operation, 0) + 1
        return {
            "summary": {
                "total_debug_operations": len(hist),
                "anomalies_detected": anomaly_operations(hist),
                "memory_leaks_detected": sum(i.memory_leak_detected for i in hist),
                "performance_issues_detected": sum(i.performance_issue_detected for i in hist),
                "debug_mode": self.config.mode.value,
                "debug_level": self.config.level.value,
            },
            "performance_analysis": {
                "average_execution_time": _mean(times),
                "max_execution_time": max(times, default=0.0),
                "min_execution_time": min(times, default=0.0),
            },
            "memory_analysis": {
                "average_memory_usage": _mean(mem),
                "max_memory_usage": max(mem, default=0.0),
                "average_gpu_memory": _mean(gpu),
                "max_gpu_memory": max(gpu, default=0.0),
            },
            "gradient_analysis": {
                "average_gradient_norm": _mean(finite),
                "max_gradient_norm": max(finite, default=0.0),
                "gradient_anomalies": sum(
                    1
                    for i in hist
                    if (i.gradient_norm is not None and not math.isfinite(i.gradient_norm))
                    or any(e.kind in ("gradient_explosion", "vanishing_gradient") for e in i.events)
                ),
            },
            "operation_breakdown": breakdown,
            "anomalies": [plain(a.to_dict()) for a in self.anomalies],
        }

    def create_debug_plots(self, path: str | Path | None = None) -> Path | None:
        """Write seed 001's 2x2 figure (time, memory, gradient norm, anomalies) as a PNG; returns its path.

        Args:
            path: the PNG file; default ``<config.debug_output_dir>/debug_analysis.png`` (folders created).

        Returns:
            The path written, or None when ``debug_history`` is empty (nothing to plot, as in the seed).

        Raises:
            ImportError: matplotlib is missing (``pip install 'torchdebug[report]'``).

        Cost: about 0.3 s (matplotlib's Agg canvas; no pyplot global state).
        """
        try:
            import matplotlib  # noqa: F401
        except ImportError as e:
            raise ImportError(f"create_debug_plots needs matplotlib: {REPORT_EXTRA}") from e
        from ..views.report._png import render_png

        hist = list(self.debug_history)
        if not hist:
            return None
        steps = list(range(len(hist)))
        norms = [(s, i.gradient_norm) for s, i in zip(steps, hist) if i.gradient_norm is not None]
        data = {
            "timings": {"total": {"steps": steps, "values": [i.execution_time for i in hist]}},
            "memory": {"rss": {"steps": steps, "values": [float(i.rss) for i in hist]}},
            "series": (
                {"grad_norm": {"steps": [s for s, _ in norms], "values": [n for _, n in norms]}}
                if norms
                else {}
            ),
            "anomalies": [{"step": s} for s, i in zip(steps, hist) if i.anomaly_detected],
            "events": [{"step": s, "severity": e.severity} for s, i in zip(steps, hist) for e in i.events],
        }
        out = Path(path) if path is not None else Path(self.config.debug_output_dir) / "debug_analysis.png"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(render_png(data, title=f"{len(hist)} operations"))
        return out

    def clear_debug_history(self) -> None:
        """Forget the history, anomalies and running statistics (seed 002's ``POST /debug/clear``)."""
        self.debug_history.clear()
        self.memory_history.clear()
        self.performance_history.clear()
        self.anomalies.clear()
        self._times.clear()
        self._explosion = self._new_explosion_rule()
        self._leaks = None
        self._profiles = 0
        self.optimization_metrics.clear()


@contextlib.contextmanager
def debug_context(
    level: DebugLevel | str | Any = DebugLevel.BASIC, model: nn.Module | None = None
) -> Iterator[PyTorchDebugger]:
    """Seed 002's ``with debug_context(DebugLevel.BASIC) as debugger:``: the block runs traced op by op.

    Yields a ``PyTorchDebugger`` built from ``level`` (or any config shape it accepts); a NaN/Inf in
    the block is recorded in ``debugger.anomalies``. A ``backward()`` that ends with one raises
    ``NonFiniteError`` there (the seed's block ran under ``torch.autograd.detect_anomaly``, which
    raises in backward), so an ``optimizer.step()`` later in the block never uses it; one found
    without a backward is warned or raised per ``anomaly_detection_mode`` (``"warn"`` by default)
    when the block ends. Everything is restored on exit.

    Example::

        try:
            with debug_context(DebugLevel.BASIC, model=net) as dbg:
                loss_fn(net(x), y).backward()
                optimizer.step()
        except td.NonFiniteError as err:
            print(err.anomaly)   # the weights are as before the step

    Cost: op-level tracing of the block (see ``AutogradAnomalyDetector``).
    """
    debugger = PyTorchDebugger(level)
    with debugger.autograd_anomaly_detection(model):
        yield debugger


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _mean_or_nan(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def debug_operation(
    debug_mode: DebugMode | str = DebugMode.ANOMALY_DETECTION,
    debugger: PyTorchDebugger | None = None,
    *,
    model: nn.Module | None = None,
) -> Any:
    """Seed 004's decorator: run each call of the function inside ``debugger.debug_context(<name>)``.

    Args:
        debug_mode: builds ``PyTorchDebugger(debug_mode=...)`` when no ``debugger`` is given;
            ``ANOMALY_DETECTION``/``FULL_DEBUG`` trace each call op by op (costly: see
            ``AutogradAnomalyDetector``).
        debugger: an existing debugger whose history receives the records.
        model: the model whose modules and parameters an origin is named after; without it, the
            first ``nn.Module`` among the call's positional arguments is used (``training_step(model,
            ...)`` as in the seed), else origins name only the op and line.

    The wrapped function has ``.debugger`` set to the debugger used.

    Example::

        @debug_operation(DebugMode.ANOMALY_DETECTION)
        def training_step(model, x, y): ...
    """
    dbg = debugger if debugger is not None else PyTorchDebugger(debug_mode=debug_mode)

    def wrap(fn: Any) -> Any:
        import functools

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            named = model if model is not None else next((a for a in args if isinstance(a, nn.Module)), None)
            with dbg.debug_context(getattr(fn, "__name__", "operation"), model=named):
                return fn(*args, **kwargs)

        call.debugger = dbg  # type: ignore[attr-defined]
        return call

    return wrap

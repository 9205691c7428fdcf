"""Seed 004's calls of ``PyTorchDebugger``: gradient check, memory and resource profiles, optimisation."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..health.gradients import check_gradients
from ..memory.analysis import debug_memory_usage
from ._common import DebugInfo

log = logging.getLogger("torchdebug.compat")

if TYPE_CHECKING:
    from collections import deque

    from .._config import DebugConfig

# profile_memory feeds one leak test per sampling stride: a loop that calls it before and after each
# batch makes a staircase (every other change is flat), which the stride-2 test sees as steady growth
_LEAK_STRIDES = (1, 2, 4)
# seed 004's monitor_resources warned when torch.cuda.memory_allocated() / 1024 / 1024 > 8000
SEED_GPU_MEMORY_WARN_BYTES = 8000 * 1024 * 1024


class OptimizationCalls:
    """Seed 004's calls (a ``PyTorchDebugger`` part): ``check_gradients``, ``profile_memory``,
    ``monitor_resources``, ``optimize_model``, ``debug_metrics``."""

    config: DebugConfig
    debug_history: deque[DebugInfo]
    optimization_metrics: list[Any]
    _leaks: Any
    _profiles: int
    last_profile: Any = None  # the last profile_model_performance summary (the manager's report shows it)

    @property
    def debug_metrics(self) -> list[DebugInfo]:
        """Seed 004's per-operation metrics: the ``DebugInfo`` records of ``debug_history``, oldest first
        (``.mode``, ``.execution_time`` in s, ``.memory_usage``/``.gpu_memory`` in bytes,
        ``.gradient_anomalies``)."""
        return list(self.debug_history)

    def check_gradients(self, model: nn.Module, loss: torch.Tensor | None = None) -> dict[str, Any]:
        """Seed 004's gradient check: ``gradient_norm``, ``gradient_anomalies`` (text), ``parameter_stats``.

        ``gradient_anomalies`` lines start with ``"NaN/Inf"``, ``"exploding"`` or ``"vanishing"``
        (seed users tested ``"NaN" in line``); ``loss`` (optional) adds ``"NaN/Inf loss"`` and the
        ``loss`` value. Cost: one host transfer for the gradients, one for the loss.
        """
        rep = check_gradients(model, explode_abs=self.config.explode_abs)
        lines = [f"NaN/Inf gradient in {n} ({rep[n].nonfinite} non-finite elements)" for n in rep.nonfinite]
        lines += [f"exploding gradient in {n} (norm {rep[n].norm:.4g})" for n in rep.exploding]
        lines += [f"vanishing gradient in {n} (norm {rep[n].norm:.4g})" for n in rep.vanishing]
        out: dict[str, Any] = {
            "gradient_norm": rep.total_norm,
            "gradient_anomalies": lines,
            "parameter_stats": {p.name: p.to_dict() for p in rep.params},
        }
        if loss is not None:
            value = float(loss.detach().float().mean())  # the loss's one host transfer
            out["loss"] = value
            if not math.isfinite(value):
                lines.insert(0, f"NaN/Inf loss ({value})")
        return out

    def optimize_model(self, model: nn.Module, optimization_mode: Any = "full_optimization") -> nn.Module:
        """Seed 004's ``optimize_model``: apply an ``OptimizationMode`` and return the model to call.

        AMP wraps the model in ``torch.autocast`` (bf16 on CPU; float outputs come back float32),
        COMPILATION returns ``torch.compile(model)``, MEMORY_EFFICIENT checkpoints repeated blocks in
        place (and channels_last for conv nets), FULL_OPTIMIZATION all three; NONE returns ``model``.
        The record (``OptimizationMetrics``: mode, seconds to apply, what was applied) is appended to
        ``optimization_metrics``; its ``speedup_factor`` stays None here: measure it with
        ``td.compare_modes`` or ``PyTorchOptimizer.optimize_training_loop``.

        Raises:
            ValueError: unknown mode (lists the allowed ones).
        """
        from ._optimize import optimize_model_in_place

        return optimize_model_in_place(model, optimization_mode, self.optimization_metrics)

    def profile_memory(self, label: str = "") -> dict[str, Any]:
        """Seed 004's memory profile: ``td.memory.analysis.debug_memory_usage()`` plus ``cpu_memory`` (system %),
        ``gpu_memory`` (CUDA allocated bytes) and ``memory_leaks`` (robust growth test over calls).

        ``memory_leaks`` lists the series (``heap_in_use``, ``rss``, ``cuda_allocated``) whose
        Theil-Sen slope over the last ``config.leak_window`` samples is positive and steady (the
        engine's ``LeakDetector``). However often the calls sample (once per batch, or before and
        after each batch as the seed's loop does), a steady leak is found: the test runs on every
        call's sample and on every 2nd and 4th call's, so the flat half of a before/after staircase
        does not hide it. Empty until ``leak_window`` calls were made.
        """
        from ..memory.instrument import LeakDetector

        if self._leaks is None:
            window = max(3, self.config.leak_window)
            # stride -> (its detector, the trends of its last sample: kept until its next sample)
            self._leaks = {s: (LeakDetector(window=window, warmup=0), []) for s in _LEAK_STRIDES}
        out = debug_memory_usage()
        sample = {k: v for k, v in out.items() if isinstance(v, int)}
        found: dict[str, Any] = {}
        for stride, (detector, trends) in self._leaks.items():
            if self._profiles % stride == 0:
                trends[:] = detector.add(self._profiles // stride, sample)
            for t in trends:
                found.setdefault(t.series, (t, stride))
        self._profiles += 1
        out.update(
            label=label,
            cpu_memory=out["system_percent"],
            gpu_memory=out.get("cuda_allocated", 0),
            memory_leaks=[
                f"{t.series} grows {t.slope / stride:.0f} bytes per call over {t.samples * stride} calls"
                for t, stride in found.values()
            ],
        )
        return out

    def profile_memory_usage(self, model: nn.Module) -> dict[str, int]:
        """Seed 002's static memory profile of ``model`` in bytes: parameters, gradients, buffers, total.

        Shared parameters count once. Activations are not included: measure a forward with
        ``td.memory.analysis.measure_module_memory`` for those. Cost: metadata only, no device work.
        """
        params = list(model.parameters())  # deduplicated: a tied weight appears once
        grads = [p.grad for p in params if p.grad is not None]
        out = {
            "parameters": sum(p.numel() * p.element_size() for p in params),
            "gradients": sum(g.numel() * g.element_size() for g in grads),
            "buffers": sum(b.numel() * b.element_size() for b in model.buffers()),
        }
        out["total"] = out["parameters"] + out["gradients"] + out["buffers"]
        return out

    def profile_model_performance(
        self, model: nn.Module, dataloader: Any, num_batches: int = 10, **kwargs: Any
    ) -> Any:
        """Seed 000's profiler entry: ``td.perf.profiling.profile_model_performance`` (torch.profiler).

        ``kwargs``: ``loss_fn``, ``optimizer``, ``run_dir`` (folder for the Perfetto trace).
        Returns its ``ProfileSummary`` (top ops and modules by self time, idle and data shares).

        Cost: ``num_batches`` profiled steps plus a wait and a warm-up batch (about 2 s of profiler
        start-up the first time in a process).
        """
        from ..perf.profiling import profile_model_performance

        self.last_profile = profile_model_performance(model, dataloader, num_batches, **kwargs)
        return self.last_profile

    def monitor_resources(self, **kwargs: Any) -> dict[str, Any]:
        """Seed 004's resource check: ``td.perf.profiling.monitor_resources`` (CPU %, memory %, RSS, GPUs).

        With the seed's thresholds unless overridden: CPU and system memory above 90 %, a GPU's
        allocated memory above 8000 MiB (the seed's ``gpu_memory > 8000  # 8GB``, in MiB).
        """
        from ..perf.profiling import monitor_resources

        kwargs.setdefault("gpu_memory_threshold_bytes", SEED_GPU_MEMORY_WARN_BYTES)
        out = monitor_resources(**kwargs)
        for line in out["warnings"]:
            log.warning("%s", line)  # the seed logged each finding as a warning
        return out

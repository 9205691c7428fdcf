"""torchdebug: where the first NaN/Inf was born, gradient health, memory and time for PyTorch training.

The only public surface; everything else is private or reached through these names. Optional
extras are imported lazily: ``serve`` needs ``torchdebug[dashboard]``, ``render_report``'s HTML/PNG
need ``torchdebug[report]``, ``export_tensorboard`` needs ``torchdebug[tensorboard]``.

Importing the package costs next to nothing and does not import torch: each public name is loaded
on first use (``td.watch`` imports the session and torch; ``td.open_run`` only the SQLite reader),
so the command line's ``runs``/``show``/``report``/``serve`` and ``--help`` never import torch.

Example::

    import torchdebug as td

    with td.watch(model, optimizer) as mon:
        for x, y in loader:
            loss = loss_fn(model(x), y)
            optimizer.zero_grad(); loss.backward(); optimizer.step()
            mon.step()
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._errors import (
    ConfigError,
    InstrumentError,
    LossSpikeError,
    NonFiniteError,
    RunStoreError,
    SchemaVersionError,
    TorchDebugError,
    TorchDebugWarning,
)
from ._version import __version__

if TYPE_CHECKING:  # the names below load on first use (module __getattr__); mypy sees them here
    from ._config import DebugConfig, DebugLevel, DebugMode
    from .compat import (
        AsyncTrainingLogger,
        AutogradAnomalyDetector,
        DebugInfo,
        DiffusionModelDebugger,
        GradientDebugger,
        ModelDebugger,
        OptimizationMode,
        PyTorchDebugConfig,
        PyTorchDebugger,
        PyTorchDebugManager,
        PyTorchOptimizer,
        TrainingDebugger,
        TrainingPhase,
        check_gradient_anomalies,
        check_gradient_anomalies_async,
        check_tensor_anomalies,
        check_tensor_anomalies_async,
        detect_model_anomalies,
        validate_model_input,
    )
    from .events import Anomaly, ModuleFrame, Phase, RuleEvent, StepRecord
    from .health.gradients import (
        GradientFlow,
        GradientReport,
        analyze_gradient_flow,
        analyze_model_parameters,
        check_gradients,
    )
    from .health.inspection import ModelSummary, inspect_model
    from .health.spikes import SpikeReport
    from .memory.analysis import (
        ModuleMemoryTable,
        PyTorchMemoryDebugger,
        debug_memory_usage,
        live_tensors,
        measure_module_memory,
        profile_memory,
    )
    from .memory.instrument import OomReport, oom_report
    from .memory.recovery import run_step_with_oom_retry
    from .nonfinite.locate import locate_nonfinite
    from .perf.flops import FlopReport, count_flops
    from .perf.optimize import ModeComparison, ModeResult, compare_modes
    from .perf.profiling import (
        ProfileSummary,
        debug_performance,
        monitor_resources,
        profile,
        profile_model_performance,
    )
    from .session.monitor import Monitor, watch
    from .stats import TensorStats, analyze_tensor, foreach_norms, nonfinite_count, total_norm
    from .store import list_runs, open_run
    from .views.report import build_report, render_report, report

# public name -> the module that defines it, imported on first access
_LAZY = {
    "DebugConfig": "._config",
    "DebugLevel": "._config",
    "DebugMode": "._config",
    "AsyncTrainingLogger": ".compat",
    "AutogradAnomalyDetector": ".compat",
    "DebugInfo": ".compat",
    "DiffusionModelDebugger": ".compat",
    "GradientDebugger": ".compat",
    "ModelDebugger": ".compat",
    "OptimizationMode": ".compat",
    "PyTorchDebugConfig": ".compat",
    "PyTorchDebugger": ".compat",
    "PyTorchDebugManager": ".compat",
    "PyTorchOptimizer": ".compat",
    "TrainingDebugger": ".compat",
    "TrainingPhase": ".compat",
    "check_gradient_anomalies": ".compat",
    "check_gradient_anomalies_async": ".compat",
    "check_tensor_anomalies": ".compat",
    "check_tensor_anomalies_async": ".compat",
    "detect_model_anomalies": ".compat",
    "validate_model_input": ".compat",
    "Anomaly": ".events",
    "ModuleFrame": ".events",
    "Phase": ".events",
    "RuleEvent": ".events",
    "StepRecord": ".events",
    "GradientFlow": ".health.gradients",
    "SpikeReport": ".health.spikes",
    "GradientReport": ".health.gradients",
    "analyze_gradient_flow": ".health.gradients",
    "analyze_model_parameters": ".health.gradients",
    "check_gradients": ".health.gradients",
    "ModelSummary": ".health.inspection",
    "inspect_model": ".health.inspection",
    "ModuleMemoryTable": ".memory.analysis",
    "PyTorchMemoryDebugger": ".memory.analysis",
    "debug_memory_usage": ".memory.analysis",
    "live_tensors": ".memory.analysis",
    "measure_module_memory": ".memory.analysis",
    "profile_memory": ".memory.analysis",
    "OomReport": ".memory.instrument",
    "oom_report": ".memory.instrument",
    "run_step_with_oom_retry": ".memory.recovery",
    "locate_nonfinite": ".nonfinite.locate",
    "FlopReport": ".perf.flops",
    "count_flops": ".perf.flops",
    "ModeComparison": ".perf.optimize",
    "ModeResult": ".perf.optimize",
    "compare_modes": ".perf.optimize",
    "ProfileSummary": ".perf.profiling",
    "debug_performance": ".perf.profiling",
    "monitor_resources": ".perf.profiling",
    "profile": ".perf.profiling",
    "profile_model_performance": ".perf.profiling",
    "Monitor": ".session.monitor",
    "watch": ".session.monitor",
    "TensorStats": ".stats",
    "analyze_tensor": ".stats",
    "foreach_norms": ".stats",
    "nonfinite_count": ".stats",
    "total_norm": ".stats",
    "list_runs": ".store",
    "open_run": ".store",
    "build_report": ".views.report",
    "render_report": ".views.report",
    "report": ".views.report",
}


def __getattr__(name: str) -> Any:
    """Load a public name on first use and keep it in the module (later accesses cost nothing)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'torchdebug' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def serve(target: Any, host: str = "127.0.0.1", port: int = 6007, token: str | None = None) -> Any:
    """Start the dashboard for a live ``Monitor``, a ``TrainingDebugger`` or a run folder in a background thread.

    Needs ``pip install 'torchdebug[dashboard]'``. Returns a handle with ``.url`` and ``.stop()``.
    See :func:`torchdebug.views.server.serve` for the details.
    """
    from .views.server import serve as _serve

    return _serve(target, host=host, port=port, token=token)


def export_tensorboard(run: Any, logdir: Any) -> Any:
    """Write a run's scalars, histograms, anomalies, events and verdict as TensorBoard event files,
    under the same ``torchdebug/...`` names as ``watch(..., report_to=["tensorboard"])``.

    Needs ``pip install 'torchdebug[tensorboard]'``. See :func:`torchdebug.sinks.export_tensorboard`;
    W&B and MLflow: :func:`torchdebug.sinks.export_run`.
    """
    from .sinks import export_tensorboard as _export

    return _export(run, logdir)


__all__ = [
    "Anomaly",
    "AsyncTrainingLogger",
    "AutogradAnomalyDetector",
    "ConfigError",
    "DebugConfig",
    "DebugInfo",
    "DebugLevel",
    "DebugMode",
    "DiffusionModelDebugger",
    "FlopReport",
    "GradientDebugger",
    "GradientFlow",
    "GradientReport",
    "InstrumentError",
    "LossSpikeError",
    "ModeComparison",
    "ModeResult",
    "ModelDebugger",
    "ModelSummary",
    "ModuleFrame",
    "ModuleMemoryTable",
    "Monitor",
    "NonFiniteError",
    "OomReport",
    "OptimizationMode",
    "Phase",
    "ProfileSummary",
    "PyTorchDebugConfig",
    "PyTorchDebugManager",
    "PyTorchDebugger",
    "PyTorchMemoryDebugger",
    "PyTorchOptimizer",
    "RuleEvent",
    "RunStoreError",
    "SchemaVersionError",
    "SpikeReport",
    "StepRecord",
    "TensorStats",
    "TorchDebugError",
    "TorchDebugWarning",
    "TrainingDebugger",
    "TrainingPhase",
    "__version__",
    "analyze_gradient_flow",
    "analyze_model_parameters",
    "analyze_tensor",
    "build_report",
    "check_gradient_anomalies",
    "check_gradient_anomalies_async",
    "check_gradients",
    "check_tensor_anomalies",
    "check_tensor_anomalies_async",
    "compare_modes",
    "count_flops",
    "debug_memory_usage",
    "debug_performance",
    "detect_model_anomalies",
    "export_tensorboard",
    "foreach_norms",
    "inspect_model",
    "list_runs",
    "live_tensors",
    "locate_nonfinite",
    "measure_module_memory",
    "monitor_resources",
    "nonfinite_count",
    "oom_report",
    "open_run",
    "profile",
    "profile_memory",
    "profile_model_performance",
    "render_report",
    "report",
    "run_step_with_oom_retry",
    "serve",
    "total_norm",
    "validate_model_input",
    "watch",
]

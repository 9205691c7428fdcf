"""The seed-era facades: the class and function names five earlier systems promised, over the engine.

Each name is a thin layer over torchdebug's engine (the op-level tracer, fused gradient norms with
one host transfer, the robust health rules, the memory sampler, the run store). What changed for
users of the seeds:

- memory is reported in bytes (int) and time in seconds (float), as everywhere in torchdebug;
- a NaN/Inf is an :class:`~torchdebug.Anomaly` naming phase, module, op and line, and
  ``anomaly_detection_mode`` decides: record (``"detect"``), ``"warn"`` (``TorchDebugWarning``)
  or ``"raise"`` (``NonFiniteError``); the debugged training steps skip the update on a NaN/Inf;
- exploding/vanishing gradients, loss spikes and slow operations come from robust running rules
  (median/MAD), not fixed thresholds; histories are bounded;
- ``torch.autograd.set_detect_anomaly`` is never switched on: the tracer replaces it.

Seed 004's optimisation helpers (``optimize_model``, ``PyTorchOptimizer``, ``benchmark_optimizations``)
measure with ``td.compare_modes``: the same batches and seeds under each mode against a plain baseline.
"""

from __future__ import annotations

from ..memory.analysis import PyTorchMemoryDebugger
from ..perf.optimize import OptimizationMode
from ..session.runtime import disable_debugging, enable_debugging, get_debugging_status
from ._async import AsyncTrainingLogger, TrainingPhase
from ._checks import (
    check_gradient_anomalies,
    check_gradient_anomalies_async,
    check_tensor_anomalies,
    check_tensor_anomalies_async,
)
from ._common import ANOMALY_MODES, DebugInfo, TensorInfo
from ._debugger import AutogradAnomalyDetector, PyTorchDebugger, debug_context, debug_operation
from ._diffusion import DiffusionModelDebugger
from ._inputs import detect_model_anomalies, prediction_problems, validate_model_input
from ._optimize import OptimizationMetrics, PyTorchOptimizer, optimize_model
from ._seedconfig import PyTorchDebugConfig
from ._trainer import OptimizedTrainer, TrainingConfig
from ._training import GradientDebugger, ModelDebugger, PyTorchDebugManager, TrainingDebugger, step_numbers

__all__ = [
    "ANOMALY_MODES",
    "AsyncTrainingLogger",
    "AutogradAnomalyDetector",
    "DebugInfo",
    "DiffusionModelDebugger",
    "GradientDebugger",
    "ModelDebugger",
    "OptimizationMetrics",
    "OptimizationMode",
    "OptimizedTrainer",
    "PyTorchDebugConfig",
    "PyTorchDebugManager",
    "PyTorchDebugger",
    "PyTorchMemoryDebugger",
    "PyTorchOptimizer",
    "TensorInfo",
    "TrainingConfig",
    "TrainingDebugger",
    "TrainingPhase",
    "check_gradient_anomalies",
    "check_gradient_anomalies_async",
    "check_tensor_anomalies",
    "check_tensor_anomalies_async",
    "debug_context",
    "debug_operation",
    "detect_model_anomalies",
    "disable_debugging",
    "enable_debugging",
    "get_debugging_status",
    "optimize_model",
    "prediction_problems",
    "step_numbers",
    "validate_model_input",
]

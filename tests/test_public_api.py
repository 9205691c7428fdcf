"""The public surface of torchdebug is exactly this list (sorted), and importing it pulls in no extras."""

from __future__ import annotations

import subprocess
import sys

import torchdebug as td

PUBLIC = [
    "Anomaly", "AsyncTrainingLogger", "AutogradAnomalyDetector", "ConfigError", "DebugConfig", "DebugInfo", "DebugLevel",
    "DebugMode", "DiffusionModelDebugger", "FlopReport", "GradientDebugger", "GradientFlow", "GradientReport", "InstrumentError",
    "LossSpikeError", "ModeComparison", "ModeResult", "ModelDebugger", "ModelSummary", "ModuleFrame", "ModuleMemoryTable", "Monitor", "NonFiniteError",
    "OomReport", "OptimizationMode", "Phase", "ProfileSummary", "PyTorchDebugConfig", "PyTorchDebugManager", "PyTorchDebugger",
    "PyTorchMemoryDebugger", "PyTorchOptimizer", "RuleEvent", "RunStoreError", "SchemaVersionError", "SpikeReport", "StepRecord", "TensorStats",
    "TorchDebugError", "TorchDebugWarning", "TrainingDebugger", "TrainingPhase", "__version__", "analyze_gradient_flow",
    "analyze_model_parameters", "analyze_tensor", "build_report", "check_gradient_anomalies",
    "check_gradient_anomalies_async", "check_gradients", "check_tensor_anomalies",
    "check_tensor_anomalies_async", "compare_modes", "count_flops", "debug_memory_usage", "debug_performance",
    "detect_model_anomalies", "export_tensorboard", "foreach_norms", "inspect_model", "list_runs", "live_tensors", "locate_nonfinite",
    "measure_module_memory", "monitor_resources", "nonfinite_count", "oom_report", "open_run", "profile",
    "profile_memory", "profile_model_performance", "render_report", "report", "run_step_with_oom_retry", "serve",
    "total_norm", "validate_model_input", "watch",
]  # fmt: skip


def test_all_is_pinned_and_sorted() -> None:
    assert td.__all__ == PUBLIC
    assert sorted(td.__all__) == td.__all__
    assert all(hasattr(td, name) for name in td.__all__)


def test_error_tree() -> None:
    assert issubclass(td.NonFiniteError, td.TorchDebugError) and issubclass(td.NonFiniteError, RuntimeError)
    assert issubclass(td.ConfigError, ValueError) and issubclass(td.SchemaVersionError, td.RunStoreError)
    assert issubclass(td.TorchDebugWarning, UserWarning)


def test_import_pulls_in_no_optional_extra() -> None:
    code = (
        "import sys, torchdebug; "
        "print(sorted(m for m in ('fastapi', 'uvicorn', 'matplotlib', 'plotly', 'tensorboard', 'yaml') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

"""torchdebug: where the first NaN/Inf was born, gradient health, memory and time for PyTorch training.

The only public surface; everything else is private or reached through these names.
"""

from ._errors import (
    ConfigError,
    InstrumentError,
    NonFiniteError,
    RunStoreError,
    SchemaVersionError,
    TorchDebugError,
    TorchDebugWarning,
)
from ._config import DebugConfig, DebugLevel, DebugMode
from ._version import __version__
from .events import Anomaly, ModuleFrame, Phase, RuleEvent, StepRecord
from .locate import locate_nonfinite
from .monitor import Monitor, watch
from .stats import TensorStats, analyze_tensor
from .store import open_run

__all__ = [
    "Anomaly",
    "ConfigError",
    "DebugConfig",
    "DebugLevel",
    "DebugMode",
    "InstrumentError",
    "ModuleFrame",
    "Monitor",
    "NonFiniteError",
    "Phase",
    "RuleEvent",
    "RunStoreError",
    "SchemaVersionError",
    "StepRecord",
    "TensorStats",
    "TorchDebugError",
    "TorchDebugWarning",
    "__version__",
    "analyze_tensor",
    "locate_nonfinite",
    "open_run",
    "watch",
]

"""Seed 003's ``PyTorchDebugConfig`` and its mapping onto ``DebugConfig``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .._config import DebugConfig, DebugLevel, DebugMode
from .._errors import ConfigError

# What a facade does when it finds a NaN/Inf: record it only, also warn, or raise NonFiniteError.
ANOMALY_MODES = ("detect", "warn", "raise")


@dataclass
class PyTorchDebugConfig:
    """The seed-003 option names, validated and mapped onto :class:`DebugConfig` by ``to_debug_config()``.

    Mapping (seed name -> DebugConfig option):

    - enable_autograd_anomaly -> enable_autograd_anomaly (the NaN/Inf sentinel; facades trace
      ``debug_context`` blocks op by op when it is on)
    - enable_gradient_debugging -> enable_gradient_checking (gradient norms and rules)
    - enable_memory_debugging -> enable_memory_profiling (memory samples, leak test)
    - enable_profiling -> enable_performance_profiling (step timing)
    - track_tensor_memory -> per_module_memory (bytes per module)
    - gradient_norm_threshold -> explode_abs (absolute bound of the explosion rule; the robust
      relative rule runs as well)
    - gradient_clip_threshold -> clip_on_spike (clip to this norm on detected spikes only)
    - memory_snapshot_frequency -> memory_every
    - enable_model_debugging, enable_training_debugging: kept for the seeds' code; model inspection
      and the training debugger run on demand, so these switch nothing on.
    - anomaly_detection_mode (not in the seed): what the facades do on a NaN/Inf: ``"detect"``
      (record), ``"warn"`` or ``"raise"`` (default, as torch's ``detect_anomaly`` raises).

    The resulting config has ``mode="none"``: only what these switches enable runs, as in the seed.
    Invalid values raise ``ConfigError`` at construction.

    Example:
        >>> cfg = PyTorchDebugConfig(enable_autograd_anomaly=True, gradient_norm_threshold=1e3)
        >>> sorted(cfg.to_debug_config().instruments())
        ['gradients', 'memory', 'nonfinite']
    """

    enable_autograd_anomaly: bool = False
    enable_gradient_debugging: bool = True
    enable_memory_debugging: bool = True
    enable_model_debugging: bool = True
    enable_training_debugging: bool = True
    enable_profiling: bool = False
    gradient_norm_threshold: float = 1e4
    gradient_clip_threshold: float | None = None
    track_tensor_memory: bool = False
    memory_snapshot_frequency: int = 50
    anomaly_detection_mode: str = "raise"
    level: DebugLevel | str = DebugLevel.INTERMEDIATE

    def __post_init__(self) -> None:
        if not isinstance(self.anomaly_detection_mode, str) or (
            self.anomaly_detection_mode.strip().lower() not in ANOMALY_MODES
        ):
            raise ConfigError(
                f"anomaly_detection_mode={self.anomaly_detection_mode!r} is not valid; "
                f"expected one of {', '.join(ANOMALY_MODES)}"
            )
        self.anomaly_detection_mode = self.anomaly_detection_mode.strip().lower()
        self.to_debug_config()  # validates every mapped value now, naming the DebugConfig option

    def to_debug_config(self, **overrides: Any) -> DebugConfig:
        """The equivalent :class:`DebugConfig` (``overrides`` are DebugConfig options applied last).

        Raises:
            ConfigError: a value of the wrong type or out of range (names the DebugConfig option).
        """
        options: dict[str, Any] = {
            "mode": DebugMode.NONE,
            "level": self.level,
            "enable_autograd_anomaly": self.enable_autograd_anomaly,
            "enable_gradient_checking": self.enable_gradient_debugging,
            "enable_memory_profiling": self.enable_memory_debugging,
            "enable_performance_profiling": self.enable_profiling,
            "per_module_memory": self.track_tensor_memory,
            "explode_abs": self.gradient_norm_threshold,
            "clip_on_spike": self.gradient_clip_threshold,
            "memory_every": self.memory_snapshot_frequency,
            # DebugConfig knows warn/raise; "detect" is a facade-only mode that never raises
            "anomaly_detection_mode": "raise" if self.anomaly_detection_mode == "raise" else "warn",
        }
        options.update(overrides)
        return DebugConfig(**options)

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain values."""
        d = dataclasses.asdict(self)
        d["level"] = str(self.level)
        return d

"""The exception and warning tree of torchdebug.

TorchDebugError (Exception)
├── NonFiniteError (also RuntimeError)   .anomaly: the Anomaly that tripped the sentinel
├── RunStoreError                        a run folder or database cannot be read or written
│   └── SchemaVersionError               the database was written by a newer torchdebug
├── ConfigError (also ValueError)        an unknown option, wrong type or unknown option string
├── InstrumentError                      an instrument failed (it is switched off, training goes on)
└── LossSpikeError (also RuntimeError)   .report: the SpikeReport (on_spike="raise", or max_rollbacks)

TorchDebugWarning (UserWarning)          warnings torchdebug emits (instrument off, rule events)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .events import Anomaly


class TorchDebugError(Exception):
    """Base class of every error torchdebug raises."""


class NonFiniteError(TorchDebugError, RuntimeError):
    """A NaN/Inf was found; ``.anomaly`` says where it was born.

    ``str(error)`` is the anomaly's multi-line report.
    """

    def __init__(self, anomaly: Anomaly) -> None:
        self.anomaly = anomaly
        super().__init__(str(anomaly))


class RunStoreError(TorchDebugError):
    """A run folder or its database cannot be opened, read or written."""


class SchemaVersionError(RunStoreError):
    """The run database has a schema version newer than this torchdebug understands."""


class ConfigError(TorchDebugError, ValueError):
    """A configuration value is unknown, of the wrong type, or out of range."""


class InstrumentError(TorchDebugError):
    """An instrument failed; it has been switched off."""


class TorchDebugWarning(UserWarning):
    """Warnings emitted by torchdebug (rule events, instruments switched off)."""


class LossSpikeError(TorchDebugError, RuntimeError):
    """The loss spiked and ``on_spike="raise"``, or it spiked again after ``max_rollbacks`` rollbacks.

    ``.report`` is the spike's ``SpikeReport`` (``torchdebug.health.spikes``): its cause and numbers.
    """

    def __init__(self, message: str, report: Any = None) -> None:
        self.report = report
        super().__init__(message)

"""The session as its own parts see it (the plain-loop driver, the async reads, the coordinator, live
control): :class:`~torchdebug._step.SessionView` plus its parts (the step now running, the models) and
the few internals they share. ``Monitor`` satisfies it (checked by mypy where it hands itself
over); these modules import this protocol, never ``monitor.py``, so no module of ``session/`` imports
the session in a circle."""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol

from torch import nn

from .._config import DebugConfig
from .._step import SessionView, StepState
from .._tensors import Items
from ..events import StepRecord
from ..nonfinite.hyperparams import HyperparameterCheck
from ..nonfinite.sentinel import Sentinel
from .models import Models
from .transfer import Transfer
from .verdicts import Verdicts


class StepPath(Protocol):
    """The session's :class:`~torchdebug.session.step.Step` (``mon.stepper``) as the drivers and the
    async reads call it: the step now running and the step protocol's boundaries (docs/architecture.md);
    a protocol here because step.py imports this module."""

    state: StepState
    grads: Any  # the gradients measured after backward() or inside a clip (session/gradcheck.py)

    def forward_started(
        self, module: nn.Module, args: tuple, kwargs: dict, outside: bool = False
    ) -> None: ...
    def forward_done(self, module: nn.Module, args: tuple, output: Any, outside: bool = False) -> None: ...
    def backward_started(self, loss: Any, gradient: Any) -> None: ...
    def backward_done(self) -> None: ...
    def update_starting(self, opt: Any = None) -> None: ...
    def update_done(self, opt: Any = None) -> None: ...
    def scaler_step_started(self, scaler: Any) -> None: ...
    def scaler_step_done(self, scaler: Any, failed: bool = False) -> None: ...
    def judge(self, *, at_optimizer: bool, opt: Any = None) -> None: ...
    # what the async reads re-run one step later (the blocking path's own pieces)
    def items(self) -> Items: ...
    def collect(self) -> Items: ...
    def decode(self) -> None: ...
    def record(self, lr: tuple[float, ...] | None = None, time_s: float | None = None) -> StepRecord: ...
    def each(self, method: str, *args: Any) -> None: ...
    def keep(self, record: StepRecord) -> None: ...


class Session(SessionView, Protocol):
    """A watch session (``Monitor``) as the session's own modules use it."""

    sentinel: Sentinel
    verdicts: Verdicts
    models: Models  # the roots and the optimizers (session/models.py)
    records: deque[StepRecord]
    _async: Any  # the async reads (session/deferred.py) or None
    _last_step_end: float
    _coord: Any  # the distributed coordinator or None
    _plain: Any  # the plain-loop driver (session/driver.py)
    _called: nn.Module  # the module the loop calls (a torch.compile wrapper: that)
    _enabled: frozenset[str]
    hyperparams: HyperparameterCheck  # lr, eps, betas ... checked before each update
    step_scalars: dict[str, float]
    spikes: list[Any]  # SpikeReports (session/rollback.py)
    rollbacks: list[Any]  # Rollbacks under on_spike="rollback"

    @property
    def stepper(self) -> StepPath: ...  # the step now running and the step protocol's boundaries
    @property
    def transfer(self) -> Transfer: ...  # the step's device numbers: all of them, for the session's parts
    def _disable(self, inst: Any, exc: BaseException) -> None: ...
    def _call(self, inst: Any, method: str, *args: Any) -> Any: ...
    def step(self) -> StepRecord: ...
    def accepts_backward(self) -> bool: ...
    def reconfigure(self, **changes: Any) -> DebugConfig: ...


__all__ = ["Session", "StepPath"]

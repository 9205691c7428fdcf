"""One training step's state as the session and its instruments see it: typed, with its phase.

The shared contract between the session (``session/``) and the parts it drives (the sentinel in
``nonfinite/``, the instruments): :class:`Readout` (the step's own numbers after its one read),
:class:`StepState` (everything one step accumulates, reset at its end), :class:`Verdict` (what the
sentinel decides, applied by the session) and the protocols :class:`SessionView` (the narrow view of
the session that instruments and the sentinel receive) and :class:`Instrument`.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import itertools
import math
import operator
from typing import Any

from ._tensors import grad_of, version_of
from .events import Anomaly, RuleEvent


@dataclasses.dataclass(eq=False)
class Readout:
    """The session's own numbers of one step after the read, by kind, each in the order its items were
    added (an item's name says its kind: :data:`SLOTS`). Empty lists: nothing of that kind this step."""

    losses: list[float] = dataclasses.field(default_factory=list)  # per micro-step loss (a mean if not 0-dim)
    micro_bad: list[float] = dataclasses.field(
        default_factory=list
    )  # per micro-step "a gradient is non-finite"
    gnorm: list[float] = dataclasses.field(default_factory=list)  # per measured gradient: norm or probe sum
    scale: float | None = None  # the loss scale the step's backward saw (GradScaler)
    edit: list[float] = dataclasses.field(
        default_factory=list
    )  # probe of the gradients edited since backward
    clips: list[float] = dataclasses.field(
        default_factory=list
    )  # per clip_grad_norm_ call: factor non-finite
    param_probe: list[float] = dataclasses.field(default_factory=list)  # the last update's parameter probe
    late_edit: list[float] = dataclasses.field(default_factory=list)  # an edit after a manual-update check
    dist: list[float] = dataclasses.field(default_factory=list)  # the coordinator's all-reduced vector
    other_rank_loss_bad: bool = False  # another rank's loss was non-finite (the coordinator's exact round)

    def any_loss_bad(self) -> bool:
        return self.other_rank_loss_bad or not all(map(math.isfinite, self.losses))


# item name -> the Readout field its numbers go to (the session's own items)
SLOTS: dict[str, str] = {
    "_loss": "losses",
    "_mbad": "micro_bad",
    "_gnorm": "gnorm",
    "_edit": "edit",
    "_clip": "clips",
    "_def_param_norms": "param_probe",
    "_def_edit": "late_edit",
    "_dist": "dist",
}


class StepPhase(str, enum.Enum):
    """Where the step now running is in the step protocol (docs/architecture.md)."""

    FORWARD = "forward"  # the step began (its first forward, or nothing yet)
    BACKWARD = "backward"  # a backward ended; more micro-steps may follow
    UPDATE = "update"  # the update started: the step's numbers were read and judged
    UPDATED = "updated"  # the update finished (its parameter probe is queued)


class SeenGrads:
    """The gradient tensors backward() left and their ``_version`` s, by parameter index: the edit check
    compares them with the gradients as the update starts. Built with one C-level pass per backward."""

    __slots__ = ("grads", "idx", "versions", "whole")

    def __init__(self, idx: list[int] | None = None, grads: list[Any] | None = None, n: int = 0) -> None:
        self.idx: list[int] = idx or []
        self.whole = idx is not None and grads is not None and len(idx) == n  # every parameter, in order
        if self.whole:
            self.grads: list[Any] = grads  # type: ignore[assignment]
        else:
            self.grads = [None] * n
            for i, g in zip(self.idx, grads or ()):
                self.grads[i] = g
        self.versions: list[int] = (
            list(map(version_of, self.grads))
            if self.whole
            else [-1 if g is None else g._version for g in self.grads]
        )

    def get(self, i: int) -> Any:
        """The gradient parameter i had after backward(), or None."""
        return self.grads[i] if 0 <= i < len(self.grads) else None

    def same(self, i: int, g: Any) -> bool:
        """Parameter i's gradient is the tensor backward() left, unchanged since."""
        return 0 <= i < len(self.grads) and self.grads[i] is g and self.versions[i] == g._version

    def unchanged(self, grads: list[Any]) -> bool:
        """Every gradient (``grads``: all parameters, in order) is the one backward() left, unchanged."""
        return (
            self.whole
            and len(grads) == len(self.grads)
            and all(map(operator.is_, grads, self.grads))
            and list(map(version_of, grads)) == self.versions
        )

    def rebase(self, idx: list[int], params: list[Any]) -> None:
        """Those gradients changed in a way judged elsewhere (a clip's factor): take them as seen now."""
        if self.whole and idx is self.idx:  # the clip's fast path: every gradient
            self.grads = list(map(grad_of, params))
            if not any(map(operator.is_, self.grads, itertools.repeat(None))):  # a C loop
                self.versions = list(map(version_of, self.grads))
                return
            self.whole = False
            self.versions = [-1 if g is None else g._version for g in self.grads]
            return
        for i in idx:
            g = params[i].grad
            if g is not None and 0 <= i < len(self.grads):
                self.grads[i] = g
                self.versions[i] = g._version


@dataclasses.dataclass(eq=False)
class StepState:
    """Everything one training step accumulates, in one place, with its phase.

    Owned by the session (``mon.state``) and reset at each step end; the sentinel reads and writes it
    through the session, the transfer holds its device numbers and their :class:`Readout`. Under
    ``sync="async"`` a step's state is kept whole until its numbers are read one step later
    (:meth:`detach`), then put back to judge it.
    """

    transfer: Any  # the step's device numbers and their read (session/transfer.py ``Transfer``)
    phase: StepPhase = StepPhase.FORWARD
    new_micro_step: bool = True  # the next forward is the first of a micro-step
    lr_used: tuple[float, ...] | None = None  # the lr of each param group as the update started
    events: list[RuleEvent] = dataclasses.field(default_factory=list)  # the rule events of this step
    # the sentinel's: what a replay needs, per micro-step (references to the batch, RNG, outputs)
    captures: list[Any] = dataclasses.field(default_factory=list)
    cap: Any = None  # the capture of the micro-step now running
    # what backward() left, for the edit check as the update starts
    seen: SeenGrads = dataclasses.field(default_factory=lambda: SeenGrads())
    edit_index: list[int] = dataclasses.field(default_factory=list)  # gradients changed since backward()
    edit_probe: Any = None  # their finiteness probe (a device tensor), read with the step's transfer
    edit_bad: list[int] = dataclasses.field(default_factory=list)  # ... non-finite as the update started
    # clip_grad_norm_ calls: (device flag "the clip factor is non-finite", the gradients it scaled)
    clips: list[tuple[Any, list[int]]] = dataclasses.field(default_factory=list)
    synced_at_backward: bool = False  # manual mode: the transfer ran at the end of backward()
    grad_anomaly: bool = False  # this step's anomaly came from the gradient check
    params_bad_now: bool = False  # the parameter probe read with this step's transfer was non-finite
    opt_ran: bool = False  # an optimizer update of the session started
    opt_ran_in_scaler: bool = False  # ... inside GradScaler.step (the scaler did not skip it)
    scaler_ran: bool = False
    scaler_skipped: bool = False
    # the verdict
    step_anomaly: Anomaly | None = None
    skipped: bool = False
    skip_reason: str = ""

    def reset(self) -> None:
        """The step ended: a fresh state for the next one (the transfer keeps what outlives a step)."""
        transfer = self.transfer
        transfer.reset()
        self.__init__(transfer)  # type: ignore[misc]

    def detach(self) -> StepState:
        """This step's state is kept (``sync="async"``); the next step gets a fresh one and its own
        per-step containers in a copy of the transfer (what outlives a step: the last norms, the plan)."""
        fresh = copy.copy(self.transfer)
        fresh.reset()  # reset assigns new containers: the kept step's stay its own
        return StepState(fresh)

"""One training step's state as the session and its instruments see it: typed, with its phase.

The shared contract between the session (``session/``) and the parts it drives (the sentinel in
``nonfinite/``, the instruments): :class:`Readout` (the step's own numbers after its one read),
:class:`StepState` (everything one step accumulates, reset at its end), :class:`Verdict` (what the
sentinel decides, applied by the session) and the protocols :class:`SessionView` (the narrow view of
the session that instruments and the sentinel receive) and :class:`Instrument`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import itertools
import math
import operator
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, NamedTuple, Protocol, runtime_checkable

import torch
from torch import nn

from ._config import DebugConfig
from ._tensors import Items, Reduced, alone, grad_of, version_of, versions_of
from .events import Anomaly, RuleEvent


@dataclasses.dataclass(eq=False)
class Readout:
    """The session's own numbers of one step after the read, by kind, each in the order its items were
    added (an item's name says its kind: :data:`SLOTS`). Empty lists: nothing of that kind this step."""

    losses: list[float] = dataclasses.field(default_factory=list)  # per micro-step loss (a mean if not 0-dim)
    micro_bad: list[float] = dataclasses.field(
        default_factory=list
    )  # per micro-step "a gradient is non-finite"
    # per micro-step whose gradients were read as one total (the sum of their squares, or of their
    # elements under the sentinel alone): finite iff every gradient is; its flag goes to ``micro_bad``
    micro_tot: list[float] = dataclasses.field(default_factory=list)
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
    # several ranks: the step's decision every rank takes (the coordinator's ``agree``, between the read
    # and the verdict); None: this rank's own numbers decide
    agreed: bool | None = None

    def any_loss_bad(self) -> bool:
        return self.other_rank_loss_bad or not all(map(math.isfinite, self.losses))


# item name -> the Readout field its numbers go to (the session's own items)
SLOTS: dict[str, str] = {
    "_loss": "losses",
    "_mbad": "micro_bad",
    "_mtot": "micro_tot",  # also sets the micro-step's ``micro_bad`` flag (session/transfer.py)
    "_gnorm": "gnorm",
    "_edit": "edit",
    "_clip": "clips",
    "_def_param_norms": "param_probe",
    "_def_edit": "late_edit",
    "_dist": "dist",
}


class StepPhase(str, enum.Enum):
    """Where the step now running is in the step protocol (docs/architecture.md). A forward in any
    phase but ``FORWARD`` is the first of a micro-step."""

    START = "start"  # the step began: nothing of it ran yet
    FORWARD = "forward"  # a micro-step's first forward ran
    BACKWARD = "backward"  # a backward ended; more micro-steps may follow
    UPDATE = "update"  # the update started: the step's numbers were read and judged
    UPDATED = "updated"  # the update finished (its parameter probe is queued)


class Update(str, enum.Enum):
    """What became of the step's optimizer update, each set where the step protocol learns it (a
    skip by the session's policy is the step's ``skip_reason``)."""

    NONE = "none"  # no update of the session's started
    IN_SCALER = "in_scaler"  # GradScaler.step began; it has not called the optimizer (yet)
    RAN = "ran"  # an update started (the optimizer's pre-hook, or a driver)
    RAN_IN_SCALER = "ran_in_scaler"  # ... inside GradScaler.step: the scaler let it run
    SCALER_SKIPPED = "scaler_skipped"  # GradScaler.step returned without calling the optimizer


SCALER_RAN = frozenset({Update.IN_SCALER, Update.RAN_IN_SCALER, Update.SCALER_SKIPPED})  # scaler.step ran


class Found(str, enum.Enum):
    """Where a NaN/Inf of the step was found (``StepState.found``: its anomaly's; ``StepState.params``:
    the parameter probe read with its numbers)."""

    NONE = "none"
    GRADIENTS = "gradients"  # the step's loss or gradients (the gradient check)
    PARAMETERS = "parameters"  # the parameter probe read with this step's numbers


class Measure(str, enum.Enum):
    """When the step's gradients were measured."""

    AT_BACKWARD = "at_backward"  # as backward() left them
    # after code had changed them (a measure held for a clip that did not come first,
    # session/gradcheck.py): a non-finite number may be that code's, not backward()'s
    AFTER_EDIT = "after_edit"


class SeenGrads:
    """The gradient tensors backward() left and their ``_version`` s, by parameter index: the edit check
    compares them with the gradients as the update starts. Built with one C-level pass per backward.

    ``bump``: clips since backward() that scaled every gradient in place once each (the session's own,
    session/gradcheck.py): each adds one to every version, so the check expects ``versions + bump``
    without reading the gradients again.

    ``watched``: no versions were read; a watch on the torch calls between backward() and the update
    (:class:`~torchdebug.nonfinite.edits.EditWatch`) keeps the tensors written there (``written``: an
    in-place op's tensor, an ``out=``, the parameter whose ``.grad`` was set) and sets ``touched`` when
    it cannot tell what a write reached (an alias such as ``p.grad.data``, a long list), or when
    something went unwatched (the watch closed early). Neither: every gradient is the one backward()
    left, unchanged, with no pass over the list."""

    __slots__ = (
        "_by_grad",
        "bump",
        "grads",
        "idx",
        "index",
        "touched",
        "versions",
        "vsum",
        "watched",
        "whole",
        "written",
    )

    def __init__(
        self,
        idx: list[int] | None = None,
        grads: list[Any] | None = None,
        n: int = 0,
        versions: list[int] | None = None,
        watched: bool = False,
        index: Mapping[int, int] | None = None,
    ) -> None:
        self.idx: list[int] = idx or []
        self.whole = idx is not None and grads is not None and len(idx) == n  # every parameter, in order
        self.watched = watched
        self.index: Mapping[int, int] = index or {}  # id(parameter) -> its index (for what was written)
        self.touched = False
        self.written: list[Any] = []
        self._by_grad: dict[int, int] | None = None  # id(gradient) -> index, built when first needed
        if self.whole:
            self.grads: list[Any] = grads  # type: ignore[assignment]
            if watched:
                self.versions: list[int] = []
            else:
                self.versions = versions if versions is not None else list(map(version_of, grads))  # type: ignore[arg-type]
        else:
            self.grads = [None] * n
            for i, g in zip(self.idx, grads or ()):
                self.grads[i] = g
            self.versions = [] if watched else _versions_or_missing(self.grads)
        self.vsum = sum(self.versions)  # a C loop over ints
        self.bump = 0

    def get(self, i: int) -> Any:
        """The gradient parameter i had after backward(), or None."""
        return self.grads[i] if 0 <= i < len(self.grads) else None

    def same(self, i: int, g: Any) -> bool:
        """Parameter i's gradient is the tensor backward() left, unchanged since (watched: the same
        tensor; what the watch saw written is the caller's to add, :meth:`edited_by_writes`)."""
        if not (0 <= i < len(self.grads) and self.grads[i] is g):
            return False
        return self.watched or self.versions[i] + self.bump == g._version

    def wrote(self, target: Any) -> None:
        """The watch saw a write to ``target``: a tensor, a list of them (a ``_foreach_*_`` call), or
        something it cannot follow (then every gradient counts as edited)."""
        items = target if isinstance(target, (list, tuple)) else (target,)
        if len(self.written) + len(items) > MAX_WRITTEN or not all(
            isinstance(t, torch.Tensor) for t in items
        ):
            self.touched = True
        else:
            self.written.extend(items)

    def edited_by_writes(self) -> set[int] | None:
        """The parameter indices whose gradients the watched writes reached (a gradient itself, or a
        parameter: its ``.grad`` set, or the parameter written), or None when the gradients were touched
        or a write reached a tensor sharing its memory with another (an alias such as ``p.grad.data``:
        every gradient counts as edited). A write to a tensor of its own (a running loss ``total +=
        loss.detach()``) reaches no gradient. A pass over the list, only when something was written."""
        if self.touched:
            return None
        if not self.written:
            return set()
        if self._by_grad is None:  # C-level (no Python loop over the parameters)
            self._by_grad = dict(zip(map(id, self.grads), itertools.count()))
        by_grad = self._by_grad
        out: set[int] = set()
        for t in self.written:  # at most MAX_WRITTEN
            i = by_grad.get(id(t), self.index.get(id(t)))
            if i is not None:
                out.add(i)
            elif not alone(t):
                return None
        return out

    def unchanged(self, grads: list[Any]) -> bool:
        """Every gradient (``grads``: all parameters, in order) is the one backward() left, unchanged.

        Two C-level passes: the same tensors, and the sum of their versions. A version only grows, and
        each is at least ``versions[i] + bump`` (the clips scaled every one), so an equal sum means
        each is exactly that. Unwatched gradients only (watched: :meth:`unedited`)."""
        return (
            self.whole
            and len(grads) == len(self.grads)
            and all(map(operator.is_, grads, self.grads))
            and sum(map(version_of, grads)) == self.vsum + self.bump * len(grads)
        )

    def unedited(self, params: list[Any]) -> bool:
        """:meth:`unchanged` for the gradients ``params`` hold now; watched: no read of them (replacing a
        ``.grad`` from Python goes through the watch too), nothing written that reaches one."""
        if self.watched:
            return self.whole and self.edited_by_writes() == set()
        return self.unchanged(list(map(grad_of, params)))

    def rebase(self, idx: list[int], params: list[Any]) -> None:
        """Those gradients changed in a way judged elsewhere (a clip's factor): take them as seen now."""
        if self.watched:
            return  # the clip scaled them in place (judged by its factor); the watch goes on after it
        if self.whole and idx is self.idx:  # the clip's fast path: every gradient
            self.grads = list(map(grad_of, params))
            self.bump = 0
            versions = versions_of(self.grads)  # None: a gradient went missing
            self.whole = versions is not None
            self.versions = versions if versions is not None else _versions_or_missing(self.grads)
        else:
            for i in idx:
                g = params[i].grad
                if g is not None and 0 <= i < len(self.grads):
                    self.grads[i] = g
                    self.versions[i] = g._version - self.bump
        self.vsum = sum(self.versions)


MAX_WRITTEN = 64  # tensors a watch keeps as written; more: every gradient counts as edited


def _versions_or_missing(grads: list[Any]) -> list[int]:
    """Each gradient's ``_version``, -1 where there is none (the per-index path of :class:`SeenGrads`)."""
    return [-1 if g is None else g._version for g in grads]


# no gradients seen (a new step, or after an update): no list and nothing watched, so what the edit check
# reads of it never changes (``written`` and ``bump`` change only a watched or whole one); shared
NO_GRADS = SeenGrads()


@dataclasses.dataclass(eq=False)
class StepState:
    """Everything one training step accumulates, in one place, with its phase.

    Owned by the session's :class:`~torchdebug.session.step.Step`, a new one for each step
    (:meth:`next`); handed to the sentinel with each call, the transfer holds its device numbers and
    their :class:`Readout`. Under ``sync="async"`` a step's state is kept whole until its numbers are
    read one step later, then put back to judge it. The facts are enums set in one place each (no
    flags): ``phase``, ``update`` (what became of the update), ``read_at``, ``found``, ``measure``.
    """

    transfer: Any  # the step's device numbers and their read (session/transfer.py ``Transfer``)
    phase: StepPhase = StepPhase.START
    # id(optimizer) -> the lr of each of its param groups as its update started
    lr_used: dict[int, tuple[float, ...]] = dataclasses.field(default_factory=dict)
    events: list[RuleEvent] = dataclasses.field(default_factory=list)  # the rule events of this step
    # the sentinel's: what a replay needs, per micro-step (references to the batch, RNG, outputs)
    captures: list[Any] = dataclasses.field(default_factory=list)
    cap: Any = None  # the capture of the micro-step now running
    # what backward() left, for the edit check as the update starts (NO_GRADS: nothing yet)
    seen: SeenGrads = NO_GRADS
    edit_index: list[int] = dataclasses.field(default_factory=list)  # gradients changed since backward()
    edit_probe: Any = None  # their finiteness probe (a device tensor), read with the step's transfer
    edit_bad: list[int] = dataclasses.field(default_factory=list)  # ... non-finite as the update started
    measure: Measure = Measure.AT_BACKWARD
    # clip_grad_norm_ calls: (device flag "the clip factor is non-finite", the gradients it scaled, None),
    # or (its total norm, the gradients, max_norm): the factor is worked out on the host after the read
    clips: list[tuple[Any, list[int], float | None]] = dataclasses.field(default_factory=list)
    # several models (the session's roots): every watched model's forward in the step is recorded
    fwd_depth: int = 0  # watched models' forwards running now (one called inside another is part of it)
    entry: int | None = None  # the tape index of a later forward running now (-1: not recorded)
    tape_only: set[int] = dataclasses.field(default_factory=set)  # captures with no forward of their own
    micro_base: int = 0  # micro-steps before the update now starting (its own are counted from here)
    updating: Any = None  # the optimizer whose update is starting (None: a driver's, unnamed)
    # BACKWARD: the step was read and judged at the end of backward() (an update by hand comes next)
    read_at: StepPhase | None = None
    update: Update = Update.NONE
    found: Found = Found.NONE  # GRADIENTS: this step's anomaly came from the gradient check
    params: Found = Found.NONE  # PARAMETERS: the parameter probe read with this step's numbers was not finite
    # the verdict
    step_anomaly: Anomaly | None = None
    skip_reason: str = ""  # why the step is skipped ("": it is not)
    skipped_updates: list[Any] = dataclasses.field(
        default_factory=list
    )  # optimizers whose update was dropped

    @property
    def skipped(self) -> bool:
        """The step is skipped (by the policy, or the GradScaler skipped its update)."""
        return bool(self.skip_reason)

    def next(self) -> StepState:
        """The step ended: a new state for the next one, with the transfer (its per-step containers new,
        what outlives a step kept: the last norms, the plan)."""
        transfer = self.transfer
        transfer.reset()
        return StepState(transfer)

    def detach(self) -> StepState:
        """This step's state is kept (``sync="async"``); the next step gets a new one and its own
        per-step containers in a copy of the transfer (what outlives a step: the last norms, the plan)."""
        fresh = copy.copy(self.transfer)
        fresh.reset()  # reset assigns new containers: the kept step's stay its own
        return StepState(fresh)


VerdictKind = Literal["ok", "skip", "anomaly"]
SCALER_SKIP = "GradScaler found inf/NaN gradients (loss scale too high)"  # the reason of a scaler's skip


class Verdict(NamedTuple):
    """What the sentinel decided about a step; the session applies it (records, the policy, skips).

    ``ok``: nothing to do. ``skip``: the step is skipped without an anomaly (``reason``; ``by_scaler``:
    the GradScaler skipped its update, counted but not announced). ``anomaly``: a NaN/Inf was found;
    the session records it (``fresh``; an anomaly recorded earlier in the step only lets ``policy="skip"``
    drop the gradients of ``opt``) and applies the policy: ``raise`` raises, ``skip`` drops the
    gradients of ``opt`` (the update about to run) or, when the GradScaler skips the update anyway
    (``by_scaler``), records the step as skipped; ``warn`` warns. ``late``: found after the update ran,
    so no policy can skip it (``raise`` raises, the others warn).
    """

    kind: VerdictKind
    anomaly: Anomaly | None = None
    reason: str = ""
    by_scaler: bool = False
    opt: Any = None
    fresh: bool = True
    late: bool = False
    # an anomaly still to be built by replaying the step (``anomaly`` None): "now", or "late" (checked
    # at the step end after an update the session did not see start); the session builds it, on every
    # rank through the coordinator
    replay: str = ""

    @property
    def ok(self) -> bool:
        return self.kind == "ok"


OK = Verdict("ok")


class TransferView(Protocol):
    """What the sentinel and the coordinator read of the step's device numbers (``session/transfer.py``)."""

    synced: bool
    values: dict[str, float]
    vectors: dict[str, list[float]]
    readout: Readout
    loss_vals: list[torch.Tensor]
    micro_bad: list[torch.Tensor]
    norms: torch.Tensor | None
    norm_index: list[int]
    norms_probe: bool
    micro_bad_cleared: bool
    shared: tuple[list[int], int] | None
    scale_used: torch.Tensor | None
    grad_norm: float | None
    grad_norms: list[float] | None
    reduced: Reduced | None  # the last backward's gradients reduced on the device, not read yet

    def plan(self, params: list[torch.Tensor]) -> tuple[Any, list[int]]: ...
    def fill_shares(self, whole: list[float]) -> None: ...
    def losses_bad(self) -> list[int]: ...
    def any_loss_bad(self) -> bool: ...
    def micro_flagged(self) -> bool: ...
    def first_bad_micro(self) -> int | None: ...
    def reset(self) -> None: ...
    def per_tensor_items(self) -> Items: ...  # the last backward's per-parameter numbers, for the read
    def norms_later(self) -> Callable[[], list[float] | None]: ...  # ``grad_norms``, read if called


class CoordinatorView(Protocol):
    """What the step and the rare paths ask of the distributed coordinator (``session/distributed.py``):
    after the read, ``agree`` (the decision every rank takes, into the readout) before the sentinel's
    verdict; ``anomaly`` builds a new one on every rank (``build``: this rank's replay)."""

    def param_share(self, mon: SessionView) -> list[int] | None: ...
    def params_flagged(self, mon: SessionView) -> bool | None: ...
    def params_agree(self, mine: bool) -> list[int]: ...
    def agree(self, mon: SessionView, readout: Readout, mine: bool) -> Readout: ...
    def anomaly(self, mon: SessionView, build: Callable[[], Anomaly]) -> Anomaly: ...


class LearningRates(Protocol):
    """What instruments read of the optimizer hyperparameter check (``nonfinite/hyperparams.py``)."""

    def describe_lrs(self, fallback: Any = None, roots: dict[str, Any] | None = None) -> str: ...


class SessionView(Protocol):
    """The narrow view of a watch session that instruments and the sentinel receive (``mon``).

    What they may read and call; everything else of ``Monitor`` is the session's own. Checked by mypy:
    ``Monitor`` satisfies it, and the sentinel, the coordinator and the async reads are typed with it.
    """

    config: DebugConfig
    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    optimizers: list[torch.optim.Optimizer]  # every optimizer of the session (given, or adopted)
    roots: dict[str, nn.Module] | None  # several models: each by name (``model`` is their ModuleDict)
    scaler: Any
    writer: Any
    run_dir: Path | None
    global_step: int
    micro_step: int
    rank: int
    world_size: int
    driver: str | None
    batch: Any
    thread: threading.Thread
    names: dict[nn.Module, str]
    param_names: list[str]
    params: list[torch.Tensor]
    counters: dict[str, int]
    anomalies: list[Anomaly]
    installs: Any
    instruments: list[Instrument]
    early_stopping: Any
    state: StepState
    uses_cuda: bool

    @property
    def transfer(self) -> TransferView: ...  # the step's device numbers and their one read
    @property
    def coordinator(self) -> CoordinatorView | None: ...
    @property
    def reads_late(self) -> bool: ...
    @property
    def adopted(self) -> bool: ...
    @property
    def closed(self) -> bool: ...
    @property
    def compiled(self) -> bool: ...
    @property
    def called(self) -> nn.Module: ...  # the module the loop calls (a torch.compile wrapper: that)
    @property
    def replaying(self) -> bool: ...
    @property
    def grad_norm_host(self) -> float | None: ...
    @property
    def grad_norms_host(self) -> list[float] | None: ...
    @property
    def hyperparams(self) -> LearningRates: ...  # ``describe_lrs()``: the lrs the last update used
    @property
    def lr_labels(
        self,
    ) -> list[str] | None: ...  # the LR events' name of each param group (several optimizers)

    def optimizer_label(self, opt: Any, k: int = 0) -> str: ...  # the model an optimizer steps, else opt<k>

    def due(self, every: int | None) -> bool: ...
    def emit(self, event: RuleEvent) -> None: ...
    def log_scalars(self, values: Mapping[str, float], step: int | None = None) -> None: ...
    def warn_once(self, key: str, message: str) -> None: ...
    def flush_store(self) -> None: ...
    def eager(self) -> contextlib.AbstractContextManager[None]: ...


@runtime_checkable
class Instrument(Protocol):
    """An instrument of a watch session: a ``name`` and any of the step protocol's methods.

    Every method is optional (the session calls only those that exist), so this protocol names only
    what all have; the full list, with when each is called, is in docs/architecture.md
    ("Instrument protocol"): ``install``, ``remove``, ``on_forward_start``, ``on_forward_end``,
    ``on_backward_start``, ``on_backward_end``, ``on_clip``, ``before_optimizer_step``,
    ``after_optimizer_step``, ``collect`` (device numbers for the step's one read), ``on_step_end``,
    ``on_observe``, ``on_exception``, ``on_exit``. Each receives the session as a :class:`SessionView`.
    """

    name: str

"""Which optimizer updates the sentinel has not probed yet, and the exact check that judges them.

A finiteness probe of the parameters after every update costs a pass over every parameter tensor
(on the CPU a flatten: about a microsecond per tensor, as much again as the gradient check). A
non-finite parameter shows in the next step's loss or gradients in nearly every model, since the
forward reads it; so the parameters are probed on the detail schedule (``detail_every``), and when
a later step's numbers read non-finite the parameters are checked exactly on that rare path. They
are blamed on the last update when nothing wrote to them since (their ``_version`` s add up to the
same total as right after it); a write outside the step (a bad checkpoint load, a hand edit) leaves
the step to the replay, which names the parameter. A non-finite value the forward never reads (an
embedding row no batch used yet) shows at the next probe, at most ``detail_every`` steps later and
at exit, blamed on the updates since the last probe.
"""

from __future__ import annotations

import torch

from .._step import SessionView
from .._tensors import local, stored_values, version_of


class UpdateLedger:
    """The last update no probe covered (``step``) and the parameters' versions right after it;
    ``since``: the first such update after the last probe (the window a later probe speaks for).

    Under ``sync="async"`` a step is judged a step late, after its own update ran (or was skipped on
    the device, which still counts as a write): :meth:`as_staged` keeps the ledger as the step saw it
    when its numbers were staged, before its update, with whether anything had written to the
    parameters by then, so the late judgement blames the same update the blocking one would."""

    __slots__ = ("since", "step", "versions", "window", "written")

    def __init__(self) -> None:
        self.step: int | None = None
        self.versions = 0
        self.since: int | None = None
        self.window: int | None = None  # the first unprobed update a probe now in flight also covers
        self.written: bool | None = None  # a staged copy: the answer of written_since at staging

    def as_staged(self, params: list[torch.Tensor]) -> UpdateLedger:
        """A copy of the ledger now, before this step's update (one C-level pass over the versions when
        an update is unprobed: the usual case under async, every step off the detail schedule)."""
        copy = UpdateLedger()
        copy.step, copy.versions, copy.since, copy.window = self.step, self.versions, self.since, self.window
        copy.written = self.written_since(params) if self.step is not None else False
        return copy

    def unprobed(self, step: int, params: list[torch.Tensor]) -> None:
        """An update ran without a probe: remember it (one C-level pass over the versions)."""
        self.step = step
        self.versions = sum(map(version_of, params))
        if self.since is None:
            self.since = step

    def probed(self) -> None:
        """A probe is taken now: it covers every update since the last one."""
        self.window, self.since, self.step = self.since, None, None

    def written_since(self, params: list[torch.Tensor]) -> bool:
        """True when something wrote to a parameter after the remembered update (versions only grow)."""
        if self.written is not None:
            return self.written  # a staged copy: as it was before the step's own update
        return sum(map(version_of, params)) != self.versions


def nonfinite_params(names: list[str], params: list[torch.Tensor]) -> list[str]:
    """The parameters holding NaN/Inf, exactly (one reduction and host read each: rare path only)."""
    with torch.no_grad():
        return [
            n
            for n, p in zip(names, params)
            if not bool(torch.isfinite(stored_values(local(p.detach()))).all())
        ]


def window_hint(since: int | None, step: int | None) -> str:
    """What a probe covering several updates can say about when the parameters went bad."""
    if since is None or step is None or since >= step:
        return ""
    return (
        f" (an update between steps {since} and {step}: the parameters are probed every detail_every "
        "steps and checked whenever a step reads non-finite)"
    )


def due(mon: SessionView) -> bool:
    """Probe after this update: on the detail schedule, and always where the probe travels in its own
    way (several ranks: the all-reduced vector). Under sync="async" too only on the schedule: a step
    judged a step late uses the ledger as its numbers were staged (:meth:`UpdateLedger.as_staged`)."""
    return mon.coordinator is not None or mon.due(mon.config.detail_every)

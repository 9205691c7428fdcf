"""One training step's state as the session and its instruments see it: typed, with its phase.

The shared contract between the session (``session/``) and the parts it drives (the sentinel in
``nonfinite/``, the instruments): :class:`Readout` (the step's own numbers after its one read),
:class:`StepState` (everything one step accumulates, reset at its end), :class:`Verdict` (what the
sentinel decides, applied by the session) and the protocols :class:`SessionView` (the narrow view of
the session that instruments and the sentinel receive) and :class:`Instrument`.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(eq=False)
class Readout:
    """The session's own numbers of one step after the read, by kind, each in the order its items were
    added (an item's name says its kind: :data:`SLOTS`). Empty lists: nothing of that kind this step."""

    losses: list[float] = dataclasses.field(default_factory=list)  # per micro-step loss (a mean if not 0-dim)
    micro_bad: list[float] = dataclasses.field(default_factory=list)  # per micro-step "a gradient is non-finite"
    gnorm: list[float] = dataclasses.field(default_factory=list)  # per measured gradient: norm or probe sum
    scale: float | None = None  # the loss scale the step's backward saw (GradScaler)
    edit: list[float] = dataclasses.field(default_factory=list)  # probe of the gradients edited since backward
    clips: list[float] = dataclasses.field(default_factory=list)  # per clip_grad_norm_ call: factor non-finite
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

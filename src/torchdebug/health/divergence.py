"""The loss divergence rule: a sustained upward level shift of the loss, once per episode (host side).

A spike is one bad step (``LossSpikeRule``); a divergence is the loss moving to a new, much higher
level and staying there: 0.018 -> ~18 after a learning-rate spike that training never recovers
from. The rule compares the median of the last ``recent`` losses with the median of the losses
before them (a lagged window that stops moving during an episode), so a single outlier moves
neither, and a loss falling fast (early training, warm-up, cosine decay) never fires: only an
upward shift counts.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from .._robust import RunningMedian
from ..events import RuleEvent

KIND = "divergence"
KIND_END = "divergence_end"


def _fmt(x: float) -> str:
    return f"{x:.3g}"


class DivergenceRule:
    """Loss divergence: the recent median stays far above the median of the losses before it.

    The loss of each step enters a ``recent`` window; losses leaving it feed the ``baseline``
    (running median and MAD of the ``window`` losses before the recent ones). Every step once both
    are full, the shift ``recent median - baseline median`` is compared with a threshold, the
    largest of:

    - ``mads`` robust sigmas of the baseline (1.4826 MAD): beyond the loss's own noise;
    - ``rel`` times ``|baseline median|``: the level at least doubled (``rel=1``);
    - ``progress`` times the progress made so far (the median of the first ``recent`` losses
      minus the baseline median, when positive): a converged loss that wiggles near zero is not a
      divergence unless it gives back a good part of what training gained.

    When the shift exceeds it, and at least ``share`` of the recent losses do too (a sustained
    level, not a few outliers), one ``divergence`` event (warning) is emitted with its onset (the
    first recent step above the threshold), ``before`` (the median of the ``recent`` losses just
    before the recent window: the level training had reached) and ``after`` (the recent median).
    The baseline is frozen during the episode; when the
    recent median falls back under half the threshold a ``divergence_end`` event (info) says
    when it recovered, and the rule can fire again.

    Non-finite losses are skipped (the NaN/Inf sentinel reports them).

    Cost per step: one insert into a sorted window (O(window)) and a median of ``recent`` values.

    Example:
        >>> rule = DivergenceRule(recent=4, window=8)
        >>> [rule.update(s, 1.0 / (s + 1)) for s in range(12)].count(None)
        12
        >>> events = [rule.update(12 + s, 20.0) for s in range(4)]
        >>> events[-1].kind, events[-1].evidence["since_step"]
        ('divergence', 12)
    """

    def __init__(
        self,
        *,
        recent: int = 25,
        window: int = 200,
        mads: float = 10.0,
        rel: float = 1.0,
        progress: float = 0.5,
        share: float = 0.8,
    ) -> None:
        if recent < 2 or window < recent:
            raise ValueError(f"need recent >= 2 and window >= recent, got recent={recent}, window={window}")
        self.recent: deque[tuple[int, float]] = deque(maxlen=recent)
        self.baseline = RunningMedian(window)
        self.last: deque[float] = deque(maxlen=recent)  # the newest baseline losses: the level just before
        self.mads, self.rel, self.progress, self.share = (
            float(mads),
            float(rel),
            float(progress),
            float(share),
        )
        self.start: float | None = None  # median of the first `recent` losses
        self._first: list[float] = []
        self.active = False
        self.before = math.nan
        self.threshold = math.nan
        self.since: int | None = None
        self.count = 0

    def update(self, step: int, loss: float) -> RuleEvent | None:
        """Feed the loss of ``step``; an event when a divergence is established or ends."""
        if not math.isfinite(loss):
            return None
        if self.start is None:
            self._first.append(loss)
            if len(self._first) == self.recent.maxlen:
                self.start = statistics.median(self._first)
                self._first = []
        if len(self.recent) == self.recent.maxlen:
            old = self.recent[0][1]
            if not self.active:  # the baseline stands still while the loss is off
                self.baseline.push(old)
                self.last.append(old)
        self.recent.append((step, loss))
        if len(self.recent) < (self.recent.maxlen or 0) or len(self.baseline) < (self.recent.maxlen or 0):
            return None
        now = statistics.median(v for _, v in self.recent)
        if self.active:
            if now - self.before < 0.5 * self.threshold:
                since, self.active = self.since, False
                return RuleEvent(
                    kind=KIND_END,
                    step=step,
                    message=(
                        f"loss back to {_fmt(now)} (median of the last {len(self.recent)} steps), "
                        f"{step - (since or step)} steps after it diverged"
                    ),
                    severity="info",
                    evidence={"metric": "loss", "before": self.before, "after": now, "since_step": since},
                )
            return None
        med = self.baseline.median()
        sigma = self.baseline.sigma(abs_floor=1e-12)
        gained = max((self.start if self.start is not None else med) - med, 0.0)
        threshold = max(self.mads * sigma, self.rel * abs(med), self.progress * gained)
        if now - med <= threshold:
            return None
        above = [s for s, v in self.recent if v - med > threshold]
        if len(above) < self.share * len(self.recent):
            return None
        self.active = True
        before = statistics.median(self.last)
        self.before, self.threshold, self.since = before, threshold, above[0]
        self.count += 1
        return RuleEvent(
            kind=KIND,
            step=above[0],
            message=(
                f"loss diverged at step {above[0]}: {_fmt(before)} -> {_fmt(now)} and did not recover "
                f"within {step - above[0] + 1} steps. Look at the learning rate and the data around "
                "that step; restart from a checkpoint before it."
            ),
            severity="warning",
            evidence={"metric": "loss", "before": before, "after": now, "since_step": above[0]},
        )


__all__ = ["KIND", "KIND_END", "DivergenceRule"]

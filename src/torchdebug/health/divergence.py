"""The divergence rules (host side, once per episode): a run that grows by orders of magnitude from its
first steps (:class:`GrowthRule`), a sustained upward level shift of the loss (:class:`DivergenceRule`)
and of the gradient norm (:class:`NormShiftRule`).

A spike is one bad step (``LossSpikeRule``); a divergence is the loss moving to a new, much higher
level and staying there: 0.018 -> ~18 after a learning-rate spike that training never recovers
from. The rule compares the median of the last ``recent`` losses with the median of the losses
before them (a lagged window that stops moving during an episode), so a single outlier moves
neither, and a loss falling fast (early training, warm-up, cosine decay) never fires: only an
upward shift counts.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from collections.abc import Callable, Mapping

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

    From the start: a rate so high that the loss never comes down leaves no good level to compare
    with (the baseline fills with diverged losses). So the rule also compares the median of the last
    ``start_recent`` losses with the first finite loss: at least ``start_factor`` times it, with
    ``share`` of them too, is a divergence from step 0 (GPT-2 under AdamW at lr 1 sits 25-35x its
    first loss from step 1: named at step ``start_recent - 1``; training brings a loss down from its
    first value, it does not multiply it). Judged only over the first ``start_horizon`` losses (a
    value loss that grows over thousands of steps as an agent's returns grow is not a start), and
    never once a loss was zero or negative (a policy-gradient or GAN loss changes sign: its first
    value is no scale).

    A jump in the first steps that stays: when the median of the three losses after the first is at
    least ``early_factor`` (4) times the first (the jump), a median of the last ``start_recent``
    losses at least ``early_factor`` times the first, within the first ``early_horizon`` losses, is
    a divergence too (it stayed), the median alone being the test: a too-high rate makes the loss
    erratic, 1x to 45x chance from step to step, as ResNet-18 at SGD lr 2.0 does. Healthy runs of
    real models stay under 1.7x their first loss there (benchmarks/rule_margins.py, ``start``): a
    loss starts near chance and training brings it down; asking for the jump at once keeps a loss
    that first came down, or a converged loss whose first batch happened to be its easiest, to the
    level test. Not judged when the session has several optimizers
    (``several``: a GAN's or a two-optimizer actor-critic's loss is the mean of objectives that pull
    against each other; a GAN's generator loss rising several times its first value is healthy).

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
        start_factor: float = 20.0,
        start_recent: int = 10,
        start_horizon: int = 200,
        early_factor: float = 4.0,
        early_horizon: int = 50,
    ) -> None:
        if recent < 2 or window < recent:
            raise ValueError(f"need recent >= 2 and window >= recent, got recent={recent}, window={window}")
        self.recent: deque[tuple[int, float]] = deque(maxlen=recent)
        self._values: deque[float] = deque(maxlen=recent)  # the recent losses alone: their median a step
        self.baseline = RunningMedian(window)
        self.last: deque[float] = deque(maxlen=recent)  # the newest baseline losses: the level just before
        self.mads, self.rel, self.progress, self.share = (
            float(mads),
            float(rel),
            float(progress),
            float(share),
        )
        self.start_factor = float(start_factor)
        self.start_recent = min(int(start_recent), recent)
        self.start_horizon = int(start_horizon)
        self.early_factor, self.early_horizon = float(early_factor), int(early_horizon)
        self.several = False  # the session has several optimizers: no early-jump test (set by its owner)
        self.jumped = False  # the three losses after the first: median >= early_factor x the first
        self.seen = 0  # finite losses fed
        self.signed = False  # a loss <= 0 was seen: the first loss is no scale
        self.first = math.nan  # the first finite loss
        self.start: float | None = None  # median of the first `recent` losses
        self._first: list[float] = []
        self.active = False
        self.before = math.nan
        self.threshold = math.nan
        self.since: int | None = None
        self.count = 0
        self._pushed = 0  # finite losses pushed into the baseline: its length until it is full

    def update(self, step: int, loss: float) -> RuleEvent | None:
        """Feed the loss of ``step``; an event when a divergence is established or ends."""
        if not math.isfinite(loss):
            return None
        self.seen += 1
        if loss <= 0:
            self.signed = True
        if self.first != self.first:  # NaN: not set yet
            self.first = loss
        elif self.seen == 4:  # the jump: the median of the three losses after the first (and this one)
            after = sorted([loss, *(v for _, v in itertools.islice(reversed(self.recent), 2))])
            self.jumped = after[1] >= self.early_factor * self.first
        if self.start is None:
            self._first.append(loss)
            if len(self._first) == self.recent.maxlen:
                self.start = statistics.median(self._first)
                self._first = []
        if len(self.recent) == self.recent.maxlen:
            old = self.recent[0][1]
            if not self.active:  # the baseline stands still while the loss is off
                self.baseline.push(old)
                self._pushed += 1
                self.last.append(old)
        self.recent.append((step, loss))
        self._values.append(loss)
        event = None
        # a counter, not len(self.baseline): no Python call per step
        if self.active or self._pushed >= (self.recent.maxlen or 0):
            event = self._level(step)  # active: an episode from the start ends on the recent median too
        if (
            event is None
            and not self.active
            and not self.signed
            and self.first > 0
            and self.start_recent <= self.seen <= self.start_horizon
        ):
            event = self._from_start(step)  # no good level to compare with: the first loss
        return event

    def _level(self, step: int) -> RuleEvent | None:
        """The recent median against the baseline's: the episode's start or end, or None."""
        now = _median(sorted(self._values))  # (statistics.median's answer, without a generator)
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

    def _from_start(self, step: int) -> RuleEvent | None:
        """The recent losses sit at least ``start_factor`` x the first loss, or their median
        ``early_factor`` x within ``early_horizon`` losses: diverged from the start."""
        now = _median(sorted(itertools.islice(reversed(self._values), self.start_recent)))
        bar = self.early_factor * self.first
        if not self.jumped or self.several or self.seen > self.early_horizon or now < bar:
            bar = self.start_factor * self.first
            if now < bar:
                return None  # the usual answer
            last = list(itertools.islice(reversed(self.recent), self.start_recent))[::-1]
            if sum(v >= bar for _, v in last) < self.share * len(last):
                return None
        last = list(itertools.islice(reversed(self.recent), self.start_recent))[::-1]
        above = [s for s, v in last if v >= bar]
        self.active = True
        # ends when the recent median is back under half-way to the bar
        self.before, self.threshold, self.since = self.first, bar - self.first, above[0]
        self.count += 1
        return RuleEvent(
            kind=KIND,
            step=above[0],
            message=(
                f"loss diverged from the start: {_fmt(now)} (median of the last {len(last)} "
                f"steps) is {now / self.first:.0f}x its first value {_fmt(self.first)} and did not come "
                f"down since step {above[0]}. Check first the learning rate (try 10x lower, or a "
                "warm-up), then the data."
            ),
            severity="warning",
            evidence={
                "metric": "loss",
                "before": self.first,
                "after": now,
                "since_step": above[0],
                "factor": now / self.first,
            },
        )


class NormShiftRule:
    """Gradient-norm divergence: the total gradient norm moves up ``factor`` x (an order of magnitude by
    default) and stays there: the median of the last ``recent`` norms against the median of the
    ``window`` before them, in log10.

    The loss can hide a divergence the gradient shows (a classifier whose logits blow up saturates
    its loss; a clipped run keeps its updates bounded while its raw gradients grew 10x), and the
    explosion rule speaks once, at the jump, then adapts its range. This rule says whether the new
    level stayed: the shift ``log10(recent median / baseline median)`` must exceed the larger of
    ``log10(factor)`` and ``mads`` robust sigmas of the baseline (in log10), with ``share`` of the
    recent norms above it too. The baseline is lagged (the norms leaving the recent window) and frozen
    during the episode, so a slow healthy drift (a norm rising 2-5x over a schedule's tail, BatchNorm
    weights shrinking under weight decay) moves with it and never fires. One ``divergence`` event
    (warning, ``evidence["metric"] == "grad_norm"``) at the start of an episode; ``divergence_end``
    (info) once the recent median is back within ``sqrt(factor)`` x the level before.

    Non-finite and zero norms are skipped (the sentinel reports NaN/Inf; a zero gradient is the
    vanishing rule's). Cost per step: one ``log10``, one insert into a sorted window (O(window)) and a
    median of ``recent`` values.

    Example:
        >>> rule = NormShiftRule(recent=4, window=8)
        >>> [rule.update(s, 1.0) for s in range(12)].count(None)
        12
        >>> events = [rule.update(12 + s, 50.0) for s in range(4)]
        >>> events[-1].kind, events[-1].evidence["since_step"], events[-1].evidence["metric"]
        ('divergence', 12, 'grad_norm')
    """

    def __init__(
        self,
        *,
        recent: int = 25,
        window: int = 200,
        factor: float = 10.0,
        mads: float = 10.0,
        share: float = 0.8,
    ) -> None:
        if recent < 2 or window < recent or factor <= 1:
            raise ValueError(
                f"need recent >= 2, window >= recent and factor > 1, got recent={recent}, window={window}, "
                f"factor={factor}"
            )
        self.recent: deque[tuple[int, float]] = deque(maxlen=recent)  # (step, log10 norm)
        self._values: deque[float] = deque(maxlen=recent)  # the log10 norms alone: their median a step
        self.baseline = RunningMedian(window)
        self.orders = math.log10(factor)
        self.factor, self.mads, self.share = float(factor), float(mads), float(share)
        self.active = False
        self.before = math.nan  # log10 of the level before the episode
        self.since: int | None = None
        self.count = 0
        self._pushed = 0  # values pushed into the baseline (finite logs): its length until it is full

    def update(self, step: int, norm: float) -> RuleEvent | None:
        """Feed the total gradient norm of ``step``; an event when a shift is established or ends."""
        if not 0.0 < norm < math.inf:  # NaN too
            return None
        if len(self.recent) == self.recent.maxlen and not self.active:
            self.baseline.push(self.recent[0][1])  # frozen while the episode lasts
            self._pushed += 1
        log = math.log10(norm)
        self.recent.append((step, log))
        self._values.append(log)
        if self._pushed < (self.recent.maxlen or 0):  # a counter, not len(): no Python call per step
            return None
        now = _median(sorted(self._values))  # (statistics.median's answer, without a generator)
        if self.active:
            if now - self.before >= 0.5 * self.orders:
                return None
            since, self.active = self.since, False
            return RuleEvent(
                kind=KIND_END,
                step=step,
                message=(
                    f"gradient norm back to {_fmt(10**now)} (median of the last {len(self.recent)} steps), "
                    f"{step - (since or step)} steps after it rose"
                ),
                severity="info",
                evidence={
                    "metric": "grad_norm",
                    "before": 10**self.before,
                    "after": 10**now,
                    "since_step": since,
                },
            )
        med = self.baseline.median()
        threshold = max(self.orders, self.mads * self.baseline.sigma(abs_floor=1e-12))
        if now - med <= threshold:
            return None
        above = [s for s, v in self.recent if v - med > threshold]
        if len(above) < self.share * len(self.recent):
            return None
        self.active, self.before, self.since = True, med, above[0]
        self.count += 1
        before, after = 10**med, 10**now
        return RuleEvent(
            kind=KIND,
            step=above[0],
            message=(
                f"gradient norm rose at step {above[0]} and stayed: {_fmt(before)} -> {_fmt(after)} (median "
                f"of the last {len(self.recent)} steps, {after / before:.0f}x the median of the "
                f"{len(self.baseline)} steps before) and did not come back within {step - above[0] + 1} "
                "steps. Check first the learning rate and the data around that step; restart from a "
                "checkpoint before it."
            ),
            severity="warning",
            evidence={"metric": "grad_norm", "before": before, "after": after, "since_step": above[0]},
        )


# The growth rule's thresholds, measured on tiny real models (benchmarks/divergence_margins.py; the
# margins are in docs/reading.md): healthy runs never grow faster than 2.9x a step on this estimator nor
# more than 13.5x over a window while reaching a new high, diverging ones 8-1000x a step, 300x-1e7x.
GROWTH_WINDOW = 4  # steps in the robust slope: judged from the 4th finite value on (step 3)
GROWTH_RATE = 3.0  # the window's robust growth rate must be at least 3x a step ...
GROWTH_ORDERS = 2.0  # ... and its last value 10**2 = 100x its first
END_FACTOR = 10.0  # the episode ends when every grown metric is back within 10x of its value at onset
CALM = math.log10(1.5)  # "since when": the last value within 1.5x of the window's lowest
_LABEL = {"loss": "loss", "grad_norm": "gradient norm"}


def repeated_median(points: list[tuple[int, float]]) -> float:
    """Siegel's repeated-median slope of ``(x, y)`` points: for each point the median of its slopes to
    the others, then the median of those. Robust to up to half the points being outliers: a single
    spike, even at the window's end, does not make a slope.

    Example:
        >>> repeated_median([(0, 0.0), (1, 0.0), (2, 0.0), (3, 3.0)])  # one spike: no growth
        0.0
        >>> repeated_median([(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.5)])
        1.0
    """
    per = []
    for i, (xi, yi) in enumerate(points):
        slopes = [(y - yi) / (x - xi) for j, (x, y) in enumerate(points) if j != i and x != xi]
        if slopes:
            per.append(statistics.median(slopes))
    return statistics.median(per) if per else 0.0


class _Series:
    """One metric's last ``window`` positive finite values, in log10, and the highest value before them.

    Every step: a comparison, one ``log10`` and an append; the robust slope only when the window
    already grew ``orders`` to a new high (rare). No other call per step (the hot path's host cost)."""

    __slots__ = ("high", "n", "points", "window")

    def __init__(self, window: int) -> None:
        self.window = window
        self.points: deque[tuple[int, float]] = deque(maxlen=window)
        self.n = 0  # len(points), kept by hand
        self.high = -math.inf  # log10 of the largest value that left the window

    def push(self, step: int, value: float) -> None:
        if not 0.0 < value < math.inf:  # NaN too: a break (the sentinel's, or a loss <= 0 with no log)
            if self.n:
                self.points.clear()
                self.n = 0
            return
        if self.n == self.window:
            old = self.points[0][1]
            if old > self.high:
                self.high = old
        else:
            self.n += 1
        self.points.append((step, math.log10(value)))

    def growth(self, rate: float, orders: float) -> dict[str, float] | None:
        """Evidence when the window grows at least ``rate``x a step (repeated median in log10) and ``orders``
        orders of magnitude from its first to its last value, to a new high; else None."""
        if self.n < self.window:
            return None
        pts = self.points
        last = pts[-1][1]
        if last - pts[0][1] < orders or last <= self.high:
            return None
        slope = repeated_median(list(pts))
        if slope < math.log10(rate):
            return None
        # since when: the last value (before the newest) within 1.5x of the window's lowest, where the
        # growth began (a calm step just before a jump is as low as the one before it)
        low = min(p[1] for p in list(pts)[:-1])
        since, then = next(p for p in reversed(list(pts)[:-1]) if p[1] <= low + CALM)
        return {"since": since, "then": 10**then, "now": 10**last, "rate": 10**slope}


def _median(s: list[float]) -> float:
    """The median of a sorted, non-empty list, as ``statistics.median`` gives it."""
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def _fmt_rate(x: float) -> str:
    return f"{x:.2g}" if x < 100 else f"{x:.3g}"


class GrowthRule:
    """Divergence from the first steps: the loss or the gradient norm grows by orders of magnitude over
    a few steps.

    Each metric keeps its last ``window`` positive finite values in log10 (no warm-up, no history to
    compare with). It grows when, over that window, (1) the robust growth rate (Siegel's repeated-median
    slope in log10, :func:`repeated_median`) is at least ``rate``x a step, (2) the last value
    is at least ``10**orders`` times the first and (3) the last value is above every value seen before
    the window (a new high: a converged loss wobbling from 1e-6 to 1e-4 is not a divergence). A loss
    falling fast never fires (the slope is negative); one spike among the window's points leaves the
    repeated median near the others' slope; a gradient norm rising 10x over the first steps of a
    fresh init stays far below 100x.

    When either metric grows, one ``divergence`` event (warning) names what grew, from what to what,
    how fast (x a step), since which step (the last value within 1.5x of the window's lowest), and what
    to check first with ``cause`` (the caller's text, such as the learning rates). The episode lasts until every
    metric that grew is back within ``END_FACTOR`` (10x) of its value at onset; then a
    ``divergence_end`` event (info), and the rule can fire again. Cost per step: the pairwise slopes of
    ``window`` points (12 for the default 4).

    Example:
        >>> rule = GrowthRule()
        >>> [rule.update(s, 4.0 * 30**s, 1.0) for s in range(3)]
        [None, None, None]
        >>> event = rule.update(3, 4.0 * 30**3, 1.0)
        >>> event.kind, event.evidence["since_step"], round(event.evidence["rate"])
        ('divergence', 0, 30)
    """

    def __init__(
        self, window: int = GROWTH_WINDOW, rate: float = GROWTH_RATE, orders: float = GROWTH_ORDERS
    ) -> None:
        if window < 3:
            raise ValueError(f"window must be >= 3 (a robust slope needs 3 points), got {window}")
        if rate <= 1 or orders <= 0:
            raise ValueError(f"need rate > 1 and orders > 0, got rate={rate}, orders={orders}")
        self.window, self.rate, self.orders = int(window), float(rate), float(orders)
        self._loss, self._norm = _Series(self.window), _Series(self.window)
        self.series = {"loss": self._loss, "grad_norm": self._norm}
        self.active = False
        self.onset: dict[str, dict[str, float]] = {}  # the metrics that grew: their evidence at onset
        self.since: int | None = None
        self.count = 0

    def update(
        self, step: int, loss: float | None, grad_norm: float | None, cause: str | Callable[[], str] = ""
    ) -> RuleEvent | None:
        """Feed the loss and total gradient norm of ``step`` (None: not measured); an event when a
        divergence starts or ends. ``cause``: what the event says to check first, or a callable
        returning it (called only when the event fires)."""
        losses, norms = self._loss, self._norm
        if loss is not None:
            losses.push(step, loss)
        if grad_norm is not None:
            norms.push(step, grad_norm)
        if self.active:
            return self._end(step, {"loss": loss, "grad_norm": grad_norm})
        grown = {}
        for name, series in (("loss", losses), ("grad_norm", norms)):
            evidence = series.growth(self.rate, self.orders)
            if evidence is not None:
                grown[name] = evidence
        if not grown:
            return None
        self.active = True
        self.count += 1
        self.onset = grown
        lead = "loss" if "loss" in grown else "grad_norm"
        since = int(min(e["since"] for e in grown.values()))
        self.since = since
        parts = [
            f"{_LABEL[n]} {_fmt(e['then'])} -> {_fmt(e['now'])} (x{_fmt_rate(e['rate'])} a step)"
            for n, e in grown.items()
        ]
        steps = step - since
        first = grown[lead]
        cause = cause() if callable(cause) else cause
        message = (
            f"diverging since step {since}: {' and '.join(parts)} in {steps} step{'s' if steps != 1 else ''}. "
            + (cause or "Check first the learning rate, then clip gradients (clip_grad_norm_)")
        )
        return RuleEvent(
            kind=KIND,
            step=step,
            message=message,
            severity="warning",
            evidence={
                "metric": lead,
                "before": first["then"],
                "after": first["now"],
                "since_step": since,
                "rate": first["rate"],
                "growth": {n: dict(e) for n, e in grown.items()},
                "cause": cause,
            },
        )

    def _end(self, step: int, values: Mapping[str, float | None]) -> RuleEvent | None:
        back = all(
            (v := values.get(n)) is not None and math.isfinite(v) and v <= END_FACTOR * e["then"]
            for n, e in self.onset.items()
        )
        if not back:
            return None
        since, self.active, onset = self.since, False, self.onset
        self.onset = {}
        lead = "loss" if "loss" in onset else "grad_norm"
        now = float(values[lead])  # type: ignore[arg-type]
        return RuleEvent(
            kind=KIND_END,
            step=step,
            message=(
                f"{_LABEL[lead]} back to {_fmt(now)} (within {END_FACTOR:g}x of {_fmt(onset[lead]['then'])} "
                f"at step {since}), {step - (since or 0)} steps after it began to diverge"
            ),
            severity="info",
            evidence={"metric": lead, "before": onset[lead]["then"], "after": now, "since_step": since},
        )


__all__ = [
    "END_FACTOR",
    "GROWTH_ORDERS",
    "GROWTH_RATE",
    "GROWTH_WINDOW",
    "KIND",
    "KIND_END",
    "DivergenceRule",
    "GrowthRule",
    "NormShiftRule",
    "repeated_median",
]

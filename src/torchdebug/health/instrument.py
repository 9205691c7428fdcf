"""Training health in ``watch()``: gradient/loss/LR/AMP rules, clip insight, update ratios, activation stats.

The rules are plain classes fed with host numbers (``ExplosionRule.update(step, norm)``), so they
are testable and reusable without a monitor; :class:`GradientHealth` is the instrument gluing them
to the monitor's single host transfer per step.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .._robust import MAD_TO_SIGMA, RunningMedian, Streak
from .._step import SessionView, StepPhase
from .._tensors import Plan, foreach_norms  # the hot path (fused), the general one for odd tensors
from ..events import RuleEvent, training_summary
from .divergence import KIND as DIVERGENCE
from .divergence import DivergenceRule, GrowthRule, NormShiftRule
from .optnorms import OptimizerNorms
from .optstate import ITEM as STATE_ITEM
from .optstate import OptimizerState

# Bounded history of every running statistic (memory O(WINDOW) per rule).
WINDOW = 200
# Floor of the robust sigma of log10(grad norm): noise below ~12 % never counts as a spread.
LOG_SIGMA_FLOOR = 0.05
# A relative explosion must also be this many times the running median norm.
MIN_EXPLODE_RATIO = 3.0
# Inside the warm-up: judged after this many norms, and only a blow-up this many times the median.
EARLY_HISTORY = 5
EARLY_RATIO = 10.0
# Exploding norms stay out of the running range for this many steps of an episode (then it adapts).
FREEZE = 50
# Floor of the loss sigma relative to |median loss| (a flat loss is not a license to flag 0.1 % bumps).
LOSS_REL_FLOOR = 1e-2
# A spike also rises at least this share of |median loss| above the median: once a loss has converged
# its noise is small, so an unusual but healthy batch is 10 sigmas of it while only 10-30 % above the
# level; a bad batch or a too-high rate multiplies the loss (the spikes of benchmarks/rule_margins.py's
# word_language_model-style Transformer at lr 20 clip 0.25 are 2-3x its median).
LOSS_MIN_RISE = 0.5
TOP_K = 3
# the expert level's tensor history: the first this many trainable parameters (weight and gradient
# statistics each) on each detail step; each is one analyze_tensor (about 20 passes, one host read)
HISTORY_TENSORS = 32


def fire_once(
    active: set[str], values: Mapping[str, float], unhealthy: Callable[[float], bool]
) -> dict[str, float]:
    """The keys whose value turned unhealthy at this check, once per episode.

    ``active`` holds the keys inside an episode; a key leaves it (and can fire again) when its value
    is healthy again. Keys absent from ``values`` keep their state.
    """
    fired: dict[str, float] = {}
    for key, value in values.items():
        if unhealthy(value):
            if key not in active:
                active.add(key)
                fired[key] = value
        else:
            active.discard(key)
    return fired


def owner(param_name: str) -> str:
    """Qualified name of the module owning a parameter: ``"blocks.0.fc.weight" -> "blocks.0.fc"``."""
    return param_name.rpartition(".")[0]


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def layer_norms(names: Sequence[str], norms: Sequence[float]) -> dict[str, float]:
    """Per-layer L2 norms from per-parameter L2 norms: sqrt of the sum of squares per owning module."""
    sq: dict[str, float] = {}
    for key, v in zip(map(owner, names), norms):
        sq[key] = sq.get(key, 0.0) + v * v
    return {k: math.sqrt(v) if math.isfinite(v) else v for k, v in sq.items()}


def top_params(names: Sequence[str], norms: Sequence[float], k: int = TOP_K) -> list[tuple[str, float]]:
    """The ``k`` parameters with the largest norms, non-finite ones first."""
    order = sorted(
        range(len(names)),
        key=lambda i: (math.isfinite(norms[i]), -abs(norms[i]) if norms[i] == norms[i] else 0),
    )
    return [(names[i], norms[i]) for i in order[:k]]


# --------------------------------------------------------------------------- pure rules


class ExplosionRule:
    """Exploding gradients: the total norm leaves its robust running range, or passes an absolute bound.

    Fires (once per episode: again only after the norm came back) when, after ``warmup`` finite
    observations, either

    - relative: ``log10(norm)`` is more than ``mads`` robust sigmas (1.4826 MAD, floored at
      ``LOG_SIGMA_FLOOR``) above the median of the last ``window`` steps AND ``norm`` is at least
      ``min_ratio`` times that median, or
    - absolute: ``norm > abs_threshold``, from the first step on (the bound is the user's
      ``explode_abs``: no warm-up hides a run that leaves it at step 1).

    Working in log space makes the rule scale-free (a model whose norm is 1e-3 and one whose norm
    is 50 are judged alike) and keeps the slow drift of a healthy run inside the range. The two
    triggers are OR-ed: a 1 -> 1000 blow-up is an explosion even if it stays below 1e4.
    During the warm-up, after ``EARLY_HISTORY`` observations, only a blow-up of at least
    ``EARLY_RATIO`` (10) times the median so far counts (early norms move a lot, but not 10x at
    once): a run that diverges in its first steps is not missed.

    The message says what grew, how fast and since when: "total gradient norm 2.9e+09 at step 12
    grew 4e+09x in 7 steps since step 5 (0.73 then, about 24x a step)".
    ``count`` counts exploding steps (not episodes). Non-finite norms are ignored here: NaN/Inf
    is the non-finite sentinel's job (and an AMP skip is the scaler's).

    Example:
        >>> rule = ExplosionRule(mads=10, abs_threshold=1e4, warmup=3)
        >>> [rule.update(s, 1.0 + 0.01 * s) for s in range(5)].count(None)
        5
        >>> rule.update(5, 500.0).kind
        'gradient_explosion'
    """

    def __init__(
        self,
        mads: float = 10.0,
        abs_threshold: float = 1e4,
        warmup: int = 20,
        window: int = WINDOW,
        min_ratio: float = MIN_EXPLODE_RATIO,
    ) -> None:
        self.mads = float(mads)
        self.abs_threshold = float(abs_threshold)
        self.warmup = int(warmup)
        self.min_ratio = float(min_ratio)
        self.history = RunningMedian(window)  # log10 norms
        self.recent: deque[tuple[int, float]] = deque(maxlen=64)  # (step, norm): "since when"
        self._exploding = 0  # consecutive exploding steps
        self.seen = 0
        self.active = False
        self.count = 0

    def check(self, norm: float) -> dict[str, float] | None:
        """Evidence if ``norm`` is exploding now (no state change), else None."""
        if not math.isfinite(norm) or norm <= 0:
            return None
        early = self.seen < self.warmup
        evidence: dict[str, float] = {"grad_norm": norm}
        rel = False
        if self.history.n and not (early and self.seen < EARLY_HISTORY):  # the relative test
            med = self.history.median()
            ratio = norm / 10**med
            least = EARLY_RATIO if early else self.min_ratio
            if ratio < least and norm <= self.abs_threshold:
                return None  # the usual answer: under the ratio the relative test needs, no sigma needed
            sigma = self.history._sigma_at(med, abs_floor=LOG_SIGMA_FLOOR)  # the median computed once
            z = (math.log10(norm) - med) / sigma
            rel = z > self.mads and ratio >= least
            evidence.update(median=10**med, mads=z, ratio=ratio, threshold=10 ** (med + self.mads * sigma))
        if rel or norm > self.abs_threshold:
            evidence["abs_threshold"] = self.abs_threshold
            return evidence
        return None

    def update(
        self,
        step: int,
        norm: float,
        top: Sequence[tuple[str, float]] | Callable[[], Sequence[tuple[str, float]]] = (),
        lrs: str | Callable[[], str] = "",
    ) -> RuleEvent | None:
        """Feed the total gradient norm of ``step``; an event at the first step of an explosion.

        Args:
            step: the step number recorded in the event.
            norm: the total (unscaled) gradient norm.
            top: the largest per-parameter norms ``[(name, norm)]``, named in the event, or a
                callable returning them (called only when the event fires: no sort per step).
            lrs: the learning rates the advice names ("lr 20 in param group 0 of SGD"), or a
                callable returning them (called only when the event fires).
        """
        evidence = self.check(norm)
        # what the message says was typical: the median before this norm joins it (read only on the
        # step that fires)
        typical = 10 ** self.history.median() if evidence is not None and len(self.history) else math.nan
        judged_on = self.history.n
        # an exploding norm stays out of the baseline for the first FREEZE steps of its episode, so
        # a run-away growth stays one episode instead of widening the range it is judged against
        frozen = evidence is not None and self._exploding < FREEZE
        self._exploding = self._exploding + 1 if evidence is not None else 0
        if math.isfinite(norm) and norm > 0:
            if not frozen:
                self.history.push(math.log10(norm))
            self.seen += 1
        if evidence is None:
            self.active = False
            if math.isfinite(norm) and norm > 0:
                self.recent.append((step, norm))
            return None
        self.count += 1
        if self.active:
            return None
        self.active = True
        if callable(top):
            top = top()
        # name the layers that matter: top parameters within 10x of the largest (or non-finite)
        lead = top[0][1] if top else 0.0
        modules = tuple(dict.fromkeys(owner(n) for n, v in top if not math.isfinite(v) or v >= 0.1 * lead))
        why = f"total gradient norm {_fmt(norm)} at step {step}"
        # since when: the last step whose norm was still typical (at most 2x the median then)
        base = next(
            ((s, v) for s, v in reversed(self.recent) if not (v > 2 * typical)),  # NaN typical: any
            self.recent[0] if self.recent else None,
        )
        if base is not None:
            since, was = base
            n = step - since
            grew = norm / was
            rate = f", about {_fmt(grew ** (1 / n))}x a step" if n > 1 else ""
            in_steps = "in one step" if n == 1 else f"in {n} steps"
            why += f" grew {_fmt(grew)}x {in_steps} since step {since} ({_fmt(was)} then{rate})"
            evidence.update(since=since, norm_then=was, growth=grew)
        if "median" in evidence:
            why += f"; typical before: {_fmt(evidence['median'])} (median of the last {judged_on} steps)"
        if norm > self.abs_threshold:
            why += f"; above the absolute bound {_fmt(self.abs_threshold)}"
        self.recent.clear()  # the next episode measures from the norms after this one
        if top:
            why += "; largest: " + ", ".join(f"{n} {_fmt(v)}" for n, v in top)
        lr_text = lrs() if callable(lrs) else lrs
        return RuleEvent(
            kind="gradient_explosion",
            step=step,
            message=why
            + f". Lower the learning rate{f' ({lr_text})' if lr_text else ''} or clip gradients (clip_grad_norm_).",
            severity="warning",
            modules=modules,
            evidence={**evidence, "top": {n: v for n, v in top}},
        )


class VanishingRule:
    """Vanishing gradients: a layer's gradient norm stays below ``threshold`` for ``patience`` checks.

    Fed on the detail schedule with per-layer norms; fires once per layer per episode, naming
    every layer that reached ``patience`` at that check. ``count`` counts layers that fired.

    Example:
        >>> rule = VanishingRule(threshold=1e-8, patience=2)
        >>> rule.update(0, {"fc1": 0.0, "fc2": 1.0}) is None
        True
        >>> rule.update(10, {"fc1": 0.0, "fc2": 1.0}).modules
        ('fc1',)
    """

    def __init__(self, threshold: float = 1e-8, patience: int = 5) -> None:
        self.threshold = float(threshold)
        self.patience = int(patience)
        self.streaks: dict[str, Streak] = {}
        self.count = 0

    def update(self, step: int, norms: Mapping[str, float]) -> RuleEvent | None:
        """Feed the per-layer gradient norms of one detail check."""
        fired: dict[str, float] = {}
        for layer, v in norms.items():
            streak = self.streaks.get(layer)
            if streak is None:  # not setdefault: no new Streak per layer per check
                streak = self.streaks[layer] = Streak(self.patience)
            if streak.update(math.isfinite(v) and v <= self.threshold):
                fired[layer] = v
        if not fired:
            return None
        self.count += len(fired)
        listed = ", ".join(f"{k or '<root>'} {_fmt(v)}" for k, v in fired.items())
        return RuleEvent(
            kind="vanishing_gradient",
            step=step,
            message=(
                f"gradient norm at or below {_fmt(self.threshold)} for {self.patience} checks in a row: {listed}. "
                "Check for saturated activations, dead ReLUs, detached branches or a too-deep stack "
                "without residuals/normalisation."
            ),
            severity="warning",
            modules=tuple(fired),
            evidence={"norms": dict(fired), "threshold": self.threshold, "patience": self.patience},
        )


class LossSpikeRule:
    """Loss spike: the loss jumps more than ``mads`` robust sigmas above its running median.

    Sigma is 1.4826 MAD of the last ``window`` losses, floored at ``LOSS_REL_FLOOR * |median|``;
    the loss must also rise at least ``min_rise`` x ``|median|`` above the median (1.5x a positive
    median by default: a bump of a converged loss is many sigmas of its tiny noise, and healthy);
    only upward jumps count, after ``warmup`` finite losses; once per episode. ``count`` counts
    spiking steps. Non-finite losses are ignored (the non-finite sentinel reports them).

    Example:
        >>> rule = LossSpikeRule(mads=10, warmup=3)
        >>> [rule.update(s, 2.0 - 0.01 * s) for s in range(6)].count(None)
        6
        >>> rule.update(6, 40.0).kind
        'loss_spike'
    """

    def __init__(
        self, mads: float = 10.0, warmup: int = 20, window: int = WINDOW, min_rise: float = LOSS_MIN_RISE
    ) -> None:
        self.mads = float(mads)
        self.warmup = int(warmup)
        self.min_rise = float(min_rise)
        self.history = RunningMedian(window)
        self.active = False
        self.count = 0
        self.fired_at = (math.nan, math.nan)  # the window's median and sigma the last spike was judged by

    def update(self, step: int, loss: float) -> RuleEvent | None:
        """Feed the loss of ``step``; an event at the first step of a spike."""
        if not math.isfinite(loss):
            return None
        fire = False
        z = med = 0.0
        if self.history.n >= max(self.warmup, 1):
            med = self.history.median()
            # the rise first (no sigma for the usual answer); then the z-score
            if loss - med >= self.min_rise * abs(med):
                z = self.history._zscore_at(med, loss, rel_floor=LOSS_REL_FLOOR, abs_floor=1e-12)
                fire = z > self.mads
                if fire:  # what the spike guard's report says it was judged by (rare)
                    self.fired_at = (med, self.history._sigma_at(med, LOSS_REL_FLOOR, 1e-12))
        self.history.push(loss)
        if not fire:
            self.active = False
            return None
        self.count += 1
        if self.active:
            return None
        self.active = True
        return RuleEvent(
            kind="loss_spike",
            step=step,
            message=(
                f"loss {_fmt(loss)} is {_fmt(z)} robust sigmas above its running median {_fmt(med)}. "
                "Look at this step's batch (outliers, bad labels) and the learning rate."
            ),
            severity="warning",
            evidence={"loss": loss, "median": med, "mads": z},
        )


class LossPlateauRule:
    """Loss plateau: over the last ``window`` losses, the median of the newer half moved from the
    median of the older half by less than ``rel`` (relative) or by less than the loss's own noise.
    Fires once per plateau, severity info (a converged run plateaus too); "loss_plateau_end" (info)
    when the loss moves again, with the plateau's length.

    Noise: the robust sigma of successive differences (1.4826 MAD / sqrt 2: a trend's differences
    are all alike, so a smooth decline is not noise), turned into the standard error of the
    difference of two half-window medians (1.2533 sigma sqrt(2 / half)). A plateau starts when the
    medians differ by less than ``max(rel, 2 se)`` and ends only when they differ by at least
    ``max(rel, 4 se)``: a noisy flat loss (random labels, small batches) is one episode, not one
    per crossing of the threshold. Judged every ``max(1, window // 20)`` steps (cost).

    Example:
        >>> rule = LossPlateauRule(window=4, rel=1e-3)
        >>> [rule.update(s, 1.0) for s in range(3)]
        [None, None, None]
        >>> rule.update(3, 1.0).kind
        'loss_plateau'
    """

    def __init__(self, window: int = 200, rel: float = 1e-4) -> None:
        if window < 2:
            raise ValueError(f"window must be >= 2, got {window}")
        self.window = int(window)
        self.rel = float(rel)
        self.every = max(1, self.window // 20)
        self.losses: deque[float] = deque(maxlen=self.window)
        self.active = False
        self.start: int | None = None
        self.count = 0
        self._seen = 0

    def update(self, step: int, loss: float) -> RuleEvent | None:
        """Feed the loss of ``step``; an event when a plateau starts (or, info, when it ends)."""
        if not math.isfinite(loss):
            return None
        self.losses.append(loss)
        self._seen += 1
        if len(self.losses) < self.window or self._seen % self.every:
            return None
        vals = list(self.losses)
        half = self.window // 2
        old = _median(vals[:half])
        new = _median(vals[-half:])
        diff = abs(new - old)
        floor = self.rel * max(abs(old), 1e-12)
        change = diff / max(abs(old), 1e-12)
        if diff >= floor:  # beyond the relative floor: is the move within the noise?
            d = [b - a for a, b in itertools.pairwise(vals)]
            md = _median(d)
            noise = MAD_TO_SIGMA * _median([abs(x - md) for x in d]) / math.sqrt(2)
            se = 1.2533 * noise * math.sqrt(2 / half)
        else:
            se = 0.0
        if self.active:
            if diff >= max(floor, 4 * se):
                start, self.start, self.active = self.start, None, False
                return RuleEvent(
                    kind="loss_plateau_end",
                    step=step,
                    message=f"loss moving again (median {_fmt(old)} -> {_fmt(new)}) after a plateau of {step - (start or step)} steps",
                    severity="info",
                    evidence={
                        "since": start,
                        "steps": step - (start or step),
                        "old_median": old,
                        "new_median": new,
                    },
                )
            return None
        if diff >= max(floor, 2 * se):
            return None
        self.active = True
        self.start = step
        self.count += 1
        within = (
            f" (within its noise, {_fmt(100 * 2 * se / max(abs(old), 1e-12))} %)" if diff >= floor else ""
        )
        return RuleEvent(
            kind="loss_plateau",
            step=step,
            message=(
                f"loss changed by {_fmt(100 * change)} %{within} over the last {self.window} steps "
                f"(median {_fmt(old)} -> {_fmt(new)}); training has stalled or converged"
            ),
            severity="info",
            evidence={
                "relative_change": change,
                "old_median": old,
                "new_median": new,
                "window": self.window,
                "noise_se": se,
            },
        )


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


class LRRule:
    """Learning-rate events: ``lr_change`` (info), ``lr_zero`` and ``lr_nonfinite``.

    ``lr_change`` fires when a group's LR changes after having been constant for at least one
    step, i.e. once at the start of each stretch of changes: a step schedule or a manual change
    gives one event per jump, a smooth per-step schedule (cosine, linear warm-up) one event when
    it starts moving, not one per step. ``lr_zero`` fires when an LR that was positive becomes 0
    by a jump (a warm-up from 0 does not fire, nor does a schedule that decays to 0: a drop to 0
    that follows a decrease at the step before and is at most twice that decrease, as at the last
    step of a linear or cosine decay); ``lr_nonfinite`` when an LR is NaN/Inf. Once per episode each.

    Example:
        >>> rule = LRRule()
        >>> rule.update(0, (0.1,)), rule.update(1, (0.1,))
        ([], [])
        >>> [e.kind for e in rule.update(2, (0.01,))]
        ['lr_change']
    """

    def __init__(self) -> None:
        self.prev: tuple[float, ...] | None = None
        self.prev2: tuple[float, ...] | None = None  # the step before prev: is a drop to 0 scheduled?
        self.changing: list[bool] = []
        self.zero: set[int] = set()
        self.bad: set[int] = set()

    def update(
        self,
        step: int,
        lrs: Sequence[float],
        labels: Sequence[str] | Callable[[], Sequence[str] | None] | None = None,
    ) -> list[RuleEvent]:
        """Feed the per-group learning rates of ``step`` (``labels``: what to call each, or a callable
        returning them, called only when the rates moved; default ``param group <g>``; with several
        optimizers, which optimizer's group)."""
        lrs = tuple(map(float, lrs))
        prev = self.prev
        if prev == lrs and not (self.bad or self.zero or True in self.changing):
            # the usual answer: the same finite rates as the step before, and nothing under way (a
            # non-finite rate is in ``bad``, so a NaN equal to itself by identity never lands here)
            self.prev2 = prev
            return []
        out: list[RuleEvent] = []
        if callable(labels):
            labels = labels()
        label = (
            (lambda g: labels[g])
            if labels is not None and len(labels) == len(lrs)
            else (lambda g: f"param group {g}")
        )
        if prev is None or len(prev) != len(lrs):
            self.prev, self.prev2, self.changing = lrs, None, [False] * len(lrs)
            prev = None
        prev2 = self.prev2
        for g, lr in enumerate(lrs):
            if not math.isfinite(lr):
                if g not in self.bad:
                    self.bad.add(g)
                    out.append(
                        RuleEvent(
                            "lr_nonfinite",
                            step,
                            f"learning rate of {label(g)} is {lr}; check the scheduler",
                            "error",
                            evidence={"group": g, "lr": lr},
                        )
                    )
                continue
            self.bad.discard(g)
            if prev is None:
                continue
            before = prev[g]
            # the end of a decay to 0: the step before also decreased, by at least half this drop
            last_drop = prev2[g] - before if prev2 is not None and self.changing[g] else 0.0
            scheduled = last_drop > 0 and before <= 2.0 * last_drop * (1 + 1e-6)
            if lr == 0 and before > 0 and g not in self.zero and not scheduled:
                self.zero.add(g)
                out.append(
                    RuleEvent(
                        "lr_zero",
                        step,
                        f"learning rate of {label(g)} dropped to 0 (was {_fmt(before)}): nothing will be learned",
                        "warning",
                        evidence={"group": g, "lr": lr, "previous": before},
                    )
                )
            if lr != 0:
                self.zero.discard(g)
            moved = lr != before and math.isfinite(before)
            if moved and not self.changing[g]:
                out.append(
                    RuleEvent(
                        "lr_change",
                        step,
                        f"learning rate of {label(g)}: {_fmt(before)} -> {_fmt(lr)}",
                        "info",
                        evidence={"group": g, "lr": lr, "previous": before},
                    )
                )
            self.changing[g] = moved
        self.prev2, self.prev = prev, lrs
        return out


class AmpScaleRule:
    """GradScaler health: ``amp_skip`` (info, the parameters holding Inf/NaN) and ``amp_scale_collapse``.

    ``amp_scale_collapse`` (warning, once per episode) fires when the loss scale falls below
    ``floor`` or, once an update has gone through, shrinks ``shrink_steps`` steps in a row: no finite
    scale exists for this model in fp16. The skips before the first update are the scaler calibrating
    its initial guess (``init_scale`` 2**16 by default, 2**32 in some DeepSpeed configs, halving once a
    step): only the floor speaks then. ``skips`` counts skipped steps.

    Example:
        >>> rule = AmpScaleRule(floor=1.0, shrink_steps=2)
        >>> rule.update(0, 1024.0, False), rule.update(1, 512.0, True, ("fc.weight",))[0].kind
        ([], 'amp_skip')
        >>> [e.kind for e in rule.update(2, 256.0, True)]
        ['amp_skip', 'amp_scale_collapse']
        >>> calibrating = AmpScaleRule(floor=1.0, shrink_steps=2)
        >>> [len(calibrating.update(i, 2.0 ** (40 - i), True)) for i in range(4)]  # skips, no warning
        [1, 1, 1, 1]
    """

    def __init__(self, floor: float = 1.0, shrink_steps: int = 5) -> None:
        self.floor = float(floor)
        self.shrinks = Streak(int(shrink_steps))
        self.prev: float | None = None
        self.active = False
        self.skips = 0
        self.updated = False  # an update went through: the scaler has found a scale that works

    def update(
        self, step: int, scale: float, skipped: bool, bad_params: Sequence[str] = ()
    ) -> list[RuleEvent]:
        """Feed the scale after ``step``, whether the step was skipped and the params with Inf/NaN grads."""
        out: list[RuleEvent] = []
        if skipped:
            self.skips += 1
            where = f": Inf/NaN in the gradients of {', '.join(bad_params)}" if bad_params else ""
            out.append(
                RuleEvent(
                    "amp_skip",
                    step,
                    f"GradScaler skipped the optimizer step{where}; the scale drops to {_fmt(scale)}",
                    "info",
                    modules=tuple(dict.fromkeys(owner(p) for p in bad_params)),
                    evidence={"scale": scale, "params": list(bad_params)},
                )
            )
        self.updated = self.updated or not skipped
        shrinking = self.prev is not None and scale < self.prev and self.updated
        streak = self.shrinks.update(shrinking)
        collapsed = scale < self.floor or self.shrinks.count >= self.shrinks.patience
        if collapsed and not self.active and (streak or scale < self.floor):
            self.active = True
            out.append(
                RuleEvent(
                    "amp_scale_collapse",
                    step,
                    f"loss scale {_fmt(scale)} "
                    + (
                        f"is below {_fmt(self.floor)}"
                        if scale < self.floor
                        else f"shrank {self.shrinks.count} steps in a row"
                    )
                    + ": no finite scale: consider bf16 (torch.autocast(dtype=torch.bfloat16) needs no GradScaler) "
                    "or find the op that overflows in fp16",
                    "warning",
                    evidence={"scale": scale, "floor": self.floor, "shrink_streak": self.shrinks.count},
                )
            )
        elif not collapsed:
            self.active = False
        self.prev = scale
        return out


def activation_scalars(
    act: Mapping[str, Any], values: Mapping[str, float], prefix: str
) -> tuple[dict[str, float], dict[str, float]]:
    """Read back one step's activation statistics: (series to log, dead-unit fraction per module).

    ``act`` maps a module name to the statistic keys captured for it; each value was handed to the
    step's transfer as ``f"{prefix}.{key}.{module}"``. Series: ``dead_units/<m>``, ``saturated/<m>``,
    ``act_<key>/<m>`` (the root module shown as ``<root>``).
    """
    scalars: dict[str, float] = {}
    dead: dict[str, float] = {}
    for mod, keys in act.items():
        label = mod or "<root>"
        for key in keys:
            v = float(values[f"{prefix}.{key}.{mod}"])
            if key == "dead":
                dead[mod] = v
                scalars[f"dead_units/{label}"] = v
            elif key == "saturated":
                scalars[f"saturated/{label}"] = v
            else:
                scalars[f"act_{key}/{label}"] = v
    return scalars, dead


class DeadUnitRule:
    """Dead units: the fraction of a ReLU-like layer's output features that were zero for the whole
    batch exceeds ``fraction``; once per layer per episode.

    Example:
        >>> DeadUnitRule(0.9).update(0, {"act": 0.95}).modules
        ('act',)
    """

    def __init__(self, fraction: float = 0.95) -> None:
        self.fraction = float(fraction)
        self.active: set[str] = set()
        self.count = 0

    def update(self, step: int, dead: Mapping[str, float]) -> RuleEvent | None:
        """Feed per-layer dead fractions of one detail check."""
        fired = fire_once(self.active, dead, lambda frac: frac > self.fraction)
        if not fired:
            return None
        self.count += len(fired)
        listed = ", ".join(f"{k} {100 * v:.0f} %" for k, v in fired.items())
        return RuleEvent(
            "dead_units",
            step,
            f"units zero for the whole batch above {100 * self.fraction:.0f} %: {listed}. "
            "Lower the learning rate, use LeakyReLU/GELU or check the initialisation.",
            "warning",
            modules=tuple(fired),
            evidence={"dead_fraction": dict(fired), "threshold": self.fraction},
        )


class UpdateRatioRule:
    """Update/weight ratio ``|Δθ| / |θ|`` of a matrix parameter outside ``[lo, hi]`` at ``patience``
    detail checks in a row.

    Only parameters with >= 2 dimensions are judged (biases and norm scales start near 0, so their
    ratio says little); a ratio of exactly 0 (the parameter was not updated) is left to the
    vanishing rule. One check is never enough: an optimizer's first update is not its steady size
    (Adadelta's first step moves every element by ~sqrt(eps / 0.1) = 3.2e-3 whatever the gradient:
    0.15 of a small Linear(2304, 32) weight, 0.05 ten steps later; Adam's first steps are
    ``lr * sign(g)``). Once per parameter per episode.

    Too large: healthy standard recipes move their matrices by far more than the 1e-3 of the folk
    rule: ResNet-18 under SGD lr 0.1 momentum 0.9 by 0.18-0.28 of their norm a step in its first
    checks, word_language_model's LSTM (SGD lr 20, clip 0.25) by up to 0.4, a small GPT under AdamW
    warm-up by ~0.1 (benchmarks/rule_margins.py prints them). So ``hi`` defaults to 1: an update at
    least as large as the weight itself, twice in a row, rewrites the parameter every step (AdamW at
    lr 1 on GPT-2's N(0, 0.02) weights: ~50).

    A learning rate lowered on purpose: fed the step's learning rates (:meth:`see_lr`), the rule
    keeps their peak; once the largest group's rate is at most ``lowered`` x that peak (the tail of a
    cosine or linear decay, a step schedule's drops, a plateau scheduler's cuts, or the user's own
    code lowering it), small updates are what the schedule asks for: "too small" is not said
    then. Too-large updates are said at any learning rate.

    Example:
        >>> rule = UpdateRatioRule(1e-5, 1.0)
        >>> rule.update(0, {"fc.weight": 5.0}, {"fc.weight": 2}) is None
        True
        >>> rule.update(10, {"fc.weight": 5.0}, {"fc.weight": 2}).kind
        'update_ratio'
    """

    def __init__(self, lo: float = 1e-5, hi: float = 1.0, patience: int = 2, lowered: float = 0.5) -> None:
        self.lo, self.hi = float(lo), float(hi)
        self.patience = int(patience)
        self.lowered = float(lowered)
        self.lr_now = 0.0  # the largest group's learning rate at the last step, and its peak so far
        self.lr_peak = 0.0
        self.streaks: dict[str, Streak] = {}
        self.active: set[str] = set()
        self.count = 0

    def see_lr(self, lrs: Sequence[float]) -> None:
        """Feed one step's learning rates (one per parameter group; host floats, no sync)."""
        finite = [x for x in lrs if math.isfinite(x) and x > 0]
        if finite:
            self.lr_now = max(finite)
            self.lr_peak = max(self.lr_peak, self.lr_now)

    @property
    def scheduled_down(self) -> bool:
        """Whether the learning rate now is at most ``lowered`` x its peak (lowered on purpose)."""
        return self.lr_peak > 0 and self.lr_now <= self.lowered * self.lr_peak

    def update(self, step: int, ratios: Mapping[str, float], ndims: Mapping[str, int]) -> RuleEvent | None:
        """Feed per-parameter update/weight ratios of one detail check and the parameters' ``ndim``."""
        judged = {n: r for n, r in ratios.items() if ndims.get(n, 0) >= 2 and r != 0 and r == r}  # no NaN
        low_ok = self.scheduled_down  # the schedule lowered the rate: small updates are its intent

        def sustained(name: str, r: float) -> bool:
            streak = self.streaks.get(name)
            if streak is None:  # not setdefault: no new Streak per parameter per check
                streak = self.streaks[name] = Streak(self.patience)
            streak.update((r < self.lo and not low_ok) or r > self.hi)
            return streak.count >= self.patience

        flags = {n: float(sustained(n, r)) for n, r in judged.items()}
        fired = {n: judged[n] for n in fire_once(self.active, flags, bool)}
        if not fired:
            return None
        self.count += len(fired)
        high = [n for n, r in fired.items() if r > self.hi]
        listed = ", ".join(f"{k} {v:.3g}" for k, v in fired.items())
        seen = f"{self.patience} detail checks in a row"
        said = (
            f"each update was larger than {self.hi:g}x the weight itself at {seen}. Check first the "
            "learning rate these parameters get, then the gradient's scale (clip_grad_norm_)"
            if high
            else f"each update moved them by less than {self.lo:g} of their norm at {seen}. Check first "
            "that their learning rate is the one intended and that they get a gradient"
        )
        return RuleEvent(
            "update_ratio",
            step,
            f"update/weight ratio outside [{self.lo:g}, {self.hi:g}]: {listed}; {said}",
            "warning",
            modules=tuple(dict.fromkeys(owner(n) for n in fired)),
            evidence={"ratios": dict(fired), "min": self.lo, "max": self.hi},
        )


# --------------------------------------------------------------------------- activation statistics

_RELU_LIKE: tuple[type[nn.Module], ...] = (nn.ReLU, nn.ReLU6)


def activation_stats(module: nn.Module, out: torch.Tensor) -> dict[str, torch.Tensor]:
    """On-device statistics of one activation: mean, std, zero fraction, dead (ReLU) / saturated fraction.

    Dead fraction: share of output features (dim 1 for inputs with >= 4 dims, the last dim
    otherwise) that are zero for every sample/position of the batch. Saturated fraction: share of
    elements with ``|y| > 0.99`` after Tanh, ``y < 0.01 or y > 0.99`` after Sigmoid. Returns 0-dim
    float32 tensors on the output's device; no host sync.
    """
    y = out.detach()
    f = y.float()
    stats = {
        "mean": f.mean(),
        "std": f.std() if f.numel() > 1 else torch.zeros((), device=f.device),
        "zero": (y == 0).float().mean(),
    }
    if isinstance(module, _RELU_LIKE) and y.dim() >= 2:
        fdim = 1 if y.dim() >= 4 else y.dim() - 1
        alive = (y != 0).movedim(fdim, -1).reshape(-1, y.shape[fdim]).any(0)  # (features,)
        stats["dead"] = 1.0 - alive.float().mean()
    elif isinstance(module, nn.Tanh):
        stats["saturated"] = (f.abs() > 0.99).float().mean()
    elif isinstance(module, nn.Sigmoid):
        stats["saturated"] = ((f < 0.01) | (f > 0.99)).float().mean()
    return stats


# --------------------------------------------------------------------------- the instrument

_EARLY_COUNTER = ("counter", "num_bad_epochs", "wait", "bad_epochs")
_EARLY_BEST = ("best", "best_score", "best_loss", "best_metric")


class GradientHealth:
    """The ``gradients`` instrument (with its ``gradient_details`` and ``activations`` parts).

    Every step, host side after the monitor's transfer (the monitor itself logs ``loss``,
    ``grad_norm``, ``lr/<group>`` and ``amp_scale``): the explosion, loss spike/plateau/divergence
    (``health/divergence.py``), LR and AMP rules, and ``grad_norm_clipped`` when the user clipped. Every ``detail_every`` steps
    (``gradient_details``): per-parameter ``grad_norm/<param>``, ``weight_norm/<param>`` and
    ``update_ratio/<param>`` (|Δθ|/|θ| measured across the optimizer step on the device) and the
    vanishing and update-ratio rules. With ``activations`` (``activation_stats=True`` or the
    advanced level): forward hooks on leaf modules log ``act_mean|act_std|act_zero/<module>``,
    ``dead_units/<module>`` (ReLU) and ``saturated/<module>`` (Tanh, Sigmoid) on detail steps and
    run the dead-unit rule.

    While installed, ``torch.nn.utils.clip_grad_norm_`` (both spellings) is wrapped to see the
    total norm it returns and its ``max_norm``; the originals come back on ``remove``.
    ``clip_on_spike=max_norm`` clips the gradients in place at the optimizer pre-hook of a step
    the explosion rule flags (event ``auto_clip``).

    ``counters`` keeps the seed-era summary numbers: ``total_steps``, ``anomaly_steps`` (steps with
    a warning/error event of this instrument), ``gradient_explosions`` (exploding steps),
    ``gradient_vanishing`` (layers flagged), ``loss_anomalies`` (spiking or non-finite losses);
    :meth:`summary` adds the rates.

    Cost per step: host arithmetic on numbers the monitor already transferred. Detail steps: one
    copy of the trainable weights and two fused norms. Activations: 3-4 small reductions per leaf
    module on detail steps; a Python check per module call otherwise.

    Known limitations: code that imported ``clip_grad_norm_`` by name before ``watch()`` (``from
    torch.nn.utils import clip_grad_norm_``) keeps the unwrapped function, so its clipping is not
    seen; several clip calls in one step keep the last; activation statistics use each module's
    first call in a detail step (one micro-batch); the dead-unit feature dimension is dim 1 for
    outputs with >= 4 dims and the last dim otherwise (a Conv1d output is judged per position);
    under AMP the norms are the monitor's, already divided by the loss scale backward used; a trainable layer the
    forward never uses (its gradient stays None, norm 0) is reported as vanishing.
    """

    name = "gradients"

    def __init__(self, *, details: bool | None = None, activations: bool | None = None) -> None:
        self._details_opt = details
        self._activations_opt = activations
        self.counters: dict[str, int] = {
            "total_steps": 0,
            "anomaly_steps": 0,
            "gradient_explosions": 0,
            "gradient_vanishing": 0,
            "loss_anomalies": 0,
        }
        self._last_clip: dict[str, Any] | None = None
        self._clip_norms: tuple[Sequence[str], Callable[[], Sequence[float] | None]] = ((), lambda: None)
        self._optnorms = OptimizerNorms()
        self._optstate = OptimizerState()  # the optimizers' state, finite or not (detail steps)
        self._state_probe: tuple[int, torch.Tensor] | None = None  # (step, its device number), to read
        self._per_handed: Any = None  # the gradient reduction whose per-parameter numbers a read carried
        self.observed: dict[str, float] = {}
        self.early_stopping_state: dict[str, float] = {}
        self._hooks: list[Any] = []
        self._auto_clipping = False  # inside clip_on_spike's own clip: not the user's clip
        self._names_cache: Any = None

    # ----------------------------------------------------------------- setup

    def install(self, mon: SessionView) -> None:
        cfg = mon.config
        enabled = cfg.instruments()
        self.details = self._details_opt if self._details_opt is not None else "gradient_details" in enabled
        self.activations = (
            self._activations_opt
            if self._activations_opt is not None
            else ("activations" in enabled or bool(cfg.activation_stats))
        )
        self.every = int(cfg.detail_every)
        # seed 002's "full tensor history" at the expert level: tensor_stats rows on detail steps
        self.history = self.details and cfg.level.value == "expert"
        self.explosion = ExplosionRule(cfg.explode_mads, cfg.explode_abs, cfg.explode_warmup)
        self.vanishing = VanishingRule(cfg.vanish_threshold, cfg.vanish_patience)
        self.spike = LossSpikeRule(cfg.loss_spike_mads, cfg.explode_warmup)
        self.plateau = LossPlateauRule(cfg.loss_plateau_window, cfg.loss_plateau_rel)
        self.divergence = DivergenceRule()
        self.growth = GrowthRule()
        self.norm_shift = NormShiftRule()
        # one warning per episode across the explosion and the divergence rules: the rules whose
        # start was not emitted because another had named the episode (their end is not emitted either)
        self._muted: set[str] = set()
        self.lr_rule = LRRule()
        self.amp = AmpScaleRule(cfg.scale_floor, cfg.scale_shrink_steps)
        self.dead = DeadUnitRule(cfg.dead_unit_fraction)
        self.ratio_rule = UpdateRatioRule(cfg.update_ratio_min, cfg.update_ratio_max)
        self._lrs_seen: Any = None  # the rates the ratio rule last saw (fed again when they move)
        self.clip_on_spike: float | None = cfg.clip_on_spike
        self._synced_step: int | None = None  # the step whose transfer already ran (collect was called)
        self._judged_step: int | None = None  # the step the explosion rule already judged
        # weights before a detail step's update: (plan, its flat copy) on the CPU, else (params, a copy each)
        self._before: tuple[Any, Any] | None = None
        self._before_step: int | None = None  # the step ``_before`` was copied at
        self._updated = False  # an update ran since ``_before`` was copied (its ratio is still to work out)
        self._pending: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (step, ratios, weight norms)
        self._handed: dict[str, Any] = {}  # what this step's collect calls handed to the transfer
        self._clip: tuple[torch.Tensor, float, float] | None = None
        self._act: dict[str, dict[str, torch.Tensor]] = {}
        self._act_armed = False
        self._act_step: int | None = None
        self._step_had_anomaly = False
        # the forward's start arms the activation capture: without one no call a step (the session's
        # dispatch skips a method set to None)
        if self.activations:
            self.__dict__.pop("on_forward_start", None)
        else:
            self.__dict__["on_forward_start"] = None
        if self.activations:
            for mod in mon.model.modules():
                if next(iter(mod.children()), None) is None:
                    hook = mod.register_forward_hook(self._make_act_hook(mon.names.get(mod, "")))
                    self._hooks.append(mon.installs.hook(hook))

    def remove(self, mon: SessionView) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._before, self._updated = None, False

    # ----------------------------------------------------------------- clip_grad_norm_ wrapping

    def on_clip(self, mon: SessionView, total: Any, max_norm: Any, norm_type: Any) -> None:
        """``clip_grad_norm_`` ran (the session's patch tells every instrument); not our own auto clip."""
        if isinstance(total, torch.Tensor) and not self._auto_clipping:
            self._clip = (total.detach(), float(max_norm), float(norm_type))

    # ----------------------------------------------------------------- activations

    def _make_act_hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            if not self._act_armed or name in self._act or not isinstance(out, torch.Tensor):
                return
            if out.is_floating_point() and out.numel() > 0:
                self._act[name] = activation_stats(module, out)

        return hook

    def on_forward_start(
        self, mon: SessionView, module: Any = None, args: Any = None, kwargs: Any = None
    ) -> None:
        if not self.activations:
            return
        step = mon.global_step
        if step != self._act_step:
            self._act_step = step
            self._act = {}
            self._act_armed = mon.due(self.every)

    # ----------------------------------------------------------------- optimizer step

    def before_optimizer_step(self, mon: SessionView) -> None:
        step = mon.global_step
        norm = mon.grad_norm_host
        # judge here only when this step's transfer already ran (the monitor syncs right before us)
        if self._synced_step == step and norm is not None and self._judged_step != step:
            unscaled = norm  # the monitor reports norms already divided by the loss scale backward used
            self._judge_growth(mon, step, unscaled, mon.transfer.values.get("loss"))
            if self.explosion.active and self.clip_on_spike is not None:  # active: this step explodes
                self._auto_clipping = True
                try:
                    torch.nn.utils.clip_grad_norm_(list(mon.params), self.clip_on_spike)
                finally:
                    self._auto_clipping = False
                self._emit(
                    mon,
                    RuleEvent(
                        "auto_clip",
                        step,
                        f"gradient norm {_fmt(unscaled)} clipped to {_fmt(self.clip_on_spike)} "
                        "before the update (clip_on_spike)",
                        "warning",
                        evidence={"grad_norm": unscaled, "max_norm": float(self.clip_on_spike)},
                    ),
                )
        # several updates in a step (several optimizers): one copy before the first, so the ratio after
        # the last covers every update of the step
        if self.details and mon.due(self.every) and mon.params and self._before_step != step:
            self._update_ratio(mon)  # an earlier step's, not read yet
            plan = _plan(mon)
            self._before_step, self._updated = step, False
            with torch.no_grad():  # detail steps only: the update ratio's one copy of the weights
                # CPU: one flat buffer (one call). Elsewhere a fused copy (a kernel per chunk of tensors)
                # and later the fused norm: segment_reduce on CUDA waits for the device (a hidden sync,
                # ~5 ms a detail step on an H100's GPT-2 small)
                if plan is not None and plan.cpu:
                    self._before = (plan, plan.snapshot(mon.params))
                else:
                    self._before = (mon.params, torch._foreach_mul(list(mon.params), 1.0))

    def after_optimizer_step(self, mon: SessionView) -> None:
        if mon.due(self.every) and mon.optimizers:
            # detail steps: the state after the update, one fused reduction, read with the step's numbers
            # (several updates in a step: the last one's probe covers every optimizer's state)
            probe = self._optstate.probe(mon)
            self._state_probe = None if probe is None else (mon.global_step, probe)
        if self._before is not None and self._before_step == mon.global_step:
            # the ratio is worked out when it is read, after the step's last update (several optimizers
            # each end an update here): then the snapshot itself can become the change, no second copy
            self._updated = True

    def _update_ratio(self, mon: SessionView) -> None:
        """The snapshot of the weights turned into the update's ratios and the weight norms (``_pending``,
        device tensors read with the step's numbers); dropped when no update ran since it was taken.
        Worked out at the step's read after its last update, so the change is the weights' over the
        step: every optimizer's update, and an edit of the weights after it (a WGAN's clamp) too."""
        before, updated, step = self._before, self._updated, self._before_step
        self._before, self._updated = None, False
        if before is None or not updated or step is None:
            return
        with torch.no_grad():
            if isinstance(before[0], Plan):  # the plan's flat copy: a few torch calls in all
                plan, snap = before
                if _plan(mon) is not plan:
                    return  # the parameter list changed since the copy: no ratio for that step
                delta, weight = plan.update_norms(snap, mon.params)  # snap becomes the change
            else:
                params, snap = before
                if params is not mon.params or len(params) != len(snap):
                    return  # the parameter list changed since the copy: no ratio for that step
                params = list(params)
                torch._foreach_sub_(snap, params)  # in place: the copy becomes the change
                delta, weight = foreach_norms(snap), foreach_norms(params)
            ratio = delta / weight.clamp_min(torch.finfo(torch.float32).tiny)
        self._pending = (step, ratio, weight)

    # ----------------------------------------------------------------- the step's transfer

    def collect(self, mon: SessionView) -> dict[str, torch.Tensor]:
        self._synced_step = mon.global_step
        out: dict[str, torch.Tensor] = {}
        red = mon.transfer.reduced
        every = self.every  # (``mon.due(self.every)``, inlined here and at the step end: every step)
        if (
            red is not None
            and red is not self._per_handed
            and self.details
            and every > 0
            and mon.global_step % every == 0
        ):
            # detail steps: every parameter's gradient norm, read with the step's numbers (ordinary
            # steps read only their total); again at a later read when a backward came since (several
            # updates in the step), so the step end needs no read of its own
            self._per_handed = red
            out.update(mon.transfer.per_tensor_items())
        if len(mon.optimizers) > 1:  # several optimizers: each one's gradient norm
            out.update(self._optnorms.items(mon))
        if self._clip is not None:
            total, max_norm, norm_type = self._clip
            self._clip = None
            out["health.clip_total"] = total.reshape(())
            self._handed["clip"] = (max_norm, norm_type)
        if self._updated and mon.state.phase != StepPhase.UPDATE:
            # (not in the read before a later update of the same step: the ratios then are not final)
            self._update_ratio(mon)
        if self._pending is not None and mon.state.phase != StepPhase.UPDATE:
            step, ratio, weight = self._pending
            self._pending = None
            out["health.ratio"] = ratio  # read as one list each (the transfer's VECTORS)
            out["health.weight"] = weight
            self._handed["update"] = (step, len(ratio))
        if self._state_probe is not None and mon.state.phase != StepPhase.UPDATE:
            out[STATE_ITEM] = self._state_probe[1].reshape(())
            self._handed["state"] = self._state_probe[0]
            self._state_probe = None
        if self._act:
            for mod, stats in self._act.items():
                for key, t in stats.items():
                    out[f"health.act.{key}.{mod}"] = t
            self._handed["act"] = (self._act_step, self._act)
            self._act = {}
            self._act_armed = False  # what was captured is handed over: no second capture this step
        return out

    def on_step_end(self, mon: SessionView, record: Any, values: Mapping[str, float]) -> None:
        step = int(record.step)
        handed, self._handed = self._handed, {}
        if self._before is not None and self._before_step is not None and self._before_step <= step:
            self._update_ratio(mon)  # a step that ended unread (its ratio goes with a later read)
        self.counters["total_steps"] += 1
        loss = values.get("loss")
        norm = values.get("grad_norm")
        names = mon.param_names  # read only (no copy a step)
        scalars: dict[str, float] = {}
        amp = mon.scaler is not None and record.scale is not None

        if norm is not None and self._judged_step != step and not record.skipped:
            self._judge_growth(mon, step, float(norm), loss)  # already unscaled by the monitor
        self.counters["gradient_explosions"] = self.explosion.count
        if loss is not None and not record.skipped:
            # a skipped AMP step's loss is unscaled with the scale after update(): not comparable
            loss = float(loss)
            for rule in (self.spike, self.plateau):
                event = rule.update(step, loss)
                if event is not None:
                    self._emit(mon, event)
            # several optimizers (a GAN): the loss is a mean of objectives that pull against each other
            self.divergence.several = len(mon.optimizers) > 1
            event = self.divergence.update(step, loss)
            if event is not None:
                self._emit_episode(mon, "level", event, self.growth.active)
            if not math.isfinite(loss) or self.spike.active:
                self.counters["loss_anomalies"] += 1
        lrs = record.lr or ()
        if lrs != self._lrs_seen:  # (a C-level comparison: the rates moved, or the first step)
            self._lrs_seen = lrs
            self.ratio_rule.see_lr(lrs)
        for event in self.lr_rule.update(step, lrs, lambda: mon.lr_labels):
            if event.kind == "lr_nonfinite" and "nonfinite" in mon.config.instruments():
                continue  # the sentinel named it before the update, as an `optimizer` anomaly
            self._emit(mon, event)
        if amp:
            bad = (
                [n for n, v in zip(names, mon.grad_norms_host or ()) if not math.isfinite(v)]
                if record.skipped
                else []
            )
            for event in self.amp.update(step, float(record.scale), bool(record.skipped), bad):
                self._emit(mon, event)
        if "clip" in handed and "health.clip_total" in values:
            self._clip_insight(mon, step, float(values["health.clip_total"]), handed["clip"], record, scalars)
        every = self.every
        due = every > 0 and mon.global_step % every == 0
        norms_host = mon.grad_norms_host if self.details and due else None
        if norms_host is not None:
            _log_vector(mon, step, self._detail_names(mon)[3], norms_host)  # host floats, names built once
            if not record.skipped:
                event = self.vanishing.update(step, layer_norms(names, norms_host))
                if event is not None:
                    self.counters["gradient_vanishing"] += len(event.modules)
                    self._emit(mon, event)
        if scalars:
            mon.log_scalars(scalars, step=step)
        if self.history and norms_host is not None and getattr(mon, "writer", None) is not None:
            self._tensor_history(mon, step)
        if "update" in handed:
            step_u = handed["update"][0]
            vectors = mon.transfer.vectors
            self._update_insight(
                mon, step_u, vectors.get("health.ratio", []), vectors.get("health.weight", [])
            )
        if "act" in handed:
            self._act_insight(mon, step, handed["act"], values)
        if "state" in handed and STATE_ITEM in values:
            event = self._optstate.judge(mon, handed["state"], float(values[STATE_ITEM]))
            if event is not None:
                self._emit(mon, event)
        if mon.early_stopping is not None:
            self._early_stopping(mon, step)
        if self._step_had_anomaly:  # also set before the update (an explosion judged pre-update)
            self.counters["anomaly_steps"] += 1
        self._step_had_anomaly = False

    # ----------------------------------------------------------------- pieces of on_step_end

    def _clip_insight(
        self,
        mon: SessionView,
        step: int,
        total: float,
        clip: tuple[float, float],
        record: Any,
        scalars: dict[str, float],
    ) -> None:
        max_norm, norm_type = clip
        names = mon.param_names
        finite = math.isfinite(total)
        # clip_grad_norm_ scales the gradients by min(1, max_norm / (total + 1e-6))
        post = total * min(1.0, max_norm / (total + 1e-6)) if finite else math.nan
        scalars["grad_norm_clipped"] = post
        # the per-parameter norms are read only if the clip's shares are asked for (``last_clip``)
        self._clip_norms = (names, mon.transfer.norms_later())
        self._last_clip = {
            "step": step,
            "pre": total,
            "post": post,
            "max_norm": max_norm,
            "norm_type": norm_type,
            "clipped": finite and total > max_norm,
        }
        if norm_type != 2.0:
            self._last_clip["shares"] = {}
        if not finite and not record.skipped:
            norms_host = mon.grad_norms_host  # rare path: read now
            # per-parameter norms the monitor read (confirmed exactly when not finite): Inf/NaN here
            # means a gradient really held Inf/NaN (an Inf times clip_coef 0 is NaN, so clipping
            # cannot hide it)
            bad = [n for n, v in zip(names, norms_host or ()) if not math.isfinite(v)]
            if bad or norms_host is None or math.isnan(total):
                self._emit(
                    mon,
                    RuleEvent(
                        "clip_nonfinite",
                        step,
                        f"clip_grad_norm_ got a non-finite total norm ({total})"
                        + (f"; Inf/NaN in the gradients of {', '.join(bad)}" if bad else "")
                        + ": clipping cannot repair it, the update will be NaN",
                        "error",
                        modules=tuple(dict.fromkeys(owner(n) for n in bad)),
                        evidence={"total_norm": total, "max_norm": max_norm, "params": bad},
                    ),
                )
            else:
                # every gradient finite, but their norm overflowed in the gradients' dtype: clip_coef
                # = max_norm / (inf + 1e-6) = 0 and clip_grad_norm_ multiplied every gradient by 0
                grads = [p.grad for p in mon.params if p.grad is not None]
                dtype = str(grads[0].dtype).replace("torch.", "") if grads else "float32"
                self._emit(
                    mon,
                    RuleEvent(
                        "clip_overflow",
                        step,
                        f"clip_grad_norm_'s total norm overflowed to {total} in {dtype} although every "
                        f"gradient was finite: it scaled them by max_norm / inf = 0, so this step's "
                        "gradients are all zero and the update carries no gradient (only momentum or "
                        "weight decay move the weights). Gradients this large mean the run is "
                        "diverging: lower the learning rate (or the loss scale) rather than clip",
                        "warning",
                        evidence={"total_norm": total, "max_norm": max_norm, "dtype": dtype},
                    ),
                )

    def _tensor_history(self, mon: SessionView, step: int) -> None:
        """The expert level's tensor history: statistics of the first ``HISTORY_TENSORS`` trainable
        weights and their gradients as ``tensor_stats`` rows (``<param>`` and ``<param>.grad``).

        Cost (detail steps, expert level only): one ``analyze_tensor`` per tensor, a host read each.
        """
        from ..stats import analyze_tensor

        for name, p in itertools.islice(zip(mon.param_names, mon.params), HISTORY_TENSORS):
            mon.writer.log_tensor_stats(step, name, analyze_tensor(p.detach(), name))
            if p.grad is not None:
                mon.writer.log_tensor_stats(step, f"{name}.grad", analyze_tensor(p.grad, f"{name}.grad"))

    @property
    def last_clip(self) -> dict[str, Any] | None:
        """The last ``clip_grad_norm_`` seen: ``step, pre, post, max_norm, norm_type, clipped`` and
        ``shares`` (the largest parameters' shares of the squared norm; worked out when read)."""
        clip = self._last_clip
        if clip is not None and "shares" not in clip:
            names, get = self._clip_norms
            norms_host = get()
            shares: list[tuple[str, float]] = []
            if norms_host is not None:
                sq = [v * v for v in norms_host]
                tot = sum(v for v in sq if math.isfinite(v))
                if tot > 0:
                    shares = sorted(
                        ((n, v / tot) for n, v in zip(names, sq) if math.isfinite(v)), key=lambda x: -x[1]
                    )[:TOP_K]
            clip["shares"] = dict(shares)
        return clip

    def _update_insight(
        self, mon: SessionView, step: int, ratio: Sequence[float], weight: Sequence[float]
    ) -> None:
        names = mon.param_names[: len(ratio)]
        names_u, names_w, ndims, _ = self._detail_names(mon)
        _log_vector(mon, step, names_u, list(ratio))
        _log_vector(mon, step, names_w, list(weight))
        ratios = dict(zip(names, ratio))
        event = self.ratio_rule.update(step, ratios, ndims)
        if event is not None:
            self._emit(mon, event)

    def _act_insight(
        self,
        mon: SessionView,
        step_now: int,
        act: tuple[int | None, dict[str, Any]],
        values: Mapping[str, float],
    ) -> None:
        step = step_now if act[0] is None else act[0]
        scalars, dead = activation_scalars(act[1], values, "health.act")
        mon.log_scalars(scalars, step=step)
        event = self.dead.update(step, dead)
        if event is not None:
            self._emit(mon, event)

    def _early_stopping(self, mon: SessionView, step: int) -> None:
        es = mon.early_stopping
        if es is None:
            return

        def number(attrs: Sequence[str]) -> float | None:
            for a in attrs:
                v = getattr(es, a, None)
                if isinstance(v, torch.Tensor) and v.numel() == 1:
                    v = v.item()  # user object, read when it changes hands: once per step at most
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    return float(v)
            return None

        state = {
            k: v
            for k, v in (
                ("patience", number(("patience",))),
                ("counter", number(_EARLY_COUNTER)),
                ("best", number(_EARLY_BEST)),
            )
            if v is not None
        }
        if not state or state == self.early_stopping_state:
            return
        previous, self.early_stopping_state = self.early_stopping_state, state
        mon.log_scalars({f"early_stopping/{k}": v for k, v in state.items()}, step=step)
        exhausted = "patience" in state and state.get("counter", -1.0) >= state["patience"]
        was = "patience" in previous and previous.get("counter", -1.0) >= previous["patience"]
        if exhausted and not was:
            best = f", best {_fmt(state['best'])}" if "best" in state else ""
            self._emit(
                mon,
                RuleEvent(
                    "early_stopping",
                    step,
                    f"early stopping patience exhausted ({state['counter']:g}/{state['patience']:g}){best}",
                    "info",
                    evidence=dict(state),
                ),
            )

    def on_observe(self, mon: SessionView, name: str, value: float) -> None:
        """Keep the last value handed to ``mon.observe`` (the monitor stores it) and re-read early stopping."""
        self.observed[name] = float(value)
        self._early_stopping(mon, mon.global_step)

    def on_exit(self, mon: SessionView) -> None:
        self._update_ratio(mon)
        pending, self._pending = self._pending, None
        if pending is None:
            return
        step, ratio, weight = pending
        host = torch.cat([ratio, weight]).tolist()  # one transfer at exit for an update no step collected
        n = len(ratio)
        self._update_insight(mon, step, host[:n], host[n:])

    # ----------------------------------------------------------------- helpers

    def _detail_names(self, mon: SessionView) -> tuple[list[str], list[str], dict[str, int], list[str]]:
        """The detail steps' scalar names and the parameters' ``ndim`` (built once per parameter list)."""
        key = (id(mon.param_names), len(mon.param_names))
        got = self._names_cache
        if got is None or got[0] != key:
            names = mon.param_names
            got = self._names_cache = (
                key,
                [f"update_ratio/{n}" for n in names],
                [f"weight_norm/{n}" for n in names],
                {n: p.dim() for n, p in zip(names, mon.params)},
                [f"grad_norm/{n}" for n in names],
            )
        return got[1], got[2], got[3], got[4]

    def _judge_growth(self, mon: SessionView, step: int, norm: float, loss: float | None) -> None:
        """The step's gradient norm and loss: the explosion rule, then the divergence growth rule, with
        one warning per episode between them: a divergence already named mutes the explosion, and an
        explosion (it names the layers) mutes a growth that starts at its step or later."""
        self._judged_step = step
        lrs = functools.partial(_lrs, mon)
        event = self.explosion.update(step, norm, functools.partial(self._top, mon), lrs)
        if event is not None and not self.growth.active:
            self._emit(mon, event)
        event = self.growth.update(step, loss, norm, cause=functools.partial(_cause, lrs))
        if event is not None:
            self._emit_episode(mon, "growth", event, self.explosion.active or self.divergence.active)
        # the norm's new level stayed: said even after the explosion named its jump (that it did not
        # come back is the news), muted when a divergence of the loss already named the episode
        event = self.norm_shift.update(step, norm)
        if event is not None:
            self._emit_episode(mon, "norm", event, self.growth.active or self.divergence.active)

    def _emit_episode(self, mon: SessionView, rule: str, event: RuleEvent, named: bool) -> None:
        """A divergence rule's start or end: its start is muted when ``named`` (another rule already
        named this episode), and then so is its end."""
        if event.kind == DIVERGENCE:
            if named:
                self._muted.add(rule)
                return
        elif rule in self._muted:
            self._muted.discard(rule)
            return
        self._emit(mon, event)

    def _top(self, mon: SessionView) -> list[tuple[str, float]]:
        norms = mon.grad_norms_host
        return [] if norms is None else top_params(list(mon.param_names), list(norms))

    def _emit(self, mon: SessionView, event: RuleEvent) -> None:
        if event.severity != "info":
            self._step_had_anomaly = True
        mon.emit(event)

    def summary(self) -> dict[str, float]:
        """The seed-era training summary: ``counters`` plus ``anomaly_rate``, ``loss_anomaly_rate``,
        ``gradient_explosion_rate`` and ``gradient_vanishing_rate`` (per step)."""
        c = self.counters
        return training_summary(
            c["total_steps"],
            c["anomaly_steps"],
            c["gradient_explosions"],
            c["gradient_vanishing"],
            c["loss_anomalies"],
        )


def _log_vector(mon: SessionView, step: int, names: list[str], values: list[float]) -> None:
    """One value per name into the run store as one record (the writer's ``log_vector``: no Python
    object per value on the training thread); the names list is the cached one, never copied."""
    writer = mon.writer
    if writer is None:
        return
    if hasattr(writer, "log_vector") and len(names) == len(values):
        writer.log_vector(step, names, values)
    else:
        mon.log_scalars(dict(zip(names, values)), step=step)


def _lrs(mon: SessionView) -> str:
    """The learning rates the last update used, as the advice names them ("lr 20 in param group 0 of
    SGD"); read only when an event fires."""
    return mon.hyperparams.describe_lrs(mon.optimizer, mon.roots)


def _cause(lrs: Callable[[], str]) -> str:
    text = lrs()
    return (
        f"Check first the learning rate{f' ({text})' if text else ''}, then clip gradients (clip_grad_norm_)"
    )


def _plan(mon: SessionView) -> Any:
    """The session's cached reduction plan of its parameters (``torchdebug._tensors.Plan``), or None."""
    return mon.transfer.plan(mon.params)[0]


__all__ = [
    "AmpScaleRule",
    "DeadUnitRule",
    "ExplosionRule",
    "GradientHealth",
    "LRRule",
    "LossPlateauRule",
    "LossSpikeRule",
    "UpdateRatioRule",
    "VanishingRule",
    "activation_stats",
    "layer_norms",
    "owner",
    "top_params",
]

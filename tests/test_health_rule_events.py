"""The health rules read each robust statistic once a step: events identical to the rules as they were."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

import pytest

from torchdebug.events import RuleEvent
from torchdebug.health.instrument import (
    EARLY_HISTORY,
    EARLY_RATIO,
    FREEZE,
    LOG_SIGMA_FLOOR,
    LOSS_REL_FLOOR,
    ExplosionRule,
    LossSpikeRule,
    _fmt,
    owner,
)


class _OldExplosionRule(ExplosionRule):
    """The rule as it was (the median read again by sigma(), and before every update): the reference."""

    def check(self, norm: float) -> dict[str, float] | None:
        """Evidence if ``norm`` is exploding now (no state change), else None."""
        if not math.isfinite(norm) or norm <= 0:
            return None
        early = self.seen < self.warmup
        evidence: dict[str, float] = {"grad_norm": norm}
        rel = False
        if len(self.history) and not (early and self.seen < EARLY_HISTORY):  # the absolute bound: always
            med = self.history.median()
            sigma = self.history.sigma(abs_floor=LOG_SIGMA_FLOOR)
            z = (math.log10(norm) - med) / sigma
            ratio = norm / 10**med
            rel = z > self.mads and ratio >= (EARLY_RATIO if early else self.min_ratio)
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
    ) -> RuleEvent | None:
        """Feed the total gradient norm of ``step``; an event at the first step of an explosion.

        Args:
            step: the step number recorded in the event.
            norm: the total (unscaled) gradient norm.
            top: the largest per-parameter norms ``[(name, norm)]``, named in the event, or a
                callable returning them (called only when the event fires: no sort per step).
        """
        evidence = self.check(norm)
        typical = 10 ** self.history.median() if len(self.history) else math.nan
        judged_on = len(self.history)
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
        return RuleEvent(
            kind="gradient_explosion",
            step=step,
            message=why + ". Lower the learning rate or clip gradients (clip_grad_norm_).",
            severity="warning",
            modules=modules,
            evidence={**evidence, "top": {n: v for n, v in top}},
        )


class _OldLossSpikeRule(LossSpikeRule):
    """The rule as it was (zscore() reads the median again): the reference."""

    def update(self, step: int, loss: float) -> RuleEvent | None:
        """Feed the loss of ``step``; an event at the first step of a spike."""
        if not math.isfinite(loss):
            return None
        fire = False
        z = med = 0.0
        if len(self.history) >= max(self.warmup, 1):
            med = self.history.median()
            z = self.history.zscore(loss, rel_floor=LOSS_REL_FLOOR, abs_floor=1e-12)
            fire = z > self.mads
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


def _norms(rng: random.Random, n: int) -> list[float]:
    """Gradient norms drifting down with noise, explosions (x1e3 for a few steps, a runaway growth),
    and now and then NaN, Inf, 0 or a negative (ignored by the rule)."""
    out, x = [], rng.uniform(0.1, 10.0)
    blow = set(rng.sample(range(10, n), 3))
    grow = 0
    for s in range(n):
        x *= math.exp(rng.gauss(-0.002, 0.05))
        v = x
        if s in blow:
            v = x * rng.choice([30.0, 1e3, 1e6])
            grow = rng.choice([0, 0, 5, 70])  # sometimes a runaway that lasts past FREEZE steps
        if grow:
            grow -= 1
            v = x * 10 ** (3 + 0.1 * (70 - grow))
        r = rng.random()
        if r < 0.02:
            v = rng.choice([math.nan, math.inf, 0.0, -1.0])
        elif r < 0.04:
            v = rng.choice([2e4, 1e5])  # above the absolute bound
        out.append(v)
    return out


@pytest.mark.parametrize("seed", range(30))
def test_explosion_rule_events_equal_the_previous_rule(seed: int) -> None:
    rng = random.Random(seed)
    kw = {
        "warmup": rng.choice([0, 5, 20]),
        "window": rng.choice([7, 50, 200]),
        "mads": rng.choice([3.0, 10.0]),
    }
    new, old = ExplosionRule(**kw), _OldExplosionRule(**kw)
    top = [("fc1.weight", 3.0), ("fc2.weight", 0.1)]
    fired = 0
    for step, norm in enumerate(_norms(rng, 500)):
        assert new.check(norm) == old.check(norm)
        a, b = new.update(step, norm, top), old.update(step, norm, lambda: top)
        assert repr(a) == repr(b)
        fired += a is not None
    assert new.count == old.count and fired >= 1


def _losses(rng: random.Random, n: int) -> list[float]:
    out, x = [], rng.uniform(0.5, 5.0)
    for _ in range(n):
        x = max(1e-3, x * (1 - 0.002) + rng.gauss(0, 0.02 * x))
        v = x
        r = rng.random()
        if r < 0.03:
            v = x * rng.choice([5.0, 50.0])  # a spike
        elif r < 0.04:
            v = rng.choice([math.nan, math.inf, -math.inf])
        elif r < 0.05:
            v = x  # flat
        out.append(v)
    return out


@pytest.mark.parametrize("seed", range(30))
def test_loss_spike_rule_events_equal_the_previous_rule(seed: int) -> None:
    rng = random.Random(seed)
    kw = {
        "warmup": rng.choice([0, 3, 20]),
        "window": rng.choice([25, 50, 200]),
        "mads": rng.choice([3.0, 10.0]),
    }
    new, old = LossSpikeRule(**kw), _OldLossSpikeRule(**kw)
    fired = 0
    for step, loss in enumerate(_losses(rng, 400)):
        a, b = new.update(step, loss), old.update(step, loss)
        assert repr(a) == repr(b)
        fired += a is not None
    assert new.count == old.count and fired >= 1

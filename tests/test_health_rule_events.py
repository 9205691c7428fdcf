"""The gradient-explosion and loss-spike rules: their events, worked out by hand on short series."""

from __future__ import annotations

import math

import pytest

from torchdebug._robust import MAD_TO_SIGMA
from torchdebug.health.instrument import FREEZE, ExplosionRule, LossSpikeRule

TOP = [("fc1.weight", 3.0), ("fc2.weight", 0.1)]


def test_explosion_after_the_warmup_names_growth_baseline_and_layers() -> None:
    rule = ExplosionRule(mads=10, abs_threshold=1e4, warmup=3)
    assert [rule.update(s, 1.0, TOP) for s in range(5)] == [None] * 5
    # log10 norms 0,0,0,0,0: median 0, MAD 0, sigma floored at 0.05; log10(100) = 2 -> z = 2 / 0.05 = 40
    assert rule.check(100.0) == {
        "grad_norm": 100.0,
        "median": 1.0,
        "mads": 40.0,
        "ratio": 100.0,
        "threshold": 10**0.5,  # 10 ** (0 + 10 x 0.05)
        "abs_threshold": 1e4,
    }
    event = rule.update(5, 100.0, lambda: TOP)
    assert event is not None and event.kind == "gradient_explosion" and event.severity == "warning"
    assert event.message == (
        "total gradient norm 100 at step 5 grew 100x in one step since step 4 (1 then); typical before: 1 "
        "(median of the last 5 steps); largest: fc1.weight 3, fc2.weight 0.1. Lower the learning rate or "
        "clip gradients (clip_grad_norm_)."
    )
    assert event.modules == ("fc1",)  # fc2's 0.1 is under a tenth of the largest (3)
    assert event.evidence["since"] == 4 and event.evidence["growth"] == 100.0
    assert event.evidence["top"] == {"fc1.weight": 3.0, "fc2.weight": 0.1}
    # the episode goes on (counted, not announced again); the exploding norm stayed out of the baseline
    assert rule.update(6, 1000.0, TOP) is None and len(rule.history) == 5
    assert rule.update(7, 1.0, TOP) is None  # back: the episode ends
    again = rule.update(8, 100.0, TOP)
    assert (
        again is not None
        and "since step 7 (1 then); typical before: 1 (median of the last 6 steps)" in again.message
    )
    assert rule.count == 3


def test_the_absolute_bound_holds_from_the_first_step() -> None:
    rule = ExplosionRule(abs_threshold=1e4, warmup=20)
    event = rule.update(0, 2e4, TOP)
    assert event is not None
    assert event.evidence == {"grad_norm": 2e4, "abs_threshold": 1e4, "top": dict(TOP)}  # no history yet
    assert event.message.startswith("total gradient norm 2e+04 at step 0; above the absolute bound 1e+04;")


def test_in_the_warmup_only_a_tenfold_blowup_counts() -> None:
    rule = ExplosionRule(mads=10, warmup=20)
    for s in range(4):
        assert rule.update(s, 1.0) is None
    assert rule.check(100.0) is None  # 4 norms seen: fewer than EARLY_HISTORY (5), not judged yet
    assert rule.update(4, 1.0) is None
    # 5 seen: log10(5) / 0.05 = 14 sigmas, but 5x the median is under EARLY_RATIO (10x)
    assert rule.check(5.0) is None
    evidence = rule.check(20.0)  # 20x: an explosion even inside the warm-up
    assert evidence is not None and evidence["ratio"] == 20.0


@pytest.mark.parametrize("norm", [math.nan, math.inf, 0.0, -1.0])
def test_a_norm_that_is_not_finite_and_positive_is_left_to_others(norm: float) -> None:
    rule = ExplosionRule(warmup=0)
    rule.update(0, 1.0)
    assert rule.check(norm) is None and rule.update(1, norm) is None
    assert (len(rule.history), rule.seen, rule.count) == (1, 1, 0)


def test_a_runaway_joins_the_baseline_after_freeze_steps() -> None:
    rule = ExplosionRule(mads=10, warmup=3)
    for s in range(5):
        rule.update(s, 1.0)
    for s in range(5, 5 + FREEZE):
        rule.update(s, 100.0)
    assert (len(rule.history), rule.count) == (5, FREEZE)  # the episode's first FREEZE steps stay out
    rule.update(5 + FREEZE, 100.0)
    assert (len(rule.history), rule.count) == (6, FREEZE + 1)


def test_loss_spike_against_the_running_median() -> None:
    rule = LossSpikeRule(mads=10, warmup=3)
    assert [rule.update(s, loss) for s, loss in enumerate([2.0, 2.5, 1.5, 2.0])] == [None] * 4
    # window 1.5, 2, 2, 2.5: median 2, deviations 0, 0, 0.5, 0.5 -> MAD 0.25, sigma 1.4826 x 0.25
    # = 0.37065; 6.0 is (6 - 2) / 0.37065 = 10.79 sigmas above
    event = rule.update(4, 6.0)
    assert event is not None and event.kind == "loss_spike"
    assert event.message == (
        "loss 6 is 10.79 robust sigmas above its running median 2. Look at this step's batch "
        "(outliers, bad labels) and the learning rate."
    )
    assert event.evidence == {"loss": 6.0, "median": 2.0, "mads": 4.0 / (MAD_TO_SIGMA * 0.25)}
    # window 1.5, 2, 2, 2.5, 6: MAD 0.5, sigma 0.7413; 20 is 24.3 sigmas above: the same episode
    assert rule.update(5, 20.0) is None and rule.count == 2
    assert rule.update(6, 2.0) is None  # below the median: the episode ends
    later = rule.update(7, 40.0)  # median 2, MAD 0.5: (40 - 2) / 0.7413 = 51.26 sigmas
    assert later is not None and later.step == 7 and "loss 40 is 51.26 robust sigmas" in later.message
    assert rule.count == 3


def test_loss_spike_waits_for_its_warmup_and_ignores_nonfinite_and_falls() -> None:
    rule = LossSpikeRule(mads=10, warmup=3)
    assert [rule.update(0, 2.0), rule.update(1, 1000.0)] == [None, None]  # 1 loss in the window: not judged
    flat = LossSpikeRule(mads=10, warmup=3)
    for s in range(5):
        flat.update(s, 2.0)
    assert flat.update(5, math.nan) is None and flat.update(6, math.inf) is None and len(flat.history) == 5
    assert flat.update(7, 0.5) is None  # only a rise counts
    # flat window: MAD 0, sigma floored at LOSS_REL_FLOOR x |median| = 0.02; 2.1 is 5 sigmas, 2.3 is 15
    # but only 1.15x the median (a spike rises at least 0.5 x |median|: to 3.0), 3.5 is 75 sigmas
    assert flat.update(8, 2.1) is None
    assert flat.update(9, 2.3) is None
    spike = flat.update(10, 3.5)
    assert spike is not None and spike.message.startswith(
        "loss 3.5 is 75 robust sigmas above its running median 2."
    )

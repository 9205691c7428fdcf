"""The rules' bars against healthy and failing series worked out by hand: the gradient norm's level
shift, the loss's divergence from its first value (fast, and silent on losses that change sign or
grow slowly), and the update/weight ratio's upper bound (an update as large as the weight)."""

from __future__ import annotations

import math
import random

import pytest

from torchdebug.health.divergence import DivergenceRule, NormShiftRule
from torchdebug.health.instrument import UpdateRatioRule


def _feed(rule, values):  # type: ignore[no-untyped-def]
    return [e for s, v in enumerate(values) if (e := rule.update(s, v)) is not None]


# ----------------------------------------------------------------------------- gradient norm level


def test_a_gradient_norm_that_rises_tenfold_and_stays_is_a_divergence() -> None:
    # 300 steps around 1.0 (x/÷ 1.2 noise), then 30x from step 300 on, for 100 steps
    rng = random.Random(0)
    norms = [rng.uniform(0.83, 1.2) for _ in range(300)] + [30 * rng.uniform(0.83, 1.2) for _ in range(100)]
    events = _feed(NormShiftRule(), norms)
    assert [e.kind for e in events] == ["divergence"]
    (e,) = events
    # every recent norm is above the bar from step 300: the onset is 300; judged once 20 of the last 25
    # (share 0.8) are above it
    assert e.step == 300 and e.evidence["since_step"] == 300 and e.evidence["metric"] == "grad_norm"
    assert 0.83 <= e.evidence["before"] <= 1.2 and 25 <= e.evidence["after"] <= 36
    assert e.message.startswith("gradient norm rose at step 300 and stayed: ")
    assert "did not come back within 20 steps. Check first the learning rate" in e.message


def test_the_gradient_norm_shift_ends_when_the_norm_comes_back() -> None:
    norms = [1.0] * 250 + [100.0] * 40 + [1.0] * 40
    events = _feed(NormShiftRule(), norms)
    assert [(e.kind, e.evidence["since_step"]) for e in events] == [
        ("divergence", 250),
        ("divergence_end", 250),
    ]
    # back when the recent median is under 10**0.5 x the level before: 13 of the last 25 at 1.0, step 302
    assert events[1].step == 302


@pytest.mark.parametrize(
    "norms",
    [
        # a healthy drift: 5x up over 2000 steps (a schedule's tail, BatchNorm weights shrinking)
        pytest.param(
            [math.exp(math.log(5) * s / 2000) * (1 + 0.3 * math.sin(s)) for s in range(2000)], id="drift-5x"
        ),
        # a burst: 15 steps at 100x, then back (an explosion the explosion rule names; it did not stay)
        pytest.param([1.0] * 300 + [100.0] * 15 + [1.0] * 100, id="burst-15-steps"),
        # noisy norms, log-normal with sigma 1 (x/÷ 2.7): 10 robust sigmas of log10 are 4.3 orders
        pytest.param([math.exp(random.Random(2).gauss(0, 1)) for _ in range(1000)], id="lognormal-noise"),
        # a 3x step up that stays (a new phase of training): below the 10x bar
        pytest.param([1.0] * 300 + [3.0] * 300, id="step-3x"),
    ],
)
def test_healthy_gradient_norms_are_no_shift(norms: list[float]) -> None:
    assert _feed(NormShiftRule(), norms) == []


# ----------------------------------------------------------------------------- loss from its first value


def test_a_loss_25_to_35_times_its_first_value_is_named_at_step_9() -> None:
    # GPT-2 at AdamW lr 1.0: 10.8 at step 0, then 25-35x from step 1 on
    rng = random.Random(0)
    losses = [10.8] + [10.8 * rng.uniform(25, 35) for _ in range(60)]
    rule = DivergenceRule()
    fired = [(s, e) for s, v in enumerate(losses) if (e := rule.update(s, v)) is not None]
    # the last 10 losses (steps 0..9) hold 9 above 20 x 10.8 = 216 (share 0.8 needs 8): judged at step 9
    assert [(s, e.kind, e.evidence["since_step"]) for s, e in fired] == [(9, "divergence", 1)]


def test_a_loss_that_changes_sign_is_not_judged_from_its_first_value() -> None:
    # an actor-critic's loss: 0.05 at first, then around 0 (negative half the time), with swings to 2.5
    rng = random.Random(3)
    losses = [0.05] + [rng.choice([-1, 1]) * rng.uniform(0.5, 2.5) for _ in range(300)]
    assert _feed(DivergenceRule(), losses) == []


def test_a_loss_that_grows_after_the_start_is_not_a_divergence_from_the_start() -> None:
    # a value loss growing as an agent's returns grow: 0.1 for 300 steps, then up 0.5 % a step to 33x
    # (the lagged baseline trails the recent median by ~113 steps: 1.005**113 = 1.76x, under the
    # level rule's doubling; the first value is judged only over the first 200 losses)
    losses = [0.1] * 300 + [0.1 * 1.005**s for s in range(700)]
    assert max(losses) > 20 * losses[0]
    assert _feed(DivergenceRule(), losses) == []


def test_a_loss_that_falls_from_its_first_value_is_silent() -> None:
    losses = [2.3 * math.exp(-s / 100) + 0.05 for s in range(400)]
    assert _feed(DivergenceRule(), losses) == []


# ----------------------------------------------------------------------------- update/weight ratio


def test_update_ratios_of_standard_recipes_are_inside_the_default_bound() -> None:
    # ResNet-18 (SGD 0.1 momentum 0.9) moves its convolutions by 0.18-0.28 of their norm in its first
    # checks, word_language_model's LSTM (SGD lr 20 clip 0.25) by up to 0.4: healthy
    rule = UpdateRatioRule()
    ndims = {"conv1.weight": 4, "rnn.weight_hh_l0": 2}
    for step in range(0, 100, 10):
        assert rule.update(step, {"conv1.weight": 0.28, "rnn.weight_hh_l0": 0.41}, ndims) is None


def test_an_update_larger_than_the_weight_twice_in_a_row_is_said_with_what_to_check() -> None:
    # AdamW at lr 1 on N(0, 0.02) weights: each element moves by ~1, the weight's elements are ~0.02
    rule = UpdateRatioRule()
    ndims = {"h.0.attn.weight": 2}
    assert rule.update(0, {"h.0.attn.weight": 48.0}, ndims) is None  # one check is never enough
    e = rule.update(10, {"h.0.attn.weight": 51.0}, ndims)
    assert e is not None and e.modules == ("h.0.attn",)
    assert e.message == (
        "update/weight ratio outside [1e-05, 1]: h.0.attn.weight 51; each update was larger than 1x the "
        "weight itself at 2 detail checks in a row. Check first the learning rate these parameters get, "
        "then the gradient's scale (clip_grad_norm_)"
    )

"""Standard recipes of real models under ``td.watch`` raise nothing (tests/fixtures/recipe_models.py;
tiny inputs, CPU).

- ResNet-18 as torchvision writes it under SGD lr 0.1 momentum 0.9 moves its convolutions by ~0.2-0.3
  of their norm a step: no ``update_ratio`` warning.
- pytorch/examples word_language_model's LSTM (SGD lr 20, clip 0.25, truncated BPTT): nothing.
- a small GPT under AdamW with warm-up and cosine: nothing.
- an actor-critic whose loss changes sign: nothing (its first loss is no scale).
"""

from __future__ import annotations

import warnings

import pytest

from tests.fixtures import recipe_models as R

CFG = {"detail_every": 5}


def _watched(run, steps: int, **kw):  # type: ignore[no-untyped-def]
    wrap = R.watched(run=False, config=CFG)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        run(steps, wrap, **kw)
    (mon,) = wrap.sessions
    # the slowdown rule reads the real clocks and /proc here: on a machine that other processes load
    # (this suite beside others on 2 CPUs) a slower step is information, not a warning, when its
    # threads' wait for a CPU explains it (test_slowdown_contention.py models the cases)
    loud = [(e.kind, e.step) for e in mon.events if e.severity != "info"]
    return mon, loud, [str(w.message) for w in said]


@pytest.mark.parametrize(
    "run, steps, kw",
    [
        pytest.param(R.resnet_run, 30, {"width": 8}, id="resnet18-sgd-0.1-momentum-0.9"),
        pytest.param(
            R.word_lm_run,
            60,
            {"ntoken": 100, "size": 32, "bptt": 20, "batch": 10},
            id="word-lm-lstm-lr20-clip",
        ),
        pytest.param(R.gpt_run, 60, {}, id="gpt-adamw-warmup-cosine"),
        pytest.param(R.actor_critic_run, 300, {}, id="actor-critic"),
    ],
)
def test_a_healthy_recipe_raises_nothing(run, steps: int, kw: dict) -> None:  # type: ignore[no-untyped-def]
    mon, loud, said = _watched(run, steps, **kw)
    assert loud == [] and said == [] and mon.anomalies == []
    assert len(mon.records) == steps


@pytest.mark.parametrize(
    "run, steps, kw, onset",
    [
        # the loss erratic between 1x and 45x chance, never NaN: the median of the last 10 losses
        # first reaches 4x the first loss (2.36) at step 19, the window's first loss above it is step 10
        pytest.param(R.resnet_run, 20, {"width": 8, "lr": 2.0}, 10, id="resnet18-sgd-lr2"),
        # 5.5x-19x its first loss (5.55) from step 1: judged with the first 10 losses, at step 9
        pytest.param(R.gpt_run, 10, {"lr": 1.0, "schedule": False}, 1, id="gpt-adamw-lr1"),
    ],
)
def test_a_far_too_high_rate_is_a_divergence_from_the_start(  # type: ignore[no-untyped-def]
    run, steps: int, kw: dict, onset: int
) -> None:
    mon, _, _ = _watched(run, steps, **kw)
    div = [(e.step, e.evidence["since_step"], e.severity) for e in mon.events if e.kind == "divergence"]
    assert div == [(onset, onset, "warning")]  # judged by the last step of the run
    assert mon.anomalies == []  # no NaN: the divergence rule is what names it

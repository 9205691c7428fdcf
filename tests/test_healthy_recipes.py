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
    # the slowdown rule reads the wall clock (tested with an injected clock in test_timing.py): here
    # it would judge the test machine's load, not the recipe
    loud = [(e.kind, e.step) for e in mon.events if e.severity != "info" and e.kind != "slowdown"]
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

"""A run that diverges from its first steps is named before its first NaN; healthy runs hear nothing.

The growth rule on hand-computed series, then watch() on tiny real models
(tests/fixtures/divergence_models.py): word_language_model's Transformer with SGD lr 20 and no clip,
the same under Adam with a far too high lr, with and without the optimizer passed to watch, and the
healthy settings whose margins benchmarks/divergence_margins.py measures.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import torchdebug as td
from tests.fixtures.divergence_models import HEALTHY, Case, TransformerLM, lm_loss, token_batches
from torchdebug.health.divergence import GrowthRule, repeated_median
from torchdebug.health.instrument import ExplosionRule
from torchdebug.store import open_run
from torchdebug.store._verdict import verdict

QUIET = {"log_performance": False}  # no step timing: a busy machine's slowdowns are not the subject


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def feed(
    rule: GrowthRule, losses: list[float], norms: list[float] | None = None, cause: str = ""
) -> list[Any]:
    norms = norms if norms is not None else [1.0] * len(losses)
    return [
        e for s, (lo, no) in enumerate(zip(losses, norms)) if (e := rule.update(s, lo, no, cause)) is not None
    ]


# ------------------------------------------------------------------------------- the rule, by hand


def test_repeated_median_ignores_one_spike_and_reads_a_line() -> None:
    # (0,0,0,3): each of the first three points has slopes (0, 0, 3/k) to the others -> median 0;
    # the spike's own are (1, 1.5, 3) -> 1.5; the median of (0, 0, 0, 1.5) is 0
    assert repeated_median([(0, 0.0), (1, 0.0), (2, 0.0), (3, 3.0)]) == 0.0
    assert repeated_median([(0, 1.0), (1, 3.0), (2, 5.0), (3, 7.0)]) == 2.0


def test_growth_by_orders_fires_once_naming_what_grew_how_fast_and_since_when() -> None:
    rule = GrowthRule()
    # loss 4 * 30**s: every pair's slope is log10(30), the window grows 30**3 = 27000x (>= 100x)
    events = feed(rule, [4.0 * 30**s for s in range(6)], cause="Likely cause: lr 20")
    assert [(e.kind, e.step) for e in events] == [("divergence", 3)]
    e = events[0]
    assert e.evidence["since_step"] == 0 and e.evidence["metric"] == "loss"
    assert e.evidence["before"] == pytest.approx(4.0) and e.evidence["after"] == pytest.approx(108_000.0)
    assert e.evidence["rate"] == pytest.approx(30.0)
    assert set(e.evidence["growth"]) == {"loss"}  # the flat gradient norm did not grow
    assert e.message == (
        "diverging since step 0: loss 4 -> 1.08e+05 (x30 a step) in 3 steps. Likely cause: lr 20"
    )
    assert rule.count == 1 and rule.active


def test_both_metrics_are_named_when_both_grow() -> None:
    rule = GrowthRule()
    # norm 0.5 * 10**s: x10 a step, 1000x over the window
    events = feed(rule, [2.0 * 5**s for s in range(4)], [0.5 * 10**s for s in range(4)])
    assert events[0].message.startswith(
        "diverging since step 0: loss 2 -> 250 (x5 a step) and gradient norm 0.5 -> 500 (x10 a step) in 3 steps."
    )
    assert "Likely cause: the learning rate is too high" in events[0].message


@pytest.mark.parametrize(
    "losses, norms",
    [
        pytest.param([4.0 * 0.5**s for s in range(30)], None, id="loss-falling-fast"),
        # one bad batch among calm steps: the repeated median stays at the calm steps' slope (0)
        pytest.param([2.0, 2.0, 2.0, 2000.0, 2.0, 2.0, 2.0], None, id="one-spike"),
        # a fresh init's gradient norm rising 10x over 4 steps (x1.78 a step), then 10x in 2 steps
        pytest.param(
            [2.0] * 9, [0.1, 0.178, 0.316, 0.562, 1.0, 3.16, 10.0, 10.0, 10.0], id="norm-rising-10x"
        ),
        # a converged loss wobbling up 1000x near 1e-6: orders of magnitude, but far below its high
        pytest.param(
            [2.3, 1.0, 0.1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-5, 1e-4, 1e-3], None, id="converged-wobble"
        ),
        # growth broken by a NaN (the sentinel's) starts a new window: 3 points after it are too few
        pytest.param([4.0, 120.0, math.nan, 4.0, 120.0, 3600.0], None, id="nan-breaks-the-window"),
        # a loss <= 0 has no log10: it breaks the window too
        pytest.param([4.0, 120.0, -1.0, 4.0, 120.0, 3600.0], None, id="negative-loss"),
    ],
)
def test_healthy_shapes_never_fire(losses: list[float], norms: list[float] | None) -> None:
    assert feed(GrowthRule(), losses, norms) == []


def test_the_episode_ends_when_the_metric_is_back_within_10x_of_its_onset() -> None:
    rule = GrowthRule()
    # fires at step 3 (since step 0, loss 4 then); step 4's 39 <= 10 * 4 ends it
    events = feed(rule, [4.0, 120.0, 3600.0, 108_000.0, 39.0, 39.0])
    assert [(e.kind, e.step, e.severity) for e in events] == [
        ("divergence", 3, "warning"),
        ("divergence_end", 4, "info"),
    ]
    assert events[1].evidence["since_step"] == 0
    assert (
        events[1].message == "loss back to 39 (within 10x of 4 at step 0), 4 steps after it began to diverge"
    )
    assert not rule.active


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="window must be >= 3"):
        GrowthRule(window=2)
    with pytest.raises(ValueError, match="rate > 1"):
        GrowthRule(rate=1.0)


def test_the_absolute_bound_holds_from_step_0() -> None:
    # no warm-up for explode_abs: a norm of 2e4 > 1e4 at the first step is an explosion at once
    rule = ExplosionRule(mads=10, abs_threshold=1e4, warmup=20)
    event = rule.update(0, 2e4, lrs="lr 1000 in param group 0 of Adam")
    assert event is not None and event.step == 0 and event.evidence["abs_threshold"] == 1e4
    assert event.message == (
        "total gradient norm 2e+04 at step 0; above the absolute bound 1e+04. "
        "Lower the learning rate (lr 1000 in param group 0 of Adam) or clip gradients (clip_grad_norm_)."
    )
    assert ExplosionRule(abs_threshold=1e4, warmup=20).update(0, 9e3) is None


# ------------------------------------------------------------------------------- real runs


def run_lm(opt_factory: Any, steps: int, *, pass_optimizer: bool, run: Any = False) -> tuple[Any, int | None]:
    """The plain loop on the tiny Transformer; (the session, the step of the NonFiniteError or None)."""
    torch.manual_seed(0)
    model = TransformerLM()
    opt = opt_factory(list(model.parameters()))
    data = token_batches()
    raised = None
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        try:
            with td.watch(model, opt if pass_optimizer else None, run=run, config=QUIET) as mon:
                for i in range(steps):
                    opt.zero_grad()
                    loss = lm_loss(model, data[i % len(data)])
                    loss.backward()
                    opt.step()
                    mon.step()
        except td.NonFiniteError as exc:
            raised = exc.anomaly.step
    return mon, raised


@pytest.mark.parametrize("pass_optimizer", [True, False], ids=["optimizer", "adopted"])
def test_sgd_lr_20_without_clip_is_named_at_step_3_before_the_nan_at_step_7(pass_optimizer: bool) -> None:
    # word_language_model's default lr with its clip 0.25 removed: loss 3.94 -> 6.44 -> 85 -> 1.85e4,
    # gradient norm 0.84 -> 6.1 -> 48 -> 443 (benchmarks/divergence_margins.py); NaN in step 7's forward
    mon, raised = run_lm(lambda ps: torch.optim.SGD(ps, lr=20.0), 12, pass_optimizer=pass_optimizer)
    assert raised == 7
    assert [(e.kind, e.step) for e in mon.events] == [("divergence", 3)]
    e = mon.events[0]
    assert e.evidence["since_step"] == 0 and set(e.evidence["growth"]) == {"loss", "grad_norm"}
    assert e.evidence["rate"] > 10  # the loss: x13 a step
    assert e.message.startswith(
        "diverging since step 0: loss 3.94 -> 1.85e+04 (x13 a step) and gradient norm 0.844"
    )
    assert e.message.endswith(
        "in 3 steps. Likely cause: the learning rate is too high (lr 20 in param group 0 of SGD): lower it, "
        "or clip gradients (clip_grad_norm_)"
    )


@pytest.mark.parametrize("pass_optimizer", [True, False], ids=["optimizer", "adopted"])
def test_adam_with_a_far_too_high_lr_is_named_at_step_1_before_its_nan(pass_optimizer: bool) -> None:
    # Adam's first update moves every weight by lr: the gradient norm jumps 0.84 -> ~1e26 in one step,
    # far past explode_abs (1e4), which holds from step 0. The gradients turn NaN later: at step 16 on
    # one thread here, at step 6 on two (the overflow's step depends on the kernels' summation order)
    mon, raised = run_lm(lambda ps: torch.optim.Adam(ps, lr=2e4), 25, pass_optimizer=pass_optimizer)
    assert raised is not None and 1 < raised < 25
    loud = [(e.kind, e.step) for e in mon.events if e.severity != "info"]
    assert loud[0] == ("gradient_explosion", 1)
    assert "divergence" not in {k for k, _ in loud}  # one warning for the episode
    assert "Lower the learning rate (lr 2e+04 in param group 0 of Adam)" in mon.events[0].message


def test_the_stored_run_says_where_it_began_to_diverge(tmp_path: Path) -> None:
    mon, raised = run_lm(lambda ps: torch.optim.SGD(ps, lr=20.0), 12, pass_optimizer=True, run=tmp_path)
    assert raised == 7
    with open_run(mon.run_dir) as run:
        (ev,) = run.events("divergence")
        v = verdict(run)
    assert ev["step"] == 3 and v["divergences"][0]["step"] == 0
    assert v["text"].startswith("failed at step 7: nan born in forward of transformer.layers.0.self_attn")
    assert v["text"].endswith("; diverged at step 0: loss 3.94 -> 1.85e+04 and did not recover")


@pytest.mark.parametrize("case", HEALTHY, ids=[c.name for c in HEALTHY])
def test_healthy_training_warns_nothing_of_divergence(case: Case) -> None:
    torch.manual_seed(0)
    model = case.model()
    opt = case.optimizer(list(model.parameters()))
    data = case.batches()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with td.watch(model, opt, run=False, config=QUIET) as mon:
            for i in range(40):
                opt.zero_grad()
                loss = case.loss(model, data[i % len(data)])
                loss.backward()
                if case.clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
                opt.step()
                mon.step()
    loud = {e.kind for e in mon.events if e.severity != "info"}
    # the update-ratio rule may speak (word_language_model's own default, SGD lr 20 with clip 0.25,
    # moves its matrices by 0.13-0.41 of their norm a step: true, and not this rule's subject)
    assert loud <= {"update_ratio"} and len(said) == len(loud) and mon.anomalies == []
    health = next(i for i in mon.instruments if i.name == "gradients")
    assert health.growth.count == 0 and health.explosion.count == 0

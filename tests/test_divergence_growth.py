"""A run that diverges from its first steps is named before its first NaN; healthy runs hear nothing.

The growth rule on hand-computed series, then watch() on tiny real models
(tests/fixtures/divergence_models.py): word_language_model's Transformer with SGD lr 20 and no clip,
the same under Adam with a far too high lr, with and without the optimizer passed to watch, the
healthy settings whose margins benchmarks/divergence_margins.py measures, and loops of two models
and two optimizers (an actor-critic, a least-squares GAN) where one optimizer's lr is far too high:
the advice names that optimizer, by its model, first.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import torchdebug as td
from tests.fixtures.divergence_models import (
    HEALTHY,
    NOT_LEARNING,
    Case,
    TransformerLM,
    actor_critic,
    actor_critic_step,
    episodes,
    gan_batches,
    lm_loss,
    lsgan,
    lsgan_step,
    token_batches,
)
from torchdebug.health.divergence import GrowthRule, repeated_median
from torchdebug.health.instrument import ExplosionRule
from torchdebug.nonfinite.hyperparams import HyperparameterCheck, update_size
from torchdebug.store import open_run
from torchdebug.views.verdict import verdict

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
    events = feed(rule, [4.0 * 30**s for s in range(6)], cause="Check first: lr 20")
    assert [(e.kind, e.step) for e in events] == [("divergence", 3)]
    e = events[0]
    assert e.evidence["since_step"] == 0 and e.evidence["metric"] == "loss"
    assert e.evidence["before"] == pytest.approx(4.0) and e.evidence["after"] == pytest.approx(108_000.0)
    assert e.evidence["rate"] == pytest.approx(30.0)
    assert set(e.evidence["growth"]) == {"loss"}  # the flat gradient norm did not grow
    assert e.message == (
        "diverging since step 0: loss 4 -> 1.08e+05 (x30 a step) in 3 steps. Check first: lr 20"
    )
    assert rule.count == 1 and rule.active


def test_both_metrics_are_named_when_both_grow() -> None:
    rule = GrowthRule()
    # norm 0.5 * 10**s: x10 a step, 1000x over the window
    events = feed(rule, [2.0 * 5**s for s in range(4)], [0.5 * 10**s for s in range(4)])
    assert events[0].message.startswith(
        "diverging since step 0: loss 2 -> 250 (x5 a step) and gradient norm 0.5 -> 500 (x10 a step) in 3 steps."
    )
    assert events[0].message.endswith("Check first the learning rate, then clip gradients (clip_grad_norm_)")


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
        "in 3 steps. Check first the learning rate (lr 20 in param group 0 of SGD), then clip gradients "
        "(clip_grad_norm_)"
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


# with the Transformer at SGD lr 20 clip 0.25, whose loss stays at 1.35x its first value: a run that
# does not learn, not a divergence either
@pytest.mark.parametrize("case", HEALTHY + NOT_LEARNING, ids=[c.name for c in HEALTHY + NOT_LEARNING])
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


# ------------------------------------------------------------------------------- several models


def run_two(kind: str, lr_first: float, lr_second: float, steps: int) -> tuple[Any, int | None, list[str]]:
    """Two models, two SGD optimizers, one ``mon.step()`` a step: ``"actor-critic"`` (lrs: actor,
    critic) or ``"gan"`` (lrs: G, D). (The session, the step of the NonFiniteError or None, the
    warnings said.)"""
    raised = None
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            if kind == "actor-critic":
                actor, critic = actor_critic()
                opt_a = torch.optim.SGD(actor.parameters(), lr=lr_first)
                opt_c = torch.optim.SGD(critic.parameters(), lr=lr_second)
                roots = {"actor": actor, "critic": critic}
                with td.watch(roots, [opt_a, opt_c], run=False, config=QUIET) as mon:
                    for batch in episodes(steps):
                        actor_critic_step(actor, critic, opt_a, opt_c, batch)
                        mon.step()
            else:
                G, D = lsgan()
                opt_g = torch.optim.SGD(G.parameters(), lr=lr_first)
                opt_d = torch.optim.SGD(D.parameters(), lr=lr_second)
                with td.watch([G, D], [opt_g, opt_d], run=False, config=QUIET) as mon:
                    for batch in gan_batches(steps):
                        lsgan_step(G, D, opt_g, opt_d, batch)
                        mon.step()
        except td.NonFiniteError as exc:
            raised = exc.anomaly.step
    return mon, raised, [str(w.message) for w in said if issubclass(w.category, td.TorchDebugWarning)]


@pytest.mark.parametrize(
    ("kind", "lrs", "fired", "first", "other"),
    [
        # the critic's value regression at lr 1.2: loss 0.893 -> 7.63e3 in 3 steps (x11 a step); the
        # actor at lr 0.01 moves its weights by ~0.007 of their norm
        ("actor-critic", (0.01, 1.2), ("divergence", 3), "lr 1.2 in param group 0 of critic's SGD", "actor"),
        # D at lr 0.5: loss 1.95 -> 3.2e4 in 3 steps
        ("gan", (0.01, 0.5), ("divergence", 3), "lr 0.5 in param group 0 of D's SGD", "G"),
        # D at lr 2: past explode_abs at step 2, where G's gradients are the largest (D's scores have
        # grown, and G's gradient runs through them): the learning rate named is still D's
        ("gan", (0.01, 2.0), ("gradient_explosion", 2), "lr 2 in param group 0 of D's SGD", "G"),
    ],
    ids=["critic-lr-1.2", "d-lr-0.5", "d-lr-2"],
)
def test_one_optimizers_lr_too_high_names_that_optimizer_first_before_the_nan(
    kind: str, lrs: tuple[float, float], fired: tuple[str, int], first: str, other: str
) -> None:
    mon, raised, said = run_two(kind, *lrs, steps=30)
    loud = [e for e in mon.events if e.severity != "info"]
    assert (loud[0].kind, loud[0].step) == fired
    assert raised is not None and raised > fired[1] + 5  # warned well before the first NaN
    assert said[0].startswith(f"torchdebug: warning: step {fired[1]}: {fired[0]}")
    # the optimizer whose update is largest against its weights comes first, with that size
    msg = loud[0].message
    advice = msg[msg.index("(lr ") + 1 :]
    assert advice.startswith(f"{first}, whose update is ")
    size = float(advice[len(first) + len(", whose update is ") :].split("x")[0])
    second = advice[advice.index("; ") + 2 :]
    assert second.startswith(f"lr 0.01 in param group 0 of {other}'s SGD, whose update is ")
    # D at lr 0.5: 3.21 against G's 0.989; D at lr 2: 94.8 against 1.0; the critic: 23.3 against 0.0065
    assert size > 2 * float(second.split("whose update is ")[1].split("x")[0]) and size > 3
    if fired[0] == "gradient_explosion":
        assert "largest: G." in msg  # the layers named are G's; the lr named is D's


def test_clean_loops_of_two_models_warn_nothing_of_divergence() -> None:
    for kind, lrs in (("actor-critic", (0.01, 0.05)), ("gan", (0.01, 0.01))):
        mon, raised, said = run_two(kind, *lrs, steps=40)
        assert raised is None and said == [] and mon.anomalies == []
        assert [e for e in mon.events if e.severity != "info"] == []
        health = next(i for i in mon.instruments if i.name == "gradients")
        assert health.growth.count == 0 and health.explosion.count == 0


def test_update_size_is_the_step_against_the_weights() -> None:
    w = torch.nn.Parameter(torch.tensor([3.0, 4.0]))  # |w| = 5
    w.grad = torch.tensor([0.0, 2.0])  # |g| = 2
    sgd = torch.optim.SGD([w], lr=0.5)
    assert update_size(sgd) == pytest.approx(0.5 * 2 / 5)  # SGD: lr |g| / |w| = 0.2
    adam = torch.optim.Adam([w], lr=0.1, eps=0.0)
    adam.state[w] = {"exp_avg": torch.tensor([1.0, -1.0]), "exp_avg_sq": torch.tensor([1.0, 4.0])}
    # Adam: exp_avg / sqrt(exp_avg_sq) = (1, -0.5): 0.1 * sqrt(1.25) / 5
    assert update_size(adam) == pytest.approx(0.1 * math.sqrt(1.25) / 5)
    assert math.isnan(update_size(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1.0)))  # no grad


def test_the_lrs_of_several_optimizers_are_named_by_model_largest_update_first() -> None:
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    for p in (*a.parameters(), *b.parameters()):
        p.grad = torch.ones_like(p)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=1e-3), torch.optim.SGD(b.parameters(), lr=10.0)
    check = HyperparameterCheck()
    check.stage(opt_a)
    check.stage(opt_b)
    text = check.describe_lrs(roots={"A": a, "B": b})
    assert text.startswith("lr 10 in param group 0 of B's SGD, whose update is ")
    assert "; lr 0.001 in param group 0 of A's SGD, whose update is " in text
    check.stage(opt_a)  # one optimizer only: named as before, without its model or size
    solo = HyperparameterCheck()
    solo.stage(opt_a)
    assert solo.describe_lrs(roots={"A": a, "B": b}) == "lr 0.001 in param group 0 of SGD"

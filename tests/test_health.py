"""Tests of the training-health rules, the robust running statistics and the GradientHealth instrument."""

from __future__ import annotations

import itertools
import math
import random
import statistics
from typing import Any

import pytest
import torch
from torch import nn

from torchdebug._robust import MAD_TO_SIGMA, RunningMedian, Streak
from torchdebug._tensors import Plan
from torchdebug.health.instrument import (
    AmpScaleRule,
    DeadUnitRule,
    ExplosionRule,
    LossPlateauRule,
    LossSpikeRule,
    LRRule,
    UpdateRatioRule,
    VanishingRule,
    activation_stats,
    layer_norms,
    top_params,
)

# --------------------------------------------------------------------------- robust statistics


def brute_mad(xs: list[float]) -> float:
    med = statistics.median(xs)
    return statistics.median([abs(x - med) for x in xs])


@pytest.mark.parametrize("window", [1, 2, 5, 8, 33], ids=lambda w: f"window{w}")
def test_running_median_and_mad_match_brute_force(window: int) -> None:
    rng = random.Random(window)
    m = RunningMedian(window)
    seen: list[float] = []
    for _ in range(120):
        x = rng.choice([rng.gauss(0, 1), rng.expovariate(0.1), float(rng.randint(-3, 3))])  # ties included
        m.push(x)
        seen.append(x)
        kept = seen[-window:]
        assert m.values() == kept
        assert m.median() == pytest.approx(statistics.median(kept))
        assert m.mad() == pytest.approx(brute_mad(kept))


def test_running_median_edges() -> None:
    m = RunningMedian(3)
    assert math.isnan(m.median()) and math.isnan(m.mad()) and math.isnan(m.zscore(1.0))
    assert m.push(float("nan")) is False and m.push(float("inf")) is False and len(m) == 0
    for x in (1.0, 1.0, 1.0):
        m.push(x)
    # constant window: MAD 0 -> any other value is infinitely far, the median itself is 0 sigmas away
    assert m.zscore(2.0) == math.inf and m.zscore(0.0) == -math.inf and m.zscore(1.0) == 0.0
    # floors: rel 0.1*|1| = 0.1 -> (1.5 - 1) / 0.1 = 5
    assert m.zscore(1.5, rel_floor=0.1) == pytest.approx(5.0)
    m.clear()
    for x in (1.0, 2.0, 4.0):
        m.push(x)
    # median 2, |dev| = [1, 0, 2] -> MAD 1, sigma 1.4826 -> z(5) = 3 / 1.4826
    assert m.zscore(5.0) == pytest.approx(3 / MAD_TO_SIGMA)
    with pytest.raises(ValueError, match="window"):
        RunningMedian(0)


def test_streak_fires_once_per_run() -> None:
    s = Streak(3)
    fired = [s.update(x) for x in [True, True, True, True, False, True, True, True]]
    assert fired == [False, False, True, False, False, False, False, True]
    with pytest.raises(ValueError, match="patience"):
        Streak(0)


# --------------------------------------------------------------------------- explosion


def healthy_norms(n: int, seed: int = 0) -> list[float]:
    """A noisy healthy run: norm drifts 2.0 -> 0.5, log-normal noise (sigma 0.35), occasional 3x bumps."""
    rng = random.Random(seed)
    out = []
    for s in range(n):
        base = 2.0 * (0.25 ** (s / n))
        bump = 3.0 if rng.random() < 0.02 else 1.0
        out.append(base * math.exp(rng.gauss(0, 0.35)) * bump)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_explosion_rule_quiet_on_a_healthy_noisy_run(seed: int) -> None:
    rule = ExplosionRule(mads=10, abs_threshold=1e4, warmup=20)
    events = [rule.update(s, v) for s, v in enumerate(healthy_norms(3000, seed))]
    assert [e for e in events if e is not None] == []
    assert rule.count == 0


def test_explosion_fires_at_the_blow_up_step_once_per_episode() -> None:
    norms = healthy_norms(300)
    # at step 150 the running median is 1.376 and the robust sigma of log10(norm) 0.181 (this run
    # is very noisy), so the relative threshold is 1.376 * 10**(10 * 0.181) = 89.4
    for s in (150, 151, 152):
        norms[s] = 300.0 * (s - 149)  # 300, 600, 900: 218x the median and up
    norms[250] = 500.0
    rule = ExplosionRule(mads=10, abs_threshold=1e4, warmup=20)
    top = [("blocks.2.fc.weight", 70.0), ("blocks.2.fc.bias", 20.0)]
    events = {s: e for s, v in enumerate(norms) if (e := rule.update(s, v, top)) is not None}
    assert sorted(events) == [150, 250]
    e = events[150]
    assert e.kind == "gradient_explosion" and e.step == 150 and e.severity == "warning"
    assert e.modules == ("blocks.2.fc",)
    assert e.evidence["grad_norm"] == 300.0
    assert e.evidence["median"] == pytest.approx(1.3759, rel=1e-4)
    assert e.evidence["threshold"] == pytest.approx(89.36, rel=1e-3)
    assert "blocks.2.fc.weight 70" in e.message
    assert rule.count == 4  # exploding steps 150, 151, 152, 250


def test_explosion_threshold_follows_the_noise_of_the_run() -> None:
    rng = random.Random(3)
    calm = [1.0 * math.exp(rng.gauss(0, 0.02)) for _ in range(100)]  # sigma below the floor 0.05 decades
    calm[80] = 3.5  # the floored threshold is 10**(10 * 0.05) = 3.16x the median, and min_ratio 3
    rule = ExplosionRule(mads=10, abs_threshold=1e4, warmup=20)
    events = [s for s, v in enumerate(calm) if rule.update(s, v) is not None]
    assert events == [80]


def test_explosion_absolute_bound_and_warmup() -> None:
    rule = ExplosionRule(mads=10, abs_threshold=1e4, warmup=3)
    # the absolute bound holds from step 0 (a run diverging from its first step passes it at once);
    # the warm-up only keeps the relative test quiet: 1 -> 9000 inside it is not judged relative
    assert rule.update(0, 5e4) is not None
    quiet = ExplosionRule(mads=10, abs_threshold=1e4, warmup=3)
    assert [quiet.update(s, x) for s, x in enumerate([1.0, 9e3, 9e3])] == [None] * 3
    rule2 = ExplosionRule(mads=10, abs_threshold=1e4, warmup=0)
    e = rule2.update(0, 2e4)  # no history: only the absolute bound can judge
    assert e is not None and "above the absolute bound 1e+04" in e.message
    # a norm that is large but steady is not an explosion by the relative rule
    rule3 = ExplosionRule(mads=10, abs_threshold=1e9, warmup=5)
    assert [rule3.update(s, 5e3) for s in range(50)] == [None] * 50
    # non-finite and zero norms are ignored and not pushed
    assert rule3.update(50, float("nan")) is None and rule3.update(51, 0.0) is None
    assert len(rule3.history) == 50


# --------------------------------------------------------------------------- other rules


def test_vanishing_needs_patience_consecutive_checks() -> None:
    rule = VanishingRule(threshold=1e-8, patience=3)
    checks = [
        {"fc1": 1e-9, "fc2": 0.5},
        {"fc1": 1e-9, "fc2": 0.5},
        {"fc1": 1e-3, "fc2": 0.5},  # fc1 recovers: the streak restarts
        {"fc1": 0.0, "fc2": 0.5},
        {"fc1": 0.0, "fc2": 0.5},
        {"fc1": 0.0, "fc2": 0.5},
        {"fc1": 0.0, "fc2": 0.5},
    ]
    events = [rule.update(10 * i, c) for i, c in enumerate(checks)]
    assert [i for i, e in enumerate(events) if e is not None] == [5]
    assert (
        events[5].modules == ("fc1",) and events[5].step == 50 and events[5].evidence["norms"] == {"fc1": 0.0}
    )
    assert rule.count == 1


def test_loss_spike_only_upwards_and_after_warmup() -> None:
    rng = random.Random(0)
    losses = [2.0 * math.exp(-s / 100) + rng.gauss(0, 0.05) for s in range(200)]
    losses[120] = 30.0
    losses[60] = -5.0  # a drop is not a spike
    rule = LossSpikeRule(mads=10, warmup=20)
    events = {s: e for s, v in enumerate(losses) if (e := rule.update(s, v)) is not None}
    assert sorted(events) == [120]
    assert events[120].kind == "loss_spike" and events[120].evidence["loss"] == 30.0
    assert rule.update(201, float("nan")) is None


def test_loss_plateau_window_and_rearm() -> None:
    rule = LossPlateauRule(window=10, rel=1e-3)
    losses = (
        [1.0 / (1 + s) for s in range(20)] + [0.05] * 15 + [0.04 - 0.001 * s for s in range(12)] + [0.01] * 10
    )
    events = {s: e for s, v in enumerate(losses) if (e := rule.update(s, v)) is not None}
    # 1/(1+19) = 0.05: the flat stretch starts at step 19; the older half (steps s-9..s-5) has median
    # 0.05 once 3 of its 5 values are 0.05 (the others are larger): s-5 = 21 -> step 26.
    # The decline 0.04 .. 0.029 (steps 35..46) ends it: at step 37 the newer half (33..37) is
    # 0.05, 0.05, 0.04, 0.039, 0.038 -> median 0.04, the older half 0.05; the noise of this smooth
    # series is 0 (its successive differences are mostly 0: MAD 0) -> "loss_plateau_end" after
    # 37 - 26 = 11 steps; 0.01 from step 47: s-5 = 49 -> the next plateau at step 54.
    assert {s: e.kind for s, e in events.items()} == {
        26: "loss_plateau",
        37: "loss_plateau_end",
        54: "loss_plateau",
    }
    assert events[26].severity == "info" and events[26].evidence["relative_change"] == 0.0
    assert events[37].evidence["steps"] == 11 and events[37].severity == "info"
    with pytest.raises(ValueError, match="window"):
        LossPlateauRule(window=1)


def test_lr_rule_change_zero_nonfinite() -> None:
    rule = LRRule()
    kinds = {}
    # StepLR-like: 0.1 x3, 0.01 x3 (one event), a cosine-like stretch (one event), then 0, then NaN
    lrs = [0.1, 0.1, 0.1, 0.01, 0.01, 0.01, 0.009, 0.008, 0.007, 0.007, 0.0, float("nan")]
    for s, lr in enumerate(lrs):
        evs = rule.update(s, (lr, 0.5))  # the second group never changes
        if evs:
            kinds[s] = [e.kind for e in evs]
    assert kinds == {3: ["lr_change"], 6: ["lr_change"], 10: ["lr_zero", "lr_change"], 11: ["lr_nonfinite"]}
    # a warm-up from 0 is not "lr going to zero"
    warm = LRRule()
    assert [e.kind for s, lr in enumerate([0.0, 0.0, 0.05]) for e in warm.update(s, (lr,))] == ["lr_change"]


def test_amp_rule_skip_reason_and_collapse() -> None:
    rule = AmpScaleRule(floor=1.0, shrink_steps=3)
    assert rule.update(0, 65536.0, False) == []
    e = rule.update(1, 32768.0, True, ("enc.weight", "enc.bias"))
    assert [x.kind for x in e] == ["amp_skip"] and e[0].modules == ("enc",)
    assert "enc.weight, enc.bias" in e[0].message
    assert [x.kind for x in rule.update(2, 16384.0, True)] == ["amp_skip"]
    e = rule.update(3, 8192.0, True)  # third shrink in a row
    assert [x.kind for x in e] == ["amp_skip", "amp_scale_collapse"]
    assert "consider bf16" in e[1].message
    assert rule.update(4, 4096.0, True)[1:] == []  # same episode: no second collapse event
    assert rule.skips == 4
    below = AmpScaleRule(floor=1.0, shrink_steps=100)
    below.update(0, 2.0, False)
    assert [x.kind for x in below.update(1, 0.5, False)] == ["amp_scale_collapse"]


def test_dead_units_and_update_ratio_rules() -> None:
    dead = DeadUnitRule(0.9)
    assert dead.update(0, {"act1": 0.5}) is None
    e = dead.update(10, {"act1": 0.95, "act2": 0.99})
    assert e is not None and e.modules == ("act1", "act2")
    assert dead.update(20, {"act1": 0.95, "act2": 0.99}) is None  # same episode
    ratio = UpdateRatioRule(1e-5, 1e-1)
    ndims = {"fc.weight": 2, "fc.bias": 1, "out.weight": 2}
    # two checks in a row (patience 2): one check, such as an optimizer's first update, is not enough
    assert ratio.update(0, {"fc.weight": 0.5, "fc.bias": 3.0, "out.weight": 1e-3}, ndims) is None
    e = ratio.update(10, {"fc.weight": 0.4, "fc.bias": 3.0, "out.weight": 1e-3}, ndims)
    assert e is not None and e.modules == ("fc",) and e.evidence["ratios"] == {"fc.weight": 0.4}
    assert "each update was larger than 0.1x the weight itself" in e.message
    assert ratio.update(20, {"fc.weight": 0.0, "out.weight": 1e-7}, ndims) is None
    assert ratio.update(30, {"fc.weight": 0.3, "out.weight": 1e-7}, ndims).modules == ("out",)
    assert ratio.update(40, {"fc.weight": 0.3, "out.weight": 1e-7}, ndims) is None  # same episodes


def test_activation_stats_hand_worked() -> None:
    y = torch.tensor([[0.0, 1.0, 0.0], [0.0, 3.0, 2.0]])  # feature 0 zero for the whole batch
    s = {k: v.item() for k, v in activation_stats(nn.ReLU(), y).items()}
    # mean 6/6 = 1; zeros 3/6; dead features 1/3
    assert s["mean"] == pytest.approx(1.0) and s["zero"] == 0.5 and s["dead"] == pytest.approx(1 / 3)
    conv = torch.zeros(2, 4, 3, 3)
    conv[:, 1] = 1.0  # only channel 1 alive -> 3 of 4 channels dead
    assert activation_stats(nn.ReLU(), conv)["dead"].item() == pytest.approx(0.75)
    t = torch.tensor([0.995, -0.999, 0.5, 0.0])
    assert activation_stats(nn.Tanh(), t)["saturated"].item() == pytest.approx(0.5)
    sg = torch.tensor([0.005, 0.5, 0.995, 0.3])
    assert activation_stats(nn.Sigmoid(), sg)["saturated"].item() == pytest.approx(0.5)


def test_layer_norms_and_top_params() -> None:
    names = ["fc.weight", "fc.bias", "out.weight"]
    assert layer_norms(names, [3.0, 4.0, 1.0]) == {"fc": 5.0, "out": 1.0}
    assert top_params(names, [3.0, float("inf"), 5.0], k=2) == [
        ("fc.bias", float("inf")),
        ("out.weight", 5.0),
    ]


# --------------------------------------------------------------------------- in watch()


import torch.nn.functional as F  # noqa: E402

from tests.fixtures import health_models as hm  # noqa: E402
from torchdebug import NonFiniteError, TorchDebugWarning  # noqa: E402
from torchdebug.health.instrument import GradientHealth  # noqa: E402
from torchdebug.session.monitor import watch  # noqa: E402
from torchdebug.store import open_run  # noqa: E402

CFG = {"mode": "gradient_checking", "detail_every": 5}
CLIP_ORIGINALS = (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad.clip_grad_norm_)


def health_of(mon) -> GradientHealth:  # type: ignore[no-untyped-def]
    found = [i for i in mon.instruments if isinstance(i, GradientHealth)]
    assert found, "the gradients instrument is not running (switched off?)"
    return found[0]


def events(mon, *kinds: str) -> list[tuple[str, int, tuple[str, ...]]]:  # type: ignore[no-untyped-def]
    return [(e.kind, e.step, e.modules) for e in mon.events if not kinds or e.kind in kinds]


def assert_restored(model: nn.Module) -> None:
    assert (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad.clip_grad_norm_) == CLIP_ORIGINALS
    assert not any(m._forward_hooks for m in model.modules())


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_healthy_run_raises_no_event(tmp_path, opt_name: str) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = hm.HealthyNet()
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.05)
        if opt_name == "sgd"
        else torch.optim.Adam(model.parameters(), lr=1e-3)
    )
    with watch(model, opt, config={**CFG, "activation_stats": True}, run=tmp_path) as mon:
        hm.train(mon, model, opt, 80)
        health = health_of(mon)
    assert events(mon) == []
    assert health.counters == {
        "total_steps": 80,
        "anomaly_steps": 0,
        "gradient_explosions": 0,
        "gradient_vanishing": 0,
        "loss_anomalies": 0,
    }
    assert_restored(model)
    run = open_run(mon.run_dir)
    assert run.series("update_ratio/inp.weight").steps == list(range(0, 80, 5))
    assert run.series("grad_norm/out.bias").steps == list(range(0, 80, 5))
    assert run.series("weight_norm/mid.weight").values[0] > 0
    dead = run.series("dead_units/relu").values
    assert len(dead) == 16 and all(0.0 <= v < 0.95 for v in dead)
    assert "saturated/tanh" in run.metric_names() and "act_std/mid" in run.metric_names()


def _real_ratio(w: torch.Tensor, before: torch.Tensor) -> float:
    """The update ratio worked out by hand: the weights' change over the step, over their norm now."""
    return (torch.linalg.vector_norm(w - before) / torch.linalg.vector_norm(w)).item()


def _six_steps_with_a_snapshot_before_the_last(
    model: nn.Module, tmp_path
) -> tuple[Any, dict[str, torch.Tensor]]:  # type: ignore[no-untyped-def]
    """Six SGD steps of ``model`` under ``watch``: the run and the parameters as step 5 began."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    snap: dict[str, torch.Tensor] = {}

    def before(step: int) -> None:
        if step == 5:
            snap.update({n: p.detach().clone() for n, p in model.named_parameters()})

    with watch(model, opt, config=CFG, run=tmp_path) as mon:
        hm.train(mon, model, opt, 6, before_step=before)
    return open_run(mon.run_dir), snap


def test_update_ratio_and_weight_norm_match_the_real_update(tmp_path) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = hm.HealthyNet()
    run, snap = _six_steps_with_a_snapshot_before_the_last(model, tmp_path)
    w = model.mid.weight.detach()
    expected = _real_ratio(w, snap["mid.weight"])
    assert run.series("update_ratio/mid.weight").values[-1] == pytest.approx(expected, rel=1e-5)
    assert run.series("weight_norm/mid.weight").values[-1] == pytest.approx(
        torch.linalg.vector_norm(w).item()
    )


def test_update_ratio_of_a_big_tensor_matches_the_real_update(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # 256 x 256 = 65,536 weights: over the plan's SMALL, so its norms come from one dot, not segments
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(hm.D_IN, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, hm.D_OUT)
    )
    run, snap = _six_steps_with_a_snapshot_before_the_last(model, tmp_path)
    for name in ("2.weight", "2.bias", "4.weight"):
        w = model.get_parameter(name).detach()
        expected = _real_ratio(w, snap[name])
        assert run.series(f"update_ratio/{name}").steps == [0, 5]
        assert run.series(f"update_ratio/{name}").values[-1] == pytest.approx(expected, rel=1e-5)
        assert run.series(f"weight_norm/{name}").values[-1] == pytest.approx(
            torch.linalg.vector_norm(w).item()
        )


def test_update_ratio_covers_an_edit_of_the_weights_after_the_update(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # a WGAN critic's loop: the weights are clamped after the update, before the step ends; the ratio
    # is the weights' change over the step, clamp included
    torch.manual_seed(0)
    model = hm.HealthyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with watch(model, opt, config=CFG, run=tmp_path) as mon:
        for step, (x, y) in enumerate(hm.batches(6)):
            if step == 5:
                before = {n: p.detach().clone() for n, p in model.named_parameters()}
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            with torch.no_grad():
                for p in model.parameters():
                    p.clamp_(-0.05, 0.05)
            mon.step()
    run = open_run(mon.run_dir)
    w = model.inp.weight.detach()
    expected = _real_ratio(w, before["inp.weight"])
    assert run.series("update_ratio/inp.weight").steps == [0, 5]
    assert run.series("update_ratio/inp.weight").values[-1] == pytest.approx(expected, rel=1e-5)
    assert w.abs().max().item() == pytest.approx(0.05)  # the clamp bit: the change is not the update's alone


class ComplexGain(nn.Module):
    """A complex gain after a linear layer: a complex parameter, which no reduction plan takes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(hm.D_IN, hm.D_OUT)
        self.z = nn.Parameter(torch.randn(hm.D_OUT, dtype=torch.cfloat))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) * self.z).abs()


def test_update_ratio_of_a_list_no_plan_takes_matches_the_real_update(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # the general path: a copy per tensor before the update, the change subtracted into it in place
    torch.manual_seed(0)
    model = ComplexGain()
    assert Plan.build(list(model.parameters())) is None
    run, snap = _six_steps_with_a_snapshot_before_the_last(model, tmp_path)
    for name in ("lin.weight", "lin.bias", "z"):
        w = model.get_parameter(name).detach()
        expected = _real_ratio(w, snap[name])
        assert run.series(f"update_ratio/{name}").steps == [0, 5]
        assert run.series(f"update_ratio/{name}").values[-1] == pytest.approx(expected, rel=1e-5)


def test_a_detail_step_copies_the_weights_once_and_no_step_copies_a_big_gradient(copies) -> None:  # type: ignore[no-untyped-def]
    # 2.weight is 256 x 256 = 65,536 elements (big: reduced in place, never copied); the small
    # tensors: 0.weight 8 x 256 + 0.bias 256 + 2.bias 256 + 4.weight 256 x 2 + 4.bias 2 = 3,074 elements;
    # every weight: 3,074 + 65,536 = 68,610
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(hm.D_IN, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, hm.D_OUT)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    marks: list[tuple[int, int]] = []
    with watch(model, opt, run=False) as mon:  # the default: detail steps 0 and 10
        hm.train(mon, model, opt, 12, before_step=lambda step: marks.append((copies[0], copies[1])))
    per_step = [(b[0] - a[0], b[1] - a[1]) for a, b in itertools.pairwise(marks)]  # steps 0-10
    # an ordinary step copies the small gradients once (the gradient check), nothing else
    assert per_step[1:10] == [(1, 3_074)] * 9
    # a detail step: the small gradients, the sentinel's probe of the small weights, the update ratio's
    # snapshot of every weight before the update and its copy of the small weights after it
    # (3 x 3,074 + 68,610 = 77,832: the big weight is copied once, for the snapshot)
    assert per_step[0] == per_step[10] == (4, 77_832)


def test_explosion_named_at_the_fault_step_and_layer() -> None:
    torch.manual_seed(0)
    model = hm.ExplodingNet(blowup=1e4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def fault(step: int) -> None:
        model.fault = step == 40

    with (
        pytest.warns(TorchDebugWarning),
        watch(model, opt, config=CFG, run=False) as mon,
    ):
        hm.train(mon, model, opt, 43, before_step=fault)
        health = health_of(mon)
    assert events(mon, "gradient_explosion") == [("gradient_explosion", 40, ("inp",))]
    (event,) = [e for e in mon.events if e.kind == "gradient_explosion"]
    assert next(iter(event.evidence["top"])) == "inp.weight"
    assert event.evidence["grad_norm"] > 1e4
    assert health.counters["gradient_explosions"] == 1
    assert health.counters["anomaly_steps"] >= 1
    summary = health.summary()
    assert summary["gradient_explosion_rate"] == pytest.approx(1 / 43)


def test_clip_on_spike_tames_the_update() -> None:
    torch.manual_seed(0)
    model = hm.ExplodingNet(blowup=1e4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    snap: list[torch.Tensor] = []

    def fault(step: int) -> None:
        model.fault = step == 30
        if step == 30:
            snap.append(torch.cat([p.detach().flatten().clone() for p in model.parameters()]))

    with (
        pytest.warns(TorchDebugWarning),
        watch(model, opt, config={**CFG, "clip_on_spike": 1.0}, run=False) as mon,
    ):
        hm.train(mon, model, opt, 31, before_step=fault)
    assert events(mon, "auto_clip")[0][:2] == ("auto_clip", 30)
    moved = torch.linalg.vector_norm(torch.cat([p.detach().flatten() for p in model.parameters()]) - snap[0])
    # plain SGD: |Δθ| = lr * |g| <= 0.01 * 1.0 after clipping (it would be ~300 without)
    assert moved.item() <= 0.01 * (1 + 1e-4)
    assert_restored(model)


def test_vanishing_layer_and_dead_units(tmp_path) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = hm.DeadNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with (
        pytest.warns(TorchDebugWarning),
        watch(model, opt, config={**CFG, "activation_stats": True}, run=tmp_path) as mon,
    ):
        hm.train(mon, model, opt, 30)
        health = health_of(mon)
    # detail checks at 0, 5, 10, 15, 20: the 5th consecutive zero norm (vanish_patience 5) is step 20
    assert events(mon, "vanishing_gradient", "dead_units") == [
        ("dead_units", 0, ("act",)),
        ("vanishing_gradient", 20, ("hidden",)),
    ]
    assert health.counters["gradient_vanishing"] == 1
    assert open_run(mon.run_dir).series("dead_units/act").values == [1.0] * 6


def test_loss_spike_at_the_bad_batch() -> None:
    torch.manual_seed(0)
    model = hm.HealthyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.warns(TorchDebugWarning), watch(model, opt, config=CFG, run=False) as mon:
        hm.train(mon, model, opt, 47, data=hm.batches(47, spike_step=45))
        health = health_of(mon)
    assert events(mon, "loss_spike") == [("loss_spike", 45, ())]
    assert health.counters["loss_anomalies"] >= 1


def amp_loop(mon, model, opt, scaler, steps: int, gain_at) -> list[tuple[int, list[str]]]:  # type: ignore[no-untyped-def]
    """fp16 autocast on CPU + GradScaler; returns (step, params with non-finite grads) per skipped step."""
    bad = []
    for step, (x, y) in enumerate(hm.batches(steps)):
        model.gain = gain_at(step)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        nonfinite = [n for n, p in model.named_parameters() if not torch.isfinite(p.grad).all()]
        scaler.step(opt)
        scaler.update()
        rec = mon.step()
        if rec.skipped:
            bad.append((step, nonfinite))
    return bad


def test_amp_skip_names_the_parameters() -> None:
    torch.manual_seed(0)
    model = hm.OverflowNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with watch(model, opt, config=CFG, run=False) as mon:  # info events only: no warning
        skipped = amp_loop(mon, model, opt, scaler, 8, lambda s: 4096.0 if s == 3 else 1.0)
    assert [s for s, _ in skipped] == [3]
    assert skipped[0][1]  # torch says some gradients held Inf/NaN
    (event,) = [e for e in mon.events if e.kind == "amp_skip"]
    assert event.step == 3 and event.evidence["params"] == skipped[0][1]
    assert events(mon, "amp_scale_collapse") == []


def test_amp_scale_collapse_suggests_bf16() -> None:
    # overflow at every scale from step 2 on, after two updates went through; a step sees the scale it
    # started with: 512 at step 3 (the 1st shrink) ... 32 at step 7, the 5th shrink in a row
    torch.manual_seed(0)
    model = hm.OverflowNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with (
        pytest.warns(TorchDebugWarning, match="consider bf16"),
        watch(model, opt, config=CFG, run=False) as mon,
    ):
        skipped = amp_loop(mon, model, opt, scaler, 9, lambda s: 4096.0 if s >= 2 else 1.0)
    assert [s for s, _ in skipped] == list(range(2, 9))
    assert events(mon, "amp_scale_collapse") == [("amp_scale_collapse", 7, ())]
    assert len(events(mon, "amp_skip")) == 7


def test_amp_calibration_from_a_high_initial_scale_is_not_a_collapse() -> None:
    # init_scale 2**20 and a model whose gradients overflow fp16 at scales above 2**15: the scaler
    # halves 5 times in a row before its first update (its calibration), then trains: info only. (A
    # streak counted from step 0 would have warned at step 5.)
    torch.manual_seed(0)
    model = hm.OverflowNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20)
    with watch(model, opt, config=CFG, run=False) as mon:
        skipped = amp_loop(mon, model, opt, scaler, 16, lambda s: 1.0)
    first_update = len(skipped)
    assert [s for s, _ in skipped] == list(range(first_update)) and first_update == 5
    assert events(mon, "amp_scale_collapse") == []
    assert len(events(mon, "amp_skip")) == first_update


def test_no_finite_scale_before_any_update_is_named_by_the_sentinel() -> None:
    # every step overflows from step 0: no warning while the scale calibrates; when a step starts with
    # the scale below the floor 1.0 (1024 halved 11 times: step 11) the overflow is an anomaly, located
    torch.manual_seed(0)
    model = hm.OverflowNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with pytest.raises(NonFiniteError) as err, watch(model, opt, config=CFG, run=False) as mon:
        amp_loop(mon, model, opt, scaler, 14, lambda s: 4096.0)
    a = err.value.anomaly
    assert (a.phase, a.module, a.op, a.kind, a.step) == ("backward", "big", "AddmmBackward0", "-inf", 11)
    assert events(mon, "amp_scale_collapse") == [] and len(events(mon, "amp_skip")) == 11


def test_amp_growing_scale_is_not_an_explosion() -> None:
    torch.manual_seed(0)
    model = hm.HealthyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # growth every step: the scaled gradient norm reaches 1e5-3e5 (> explode_abs 1e4) and overflows
    # every few steps; unscaled it is a healthy ~2. 60 steps: well past the 20-step warm-up even
    # though skipped steps are not judged
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**14, growth_interval=1)
    with watch(model, opt, config=CFG, run=False) as mon:
        skipped = amp_loop(mon, model, opt, scaler, 60, lambda s: 1.0)
        health = health_of(mon)
    assert len(skipped) >= 5
    # the records carry the true (unscaled) norm: the scaled one (x2**14 and growing) would be > 1e4
    assert max(r.grad_norm for r in mon.records if not r.skipped) < 10
    assert {e.kind for e in mon.events} == {"amp_skip"}
    assert health.counters["gradient_explosions"] == 0


def test_clip_grad_norm_is_seen_and_restored(tmp_path) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = hm.HealthyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    totals: list[float] = []

    def clip(step: int) -> None:
        totals.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5).item())

    with watch(model, opt, config=CFG, run=tmp_path) as mon:
        hm.train(mon, model, opt, 4, after_backward=clip)
        health = health_of(mon)
        assert torch.nn.utils.clip_grad_norm_ is not CLIP_ORIGINALS[0]
    assert_restored(model)
    last = health.last_clip
    assert last is not None and last["step"] == 3 and last["pre"] == pytest.approx(totals[-1])
    # clip_grad_norm_ scales by 0.5 / (total + 1e-6)
    assert last["post"] == pytest.approx(totals[-1] * 0.5 / (totals[-1] + 1e-6)) and last["clipped"]
    assert sum(last["shares"].values()) <= 1.0 and len(last["shares"]) == 3
    clipped = open_run(mon.run_dir).series("grad_norm_clipped")
    assert clipped.steps == [0, 1, 2, 3] and clipped.values[0] == pytest.approx(0.5, rel=1e-5)


def test_nonfinite_clip_names_the_parameter() -> None:
    torch.manual_seed(0)
    model = hm.HealthyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    handles = []

    def poison(step: int) -> None:
        if step == 2:  # an Inf born in backward, in mid.weight's gradient
            handles.append(
                model.mid.weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), math.inf))
            )
        elif handles:
            handles.pop().remove()

    def clip(step: int) -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)

    cfg = {**CFG, "policy": "warn", "replay": False}
    with pytest.warns(TorchDebugWarning), watch(model, opt, config=cfg, run=False) as mon:
        hm.train(mon, model, opt, 3, before_step=poison, after_backward=clip)
    (event,) = [e for e in mon.events if e.kind == "clip_nonfinite"]
    assert event.step == 2 and event.modules == ("mid",) and event.evidence["params"] == ["mid.weight"]


def test_removed_on_exception() -> None:
    model = hm.HealthyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with (
        pytest.raises(RuntimeError, match="boom"),
        watch(model, opt, config={**CFG, "activation_stats": True}, run=False),
    ):
        assert any(m._forward_hooks for m in model.modules())
        raise RuntimeError("boom")
    assert_restored(model)


def test_lr_schedule_events() -> None:
    torch.manual_seed(0)
    model = hm.HealthyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)

    def before(step: int) -> None:
        if step == 25:
            for g in opt.param_groups:
                g["lr"] = 0.0

    with pytest.warns(TorchDebugWarning), watch(model, opt, config=CFG, run=False) as mon:
        for step, (x, y) in enumerate(hm.batches(28)):
            before(step)
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
            mon.step()
            sched.step()
    # mon.step reads the LR before sched.step(): 0.05 for steps 0-9, 0.025 from 10, 0.0125 from 20, 0 from 25
    assert events(mon, "lr_change", "lr_zero") == [
        ("lr_change", 10, ()),
        ("lr_change", 20, ()),
        ("lr_zero", 25, ()),
        ("lr_change", 25, ()),
    ]
    assert [e.severity for e in mon.events if e.kind == "lr_change"] == ["info"] * 3


def test_basic_level_runs_the_rules_without_details(tmp_path) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = hm.ExplodingNet(blowup=1e4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def fault(step: int) -> None:
        model.fault = step == 25

    cfg = {**CFG, "level": "basic"}  # gradients without gradient_details
    with pytest.warns(TorchDebugWarning), watch(model, opt, config=cfg, run=tmp_path) as mon:
        hm.train(mon, model, opt, 26, before_step=fault)
        health = health_of(mon)
    assert not health.details and not health.activations
    assert events(mon, "gradient_explosion") == [("gradient_explosion", 25, ("inp",))]
    names = open_run(mon.run_dir).metric_names()
    assert not [n for n in names if "/" in n and not n.startswith("lr/")]  # no per-parameter series


class EarlyStopper:
    """Duck-typed early stopping: patience / counter / best."""

    def __init__(self, patience: int) -> None:
        self.patience = patience
        self.counter = 0
        self.best = math.inf

    def update(self, value: float) -> None:
        if value < self.best:
            self.best, self.counter = value, 0
        else:
            self.counter += 1


def test_early_stopping_and_observe(tmp_path) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = hm.HealthyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    stopper = EarlyStopper(patience=2)
    val = [1.0, 0.8, 0.9, 0.85]  # best 0.8 at epoch 1, then two epochs without improvement
    with watch(model, opt, config=CFG, run=tmp_path, early_stopping=stopper) as mon:
        data = hm.batches(8)
        for v in val:
            hm.train(mon, model, opt, 2, data=(next(data) for _ in range(2)))
            stopper.update(v)
            mon.observe("val_loss", v)
        health = health_of(mon)
    assert health.observed == {"val_loss": 0.85}
    assert events(mon, "early_stopping") == [("early_stopping", 8, ())]
    assert health.early_stopping_state == {"patience": 2.0, "counter": 2.0, "best": 0.8}
    run = open_run(mon.run_dir)
    # logged when the state changes: step 0 (no best yet), then after each epoch's 2 steps
    counter = run.series("early_stopping/counter")
    assert (counter.steps, counter.values) == ([0, 2, 4, 6, 8], [0.0, 0.0, 0.0, 1.0, 2.0])
    assert run.series("early_stopping/best").values == [1.0, 0.8, 0.8, 0.8]  # steps 2, 4, 6, 8

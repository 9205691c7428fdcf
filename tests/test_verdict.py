"""The verdict (one sentence per run, the same in every view), anomaly groups and the divergence rule."""

from __future__ import annotations

import math
import random
import statistics
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures import watched_runs as W
from tests.fixtures.runs import write_small_run
from torchdebug.health.divergence import DivergenceRule
from torchdebug.store import open_run
from torchdebug.views.verdict import group_anomalies, judge, verdict

A = {
    "summary": "nan born in forward of fc2 (Linear): aten.addmm at train.py:42 (step 6)",
    "kind": "nan",
    "phase": "forward",
    "module": "fc2",
    "op": "aten.addmm",
    "location": "train.py:42",
    "step": 6,
}
DIVERGED = {
    "kind": "divergence",
    "step": 1210,
    "severity": "warning",
    "message": "loss diverged at step 1210",
    "data": {"evidence": {"metric": "loss", "before": 0.018, "after": 17.6, "since_step": 1210}},
}


def test_a_healthy_run_is_green_and_says_so() -> None:
    v = judge("finished", steps=2000, last_step=1999, anomalies=[], events=[])
    assert (v["level"], v["text"]) == ("ok", "finished: 2000 steps, no anomalies")


def test_a_failed_run_names_the_step_and_the_origin() -> None:
    v = judge("failed", steps=7, last_step=6, anomalies=[A], events=[])
    assert v["level"] == "error"
    assert v["text"] == "failed at step 6: nan born in forward of fc2 (Linear): aten.addmm at train.py:42"


def test_a_failed_run_without_nan_says_it_raised() -> None:
    v = judge("failed", steps=3, last_step=2, anomalies=[], events=[])
    assert v["text"] == "failed at step 2: the training raised an exception (no NaN/Inf recorded)"


def test_many_nan_steps_are_counted_and_finished_is_not_green() -> None:
    # 788 steps 1212..1999 with the same origin: one group, counted once per step
    many = [
        dict(A, step=s, summary=f"nan born in forward of fc2 (Linear): aten.addmm at train.py:42 (step {s})")
        for s in range(1212, 2000)
    ]
    v = judge("finished", steps=2000, last_step=1999, anomalies=many, events=[])
    assert v["level"] == "error"
    assert v["text"] == (
        "finished, 788 steps with non-finite values, first at step 1212: "
        "nan born in forward of fc2 (Linear): aten.addmm at train.py:42"
    )
    assert [(g["count"], g["first_step"], g["last_step"]) for g in v["groups"]] == [(788, 1212, 1999)]


def test_divergence_without_recovery_is_a_warning_sentence() -> None:
    v = judge("finished", steps=2000, last_step=1999, anomalies=[], events=[DIVERGED])
    assert (v["level"], v["text"]) == (
        "warning",
        "finished, but diverged at step 1210: loss 0.018 -> 17.6 and did not recover",
    )
    end = {"kind": "divergence_end", "step": 1400, "severity": "info", "data": {}}
    v = judge("finished", steps=2000, last_step=1999, anomalies=[], events=[DIVERGED, end])
    assert v["text"] == "finished, but diverged at step 1210 (loss 0.018 -> 17.6), recovered by step 1400"


def test_running_and_lost_records() -> None:
    assert judge("running", steps=5, last_step=4, anomalies=[], events=[])["text"] == (
        "running: step 4, no anomalies so far"
    )
    v = judge("finished", steps=5, last_step=4, anomalies=[], events=[], lost=3)
    assert (v["level"], v["text"]) == (
        "warning",
        "finished: 5 steps, no anomalies; incomplete: 3 records lost",
    )


def test_warning_events_keep_finished_from_green() -> None:
    ev = [
        {"kind": "info_only", "step": 1, "severity": "info", "message": "fine"},
        {"kind": "gradient_explosion", "step": 5, "severity": "warning", "message": "grad norm 64 is 32x"},
        {"kind": "memory_leak", "step": 7, "severity": "warning", "message": "RSS grew"},
    ]
    v = judge("finished", steps=8, last_step=7, anomalies=[], events=ev)
    assert (v["level"], v["text"]) == (
        "warning",
        "finished, but gradient_explosion at step 5: grad norm 64 is 32x; also 1 memory_leak",
    )


def _ev(kind: str, step: int, message: str = "m", severity: str = "warning") -> dict[str, Any]:
    return {"kind": kind, "step": step, "severity": severity, "message": message}


def test_the_verdict_ranks_by_consequence_not_by_time() -> None:
    # a live run: 6 input_bound hints from step 6, the gradient explosion that ruined it at step 1201,
    # 3 update_ratio warnings after it: the explosion leads, the rest are counted by kind
    ev = [_ev("input_bound", s, "data wait 60% of the step") for s in range(6, 12)]
    ev.append(_ev("gradient_explosion", 1201, "grad norm 4.1e+03 is 310x its median"))
    ev += [_ev("update_ratio", s, "updates 1e-1 of the weights") for s in (1300, 1400, 1500)]
    v = judge("running", steps=1600, last_step=1599, anomalies=[], events=ev)
    assert (v["level"], v["text"]) == (
        "warning",
        "running: step 1599, gradient_explosion at step 1201: grad norm 4.1e+03 is 310x its median; "
        "also 3 update_ratio, 6 input_bound",
    )
    assert [(f["kind"], f["step"], f["count"]) for f in v["findings"]] == (
        [("gradient_explosion", 1201, 1)]
        + [("update_ratio", s, 3) for s in (1300, 1400, 1500)]
        + [("input_bound", s, 6) for s in range(6, 12)]
    )


def test_nan_then_open_divergence_then_a_rollback_then_warnings() -> None:
    ev = [
        _ev("slowdown", 2, "step 2.1x its median"),
        _ev("rollback", 40, "rolled back to step 30, 10 batches skipped"),
        _ev("gradient_explosion", 39, "grad norm 90 is 40x"),
        DIVERGED,
    ]
    nan = dict(
        A, step=1300, summary="nan born in forward of fc2 (Linear): aten.addmm at train.py:42 (step 1300)"
    )
    v = judge("finished", steps=2000, last_step=1999, anomalies=[nan], events=ev)
    # two clauses (the NaN, then the divergence that did not recover), the rest counted
    assert (v["level"], v["text"]) == (
        "error",
        "finished, but non-finite values at step 1300: nan born in forward of fc2 (Linear): aten.addmm "
        "at train.py:42; diverged at step 1210: loss 0.018 -> 17.6 and did not recover; "
        "also 1 rollback, 1 gradient_explosion, 1 slowdown",
    )
    assert [f["kind"] for f in v["findings"]] == [
        "nan",
        "divergence",
        "rollback",
        "gradient_explosion",
        "slowdown",
    ]
    # without the NaN and the divergence, the rollback leads; an error event outranks it
    v = judge("finished", steps=50, last_step=49, anomalies=[], events=ev[:3])
    assert v["text"] == (
        "finished, but rollback at step 40: rolled back to step 30, 10 batches skipped; "
        "also 1 gradient_explosion, 1 slowdown"
    )
    hang = _ev("hang", 45, "rank 1 waited 300 s in all_reduce", "error")
    v = judge("finished", steps=50, last_step=49, anomalies=[], events=[*ev[:3], hang])
    assert (v["level"], v["text"].split(";")[0]) == (
        "error",
        "finished, but hang at step 45: rank 1 waited 300 s in all_reduce",
    )
    assert v["text"].split("; ")[1] == "rollback at step 40: rolled back to step 30, 10 batches skipped"


def test_a_hint_alone_is_amber_and_info_events_are_green() -> None:
    v = judge("finished", steps=9, last_step=8, anomalies=[], events=[_ev("input_bound", 3, "add workers")])
    assert (v["level"], v["text"]) == ("warning", "finished, but input_bound at step 3: add workers")
    infos = [_ev("slowdown", 3, "the machine is busy", "info"), _ev("lr_change", 4, "lr 0.1 -> 0.01", "info")]
    v = judge("finished", steps=9, last_step=8, anomalies=[], events=infos)
    assert (v["level"], v["text"], v["findings"]) == ("ok", "finished: 9 steps, no anomalies", [])


def test_a_bounded_sample_with_counts_by_kind_says_the_same() -> None:
    # the trackers keep each kind's first event and the counts: the same sentence as the whole list
    ev = [_ev("input_bound", s) for s in range(5)] + [_ev("loss_spike", s) for s in (7, 9)]
    whole = judge("finished", steps=10, last_step=9, anomalies=[], events=ev)
    sample = judge(
        "finished",
        steps=10,
        last_step=9,
        anomalies=[],
        events=[ev[0], ev[5]],
        event_counts={"input_bound": 5, "loss_spike": 2},
    )
    assert (
        sample["text"]
        == whole["text"]
        == "finished, but loss_spike at step 7: m; also 1 loss_spike, 5 input_bound"
    )


def test_groups_fold_same_origin_and_same_symptom() -> None:
    sym = {"kind": "nan", "phase": "backward", "module": None, "symptom": "grad of fc1.weight"}
    other = dict(A, module="fc1", step=9)
    groups = group_anomalies(
        [A, dict(A, step=8), other, dict(sym, step=10), dict(sym, step=12), dict(A, step=8)]
    )
    # A at 6, 8, 8 (two records at step 8: 3 records, 2 distinct steps); fc1 once; the symptom twice
    assert [
        (g["anomaly"]["module"], g["count"], g["first_step"], g["last_step"], g["steps"]) for g in groups
    ] == [
        ("fc2", 3, 6, 8, [6, 8]),
        ("fc1", 1, 9, 9, [9]),
        (None, 2, 10, 12, [10, 12]),
    ]


def test_the_small_run_verdict_from_the_store(tmp_path: Path) -> None:
    with open_run(write_small_run(tmp_path)) as run:
        v = verdict(run)
    # one NaN at step 6 (the loss NaN is the same step), finished
    assert v["level"] == "error"
    assert v["text"] == (
        "finished, but non-finite values at step 6: nan born in forward of fc2 (Linear): aten.addmm at train.py:42; "
        "also 1 nonfinite_gradients, 1 gradient_explosion, 1 loss_spike, 1 memory_leak"
    )


# ---------------------------------------------------------------------------------------- divergence


def _feed(rule: DivergenceRule, losses: list[float], start: int = 0) -> list[Any]:
    return [e for s, x in enumerate(losses, start) if (e := rule.update(s, x)) is not None]


def test_divergence_fires_once_with_onset_before_and_after() -> None:
    rule = DivergenceRule(recent=4, window=8)
    # 12 losses 1/(s+1), then 20.0 from step 12 on
    events = _feed(rule, [1.0 / (s + 1) for s in range(12)] + [20.0] * 30)
    assert [e.kind for e in events] == ["divergence"]
    ev = events[0]
    # it fires at step 15 (steps 12..15 above: 4 of 4 >= 0.8 * 4; at step 14 only 3 < 3.2), onset 12;
    # before: the median of the 4 losses before the recent window (steps 8..11: 1/9..1/12) =
    # (1/10 + 1/11) / 2 = 0.0955; after: the recent median (steps 12..15) = 20
    assert ev.step == 12 and ev.evidence["since_step"] == 12
    assert ev.evidence["before"] == pytest.approx((1 / 10 + 1 / 11) / 2)
    assert ev.evidence["after"] == 20.0
    assert ev.severity == "warning"
    assert ev.message.startswith("loss diverged at step 12: 0.0955 -> 20 and did not recover within 4 steps")


def test_divergence_ends_when_the_loss_comes_back_and_can_fire_again() -> None:
    rule = DivergenceRule(recent=4, window=8)
    losses = [1.0 / (s + 1) for s in range(12)] + [20.0] * 6 + [0.1] * 6 + [0.1] * 10 + [30.0] * 6
    events = _feed(rule, losses)
    assert [(e.kind, e.step) for e in events] == [
        ("divergence", 12),
        ("divergence_end", 20),
        ("divergence", 34),
    ]


def test_a_single_spike_or_a_few_outliers_are_not_divergence() -> None:
    rule = DivergenceRule(recent=10, window=40)
    losses = [1.0 / (s + 1) for s in range(60)]
    losses[50] = 1e6  # one spike
    losses[53] = losses[55] = 500.0  # two more outliers: 3 of 10 < share 0.8
    assert _feed(rule, losses) == []


def _noisy(n: int, f: Any, seed: int = 0) -> list[float]:
    import random

    rnd = random.Random(seed)
    return [f(s) * (1 + 0.2 * rnd.uniform(-1, 1)) for s in range(n)]


@pytest.mark.parametrize(
    "curve",
    [
        pytest.param(lambda s: 2.3 * math.exp(-s / 50) + 0.01, id="fast-fall"),
        pytest.param(lambda s: 1.0 + 0.0 * s, id="noisy-flat"),
        pytest.param(lambda s: 1e-6 * (1 + (s % 7)), id="near-zero-wiggle"),
        # warm-up: loss creeps up 20 % while the lr ramps over 100 steps, then a cosine decay
        pytest.param(
            lambda s: (
                2.0 * (1 + 0.2 * min(s, 100) / 100)
                if s < 150
                else 2.4 * (0.5 + 0.5 * math.cos(math.pi * (s - 150) / 1850)) + 0.05
            ),
            id="warmup-cosine",
        ),
    ],
)
def test_healthy_curves_never_diverge(curve: Any) -> None:
    assert _feed(DivergenceRule(), _noisy(2000, curve)) == []


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="recent >= 2 and window >= recent"):
        DivergenceRule(recent=10, window=5)


# ---------------------------------------------------------------------------------------- real runs


@pytest.fixture
def runs(watched_runs: dict[str, Path]) -> dict[str, Path]:
    return watched_runs


def test_real_runs_verdicts(runs: dict[str, Path]) -> None:
    texts = {}
    for name, path in runs.items():
        with open_run(path) as run:
            texts[name] = verdict(run)
    assert (texts["healthy"]["level"], texts["healthy"]["text"]) == (
        "ok",
        f"finished: {140} steps, no anomalies",
    )
    div = texts["diverged"]
    assert div["level"] == "warning" and div["text"].startswith("finished, but diverged at step 10")
    # the spike's forensics and the loss rule's warnings are the same incident: counted, not said
    assert "and did not recover; also " in div["text"]
    assert div["findings"][0]["kind"] == "divergence" and div["findings"][1]["kind"] == "spike_report"
    assert texts["failed"]["text"] == (
        "failed at step 3: nan born in forward of blocks.1.act (LogAct): aten.log at tests/fixtures/models.py:49"
    )
    warned = texts["warned"]
    # steps 10..39 each turned NaN: 30 steps; the first traced at blocks.1.act, the rest then seen
    # in the weights the NaN reached (one origin each: two groups)
    assert warned["text"].startswith(
        "finished, 30 steps with non-finite values, first at step 10: nan born in"
    )
    assert [(g["count"], g["first_step"], g["last_step"]) for g in warned["groups"]] == [
        (1, 10, 10),
        (29, 11, 39),
    ]


def test_the_diverged_run_has_one_divergence_event_near_the_spike(runs: dict[str, Path]) -> None:
    with open_run(runs["diverged"]) as run:
        ev = run.events("divergence")
        assert run.events("divergence_end") == []
    assert len(ev) == 1
    e = ev[0]["data"]["evidence"]
    # the learning rate jumps at step 100; the loss is ~0.02 there and far above 1 after it
    assert W.SPIKE_STEP <= e["since_step"] <= W.SPIKE_STEP + 5
    assert e["before"] < 0.1 and e["after"] > 1.0 and e["metric"] == "loss"


def test_healthy_and_failed_runs_have_no_divergence(runs: dict[str, Path]) -> None:
    for name in ("healthy", "failed", "warned"):
        with open_run(runs[name]) as run:
            assert run.events("divergence") == [], name


def test_a_loss_far_above_its_first_value_diverged_from_the_start() -> None:
    # GPT-2 at AdamW lr 1.0: the loss 25-35x its step-0 value from step 1 on, never NaN. No good level
    # to compare with (the baseline fills with diverged losses): the first loss is the reference
    rng = random.Random(0)
    losses = [10.8] + [10.8 * rng.uniform(25, 35) for _ in range(60)]
    rule = DivergenceRule()
    events = _feed(rule, losses)
    assert [e.kind for e in events] == ["divergence"]
    (e,) = events
    # judged once the recent window is full (steps 0..24: 24 of 25 above 20x, share 0.8); the
    # event names its onset, step 1
    assert (e.step, e.evidence["before"], e.evidence["since_step"]) == (1, 10.8, 1)
    assert 25 <= e.evidence["factor"] <= 35
    assert "diverged from the start" in e.message and "Check first the learning rate" in e.message
    assert "Likely" not in e.message and "too high" not in e.message  # what was seen, not a guess


def test_a_level_shift_that_stays_is_a_divergence() -> None:
    # 1200 steps of a healthy decay from 2.3 to ~0.1, then the loss jumps 19x and stays for 800 steps
    rng = random.Random(1)
    healthy = [0.1 + 2.2 * math.exp(-s / 150) + rng.gauss(0, 0.01) for s in range(1200)]
    level = statistics.median(healthy[-25:])
    shifted = [19 * level * rng.uniform(0.9, 1.1) for _ in range(800)]
    events = _feed(DivergenceRule(), healthy + shifted)
    assert [e.kind for e in events] == ["divergence"]
    assert 1200 <= events[0].evidence["since_step"] <= 1201
    assert 17 < events[0].evidence["after"] / events[0].evidence["before"] < 21


@pytest.mark.parametrize(
    "first, later, several",
    [(1.38, 0.9, True), (0.69, 5.0, True), (2.3, 4.0, False)],
    ids=["gan_d", "gan_g", "noisy"],
)
def test_losses_that_rise_a_few_times_their_first_value_are_not_divergence(
    first: float, later: float, several: bool
) -> None:
    # a GAN's generator loss going from 0.69 to ~5 (7x), a discriminator's falling: healthy. A GAN's
    # session has two optimizers (``several``): its loss is not judged by the early 4x jump, which a
    # single model's loss jumping 7x at step 1 and staying is (test_rule_calibration.py)
    rng = random.Random(2)
    losses = [first] + [later * rng.uniform(0.7, 1.3) for _ in range(300)]
    rule = DivergenceRule()
    rule.several = several
    assert _feed(rule, losses) == []

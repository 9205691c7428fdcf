"""The update boundary: manual updates without an optimizer object, and gradients edited between
``backward()`` and the update (normalisation, clipping, unscaling) never reach the weights."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch

import torchdebug as td
from tests.fixtures import models as fx
from tests.fixtures.models import origin_line
from tests.fixtures.stack_models import PATH, GatedSqrt

SENTINEL_ONLY = td.DebugConfig(mode="anomaly_detection")


def _manual_sgd(model: torch.nn.Module, mon: td.Monitor, steps: int, before: Callable[[int], float]) -> None:
    """pytorch/examples word_language_model: zero_grad, forward, backward, clip, p.data.add_(grad)."""
    torch.manual_seed(0)
    for i in range(steps):
        lr = before(i)
        model.zero_grad()
        loss = model(torch.randn(3, 4)).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        mon.step()


def _gate_at(model: GatedSqrt, step: int) -> Callable[[int], float]:
    def before(i: int) -> float:
        model.gate = 0.0 if i == step else 1.0
        return 0.1

    return before


def test_manual_update_nan_gradients_are_a_backward_anomaly_checked_before_the_update() -> None:
    model = GatedSqrt()
    with pytest.raises(td.NonFiniteError) as ei, td.watch(model, run=False, config=SENTINEL_ONLY) as mon:
        _manual_sgd(model, mon, 4, _gate_at(model, 2))
    a = ei.value.anomaly
    assert (a.step, a.phase, a.module, a.op) == (2, "backward", "", "SqrtBackward0")
    assert a.location == origin_line("gated-sqrt", PATH) and a.detected_by == "sentinel"
    assert mon.global_step == 2
    # from step 1 on the check runs at the end of backward(): the update never saw the NaN
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_manual_update_nan_gradients_at_step_0_are_not_blamed_on_the_optimizer() -> None:
    # step 0: the monitor cannot know yet that no optimizer will run; the check runs at mon.step(),
    # after the update made the weights NaN: a backward symptom naming the parameter, never "optimizer"
    model = GatedSqrt()
    with pytest.raises(td.NonFiniteError) as ei, td.watch(model, run=False, config=SENTINEL_ONLY) as mon:
        _manual_sgd(model, mon, 2, _gate_at(model, 0))
    a = ei.value.anomaly
    assert (a.step, a.phase, a.parameter, a.module) == (0, "backward", "fc.weight", "fc")
    assert a.detected_by == "sentinel (no replay)" and "mon.update_starting()" in a.hint


@pytest.mark.parametrize("step", [0, 1], ids=["step0-same-transfer", "step1-next-backward"])
def test_manual_update_that_makes_weights_nan_from_finite_gradients_is_the_optimizer(step: int) -> None:
    model = GatedSqrt()

    def before(i: int) -> float:
        return float("inf") if i == step else 0.1  # lr = inf: finite grads, non-finite weights

    with pytest.raises(td.NonFiniteError) as ei, td.watch(model, run=False, config=SENTINEL_ONLY) as mon:
        _manual_sgd(model, mon, 3, before)
    a = ei.value.anomaly
    assert (a.step, a.phase, a.parameter, a.module) == (step, "optimizer", "fc.weight", "fc")
    assert a.op == "optimizer.step"


# -- gradients edited between backward() and the update (issue 14 item 5) --------------------------
def _normalise(model: torch.nn.Module, opt: torch.optim.Optimizer, scaler: object, bad: bool) -> None:
    for p in model.parameters():
        p.grad /= p.grad.norm()  # at the bad step fc1.weight's gradient is 0 (zero input): 0/0 = NaN
    opt.step()


def _clip(model: torch.nn.Module, opt: torch.optim.Optimizer, scaler: object, bad: bool) -> None:
    torch.nn.utils.clip_grad_norm_(
        model.parameters(), float("nan") if bad else 1.0
    )  # NaN max_norm: NaN grads
    opt.step()


def _unscale(model: torch.nn.Module, opt: torch.optim.Optimizer, scaler: object, bad: bool) -> None:
    scaler.unscale_(opt)  # type: ignore[attr-defined]  # at the bad step the scale is 0: 0 * (1/0) = NaN
    scaler.step(opt)  # type: ignore[attr-defined]


EDITS = {"normalise": _normalise, "clip": _clip, "unscale": _unscale}


def _edited_loop(edit: str, policy: str, mon_out: list, snaps: dict) -> None:
    torch.manual_seed(0)
    model = fx.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    with td.watch(model, opt, run=False, policy=policy, config=SENTINEL_ONLY) as mon:
        mon_out.append(mon)
        for i in range(4):
            bad = i == 2
            x = torch.zeros(4, 8) if bad and edit == "normalise" else torch.randn(4, 8)
            if bad and edit == "unscale":
                scaler.update(new_scale=0.0)
            opt.zero_grad()
            loss = model(x).pow(2).mean() + 1.0
            (scaler.scale(loss) if edit == "unscale" else loss).backward()
            if bad:
                snaps["params"] = [p.detach().clone() for p in model.parameters()]
                snaps["momentum"] = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
            EDITS[edit](model, opt, scaler, bad)
            if bad:
                snaps["after"] = [p.detach().clone() for p in model.parameters()]
                snaps["momentum_after"] = [
                    opt.state[p]["momentum_buffer"].clone() for p in model.parameters()
                ]
            if edit == "unscale":
                scaler.update(new_scale=4.0 if bad else None)
            snaps.setdefault("records", []).append(mon.step())
    snaps["model"] = model


@pytest.mark.parametrize("edit", list(EDITS))
def test_gradient_made_nan_after_backward_is_a_gradient_edit_anomaly_under_raise(edit: str) -> None:
    mons: list = []
    with pytest.raises(td.NonFiniteError) as ei:
        _edited_loop(edit, "raise", mons, {})
    a = ei.value.anomaly
    assert (a.step, a.phase, a.parameter, a.module, a.kind) == (
        2,
        "gradient_edit",
        "fc1.weight",
        "fc1",
        "nan",
    )
    assert "SGD" not in a.summary() and a.detected_by == "sentinel"
    assert mons[0].counters["replays"] == 0  # backward() was measured finite: nothing to replay


@pytest.mark.parametrize("edit", list(EDITS))
def test_gradient_made_nan_after_backward_never_reaches_the_weights_under_skip(edit: str) -> None:
    mons: list = []
    snaps: dict = {}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _edited_loop(edit, "skip", mons, snaps)
    mon = mons[0]
    # nothing but the skip episode, said once as it starts and once as it ends (issue 12.5)
    said = [str(w.message) for w in record]
    assert len(said) == 2, said
    assert said[0].startswith("torchdebug: step 2 skipped by policy: nan born in gradient_edit of fc1.weight")
    assert said[1] == "torchdebug: 1 step skipped by policy='skip' (step 2); training resumed at step 3"
    assert all(torch.equal(a, b) for a, b in zip(snaps["params"], snaps["after"]))  # bitwise unchanged
    assert all(torch.equal(a, b) for a, b in zip(snaps["momentum"], snaps["momentum_after"]))
    assert all(torch.isfinite(p).all() for p in snaps["model"].parameters())
    assert [r.skipped for r in snaps["records"]] == [False, False, True, False]
    assert [(a.step, a.phase, a.parameter) for a in mon.anomalies] == [(2, "gradient_edit", "fc1.weight")]


def test_manual_update_with_a_gradient_edit_after_the_backward_check_blames_the_edit() -> None:
    # from step 1 on the check runs at the end of backward(); the clip after it (NaN max_norm at
    # step 2) is probed at mon.step() and read with step 3's transfer: the edit, not the update
    model = GatedSqrt()
    with pytest.raises(td.NonFiniteError) as ei, td.watch(model, run=False, config=SENTINEL_ONLY) as mon:
        torch.manual_seed(0)
        for i in range(5):
            model.zero_grad()
            model(torch.randn(3, 4)).sum().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), float("nan") if i == 2 else 0.25)
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-0.1)
            mon.step()
    a = ei.value.anomaly
    assert (a.step, a.phase, a.parameter, a.module, a.kind) == (2, "gradient_edit", "fc.weight", "fc", "nan")
    assert mon.global_step == 3  # raised from step 3's backward(), at its transfer


def test_clip_grad_norm_is_judged_by_its_factor_not_by_a_pass_over_every_gradient() -> None:
    # clip_grad_norm_ multiplies every gradient by one factor: finite gradients stay finite iff it is, so
    # the sentinel reads that factor instead of probing each gradient again; an edit before the clip,
    # or after it, is still probed (only the gradients it touched)
    torch.manual_seed(0)
    model = fx.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probed: list[list[str]] = []

    class Spy:
        name = "spy"

        def before_optimizer_step(self, mon: td.Monitor) -> None:
            probed.append([mon.param_names[i] for i in mon.sentinel.edit_index])

    with td.watch(model, opt, run=False, config=SENTINEL_ONLY) as mon:
        mon.instruments.append(Spy())
        for i in range(3):
            opt.zero_grad()
            model(torch.randn(4, 8)).pow(2).mean().backward()
            if i == 1:
                model.fc2.bias.grad.mul_(0.5)  # a hand edit before the clip
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            if i == 2:
                model.fc1.bias.grad.add_(1.0)  # ... and after it
            opt.step()
            mon.step()
    assert probed == [[], ["fc2.bias"], ["fc1.bias"]]
    assert mon.anomalies == [] and mon.counters["skipped_steps"] == 0

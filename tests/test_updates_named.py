"""Who made the weights non-finite, when several parameters, optimizers or anomalies are involved:

- a multi-tensor update (``foreach``, ``fused``) that writes several parameters at once names the
  first parameter it made non-finite, as the single-tensor update does, under ``watch`` and in
  ``locate_nonfinite``;
- several optimizers in one step (a GAN whose generator's optimizer gets an infinite learning rate):
  the generator's optimizer is named, the discriminator's update stays alone;
- after the first (correct) anomaly, the weights that the updates it let through made non-finite are
  its consequence, never a new ``parameter`` origin "loaded from a bad checkpoint or written outside
  the step" (resuming from a poisoned optimizer state; the GAN under ``warn``);
- ``locate_nonfinite`` does not alarm on a NaN input the model replaces before using it.

Every scenario runs under ``warn`` and ``skip`` to the end of its loop.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import torchdebug as td
from tests.fixtures.gan_script import Discriminator, Generator, gan_step
from tests.test_optimizer_state import _checkpoint, _resumed, _train

STEPS, BAD = 4, 2
IMPLS = [{"foreach": False}, {"foreach": True}, {"fused": True}]
IDS = ["single-tensor", "foreach", "fused"]


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


# -- a multi-tensor update that writes several parameters -----------------------------------------------
def _sgd_step(model: nn.Sequential, opt: torch.optim.Optimizer, x: torch.Tensor, bad: bool) -> None:
    """SGD with a finite gradient whose update overflows for 2.weight and 0.bias: their gradients are
    set to 3e38 (finite) and lr 10 makes the update 3e39 = +Inf in float32 (the loop's own clipping gone
    wrong: a scale of 1e38 applied to the gradients). In the optimizer's parameter order 0.bias (index
    1) comes before 2.weight (index 2): the first parameter the update made non-finite is 0.bias."""
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    if bad:
        with torch.no_grad():
            model[2].weight.grad.fill_(3e38)
            model[0].bias.grad.fill_(3e38)
    opt.step()


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_locate_names_the_first_parameter_a_multi_tensor_update_made_non_finite(
    impl: dict[str, bool],
) -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=10.0, **impl)
    x = torch.randn(5, 4)
    a = td.locate_nonfinite(lambda: _sgd_step(model, opt, x, True), model=model, optimizer=opt)
    assert a is not None
    assert (a.phase, a.module, a.parameter, a.kind) == ("optimizer", "0", "0.bias", "-inf")  # p - 10 * 3e38
    assert a.symptom.startswith("-inf in the optimizer update of 0.bias, made by aten.")


@pytest.mark.parametrize("policy", ["warn", "skip"])
@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_watch_names_the_first_parameter_a_multi_tensor_update_made_non_finite(
    impl: dict[str, bool], policy: str
) -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=10.0, **impl)
    g = torch.Generator().manual_seed(1)
    with pytest.warns(td.TorchDebugWarning), td.watch(model, opt, policy=policy, run=False) as mon:
        for step in range(STEPS):
            _sgd_step(model, opt, torch.randn(5, 4, generator=g), step == BAD)
            mon.step()
    first = mon.anomalies[0]
    # the gradients are finite: the update made the weights non-finite, named after it ran
    assert (first.phase, first.op, first.parameter, first.kind, first.step) == (
        "optimizer",
        "SGD.step",
        "0.bias",
        "-inf",  # p - lr * g = p - 10 * 3e38 = -3e39: below float32's range
        BAD,
    )
    assert first.hint.startswith("the optimizer update made 0.bias non-finite (and 1 more: 2.weight)")
    assert len(mon.records) == STEPS
    assert all(a.phase != "parameter" for a in mon.anomalies)


# -- several optimizers in one step ---------------------------------------------------------------------
def _gan(policy: str) -> tuple[td.Monitor, list[float], nn.Module]:
    torch.manual_seed(0)
    G, D = Generator(), Discriminator()
    opt_g = torch.optim.Adam(G.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(D.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(3)
    losses = []
    with (
        pytest.warns(td.TorchDebugWarning),
        td.watch([G, D], [opt_g, opt_d], policy=policy, run=False) as mon,
    ):
        for step in range(STEPS):
            opt_g.param_groups[0]["lr"] = math.inf if step == BAD else 1e-3  # a scheduler gone wrong
            x, z = torch.randn(5, 6, generator=g), torch.randn(5, 4, generator=g)
            losses.append(gan_step(G, D, opt_g, opt_d, x, z).item())
            mon.step()
    return mon, losses, D


@pytest.mark.parametrize("policy", ["warn", "skip"])
def test_a_gans_second_optimizer_with_an_infinite_lr_is_named_and_not_blamed_again(policy: str) -> None:
    mon, losses, D = _gan(policy)
    first = mon.anomalies[0]
    assert (first.phase, first.module, first.step) == ("optimizer", "G", BAD)
    assert first.op == "lr = inf in param group 0 (since step 2)"
    assert len(mon.records) == STEPS and len(losses) == STEPS
    if policy == "skip":
        assert len(mon.anomalies) == 1  # the update was dropped before it ran
        assert all(torch.isfinite(p).all() for p in D.parameters())  # D trained on, untouched
        return
    # warn let the update run: G's weights are +Inf from then on; the next step says so as that
    # anomaly's consequence, not as a new origin
    later = mon.anomalies[1]
    assert (later.phase, later.module, later.op, later.parameter, later.step) == (
        "optimizer",
        "G.main.0",
        "Adam.step",
        "G.main.0.weight",
        BAD + 1,
    )
    assert later.hint == (
        "G.main.0.weight already holds non-finite values (0 NaN / 32 Inf) as this step began: the updates "
        "(Adam.step) that ran since the anomaly of step 2 (lr = inf in param group 0 of G's Adam (since "
        "step 2)) carried them in; a consequence of that anomaly, not a new origin"
    )
    assert all(a.phase != "parameter" for a in mon.anomalies)


# -- resuming from a poisoned optimizer state -----------------------------------------------------------
@pytest.mark.parametrize("policy", ["warn", "skip"])
def test_after_a_poisoned_optimizer_state_the_weights_it_spoils_are_its_consequence(policy: str) -> None:
    model, opt = _resumed(_checkpoint(poison=True))
    with pytest.warns(td.TorchDebugWarning), td.watch(model, opt, run=False, policy=policy) as mon:
        assert _train(model, opt, mon, steps=STEPS) == STEPS  # the loop runs to its end
    first, second = mon.anomalies[:2]
    assert first.op == "loaded optimizer state 'exp_avg' (AdamW)" and first.step == 0
    # the first update applied the NaN state to fc1.weight; step 1 begins with it
    assert (second.phase, second.module, second.op, second.parameter, second.step) == (
        "optimizer",
        "fc1",
        "AdamW.step",
        "fc1.weight",
        1,
    )
    assert second.hint == (
        "fc1.weight already holds non-finite values (1 NaN / 0 Inf) as this step began: the updates "
        "(AdamW.step) that ran since the anomaly of step 0 (nan in the loaded optimizer state of "
        "fc1.weight (exp_avg) when the session started) carried them in; a consequence of that anomaly, "
        "not a new origin"
    )
    assert all(a.phase != "parameter" for a in mon.anomalies)
    assert len(mon.records) == STEPS


# -- a NaN input the model replaces before use -----------------------------------------------------------
class CleansInput(nn.Module):
    """Sensor readings with gaps (NaN), replaced before use, as tabular and time-series code does."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.nan_to_num(x) if self.how == "nan_to_num" else x.masked_fill(torch.isnan(x), 0.0)
        return self.fc(x)


@pytest.mark.parametrize("how", ["nan_to_num", "masked_fill"])
def test_locate_is_silent_on_a_nan_input_the_model_replaces_before_use(how: str) -> None:
    torch.manual_seed(0)
    model = CleansInput(how)
    x = torch.randn(5, 4)
    x[1, 2] = math.nan

    def step(batch: torch.Tensor) -> torch.Tensor:
        model.zero_grad()
        loss = model(batch).pow(2).mean()
        loss.backward()
        return loss

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert td.locate_nonfinite(step, x, model=model) is None
    # used without the replacement, the same input is named as the batch's NaN, at its row
    model.how = "none"
    model.forward = lambda x: model.fc(x)  # type: ignore[method-assign]
    a = td.locate_nonfinite(step, x, model=model)
    assert a is not None and (a.phase, a.symptom) == ("input", "nan in input #0, row 1 (1 of 5 rows)")

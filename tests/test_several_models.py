"""Loops with several models and optimizers: a GAN, a teacher and its student, an actor and its critic.

One ``mon.step()`` per training step; each optimizer's update is checked before it runs; every forward
of a watched model in the step is recorded and the replay re-runs the step's micro-steps in order, so
an origin is named with the model's name (``D.1``), the op and the user's line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import torchdebug as td
from tests.fixtures import gan_script
from tests.fixtures.gan_script import Discriminator, Fault, Generator, gan_step
from tests.fixtures.models import origin_line
from torchdebug.store import open_run

GAN_FILE = gan_script.__file__
FORWARD_LINE = origin_line("fault_forward", GAN_FILE)  # sqrt of negative inputs: NaN
BACKWARD_LINE = origin_line("fault_backward", GAN_FILE)  # sqrt at exact zeros: an infinite gradient


def _gan() -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    torch.manual_seed(0)
    G, D = Generator(), Discriminator()
    return G, D, torch.optim.Adam(G.parameters(), lr=1e-3), torch.optim.Adam(D.parameters(), lr=1e-3)


def _gan_run(fault: str, bad_step: int = 2, steps: int = 4, adopt: bool = False) -> tuple[Any, Any]:
    G, D, opt_g, opt_d = _gan()
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(5, 6, generator=gen), torch.randn(5, 4, generator=gen)) for _ in range(steps)]
    # adopt: an nn.ModuleDict and no optimizer (every optimizer of their parameters is adopted)
    args = (nn.ModuleDict({"G": G, "D": D}),) if adopt else ([G, D], [opt_g, opt_d])
    with td.watch(*args, run=False) as mon:
        for step, (x, z) in enumerate(data):
            if step == bad_step:
                if fault == "D.forward":
                    D[1].mode = "forward"
                elif fault == "G.forward":
                    G.main[1].mode = "forward"
                elif fault == "G.backward":
                    G.main[1].mode = "backward"
                elif fault == "D.update":  # D's optimizer state goes bad: its update makes D.0 NaN
                    opt_d.state[D[0].weight]["exp_avg_sq"].fill_(-1.0)
            gan_step(G, D, opt_g, opt_d, x, z)
            mon.step()
    return mon, (G, D, opt_g, opt_d)


def test_a_nan_born_in_the_discriminators_forward_is_named_with_its_model() -> None:
    with pytest.raises(td.NonFiniteError) as info:
        _gan_run("D.forward")
    a = info.value.anomaly
    # D(x) is the first forward of D's micro-step: sqrt of D.0's negative outputs, at step 2
    assert (a.phase, a.module, a.op, a.step) == ("forward", "D.1", "aten.sqrt", 2)
    assert a.location == FORWARD_LINE
    assert a.micro_step is None  # D's update accumulates one backward


def test_a_nan_born_in_the_generators_forward_is_named_in_the_generator() -> None:
    with pytest.raises(td.NonFiniteError) as info:
        _gan_run("G.forward")
    a = info.value.anomaly
    # G(z) is the step's first forward; D then reads its NaN through fake.detach(), a tensor the loss code
    # made from G's output (not a batch input): the replay follows it back into G
    assert (a.phase, a.module, a.op, a.step) == ("forward", "G.main.1", "aten.sqrt", 2)
    assert a.location == FORWARD_LINE


def test_a_module_dict_without_optimizers_adopts_both_and_names_the_same_origin() -> None:
    with pytest.raises(td.NonFiniteError) as info:
        _gan_run("D.forward", adopt=True)
    a = info.value.anomaly
    assert (a.phase, a.module, a.op, a.step) == ("forward", "D.1", "aten.sqrt", 2)
    with pytest.raises(td.NonFiniteError) as info:
        _gan_run("D.update", adopt=True)
    a = info.value.anomaly
    assert (a.phase, a.module, a.op, a.step) == ("optimizer", "D.0", "Adam.step", 2)


@pytest.mark.parametrize(
    ("models", "optimizers", "error", "match"),
    [
        ([], None, TypeError, "expected torch.nn.Module objects"),
        ([nn.Linear(2, 2), "D"], None, TypeError, "expected torch.nn.Module objects, got Linear, str"),
        ({"G": nn.Linear(2, 2), "D": 3}, None, TypeError, "dict of str -> torch.nn.Module"),
        (nn.ModuleDict(), None, ValueError, "holds no model"),
        (
            [nn.Linear(2, 2), nn.Linear(2, 2)],
            [object()],
            TypeError,
            "expected a torch.optim.Optimizer, got object",
        ),
    ],
    ids=["empty-list", "not-a-module", "dict-of-int", "empty-moduledict", "not-an-optimizer"],
)
def test_bad_models_or_optimizers_name_the_fix(models: Any, optimizers: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        td.watch(models, optimizers, run=False)


def test_the_same_model_twice_is_an_error_and_one_model_in_a_list_is_one_model() -> None:
    G = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="the same model is given twice"):
        td.watch([G, G], run=False)
    mon = td.watch([G], run=False)
    assert mon.roots is None and mon.param_names == ["weight", "bias"]


def test_an_inf_born_in_the_generators_backward_is_named_at_its_module_and_line() -> None:
    with pytest.raises(td.NonFiniteError) as info:
        _gan_run("G.backward")
    a = info.value.anomaly
    # G's backward runs in the second backward of the step (G's loss through D(fake)); G's forward ran
    # in D's micro-step, so the replay re-runs both, in order
    assert (a.phase, a.module, a.op, a.step) == ("backward", "G.main.1", "SqrtBackward0", 2)
    assert a.location == BACKWARD_LINE
    assert a.micro_step is None  # G's update accumulates one backward: no micro-step to name


def test_a_bad_update_of_the_discriminator_is_named_before_the_generators_update() -> None:
    with pytest.raises(td.NonFiniteError) as info:
        _gan_run("D.update")
    a = info.value.anomaly
    # read as G's update starts (same step): D's weights, not G's loss through them, are the origin
    assert (a.phase, a.module, a.op, a.step, a.parameter) == (
        "optimizer",
        "D.0",
        "Adam.step",
        2,
        "D.0.weight",
    )
    assert a.location is None


def test_a_clean_gan_warns_nothing_and_its_update_ratios_are_each_optimizers(tmp_path: Path) -> None:
    G, D, opt_g, opt_d = _gan()
    gen = torch.Generator().manual_seed(1)
    before: dict[str, torch.Tensor] = {}
    after: dict[str, torch.Tensor] = {}
    cfg = td.DebugConfig(mode="gradient_checking", detail_every=2)
    with td.watch({"G": G, "D": D}, [opt_g, opt_d], config=cfg, run=tmp_path) as mon:
        for step in range(3):
            x, z = torch.randn(5, 6, generator=gen), torch.randn(5, 4, generator=gen)
            if step == 2:
                before.update({f"G.{n}": p.detach().clone() for n, p in G.named_parameters()})
                before.update({f"D.{n}": p.detach().clone() for n, p in D.named_parameters()})
            gan_step(G, D, opt_g, opt_d, x, z)
            mon.step()
        after.update({f"G.{n}": p.detach().clone() for n, p in G.named_parameters()})
        after.update({f"D.{n}": p.detach().clone() for n, p in D.named_parameters()})
    assert mon.anomalies == [] and [e for e in mon.events if e.severity != "info"] == []
    assert [r.micro_steps for r in mon.records] == [2, 2, 2]  # two backward calls a step, as written
    run = open_run(mon.run_dir)
    for name in ("G.main.0.weight", "G.main.2.bias", "D.0.weight", "D.2.weight"):
        # |w_after - w_before| / |w_after| over the whole step (each weight is stepped by one optimizer)
        expected = (
            torch.linalg.vector_norm(after[name] - before[name]) / torch.linalg.vector_norm(after[name])
        ).item()
        series = run.series(f"update_ratio/{name}")
        assert series.steps == [0, 2]
        assert series.values[-1] == pytest.approx(expected, rel=1e-5) and expected > 0
    assert run.series("lr/G/0").values == [1e-3] * 3 and run.series("lr/D/0").values == [1e-3] * 3


def _snapshot(models: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
    return {
        f"{m}.{n}": p.detach().clone() for m, model in models.items() for n, p in model.named_parameters()
    }


def _ratio(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], name: str) -> float:
    """|w_after - w_before| / |w_after|: the update ratio over the step, worked out here."""
    return (
        torch.linalg.vector_norm(after[name] - before[name]) / torch.linalg.vector_norm(after[name])
    ).item()


# -- a teacher and its student: the frozen teacher's forward runs inside the student's step -------------
def _distil(
    fault: bool, run: Any, steps: int = 3, cfg: Any = None
) -> tuple[Any, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(4, 8), Fault(), nn.Linear(8, 3)).requires_grad_(False).eval()
    student = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(2)
    before: dict[str, torch.Tensor] = {}
    with td.watch([teacher, student], opt, run=run, config=cfg) as mon:
        for step in range(steps):
            x = torch.randn(6, 4, generator=gen)
            teacher[1].mode = "forward" if fault and step == 1 else ""
            before = _snapshot({"student": student})
            with torch.no_grad():
                target = teacher(x).softmax(-1)
            loss = nn.functional.kl_div(student(x).log_softmax(-1), target, reduction="batchmean")
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step()
    return mon, before, _snapshot({"student": student})


def test_a_nan_born_in_the_frozen_teachers_forward_is_named_in_the_teacher() -> None:
    with pytest.raises(td.NonFiniteError) as info:
        _distil(fault=True, run=False)
    a = info.value.anomaly
    # the teacher runs under no_grad before the student's forward: its forward is replayed first
    assert (a.phase, a.module, a.op, a.step) == ("forward", "teacher.1", "aten.sqrt", 1)
    assert a.location == FORWARD_LINE


def test_a_clean_distillation_warns_nothing_and_its_update_ratio_is_the_students(tmp_path: Path) -> None:
    cfg = td.DebugConfig(mode="gradient_checking", detail_every=2)
    mon, before, after = _distil(fault=False, run=tmp_path, cfg=cfg)
    assert mon.anomalies == [] and [e for e in mon.events if e.severity != "info"] == []
    assert mon.param_names == ["student.0.weight", "student.0.bias", "student.2.weight", "student.2.bias"]
    run = open_run(mon.run_dir)
    series = run.series("update_ratio/student.2.weight")
    assert series.steps == [0, 2]
    assert series.values[-1] == pytest.approx(_ratio(before, after, "student.2.weight"), rel=1e-5)
    assert run.series("lr/0").values == [0.1] * 3  # one optimizer: the names of one model's session


# -- an actor and its critic: two models, two optimizers, two backward calls a step ---------------------
def _actor_critic(fault: str, run: Any, steps: int = 3, cfg: Any = None) -> tuple[Any, Any, Any]:
    torch.manual_seed(0)
    actor = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    critic = nn.Sequential(nn.Linear(4, 8), Fault(), nn.Linear(8, 1))
    opt_a = torch.optim.Adam(actor.parameters(), lr=1e-2)
    opt_c = torch.optim.Adam(critic.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(3)
    before: dict[str, torch.Tensor] = {}
    with td.watch([actor, critic], [opt_a, opt_c], run=run, config=cfg) as mon:
        for step in range(steps):
            s, r = torch.randn(7, 4, generator=gen), torch.randn(7, generator=gen)
            critic[1].mode = fault if step == 1 else ""
            before = _snapshot({"actor": actor, "critic": critic})
            dist = torch.distributions.Categorical(logits=actor(s))
            logp = dist.log_prob(dist.sample())
            v = critic(s).squeeze(-1)
            actor_loss = -(logp * (r - v).detach()).mean()
            opt_a.zero_grad()
            actor_loss.backward()
            opt_a.step()
            critic_loss = ((r - v) ** 2).mean()
            opt_c.zero_grad()
            critic_loss.backward()
            opt_c.step()
            mon.step()
    return mon, before, _snapshot({"actor": actor, "critic": critic})


def test_a_nan_born_in_the_critics_forward_is_named_in_the_critic() -> None:
    with pytest.raises(td.NonFiniteError) as info:
        _actor_critic("forward", run=False)
    a = info.value.anomaly
    # the critic's value is NaN, so the actor's loss (its advantage) is: judged as the actor's update starts
    assert (a.phase, a.module, a.op, a.step) == ("forward", "critic.1", "aten.sqrt", 1)
    assert a.location == FORWARD_LINE


def test_an_inf_born_in_the_critics_backward_is_named_in_the_second_backward() -> None:
    with pytest.raises(td.NonFiniteError) as info:
        _actor_critic("backward", run=False)
    a = info.value.anomaly
    # the critic's loss comes after the actor's update, from the value of the step's only critic forward
    assert (a.phase, a.module, a.op, a.step) == ("backward", "critic.1", "SqrtBackward0", 1)
    assert a.location == BACKWARD_LINE
    assert a.micro_step is None


def test_a_clean_actor_critic_warns_nothing_and_has_each_optimizers_numbers(tmp_path: Path) -> None:
    cfg = td.DebugConfig(mode="gradient_checking", detail_every=2)
    mon, before, after = _actor_critic("", run=tmp_path, cfg=cfg)
    assert mon.anomalies == [] and [e for e in mon.events if e.severity != "info"] == []
    assert [r.micro_steps for r in mon.records] == [2, 2, 2]
    run = open_run(mon.run_dir)
    for name in ("actor.2.weight", "critic.0.weight"):
        assert run.series(f"update_ratio/{name}").values[-1] == pytest.approx(
            _ratio(before, after, name), rel=1e-5
        )
    assert run.series("lr/actor/0").values == [1e-2] * 3 and run.series("lr/critic/0").values == [1e-2] * 3

"""A non-finite optimizer hyperparameter is named before the update it would ruin.

A LambdaLR whose lambda returns inf (at step 0 or later), a NaN lr set by hand, a NaN beta, an inf
eps / momentum / weight decay in one param group of several: each is an ``optimizer`` anomaly at
the optimizer's step pre-hook, before the weights change; ``raise`` raises there, ``skip`` skips
the update (weights and optimizer state untouched) and the run is not marked healthy.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchdebug as td
from torchdebug.nonfinite.hyperparams import HyperparameterCheck
from torchdebug.store import open_run
from torchdebug.views.verdict import verdict

THIS = __file__


def model_and_data() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(16, 4, generator=g), torch.randint(0, 2, (16,), generator=g)


def snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def same(model: nn.Module, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    steps: int,
    policy: str = "raise",
    sched: Any = None,
    edit: Any = None,
    run: Any = False,
) -> tuple[Any, list[list[torch.Tensor]], list[str]]:
    """The plain loop; (the session, the weights before each step's update, the warnings said)."""
    before: list[list[torch.Tensor]] = []
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with td.watch(model, opt, policy=policy, run=run, config={"log_performance": False}) as mon:
            for i in range(steps):
                if edit is not None:
                    edit(i, opt)
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                before.append(snapshot(model))
                opt.step()  # the line the anomaly names
                if sched is not None:
                    sched.step()
                mon.step()
    return mon, before, [str(w.message) for w in said]


with open(THIS) as _f:
    # the `opt.step()` lines: train()'s, then the raise test's
    STEP_LINE, RAISE_LINE = [
        i for i, line in enumerate(_f, 1) if line.rstrip().endswith("# the line the anomaly names")
    ]


def lambda_inf_from(k: int) -> Any:
    return lambda epoch: math.inf if epoch >= k else 1.0


@pytest.mark.parametrize("k", [0, 3], ids=["at-step-0", "at-step-3"])
def test_lambdalr_returning_inf_raises_before_the_update(k: int) -> None:
    model, x, y = model_and_data()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda_inf_from(k))
    before: list[list[torch.Tensor]] = []
    with pytest.raises(td.NonFiniteError) as err, td.watch(model, opt, run=False) as mon:
        for _ in range(6):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            before.append(snapshot(model))
            opt.step()  # the line the anomaly names
            sched.step()
            mon.step()
    a = err.value.anomaly
    assert (a.phase, a.module, a.module_type, a.kind, a.step) == ("optimizer", "", "AdamW", "inf", k)
    assert a.symptom == f"lr = inf in param group 0 of AdamW (set by LambdaLR at step {k})"
    assert a.op == f"lr = inf in param group 0 (set by LambdaLR at step {k})"
    assert a.location == f"tests/test_hyperparams.py:{RAISE_LINE}"
    assert a.summary() == (
        f"inf born in optimizer of AdamW: lr = inf in param group 0 (set by LambdaLR at step {k}) "
        f"at tests/test_hyperparams.py:{RAISE_LINE} (step {k})"
    )
    assert len(before) == k + 1 and same(model, before[k])  # the update of step k never ran
    assert mon.anomalies == [a]


@pytest.mark.parametrize("k", [0, 3], ids=["at-step-0", "at-step-3"])
def test_skip_keeps_the_weights_finite_and_the_run_is_not_healthy(k: int, tmp_path: Path) -> None:
    model, x, y = model_and_data()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda_inf_from(k))
    mon, before, said = train(model, opt, x, y, steps=6, policy="skip", sched=sched, run=tmp_path)
    # the lambda stays inf: steps k..5 are all skipped, each named before its update
    assert [r.skipped for r in mon.records] == [False] * k + [True] * (6 - k)
    assert [a.step for a in mon.anomalies] == list(range(k, 6))
    assert {a.symptom for a in mon.anomalies} == {
        f"lr = inf in param group 0 of AdamW (set by LambdaLR at step {k})"
    }
    assert same(model, before[k]) and all(torch.isfinite(p).all() for p in model.parameters())
    assert (
        opt.state[next(iter(model.parameters()))].get("step", torch.tensor(0.0)).item() == k
    )  # no state change
    assert said[0].startswith(f"torchdebug: step {k} skipped by policy: inf born in optimizer of AdamW")
    with open_run(mon.run_dir) as run:
        v = verdict(run)
        assert run.status == "finished"
    assert v["level"] == "error" and v["anomaly_steps"] == 6 - k
    assert v["text"].startswith(
        f"finished, {6 - k} steps with non-finite values, first at step {k}: inf born in optimizer"
    )


def test_warn_names_it_and_lets_the_update_through() -> None:
    model, x, y = model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda_inf_from(2))
    mon, _, said = train(model, opt, x, y, steps=3, policy="warn", sched=sched)
    assert mon.anomalies[0].symptom == "lr = inf in param group 0 of SGD (set by LambdaLR at step 2)"
    assert said[0] == (
        "torchdebug: inf born in optimizer of SGD: lr = inf in param group 0 (set by LambdaLR at step 2) "
        f"at tests/test_hyperparams.py:{STEP_LINE} (step 2) (policy='warn': training goes on)"
    )
    assert not all(torch.isfinite(p).all() for p in model.parameters())  # warn: it ran


def set_at(step: int, key: str, value: Any) -> Any:
    """Set a hyperparameter of param group 0 by hand before ``step`` (the constructors refuse these)."""

    def edit(i: int, opt: torch.optim.Optimizer) -> None:
        if i == step:
            opt.param_groups[0][key] = value

    return edit


@pytest.mark.parametrize(
    "make, edit, symptom",
    [
        pytest.param(
            lambda ps: torch.optim.SGD(ps, lr=0.1),
            set_at(2, "lr", math.nan),
            "lr = nan in param group 0 of SGD (since step 2)",
            id="nan-lr-by-hand",
        ),
        pytest.param(
            lambda ps: torch.optim.Adam(ps, lr=1e-3),
            set_at(1, "betas", (0.9, math.nan)),
            "betas[1] = nan in param group 0 of Adam (since step 1)",
            id="nan-beta",
        ),
        pytest.param(
            lambda ps: torch.optim.Adam(ps, lr=1e-3, eps=math.inf),
            None,
            "eps = inf in param group 0 of Adam (since step 0)",
            id="inf-eps",
        ),
        pytest.param(
            lambda ps: torch.optim.SGD(
                [{"params": ps[:2]}, {"params": ps[2:], "momentum": math.inf}], lr=0.1, momentum=0.9
            ),
            None,
            "momentum = inf in param group 1 of SGD (since step 0)",
            id="inf-momentum-group-1",
        ),
        pytest.param(
            lambda ps: torch.optim.AdamW(ps, lr=1e-3),
            set_at(0, "weight_decay", -math.inf),
            "weight_decay = -inf in param group 0 of AdamW (since step 0)",
            id="minus-inf-weight-decay",
        ),
        pytest.param(
            lambda ps: torch.optim.Adam(ps, lr=torch.tensor(1e-3)),
            lambda i, opt: opt.param_groups[0]["lr"].fill_(math.nan) if i == 3 else None,
            "lr = nan in param group 0 of Adam (since step 3)",
            id="cpu-tensor-lr",
        ),
    ],
)
def test_each_hyperparameter_is_named_before_the_update(make: Any, edit: Any, symptom: str) -> None:
    model, x, y = model_and_data()
    opt = make(list(model.parameters()))
    with pytest.raises(td.NonFiniteError) as err:
        train(model, opt, x, y, steps=4, edit=edit)
    a = err.value.anomaly
    assert a.symptom == symptom and a.phase == "optimizer"
    assert a.kind == symptom.split(" = ")[1].split(" ")[0]
    assert all(torch.isfinite(p).all() for p in model.parameters())  # raised before the update


def test_under_async_reads_the_host_check_still_comes_before_the_update() -> None:
    # sync="async" reads the step's device numbers one step late; the lr is a Python float, checked
    # on the host at the pre-hook all the same, and skip drops the gradients of the fused update
    model, x, y = model_and_data()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda_inf_from(3))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with td.watch(model, opt, policy="skip", run=False, sync="async") as mon:
            before = []
            for _ in range(5):
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                before.append(snapshot(model))
                opt.step()
                sched.step()
                mon.step()
    assert [a.step for a in mon.anomalies] == [3, 4]
    assert [r.skipped for r in mon.records] == [False, False, False, True, True]
    assert same(model, before[3])


def test_a_healthy_schedule_says_nothing_and_costs_no_device_read() -> None:
    model, x, y = model_and_data()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10)  # moves lr and betas
    mon, _, said = train(model, opt, x, y, steps=10, sched=sched)
    assert mon.anomalies == [] and said == []
    check = mon.hyperparams
    assert check.items() == [] and check.first_seen == {}  # Python floats: nothing joins the read


def test_the_check_by_hand() -> None:
    check = HyperparameterCheck()
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([p], lr=0.5)
    opt.param_groups[0]["betas"] = (0.9, math.inf)
    check.stage(opt)
    assert [(b.name, b.value, b.group) for b in check.bad] == [("betas[1]", math.inf, 0)]
    assert check.describe_lrs() == "lr 0.5 in param group 0 of Adam"
    two = torch.optim.SGD([{"params": [p]}, {"params": [nn.Parameter(torch.zeros(1))], "lr": 0.1}], lr=1.0)
    fresh = HyperparameterCheck()
    assert fresh.describe_lrs(two) == "lrs 1, 0.1 in param groups 0-1 of SGD"


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device: a tensor lr on it joins the step's read"
)
def test_a_device_tensor_lr_is_read_with_the_step() -> None:
    model, x, y = model_and_data()
    model, x, y = model.cuda(), x.cuda(), y.cuda()
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-3, device="cuda"), capturable=True)

    def inf_at_1(i: int, o: torch.optim.Optimizer) -> None:
        if i == 1:
            o.param_groups[0]["lr"].fill_(math.inf)

    with pytest.raises(td.NonFiniteError) as err:
        train(model, opt, x, y, steps=3, edit=inf_at_1)
    assert err.value.anomaly.symptom == "lr = inf in param group 0 of Adam (since step 1)"
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ------------------------------------------------------------------------------- several models


def gan_run(policy: str, steps: int = 4) -> tuple[Any, dict[str, list[list[torch.Tensor]]], Any, list[str]]:
    """A GAN (G, D, an Adam each) whose D's LambdaLR returns inf from step 2 on. (The session, each
    model's weights before D's update of each step, D's optimizer, the warnings said.)"""
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6))
    D = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1), nn.Sigmoid())
    opt_g, opt_d = torch.optim.Adam(G.parameters(), lr=1e-3), torch.optim.Adam(D.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt_d, lambda_inf_from(2))
    gen = torch.Generator().manual_seed(1)
    before: dict[str, list[list[torch.Tensor]]] = {"G": [], "D": []}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with td.watch(
            [G, D], [opt_g, opt_d], policy=policy, run=False, config={"log_performance": False}
        ) as mon:
            for _ in range(steps):
                x, z = torch.randn(5, 6, generator=gen), torch.randn(5, 4, generator=gen)
                opt_d.zero_grad()
                fake = G(z)
                (-(torch.log(D(x)) + torch.log(1 - D(fake.detach()))).mean()).backward()
                before["G"].append(snapshot(G))
                before["D"].append(snapshot(D))
                opt_d.step()  # D's update: the line named
                opt_g.zero_grad()
                (-torch.log(D(fake)).mean()).backward()
                opt_g.step()
                sched.step()
                mon.step()
    return mon, before, opt_d, [str(w.message) for w in said]


with open(THIS) as _f:
    D_STEP_LINE = next(
        i for i, line in enumerate(_f, 1) if line.rstrip().endswith("# D's update: the line named")
    )

D_SUMMARY = (
    "inf born in optimizer of D (Adam): lr = inf in param group 0 (set by LambdaLR at step 2) "
    f"at tests/test_hyperparams.py:{D_STEP_LINE} (step 2)"
)


def test_an_inf_lr_of_the_discriminators_optimizer_is_named_as_ds_before_its_update() -> None:
    with pytest.raises(td.NonFiniteError) as err:
        gan_run("raise")
    a = err.value.anomaly
    assert (a.phase, a.module, a.module_type, a.kind, a.step) == ("optimizer", "D", "Adam", "inf", 2)
    assert a.symptom == "lr = inf in param group 0 of D's Adam (set by LambdaLR at step 2)"
    assert a.summary() == D_SUMMARY


def test_skip_leaves_d_as_it_was_while_g_trains_on() -> None:
    mon, before, opt_d, said = gan_run("skip", steps=4)
    D, G = mon.roots["D"], mon.roots["G"]
    assert [r.skipped for r in mon.records] == [False, False, True, True]
    assert [(a.step, a.module) for a in mon.anomalies] == [(2, "D"), (3, "D")]
    assert same(D, before["D"][2]) and all(torch.isfinite(p).all() for p in D.parameters())
    assert opt_d.state[D[0].weight]["step"].item() == 2  # D's two updates, none since
    assert not same(G, before["G"][3]) and all(torch.isfinite(p).all() for p in G.parameters())  # G's ran
    assert said[0].startswith(f"torchdebug: step 2 skipped by policy: {D_SUMMARY}")
    # only D's update was dropped: the warning says so and does not claim G's weights stayed
    assert said[0].endswith(
        "; the parameters and the optimizer state of D are unchanged; the other optimizers' updates ran "
        "(policy='skip'). Skipped steps in a row are counted and said once when they stop"
    )


def test_warn_names_ds_optimizer_and_lets_its_update_through() -> None:
    mon, _, _, said = gan_run("warn", steps=3)
    assert said == [f"torchdebug: {D_SUMMARY} (policy='warn': training goes on)"]
    assert not all(torch.isfinite(p).all() for p in mon.roots["D"].parameters())  # warn: it ran
    assert [a.step for a in mon.anomalies] == [2]  # G's gradients through D's NaN: the same step's

"""Optimizer state as a source of non-finite values: a poisoned checkpoint's loaded state, said at once;
a NaN that a library's loss makes (every target ``ignore_index``) named at the loss with its reason."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchdebug as td
from tests.fixtures.models import origin_line

_THIS = os.path.abspath(__file__)
POLICIES = ["raise", "warn", "skip"]


@pytest.fixture(autouse=True)
def _no_hooks_left() -> Iterator[None]:
    yield
    assert torch._C._len_torch_function_stack() == 0


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)


def _checkpoint(poison: bool) -> dict[str, Any]:
    """A checkpoint after one AdamW step; ``poison``: one NaN in fc1.weight's ``exp_avg`` (state 0)."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = _data()
    F.mse_loss(model(x), y).backward()
    opt.step()
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    if poison:
        ckpt["optimizer"]["state"][0]["exp_avg"][0, 0] = float("nan")  # param 0 is fc1.weight
    return ckpt


def _train(model: nn.Module, opt: torch.optim.Optimizer, mon: Any, steps: int) -> int:
    x, y = _data()
    done = 0
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        mon.step()
        done += 1
    return done


def _resumed(ckpt: dict[str, Any]) -> tuple[MLP, torch.optim.AdamW]:
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    return model, opt


def _assert_loaded_state(a: td.Anomaly, when: str) -> None:
    assert (a.phase, a.module, a.parameter, a.kind, a.step) == ("optimizer", "fc1", "fc1.weight", "nan", 0)
    assert a.op == "loaded optimizer state 'exp_avg' (AdamW)"
    assert a.symptom == f"nan in the loaded optimizer state of fc1.weight (exp_avg) {when}"
    assert a.hint.startswith(f"the loaded optimizer state 'exp_avg' of fc1.weight holds 1 NaN / 0 Inf {when}")
    assert "the next AdamW.step writes non-finite values into fc1.weight" in a.hint


# -- a poisoned optimizer checkpoint --------------------------------------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
def test_loaded_optimizer_state_is_said_as_the_session_starts(policy: str) -> None:
    model, opt = _resumed(_checkpoint(poison=True))
    when = "when the session started"
    if policy == "raise":
        with pytest.raises(td.NonFiniteError) as ei, td.watch(model, opt, run=False, policy=policy):
            pytest.fail("the session must not start")  # pragma: no cover
        _assert_loaded_state(ei.value.anomaly, when)
        assert torch.isfinite(model.fc1.weight).all()  # said before the first update wrote the NaN
        return
    with (
        pytest.warns(td.TorchDebugWarning) as said,  # then what the NaN does in the steps that follow
        td.watch(model, opt, run=False, policy=policy) as mon,
    ):
        assert len(mon.anomalies) == 1  # said at entry, before any step
        assert torch.isfinite(model.fc1.weight).all()
        assert _train(model, opt, mon, steps=3) == 3  # the loop runs to its end
    _assert_loaded_state(mon.anomalies[0], when)
    assert str(said[0].message).startswith(
        "torchdebug: nan born in optimizer of fc1.weight: loaded optimizer state 'exp_avg' (AdamW) (step 0)"
    )


def test_optimizer_state_loaded_during_the_session_is_said_at_the_load() -> None:
    ckpt = _checkpoint(poison=True)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with td.watch(model, opt, run=False, policy="raise") as mon:
        model.load_state_dict(ckpt["model"])
        with pytest.raises(td.NonFiniteError) as ei:
            opt.load_state_dict(ckpt["optimizer"])
    _assert_loaded_state(ei.value.anomaly, "when load_state_dict put it in the optimizer")
    assert mon.anomalies == [ei.value.anomaly]
    assert not opt._optimizer_load_state_dict_post_hooks  # the hook came off with the session


def test_sane_optimizer_checkpoint_is_silent() -> None:
    model, opt = _resumed(_checkpoint(poison=False))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with td.watch(model, opt, run=False, policy="raise") as mon:
            assert _train(model, opt, mon, steps=3) == 3
            opt.load_state_dict(_checkpoint(poison=False)["optimizer"])  # a reload: still silent
    assert mon.anomalies == []


# -- a library loss's 0/0: every target ignore_index -----------------------------------------------------
class Classifier(nn.Module):
    """A Hugging Face-style head: the model computes its loss when given labels."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> tuple[Any, torch.Tensor]:
        logits = self.head(x)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits, labels, ignore_index=-100)  # ORIGIN:all-ignored
        return loss, logits


def _labels(step: int, all_ignored_at: int | None) -> torch.Tensor:
    labels = torch.tensor([0, 1, 2, 3, 4, -100])  # a padded batch: one ignored target is ordinary
    return torch.full((6,), -100) if step == all_ignored_at else labels


def _classify(policy: str, all_ignored_at: int | None, steps: int = 4) -> tuple[td.Monitor, int]:
    torch.manual_seed(0)
    model = Classifier()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(6, 4)
    done = 0
    with td.watch(model, opt, run=False, policy=policy) as mon:
        for step in range(steps):
            loss, _ = model(x, labels=_labels(step, all_ignored_at))
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.step()
            done += 1
    return mon, done


def _assert_all_ignored(a: td.Anomaly) -> None:
    # cross_entropy = log_softmax + nll_loss; nll_loss's mean is sum / (count of non-ignored targets) = 0/0
    assert (a.phase, a.module, a.op, a.kind, a.step) == ("forward", "", "aten.nll_loss_forward", "nan", 1)
    assert a.location == origin_line("all-ignored", _THIS)
    assert a.hint.startswith(
        "all 6 targets are ignore_index (-100): nll_loss with reduction='mean' divides the summed loss "
        "by the number of counted targets, 0/0 = NaN"
    )


@pytest.mark.parametrize("policy", POLICIES)
def test_all_ignored_targets_are_named_at_the_loss_with_the_reason(policy: str) -> None:
    if policy == "raise":
        with pytest.raises(td.NonFiniteError) as ei:
            _classify(policy, all_ignored_at=1)
        _assert_all_ignored(ei.value.anomaly)
        return
    with pytest.warns(td.TorchDebugWarning) as said:
        mon, done = _classify(policy, all_ignored_at=1)
    assert done == 4  # the loop runs to its end
    first = str(said[0].message)
    assert (
        first.startswith("torchdebug: ")
        and "nan born in forward of Classifier: aten.nll_loss_forward" in first
    )
    assert len(said) == (1 if policy == "warn" else 2)  # skip: the skipped step's start and its end
    _assert_all_ignored(mon.anomalies[0])
    assert len(mon.anomalies) == 1


def test_partly_ignored_targets_are_silent() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mon, done = _classify("raise", all_ignored_at=None)
    assert (done, mon.anomalies) == (4, [])


# -- a second moment that overflows: the weights freeze -------------------------------------------------
KINDS = {"single-tensor": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def _overflow(impl: str, policy: str, blow_at: int | None, steps: int = 12) -> tuple[Any, list[torch.Tensor]]:
    """AdamW (no weight decay) on MLP; at ``blow_at`` the loss is scaled by 1e30: the gradients reach
    ~1e29, exp_avg_sq = 0.001 * g**2 ~ 1e55 overflows float32 (3.4e38) to +Inf while exp_avg = 0.1 * g
    ~ 1e28 stays finite, so every later update m / (sqrt(inf) + eps) is 0."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, **KINDS[impl])
    x, y = _data()
    seen = []
    cfg = td.DebugConfig(detail_every=5)  # detail steps 0, 5, 10
    with td.watch(model, opt, run=False, policy=policy, config=cfg) as mon:
        for step in range(steps):
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            if step == blow_at:
                loss = loss * 1e30
            loss.backward()
            opt.step()
            mon.step()
            seen.append(model.fc1.weight.detach().clone())
    return mon, seen


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("impl", list(KINDS))
def test_overflowing_second_moment_is_named_once_with_what_it_does(impl: str, policy: str) -> None:
    with pytest.warns(td.TorchDebugWarning) as said:
        mon, seen = _overflow(impl, policy, blow_at=3)
    assert len(seen) == 12  # the loop runs to its end under every policy: the weights stay finite
    assert mon.anomalies == []
    events = [e for e in mon.events if e.kind == "optimizer_state_nonfinite"]
    assert len(events) == 1  # one episode: steps 5 and 10 both see it, said once
    e = events[0]
    assert (e.step, e.modules) == (5, ("fc1",))  # the first detail step after step 3
    assert e.message == (
        "finite at step 0, the previous check; the optimizer state 'exp_avg_sq' of fc1.weight holds "
        "32 +Inf (AdamW) while its weights are finite: the update of fc1.weight is 0 from here: its "
        "weights are frozen; also fc1.bias (exp_avg_sq), fc2.weight (exp_avg_sq), fc2.bias (exp_avg_sq). "
        "A gradient overflowed the moment: lower the learning rate, clip the gradients, or scale the loss down"
    )
    assert dict(e.evidence) == {
        "parameter": "fc1.weight",
        "state": "exp_avg_sq",
        "nan": 0,
        "posinf": 32,
        "neginf": 0,
    }
    assert all(torch.equal(w, seen[4]) for w in seen[4:])  # frozen indeed, from step 4 on
    assert sum("optimizer_state_nonfinite" in str(w.message) for w in said) == 1


@pytest.mark.parametrize("impl", list(KINDS))
def test_sane_learning_twin_is_silent(impl: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mon, seen = _overflow(impl, "raise", blow_at=None)
    assert [e.kind for e in mon.events if e.kind == "optimizer_state_nonfinite"] == []
    assert not torch.equal(seen[-1], seen[4])  # it learns

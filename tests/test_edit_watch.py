"""The edit check's watch: between backward() and the update the session watches the torch calls for one
that may write to a gradient, instead of reading every gradient's version after backward() and again as
the update starts. A plain loop (``loss.backward(); opt.step()``) then reads no version at all, and an
edit is still named where it happened, also one the versions never saw (a write through ``.data``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
from torch import nn

import torchdebug as td
from tests.fixtures import models as fx
from tests.fixtures.stack_models import GatedSqrt
from torchdebug._step import SeenGrads
from torchdebug.nonfinite import edits
from torchdebug.session import transfer

SENTINEL_ONLY = td.DebugConfig(mode="anomaly_detection")
NAN = float("nan")


def _counting(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count the passes the versions' path makes: the versions read after backward() and the gradients
    compared again as the update starts."""
    calls = {"versions": 0, "compared": 0}
    real_versions, real_unchanged = transfer.versions_of, SeenGrads.unchanged

    def versions_of(tensors: list) -> list[int] | None:
        calls["versions"] += 1
        return real_versions(tensors)

    def unchanged(self: SeenGrads, grads: list) -> bool:
        calls["compared"] += 1
        return real_unchanged(self, grads)

    monkeypatch.setattr(transfer, "versions_of", versions_of)
    monkeypatch.setattr(SeenGrads, "unchanged", unchanged)
    return calls


def _plain_steps(n: int, edit: Callable[[nn.Module, int], None] = lambda m, i: None) -> td.Monitor:
    torch.manual_seed(0)
    model = fx.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with td.watch(model, opt, run=False, config=SENTINEL_ONLY) as mon:
        for i in range(n):
            opt.zero_grad()
            model(torch.randn(4, 8)).pow(2).mean().backward()
            edit(model, i)
            opt.step()
            mon.step()
    return mon


@pytest.mark.parametrize("watched", [True, False])
def test_a_plain_loop_reads_no_version_between_backward_and_the_update(
    monkeypatch: pytest.MonkeyPatch, watched: bool
) -> None:
    calls = _counting(monkeypatch)
    if not watched:  # the versions' path (several processes, several models...)
        monkeypatch.setattr(edits.EditCheck, "watches_edits", lambda self: False)
    mon = _plain_steps(5)
    assert mon.anomalies == []
    # watched: nothing read between backward() and the update; else once after each backward and once
    # as each update starts
    assert calls == ({"versions": 0, "compared": 0} if watched else {"versions": 5, "compared": 5})


def _edit_in_place(model: nn.Module, i: int) -> None:
    if i == 3:
        model.fc1.weight.grad.mul_(NAN)  # type: ignore[union-attr]


def _edit_by_replacing(model: nn.Module, i: int) -> None:
    if i == 3:
        model.fc1.weight.grad = model.fc1.weight.grad * NAN  # type: ignore[operator]


def _edit_through_data(model: nn.Module, i: int) -> None:
    if i == 3:  # .data has its own version counter: the gradient's version does not move
        model.fc1.weight.grad.data.mul_(NAN)  # type: ignore[union-attr]


def _edit_an_item(model: nn.Module, i: int) -> None:
    if i == 3:
        model.fc1.weight.grad[0, 0] = NAN  # type: ignore[index]


@pytest.mark.parametrize("edit", [_edit_in_place, _edit_by_replacing, _edit_through_data, _edit_an_item])
def test_an_edit_between_backward_and_the_update_is_named_under_the_watch(
    edit: Callable[[nn.Module, int], None],
) -> None:
    with pytest.raises(td.NonFiniteError) as ei:
        _plain_steps(5, edit)
    a = ei.value.anomaly
    assert (a.step, a.phase, a.parameter, a.module, a.kind) == (
        3,
        "gradient_edit",
        "fc1.weight",
        "fc1",
        "nan",
    )


def test_a_backward_nan_stays_backwards_when_code_wrote_to_the_gradients_after_it() -> None:
    # clip_grad_value_ writes every gradient in place (the watch counts them all as edited, and probes
    # them all as the update starts); the NaN came from backward() and is named there
    torch.manual_seed(0)
    model = GatedSqrt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(td.NonFiniteError) as ei, td.watch(model, opt, run=False, config=SENTINEL_ONLY) as mon:
        for i in range(5):
            model.gate = 0.0 if i == 3 else 1.0
            opt.zero_grad()
            model(torch.randn(3, 4)).sum().backward()
            torch.nn.utils.clip_grad_value_(model.parameters(), 10.0)
            opt.step()
            mon.step()
    a = ei.value.anomaly
    assert (a.step, a.phase, a.op) == (3, "backward", "SqrtBackward0")


def test_a_loop_busy_between_backward_and_the_update_goes_back_to_the_versions() -> None:
    # 16 parameter tensors, each gradient's norm read before the update: 48 torch calls through the
    # watch at ~2 us each, more than the versions' two passes cost: the watch is not opened again, and
    # an edit is still named
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(8)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watched = []
    with pytest.raises(td.NonFiniteError) as ei, td.watch(model, opt, run=False, config=SENTINEL_ONLY) as mon:
        for i in range(4):
            opt.zero_grad()
            model(torch.randn(2, 4)).pow(2).mean().backward()
            watched.append(mon.state.seen.watched)
            norms = [p.grad.norm() for p in model.parameters()]  # type: ignore[union-attr]
            assert len(norms) == 16
            if i == 2:
                model[5].bias.grad.add_(NAN)  # type: ignore[union-attr]
            opt.step()
            mon.step()
    assert watched == [True, False, False]
    assert mon.sentinel.watch_off
    a = ei.value.anomaly
    assert (a.step, a.phase, a.parameter) == (2, "gradient_edit", "5.bias")


def test_an_error_between_backward_and_the_update_leaves_no_mode_behind() -> None:
    model = fx.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        pytest.raises(RuntimeError, match="user code"),
        td.watch(model, opt, run=False, config=SENTINEL_ONLY),
    ):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        assert torch._C._len_torch_function_stack() == 1  # the watch
        raise RuntimeError("user code")
    assert torch._C._len_torch_function_stack() == 0


def _weights_after(watched: bool, opt_cls: type, step: Callable[[nn.Module, torch.optim.Optimizer], None]):
    """Four steps of an MLP, ``step(model, opt)`` each (its backward and update), under the sentinel or
    not: the weights at the end. Nothing is left on the torch-function mode stack after each update."""
    torch.manual_seed(0)
    model = fx.MLP()
    opt = opt_cls(model.parameters(), lr=0.01)
    with (
        td.watch(model, opt, run=False, config=SENTINEL_ONLY) if watched else contextlib.nullcontext() as mon
    ):
        for _ in range(4):
            opt.zero_grad()
            step(model, opt)
            assert torch._C._len_torch_function_stack() == 0
            if mon is not None:
                mon.step()
        assert mon is None or mon.anomalies == []
    return [p.detach().clone() for p in model.parameters()]


def test_a_users_mode_around_the_update_trains_as_without_the_session() -> None:
    # torch.device(...) as a context is a torch-function mode: entered after backward() it sits above the
    # watch as the update starts; the watch is taken out from under it, and training is bit for bit the
    # same as without the session
    def step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        model(torch.randn(4, 8)).pow(2).mean().backward()
        with torch.device("cpu"):
            opt.step()

    a, b = (_weights_after(w, torch.optim.AdamW, step) for w in (True, False))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_running_total_kept_between_backward_and_the_update_reaches_no_gradient(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the HF Trainer's ``tr_loss += tr_loss_step`` between backward() and the update: an in-place write,
    # to a tensor sharing its memory with nothing: no gradient is probed, nothing is read
    calls = _counting(monkeypatch)
    running = torch.zeros(())
    probed: list[list[int]] = []

    def accumulate(model: nn.Module, i: int) -> None:
        running.add_(1.0)

    class Spy:
        name = "spy"

        def before_optimizer_step(self, mon: td.Monitor) -> None:
            probed.append(list(mon.state.edit_index))

    torch.manual_seed(0)
    model = fx.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with td.watch(model, opt, run=False, config=SENTINEL_ONLY) as mon:
        mon.instruments.append(Spy())
        for i in range(4):
            opt.zero_grad()
            model(torch.randn(4, 8)).pow(2).mean().backward()
            accumulate(model, i)
            opt.step()
            mon.step()
    assert float(running) == 4.0
    assert probed == [[], [], [], []]
    assert calls == {"versions": 0, "compared": 0}
    assert not mon.sentinel.watch_off


def test_writes_the_watch_cannot_follow_update_after_update_go_back_to_the_versions() -> None:
    # a write through ``.data`` every step (an alias: the watch cannot tell which gradient it reached, so
    # every gradient is probed as the update starts); after three such updates the versions are cheaper
    watched: list[bool] = []

    def rescale(model: nn.Module, i: int) -> None:
        watched.append(model_state["mon"].state.seen.watched)
        model.fc1.weight.grad.data.mul_(1.0)  # type: ignore[union-attr]

    model_state: dict[str, td.Monitor] = {}
    torch.manual_seed(0)
    model = fx.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with td.watch(model, opt, run=False, config=SENTINEL_ONLY) as mon:
        model_state["mon"] = mon
        for i in range(5):
            opt.zero_grad()
            model(torch.randn(4, 8)).pow(2).mean().backward()
            rescale(model, i)
            opt.step()
            mon.step()
    assert watched == [True, True, True, False, False]
    assert mon.anomalies == []


def test_a_second_backward_between_the_first_and_the_update_trains_as_without_the_session() -> None:
    # the second backward() closes the first one's watch (the gradients count as edited) and opens its
    # own; nothing is left on the mode stack, and the weights end bit for bit where they end without
    # the session
    def step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        out = model(torch.randn(4, 8))
        out.pow(2).mean().backward(retain_graph=True)
        out.abs().mean().backward()
        opt.step()

    a, b = (_weights_after(w, torch.optim.SGD, step) for w in (True, False))
    assert all(torch.equal(x, y) for x, y in zip(a, b))

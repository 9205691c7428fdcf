"""Never break a healthy run: every level x unusual models trains bitwise as without torchdebug (issue 13)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import torchdebug as td

LEVELS = ("basic", "intermediate", "advanced", "expert")
STEPS = 3


@pytest.fixture(autouse=True)
def _assert_global_state_restored() -> Iterator[None]:
    from torch.optim import optimizer as optim_mod

    before = (torch.Tensor.backward, torch.autograd.backward)
    yield
    assert (torch.Tensor.backward, torch.autograd.backward) == before, "a global patch was left behind"
    assert not optim_mod._global_optimizer_pre_hooks and not optim_mod._global_optimizer_post_hooks
    assert torch._C._len_torch_function_stack() == 0


class _Plain:
    """The reference: the same loop without torchdebug."""

    def __enter__(self) -> _Plain:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def step(self) -> None:
        return None


Session = Callable[[nn.Module, "torch.optim.Optimizer | None"], Any]


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _data(n: int = STEPS * 2, shape: tuple[int, ...] = (3, 4)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(*shape, generator=g) for _ in range(n)]


def _state(model: nn.Module, *extra: torch.Tensor) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()] + [t.detach().clone() for t in extra]


# -- the models and their loops: each returns what must come out bitwise equal -----------------------
def no_parameters(session: Session) -> list[torch.Tensor]:
    model = nn.Sequential(nn.Tanh(), nn.ReLU())
    grads = []
    with session(model, None) as mon:
        for x in _data(STEPS):
            x.requires_grad_(True)
            model(x).pow(2).sum().backward()
            grads.append(x.grad)
            mon.step()
    return grads


def frozen_only(session: Session) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = _mlp().requires_grad_(False)
    grads = []
    with session(model, None) as mon:
        for x in _data(STEPS):
            x.requires_grad_(True)
            model(x).pow(2).sum().backward()
            grads.append(x.grad)
            mon.step()
    return grads + _state(model)


def meta_device(session: Session) -> list[torch.Tensor]:
    model = nn.Linear(4, 2, device="meta")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with session(model, opt) as mon:
        for _ in range(STEPS):
            opt.zero_grad()
            model(torch.randn(3, 4, device="meta")).pow(2).mean().backward()
            opt.step()
            mon.step()
    return []  # meta tensors hold no values: the run only has to complete


def sparse_adam(session: Session) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SparseAdam(list(model.parameters()), lr=0.01)
    g = torch.Generator().manual_seed(1)
    with session(model, opt) as mon:
        for _ in range(STEPS):
            idx = torch.randint(0, 10, (5,), generator=g)
            opt.zero_grad()
            model(idx).pow(2).mean().backward()
            opt.step()
            mon.step()
    return _state(model)


def complex_params(session: Session) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2, dtype=torch.cfloat)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with session(model, opt) as mon:
        for x in _data(STEPS):
            opt.zero_grad()
            model(x.to(torch.cfloat)).abs().pow(2).mean().backward()
            opt.step()
            mon.step()
    return _state(model)


def gradient_penalty(session: Session) -> list[torch.Tensor]:
    """WGAN-GP: the gradient of the critic's output w.r.t. its (leaf) input, create_graph=True."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with session(model, opt) as mon:
        for x in _data(STEPS):
            x.requires_grad_(True)
            out = model(x)
            (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
            loss = out.mean() + (g.norm(2, dim=1) - 1).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step()
    return _state(model)


def double_backward(session: Session) -> list[torch.Tensor]:
    """A penalty on the parameters' own gradient norm: backward through a backward."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with session(model, opt) as mon:
        for x in _data(STEPS):
            loss = model(x).pow(2).mean()
            grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
            opt.zero_grad()
            (loss + sum(g.pow(2).sum() for g in grads)).backward()
            opt.step()
            mon.step()
    return _state(model)


def two_optimizers(session: Session) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = _mlp()
    opt_a = torch.optim.SGD(model[0].parameters(), lr=0.01)
    opt_b = torch.optim.Adam(model[2].parameters(), lr=0.001)
    with session(model, None) as mon:
        for x in _data(STEPS):
            opt_a.zero_grad()
            opt_b.zero_grad()
            model(x).pow(2).mean().backward()
            opt_a.step()
            opt_b.step()
            mon.step()
    return _state(model)


def gradient_accumulation(session: Session) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = _data(STEPS * 2)
    with session(model, opt) as mon:
        for i in range(STEPS):
            opt.zero_grad()
            for x in data[2 * i : 2 * i + 2]:
                (model(x).pow(2).mean() / 2).backward()
            opt.step()
            mon.step()
    return _state(model)


def called_twice(session: Session) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = _data(STEPS * 2)
    with session(model, opt) as mon:
        for i in range(STEPS):
            opt.zero_grad()
            (model(data[2 * i]) - model(data[2 * i + 1])).pow(2).mean().backward()
            opt.step()
            mon.step()
    return _state(model)


class _Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.block = _mlp()
        self.head = nn.Linear(2, 1)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.block, x, use_reentrant=self.reentrant))


def _checkpointed(session: Session, reentrant: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = _Checkpointed(reentrant)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with session(model, opt) as mon:
        for x in _data(STEPS):
            opt.zero_grad()
            # reentrant checkpointing needs an input that requires grad to build the graph
            model(x.requires_grad_(reentrant)).pow(2).mean().backward()
            opt.step()
            mon.step()
    return _state(model)


def checkpointed(session: Session) -> list[torch.Tensor]:
    return _checkpointed(session, reentrant=False)


def checkpointed_reentrant(session: Session) -> list[torch.Tensor]:
    return _checkpointed(session, reentrant=True)


MODELS: dict[str, Callable[[Session], list[torch.Tensor]]] = {
    f.__name__: f
    for f in (
        no_parameters,
        frozen_only,
        meta_device,
        sparse_adam,
        complex_params,
        gradient_penalty,
        double_backward,
        two_optimizers,
        gradient_accumulation,
        called_twice,
        checkpointed,
        checkpointed_reentrant,
    )
}

META_OFF = "tensors on the meta device hold no values"

# The warnings each row must give, exactly: (level, model) -> message fragments, one warning each.
# An instrument that cannot handle a model turns itself off once and says why; nothing else warns.
EXPECTED_WARNINGS: dict[tuple[str, str], list[str]] = {
    ("basic", "meta_device"): [META_OFF],
    ("intermediate", "meta_device"): [META_OFF, "instrument 'gradients' failed and was switched off"],
    ("advanced", "meta_device"): [META_OFF, "instrument 'gradients' failed and was switched off"],
    ("expert", "meta_device"): [META_OFF, "instrument 'gradients' failed and was switched off"],
}


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("level", LEVELS)
def test_trains_as_without_torchdebug(level: str, model: str, tmp_path: Path) -> None:
    train = MODELS[model]
    reference = train(lambda m, opt: _Plain())

    def session(m: nn.Module, opt: torch.optim.Optimizer | None) -> td.Monitor:
        return td.watch(m, opt, run=tmp_path, config={"level": level})

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watched = train(session)
    messages = [str(w.message) for w in caught]
    assert all(issubclass(w.category, td.TorchDebugWarning) for w in caught), messages
    expected = EXPECTED_WARNINGS.get((level, model), [])
    assert len(messages) == len(expected), messages
    for fragment in expected:
        assert sum(fragment in m for m in messages) == 1, (fragment, messages)
    assert len(watched) == len(reference)
    for a, b in zip(watched, reference, strict=True):
        assert torch.equal(a, b)


# -- the probes of issue 13, items 1 and 2, one by one ------------------------------------------------
@pytest.mark.parametrize("frozen", [False, True], ids=["no_parameters", "frozen_only"])
def test_no_trainable_parameters_step(frozen: bool) -> None:
    # was: IndexError in _finite_probe at mon.step()
    model = nn.Linear(2, 2).requires_grad_(False) if frozen else nn.ReLU()
    x = torch.ones(1, 2, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with td.watch(model, run=False) as mon:
            loss = model(x).sum()
            loss.backward()
            record = mon.step()
    assert mon.global_step == 1 and record.grad_norm is None and record.anomaly is None
    assert record.loss == loss.item()  # still read: relu(1) + relu(1) = 2.0 without parameters
    assert frozen or record.loss == 2.0
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_meta_device_step_warns_once() -> None:
    # was: NotImplementedError: Cannot copy out of meta tensor
    model = nn.Linear(2, 2, device="meta")
    with pytest.warns(td.TorchDebugWarning, match=META_OFF) as caught, td.watch(model, run=False) as mon:
        for _ in range(2):
            model(torch.ones(1, 2, device="meta")).sum().backward()
            mon.step()
    assert mon.global_step == 2 and len(caught) == 1


def test_module_time_with_autograd_grad_penalty() -> None:
    # was: RuntimeError: A leaf node was passed to _will_engine_execute_node (level expert)
    from torchdebug.perf.timing import ModuleTimer

    torch.manual_seed(0)
    model = _mlp()
    x = torch.randn(3, 4, requires_grad=True)
    with ModuleTimer(model) as timer:
        out = model(x)
        (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        (out.mean() + g.pow(2).sum()).backward()
    times = timer.collect()
    # every module ran forward once; the backward of .backward() is still timed per module
    assert sorted(times) == ["", "0", "1", "2"]
    assert all(times[n][2] == 1 and times[n][1] is not None and times[n][1] >= 0 for n in times)


def test_a_nan_in_a_complex_gradient_is_caught(tmp_path) -> None:
    # complex parameters: the CPU probe sums real and imaginary parts (it used to skip complex tensors)
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(3, dtype=torch.complex64))
    holder = nn.Module()
    holder.w = w
    opt = torch.optim.SGD([w], lr=0.1)
    with (
        pytest.raises(td.NonFiniteError) as ei,
        td.watch(holder, opt, run=False, config={"mode": "anomaly_detection"}) as mon,
    ):
        for step in range(3):
            opt.zero_grad()
            z = w * (float("nan") if step == 1 else 1.0)
            z.abs().sum().backward()
            opt.step()
            mon.step()
    a = ei.value.anomaly
    assert (a.step, a.parameter) == (1, "w")
    assert torch.isfinite(torch.view_as_real(w.detach())).all()  # the update never ran on the NaN

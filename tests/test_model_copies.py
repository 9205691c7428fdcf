"""Checkpoints, EMA and copies of a watched model behave exactly as without watch.

``torch.save(model)``, ``copy.deepcopy(model)``, ``AveragedModel(model)`` and ``model.state_dict()``
inside ``watch``: nothing torchdebug attached travels with the copy and nothing fires into the session.
"""

from __future__ import annotations

import contextlib
import copy
import io
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

import torchdebug as td
from tests.fixtures import models as fx

LEVELS = ["intermediate", "expert"]  # the default level, and the one with every module hook


def _hooks(model: nn.Module) -> int:
    return sum(
        len(m._forward_pre_hooks)
        + len(m._forward_hooks)
        + len(m._backward_hooks)
        + len(m._backward_pre_hooks)
        for m in model.modules()
    )


@pytest.fixture(autouse=True)
def _no_warnings() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def _session(tmp_path: Path, level: str, body: object) -> tuple[nn.Module, td.Monitor, object]:
    torch.manual_seed(0)
    model = fx.TinyGPT()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    getstate = nn.Module.__getstate__
    with td.watch(model, opt, run=tmp_path, config=td.DebugConfig(level=level)) as mon:
        for _ in range(2):
            idx = torch.randint(0, 16, (2, 6))
            loss = nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step()
        assert _hooks(model) > 0  # the session's hooks are on the model
        out = body(model, mon)  # type: ignore[operator]
    assert nn.Module.__getstate__ is getstate and _hooks(model) == 0  # restored on exit
    return model, mon, out


@pytest.mark.parametrize("level", LEVELS)
def test_torch_save_of_a_watched_model_loads_without_hooks(tmp_path: Path, level: str) -> None:
    def body(model: nn.Module, mon: td.Monitor) -> nn.Module:
        buf = io.BytesIO()
        torch.save(model, buf)  # used to raise: cannot pickle 'sqlite3.Connection'
        buf.seek(0)
        return torch.load(buf, weights_only=False)

    model, _, loaded = _session(tmp_path, level, body)
    assert isinstance(loaded, fx.TinyGPT) and _hooks(loaded) == 0
    idx = torch.randint(0, 16, (2, 6))
    assert torch.equal(loaded(idx), model(idx))


@pytest.mark.parametrize("level", LEVELS)
def test_deepcopy_of_a_watched_model_has_no_hooks_and_does_not_fire_into_the_session(
    tmp_path: Path, level: str
) -> None:
    def body(model: nn.Module, mon: td.Monitor) -> nn.Module:
        clone = copy.deepcopy(model)
        captures, micro = len(mon.sentinel.captures), mon.micro_step
        with torch.no_grad():
            clone(torch.randint(0, 16, (2, 6)))
        clone(torch.randint(0, 16, (2, 6)))  # with grad: the session's root hook would capture it
        assert (len(mon.sentinel.captures), mon.micro_step) == (captures, micro)
        return clone

    model, _, clone = _session(tmp_path, level, body)
    assert _hooks(clone) == 0
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), clone.state_dict().values()))


def test_averaged_model_under_watch_equals_the_one_without(tmp_path: Path) -> None:
    def run(watched: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = fx.MLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with td.watch(model, opt, run=tmp_path) if watched else contextlib.nullcontext() as mon:
            ema = AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
            assert _hooks(ema) == 0
            for _ in range(3):
                loss = model(torch.randn(4, 8)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                ema.update_parameters(model)
                if mon is not None:
                    mon.step()
            ema(torch.randn(2, 8))
        return {k: v.clone() for k, v in ema.state_dict().items()}

    a, b = run(True), run(False)
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("level", LEVELS)
def test_state_dict_of_a_watched_model_is_identical(tmp_path: Path, level: str) -> None:
    def body(model: nn.Module, mon: td.Monitor) -> dict:
        sd = model.state_dict()
        model.load_state_dict(sd)
        return {k: v.clone() for k, v in sd.items()}

    model, _, sd = _session(tmp_path, level, body)
    assert list(sd) == list(fx.TinyGPT().state_dict())
    assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items())

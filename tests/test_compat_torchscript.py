"""Seed 004's TorchScript path: a ``torch.jit.script`` model inside ``debug_context`` blocks.

Traced blocks (the seed's ``DebugMode.FULL_DEBUG``) stop a NaN batch before the update; torch takes
no hooks on a ScriptModule, so an untraced block says once that it is unguarded instead of failing
the user's forward.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import torchdebug as td
import torchdebug.compat._guard as guard
from torchdebug import DebugMode, PyTorchDebugger


def _scripted() -> torch.jit.ScriptModule:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.script is deprecated in torch
        return torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)))


def _batches() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    data, target = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
    bad = data.clone()
    bad[0, 0] = math.nan
    return data, target, bad


def test_traced_blocks_stop_a_nan_batch_on_a_scripted_model() -> None:
    model = _scripted()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    criterion = nn.MSELoss()
    data, target, bad = _batches()
    debugger = PyTorchDebugger(debug_mode=DebugMode.FULL_DEBUG)
    with debugger.debug_context("training_operation"):  # seed 004, "Anomaly Detection"
        optimizer.zero_grad()
        output = model(data)
        loss = criterion(output, target)
        loss.backward()
        optimizer.step()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(td.NonFiniteError) as err, debugger.debug_context("training_operation"):
        optimizer.zero_grad()
        output = model(bad)
        loss = criterion(output, target)
        loss.backward()
        optimizer.step()
    assert err.value.anomaly.phase == "input"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert [i.anomaly_detected for i in debugger.debug_history] == [False, True]


def test_an_untraced_block_says_once_that_it_is_unguarded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(guard, "_WARNED", set())
    model = _scripted()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data, target, _ = _batches()
    debugger = PyTorchDebugger()
    warned = pytest.warns(td.TorchDebugWarning, match="RecursiveScriptModule is a TorchScript module")
    with warned, debugger.debug_context("training_step"):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(data), target).backward()
        optimizer.step()
    with debugger.debug_context("training_step"):  # no second warning (warnings are errors here)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(data), target).backward()
        optimizer.step()
    assert [i.error for i in debugger.debug_history] == [None, None]


def test_watch_refuses_a_scripted_model_naming_the_fix() -> None:
    model = _scripted()
    with pytest.raises(td.ConfigError) as err:
        td.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), run=False)
    text = str(err.value)
    assert "the model is a TorchScript module (RecursiveScriptModule" in text
    assert "Watch the eager module instead: train the nn.Module under td.watch(model)" in text
    assert "torch.compile(model)" in text and "DebugMode.FULL_DEBUG" in text


def test_watch_refuses_a_traced_model_among_several() -> None:
    torch.manual_seed(0)
    eager = nn.Linear(4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.trace is deprecated in torch
        traced = torch.jit.trace(nn.Linear(4, 1), torch.randn(2, 4))
    with pytest.raises(td.ConfigError, match=r"model 'head' is a TorchScript module \(TopLevelTracedModule"):
        td.watch({"body": eager, "head": traced}, run=False)
    assert not eager._forward_hooks and not eager._forward_pre_hooks  # nothing was installed


def test_the_fix_works_watch_the_eager_model_then_script_it() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data, target, bad = _batches()
    with (
        pytest.warns(td.TorchDebugWarning, match="skipped by policy"),
        td.watch(model, optimizer, run=False, policy="skip") as mon,
    ):
        for x in (data, bad, data):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), target).backward()
            optimizer.step()
            mon.step()
    assert [(a.step, a.phase) for a in mon.anomalies] == [(1, "input")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.script is deprecated in torch
        scripted = torch.jit.script(model)
    assert all(a is b for a, b in zip(model.parameters(), scripted.parameters()))  # the trained weights
    assert torch.equal(scripted(data), model(data))

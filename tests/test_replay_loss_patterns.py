"""The sentinel's replay rebuilds what the step's loss code used from the captured inputs, on the loss
code public training code writes:

- SimCLR (``z1 = model(x1); z2 = model(x2); loss = nt_xent(z1, z2)``): the model is called twice in
  the micro-step; both calls are replayed (the second from its own input), so a NaN born in the second
  view's forward is named there;
- an output used with a view of itself (``z @ z.T``, a Gram/orthogonality term): the view is taken of
  the replayed output;
- a model returning a ``torch.distributions`` object (``dist = model(x); -dist.log_prob(y)``).

Each runs under ``warn`` and ``skip`` to the end of its loop, bit for bit as without torchdebug; a
healthy twin is silent. Where the loss code was not recorded, the anomaly says why (never "trace_loss
off" when it was on).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchdebug as td
from tests.fixtures import gan_script
from tests.fixtures.gan_script import Fault
from tests.fixtures.models import origin_line
from tests.fixtures.policy_loops import run_loop

THIS = __file__
STEPS, BAD = 4, 2
LOG_LINE = origin_line("log_power", THIS)
BACKWARD_LINE = origin_line("fault_backward", gan_script.__file__)  # sqrt at exact zeros: an Inf gradient


class LogSpecEncoder(nn.Module):
    """Power spectra (B, 6) -> embeddings (B, 4): log-compressed (COLA-style audio SimCLR), then an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.proj = nn.Linear(8, 4)

    def forward(self, spec: torch.Tensor) -> torch.Tensor:
        h = torch.log(spec + 1e-6)  # ORIGIN:log_power
        return self.proj(torch.relu(self.fc(h)))


def nt_xent(z1: torch.Tensor, z2: torch.Tensor, temperature: float = 0.5) -> torch.Tensor:
    """SimCLR's loss: each view's positive is the other view of the same sample."""
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    sim = z @ z.T / temperature
    n = z1.shape[0]
    sim = sim.masked_fill(torch.eye(2 * n, dtype=torch.bool), float("-inf"))
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)])
    return F.cross_entropy(sim, targets)


class Embedder(nn.Module):
    """x (B, 6) -> z (B, 4); its activation is ``act``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.act = Fault()
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.fc(x)))


class GaussianHead(nn.Module):
    """Heteroscedastic regression: x (B, 6) -> Normal(mu, sigma) over y (B,)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.act = Fault()
        self.mu = nn.Linear(8, 1)
        self.log_sigma = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.distributions.Normal:
        h = self.act(self.fc(x))
        return torch.distributions.Normal(self.mu(h).squeeze(-1), self.log_sigma(h).squeeze(-1).exp())


# -- the loops: (model, optimizer, per-step loss); ``fault`` False: the healthy twin -------------------
def simclr(fault: bool, bad: int) -> tuple[nn.Module, Callable[[int, torch.Generator], torch.Tensor]]:
    model = LogSpecEncoder()

    def loss(step: int, g: torch.Generator) -> torch.Tensor:
        spec = torch.rand(8, 6, generator=g)  # powers: >= 0
        x1 = spec * (0.5 + torch.rand(8, 1, generator=g))  # random gain
        x2 = spec * (0.5 + torch.rand(8, 1, generator=g))
        if fault and step == bad:
            x2[5, 2] = -0.5  # a mixing bug: one bin of one sample's second view below zero
        z1 = model(x1)
        z2 = model(x2)
        return nt_xent(z1, z2)

    return model, loss


def gram(fault: bool, bad: int) -> tuple[nn.Module, Callable[[int, torch.Generator], torch.Tensor]]:
    model = Embedder()

    def loss(step: int, g: torch.Generator) -> torch.Tensor:
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 4, generator=g)
        model.act.mode = "backward" if fault and step == bad else ""
        z = model(x)
        ortho = (z @ z.T - torch.eye(8)).pow(2).mean()  # decorrelate the batch's embeddings
        return F.mse_loss(z, y) + 0.1 * ortho

    return model, loss


def gaussian(fault: bool, bad: int) -> tuple[nn.Module, Callable[[int, torch.Generator], torch.Tensor]]:
    model = GaussianHead()

    def loss(step: int, g: torch.Generator) -> torch.Tensor:
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, generator=g)
        model.act.mode = "backward" if fault and step == bad else ""
        dist = model(x)
        return -dist.log_prob(y).mean()

    return model, loss


LOOPS = {"simclr": simclr, "gram": gram, "distribution": gaussian}


def _run(
    name: str, policy: str | None, *, fault: bool = True, skipping: bool = False, **watch: Any
) -> tuple[td.Monitor | None, list[float], list[torch.Tensor]]:
    """The loop under ``policy`` (None: without torchdebug; ``skipping``: it drops a non-finite step's
    gradients, as ``skip`` does). Under ``warn`` the distribution's fault is at the last step: the NaN
    its update lets into the weights makes ``Normal`` raise in the next forward, also without
    torchdebug."""
    torch.manual_seed(0)
    bad = STEPS - 1 if name == "distribution" and policy in ("warn", None) and not skipping else BAD
    model, step_loss = LOOPS[name](fault, bad)
    return run_loop(model, step_loss, policy, steps=STEPS, lr=1e-2, skipping=skipping, **watch)


def _bad_step(name: str, policy: str) -> int:
    return STEPS - 1 if name == "distribution" and policy == "warn" else BAD


def _is_the_origin(name: str, a: td.Anomaly, step: int) -> None:
    assert a.step == step and a.reproducible
    if name == "simclr":
        # log(-0.5 + 1e-6) in the second view's forward: one NaN, in row 5, column 2 of (8, 6)
        assert (a.phase, a.module, a.module_type, a.op) == ("forward", "", "LogSpecEncoder", "aten.log")
        assert a.location == LOG_LINE
        assert a.tensor is not None and (a.tensor.nan_count, a.tensor.numel) == (1, 48)
    else:
        # the activation's sqrt at exact zeros: an Inf gradient born in its backward
        assert (a.phase, a.module, a.op) == ("backward", "act", "SqrtBackward0")
        assert a.location == BACKWARD_LINE


@pytest.mark.parametrize("policy", ["warn", "skip"])
@pytest.mark.parametrize("name", list(LOOPS))
def test_the_replay_rebuilds_the_loss_code_and_the_loop_runs_on_as_without_torchdebug(
    name: str, policy: str
) -> None:
    _, want, want_state = _run(name, None, skipping=policy == "skip")
    with pytest.warns(td.TorchDebugWarning):
        mon, got, state = _run(name, policy)
    assert mon is not None
    _is_the_origin(name, mon.anomalies[0], _bad_step(name, policy))
    assert len(got) == STEPS and len(mon.records) == STEPS
    assert all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(got, want)), (got, want)
    for p, q in zip(state, want_state):
        torch.testing.assert_close(p, q, rtol=0, atol=0, equal_nan=True)
    if policy == "skip":  # the skipped update left the weights finite: the steps after it trained on
        assert all(map(math.isfinite, got[BAD + 1 :]))


@pytest.mark.parametrize("name", list(LOOPS))
def test_the_healthy_twin_is_silent(name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mon, losses, _ = _run(name, "raise", fault=False)
    assert mon is not None and mon.anomalies == [] and len(mon.records) == STEPS
    assert all(map(math.isfinite, losses))


def test_without_the_loss_code_the_anomaly_says_trace_loss_was_off() -> None:
    """trace_loss off: the replay feeds the gradient seen at the first call's outputs, already NaN (the
    second view's NaN reached it through the loss code): no op of the model's backward is blamed, and
    the anomaly says what the replay could not rebuild, and why."""
    cfg = td.DebugConfig(trace_loss=False)
    with pytest.warns(td.TorchDebugWarning):
        mon, _, _ = _run("simclr", "skip", config=cfg)
    assert mon is not None
    a = mon.anomalies[0]
    assert (a.phase, a.module, a.op, a.location, a.step) == ("forward", "", None, None, BAD)
    assert a.hint == (
        "the loss already held NaN in the step, made after the model's forward (by the loss code, another "
        "model or another call of this one), which the replay could not rebuild: trace_loss is off "
        "(config.trace_loss=False)"
    )


def test_with_the_loss_code_on_the_anomaly_never_says_trace_loss_off() -> None:
    with pytest.warns(td.TorchDebugWarning):
        mon, _, _ = _run("simclr", "skip")
    assert mon is not None
    assert all("trace_loss" not in a.hint for a in mon.anomalies)

"""A NaN the forward writes into a buffer is named at the step it was written, with the op and line
that wrote it, not one step late as a ``parameter``:

- a VQ-VAE codebook updated by EMA inside ``forward`` under ``no_grad`` (rosinality/vq-vae-2-pytorch's
  ``Quantize``, with its smoothing ``eps`` at 0 and the running sum starting at zero: a code no input
  picked is 0/0);
- a running statistic updated in ``forward`` (an observation normaliser as RL code writes it) from
  ``x.var(0)`` of a batch of one row (the last, short batch of an epoch): NaN.

In both the step that writes the NaN computes a finite loss and finite gradients (the forward reads the
buffer before it writes it); the next step's forward reads the NaN. Each runs under ``warn`` and
``skip`` to the end of its loop, bit for bit as without torchdebug; a healthy twin is silent.
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
from tests.fixtures.models import origin_line
from tests.fixtures.policy_loops import run_loop

THIS = __file__
STEPS = 4
DIV_LINE = origin_line("codebook_div", THIS)
VAR_LINE = origin_line("running_var", THIS)

pytestmark = pytest.mark.filterwarnings("ignore:var\\(\\)")  # the user's x.var(0) of one row warns


class Quantize(nn.Module):
    """rosinality/vq-vae-2-pytorch's EMA codebook; ``eps`` 0 and a zero running sum: an unused code is 0/0."""

    def __init__(self, dim: int, n_embed: int, decay: float = 0.99, eps: float = 0.0) -> None:
        super().__init__()
        self.dim, self.n_embed, self.decay, self.eps = dim, n_embed, decay, eps
        self.register_buffer("embed", torch.randn(dim, n_embed))
        self.register_buffer("cluster_size", torch.zeros(n_embed))
        self.register_buffer("embed_avg", torch.zeros(dim, n_embed))

    def forward(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flatten = input.reshape(-1, self.dim)
        dist = (
            flatten.pow(2).sum(1, keepdim=True)
            - 2 * flatten @ self.embed
            + self.embed.pow(2).sum(0, keepdim=True)
        )
        _, embed_ind = (-dist).max(1)
        embed_onehot = F.one_hot(embed_ind, self.n_embed).type(flatten.dtype)
        quantize = F.embedding(embed_ind, self.embed.transpose(0, 1))
        if self.training:
            with torch.no_grad():
                embed_onehot_sum = embed_onehot.sum(0)
                embed_sum = flatten.transpose(0, 1) @ embed_onehot
                self.cluster_size.data.mul_(self.decay).add_(embed_onehot_sum, alpha=1 - self.decay)
                self.embed_avg.data.mul_(self.decay).add_(embed_sum, alpha=1 - self.decay)
                n = self.cluster_size.sum()
                cluster_size = (self.cluster_size + self.eps) / (n + self.n_embed * self.eps) * n
                embed_normalized = self.embed_avg / cluster_size.unsqueeze(0)  # ORIGIN:codebook_div
                self.embed.data.copy_(embed_normalized)
        diff = (quantize.detach() - input).pow(2).mean()
        quantize = input + (quantize - input).detach()
        return quantize, diff


class VQVAE(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.enc = nn.Linear(6, 4)
        self.quantize = Quantize(4, 8, eps=eps)
        self.dec = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, diff = self.quantize(self.enc(x))
        return self.dec(q), diff


class ObsNorm(nn.Module):
    """Observations normalised by running statistics, updated in forward (after they are used)."""

    def __init__(self, dim: int, momentum: float = 0.1) -> None:
        super().__init__()
        self.momentum = momentum
        self.register_buffer("running_mean", torch.zeros(dim))
        self.register_buffer("running_var", torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = (x - self.running_mean) / torch.sqrt(self.running_var + 1e-5)
        if self.training:
            with torch.no_grad():
                m = self.momentum
                self.running_mean.mul_(1 - m).add_(m * x.mean(0))
                self.running_var.mul_(1 - m).add_(m * x.var(0))  # ORIGIN:running_var
        return out


class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = ObsNorm(6)
        self.fc = nn.Linear(6, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.fc(self.norm(x)))).squeeze(-1)


def vqvae(fault: bool) -> tuple[nn.Module, Callable[[nn.Module, int, torch.Generator], torch.Tensor], int]:
    """The fault: with eps 0, codes no input picked at step 0 are 0/0 (written at step 0)."""

    def loss(model: nn.Module, step: int, g: torch.Generator) -> torch.Tensor:
        x = torch.randn(16, 6, generator=g)
        out, diff = model(x)
        return F.mse_loss(out, x) + 0.25 * diff

    return VQVAE(eps=0.0 if fault else 1e-5), loss, 0


def critic(fault: bool) -> tuple[nn.Module, Callable[[nn.Module, int, torch.Generator], torch.Tensor], int]:
    """The fault: the last, short batch of an epoch (one row) at step 1; var of one row is NaN."""

    def loss(model: nn.Module, step: int, g: torch.Generator) -> torch.Tensor:
        rows = 1 if fault and step == 1 else 8
        obs, ret = torch.randn(rows, 6, generator=g), torch.randn(rows, generator=g)
        return F.mse_loss(model(obs), ret)

    return Critic(), loss, 1


MODELS = {"vqvae-codebook": vqvae, "running-statistic": critic}
TRUTH = {  # (module, module type, op, line, kind)
    "vqvae-codebook": ("quantize", "Quantize", "aten.div", DIV_LINE, "nan"),
    "running-statistic": ("norm", "ObsNorm", "aten.var", VAR_LINE, "nan"),
}


def _run(
    name: str, policy: str | None, *, fault: bool = True, skipping: bool = False
) -> tuple[td.Monitor | None, list[float], list[torch.Tensor], int]:
    """The loop under ``policy`` (None: without torchdebug; ``skipping``: it drops a non-finite step's
    gradients, as ``skip`` does)."""
    torch.manual_seed(0)
    model, step_loss, bad = MODELS[name](fault)
    mon, losses, state = run_loop(
        model, lambda step, g: step_loss(model, step, g), policy, steps=STEPS, lr=1e-3, skipping=skipping
    )
    return mon, losses, state, bad


def _is_the_origin(name: str, a: td.Anomaly, step: int) -> None:
    module, mtype, op, line, kind = TRUTH[name]
    assert (a.phase, a.module, a.module_type, a.op, a.kind, a.step) == (
        "forward",
        module,
        mtype,
        op,
        kind,
        step,
    )
    assert a.location == line and a.reproducible
    buffer = "quantize.embed" if name == "vqvae-codebook" else "norm.running_var"
    assert a.symptom == f"nan in {buffer} after the step"


@pytest.mark.parametrize("name", list(MODELS))
def test_a_buffer_the_forward_writes_nan_into_raises_at_that_step(name: str) -> None:
    with pytest.raises(td.NonFiniteError) as info:
        _run(name, "raise")
    bad = MODELS[name](True)[2]
    _is_the_origin(name, info.value.anomaly, bad)


@pytest.mark.parametrize("policy", ["warn", "skip"])
@pytest.mark.parametrize("name", list(MODELS))
def test_a_buffer_written_with_nan_is_named_at_its_step_and_the_loop_runs_on(name: str, policy: str) -> None:
    _, want, want_state, _ = _run(name, None, skipping=policy == "skip")
    with pytest.warns(td.TorchDebugWarning):
        mon, got, state, bad = _run(name, policy)
    assert mon is not None
    _is_the_origin(name, mon.anomalies[0], bad)
    # the steps after it read the NaN buffer: their loss is NaN, said as such, never as a new origin
    assert [a.step for a in mon.anomalies] == list(range(bad, STEPS))
    assert all(a.phase != "parameter" for a in mon.anomalies)
    assert len(got) == STEPS and len(mon.records) == STEPS
    assert all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(got, want)), (got, want)
    for p, q in zip(state, want_state):
        torch.testing.assert_close(p, q, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("name", list(MODELS))
def test_the_healthy_twin_is_silent(name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mon, losses, _, _ = _run(name, "raise", fault=False)
    assert mon is not None and mon.anomalies == [] and len(mon.records) == STEPS
    assert all(map(math.isfinite, losses))


def test_batchnorm_running_statistics_are_watched_after_the_first_step_only_if_written() -> None:
    """Which buffers are kept and probed: after the first step, those it changed (BatchNorm's running
    mean and variance; not ``num_batches_tracked``, an integer, nor a constant buffer)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    model.register_buffer("scale", torch.full((1,), 2.0))  # constant: never written
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with td.watch(model, opt, run=False) as mon:
        for _ in range(2):
            opt.zero_grad()
            (model(torch.randn(8, 4)).sum() * model.scale).backward()
            opt.step()
            mon.step()
        got: Any = mon.sentinel.buffers.names
    assert got == ["1.running_mean", "1.running_var"]

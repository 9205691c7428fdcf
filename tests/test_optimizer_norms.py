"""Several optimizers in a step (an actor-critic: two backward calls, two updates): each optimizer's
gradient norm is recorded as ``grad_norm/<model>``, the norm of the gradients it stepped with, read
with the read that precedes its update (no read of its own)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchdebug as td
from tests.fixtures.host_reads import HostReads


def _norm(model: nn.Module) -> torch.Tensor:
    # the true L2 norm of every gradient of the model, in float64 (a copy: read after the step, so
    # the host reads counted are torchdebug's only)
    return torch.stack([p.grad.double().pow(2).sum() for p in model.parameters()]).sum().sqrt()


def test_each_optimizer_records_the_norm_of_the_gradients_it_stepped_with() -> None:
    torch.manual_seed(0)
    actor = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    critic = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt_a = torch.optim.SGD(actor.parameters(), lr=0.05)
    opt_c = torch.optim.Adam(critic.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    want: list[tuple[torch.Tensor, torch.Tensor]] = []
    got: list[dict[str, float]] = []
    reads = []
    with td.watch([actor, critic], [opt_a, opt_c], run=False, config=td.DebugConfig(detail_every=100)) as mon:
        for _ in range(3):
            s = torch.randn(5, 4, generator=g)
            with HostReads() as r:
                opt_c.zero_grad()
                value = critic(s).squeeze(1)
                critic_loss = (value - 1.0).pow(2).mean()
                critic_loss.backward()
                nc = _norm(critic)  # what opt_c steps with
                opt_c.step()
                for p in critic.parameters():  # after its update: the number must stay the one it used
                    p.grad.mul_(3.0)
                opt_a.zero_grad()
                actor_loss = -(actor(s).softmax(1)[:, 0] * value.detach()).mean()
                actor_loss.backward()
                na = _norm(actor)
                opt_a.step()
                rec = mon.step()
            reads.append(r.count)
            want.append((na, nc))
            got.append({k: v for k, v in rec.values.items() if k.startswith("grad_norm/")})
        names = sorted(got[0])
        assert set(mon.step_scalars) >= set(names)  # to the run store with the step's scalars
    assert names == ["grad_norm/actor", "grad_norm/critic"]  # the models by the names watch gave them
    for (na, nc), values in zip(want, got):
        assert values["grad_norm/actor"] == pytest.approx(float(na), rel=1e-5)
        assert values["grad_norm/critic"] == pytest.approx(float(nc), rel=1e-5)
    # the reads are those before each update (one per update that follows a backward), no more:
    # step 0 is a detail step (one more at its end)
    assert reads == [3, 2, 2]


def test_one_optimizer_records_no_per_optimizer_norm() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with td.watch(model, opt, run=False) as mon:
        opt.zero_grad()
        model(torch.randn(3, 4)).pow(2).sum().backward()
        opt.step()
        rec = mon.step()
    assert not [k for k in rec.values if k.startswith("grad_norm/")]
    assert rec.grad_norm is not None

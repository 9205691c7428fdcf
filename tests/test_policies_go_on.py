"""``policy="warn"`` and ``"skip"`` go on: a fault never makes torchdebug raise out of the loop, and
every step computes bit for bit what the loop computes without torchdebug.

Three loops as public code writes them, each with a fault injected at one step:

- pytorch/examples' DCGAN order (``fake = netG(noise)`` once, D's update on ``fake.detach()``, then
  G's loss through D on the same ``fake``): G's graph holds G's BatchNorm tensors while D's update is
  checked, so a replay at D's update that wrote into them made ``errG.backward()`` raise "modified by
  an inplace operation";
- an actor-critic with an environment rollout in the loop (four vectorised environments, a critic
  with BatchNorm), with two optimizers or one optimizer over two losses;
- a distillation loop (the frozen teacher's forward under ``no_grad``, a student with BatchNorm and
  dropout).

The reference is the same loop without torchdebug; for ``skip`` it drops the gradients of an update
whose gradients are non-finite, as the policy does, so the healthy steps after the fault must match.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import torchdebug as td
from tests.fixtures import dcgan_script
from tests.fixtures.gan_script import Fault

STEPS = 5
BAD = 2  # the step with the fault


@pytest.fixture(autouse=True)
def _nothing_left_behind() -> Iterator[None]:
    from torch.optim import optimizer as optim_mod

    before = (torch.Tensor.backward, torch.autograd.backward)
    yield
    assert (torch.Tensor.backward, torch.autograd.backward) == before
    assert not optim_mod._global_optimizer_pre_hooks and not optim_mod._global_optimizer_post_hooks
    assert torch._C._len_torch_function_stack() == 0


class Loop:
    """How a loop is run: under ``policy`` with torchdebug, or (``reference``) without it, as the
    policy would leave it: for ``"skip"`` it drops, as the policy does, the gradients of an update
    whose gradients are non-finite and of every later update in that step."""

    def __init__(self, policy: str, reference: bool = False, **watch: Any) -> None:
        self.policy, self.reference, self.watch = policy, reference, watch
        self.skipping = reference and policy == "skip"
        self.mon: Any = None
        self.dropping = False  # an update of this step was dropped

    def session(self, models: Any, optimizers: Any) -> Any:
        if self.reference:
            return _NoSession()
        self.mon = td.watch(models, optimizers, policy=self.policy, run=False, **self.watch)
        return self.mon

    def update(self, opt: torch.optim.Optimizer) -> None:
        if self.skipping:
            params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
            if self.dropping or not all(bool(torch.isfinite(p.grad).all()) for p in params):
                self.dropping = True
                for p in params:
                    p.grad = None  # the optimizer leaves a parameter without a gradient alone
        opt.step()

    def step(self, mon: Any) -> None:
        mon.step()
        self.dropping = False


class _NoSession:
    def __enter__(self) -> _NoSession:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def step(self) -> None:
        return None


def _state(*models: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for m in models for t in [*m.parameters(), *m.buffers()]]


# -- the loops: each returns (per-step numbers, final parameters and buffers) ------------------------------
def dcgan(loop: Loop, fault: str) -> tuple[list[float], list[torch.Tensor]]:
    """pytorch/examples' dcgan main.py order; ``fault``: ``"label"`` (the fake batch's labels are NaN at
    step BAD) or ``"spike"`` (D's fake loss weighs 40x at step BAD + 3: a loss spike, every value
    finite)."""
    netG, netD, optG, optD, criterion = dcgan_script.models()
    seen: list[float] = []
    with loop.session([netG, netD], [optG, optD]) as mon:
        for i, real in enumerate(dcgan_script.batches(STEPS + 3 if fault == "spike" else STEPS)):
            fake_label = math.nan if fault == "label" and i == BAD else 0.0
            weight = 40.0 if fault == "spike" and i == BAD + 3 else 1.0
            netD.zero_grad()
            label = torch.full((real.size(0),), 1.0)
            errD_real = criterion(netD(real), label)
            errD_real.backward()
            fake = netG(torch.randn(real.size(0), dcgan_script.NZ, 1, 1))
            label.fill_(fake_label)
            errD_fake = criterion(netD(fake.detach()), label) * weight
            errD_fake.backward()
            loop.update(optD)
            netG.zero_grad()
            label.fill_(1.0)
            errG = criterion(netD(fake), label)
            errG.backward()
            loop.update(optG)
            loop.step(mon)
            seen += [(errD_real + errD_fake).item(), errG.item()]
    return seen, _state(netG, netD)


class VecEnv:
    """Four environments stepped at once: a state (4, 4) driven by the action (0 or 1), reward -|s_0|."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(4)
        self.a = torch.randn(4, 4, generator=g) * 0.5
        self.push = torch.randn(2, 4, generator=g)
        self.s = torch.randn(4, 4, generator=g)

    def step(self, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.s = torch.tanh(self.s @ self.a + self.push[action])
        return self.s, -self.s[:, 0].abs()


def actor_critic(loop: Loop, optimizers: int) -> tuple[list[float], list[torch.Tensor]]:
    """A2C: a rollout of 3 environment steps per update (actions sampled: RNG), returns discounted,
    then the actor's and the critic's losses: two optimizers (the actor's update first, while the
    critic's graph waits), or one over both losses. The fault: a NaN born in the critic's forward (its
    values, so the actor's advantage too). Under ``warn`` it is at the last step: the NaN an update
    lets into the actor's weights makes ``Categorical`` raise in the next rollout, also without
    torchdebug."""
    torch.manual_seed(0)
    actor = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))
    critic = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), Fault(), nn.Linear(16, 1))
    bad = STEPS - 1 if loop.policy == "warn" else BAD
    if optimizers == 2:
        opts = [torch.optim.Adam(actor.parameters(), lr=1e-2), torch.optim.Adam(critic.parameters(), lr=1e-2)]
    else:
        opts = [torch.optim.Adam([*actor.parameters(), *critic.parameters()], lr=1e-2)]
    env = VecEnv()
    seen: list[float] = []
    with loop.session([actor, critic], opts) as mon:
        for step in range(STEPS):
            critic[2].mode = "forward" if step == bad else ""
            s = env.s
            logps, values, rewards = [], [], []
            for _ in range(3):
                dist = torch.distributions.Categorical(logits=actor(s))
                action = dist.sample()
                logps.append(dist.log_prob(action))
                values.append(critic(s).squeeze(-1))
                s, r = env.step(action)
                rewards.append(r)
            ret, returns = torch.zeros(4), []
            for r in reversed(rewards):
                ret = r + 0.9 * ret
                returns.insert(0, ret)
            value, target = torch.stack(values), torch.stack(returns)
            actor_loss = -(torch.stack(logps) * (target - value).detach()).mean()
            critic_loss = (target - value).pow(2).mean()
            for opt in opts:
                opt.zero_grad()
            if optimizers == 2:
                actor_loss.backward()
                loop.update(opts[0])
                critic_loss.backward()
                loop.update(opts[1])
            else:
                (actor_loss + critic_loss).backward()
                loop.update(opts[0])
            loop.step(mon)
            seen += [actor_loss.item(), critic_loss.item()]
    return seen, [*_state(actor, critic), env.s]


def distillation(loop: Loop) -> tuple[list[float], list[torch.Tensor]]:
    """A frozen teacher (BatchNorm in eval mode) under no_grad, a student with BatchNorm and dropout."""
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    teacher.requires_grad_(False).eval()
    student = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), Fault(), nn.Dropout(0.2), nn.Linear(8, 3))
    opt = torch.optim.SGD(student.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(5)
    seen: list[float] = []
    with loop.session([teacher, student], opt) as mon:
        for step in range(STEPS):
            x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
            student[2].mode = "forward" if step == BAD else ""
            with torch.no_grad():
                soft = (teacher(x) / 2.0).softmax(-1)
            logits = student(x)
            kd = nn.functional.kl_div((logits / 2.0).log_softmax(-1), soft, reduction="batchmean") * 4.0
            loss = kd + nn.functional.cross_entropy(logits, y)
            opt.zero_grad()
            loss.backward()
            loop.update(opt)
            loop.step(mon)
            seen.append(loss.item())
    return seen, _state(teacher, student)


LOOPS: dict[str, Callable[[Loop], tuple[list[float], list[torch.Tensor]]]] = {
    "dcgan": lambda loop: dcgan(loop, "label"),
    "actor-critic-two-optimizers": lambda loop: actor_critic(loop, 2),
    "actor-critic-one-optimizer": lambda loop: actor_critic(loop, 1),
    "distillation": distillation,
}


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)


def _same_numbers(a: list[float], b: list[float]) -> None:
    assert len(a) == len(b)
    assert all((x == y) or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b)), (a, b)


@pytest.mark.parametrize("policy", ["warn", "skip"])
@pytest.mark.parametrize("name", list(LOOPS))
def test_a_fault_under_a_go_on_policy_leaves_the_loop_as_it_runs_without_torchdebug(
    name: str, policy: str
) -> None:
    run = LOOPS[name]
    want, want_state = run(Loop(policy, reference=True))
    loop = Loop(policy)
    with pytest.warns(td.TorchDebugWarning):
        got, got_state = run(loop)
    _same_numbers(got, want)
    _same(got_state, want_state)
    mon = loop.mon
    # the fault was seen at its step and replayed (the replay is what must leave no trace)
    first = mon.anomalies[0]
    assert first.step == (STEPS - 1 if name.startswith("actor") and policy == "warn" else BAD)
    assert first.reproducible
    assert len(mon.records) == STEPS
    if policy == "skip":
        # the healthy steps after the fault are finite: the comparison above covers real training
        per_step = len(got) // STEPS
        assert all(math.isfinite(x) for x in got[per_step * (BAD + 1) :])


def test_a_loss_spikes_forensics_in_the_dcgan_order_leave_the_generators_graph_alone() -> None:
    """A finite spike in D's loss at D's update: its per-row replay runs G's forward again (BatchNorm)
    while G's graph waits for ``errG.backward()``; the loop goes on bit for bit as without torchdebug."""
    want, want_state = dcgan(Loop("warn", reference=True), "spike")
    loop = Loop("warn", config=td.DebugConfig(explode_warmup=3))
    with pytest.warns(td.TorchDebugWarning):  # the spike's warnings
        got, got_state = dcgan(loop, "spike")
    _same_numbers(got, want)
    _same(got_state, want_state)
    (report,) = loop.mon.spikes
    assert report.step == BAD + 3
    assert report.evidence["rows"]["count"] == 8  # the per-row replay ran: one loss per row of the batch

"""torchdebug's global optimizer hooks see one update once, whatever the optimizer's class does."""

from __future__ import annotations

import torch
from torch import nn

from torchdebug._installs import optimizer_hooks


class NestedSGD(torch.optim.SGD):
    """An SGD subclass whose step adds to the parent's, as user code writes it."""

    def step(self, closure=None):
        return super().step(closure)


class FailingOnceSGD(torch.optim.SGD):
    """Raises inside its step (after torch's pre-hooks, before the post-hooks) the first time."""

    failed = False

    def step(self, closure=None):
        if not self.failed:
            self.failed = True
            raise RuntimeError("boom")
        return super().step(closure)


def _calls(opt, steps):
    seen: list[tuple[str, int]] = []
    handle = optimizer_hooks(
        lambda o, a, k: seen.append(("pre", id(o))), lambda o, a, k: seen.append(("post", id(o)))
    )
    try:
        for _ in range(steps):
            try:
                opt.step()
            except RuntimeError:
                seen.append(("raised", id(opt)))
    finally:
        handle.remove()
    return seen


def test_a_subclass_calling_super_step_is_one_update_when_the_parent_is_hooked_too():
    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)  # torch hooks SGD.step on its first instance
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    opt = NestedSGD([p], lr=0.5)
    assert _calls(opt, 3) == [("pre", id(opt)), ("post", id(opt))] * 3
    assert torch.equal(p.detach(), torch.tensor([-0.5, -0.5]))  # 1 - 3 * 0.5: three updates, no more


def test_a_step_that_raised_does_not_hide_the_next_ones():
    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    opt = FailingOnceSGD([p], lr=0.5)
    key = id(opt)
    # the first call's pre-hooks ran, then it raised: no post; the next two are whole updates
    assert _calls(opt, 3) == [("pre", key), ("raised", key)] + [("pre", key), ("post", key)] * 2

"""Each optimizer's gradient norm, in a step where several optimizers update (``grad_norm/<model>``).

With one optimizer the step's ``grad_norm`` is the norm of the gradients it stepped with. With
several (an actor-critic, a GAN: two backward calls and two updates per step) that single number
is only the last backward's, over every parameter. So at each read that precedes an update (the
session reads before each update that follows a backward), the gradients of the optimizer about to
step, and of those still to step this step, are reduced to one total each on the device and read
with that same read: no read of their own. A later read before a later update replaces the numbers
of the optimizers still to step (their gradients may have changed since); an optimizer that
already stepped keeps the number of the gradients it stepped with. The values are the true norms:
the session's optimizer hook runs after ``GradScaler.step`` unscaled the gradients.

Cost per read: one ``Plan.reduce`` per optimizer still to step (cached plans: a few torch calls
each, whatever the parameter count); none with a single optimizer. Not under ``sync="async"`` (the
numbers are read a step later) nor with several ranks (FSDP2 shards hold part of each gradient).
"""

from __future__ import annotations

from typing import Any

import torch

from .._step import SessionView, StepPhase
from .._tensors import Plan, foreach_norms, grad_of

PREFIX = "grad_norm/"


class OptimizerNorms:
    """The per-optimizer reductions of one session (plans cached per optimizer)."""

    def __init__(self) -> None:
        # id(optimizer) -> (its parameter count, its parameters with gradients, their Plan)
        self._plans: dict[int, tuple[int, list[torch.Tensor], Plan | None]] = {}

    def items(self, mon: SessionView) -> dict[str, torch.Tensor]:
        """Device numbers for the read now running: ``grad_norm/<model>`` per optimizer still to step."""
        opts = mon.optimizers
        st = mon.state
        if len(opts) < 2 or st.phase is not StepPhase.UPDATE:
            return {}
        if mon.reads_late or mon.coordinator is not None:
            return {}
        started = st.lr_used  # id -> lrs of every optimizer whose update started this step
        now = st.updating
        out: dict[str, torch.Tensor] = {}
        for k, opt in enumerate(opts):
            if id(opt) in started and opt is not now:
                continue  # stepped already this step: its number stands
            norm = self._norm(opt)
            if norm is not None:
                name = mon.optimizer_label(opt, k)
                out[PREFIX + name] = norm
        return out

    def _norm(self, opt: Any) -> torch.Tensor | None:
        count = sum([len(g["params"]) for g in opt.param_groups])  # a group added: plan again
        got = self._plans.get(id(opt))
        if got is None or got[0] != count:
            params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
            got = self._plans[id(opt)] = (count, params, Plan.build(params))
        _, params, plan = got
        grads = list(map(grad_of, params))
        present = [g for g in grads if g is not None]
        if not present:
            return None
        with torch.no_grad():
            if plan is not None and len(present) == len(grads):
                try:
                    return plan.reduce(grads, square=True).total.sqrt()
                except (RuntimeError, ValueError):  # a gradient unlike its parameter
                    pass
            return torch.linalg.vector_norm(foreach_norms(present).float())

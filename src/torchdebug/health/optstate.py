"""The optimizers' state, checked for NaN/Inf on the detail schedule (``optimizer_state_nonfinite``).

Adam's second moment (``exp_avg_sq``) can overflow to Inf while every weight stays finite: the update
``exp_avg / (sqrt(exp_avg_sq) + eps)`` is then 0 and the weight silently stops learning, and no weight,
gradient or loss shows it. So after the update of each detail step (``detail_every``), every floating
state tensor is reduced on the device to one number (the sum of the fused per-tensor norms), read with
the step's numbers: no read of its own. Only when that number is not finite is the state walked on the
host, each tensor confirmed exactly (a sum of large finite norms can overflow) and the first bad entry
named with its parameter; said once per episode (until the state is finite again).

Cost per detail step: one reduction of the state tensors (on the CPU one copy of the small tensors
and a few BLAS calls, whatever their number; elsewhere the fused norm) and a sum. The
list of state tensors is built once and again only when an optimizer's state gains entries or is
replaced (``load_state_dict``). Known limitation: a state tensor replaced in place of an entry
(``opt.state[p]["exp_avg"] = t``) without a new entry is not seen until the list is built again.
"""

from __future__ import annotations

from typing import Any

import torch

from .._step import SessionView
from .._tensors import Plan, foreach_norms, local, optimizer_state_tensors, unwrap_optimizer
from ..events import RuleEvent
from ..nonfinite.startup import state_effect

KIND = "optimizer_state_nonfinite"
ITEM = "health.optstate"


class OptimizerState:
    """The state-finiteness check of one session (the health instrument holds one)."""

    def __init__(self) -> None:
        self._key: tuple[tuple[int, int], ...] = ()
        # (optimizer, parameter name, state key, tensor) of every floating state tensor
        self._entries: list[tuple[Any, str, str, torch.Tensor]] = []
        # the state tensors (this rank's shards) and how to reduce them (built with the list); None: the
        # general path (several dtypes on an accelerator, odd layouts), or state on several devices
        self._tensors: list[torch.Tensor] = []
        self._plan: Plan | None = None
        self.active = False  # an episode is running: said once, until the state is finite again
        self.last_ok: int | None = None  # the last detail step whose state was finite

    def _walk(self, mon: SessionView) -> list[tuple[Any, str, str, torch.Tensor]]:
        opts = [unwrap_optimizer(o) for o in mon.optimizers]
        key = tuple((id(o.state), len(o.state)) for o in opts)
        if key != self._key:  # state created lazily at the first step, or replaced by a load
            names = {id(p): n for p, n in zip(mon.params, mon.param_names)}
            self._entries = [e for e in optimizer_state_tensors(opts, names) if e[2] != "step"]
            self._key = key
            self._tensors = [local(t) for *_, t in self._entries]
            self._plan = Plan.build(self._tensors)
        return self._entries

    def probe(self, mon: SessionView) -> torch.Tensor | None:
        """One device number, finite iff (up to an overflowing sum, confirmed later) every state tensor is."""
        entries = self._walk(mon)
        if not entries:
            return None
        tensors, plan = self._tensors, self._plan
        if plan is not None:
            try:
                # the sum of every element: finite iff every one is (an overflow is confirmed in
                # judge); on the CPU one copy of the small tensors and a few BLAS calls, not a kernel
                # per state tensor; elsewhere the fused norm
                return plan.reduce(tensors, square=False).total
            except (RuntimeError, ValueError):  # a state tensor resized in place: the general path
                pass
        if len({t.device for t in tensors}) > 1:
            return None  # state on several devices (offloaded): not checked here
        with torch.no_grad():
            return foreach_norms(tensors).sum()  # one fused reduction; read with the step's numbers

    def judge(self, mon: SessionView, step: int, value: float) -> RuleEvent | None:
        """After the read: an event when the state went non-finite (once per episode), else None."""
        if value == value and abs(value) != float("inf"):
            self.active = False
            self.last_ok = step
            return None
        if self.active:
            return None
        bad = []  # rare path: the flagged state confirmed exactly, tensor by tensor
        with torch.no_grad():
            for e in self._entries:
                t = local(e[3].detach())
                if not bool(torch.isfinite(t).all()):
                    bad.append(e)
        if not bad:
            return None  # the sum overflowed on finite values
        self.active = True
        opt, param, key, t = bad[0]
        t = local(t.detach())
        nan, pos, neg = int(torch.isnan(t).sum()), int(torch.isposinf(t).sum()), int(torch.isneginf(t).sum())
        kind = "nan" if nan else ("inf" if pos else "-inf")
        cls = type(opt).__name__
        what = ", ".join(f"{n} {w}" for n, w in ((nan, "NaN"), (pos, "+Inf"), (neg, "-Inf")) if n)
        weight = dict(zip(mon.param_names, mon.params)).get(param)
        finite = weight is not None and bool(torch.isfinite(local(weight.detach())).all())
        effect = state_effect(f"{cls}.step", param, key, kind)
        if kind == "inf" and key.endswith("_sq"):
            if pos < t.numel():
                effect += f" in the {pos} of {t.numel()} entries where {key} is Inf"
            decay = next((g.get("weight_decay", 0.0) for g in opt.param_groups if _holds(g, weight)), 0.0)
            if decay and "AdamW" in cls:
                effect += f"; only the decoupled weight decay ({decay:g}) still moves them"
        others = [f"{n} ({k})" for _, n, k, _ in bad[1:4]]
        more = f"; also {', '.join(others)}{', ...' if len(bad) > 4 else ''}" if others else ""
        since = f"finite at step {self.last_ok}, the previous check; " if self.last_ok is not None else ""
        message = since + (
            f"the optimizer state {key!r} of {param} holds {what} ({cls}) while "
            f"{'its weights are finite' if finite else 'its weights are not finite either'}: {effect}{more}. "
            "A gradient overflowed the moment: lower the learning rate, clip the gradients, or scale the "
            "loss down"
            if kind == "inf" and key.endswith("_sq")
            else f"the optimizer state {key!r} of {param} holds {what} ({cls}): {effect}{more}"
        )
        owner = param.rpartition(".")[0]
        return RuleEvent(
            KIND,
            step,
            message,
            "warning",
            modules=(owner,) if owner else (),
            evidence={"parameter": param, "state": key, "nan": nan, "posinf": pos, "neginf": neg},
        )


def _holds(group: dict[str, Any], weight: Any) -> bool:
    return any(p is weight for p in group["params"])

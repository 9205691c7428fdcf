"""Optimizer hyperparameters checked before each update: a non-finite lr, eps, beta, momentum or weight
decay is named (an ``optimizer`` anomaly) before it reaches the weights.

A scheduler that returns ``inf`` (a ``LambdaLR`` dividing by a warm-up of 0 steps), a NaN from a
hand-written schedule or a NaN beta destroys every weight in one update, and after that each step is
NaN from the forward on. The values are in the optimizer's ``param_groups`` before the update runs,
so the session checks them at the optimizer's step pre-hook:

- :meth:`HyperparameterCheck.stage` (before the step's read): Python numbers and CPU tensors are
  checked on the host at once (a few ``math.isfinite`` per param group: no device work, no sync);
  a hyperparameter held in a tensor on an accelerator joins the step's ONE read (an item of the
  transfer), so no blocking read is added;
- :meth:`HyperparameterCheck.judge` (after the read, still before the update): a non-finite value is
  recorded as an ``optimizer`` anomaly, "lr = inf in param group 0 of AdamW (set by LambdaLR at step
  0)", and the policy applied: ``raise`` raises before the update, ``skip`` drops the gradients so
  the update leaves weights and optimizer state as they were, ``warn`` lets it through.

It also remembers each optimizer's learning rates as its last update saw them, what the divergence
rule names as the likely cause (``describe_lrs``).
"""

from __future__ import annotations

import gc
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._errors import NonFiniteError
from .._frames import user_location
from .._tensors import unwrap_optimizer
from ..events import Anomaly, Phase

# The numeric hyperparameters torch's optimizers keep per param group (Adam/AdamW/SGD/RMSprop/Adagrad/
# Adadelta/Adamax/NAdam/RAdam/ASGD/Rprop ...). Booleans (nesterov, amsgrad, ...) and strings are skipped.
KEYS = ("lr", "eps", "betas", "momentum", "weight_decay", "dampening", "alpha", "rho", "lr_decay")
ITEM = "_hyper"  # the transfer item of the device-held hyperparameters
MAX_OPTIMIZERS = 4  # optimizers whose learning rates are remembered (the most recent updates')


@dataclass(frozen=True)
class BadValue:
    """One non-finite hyperparameter: ``name`` (``lr``, ``betas[1]``), its value, its param group."""

    name: str
    value: float
    group: int


def _finite_host(v: Any) -> float | None:
    """The value when it is non-finite, else None (a Python number, or a CPU tensor read on the host)."""
    if isinstance(v, float):
        return None if math.isfinite(v) else v
    if isinstance(v, torch.Tensor):
        x = v.detach()
        if x.numel() == 1:
            f = float(x)  # a CPU tensor: a host read, no device sync
            return None if math.isfinite(f) else f
        if not bool(torch.isfinite(x).all()):
            return next(float(e) for e in x.reshape(-1).tolist() if not math.isfinite(e))
    return None


class HyperparameterCheck:
    """The session's check of the hyperparameters of the optimizer about to update (see module doc)."""

    def __init__(self) -> None:
        self.opt: Any = None  # the optimizer staged for this step's update
        self.bad: list[BadValue] = []  # found on the host at stage()
        self.device: list[tuple[str, int, torch.Tensor]] = []  # (name, group, tensor) read with the step
        self.staged: torch.Tensor | None = None
        # (id(optimizer), group, name) -> what set the non-finite value and the step it was first seen
        # (" (set by LambdaLR at step 0)"): one entry per episode, so the scheduler is looked for once,
        # not at every skipped step
        self.first_seen: dict[tuple[int, int, str], str] = {}
        # id(optimizer) -> (class name, the param groups' lr values) as its last update saw them
        self.lrs: dict[int, tuple[str, list[Any]]] = {}
        self.last: Any = None  # the optimizer of the last update

    # -- before the read ------------------------------------------------------------------------
    def stage(self, opt: Any, device_ok: bool = True) -> None:
        """Check ``opt``'s param groups: host values now, tensors on an accelerator staged for the read.

        Cost per update: one ``map`` over ``KEYS`` per param group and a comparison per value (``x - x``
        is 0 for every finite float: no call); only a group holding something else than Python numbers
        (a tensor) or a non-finite value takes the per-value path. No loop over parameters, no device
        work for Python floats. ``device_ok``: False under ``sync="async"``, where accelerator tensors
        are not staged (the read comes a step late).
        """
        opt = unwrap_optimizer(opt)
        self.opt, self.bad, self.device, self.staged = opt, [], [], None
        groups = getattr(opt, "param_groups", None)
        if not groups:
            return
        lrs: list[Any] = []
        for gi, g in enumerate(groups):
            vals = list(map(g.get, KEYS))
            lrs.append(vals[0])
            plain = True
            for v in vals:
                c = v.__class__
                if c is float:
                    if v - v != 0.0:  # inf - inf and nan - nan are nan
                        plain = False
                elif c is tuple or c is list:
                    for e in v:
                        ec = e.__class__
                        if (ec is not float and ec is not int) or e - e != 0:
                            plain = False
                elif v is not None and c is not int and c is not bool:
                    plain = False  # a tensor, or something else: the per-value path
            if not plain:
                self._group(gi, g, device_ok)
        if self.last is not opt:  # another optimizer than the last update's: keep the bounded memory
            self.last = opt
            self.lrs.pop(id(opt), None)
            while len(self.lrs) >= MAX_OPTIMIZERS:
                del self.lrs[next(iter(self.lrs))]
        self.lrs[id(opt)] = (type(opt).__name__, lrs)  # the newest last
        if self.device:
            with torch.no_grad():  # a few small device ops, read with the step's one transfer
                dev = self.device[0][2].device
                self.staged = torch.cat([t.detach().float().reshape(-1).to(dev) for _, _, t in self.device])

    def _group(self, gi: int, g: dict[str, Any], device_ok: bool) -> None:
        """The per-value path of one param group (only when its fast check saw a tensor or a bad value)."""
        for key in KEYS:
            v = g.get(key)
            if v is None or isinstance(v, (bool, str)):
                continue
            if isinstance(v, (tuple, list)):
                for i, e in enumerate(v):
                    self._one(f"{key}[{i}]", gi, e, device_ok)
            else:
                self._one(key, gi, v, device_ok)

    def _one(self, name: str, group: int, v: Any, device_ok: bool) -> None:
        if isinstance(v, int):
            return  # an int is finite
        if isinstance(v, torch.Tensor) and v.device.type not in ("cpu", "meta"):
            if device_ok and v.is_floating_point():
                self.device.append((name, group, v))
            return
        if isinstance(v, torch.Tensor) and v.device.type == "meta":
            return
        bad = _finite_host(v)
        if bad is not None:
            self.bad.append(BadValue(name, bad, group))

    def items(self) -> list[tuple[str, torch.Tensor]]:
        """The device-held hyperparameters for the step's read (none in the usual case: Python floats)."""
        return [(ITEM, self.staged)] if self.staged is not None else []

    # -- after the read, before the update ------------------------------------------------------
    def judge(self, mon: Any) -> None:
        """Name a non-finite hyperparameter and apply the policy (may raise :class:`NonFiniteError`)."""
        opt, bad, staged, device = self.opt, self.bad, self.staged, self.device
        if opt is None or (not bad and staged is None and not self.first_seen):
            self.opt = None
            return  # the usual answer: every value a finite Python number
        self.opt, self.bad, self.device, self.staged = None, [], [], None
        if staged is not None:
            values = mon.transfer.values
            n = staged.numel()
            read = f"{ITEM}#0" in values or ITEM in values
            # not in the step's read when it ran before this update staged (a second optimizer in the
            # step): one more read, only then and only with accelerator-held hyperparameters
            got = mon.transfer.vector(ITEM, n) if read else staged.tolist()
            off = 0
            for name, group, t in device:
                k = t.numel()
                first = next((x for x in got[off : off + k] if not math.isfinite(x)), None)
                off += k
                if first is not None:
                    bad.append(BadValue(name, first, group))
        step = mon.global_step
        key_of = id(opt)
        if not bad:
            if self.first_seen:
                for ended in [e for e in self.first_seen if e[0] == key_of]:
                    del self.first_seen[ended]  # finite again: the next non-finite value starts a new episode
            return
        sentinel = mon.sentinel
        if sentinel.step_anomaly is not None or not sentinel.active:
            return  # this step's gradients were already judged bad: one anomaly per step
        k0 = (key_of, bad[0].group, bad[0].name)
        if k0 not in self.first_seen:
            self.first_seen[k0] = set_by(opt, bad[0], step)
        anomaly = hyperparameter_anomaly(opt, bad, self.first_seen[k0], step, mon.rank, sys._getframe(1))
        sentinel.record(anomaly)
        policy = mon.config.policy
        if policy == "raise":
            mon._flush_store()
            raise NonFiniteError(anomaly)
        if policy == "skip":
            sentinel.drop_grads(opt)  # no gradient: the optimizer leaves the weights and its state alone
            return
        mon._warn_once("anomaly", f"torchdebug: {anomaly.summary()} (policy='warn': the update runs)")

    # -- what the divergence rule names -----------------------------------------------------------
    def describe_lrs(self, fallback: Any = None) -> str:
        """``"lr 20 in param group 0 of SGD"``: each optimizer's learning rates as its last update saw
        them (``fallback``: an optimizer to read when no update was staged yet); "" when unknown."""
        seen = list(self.lrs.values())
        if not seen and fallback is not None and getattr(fallback, "param_groups", None):
            seen = [(type(fallback).__name__, [g.get("lr") for g in fallback.param_groups])]
        parts = []
        for name, lrs in seen:
            vals = [_as_float(v) for v in lrs]
            if not vals:
                continue
            if len(vals) == 1:
                parts.append(f"lr {_fmt(vals[0])} in param group 0 of {name}")
            elif len(set(vals)) == 1:
                parts.append(f"lr {_fmt(vals[0])} in all {len(vals)} param groups of {name}")
            else:
                parts.append(f"lrs {', '.join(map(_fmt, vals))} in param groups 0-{len(vals) - 1} of {name}")
        return "; ".join(parts)


def _as_float(v: Any) -> float:
    try:
        return float(v)  # a device tensor here: read once, on the rare path that names a cause
    except (TypeError, ValueError, RuntimeError):
        return math.nan


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def _kind(x: float) -> str:
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def scheduler_of(opt: Any) -> Any:
    """The LR scheduler driving ``opt``, or None. Rare path only: ``gc.get_referrers`` walks every
    tracked object (milliseconds on a large program), run once when an anomaly is being named."""

    def drives(obj: Any) -> bool:
        return getattr(obj, "optimizer", None) is opt and (
            isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or type(obj).__name__ == "ReduceLROnPlateau"
        )

    for ref in gc.get_referrers(opt):
        if drives(ref):  # an object whose attributes live inline (no __dict__ materialised)
            return ref
        if isinstance(ref, dict):  # the scheduler's __dict__ holds the optimizer
            for owner in gc.get_referrers(ref):
                if drives(owner):
                    return owner
    return None


def set_by(opt: Any, bad: BadValue, first: int) -> str:
    """`` (set by LambdaLR at step 0)`` when the optimizer's scheduler last set this lr, else
    `` (since step k)``."""
    if bad.name == "lr":
        sched = scheduler_of(opt)
        last = getattr(sched, "_last_lr", None) if sched is not None else None
        if isinstance(last, Sequence) and bad.group < len(last):
            x = _as_float(last[bad.group])
            if x == bad.value or (math.isnan(x) and math.isnan(bad.value)):
                return f" (set by {type(sched).__name__} at step {first})"
    return f" (since step {first})"


def hyperparameter_anomaly(
    opt: Any, bad: list[BadValue], when: str, step: int, rank: int, frame: Any
) -> Anomaly:
    """The ``optimizer`` anomaly naming the first non-finite hyperparameter (and how many more);
    ``when``: what :func:`set_by` said about the first one."""
    name = type(opt).__name__
    b = bad[0]
    what = f"{b.name} = {b.value} in param group {b.group}"
    symptom = f"{what} of {name}{when}"
    more = ""
    if len(bad) > 1:
        rest = ", ".join(f"{x.name} = {x.value} in param group {x.group}" for x in bad[1:4])
        more = f"; also {rest}" + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
    key = b.name.split("[")[0]
    fix = {
        "lr": "check the scheduler's lambda or factor (a division by a warm-up of 0 steps, log(0))",
        "betas": "betas must be finite numbers in [0, 1)",
        "eps": "eps must be a small positive finite number (1e-8)",
    }.get(key, f"set {key} to a finite number")
    return Anomaly(
        phase=Phase.OPTIMIZER.value,
        module="",
        op=f"{what}{when}",
        location=user_location(frame),
        kind=_kind(b.value),
        step=step,
        rank=rank,
        module_type=name,
        symptom=symptom + more,
        detected_by="sentinel",
        hint=(
            f"the update would apply {b.name} = {b.value} to every parameter of param group {b.group} "
            f"and make them non-finite; it was caught before it ran: {fix}"
        ),
    )


__all__ = [
    "ITEM",
    "KEYS",
    "BadValue",
    "HyperparameterCheck",
    "hyperparameter_anomaly",
    "scheduler_of",
    "set_by",
]

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
- :meth:`HyperparameterCheck.judge` (after the read, still before the update): a non-finite value
  gives an ``anomaly`` :class:`~torchdebug._step.Verdict` naming it, "lr = inf in param group 0 of
  AdamW (set by LambdaLR at step 0)" (with several models, "... of D's Adam ..."), which the session
  applies as it applies the sentinel's (``session/verdicts.py``): ``raise`` raises before the update,
  ``skip`` drops the gradients so the update leaves weights and optimizer state as they were,
  ``warn`` lets it through.

It also remembers each optimizer's learning rates as its last update saw them, what the divergence
rule names as the likely cause (``describe_lrs``; with several optimizers the one whose update is
largest against its weights first).
"""

from __future__ import annotations

import gc
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._frames import user_location
from .._step import OK, SessionView, Verdict
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
        # id(optimizer) -> (the optimizer, the param groups' lr values) as its last update saw them
        self.lrs: dict[int, tuple[Any, list[Any]]] = {}
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
        attrs = getattr(opt, "__dict__", None)
        if attrs is None or "_optimizer" in attrs or "optimizer" in attrs:  # a wrapper (the usual: none)
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
        self.lrs[id(opt)] = (opt, lrs)  # the newest last
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
    def judge(self, mon: SessionView, active: bool = True) -> Verdict:
        """The verdict on the staged optimizer's hyperparameters: :data:`OK`, or an ``anomaly`` verdict
        naming the first non-finite one, for the session to apply as the sentinel's (``raise`` raises
        before the update, ``skip`` drops the gradients of ``opt``, ``warn`` warns). ``active``: the
        NaN/Inf check is on (off: nothing is judged)."""
        opt, bad, staged, device = self.opt, self.bad, self.staged, self.device
        if opt is None or (not bad and staged is None and not self.first_seen):
            self.opt = None
            return OK  # the usual answer: every value a finite Python number
        self.opt, self.bad, self.device, self.staged = None, [], [], None
        if staged is not None:
            values = mon.transfer.values
            n = staged.numel()
            names = [ITEM] if n == 1 else [f"{ITEM}#{i}" for i in range(n)]
            read = all(k in values for k in names)
            # not in the step's read when it ran before this update staged (a second optimizer in the
            # step): one more read, only then and only with accelerator-held hyperparameters
            got = [values.pop(k) for k in names] if read else staged.tolist()  # popped: never read twice
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
            return OK
        if mon.state.step_anomaly is not None or not active:
            return OK  # this step's gradients were already judged bad: one anomaly per step
        k0 = (key_of, bad[0].group, bad[0].name)
        if k0 not in self.first_seen:
            self.first_seen[k0] = set_by(opt, bad[0], step)
        owner = model_of(mon.roots, opt) if len(mon.optimizers) > 1 else ""
        anomaly = hyperparameter_anomaly(
            opt, bad, self.first_seen[k0], step, mon.rank, sys._getframe(1), owner=owner
        )
        return Verdict("anomaly", anomaly, opt=opt)  # skip: no gradient, so no update and no state change

    # -- what the divergence rule names -----------------------------------------------------------
    def describe_lrs(self, fallback: Any = None, roots: dict[str, Any] | None = None) -> str:
        """``"lr 20 in param group 0 of SGD"``: each optimizer's learning rates as its last update saw
        them (``fallback``: an optimizer to read when no update was staged yet); "" when unknown.

        Several optimizers (``roots``: the session's models by name): each is named after the model it
        steps ("lr 20 in param group 0 of D's SGD"), the one whose update moves its weights most
        relative to their norm first, with that size (", whose update is 3.1x its weights' norm"). Rare
        path (an event fires): a loop over the parameters of each optimizer.
        """
        seen = list(self.lrs.values())
        if not seen and fallback is not None and getattr(fallback, "param_groups", None):
            seen = [(fallback, [g.get("lr") for g in fallback.param_groups])]
        several = len(seen) > 1
        parts: list[tuple[float, str]] = []
        for opt, lrs in seen:
            vals = [_as_float(v) for v in lrs]
            if not vals:
                continue
            name = type(opt).__name__
            if several:
                owner = model_of(roots, opt)
                name = f"{owner}'s {name}" if owner else name
            if len(vals) == 1:
                text = f"lr {_fmt(vals[0])} in param group 0 of {name}"
            elif len(set(vals)) == 1:
                text = f"lr {_fmt(vals[0])} in all {len(vals)} param groups of {name}"
            else:
                text = f"lrs {', '.join(map(_fmt, vals))} in param groups 0-{len(vals) - 1} of {name}"
            size = update_size(opt) if several else math.nan
            if math.isfinite(size):
                text += f", whose update is {_fmt(size)}x its weights' norm"
            parts.append((size if math.isfinite(size) else -1.0, text))
        if several:
            parts.sort(key=lambda p: -p[0])  # the largest update first: the likely cause
        return "; ".join(text for _, text in parts)


def model_of(roots: dict[str, Any] | None, opt: Any) -> str:
    """The name of the session's model whose parameters ``opt`` steps ("D"), or "" (rare path)."""
    first = next((p for g in getattr(opt, "param_groups", ()) for p in g["params"]), None)
    for name, root in (roots or {}).items():
        if first is not None and any(p is first for p in root.parameters()):
            return str(name)
    return ""


def update_size(opt: Any) -> float:
    """How far ``opt``'s next update would move its weights, relative to their norm:
    ``||lr * direction|| / ||weights||`` over its param groups, the direction being Adam's
    ``exp_avg / (sqrt(exp_avg_sq) + eps)`` where that state exists, else the momentum buffer or the
    gradient (SGD). NaN when it cannot be told. Rare path only: one loop over the parameters and a
    host read of two sums."""
    step_sq: list[torch.Tensor] = []
    weight_sq: list[torch.Tensor] = []
    try:
        with torch.no_grad():
            for g in opt.param_groups:
                lr = _as_float(g.get("lr"))
                for p in g["params"]:
                    state = opt.state.get(p, {})
                    if "exp_avg" in state and "exp_avg_sq" in state:
                        d = state["exp_avg"] / (state["exp_avg_sq"].sqrt() + float(g.get("eps", 1e-8)))
                    elif state.get("momentum_buffer") is not None:
                        d = state["momentum_buffer"]
                    elif p.grad is not None:
                        d = p.grad
                    else:
                        continue
                    step_sq.append((d.double() * lr).square().sum().cpu())
                    weight_sq.append(p.detach().double().square().sum().cpu())
        if not step_sq:
            return math.nan
        w = float(torch.stack(weight_sq).sum())
        return math.sqrt(float(torch.stack(step_sq).sum()) / w) if w > 0 else math.nan
    except (RuntimeError, TypeError, ValueError, KeyError, AttributeError):
        return math.nan


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
    opt: Any, bad: list[BadValue], when: str, step: int, rank: int, frame: Any, owner: str = ""
) -> Anomaly:
    """The ``optimizer`` anomaly naming the first non-finite hyperparameter (and how many more);
    ``when``: what :func:`set_by` said about the first one; ``owner``: with several models, the one
    the optimizer steps ("D": the anomaly's module, and "D's Adam" in its symptom)."""
    name = type(opt).__name__
    b = bad[0]
    what = f"{b.name} = {b.value} in param group {b.group}"
    who = f"{owner}'s {name}" if owner else name
    symptom = f"{what} of {who}{when}"
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
        module=owner,
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
    "model_of",
    "scheduler_of",
    "set_by",
    "update_size",
]

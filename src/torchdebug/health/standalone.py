"""Activation and weight statistics as instruments of their own, for configs without the gradients instrument.

When ``gradients`` runs, ``GradientHealth`` records these itself (one set of hooks); a seed flag alone
(``debug_forward_pass``, ``log_activations``, ``activation_stats``, ``log_weights``) gets these.
Both record on detail steps only (``detail_every``), hand device numbers to the step's one transfer,
and write the same series names as ``GradientHealth`` so reports read them the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .._step import SessionView
from ..stats import foreach_norms
from .instrument import DeadUnitRule, UpdateRatioRule, activation_scalars, activation_stats


class ActivationInstrument:
    """Mean, std, zero fraction (and dead/saturated fractions) of every leaf module's output.

    Series: ``act_mean/<module>``, ``act_std/<module>``, ``act_zero/<module>``, ``dead_units/<module>``
    (ReLU-like), ``saturated/<module>`` (Tanh, Sigmoid); the dead-unit rule fires as under
    ``GradientHealth``. Cost: a forward hook per leaf module (a Python check each call); on detail
    steps a few reductions per module, read with the step's transfer.
    """

    name = "activations"

    def __init__(self) -> None:
        self._hooks: list[Any] = []
        self._act: dict[str, dict[str, torch.Tensor]] = {}
        self._armed = False
        self._step: int | None = None
        self._handed: tuple[int, dict[str, dict[str, torch.Tensor]]] | None = None

    def install(self, mon: SessionView) -> None:
        self.every = int(mon.config.detail_every)
        self.dead = DeadUnitRule(mon.config.dead_unit_fraction)
        for mod in mon.model.modules():
            if next(iter(mod.children()), None) is None:
                hook = mod.register_forward_hook(self._hook(mon.names.get(mod, "")))
                self._hooks.append(mon.installs.hook(hook))

    def remove(self, mon: SessionView) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            if not self._armed or name in self._act or not isinstance(out, torch.Tensor):
                return
            if out.is_floating_point() and out.numel() > 0:
                self._act[name] = activation_stats(module, out)

        return hook

    def on_forward_start(
        self, mon: SessionView, module: Any = None, args: Any = None, kwargs: Any = None
    ) -> None:
        if mon.global_step != self._step:
            self._step = mon.global_step
            self._act = {}
            self._armed = mon.due(self.every)

    def collect(self, mon: SessionView) -> dict[str, torch.Tensor]:
        if not self._act:
            return {}
        out = {f"act.{key}.{mod}": t for mod, stats in self._act.items() for key, t in stats.items()}
        self._handed = (self._step if self._step is not None else mon.global_step, self._act)
        self._act, self._armed = {}, False  # one capture per detail step (the first micro-batch)
        return out

    def on_step_end(self, mon: SessionView, record: Any, values: Mapping[str, float]) -> None:
        handed, self._handed = self._handed, None
        if handed is None:
            return
        step, act = handed
        scalars, dead = activation_scalars(act, values, "act")
        mon.log_scalars(scalars, step=step)
        event = self.dead.update(step, dead)
        if event is not None:
            mon.emit(event)


class WeightInstrument:
    """Per-parameter gradient norm, weight norm and update/weight ratio on detail steps.

    Series: ``grad_norm/<param>``, ``weight_norm/<param>``, ``update_ratio/<param>``; the update-ratio
    rule fires as under ``GradientHealth``. Cost on detail steps only: a copy of the weights before
    the update and fused norms; nothing on other steps.
    """

    name = "gradient_details"

    def __init__(self) -> None:
        self._before: list[torch.Tensor] | None = None
        self._grads: torch.Tensor | None = None
        self._grad_idx: list[int] = []
        self._pending: dict[str, torch.Tensor] = {}
        self._handed: dict[str, Any] = {}

    def install(self, mon: SessionView) -> None:
        self.every = int(mon.config.detail_every)
        self.ratio_rule = UpdateRatioRule(mon.config.update_ratio_min, mon.config.update_ratio_max)

    def before_optimizer_step(self, mon: SessionView) -> None:
        if not (mon.due(self.every) and mon.params):
            return
        with torch.no_grad():
            grads = [(i, p.grad) for i, p in enumerate(mon.params) if p.grad is not None]
            if grads:
                self._grad_idx = [i for i, _ in grads]
                self._grads = foreach_norms([g for _, g in grads])
            self._before = [p.detach().clone() for p in mon.params]

    def after_optimizer_step(self, mon: SessionView) -> None:
        before, self._before = self._before, None
        if before is None:
            return
        params = [p.detach() for p in mon.params]
        with torch.no_grad():
            delta = foreach_norms(torch._foreach_sub(params, before))
            weight = foreach_norms(params)
            ratio = delta / weight.clamp_min(torch.finfo(torch.float32).tiny)
        self._pending = {"ratio": ratio, "weight": weight}
        if self._grads is not None:
            self._pending["grad"] = self._grads
        self._grads = None

    def collect(self, mon: SessionView) -> dict[str, torch.Tensor]:
        pending, self._pending = self._pending, {}
        out: dict[str, torch.Tensor] = {}
        for key, vec in pending.items():
            for i, v in enumerate(vec.unbind()):
                out[f"weights.{key}.{i}"] = v
        if pending:
            self._handed = {k: len(v) for k, v in pending.items()}
            self._handed["grad_idx"] = list(self._grad_idx)
        return out

    def on_step_end(self, mon: SessionView, record: Any, values: Mapping[str, float]) -> None:
        handed, self._handed = self._handed, {}
        if not handed:
            return
        names = list(mon.param_names)
        step = int(record.step)
        scalars: dict[str, float] = {}
        ratios: dict[str, float] = {}
        for i in range(handed.get("weight", 0)):
            scalars[f"weight_norm/{names[i]}"] = float(values[f"weights.weight.{i}"])
            ratios[names[i]] = float(values[f"weights.ratio.{i}"])
            scalars[f"update_ratio/{names[i]}"] = ratios[names[i]]
        for j, i in enumerate(handed["grad_idx"][: handed.get("grad", 0)]):
            scalars[f"grad_norm/{names[i]}"] = float(values[f"weights.grad.{j}"])
        mon.log_scalars(scalars, step=step)
        ndims = {n: p.dim() for n, p in zip(names, mon.params)}
        event = self.ratio_rule.update(step, ratios, ndims)
        if event is not None:
            mon.emit(event)

    def on_exit(self, mon: SessionView) -> None:
        self._pending = {}


__all__ = ["ActivationInstrument", "WeightInstrument"]

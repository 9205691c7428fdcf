"""Several models and optimizers in one session: the step's roots and each optimizer's learning rates.

A base class of :class:`~torchdebug.session.monitor.Monitor`. With several models (``watch([G, D],
...)``) each model's forward is a root of the step: every one is recorded in order for the replay (a
frozen model's under ``no_grad`` too); with several optimizers each has its learning rates, named
after the model it steps (``lr/D/0``)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .._step import StepPhase, StepState
from .._tensors import unwrap_optimizer
from ..nonfinite.sentinel import Sentinel
from .options import _names
from .wrappers import _compiled_orig


class SeveralModels:
    """The session's several roots and optimizers (see above)."""

    # the session's attributes these methods use (set in Monitor.__init__)
    model: nn.Module
    _called: nn.Module
    roots: dict[str, nn.Module] | None
    optimizers: list[torch.optim.Optimizer]
    state: StepState
    sentinel: Sentinel
    global_step: int
    micro_step: int
    _lr_names: tuple[tuple[int, ...], list[str]]
    _bare_optimizer: Any
    _given: bool
    _adopted: set[int]
    _param_ids: set[int]

    def step_lrs(self) -> tuple[float, ...]:
        """Every optimizer's learning rates (param group order), as each update of the step used them."""
        used = self.state.lr_used
        out: list[float] = []
        for o in self.optimizers:
            got = used.get(id(o))
            out.extend(got if got is not None else [float(g.get("lr", math.nan)) for g in o.param_groups])
        return tuple(out)

    def lr_names(self) -> list[str]:
        """The scalar names of :meth:`step_lrs`: ``lr/<group>``; with several optimizers
        ``lr/<model>/<group>`` (the model whose parameters the optimizer steps, else ``opt<k>``)."""
        shape = tuple([len(o.param_groups) for o in self.optimizers])
        if self._lr_names[0] != shape:
            if len(self.optimizers) == 1:
                names = [f"lr/{g}" for g in range(shape[0])]
            else:
                names = [
                    f"lr/{self.optimizer_label(o, k)}/{g}"
                    for k, o in enumerate(self.optimizers)
                    for g in range(len(o.param_groups))
                ]
            self._lr_names = (shape, names)
        return self._lr_names[1]

    @property
    def lr_labels(self) -> list[str] | None:
        """What the learning-rate events call each entry of :meth:`step_lrs` (None: ``param group <g>``)."""
        if len(self.optimizers) < 2:
            return None
        return [
            f"{self.optimizer_label(o, k)}'s {type(o).__name__}, param group {g}"
            for k, o in enumerate(self.optimizers)
            for g in range(len(o.param_groups))
        ]

    def optimizer_label(self, opt: Any, k: int = 0) -> str:
        """The model an optimizer steps (several models: its name), else ``opt<k>`` (its place in ``optimizers``)."""
        first = next((p for g in opt.param_groups for p in g["params"]), None)
        if first is not None and self.roots is not None:
            for name, root in self.roots.items():
                if any([p is first for p in root.parameters()]):
                    return name
        return f"opt{k}"

    def owns_optimizer(self, opt: Any) -> bool:
        """True for this session's optimizer; without one, the first optimizer of its parameters is adopted."""
        if opt is self._bare_optimizer and opt is not None:
            return True  # twice a step (the optimizer hooks): the session's own, unwrapped optimizer
        opt = unwrap_optimizer(opt)
        if self._given:
            return any([opt is o for o in self.optimizers])
        if id(opt) in self._adopted:
            return True
        for g in getattr(opt, "param_groups", []):
            for p in g["params"]:
                if id(p) in self._param_ids:
                    self._adopted.add(id(opt))
                    self.optimizers.append(opt)  # every optimizer of these parameters, as it first steps
                    return True
                break
        return False

    def watch_also(
        self, model: nn.Module | None, optimizer: torch.optim.Optimizer | None, caller: Any = None
    ) -> bool:
        """Watch one more model and/or optimizer, before the session's first forward (``torchdebug run``
        watches every optimizer the script creates). A model not watched yet makes the session one of
        several models (names gain the model's name: ``G.main.0``). False when it is too late (a step began)."""
        if optimizer is not None and not any([optimizer is o for o in self.optimizers]):
            self.optimizers.append(optimizer)
            self._given = True
        if model is None or any([model is m for m in self.model.modules()]):
            return True
        state = self.state
        if self.global_step or self.micro_step or state.phase is StepPhase.FORWARD or state.captures:
            return False  # a step began: its names and captures stay as they are
        current = dict(self.roots) if self.roots is not None else {}
        if not current:  # the one model so far, as the loop calls it (a torch.compile wrapper: that)
            called = self._called if _compiled_orig(self._called) is self.model else self.model
            current = {_names([called], caller)[0]: called}
        both = _names([*current.values(), model], caller)
        roots = {**current, both[-1] if both[-1] not in current else f"{both[-1]}_2": model}
        self._regroup(roots)
        return True

    def _regroup(self, roots: dict[str, nn.Module]) -> None:
        raise NotImplementedError

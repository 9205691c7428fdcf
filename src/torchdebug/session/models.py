"""Several models and optimizers in one session: the step's roots and each optimizer's learning rates.

A member of :class:`~torchdebug.session.monitor.Monitor` (``mon.models``). With several models
(``watch([G, D], ...)``) each model's forward is a root of the step: every one is recorded in order for
the replay (a frozen model's under ``no_grad`` too); with several optimizers each has its learning
rates, named after the model it steps (``lr/D/0``). It holds the roots and the optimizers; what it
needs of the step (the learning rates each update used) is handed in."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .._tensors import unwrap_optimizer
from .options import _names


class Models:
    """The session's roots and optimizers (see above).

    Args:
        roots: several models, each by name (the modules the loop calls); None: one model.
        optimizers: the optimizers given to ``watch`` (none: each optimizer of ``param_ids`` is adopted
            as it first steps).
        param_ids: ``id`` of every parameter of the session's models.
    """

    def __init__(
        self,
        roots: dict[str, nn.Module] | None,
        optimizers: list[torch.optim.Optimizer],
        param_ids: set[int],
    ) -> None:
        self.roots = roots
        # every optimizer of the session: those given, else those adopted (in the order they first stepped)
        self.optimizers: list[torch.optim.Optimizer] = list(optimizers)
        self.given = bool(optimizers)
        self.bare = optimizers[0] if optimizers else None  # ``owns_optimizer``'s shortcut
        self.param_ids = param_ids
        self.adopted: set[int] = set()
        self._lr_names: tuple[tuple[int, ...], list[str]] = ((-1,), [])

    def step_lrs(self, used: Mapping[int, tuple[float, ...]]) -> tuple[float, ...]:
        """Every optimizer's learning rates (param group order), as each update of the step used them
        (``used``: by optimizer id, what the step's updates read as they started)."""
        out: list[float] = []
        for o in self.optimizers:
            got = used.get(id(o))
            out.extend(got if got is not None else [float(g.get("lr", math.nan)) for g in o.param_groups])
        return tuple(out)

    def lr_names(self) -> list[str]:
        """The scalar names of :meth:`step_lrs`: ``lr/<group>``; with several optimizers
        ``lr/<model>/<group>`` (the model whose parameters the optimizer steps, else ``opt<k>``)."""
        opts = self.optimizers
        # (one optimizer, every step: no comprehension)
        shape = (len(opts[0].param_groups),) if len(opts) == 1 else tuple([len(o.param_groups) for o in opts])
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
        if opt is self.bare and opt is not None:
            return True  # twice a step (the optimizer hooks): the session's own, unwrapped optimizer
        opt = unwrap_optimizer(opt)
        if self.given:
            return any([opt is o for o in self.optimizers])
        if id(opt) in self.adopted:
            return True
        for g in getattr(opt, "param_groups", []):
            for p in g["params"]:
                if id(p) in self.param_ids:
                    self.adopted.add(id(opt))
                    self.optimizers.append(opt)  # every optimizer of these parameters, as it first steps
                    return True
                break
        return False

    def add_optimizer(self, opt: torch.optim.Optimizer) -> None:
        """One more optimizer to watch (``watch_also``): given, so none is adopted from now on."""
        if not any([opt is o for o in self.optimizers]):
            self.optimizers.append(opt)
            self.given = True

    def joined(self, model: nn.Module, called: nn.Module, caller: Any) -> dict[str, nn.Module]:
        """The roots with ``model`` added (``called``: the one model so far, as the loop calls it),
        each named after the caller's variables; a name already taken gets ``_2``."""
        current = dict(self.roots) if self.roots is not None else {}
        if not current:
            current = {_names([called], caller)[0]: called}
        both = _names([*current.values(), model], caller)
        return {**current, both[-1] if both[-1] not in current else f"{both[-1]}_2": model}

    def regroup(self, roots: dict[str, nn.Module], container: nn.Module) -> None:
        """The session watches these models now (``container``: their ModuleDict)."""
        self.roots = roots
        self.param_ids = {id(p) for p in container.parameters()}


__all__ = ["Models"]

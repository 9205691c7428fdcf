"""What the step's one host read holds: the session's own numbers, the sentinel's probes, the optimizer
hyperparameters held on an accelerator, every instrument's. A base class of
:class:`~torchdebug.session.monitor.Monitor`; the attributes it uses are the session's."""

from __future__ import annotations

from typing import Any

from .._tensors import Items
from ..nonfinite.hyperparams import HyperparameterCheck
from ..nonfinite.sentinel import Sentinel
from .transfer import Transfer


class StepItems:
    """The step's device numbers for its one read (see above)."""

    # the session's attributes these methods use (set in Monitor.__init__)
    scaler: Any
    sentinel: Sentinel
    hyperparams: HyperparameterCheck  # lr, eps, betas ... checked before each update

    @property
    def transfer(self) -> Transfer:
        raise NotImplementedError

    def _collect(self) -> Items:
        raise NotImplementedError

    def _step_items(self) -> Items:
        """The step's device numbers: its own, the sentinel's probes, the hyperparameters held on an
        accelerator (none for Python floats), every instrument's."""
        return (
            self.transfer.items(self.scaler)
            + self.sentinel.items()
            + self.hyperparams.items()
            + self._collect()
        )

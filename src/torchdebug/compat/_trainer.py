"""Seed 003's ``OptimizedTrainer`` and ``TrainingConfig``: a plain training loop under ``watch``."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._errors import ConfigError
from ..health.inspection import call_model
from ._seedconfig import PyTorchDebugConfig
from ._training import _cuda_info, _model_info


@dataclass
class TrainingConfig:
    """Seed 003's training options (the ones its documents use, and the two a loop needs).

    Args:
        epochs: passes over ``train_loader`` (>= 1).
        batch_size: the loader's batch size, as the seed passed it. A ``DataLoader`` whose own batch
            size differs raises ``ConfigError`` (the loader decides the batches; ``None``: take the
            loader's).
        learning_rate: for the default optimizer (``AdamW``) when the trainer is given none.
        enable_pytorch_debugging: run the loop under ``td.watch`` (the seed's "automatic features").
        debug_config: a :class:`PyTorchDebugConfig` (``None``: its defaults). Its
            ``anomaly_detection_mode`` decides what a NaN/Inf does: ``"raise"`` (the default) raises
            ``NonFiniteError`` out of ``train()`` before the bad update; ``"warn"`` and ``"detect"``
            skip that update and go on (the seed's "skip batch" recovery), counted in
            ``skipped_steps``.

    Raises:
        ConfigError: a value of the wrong type or out of range.
    """

    epochs: int = 1
    batch_size: int | None = 32
    learning_rate: float = 1e-3
    enable_pytorch_debugging: bool = False
    debug_config: PyTorchDebugConfig | None = None

    def __post_init__(self) -> None:
        if isinstance(self.epochs, bool) or not isinstance(self.epochs, int) or self.epochs < 1:
            raise ConfigError(f"TrainingConfig(epochs={self.epochs!r}): give an int >= 1")
        if self.batch_size is not None and (
            isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1
        ):
            raise ConfigError(f"TrainingConfig(batch_size={self.batch_size!r}): give an int >= 1, or None")
        if not isinstance(self.learning_rate, (int, float)) or not self.learning_rate > 0:
            raise ConfigError(f"TrainingConfig(learning_rate={self.learning_rate!r}): give a float > 0")
        if self.debug_config is not None and not isinstance(self.debug_config, PyTorchDebugConfig):
            raise ConfigError(
                f"TrainingConfig(debug_config=...): expected a PyTorchDebugConfig, got "
                f"{type(self.debug_config).__name__}"
            )


class OptimizedTrainer:
    """Seed 003's trainer: ``train()`` runs the epochs, under ``td.watch`` when debugging is enabled.

    With ``config.enable_pytorch_debugging`` the loop is watched with ``debug_config`` mapped by
    :meth:`PyTorchDebugConfig.to_debug_config` (the seed's five "automatic features": the NaN/Inf
    sentinel instead of ``autograd.detect_anomaly()``, gradient checks after each backward, clipping
    to ``gradient_clip_threshold`` on a detected spike, memory samples every
    ``memory_snapshot_frequency`` steps, and the run's report at the end), into a run folder under
    ``run_dir`` (default: the config's ``run_dir``).

    The loss: with ``loss_fn``, batches are ``(inputs, targets)`` and the loss is
    ``loss_fn(model(inputs), targets)``; without it the model is called with the batch (a dict as
    keywords, a tuple as positional arguments, a tensor as one) and returns its loss: a scalar
    tensor, ``output.loss`` or ``output["loss"]`` (Hugging Face style).

    Args:
        model: the ``nn.Module`` to train (a TorchScript module cannot be watched: ``ConfigError``).
        train_loader: an iterable of batches, re-iterated each epoch (a ``DataLoader``).
        config: a :class:`TrainingConfig` (default: its defaults).
        optimizer: default ``AdamW(model.parameters(), lr=config.learning_rate)``.
        loss_fn: ``loss_fn(output, targets) -> scalar tensor``.
        run_dir: where the debugged run's folder goes.

    Example::

        trainer = OptimizedTrainer(model=model, train_loader=loader, config=TrainingConfig(
            epochs=2, enable_pytorch_debugging=True), loss_fn=F.cross_entropy)
        results = trainer.train()
        print(results["train_loss"], results["debug_report"]["summary"])

    Cost: the loss is summed on the device and read once per epoch; under debugging, ``watch``'s own
    per-step cost (see docs/compatibility.md).
    """

    def __init__(
        self,
        model: nn.Module,
        train_loader: Iterable[Any],
        config: TrainingConfig | None = None,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        run_dir: str | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"OptimizedTrainer(model=...): expected a torch.nn.Module, got {type(model).__name__}"
            )
        self.config = config if config is not None else TrainingConfig()
        if not isinstance(self.config, TrainingConfig):
            raise ConfigError(
                f"OptimizedTrainer(config=...): expected a TrainingConfig, got {type(config).__name__}"
            )
        loader_bs = getattr(train_loader, "batch_size", None)
        if (
            self.config.batch_size is not None
            and isinstance(loader_bs, int)
            and loader_bs != self.config.batch_size
        ):
            raise ConfigError(
                f"TrainingConfig(batch_size={self.config.batch_size}) but train_loader's batch size is "
                f"{loader_bs}: the loader decides the batches, so build it with "
                f"batch_size={self.config.batch_size}, or set TrainingConfig(batch_size={loader_bs}) or None"
            )
        self.model = model
        self.train_loader = train_loader
        self.optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=self.config.learning_rate)
        self.loss_fn = loss_fn
        self.debug_config = self.config.debug_config or PyTorchDebugConfig()
        self.run_dir = run_dir
        self.monitor: Any = None  # the last train()'s watch session (None without debugging)

    def _loss(self, batch: Any) -> torch.Tensor:
        if self.loss_fn is not None:
            if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
                raise ConfigError(
                    f"OptimizedTrainer(loss_fn=...) needs (inputs, targets) batches, got "
                    f"{type(batch).__name__}; without loss_fn the model's own loss is used"
                )
            return self.loss_fn(call_model(self.model, batch[0]), batch[1])
        output = call_model(self.model, batch)  # the model computes its loss (Hugging Face style)
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", output)
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            return loss
        raise ConfigError(
            f"OptimizedTrainer: the model returned {type(output).__name__}, not a loss; pass "
            "loss_fn=(output, targets) -> loss for (inputs, targets) batches, or return a scalar "
            "loss (or an object with .loss) from the model"
        )

    def _epoch(self, mon: Any) -> tuple[float, int, int]:
        """One pass: (sum of the finite losses, how many were finite, batches run)."""
        total: torch.Tensor | None = None
        finite: torch.Tensor | None = None
        batches = 0
        for batch in self.train_loader:
            self.optimizer.zero_grad(set_to_none=True)
            loss = self._loss(batch)
            loss.backward()
            self.optimizer.step()
            if mon is not None:
                mon.step()
            d = loss.detach().float().reshape(())
            ok = torch.isfinite(d)  # a skipped NaN batch stays out of the mean; summed on the loss's device
            total = torch.where(ok, d, 0.0) + (total if total is not None else 0.0)
            finite = ok.long() + (finite if finite is not None else 0)
            batches += 1
        if total is None or finite is None:
            return 0.0, 0, 0
        return float(total), int(finite), batches  # the epoch's host reads (two scalars)

    def train(self) -> dict[str, Any]:
        """Train ``config.epochs`` epochs; the results.

        Returns:
            ``{"epochs", "steps" (batches run), "train_loss" (mean finite loss per epoch),
            "final_loss", "total_time" (s), "skipped_steps", "anomalies" (each ``Anomaly.to_dict()``),
            "run_dir", "debug_report"}``. ``debug_report`` (None without debugging) is the run's JSON
            report (``td.report(run, "json")``: summary, anomalies, gradient, memory and performance
            analysis, ...) plus ``model_info`` and ``cuda``.

        Raises:
            NonFiniteError: debugging on, ``anomaly_detection_mode="raise"``, and a step made a NaN/Inf
                (raised before its update; the run folder is closed as failed).
            ConfigError: no ``loss_fn`` and the model returns no loss (at the first batch).
        """
        import torchdebug as td

        t0 = time.perf_counter()
        losses: list[float | None] = []
        steps = 0
        mon: Any = None
        with contextlib.ExitStack() as stack:  # the session closes on any exception (a failed run)
            if self.config.enable_pytorch_debugging:
                mode = self.debug_config.anomaly_detection_mode
                cfg = self.debug_config.to_debug_config(policy="raise" if mode == "raise" else "skip")
                mon = stack.enter_context(td.watch(self.model, self.optimizer, config=cfg, run=self.run_dir))
                self.monitor = mon
            for _ in range(self.config.epochs):
                total, finite, batches = self._epoch(mon)
                steps += batches
                losses.append(total / finite if finite else None)
        report = self._report(mon) if mon is not None else None
        return {
            "epochs": self.config.epochs,
            "steps": steps,
            "train_loss": losses,
            "final_loss": losses[-1] if losses else None,
            "total_time": time.perf_counter() - t0,
            "skipped_steps": mon.counters["skipped_steps"] if mon is not None else 0,
            "anomalies": [a.to_dict() for a in mon.anomalies] if mon is not None else [],
            "run_dir": str(mon.run_dir) if mon is not None and mon.run_dir is not None else None,
            "debug_report": report,
        }

    def _report(self, mon: Any) -> dict[str, Any]:
        from ..views.report import render_report

        if mon.run_dir is not None:
            report: dict[str, Any] = json.loads(render_report(mon.run_dir, "json"))
        else:  # run=False / store=False: the session's own counts
            report = {"summary": mon.training_summary(), "anomalies": [a.to_dict() for a in mon.anomalies]}
        report["model_info"] = _model_info(self.model)
        report["cuda"] = _cuda_info()
        return report

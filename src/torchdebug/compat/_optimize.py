"""Seed 004's optimization half: optimize_model, PyTorchOptimizer, benchmark_optimizations, the decorator.

All measurements come from ``td.compare_modes`` (same batches, same seeds, a plain baseline), so a
speedup is a measured ratio of median step times, never an assumption.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..health.inspection import call_model
from ..perf.optimize import OptimizationMode, _mode, compare_modes, prepare


@dataclass
class OptimizationMetrics:
    """One optimization applied (seed 004's record): ``mode``, ``execution_time`` (s to apply it),
    ``speedup_factor`` and ``memory_savings`` (fractions; None until measured), ``amp_enabled``,
    ``applied`` (what was done, in words)."""

    mode: OptimizationMode
    execution_time: float
    speedup_factor: float | None = None
    memory_savings: float | None = None
    amp_enabled: bool = False
    applied: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode.value,
            "execution_time": self.execution_time,
            "speedup_factor": self.speedup_factor,
            "memory_savings": self.memory_savings,
            "amp_enabled": self.amp_enabled,
            "applied": list(self.applied),
        }


def optimize_model_in_place(
    model: nn.Module, optimization_mode: OptimizationMode | str, sink: list[OptimizationMetrics] | None = None
) -> nn.Module:
    """Apply a mode (see ``td.perf.optimize.prepare``); returns the model to call (``model`` itself for NONE)."""
    mode = _mode(optimization_mode)
    t0 = time.perf_counter()
    prep = prepare(model, mode)
    metrics = OptimizationMetrics(
        mode=mode,
        execution_time=time.perf_counter() - t0,
        amp_enabled=any(a.startswith("autocast") for a in prep.applied),
        applied=prep.applied,
    )
    if sink is not None:
        sink.append(metrics)
    return prep.model


def _check_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if type(optimizer).__name__ == "PyTorchOptimizer":
        raise TypeError(
            "optimizer= got the PyTorchOptimizer itself (seed 004's example rebinds the name 'optimizer'): "
            "pass the torch optimizer, e.g. torch.optim.SGD(model.parameters(), lr=0.01)"
        )
    raise TypeError(f"optimizer= must be a torch.optim.Optimizer, got {type(optimizer).__name__}")


def _same_kind(optimizer: torch.optim.Optimizer) -> Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]:
    """Fresh optimizers of the same class and defaults (lr, momentum ...) for the A/B copies."""
    return lambda params: type(optimizer)(params, **optimizer.defaults)


class PyTorchOptimizer:
    """Seed 004's training-loop optimizer over ``td.compare_modes``.

    Args:
        debugger: a ``PyTorchDebugger`` whose ``optimization_metrics`` receive the records (or None).

    Example::

        opt_helper = PyTorchOptimizer(debugger)
        result = opt_helper.optimize_training_loop(model=model, dataloader=loader, optimizer=sgd,
                                                   criterion=F.cross_entropy, epochs=1,
                                                   optimization_mode=OptimizationMode.AMP)
        print(result["total_time"], result["optimization_metrics"]["speedup_factor"])
    """

    def __init__(self, debugger: Any = None, *, ab_steps: int = 5) -> None:
        self.debugger = debugger
        self.ab_steps = ab_steps

    def _sink(self) -> list[OptimizationMetrics] | None:
        return getattr(self.debugger, "optimization_metrics", None)

    def optimize_training_loop(
        self,
        model: nn.Module,
        dataloader: Iterable[Any],
        optimizer: torch.optim.Optimizer,
        criterion: Callable[[Any, Any], torch.Tensor],
        epochs: int = 1,
        optimization_mode: OptimizationMode | str = OptimizationMode.FULL_OPTIMIZATION,
        *,
        compile_options: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Train ``model`` for ``epochs`` under the mode; the speedup is measured by an A/B first.

        Before training, ``compare_modes`` runs NONE and the mode on copies of the model over the
        first ``ab_steps`` batches (same seeds): ``speedup_factor`` is the ratio of their median step
        times, ``memory_savings`` 1 - peak(mode)/peak(none) where measured. Then the model itself is
        trained under the mode (in place, as the seed's ``optimize_model``), every step timed.

        Returns:
            ``{"total_time" (s), "epochs", "steps", "epoch_losses" (mean per epoch), "model" (what
            was called), "optimization_metrics": {"mode", "speedup_factor", "memory_savings",
            "amp_enabled", "applied", "comparison" (the A/B's to_dict())}}``.

        Raises:
            TypeError: ``optimizer`` is not a torch optimizer (the seed's example passed the
                PyTorchOptimizer itself: the message says what to pass).
            ValueError: unknown mode, or an empty dataloader.

        Cost: 2 x ``ab_steps`` extra steps on copies (none for NONE), then the training.
        """
        opt = _check_optimizer(optimizer)
        mode = _mode(optimization_mode)
        first = []
        for batch in dataloader:
            first.append(batch)
            if len(first) >= max(2, self.ab_steps):
                break
        if not first:
            raise ValueError("optimize_training_loop needs a non-empty dataloader")
        speedup: float | None = 1.0
        savings: float | None = None
        comparison = None
        if mode is not OptimizationMode.NONE:
            cmp = compare_modes(
                model,
                criterion,
                [tuple(b) for b in first],
                modes=[OptimizationMode.NONE, mode],
                optimizer_fn=_same_kind(opt),
                compile_options=compile_options,
            )
            comparison = cmp.to_dict()
            r, b = cmp[mode], cmp[OptimizationMode.NONE]
            if r.error is not None:
                raise RuntimeError(f"optimization mode {mode.value} failed on this model: {r.error}")
            speedup = r.speedup
            if r.peak_bytes and b.peak_bytes:
                savings = 1.0 - r.peak_bytes / b.peak_bytes
        t0 = time.perf_counter()
        prep = prepare(model, mode, compile_options=compile_options)
        apply_s = time.perf_counter() - t0
        total, steps, epoch_losses = 0.0, 0, []
        model.train()
        for _ in range(epochs):
            losses = []
            for data, target in dataloader:
                t = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                loss = criterion(call_model(prep.model, data), target)
                if prep.scaler is not None:
                    prep.scaler.scale(loss).backward()
                    prep.scaler.step(opt)
                    prep.scaler.update()
                else:
                    loss.backward()
                    opt.step()
                losses.append(loss.detach())
                total += time.perf_counter() - t
                steps += 1
            epoch_losses.append(float(torch.stack(losses).float().mean()) if losses else float("nan"))
        metrics = OptimizationMetrics(
            mode=mode,
            execution_time=apply_s,
            speedup_factor=speedup,
            memory_savings=savings,
            amp_enabled=any(a.startswith("autocast") for a in prep.applied),
            applied=prep.applied,
        )
        sink = self._sink()
        if sink is not None:
            sink.append(metrics)
        return {
            "total_time": total,
            "epochs": epochs,
            "steps": steps,
            "epoch_losses": epoch_losses,
            "model": prep.model,
            "optimization_metrics": {**metrics.to_dict(), "comparison": comparison},
        }

    def benchmark_optimizations(
        self,
        model: nn.Module,
        dataloader: Iterable[Any],
        optimizer: torch.optim.Optimizer,
        criterion: Callable[[Any, Any], torch.Tensor],
        epochs: int = 1,
        *,
        modes: Iterable[OptimizationMode | str] = tuple(OptimizationMode),
        compile_options: dict[str, Any] | None = None,
    ) -> dict[str, dict[str, Any]]:
        """Every mode on copies of ``model`` over ``epochs`` passes of ``dataloader``: ``{mode: result}``.

        Each result is ``ModeResult.to_dict()`` (``total_time``, ``median_s``, ``speedup``,
        ``peak_bytes``, numerics vs NONE ...); a mode that fails gives ``{"error": message}``, never an
        exception. ``model`` and ``optimizer`` are not changed (fresh optimizers of the same class and
        defaults train the copies).
        """
        opt = _check_optimizer(optimizer)
        chosen = [_mode(m) for m in modes]
        if OptimizationMode.NONE in chosen:
            chosen.remove(OptimizationMode.NONE)
        chosen.insert(0, OptimizationMode.NONE)  # the baseline first
        batches = [tuple(b) for _ in range(epochs) for b in dataloader]
        cmp = compare_modes(
            model,
            criterion,
            batches,
            modes=chosen,
            optimizer_fn=_same_kind(opt),
            warmup=1 if len(batches) > 1 else 0,
            compile_options=compile_options,
        )
        out: dict[str, dict[str, Any]] = {}
        for k, r in cmp.results.items():
            d = r.to_dict()
            d.pop("error")  # the seed tests `"error" not in result`: only failed modes carry the key
            out[k] = {"error": r.error} if r.error is not None else d
        return out


def optimize_model(
    optimization_mode: OptimizationMode | str = OptimizationMode.FULL_OPTIMIZATION, debugger: Any = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Seed 004's decorator: the function's first ``nn.Module`` argument is replaced by its optimized form.

    Each model is optimized once (kept in a weak map) and the metrics go to ``debugger.optimization_metrics``
    when given (else to the wrapper's ``.optimization_metrics``). As ``optimize_model``, the model is changed in
    place (checkpointed blocks) and wrapped (autocast, compile).

    Example::

        @optimize_model(optimization_mode=OptimizationMode.AMP)
        def inference_step(model, data):
            with torch.no_grad():
                return model(data)
    """
    mode = _mode(optimization_mode)

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        done: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()
        records: list[OptimizationMetrics] = debugger.optimization_metrics if debugger is not None else []

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            args_l = list(args)
            for i, a in enumerate(args_l):
                if isinstance(a, nn.Module):
                    if a not in done:
                        done[a] = optimize_model_in_place(a, mode, records)
                    args_l[i] = done[a]
                    break
            return fn(*args_l, **kwargs)

        call.optimization_metrics = records  # type: ignore[attr-defined]
        return call

    return wrap


__all__ = ["OptimizationMetrics", "PyTorchOptimizer", "optimize_model", "optimize_model_in_place"]

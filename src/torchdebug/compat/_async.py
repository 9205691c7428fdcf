"""Seed 002's ``AsyncTrainingLogger`` and ``TrainingPhase``: progress, warnings and errors into the run store."""

from __future__ import annotations

import asyncio
import enum
import traceback
from typing import Any

import torch
from torch import nn

from .._errors import NonFiniteError
from ..events import plain
from ._checks import check_gradient_anomalies, check_tensor_anomalies


class TrainingPhase(str, enum.Enum):
    """Where in training a warning or error happened (seed 002)."""

    INITIALIZATION = "initialization"
    DATA_LOADING = "data_loading"
    TRAINING = "training"
    VALIDATION = "validation"
    CHECKPOINTING = "checkpointing"
    EVALUATION = "evaluation"

    def __str__(self) -> str:
        return self.value


class AsyncTrainingLogger:
    """Seed 002's training logger: progress, warnings, errors and anomaly checks into a run folder.

    Writes go through the run store's writer, which queues them for its own thread: ``log_warning``
    and ``log_error`` never wait on disk, and the ``*_async`` methods move their host transfers to a
    worker thread (``asyncio.to_thread``), so an event loop is never blocked.

    Args:
        user_id, model_name: recorded in the run's meta (``config``).
        enable_autograd_debug: as the seed's flag switched on ``torch.autograd.detect_anomaly``
            for the training, ``start_training`` puts the engine's NaN/Inf sentinel on the model
            (the first module called after it): a ``backward()`` that ends with a NaN/Inf loss or
            gradient raises ``NonFiniteError`` there, before ``optimizer.step()`` (the seed loop's
            ``except`` logs it with ``log_error``, which files the anomaly in the run), and
            ``end_training`` takes it off. The anomaly checks also record what they find as events.
        run_dir: runs root (default ``"runs"``); the folder is ``<run_dir>/<run_name>-<time>``.
        run_name: default ``model_name`` with ``/`` replaced.

    Example::

        logger = AsyncTrainingLogger(user_id=123, model_name="tiny-gpt", run_dir=tmp)
        logger.start_training(total_epochs=10, total_steps=1000)
        await logger.update_progress_async(epoch=0, step=0, loss=2.3, learning_rate=1e-3)
        logger.log_warning("Loss tensor contains NaN values")
        logger.end_training()

    Cost: ``start_training`` creates the run folder (a few ms); each record is a queue put.
    """

    def __init__(
        self,
        user_id: Any = None,
        model_name: str = "model",
        enable_autograd_debug: bool = False,
        *,
        run_dir: str = "runs",
        run_name: str | None = None,
    ) -> None:
        self.user_id = user_id
        self.model_name = str(model_name)
        self.enable_autograd_debug = bool(enable_autograd_debug)
        self.run_dir = run_dir
        self.run_name = run_name or self.model_name.replace("/", "-").replace("\\", "-")
        self.writer: Any = None
        self.step: int | None = None
        self.epoch: int | None = None
        self.total_epochs: int | None = None
        self.total_steps: int | None = None
        self.warnings = 0
        self.errors = 0
        self._guard: Any = None  # enable_autograd_debug: the sentinel's session (start..end_training)
        self._logged: set[int] = set()  # ids of the guard's anomalies already in the run
        self._updates = 0  # optimizer steps since start_training (the step in progress, see _step_now)
        self._updates_at_progress = 0
        self._hook: Any = None

    @property
    def path(self) -> Any:
        """The run folder (None before ``start_training``)."""
        return None if self.writer is None else self.writer.path

    def start_training(self, total_epochs: int | None = None, total_steps: int | None = None) -> Any:
        """Open the run (its meta holds user, model, totals); returns the run folder.

        Raises:
            RuntimeError: training already started (call ``end_training`` first).
        """
        from ..store import create_run

        if self.writer is not None:
            raise RuntimeError("start_training was already called: end_training() first")
        self.total_epochs, self.total_steps = total_epochs, total_steps
        self.writer = create_run(
            root=self.run_dir,
            name=self.run_name,
            config={
                "user_id": plain(self.user_id),
                "model_name": self.model_name,
                "total_epochs": total_epochs,
                "total_steps": total_steps,
                "enable_autograd_debug": self.enable_autograd_debug,
            },
        )
        self._event(
            "training_started",
            "info",
            f"training {self.model_name}: {total_epochs} epochs, {total_steps} steps",
        )
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._updates = self._updates_at_progress = 0
        self._hook = register_optimizer_step_post_hook(self._count_update)
        if self.enable_autograd_debug:
            from .._config import DebugConfig
            from ._guard import _Guard

            # no loss tape: it is a thread-local torch-function mode, and end_training may run in a
            # worker thread (asyncio.to_thread) that cannot take it off the training thread's stack
            self._guard = _Guard(DebugConfig(trace_loss=False), "raise")
            self._guard.discover()
        return self.writer.path

    def _count_update(self, opt: Any, args: Any, kwargs: Any) -> None:
        self._updates += 1

    def _step_now(self, explicit: Any = None) -> int | None:
        """The step an event belongs to: ``explicit`` when given, else the step in progress.

        The step in progress is the last progress step plus the optimizer updates since that
        ``update_progress_async`` call: the seed's loop reports progress before ``optimizer.step()``,
        so a warning raised before the next report belongs to the next step.
        """
        if explicit is not None:
            return int(explicit)
        if self.step is None:
            return self._updates if self._hook is not None else None
        return self.step + (self._updates - self._updates_at_progress)

    def _file_anomalies(self) -> None:
        """Write the sentinel's anomalies not yet in the run (queued, returns at once)."""
        mon = self._guard.mon if self._guard is not None else None
        if mon is None or self.writer is None:
            return
        for a in list(mon.anomalies):
            if id(a) not in self._logged:
                self._logged.add(id(a))
                self.writer.log_anomaly(self._step_now(), a.to_dict())

    def _need(self) -> Any:
        if self.writer is None:
            raise RuntimeError("call start_training(...) before logging")
        return self.writer

    def _event(
        self,
        kind: str,
        severity: str,
        message: str,
        data: dict[str, Any] | None = None,
        step: int | None = None,
    ) -> None:
        self._need().log_event(self._step_now(step), kind, severity, message, plain(data) if data else None)

    def log_warning(
        self, message: str, phase: TrainingPhase | str = TrainingPhase.TRAINING, *, step: int | None = None
    ) -> None:
        """Record a warning event with its phase, epoch and step (queued, returns at once).

        ``step``: the step it belongs to; default the step in progress (see the class).
        """
        self.warnings += 1
        self._file_anomalies()
        self._event(
            "warning",
            "warning",
            str(message),
            {"phase": str(TrainingPhase(phase)), "epoch": self.epoch},
            step=step,
        )

    def log_error(
        self, error: BaseException, phase: TrainingPhase | str = TrainingPhase.TRAINING, context: Any = None
    ) -> None:
        """Record an error event: type, message, phase, the context mapping (tensors summarized), traceback.

        Filed under ``context["step"]`` when the context names one, else the step in progress. A
        ``NonFiniteError`` also files its anomaly (phase, module, op, line) in the run.
        """
        self.errors += 1
        explicit = context.get("step") if isinstance(context, dict) else None
        if isinstance(error, NonFiniteError) and self.writer is not None:
            self._logged.add(id(error.anomaly))
            self.writer.log_anomaly(self._step_now(explicit), error.anomaly.to_dict())
        self._file_anomalies()
        tb = "".join(traceback.format_exception(type(error), error, error.__traceback__)[-3:])
        self._event(
            "error",
            "error",
            f"{type(error).__name__}: {error}",
            {
                "phase": str(TrainingPhase(phase)),
                "type": type(error).__name__,
                "context": _summarize(context),
                "traceback": tb,
                "epoch": self.epoch,
            },
            step=explicit,
        )

    async def update_progress_async(
        self, epoch: int, step: int, loss: Any = None, learning_rate: float | None = None, **metrics: Any
    ) -> None:
        """Record progress: ``loss``, ``learning_rate`` and ``metrics`` as scalars at ``step``.

        A tensor loss is read in a worker thread (its host transfer never blocks the loop).
        """
        writer = self._need()
        self.epoch, self.step = int(epoch), int(step)
        self._updates_at_progress = self._updates
        values: dict[str, float] = {"epoch": float(epoch)}
        if loss is not None:
            values["loss"] = float(await asyncio.to_thread(_as_float, loss))
        if learning_rate is not None:
            values["lr/0"] = float(learning_rate)
        for k, v in metrics.items():
            values[str(k)] = float(await asyncio.to_thread(_as_float, v))
        writer.log_scalars(self.step, values)  # queued for the writer's thread

    async def check_tensor_anomalies_async(
        self, tensor: torch.Tensor, name: str | None = None
    ) -> dict[str, Any]:
        """``check_tensor_anomalies`` in a worker thread; with ``enable_autograd_debug`` a NaN/Inf is an event."""
        info = await asyncio.to_thread(check_tensor_anomalies, tensor, name)
        if self.enable_autograd_debug and self.writer is not None and (info["has_nan"] or info["has_inf"]):
            self._event("tensor_anomaly", "warning", f"non-finite values in {name or 'tensor'}", info)
        return info

    async def check_gradient_anomalies_async(self, model: nn.Module) -> dict[str, Any]:
        """``check_gradient_anomalies`` in a worker thread; with ``enable_autograd_debug`` NaN/Inf is an event."""
        info = await asyncio.to_thread(check_gradient_anomalies, model)
        bad = info["params_with_nan_grad"] or info["params_with_inf_grad"]
        if self.enable_autograd_debug and self.writer is not None and bad:
            self._event("gradient_anomaly", "warning", "NaN/Inf gradients", info)
        return info

    def end_training(self, status: str = "finished") -> None:
        """Take the sentinel off and close the run (flushes the queue); idempotent."""
        self._file_anomalies()
        if self._guard is not None:
            self._guard.close(None)
            self._guard = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.writer is not None:
            self.writer.close(status)
            self.writer = None

    close = end_training

    async def __aenter__(self) -> AsyncTrainingLogger:
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        await asyncio.to_thread(self.end_training, "finished" if exc is None else "failed")


def _as_float(v: Any) -> float:
    if isinstance(v, torch.Tensor):
        return float(v.detach().float().mean())
    return float(v)


def _summarize(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return {"tensor": list(obj.shape), "dtype": str(obj.dtype).removeprefix("torch.")}
    if isinstance(obj, dict):
        return {str(k): _summarize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_summarize(v) for v in obj]
    return plain(obj)


__all__ = ["AsyncTrainingLogger", "TrainingPhase"]

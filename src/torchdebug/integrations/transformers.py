"""The Hugging Face ``Trainer`` driver of watch(): a ``TrainerCallback`` that runs the step protocol.

``Trainer._inner_training_loop`` order this callback relies on (transformers 5.x, trainer.py):

- per micro-batch ``training_step`` (1909): ``compute_loss`` (2082, the model's forward), the loss
  divided by the accumulation steps (2111), ``accelerator.backward`` (2118; ``scaler.scale(loss).backward()``
  under fp16, accelerate/accelerator.py:2856-2857);
- on the last micro-batch of a step: gradient clipping (1931; unscales a GradScaler first), then
  ``on_pre_optimizer_step`` (1934), ``optimizer.step()`` (1935: accelerate's ``AcceleratedOptimizer.step``,
  which calls ``scaler.step`` + ``scaler.update`` under fp16 and records ``step_was_skipped``,
  accelerate/optimizer.py:152-186), ``on_optimizer_step`` (1936), ``model.zero_grad()`` (1946),
  ``on_step_end`` (1949); on the other micro-batches ``on_substep_end`` (1961);
- ``on_train_begin`` (1653) after the optimizer is created and prepared; ``on_train_end`` at the end.
- ``Trainer.log`` (4189) copies ``logs`` into ``state.log_history`` and then calls every callback's
  ``on_log`` with the same dict, in the order of ``callback_handler.callbacks``: the defaults and the
  ``report_to`` integrations first, the user's callbacks after them (trainer.py:586-595). The
  ``report_to`` callbacks read ``logs`` in their ``on_log``: TensorBoardCallback writes numbers with
  ``add_scalar`` and strings with ``add_text`` at ``state.global_step`` under ``train/<key>``
  (integrations/integration_utils.py:634-655, ``rewrite_logs``); WandbCallback logs the dict with
  ``train/global_step``. So at ``on_init_end`` this callback moves itself to the front of the list,
  and its ``on_log`` adds torchdebug's values to ``logs`` before they read it. The final log of
  ``train()`` (``train_runtime``) comes before ``on_train_end``.

Hugging Face has no exception callback. So that a run is marked ``failed`` the moment training
raises: the callback raises :class:`NonFiniteError` itself and closes the run first; and it wraps
the trainer's own ``train`` (found when the callback is registered, ``on_init_end``) and
``training_step`` / ``compute_loss`` (found at ``on_train_begin``) on the instance, closing the
run as failed before any exception leaves them. The wrappers are removed when the run ends.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from torch import nn

from .._tensors import unwrap_optimizer
from ..session.monitor import Monitor
from ..session.wrappers import compiled_later
from ..sinks import Finding
from ._report import run_end, step_findings, tagged
from ._session import check_watch_kwargs, close_session, open_session

try:
    from transformers import Trainer, TrainerCallback
except ImportError as exc:
    raise ImportError(
        "torchdebug.integrations.transformers needs Hugging Face transformers: "
        "pip install 'torchdebug[transformers]'"
    ) from exc

if not hasattr(TrainerCallback, "on_pre_optimizer_step"):
    raise ImportError(
        "torchdebug.integrations.transformers needs transformers>=4.46 (TrainerCallback.on_pre_optimizer_step): "
        "pip install -U 'torchdebug[transformers]'"
    )

__all__ = ["TorchDebugCallback"]


def _find_trainer(depth: int = 12) -> Any:
    """The ``Trainer`` whose code called this callback (a few frames up), or None."""
    f: Any = sys._getframe(2)
    while f is not None and depth > 0:
        obj = f.f_locals.get("self")
        if isinstance(obj, Trainer):
            return obj
        f, depth = f.f_back, depth - 1
    return None


class TorchDebugCallback(TrainerCallback):  # type: ignore[misc]
    """Watch the model under ``transformers.Trainer``: the NaN/Inf sentinel and instruments of :func:`watch`.

    Args:
        **watch_kwargs: the options of :func:`torchdebug.watch` (``policy``, ``run``, ``config`` ...);
            the model and optimizer come from the trainer.

    The gradients are checked at ``on_pre_optimizer_step`` (after the last micro-batch's backward,
    before ``optimizer.step()``); accelerate's ``AcceleratedOptimizer`` is unwrapped, its GradScaler
    is known from the first step, and an update the scaler skipped (``step_was_skipped``) is recorded
    as a skipped step. ``policy="skip"`` drops the bad step's gradients so the update does nothing;
    ``"raise"`` stops ``train()`` with :class:`torchdebug.NonFiniteError` and the run is ``failed``.
    Pass the callback to ``Trainer(callbacks=[...])`` so any exception from ``train()`` marks the run
    failed; added later with ``add_callback``, exceptions outside ``training_step`` and the check are
    seen only from the next ``train()`` call.

    Raises:
        TypeError / ValueError: an unknown option, ``model=``/``optimizer=``, or a bad policy.
        ImportError: transformers is not installed (``pip install 'torchdebug[transformers]'``).

    Example::

        from torchdebug.integrations.transformers import TorchDebugCallback
        trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[TorchDebugCallback()])
        trainer.train()

    The trainer's ``report_to`` ships torchdebug's findings: at each ``on_log`` the callback adds to
    ``logs`` the last step's own scalars (``torchdebug/loss``, ``torchdebug/grad_norm``,
    ``torchdebug/lr/0`` ..., the run folder's values of torchdebug step ``state.global_step - 1``),
    the anomalies and rule events since the previous log as text (``torchdebug/anomalies``: the full
    block; ``torchdebug/events``), and in the final log ``torchdebug/status``, ``torchdebug/verdict``
    and ``torchdebug/run_folder``. The integrations prefix them (TensorBoard and W&B:
    ``train/torchdebug/loss``); MLflow's takes the numbers only.

    Cost: that of :func:`watch` (one host transfer per optimizer step); a dict copy of each batch's
    references (so a batch tensor only the loss used can be named).
    """

    def __init__(self, **watch_kwargs: Any) -> None:
        super().__init__()
        self.watch_kwargs = check_watch_kwargs("TorchDebugCallback", watch_kwargs)
        self.monitor: Monitor | None = None
        self._patched: list[tuple[Any, str]] = []  # (trainer, attribute) wrapped on the instance
        self._trainer: Any = None
        self._unlogged: list[Finding] = []  # findings since the last on_log

    def _live(self) -> Monitor | None:
        mon = self.monitor
        return None if mon is None or mon.closed else mon

    # -- lifecycle -------------------------------------------------------------------------------
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = _find_trainer()
        if trainer is not None and "train" not in vars(trainer):
            self._wrap(trainer, "train", self._guard(trainer.train))
        callbacks = getattr(getattr(trainer, "callback_handler", None), "callbacks", None)
        if isinstance(callbacks, list) and self in callbacks:
            # first, so the report_to callbacks read what on_log adds. The handler is iterating this list
            # right now: taking us out and putting us in front leaves the callbacks after us in place.
            callbacks.remove(self)
            callbacks.insert(0, self)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        close_session(self.monitor, None)  # a previous train() that ended without on_train_end
        self._unlogged = []
        model: nn.Module = kwargs["model"]
        trainer = self._trainer = _find_trainer()
        # model_wrapped: DDP(model) under several ranks, prepared before on_train_begin (trainer.py:1615, 1781)
        wrapped = getattr(trainer, "model_wrapped", None)
        self.monitor = mon = open_session(model, "transformers", self.watch_kwargs, wrapper=wrapped)
        opt = kwargs.get("optimizer")
        if opt is not None:
            mon.owns_optimizer(unwrap_optimizer(opt))  # adopt it: the skipped-step rules know it
        if trainer is None:
            return
        scaler = getattr(getattr(trainer, "accelerator", None), "scaler", None)
        if scaler is not None and mon.scaler is None:
            mon.scaler = scaler  # fp16: known from step 0, so the first loss is reported unscaled
        if "training_step" not in vars(trainer):
            self._wrap(trainer, "training_step", self._guard(trainer.training_step))
        if "compute_loss" not in vars(trainer):
            self._wrap(trainer, "compute_loss", self._keep_batch(trainer.compute_loss))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close(None)

    def _close(self, exc: BaseException | None) -> None:
        for trainer, name in [p for p in self._patched if p[1] != "train"]:
            vars(trainer).pop(name, None)  # the class's method again
        self._patched = [p for p in self._patched if p[1] == "train"]
        close_session(self.monitor, exc)  # the monitor stays readable: .anomalies, .records, .run_dir

    def _wrap(self, trainer: Any, name: str, fn: Any) -> None:
        setattr(trainer, name, fn)
        self._patched.append((trainer, name))

    def _guard(self, method: Any) -> Any:
        @functools.wraps(method)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs)
            except BaseException as exc:
                self._close(exc)  # HF has no exception callback: the run is failed from here
                raise

        return guarded

    def _keep_batch(self, method: Any) -> Any:
        @functools.wraps(method)
        def compute_loss(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            mon = self._live()
            if mon is not None:
                # references only; a copy because user code pops keys (a per-token weight) from it
                mon.batch = dict(inputs) if isinstance(inputs, dict) else inputs
                if model is not mon.called:  # torch_compile=True: a wrapper made after on_train_begin
                    compiled_later(mon, model)
            return method(model, inputs, *args, **kwargs)

        return compute_loss

    # -- the step protocol -----------------------------------------------------------------------
    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        mon = self._live()
        if mon is None:
            return
        raw = unwrap_optimizer(kwargs.get("optimizer"))
        try:
            mon.stepper.update_starting(raw)  # the step's one transfer + the check
        except BaseException as exc:
            self._close(exc)  # marked failed before NonFiniteError leaves the callback
            raise

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        mon = self._live()
        if mon is None:
            return
        opt = kwargs.get("optimizer")
        if not getattr(opt, "step_was_skipped", False):  # accelerate: the GradScaler skipped the update
            mon.stepper.update_done(unwrap_optimizer(opt))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        mon = self._live()
        if mon is None:
            return
        try:
            record = mon.step()
        except BaseException as exc:
            self._close(exc)
            raise
        if record.anomaly is not None or record.events:
            self._unlogged += step_findings(record)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        mon = self._live()
        if mon is None or not isinstance(logs, dict):
            return
        logs.update(tagged(mon.step_scalars))  # torchdebug step state.global_step - 1
        found, self._unlogged = self._unlogged, []
        anomalies = [f.text() for f in found if f.kind == "anomaly"]
        events = [f.text() for f in found if f.kind != "anomaly"]
        if anomalies:
            logs["torchdebug/anomalies"] = "\n\n".join(anomalies)
        if events:
            logs["torchdebug/events"] = "\n".join(events)
        if "train_runtime" in logs:  # the last log of train(): the loop finished
            end = run_end(mon, "finished")
            logs["torchdebug/status"] = end.status
            logs["torchdebug/verdict"] = end.verdict
            if end.path is not None:
                logs["torchdebug/run_folder"] = str(end.path)

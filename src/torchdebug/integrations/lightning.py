"""The Lightning driver of watch(): a ``Callback`` that runs the step protocol where Lightning owns the loop.

Lightning 2.x hook order this callback relies on (lightning/pytorch, 2.6):

- automatic optimization: ``LightningModule.optimizer_step`` -> ``optimizer.step(closure)``; the
  precision plugin's ``_wrap_closure`` runs the closure (``training_step``, ``zero_grad``, backward)
  and then ``on_before_optimizer_step`` (plugins/precision/precision.py:109-110, 87), all inside
  ``optimizer.step``: the optimizer's step pre-hook fires before the forward, so the check runs at
  ``on_before_optimizer_step`` instead. With a GradScaler (``16-mixed``) the closure runs, then
  ``scaler.unscale_``, then ``on_before_optimizer_step``, then ``scaler.step`` (plugins/precision/amp.py:79-96).
- gradient accumulation: the closure runs without ``optimizer.step`` on accumulating batches
  (loops/optimization/automatic.py:183-190); ``on_before_optimizer_step`` fires on the stepping batch only.
- manual optimization: ``LightningOptimizer.step`` -> ``strategy.optimizer_step`` -> the same
  precision plugin path (core/optimizer.py:146-156), so ``on_before_optimizer_step`` fires there too.
- ``on_train_batch_end`` comes after the batch's optimizer step (loops/training_epoch_loop.py:350-374).
- ``strategy.setup`` (DDP's wrapper around the LightningModule, ``strategy.model``) runs before
  ``on_fit_start`` (trainer/trainer.py:1053-1057); with a wrapper, ``strategy.training_step`` calls
  ``training_step`` through the wrapper's forward, patching the module's ``forward`` for that call
  (``_ForwardRedirection``, strategies/strategy.py:388-390, 602-643).
- an exception in ``fit`` calls ``on_exception`` and re-raises (trainer/call.py:67-78), then each
  logger's ``finalize("failed")`` (call.py:83); after ``on_fit_end`` the teardown finalizes the
  loggers with "success" (call.py:149), so the verdict reaches them before they close.
- Lightning logs the user's training metrics after ``on_train_batch_end`` at
  ``step = fit_loop.epoch_loop._batches_that_stepped`` (the number of optimizer steps before this
  one, logger_connector.py:123: torchdebug's step index) when ``(step + 1) % log_every_n_steps == 0``
  (logger_connector.py:59-64); the callback forwards its scalars on the same steps.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._tensors import unwrap_optimizer
from ..session.monitor import Monitor
from ..sinks import MlflowSink, RunInfo, Sink, SinkHub, TensorBoardSink, WandbSink
from ._report import anomaly_finding, marks, run_end, step_findings, tagged
from ._session import check_watch_kwargs, close_session, open_session

try:
    from lightning.pytorch import Callback
except ImportError:
    try:
        from pytorch_lightning import Callback  # type: ignore[assignment]  # the older package name, same hooks
    except ImportError as exc:
        raise ImportError(
            "torchdebug.integrations.lightning needs Lightning: pip install 'torchdebug[lightning]'"
        ) from exc

__all__ = ["TorchDebugCallback"]


class TorchDebugCallback(Callback):  # type: ignore[misc]
    """Watch a LightningModule under ``Trainer.fit``: the NaN/Inf sentinel and instruments of :func:`watch`.

    Args:
        **watch_kwargs: the options of :func:`torchdebug.watch` (``policy``, ``run``, ``config`` ...);
            the model and optimizer come from the trainer.

    Module names are relative to the LightningModule (``model.blocks.0.attn`` when ``training_step``
    calls ``self.model(x)``). With several optimizers (manual optimization, a GAN's ``self.G`` and
    ``self.D``) each child that holds parameters is a model of the step (``td.watch`` of several
    models): every forward of each is recorded, the learning rates are ``lr/G/0`` and ``lr/D/0``. The gradients are checked at ``on_before_optimizer_step``, after the
    closure's forward and backward and before the update, in automatic and manual optimization, with
    gradient accumulation and the AMP precision plugins. ``policy="skip"`` drops the bad step's
    gradients so the update does nothing and training goes on; ``"raise"`` stops ``fit`` with
    :class:`torchdebug.NonFiniteError` and the run is marked ``failed``.

    Raises:
        TypeError / ValueError: an unknown option, ``model=``/``optimizer=``, or a bad policy.
        ImportError: Lightning is not installed (``pip install 'torchdebug[lightning]'``).

    Example::

        from torchdebug.integrations.lightning import TorchDebugCallback
        trainer = L.Trainer(callbacks=[TorchDebugCallback(policy="raise")])
        trainer.fit(model, loader)

    Findings reach every logger in ``trainer.loggers`` (TensorBoard, W&B, MLflow, CSV ...) with no
    ``report_to``: the step's own scalars (``torchdebug/loss``, ``torchdebug/grad_norm``,
    ``torchdebug/lr/0`` ..., the run folder's values) through ``logger.log_metrics`` at torchdebug's
    step on the steps Lightning logs (``log_every_n_steps``); each anomaly and rule event as a marker
    metric (1.0 under ``torchdebug/anomaly`` / ``torchdebug/events/<kind>``) at its step. Loggers with
    a text channel get the findings themselves through the matching sink on their experiment
    (TensorBoard text, a W&B alert and findings table, MLflow tags and JSON artifacts) and the
    verdict at the end; any other logger gets ``torchdebug/status``, ``torchdebug/verdict`` and
    ``torchdebug/run_folder`` through ``log_hyperparams`` when the fit ends.

    Cost: that of :func:`watch` (one host transfer per optimizer step), plus on the first training
    batch a forward pre-hook on each module to find the one ``training_step`` calls, plus one
    ``log_metrics`` per logger on logging steps (Lightning's own cost for a logged value).
    """

    def __init__(self, **watch_kwargs: Any) -> None:
        super().__init__()
        self.watch_kwargs = check_watch_kwargs("TorchDebugCallback", watch_kwargs)
        self.monitor: Monitor | None = None
        self._handles: list[Any] = []
        self._finding: list[Any] = []
        self._in_batch = False
        self._root_depth = 0
        self._stepped = False
        self._loggers: list[Any] = []  # trainer.loggers (rank zero)
        self._plain_loggers: list[Any] = []  # those without a sink: the verdict via log_hyperparams
        self._every = 50
        self._hub: SinkHub | None = None
        self._sent = 0  # anomalies forwarded so far

    # -- lifecycle -------------------------------------------------------------------------------
    def on_fit_start(self, trainer: Any, pl_module: nn.Module) -> None:
        close_session(self.monitor, None)  # a previous fit that ended without our hooks
        models = _models(pl_module, trainer.optimizers)
        name = type(pl_module).__name__ if isinstance(models, dict) else None
        # strategy.setup (DDP's wrapper around the module) ran before on_fit_start (trainer.py:1053-1057)
        self.monitor = open_session(models, "lightning", self.watch_kwargs, name, trainer.strategy.model)
        self._stepped = False
        scaler = getattr(trainer.precision_plugin, "scaler", None)  # "16-mixed": known from step 0
        if scaler is not None and self.monitor.scaler is None:
            self.monitor.scaler = scaler
        for opt in trainer.optimizers:
            raw = unwrap_optimizer(opt)
            self.monitor.owns_optimizer(raw)  # adopt it: the skipped-step rules know an optimizer exists
            self._handles.append(raw.register_step_post_hook(self._after_update))
        if self.monitor.roots is None:  # several models: each one's forward is already a root
            if trainer.strategy.model is not pl_module:  # DDP ...: training_step runs as its forward
                self._hook_root(pl_module)
            self._find_entry(pl_module)
        self._open_loggers(trainer)

    def on_fit_end(self, trainer: Any, pl_module: nn.Module) -> None:
        self._close(None)

    def on_exception(self, trainer: Any, pl_module: nn.Module, exception: BaseException) -> None:
        self._close(exception)

    def teardown(self, trainer: Any, pl_module: nn.Module, stage: str) -> None:
        self._close(None)  # no-op after on_fit_end / on_exception

    def _close(self, exc: BaseException | None) -> None:
        self._unhook()
        live = self._live() is not None
        close_session(self.monitor, exc)  # the monitor stays readable: .anomalies, .records, .run_dir
        if live:
            self._close_loggers("failed" if exc is not None else "finished")

    # -- the trainer's loggers -------------------------------------------------------------------
    def _open_loggers(self, trainer: Any) -> None:
        self._loggers = list(trainer.loggers) if getattr(trainer, "is_global_zero", True) else []
        self._every = max(int(getattr(trainer, "log_every_n_steps", 50) or 0), 0)
        sinks: list[Sink] = []
        self._plain_loggers = []
        for lg in self._loggers:
            sink = _logger_sink(lg)
            if sink is None:
                self._plain_loggers.append(lg)
            else:
                sinks.append(sink)
        mon = self.monitor
        self._hub = None
        self._sent = 0
        if sinks and mon is not None:
            info = RunInfo(name=type(mon.model).__name__.lower(), path=mon.run_dir)
            self._hub = SinkHub(sinks, info)  # findings only: scalars go through log_metrics

    def _forward(self, mon: Monitor, record: Any) -> None:
        """The step's findings (always) and scalars (on logging steps) to every logger."""
        findings = step_findings(record)
        values: dict[str, float] = {}
        if self._every and (record.step + 1) % self._every == 0:
            values = tagged(mon.step_scalars)
        if record.anomaly is not None:
            self._sent = len(mon.anomalies)
        if findings:
            values.update(marks(findings))
            if self._hub is not None:
                self._hub.put(list(findings))
        if values:
            for lg in self._loggers:
                lg.log_metrics(values, step=record.step)
        hub = self._hub
        if hub is not None and hub.pending:
            hub.warn()

    def _close_loggers(self, status: str) -> None:
        mon = self.monitor
        if mon is None or not self._loggers:
            return
        end = run_end(mon, status)
        late = [anomaly_finding(a) for a in mon.anomalies[self._sent :]]  # raised before the step ended
        if late:
            for lg in self._loggers:
                for f in late:
                    lg.log_metrics(marks([f]), step=f.step)
            if self._hub is not None:
                self._hub.put(list(late))
        hub, self._hub = self._hub, None
        if hub is not None:
            hub.close(status, end.last_step, steps=mon.global_step)  # its scalars went through log_metrics
        fields = {"torchdebug/status": end.status, "torchdebug/verdict": end.verdict}
        if end.path is not None:
            fields["torchdebug/run_folder"] = str(end.path)
        if end.first_anomaly is not None:
            fields.update(end.first_anomaly.first_anomaly_fields())
        for lg in self._plain_loggers:
            lg.log_hyperparams(fields)

    def _live(self) -> Monitor | None:
        mon = self.monitor
        return None if mon is None or mon.closed else mon

    def _unhook(self) -> None:
        for h in self._handles + self._finding:
            h.remove()
        self._handles.clear()
        self._finding.clear()

    # -- the step protocol -----------------------------------------------------------------------
    def on_train_batch_start(self, trainer: Any, pl_module: nn.Module, batch: Any, batch_idx: int) -> None:
        self._in_batch = True
        mon = self._live()
        if mon is not None:
            mon.batch = batch  # names a batch tensor that only the loss code used, in a replay

    def on_before_optimizer_step(self, trainer: Any, pl_module: nn.Module, optimizer: Any) -> None:
        mon = self._live()
        if mon is None:
            return
        self._stepped = True
        raw = unwrap_optimizer(optimizer)
        mon.owns_optimizer(raw)
        mon.stepper.update_starting(raw)  # the step's one transfer + the check; may raise NonFiniteError

    def _after_update(self, opt: Any, args: Any, kwargs: Any) -> None:
        # the optimizer's own step post-hook: the update ran (not skipped by a GradScaler)
        mon = self._live()
        if mon is not None and self._stepped:
            mon.stepper.update_done(opt)

    def on_train_batch_end(
        self, trainer: Any, pl_module: nn.Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._in_batch = False
        mon = self._live()
        if mon is not None and self._stepped:
            self._stepped = False
            record = mon.step()  # accumulating batches end without an optimizer step: not a step
            if self._loggers:
                self._forward(mon, record)

    # -- which module training_step calls --------------------------------------------------------
    def _hook_root(self, pl_module: nn.Module) -> None:
        """The session's root hooks on the LightningModule, minus the call that is ``training_step``.

        A strategy that wraps the module (DDP) calls ``training_step`` through the wrapper's forward:
        it patches the module's ``forward`` to run ``training_step`` and calls the wrapper
        (``_ForwardRedirection``, strategies/strategy.py:602-643). That call is the training step, not
        a forward: the forward is the module it calls (found as without a wrapper), or ``self(x)``
        inside it (whose ``forward`` is the class's again by then, so these hooks see it)."""
        mon = self.monitor
        assert mon is not None
        mon._plain.hook_roots([])  # the session's own root hooks would capture the redirected call
        skipped: list[bool] = []

        def pre(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            skipped.append(_redirected(mod))
            if not skipped[-1]:
                mon.stepper.forward_started(mod, args, kwargs)

        def post(mod: nn.Module, args: tuple, out: Any) -> None:
            if skipped and not skipped.pop():
                mon.stepper.forward_done(mod, args, out)

        self._handles.append(pl_module.register_forward_pre_hook(pre, with_kwargs=True))
        self._handles.append(pl_module.register_forward_hook(post))

    def _find_entry(self, pl_module: nn.Module) -> None:
        """Hook the module ``training_step`` calls first: the LightningModule itself (``self(x)``, the
        session's own hooks) or a submodule (``self.model(x)``, which the root's hooks never see)."""

        redirected: list[bool] = []

        def root_pre(mod: nn.Module, args: Any) -> None:
            redirected.append(_redirected(mod))  # the wrapper's call of training_step: not a forward
            self._root_depth += not redirected[-1]

        def root_post(mod: nn.Module, args: Any, out: Any) -> None:
            if redirected and redirected.pop():
                return
            self._root_depth -= 1
            if self._in_batch and torch.is_grad_enabled():
                self._stop_finding()  # self(x): the session's root hooks capture it

        def child_pre(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            mon = self._live()
            if mon is None or self._root_depth or not self._in_batch or not torch.is_grad_enabled():
                return
            self._stop_finding()
            self._handles.append(mod.register_forward_pre_hook(mon.stepper.forward_started, with_kwargs=True))
            self._handles.append(mod.register_forward_hook(mon.stepper.forward_done))
            mon.stepper.forward_started(
                mod, args, kwargs
            )  # this call's pre-hooks were gathered before ours was added

        self._finding.append(pl_module.register_forward_pre_hook(root_pre))
        self._finding.append(pl_module.register_forward_hook(root_post))
        for mod in pl_module.modules():
            if mod is not pl_module:
                self._finding.append(mod.register_forward_pre_hook(child_pre, with_kwargs=True))

    def _stop_finding(self) -> None:
        for h in self._finding:
            h.remove()
        self._finding.clear()


def _redirected(pl_module: nn.Module) -> bool:
    """This call of the LightningModule is a strategy's redirection of ``training_step`` through its
    wrapper (its ``forward`` patched on the instance by ``_ForwardRedirection`` for this call)."""
    fwd = vars(pl_module).get("forward")
    return fwd is not None and "_ForwardRedirection" in getattr(fwd, "__qualname__", "")


def _models(pl_module: nn.Module, optimizers: list[Any]) -> nn.Module | dict[str, nn.Module]:
    """What the session watches: the LightningModule, or with several optimizers (manual optimization:
    a GAN's generator and discriminator) its children that hold parameters, each a model of the step
    (its every forward recorded for the replay, its optimizer's ``lr/<child>/<group>``), named as in the
    LightningModule (``D.0``). A LightningModule with parameters of its own stays one model."""
    if len(optimizers) < 2 or any(True for _ in pl_module.parameters(recurse=False)):
        return pl_module
    children = {n: m for n, m in pl_module.named_children() if any(True for _ in m.parameters())}
    return children if len(children) > 1 else pl_module


def _logger_sink(logger: Any) -> Sink | None:
    """The sink that writes findings into a Lightning logger's experiment, for loggers with text."""
    kind = type(logger).__name__
    if kind == "TensorBoardLogger":
        return TensorBoardSink(writer=logger.experiment)
    if kind == "WandbLogger":
        return WandbSink(run=logger.experiment)
    if kind == "MLFlowLogger":
        return MlflowSink(logger.run_id, client=logger.experiment)
    return None

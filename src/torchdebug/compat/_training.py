"""Seed-era training facades: PyTorchDebugManager, TrainingDebugger, GradientDebugger, ModelDebugger."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..events import Anomaly, RuleEvent, is_anomalous, plain, training_summary
from ..health.gradients import GradientFlow, GradientReport, analyze_gradient_flow, check_gradients
from ..health.inspection import ModelSummary, call_model, inspect_model
from ..health.instrument import (
    ExplosionRule,
    LossPlateauRule,
    LossSpikeRule,
    VanishingRule,
    layer_norms,
    top_params,
)
from ..memory.analysis import PyTorchMemoryDebugger, memory_sample
from ..stats import foreach_norms, total_norm
from ._common import (
    HISTORY_SIZE,
    grad_norms,
    nonfinite_optimizer_state,
    optimizer_state_anomaly,
    replay_origin,
    resolve_config,
    rng_state,
    symptom_anomaly,
)
from ._debugger import (
    AutogradAnomalyDetector,
    PyTorchDebugger,
    _activation_capture,
    _trainable,
    log,
    tracing_active,
)
from ._inputs import prediction_problems
from ._seedconfig import PyTorchDebugConfig
from ._tracing import take_traced_anomaly


@dataclass
class StepNumbers:
    """One step's numbers after their single host transfer."""

    loss: float
    grad_norm: float
    param_norm: float | None
    names: list[str]  # parameters with a gradient, in named_parameters order
    norms: list[float]  # their gradient L2 norms

    @property
    def bad_params(self) -> list[str]:
        return [n for n, v in zip(self.names, self.norms) if not math.isfinite(v)]

    @property
    def loss_bad(self) -> bool:
        return not math.isfinite(self.loss)

    @property
    def nonfinite(self) -> bool:
        return self.loss_bad or bool(self.bad_params)

    @property
    def kind(self) -> str:
        return "nan" if math.isnan(self.loss) or any(math.isnan(v) for v in self.norms) else "inf"


def step_numbers(model: nn.Module, loss: torch.Tensor, *, with_params: bool = False) -> StepNumbers:
    """Loss, total and per-parameter gradient norms (and the parameters' total norm) in ONE host transfer.

    The total gradient norm is ``stats.total_norm`` of the fused per-parameter norms: the same
    value ``clip_grad_norm_(model.parameters(), max_norm)`` returns. NaN/Inf in a gradient shows as a
    non-finite per-parameter norm (what the engine's sentinel checks).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss must be a tensor (the value backward ran on), got {type(loss).__name__}")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    idx, norms = grad_norms(params)
    lv = loss.detach().float().mean()
    dev = lv.device
    with torch.no_grad():
        parts = [lv.reshape(1), (total_norm(norms) if norms is not None else torch.zeros(())).reshape(1)]
        if with_params:
            pn = total_norm(foreach_norms([p.detach() for p in params])) if params else torch.zeros(())
            parts.append(pn.reshape(1))
        if norms is not None:
            parts.append(norms)
        host = torch.cat([t.to(dev, torch.float32) for t in parts]).tolist()  # the step's one host transfer
    k = 3 if with_params else 2
    return StepNumbers(
        loss=host[0],
        grad_norm=host[1],
        param_norm=host[2] if with_params else None,
        names=[named[i][0] for i in idx],
        norms=host[k:],
    )


class TrainingDebugger(PyTorchDebugger):
    """Seed 002/003's training debugger: per-step gradient and loss health with robust rules.

    ``monitor_training_step(model, loss, step)`` (after ``backward``, before ``optimizer.step()``)
    reads the loss and every gradient norm in one host transfer and feeds the engine's rules:
    exploding gradients (``ExplosionRule``: robust log-space z-score over a running window, or
    ``explode_abs``), vanishing gradients (``VanishingRule``: a layer at or below
    ``vanish_threshold`` for ``vanish_patience`` steps), loss spikes and plateaus. A NaN/Inf loss or
    gradient is an anomaly, recorded and warned or raised per ``config.anomaly_detection_mode``.

    Args:
        config: a ``DebugLevel`` (seed 002), ``DebugConfig``, ``PyTorchDebugConfig``, mapping or None.

    Example::

        dbg = TrainingDebugger(DebugLevel.ADVANCED)
        for step in range(n):
            loss = loss_fn(model(x), y); loss.backward()
            info = dbg.monitor_training_step(model, loss, step)
            optimizer.step(); optimizer.zero_grad()
        print(dbg.get_training_summary()["anomaly_rate"])

    Cost per step: fused gradient norms and one host transfer, plus two memory samples.
    """

    def __init__(self, config: Any = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        # a DiffusionModelDebugger attached here is counted in td.serve()'s diffusion_debugger block
        self.diffusion_debugger: Any = None
        self._reset_rules()

    def _reset_rules(self) -> None:
        c = self.config
        self.total_steps = 0
        self.anomaly_steps = 0
        self.loss_anomalies = 0
        self.gradient_explosions = 0
        self.gradient_vanishing = 0
        self._rule_explode = ExplosionRule(
            mads=c.explode_mads, abs_threshold=c.explode_abs, warmup=c.explode_warmup
        )
        self._rule_vanish = VanishingRule(threshold=c.vanish_threshold, patience=c.vanish_patience)
        self._rule_spike = LossSpikeRule(mads=c.loss_spike_mads, warmup=c.explode_warmup)
        self._rule_plateau = LossPlateauRule(window=c.loss_plateau_window, rel=c.loss_plateau_rel)

    def clear_debug_history(self) -> None:
        """Forget the history, anomalies, counters and the rules' running statistics."""
        super().clear_debug_history()
        self._reset_rules()

    def monitor_training_step(self, model: nn.Module, loss: torch.Tensor, step: int) -> dict[str, Any]:
        """Check one step after ``backward``: returns the step's numbers, anomaly and rule events.

        Returns:
            ``{"step", "loss", "gradient_norm", "nonfinite_gradients": [names], "loss_anomaly": bool,
            "gradient_explosion": bool, "gradient_vanishing": [layers], "anomaly": Anomaly | None,
            "events": [RuleEvent]}``.

        Raises:
            NonFiniteError: mode "raise" and the loss or a gradient is NaN/Inf (raise before
            ``optimizer.step()`` and the weights stay finite).
        """
        return self._observe(model, loss, step, locate=None)

    def _observe(
        self, model: nn.Module, loss: torch.Tensor, step: int, locate: Callable[[], Anomaly | None] | None
    ) -> dict[str, Any]:
        with self._context("training_step", type(model).__name__, batch=int(step), model=model) as info:
            n = step_numbers(model, loss)
            info.gradient_norm = n.grad_norm
            self.total_steps += 1
            out: dict[str, Any] = {
                "step": step,
                "loss": n.loss,
                "gradient_norm": n.grad_norm,
                "nonfinite_gradients": n.bad_params,
                "loss_anomaly": n.loss_bad,
                "gradient_explosion": False,
                "gradient_vanishing": [],
                "anomaly": None,
                "events": info.events,
            }
            events = []
            if math.isfinite(n.grad_norm):
                ev = self._rule_explode.update(step, n.grad_norm, top_params(n.names, n.norms))
                if ev is not None:
                    self.gradient_explosions += 1
                    out["gradient_explosion"] = True
                    events.append(ev)
                ev = self._rule_vanish.update(step, layer_norms(n.names, n.norms))
                if ev is not None:
                    self.gradient_vanishing += 1
                    out["gradient_vanishing"] = list(ev.modules)
                    events.append(ev)
            for rule in (self._rule_spike, self._rule_plateau):
                ev = rule.update(step, n.loss)
                if ev is not None:
                    self.loss_anomalies += 1
                    events.append(ev)
            if n.loss_bad:
                self.loss_anomalies += 1
            info.events.extend(events)
            for ev in events:
                log.log(logging.INFO if ev.severity == "info" else logging.WARNING, "%s", ev)
            if is_anomalous(True if n.nonfinite else None, [e.severity for e in events]):
                self.anomaly_steps += 1
                info.anomaly_detected = True
            # inside a traced block: the trace's origin (None when it was reported already)
            traced_anomaly = take_traced_anomaly() if n.nonfinite and tracing_active() else None
            if traced_anomaly is not None:
                out["anomaly"] = traced_anomaly
                self._report(info, traced_anomaly)
            elif n.nonfinite and not tracing_active():
                anomaly = locate() if locate is not None else None
                if anomaly is None:
                    anomaly = symptom_anomaly(
                        model, loss_bad=n.loss_bad, bad_params=n.bad_params, kind=n.kind, step=step
                    )
                out["anomaly"] = anomaly
                self._report(info, anomaly)
        return out

    def debug_training_step(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[..., torch.Tensor],
        inputs: Any,
        targets: Any,
        step: int,
    ) -> dict[str, Any]:
        """One complete step (zero grads, forward, loss, backward, check, optimizer step), seed 003.

        Like ``monitor_training_step``; on a NaN/Inf the step is replayed under the op-level tracer
        (same RNG; grads, buffers and RNG restored) so the anomaly names its origin, and the
        optimizer update is skipped (``"skipped": True``) so the weights stay finite.

        Raises:
            NonFiniteError: mode "raise" and the step produced a NaN/Inf (before the update).
        """
        rng = rng_state(any(p.is_cuda for p in model.parameters()))
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(call_model(model, inputs), targets)
        loss.backward()

        def locate() -> Anomaly | None:
            return replay_origin(model, _step_fn(model, loss_fn), inputs, targets, rng=rng, step=step)

        out = self._observe(model, loss, step, locate=locate)
        bad = bool(out["nonfinite_gradients"]) or out["loss_anomaly"]
        if not bad:
            bad = self._state_refused(model, optimizer, step, out)
        if not bad:
            optimizer.step()
        out["skipped"] = bad
        return out

    def _state_refused(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int, out: dict[str, Any]
    ) -> bool:
        """Judge the update before it lands: a NaN/Inf in the optimizer state skips it (recorded, warned
        or raised per the mode, naming ``<Optimizer>.step``). True when the update must not run."""
        state_bad = nonfinite_optimizer_state(model, optimizer)
        if not state_bad:
            return False
        anomaly = optimizer_state_anomaly(model, optimizer, state_bad, step)
        out["anomaly"] = anomaly
        self.anomaly_steps += 1
        self._report(self.debug_history[-1], anomaly)  # the step's record (from _observe)
        return True

    def __torchdebug_session__(self) -> Any:
        """The live-session view ``td.serve()`` talks to: this debugger's summaries, level and history."""
        from ._serving import TrainingDebuggerSession

        return TrainingDebuggerSession(self)

    def get_training_summary(self) -> dict[str, Any]:
        """Seed 002's summary: counts and rates since the last ``clear_debug_history()``.

        ``anomaly_steps`` counts steps with a NaN/Inf or a warning-level rule event;
        ``gradient_explosions``/``gradient_vanishing`` count rule events (an episode fires once);
        ``loss_anomalies`` counts NaN/Inf losses plus loss spike/plateau events. Rates divide by
        ``total_steps`` (0 when there were none).
        """
        return training_summary(
            self.total_steps,
            self.anomaly_steps,
            self.gradient_explosions,
            self.gradient_vanishing,
            self.loss_anomalies,
        )


def _step_fn(model: nn.Module, loss_fn: Callable[..., torch.Tensor]) -> Callable[[Any, Any], None]:
    def step(inputs: Any, targets: Any) -> None:
        loss_fn(call_model(model, inputs), targets).backward()

    return step


class GradientDebugger:
    """Seed 003's gradient debugger over ``td.gradients``: checks, flow, clipping, with a bounded history.

    ``check_gradients`` also feeds the robust explosion rule; with ``config.clip_on_spike`` set
    (``PyTorchDebugConfig.gradient_clip_threshold``) an explosion clips the gradients to it.

    Example::

        gd = GradientDebugger()
        loss.backward()
        report = gd.check_gradients(model, step)
        print(report)          # ranked table, NaN/Inf first
        gd.clip_gradients(model, max_norm=1.0)
    """

    def __init__(self, config: Any = None, *, history_size: int = HISTORY_SIZE) -> None:
        self.config, _ = resolve_config(config)
        self.history: deque[dict[str, Any]] = deque(maxlen=history_size)
        self.clip_history: deque[dict[str, Any]] = deque(maxlen=history_size)
        self.events: deque[RuleEvent] = deque(maxlen=history_size)
        c = self.config
        self._rule = ExplosionRule(mads=c.explode_mads, abs_threshold=c.explode_abs, warmup=c.explode_warmup)
        self._calls = 0
        self.checks = 0  # check_gradients calls (the manager's report counts them as operations)
        self.anomalous_checks = 0  # ... of which events.is_anomalous: NaN/Inf or a warning-level event
        self.last_model: Any = None  # a weak reference to the model last checked

    def check_gradients(self, model: nn.Module, step: int | None = None) -> GradientReport:
        """``td.health.gradients.check_gradients`` (one host transfer), recorded with ``step``.

        Returns:
            The engine's ``GradientReport`` (``.total_norm``, ``.nonfinite``, ``.exploding``,
            ``.vanishing``, ``str()`` a ranked table, ``.to_dict()``).
        """
        rep = check_gradients(model, explode_abs=self.config.explode_abs)
        at = self._calls if step is None else int(step)
        self._calls += 1
        self.checks += 1
        self.last_model = weakref.ref(model)
        severities: list[str] = []
        entry: dict[str, Any] = {
            "step": at,
            "total_norm": rep.total_norm,
            "nonfinite": list(rep.nonfinite),
            "exploding": list(rep.exploding),
            "vanishing": list(rep.vanishing),
            "clipped": False,
        }
        if math.isfinite(rep.total_norm):
            top = [(p.name, p.norm) for p in rep.ranked()[:3] if p.norm is not None]
            ev = self._rule.update(at, rep.total_norm, top)
            if ev is not None:
                self.events.append(ev)
                severities.append(ev.severity)
                log.warning("%s", ev)
                if self.config.clip_on_spike is not None:
                    self.clip_gradients(model, self.config.clip_on_spike)
                    entry["clipped"] = True
        self.history.append(entry)
        if is_anomalous(True if rep.nonfinite else None, severities):
            self.anomalous_checks += 1
        return rep

    def analyze_gradient_flow(self, model: nn.Module, example_input: Any = None) -> GradientFlow:
        """Per-layer mean/max |grad| in forward order (``td.health.gradients.analyze_gradient_flow``)."""
        return analyze_gradient_flow(model, example_input)

    def clip_gradients(self, model: nn.Module, max_norm: float, norm_type: float | str = 2.0) -> float:
        """``clip_grad_norm_`` on the model's parameters; returns (and records) the norm before clipping.

        Raises:
            ValueError: ``max_norm`` is not a positive number.

        Cost: one host transfer (the returned float).
        """
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
            raise ValueError(f"max_norm must be a positive number, got {max_norm!r}")
        total = float(
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type=float(norm_type))
        )
        self.clip_history.append(
            {"max_norm": float(max_norm), "total_norm": total, "clipped": total > max_norm}
        )
        return total


class ModelDebugger:
    """Seed 003's model debugger over ``td.health.inspection.inspect_model``."""

    def __init__(self, config: Any = None) -> None:
        self.config, _ = resolve_config(config)

    def inspect_model(
        self, model: nn.Module, input_shape: Sequence[int] | None = None, example_input: Any = None
    ) -> ModelSummary:
        """Per-module summary (parameters, bytes, output shapes with an input); see ``inspect_model``."""
        if example_input is not None:
            return inspect_model(model, example_input)
        return inspect_model(model, input_shape=input_shape)

    def _validate_model_inputs(self, model: nn.Module, input_shape: Sequence[int]) -> dict[str, Any]:
        """Whether a seeded input of ``input_shape`` fits: ``{"valid", "problems", "output_shape", ...}``.

        ``problems`` says in plain words what does not fit the first layer (shape, dtype, device,
        embedding index range) or how the forward failed. Cost: one forward in eval mode, no grad.
        """
        s = inspect_model(model, input_shape=input_shape)
        return {
            "valid": s.ok,
            "problems": list(s.problems),
            "input_shape": s.input_shape,
            "output_shape": s.output_shape,
            "forward_error": s.forward_error,
        }


class PyTorchDebugManager:
    """Seed 001/003's manager: one object holding the debuggers, a debugged training step and reports.

    Attributes: ``debugger`` (``PyTorchDebugger``), ``anomaly_detector``, ``gradient_debugger``,
    ``memory_debugger``, ``model_debugger``, ``training_debugger``, ``training_logger`` (a run
    store writer after ``setup_training_logging``).

    Example::

        mgr = PyTorchDebugManager(DebugConfig(anomaly_detection_mode="raise"))
        mgr.setup_training_logging("exp1")          # metrics go to a run folder
        m = mgr.debug_training_step(model, opt, loss_fn, x, y, epoch=0, batch=i)
        print(m["loss"], m["gradient_norm"])
        mgr.close()
    """

    def __init__(self, config: Any = None) -> None:
        self.debugger = PyTorchDebugger(config)
        self.config = self.debugger.config
        self.logger = self.debugger.logger
        self.training_logger: Any = None
        self.anomaly_detector = AutogradAnomalyDetector(config)
        self.gradient_debugger = GradientDebugger(self.config)
        self.memory_debugger = PyTorchMemoryDebugger()
        self.model_debugger = ModelDebugger(self.config)
        self.training_debugger = TrainingDebugger(config)
        self._steps = 0
        # seed 003's memory_snapshot_frequency: the debugged steps take a memory snapshot every that
        # many steps (0, f, 2f, ...) when its enable_memory_debugging is on
        seed = isinstance(config, PyTorchDebugConfig) and config.enable_memory_debugging
        self.snapshot_every: int | None = config.memory_snapshot_frequency if seed else None

    def setup_training_logging(self, experiment_name: str | None = None, root: str | None = None) -> Any:
        """Send every debugged step's numbers and anomalies to a new run folder (the run store).

        Args:
            experiment_name: run name (default ``"training"``); the folder is ``<root>/<name>-<time>``.
            root: runs root (default ``config.run_dir``).

        Returns:
            The ``RunWriter`` (also ``self.training_logger``); ``close()`` finishes the run.
        """
        from ..store import create_run

        self.close()
        self.training_logger = create_run(
            root=root if root is not None else self.config.run_dir,
            name=experiment_name or "training",
            config=self.config.to_dict(),
        )
        return self.training_logger

    def close(self, status: str = "finished") -> None:
        """Finish the run opened by ``setup_training_logging`` (idempotent)."""
        if self.training_logger is not None:
            self.training_logger.close(status=status)
            self.training_logger = None

    def __enter__(self) -> PyTorchDebugManager:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(status="finished" if exc is None else "failed")

    def debug_training_step(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[..., torch.Tensor],
        data_batch: Any,
        target_batch: Any,
        epoch: int = 0,
        batch: int = 0,
    ) -> dict[str, Any]:
        """One complete debugged step: zero grads, forward, loss, backward, check, optimizer step.

        Returns:
            ``{"loss", "gradient_norm", "param_norm", "cpu_memory", "gpu_memory", "execution_time",
            "skipped", "anomaly"}``: ``gradient_norm`` is the total L2 norm of all gradients (what
            ``clip_grad_norm_`` returns), ``param_norm`` the total L2 norm of the trainable
            parameters entering the update; both and the loss come from ONE host transfer, taken
            before the update. Memory in bytes (process RSS, CUDA allocated), time in seconds.

        On a NaN/Inf loss or gradient, the step is replayed under the op-level tracer (same RNG;
        grads, buffers and RNG restored) to name the origin, and the update is skipped so the
        weights stay finite; then recorded, warned (``"skipped": True``) or raised per
        ``config.anomaly_detection_mode``.

        Raises:
            NonFiniteError: mode "raise" and the step produced a NaN/Inf (before the update).
        """
        with self.debugger._context("training_step", type(model).__name__, epoch, batch, model=model) as info:
            t0 = time.perf_counter()
            rng = rng_state(any(p.is_cuda for p in model.parameters()))
            optimizer.zero_grad(set_to_none=True)
            if self.config.log_activations:
                with _activation_capture(model) as act:
                    output = call_model(model, data_batch)
                info.details["activations"] = act.read()
            else:
                output = call_model(model, data_batch)
            loss = loss_fn(output, target_batch)
            t_forward = time.perf_counter()
            loss.backward()
            n = step_numbers(model, loss, with_params=True)
            info.gradient_norm = n.grad_norm
            if self.config.log_gradients:
                info.details["gradients"] = dict(zip(n.names, n.norms))
            t_backward = time.perf_counter()
            anomaly: Anomaly | None = None
            if n.nonfinite:
                if tracing_active():  # the trace saw every op: its origin (a NaN batch is phase input)
                    anomaly = take_traced_anomaly()
                    if anomaly is not None:
                        anomaly = dataclasses.replace(anomaly, step=self._steps)
                else:
                    anomaly = replay_origin(
                        model, _step_fn(model, loss_fn), data_batch, target_batch, rng=rng, step=self._steps
                    )
                    if anomaly is None:
                        anomaly = symptom_anomaly(
                            model, loss_bad=n.loss_bad, bad_params=n.bad_params, kind=n.kind, step=self._steps
                        )
            if anomaly is not None:
                self._log_anomaly(anomaly)
                self.debugger._report(info, anomaly)
            skipped = n.nonfinite
            if not skipped:
                state_bad = nonfinite_optimizer_state(model, optimizer)  # judged before the update lands
                if state_bad:
                    skipped = True
                    anomaly = optimizer_state_anomaly(model, optimizer, state_bad, self._steps)
                    self._log_anomaly(anomaly)
                    self.debugger._report(info, anomaly)
            if not skipped:
                optimizer.step()
            t_update = time.perf_counter()
            if self.config.log_weights:
                names, params = _trainable(model)
                with torch.no_grad():  # the weights after the update: a second transfer, only when asked
                    info.details["weights"] = dict(
                        zip(names, foreach_norms([p.detach() for p in params]).tolist())
                    )
            sample = memory_sample()
            elapsed = time.perf_counter() - t0
        metrics: dict[str, Any] = {
            "loss": n.loss,
            "gradient_norm": n.grad_norm,
            "param_norm": n.param_norm,
            "cpu_memory": sample["rss"],
            "gpu_memory": sample.get("cuda_allocated", 0),
            "execution_time": elapsed,
            "skipped": skipped,
            "anomaly": anomaly,
        }
        if self.training_logger is not None:
            w, step = self.training_logger, self._steps
            values = {k: float(metrics[k]) for k in ("loss", "gradient_norm", "param_norm", "execution_time")}
            # the names the reports, the dashboard and TensorBoard read (grad_norm, skipped, a timing
            # breakdown), beside the seed's own (gradient_norm, execution_time)
            values["grad_norm"] = values["gradient_norm"]
            values["skipped"] = 1.0 if skipped else 0.0
            w.log_scalars(step, values)
            w.log_timing(
                step,
                {
                    "forward": t_forward - t0,
                    "backward": t_backward - t_forward,
                    "optimizer": t_update - t_backward,
                    "other": max(0.0, elapsed - (t_update - t0)),
                    "step": elapsed,
                },
            )
            w.log_memory(step, {"rss": metrics["cpu_memory"], "cuda_allocated": metrics["gpu_memory"]})
        if self.snapshot_every and self._steps % self.snapshot_every == 0:
            self.memory_debugger.take_memory_snapshot(f"step_{self._steps}")
        self._steps += 1
        return metrics

    def _log_anomaly(self, anomaly: Anomaly) -> None:
        if self.training_logger is not None:
            self.training_logger.log_anomaly(anomaly.step, anomaly.to_dict())

    def debug_model_inference(self, model: nn.Module, input_data: Any) -> dict[str, Any]:
        """Run ``model(input_data)`` under ``no_grad`` in a debug context; check the output for NaN/Inf.

        Returns:
            ``{"output", "execution_time" (s), "cpu_memory", "gpu_memory" (bytes), "anomaly_detected",
            "anomaly", "prediction_problems"}``; on a NaN/Inf the forward is replayed under the tracer
            to name its origin, then recorded, warned or raised per the config.
            ``prediction_problems`` lists constant or uniform predictions and one class always
            predicted (``prediction_problems``; each also a warning-level event on the record).

        Raises:
            NonFiniteError: mode "raise" and the input or output holds a NaN/Inf.
        """
        with self.debugger._context("inference", type(model).__name__, model=model) as info:
            t0 = time.perf_counter()
            output = self.debugger._checked_forward(model, input_data, info, grad=False)
            elapsed = time.perf_counter() - t0
            sample = memory_sample()
            problems = prediction_problems(output) if info.anomaly is None else []
            for text in problems:
                kind = "one_class_predictions" if text.startswith("one class") else "constant_predictions"
                info.events.append(RuleEvent(kind, None, text, "warning"))
                log.warning("%s", text)
        return {
            "output": output,
            "execution_time": elapsed,
            "cpu_memory": sample["rss"],
            "gpu_memory": sample.get("cuda_allocated", 0),
            "anomaly_detected": info.anomaly_detected,
            "anomaly": info.anomaly,
            "prediction_problems": problems,
        }

    def create_comprehensive_report(self) -> dict[str, Any]:
        """JSON-ready report of everything the manager's parts did (seed 003's sections).

        ``summary`` counts over every part: ``total_debug_operations`` = the debugger's operations
        + detector blocks + gradient checks + training-debugger steps + memory snapshots;
        ``anomalies_detected`` = those that ``events.is_anomalous`` calls anomalous (a NaN/Inf or a
        warning-level event; a failed debugger operation too), with ``operations_by_part`` and
        ``anomalies_by_part``. Then the debugger's ``create_debug_report()`` sections, the training
        summary, memory snapshots, clipping history, the detector's anomalies, ``model_info`` (the
        last model seen: parameters, bytes, devices, dtypes; None before any), ``cuda`` (devices
        and allocator bytes; ``{"available": False}`` without CUDA), ``profiling`` (step-time
        statistics and the last ``profile_model_performance`` summary) and the run folder.
        """
        rep = self.debugger.create_debug_report()
        dbg, td_ = self.debugger, self.training_debugger
        ops = {
            "debugger": len(dbg.debug_history),
            "anomaly_detector": self.anomaly_detector.blocks,
            "gradient_debugger": self.gradient_debugger.checks,
            "training_debugger": td_.total_steps,
            "memory_debugger": len(self.memory_debugger.snapshots),
        }
        bad = {
            "debugger": rep["summary"]["anomalies_detected"],
            "anomaly_detector": len(self.anomaly_detector.anomalies),
            "gradient_debugger": self.gradient_debugger.anomalous_checks,
            "training_debugger": td_.anomaly_steps,
            "memory_debugger": 0,
        }
        rep["summary"].update(
            total_debug_operations=sum(ops.values()),
            anomalies_detected=sum(bad.values()),
            operations_by_part=ops,
            anomalies_by_part=bad,
        )
        rep["gradient_analysis"] = self._gradient_analysis(rep["gradient_analysis"])
        rep["memory_analysis"] = self._memory_analysis()
        breakdown = dict(rep["operation_breakdown"])
        for i in td_.debug_history:
            breakdown[i.operation] = breakdown.get(i.operation, 0) + 1
        for name, count in (
            ("detect_anomaly", self.anomaly_detector.blocks),
            ("check_gradients", self.gradient_debugger.checks),
            ("take_memory_snapshot", len(self.memory_debugger.snapshots)),
        ):
            if count:
                breakdown[name] = breakdown.get(name, 0) + count
        rep["operation_breakdown"] = breakdown
        rep["model_info"] = _model_info(self._last_model())
        rep["cuda"] = _cuda_info()
        rep["profiling"] = {
            "performance_analysis": rep["performance_analysis"],
            "last_profile": _plain_profile(getattr(dbg, "last_profile", None)),
        }
        rep["training_summary"] = self.training_debugger.get_training_summary()
        rep["memory_snapshots"] = list(self.memory_debugger.snapshots)
        rep["gradient_clipping"] = list(self.gradient_debugger.clip_history)
        rep["detector_anomalies"] = [a.to_dict() for a in self.anomaly_detector.anomalies]
        rep["run_dir"] = str(self.training_logger.path) if self.training_logger is not None else None
        return plain(rep)  # type: ignore[no-any-return]

    generate_comprehensive_report = create_comprehensive_report

    def _gradient_analysis(self, own: dict[str, Any]) -> dict[str, Any]:
        """Gradient norms over every part: the debugger's and the training debugger's steps and the
        gradient debugger's checks (finite values; ``gradient_checks`` counts them all)."""
        norms = [i.gradient_norm for i in self.debugger.debug_history if i.gradient_norm is not None]
        norms += [
            i.gradient_norm for i in self.training_debugger.debug_history if i.gradient_norm is not None
        ]
        norms += [float(e["total_norm"]) for e in self.gradient_debugger.history]
        finite = [n for n in norms if math.isfinite(n)]
        trained = self.training_debugger.create_debug_report()["gradient_analysis"]["gradient_anomalies"]
        return {
            "average_gradient_norm": sum(finite) / len(finite) if finite else None,
            "max_gradient_norm": max(finite, default=0.0),
            "gradient_anomalies": own["gradient_anomalies"]
            + trained
            + self.gradient_debugger.anomalous_checks,
            "gradient_checks": len(norms),
        }

    def _memory_analysis(self) -> dict[str, Any]:
        """Memory over every part, in bytes: the change of RSS (and CUDA allocated) over each operation
        of the debuggers and between consecutive memory snapshots; the snapshots' RSS; leaks found."""
        ops = list(self.debugger.debug_history) + list(self.training_debugger.debug_history)
        mem = [float(i.memory_usage) for i in ops]
        gpu = [float(i.gpu_memory) for i in ops]
        snaps = list(self.memory_debugger.snapshots)
        for a, b in itertools.pairwise(snaps):
            mem.append(float(b["rss"] - a["rss"]))
            gpu.append(float(b.get("cuda_allocated", 0) - a.get("cuda_allocated", 0)))
        rss = [int(s["rss"]) for s in snaps]
        return {
            "average_memory_usage": sum(mem) / len(mem) if mem else None,
            "max_memory_usage": max(mem, default=0.0),
            "average_gpu_memory": sum(gpu) / len(gpu) if gpu else None,
            "max_gpu_memory": max(gpu, default=0.0),
            "snapshots": len(snaps),
            "first_rss": rss[0] if rss else None,
            "last_rss": rss[-1] if rss else None,
            "peak_rss": max(rss, default=None),
            "memory_leaks": list(self.memory_debugger.memory_leaks),
        }

    def _last_model(self) -> nn.Module | None:
        ref = self.gradient_debugger.last_model
        model = ref() if ref is not None else None
        return model if model is not None else self.anomaly_detector.model


def _model_info(model: nn.Module | None) -> dict[str, Any] | None:
    """Parameters and bytes of ``model`` from metadata (no device work); None without a model."""
    if model is None:
        return None
    params = list(model.parameters())
    buffers = list(model.buffers())
    return {
        "class": type(model).__name__,
        "modules": sum(1 for _ in model.modules()),
        "parameters": sum(p.numel() for p in params),
        "trainable_parameters": sum(p.numel() for p in params if p.requires_grad),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in params),
        "buffer_bytes": sum(b.numel() * b.element_size() for b in buffers),
        "devices": sorted({str(p.device) for p in params}),
        "dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in params}),
    }


def _cuda_info() -> dict[str, Any]:
    """CUDA devices and their allocator bytes (``torch.cuda`` counters, no sync)."""
    if not torch.cuda.is_available():
        return {"available": False, "device_count": 0, "devices": []}
    devices = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        devices.append(
            {
                "index": i,
                "name": props.name,
                "capability": f"{props.major}.{props.minor}",
                "total_memory": int(props.total_memory),
                "memory_allocated": int(torch.cuda.memory_allocated(i)),
                "memory_reserved": int(torch.cuda.memory_reserved(i)),
                "max_memory_allocated": int(torch.cuda.max_memory_allocated(i)),
            }
        )
    return {"available": True, "device_count": len(devices), "devices": devices}


def _plain_profile(summary: Any) -> Any:
    if summary is None:
        return None
    return summary.to_dict() if hasattr(summary, "to_dict") else plain(summary)

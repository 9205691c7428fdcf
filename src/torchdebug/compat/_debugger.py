"""Seed-era ``PyTorchDebugger``, ``AutogradAnomalyDetector``, ``debug_context`` over the engine's tracer."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._config import DebugLevel, DebugMode
from .._errors import NonFiniteError
from .._robust import RunningMedian
from .._trees import tensor_leaves
from ..events import Anomaly, Phase, plain
from ..health.gradients import GradientReport, analyze_model_parameters, check_gradients
from ..health.inspection import call_model
from ..health.instrument import ExplosionRule, top_params
from ..memory.analysis import debug_memory_usage, memory_sample
from ..nonfinite.locate import Tracer
from ..stats import analyze_tensor, foreach_norms, total_norm
from ._common import (
    HISTORY_SIZE,
    DebugInfo,
    TensorInfo,
    check_mode,
    grad_norms,
    handle_anomaly,
    nonfinite_flag,
    replay_origin,
    resolve_config,
    rng_state,
    symptom_anomaly,
)

REPORT_EXTRA = "pip install 'torchdebug[report]'"
log = logging.getLogger("torchdebug.compat")

# One op-level trace at a time per thread: a nested block runs inside the outer trace (it reports).
_TRACING = threading.local()
# A slow operation: slower than slowdown_factor x its running median, after this many samples.
_SLOW_MIN_SAMPLES = 5
_SLOW_WINDOW = 50
# Timer and scheduler jitter: an operation at most this much slower than its median is never slow.
_SLOW_MIN_EXCESS_S = 0.01


def tracing_active() -> bool:
    """True inside a traced block on this thread (the tracer then owns NaN/Inf detection)."""
    return bool(getattr(_TRACING, "active", False))


@contextlib.contextmanager
def traced(model: nn.Module | None, frames: int, mode: str, sink: list[Anomaly]) -> Iterator[list[Anomaly]]:
    """Run the block under the engine's op-level ``Tracer``; at its end record/warn/raise per ``mode``.

    The yielded list receives the anomaly (if any) before ``handle_anomaly`` runs. Hooks and
    dispatch modes are removed before anything is raised or warned, also when the block raised.
    If the block raised after a NaN/Inf was found, mode "raise" raises ``NonFiniteError`` chained
    to the block's error; the other modes record the anomaly and let the error through.
    """
    found: list[Anomaly] = []
    if tracing_active():  # nested: the outer trace sees these ops and reports
        yield found
        return
    tracer = Tracer(model, frames=frames)
    if model is not None:
        tracer.check_parameters()  # NaN/Inf weights before the block are phase "parameter"
    error: BaseException | None = None
    _TRACING.active = True
    try:
        with tracer:
            try:
                yield found
            except Exception as exc:  # kept to re-raise after the anomaly is handled
                error = exc
    finally:
        _TRACING.active = False
    anomaly = tracer.anomaly()
    if anomaly is not None:
        found.append(anomaly)
        try:
            handle_anomaly(anomaly, mode, sink, stacklevel=5)
        except NonFiniteError as nf:
            if error is not None:
                raise nf from error
            raise
    if error is not None:
        raise error


class AutogradAnomalyDetector:
    """Seed 003's detector: ``with detector.detect_anomaly(): loss.backward()`` names the first NaN/Inf.

    Instead of ``torch.autograd.detect_anomaly`` (which only says which backward node failed), the
    block runs under torchdebug's op-level tracer: the anomaly names the phase (input, parameter,
    forward, backward, optimizer), the module, the aten op or autograd node and the source line.
    torch's own anomaly mode is not touched.

    Args:
        config: a ``DebugConfig``, ``PyTorchDebugConfig``, mapping or None; gives the mode unless
            ``mode`` is passed, and ``frames`` (module calls kept in the anomaly).
        mode: ``"detect"`` (record in ``.anomalies`` only), ``"warn"`` (also a ``TorchDebugWarning``)
            or ``"raise"`` (``NonFiniteError`` when the block ends; the default without a config,
            as torch's detect_anomaly raises).
        model: names modules as in ``model.named_modules()``; without it the anomaly still names the
            op and line. ``detect_anomaly(model)`` overrides it for one block.

    Raises:
        ValueError: unknown ``mode``. TypeError: ``model`` is not an ``nn.Module``.

    Example::

        det = AutogradAnomalyDetector(mode="detect", model=net)
        with det.detect_anomaly():
            loss_fn(net(x), y).backward()
        print(det.anomalies[0])   # nan born in forward of act (LogAct): aten.log at model.py:41

    Cost: every op's outputs are read on the host while the block runs: about 20x the block for a
    3-layer MLP step on CPU (measured; the ratio falls as ops grow), more per op on GPU (a sync each).
    Use it on a failing step; ``td.watch`` is the always-on sentinel.
    """

    def __init__(
        self, config: Any = None, *, mode: str | None = None, model: nn.Module | None = None
    ) -> None:
        self.config, cfg_mode = resolve_config(config, default_mode="raise")
        self.mode = check_mode(mode) if mode is not None else cfg_mode
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"model= must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.anomalies: list[Anomaly] = []

    @contextlib.contextmanager
    def detect_anomaly(self, model: nn.Module | None = None) -> Iterator[AutogradAnomalyDetector]:
        """Run the block under op-level tracing; on a NaN/Inf record, warn or raise per ``self.mode``.

        Not re-entrant: a nested block (same thread) runs inside the outer trace, which reports.

        Raises:
            NonFiniteError: mode "raise" and the block produced (or started with) a NaN/Inf.
        """
        with traced(
            model if model is not None else self.model, self.config.frames, self.mode, self.anomalies
        ):
            yield self


class PyTorchDebugger:
    """The seed-era debugger (seeds 001, 002, 004) as a thin layer over torchdebug's engine.

    Args:
        config: any of the seeds' shapes: a ``DebugConfig`` (001), a ``DebugLevel`` or level name
            (002), a ``PyTorchDebugConfig`` (003), a mapping, a config file path, or None.
        error_system, training_logger: seed 004's collaborators, kept as attributes (unused here).
        debug_mode: seed 004's keyword; ``ANOMALY_DETECTION`` and ``FULL_DEBUG`` also switch on
            op-level tracing of ``debug_context`` blocks (what the seed did with detect_anomaly).
        history_size: how many ``DebugInfo`` records ``debug_history`` keeps (oldest dropped).

    What a NaN/Inf does is ``config.anomaly_detection_mode`` (``"warn"`` by default, or
    ``"raise"``): the anomaly is kept in ``.anomalies`` and on the operation's ``DebugInfo``.
    ``debug_context`` blocks are traced op by op when ``enable_anomaly_detection`` or
    ``enable_autograd_anomaly`` is set (costly: see ``AutogradAnomalyDetector``); otherwise the
    debug_* methods check their outputs and gradients with fused reductions and one host transfer
    each, and replay a failing forward under the tracer to name its origin.

    Example::

        dbg = PyTorchDebugger(DebugConfig(anomaly_detection_mode="raise"))
        out = dbg.debug_forward_pass(model, x)
        norm = dbg.debug_backward_pass(loss_fn(out, y), model)
        print(dbg.create_debug_report()["gradient_analysis"])

    Known limitations: memory numbers are bytes and times seconds (the seeds printed MB).
    """

    def __init__(
        self,
        config: Any = None,
        *,
        error_system: Any = None,
        training_logger: Any = None,
        debug_mode: DebugMode | str | None = None,
        history_size: int = HISTORY_SIZE,
    ) -> None:
        cfg, mode = resolve_config(config)
        if debug_mode is not None:
            try:
                dm = DebugMode(debug_mode)
            except ValueError:
                allowed = ", ".join(m.value for m in DebugMode)
                raise ValueError(
                    f"debug_mode={debug_mode!r} is not a DebugMode; use one of {allowed}"
                ) from None
            trace = dm in (DebugMode.ANOMALY_DETECTION, DebugMode.FULL_DEBUG)
            cfg = cfg.replace(mode=dm, enable_anomaly_detection=cfg.enable_anomaly_detection or trace)
        self.config, self.mode_on_anomaly = cfg, mode
        if not isinstance(history_size, int) or isinstance(history_size, bool) or history_size < 1:
            raise ValueError(f"history_size must be an int >= 1, got {history_size!r}")
        self.error_system = error_system
        self.training_logger = training_logger
        self.logger = log
        self.debug_history: deque[DebugInfo] = deque(maxlen=history_size)
        self.memory_history: deque[dict[str, Any]] = deque(maxlen=history_size)
        self.performance_history: deque[dict[str, Any]] = deque(maxlen=history_size)
        self.anomalies: list[Anomaly] = []
        self._times: dict[str, RunningMedian] = {}
        self._explosion = self._new_explosion_rule()
        self._leaks: Any = None
        self._profiles = 0
        self.optimization_metrics: list[Any] = []  # OptimizationMetrics, one per optimize_model call

    # -- configuration -------------------------------------------------------------------------------
    @property
    def level(self) -> DebugLevel:
        return self.config.level

    @property
    def debug_mode(self) -> DebugMode:
        return self.config.mode

    @property
    def anomaly_detection_active(self) -> bool:
        """True when ``debug_context`` blocks are traced op by op (seed 001's flag)."""
        return bool(self.config.enable_anomaly_detection or self.config.enable_autograd_anomaly)

    @property
    def gradient_checking_active(self) -> bool:
        """True when the config runs gradient checks (``"gradients"`` in ``config.instruments()``)."""
        return "gradients" in self.config.instruments()

    @property
    def memory_profiling_active(self) -> bool:
        """True when the config runs memory profiling (``"memory"`` in ``config.instruments()``)."""
        return "memory" in self.config.instruments()

    @property
    def performance_profiling_active(self) -> bool:
        """True when the config runs step timing (``"timing"`` in ``config.instruments()``)."""
        return "timing" in self.config.instruments()

    @property
    def debug_metrics(self) -> list[DebugInfo]:
        """Seed 004's per-operation metrics: the ``DebugInfo`` records of ``debug_history``, oldest first
        (``.mode``, ``.execution_time`` in s, ``.memory_usage``/``.gpu_memory`` in bytes,
        ``.gradient_anomalies``)."""
        return list(self.debug_history)

    def set_level(self, level: DebugLevel | str) -> DebugLevel:
        """Change the debug level (seed 002's ``POST /debug/level``)."""
        self.config = self.config.replace(level=DebugLevel(level))
        return self.config.level

    def _new_explosion_rule(self) -> ExplosionRule:
        c = self.config
        return ExplosionRule(mads=c.explode_mads, abs_threshold=c.explode_abs, warmup=c.explode_warmup)

    # -- anomaly detection ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def autograd_anomaly_detection(self, model: nn.Module | None = None) -> Iterator[PyTorchDebugger]:
        """Trace the block op by op; a NaN/Inf is recorded, warned or raised per the config's mode.

        Seed 001/002's ``with debugger.autograd_anomaly_detection():`` (yields the debugger).
        Everything is restored when the block ends, also on exceptions; torch's anomaly mode is left
        as it was.

        Args:
            model: to name modules as in ``model.named_modules()`` (the op and line are named anyway).

        Raises:
            NonFiniteError: mode "raise" and the block produced a NaN/Inf.

        Cost: op-level tracing, every op's outputs read on the host (see ``AutogradAnomalyDetector``).
        """
        with traced(model, self.config.frames, self.mode_on_anomaly, self.anomalies):
            yield self

    @contextlib.contextmanager
    def debug_context(
        self,
        operation: str,
        model_name: str = "unknown",
        epoch: int = 0,
        batch: int = 0,
        *,
        model: nn.Module | None = None,
    ) -> Iterator[DebugInfo]:
        """Time one operation and measure its memory; yields the ``DebugInfo`` filled when the block ends.

        The record lands in ``debug_history`` also when the block raises (then ``anomaly_detected``
        is True and ``error`` holds the exception's repr). With anomaly detection on (see the class)
        the block is traced op by op and a NaN/Inf sets ``anomaly``.

        Example::

            with dbg.debug_context("eval", "mlp") as info:
                model(x)
            print(info.execution_time, info.memory_usage)

        Cost: two memory samples (a /proc read, CUDA allocator counters; no device sync).
        """
        info = DebugInfo(
            timestamp=datetime.now(),
            mode=self.config.mode,
            level=self.config.level,
            operation=operation,
            model_name=model_name,
            epoch=epoch,
            batch=batch,
        )
        before = memory_sample()
        t0 = time.perf_counter()
        found: list[Anomaly] = []
        block = (
            traced(model, self.config.frames, self.mode_on_anomaly, self.anomalies)
            if self.anomaly_detection_active
            else contextlib.nullcontext(found)
        )
        try:
            with block as found:
                yield info
        except BaseException as exc:
            info.anomaly_detected = True
            info.error = repr(exc)
            log.info("operation %r failed: %r", operation, exc)
            raise
        finally:
            info.execution_time = time.perf_counter() - t0
            after = memory_sample()
            info.rss = after["rss"]
            info.memory_usage = after["rss"] - before["rss"]
            info.gpu_memory = after.get("cuda_allocated", 0) - before.get("cuda_allocated", 0)
            if found and info.anomaly is None:
                info.anomaly = found[0]
            if info.anomaly is not None:
                info.anomaly_detected = True
            self._note_time(info)
            self.debug_history.append(info)
            if self.config.save_debug_info:
                self._save_debug_info(info)

    def _save_debug_info(self, info: DebugInfo) -> None:
        """Append ``info`` as one JSON line to ``<debug_output_dir>/debug_info.jsonl`` (seed 001's save).

        An unwritable folder warns once and switches saving off: debugging never breaks training.
        """
        import json
        import warnings

        from .._errors import TorchDebugWarning

        path = Path(self.config.debug_output_dir) / "debug_info.jsonl"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(info.to_dict(), sort_keys=True) + "\n")
        except OSError as exc:
            self.config = self.config.replace(save_debug_info=False)
            warnings.warn(
                TorchDebugWarning(f"torchdebug: cannot save debug info to {path} ({exc}); saving is off"),
                stacklevel=4,
            )

    def _note_time(self, info: DebugInfo) -> None:
        """Flag an operation slower than ``slowdown_factor`` x its running median (robust, per operation)."""
        hist = self._times.setdefault(info.operation, RunningMedian(_SLOW_WINDOW))
        if len(hist) >= _SLOW_MIN_SAMPLES and info.error is None:
            med = hist.median()
            limit = max(self.config.slowdown_factor * med, med + _SLOW_MIN_EXCESS_S)
            if info.execution_time > limit:
                info.performance_issue_detected = True
                log.info(
                    "slow operation %r: %.4g s vs running median %.4g s",
                    info.operation,
                    info.execution_time,
                    med,
                )
        hist.push(info.execution_time)

    def _report(self, info: DebugInfo, anomaly: Anomaly) -> None:
        info.anomaly = anomaly
        info.anomaly_detected = True
        log.info("%s", anomaly.summary())
        handle_anomaly(anomaly, self.mode_on_anomaly, self.anomalies, stacklevel=5)

    # -- tensors and parameters -------------------------------------------------------------------
    def analyze_tensor(self, tensor: torch.Tensor, name: str | None = None) -> TensorInfo:
        """``td.analyze_tensor`` with seed 002's attribute names (``has_nan``, ``has_inf``, ``mean_value``).

        Raises:
            TypeError: not a tensor.

        Cost: one host transfer.
        """
        return TensorInfo.of(analyze_tensor(tensor, name))

    def analyze_model_parameters(self, model: nn.Module) -> dict[str, TensorInfo]:
        """Statistics of every parameter and buffer by qualified name (one host transfer per tensor)."""
        return {k: TensorInfo.of(v) for k, v in analyze_model_parameters(model).items()}

    def analyze_gradients(self, model: nn.Module) -> GradientReport:
        """``td.health.gradients.check_gradients``: per-parameter norms, NaN/Inf, exploding, vanishing."""
        return check_gradients(model, explode_abs=self.config.explode_abs)

    def check_gradient_explosion(self, model: nn.Module, threshold: float | None = None) -> list[str]:
        """Parameters whose gradient is NaN/Inf or exploding, in ``named_parameters`` order.

        Exploding: norm above ``threshold`` (default ``config.explode_abs``), or far above the
        other parameters' size-normalised norms (the engine's relative rule).
        """
        rep = check_gradients(
            model, explode_abs=threshold if threshold is not None else self.config.explode_abs
        )
        bad = set(rep.nonfinite) | set(rep.exploding)
        return [p.name for p in rep.params if p.name in bad]

    def check_gradient_vanishing(self, model: nn.Module, threshold: float | None = None) -> list[str]:
        """Parameters whose gradient norm is below ``threshold`` (default 1e-7) or far below the others'."""
        rep = (
            check_gradients(model, vanish_abs=threshold) if threshold is not None else check_gradients(model)
        )
        return list(rep.vanishing)

    def check_gradients(self, model: nn.Module, loss: torch.Tensor | None = None) -> dict[str, Any]:
        """Seed 004's gradient check: ``gradient_norm``, ``gradient_anomalies`` (text), ``parameter_stats``.

        ``gradient_anomalies`` lines start with ``"NaN/Inf"``, ``"exploding"`` or ``"vanishing"``
        (seed users tested ``"NaN" in line``); ``loss`` (optional) adds ``"NaN/Inf loss"`` and the
        ``loss`` value. Cost: one host transfer for the gradients, one for the loss.
        """
        rep = check_gradients(model, explode_abs=self.config.explode_abs)
        lines = [f"NaN/Inf gradient in {n} ({rep[n].nonfinite} non-finite elements)" for n in rep.nonfinite]
        lines += [f"exploding gradient in {n} (norm {rep[n].norm:.4g})" for n in rep.exploding]
        lines += [f"vanishing gradient in {n} (norm {rep[n].norm:.4g})" for n in rep.vanishing]
        out: dict[str, Any] = {
            "gradient_norm": rep.total_norm,
            "gradient_anomalies": lines,
            "parameter_stats": {p.name: p.to_dict() for p in rep.params},
        }
        if loss is not None:
            value = float(loss.detach().float().mean())  # the loss's one host transfer
            out["loss"] = value
            if not math.isfinite(value):
                lines.insert(0, f"NaN/Inf loss ({value})")
        return out

    # -- passes ---------------------------------------------------------------------------------------
    def debug_forward_pass(self, model: nn.Module, input_data: Any, **kwargs: Any) -> Any:
        """Run ``model(input_data)`` in a ``debug_context``; a NaN/Inf in the input or output is located.

        ``input_data`` is a tensor, a tuple/list (positional args) or a dict (keyword args).
        ``kwargs``: ``epoch``, ``batch`` for the record. On a NaN/Inf the forward is replayed under the
        tracer (same RNG; buffers and grads restored) to name its origin, then recorded, warned or
        raised per the config.

        Returns:
            The model's output.

        Raises:
            NonFiniteError: mode "raise" and the input or output holds a NaN/Inf.

        With ``config.log_activations`` each leaf module's output statistics (mean, std, zero
        fraction, dead/saturated fraction) land in ``info.details["activations"]`` (one more transfer).

        Cost: one fused NaN/Inf count and one host transfer; the traced replay only on a NaN/Inf.
        """
        with self.debug_context("forward_pass", type(model).__name__, model=model, **kwargs) as info:
            if self.config.log_activations:
                with _activation_capture(model) as act:
                    output = self._checked_forward(model, input_data, info, grad=torch.is_grad_enabled())
                info.details["activations"] = act.read()
            else:
                output = self._checked_forward(model, input_data, info, grad=torch.is_grad_enabled())
        return output

    def _checked_forward(self, model: nn.Module, input_data: Any, info: DebugInfo, *, grad: bool) -> Any:
        """Forward with one fused NaN/Inf count of input and output; on a hit, replay under the tracer."""
        rng = rng_state(any(p.is_cuda for p in model.parameters()))
        if tracing_active():
            # the enclosing trace checks every op and reports what is born inside the block; a NaN/Inf
            # that arrives in the input was born outside it, so it is checked here, before the forward
            bad_input = _input_nonfinite(input_data)
            if bad_input is not None:
                self._report(info, _input_anomaly(model, bad_input))
            with torch.set_grad_enabled(grad):
                return call_model(model, input_data)
        with torch.set_grad_enabled(grad):
            output = call_model(model, input_data)
        flags = [f for f in (nonfinite_flag(input_data), nonfinite_flag(output)) if f is not None]
        if flags and int(torch.stack([f.to(flags[0].device) for f in flags]).sum()) > 0:  # the one transfer

            def forward(x: Any) -> Any:
                with torch.set_grad_enabled(grad):
                    return call_model(model, x)

            anomaly = replay_origin(model, forward, input_data, rng=rng)
            if anomaly is None:
                anomaly = symptom_anomaly(model, loss_bad=True, bad_params=[], kind="nan", where="the output")
            self._report(info, anomaly)
        return output

    def debug_backward_pass(self, loss: torch.Tensor, model: nn.Module, **kwargs: Any) -> float:
        """Run ``loss.backward()`` in a ``debug_context``; returns the total L2 gradient norm.

        The norm equals what ``clip_grad_norm_(model.parameters(), inf)`` returns. A NaN/Inf loss or
        gradient is recorded (the symptom: which parameter; trace the step with
        ``autograd_anomaly_detection`` for the op) and warned or raised per the config; an exploding
        norm (robust running rule, see ``ExplosionRule``) is logged and flags ``anomaly_detected``.

        Raises:
            NonFiniteError: mode "raise" and the loss or a gradient is non-finite.

        ``config.log_gradients`` / ``config.log_weights`` put every parameter's gradient / weight L2
        norm in ``info.details["gradients"]`` / ``["weights"]`` (in the same transfer).

        Cost: fused norms of all gradients and one host transfer.
        """
        with self.debug_context("backward_pass", type(model).__name__, model=model, **kwargs) as info:
            loss_value = loss.detach().float().mean()
            loss.backward()
            names, params = _trainable(model)
            idx, norms = grad_norms(params)
            dev = loss_value.device
            total = total_norm(norms) if norms is not None else torch.zeros((), device=dev)
            parts = [loss_value.reshape(1), total.reshape(1).to(dev)]
            if norms is not None:
                parts.append(norms.to(dev))
            if self.config.log_weights and params:
                with torch.no_grad():
                    parts.append(foreach_norms([p.detach() for p in params]).to(dev))
            host = torch.cat([p.float() for p in parts]).tolist()  # the one host transfer
            loss_f, norm = host[0], host[1]
            per = host[2 : 2 + len(idx)]
            info.gradient_norm = norm
            if self.config.log_gradients:
                info.details["gradients"] = {names[i]: v for i, v in zip(idx, per)}
            if self.config.log_weights and params:
                info.details["weights"] = dict(zip(names, host[2 + len(idx) :]))
            bad = [names[idx[j]] for j, v in enumerate(per) if not math.isfinite(v)]
            if (bad or not math.isfinite(loss_f)) and not tracing_active():
                kind = "nan" if math.isnan(loss_f) or any(math.isnan(v) for v in per) else "inf"
                anomaly = symptom_anomaly(
                    model, loss_bad=not math.isfinite(loss_f), bad_params=bad, kind=kind
                )
                self._report(info, anomaly)
            elif math.isfinite(norm):
                event = self._explosion.update(
                    len(self.debug_history), norm, top_params([names[i] for i in idx], per)
                )
                if event is not None:
                    info.events.append(event)
                    info.anomaly_detected = True
                    log.warning("%s", event)
        return norm

    def debug_optimization_step(
        self, optimizer: torch.optim.Optimizer, model: nn.Module, **kwargs: Any
    ) -> float:
        """Seed 001's optimizer step in a ``debug_context``: check the gradients, step, return the parameter norm.

        The gradients are checked as they are when the update starts (after any clipping or
        unscaling the caller did): a NaN/Inf gradient skips the update (the weights stay finite) and is
        recorded, warned or raised per the config. Returns the total L2 norm of the trainable
        parameters after the update (``kwargs``: ``epoch``, ``batch``).

        Raises:
            NonFiniteError: mode "raise" and a gradient, or a parameter after the update, is NaN/Inf.

        Cost: two host transfers (the gradient check before the update, the norm after it).
        """
        with self.debug_context("optimization_step", type(model).__name__, model=model, **kwargs) as info:
            names, params = _trainable(model)
            idx, norms = grad_norms(params)
            per = (
                norms.tolist() if norms is not None else []
            )  # transfer 1: the gradients as the update sees them
            bad = [names[idx[j]] for j, v in enumerate(per) if not math.isfinite(v)]
            if bad:
                kind = "nan" if any(math.isnan(v) for v in per) else "inf"
                self._report(
                    info,
                    symptom_anomaly(
                        model,
                        loss_bad=False,
                        bad_params=bad,
                        kind=kind,
                        where="the gradients entering the update (update skipped)",
                    ),
                )
            else:
                optimizer.step()
            with torch.no_grad():
                pn = foreach_norms([p.detach() for p in params]) if params else torch.zeros(1)
                host = pn.tolist()  # transfer 2: the parameters after the update
            total = math.sqrt(sum(v * v for v in host)) if all(math.isfinite(v) for v in host) else math.nan
            info.details["param_norm"] = {"total": total}
            nonfinite = [n for n, v in zip(names, host) if not math.isfinite(v)]
            if nonfinite and not bad:
                self._report(
                    info,
                    symptom_anomaly(
                        model,
                        loss_bad=False,
                        bad_params=nonfinite,
                        kind="nan",
                        where="the parameters after the update",
                    ),
                )
        return total

    def optimize_model(self, model: nn.Module, optimization_mode: Any = "full_optimization") -> nn.Module:
        """Seed 004's ``optimize_model``: apply an ``OptimizationMode`` and return the model to call.

        AMP wraps the model in ``torch.autocast`` (bf16 on CPU; float outputs come back float32),
        COMPILATION returns ``torch.compile(model)``, MEMORY_EFFICIENT checkpoints repeated blocks in
        place (and channels_last for conv nets), FULL_OPTIMIZATION all three; NONE returns ``model``.
        The record (``OptimizationMetrics``: mode, seconds to apply, what was applied) is appended to
        ``optimization_metrics``; its ``speedup_factor`` stays None here: measure it with
        ``td.compare_modes`` or ``PyTorchOptimizer.optimize_training_loop``.

        Raises:
            ValueError: unknown mode (lists the allowed ones).
        """
        from ._optimize import optimize_model_in_place

        return optimize_model_in_place(model, optimization_mode, self.optimization_metrics)

    # -- memory and time --------------------------------------------------------------------------------
    def debug_memory_usage(self, **kwargs: Any) -> tuple[int, int]:
        """Seed 001's ``(cpu_memory, gpu_memory)``: process RSS and CUDA allocated bytes (0 without CUDA)."""
        with self.debug_context("memory_profiling", **kwargs) as info:
            sample = memory_sample()
            cpu, gpu = sample["rss"], sample.get("cuda_allocated", 0)
            self.memory_history.append(
                {
                    "timestamp": info.timestamp.isoformat(),
                    "cpu_memory": cpu,
                    "gpu_memory": gpu,
                    "epoch": info.epoch,
                    "batch": info.batch,
                }
            )
        return cpu, gpu

    def debug_performance(self, operation: str, **kwargs: Any) -> float:
        """Execution time (s) of the latest recorded ``operation``; 0.0 if none was recorded.

        Unlike the seed (which timed an empty block), this reads the history ``debug_context`` keeps;
        the entry is flagged ``performance_issue_detected`` when slower than ``slowdown_factor`` x
        that operation's running median (and by more than 10 ms, so timer jitter never counts).
        """
        latest = next((i for i in reversed(self.debug_history) if i.operation == operation), None)
        seconds = latest.execution_time if latest is not None else 0.0
        self.performance_history.append(
            {
                "timestamp": datetime.now().isoformat(),
                "operation": operation,
                "execution_time": seconds,
                "epoch": kwargs.get("epoch", 0),
                "batch": kwargs.get("batch", 0),
                "slow": bool(latest is not None and latest.performance_issue_detected),
            }
        )
        return seconds

    def profile_memory(self, label: str = "") -> dict[str, Any]:
        """Seed 004's memory profile: ``td.memory.analysis.debug_memory_usage()`` plus ``cpu_memory`` (system %),
        ``gpu_memory`` (CUDA allocated bytes) and ``memory_leaks`` (robust growth test over calls).

        ``memory_leaks`` lists the series (``heap_in_use``, ``rss``, ``cuda_allocated``) whose
        Theil-Sen slope over the last ``config.leak_window`` calls is positive and steady (the
        engine's ``LeakDetector``); empty until that many calls were made.
        """
        from ..memory.instrument import LeakDetector

        if self._leaks is None:
            self._leaks = LeakDetector(window=max(3, self.config.leak_window), warmup=0)
        out = debug_memory_usage()
        trends = self._leaks.add(self._profiles, {k: v for k, v in out.items() if isinstance(v, int)})
        self._profiles += 1
        out.update(
            label=label,
            cpu_memory=out["system_percent"],
            gpu_memory=out.get("cuda_allocated", 0),
            memory_leaks=[
                f"{t.series} grows {t.slope:.0f} bytes per call over {t.samples} calls" for t in trends
            ],
        )
        return out

    def profile_memory_usage(self, model: nn.Module) -> dict[str, int]:
        """Seed 002's static memory profile of ``model`` in bytes: parameters, gradients, buffers, total.

        Shared parameters count once. Activations are not included: measure a forward with
        ``td.memory.analysis.measure_module_memory`` for those. Cost: metadata only, no device work.
        """
        params = list(model.parameters())  # deduplicated: a tied weight appears once
        grads = [p.grad for p in params if p.grad is not None]
        out = {
            "parameters": sum(p.numel() * p.element_size() for p in params),
            "gradients": sum(g.numel() * g.element_size() for g in grads),
            "buffers": sum(b.numel() * b.element_size() for b in model.buffers()),
        }
        out["total"] = out["parameters"] + out["gradients"] + out["buffers"]
        return out

    def profile_model_performance(
        self, model: nn.Module, dataloader: Any, num_batches: int = 10, **kwargs: Any
    ) -> Any:
        """Seed 000's profiler entry: ``td.perf.profiling.profile_model_performance`` (torch.profiler).

        ``kwargs``: ``loss_fn``, ``optimizer``, ``run_dir`` (folder for the Perfetto trace).
        Returns its ``ProfileSummary`` (top ops and modules by self time, idle and data shares).

        Cost: ``num_batches`` profiled steps plus a wait and a warm-up batch (about 2 s of profiler
        start-up the first time in a process).
        """
        from ..perf.profiling import profile_model_performance

        return profile_model_performance(model, dataloader, num_batches, **kwargs)

    def monitor_resources(self, **kwargs: Any) -> dict[str, Any]:
        """Seed 004's resource check: ``td.perf.profiling.monitor_resources`` (CPU %, memory %, RSS, GPUs)."""
        from ..perf.profiling import monitor_resources

        return monitor_resources(**kwargs)

    # -- summaries and reports ----------------------------------------------------------------------------
    def get_debug_summary(self) -> dict[str, Any]:
        """Counts and times over ``debug_history`` (seed 002/004 keys; seconds and bytes)."""
        hist = list(self.debug_history)
        times = [i.execution_time for i in hist]
        return {
            "total_operations": len(hist),
            "debug_history_length": len(hist),
            "total_anomalies": len(self.anomalies),
            "anomaly_operations": sum(i.anomaly_detected for i in hist),
            "avg_execution_time": _mean(times),
            "max_execution_time": max(times, default=0.0),
            "avg_memory_usage": _mean([float(i.memory_usage) for i in hist]),
            "level": self.config.level.value,
            "mode": self.config.mode.value,
            "total_optimizations": len(self.optimization_metrics),
        }

    def create_debug_report(self) -> dict[str, Any]:
        """Seed 001's report: ``summary``, ``performance_analysis``, ``memory_analysis``,
        ``gradient_analysis``, ``operation_breakdown`` (JSON-ready; averages None when empty).

        ``gradient_analysis.gradient_anomalies`` counts operations whose gradient norm was non-finite
        or fired a gradient rule (not the seed's fixed "norm > 10"). Averages and maxima of gradient
        norms are over finite values.
        """
        hist = list(self.debug_history)
        times = [i.execution_time for i in hist]
        mem = [float(i.memory_usage) for i in hist]
        gpu = [float(i.gpu_memory) for i in hist]
        norms = [i.gradient_norm for i in hist if i.gradient_norm is not None]
        finite = [n for n in norms if math.isfinite(n)]
        breakdown: dict[str, int] = {}
        for i in hist:
            breakdown[i.operation] = breakdown.get(i.operation, 0) + 1
        return {
            "summary": {
                "total_debug_operations": len(hist),
                "anomalies_detected": sum(i.anomaly_detected for i in hist),
                "memory_leaks_detected": sum(i.memory_leak_detected for i in hist),
                "performance_issues_detected": sum(i.performance_issue_detected for i in hist),
                "debug_mode": self.config.mode.value,
                "debug_level": self.config.level.value,
            },
            "performance_analysis": {
                "average_execution_time": _mean(times),
                "max_execution_time": max(times, default=0.0),
                "min_execution_time": min(times, default=0.0),
            },
            "memory_analysis": {
                "average_memory_usage": _mean(mem),
                "max_memory_usage": max(mem, default=0.0),
                "average_gpu_memory": _mean(gpu),
                "max_gpu_memory": max(gpu, default=0.0),
            },
            "gradient_analysis": {
                "average_gradient_norm": _mean(finite),
                "max_gradient_norm": max(finite, default=0.0),
                "gradient_anomalies": sum(
                    1
                    for i in hist
                    if (i.gradient_norm is not None and not math.isfinite(i.gradient_norm))
                    or any(e.kind in ("gradient_explosion", "vanishing_gradient") for e in i.events)
                ),
            },
            "operation_breakdown": breakdown,
            "anomalies": [plain(a.to_dict()) for a in self.anomalies],
        }

    def create_debug_plots(self, path: str | Path | None = None) -> Path | None:
        """Write seed 001's 2x2 figure (time, memory, gradient norm, anomalies) as a PNG; returns its path.

        Args:
            path: the PNG file; default ``<config.debug_output_dir>/debug_analysis.png`` (folders created).

        Returns:
            The path written, or None when ``debug_history`` is empty (nothing to plot, as in the seed).

        Raises:
            ImportError: matplotlib is missing (``pip install 'torchdebug[report]'``).

        Cost: about 0.3 s (matplotlib's Agg canvas; no pyplot global state).
        """
        try:
            import matplotlib  # noqa: F401
        except ImportError as e:
            raise ImportError(f"create_debug_plots needs matplotlib: {REPORT_EXTRA}") from e
        from ..views.report._png import render_png

        hist = list(self.debug_history)
        if not hist:
            return None
        steps = list(range(len(hist)))
        norms = [(s, i.gradient_norm) for s, i in zip(steps, hist) if i.gradient_norm is not None]
        data = {
            "timings": {"total": {"steps": steps, "values": [i.execution_time for i in hist]}},
            "memory": {"rss": {"steps": steps, "values": [float(i.rss) for i in hist]}},
            "series": (
                {"grad_norm": {"steps": [s for s, _ in norms], "values": [n for _, n in norms]}}
                if norms
                else {}
            ),
            "anomalies": [{"step": s} for s, i in zip(steps, hist) if i.anomaly_detected],
            "events": [{"step": s, "severity": e.severity} for s, i in zip(steps, hist) for e in i.events],
        }
        out = Path(path) if path is not None else Path(self.config.debug_output_dir) / "debug_analysis.png"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(render_png(data, title=f"{len(hist)} operations"))
        return out

    def clear_debug_history(self) -> None:
        """Forget the history, anomalies and running statistics (seed 002's ``POST /debug/clear``)."""
        self.debug_history.clear()
        self.memory_history.clear()
        self.performance_history.clear()
        self.anomalies.clear()
        self._times.clear()
        self._explosion = self._new_explosion_rule()
        self._leaks = None
        self._profiles = 0
        self.optimization_metrics.clear()


@contextlib.contextmanager
def debug_context(
    level: DebugLevel | str | Any = DebugLevel.BASIC, model: nn.Module | None = None
) -> Iterator[PyTorchDebugger]:
    """Seed 002's ``with debug_context(DebugLevel.BASIC) as debugger:``: the block runs traced op by op.

    Yields a ``PyTorchDebugger`` built from ``level`` (or any config shape it accepts); a NaN/Inf in
    the block is recorded in ``debugger.anomalies`` and warned or raised per the config's
    ``anomaly_detection_mode`` (``"warn"`` by default). Everything is restored on exit.

    Example::

        with debug_context(DebugLevel.BASIC, model=net) as dbg:
            loss_fn(net(x), y).backward()
        print(dbg.anomalies)

    Cost: op-level tracing of the block (see ``AutogradAnomalyDetector``).
    """
    debugger = PyTorchDebugger(level)
    with debugger.autograd_anomaly_detection(model):
        yield debugger


def _input_nonfinite(data: Any) -> str | None:
    """``"nan"`` / ``"inf"`` when a floating tensor in ``data`` holds one (NaN first), else None; one transfer."""
    ts = [t for t in tensor_leaves(data) if t.is_floating_point() or t.is_complex()]
    if not ts:
        return None
    dev = ts[0].device
    with torch.no_grad():
        flags = torch.stack(
            [torch.stack([torch.isnan(t).any(), (~torch.isfinite(t)).any()]).to(dev) for t in ts]
        ).any(0)
        nan, bad = flags.tolist()  # one transfer
    return "nan" if nan else ("inf" if bad else None)


def _input_anomaly(model: nn.Module, kind: str) -> Anomaly:
    return Anomaly(
        phase=Phase.INPUT.value,
        module="",
        op=None,
        location=None,
        kind=kind,
        module_type=type(model).__name__,
        symptom="non-finite value in the model input",
        detected_by="sentinel (no replay)",
        hint="the data arrived non-finite: check the data pipeline (td.validate_model_input names the index)",
    )


class _ActivationCapture:
    """Activation statistics of each leaf module's first output in one forward (device tensors until read)."""

    def __init__(self, model: nn.Module) -> None:
        from ..health.instrument import activation_stats

        self.stats: dict[str, dict[str, torch.Tensor]] = {}
        self.handles: list[Any] = []
        for name, mod in model.named_modules():
            if next(iter(mod.children()), None) is not None:
                continue

            def hook(module: nn.Module, args: Any, out: Any, name: str = name) -> None:
                if name in self.stats or not isinstance(out, torch.Tensor):
                    return
                if out.is_floating_point() and out.numel() > 0:
                    self.stats[name] = activation_stats(module, out)

            self.handles.append(mod.register_forward_hook(hook))

    def read(self) -> dict[str, dict[str, float]]:
        """Every statistic in one host transfer: ``{module: {"mean", "std", "zero", ("dead"|"saturated")}}``."""
        flat = [(m, k, t) for m, ks in self.stats.items() for k, t in ks.items()]
        if not flat:
            return {}
        dev = flat[0][2].device
        host = torch.stack([t.to(dev, torch.float32) for _, _, t in flat]).tolist()  # one transfer
        out: dict[str, dict[str, float]] = {}
        for (m, k, _), v in zip(flat, host):
            out.setdefault(m, {})[k] = v
        return out


@contextlib.contextmanager
def _activation_capture(model: nn.Module) -> Iterator[_ActivationCapture]:
    cap = _ActivationCapture(model)
    try:
        yield cap
    finally:
        for h in cap.handles:
            h.remove()


def _trainable(model: nn.Module) -> tuple[list[str], list[torch.Tensor]]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [n for n, _ in named], [p for _, p in named]


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def debug_operation(
    debug_mode: DebugMode | str = DebugMode.ANOMALY_DETECTION,
    debugger: PyTorchDebugger | None = None,
    *,
    model: nn.Module | None = None,
) -> Any:
    """Seed 004's decorator: run each call of the function inside ``debugger.debug_context(<name>)``.

    Args:
        debug_mode: builds ``PyTorchDebugger(debug_mode=...)`` when no ``debugger`` is given;
            ``ANOMALY_DETECTION``/``FULL_DEBUG`` trace each call op by op (costly: see
            ``AutogradAnomalyDetector``).
        debugger: an existing debugger whose history receives the records.
        model: the model whose modules and parameters an origin is named after; without it, the
            first ``nn.Module`` among the call's positional arguments is used (``training_step(model,
            ...)`` as in the seed), else origins name only the op and line.

    The wrapped function has ``.debugger`` set to the debugger used.

    Example::

        @debug_operation(DebugMode.ANOMALY_DETECTION)
        def training_step(model, x, y): ...
    """
    dbg = debugger if debugger is not None else PyTorchDebugger(debug_mode=debug_mode)

    def wrap(fn: Any) -> Any:
        import functools

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            named = model if model is not None else next((a for a in args if isinstance(a, nn.Module)), None)
            with dbg.debug_context(getattr(fn, "__name__", "operation"), model=named):
                return fn(*args, **kwargs)

        call.debugger = dbg  # type: ignore[attr-defined]
        return call

    return wrap

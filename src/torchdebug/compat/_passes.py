"""Seed 001/002's debugging calls of ``PyTorchDebugger``: passes, memory and time, tensor analysis."""

from __future__ import annotations

import contextlib
import logging
import math
from collections import deque
from collections.abc import Iterator
from datetime import datetime
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .._trees import tensor_leaves
from ..events import Anomaly, Phase, RuleEvent
from ..health.gradients import GradientReport, analyze_model_parameters, check_gradients
from ..health.inspection import call_model
from ..health.instrument import ExplosionRule, top_params
from ..memory.analysis import memory_sample
from ..stats import analyze_tensor, foreach_norms, total_norm
from ._common import (
    DebugInfo,
    TensorInfo,
    grad_norms,
    nonfinite_flag,
    replay_origin,
    rng_state,
    symptom_anomaly,
)
from ._tracing import take_traced_anomaly, tracing_active

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from .._config import DebugConfig

log = logging.getLogger("torchdebug.compat")


class DebuggingCalls:
    """Seed 001's ``debug_*`` calls and seed 002's tensor and gradient analysis (a ``PyTorchDebugger`` part).

    Each call runs in the debugger's own ``debug_context`` record (without the step guard: it checks
    its outputs and gradients itself, with fused reductions and one host transfer, and reports per
    ``config.anomaly_detection_mode``).
    """

    config: DebugConfig
    debug_history: deque[DebugInfo]
    memory_history: deque[dict[str, Any]]
    performance_history: deque[dict[str, Any]]
    _explosion: ExplosionRule

    if TYPE_CHECKING:

        def _context(
            self,
            operation: str,
            model_name: str = ...,
            epoch: int = ...,
            batch: int = ...,
            *,
            model: nn.Module | None = ...,
            guard: bool = ...,
        ) -> AbstractContextManager[DebugInfo]: ...

        def _report(self, info: DebugInfo, anomaly: Anomaly) -> None: ...

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
        with self._context("forward_pass", type(model).__name__, model=model, **kwargs) as info:
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
            # the enclosing trace checks every op (and the first model call's inputs) and reports what
            # it found when its block ends; a NaN/Inf that arrived in the input is reported here
            with torch.set_grad_enabled(grad):
                output = call_model(model, input_data)
            bad_input = _input_nonfinite(input_data)
            if bad_input is not None:
                self._report(info, take_traced_anomaly() or _input_anomaly(model, bad_input))
            return output
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
        with self._context("backward_pass", type(model).__name__, model=model, **kwargs) as info:
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
            if bad or not math.isfinite(loss_f):
                kind = "nan" if math.isnan(loss_f) or any(math.isnan(v) for v in per) else "inf"
                # traced: the trace's origin (None when it was reported already); else the symptom
                anomaly = (
                    take_traced_anomaly()
                    if tracing_active()
                    else symptom_anomaly(model, loss_bad=not math.isfinite(loss_f), bad_params=bad, kind=kind)
                )
                if anomaly is not None:
                    self._report(info, anomaly)
            elif norm == 0.0 and params:
                # seed 001's "Zero gradient norm detected": a model with trainable parameters learned
                # nothing from this loss (an exact 0, so no threshold to tune)
                why = (
                    f"every gradient of the {len(params)} trainable parameters is exactly 0 (a zero loss, "
                    "dead activations, or a loss that does not depend on them)"
                    if idx
                    else f"none of the {len(params)} trainable parameters received a gradient (.grad is None: "
                    "is the loss detached from the model?)"
                )
                zero = RuleEvent("vanishing_gradient", len(self.debug_history), f"zero gradient norm: {why}")
                info.events.append(zero)
                info.anomaly_detected = True
                log.warning("%s", zero)
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
        with self._context("optimization_step", type(model).__name__, model=model, **kwargs) as info:
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

    # -- memory and time --------------------------------------------------------------------------------
    def debug_memory_usage(self, **kwargs: Any) -> tuple[int, int]:
        """Seed 001's ``(cpu_memory, gpu_memory)``: process RSS and CUDA allocated bytes (0 without CUDA)."""
        with self._context("memory_profiling", **kwargs) as info:
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

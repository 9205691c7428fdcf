"""A compiled step function (``step_fn = torch.compile(train_step)``, given as ``watch(step_fn=...)``):
its calls kept for the replay, and the failing step replayed through it (the rare path).

Inside a ``torch.compile``'d function the model's forward runs in compiled code, where no module hook
runs: the session sees the backward and the update, never the forward, so the forward pre-hook's
capture (:meth:`Sentinel.on_forward_start`) is never taken. Given the compiled function, torchdebug
keeps its arguments instead, from the hook ``torch.compile`` runs as each call of it begins (Dynamo's
``enter_exit_hooks``, outside the compiled code: no graph break, nothing added to the graph). At the
first anomaly the step function's original (``_torchdynamo_orig_callable``) is replayed eagerly under
the tracer, then through the compiled function; the weights, gradients, buffers, RNG and the state of
an optimizer that stepped inside it are put back after each run.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._errors import ConfigError
from .._step import SessionView
from ..events import Anomaly
from .cause import Compiled, _nonfinite, recorded
from .locate import StepCapture, Tracer, _autocast, _eager, _preserved_state, _undone

_MAX_CALLS = 64  # calls of the step function kept per step (gradient accumulation), like the captures


@dataclasses.dataclass
class StepCall:
    """One call of the compiled step function: its arguments (references, no copies), the RNG and
    autocast state and grad mode it began with, and the step it belongs to."""

    cap: StepCapture
    step: int


class CompiledStep:
    """The user's ``torch.compile``'d step function: its calls kept while a session is active.

    Cost: per call of the step function, one frame read and the RNG state (a 5 KB copy on CPU): the
    capture the forward pre-hook takes in a plain loop, which does not run inside compiled code.
    """

    def __init__(self, fn: Callable[..., Any], orig: Callable[..., Any], hooks: list[Any]) -> None:
        self.fn, self.orig, self._hooks = fn, orig, hooks
        self.calls: list[StepCall] = []
        self._live: Any = None  # the session's sentinel and step counter, while installed
        self._step_of: Callable[[], int] = lambda: 0
        self._uses_cuda = False

    @staticmethod
    def of(fn: Any) -> CompiledStep:
        """Check ``watch(step_fn=fn)``: the function ``torch.compile`` returned. Raises ``ConfigError``
        naming the fix."""
        if isinstance(fn, nn.Module):
            raise ConfigError(
                f"step_fn= takes the function torch.compile returned (torch.compile(train_step)); got a "
                f"module ({type(fn).__name__}): pass a compiled model as watch()'s model instead"
            )
        orig = getattr(fn, "_torchdynamo_orig_callable", None)
        cells = [c.cell_contents for c in getattr(fn, "__closure__", None) or () if _filled(c)]
        hooks = next(
            (h for h in (getattr(c, "enter_exit_hooks", None) for c in cells) if isinstance(h, list)), None
        )
        if orig is None or hooks is None or not callable(fn):
            raise ConfigError(
                f"step_fn= takes the function torch.compile returned (step_fn = torch.compile(train_step)); "
                f"got {type(fn).__name__}, which torch.compile did not make"
            )
        return CompiledStep(fn, orig, hooks)

    def install(self, live: Any, step_of: Callable[[], int], uses_cuda: bool) -> CompiledStep:
        """Keep each call from now on (``live``: the sentinel, whose ``active``, ``config.replay`` and
        ``replaying`` say whether to). Returns itself (``remove()`` takes the hook off)."""
        self._live, self._step_of, self._uses_cuda = live, step_of, uses_cuda
        self._hooks.append(self._enter)
        return self

    def remove(self) -> None:
        if self._enter in self._hooks:
            self._hooks.remove(self._enter)
        self._live = None
        self.calls = []

    def _enter(self) -> Callable[[], None]:
        """Dynamo's hook as a call of the compiled function begins (outside compiled code): its
        arguments, read from the calling wrapper's frame."""
        s = self._live
        if s is not None and s.active and s.config.replay and not s.replaying:
            f = sys._getframe(1)
            if f.f_code.co_name != "compile_wrapper" and f.f_back is not None:
                f = f.f_back  # Python < 3.12: the wrapper's list comprehension has a frame of its own
            seen = f.f_locals
            if seen.get("fn") is self.orig and "args" in seen:
                step = self._step_of()
                if self.calls and self.calls[0].step != step:
                    self.calls = []
                if len(self.calls) < _MAX_CALLS:
                    cap = StepCapture.take(seen["args"], seen.get("kwargs") or {}, self._uses_cuda)
                    self.calls.append(StepCall(cap, step))
        return _nothing

    def call_at(self, step: int, idx: int) -> StepCall | None:
        """The call of micro-step ``idx`` of ``step`` (the last one kept when it made fewer), or None."""
        calls = [c for c in self.calls if c.step == step]
        return calls[min(idx, len(calls) - 1)] if calls else None


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


def _nothing() -> None:
    return None


def _run(call: StepCall, fn: Callable[..., Any], model: nn.Module) -> Any:
    """Run ``fn`` on the call's arguments as it began; when it made no gradient and returned a scalar
    that needs one (the loop calls ``backward()`` itself), backward from it."""
    cap = call.cap
    torch.set_rng_state(cap.rng_cpu)
    if cap.rng_cuda is not None:
        torch.cuda.set_rng_state_all(cap.rng_cuda)
    with torch.set_grad_enabled(cap.grad_enabled), _autocast(cap.autocast):
        out = fn(*cap.args, **cap.kwargs)
        params = [p for p in model.parameters() if p.requires_grad]
        if (
            isinstance(out, torch.Tensor)
            and out.requires_grad
            and out.numel() == 1
            and all(p.grad is None for p in params)
            and not _nonfinite(out)
        ):
            out.backward()
    return out


def replay_eager(
    mon: SessionView, sf: CompiledStep, call: StepCall, micro: int | None
) -> tuple[Anomaly | None, Tracer]:
    """The step function's original, run eagerly under the tracer on the call's arguments: its anomaly
    (None when finite) and the tracer. What it changed is put back."""
    model = mon.model
    tracer = Tracer(model, frames=mon.config.frames, names=mon.names)
    with _preserved_state(model, mon.uses_cuda), _undone(model), mon.eager():
        tracer.check_inputs(call.cap.args, call.cap.kwargs)
        tracer.check_parameters()
        if tracer.symptom is None:
            try:
                with _eager(), tracer:
                    out = _run(call, sf.orig, model)
                    if tracer.symptom is None:
                        tracer.on_backward_call(out)
            except Exception:
                if tracer.symptom is None:
                    raise
    a = tracer.anomaly(step=mon.global_step, rank=mon.rank, micro_step=micro, detected_by="sentinel")
    return a, tracer


def compiled_code(mon: SessionView, sf: CompiledStep, call: StepCall) -> Compiled:
    """The compiled step function as the compiler's search sees it."""
    model = mon.model
    names = {id(p): n for n, p in model.named_parameters()}

    def replay() -> str | None:
        with _preserved_state(model, mon.uses_cuda), _undone(model):
            out = _run(call, sf.fn, model)
            if _nonfinite(out):
                return "the loss" if isinstance(out, torch.Tensor) and out.numel() == 1 else "its output"
            bad = [names[id(p)] for p in model.parameters() if p.grad is not None and _nonfinite(p.grad)]
        if bad:
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            return f"the gradients of {', '.join(bad[:3])}{more}"
        return None

    def record(grads: bool) -> list[Any]:
        with (
            recorded(model, grads) as calls,
            mon.eager(),
            _eager(),
            _preserved_state(model, mon.uses_cuda),
            _undone(model),
        ):
            _run(call, sf.orig, model)
        return calls

    return Compiled("the compiled step function", replay, record)

"""Op-level traced blocks of the seed facades: ``traced()``, seed 003's ``AutogradAnomalyDetector``."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from .._errors import NonFiniteError
from ..events import Anomaly
from ..nonfinite.locate import Tracer
from ._common import MAX_ANOMALIES, check_mode, handle_anomaly, resolve_config

# One op-level trace at a time per thread: a nested block runs inside the outer trace (it reports).
_TRACING = threading.local()


@dataclass
class _Trace:
    tracer: Tracer
    handled: bool = False  # its anomaly was reported (by the block's backward stop or a facade method)


def _current() -> _Trace | None:
    return getattr(_TRACING, "trace", None)  # type: ignore[no-any-return]


def tracing_active() -> bool:
    """True inside a traced block on this thread (the tracer then owns NaN/Inf detection)."""
    return _current() is not None


def take_traced_anomaly() -> Anomaly | None:
    """The enclosing trace's anomaly so far, marked reported: the caller reports it (None: none yet)."""
    state = _current()
    if state is None or state.handled:
        return None
    anomaly = state.tracer.anomaly()
    if anomaly is not None:
        state.handled = True
    return anomaly


def stop_for(mode: str, *, raise_on_warn: bool) -> str:
    """What a traced step block does when a backward() ends with a NaN/Inf found: ``"raise"`` or ``"skip"``.

    ``raise_on_warn``: the seeds whose warn mode switched on ``torch.autograd.detect_anomaly`` (001,
    002, 004: it raises in ``backward()`` whatever the mode's name) raise in "warn" too.
    """
    if mode == "raise" or (mode == "warn" and raise_on_warn):
        return "raise"
    return "skip"


def drop_gradients(params: list[torch.Tensor]) -> None:
    """Set ``.grad`` to None so a following ``optimizer.step()`` leaves these parameters as they are.

    Rare path (after an anomaly): a Python pass over the parameters.
    """
    for p in params:
        p.grad = None


def _traced_leaves(tracer: Tracer, model: nn.Module | None) -> list[torch.Tensor]:
    if model is not None:
        return list(model.parameters())
    # no model: the leaves whose gradient accumulators the trace mapped (rare path: after an anomaly)
    refs = tracer._node_refs
    return [n.variable for n in refs if type(n).__name__ == "AccumulateGrad"]


@contextlib.contextmanager
def _input_check(tracer: Tracer, model: nn.Module | None) -> Iterator[None]:
    """Check the first model call's inputs: a NaN/Inf that arrives with the batch is phase ``input``.

    With ``model`` its forward pre-hook; without, a one-shot global module pre-hook (the first module
    called on this thread is the outermost). Our reductions run outside the trace's modes.
    """
    tid = threading.get_ident()
    handles: list[Any] = []

    def check(module: nn.Module, args: Any) -> None:
        if threading.get_ident() != tid or not handles:
            return
        for h in handles:
            h.remove()
        handles.clear()
        if tracer.symptom is None:
            with _disable_current_modes(), torch._C.DisableTorchFunction():
                tracer.check_inputs(args, {})

    if model is not None:
        handles.append(model.register_forward_pre_hook(check))
    else:
        handles.append(torch.nn.modules.module.register_module_forward_pre_hook(check))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        handles.clear()


@contextlib.contextmanager
def traced(
    model: nn.Module | None,
    frames: int,
    mode: str,
    sink: list[Anomaly],
    *,
    stop: str | None = None,
) -> Iterator[list[Anomaly]]:
    """Run the block under the engine's op-level ``Tracer``; a NaN/Inf is recorded, warned or raised.

    ``stop`` is what happens when a ``backward()`` in the block ends and the trace has found a
    NaN/Inf (the update has not run yet): ``"raise"`` raises ``NonFiniteError`` out of ``backward()``
    (as ``torch.autograd.detect_anomaly`` did), ``"skip"`` records it (and warns in mode "warn") and
    drops the gradients so a following ``optimizer.step()`` changes nothing; None leaves it to the
    caller (a facade method that skips the update itself). Anything not handled there is handled
    when the block ends per ``mode``: recorded, warned, or raised (chained to the block's error).

    The yielded list receives the anomaly. Hooks and dispatch modes are removed before anything is
    raised or warned, also when the block raised.
    """
    found: list[Anomaly] = []
    if tracing_active():  # nested: the outer trace sees these ops and reports
        yield found
        return
    tracer = Tracer(model, frames=frames)
    if model is not None:
        tracer.check_parameters()  # NaN/Inf weights before the block are phase "parameter"
    state = _Trace(tracer)

    def after_backward() -> None:
        if stop is None or state.handled or tracer.symptom is None:
            return
        state.handled = True
        anomaly = tracer.anomaly()
        assert anomaly is not None
        found.append(anomaly)
        if stop == "raise":
            if len(sink) < MAX_ANOMALIES:
                sink.append(anomaly)
            raise NonFiniteError(anomaly)
        drop_gradients(_traced_leaves(tracer, model))
        handle_anomaly(anomaly, "warn" if mode == "warn" else "detect", sink, stacklevel=4)

    tracer.after_backward = after_backward
    error: BaseException | None = None
    _TRACING.trace = state
    try:
        with _input_check(tracer, model), tracer:
            try:
                yield found
            except Exception as exc:  # kept to re-raise after the anomaly is handled
                error = exc
    finally:
        _TRACING.trace = None
    anomaly = None if state.handled else tracer.anomaly()
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


@functools.cache
def warm_up() -> None:
    """Trace one tiny step, once per process, so the tracer's first-use cost lands here.

    The first op under the tracer imports ``torch._dynamo`` (torch's own lazy import behind its
    dispatch layers: about 1-2 s and 70 MiB on first use); a facade calls this before it starts the
    clock and the memory sample of a user's block, so the block is not charged with it.
    """
    x = torch.ones(1, requires_grad=True)
    with traced(None, 1, "detect", []):
        (x * 2.0).sum().backward()


class AutogradAnomalyDetector:
    """Seed 003's detector: ``with detector.detect_anomaly(): loss.backward()`` names the first NaN/Inf.

    Instead of ``torch.autograd.detect_anomaly`` (which only says which backward node failed), the
    block runs under torchdebug's op-level tracer: the anomaly names the phase (input, parameter,
    forward, backward, optimizer), the module, the aten op or autograd node and the source line.
    torch's own anomaly mode is not touched.

    The update never uses a NaN/Inf the block found: when a ``backward()`` inside the block ends
    with one, mode ``"raise"`` raises ``NonFiniteError`` out of that ``backward()`` (as torch's
    detect_anomaly did: the seed's ``except`` recovery runs), and modes ``"warn"`` / ``"detect"``
    drop the gradients (``.grad = None``), so the ``optimizer.step()`` after the block (or inside
    it) changes no weight. A NaN/Inf in the batch is phase ``input`` (the first model call's
    arguments are checked).

    Args:
        config: a ``DebugConfig``, ``PyTorchDebugConfig``, mapping or None; gives the mode unless
            ``mode`` is passed, and ``frames`` (module calls kept in the anomaly).
        mode: ``"detect"`` (record in ``.anomalies`` only), ``"warn"`` (also a ``TorchDebugWarning``)
            or ``"raise"`` (``NonFiniteError``; the default without a config, as torch's
            detect_anomaly raises).
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
        self.blocks = 0  # detect_anomaly blocks run (the manager's report counts them as operations)

    @contextlib.contextmanager
    def detect_anomaly(self, model: nn.Module | None = None) -> Iterator[AutogradAnomalyDetector]:
        """Run the block under op-level tracing; on a NaN/Inf stop the update, record, warn or raise.

        Not re-entrant: a nested block (same thread) runs inside the outer trace, which reports.

        Raises:
            NonFiniteError: mode "raise" and the block produced (or started with) a NaN/Inf: out of
                the ``backward()`` that ended with it, else when the block ends.
        """
        self.blocks += 1
        with traced(
            model if model is not None else self.model,
            self.config.frames,
            self.mode,
            self.anomalies,
            stop=stop_for(self.mode, raise_on_warn=False),
        ):
            yield self

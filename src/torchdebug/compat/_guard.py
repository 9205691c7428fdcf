"""The seed facades' step guard: a watch session that stops a NaN/Inf before the update can use it.

The seeds wrapped forward, backward and ``optimizer.step()`` in one block and relied on
``torch.autograd.detect_anomaly`` raising inside ``backward()`` to skip a bad batch. The guard gives
such a block the engine's sentinel (:mod:`torchdebug.nonfinite.sentinel`) instead: one fused
finiteness probe of the gradients at the end of each ``backward()`` and one host read; a NaN/Inf is
replayed to its origin and raises ``NonFiniteError`` out of ``backward()`` (mode "raise"/"warn"), or
the sentinel's skip policy drops the gradients at the update (mode "detect").
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .._config import DebugConfig, DebugMode
from ..events import Anomaly
from ._common import MAX_ANOMALIES

if TYPE_CHECKING:
    from ..session.monitor import Monitor

_GUARDED = threading.local()  # one guard per thread: a nested block runs inside the outer guard


@functools.lru_cache(maxsize=32)
def _session_config(stop: str, replay: bool, frames: int, trace_loss: bool) -> DebugConfig:
    # built once per shape: a DebugConfig validates every field (about 1 ms)
    return DebugConfig(
        mode=DebugMode.NONE,
        enable_anomaly_detection=True,  # the sentinel only: the facades measure the rest
        store=False,
        policy="raise" if stop == "raise" else "skip",
        replay=replay,
        frames=frames,
        trace_loss=trace_loss,
    )


_WARNED: set[str] = set()


def _warn_once(key: str, text: str) -> None:
    import warnings

    from .._errors import TorchDebugWarning

    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(TorchDebugWarning(text), stacklevel=4)


class _Guard:
    def __init__(self, config: DebugConfig, stop: str) -> None:
        self.config = _session_config(stop, config.replay, config.frames, config.trace_loss)
        self.stop = stop
        self.mon: Monitor | None = None
        self.handles: list[Any] = []
        self.tid = threading.get_ident()

    def open(self, model: nn.Module, args: Any = None) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        from ..session.monitor import Monitor

        if isinstance(model, torch.jit.ScriptModule):
            # torch refuses hooks on TorchScript modules: the block runs unguarded, said once
            _warn_once(
                "script",
                f"torchdebug: {type(model).__name__} is a TorchScript module, which takes no hooks: "
                "debug_context blocks that call it are timed and measured but not guarded against a "
                "NaN/Inf; trace them instead (debug_mode=DebugMode.ANOMALY_DETECTION or "
                "enable_anomaly_detection=True), or use torch.compile",
            )
            return
        mon = Monitor(model, config=self.config, run=False)
        try:
            mon.__enter__()
        except Exception as exc:  # the debugger never breaks the user's block: unguarded, said once
            with contextlib.suppress(Exception):
                mon.__exit__(type(exc), exc, None)
            _warn_once("open", f"torchdebug: the step guard failed to start ({exc!r}); blocks run unguarded")
            return
        self.mon = mon
        mon.sentinel.check_each_backward = self.stop == "raise"
        # after the session's own post-hook (registered first): the step ends with the update, so the
        # next batch in the same block starts clean
        self.handles.append(register_optimizer_step_post_hook(self._after_update))
        if args is not None:
            mon.forward_started(model, args, {})  # the discovering call: capture its batch for replay

    def discover(self) -> None:
        """No model given: the first module called on this thread is the model (a one-shot hook)."""

        def first_call(module: nn.Module, args: Any) -> None:
            if threading.get_ident() != self.tid or self.mon is not None:
                return
            self.remove_hooks()
            self.open(module, args)  # a TorchScript module: stays unguarded (see open)

        self.handles.append(torch.nn.modules.module.register_module_forward_pre_hook(first_call))

    def _after_update(self, opt: Any, args: Any, kwargs: Any) -> None:
        mon = self.mon
        if mon is not None and not mon.closed and not mon.replaying and mon.owns_optimizer(opt):
            mon.step()

    def remove_hooks(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def close(self, exc: BaseException | None) -> list[Anomaly]:
        self.remove_hooks()
        mon, self.mon = self.mon, None
        if mon is None:
            return []
        with contextlib.suppress(Exception):  # the session's exit must not replace the block's error
            mon.__exit__(type(exc) if exc is not None else None, exc, None)
        return list(mon.anomalies)


@functools.cache
def warm_up() -> None:
    """Import what a guard's session needs, once per process, before a facade starts its clock."""
    import torch.optim.optimizer  # noqa: F401

    from ..session import monitor  # noqa: F401


@contextlib.contextmanager
def step_guard(
    model: nn.Module | None, config: DebugConfig, stop: str, sink: list[Anomaly]
) -> Iterator[list[Anomaly]]:
    """Guard one block that may run a training step (see the module docstring).

    Args:
        model: the model; None: the first module the block calls on this thread.
        config: gives ``replay``, ``frames``, ``trace_loss``.
        stop: ``"raise"`` (NonFiniteError out of ``backward()``) or ``"skip"`` (the update is skipped).
        sink: receives the anomalies (bounded) when the block ends.

    Yields the list of this block's anomalies (filled when the block ends). Everything installed
    comes off when the block ends, also on exceptions. A nested guard on the same thread does nothing.

    Cost: building a session per block (a walk of the model's modules); per ``backward()`` one
    fused finiteness probe of the gradients and one host read (plus one at the update when the
    gradients may have been edited since).
    """
    found: list[Anomaly] = []
    if getattr(_GUARDED, "active", False):
        yield found
        return
    guard = _Guard(config, stop)
    _GUARDED.active = True
    error: BaseException | None = None
    try:
        if model is not None:
            guard.open(model)
        else:
            guard.discover()
        yield found
    except BaseException as exc:
        error = exc
        raise
    finally:
        _GUARDED.active = False
        found.extend(guard.close(error))
        for a in found:
            if len(sink) < MAX_ANOMALIES and not any(a is b for b in sink):
                sink.append(a)

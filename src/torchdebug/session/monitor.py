"""watch(): the always-on session. Installs the sentinel and instruments, counts steps, removes all on exit.

The sentinel's hot path, per micro-step: a reference to the batch and the RNG state at the model's
first forward; a foreach norm of the gradients after each backward (device only), plus, as the
update starts, a finiteness probe of the gradients changed since (clipping, normalisation,
unscaling); and, once per step, ONE host transfer of every number the step produced (as the update
starts, so corrupted gradients never reach the weights; else at ``mon.step()``, or at the end of
each backward once the loop is known to update by hand). Parameters are checked after each
optimizer update on the device; that flag travels with the next step's transfer. When the transfer
shows a NaN/Inf, the failing micro-step is replayed under op-level tracing (``locate.replay_capture``)
to name the phase, module, op and source line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import math
import os
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._config import DebugConfig, DebugLevel, coerce_config
from .._errors import NonFiniteError, RunStoreError, TorchDebugWarning
from .._frames import warn_at_user
from .._trees import tensor_leaves
from ..events import Anomaly, Phase, RuleEvent, StepRecord, rule_counts, training_summary
from ..nonfinite.locate import LossTape, StepCapture, replay_capture
from . import distributed as _distributed

POLICIES = ("raise", "warn", "skip")
_MAX_CAPTURES = 64  # micro-steps kept per step for replay (references only)
_MAX_OUT_HOOKS = 16
_MAX_ANOMALIES = 1000
_MAX_EVENTS = 10_000

# instrument name -> (module, class); each class is constructed with no arguments
_INSTRUMENTS: dict[str, tuple[str, str]] = {
    "gradients": ("torchdebug.health.instrument", "GradientHealth"),
    # alone (no "gradients"): GradientHealth records these itself when it runs, see _wanted()
    "activations": ("torchdebug.health.standalone", "ActivationInstrument"),
    "gradient_details": ("torchdebug.health.standalone", "WeightInstrument"),
    "device_placement": ("torchdebug.session.placement", "DevicePlacementInstrument"),
    "memory": ("torchdebug.memory.instrument", "MemoryInstrument"),
    "module_memory": ("torchdebug.memory.instrument", "ModuleMemoryInstrument"),
    "timing": ("torchdebug.perf.timing", "TimingInstrument"),
    "module_time": ("torchdebug.perf.timing", "ModuleTimeInstrument"),
    "flops": ("torchdebug.perf.flops", "FlopsInstrument"),
    "profiler": ("torchdebug.perf.profiler", "ProfilerInstrument"),
    "tensorboard": ("torchdebug.views.tensorboard", "TensorBoardInstrument"),
}

_ACTIVE: list[Monitor] = []
_TLS = threading.local()
_ORIGINALS: dict[str, Any] = {}


def _foreach_norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Per-tensor L2 norms as one float32 device tensor; no host sync.

    Hot path: all dense float32 on one device (the common case): a BLAS dot per tensor on CPU,
    the fused ``torch._foreach_norm`` elsewhere; anything else through
    :func:`torchdebug.stats.foreach_norms`. Callers confirm non-finite entries exactly.
    """
    tensors = _distributed.local_shards(tensors)  # FSDP2 DTensors: this rank's shard
    first = tensors[0]
    if all(
        t.dtype is torch.float32 and t.device == first.device and t.layout is torch.strided for t in tensors
    ):
        with torch.no_grad():
            if first.device.type == "cpu" and all(t.is_contiguous() for t in tensors):
                # CPU: a BLAS dot per tensor is ~1.6x faster than the foreach norm (which is not fused
                # there); its float32 sum of squares can overflow: callers confirm non-finite entries
                return torch.stack([torch.dot(t.view(-1), t.view(-1)) for t in tensors]).sqrt()
            return torch.stack(torch._foreach_norm(tensors))
    from ..stats import foreach_norms

    return foreach_norms(tensors)


def _finite_probe(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One float32 per tensor that is finite iff the tensor is (a false alarm is possible: see below).

    CPU: a plain sum per tensor, one memory pass and about half the cost of a norm; a finite sum
    proves every element finite. A sum of finite values that overflows reads as non-finite: the
    caller confirms flagged tensors exactly. Accelerators: the fused foreach norm (one kernel).
    """
    if not tensors:  # no trainable parameters (none, or all frozen): nothing to check
        return torch.zeros(0)
    tensors = _distributed.local_shards(tensors)  # FSDP2 DTensors: this rank's shard
    if tensors[0].device.type != "cpu":
        return _foreach_norms(tensors)
    with torch.no_grad():
        return torch.stack([_probe_one(t) for t in tensors])


def _probe_one(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        return t.sum(dtype=torch.float32)
    if t.is_complex():  # real and imaginary parts: a NaN in either is a NaN gradient
        return torch.view_as_real(t).sum(dtype=torch.float32)
    return t.new_zeros((), dtype=torch.float32)  # integer tensors hold no NaN/Inf


# -- global patches, installed while at least one monitor is active -----------------------------------
def _backward_wrapper(orig: Callable[..., Any], is_method: bool) -> Callable[..., Any]:
    @functools.wraps(orig)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # Tensor.backward calls torch.autograd.backward: only the outermost call counts
        mons = (
            [m for m in _ACTIVE if m._accepts_backward()] if not getattr(_TLS, "in_backward", False) else []
        )
        if not mons:
            return orig(*args, **kwargs)
        _TLS.in_backward = True
        loss = args[0] if args else kwargs.get("tensors", kwargs.get("self"))
        gradient = args[1] if len(args) > 1 else kwargs.get("gradient", kwargs.get("grad_tensors"))
        for m in mons:
            m._on_backward_start(loss, gradient)
        try:
            return orig(*args, **kwargs)
        finally:
            _TLS.in_backward = False
            for m in mons:
                m._on_backward_end()

    wrapper.__torchdebug_wrapper__ = True  # type: ignore[attr-defined]
    return wrapper


def _scaler_step_wrapper(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def step(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        mons = [m for m in _ACTIVE if m._owns_optimizer(optimizer)]
        for m in mons:
            m._scaler_step_begin(self)
        try:
            out = orig(self, optimizer, *args, **kwargs)
        except BaseException:
            for m in mons:
                m._scaler_step_end(self, failed=True)
            raise
        for m in mons:
            m._scaler_step_end(self)  # may raise NonFiniteError: a skipped step the scaler cannot fix
        return out

    step.__torchdebug_wrapper__ = True  # type: ignore[attr-defined]
    return step


def _is_ours(hook: Any) -> bool:
    """True for a hook torchdebug registered (a bound method, closure or partial from its modules)."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    fn = getattr(hook, "__func__", hook)
    owner = getattr(hook, "__self__", None)
    names = (getattr(fn, "__module__", None) or "", type(owner).__module__ if owner is not None else "")
    return any(n == "torchdebug" or n.startswith("torchdebug.") for n in names)


def _getstate_wrapper(orig: Callable[..., Any]) -> Callable[..., Any]:
    """``nn.Module.__getstate__`` without torchdebug's hooks: pickling, ``copy.deepcopy``,
    ``torch.save(model)`` and ``AveragedModel`` see the module as it is without ``watch``."""

    @functools.wraps(orig)
    def __getstate__(self: nn.Module) -> dict:
        state = orig(self)
        for key, hooks in list(state.items()):
            if not (key.startswith("_") and "hooks" in key and isinstance(hooks, dict) and hooks):
                continue
            ours = {k for k, h in hooks.items() if callable(h) and _is_ours(h)}
            if ours:
                state[key] = type(hooks)((k, h) for k, h in hooks.items() if k not in ours)
                for flags in (
                    "_forward_pre_hooks_with_kwargs",
                    "_forward_hooks_with_kwargs",
                    "_forward_hooks_always_called",
                ):  # keyed by the same handle ids
                    d = state.get(flags)
                    if isinstance(d, dict) and ours & d.keys():
                        state[flags] = type(d)((k, v) for k, v in d.items() if k not in ours)
        return state

    __getstate__.__torchdebug_wrapper__ = True  # type: ignore[attr-defined]
    return __getstate__


def _install_patches() -> None:
    if _ORIGINALS:
        return
    _ORIGINALS["Module.__getstate__"] = nn.Module.__getstate__
    nn.Module.__getstate__ = _getstate_wrapper(nn.Module.__getstate__)  # type: ignore[method-assign]
    _ORIGINALS["Tensor.backward"] = torch.Tensor.backward
    _ORIGINALS["autograd.backward"] = torch.autograd.backward
    torch.Tensor.backward = _backward_wrapper(torch.Tensor.backward, True)  # type: ignore[method-assign]
    torch.autograd.backward = _backward_wrapper(torch.autograd.backward, False)  # type: ignore[assignment]
    try:
        from torch.amp.grad_scaler import GradScaler

        _ORIGINALS["GradScaler.step"] = GradScaler.step
        GradScaler.step = _scaler_step_wrapper(GradScaler.step)  # type: ignore[method-assign]
    except ImportError:  # torch without torch.amp.grad_scaler
        pass


def _remove_patches() -> None:
    if not _ORIGINALS:
        return
    if getattr(torch.Tensor.backward, "__torchdebug_wrapper__", False):
        torch.Tensor.backward = _ORIGINALS["Tensor.backward"]  # type: ignore[method-assign]
    if getattr(torch.autograd.backward, "__torchdebug_wrapper__", False):
        torch.autograd.backward = _ORIGINALS["autograd.backward"]  # type: ignore[assignment]
    if getattr(nn.Module.__getstate__, "__torchdebug_wrapper__", False):
        nn.Module.__getstate__ = _ORIGINALS["Module.__getstate__"]  # type: ignore[method-assign]
    if "GradScaler.step" in _ORIGINALS:
        from torch.amp.grad_scaler import GradScaler

        if getattr(GradScaler.step, "__torchdebug_wrapper__", False):
            GradScaler.step = _ORIGINALS["GradScaler.step"]  # type: ignore[method-assign]
    _ORIGINALS.clear()


def _detect_rank(config: DebugConfig) -> int:
    return _distributed.detect(config)[0]


class Monitor:
    """A watch session over one model. Create it with :func:`watch`; see there."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        policy: str | None = None,
        scaler: Any = None,
        run: Any = None,
        config: Any = None,
        early_stopping: Any = None,
        tensorboard: bool | str | None = None,
        clip_on_spike: float | None = None,
        on_oom: str | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"watch(model, ...): model must be a torch.nn.Module, got {type(model).__name__}")
        optimizer = _unwrap_optimizer(optimizer)
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"watch(..., optimizer=): expected a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        cfg = coerce_config(config)
        changes: dict[str, Any] = {}
        if policy is not None:
            if not isinstance(policy, str) or policy.lower() not in POLICIES:
                raise ValueError(
                    f"watch(..., policy={policy!r}): policy must be one of {', '.join(POLICIES)}"
                )
            changes["policy"] = policy.lower()
        if tensorboard is not None:
            changes["tensorboard"] = tensorboard
        if clip_on_spike is not None:
            changes["clip_on_spike"] = clip_on_spike
        if on_oom is not None:
            changes["on_oom"] = on_oom
        self.config: DebugConfig = cfg.replace(**changes) if changes else cfg
        if scaler is not None and not all(hasattr(scaler, a) for a in ("scale", "step", "update")):
            raise TypeError(
                f"watch(..., scaler=): expected a torch.amp.GradScaler, got {type(scaler).__name__}"
            )
        self._ddp, model = _distributed.split_ddp(model)  # DDP: watch the wrapped module
        # torch.compile(model) wraps the module: the root hooks go on the module that is called, while
        # names, parameters and the instruments see the original (no "_orig_mod." prefix anywhere)
        self._called: nn.Module = model
        orig = getattr(model, "_orig_mod", None)
        if type(model).__name__ == "OptimizedModule" and isinstance(orig, nn.Module):
            model = orig
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        self.early_stopping = early_stopping
        self._run_arg = run
        self.names: dict[nn.Module, str] = {m: n for n, m in model.named_modules()}
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.param_names: list[str] = [n for n, _ in named]
        self.params: list[torch.Tensor] = [p for _, p in named]
        self._param_ids = {id(p) for p in model.parameters()}
        self.rank, self.world_size, self._has_pg = _distributed.detect(self.config)
        self._coord: Any = None  # the distributed coordinator (world_size > 1 or a hang_timeout)
        self.global_step: int = 0  # completed steps; mon.step() completes one
        self.micro_step = 0
        # who produces the step protocol: None = the plain-loop hooks (optimizer pre/post hooks);
        # a framework adapter sets its name and calls update_starting()/update_done() itself
        self.driver: str | None = None
        self.batch: Any = None  # a driver's current batch; kept (a reference) with the micro-step's capture
        self.writer: Any = None
        self.run_dir: Path | None = None
        self.instruments: list[Any] = []
        self.anomalies: list[Anomaly] = []
        self.events: deque[RuleEvent] = deque(maxlen=_MAX_EVENTS)
        self.records: deque[StepRecord] = deque(maxlen=1000)
        self.counters: dict[str, int] = {"anomaly_steps": 0, "skipped_steps": 0, "replays": 0}
        self._skip_run: list[int] | None = None  # policy="skip": [first step, count] of the current run
        self.grad_norm_host: float | None = None
        self.grad_norms_host: list[float] | None = None
        self.level_overrides: list[str] = []
        self._enabled = self.config.instruments()
        self._sentinel = "nonfinite" in self._enabled
        self._entered = False
        self._closed = False
        self._replaying = False
        self._handles: list[Any] = []
        self._warned: set[str] = set()
        self._uses_cuda = any(p.is_cuda for p in self.params)
        self._reset_step_state()
        self._deferred: dict[str, torch.Tensor] = {}
        self._deferred_step: int | None = None
        # manual updates: the gradients an edit changed after the backward check (their probe: _deferred)
        self._deferred_edit_index: list[int] = []
        self._tape: LossTape | None = None
        self._last_step_end = time.perf_counter()
        self._adopted: set[int] = set()
        # manual update (no optimizer object, e.g. p.data.add_(p.grad, alpha=-lr)): known after a step
        # ended with no optimizer hook; from then on the check runs at the end of each backward()
        self._manual = False
        self._segment_start = 0  # the step the current history segment (dashboard "clear") began
        self._in_compiled_call = False
        self._pending_level: DebugLevel | None = None  # set_level() from any thread, applied in step()
        self._pending_changes: dict[str, Any] = {}  # reconfigure() from any thread, applied in step()

    # -- lifecycle ------------------------------------------------------------------------------
    def __enter__(self) -> Monitor:
        if self._entered:
            raise RuntimeError(
                "this watch() session is already active: it is not re-entrant; create a new one"
            )
        self._entered = True
        try:
            self._open_store()
            self._install()
        except BaseException:
            self._teardown(None)
            raise
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        # Everything installed comes off whatever happens here (a warning turned into an error by the
        # user's filters, a NonFiniteError from the final check, an instrument that fails at exit).
        try:
            if exc is not None and not isinstance(exc, NonFiniteError):
                for inst in list(self.instruments):
                    self._call(inst, "on_exception", exc)
            if exc is None and self._sentinel:
                with contextlib.suppress(Exception):
                    self._final_check()
            self._say_skips(at_exit=True)
            for inst in list(self.instruments):
                self._call(inst, "on_exit")
        finally:
            self._teardown(exc)

    def _install(self) -> None:
        _ACTIVE.append(self)
        _install_patches()
        self._handles.append(self._called.register_forward_pre_hook(self._root_pre, with_kwargs=True))
        self._handles.append(self._called.register_forward_hook(self._root_post))
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self._handles.append(register_optimizer_step_pre_hook(self._opt_pre))
        self._handles.append(register_optimizer_step_post_hook(self._opt_post))
        for name in sorted(self._wanted()):
            self._build_instrument(name)
        if self.world_size > 1 or self.config.hang_timeout is not None:
            self._coord = _distributed.Coordinator(self, self.rank, self.world_size, self._has_pg, self._ddp)
            self.instruments.append(self._coord)
        self._guard_module_hooks()
        self._wrap_compiled()

    # -- torch.compile / model.compile() -------------------------------------------------------------
    def _guard_module_hooks(self) -> None:
        """Make every torchdebug module hook a no-op while Dynamo traces (``model.compile()`` compiles
        ``_call_impl`` with its hooks): no graph break, no Dynamo warning, the same graphs as without
        watch. Per-module instruments then record nothing inside compiled regions; the root's work runs
        outside them (:meth:`_wrap_compiled`)."""
        for mod in {*self._called.modules(), *self.model.modules()}:
            for attr in ("_forward_pre_hooks", "_forward_hooks"):
                hooks = getattr(mod, attr, None)
                if not isinstance(hooks, dict):
                    continue
                for k, h in list(hooks.items()):
                    if _is_ours(h) and not getattr(h, "__torchdebug_guard__", False):
                        hooks[k] = _compile_guard(h)

    def _wrap_compiled(self) -> None:
        """``model.compile()`` in place: run the root's capture around the compiled call, outside Dynamo.

        Called at enter and at each backward (a model compiled after ``watch`` began is picked up one
        micro-step later). Restored at exit.
        """
        root = self._called
        impl = root.__dict__.get("_compiled_call_impl")
        if impl is None or getattr(impl, "__torchdebug_compiled__", None) is not None:
            return
        ref = weakref.ref(self)

        def call(*args: Any, **kwargs: Any) -> Any:
            mon = ref()
            if mon is None or mon._closed:
                return impl(*args, **kwargs)
            mon._root_pre(root, args, kwargs, outside=True)
            mon._in_compiled_call = True  # the hooks inside (eager fallback) must not run twice
            try:
                out = impl(*args, **kwargs)
            finally:
                mon._in_compiled_call = False
            mon._root_post(root, args, out, outside=True)
            return out

        call.__torchdebug_compiled__ = impl  # type: ignore[attr-defined]
        root._compiled_call_impl = call  # type: ignore[assignment]

    def _unwrap_compiled(self) -> None:
        impl = self._called.__dict__.get("_compiled_call_impl")
        orig = getattr(impl, "__torchdebug_compiled__", None)
        if orig is not None:
            self._called._compiled_call_impl = orig

    @contextlib.contextmanager
    def _eager(self) -> Any:
        """Run the model eagerly (the replay traces ops one by one): bypass an in-place compile."""
        impl = self._called.__dict__.get("_compiled_call_impl")
        if impl is None or self.model is not self._called:
            yield
            return
        self._called._compiled_call_impl = None
        try:
            yield
        finally:
            self._called._compiled_call_impl = impl

    def _wanted(self) -> set[str]:
        wanted = set(self._enabled) | ({"tensorboard"} if self.config.tensorboard else set())
        if "gradients" in wanted:
            wanted -= {"activations", "gradient_details"}  # GradientHealth records them (one set of hooks)
        return wanted

    def _build_instrument(self, name: str) -> None:
        spec = _INSTRUMENTS.get(name)
        if spec is None:
            return  # handled by the monitor (nonfinite)
        try:
            cls = getattr(importlib.import_module(spec[0]), spec[1])
        except (ImportError, AttributeError):
            return  # not available in this build, or its extra is not installed
        if any(type(i) is cls for i in self.instruments):
            return
        try:
            inst = cls()
        except Exception as exc:
            self._disable(cls, exc)
            return
        self.instruments.append(inst)
        self._call(inst, "install")

    def _apply_level(self, level: DebugLevel, **changes: Any) -> None:
        """Switch the instruments to a new level and options (on the training thread, between steps)."""
        self.config = self.config.replace(level=level, **changes)
        self._enabled = self.config.instruments()
        self._sentinel = "nonfinite" in self._enabled
        ours = {spec[1] for spec in _INSTRUMENTS.values()}
        for inst in [i for i in self.instruments if type(i).__name__ in ours]:
            self.instruments.remove(inst)  # rebuilt below: their depth follows the level
            with contextlib.suppress(Exception):
                if hasattr(inst, "remove"):
                    inst.remove(self)
        for name in sorted(self._wanted()):
            self._build_instrument(name)
        self._guard_module_hooks()

    def _teardown(self, exc: BaseException | None) -> None:
        if self._closed:
            return
        self._closed = True
        self._pop_tape(force=True)
        self._unwrap_compiled()
        for h in self._handles:
            with contextlib.suppress(Exception):
                h.remove()
        self._handles.clear()
        for inst in list(self.instruments):
            with contextlib.suppress(Exception):
                if hasattr(inst, "remove"):
                    inst.remove(self)
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        if not _ACTIVE:
            _remove_patches()
        self._reset_step_state()
        if self.writer is not None and self._owns_writer:
            status = "finished" if exc is None else "failed"
            with contextlib.suppress(Exception):
                self.writer.close(status=status)

    def _open_store(self) -> None:
        run = self._run_arg
        self._owns_writer = False
        if run is False or (run is None and not self.config.store):
            return
        if run is not None and hasattr(run, "log_scalars"):
            self.writer = run
        else:
            try:
                from ..store import create_run
            except ImportError:
                return
            root = os.fspath(run) if run is not None else self.config.run_dir
            name = self.config.run_name or type(self.model).__name__.lower()
            cfg = self.config.to_dict()
            try:
                self.writer = _distributed.create_run_for(
                    create_run, root, name, cfg, self.rank, self.world_size, self._has_pg
                )
            except (OSError, RunStoreError) as exc:
                # recording is a convenience: training goes on without a run folder
                warnings.warn(
                    TorchDebugWarning(
                        f"torchdebug: cannot create a run under {root!r} ({exc}); recording is off for this "
                        "session. Pass run=<writable folder> or run=False."
                    ),
                    stacklevel=4,
                )
                return
            self._owns_writer = True
        self.run_dir = Path(self.writer.path) if getattr(self.writer, "path", None) is not None else None

    # -- instrument plumbing ---------------------------------------------------------------------
    def _call(self, inst: Any, method: str, *args: Any) -> Any:
        fn = getattr(inst, method, None)
        if fn is None:
            return None
        try:
            return fn(self, *args)
        except NonFiniteError:
            raise
        except Exception as exc:
            self._disable(inst, exc)
            return None

    def _disable(self, inst: Any, exc: BaseException) -> None:
        name = getattr(inst, "name", type(inst).__name__)
        warnings.warn(
            TorchDebugWarning(f"torchdebug: instrument {name!r} failed and was switched off: {exc!r}"),
            stacklevel=3,
        )
        if inst in self.instruments:
            self.instruments.remove(inst)
            with contextlib.suppress(Exception):
                if hasattr(inst, "remove"):
                    inst.remove(self)

    def _each(self, method: str, *args: Any) -> None:
        for inst in list(self.instruments):
            if hasattr(inst, method):
                self._call(inst, method, *args)

    def due(self, every: int | None) -> bool:
        """True on steps 0, every, 2*every ... (the detailed schedule)."""
        return every is not None and every > 0 and self.global_step % every == 0

    def emit(self, event: RuleEvent) -> None:
        """Record a rule event (store + memory) and warn once per kind."""
        self.events.append(event)
        self._step_events.append(event)
        if self.writer is not None:
            with contextlib.suppress(Exception):
                self.writer.log_event(event.step, event.kind, event.severity, event.message, event.to_dict())
        if event.severity != "info" and event.kind not in self._warned:
            self._warned.add(event.kind)
            warn_at_user(TorchDebugWarning(f"torchdebug: {event}"))  # the user's line, not ours

    def log_scalars(self, values: Mapping[str, float], step: int | None = None) -> None:
        if self.writer is not None:
            self.writer.log_scalars(self.global_step if step is None else step, dict(values))

    def observe(self, name: str, value: float) -> None:
        """Record a monitored value (validation loss, early-stopping metric) at the current step."""
        if not isinstance(name, str) or not name:
            raise TypeError("observe(name, value): name must be a non-empty string")
        value = float(value)
        self.log_scalars({f"observe/{name}": value})
        self._each("on_observe", name, value)

    def run_step(self, step_fn: Callable[[Any], Any], batch: Any) -> Any:
        """Run ``step_fn(batch)`` (forward + loss + backward; returns the loss) with the OOM policy.

        With ``on_oom="retry_half"`` an out-of-memory error re-runs the step on halves of the batch
        with gradients scaled so they equal the full-batch gradients (gradient accumulation), and
        records an ``oom_retry`` event. Call ``optimizer.step()`` and ``mon.step()`` after it.
        """
        if not callable(step_fn):
            raise TypeError(
                f"run_step(step_fn, batch): step_fn must be callable, got {type(step_fn).__name__}"
            )
        from ..memory.recovery import run_step_with_oom_retry

        def new_micro_step(_piece: Any) -> None:
            self._need_new_capture = True  # the failed attempt never reached its backward

        def record(retry: Any) -> None:
            evidence = retry.to_dict() if hasattr(retry, "to_dict") else {}
            self.emit(RuleEvent("oom_retry", self.global_step, str(retry), "warning", evidence=evidence))

        return run_step_with_oom_retry(
            step_fn,
            batch,
            on_oom=self.config.on_oom,
            optimizer=self.optimizer,
            params=self.params,
            before_attempt=new_micro_step,
            on_retry=record,
        )

    # -- live control (dashboard) ----------------------------------------------------------------
    def set_level(self, level: str | DebugLevel) -> DebugLevel:
        """Switch the debug level of the live session; instruments follow at the end of the next step.

        Safe to call from another thread (the dashboard's): the switch itself happens on the training
        thread inside ``mon.step()``. Raises ``ValueError`` for an unknown level, listing the allowed.
        """
        lv = DebugLevel(level) if not isinstance(level, DebugLevel) else level
        self._pending_level = lv
        self.level_overrides.append(lv.value)
        if self.writer is not None:
            self.writer.log_event(
                self.global_step,
                "level_change",
                "info",
                f"debug level set to {lv.value}",
                {"level": lv.value},
            )
        return lv

    def reconfigure(self, **changes: Any) -> DebugConfig:
        """Change options of the live session; instruments follow at the end of the next step.

        Validated now (``ConfigError`` naming the option), applied on the training thread inside
        ``mon.step()`` like ``set_level``, and recorded as a ``config_change`` event. Returns the
        config the session will run with. Runtime switches of the seed-era names:
        ``enable_debugging`` / ``disable_debugging`` / ``get_debugging_status``.
        """
        new = self.config.replace(**{**self._pending_changes, **changes})
        self._pending_changes.update(changes)
        if self.writer is not None:
            with contextlib.suppress(Exception):
                self.writer.log_event(
                    self.global_step,
                    "config_change",
                    "info",
                    "options changed: " + ", ".join(f"{k}={v!r}" for k, v in sorted(changes.items())),
                    {"changes": {k: getattr(v, "value", v) for k, v in changes.items()}},
                )
        return new

    def enable_debugging(self, options: Any = None) -> dict[str, Any]:
        """Seed 000's runtime switch; see ``torchdebug.compat.enable_debugging``."""
        from .runtime import enable_debugging

        return enable_debugging(self, options)

    def disable_debugging(self, options: Any = None) -> dict[str, Any]:
        """Seed 000's runtime switch; see ``torchdebug.compat.disable_debugging``."""
        from .runtime import disable_debugging

        return disable_debugging(self, options)

    def get_debugging_status(self) -> dict[str, Any]:
        """Seed 000's status; see ``torchdebug.compat.get_debugging_status``."""
        from .runtime import get_debugging_status

        return get_debugging_status(self)

    def clear(self) -> None:
        """Start a new history segment (the dashboard's "clear"); nothing stored is deleted."""
        self.events.clear()
        self.records.clear()
        self.counters = dict.fromkeys(self.counters, 0)
        for inst in self.instruments:
            c = getattr(inst, "counters", None)
            if isinstance(c, dict):
                for k in c:
                    c[k] = 0
        if self.writer is not None and hasattr(self.writer, "start_segment"):
            self.writer.start_segment(f"cleared at step {self.global_step}", step=self.global_step)
        self._segment_start = self.global_step

    def training_summary(self) -> dict[str, Any]:
        """The seed-era training summary (counts and rates since the last ``clear()``)."""
        total = max(self.global_step - self._segment_start, 0)
        explosions, vanishing, loss = rule_counts(e.kind for e in self.events)
        return training_summary(total, self.counters["anomaly_steps"], explosions, vanishing, loss)

    # -- hot path: forward -----------------------------------------------------------------------
    def _reset_step_state(self) -> None:
        self._captures: list[StepCapture] = []
        self._cap: StepCapture | None = None
        self._loss_vals: list[torch.Tensor] = []
        self._micro_bad: list[torch.Tensor] = []
        self._norms: torch.Tensor | None = None
        self._norm_index: list[int] = []
        self._norms_probe = False
        # what backward() left, for the edit check as the update starts: index -> (grad, its _version)
        self._grad_seen: dict[int, tuple[torch.Tensor, int]] = {}
        self._edit_index: list[int] = []  # gradients changed since backward() measured them
        self._edit_probe: torch.Tensor | None = None
        self._edit_bad: list[int] = []  # ... and non-finite when the update started (confirmed exactly)
        self._synced_at_backward = False  # manual mode: the transfer ran at the end of backward()
        self._grad_anomaly = False  # this step's anomaly came from the gradient check
        self._params_bad_now = False  # the parameter probe read with this step's transfer was non-finite
        self._micro_bad_cleared = False  # the probe flagged an overflowing sum that the exact check cleared
        self._synced = False
        self._values: dict[str, float] = {}
        self._opt_ran = False
        self._scaler_ran = False
        self._scaler_skipped = False
        self._scale_used: torch.Tensor | None = None
        self._step_events: list[RuleEvent] = []
        self._step_anomaly: Anomaly | None = None
        self._skipped = False
        self._skip_reason = ""
        self._in_forward = False
        self._need_new_capture = True

    def _accepts_backward(self) -> bool:
        return not self._replaying and not self._closed

    def _root_pre(self, module: nn.Module, args: tuple, kwargs: dict, outside: bool = False) -> None:
        if self._replaying or not torch.is_grad_enabled() or (self._in_compiled_call and not outside):
            return
        self._pop_tape()
        if self._need_new_capture:
            self._need_new_capture = False
            if self._sentinel and self.config.replay and len(self._captures) < _MAX_CAPTURES:
                self._cap = StepCapture.take(args, kwargs, self._uses_cuda)
                if module is not self.model:
                    self._cap.module = module  # a driver hooked the submodule the training step calls
                self._cap.batch = self.batch
                self._captures.append(self._cap)
            else:
                self._cap = None
            self._each("on_forward_start", module, args, kwargs)
            if outside or self._called is not self.model:
                self._guard_module_hooks()  # compiled: hooks an instrument added just now (on a schedule)

    def _root_post(self, module: nn.Module, args: tuple, output: Any, outside: bool = False) -> None:
        if self._replaying or not torch.is_grad_enabled() or (self._in_compiled_call and not outside):
            return
        cap = self._cap
        if cap is not None:
            cap.outputs = output
            n = 0
            for i, t in enumerate(tensor_leaves(output)):
                if t.requires_grad and n < _MAX_OUT_HOOKS:
                    n += 1
                    t.register_hook(functools.partial(_store_grad, weakref.ref(cap), i))
            if self.config.trace_loss:
                cap.tape_complete = True
                self._tape = LossTape(cap)
                self._tape.__enter__()
        self._each("on_forward_end", module, output)

    def _pop_tape(self, force: bool = False) -> None:
        tape = self._tape
        if tape is None:
            return
        tape.recording = False
        from torch.overrides import _get_current_function_mode

        if _get_current_function_mode() is tape:
            tape.__exit__(None, None, None)
            self._tape = None
        elif force:
            _lift_mode(tape)  # the session ends: take it out from under the user's modes
            self._tape = None
        # else: another mode sits on top; the tape stays as a pass-through until it can be popped

    # -- hot path: backward ----------------------------------------------------------------------
    def _on_backward_start(self, loss: Any, gradient: Any) -> None:
        self._pop_tape()
        self._wrap_compiled()
        cap = self._cap
        if cap is not None and isinstance(loss, torch.Tensor):
            cap.loss = loss
            cap.loss_grad = gradient if isinstance(gradient, torch.Tensor) else None
        if (
            isinstance(loss, torch.Tensor)
            and loss.is_floating_point()
            and (self._sentinel or "gradients" in self._enabled)
        ):
            self._loss_vals.append(loss.detach())  # reduced and cast in the step's transfer
        self._each("on_backward_start", loss)

    def _on_backward_end(self) -> None:
        self.micro_step += 1
        self._need_new_capture = True
        if self._sentinel or "gradients" in self._enabled:
            idx = [i for i, p in enumerate(self.params) if p.grad is not None]
            if idx:
                grads = [self.params[i].grad for i in idx]
                # gradient health needs true norms; the sentinel alone only finiteness (a cheaper probe)
                probe = "gradients" not in self._enabled
                norms = _finite_probe(grads) if probe else _foreach_norms(grads)  # type: ignore[arg-type]
                self._norms, self._norm_index, self._norms_probe = norms, idx, probe
                self._micro_bad.append(torch.isfinite(norms.sum()).logical_not())
                if self._sentinel:  # a Python attribute read per gradient: no device work
                    self._grad_seen = {i: (g, g._version) for i, g in zip(idx, grads)}  # type: ignore[union-attr,misc]
        self._each("on_backward_end")
        if self._manual and self._sentinel and self.driver is None and not self._replaying:
            # no optimizer hook will run before the user's update: check here, before it
            self._sync()
            self._synced_at_backward = True
            self._check_gradients(at_optimizer=False)

    def _scaler_unscaled(self, opt: Any) -> bool:
        """True once the GradScaler unscaled this step's gradients (``unscale_`` bumps no ``_version``)."""
        sc = self.scaler
        if sc is None or not getattr(sc, "is_enabled", lambda: True)():
            return False
        if self._scaler_ran:
            return True  # scaler.step() unscales before it calls the optimizer or skips it
        states = getattr(sc, "_per_optimizer_states", {})
        for o in (opt, self.optimizer):
            st = states.get(id(o)) if o is not None else None  # .get: the defaultdict must not grow
            if st and int(getattr(st.get("stage"), "value", 0)) != 0:  # OptState.READY = 0
                return True
        return False

    def _probe_edits(self, opt: Any = None) -> None:
        """Gradients changed since backward() measured them (clipping, normalisation, unscaling, a hook):
        a finiteness probe of those only, on the device, read with this step's transfer. Unedited
        gradients cost a Python comparison each (the same tensor, the same ``_version``)."""
        seen = {} if self._scaler_unscaled(opt) else self._grad_seen  # unscaled: every gradient changed
        edited = []
        for i, p in enumerate(self.params):
            g = p.grad
            if g is None:
                continue  # dropped: nothing reaches the weight
            prev = seen.get(i)
            if prev is None or prev[0] is not g or prev[1] != g._version:
                edited.append(i)
        if edited:
            self._edit_index = edited
            self._edit_probe = _finite_probe([self.params[i].grad for i in edited])  # type: ignore[misc]

    # -- hot path: optimizer ---------------------------------------------------------------------
    def _owns_optimizer(self, opt: Any) -> bool:
        opt = _unwrap_optimizer(opt)
        if self.optimizer is not None:
            return opt is self.optimizer
        if id(opt) in self._adopted:
            return True
        for g in getattr(opt, "param_groups", []):
            for p in g["params"]:
                if id(p) in self._param_ids:
                    self._adopted.add(id(opt))
                    return True
                break
        return False

    def _scaler_step_begin(self, scaler: Any) -> None:
        if self.scaler is None:
            self.scaler = scaler  # detected: GradScaler.step was called with our optimizer
        scale = getattr(scaler, "_scale", None)
        if isinstance(scale, torch.Tensor):
            self._scale_used = (
                scale.detach().clone()
            )  # the scale this step's backward saw (update() comes later)
        self._scaler_ran = True
        self._opt_ran_in_scaler = False

    def _scaler_step_end(self, scaler: Any, failed: bool = False) -> None:
        if failed or getattr(self, "_opt_ran_in_scaler", False):
            return
        self._scaler_skipped = True
        if self._sentinel and not self._replaying:
            # the scaler found Inf/NaN and skipped the update: judge it now, while the (unscaled) gradients
            # are still there (users zero them before mon.step()); this is the step's transfer
            if not self._synced:
                self._probe_edits()
                self._sync()
            self._check_gradients(at_optimizer=False)

    def _opt_pre(self, opt: Any, args: Any, kwargs: Any) -> None:
        if self._replaying or not self._owns_optimizer(opt):
            return
        self._opt_ran_in_scaler = True  # inside GradScaler.step: the update was not skipped
        if self.driver is not None:
            return
        self.update_starting(opt)

    def update_starting(self, opt: Any = None) -> None:
        """Step protocol: the optimizer update is about to start and the gradients are final.

        The plain-loop driver calls it from the optimizer's step pre-hook; a framework driver that owns
        the loop (Lightning's ``on_before_optimizer_step``, HF's ``on_pre_optimizer_step``) calls it
        itself after ``mon.driver`` is set. Here the step's transfer runs and the gradients are checked
        (under ``policy="skip"`` a bad step's gradients are dropped so the update does nothing).
        """
        if self._replaying:
            return
        self._opt_ran = True
        self._opt_ran_in_scaler = True
        self._manual = False
        if self._synced_at_backward:  # an optimizer after all: judge the gradients as the update sees them
            self._synced, self._synced_at_backward = False, False
        if self._sentinel:
            if not self._synced:  # a second optimizer in the same step reuses this step's transfer
                self._probe_edits(opt)  # clipping, normalisation, unscaling since backward()
                self._sync()
            self._check_gradients(at_optimizer=True, opt=opt)
        self._each("before_optimizer_step")

    def _opt_post(self, opt: Any, args: Any, kwargs: Any) -> None:
        if self._replaying or self.driver is not None or not self._owns_optimizer(opt):
            return
        self.update_done(opt)

    def update_done(self, opt: Any = None) -> None:
        """Step protocol: the optimizer update finished (the optimizer's step post-hook, or a driver)."""
        if self._replaying:
            return
        if self._sentinel and not self._skipped and self._step_anomaly is None:
            # checked on the device now, read with the next transfer (no extra sync). Skipped when this
            # step's gradients were already flagged: non-finite weights are then their consequence.
            self._deferred["param_norms"] = _finite_probe(self.params)
            self._deferred_step = self.global_step
        self._grad_seen = {}  # the references are not needed after the update
        self._each("after_optimizer_step")

    # -- the one transfer --------------------------------------------------------------------------
    def _collect(self) -> list[tuple[str, torch.Tensor]]:
        """The instruments' device numbers; plain numbers they hand over go straight into the values."""
        items: list[tuple[str, torch.Tensor]] = []
        for inst in list(self.instruments):
            got = self._call(inst, "collect") or {}
            if any(isinstance(v, torch.Tensor) and v.is_meta for v in got.values()):
                # a model on the meta device: shapes only, no values for this instrument to report
                self._disable(inst, RuntimeError("its tensors are on the meta device and hold no values"))
                continue
            for k, v in got.items():
                if isinstance(v, torch.Tensor):
                    items.append((k, v))
                else:
                    self._values[k] = float(v)
        return items

    def _sync(self) -> None:
        """Stack every pending device number and read them with ONE host transfer."""
        items: list[tuple[str, torch.Tensor]] = []
        for i, lv in enumerate(self._loss_vals):
            items.append((f"_loss#{i}", lv if lv.numel() == 1 else lv.float().mean()))  # non-scalar: its mean
        if self._norms is not None:
            items.append(("_gnorm", self._norms))
        items += [(f"_mbad#{i}", b) for i, b in enumerate(self._micro_bad)]
        if self._edit_probe is not None:
            items.append(("_edit", self._edit_probe))
        items += [(f"_def_{k}", v) for k, v in self._deferred.items()]
        scale_t = self._scale_used
        if scale_t is None and self.scaler is not None:
            scale_t = getattr(self.scaler, "_scale", None)
        if isinstance(scale_t, torch.Tensor):
            items.append(("_scale", scale_t))
        items += self._collect()
        self._synced = True
        if any(t.is_meta for _, t in items):
            # a model on the meta device computes shapes only: there are no values to read or check
            items = [(k, t) for k, t in items if not t.is_meta]
            self._warn_once(
                "meta",
                "torchdebug: tensors on the meta device hold no values: the NaN/Inf checks and the "
                "numbers of this run skip them (move the model to a real device to check it)",
            )
        if items:
            self._values.update(_read(items))  # the step's host sync
            self._post_sync()

    def _post_sync(self) -> None:
        v = self._values
        losses = [v[k] for k in list(v) if k.startswith("_loss#")]
        if losses:
            v["loss"] = sum(losses) / len(losses)
            scale = v.get("_scale")
            if scale and self.scaler is not None and getattr(self.scaler, "is_enabled", lambda: True)():
                v["loss"] = v["loss"] / scale  # the loss backward saw was scaled
        scale = v.get("_scale")
        scaler_on = self.scaler is not None and getattr(self.scaler, "is_enabled", lambda: True)()
        if self._edit_probe is not None:
            ep = [
                v[f"_edit#{j}"] if f"_edit#{j}" in v else v.get("_edit", 0.0)
                for j in range(len(self._edit_index))
            ]
            self._edit_bad = [
                i
                for j, i in enumerate(self._edit_index)
                if not math.isfinite(ep[j]) and not self._grad_finite(i, now=True)
            ]
            self._edit_probe = None
        if self._norms is not None:
            gn = [
                v[f"_gnorm#{i}"] if f"_gnorm#{i}" in v else v.get("_gnorm", 0.0)
                for i in range(len(self._norm_index))
            ]
            per = [0.0] * len(self.params)
            for j, i in enumerate(self._norm_index):
                per[i] = gn[j]
            # A float32 sum (probe) or sum of squares (norm) of finite values can overflow: confirm
            # every non-finite entry exactly before it counts (a host read, on this rare path only).
            for i in [i for i in self._norm_index if not math.isfinite(per[i])]:
                if self._grad_finite(i):
                    g = self.params[i].grad
                    per[i] = (
                        0.0 if self._norms_probe or g is None else float(torch.linalg.vector_norm(g.double()))
                    )
            if scale and scaler_on:  # measured after backward on the scaled gradients: report true norms
                per = [x / scale for x in per]
            gn = [per[i] for i in self._norm_index]
            self.grad_norms_host = per
            bad_after_backward = {i for i in self._norm_index if not math.isfinite(per[i])}
            if not bad_after_backward:
                self._micro_bad_cleared = True
            # the parameters whose gradient was non-finite after backward() or when the update started
            v["grad_nonfinite"] = float(len(bad_after_backward | set(self._edit_bad)))
            if self._norms_probe:
                gn = []  # sums, not norms: nothing to report beyond finiteness
            if gn:
                total = (
                    math.sqrt(sum(x * x for x in gn))
                    if all(math.isfinite(x) for x in gn)
                    else (math.nan if any(math.isnan(x) for x in gn) else math.inf)
                )
                if self._coord is not None:  # FSDP2: the global norm, not this rank's shard (issue 11)
                    total = self._coord.global_grad_norm(self, total, scale if scale and scaler_on else 1.0)
                v["grad_norm"] = total
                self.grad_norm_host = total
        if "_scale" in v:
            v["amp_scale"] = v["_scale"]
        pn = [v[k] for k in sorted((k for k in v if k.startswith("_def_param_norms")), key=_suffix)]
        if pn:
            bad = [
                self.param_names[i]
                for i, x in enumerate(pn)
                if not math.isfinite(x)
                and i < len(self.params)
                and not bool(
                    torch.isfinite(_distributed.local(self.params[i].detach())).all()
                )  # exact: rare path
            ]
            step = self._deferred_step
            de = [v[k] for k in sorted((k for k in v if k.startswith("_def_edit")), key=_suffix)]
            edited, self._deferred_edit_index = self._deferred_edit_index, []
            self._deferred.clear()
            for k in [k for k in v if k.startswith("_def_")]:
                del v[k]
            self._params_bad_now = bool(bad)
            # (probe values, not confirmed: the gradients are gone by now; they only choose the phase)
            edit_bad = [i for j, i in enumerate(edited) if j < len(de) and not math.isfinite(de[j])]
            if bad and edit_bad:
                # a manual update used gradients that an edit after backward() made non-finite
                self._edit_bad = edit_bad
                nan = any(math.isnan(x) for x in de)
                anomaly = self._gradient_edit_anomaly(None, kind="nan" if nan else "inf")
                self._edit_bad = []
                self._record_anomaly(dataclasses.replace(anomaly, step=step))
                if self.config.policy == "raise":
                    self._flush_store()
                    raise NonFiniteError(self._step_anomaly)  # type: ignore[arg-type]
                self._warn_once("anomaly", f"torchdebug: {anomaly.summary()}")
            elif bad and not (step == self.global_step and self._grads_bad()):
                # blamed on the update only when the gradients it used were finite; else they are the cause
                self._optimizer_anomaly(bad, step)

    def _final_check(self) -> None:
        if self._deferred:
            self._values = {}
            self._sync()

    # -- detection ---------------------------------------------------------------------------------
    def _grad_finite(self, i: int, now: bool = False) -> bool:
        """Exact finiteness of parameter i's gradient (a host read: only when the probe flagged it).

        The tensor backward() left (kept: users may set ``.grad`` to None before ``mon.step()``), or with
        ``now`` the gradient as it is.
        """
        seen = None if now else self._grad_seen.get(i)
        g = _distributed.local(seen[0] if seen is not None else self.params[i].grad)
        return g is None or bool(torch.isfinite(g).all())

    def _grads_bad(self) -> bool:
        v = self._values
        loss_bad = any(not math.isfinite(v[k]) for k in v if k.startswith("_loss#"))
        mbad = any(v[k] > 0 for k in v if k.startswith("_mbad#")) and not self._micro_bad_cleared
        return loss_bad or mbad or bool(self._edit_bad)

    def _scaler_cannot_fix(self) -> str | None:
        """Why a GradScaler overflow step is an anomaly rather than an ordinary skipped step, or None.

        Ordinary: the loss is finite and the scale is at least ``config.scale_floor`` (1.0): the scaler
        halves the scale and the step is retried with the next batch. An anomaly: a non-finite loss (no
        scale can fix it), or an overflow at a scale below the floor (the scale collapsed: even
        unscaled, the fp16 backward overflows).
        """
        v = self._values
        if any(not math.isfinite(v[k]) for k in v if k.startswith("_loss#")):
            return "non-finite loss under the GradScaler"
        scale = v.get("_scale")
        floor = float(getattr(self.config, "scale_floor", 1.0))
        if scale is not None and scale < floor:
            return f"the gradients overflow at loss scale {scale:g} (below {floor:g}): the scale collapsed"
        return None

    def _scaler_will_skip(self, opt: Any) -> bool:
        """True when ``scaler.unscale_(opt)`` already found Inf/NaN (``scaler.step`` will skip the update).

        Reads the scaler's flag from the device: called only on the rare path where gradients are bad.
        """
        sc = self.scaler
        if sc is None or opt is None or not getattr(sc, "is_enabled", lambda: True)():
            return False
        st = getattr(sc, "_per_optimizer_states", {}).get(id(opt))
        found = st.get("found_inf_per_device") if st else None
        return found is not None and any(float(v) > 0 for v in found.values())

    def _check_gradients(self, *, at_optimizer: bool, opt: Any = None) -> None:
        bad = self._grads_bad() if self._coord is None else self._coord.step_bad(self)  # same on every rank
        if self._step_anomaly is not None:
            if at_optimizer and opt is not None and self._grad_anomaly and self.config.policy == "skip":
                self._drop_grads(opt)  # flagged at the end of backward(), before an optimizer turned up
            return
        if not bad or (self._skipped and not at_optimizer):
            return
        scaler_skip = (self._scaler_ran and self._scaler_skipped) or (
            at_optimizer and self.driver is not None and self._scaler_will_skip(opt)
        )
        if scaler_skip and at_optimizer and self._scaler_cannot_fix() is None:
            # a driver announced the update after scaler.unscale_() found Inf/NaN: scaler.step() skips it
            self._mark_skipped("GradScaler found inf/NaN gradients (loss scale too high)", scaler=True)
            return
        if not at_optimizer:
            if scaler_skip:
                if self._scaler_cannot_fix() is None:
                    self._mark_skipped(
                        "GradScaler found inf/NaN gradients (loss scale too high)", scaler=True
                    )
                    return
            elif (self.optimizer is not None or self._adopted) and not self._synced_at_backward:
                self._mark_skipped("non-finite gradients and the optimizer step was not called")
                return
        late = not at_optimizer and not scaler_skip and not self._synced_at_backward
        anomaly = self._build_anomaly(late=late) if self._coord is None else self._coord.anomaly(self)
        self._grad_anomaly = True
        self._record_anomaly(anomaly)
        policy = self.config.policy
        if policy == "skip":
            if at_optimizer and opt is not None:
                self._drop_grads(opt)
            elif scaler_skip:
                self._mark_skipped(f"skipped by the GradScaler: {anomaly.summary()}", severity="info")
            else:
                self._warn_once(
                    "skip-needs-opt", "policy='skip' needs the optimizer's step to skip it; recorded only"
                )
            return
        if policy == "warn":
            self._warn_once("anomaly", f"torchdebug: {anomaly.summary()} (policy='warn': training goes on)")
            return
        self._flush_store()
        raise NonFiniteError(anomaly)

    def _drop_grads(self, opt: Any) -> None:
        for g in _unwrap_optimizer(opt).param_groups:
            for p in g["params"]:
                p.grad = None  # the optimizer skips parameters without grads: no update, no state change
        self._mark_skipped(f"skipped by policy: {self._step_anomaly.summary()}", severity="info")  # type: ignore[union-attr]

    def _optimizer_anomaly(self, bad: list[str], step: int | None) -> None:
        first = bad[0]
        owner = first.rpartition(".")[0]
        mod = self.model.get_submodule(owner) if owner else self.model
        stats = None
        with contextlib.suppress(Exception):
            from ..stats import analyze_tensor

            stats = analyze_tensor(dict(self.model.named_parameters())[first], first)
        kind = (
            "nan"
            if stats is not None and stats.has_nan
            else ("inf" if stats is None or stats.posinf_count else "-inf")
        )
        more = f" (and {len(bad) - 1} more: {', '.join(bad[1:4])})" if len(bad) > 1 else ""
        anomaly = Anomaly(
            phase=Phase.OPTIMIZER.value,
            module=owner,
            op=type(self.optimizer).__name__ + ".step" if self.optimizer is not None else "optimizer.step",
            location=None,
            kind=kind,
            step=step,
            rank=self.rank,
            tensor=stats,
            module_type=type(mod).__name__,
            hint=f"the optimizer update made {first} non-finite{more}: check lr, eps, weight decay and the update formula",
            symptom=f"{kind} in parameter {first} after the optimizer step",
            detected_by="sentinel",
            parameter=first,
        )
        self._record_anomaly(anomaly)
        if self.config.policy == "raise":
            self._flush_store()
            raise NonFiniteError(anomaly)
        self._warn_once("anomaly", f"torchdebug: {anomaly.summary()}")

    def _build_anomaly(self, late: bool = False) -> Anomaly:
        """The anomaly of this step's bad gradients or loss: replayed (the first one) to its origin.

        ``late``: checked at ``mon.step()`` after an update the monitor did not see start; when that
        update already made the parameters non-finite a replay would blame them, so it is not replayed.
        """
        v = self._values
        bad_micro = next((i for i in range(len(self._micro_bad)) if v.get(f"_mbad#{i}", 0) > 0), None)
        losses_bad = [i for i in range(len(self._loss_vals)) if not math.isfinite(v.get(f"_loss#{i}", 0.0))]
        idx = min([i for i in [bad_micro, losses_bad[0] if losses_bad else None] if i is not None], default=0)
        micro = idx if len(self._micro_bad) > 1 else None
        mbad = any(v[k] > 0 for k in v if k.startswith("_mbad#")) and not self._micro_bad_cleared
        if self._edit_bad and not mbad and not losses_bad:
            # backward() made finite gradients (measured then); code before the update made them non-finite
            return self._gradient_edit_anomaly(micro)
        first_replay = self.counters["replays"] == 0
        replayable = not (late and self._params_bad_now)
        if self.config.replay and first_replay and replayable and idx < len(self._captures):
            self.counters["replays"] += 1
            self._replaying = True
            try:
                # A fault that does not come back when the step is re-run is information (a one-off
                # fault, a nondeterministic kernel, state that changed): a second replay confirms it.
                for _ in range(2):
                    with self._eager():
                        tracer = replay_capture(
                            self.model,
                            self._captures[idx],
                            names=self.names,
                            frames=self.config.frames,
                            uses_cuda=self._uses_cuda,
                        )
                    a = tracer.anomaly(
                        step=self.global_step, rank=self.rank, micro_step=micro, detected_by="sentinel"
                    )
                    if a is not None:
                        return dataclasses.replace(a, reproducible=True)
                return self._symptom_anomaly(micro, losses_bad, reproduced=False)
            except Exception as exc:
                self._warn_once(
                    "replay",
                    f"torchdebug: replay of the failing step failed ({exc!r}); reporting the symptom only",
                )
                return self._symptom_anomaly(micro, losses_bad, why="the replay failed")
            finally:
                self._replaying = False
        why = "only the first anomaly of a session is replayed"
        if not self.config.replay:
            why = "replay is off (config.replay=False)"
        elif first_replay and not replayable:
            why = (
                "your update (no optimizer object) ran before the check and made the parameters non-finite; "
                "call mon.update_starting() before it"
            )
        elif first_replay:
            why = "the failing micro-step was not captured"
        return self._symptom_anomaly(micro, losses_bad, why=why)

    def _gradient_edit_anomaly(self, micro: int | None, kind: str | None = None) -> Anomaly:
        bad = [self.param_names[i] for i in self._edit_bad]
        first = bad[0] if bad else None
        owner = first.rpartition(".")[0] if first else ""
        mod = self.model.get_submodule(owner) if owner else self.model
        g = self.params[self._edit_bad[0]].grad if self._edit_bad else None
        if kind is None:
            kind = "nan" if g is not None and bool(torch.isnan(g).any()) else "inf"  # exact: rare path only
        more = f" (+{len(bad) - 1} more parameters)" if len(bad) > 1 else ""
        return Anomaly(
            phase=Phase.GRADIENT_EDIT.value,
            module=owner,
            op=None,
            location=None,
            kind=kind,
            step=self.global_step,
            rank=self.rank,
            module_type=type(mod).__name__,
            micro_step=micro,
            symptom=f"non-finite gradient of {first} when the update started{more}",
            detected_by="sentinel",
            hint=(
                "backward() made finite gradients (measured right after it); code between backward() and "
                "the update made them non-finite: gradient clipping (a NaN max_norm), a manual normalisation "
                "(0/0), GradScaler.unscale_ with a zero scale, or a gradient hook"
            ),
            parameter=first,
        )

    def _symptom_anomaly(
        self, micro: int | None, losses_bad: list[int], reproduced: bool | None = None, why: str = ""
    ) -> Anomaly:
        per = self.grad_norms_host or []
        bad = [self.param_names[i] for i, x in enumerate(per) if not math.isfinite(x)]
        loss_bad = bool(losses_bad)
        kind = "nan" if any(math.isnan(x) for x in per) else "inf"
        if reproduced is False:
            # Say what was seen and what was compared; name no origin the replay could not confirm.
            v = self._values
            loss_kinds = sorted(
                {"nan" if math.isnan(v[f"_loss#{i}"]) else "inf" for i in losses_bad if f"_loss#{i}" in v}
            )
            if loss_kinds == ["nan"] or (not per and loss_kinds):
                kind = loss_kinds[0]
            seen = []
            if loss_bad:
                seen.append(f"the loss ({'/'.join(loss_kinds) or 'non-finite'})")
            if bad:
                more = f" and {len(bad) - 4} more" if len(bad) > 4 else ""
                seen.append(f"the gradients of {', '.join(bad[:4])}{more}")
            observed = " and ".join(seen) or "a non-finite value"
            return Anomaly(
                phase=Phase.FORWARD.value if loss_bad else Phase.BACKWARD.value,
                module=None,
                op=None,
                location=None,
                kind=kind,
                step=self.global_step,
                rank=self.rank,
                micro_step=micro,
                symptom=f"{observed} held NaN/Inf in the step",
                detected_by="sentinel",
                hint=(
                    f"not reproducible: in the step, {observed} held NaN/Inf; replayed twice with the same "
                    "batch, weights, buffers and RNG state, the loss and every gradient came out finite. "
                    "Likely a one-off fault: hardware or silent data corruption, a nondeterministic "
                    "kernel or race, a hook or state that changed between the step and the replay, or "
                    "loss code the replay did not capture"
                ),
                reproducible=False,
            )
        first = bad[0] if bad else None
        owner = first.rpartition(".")[0] if first else ""
        mod = self.model.get_submodule(owner) if owner else self.model
        symptom = "non-finite loss" if loss_bad else f"non-finite gradient of {first}"
        return Anomaly(
            phase=Phase.FORWARD.value if loss_bad else Phase.BACKWARD.value,
            module=owner if not loss_bad else "",
            op=None,
            location=None,
            kind=kind,
            step=self.global_step,
            rank=self.rank,
            module_type=type(mod).__name__,
            micro_step=micro,
            symptom=symptom + (f" (+{len(bad) - 1} more parameters)" if len(bad) > 1 else ""),
            detected_by="sentinel (no replay)",
            hint=f"origin not traced: {why}; use td.locate_nonfinite(step_fn) for the exact op",
            parameter=first,
        )

    def _record_anomaly(self, anomaly: Anomaly) -> None:
        self._step_anomaly = anomaly
        self.counters["anomaly_steps"] += 1
        if len(self.anomalies) < _MAX_ANOMALIES:
            self.anomalies.append(anomaly)
        if self.writer is not None:
            with contextlib.suppress(Exception):
                self.writer.log_anomaly(anomaly.step, anomaly.to_dict())

    def _mark_skipped(self, reason: str, scaler: bool = False, severity: str = "warning") -> None:
        self._skipped = True
        self._skip_reason = reason
        self.counters["skipped_steps"] += 1
        if not scaler:
            self.emit(RuleEvent("skipped_step", self.global_step, reason, severity))

    def _say_skips(self, at_exit: bool = False) -> None:
        """policy="skip": say a run of skipped steps once when it starts and once, with its count, when it ends."""
        run = self._skip_run
        if not at_exit and self._skipped and self._skip_reason.startswith("skipped by policy"):
            if run is not None:
                run[1] += 1
                return
            self._skip_run = [self.global_step, 1]
            warn_at_user(
                TorchDebugWarning(
                    f"torchdebug: step {self.global_step} {self._skip_reason}; the parameters and the "
                    "optimizer state are unchanged (policy='skip'). Skipped steps in a row are counted "
                    "and said once when they stop"
                )
            )
            return
        if run is None:
            return
        self._skip_run = None
        first, n = run
        span = f"step {first}" if n == 1 else f"steps {first}-{first + n - 1}"
        after = "when the run ended" if at_exit else f"training resumed at step {self.global_step}"
        message = f"{n} step{'s' if n != 1 else ''} skipped by policy='skip' ({span}); {after}"
        self.emit(
            RuleEvent(
                "skipped_steps", self.global_step, message, "info", evidence={"first": first, "count": n}
            )
        )
        warn_at_user(TorchDebugWarning(f"torchdebug: {message}"))

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(TorchDebugWarning(message), stacklevel=4)

    def _flush_store(self) -> None:
        if self.writer is not None:
            with contextlib.suppress(Exception):
                self.writer.flush()

    # -- the step ----------------------------------------------------------------------------------
    def step(self) -> StepRecord:
        """Step protocol: the training step ended. Call once per step, after ``optimizer.step()``.

        Reads what the step produced (one host transfer, unless the update already did), records it and
        returns the step's :class:`StepRecord`; ``mon.global_step`` then counts one more.
        """
        return self._do_step()

    def _do_step(self) -> StepRecord:
        if self._closed or not self._entered:
            raise RuntimeError("mon.step() called outside its `with td.watch(...)` block")
        manual = self._sentinel and not self._opt_ran and self.optimizer is None and not self._adopted
        if manual and self._step_anomaly is None:
            # no optimizer hook: the user's update already ran; check the parameters on the device, read
            # with this transfer, or the next one when this step's already ran (at the end of backward())
            self._deferred["param_norms"] = _finite_probe(self.params)
            self._deferred_step = self.global_step
            if self._synced_at_backward:
                # checked at the end of backward(): an edit after it (clipping, normalisation) is seen
                # here, read with the next transfer, so a NaN it made is not blamed on the update
                self._probe_edits()
                if self._edit_probe is not None:
                    self._deferred["edit"] = self._edit_probe
                    self._deferred_edit_index = list(self._edit_index)
                    self._edit_probe = None
        if self._sentinel and not self._synced:
            self._probe_edits()
            self._sync()
            self._check_gradients(at_optimizer=False)
        elif self._synced:
            items = self._collect()  # numbers made after the optimizer step (detail steps only)
            if items:
                self._values.update(_read(items))  # detail steps only: one more transfer
        elif not self._sentinel:
            self._sync()
        if self._scaler_ran and self._scaler_skipped and not self._skipped:
            self._mark_skipped("GradScaler found inf/NaN gradients (loss scale too high)", scaler=True)
        now = time.perf_counter()
        v = {k: x for k, x in self._values.items() if not k.startswith("_")}
        lr = (
            tuple(float(g.get("lr", math.nan)) for g in self.optimizer.param_groups)
            if self.optimizer is not None
            else ()
        )
        record = StepRecord(
            step=self.global_step,
            micro_steps=len(self._micro_bad) or len(self._captures),
            loss=v.get("loss"),
            grad_norm=v.get("grad_norm"),
            skipped=self._skipped,
            skip_reason=self._skip_reason,
            scale=v.get("amp_scale"),
            lr=lr,
            time_s=now - self._last_step_end,
            values=v,
            anomaly=self._step_anomaly,
            events=self._step_events,
        )
        scalars = {k: x for k, x in v.items() if k in ("loss", "grad_norm", "grad_nonfinite", "amp_scale")}
        scalars["skipped"] = 1.0 if self._skipped else 0.0
        for i, x in enumerate(lr):
            scalars[f"lr/{i}"] = x
        if self.writer is not None:
            with contextlib.suppress(Exception):
                self.writer.log_scalars(self.global_step, scalars)
        self._say_skips()
        self._each("on_step_end", record, v)
        self.records.append(record)
        if manual and self.driver is None and not self._scaler_ran and self._micro_bad:
            self._manual = True  # from the next step on, the check runs at the end of backward()
        if self._pending_level is not None or self._pending_changes:
            level, self._pending_level = self._pending_level, None
            changes, self._pending_changes = self._pending_changes, {}
            self._apply_level(level if level is not None else self.config.level, **changes)
        self.global_step += 1
        self._reset_step_state()
        self._last_step_end = time.perf_counter()
        return record


def _unwrap_optimizer(opt: Any) -> Any:
    """The torch optimizer inside a framework's wrapper (Lightning's ``LightningOptimizer._optimizer``,
    accelerate's ``AcceleratedOptimizer.optimizer``); anything else unchanged."""
    for _ in range(4):  # wrappers nest at most a few deep
        attrs = getattr(opt, "__dict__", None) or {}  # not getattr: LightningOptimizer forwards lookups
        inner = attrs.get("_optimizer", attrs.get("optimizer"))
        if not isinstance(inner, torch.optim.Optimizer):
            return opt
        opt = inner
    return opt


def _read(items: list[tuple[str, torch.Tensor]]) -> dict[str, float]:
    """Read named device numbers with ONE host transfer; an n-element tensor gives ``name#0..n-1``."""
    names: list[str] = []
    flat: list[torch.Tensor] = []
    for name, t in items:
        t = _distributed.local(t).detach().reshape(-1).float()  # FSDP2 DTensor: this rank's shard
        names += [name] if t.numel() == 1 else [f"{name}#{i}" for i in range(t.numel())]
        flat.append(t)
    dev = flat[0].device
    return dict(zip(names, torch.cat([t.to(dev) for t in flat]).tolist()))


def _lift_mode(mode: Any) -> None:
    """Remove ``mode`` from the torch-function mode stack even when others sit above it (kept in order)."""
    stack = torch._C
    above = []
    while stack._len_torch_function_stack() > 0:
        top = stack._pop_torch_function_stack()
        if top is mode:
            break
        above.append(top)
    for m in reversed(above):
        stack._push_on_torch_function_stack(m)


def _suffix(key: str) -> int:
    try:
        return int(key.rsplit("#", 1)[1])
    except (IndexError, ValueError):
        return 0


def _compile_guard(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` that does nothing while Dynamo traces (``is_compiling()`` folds to a constant: no break)."""

    @functools.wraps(hook)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_dynamo_compiling():
            return None
        return hook(*args, **kwargs)

    guarded.__torchdebug_guard__ = True  # type: ignore[attr-defined]
    return guarded


def _store_grad(cap_ref: Any, i: int, grad: torch.Tensor) -> None:
    cap = cap_ref()
    if cap is not None:
        cap.out_grads[i] = grad


def watch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    policy: str | None = None,
    scaler: Any = None,
    run: Any = None,
    config: Any = None,
    early_stopping: Any = None,
    tensorboard: bool | str | None = None,
    clip_on_spike: float | None = None,
    on_oom: str | None = None,
) -> Monitor:
    """Watch a training loop: the always-on NaN/Inf sentinel plus the instruments the config switches on.

    Call ``mon.step()`` once per training step (after ``optimizer.step()``). Returns the step's
    :class:`StepRecord`.

    Args:
        model: the model; modules are named as in ``model.named_modules()``.
        optimizer: the optimizer. With it, the check runs in its step pre-hook so corrupted gradients
            never reach the weights, and ``policy="skip"`` can skip the update. Without it, the first
            optimizer stepping this model's parameters is adopted.
        policy: ``"raise"`` (default: raise :class:`NonFiniteError`), ``"warn"`` (warn, record, go on)
            or ``"skip"`` (skip the optimizer update: parameters and optimizer state unchanged).
        scaler: the ``torch.amp.GradScaler``, if any (detected when ``scaler.step`` is called). Its
            overflow steps are recorded as skipped steps, never raised, while the loss is finite and
            the scale is at least ``config.scale_floor``; a NaN/Inf loss or a collapsed scale is an
            anomaly.
        run: where to record: ``None`` (a new run folder under ``config.run_dir``), a folder path
            (the runs root), an open run writer, or ``False`` (no store).
        config: a :class:`DebugConfig`, a dict, or a YAML/TOML path (``None`` honours ``TORCHDEBUG_*``).
        early_stopping: an early-stopping object whose patience/counter/best are recorded.
        tensorboard: ``True`` or a log dir to mirror the scalars to TensorBoard.
        clip_on_spike: clip gradients to this norm on detected spikes only.
        on_oom: ``"raise"`` or ``"retry_half"`` (with ``mon.run_step``).

    Raises:
        NonFiniteError: (policy "raise") at the first check point after a NaN/Inf, with ``.anomaly``
            naming phase, module, op and source line (the failing step is replayed under tracing).
        TypeError / ValueError: bad arguments, naming the fix.

    Cost: one foreach norm of the gradients per backward, one of the parameters per optimizer step,
    and one host transfer per step. The replay (2-4x a step) runs only when something went wrong.

    Example::

        with td.watch(model, optimizer) as mon:
            for x, y in loader:
                loss = F.cross_entropy(model(x), y)
                optimizer.zero_grad(); loss.backward(); optimizer.step()
                mon.step()
    """
    return Monitor(
        model,
        optimizer,
        policy=policy,
        scaler=scaler,
        run=run,
        config=config,
        early_stopping=early_stopping,
        tensorboard=tensorboard,
        clip_on_spike=clip_on_spike,
        on_oom=on_oom,
    )

"""watch(): the always-on session. It owns the lifecycle; its Step runs the step protocol; instruments do the work.

The step protocol: a training step is seen as a sequence of boundaries. A *driver* produces them
(:class:`~torchdebug.session.driver.PlainLoopDriver` for a hand-written loop; the Lightning and
Hugging Face callbacks set ``mon.driver`` and call the update boundaries themselves) on the session's
:class:`~torchdebug.session.step.Step` (``mon.stepper``), which owns the step's state; at each it hands
that state to the sentinel first, then calls every instrument. ``Monitor`` keeps the same names:

==================  ==============================  =============================================
boundary            session method                  what happens
==================  ==============================  =============================================
forward began       ``forward_started``             first forward of a micro-step: the sentinel
                                                    keeps what a replay needs; ``on_forward_start``
forward done        ``forward_done``                ``on_forward_end``
backward began      ``backward_started``            the loss is kept (device); ``on_backward_start``
backward done       ``backward_done``               one device reduction of the gradients;
                                                    ``on_backward_end``
update starting     ``update_starting(opt)``        the step's ONE host transfer (``sync``), the
                                                    sentinel's verdict and policy; the optimizer's
                                                    hyperparameters judged the same way;
                                                    ``before_optimizer_step``
update done         ``update_done(opt)``            the parameter probe (read with the next
                                                    transfer); ``after_optimizer_step``
gradients clipped   ``clip_starting/clip_done``     the sentinel judges the clip by its factor;
                                                    ``on_clip``
step end            ``step()``                      the verdict if the update did not give it, the
                                                    record, ``on_step_end``; ``global_step += 1``
exception           ``__exit__``                    ``on_exception``; everything comes off
==================  ==============================  =============================================

The pieces: the step (:mod:`torchdebug.session.step`: the state and the per-step path), the sentinel
(:mod:`torchdebug.nonfinite.sentinel`: the judge, handed the state; replay on the rare path), the
transfer (:mod:`torchdebug.session.transfer`: the step's device numbers and their one read), the
plain-loop driver and global patches (:mod:`torchdebug.session.driver`), the distributed coordinator
(:mod:`torchdebug.session.distributed`, an instrument on these same boundaries).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .._config import DebugConfig, DebugLevel
from .._errors import LossSpikeError, NonFiniteError, TorchDebugWarning
from .._frames import warn_at_user
from .._installs import Installs
from .._instruments import REGISTRY, spec
from .._step import Instrument, StepPhase, StepState
from ..events import Anomaly, RuleEvent, StepRecord
from ..nonfinite.hyperparams import HyperparameterCheck
from ..nonfinite.sentinel import Sentinel
from ..nonfinite.stepfn import CompiledStep
from . import distributed as _distributed
from . import runtime
from .control import Controls, describe, describe_html, verdict
from .deferred import DeferredReads, reads_for
from .driver import PlainLoopDriver
from .models import Models
from .options import check_options, gather_models
from .recording import Recording
from .rollback import SpikeGuard
from .step import Step
from .transfer import Transfer
from .verdicts import Verdicts
from .wrappers import _compiled_orig, is_compiled, split_models

_MAX_EVENTS = 10_000


class Monitor:
    """A watch session over one model. Create it with :func:`watch`; see there.

    It keeps the lifecycle (install, the instruments, teardown) and holds its parts: ``stepper`` (the
    step now running and the step protocol), ``models`` (the roots and optimizers), ``recording`` (the
    run folder and the trackers), ``controls`` (live switches, history segments)."""

    def __init__(
        self,
        model: Any,
        optimizer: Any = None,
        *,
        policy: str | None = None,
        scaler: Any = None,
        run: Any = None,
        config: Any = None,
        early_stopping: Any = None,
        tensorboard: bool | str | None = None,
        clip_on_spike: float | None = None,
        on_oom: str | None = None,
        report_to: Any = None,
        announce: bool | None = None,
        sync: str | None = None,
        on_spike: str | None = None,
    ) -> None:
        # several models (a list, dict or ModuleDict) are watched as one ModuleDict whose models are the
        # step's roots; several optimizers (a list) are each checked before their update
        model, roots, optimizers = gather_models(model, optimizer, _caller())
        self.config, sink_objects = check_options(
            model,
            None,
            policy,
            scaler,
            run,
            config,
            tensorboard,
            clip_on_spike,
            on_oom,
            report_to,
            announce,
            sync,
            on_spike,
        )  # TypeError / ValueError / ConfigError / ImportError naming the fix, before anything is installed
        optimizer = optimizers[0] if optimizers else None
        self._ddp, model, roots = split_models(model, roots)  # DDP, compile: the wrapped modules
        # torch.compile(model) wraps the module: the root hooks go on the module that is called, while
        # names, parameters and the instruments see the original (no "_orig_mod." prefix anywhere)
        self._called: nn.Module = model
        orig = getattr(model, "_orig_mod", None)
        if type(model).__name__ == "OptimizedModule" and isinstance(orig, nn.Module):
            model = orig
        self.model = model
        self.optimizer = optimizer  # the first optimizer given (None: adopted as they step)
        self.scaler = scaler
        self.early_stopping = early_stopping
        self.recording = Recording(run, sink_objects)  # the run folder and the trackers
        self.controls = Controls()  # live switches (any thread), applied at the end of a step
        # everything the session and its instruments install: taken off in _teardown, whatever failed
        self.installs = Installs()
        self.thread = threading.current_thread()  # modes are entered only here (see _installs.py)
        self.names: dict[nn.Module, str] = {m: n for n, m in model.named_modules()}
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.param_names: list[str] = [n for n, _ in named]
        self.params: list[torch.Tensor] = [p for _, p in named]
        self.models = Models(roots, list(optimizers), {id(p) for p in model.parameters()})
        self.rank, self.world_size, self._has_pg = _distributed.detect(self.config)
        self._coord: Any = None  # the distributed coordinator (world_size > 1 or a hang_timeout)
        self.global_step: int = 0  # completed steps; mon.step() completes one
        self.micro_step = 0
        # who produces the step protocol: None = the plain-loop hooks (optimizer pre/post hooks);
        # a framework adapter sets its name and calls update_starting()/update_done() itself
        self.driver: str | None = None
        self.batch: Any = None  # a driver's current batch; kept (a reference) with the micro-step's capture
        self.step_scalars: dict[str, float] = {}  # the last step's own scalars, as stored
        self.instruments: list[Instrument] = []
        self.anomalies: list[Anomaly] = []
        self.spikes: list[Any] = []  # a SpikeReport per loss-spike episode (session/rollback.py)
        self.rollbacks: list[Any] = []  # a Rollback per on_spike="rollback" restore
        self.events: deque[RuleEvent] = deque(maxlen=_MAX_EVENTS)
        self.records: deque[StepRecord] = deque(maxlen=1000)
        # anomaly_steps: steps with a NaN/Inf record; anomalous_steps: ``events.is_anomalous`` steps
        # (a NaN/Inf or a warning-level event), what every seed-era summary counts
        self.counters = dict.fromkeys(("anomaly_steps", "anomalous_steps", "skipped_steps", "replays"), 0)
        self._enabled = self.config.instruments()
        self.sentinel = Sentinel(self.params, self.param_names, self.config)
        self.stepper = Step(self)  # the step now running (its state) and the step protocol's boundaries
        self.sentinel.holder = self.stepper
        self.verdicts = Verdicts(self)  # applies the sentinel's verdicts: records, the policy, skips
        self.sentinel.active = "nonfinite" in self._enabled
        self.hyperparams = HyperparameterCheck()  # lr, eps, betas ... checked before each update
        # sync="async" (or "auto" where it fits): the step's numbers read one step later
        # (session/deferred.py); None: blocking
        self._async = reads_for(self)
        self._plain = PlainLoopDriver(self, self._called, self.model, list((roots or {}).values()))
        self._entered = False
        self._closed = False
        self._warned: set[str] = set()
        self.uses_cuda = any(p.is_cuda for p in self.params)
        self._last_step_end = time.perf_counter()

    # -- the step protocol: the Step's (session/step.py); these are its public names ------------------
    def forward_started(self, module: nn.Module, args: tuple, kwargs: dict, outside: bool = False) -> None:
        """Forward began (the root module's forward pre-hook; ``outside``: around a compiled call)."""
        self.stepper.forward_started(module, args, kwargs, outside)

    def forward_done(self, module: nn.Module, args: tuple, output: Any, outside: bool = False) -> None:
        """Forward done (the root module's forward hook)."""
        self.stepper.forward_done(module, args, output, outside)

    def backward_started(self, loss: Any, gradient: Any) -> None:
        """Backward began (the ``Tensor.backward`` / ``torch.autograd.backward`` wrapper)."""
        self.stepper.backward_started(loss, gradient)

    def backward_done(self) -> None:
        """Backward done: one device reduction of the gradients (a norm or a finiteness probe each)."""
        self.stepper.backward_done()

    def update_starting(self, opt: Any = None) -> None:
        """Step protocol: the optimizer update is about to start and the gradients are final (see
        :meth:`Step.update_starting <torchdebug.session.step.Step.update_starting>`)."""
        self.stepper.update_starting(opt)

    def update_done(self, opt: Any = None) -> None:
        """Step protocol: the optimizer update finished (the optimizer's step post-hook, or a driver)."""
        self.stepper.update_done(opt)

    def scaler_step_started(self, scaler: Any) -> None:
        """``GradScaler.step`` began for this session's optimizer (the scaler is adopted if unknown)."""
        self.stepper.scaler_step_started(scaler)

    def scaler_step_done(self, scaler: Any, failed: bool = False) -> None:
        """``GradScaler.step`` returned: when it skipped the update, the sentinel judges it now."""
        self.stepper.scaler_step_done(scaler, failed)

    def step(self) -> StepRecord:
        """Step protocol: the training step ended. Call once per step, after ``optimizer.step()``.

        Reads what the step produced (one host transfer, unless the update already did), records it and
        returns the step's :class:`StepRecord`; ``mon.global_step`` then counts one more."""
        if self._closed or not self._entered:
            raise RuntimeError("mon.step() called outside its `with td.watch(...)` block")
        record = self.stepper.end()
        # the step is over: live changes applied, counted, a new state for the next step
        controls = self.controls
        if controls.pending_level is not None or controls.pending_changes:
            level, changes = controls.take()
            self._apply_level(level if level is not None else self.config.level, **changes)
        self.global_step += 1
        (transfer := self.stepper.state.transfer).reset()  # ``StepState.next``, inlined (every step)
        self.stepper.state = StepState(transfer)  # a new state for the next step
        hub = self.recording.hub
        if hub is not None and hub.pending:
            hub.warn()  # a sink was switched off (on its thread): say it here, once
        self._last_step_end = time.perf_counter()
        return record

    def sync(self) -> None:
        """The step's ONE host transfer: its own numbers, the sentinel's probes, every instrument's."""
        self.stepper.sync()

    def _set_state(self, state: StepState) -> None:
        self.stepper.state = state

    # the step's state and numbers, read without a call of their own (C-level getters)
    if TYPE_CHECKING:
        state: StepState
        transfer: Transfer
        coordinator: Any
        roots: dict[str, nn.Module] | None
        optimizers: list[torch.optim.Optimizer]
        writer: Any
        run_dir: Path | None
        level_overrides: list[str]
        lr_labels: list[str] | None
        called: nn.Module
        replaying: bool
        closed: bool
        grad_norm_host: float | None
        grad_norms_host: list[float] | None
    else:
        state = property(
            attrgetter("stepper.state"), _set_state, doc="The step now running (``Step.state``)."
        )
        transfer = property(
            attrgetter("stepper.state.transfer"), doc="The step's device numbers and their one read."
        )
        roots = property(
            attrgetter("models.roots"), doc="Several models: each by name (``model`` is their ModuleDict)."
        )
        optimizers = property(
            attrgetter("models.optimizers"),
            doc="Every optimizer of the session: those given, else those adopted as they first stepped.",
        )
        writer = property(attrgetter("recording.writer"), doc="The run writer, or None (no run folder).")
        run_dir = property(attrgetter("recording.run_dir"), doc="The run folder, or None.")
        level_overrides = property(
            attrgetter("controls.level_overrides"), doc="Every level ``set_level`` was asked for, in order."
        )
        lr_labels = property(
            attrgetter("models.lr_labels"),
            doc="What the learning-rate events call each entry of ``step_lrs()`` (None: ``param group <g>``).",
        )
        coordinator = property(
            attrgetter("_coord"),
            doc="The distributed coordinator (several ranks, or a hang timeout), or None.",
        )
        closed = property(attrgetter("_closed"), doc="True once the session has exited.")
        called = property(
            attrgetter("_called"),
            doc="The module the loop calls: a ``torch.compile`` wrapper, else the model (``model.compile()``"
            " compiles it in place).",
        )
        replaying = property(
            attrgetter("sentinel.replaying"),
            doc="True while the sentinel replays a failing micro-step (drivers ignore what it does).",
        )
        grad_norm_host = property(
            attrgetter("stepper.state.transfer.grad_norm"),
            doc="The last read total gradient norm (host float), or None.",
        )
        grad_norms_host = property(
            attrgetter("stepper.state.transfer.grad_norms"),
            doc="The last read per-parameter gradient norms, in the order of ``params``, or None.",
        )

    # -- what drivers and instruments read -------------------------------------------------------
    @property
    def adopted(self) -> bool:
        """True once an optimizer of the session's parameters was adopted (``watch`` got none)."""
        return bool(self.models.adopted)

    @contextlib.contextmanager
    def eager(self) -> Iterator[None]:
        """Run the model eagerly while the sentinel replays a step (bypasses an in-place compile)."""
        with self._plain.eager():
            yield

    @property
    def compiled(self) -> bool:
        """True while the model (or one of several) runs under ``torch.compile`` (a wrapper, or
        ``model.compile()`` in place): per-module instruments stand down (their hooks see nothing in it)."""
        return is_compiled([self._called, *(self.roots or {}).values()])

    def accepts_backward(self) -> bool:
        return not self.sentinel.replaying and not self._closed

    # -- lifecycle ------------------------------------------------------------------------------
    def __enter__(self) -> Monitor:
        if self._entered:
            raise RuntimeError(
                "this watch() session is already active: it is not re-entrant; create a new one"
            )
        self._entered = True
        self.thread = self.sentinel.thread = self.sentinel.edits.thread = threading.current_thread()
        name = type(self.model).__name__.lower()
        try:
            self.recording.open(self.config, name, self.rank, self.world_size, self._has_pg)
            self._install()
            self.recording.open_sinks(self.config, name, self.rank)
        except BaseException:
            self._teardown(None)
            raise
        if (
            self.run_dir is not None
            and self.config.announce
            and self.rank == 0
            and self.recording.owns_writer
        ):
            # one quiet line, once: where to look (the same folder on every rank, so rank 0 says it)
            print(f"torchdebug: recording to {self.run_dir}", file=sys.stderr, flush=True)
        self.verdicts.check_weights(
            functools.partial(self.sentinel.check_at_start, self), self.__exit__
        )  # a NaN checkpoint: said now
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        # Everything installed comes off whatever happens here (a warning turned into an error by the
        # user's filters, a NonFiniteError from the final check, an instrument that fails at exit).
        late: NonFiniteError | None = None
        try:
            if self._async is not None:
                if exc is None:
                    try:
                        self._async.finish()  # sync="async": the steps still in flight are judged now
                    except NonFiniteError as err:
                        late = err  # raised below, after the instruments' on_exit
                else:
                    self._async.settle(exc)  # what is staged is judged and recorded, never raised
            if exc is not None and not isinstance(exc, NonFiniteError):
                for inst in list(self.instruments):
                    self._call(inst, "on_exception", exc)
            if exc is None and self.sentinel.active:
                with contextlib.suppress(Exception):
                    if self.sentinel.final_check(self):  # the last update's parameter probe
                        self.transfer.values = {}
                        self.sync()
            self.verdicts.say_skips(at_exit=True)
            for inst in list(self.instruments):
                self._call(inst, "on_exit")
            if late is not None:
                raise late
        finally:
            self._teardown(exc or late)

    def _install(self) -> None:
        self._plain.install()
        for name in sorted(self._wanted()):
            self._build_instrument(name)
        if self.world_size > 1 or self.config.hang_timeout is not None:
            self._coord = _distributed.Coordinator(
                self, self.rank, self.world_size, self._has_pg, self._ddp, self.sentinel.deferred
            )
            self.instruments.append(self._coord)
        if self.config.on_spike != "off" and "gradients" in self._enabled:  # where the loss rules run;
            # last: it reads the step's numbers and the coordinator's
            self.instruments.append(SpikeGuard())
            self._call(self.instruments[-1], "install")
        self._plain.guard_module_hooks()
        self._plain.wrap_compiled()

    def _teardown(self, exc: BaseException | None) -> None:
        if self._closed:
            return
        self._closed = True
        if self._async is not None:
            self._async.discard()  # every optimizer's found_inf as it was
        self.sentinel.remove(self.state)
        for inst in list(self.instruments):
            with contextlib.suppress(Exception):
                if hasattr(inst, "remove"):
                    inst.remove(self)
        self._plain.remove()
        self.installs.close()  # what an instrument's remove() missed (a failed install, another thread)
        self.stepper.next()
        self._end_status = "finished" if exc is None else "failed"  # what verdict() and the store say
        self.recording.close(self._end_status, self.global_step - 1 if self.global_step else None)

    def warn_once(self, key: str, message: str) -> None:
        """Warn (at the user's line) once per ``key`` in this session."""
        if key not in self._warned:
            self._warned.add(key)
            warn_at_user(TorchDebugWarning(message))  # the user's line, wherever the check runs

    # -- instrument plumbing ---------------------------------------------------------------------
    def _call(self, inst: Any, method: str, *args: Any) -> Any:
        fn = getattr(inst, method, None)
        if fn is None:
            return None
        try:
            return fn(self, *args)
        except (NonFiniteError, LossSpikeError):
            raise
        except Exception as exc:
            self._disable(inst, exc)
            return None

    def _disable(self, inst: Any, exc: BaseException) -> None:
        name = getattr(inst, "name", type(inst).__name__)
        warn_at_user(
            TorchDebugWarning(f"torchdebug: instrument {name!r} failed and was switched off: {exc!r}")
        )
        if inst in self.instruments:
            self.instruments.remove(inst)
            with contextlib.suppress(Exception):
                if hasattr(inst, "remove"):
                    inst.remove(self)

    def due(self, every: int | None) -> bool:
        """True on steps 0, every, 2*every ... (the detailed schedule)."""
        return every is not None and every > 0 and self.global_step % every == 0

    def emit(self, event: RuleEvent) -> None:
        """Record a rule event (store + memory) and warn once per kind."""
        self.events.append(event)
        self.state.events.append(event)
        if self.writer is not None:
            with contextlib.suppress(Exception):
                self.writer.log_event(event.step, event.kind, event.severity, event.message, event.to_dict())
        if event.severity != "info" and event.kind not in self._warned:
            self._warned.add(event.kind)
            warn_at_user(TorchDebugWarning(f"torchdebug: {event}"))  # the user's line, not ours

    def observe(self, name: str, value: float) -> None:
        """Record a monitored value (validation loss, early-stopping metric) at the current step."""
        if not isinstance(name, str) or not name:
            raise TypeError("observe(name, value): name must be a non-empty string")
        value = float(value)
        self.log_scalars({f"observe/{name}": value})
        self.stepper.each("on_observe", name, value)

    def log_scalars(self, values: Mapping[str, float], step: int | None = None) -> None:
        """Record scalars in the run folder at ``step`` (default: the current step)."""
        self.recording.log_scalars(self.global_step if step is None else step, values)

    def flush_store(self) -> None:
        """Flush the run store (before raising: what led to the error is on disk)."""
        self.recording.flush()

    # -- the instruments, built for the level -------------------------------------------------------
    def _wanted(self) -> set[str]:
        # an instrument recorded within another that runs (GradientHealth's activations and details:
        # one set of hooks) is not built on its own
        return {n for n in self._enabled if spec(n).within not in self._enabled}

    def _build_instrument(self, name: str) -> None:
        entry = spec(name)
        if not entry.built:
            return  # the session holds it from its start (the sentinel)
        try:
            cls = entry.load()
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
        self.sentinel.config = self.config
        self.sentinel.active = "nonfinite" in self._enabled
        sync, reads = self.config.sync, self._async
        # switched live ("auto" keeps what the session chose as it started; "async" replaces its choice)
        if (sync == "blocking" and reads is not None) or (sync == "async" and (reads is None or reads.auto)):
            if reads is not None:
                reads.finish()  # the steps in flight are judged now (may raise)
            self._async = DeferredReads(self) if sync == "async" else None
        ours = {entry.cls for entry in REGISTRY if entry.built}
        for inst in [i for i in self.instruments if type(i).__name__ in ours]:
            self.instruments.remove(inst)  # rebuilt below: their depth follows the level
            with contextlib.suppress(Exception):
                if hasattr(inst, "remove"):
                    inst.remove(self)
        for name in sorted(self._wanted()):
            self._build_instrument(name)
        self._plain.guard_module_hooks()

    # -- several models and optimizers (``mon.models``) -----------------------------------------------
    def step_lrs(self) -> tuple[float, ...]:
        """Every optimizer's learning rates (param group order), as each update of the step used them."""
        return self.models.step_lrs(self.state.lr_used)

    def lr_names(self) -> list[str]:
        """The scalar names of :meth:`step_lrs` (``lr/<group>``; several optimizers: ``lr/<model>/<group>``)."""
        return self.models.lr_names()

    def optimizer_label(self, opt: Any, k: int = 0) -> str:
        """The model an optimizer steps (several models: its name), else ``opt<k>``."""
        return self.models.optimizer_label(opt, k)

    def owns_optimizer(self, opt: Any) -> bool:
        """True for this session's optimizer; without one, the first optimizer of its parameters is adopted."""
        return self.models.owns_optimizer(opt)

    def watch_also(
        self, model: nn.Module | None, optimizer: torch.optim.Optimizer | None, caller: Any = None
    ) -> bool:
        """Watch one more model and/or optimizer, before the session's first forward (``torchdebug run``
        watches every optimizer the script creates). A model not watched yet makes the session one of
        several models (names gain the model's name: ``G.main.0``). False when it is too late (a step began)."""
        if optimizer is not None:
            self.models.add_optimizer(optimizer)
        if model is None or any([model is m for m in self.model.modules()]):
            return True
        state = self.state
        if self.global_step or self.micro_step or state.phase is StepPhase.FORWARD or state.captures:
            return False  # a step began: its names and captures stay as they are
        called = self._called if _compiled_orig(self._called) is self.model else self.model  # as called
        self._regroup(self.models.joined(model, called, caller))
        return True

    def _regroup(self, roots: dict[str, nn.Module]) -> None:
        """The session watches these models now (as one ModuleDict, each by name): names, parameters,
        root hooks and instruments again. ``roots``: the modules the loop calls; a ``torch.compile``
        wrapper among them is named and watched as the module it compiles (no ``_orig_mod.``), its root
        hooks stay on the wrapper that is called."""
        container = nn.ModuleDict({n: _compiled_orig(m) or m for n, m in roots.items()})
        self.model = self._called = container
        self.models.regroup(roots, container)
        self.names = {m: n for n, m in container.named_modules()}
        named = [(n, p) for n, p in container.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.uses_cuda = any(p.is_cuda for p in self.params)
        self.sentinel.reindex(self.params, self.param_names)
        self._plain.model = self._plain.root = container
        self._plain.hook_roots(list(roots.values()))
        self._apply_level(self.config.level)  # the instruments again, over every model

    # -- live control (``mon.controls``: held from any thread, applied at the end of the next step) ---
    @property
    def reads_late(self) -> bool:
        """The step's numbers are read one step later (``sync="async"``, or "auto" where it fits)."""
        return self._async is not None

    def set_level(self, level: str | DebugLevel) -> DebugLevel:
        """Switch the debug level of the live session; instruments follow at the end of the next step.
        Safe from another thread (the dashboard's): it is applied on the training thread inside
        ``mon.step()``. Raises ``ValueError`` for an unknown level, listing the allowed."""
        return self.controls.set_level(level, self.writer, self.global_step)

    def reconfigure(self, **changes: Any) -> DebugConfig:
        """Change options of the live session; instruments follow at the end of the next step. Validated
        now (``ConfigError`` naming the option), applied on the training thread inside ``mon.step()``
        like ``set_level``, recorded as a ``config_change`` event. Returns the config the session will
        run with. The seed-era names: ``enable_debugging`` / ``disable_debugging`` / ``get_debugging_status``."""
        return self.controls.reconfigure(self.config, changes, self.writer, self.global_step)

    def enable_debugging(self, options: Any = None) -> dict[str, Any]:
        """Seed 000's runtime switch; see ``torchdebug.compat.enable_debugging``."""
        return runtime.enable_debugging(self, options)

    def disable_debugging(self, options: Any = None) -> dict[str, Any]:
        """Seed 000's runtime switch; see ``torchdebug.compat.disable_debugging``."""
        return runtime.disable_debugging(self, options)

    def get_debugging_status(self) -> dict[str, Any]:
        """Seed 000's status; see ``torchdebug.compat.get_debugging_status``."""
        return runtime.get_debugging_status(self)

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
        self.controls.new_segment(self.writer, self.global_step)

    def training_summary(self) -> dict[str, Any]:
        """The seed-era training summary (counts and rates since the last ``clear()``).

        ``anomaly_steps`` counts the steps ``events.is_anomalous`` calls anomalous (a NaN/Inf, or a
        warning-level event), as every seed-era summary does; the rule counts are ``rule_counts``."""
        kinds = [e.kind for e in self.events]
        return self.controls.summary(self.global_step, self.counters["anomalous_steps"], kinds)

    def run_step(self, step_fn: Callable[[Any], Any], batch: Any) -> Any:
        """Run ``step_fn(batch)`` (forward + loss + backward; returns the loss) with the OOM policy: with
        ``on_oom="retry_half"`` an out-of-memory error re-runs the step on halves of the batch, gradients
        scaled to equal the full batch's, and records an ``oom_retry`` event. Then call
        ``optimizer.step()`` and ``mon.step()``."""
        if not callable(step_fn):
            raise TypeError(
                f"run_step(step_fn, batch): step_fn must be callable, got {type(step_fn).__name__}"
            )
        from ..memory.recovery import run_step_with_oom_retry

        def new_micro_step(_piece: Any) -> None:
            self.state.phase = StepPhase.START  # the failed attempt never reached its backward

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

    # -- how a session reads in a notebook or a debugger -----------------------------------------------
    @property
    def status(self) -> str:
        """``"not started"`` (before ``with``), ``"active"``, or ``"closed"`` (after ``with``)."""
        if not self._entered:
            return "not started"
        return "closed" if self._closed else "active"

    def verdict(self) -> dict[str, Any]:
        """The session's verdict, ranked as ``torchdebug show`` ranks a run's: a dict (``"text"``,
        ``"level"``, ``"findings"``...) whose ``str()`` is its sentence, shown coloured in a notebook."""
        status = "running" if not self._closed else getattr(self, "_end_status", None) or "finished"
        return verdict(status, self.global_step, self.anomalies, self.events)

    def __repr__(self) -> str:
        return describe(self.status, self.global_step, self.anomalies, self.events, self.run_dir)

    def _repr_html_(self) -> str:
        """The session in a notebook: the verdict first (as ``torchdebug show`` says it), then status,
        step, the first anomaly, the warnings so far, the run folder."""
        model = type(self.model).__name__
        return describe_html(
            model, self.verdict(), self.status, self.global_step, self.anomalies, self.events, self.run_dir
        )


def _caller() -> Any:
    """The first frame outside torchdebug (names several models after the caller's variables)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("torchdebug"):
        frame = frame.f_back  # type: ignore[assignment]
    return frame


def watch(
    model: nn.Module | list[nn.Module] | tuple[nn.Module, ...] | dict[str, nn.Module],
    optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer] | None = None,
    *,
    policy: str | None = None,
    scaler: Any = None,
    run: Any = None,
    config: Any = None,
    early_stopping: Any = None,
    tensorboard: bool | str | None = None,
    clip_on_spike: float | None = None,
    on_oom: str | None = None,
    report_to: Any = None,
    announce: bool | None = None,
    sync: str | None = None,
    on_spike: str | None = None,
    step_fn: Any = None,
) -> Monitor:
    """Watch a training loop: the always-on NaN/Inf sentinel plus the instruments the config switches on.

    Call ``mon.step()`` once per training step (after ``optimizer.step()``). Returns the step's
    :class:`StepRecord`.

    Args:
        model: the model; modules are named as in ``model.named_modules()``. Several models (a GAN's
            G and D, a teacher and its student, an actor and its critic): a list (named after the
            caller's variables: ``td.watch([G, D], ...)`` names ``G.main.0``, ``D.1``), a dict or an
            ``nn.ModuleDict`` (named by its keys); every forward of each in a step is recorded and
            the replay re-runs the step's micro-steps in order (docs/integrations.md).
        optimizer: the optimizer, or a list of them. With it, the check runs in its step pre-hook so
            corrupted gradients never reach the weights, and ``policy="skip"`` can skip the update;
            with several, each update is checked before it runs. Without it, every optimizer
            stepping these parameters is adopted as it first steps (``mon.optimizers``).
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
        tensorboard: ``True`` or a log dir: the TensorBoard sink (``report_to=["tensorboard"]``)
            writing into ``<run folder>/tensorboard`` or that directory.
        report_to: the trackers that receive the run's records as the run folder gets them: names
            from ``"tensorboard"``, ``"wandb"``, ``"mlflow"``, ``"logging"``, or ``"all"`` (those
            installed) / ``"none"``; also sink objects (``torchdebug.sinks.WandbSink(run=...)``) or an
            open ``SummaryWriter``. A sink uses the tracker run already open (``wandb.run``, the active
            MLflow run) and opens one only when there is none. Sent from background threads, never
            the training step's; a tracker that fails or falls behind is switched off with one
            warning. Rank 0 reports. See docs/trackers.md.
        clip_on_spike: clip gradients to this norm on detected spikes only.
        on_oom: ``"raise"`` or ``"retry_half"`` (with ``mon.run_step``).
        announce: print the run folder once on stderr as the session starts
            (``torchdebug: recording to runs/gpt-20260101-120000``; rank 0 only, nothing without a
            run folder). Default ``config.announce`` (True; ``TORCHDEBUG_ANNOUNCE=0`` turns it off).
        sync: ``"auto"`` (default: ``"async"`` where it is safe and pays, the parameters on a CUDA
            device with one fused optimizer, no GradScaler, one process, no ``clip_on_spike``, a
            plain loop; else ``"blocking"``, silently), ``"blocking"`` (the step's numbers are read
            as the update starts, one device-to-host sync per step) or ``"async"``: ordinary steps
            make no blocking read. The
            numbers go to the host with a non-blocking copy (pinned memory and a CUDA event) and
            are read at the next step's first forward; meanwhile a fused optimizer
            (``Adam``/``AdamW``/``SGD``/``Adagrad`` with ``fused=True``) gets a device flag as
            ``found_inf`` and skips the update of a non-finite step on the device, so parameters and
            optimizer state stay as before it and the step replays to the same origin. ``raise``
            then raises at the next step's first forward (or at exit) naming the step of birth;
            ``skip``/``warn`` record the step as skipped (its update never ran). ``mon.step()``
            returns a record whose numbers are read (and the step judged: it may raise) when one
            is first read, so a loop that never reads them waits for nothing; else ``mon.records``,
            the store and instruments' ``on_step_end`` get the step one step later. Other optimizers, a GradScaler,
            framework drivers, several ranks and updates by hand fall back to ``"blocking"`` with one
            ``TorchDebugWarning``; the optimizer's first update is always read blocking (its state
            does not exist yet). Cost: one small device-to-host copy per step, no wait.
        on_spike: what a loss spike (the robust loss-spike rule) does: ``"warn"`` (default: a
            ``SpikeReport`` in ``mon.spikes`` says why: cause ``batch`` naming the rows,
            ``learning_rate``, ``optimizer_state`` naming the parameters, ``layer`` naming the module,
            or ``unknown``, each with its numbers), ``"rollback"`` (also restore the last snapshot
            before the spike, taken every ``config.snapshot_every`` steps, and go on with the next
            batch; ``mon.rollbacks``), ``"raise"`` (``LossSpikeError``) or ``"off"``. See docs/spikes.md.
        step_fn: the ``torch.compile``'d step function the loop calls (``step_fn =
            torch.compile(train_step)``, the model's forward inside it), when the model itself is not
            compiled. Inside compiled code no module hook runs, so without it the failing step cannot
            be replayed; with it, each call's arguments are kept (references and the RNG state, as the
            forward's capture in a plain loop) and the first anomaly is replayed eagerly and through
            the compiled function: ``anomaly.cause`` says ``model`` or ``compiler`` (docs/reading.md).

    Raises:
        NonFiniteError: (policy "raise") at the first check point after a NaN/Inf, with ``.anomaly``
            naming phase, module, op and source line (the failing step is replayed under tracing).
        LossSpikeError: (``on_spike="raise"``) at a loss spike, or a spike after ``max_rollbacks``
            rollbacks; ``.report`` is its ``SpikeReport``.
        TypeError / ValueError: bad arguments, naming the fix (``sync`` not "blocking"/"async";
            ``ConfigError``: an unknown tracker name,
            listing the allowed ones, or ``report_to`` without a run folder).
        ImportError: a tracker's library is missing (names the extra, e.g. ``torchdebug[wandb]``).

    Cost: one foreach norm of the gradients per backward, one of the parameters per optimizer step,
    and one host transfer per step. The replay (2-4x a step) runs only when something went wrong.

    Example::

        with td.watch(model, optimizer) as mon:
            for x, y in loader:
                loss = F.cross_entropy(model(x), y)
                optimizer.zero_grad(); loss.backward(); optimizer.step()
                mon.step()
    """
    compiled_step = CompiledStep.of(step_fn) if step_fn is not None else None  # ConfigError naming the fix
    mon = Monitor(
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
        report_to=report_to,
        announce=announce,
        sync=sync,
        on_spike=on_spike,
    )
    mon.sentinel.step_fn = compiled_step
    return mon

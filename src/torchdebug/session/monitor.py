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
from collections.abc import Iterator
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .._config import DebugLevel
from .._errors import LossSpikeError, NonFiniteError, TorchDebugWarning
from .._frames import warn_at_user
from .._installs import Installs
from .._step import Instrument, StepState
from ..events import Anomaly, RuleEvent, StepRecord
from ..nonfinite.hyperparams import HyperparameterCheck
from ..nonfinite.sentinel import Sentinel
from . import distributed as _distributed
from .control import Controls
from .deferred import reads_for
from .driver import PlainLoopDriver
from .models import SeveralModels
from .options import check_options, gather_models
from .recording import Recording
from .rollback import SpikeGuard
from .step import Step
from .transfer import Items, Transfer
from .verdicts import Verdicts
from .wrappers import is_compiled, split_models

_MAX_EVENTS = 10_000


class Monitor(Controls, Recording, SeveralModels):
    """A watch session over one model. Create it with :func:`watch`; see there."""

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
        model, self.roots, optimizers = gather_models(model, optimizer, _caller())
        self.config, self._sink_objects = check_options(
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
        self._hub: Any = None  # the sinks' hub (report_to), fed by the run writer's thread
        self._ddp, model, self.roots = split_models(model, self.roots)  # DDP, compile: the wrapped modules
        # torch.compile(model) wraps the module: the root hooks go on the module that is called, while
        # names, parameters and the instruments see the original (no "_orig_mod." prefix anywhere)
        self._called: nn.Module = model
        orig = getattr(model, "_orig_mod", None)
        if type(model).__name__ == "OptimizedModule" and isinstance(orig, nn.Module):
            model = orig
        self.model = model
        self.optimizer = optimizer  # the first optimizer given (None: adopted as they step)
        # every optimizer of the session: those given, else those adopted (in the order they first stepped)
        self.optimizers: list[torch.optim.Optimizer] = list(optimizers)
        self._given = bool(optimizers)
        self._lr_names: tuple[tuple[int, ...], list[str]] = ((-1,), [])
        self._bare_optimizer = optimizer  # ``owns_optimizer``'s shortcut
        self.scaler = scaler
        self.early_stopping = early_stopping
        self._run_arg = run
        # everything the session and its instruments install: taken off in _teardown, whatever failed
        self.installs = Installs()
        self.thread = threading.current_thread()  # modes are entered only here (see _installs.py)
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
        self.step_scalars: dict[str, float] = {}  # the last step's own scalars, as stored
        self.instruments: list[Instrument] = []
        self.anomalies: list[Anomaly] = []
        self.spikes: list[Any] = []  # a SpikeReport per loss-spike episode (session/rollback.py)
        self.rollbacks: list[Any] = []  # a Rollback per on_spike="rollback" restore
        self.events: deque[RuleEvent] = deque(maxlen=_MAX_EVENTS)
        self.records: deque[StepRecord] = deque(maxlen=1000)
        # anomaly_steps: steps with a NaN/Inf record; anomalous_steps: ``events.is_anomalous`` steps
        # (a NaN/Inf or a warning-level event), what every seed-era summary counts
        self.counters: dict[str, int] = {
            "anomaly_steps": 0,
            "anomalous_steps": 0,
            "skipped_steps": 0,
            "replays": 0,
        }
        self.level_overrides: list[str] = []
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
        self._plain = PlainLoopDriver(self, self._called, self.model, list((self.roots or {}).values()))
        self._entered = False
        self._closed = False
        self._warned: set[str] = set()
        self.uses_cuda = any(p.is_cuda for p in self.params)
        self._last_step_end = time.perf_counter()
        self._adopted: set[int] = set()
        self._segment_start = 0  # the step the current history segment (dashboard "clear") began
        self._pending_level: DebugLevel | None = None  # set_level() from any thread, applied in step()
        self._pending_changes: dict[str, Any] = {}  # reconfigure() from any thread, applied in step()

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
        if self._pending_level is not None or self._pending_changes:
            level, self._pending_level = self._pending_level, None
            changes, self._pending_changes = self._pending_changes, {}
            self._apply_level(level if level is not None else self.config.level, **changes)
        self.global_step += 1
        (transfer := self.stepper.state.transfer).reset()  # ``StepState.next``, inlined (every step)
        self.stepper.state = StepState(transfer)  # a new state for the next step
        hub = self._hub
        if hub is not None and hub.pending:
            hub.warn()  # a sink was switched off (on its thread): say it here, once
        self._last_step_end = time.perf_counter()
        return record

    # the async reads re-run the blocking path's pieces one step later (session/deferred.py)
    def sync(self) -> None:
        """The step's ONE host transfer: its own numbers, the sentinel's probes, every instrument's."""
        self.stepper.sync()

    def _decode_read(self) -> None:
        self.stepper.decode()

    def _collect(self) -> Items:
        return self.stepper.collect()

    def _step_items(self) -> Items:
        return self.stepper.items()

    def _record(self, lr: tuple[float, ...] | None = None, time_s: float | None = None) -> StepRecord:
        return self.stepper.record(lr, time_s)

    def _keep(self, record: StepRecord) -> None:
        self.stepper.keep(record)

    def _each(self, method: str, *args: Any) -> None:
        self.stepper.each(method, *args)

    def _set_state(self, state: StepState) -> None:
        self.stepper.state = state

    # the step's state and numbers, read without a call of their own (C-level getters)
    if TYPE_CHECKING:
        state: StepState
        transfer: Transfer
        coordinator: Any
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
        coordinator = property(
            attrgetter("_coord"),
            doc="The distributed coordinator (several ranks, or a hang timeout), or None.",
        )
        closed = property(attrgetter("_closed"), doc="True once the session has exited.")
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
        return bool(self._adopted)

    @contextlib.contextmanager
    def eager(self) -> Iterator[None]:
        """Run the model eagerly while the sentinel replays a step (bypasses an in-place compile)."""
        with self._plain.eager():
            yield

    @property
    def compiled(self) -> bool:
        """True while the model (or one of several) runs under ``torch.compile`` (a wrapper, or
        ``model.compile()`` in place): per-module instruments stand down (their hooks would see nothing
        inside it)."""
        return is_compiled([self._called, *(self.roots or {}).values()])

    @property
    def called(self) -> nn.Module:
        """The module the loop calls: a ``torch.compile`` wrapper, else the model (``model.compile()``
        compiles it in place)."""
        return self._called

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
        try:
            self._open_store()
            self._install()
            self._open_sinks()
        except BaseException:
            self._teardown(None)
            raise
        if self.run_dir is not None and self.config.announce and self.rank == 0 and self._owns_writer:
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
        self._close_store(self._end_status)

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
        self._each("on_observe", name, value)


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
        report_to=report_to,
        announce=announce,
        sync=sync,
        on_spike=on_spike,
    )

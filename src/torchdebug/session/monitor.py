"""watch(): the always-on session. It owns the lifecycle and the step protocol; instruments do the work.

The step protocol: a training step is seen as a sequence of boundaries. A *driver* produces them
(:class:`~torchdebug.session.driver.PlainLoopDriver` for a hand-written loop; the Lightning and
Hugging Face callbacks set ``mon.driver`` and call the update boundaries themselves), and at each
the session calls the sentinel first, then every instrument:

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

The pieces: the sentinel (:mod:`torchdebug.nonfinite.sentinel`: detection, replay, policies), the
transfer (:mod:`torchdebug.session.transfer`: the step's device numbers and their one read), the
plain-loop driver and global patches (:mod:`torchdebug.session.driver`), the distributed coordinator
(:mod:`torchdebug.session.distributed`, an instrument on these same boundaries).
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._config import DebugLevel
from .._errors import LossSpikeError, NonFiniteError, TorchDebugWarning
from .._frames import warn_at_user
from .._installs import Installs
from .._step import Instrument, StepPhase, StepState
from ..events import Anomaly, RuleEvent, StepRecord, is_anomalous
from ..nonfinite.hyperparams import HyperparameterCheck
from ..nonfinite.sentinel import Sentinel
from . import distributed as _distributed
from .control import Controls
from .deferred import reads_for
from .driver import PlainLoopDriver
from .gradcheck import GradientCheck
from .items import StepItems
from .models import SeveralModels
from .options import check_options, gather_models
from .recording import Recording
from .rollback import SpikeGuard
from .transfer import Items, Transfer
from .verdicts import Verdicts
from .wrappers import is_compiled, split_models

_MAX_EVENTS = 10_000
_SCALARS = ("loss", "grad_norm", "grad_nonfinite", "amp_scale")  # the record's scalars to the store


class Monitor(Controls, Recording, SeveralModels, StepItems, GradientCheck):
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
        self.state = StepState(Transfer())  # the step now running: its numbers, captures, verdict, phase
        self.sentinel = Sentinel(self)
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

    # -- the step protocol (see the module docstring) -------------------------------------------
    def forward_started(self, module: nn.Module, args: tuple, kwargs: dict, outside: bool = False) -> None:
        """Forward began (the root module's forward pre-hook; ``outside``: around a compiled call)."""
        if self.sentinel.watch is not None:
            self.sentinel.watch_edits_end(judge=False)  # a forward before the update: unwatched from here
        if self.roots is not None:
            self._root_started(module, args, kwargs)
            return
        if (
            self.sentinel.replaying
            or not torch.is_grad_enabled()
            or (self._plain.in_compiled_call and not outside)
        ):
            return
        self.sentinel.pop_tape()
        self._first_forward(module, args, kwargs, outside)

    def _first_forward(self, module: nn.Module, args: tuple, kwargs: dict, outside: bool = False) -> None:
        state = self.state
        if state.new_micro_step:
            state.new_micro_step = False
            state.phase = StepPhase.FORWARD
            if self._async is not None:
                self._async.resolve(block=False)  # the last step's numbers, copied by now (may raise)
            self.sentinel.on_forward_start(self, module, args, kwargs)
            self._each("on_forward_start", module, args, kwargs)
            if outside or self._called is not self.model:
                self._plain.guard_module_hooks()  # compiled: hooks an instrument added just now
        # (later forward calls in the same micro-step are not boundaries)

    def forward_done(self, module: nn.Module, args: tuple, output: Any, outside: bool = False) -> None:
        """Forward done (the root module's forward hook)."""
        if self.roots is not None:
            self._root_done(module, output)
            return
        if (
            self.sentinel.replaying
            or not torch.is_grad_enabled()
            or (self._plain.in_compiled_call and not outside)
        ):
            return
        self.sentinel.on_forward_end(self, module, output)
        self._each("on_forward_end", module, output)

    def backward_started(self, loss: Any, gradient: Any) -> None:
        """Backward began (the ``Tensor.backward`` / ``torch.autograd.backward`` wrapper)."""
        self.sentinel.watch_edits_end()
        if self._held is not None:
            self.flush_measure()  # the last backward's gradients, before this one adds to them
        self.sentinel.watch_edits_end(judge=False)  # this backward adds to them
        self.sentinel.pop_tape()
        self.state.fwd_depth = 0
        if self._plain.in_place_roots():  # model.compile() in place (any of several models)
            self._plain.wrap_compiled()
        self.sentinel.on_backward_start(self, loss, gradient)
        if (
            isinstance(loss, torch.Tensor)
            and loss.is_floating_point()
            and (self.sentinel.active or "gradients" in self._enabled)
        ):
            self.transfer.add_loss(loss)
        self._each("on_backward_start", loss)

    def backward_done(self) -> None:
        """Backward done: one device reduction of the gradients (a norm or a finiteness probe each)."""
        self.micro_step += 1
        self.state.new_micro_step = True
        self.state.phase = StepPhase.BACKWARD
        self._measure_gradients()  # now, or held for a clip that follows (session/gradcheck.py)
        self._each("on_backward_end")
        if self.roots is not None:
            self.sentinel.after_backward(self)  # the loss code that follows is recorded too
        if self.sentinel.judges_at_backward_end(self):
            # an update by hand (or every backward checked): no optimizer hook runs before the update
            self.sync()
            self.state.synced_at_backward = True
            self.verdicts.apply(self.sentinel.judge(at_optimizer=False))
        self.sentinel.watch_edits_begin()  # the torch calls until the update, for the edit check

    def update_starting(self, opt: Any = None) -> None:
        """Step protocol: the optimizer update is about to start and the gradients are final.

        The plain-loop driver calls it from the optimizer's step pre-hook; a framework driver that owns
        the loop (Lightning's ``on_before_optimizer_step``, HF's ``on_pre_optimizer_step``) calls it
        itself after ``mon.driver`` is set. Here the step's transfer runs and the gradients are checked
        (under ``policy="skip"`` a bad step's gradients are dropped so the update does nothing).
        """
        if self.sentinel.replaying:
            return
        self.sentinel.watch_edits_end()  # what ran since backward(), for the edit check
        if self._held is not None:
            self.flush_measure()
        state = self.state
        state.phase, state.updating = StepPhase.UPDATE, opt
        self.sentinel.pop_tape()  # the update is not loss code
        # the LR each update uses (a scheduler stepped before mon.step() must not change what is recorded)
        for o in [opt] if any([opt is o for o in self.optimizers]) else self.optimizers:
            state.lr_used.setdefault(id(o), tuple([float(g.get("lr", math.nan)) for g in o.param_groups]))
        self.hyperparams.stage(opt if opt is not None else self.optimizer, device_ok=self._async is None)
        if self._async is None or not self._async.update_starting(opt):
            if self.sentinel.before_update(self, opt):
                self.sync()  # the step's one read (a second optimizer in the step reuses it)
            if self.sentinel.active:
                self.verdicts.apply(self.sentinel.judge(at_optimizer=True, opt=opt))  # may raise or skip
        self.verdicts.apply(self.hyperparams.judge(self, self.sentinel.active))  # lr, eps, betas ...
        self._each("before_optimizer_step")

    def update_done(self, opt: Any = None) -> None:
        """Step protocol: the optimizer update finished (the optimizer's step post-hook, or a driver)."""
        if self.sentinel.replaying:
            return
        state = self.state
        state.phase = StepPhase.UPDATED
        state.micro_base = len(self.transfer.micro_bad)  # the next update's micro-steps count from here
        if self._async is not None:
            self._async.update_done(opt)
        self.sentinel.after_update(self)
        self._each("after_optimizer_step")
        if (
            self.roots is not None
            and state.cap is not None
            and state.captures
            and state.cap is state.captures[-1]
            and len(state.captures) - 1 in state.tape_only  # the capture of what follows a backward
        ):
            self.sentinel.open_tape(self, state.cap)  # several models: the loss code after it is recorded

    def scaler_step_started(self, scaler: Any) -> None:
        """``GradScaler.step`` began for this session's optimizer (the scaler is adopted if unknown)."""
        if self.scaler is None:
            self.scaler = scaler  # detected: GradScaler.step was called with our optimizer
        self.sentinel.scaler_step_started(self, scaler)

    def scaler_step_done(self, scaler: Any, failed: bool = False) -> None:
        """``GradScaler.step`` returned: when it skipped the update, the sentinel judges it now."""
        if self.sentinel.scaler_step_done(self, scaler, failed):  # skipped: judged now, gradients still here
            if self.sentinel.wants_read():
                self.sync()
            self.verdicts.apply(self.sentinel.judge(at_optimizer=False))

    def step(self) -> StepRecord:
        """Step protocol: the training step ended. Call once per step, after ``optimizer.step()``.

        Reads what the step produced (one host transfer, unless the update already did), records it and
        returns the step's :class:`StepRecord`; ``mon.global_step`` then counts one more.
        """
        if self._closed or not self._entered:
            raise RuntimeError("mon.step() called outside its `with td.watch(...)` block")
        self.sentinel.watch_edits_end()  # an update by hand ran: the edit check reads the watch
        if self.roots is not None:
            self.sentinel.pop_tape()
        if self._held is not None:
            self.flush_measure()  # no update came (the clip was predicted)
        if self._async is not None:
            early = self._async.step_end()  # a staged step: judged one step later
            if early is not None:
                self._advance()
                return early
        sentinel, transfer = self.sentinel, self.transfer
        manual = sentinel.manual_update(self)
        synced = transfer.synced
        if sentinel.before_step_end(self, manual):  # the verdict, when the update did not give it
            self.sync()
            self.verdicts.apply(sentinel.judge(at_optimizer=False))
        if synced:
            transfer.read(self._collect())  # numbers made after the optimizer step (detail steps only)
        elif not sentinel.active:
            self.sync()
        self.verdicts.note_scaler_skip()
        record = self._record()
        self.verdicts.say_skips()
        sentinel.after_step_end(self, manual)
        self._each("on_step_end", record, record.values)
        self._keep(record)
        self._advance()
        return record

    def _keep(self, record: StepRecord) -> None:
        """A step's full record (now, or one step later under sync="async"): counted and kept."""
        if is_anomalous(record.anomaly, [e.severity for e in self.state.events]):
            self.counters["anomalous_steps"] += 1
        self.records.append(record)

    def _advance(self) -> None:
        """The step is over: apply live changes, count it, reset the per-step state."""
        if self._pending_level is not None or self._pending_changes:
            level, self._pending_level = self._pending_level, None
            changes, self._pending_changes = self._pending_changes, {}
            self._apply_level(level if level is not None else self.config.level, **changes)
        self.global_step += 1
        self._reset_step()
        hub = self._hub
        if hub is not None and hub.pending:
            hub.warn()  # a sink was switched off (on its thread): say it here, once
        self._last_step_end = time.perf_counter()

    # -- the one transfer --------------------------------------------------------------------------
    def sync(self) -> None:
        """The step's ONE host transfer: its own numbers, the sentinel's probes, every instrument's."""
        if self._held is not None:
            self.flush_measure()
        items = self._step_items()
        self.transfer.synced = True
        if any([t.is_meta for _, t in items]):
            # a model on the meta device computes shapes only: there are no values to read or check
            items = [(k, t) for k, t in items if not t.is_meta]
            self.warn_once(
                "meta",
                "torchdebug: tensors on the meta device hold no values: the NaN/Inf checks and the "
                "numbers of this run skip them (move the model to a real device to check it)",
            )
        if not items:
            return
        self.transfer.read(items)  # the step's host sync
        self._decode_read()

    def _decode_read(self) -> None:
        """After the read: other ranks' shares, the sentinel's readers, the decoded numbers."""
        if self._coord is not None:
            self._coord.fill_shares(self)  # DDP: the other ranks' shares of the gradient numbers
        values, readout = self.transfer.values, self.transfer.readout
        self.sentinel.read_edits(readout)
        scaled = self.scaler is not None and getattr(self.scaler, "is_enabled", lambda: True)()
        self.transfer.decode(self.params, self.sentinel.grad_finite, scaled, also_bad=self.state.edit_bad)
        if (
            self._coord is not None and "grad_norm" in values
        ):  # FSDP2: the whole gradient's norm, not the shard's
            scale = (readout.scale if scaled else None) or 1.0
            values["grad_norm"] = self._coord.global_grad_norm(self, values["grad_norm"], scale)
            self.transfer.grad_norm = values["grad_norm"]
            self.transfer.grad_norms = self._coord.global_grad_norms(self, self.transfer.grad_norms, scale)
        self.verdicts.apply(self.sentinel.read_deferred(readout))  # the last update's probe (may raise)

    def _collect(self) -> Items:
        """The instruments' device numbers; plain numbers they hand over go straight into the values."""
        items: Items = []
        for inst in list(self.instruments):
            if getattr(inst, "collect", None) is None:
                continue  # most instruments hand over nothing (no call, twice a step)
            got = self._call(inst, "collect") or {}
            if not got:
                continue
            if any(isinstance(v, torch.Tensor) and v.is_meta for v in got.values()):
                # a model on the meta device: shapes only, no values for this instrument to report
                self._disable(inst, RuntimeError("its tensors are on the meta device and hold no values"))
                continue
            for k, v in got.items():
                if isinstance(v, torch.Tensor):
                    items.append((k, v))
                else:
                    self.transfer.values[k] = float(v)
        return items

    def _record(self, lr: tuple[float, ...] | None = None, time_s: float | None = None) -> StepRecord:
        """The step's record; its scalars go to the store (``lr``, ``time_s``: kept from the step end)."""
        now = time.perf_counter()
        v = {k: x for k, x in self.transfer.values.items() if not k.startswith("_")}
        if lr is None:
            lr = self.step_lrs()
        record = StepRecord(
            step=self.global_step,
            micro_steps=len(self.transfer.micro_bad) or len(self.state.captures),
            loss=v.get("loss"),
            grad_norm=v.get("grad_norm"),
            skipped=self.state.skipped,
            skip_reason=self.state.skip_reason,
            scale=v.get("amp_scale"),
            lr=lr,
            time_s=now - self._last_step_end if time_s is None else time_s,
            values=v,
            anomaly=self.state.step_anomaly,
            events=self.state.events,
        )
        scalars = {k: x for k, x in v.items() if k in _SCALARS or k.startswith("grad_norm/")}  # optnorms.py
        scalars["skipped"] = 1.0 if self.state.skipped else 0.0
        for name, x in zip(self.lr_names(), lr):
            scalars[name] = x
        self.step_scalars = scalars  # what the run folder gets for this step (framework callbacks forward it)
        if self.writer is not None:
            with contextlib.suppress(Exception):
                self.writer.log_scalars(self.global_step, scalars)
        return record

    def _reset_step(self) -> None:
        self.state.reset()

    # -- what drivers and instruments read -------------------------------------------------------
    @property
    def closed(self) -> bool:
        """True once the session has exited."""
        return self._closed

    @property
    def replaying(self) -> bool:
        """True while the sentinel replays a failing micro-step (drivers ignore what it does)."""
        return self.sentinel.replaying

    @property
    def coordinator(self) -> Any:
        """The distributed coordinator (several ranks, or a hang timeout), or None."""
        return self._coord

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
    def transfer(self) -> Transfer:
        """The step's device numbers and their one read (``self.state.transfer``)."""
        return self.state.transfer  # type: ignore[no-any-return]

    @property
    def grad_norm_host(self) -> float | None:
        """The last read total gradient norm (host float), or None."""
        return self.transfer.grad_norm

    @property
    def grad_norms_host(self) -> list[float] | None:
        """The last read per-parameter gradient norms, in the order of ``params``, or None."""
        return self.transfer.grad_norms

    @property
    def compiled(self) -> bool:
        """True while the model (or one of several) runs under ``torch.compile`` (a wrapper, or
        ``model.compile()`` in place): per-module instruments stand down (their hooks would see nothing
        inside it)."""
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
        self.thread = threading.current_thread()
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
        self.verdicts.check_weights(self.sentinel.check_at_start, self.__exit__)  # a NaN checkpoint: said now
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
            self._coord = _distributed.Coordinator(self, self.rank, self.world_size, self._has_pg, self._ddp)
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
        self.sentinel.remove()
        for inst in list(self.instruments):
            with contextlib.suppress(Exception):
                if hasattr(inst, "remove"):
                    inst.remove(self)
        self._plain.remove()
        self.installs.close()  # what an instrument's remove() missed (a failed install, another thread)
        self._reset_step()
        self._close_store("finished" if exc is None else "failed")

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

    def _each(self, method: str, *args: Any) -> None:
        # several times a step: ``_call`` inlined (one lookup, no extra frame per instrument)
        for inst in list(self.instruments):
            fn = getattr(inst, method, None)
            if fn is None:
                continue
            try:
                fn(self, *args)
            except (NonFiniteError, LossSpikeError):
                raise
            except Exception as exc:
                self._disable(inst, exc)  # the warning points at the user's line

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

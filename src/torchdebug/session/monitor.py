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
                                                    sentinel's verdict and policy;
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
import importlib
import math
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._config import DebugConfig, DebugLevel, check_path, coerce_config
from .._errors import ConfigError, NonFiniteError, RunStoreError, TorchDebugWarning
from .._frames import warn_at_user
from .._installs import Installs
from .._tensors import unwrap_optimizer
from ..events import Anomaly, RuleEvent, StepRecord, is_anomalous, rule_counts, training_summary
from ..nonfinite.hyperparams import HyperparameterCheck
from ..nonfinite.sentinel import Sentinel
from . import distributed as _distributed
from .deferred import DeferredReads
from .driver import PlainLoopDriver
from .transfer import Items, Transfer

POLICIES = ("raise", "warn", "skip")
SYNCS = ("blocking", "async")
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
    "step_details": ("torchdebug.health.details", "StepDetails"),
}


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
        report_to: Any = None,
        announce: bool | None = None,
        sync: str | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"watch(model, ...): model must be a torch.nn.Module, got {type(model).__name__}")
        optimizer = unwrap_optimizer(optimizer)
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
        self._sink_objects: list[Any] = []  # Sink objects / SummaryWriters given in report_to
        if report_to is not None:
            items = [report_to] if isinstance(report_to, str) else report_to
            if not isinstance(items, (list, tuple)):
                items = [items]
            changes["report_to"] = [i for i in items if isinstance(i, str)]
            self._sink_objects = [i for i in items if not isinstance(i, str)]
        if announce is not None:
            changes["announce"] = announce
        if sync is not None:
            if not isinstance(sync, str) or sync.lower() not in SYNCS:
                raise ValueError(f"watch(..., sync={sync!r}): sync must be one of {', '.join(SYNCS)}")
            changes["sync"] = sync.lower()
        self.config: DebugConfig = cfg.replace(**changes) if changes else cfg
        self._hub: Any = None  # the sinks' hub (report_to), fed by the run writer's thread
        if self.config.report_to or self.config.tensorboard or self._sink_objects:
            from ..sinks import as_sink, require, resolve_names

            if run is False or (run is None and not self.config.store):
                raise ConfigError(
                    "report_to / tensorboard send the run's records as the run folder gets them, so they "
                    "need the run store: drop run=False (or store=False), or drop report_to"
                )
            resolve_names(self.config.report_to)  # a missing library: ImportError naming the extra, now
            if self.config.tensorboard:
                require("tensorboard")
            for obj in self._sink_objects:
                as_sink(obj)  # a TypeError for anything else, now
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
        # the optimizer when unwrapping leaves it as it is (``owns_optimizer``'s shortcut)
        self._bare_optimizer = optimizer if unwrap_optimizer(optimizer) is optimizer else None
        self.scaler = scaler
        self.early_stopping = early_stopping
        if isinstance(run, (str, bytes, os.PathLike)):
            check_path(os.fspath(run), "run")  # a NUL byte would only fail later, inside the user's `with`
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
        self.instruments: list[Any] = []
        self.anomalies: list[Anomaly] = []
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
        self.transfer = Transfer()
        self.sentinel = Sentinel(self)
        self.sentinel.active = "nonfinite" in self._enabled
        self.hyperparams = HyperparameterCheck()  # lr, eps, betas ... checked before each update
        # sync="async": the step's numbers read one step later (session/deferred.py); None: blocking
        self._async = DeferredReads(self) if self.config.sync == "async" else None
        self._plain = PlainLoopDriver(self, self._called, self.model)
        self._entered = False
        self._closed = False
        self._warned: set[str] = set()
        self._uses_cuda = any(p.is_cuda for p in self.params)
        self._step_events: list[RuleEvent] = []
        self._lr_used: tuple[float, ...] | None = None  # read as the update starts (update_starting)
        self._new_micro_step = True  # the next forward is the first of a micro-step
        self._last_step_end = time.perf_counter()
        self._adopted: set[int] = set()
        self._segment_start = 0  # the step the current history segment (dashboard "clear") began
        self._pending_level: DebugLevel | None = None  # set_level() from any thread, applied in step()
        self._pending_changes: dict[str, Any] = {}  # reconfigure() from any thread, applied in step()

    # -- the step protocol (see the module docstring) -------------------------------------------
    def forward_started(self, module: nn.Module, args: tuple, kwargs: dict, outside: bool = False) -> None:
        """Forward began (the root module's forward pre-hook; ``outside``: around a compiled call)."""
        if (
            self.sentinel.replaying
            or not torch.is_grad_enabled()
            or (self._plain.in_compiled_call and not outside)
        ):
            return
        self.sentinel.pop_tape()
        if self._new_micro_step:
            self._new_micro_step = False
            if self._async is not None:
                self._async.resolve(block=False)  # the last step's numbers, copied by now (may raise)
            self.sentinel.on_forward_start(self, module, args, kwargs)
            self._each("on_forward_start", module, args, kwargs)
            if outside or self._called is not self.model:
                self._plain.guard_module_hooks()  # compiled: hooks an instrument added just now
        # (later forward calls in the same micro-step are not boundaries)

    def forward_done(self, module: nn.Module, args: tuple, output: Any, outside: bool = False) -> None:
        """Forward done (the root module's forward hook)."""
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
        self.sentinel.pop_tape()
        if self._called.__dict__.get("_compiled_call_impl") is not None:  # model.compile() in place
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
        self._new_micro_step = True
        if self.sentinel.active or "gradients" in self._enabled:
            # gradient health needs true norms; the sentinel alone only finiteness (a cheaper probe)
            share = self._coord.grad_share(self) if self._coord is not None else None  # DDP: this rank's
            idx, grads = self.transfer.measure(
                self.params, probe="gradients" not in self._enabled, share=share
            )
            if idx:
                self.sentinel.saw_gradients(idx, grads)
        self._each("on_backward_end")
        self.sentinel.on_backward_end(self)  # a loop that updates by hand is checked here

    def update_starting(self, opt: Any = None) -> None:
        """Step protocol: the optimizer update is about to start and the gradients are final.

        The plain-loop driver calls it from the optimizer's step pre-hook; a framework driver that owns
        the loop (Lightning's ``on_before_optimizer_step``, HF's ``on_pre_optimizer_step``) calls it
        itself after ``mon.driver`` is set. Here the step's transfer runs and the gradients are checked
        (under ``policy="skip"`` a bad step's gradients are dropped so the update does nothing).
        """
        if self.sentinel.replaying:
            return
        if self.optimizer is not None and self._lr_used is None:  # the LR this update uses (a
            # scheduler stepped before mon.step() must not change what the step records)
            self._lr_used = tuple([float(g.get("lr", math.nan)) for g in self.optimizer.param_groups])
        self.hyperparams.stage(opt if opt is not None else self.optimizer, device_ok=self._async is None)
        if self._async is None or not self._async.update_starting(opt):
            self.sentinel.before_update(self, opt)
        self.hyperparams.judge(self)  # before the update: a non-finite lr/eps/beta never reaches the weights
        self._each("before_optimizer_step")

    def update_done(self, opt: Any = None) -> None:
        """Step protocol: the optimizer update finished (the optimizer's step post-hook, or a driver)."""
        if self.sentinel.replaying:
            return
        if self._async is not None:
            self._async.update_done(opt)
        self.sentinel.after_update(self)
        self._each("after_optimizer_step")

    def scaler_step_started(self, scaler: Any) -> None:
        """``GradScaler.step`` began for this session's optimizer (the scaler is adopted if unknown)."""
        if self.scaler is None:
            self.scaler = scaler  # detected: GradScaler.step was called with our optimizer
        self.sentinel.scaler_step_started(self, scaler)

    def scaler_step_done(self, scaler: Any, failed: bool = False) -> None:
        """``GradScaler.step`` returned: when it skipped the update, the sentinel judges it now."""
        self.sentinel.scaler_step_done(self, scaler, failed)

    def clip_starting(self, params: list[Any]) -> list[int]:
        """``torch.nn.utils.clip_grad_norm_`` is about to scale these parameters' gradients (the
        driver's patch): the ones the sentinel can judge by the clip factor alone."""
        return self.sentinel.before_clip(params)

    def clip_done(self, idx: list[int], total: Any, max_norm: Any, norm_type: Any) -> None:
        """The clip returned its total norm: the sentinel reads the factor; ``on_clip`` for instruments."""
        self.sentinel.after_clip(idx, total, max_norm)
        self._each("on_clip", total, max_norm, norm_type)

    def step(self) -> StepRecord:
        """Step protocol: the training step ended. Call once per step, after ``optimizer.step()``.

        Reads what the step produced (one host transfer, unless the update already did), records it and
        returns the step's :class:`StepRecord`; ``mon.global_step`` then counts one more.
        """
        if self._closed or not self._entered:
            raise RuntimeError("mon.step() called outside its `with td.watch(...)` block")
        if self._async is not None:
            early = self._async.step_end()  # a staged step: judged one step later
            if early is not None:
                self._advance()
                return early
        sentinel, transfer = self.sentinel, self.transfer
        manual = sentinel.manual_update(self)
        synced = transfer.synced
        sentinel.before_step_end(self, manual)  # the verdict, when the update did not give it
        if synced:
            transfer.read(self._collect())  # numbers made after the optimizer step (detail steps only)
        elif not sentinel.active:
            self.sync()
        sentinel.note_scaler_skip()
        record = self._record()
        sentinel.after_step_end(self, manual)
        self._each("on_step_end", record, record.values)
        self._keep(record)
        self._advance()
        return record

    def _keep(self, record: StepRecord) -> None:
        """A step's full record (now, or one step later under sync="async"): counted and kept."""
        if is_anomalous(record.anomaly, [e.severity for e in self._step_events]):
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
        items = self._step_items()
        self.transfer.synced = True
        if any([t.is_meta for _, t in items]):
            # a model on the meta device computes shapes only: there are no values to read or check
            items = [(k, t) for k, t in items if not t.is_meta]
            self._warn_once(
                "meta",
                "torchdebug: tensors on the meta device hold no values: the NaN/Inf checks and the "
                "numbers of this run skip them (move the model to a real device to check it)",
            )
        if not items:
            return
        self.transfer.read(items)  # the step's host sync
        self._decode_read()

    def _step_items(self) -> Items:
        """The step's device numbers: its own, the sentinel's probes, every instrument's."""
        return (
            self.transfer.items(self.scaler)
            + self.sentinel.items()
            + self.hyperparams.items()
            + self._collect()
        )

    def _decode_read(self) -> None:
        """After the read: other ranks' shares, the sentinel's readers, the decoded numbers."""
        if self._coord is not None:
            self._coord.fill_shares(self)  # DDP: the other ranks' shares of the gradient numbers
        values = self.transfer.values
        self.sentinel.read_edits(values)
        scaled = self.scaler is not None and getattr(self.scaler, "is_enabled", lambda: True)()
        self.transfer.decode(self.params, self.sentinel.grad_finite, scaled, also_bad=self.sentinel.edit_bad)
        if (
            self._coord is not None and "grad_norm" in values
        ):  # FSDP2: the whole gradient's norm, not the shard's
            scale = (values.get("_scale") if scaled else None) or 1.0
            values["grad_norm"] = self._coord.global_grad_norm(self, values["grad_norm"], scale)
            self.transfer.grad_norm = values["grad_norm"]
            self.transfer.grad_norms = self._coord.global_grad_norms(self, self.transfer.grad_norms, scale)
        self.sentinel.read_deferred(values)  # the last update's parameter probe (may raise)

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
        sentinel = self.sentinel
        now = time.perf_counter()
        v = {k: x for k, x in self.transfer.values.items() if not k.startswith("_")}
        if lr is None:
            lr = (
                self._lr_used
                if self._lr_used is not None
                else tuple([float(g.get("lr", math.nan)) for g in self.optimizer.param_groups])
                if self.optimizer is not None
                else ()
            )
        record = StepRecord(
            step=self.global_step,
            micro_steps=len(self.transfer.micro_bad) or len(sentinel.captures),
            loss=v.get("loss"),
            grad_norm=v.get("grad_norm"),
            skipped=sentinel.skipped,
            skip_reason=sentinel.skip_reason,
            scale=v.get("amp_scale"),
            lr=lr,
            time_s=now - self._last_step_end if time_s is None else time_s,
            values=v,
            anomaly=sentinel.step_anomaly,
            events=self._step_events,
        )
        scalars = {k: x for k, x in v.items() if k in ("loss", "grad_norm", "grad_nonfinite", "amp_scale")}
        scalars["skipped"] = 1.0 if sentinel.skipped else 0.0
        for i, x in enumerate(lr):
            scalars[f"lr/{i}"] = x
        self.step_scalars = scalars  # what the run folder gets for this step (framework callbacks forward it)
        if self.writer is not None:
            with contextlib.suppress(Exception):
                self.writer.log_scalars(self.global_step, scalars)
        return record

    def _reset_step(self) -> None:
        self._lr_used = None
        self.transfer.reset()
        self.sentinel.reset()
        self._step_events = []
        self._new_micro_step = True

    # -- what drivers and instruments read -------------------------------------------------------
    @property
    def closed(self) -> bool:
        """True once the session has exited."""
        return self._closed

    # -- how a session reads in a notebook or a debugger -----------------------------------------
    @property
    def status(self) -> str:
        """``"not started"`` (before ``with``), ``"active"``, or ``"closed"`` (after ``with``)."""
        if not self._entered:
            return "not started"
        return "closed" if self._closed else "active"

    def _findings(self) -> tuple[int, list[RuleEvent]]:
        """(anomalies so far, the warning/error rule events so far)."""
        return len(self.anomalies), [e for e in self.events if e.severity != "info"]

    def __repr__(self) -> str:
        n, warned = self._findings()
        where = f", run {self.run_dir}" if self.run_dir is not None else ""
        return (
            f"<Monitor {self.status}: step {self.global_step}, {n} anomal{'y' if n == 1 else 'ies'}, "
            f"{len(warned)} warning{'' if len(warned) == 1 else 's'}{where}>"
        )

    def _repr_html_(self) -> str:
        """The session in a notebook: status, step, the first anomaly, the warnings so far, the run folder."""
        from ..events import html_table

        n, warned = self._findings()
        rows: list[tuple[str, Any]] = [
            ("status", self.status),
            ("step", self.global_step),
            ("anomalies", n if n == 0 else f"{n}, first: {self.anomalies[0].summary()}"),
            (
                "warnings",
                len(warned)
                if not warned
                else f"{len(warned)}: {', '.join(sorted({e.kind for e in warned}))}",
            ),
            ("run folder", self.run_dir if self.run_dir is not None else "none"),
        ]
        colour = "#c0392b" if n else ("#b9770e" if warned else "#1e8449")
        title = f"torchdebug watch of {type(self.model).__name__}"
        return html_table(title, colour, rows, "torchdebug-monitor")

    @property
    def replaying(self) -> bool:
        """True while the sentinel replays a failing micro-step (drivers ignore what it does)."""
        return self.sentinel.replaying

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
        """True while the model runs under ``torch.compile`` (a wrapper, or ``model.compile()`` in
        place): per-module instruments stand down (their hooks would see nothing inside it)."""
        called = self._called
        return (
            type(called).__name__ == "OptimizedModule"
            or called.__dict__.get("_compiled_call_impl") is not None
        )

    def accepts_backward(self) -> bool:
        return not self.sentinel.replaying and not self._closed

    def owns_optimizer(self, opt: Any) -> bool:
        """True for this session's optimizer; without one, the first optimizer of its parameters is adopted."""
        if opt is self._bare_optimizer and opt is not None and opt is self.optimizer:
            return True  # twice a step (the optimizer hooks): the session's own, unwrapped optimizer
        opt = unwrap_optimizer(opt)
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
                    self._async.discard()
            if exc is not None and not isinstance(exc, NonFiniteError):
                for inst in list(self.instruments):
                    self._call(inst, "on_exception", exc)
            if exc is None and self.sentinel.active:
                with contextlib.suppress(Exception):
                    self.sentinel.final_check(self)
            self.sentinel.say_skips(at_exit=True)
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
        status = "finished" if exc is None else "failed"
        if self.writer is not None and self._owns_writer:
            with contextlib.suppress(Exception):
                self.writer.close(status=status)
        if self._hub is not None:
            hub, self._hub = self._hub, None
            if not self._owns_writer:
                with contextlib.suppress(Exception):
                    self.writer.flush()  # the listener has what was logged
                self.writer.remove_listener(hub.feed)
            with contextlib.suppress(Exception):
                lost = getattr(self.writer, "lost", 0)  # records the store could not write
                hub.close(status, self.global_step - 1 if self.global_step else None, lost)

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
                warn_at_user(
                    TorchDebugWarning(
                        f"torchdebug: cannot create a run under {root!r} ({exc}); recording is off for this "
                        "session. Pass run=<writable folder> or run=False."
                    )
                )
                return
            self._owns_writer = True
        self.run_dir = Path(self.writer.path) if getattr(self.writer, "path", None) is not None else None

    def _open_sinks(self) -> None:
        """Start the trackers of ``report_to`` / ``tensorboard``: they hear the run writer's batches."""
        cfg = self.config
        if not (cfg.report_to or cfg.tensorboard or self._sink_objects) or self.rank != 0:
            return  # rank 0 reports the run; the other ranks' records stay in their run files
        if self.writer is None or not hasattr(self.writer, "add_listener"):
            self._warn_once("sinks", "torchdebug: no run folder, so report_to sends nothing this session")
            return
        from ..sinks import RunInfo, SinkHub, build_sinks

        info = RunInfo(
            name=str(getattr(self.writer, "name", None) or type(self.model).__name__.lower()),
            run_id=getattr(self.writer, "run_id", None),
            path=self.run_dir,
            config=cfg.to_dict(),
        )
        hub = SinkHub(build_sinks(cfg.report_to, self._sink_objects, cfg.tensorboard), info)
        self.writer.add_listener(hub.feed)
        self._hub = hub
        if hub.pending:
            hub.warn(stacklevel=5)  # a tracker that could not start

    # -- instruments -----------------------------------------------------------------------------
    def _wanted(self) -> set[str]:
        wanted = set(self._enabled)
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
        self.sentinel.active = "nonfinite" in self._enabled
        if (self._async is not None) != (self.config.sync == "async"):  # sync switched live
            if self._async is not None:
                self._async.finish()  # the steps in flight are judged now (may raise)
            self._async = DeferredReads(self) if self._async is None else None
        ours = {spec[1] for spec in _INSTRUMENTS.values()}
        for inst in [i for i in self.instruments if type(i).__name__ in ours]:
            self.instruments.remove(inst)  # rebuilt below: their depth follows the level
            with contextlib.suppress(Exception):
                if hasattr(inst, "remove"):
                    inst.remove(self)
        for name in sorted(self._wanted()):
            self._build_instrument(name)
        self._plain.guard_module_hooks()

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warn_at_user(TorchDebugWarning(message))  # the user's line, wherever the check runs

    def _flush_store(self) -> None:
        if self.writer is not None:
            with contextlib.suppress(Exception):
                self.writer.flush()

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
            except NonFiniteError:
                raise
            except Exception as exc:
                self._disable(inst, exc)  # the warning points at the user's line

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
            self._new_micro_step = True  # the failed attempt never reached its backward

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
        """The seed-era training summary (counts and rates since the last ``clear()``).

        ``anomaly_steps`` counts the steps ``events.is_anomalous`` calls anomalous (a NaN/Inf, or a
        warning-level event), as every seed-era summary does; the rule counts are ``rule_counts``."""
        total = max(self.global_step - self._segment_start, 0)
        explosions, vanishing, loss = rule_counts(e.kind for e in self.events)
        return training_summary(total, self.counters["anomalous_steps"], explosions, vanishing, loss)


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
    report_to: Any = None,
    announce: bool | None = None,
    sync: str | None = None,
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
        sync: ``"blocking"`` (default: the step's numbers are read as the update starts, one
            device-to-host sync per step) or ``"async"``: ordinary steps make no blocking read. The
            numbers go to the host with a non-blocking copy (pinned memory and a CUDA event) and
            are read at the next step's first forward; meanwhile a fused optimizer
            (``Adam``/``AdamW``/``SGD``/``Adagrad`` with ``fused=True``) gets a device flag as
            ``found_inf`` and skips the update of a non-finite step on the device, so parameters and
            optimizer state stay as before it and the step replays to the same origin. ``raise``
            then raises at the next step's first forward (or at exit) naming the step of birth;
            ``skip``/``warn`` record the step as skipped (its update never ran). ``mon.step()``
            returns a record without numbers; the full record (``mon.records``, the store,
            instruments' ``on_step_end``) follows one step later. Other optimizers, a GradScaler,
            framework drivers, several ranks and updates by hand fall back to ``"blocking"`` with one
            ``TorchDebugWarning``; the optimizer's first update is always read blocking (its state
            does not exist yet). Cost: one small device-to-host copy per step, no wait.

    Raises:
        NonFiniteError: (policy "raise") at the first check point after a NaN/Inf, with ``.anomaly``
            naming phase, module, op and source line (the failing step is replayed under tracing).
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
    )

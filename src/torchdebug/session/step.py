"""The step now running and the step protocol's boundaries: the session's per-step path, in one room.

A :class:`Step` owns the :class:`~torchdebug._step.StepState` of the step now running (with its
``Transfer``: the device numbers and their one host read) and a new one for each step. The drivers
(the plain-loop hooks of :mod:`.driver`, the Lightning and Hugging Face callbacks, ``torchdebug
run``) call its boundary methods; at each it hands the state to the sentinel first, then calls every
instrument. One pass, one direction after the read:

    read (``sync``)  ->  agree across ranks (the coordinator, ``agree``, as a verdict is asked for)
    ->  judge (the sentinel, ``judge(state, readout)``)  ->  apply (``session/verdicts.py``)

Nobody in that chain calls an earlier link: the sentinel returns a :class:`~torchdebug._step.Verdict`
(a new anomaly comes back unbuilt and the step replays it, through the coordinator on several ranks).
The boundaries, with when each is called, are in :mod:`.monitor`'s docstring.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .._errors import LossSpikeError, NonFiniteError
from .._step import StepPhase, StepState, Update, Verdict
from ..events import StepRecord, is_anomalous
from .gradcheck import GradientCheck
from .transfer import Items, Transfer

if TYPE_CHECKING:
    from .protocol import Session

_SCALARS = ("loss", "grad_norm", "grad_nonfinite", "amp_scale")  # the record's scalars to the store


class Step:
    """The step now running (``state``) and the step protocol's boundaries (see the module docstring)."""

    def __init__(self, mon: Session) -> None:
        self.mon = mon
        self.state = StepState(Transfer())  # the step now running: its numbers, captures, verdict, phase
        self.grads = GradientCheck(mon)  # the gradients measured after backward(), or inside the clip
        # the instruments that have each method, per method name, for the list they were found in
        # (``_of``, a copy: a changed ``mon.instruments`` finds them again); no failed getattr a step
        self._of: list[Any] = []
        self._having: dict[str, list[Any]] = {}

    # -- instrument plumbing ---------------------------------------------------------------------
    def having(self, method: str) -> list[Any]:
        """The instruments that have ``method``, in order (a snapshot: one may be switched off while
        they are called), found again when ``mon.instruments`` changed (the callers inline the lookup)."""
        instruments = self.mon.instruments
        if self._of != instruments:
            self._of, self._having = list(instruments), {}
        # (an attribute set to None is no such method)
        got = self._having[method] = [i for i in instruments if getattr(i, method, None) is not None]
        return got

    def each(self, method: str, *args: Any) -> None:
        """Call ``method`` of every instrument that has it; a failing one is switched off."""
        mon = self.mon
        # (``having``, inlined: seven times a step; the list comparison is C-level, by identity)
        having = self._having.get(method) if self._of == mon.instruments else None
        for inst in having if having is not None else self.having(method):
            fn = getattr(inst, method)  # looked up at the call: an instrument may replace its method
            try:
                fn(mon, *args)
            except (NonFiniteError, LossSpikeError):
                raise
            except Exception as exc:
                mon._disable(inst, exc)  # the warning points at the user's line

    # -- forward ---------------------------------------------------------------------------------
    def forward_started(self, module: nn.Module, args: tuple, kwargs: dict, outside: bool = False) -> None:
        """Forward began (the root module's forward pre-hook; ``outside``: around a compiled call)."""
        mon, st = self.mon, self.state
        s = mon.sentinel
        if s.edits.watch is not None:
            s.edits.watch_edits_end(st, judge=False)  # a forward before the update: unwatched from here
        if mon.roots is not None:
            self.root_started(module, args, kwargs)
            return
        if s.replaying or (mon._plain.in_compiled_call and not outside):
            return
        st = self.state
        if st.phase is StepPhase.FORWARD and st.cap is not None and st.entry is None:
            # the model called again in the micro-step (SimCLR's second view, a pseudo-label under
            # no_grad): an entry of its tape, replayed as a forward (not a boundary)
            s.later_forward(st, module, args, kwargs, grad=torch.is_grad_enabled())
            return
        if not torch.is_grad_enabled():
            return
        if s.tape is not None:
            s.pop_tape()
        if st.phase is StepPhase.FORWARD:
            return  # a later forward call in the micro-step: not a boundary
        # (``first_forward``, inlined: every step)
        if mon._async is not None:
            mon._async.resolve(block=False)  # the last step's numbers, copied by now (may raise)
        st = self.state  # (resolve may have put the state back)
        st.phase = StepPhase.FORWARD
        s.on_forward_start(st, mon, module, args, kwargs)
        self.each("on_forward_start", module, args, kwargs)
        if outside or mon._called is not mon.model:
            mon._plain.guard_module_hooks()  # compiled: hooks an instrument added just now

    def first_forward(self, module: nn.Module, args: tuple, kwargs: dict, outside: bool = False) -> None:
        mon = self.mon
        if self.state.phase is not StepPhase.FORWARD:  # the first forward of a micro-step
            if mon._async is not None:
                mon._async.resolve(block=False)  # the last step's numbers, copied by now (may raise)
            st = self.state  # (resolve may have put the state back)
            st.phase = StepPhase.FORWARD
            mon.sentinel.on_forward_start(st, mon, module, args, kwargs)
            self.each("on_forward_start", module, args, kwargs)
            if outside or mon._called is not mon.model:
                mon._plain.guard_module_hooks()  # compiled: hooks an instrument added just now
        # (later forward calls in the same micro-step are not boundaries)

    def forward_done(self, module: nn.Module, args: tuple, output: Any, outside: bool = False) -> None:
        """Forward done (the root module's forward hook)."""
        mon = self.mon
        if mon.roots is not None:
            self.root_done(module, output)
            return
        if mon.sentinel.replaying or (mon._plain.in_compiled_call and not outside):
            return
        if self.state.entry is not None and mon.sentinel.forward_entry_done(self.state, output):
            return  # a later call of the model in the micro-step: its output kept on the tape
        if not torch.is_grad_enabled():
            return
        mon.sentinel.on_forward_end(self.state, output)
        self.each("on_forward_end", module, output)

    # several models: each one's forward is a root; every one in the step is recorded for the replay
    def root_started(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        mon, st = self.mon, self.state
        s = mon.sentinel
        st.fwd_depth += 1
        if s.replaying or st.fwd_depth > 1:
            return  # a watched model called inside another's forward is part of that forward
        if not torch.is_grad_enabled():
            s.no_grad_forward(st, mon, module, args, kwargs)  # a frozen model inside the step
        elif st.phase is not StepPhase.FORWARD:
            s.pop_tape()
            self.first_forward(module, args, kwargs)
        else:
            s.later_forward(st, module, args, kwargs)

    def root_done(self, module: nn.Module, output: Any) -> None:
        mon, st = self.mon, self.state
        st.fwd_depth = max(st.fwd_depth - 1, 0)
        if mon.sentinel.replaying or st.fwd_depth > 0:
            return
        if not mon.sentinel.forward_entry_done(st, output) and torch.is_grad_enabled():
            mon.sentinel.on_forward_end(st, output)
            self.each("on_forward_end", module, output)

    # -- backward --------------------------------------------------------------------------------
    def backward_started(self, loss: Any, gradient: Any) -> None:
        """Backward began (the ``Tensor.backward`` / ``torch.autograd.backward`` wrapper)."""
        mon, st = self.mon, self.state
        s = mon.sentinel
        if s.edits.watch is not None:
            s.edits.watch_edits_end(st)
        if self.grads.held is not None:
            self.grads.flush_measure()  # the last backward's gradients, before this one adds to them
        if s.edits.watch is not None or st.seen.watched:
            s.edits.watch_edits_end(st, judge=False)  # this backward adds to them
        if s.tape is not None:
            s.pop_tape()
        st.fwd_depth = 0
        s.on_backward_start(st, loss, gradient)
        if (
            isinstance(loss, torch.Tensor)
            and loss.is_floating_point()
            and (s.active or "gradients" in mon._enabled)
        ):
            st.transfer.add_loss(loss)
        self.each("on_backward_start", loss)

    def backward_done(self) -> None:
        """Backward done: one device reduction of the gradients (a norm or a finiteness probe each)."""
        mon, st = self.mon, self.state
        s = mon.sentinel
        mon.micro_step += 1
        st.phase = StepPhase.BACKWARD
        self.grads.measure()  # now, or held for a clip that follows (session/gradcheck.py)
        self.each("on_backward_end")
        if mon.roots is not None:
            s.after_backward(st, mon)  # the loss code that follows is recorded too
        if (s.manual or s.check_each_backward) and s.judges_at_backward_end(mon.driver):
            # an update by hand (or every backward checked): no optimizer hook runs before the update
            self.sync()
            st.read_at = StepPhase.BACKWARD
            self.judge(at_optimizer=False)
        if st.seen.watched:
            s.edits.watch_edits_begin(st)  # the torch calls until the update, for the edit check

    # -- update ----------------------------------------------------------------------------------
    def update_starting(self, opt: Any = None) -> None:
        """Step protocol: the optimizer update is about to start and the gradients are final.

        The plain-loop driver calls it from the optimizer's step pre-hook; a framework driver that owns
        the loop (Lightning's ``on_before_optimizer_step``, HF's ``on_pre_optimizer_step``) calls it
        itself after ``mon.driver`` is set. Here the step's transfer runs and the gradients are checked
        (under ``policy="skip"`` a bad step's gradients are dropped so the update does nothing).
        """
        mon, st = self.mon, self.state
        s = mon.sentinel
        if s.replaying:
            return
        if s.edits.watch is not None:
            s.edits.watch_edits_end(st)  # what ran since backward(), for the edit check
        if self.grads.held is not None:
            self.grads.flush_measure()
        st.phase, st.updating = StepPhase.UPDATE, opt
        if s.tape is not None:
            s.pop_tape()  # the update is not loss code
        # the LR each update uses (a scheduler stepped before mon.step() must not change what is recorded)
        opts = mon.optimizers
        if not (len(opts) == 1 and opts[0] is opt):  # (the usual answer: the one optimizer)
            opts = [opt] if any([opt is o for o in opts]) else opts
        for o in opts:
            if id(o) not in st.lr_used:
                st.lr_used[id(o)] = tuple([float(g.get("lr", math.nan)) for g in o.param_groups])
        mon.hyperparams.stage(opt if opt is not None else mon.optimizer, device_ok=mon._async is None)
        if mon._async is None or not mon._async.update_starting(opt):
            # several models or optimizers: each update is read and checked before it runs
            several = mon.roots is not None or len(mon.optimizers) > 1
            if s.before_update(st, opt, mon.scaler, several, mon.optimizer):
                self.sync()  # the step's one read (a second optimizer in the step reuses it)
            if s.active:
                self.judge(at_optimizer=True, opt=opt)  # may raise or skip
        verdict = mon.hyperparams.judge(mon, s.active)  # lr, eps, betas ...
        if verdict.kind != "ok":
            mon.verdicts.apply(verdict)
        self.each("before_optimizer_step")

    def update_done(self, opt: Any = None) -> None:
        """Step protocol: the optimizer update finished (the optimizer's step post-hook, or a driver)."""
        mon, st = self.mon, self.state
        s = mon.sentinel
        if s.replaying:
            return
        st.phase = StepPhase.UPDATED
        st.micro_base = len(st.transfer.micro_bad)  # the next update's micro-steps count from here
        if mon._async is not None:
            mon._async.update_done(opt)
        coord = mon._coord
        # the probe's schedule (nonfinite/ledger.py): every detail step, and every step under several ranks
        due = coord is not None or mon.global_step % mon.config.detail_every == 0
        share = coord.param_share(mon) if coord is not None and due else None
        s.after_update(st, mon, due, share)
        self.each("after_optimizer_step")
        if (
            mon.roots is not None
            and st.cap is not None
            and st.captures
            and st.cap is st.captures[-1]
            and len(st.captures) - 1 in st.tape_only  # the capture of what follows a backward
        ):
            s.open_tape(st.cap)  # several models: the loss code after it is recorded

    def scaler_step_started(self, scaler: Any) -> None:
        """``GradScaler.step`` began for this session's optimizer (the scaler is adopted if unknown)."""
        mon = self.mon
        if mon.scaler is None:
            mon.scaler = scaler  # detected: GradScaler.step was called with our optimizer
        mon.sentinel.scaler_step_started(self.state, scaler)

    def scaler_step_done(self, scaler: Any, failed: bool = False) -> None:
        """``GradScaler.step`` returned: when it skipped the update, the sentinel judges it now."""
        mon, st = self.mon, self.state
        s = mon.sentinel
        if s.scaler_step_done(st, failed):  # skipped: judged now, the gradients still here
            several = mon.roots is not None or len(mon.optimizers) > 1
            if s.wants_read(st, None, mon.scaler, several, mon.optimizer):
                self.sync()
            self.judge(at_optimizer=False)

    # -- the verdict -----------------------------------------------------------------------------
    def judge(self, *, at_optimizer: bool, opt: Any = None) -> None:
        """The sentinel's verdict on the step as read, applied (a new anomaly is built here: replayed,
        on every rank through the coordinator)."""
        mon, st = self.mon, self.state
        if mon._coord is not None:  # the decision every rank takes, between the read and the verdict
            mon._coord.agree(mon, st.transfer.readout, mon.sentinel.grads_bad(st))
        verdict = mon.sentinel.judge(
            st,
            st.transfer.readout,
            at_optimizer=at_optimizer,
            opt=opt,
            scaler=mon.scaler,
            driver=mon.driver,
            has_optimizer=mon.optimizer is not None or mon.adopted,
        )
        if verdict.kind != "ok":
            if verdict.replay:
                verdict = self.built(verdict)
            mon.verdicts.apply(verdict)  # may raise or skip

    def built(self, verdict: Verdict) -> Verdict:
        """The verdict's anomaly, replayed to its origin (the rare path)."""
        mon = self.mon
        sentinel, late = mon.sentinel, verdict.replay == "late"
        coord = mon._coord
        if coord is None:
            anomaly = sentinel.build_anomaly(mon, late=late)
        else:  # every rank builds the same anomaly; the rank of birth replays
            anomaly = coord.anomaly(mon, lambda: sentinel.build_anomaly(mon))
        return verdict._replace(anomaly=anomaly, replay="")

    # -- step end --------------------------------------------------------------------------------
    def end(self) -> StepRecord:
        """The training step ended (``mon.step()``): the verdict when the update did not give it, the
        record, ``on_step_end``; then the next step's state."""
        mon, st = self.mon, self.state
        s = mon.sentinel
        if s.edits.watch is not None:
            s.edits.watch_edits_end(st)  # an update by hand ran: the edit check reads the watch
        if mon.roots is not None:
            s.pop_tape()
        if self.grads.held is not None:
            self.grads.flush_measure()  # no update came (the clip was predicted)
        if mon._async is not None:
            early: StepRecord | None = mon._async.step_end()  # a staged step: judged one step later
            if early is not None:
                return early
        st = self.state
        transfer = st.transfer
        manual = st.update is Update.NONE and s.manual_update(st, mon.optimizer is not None or mon.adopted)
        synced = transfer.synced
        several = mon.roots is not None or len(mon.optimizers) > 1
        if (manual or not synced or several) and s.before_step_end(
            st, mon, manual, mon.scaler, several, mon.optimizer
        ):
            self.sync()  # the verdict, when the update did not give it
            self.judge(at_optimizer=False)
        if synced:
            more = self.collect()  # numbers made after the optimizer step (detail steps only)
            if more:
                transfer.read(more)
        elif not s.active:
            self.sync()
        if st.update is Update.SCALER_SKIPPED:
            mon.verdicts.note_scaler_skip()
        record = self.record()
        if st.skip_reason or mon.verdicts.skip_run is not None:
            mon.verdicts.say_skips()
        if manual:
            s.after_step_end(st, manual, mon.driver)
        self.each("on_step_end", record, record.values)
        if record.anomaly is not None or st.events:  # (``keep``, inlined: every step)
            self.keep(record)
        else:
            mon.records.append(record)
        return record  # the session then counts it and starts the next one (``Monitor.step``)

    def keep(self, record: StepRecord) -> None:
        """A step's full record (now, or one step later under sync="async"): counted and kept."""
        mon = self.mon
        if is_anomalous(record.anomaly, [e.severity for e in self.state.events]):
            mon.counters["anomalous_steps"] += 1
        mon.records.append(record)

    def next(self) -> None:
        """The step is over: the next one gets a new state."""
        self.state = self.state.next()

    # -- the one transfer ------------------------------------------------------------------------
    def sync(self) -> None:
        """The step's ONE host transfer: its own numbers, the sentinel's probes, every instrument's."""
        mon, st = self.mon, self.state
        if self.grads.held is not None:
            self.grads.flush_measure()
        transfer, s = st.transfer, mon.sentinel
        # the step's device numbers (``items``, inlined: every step): its own, the sentinel's probes, the
        # hyperparameters held on an accelerator (none for Python floats), every instrument's
        items: Items = transfer.items(mon.scaler)
        if self.grads.comparing:  # sync="async" read blocking this step: the merged clip's comparison
            items += self.grads.staged_items()
        if st.edit_probe is not None or st.clips or s.deferred or s.buffers.fresh:
            items += s.items(st)
        if mon.hyperparams.staged is not None:  # device-held hyperparameters (rare)
            items += mon.hyperparams.items()
        items += self.collect()
        transfer.synced = True
        meta = False
        for _, t in items:  # (no comprehension frame: every step)
            if t.is_meta:
                meta = True
                break
        if meta:
            # a model on the meta device computes shapes only: there are no values to read or check
            items = [(k, t) for k, t in items if not t.is_meta]
            mon.warn_once(
                "meta",
                "torchdebug: tensors on the meta device hold no values: the NaN/Inf checks and the "
                "numbers of this run skip them (move the model to a real device to check it)",
            )
        if not items:
            return
        transfer.read(items)  # the step's host sync
        self.decode()

    def items(self) -> Items:
        """The step's device numbers: its own, the sentinel's probes, the hyperparameters held on an
        accelerator (none for Python floats), every instrument's."""
        mon, st = self.mon, self.state
        s = mon.sentinel
        own: Items = st.transfer.items(mon.scaler)
        if self.grads.comparing:  # the merged clip's comparison with torch's, read late (async)
            own += self.grads.staged_items()
        if st.edit_probe is not None or st.clips or s.deferred or s.buffers.fresh:
            own += s.items(st)
        if mon.hyperparams.staged is not None:  # device-held hyperparameters (rare)
            own += mon.hyperparams.items()
        return own + self.collect()

    def decode(self) -> None:
        """After the read: other ranks' shares, the sentinel's readers, the decoded numbers, the verdict
        on the last update's parameter probe (the ranks agree on the step's own as it is judged)."""
        mon, st = self.mon, self.state
        transfer, s, coord = st.transfer, mon.sentinel, mon._coord
        if coord is not None:
            coord.fill_shares(mon)  # DDP: the other ranks' shares of the gradient numbers
        values, readout = transfer.values, transfer.readout
        if st.edit_probe is not None or st.clips:
            s.read_edits(st, readout)
        scaled = mon.scaler is not None and getattr(mon.scaler, "is_enabled", lambda: True)()
        transfer.decode(mon.params, lambda i: s.grad_finite(st, i), scaled, also_bad=st.edit_bad)
        if self.grads.comparing:
            self.grads.read_check(values)
        flagged = None
        if coord is not None:
            if "grad_norm" in values:  # FSDP2: the whole gradient's norm, not the shard's
                scale = (readout.scale if scaled else None) or 1.0
                values["grad_norm"] = coord.global_grad_norm(mon, values["grad_norm"], scale)
                transfer.grad_norm = values["grad_norm"]
                transfer.grad_norms = coord.global_grad_norms(mon, transfer.grad_norms, scale)
            flagged = coord.params_flagged(mon)
        verdict = s.read_deferred(st, readout, mon, flagged)  # the last update's probe
        if verdict.kind != "ok":
            mon.verdicts.apply(verdict)  # may raise
        if s.buffers.fresh:  # the buffers the forward writes (nonfinite/buffers.py)
            verdict = s.judge_buffers(st, mon, values.pop("_buffers", None))
            if verdict.kind != "ok":
                mon.verdicts.apply(verdict)  # may raise

    def collect(self) -> Items:
        """The instruments' device numbers; plain numbers they hand over go straight into the values."""
        mon = self.mon
        items: Items = []
        having = self._having.get("collect") if self._of == mon.instruments else None
        # most instruments hand over nothing: no call for them, twice a step
        for inst in having if having is not None else self.having("collect"):
            try:
                got = inst.collect(mon) or {}
            except (NonFiniteError, LossSpikeError):
                raise
            except Exception as exc:
                mon._disable(inst, exc)
                continue
            if not got:
                continue
            if any(isinstance(v, torch.Tensor) and v.is_meta for v in got.values()):
                # a model on the meta device: shapes only, no values for this instrument to report
                mon._disable(inst, RuntimeError("its tensors are on the meta device and hold no values"))
                continue
            for k, v in got.items():
                if isinstance(v, torch.Tensor):
                    items.append((k, v))
                else:
                    self.state.transfer.values[k] = float(v)
        return items

    def record(self, lr: tuple[float, ...] | None = None, time_s: float | None = None) -> StepRecord:
        """The step's record; its scalars go to the store (``lr``, ``time_s``: kept from the step end)."""
        mon, st = self.mon, self.state
        now = time.perf_counter()
        # the record's values and the store's scalars in one pass (no comprehension frames: every step)
        v: dict[str, float] = {}
        scalars: dict[str, float] = {}
        for k, x in st.transfer.values.items():
            if not k.startswith("_"):
                v[k] = x
                if k in _SCALARS or k.startswith("grad_norm/"):  # (optnorms.py)
                    scalars[k] = x
        if lr is None:
            lr = mon.models.step_lrs(st.lr_used)
        record = StepRecord(
            step=mon.global_step,
            micro_steps=len(st.transfer.micro_bad) or len(st.captures),
            loss=v.get("loss"),
            grad_norm=v.get("grad_norm"),
            skipped=bool(st.skip_reason),
            skip_reason=st.skip_reason,
            scale=v.get("amp_scale"),
            lr=lr,
            time_s=now - mon._last_step_end if time_s is None else time_s,
            values=v,
            anomaly=st.step_anomaly,
            events=st.events,
        )
        scalars["skipped"] = 1.0 if st.skip_reason else 0.0
        for name, x in zip(mon.models.lr_names(), lr):
            scalars[name] = x
        mon.step_scalars = scalars  # what the run folder gets for this step (framework callbacks forward it)
        if mon.writer is not None:
            with contextlib.suppress(Exception):
                mon.writer.log_scalars(mon.global_step, scalars)
        return record


__all__ = ["Step"]

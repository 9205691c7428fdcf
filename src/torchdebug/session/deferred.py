"""sync="async": the step's numbers read one step later, while the device protects the weights.

In the blocking mode (the default) the session reads the step's numbers as the update starts: one
device-to-host sync per step, after which nothing is queued until the host has decided. Here no
ordinary step blocks:

- update starting: the step's items (losses, gradient probes, edit and clip flags, the last update's
  parameter probe, the instruments' numbers) are stacked on the device; a one-element device flag
  ``bad`` says whether any of them is non-finite; ``halt = max(halt, bad)`` (sticky until read) is
  handed to the optimizer as ``found_inf``, the attribute ``GradScaler`` uses to drive fused
  optimizers without a sync (torch/amp/grad_scaler.py ``_step_supports_amp_scaling``). The fused
  kernels (``_fused_adam_``, ``_fused_adamw_``, ``_fused_sgd_``, ``_fused_adagrad_``) then leave the
  parameters and the optimizer state untouched when it is 1, and the ``step`` counters are put back
  (``+1`` then ``-found_inf``). The stacked numbers go to the host with a non-blocking copy (pinned
  memory and a CUDA event; on CPU the values exist at once and are simply kept);
- the next step's first forward (or later boundaries, when a CUDA copy is not done yet): the
  numbers are read from host memory (no sync: the event says the copy is complete) and the step is
  judged by the sentinel's usual code with the step's state put back in place, so a bad step is
  replayed to the same origin as in the blocking mode: its update never ran, so the weights are
  those the step saw. Its record, store rows and ``on_step_end`` calls happen then.

``mon.step()`` returns a :class:`LateRecord`: the step, micro-steps, lr and time at once; its numbers
(loss, gradient norm, values, skipped, anomaly, events) when first read, which waits for that step's
copy and judges it there (the one blocking read a loop that prints ``rec.loss`` pays each step). A
loop that never reads them waits for nothing.

Where the optimizer cannot take the flag (not fused, a custom one, a GradScaler that owns
``found_inf``, a framework driver, several ranks, an update by hand, the optimizer's first update
while its state does not exist yet) the session says so once and reads that step blocking.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import operator
import time
from collections import deque
from typing import Any

import torch

from .._errors import LossSpikeError, NonFiniteError
from .._step import StepState, Update
from .._tensors import Items
from ..events import StepRecord
from ..nonfinite.ledger import UpdateLedger
from .protocol import Session
from .transfer import stack

_MAX_PENDING = 2  # steps whose numbers are in flight; one more blocks on the oldest (bounded memory)
_BAD = "_async_bad"  # this step's own items held a non-finite value
_HALT = "_async_halt"  # the flag the optimizer saw (this step's or an earlier unread bad step's)
_BAD_VALUES = frozenset({"_loss", "_gnorm", "_mtot", "_edit"})  # non-finite number = bad
_BAD_FLAGS = frozenset({"_mbad", "_clip"})  # a flag > 0 = bad


def host_values(buf: torch.Tensor) -> list[float]:
    """The one host read of a staged step: a host buffer whose copy is complete (no device sync).

    On CUDA ``buf`` is pinned memory filled by a non-blocking copy whose event reported completion; on
    CPU it is the stacked numbers of the previous step. Kept as one function so tests can tell it
    apart from a blocking read.
    """
    return buf.tolist()


@dataclasses.dataclass
class _Pending:
    """One step whose numbers are in flight: where they are and the step's state to judge them with."""

    step: int
    opt: Any
    spec: list[tuple[str, int]]  # each staged item's name and size, in order
    buffers: list[tuple[torch.Tensor, Any]]  # (host buffer, CUDA event or None); one per staging
    deferred: tuple[dict[str, torch.Tensor], int | None, list[int] | None, list[int]]
    state: StepState | None = None  # the step's whole state, kept at its end
    ledger: UpdateLedger | None = None  # the unprobed updates as the step saw them when staged
    lr: tuple[float, ...] = ()
    time_s: float | None = None
    record: StepRecord | None = None  # the full record, once read
    opts: list[Any] = dataclasses.field(default_factory=list)  # every optimizer handed the flag

    def ready(self) -> bool:
        return all(ev is None or ev.query() for _, ev in self.buffers)


def _stack(items: Items) -> tuple[list[tuple[str, int]], torch.Tensor]:
    """The items as one float32 vector on the first item's device, and each item's name and size."""
    flat = stack(items)
    dev = flat[0].device
    spec = [(name, t.numel()) for (name, _), t in zip(items, flat)]
    return spec, torch.cat([t.to(dev, non_blocking=True) for t in flat])


_IS_CUDA = operator.attrgetter("is_cuda")


def on_cuda(params: list[torch.Tensor]) -> bool:
    """Every parameter on a CUDA device (one C-level pass). Looked up in this module when called:
    tests stand a GPU in for it on a CPU machine."""
    return all(map(_IS_CUDA, params))


def reads_for(mon: Session) -> DeferredReads | None:
    """The session's async reads, or None (blocking): ``sync="async"``, or ``"auto"`` where it is safe
    and pays: every parameter on a CUDA device (there a blocking read a step stops the host from
    queueing ahead of the device; on a CPU there is nothing to wait for), at most one optimizer given
    (several: their per-optimizer gradient norms are read blocking), no GradScaler given, one process,
    no ``clip_on_spike`` (it needs the step's norm before the update). What only the first update shows
    (a framework driver, an optimizer that is not fused, an adopted GradScaler) switches "auto" back
    to blocking there, silently."""
    sync = mon.config.sync
    if sync == "async":
        return DeferredReads(mon)
    params = mon.params
    fits = (
        sync == "auto"
        and bool(params)
        and on_cuda(params)
        and len(mon.optimizers) <= 1
        and mon.scaler is None
        and mon.world_size == 1
        and mon.config.clip_on_spike is None
    )
    return DeferredReads(mon, auto=True) if fits else None


class DeferredReads:
    """The async read of one session (``config.sync`` "async", or "auto" where it fits: ``auto``);
    see the module docstring."""

    def __init__(self, mon: Session, auto: bool = False) -> None:
        self.mon = mon
        self.auto = auto  # chosen by sync="auto": a step that cannot be read late ends it, silently
        self.leaving = False
        self.pending: deque[_Pending] = deque()
        self.staged: _Pending | None = None  # this step's numbers, staged at update_starting
        self.halt: torch.Tensor | None = None  # device flag, sticky until the host read it
        self._why_not: dict[int, str | None] = {}  # id(optimizer) -> why it cannot skip on the device
        self._set: dict[int, tuple[Any, bool, Any]] = {}  # optimizer -> its found_inf before ours
        # the stacked vector's layout -> where its value and flag items sit (_masks)
        self._layouts: dict[tuple[Any, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        self.host_reads = 0  # staged steps read from host memory (no sync)
        self.blocking_reads = 0  # waits for a copy: the pending queue was full, or the session ended

    # -- which optimizer can skip on the device -----------------------------------------------------
    def why_not(self, opt: Any) -> str | None:
        """Why this step cannot be judged one step later (None: it can). Said once per reason."""
        mon = self.mon
        if not mon.sentinel.active:
            return "the NaN/Inf sentinel is off"  # nothing to protect: said nowhere (the user's choice)
        if mon.driver is not None:
            reason = f"the {mon.driver} driver owns the update"
        elif mon.coordinator is not None:
            reason = "several ranks decide each step together (one all-reduced verdict)"
        elif self.auto and len(mon.optimizers) > 1:
            reason = "several optimizers (each one's gradient norm is read as its update starts)"
        elif mon.scaler is not None and getattr(mon.scaler, "is_enabled", lambda: True)():
            reason = "a GradScaler owns the optimizer's found_inf"
        elif opt is None:
            reason = "no optimizer object (an update by hand)"
        else:
            key = id(opt)
            if key not in self._why_not:
                fused = getattr(opt, "_step_supports_amp_scaling", False) and all(
                    g.get("fused", True) for g in opt.param_groups
                )
                self._why_not[key] = (
                    None
                    if fused
                    else f"{type(opt).__name__} cannot skip its update on the device (only fused "
                    "optimizers take found_inf, e.g. torch.optim.AdamW(..., fused=True))"
                )
            cached = self._why_not[key]
            if cached is None:
                # the first update creates the state (fused SGD fills its momentum with empty_like and
                # would keep it if skipped): that one step is read blocking, said nowhere
                return "its state does not exist yet" if not opt.state else None
            reason = cached
        if self.auto:
            self.leaving = True  # blocking from this step's end on (session/deferred.py _leave)
            return reason
        mon.warn_once(
            f"async:{reason}",
            f"torchdebug: sync='async' falls back to the blocking read (one host sync per step): {reason}",
        )
        return reason

    # -- update starting: stage the step ------------------------------------------------------------
    def update_starting(self, opt: Any) -> bool:
        """Stage the step's numbers and hand the optimizer the skip flag; False: judge it blocking."""
        try:
            return self._update_starting(opt)
        except (NonFiniteError, LossSpikeError):
            raise
        except Exception as exc:
            self._fail(exc)
            return False

    def _update_starting(self, opt: Any) -> bool:
        mon, s = self.mon, self.mon.sentinel
        self.resolve(block=False)
        if mon._async is not self:
            return False  # switched off by a failure just now
        if self.staged is not None:  # a second optimizer in the same step: the same verdict covers it
            if opt is not None and opt is not self.staged.opt:
                if self.why_not(opt) is None:
                    self._hand_flag(opt)
                    self.staged.opts.append(opt)
                elif self.halt is not None and float(self.halt) > 0:  # blocking: it cannot skip itself
                    for g in opt.param_groups:
                        for p in g["params"]:
                            p.grad = None
            return True
        if mon.transfer.synced:
            return False  # this step was read blocking already
        if self.why_not(opt) is not None:
            self.resolve(block=True)  # the blocking verdict comes after every earlier step's
            return False
        mon.state.update = Update.RAN
        s.manual = False
        s.edits.probe_edits(
            mon.state, opt, mon.scaler, mon.optimizer
        )  # device work: gradients changed since backward()
        items = mon.stepper.items()
        if not items or any([t.is_meta for _, t in items]):
            return False  # nothing to read, or a meta model: the blocking path says so
        spec, flat = _stack(items)
        with torch.no_grad():
            # judged on the stacked vector itself: a value item non-finite or a flag item up (where each
            # sits in it: two masks, cached by the step's layout, which ordinary steps repeat)
            values, flags = self._masks(spec, flat.device)
            bad = (
                flat.isfinite()
                .logical_not_()
                .logical_and_(values)
                .logical_or_(flat.gt(0).logical_and_(flags))
            )
            bad = bad.any()
            dev = next((p.device for g in opt.param_groups for p in g["params"]), flat.device)
            if self.halt is None or self.halt.device != dev:
                self.halt = torch.zeros((), dtype=torch.float32, device=dev)
            self.halt.copy_(torch.maximum(self.halt, bad.float().to(dev, non_blocking=True)))
            flat = torch.cat([bad.float().reshape(1), self.halt.reshape(1).to(flat.device), flat])
        spec = [(_BAD, 1), (_HALT, 1), *spec]
        self._hand_flag(opt)
        d = (s.deferred, s.deferred_step, s.deferred_index, s.deferred_edit_index)
        s.deferred, s.deferred_index, s.deferred_edit_index = {}, None, []  # staged: travels with the step
        self.staged = _Pending(
            mon.global_step,
            opt,
            spec,
            [self._copy(flat)],
            d,
            ledger=s.ledger.as_staged(mon.params),
            opts=[opt],
        )
        mon.transfer.synced = True
        # this step's norms come one step later: an instrument's before_optimizer_step (gradient
        # health's explosion check, clip_on_spike) sees none rather than the last step's
        mon.transfer.grad_norm = mon.transfer.grad_norms = None
        return True

    def _masks(self, spec: list[tuple[str, int]], dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the value items and the flag items sit in a step's stacked vector (bool, on ``dev``)."""
        key = (tuple(spec), dev)
        got = self._layouts.get(key)
        if got is None:
            # built on the device by fills (one small kernel per item, once per layout): a host tensor
            # copied over would be a pageable copy, which synchronizes with the device
            total = sum(k for _, k in spec)
            values = torch.zeros(total, dtype=torch.bool, device=dev)
            flags = torch.zeros(total, dtype=torch.bool, device=dev)
            at = 0
            for n, k in spec:
                if n in _BAD_VALUES:
                    values[at : at + k] = True
                elif n in _BAD_FLAGS:
                    flags[at : at + k] = True
                at += k
            if len(self._layouts) >= 8:  # a few layouts (ordinary, detail steps) in a session
                self._layouts.clear()
            got = self._layouts[key] = (values, flags)
        return got

    def _hand_flag(self, opt: Any) -> None:
        if id(opt) not in self._set:
            self._set[id(opt)] = (opt, hasattr(opt, "found_inf"), getattr(opt, "found_inf", None))
        opt.found_inf = self.halt  # the fused kernel skips the update on the device when it is 1

    def _copy(self, flat: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if flat.device.type != "cuda":
            return flat, None  # CPU: the values exist already; they are read one step later
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)  # the caching host allocator
        host.copy_(flat, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        return host, ev

    def update_done(self, opt: Any) -> None:
        """The update ran (or was skipped on the device): the optimizer's ``found_inf`` as it was."""
        saved = self._set.pop(id(opt), None)
        if saved is not None:
            _restore(*saved)

    # -- step end -----------------------------------------------------------------------------------
    def step_end(self) -> StepRecord | None:
        """``mon.step()`` of a staged step: keep its state for the read; None: a blocking step."""
        try:
            return self._step_end()
        except (NonFiniteError, LossSpikeError):
            raise
        except Exception as exc:
            self._fail(exc)
            return None
        finally:
            if self.leaving and self.mon._async is self:
                self._leave()

    def _step_end(self) -> StepRecord | None:
        p, mon = self.staged, self.mon
        if p is None:
            if mon.sentinel.manual_update(mon.state, mon.optimizer is not None or mon.adopted):
                self.why_not(None)  # an update by hand: said once
            self.resolve(block=True)  # a blocking step after async ones: theirs come first
            return None
        self.staged = None
        more = mon.stepper.collect()  # numbers made after the update (detail steps)
        if more:
            spec, flat = _stack(more)
            p.spec += spec
            p.buffers.append(self._copy(flat))
        p.state = mon.state
        p.lr = tuple([float(g.get("lr", math.nan)) for o in mon.optimizers for g in o.param_groups])
        now = time.perf_counter()
        p.time_s = now - mon._last_step_end
        mon.state = p.state.detach()  # the next step's: fresh containers, what outlives a step
        self.pending.append(p)
        while len(self.pending) > _MAX_PENDING:
            self._resolve(self.pending.popleft(), block=True)
        # the step's numbers come one step later (mon.records, the store, on_step_end), or when read
        return LateRecord(
            p.step, len(p.state.transfer.micro_bad) or len(p.state.captures), p.lr, p.time_s, self, p
        )

    def read_now(self, p: _Pending) -> StepRecord | None:
        """A :class:`LateRecord` is read: judge every pending step up to it now (waits for the copies;
        may raise under policy "raise"). None: its numbers were lost (the async read failed)."""
        if p.record is None and any([q is p for q in self.pending]):
            self.resolve(block=True)
        return p.record

    # -- the read -----------------------------------------------------------------------------------
    def resolve(self, block: bool) -> None:
        """Judge every pending step whose copy is complete (``block``: all of them, waiting)."""
        try:
            self._resolve_ready(block)
        except (NonFiniteError, LossSpikeError):
            raise
        except Exception as exc:
            self._fail(exc)

    def _leave(self) -> None:
        """sync="auto" met a step it cannot read late: blocking from now on (at the end of that step,
        after every step in flight is judged; silently: "auto" promised nothing more)."""
        self.resolve(block=True)
        self._off()

    def _off(self) -> None:
        """Blocking from now on: the device flag down, the session without async reads."""
        if self.halt is not None:
            self.halt.zero_()
        if self.mon._async is self:
            self.mon._async = None

    def _fail(self, exc: BaseException) -> None:
        """A failure of this machinery never stops training: one warning, blocking reads from now on."""
        mon = self.mon
        mon.warn_once(
            "async:failed",
            f"torchdebug: sync='async' failed ({exc!r}) and was switched off: the session reads each "
            "step blocking from now on",
        )
        self.discard()
        self._off()

    def _resolve_ready(self, block: bool) -> None:
        while self.pending and (block or self.pending[0].ready()):
            self._resolve(self.pending.popleft(), block)
        for p in self.pending:  # still in flight (CUDA, the device behind): keep less while waiting
            for cap in p.state.captures if p.state is not None else ():
                if getattr(cap, "tape_complete", False):
                    # the replay re-runs the loss from its tape; the outputs' gradients (on a language
                    # model the logits' gradient) are only its fallback: not kept through this forward
                    cap.out_grads = {}

    def _resolve(self, p: _Pending, block: bool) -> None:
        mon, s = self.mon, self.mon.sentinel
        host: list[float] = []
        for buf, ev in p.buffers:
            if ev is not None and not ev.query():
                ev.synchronize()  # only when the queue is full or the session ends
                self.blocking_reads += 1
            host += host_values(buf)
        self.host_reads += 1
        bad, halt = host[0], host[1]  # staged first: _BAD, _HALT (not unpacked)
        if halt > 0 and self.halt is not None:
            self.halt.zero_()  # read: later updates follow their own flag again (queued before them)
        assert p.state is not None  # set at the step end
        live = (
            mon.state,
            mon.global_step,
            (s.deferred, s.deferred_step, s.deferred_index, s.deferred_edit_index),
        )
        live_ledger = s.ledger
        if p.ledger is not None:
            s.ledger = p.ledger  # judged as the blocking read would have, before the step's own update
        mon.state, mon.global_step = p.state, p.step
        s.deferred, s.deferred_step, s.deferred_index, s.deferred_edit_index = p.deferred
        mon.verdicts.update_held = True  # the update ran (or was skipped on the device): nothing to drop
        mon.verdicts.skipped_on_device = halt > 0
        s.grads_gone = True  # the step's gradients may be gone: a flagged one is not confirmed
        try:
            mon.transfer.unpack(p.spec[2:], host[2:])
            mon.stepper.decode()  # the sentinel's readers, the numbers (may raise: the last update's probe)
            # the verdict (may replay), then recorded and the policy applied (may raise)
            mon.stepper.judge(at_optimizer=True, opt=p.opt)
            if halt > 0 and not mon.state.skipped:
                held = bad == 0 and mon.state.step_anomaly is None
                why = (
                    "held on the device: an earlier step's NaN/Inf was not read yet (sync='async')"
                    if held
                    else "the update was skipped on the device (sync='async')"
                )
                if held and mon.config.policy == "skip":
                    why = "skipped by policy: " + why  # counted with the run of skipped steps
                mon.verdicts.mark_skipped(
                    why, severity="info"
                )  # the anomaly (or the earlier one) was said already
            if bad > 0:
                _drop_bad_grads(p.opts, live[0])
            record = p.record = mon.stepper.record(lr=p.lr, time_s=p.time_s)
            mon.verdicts.say_skips()
            s.after_step_end(mon.state, False, mon.driver)
            mon.stepper.each("on_step_end", record, record.values)
            mon.stepper.keep(record)
        finally:
            mon.verdicts.update_held = mon.verdicts.skipped_on_device = s.grads_gone = False
            t = mon.transfer
            mon.state, mon.global_step, d = live
            s.ledger = live_ledger
            p.state, p.buffers = None, []  # judged: a record kept by the user keeps no step state
            mon.transfer.keep_norms(t)
            s.deferred, s.deferred_step, s.deferred_index, s.deferred_edit_index = d

    # -- exit -----------------------------------------------------------------------------------------
    def finish(self) -> None:
        """Session exit: read every step still in flight (waits; may raise under ``policy="raise"``)."""
        self.restore()
        if self.staged is not None:  # an update began but mon.step() never came: judge it now
            self.step_end()
        self.resolve(block=True)

    def settle(self, exc: BaseException) -> None:
        """An exception (Ctrl-C included) left the session: judge and record what is in flight anyway,
        so the run keeps the anomaly and the numbers of the steps before it. Never raises: the user's
        exception goes on; under ``policy="raise"`` the anomaly rides on it as a note."""
        self.restore()
        try:
            self.finish()
        except (NonFiniteError, LossSpikeError) as err:
            if hasattr(exc, "add_note") and err is not exc:
                exc.add_note(str(err))  # the full diagnosis, under the user's traceback
            with contextlib.suppress(Exception):
                self.resolve(block=True)  # the steps after it (held on the device): recorded as skipped
        except Exception as err:  # the machinery failed: the user's exception matters, ours is said
            self.mon.warn_once(
                "async:failed", f"torchdebug: sync='async' could not judge the last steps at exit ({err!r})"
            )
        finally:
            self.discard()

    def restore(self) -> None:
        """Every optimizer's ``found_inf`` as it was before the session (also on exceptions)."""
        for saved in self._set.values():
            _restore(*saved)
        self._set.clear()

    def discard(self) -> None:
        """An exception left the session: drop what is in flight, unread."""
        self.restore()
        self.pending.clear()
        self.staged = None


def _drop_bad_grads(opts: list[Any], live: StepState) -> None:
    """A bad step's updates were skipped on the device, its gradients left in place: dropped now, as
    the blocking read's ``policy="skip"`` drops them before the update, so the next step does not add
    to them (a GAN's G is zeroed only after D's backward: its NaN gradients would make the next
    step's total NaN and skip it too). Only while the step now running has had no backward yet (its
    first forward, where a CPU or a finished copy is read); later, its own gradients are in them."""
    if live.transfer.micro_bad or live.transfer.loss_vals:
        return
    for opt in opts:
        for g in opt.param_groups:
            for p in g["params"]:
                p.grad = None  # rare path: once per bad step


def _restore(opt: Any, had: bool, old: Any) -> None:
    if had:
        opt.found_inf = old
    elif "found_inf" in vars(opt):
        del opt.found_inf


def _record_from(fields: dict[str, Any]) -> StepRecord:
    """A pickled :class:`LateRecord` comes back as the plain record it was read as."""
    return StepRecord(**fields)


_NOW = ("step", "micro_steps", "lr", "time_s")  # known as the step ends; the rest when read


class _LateField:
    """A field of :class:`LateRecord` that, read before the step was judged, judges it first (a data
    descriptor: it wins over StepRecord's class-level defaults)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        if self.name not in obj.__dict__:
            obj._read()
        return obj.__dict__[self.name]

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.name] = value


class LateRecord(StepRecord):
    """``mon.step()``'s record under ``sync="async"``: ``step``, ``micro_steps``, ``lr`` and ``time_s``
    now; the other fields (``loss``, ``grad_norm``, ``values``, ``skipped``, ``anomaly``...) on first
    read, which waits for the step's numbers and judges the step (under ``policy="raise"`` that read
    raises :class:`NonFiniteError` for a bad step, or an earlier one still unread). Then it equals the
    record in ``mon.records``. Without its numbers (the async read failed and was switched off) the
    fields keep their defaults."""

    def __init__(
        self,
        step: int,
        micro_steps: int,
        lr: tuple[float, ...],
        time_s: float | None,
        reads: DeferredReads,
        pending: _Pending,
    ) -> None:  # the other fields are not set here: the first read of one fills them all
        self.step, self.micro_steps, self.lr, self.time_s = step, micro_steps, lr, time_s
        self._late: tuple[DeferredReads, _Pending] | None = (reads, pending)

    def _read(self) -> None:
        late, self._late = self._late, None
        full = None
        try:
            if late is not None:
                full = late[0].read_now(late[1])
        finally:
            for f in dataclasses.fields(StepRecord):
                if f.name not in _NOW and f.name not in self.__dict__:
                    default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc,operator]
                    self.__dict__[f.name] = getattr(full, f.name) if full is not None else default

    def plain(self) -> StepRecord:
        """This record as a plain :class:`StepRecord` (read first): what copies and pickles get, so a
        copy never drags the session along."""
        return StepRecord(**{f.name: getattr(self, f.name) for f in dataclasses.fields(StepRecord)})

    def __copy__(self) -> StepRecord:
        return self.plain()

    def __deepcopy__(self, memo: dict[int, Any]) -> StepRecord:
        return copy.deepcopy(self.plain(), memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return _record_from, (dict(self.plain().__dict__),)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepRecord):
            return NotImplemented
        names = [f.name for f in dataclasses.fields(StepRecord)]
        return [getattr(self, n) for n in names] == [getattr(other, n) for n in names]

    __hash__ = None  # type: ignore[assignment]  # as StepRecord's: mutable, compared by value


for _f in dataclasses.fields(StepRecord):
    if _f.name not in _NOW:
        _field = _LateField()
        _field.__set_name__(LateRecord, _f.name)
        setattr(LateRecord, _f.name, _field)

"""The NaN/Inf sentinel: the session's first instrument, the only one that decides a step (its per-step path).

At each boundary of the step protocol the session calls the sentinel before the other instruments;
the step's state lives in the session's :class:`~torchdebug._step.StepState` (``mon.state``):

- forward began: keep a reference to the batch, the RNG and autocast state (:class:`StepCapture`), so
  the micro-step can be replayed; forward done: hooks that keep the output's gradients, the loss tape;
- backward done: remember which gradient tensors backward() left (a Python read, no device work);
- update starting: a finiteness probe of the gradients changed since (clipping, normalisation,
  unscaling); the session then reads the step (its one transfer) and asks :meth:`Sentinel.judge`
  for the :class:`~torchdebug._step.Verdict` (ok, skip or anomaly), which the session applies
  (``session/verdicts.py``: ``raise`` raises, ``skip`` drops the gradients so the update does
  nothing, ``warn`` warns);
- update done: a finiteness probe of the parameters, read with the next step's transfer
  (:meth:`Sentinel.read_deferred` gives its verdict);
- step end: the same verdict when no update was seen (a manual update, GradScaler skipped it, ...).

The sentinel never calls back into the session. When the verdict is bad, the failing micro-step is
replayed under op-level tracing (:mod:`torchdebug.nonfinite.replay`, the rare path: twice, so a
fault that does not come back is reported as not reproducible) to name the phase, module, op and
source line. With several ranks the session's distributed coordinator makes every rank take the
same decision and replays on the rank of birth only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
import weakref
from typing import Any

import torch
from torch import nn

from .._step import OK, SCALER_SKIP, Readout, SeenGrads, SessionView, StepState, Verdict
from .._tensors import dtensor_type, finite_probe, local, stored_values
from .._trees import tensor_leaves
from ..events import Anomaly
from . import replay
from .edits import EditCheck, item_numbers, lift_mode
from .ledger import UpdateLedger, due, nonfinite_params
from .locate import LossTape, StepCapture
from .replay import FORWARD, FORWARD_NO_GRAD
from .startup import loaded_anomaly

_MAX_CAPTURES = 64  # micro-steps kept per step for replay (references only)
_MAX_TAPE = 64  # torch calls and model forwards recorded per micro-step (as the loss tape's limit)
_MAX_OUT_HOOKS = 16


class Sentinel(EditCheck):
    """The NaN/Inf sentinel of one session (see the module docstring); ``active`` follows the level."""

    name = "nonfinite"

    def __init__(self, mon: SessionView) -> None:
        self.mon = mon
        self.active = False
        self.replaying = False
        self.manual = False  # the loop updates by hand (no optimizer object): checked at each backward end
        # check at the end of every backward(), also with an optimizer (the seed facades' step blocks:
        # a NaN raises out of backward() as torch.autograd.detect_anomaly did); costs a second read
        self.check_each_backward = False
        self.tape: LossTape | None = None
        # the parameter probe after an update, read with the next transfer: name -> device tensor
        self.deferred: dict[str, torch.Tensor] = {}
        self.deferred_step: int | None = None
        self.deferred_index: list[int] | None = None  # the parameters the probe covers (None: all)
        self.deferred_edit_index: list[int] = []  # manual updates: gradients an edit changed after backward
        self.deferred_clean = False  # the probed update was judged clean before it ran
        self.ledger = UpdateLedger()  # updates not probed (off the detail schedule): see ledger.py
        # sync="async" (session/deferred.py), while a step is judged one step later: its gradients may be
        # gone (no exact check)
        self.grads_gone = False
        self.loaded_bad = False  # weights already non-finite at start or at a load_state_dict: said once
        self.reindex(mon)

    def reindex(self, mon: SessionView) -> None:
        """The session's parameter list (again, when ``torchdebug run`` added a model before the first step)."""
        self._index = {id(p): i for i, p in enumerate(mon.params)}
        # FSDP2 DTensor parameters: the clip's fast path (whole local tensors) does not apply
        dtensor = dtensor_type()
        self._sharded = dtensor is not None and any(isinstance(p, dtensor) for p in mon.params)

    @property
    def st(self) -> StepState:
        """The session's state of the step now running (swapped by ``sync="async"`` to judge a step late)."""
        return self.mon.state

    # what a step's verdict left, as the session's step state has it (read by tests and the seed facades)
    @property
    def step_anomaly(self) -> Anomaly | None:
        return self.mon.state.step_anomaly

    @property
    def skipped(self) -> bool:
        return self.mon.state.skipped

    @property
    def skip_reason(self) -> str:
        return self.mon.state.skip_reason

    @property
    def captures(self) -> list[StepCapture]:
        return self.mon.state.captures

    @property
    def edit_index(self) -> list[int]:
        return self.mon.state.edit_index

    def remove(self, mon: SessionView | None = None) -> None:
        self.pop_tape(force=True)
        self.watch_edits_end(judge=False)

    # -- forward -------------------------------------------------------------------------------------
    def on_forward_start(self, mon: SessionView, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """The first forward of a micro-step: keep what its replay needs (references, no copies)."""
        st = self.st
        cont = (
            st.cap is not None
            and st.captures
            and st.cap is st.captures[-1]
            and (len(st.captures) - 1) in st.tape_only
        )
        if (
            cont and st.cap.tape
        ):  # several models: loss code ran since the last backward, this forward is part of it
            self.later_forward(mon, module, args, kwargs)
            return
        if cont:  # nothing ran since the last backward: this forward begins the micro-step
            st.tape_only.discard(len(st.captures) - 1)
            st.captures.pop()
        if self.active and mon.config.replay and len(st.captures) < _MAX_CAPTURES:
            st.cap = StepCapture.take(args, kwargs, mon.uses_cuda)
            if module is not mon.model:
                st.cap.module = module  # a driver hooked the submodule the training step calls
            st.cap.batch = mon.batch
            st.captures.append(st.cap)
        else:
            st.cap = None

    # -- several models: every watched model's forward in the step is recorded, in order -----------------
    def later_forward(
        self, mon: SessionView, module: nn.Module, args: tuple, kwargs: dict, grad: bool = True
    ) -> None:
        """Another watched model's forward inside the micro-step: an entry on its tape (replayed in order)."""
        st, cap = self.st, self.st.cap
        self.pop_tape()
        if cap is None or not cap.tape_complete or len(cap.tape) >= _MAX_TAPE:
            st.entry = -1  # not recorded: the replay starts from what it has
            if cap is not None:
                cap.tape_complete = False
            return
        st.entry = len(cap.tape)
        cap.tape.append((module, FORWARD if grad else FORWARD_NO_GRAD, args, kwargs, (), None))

    def no_grad_forward(self, mon: SessionView, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """A watched model's forward under ``no_grad`` (a frozen teacher, a target network) in the step:
        an entry of the micro-step's tape. Before the micro-step's first forward, a frozen model's
        forward begins the micro-step's capture (a trainable model's, an evaluation, is not recorded)."""
        st = self.st
        if not (self.active and mon.config.replay):
            return
        cont = (
            st.cap is not None
            and st.captures
            and st.cap is st.captures[-1]
            and (len(st.captures) - 1) in st.tape_only
        )
        if st.new_micro_step and not cont:
            if any(p.requires_grad for p in module.parameters()):
                return
            self.after_backward(mon)  # a capture of the loss code from here on, this forward first
        if st.cap is not None:
            self.later_forward(mon, module, args, kwargs, grad=False)

    def forward_entry_done(self, mon: SessionView, output: Any) -> bool:
        """A recorded later forward returned: keep its output; True when it was one (not the first)."""
        st = self.st
        i, st.entry = st.entry, None
        if i is None:
            return False
        cap = st.cap
        if i >= 0 and cap is not None and i < len(cap.tape):
            cap.tape[i] = (*cap.tape[i][:5], output)
        if cap is not None and cap.tape_complete:
            self.open_tape(mon, cap)
        return True

    def after_backward(self, mon: SessionView) -> None:
        """Several models: the loss code after a backward (an actor-critic's second loss) is recorded too,
        on a capture of its own that the next forward takes over when nothing ran before it."""
        st = self.st
        if (
            not (self.active and mon.config.replay and mon.config.trace_loss)
            or len(st.captures) >= _MAX_CAPTURES
        ):
            return
        st.cap = StepCapture.take((), {}, mon.uses_cuda)
        st.cap.grad_enabled = True  # a backward ends the micro-step (a frozen model's no_grad is its own)
        st.cap.batch = mon.batch
        st.captures.append(st.cap)
        st.tape_only.add(len(st.captures) - 1)
        self.open_tape(mon, st.cap)

    def open_tape(self, mon: SessionView, cap: StepCapture) -> None:
        if mon.config.trace_loss and threading.current_thread() is mon.thread:
            cap.tape_complete = True
            self.tape = LossTape(cap)
            self.tape.__enter__()

    def on_forward_end(self, mon: SessionView, module: nn.Module, output: Any) -> None:
        cap = self.st.cap
        if cap is None:
            return
        cap.outputs = output
        n = 0
        for i, t in enumerate(tensor_leaves(output)):
            if t.requires_grad and n < _MAX_OUT_HOOKS:
                n += 1
                t.register_hook(functools.partial(_store_grad, weakref.ref(cap), i))
        # A function mode lives on its thread's stack: opened in a worker thread's forward it would miss
        # the loss code (run here) and outlive the session there. Without a tape the replay starts from
        # the gradient captured at the outputs.
        self.open_tape(mon, cap)

    def pop_tape(self, force: bool = False) -> None:
        tape = self.tape
        if tape is None:
            return
        tape.recording = False
        from torch.overrides import _get_current_function_mode

        if _get_current_function_mode() is tape:
            tape.__exit__(None, None, None)
            self.tape = None
        elif force:
            lift_mode(tape)  # the session ends: take it out from under the user's modes
            self.tape = None
        # else: another mode sits on top; the tape stays as a pass-through until it can be popped

    # -- backward ------------------------------------------------------------------------------------
    def on_backward_start(self, mon: SessionView, loss: Any, gradient: Any) -> None:
        cap = self.st.cap
        if cap is not None and isinstance(loss, torch.Tensor):
            cap.loss = loss
            cap.loss_grad = gradient if isinstance(gradient, torch.Tensor) else None

    def saw_gradients(
        self,
        idx: list[int],
        grads: list[torch.Tensor],
        versions: list[int] | None = None,
        watched: bool = False,
    ) -> None:
        """The gradient tensors backward() left and their versions (one C-level pass over the list,
        none when the caller read ``versions`` already, or ``watched``: none, edits.EditWatch)."""
        if self.active:
            self.watch_edits_end(judge=False)  # a watch still open belongs to the last backward's gradients
            self.st.seen = SeenGrads(idx, grads, len(self.mon.params), versions, watched, self._index)

    def judges_at_backward_end(self, mon: SessionView) -> bool:
        """True when the step must be read and judged now, as a backward ends: no optimizer hook will
        run before the user's update (an update by hand), or every backward is checked."""
        return (
            (self.manual or self.check_each_backward)
            and self.active
            and mon.driver is None
            and not self.replaying
        )

    # -- update --------------------------------------------------------------------------------------
    def update_not_skipped(self) -> None:
        self.st.opt_ran_in_scaler = True  # inside GradScaler.step: the update was not skipped

    def before_update(self, mon: SessionView, opt: Any) -> bool:
        """Update starting: the gradients are final. True when the session must read the step now
        (then :meth:`judge` gives the verdict; a second optimizer in the same step reuses the read)."""
        st = self.st
        st.opt_ran = True
        st.opt_ran_in_scaler = True
        self.manual = False
        if st.synced_at_backward:  # an optimizer after all: judge the gradients as the update sees them
            mon.transfer.synced, st.synced_at_backward = False, False
        return self.wants_read(opt)

    def wants_read(self, opt: Any = None) -> bool:
        """True when the step's numbers are still to be read before a verdict; then the gradients
        changed since backward() (clipping, normalisation, unscaling) are probed first (device work)."""
        mon = self.mon
        if not self.active:
            return False
        if mon.transfer.synced:
            # read already; with several models or optimizers each update is checked before it runs:
            # read again when a backward came since
            several = mon.roots is not None or len(mon.optimizers) > 1
            if not (several and mon.transfer.unread()):
                return False
        self.probe_edits(opt)
        return True

    def after_update(self, mon: SessionView) -> None:
        if self.active and not self.st.skipped and self.st.step_anomaly is None:
            # checked on the device now, read with the next transfer (no extra sync). Skipped when this
            # step's gradients were already flagged: non-finite weights are then their consequence.
            # Under DDP each rank probes its share (the parameters are the same on every rank).
            if not due(mon):  # off the schedule: judged by the next step's numbers (ledger.py)
                self.ledger.unprobed(mon.global_step, mon.params)
            else:
                self.ledger.probed()
                coord = mon.coordinator
                share = coord.param_share(mon) if coord is not None else None
                self.deferred["param_norms"] = self._param_probe(mon, share)
                self.deferred_index = share
                self.deferred_step = mon.global_step
                self.deferred_clean = True  # judged clean before it ran: what it made is its own
        self.st.seen = SeenGrads()  # the references are not needed after the update

    def _param_probe(self, mon: SessionView, share: list[int] | None = None) -> torch.Tensor:
        """A finiteness probe of the parameters (``share``: of those only), on the device, no host sync.

        Every parameter: one float32, the sum of every element (the session's cached plan: a few torch
        calls for the whole list; per-tensor sums would cost a ``segment_reduce``, a scalar loop, as
        much again on the CPU); a non-finite total has the parameters checked exactly (rare path). A
        share, or a list the plan does not cover: one float32 per tensor."""
        if share is None:
            plan, _ = mon.transfer.plan(mon.params)
            if plan is not None:
                with contextlib.suppress(RuntimeError, ValueError):
                    total: torch.Tensor = plan.total(mon.params)
                    return total
            return finite_probe(mon.params)
        return finite_probe([mon.params[i] for i in share])

    def scaler_step_started(self, mon: SessionView, scaler: Any) -> None:
        scale = getattr(scaler, "_scale", None)
        if isinstance(scale, torch.Tensor):
            mon.transfer.scale_used = scale.detach().clone()  # the scale backward saw (update() comes later)
        self.st.scaler_ran = True
        self.st.opt_ran_in_scaler = False

    def scaler_step_done(self, mon: SessionView, scaler: Any, failed: bool = False) -> bool:
        """``GradScaler.step`` returned. True when it skipped the update and the step is to be judged
        now, while the (unscaled) gradients are still there (users zero them before ``mon.step()``)."""
        if failed or self.st.opt_ran_in_scaler:
            return False
        self.st.scaler_skipped = True
        return self.active and not self.replaying

    def scaler_unscaled(self, opt: Any) -> bool:
        """True once the GradScaler unscaled this step's gradients (``unscale_`` bumps no ``_version``)."""
        sc = self.mon.scaler
        if sc is None or not getattr(sc, "is_enabled", lambda: True)():
            return False
        if self.st.scaler_ran:
            return True  # scaler.step() unscales before it calls the optimizer or skips it
        states = getattr(sc, "_per_optimizer_states", {})
        for o in (opt, self.mon.optimizer):
            st = states.get(id(o)) if o is not None else None  # .get: the defaultdict must not grow
            if st and int(getattr(st.get("stage"), "value", 0)) != 0:  # OptState.READY = 0
                return True
        return False

    # -- step end ------------------------------------------------------------------------------------
    def manual_update(self, mon: SessionView) -> bool:
        """True when this step's update ran without an optimizer the session saw (an update by hand)."""
        return self.active and not self.st.opt_ran and mon.optimizer is None and not mon.adopted

    def before_step_end(self, mon: SessionView, manual: bool) -> bool:
        """Step end. True when the step is still to be read and judged (the update did not do it)."""
        if manual and self.st.step_anomaly is None:
            # no optimizer hook: the user's update already ran; check the parameters on the device, read
            # with this transfer, or the next one when this step's already ran (at the end of backward())
            self.deferred["param_norms"] = self._param_probe(mon)
            self.deferred_index = None
            self.deferred_step = mon.global_step
            self.deferred_clean = False  # an update by hand, not judged before it ran
            if self.st.synced_at_backward:
                # checked at the end of backward(): an edit after it (clipping, normalisation) is seen
                # here, read with the next transfer, so a NaN it made is not blamed on the update
                self.probe_edits()
                if self.st.edit_probe is not None:
                    self.deferred["edit"] = self.st.edit_probe
                    self.deferred_edit_index = list(self.st.edit_index)
                    self.st.edit_probe = None
        return self.wants_read()

    def after_step_end(self, mon: SessionView, manual: bool) -> None:
        if manual and mon.driver is None and not self.st.scaler_ran and mon.transfer.micro_bad:
            self.manual = True  # from the next step on, the check runs at the end of backward()

    def final_check(self, mon: SessionView) -> bool:
        """Session exit: True when the last update's parameter probe is still to be read."""
        if self.deferred_index is not None and "param_norms" in self.deferred:
            # a DDP rank's share travels with the next step's all-reduce, and there is none: probe all
            self.deferred["param_norms"] = finite_probe(mon.params)
            self.deferred_index = None
        elif "param_norms" not in self.deferred and self.ledger.step is not None:
            # the last update was not probed (off the schedule): probe it now, once
            self.deferred_step = self.ledger.step
            self.ledger.probed()
            self.deferred["param_norms"] = self._param_probe(mon)
            self.deferred_index = None
            self.deferred_clean = True
        return bool(self.deferred)

    def check_at_start(self, when: str = "when the session started") -> Verdict:
        """Session start, and each ``load_state_dict`` into the model during it: parameters already
        non-finite (a NaN checkpoint) are an anomaly now, before the model is evaluated or saved
        (:mod:`.startup`). One probe and read each time; said once per session. Not with FSDP2 shards:
        a rank sees only its own, and one rank raising alone would leave the others waiting in the next
        collective; the first step's check, which every rank agrees on, says it."""
        if not self.active or self.loaded_bad or self._sharded:
            return OK
        try:
            anomaly = loaded_anomaly(self.mon, when)
        except Exception:  # a check that cannot run (odd tensor types) must not stop the session
            return OK
        if anomaly is None:
            return OK
        self.loaded_bad = True
        return Verdict("anomaly", anomaly, late=True)  # nothing to skip: no update is running

    # -- the transfer ---------------------------------------------------------------------------------
    def items(self) -> list[tuple[str, torch.Tensor]]:
        """The sentinel's device numbers for the step's transfer."""
        items = [("_edit", self.st.edit_probe)] if self.st.edit_probe is not None else []
        items += [("_clip", flag) for flag, _, _ in self.st.clips]
        return items + [(f"_def_{k}", v) for k, v in self.deferred.items()]

    def read_deferred(self, readout: Readout) -> Verdict:
        """After the read: the verdict on the last update, from its parameter probe."""
        mon = self.mon
        if "param_norms" not in self.deferred:
            return self.judge_unprobed()
        sizes = {k: t.numel() for k, t in self.deferred.items()}  # the keys the read gave: no scan of v
        pn = item_numbers(readout.param_probe, sizes["param_norms"])
        coord = mon.coordinator
        flagged = coord.params_flagged(mon) if coord is not None else None
        if flagged is None:  # this rank's own probe
            suspects = []
            if not all(map(math.isfinite, pn)):  # C loop: the usual answer
                index = self.deferred_index
                if index is None:
                    index = list(range(len(mon.params)))
                suspects = (
                    [index[j] for j, x in enumerate(pn) if not math.isfinite(x) and j < len(index)]
                    if len(pn) == len(index)
                    else index  # the whole list's total: every parameter is checked exactly
                )
        else:  # several ranks: any rank's probe (of its share under DDP) flags every parameter
            suspects = list(range(len(mon.params))) if flagged else []
        bad = [
            mon.param_names[i]
            for i in suspects
            if i < len(mon.params)
            and not bool(
                torch.isfinite(stored_values(local(mon.params[i].detach()))).all()
            )  # exact: rare path
        ]
        ranks = (
            coord.params_agree(bool(bad)) if coord is not None and flagged else []
        )  # the same decision on every rank
        step, clean = self.deferred_step, self.deferred_clean
        de = item_numbers(readout.late_edit, sizes["edit"]) if "edit" in sizes else []
        edited, self.deferred_edit_index = self.deferred_edit_index, []
        self.deferred.clear()
        self.deferred_index = None
        readout.param_probe, readout.late_edit = [], []
        self.st.params_bad_now = bool(bad)
        # (probe values, not confirmed: the gradients are gone by now; they only choose the phase)
        edit_bad = [i for j, i in enumerate(edited) if j < len(de) and not math.isfinite(de[j])]
        if bad and edit_bad:
            # a manual update used gradients that an edit after backward() made non-finite
            self.st.edit_bad = edit_bad
            nan = any(math.isnan(x) for x in de)
            anomaly = replay.gradient_edit_anomaly(mon, None, kind="nan" if nan else "inf")
            self.st.edit_bad = []
            return Verdict("anomaly", dataclasses.replace(anomaly, step=step), late=True)
        if (bad or ranks) and (clean or not (step == mon.global_step and self.grads_bad())):
            # blamed on the update only when the gradients it used were finite; else they are the cause
            # (an update judged clean before it ran: gradients after it, in the same step, are not)
            anomaly = replay.optimizer_anomaly(mon, bad, step, ranks, since=self.ledger.window)
            return Verdict("anomaly", anomaly, late=True)
        return OK

    def judge_unprobed(self) -> Verdict:
        """After the read, when the last update was not probed and this step read a non-finite loss or
        gradient: the parameters checked exactly (rare path); non-finite ones nothing wrote to since
        that update are its doing."""
        led, mon = self.ledger, self.mon
        step, t = led.step, mon.transfer
        # (an update earlier in this step counts too: several models or optimizers read before each)
        if step is None or not (t.any_loss_bad() or t.micro_flagged()):
            return OK  # the usual answer: the step's numbers are finite
        led.step = None
        bad = nonfinite_params(mon.param_names, mon.params)
        if not bad or led.written_since(mon.params):
            return OK
        self.st.params_bad_now = True
        return Verdict("anomaly", replay.optimizer_anomaly(mon, bad, step), late=True)

    # -- detection ------------------------------------------------------------------------------------
    def grad_finite(self, i: int, now: bool = False) -> bool:
        """Exact finiteness of parameter i's gradient (a host read: only when the probe flagged it).

        The tensor backward() left (kept: users may set ``.grad`` to None before ``mon.step()``), or with
        ``now`` the gradient as it is.
        """
        if self.grads_gone:
            return False  # judged one step later (sync="async"): the probe's verdict stands
        seen = None if now else self.st.seen.get(i)
        g = stored_values(local(seen if seen is not None else self.mon.params[i].grad))  # sparse: values
        return g is None or bool(torch.isfinite(g).all())

    def grads_bad(self) -> bool:
        """This rank's verdict after the read: a non-finite loss or gradient (confirmed)."""
        t = self.mon.transfer
        return t.any_loss_bad() or t.micro_flagged() or bool(self.st.edit_bad)

    def scaler_cannot_fix(self) -> str | None:
        """Why a GradScaler overflow step is an anomaly rather than an ordinary skipped step, or None.

        Ordinary: the loss is finite and the scale is at least ``config.scale_floor`` (1.0): the scaler
        halves the scale and the step is retried with the next batch. An anomaly: a non-finite loss (no
        scale can fix it), or an overflow at a scale below the floor (the scale collapsed: even
        unscaled, the fp16 backward overflows).
        """
        mon = self.mon
        if mon.transfer.any_loss_bad():
            return "non-finite loss under the GradScaler"
        scale = mon.transfer.readout.scale
        floor = float(getattr(mon.config, "scale_floor", 1.0))
        if scale is not None and scale < floor:
            return f"the gradients overflow at loss scale {scale:g} (below {floor:g}): the scale collapsed"
        return None

    def scaler_will_skip(self, opt: Any) -> bool:
        """True when ``scaler.unscale_(opt)`` already found Inf/NaN (``scaler.step`` will skip the update).

        Reads the scaler's flag from the device: called only on the rare path where gradients are bad.
        """
        sc = self.mon.scaler
        if sc is None or opt is None or not getattr(sc, "is_enabled", lambda: True)():
            return False
        st = getattr(sc, "_per_optimizer_states", {}).get(id(opt))
        found = st.get("found_inf_per_device") if st else None
        return found is not None and any(float(v) > 0 for v in found.values())

    def judge(self, *, at_optimizer: bool, opt: Any = None) -> Verdict:
        """The step's verdict after its read (``at_optimizer``: as ``opt``'s update is about to run).
        The session applies it (records, the policy); building an anomaly replays the step (rare)."""
        mon = self.mon
        st = self.st
        coord = mon.coordinator
        bad = self.grads_bad() if coord is None else coord.step_bad(mon)  # the same on every rank
        if st.step_anomaly is not None:
            # flagged at the end of backward(), before an optimizer turned up: policy "skip" drops its
            # gradients now
            drop = opt if at_optimizer and st.grad_anomaly else None
            return Verdict("anomaly", st.step_anomaly, opt=drop, fresh=False)
        if not bad or (st.skipped and not at_optimizer):
            return OK
        scaler_skip = (st.scaler_ran and st.scaler_skipped) or (
            at_optimizer and mon.driver is not None and self.scaler_will_skip(opt)
        )
        if scaler_skip and self.scaler_cannot_fix() is None:
            # at the update: a driver announced it after scaler.unscale_() found Inf/NaN (scaler.step()
            # skips it); at the step end: the scaler skipped it
            return Verdict("skip", reason=SCALER_SKIP, by_scaler=True)
        if (
            not at_optimizer
            and not scaler_skip
            and (mon.optimizer is not None or mon.adopted)
            and not st.synced_at_backward
        ):
            return Verdict("skip", reason="non-finite gradients and the optimizer step was not called")
        late = not at_optimizer and not scaler_skip and not st.synced_at_backward
        anomaly = self.build_anomaly(late=late) if coord is None else coord.anomaly(mon)
        st.grad_anomaly = True
        return Verdict("anomaly", anomaly, by_scaler=scaler_skip, opt=opt if at_optimizer else None)

    def build_anomaly(self, late: bool = False) -> Anomaly:
        """This step's anomaly, replayed to its origin (the rare path, :mod:`.replay`)."""
        return replay.step_anomaly(self.mon, self, late=late)


def _store_grad(cap_ref: Any, i: int, grad: torch.Tensor) -> None:
    cap = cap_ref()
    if cap is not None:
        cap.out_grads[i] = grad

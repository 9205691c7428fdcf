"""The NaN/Inf sentinel: the session's first instrument, the only one that decides a step (its per-step path).

At each boundary of the step protocol the session's step (``session/step.py``) calls the sentinel
before the other instruments and hands it the step's :class:`~torchdebug._step.StepState`; the
sentinel is built from the parameters, their names and the config and holds no session:

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

The sentinel never calls back into the session, nor the coordinator for a verdict (the step asks it to
``agree`` after the read and hands the answer in ``Readout.agreed``). When the verdict is bad, the failing micro-step is
replayed under op-level tracing (:mod:`torchdebug.nonfinite.replay`, the rare path: twice, so a
fault that does not come back is reported as not reproducible) to name the phase, module, op and
source line: :meth:`Sentinel.judge` returns a new anomaly unbuilt (``Verdict.replay``) and the step
builds it; with several ranks through the distributed coordinator, which makes every rank take the
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

from .._config import DebugConfig
from .._step import (
    NO_GRADS,
    OK,
    SCALER_RAN,
    SCALER_SKIP,
    Found,
    Readout,
    SeenGrads,
    SessionView,
    StepPhase,
    StepState,
    TransferView,
    Update,
    Verdict,
)
from .._tensors import dtensor_type, finite_probe, local, stored_values
from .._trees import tensor_leaves
from ..events import Anomaly
from . import replay
from .buffers import WrittenBuffers
from .cause import ReplicaCheck
from .edits import EditCheck, item_numbers, lift_mode
from .ledger import UpdateLedger, nonfinite_params
from .locate import FORWARD, FORWARD_NO_GRAD, LossTape, StepCapture
from .startup import loaded_anomaly
from .stepfn import CompiledStep

_MAX_CAPTURES = 64  # micro-steps kept per step for replay (references only)
_MAX_TAPE = 64  # torch calls and model forwards recorded per micro-step (as the loss tape's limit)
_MAX_OUT_HOOKS = 16


class Sentinel:
    """The NaN/Inf sentinel of one session (see the module docstring); ``active`` follows the level."""

    name = "nonfinite"

    def __init__(self, params: list[torch.Tensor], names: list[str], config: DebugConfig) -> None:
        self.config = config
        self.thread = threading.current_thread()  # the training thread (the session's, set as it enters)
        # who holds the step now running (the session's Step): read only by the accessors below, for
        # readers outside the step's path (tests, the seed facades); the path hands the state in
        self.holder: Any = None
        self.active = False
        self.replaying = False
        # several ranks: the distributed coordinator's replay of a step on another rank (whose fault:
        # a rank's hardware), asked when every replay on this rank came out finite
        self.replica: ReplicaCheck | None = None
        self.step_fn: CompiledStep | None = None  # watch(step_fn=...): the compiled step function's calls
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
        self.edits = EditCheck()  # what changed the gradients between backward() and the update
        self.buffers = WrittenBuffers()  # the buffers the forward writes: kept as each step began, probed
        self.reindex(params, names)

    def reindex(self, params: list[torch.Tensor], names: list[str]) -> None:
        """The session's parameters and their names (again, when ``torchdebug run`` added a model before
        the first step)."""
        self.params, self.param_names = params, names
        self._index = {id(p): i for i, p in enumerate(params)}
        # FSDP2 DTensor parameters: the clip's fast path (whole local tensors) does not apply
        dtensor = dtensor_type()
        self._sharded = dtensor is not None and any(isinstance(p, dtensor) for p in params)
        self.edits.reindex(params, self._index, self._sharded)

    @property
    def watch_off(self) -> bool:
        """The edit check stopped watching the calls (a watch saw too many): it reads versions."""
        return self.edits.watch_off

    def watches_edits(self) -> bool:
        """After this backward, watch the torch calls until the update (``EditCheck.watches_edits``),
        unless the sentinel is off, replaying, or checks each backward on its own."""
        return (
            self.active
            and not (self.replaying or self.manual or self.check_each_backward)
            and self.edits.watches_edits()
        )

    def before_clip(self, st: StepState, params: list[Any]) -> list[int]:
        """``clip_grad_norm_`` is about to scale these gradients: those its factor alone can judge."""
        if not self.active or self.replaying:
            return []
        return self.edits.before_clip(st, params)

    def read_edits(self, st: StepState, readout: Readout) -> None:
        """After the read: which edited gradients are non-finite (confirmed exactly)."""
        bad = self.edits.read_edits(st, readout)
        if bad:
            st.edit_bad = [i for i in sorted(bad) if not self.grad_finite(st, i, now=True)]

    # what a step's verdict left, as the step now running has it (read by tests and the seed facades)
    @property
    def step_anomaly(self) -> Anomaly | None:
        return self.holder.state.step_anomaly  # type: ignore[no-any-return]

    @property
    def skipped(self) -> bool:
        return bool(self.holder.state.skip_reason)

    @property
    def skip_reason(self) -> str:
        return self.holder.state.skip_reason  # type: ignore[no-any-return]

    @property
    def captures(self) -> list[StepCapture]:
        return self.holder.state.captures  # type: ignore[no-any-return]

    @property
    def edit_index(self) -> list[int]:
        return self.holder.state.edit_index  # type: ignore[no-any-return]

    def remove(self, st: StepState) -> None:
        self.pop_tape(force=True)
        self.edits.watch_edits_end(st, judge=False)

    # -- forward -------------------------------------------------------------------------------------
    def on_forward_start(
        self, st: StepState, mon: SessionView, module: nn.Module, args: tuple, kwargs: dict
    ) -> None:
        """The first forward of a micro-step: keep what its replay needs (references, no copies)."""
        cont = (
            st.cap is not None
            and st.captures
            and st.cap is st.captures[-1]
            and (len(st.captures) - 1) in st.tape_only
        )
        if (
            cont and st.cap.tape
        ):  # several models: loss code ran since the last backward, this forward is part of it
            self.later_forward(st, module, args, kwargs)
            return
        if cont:  # nothing ran since the last backward: this forward begins the micro-step
            st.tape_only.discard(len(st.captures) - 1)
            st.captures.pop()
        if not (st.captures or self.buffers.idle) and self.active and self.config.replay:
            # the step's first forward: the buffers it writes kept (not when judged a step late, or by
            # one rank alone: buffers.py)
            self.buffers.begin_step(mon.model, late=mon.reads_late or mon.coordinator is not None)
        if self.active and self.config.replay and len(st.captures) < _MAX_CAPTURES:
            st.cap = StepCapture.take(args, kwargs, mon.uses_cuda)
            if module is not mon.model:
                st.cap.module = module  # a driver hooked the submodule the training step calls
            st.cap.batch = mon.batch
            st.captures.append(st.cap)
        else:
            st.cap = None

    # -- several models: every watched model's forward in the step is recorded, in order -----------------
    def later_forward(
        self, st: StepState, module: nn.Module, args: tuple, kwargs: dict, grad: bool = True
    ) -> None:
        """Another watched model's forward inside the micro-step: an entry on its tape (replayed in order)."""
        cap = st.cap
        self.pop_tape()
        if cap is None or not cap.tape_complete or len(cap.tape) >= _MAX_TAPE:
            st.entry = -1  # not recorded: the replay starts from what it has
            if cap is not None and cap.tape_complete:
                cap.tape_complete = False
                cap.untaped = f"the micro-step made more than {_MAX_TAPE} torch calls and forwards"
            return
        st.entry = len(cap.tape)
        cap.tape.append((module, FORWARD if grad else FORWARD_NO_GRAD, args, kwargs, (), None))

    def no_grad_forward(
        self, st: StepState, mon: SessionView, module: nn.Module, args: tuple, kwargs: dict
    ) -> None:
        """A watched model's forward under ``no_grad`` (a frozen teacher, a target network) in the step:
        an entry of the micro-step's tape. Before the micro-step's first forward, a frozen model's
        forward begins the micro-step's capture (a trainable model's, an evaluation, is not recorded)."""
        if not (self.active and self.config.replay):
            return
        cont = (
            st.cap is not None
            and st.captures
            and st.cap is st.captures[-1]
            and (len(st.captures) - 1) in st.tape_only
        )
        if st.phase is not StepPhase.FORWARD and not cont:
            if any(p.requires_grad for p in module.parameters()):
                return
            self.after_backward(st, mon)  # a capture of the loss code from here on, this forward first
        if st.cap is not None:
            self.later_forward(st, module, args, kwargs, grad=False)

    def forward_entry_done(self, st: StepState, output: Any) -> bool:
        """A recorded later forward returned: keep its output; True when it was one (not the first)."""
        i, st.entry = st.entry, None
        if i is None:
            return False
        cap = st.cap
        if i >= 0 and cap is not None and i < len(cap.tape):
            cap.tape[i] = (*cap.tape[i][:5], output)
        if cap is not None and cap.tape_complete:
            self.open_tape(cap)
        return True

    def after_backward(self, st: StepState, mon: SessionView) -> None:
        """Several models: the loss code after a backward (an actor-critic's second loss) is recorded too,
        on a capture of its own that the next forward takes over when nothing ran before it."""
        if (
            not (self.active and self.config.replay and self.config.trace_loss)
            or len(st.captures) >= _MAX_CAPTURES
        ):
            return
        st.cap = StepCapture.take((), {}, mon.uses_cuda)
        st.cap.grad_enabled = True  # a backward ends the micro-step (a frozen model's no_grad is its own)
        st.cap.batch = mon.batch
        st.captures.append(st.cap)
        st.tape_only.add(len(st.captures) - 1)
        self.open_tape(st.cap)

    def open_tape(self, cap: StepCapture) -> None:
        if not self.config.trace_loss:
            cap.untaped = "trace_loss is off (config.trace_loss=False)"
        elif threading.current_thread() is not self.thread:
            cap.untaped = "the forward ran in another thread than the loop (its loss code is not recorded)"
        else:
            cap.tape_complete = True
            self.tape = LossTape(cap)
            self.tape.__enter__()

    def on_forward_end(self, st: StepState, output: Any) -> None:
        cap = st.cap
        if cap is None:
            return
        cap.outputs = output
        n = 0
        for i, t in enumerate([output] if isinstance(output, torch.Tensor) else tensor_leaves(output)):
            if t.requires_grad and n < _MAX_OUT_HOOKS:
                n += 1
                t.register_hook(functools.partial(_store_grad, weakref.ref(cap), i))
        # A function mode lives on its thread's stack: opened in a worker thread's forward it would miss
        # the loss code (run here) and outlive the session there. Without a tape the replay starts from
        # the gradient captured at the outputs.
        self.open_tape(cap)

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
    def on_backward_start(self, st: StepState, loss: Any, gradient: Any) -> None:
        cap = st.cap
        if cap is not None and isinstance(loss, torch.Tensor):
            cap.loss = loss
            cap.loss_grad = gradient if isinstance(gradient, torch.Tensor) else None

    def saw_gradients(
        self,
        st: StepState,
        idx: list[int],
        grads: list[torch.Tensor],
        versions: list[int] | None = None,
        watched: bool = False,
    ) -> None:
        """The gradient tensors backward() left and their versions (one C-level pass over the list,
        none when the caller read ``versions`` already, or ``watched``: none, edits.EditWatch)."""
        if self.active:
            if self.edits.watch is not None:  # a watch still open belongs to the last backward's gradients
                self.edits.watch_edits_end(st, judge=False)
            st.seen = SeenGrads(idx, grads, len(self.params), versions, watched, self._index)

    def judges_at_backward_end(self, driver: str | None) -> bool:
        """True when the step must be read and judged now, as a backward ends: no optimizer hook will
        run before the user's update (an update by hand), or every backward is checked."""
        return (
            (self.manual or self.check_each_backward)
            and self.active
            and driver is None
            and not self.replaying
        )

    # -- update --------------------------------------------------------------------------------------
    def update_not_skipped(self, st: StepState) -> None:
        """Inside GradScaler.step the optimizer was called: the scaler did not skip its update."""
        if st.update is Update.IN_SCALER:
            st.update = Update.RAN_IN_SCALER

    def before_update(self, st: StepState, opt: Any, scaler: Any, several: bool, first: Any = None) -> bool:
        """Update starting: the gradients are final. True when the session must read the step now
        (then :meth:`judge` gives the verdict; a second optimizer in the same step reuses the read)."""
        st.update = Update.RAN_IN_SCALER if st.update in SCALER_RAN else Update.RAN
        self.manual = False
        if st.read_at is StepPhase.BACKWARD:  # an optimizer after all: judge the gradients as it sees them
            st.transfer.synced, st.read_at = False, None
        if not self.active or (st.transfer.synced and not (several and st.transfer.unread())):
            return False  # (``wants_read``, inlined: every update)
        self.edits.probe_edits(st, opt, scaler, first)
        return True

    def wants_read(
        self, st: StepState, opt: Any = None, scaler: Any = None, several: bool = False, first: Any = None
    ) -> bool:
        """True when the step's numbers are still to be read before a verdict; then the gradients
        changed since backward() (clipping, normalisation, unscaling) are probed first (device work).
        ``several``: several models or optimizers, each update checked before it runs; ``first``: the
        session's first optimizer (whose ``scaler.unscale_`` counts when ``opt`` is not named)."""
        if not self.active:
            return False
        # read already: no read; with several models or optimizers each update is checked before it
        # runs: read again when a backward came since
        if st.transfer.synced and not (several and st.transfer.unread()):
            return False
        self.edits.probe_edits(st, opt, scaler, first)
        return True

    def after_update(self, st: StepState, mon: SessionView, due: bool, share: list[int] | None) -> None:
        """The update ran: its parameters probed on the device (``due``: on the schedule; ``share``:
        this rank's share of them under DDP), read with the next transfer (no extra sync)."""
        step = mon.global_step
        if self.active and not st.skip_reason and st.step_anomaly is None:
            # Skipped when this step's gradients were already flagged: non-finite weights are then their
            # consequence. Under DDP each rank probes its share (the parameters are the same on every rank).
            if not due:  # off the schedule: judged by the next step's numbers (ledger.py)
                self.ledger.unprobed(step, self.params)
            else:
                self.ledger.probed()
                self.deferred["param_norms"] = self._param_probe(mon, share)
                self.deferred_index = share
                self.deferred_step = step
                self.deferred_clean = True  # judged clean before it ran: what it made is its own
        st.seen = NO_GRADS  # the references are not needed after the update

    def _param_probe(self, mon: SessionView, share: list[int] | None = None) -> torch.Tensor:
        """A finiteness probe of the parameters (``share``: of those only), on the device, no host sync.

        Every parameter: one float32, the sum of every element (the session's cached plan: a few torch
        calls for the whole list; per-tensor sums would cost a ``segment_reduce``, a scalar loop, as
        much again on the CPU); a non-finite total has the parameters checked exactly (rare path). A
        share, or a list the plan does not cover: one float32 per tensor."""
        params = self.params
        if share is None:
            plan, _ = mon.transfer.plan(params)
            if plan is not None:
                with contextlib.suppress(RuntimeError, ValueError):
                    total: torch.Tensor = plan.total(params)
                    return total
            return finite_probe(params)
        return finite_probe([params[i] for i in share])

    def scaler_step_started(self, st: StepState, scaler: Any) -> None:
        scale = getattr(scaler, "_scale", None)
        if isinstance(scale, torch.Tensor):
            st.transfer.scale_used = scale.detach().clone()  # the scale backward saw (update() comes later)
        st.update = Update.IN_SCALER

    def scaler_step_done(self, st: StepState, failed: bool = False) -> bool:
        """``GradScaler.step`` returned. True when it skipped the update and the step is to be judged
        now, while the (unscaled) gradients are still there (users zero them before ``mon.step()``)."""
        if failed or st.update is not Update.IN_SCALER:
            return False
        st.update = Update.SCALER_SKIPPED
        return self.active and not self.replaying

    # -- step end ------------------------------------------------------------------------------------
    def manual_update(self, st: StepState, has_optimizer: bool) -> bool:
        """True when this step's update ran without an optimizer the session saw (an update by hand;
        ``has_optimizer``: the session was given one or adopted one)."""
        return self.active and st.update is Update.NONE and not has_optimizer

    def before_step_end(
        self, st: StepState, mon: SessionView, manual: bool, scaler: Any, several: bool, first: Any = None
    ) -> bool:
        """Step end. True when the step is still to be read and judged (the update did not do it)."""
        if manual and st.step_anomaly is None:
            # no optimizer hook: the user's update already ran; check the parameters on the device, read
            # with this transfer, or the next one when this step's already ran (at the end of backward())
            self.deferred["param_norms"] = self._param_probe(mon)
            self.deferred_index = None
            self.deferred_step = mon.global_step
            self.deferred_clean = False  # an update by hand, not judged before it ran
            if st.read_at is StepPhase.BACKWARD:
                # checked at the end of backward(): an edit after it (clipping, normalisation) is seen
                # here, read with the next transfer, so a NaN it made is not blamed on the update
                self.edits.probe_edits(st, None, scaler, first)
                if st.edit_probe is not None:
                    self.deferred["edit"] = st.edit_probe
                    self.deferred_edit_index = list(st.edit_index)
                    st.edit_probe = None
        return self.wants_read(st, None, scaler, several, first)

    def after_step_end(self, st: StepState, manual: bool, driver: str | None) -> None:
        if manual and driver is None and st.update not in SCALER_RAN and st.transfer.micro_bad:
            self.manual = True  # from the next step on, the check runs at the end of backward()

    def final_check(self, mon: SessionView) -> bool:
        """Session exit: True when the last update's parameter probe is still to be read."""
        if self.deferred_index is not None and "param_norms" in self.deferred:
            # a DDP rank's share travels with the next step's all-reduce, and there is none: probe all
            self.deferred["param_norms"] = finite_probe(self.params)
            self.deferred_index = None
        elif "param_norms" not in self.deferred and self.ledger.step is not None:
            # the last update was not probed (off the schedule): probe it now, once
            self.deferred_step = self.ledger.step
            self.ledger.probed()
            self.deferred["param_norms"] = self._param_probe(mon)
            self.deferred_index = None
            self.deferred_clean = True
        return bool(self.deferred)

    def check_at_start(self, mon: SessionView, when: str = "when the session started") -> Verdict:
        """Session start, and each ``load_state_dict`` into the model during it: parameters already
        non-finite (a NaN checkpoint) are an anomaly now, before the model is evaluated or saved
        (:mod:`.startup`). One probe and read each time; said once per session. Not with FSDP2 shards:
        a rank sees only its own, and one rank raising alone would leave the others waiting in the next
        collective; the first step's check, which every rank agrees on, says it."""
        if not self.active or self.loaded_bad or self._sharded:
            return OK
        try:
            anomaly = loaded_anomaly(mon, when)
        except Exception:  # a check that cannot run (odd tensor types) must not stop the session
            return OK
        if anomaly is None:
            return OK
        self.loaded_bad = True
        return Verdict("anomaly", anomaly, late=True)  # nothing to skip: no update is running

    # -- the transfer ---------------------------------------------------------------------------------
    def items(self, st: StepState) -> list[tuple[str, torch.Tensor]]:
        """The sentinel's device numbers for the step's transfer."""
        items = [("_edit", st.edit_probe)] if st.edit_probe is not None else []
        items += [("_clip", flag) for flag, _, _ in st.clips]
        if self.buffers.fresh and (probe := self.buffers.probe()) is not None:
            items.append(("_buffers", probe))
        return items + [(f"_def_{k}", v) for k, v in self.deferred.items()]

    def judge_buffers(self, st: StepState, mon: SessionView, value: float | None) -> Verdict:
        """After the read: a buffer the forward writes went non-finite (``value``: the probe) in a step
        whose loss and gradients are finite (else the step's own verdict replays it): an anomaly."""
        bad = self.buffers.judge(value)
        if not bad or _read_bad(st.transfer):
            return OK  # the usual answer
        return Verdict("anomaly", replay.buffer_anomaly(mon, self, bad), late=True)

    def read_deferred(
        self, st: StepState, readout: Readout, mon: SessionView, flagged: bool | None
    ) -> Verdict:
        """After the read: the verdict on the last update, from its parameter probe (``flagged``:
        several ranks, any rank's probe was non-finite; None: this rank's own probe decides). ``mon``
        is for the rare path only (the anomaly of a bad update)."""
        if "param_norms" not in self.deferred:
            if self.ledger.step is None or not _read_bad(st.transfer):
                return OK  # the usual answer: nothing unprobed, or the step's numbers are finite
            return self.judge_unprobed(st, mon)
        sizes = {k: t.numel() for k, t in self.deferred.items()}  # the keys the read gave: no scan of v
        pn = item_numbers(readout.param_probe, sizes["param_norms"])
        params = self.params
        if flagged is None:  # this rank's own probe
            suspects = []
            if not all(map(math.isfinite, pn)):  # C loop: the usual answer
                index = self.deferred_index
                if index is None:
                    index = list(range(len(params)))
                suspects = (
                    [index[j] for j, x in enumerate(pn) if not math.isfinite(x) and j < len(index)]
                    if len(pn) == len(index)
                    else index  # the whole list's total: every parameter is checked exactly
                )
        else:  # several ranks: any rank's probe (of its share under DDP) flags every parameter
            suspects = list(range(len(params))) if flagged else []
        bad = [
            self.param_names[i]
            for i in suspects
            if i < len(params)
            and not bool(torch.isfinite(stored_values(local(params[i].detach()))).all())  # exact: rare
        ]
        coord = mon.coordinator
        ranks = (
            coord.params_agree(bool(bad)) if coord is not None and flagged else []
        )  # the same decision on every rank
        step, clean = self.deferred_step, self.deferred_clean
        de = item_numbers(readout.late_edit, sizes["edit"]) if "edit" in sizes else []
        edited, self.deferred_edit_index = self.deferred_edit_index, []
        self.deferred.clear()
        self.deferred_index = None
        readout.param_probe, readout.late_edit = [], []
        if bad:
            st.params = Found.PARAMETERS
        # (probe values, not confirmed: the gradients are gone by now; they only choose the phase)
        edit_bad = [i for j, i in enumerate(edited) if j < len(de) and not math.isfinite(de[j])]
        if bad and edit_bad:
            # a manual update used gradients that an edit after backward() made non-finite
            st.edit_bad = edit_bad
            nan = any(math.isnan(x) for x in de)
            anomaly = replay.gradient_edit_anomaly(mon, None, kind="nan" if nan else "inf")
            st.edit_bad = []
            return Verdict("anomaly", dataclasses.replace(anomaly, step=step), late=True)
        if (bad or ranks) and (clean or not (step == mon.global_step and self.grads_bad(st))):
            # blamed on the update only when the gradients it used were finite; else they are the cause
            # (an update judged clean before it ran: gradients after it, in the same step, are not)
            anomaly = replay.optimizer_anomaly(mon, bad, step, ranks, since=self.ledger.window)
            return Verdict("anomaly", anomaly, late=True)
        return OK

    def judge_unprobed(self, st: StepState, mon: SessionView) -> Verdict:
        """After the read, when the last update was not probed and this step read a non-finite loss or
        gradient: the parameters checked exactly (rare path); non-finite ones nothing wrote to since
        that update are its doing."""
        led, t = self.ledger, st.transfer
        step = led.step
        # (an update earlier in this step counts too: several models or optimizers read before each)
        if step is None or not _read_bad(t):
            return OK  # the usual answer: the step's numbers are finite
        led.step = None
        bad = nonfinite_params(self.param_names, self.params)
        if not bad or led.written_since(self.params):
            return OK
        st.params = Found.PARAMETERS
        return Verdict("anomaly", replay.optimizer_anomaly(mon, bad, step), late=True)

    # -- detection ------------------------------------------------------------------------------------
    def grad_finite(self, st: StepState, i: int, now: bool = False) -> bool:
        """Exact finiteness of parameter i's gradient (a host read: only when the probe flagged it).

        The tensor backward() left (kept: users may set ``.grad`` to None before ``mon.step()``), or with
        ``now`` the gradient as it is.
        """
        if self.grads_gone:
            return False  # judged one step later (sync="async"): the probe's verdict stands
        seen = None if now else st.seen.get(i)
        g = stored_values(local(seen if seen is not None else self.params[i].grad))  # sparse: its values
        return g is None or bool(torch.isfinite(g).all())

    def grads_bad(self, st: StepState) -> bool:
        """This rank's verdict after the read: a non-finite loss or gradient (confirmed)."""
        return _read_bad(st.transfer) or bool(st.edit_bad)

    def scaler_cannot_fix(self, st: StepState) -> str | None:
        """Why a GradScaler overflow step is an anomaly rather than an ordinary skipped step, or None.

        Ordinary: the loss is finite and the scale is at least ``config.scale_floor`` (1.0): the scaler
        halves the scale and the step is retried with the next batch. An anomaly: a non-finite loss (no
        scale can fix it), or an overflow at a scale below the floor (the scale collapsed: even
        unscaled, the fp16 backward overflows).
        """
        if st.transfer.any_loss_bad():
            return "non-finite loss under the GradScaler"
        scale = st.transfer.readout.scale
        floor = float(getattr(self.config, "scale_floor", 1.0))
        if scale is not None and scale < floor:
            return f"the gradients overflow at loss scale {scale:g} (below {floor:g}): the scale collapsed"
        return None

    @staticmethod
    def scaler_will_skip(opt: Any, scaler: Any) -> bool:
        """True when ``scaler.unscale_(opt)`` already found Inf/NaN (``scaler.step`` will skip the update).

        Reads the scaler's flag from the device: called only on the rare path where gradients are bad.
        """
        if scaler is None or opt is None or not getattr(scaler, "is_enabled", lambda: True)():
            return False
        ost = getattr(scaler, "_per_optimizer_states", {}).get(id(opt))
        found = ost.get("found_inf_per_device") if ost else None
        return found is not None and any(float(v) > 0 for v in found.values())

    def judge(
        self,
        st: StepState,
        readout: Readout,
        *,
        at_optimizer: bool,
        opt: Any = None,
        scaler: Any = None,
        driver: str | None = None,
        has_optimizer: bool = True,
    ) -> Verdict:
        """The step's verdict after its read (``at_optimizer``: as ``opt``'s update is about to run).

        ``readout.agreed``: the decision every rank took (the coordinator's, between the read and this
        verdict); None: this rank's own. The session applies the verdict (records, the policy). A new
        anomaly comes back unbuilt (``Verdict.replay``): the session replays the step to build it."""
        # this rank's own verdict (``grads_bad``), or the one every rank agreed on
        bad = (_read_bad(st.transfer) or bool(st.edit_bad)) if readout.agreed is None else readout.agreed
        if st.step_anomaly is not None:
            # flagged at the end of backward(), before an optimizer turned up: policy "skip" drops its
            # gradients now
            drop = opt if at_optimizer and st.found is Found.GRADIENTS else None
            return Verdict("anomaly", st.step_anomaly, opt=drop, fresh=False)
        if not bad or (st.skip_reason and not at_optimizer):
            return OK
        scaler_skip = st.update is Update.SCALER_SKIPPED or (
            at_optimizer and driver is not None and self.scaler_will_skip(opt, scaler)
        )
        if scaler_skip and self.scaler_cannot_fix(st) is None:
            # at the update: a driver announced it after scaler.unscale_() found Inf/NaN (scaler.step()
            # skips it); at the step end: the scaler skipped it
            return Verdict("skip", reason=SCALER_SKIP, by_scaler=True)
        at_backward = st.read_at is StepPhase.BACKWARD
        if not at_optimizer and not scaler_skip and has_optimizer and not at_backward:
            return Verdict("skip", reason="non-finite gradients and the optimizer step was not called")
        late = not at_optimizer and not scaler_skip and not at_backward
        st.found = Found.GRADIENTS
        return Verdict(
            "anomaly",
            None,
            by_scaler=scaler_skip,
            opt=opt if at_optimizer else None,
            replay="late" if late else "now",
        )

    def build_anomaly(self, mon: SessionView, late: bool = False) -> Anomaly:
        """This step's anomaly, replayed to its origin (the rare path, :mod:`.replay`)."""
        return replay.step_anomaly(mon, self, late=late)


def _read_bad(t: TransferView) -> bool:
    """The step's numbers as read: a non-finite loss (this rank's, or another's in the coordinator's
    exact round) or a micro-step's gradient flag the exact check did not clear (``any_loss_bad`` and
    ``micro_flagged`` of the transfer, in one call: every step)."""
    r = t.readout
    return (
        r.other_rank_loss_bad
        or not all(map(math.isfinite, r.losses))
        or (not t.micro_bad_cleared and any([x > 0 for x in r.micro_bad]))
    )


def _store_grad(cap_ref: Any, i: int, grad: torch.Tensor) -> None:
    cap = cap_ref()
    if cap is not None:
        cap.out_grads[i] = grad

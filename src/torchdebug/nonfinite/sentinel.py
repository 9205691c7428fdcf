"""The NaN/Inf sentinel: the session's first instrument, the only one that may stop or skip a step.

At each boundary of the step protocol the session calls the sentinel before the other instruments:

- forward began: keep a reference to the batch, the RNG and autocast state (:class:`StepCapture`), so
  the micro-step can be replayed; forward done: hooks that keep the output's gradients, the loss tape;
- backward done: remember which gradient tensors backward() left (a Python read, no device work);
- update starting: a finiteness probe of the gradients changed since (clipping, normalisation,
  unscaling), the step's one transfer (:class:`torchdebug.session.transfer.Transfer`), the verdict and
  the policy (``raise`` raises, ``skip`` drops the gradients so the update does nothing, ``warn``);
- update done: a finiteness probe of the parameters, read with the next step's transfer;
- step end: the same verdict when no update was seen (a manual update, GradScaler skipped it, ...).

When the verdict is bad, the failing micro-step is replayed under op-level tracing
(:func:`replay_capture`, twice: a fault that does not come back is reported as not reproducible) to
name the phase, module, op and source line; the anomaly is recorded and the policy applied. With
several ranks the session's distributed coordinator makes every rank take the same decision and
replays on the rank of birth only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import operator
import threading
import weakref
from typing import Any

import torch
from torch import nn

from .._errors import NonFiniteError, TorchDebugWarning
from .._frames import warn_at_user
from .._tensors import dtensor_type, finite_probe, grad_of, local, unwrap_optimizer, version_of
from .._trees import tensor_leaves
from ..events import Anomaly, Phase, RuleEvent
from .ledger import UpdateLedger, due, nonfinite_params, window_hint
from .locate import LossTape, StepCapture, replay_capture

_MAX_CAPTURES = 64  # micro-steps kept per step for replay (references only)
_MAX_OUT_HOOKS = 16
_MAX_ANOMALIES = 1000


class Sentinel:
    """The NaN/Inf sentinel of one session (see the module docstring); ``active`` follows the level."""

    name = "nonfinite"

    def __init__(self, mon: Any) -> None:
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
        self.ledger = UpdateLedger()  # updates not probed (off the detail schedule): see ledger.py
        self.skip_run: list[int] | None = None  # policy="skip": [first step, count] of the current run
        # sync="async" (session/deferred.py), while a step is judged one step later: its update already
        # ran or was skipped on the device (nothing to drop), and its gradients may be gone (no exact check)
        self.update_held = False
        self.grads_gone = False
        self._index = {id(p): i for i, p in enumerate(mon.params)}
        # FSDP2 DTensor parameters: the clip's fast path (whole local tensors) does not apply
        dtensor = dtensor_type()
        self._sharded = dtensor is not None and any(isinstance(p, dtensor) for p in mon.params)
        self.reset()

    def reset(self) -> None:
        """Per-step state (the session's step end)."""
        self.captures: list[StepCapture] = []
        self.cap: StepCapture | None = None
        # what backward() left, for the edit check as the update starts (see saw_gradients)
        self.seen = SeenGrads()
        self.edit_index: list[int] = []  # gradients changed since backward() measured them
        self.edit_probe: torch.Tensor | None = None
        self.edit_bad: list[int] = []  # ... and non-finite when the update started (confirmed exactly)
        # clip_grad_norm_ calls: (device flag "the clip factor is non-finite", the gradients it scaled, None),
        # or (its total norm, the gradients, max_norm): the factor is worked out after the read
        self.clips: list[tuple[torch.Tensor, list[int], float | None]] = []
        self.synced_at_backward = False  # manual mode: the transfer ran at the end of backward()
        self.grad_anomaly = False  # this step's anomaly came from the gradient check
        self.params_bad_now = False  # the parameter probe read with this step's transfer was non-finite
        self.opt_ran = False
        self.opt_ran_in_scaler = False
        self.scaler_ran = False
        self.scaler_skipped = False
        self.step_anomaly: Anomaly | None = None
        self.skipped = False
        self.skip_reason = ""

    def remove(self, mon: Any = None) -> None:
        self.pop_tape(force=True)

    # -- forward -------------------------------------------------------------------------------------
    def on_forward_start(self, mon: Any, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """The first forward of a micro-step: keep what its replay needs (references, no copies)."""
        if self.active and mon.config.replay and len(self.captures) < _MAX_CAPTURES:
            self.cap = StepCapture.take(args, kwargs, mon._uses_cuda)
            if module is not mon.model:
                self.cap.module = module  # a driver hooked the submodule the training step calls
            self.cap.batch = mon.batch
            self.captures.append(self.cap)
        else:
            self.cap = None

    def on_forward_end(self, mon: Any, module: nn.Module, output: Any) -> None:
        cap = self.cap
        if cap is None:
            return
        cap.outputs = output
        n = 0
        for i, t in enumerate(tensor_leaves(output)):
            if t.requires_grad and n < _MAX_OUT_HOOKS:
                n += 1
                t.register_hook(functools.partial(_store_grad, weakref.ref(cap), i))
        if mon.config.trace_loss and threading.current_thread() is mon.thread:
            # A function mode lives on its thread's stack: opened in a worker thread's forward it would
            # miss the loss code (run here) and outlive the session there. Without a tape the replay
            # starts from the gradient captured at the outputs.
            cap.tape_complete = True
            self.tape = LossTape(cap)
            self.tape.__enter__()

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
            _lift_mode(tape)  # the session ends: take it out from under the user's modes
            self.tape = None
        # else: another mode sits on top; the tape stays as a pass-through until it can be popped

    # -- backward ------------------------------------------------------------------------------------
    def on_backward_start(self, mon: Any, loss: Any, gradient: Any) -> None:
        cap = self.cap
        if cap is not None and isinstance(loss, torch.Tensor):
            cap.loss = loss
            cap.loss_grad = gradient if isinstance(gradient, torch.Tensor) else None

    def saw_gradients(self, idx: list[int], grads: list[torch.Tensor]) -> None:
        """The gradient tensors backward() left and their versions (one C-level pass over the list)."""
        if self.active:
            self.seen = SeenGrads(idx, grads, len(self.mon.params))

    def on_backward_end(self, mon: Any) -> None:
        if (
            (self.manual or self.check_each_backward)
            and self.active
            and mon.driver is None
            and not self.replaying
        ):
            # no optimizer hook will run before the user's update: check here, before it
            mon.sync()
            self.synced_at_backward = True
            self.check_gradients(at_optimizer=False)

    # -- update --------------------------------------------------------------------------------------
    def update_not_skipped(self) -> None:
        self.opt_ran_in_scaler = True  # inside GradScaler.step: the update was not skipped

    def before_update(self, mon: Any, opt: Any) -> None:
        """Update starting: the gradients are final. The step's transfer and the verdict (may raise)."""
        self.opt_ran = True
        self.opt_ran_in_scaler = True
        self.manual = False
        if self.synced_at_backward:  # an optimizer after all: judge the gradients as the update sees them
            mon.transfer.synced, self.synced_at_backward = False, False
        if self.active:
            if not mon.transfer.synced:  # a second optimizer in the same step reuses this step's transfer
                self.probe_edits(opt)  # clipping, normalisation, unscaling since backward()
                mon.sync()
            self.check_gradients(at_optimizer=True, opt=opt)

    def after_update(self, mon: Any) -> None:
        if self.active and not self.skipped and self.step_anomaly is None:
            # checked on the device now, read with the next transfer (no extra sync). Skipped when this
            # step's gradients were already flagged: non-finite weights are then their consequence.
            # Under DDP each rank probes its share (the parameters are the same on every rank).
            share = mon._coord.param_share(mon) if mon._coord is not None else None
            if not due(mon):  # off the schedule: judged by the next step's numbers (ledger.py)
                self.ledger.unprobed(mon.global_step, mon.params)
            else:
                self.ledger.probed()
                self.deferred["param_norms"] = self._param_probe(mon, share)
                self.deferred_index = share
                self.deferred_step = mon.global_step
        self.seen = SeenGrads()  # the references are not needed after the update

    def _param_probe(self, mon: Any, share: list[int] | None = None) -> torch.Tensor:
        """A finiteness probe of the parameters (``share``: of those only), on the device: one float32
        per tensor, a few torch calls for the whole list (the session's cached plan)."""
        if share is None:
            plan, _ = mon.transfer.plan(mon.params)
            if plan is not None:
                with contextlib.suppress(RuntimeError, ValueError):
                    return plan.sums(mon.params)
            return finite_probe(mon.params)
        return finite_probe([mon.params[i] for i in share])

    def scaler_step_started(self, mon: Any, scaler: Any) -> None:
        scale = getattr(scaler, "_scale", None)
        if isinstance(scale, torch.Tensor):
            mon.transfer.scale_used = scale.detach().clone()  # the scale backward saw (update() comes later)
        self.scaler_ran = True
        self.opt_ran_in_scaler = False

    def scaler_step_done(self, mon: Any, scaler: Any, failed: bool = False) -> None:
        if failed or self.opt_ran_in_scaler:
            return
        self.scaler_skipped = True
        if self.active and not self.replaying:
            # the scaler found Inf/NaN and skipped the update: judge it now, while the (unscaled) gradients
            # are still there (users zero them before mon.step()); this is the step's transfer
            if not mon.transfer.synced:
                self.probe_edits()
                mon.sync()
            self.check_gradients(at_optimizer=False)

    def scaler_unscaled(self, opt: Any) -> bool:
        """True once the GradScaler unscaled this step's gradients (``unscale_`` bumps no ``_version``)."""
        sc = self.mon.scaler
        if sc is None or not getattr(sc, "is_enabled", lambda: True)():
            return False
        if self.scaler_ran:
            return True  # scaler.step() unscales before it calls the optimizer or skips it
        states = getattr(sc, "_per_optimizer_states", {})
        for o in (opt, self.mon.optimizer):
            st = states.get(id(o)) if o is not None else None  # .get: the defaultdict must not grow
            if st and int(getattr(st.get("stage"), "value", 0)) != 0:  # OptState.READY = 0
                return True
        return False

    def probe_edits(self, opt: Any = None) -> None:
        """Gradients changed since backward() measured them (clipping, normalisation, unscaling, a hook):
        a finiteness probe of those only, on the device, read with this step's transfer. The usual
        answer, nothing edited (the same tensors at the same ``_version``), costs two C-level passes."""
        params = self.mon.params
        unscaled = self.scaler_unscaled(opt)  # unscaled: every gradient changed (no version bump)
        grads = list(map(grad_of, params))
        seen = self.seen
        if not unscaled and seen.unchanged(grads):
            return
        edited = [i for i, g in enumerate(grads) if g is not None and (unscaled or not seen.same(i, g))]
        if edited:
            self.edit_index = edited
            if len(edited) == len(params):
                plan, _ = self.mon.transfer.plan(params)
                if plan is not None:
                    with contextlib.suppress(RuntimeError, ValueError):
                        self.edit_probe = plan.sums(grads)
                        return
            self.edit_probe = finite_probe([grads[i] for i in edited])  # type: ignore[misc]

    def before_clip(self, params: list[Any]) -> list[int]:
        """``clip_grad_norm_`` is about to scale these parameters' gradients: the ones backward() left
        unedited (their after-backward check stands), else []."""
        if not self.active or self.replaying or self.synced_at_backward or self.mon.transfer.synced:
            return []  # a manual-update loop, or after the step's transfer: the probe judges the clip
        seen = self.seen
        mine = self.mon.params
        if (
            not self._sharded
            and len(params) == len(mine)
            and all(map(operator.is_, params, mine))
            and seen.unchanged(list(map(grad_of, mine)))
        ):
            return seen.idx  # the usual call, clip_grad_norm_(model.parameters(), ...): C-level checks
        idx: list[int] = []
        for p in params:
            i = self._index.get(id(p), -1)
            g = p.grad
            if g is not None and seen.same(i, g) and local(g) is g:
                idx.append(i)
        return idx

    def after_clip(self, idx: list[int], total: Any, max_norm: Any) -> None:
        """The clip multiplied those gradients by ``min(max_norm / (total + 1e-6), 1)`` (torch's formula):
        finite gradients stay finite iff that factor is finite, so a one-element flag on the device
        replaces a probe of every gradient (read with the step's transfer; confirmed exactly if up)."""
        if not idx or not isinstance(total, torch.Tensor) or local(total) is not total:
            return
        try:
            m = float(max_norm)
        except (TypeError, ValueError):
            return
        if (
            self.mon.transfer.lazy and self.mon._async is None
        ):  # the total: its factor is worked out on the host
            self.clips.append((total, idx, m))  # computed under no_grad: nothing to detach
        else:
            with torch.no_grad():
                coef = torch.clamp(m / (total.detach().float() + 1e-6), max=1.0)
                self.clips.append((torch.isfinite(coef).logical_not(), idx, None))
        self.seen.rebase(idx, self.mon.params)  # scaled by that factor: judged by the flag

    # -- step end ------------------------------------------------------------------------------------
    def manual_update(self, mon: Any) -> bool:
        """True when this step's update ran without an optimizer the session saw (an update by hand)."""
        return self.active and not self.opt_ran and mon.optimizer is None and not mon._adopted

    def before_step_end(self, mon: Any, manual: bool) -> None:
        """Step end: the verdict when the update did not already give it (may raise)."""
        if manual and self.step_anomaly is None:
            # no optimizer hook: the user's update already ran; check the parameters on the device, read
            # with this transfer, or the next one when this step's already ran (at the end of backward())
            self.deferred["param_norms"] = self._param_probe(mon)
            self.deferred_index = None
            self.deferred_step = mon.global_step
            if self.synced_at_backward:
                # checked at the end of backward(): an edit after it (clipping, normalisation) is seen
                # here, read with the next transfer, so a NaN it made is not blamed on the update
                self.probe_edits()
                if self.edit_probe is not None:
                    self.deferred["edit"] = self.edit_probe
                    self.deferred_edit_index = list(self.edit_index)
                    self.edit_probe = None
        if self.active and not mon.transfer.synced:
            self.probe_edits()
            mon.sync()
            self.check_gradients(at_optimizer=False)

    def after_step_end(self, mon: Any, manual: bool) -> None:
        self.say_skips()
        if manual and mon.driver is None and not self.scaler_ran and mon.transfer.micro_bad:
            self.manual = True  # from the next step on, the check runs at the end of backward()

    def final_check(self, mon: Any) -> None:
        """Session exit: read a pending parameter probe (the last update's)."""
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
        if self.deferred:
            mon.transfer.values = {}
            mon.sync()

    # -- the transfer ---------------------------------------------------------------------------------
    def items(self) -> list[tuple[str, torch.Tensor]]:
        """The sentinel's device numbers for the step's transfer."""
        items = [("_edit", self.edit_probe)] if self.edit_probe is not None else []
        items += [(f"_clip{k}", flag) for k, (flag, _, _) in enumerate(self.clips)]
        return items + [(f"_def_{k}", v) for k, v in self.deferred.items()]

    def read_edits(self, values: dict[str, float]) -> None:
        """After the read: which edited gradients are non-finite (confirmed exactly)."""
        bad: list[int] = []
        if self.edit_probe is not None:
            ep = self.mon.transfer.vector("_edit", len(self.edit_index))
            if not all(map(math.isfinite, ep)):  # C loop: the usual answer
                bad = [i for j, i in enumerate(self.edit_index) if not math.isfinite(ep[j])]
            self.edit_probe = None
        for k, (_, idx, max_norm) in enumerate(self.clips):
            x = values.get(f"_clip{k}", 0.0)
            if x > 0 if max_norm is None else _factor_bad(x, max_norm):  # every gradient it scaled
                bad += [i for i in idx if i not in bad]
        self.clips = []
        if bad:
            self.edit_bad = [i for i in sorted(bad) if not self.grad_finite(i, now=True)]

    def read_deferred(self, values: dict[str, float]) -> None:
        """After the read: the parameter probe of the last update (may raise under ``raise``)."""
        mon = self.mon
        if "param_norms" not in self.deferred:
            self.judge_unprobed()
            return
        sizes = {k: t.numel() for k, t in self.deferred.items()}  # the keys the read gave: no scan of v
        transfer = mon.transfer
        pn = transfer.vector("_def_param_norms", sizes["param_norms"])
        coord = mon._coord
        flagged = coord.params_flagged(mon) if coord is not None else None
        if flagged is None:  # this rank's own probe
            suspects = []
            if not all(map(math.isfinite, pn)):  # C loop: the usual answer
                index = self.deferred_index if self.deferred_index is not None else list(range(len(pn)))
                suspects = [index[j] for j, x in enumerate(pn) if not math.isfinite(x) and j < len(index)]
        else:  # several ranks: any rank's probe (of its share under DDP) flags every parameter
            suspects = list(range(len(mon.params))) if flagged else []
        bad = [
            mon.param_names[i]
            for i in suspects
            if i < len(mon.params)
            and not bool(torch.isfinite(local(mon.params[i].detach())).all())  # exact: rare path
        ]
        ranks = coord.params_agree(bool(bad)) if flagged else []  # the same decision on every rank
        step = self.deferred_step
        de = transfer.vector("_def_edit", sizes["edit"]) if "edit" in sizes else []
        edited, self.deferred_edit_index = self.deferred_edit_index, []
        self.deferred.clear()
        self.deferred_index = None
        for name in sizes:
            transfer.vectors.pop(f"_def_{name}", None)  # VECTORS items: one list each
        self.params_bad_now = bool(bad)
        # (probe values, not confirmed: the gradients are gone by now; they only choose the phase)
        edit_bad = [i for j, i in enumerate(edited) if j < len(de) and not math.isfinite(de[j])]
        if bad and edit_bad:
            # a manual update used gradients that an edit after backward() made non-finite
            self.edit_bad = edit_bad
            nan = any(math.isnan(x) for x in de)
            anomaly = self.gradient_edit_anomaly(None, kind="nan" if nan else "inf")
            self.edit_bad = []
            self.record(dataclasses.replace(anomaly, step=step))
            if mon.config.policy == "raise":
                mon._flush_store()
                raise NonFiniteError(self.step_anomaly)  # type: ignore[arg-type]
            mon._warn_once("anomaly", f"torchdebug: {anomaly.summary()}")
        elif (bad or ranks) and not (step == mon.global_step and self.grads_bad()):
            # blamed on the update only when the gradients it used were finite; else they are the cause
            self.optimizer_anomaly(bad, step, ranks, since=self.ledger.window)

    def judge_unprobed(self) -> None:
        """After the read, when the last update was not probed and this step read a non-finite loss or
        gradient: the parameters checked exactly (rare path); non-finite ones nothing wrote to since
        that update are its doing (may raise under ``raise``)."""
        led, mon = self.ledger, self.mon
        step, t = led.step, mon.transfer
        if step is None or step == mon.global_step or not (t.any_loss_bad() or t.micro_flagged()):
            return  # the usual answer: the step's numbers are finite
        led.step = None
        bad = nonfinite_params(mon.param_names, mon.params)
        if bad and not led.written_since(mon.params):
            self.params_bad_now = True
            self.optimizer_anomaly(bad, step)

    # -- detection ------------------------------------------------------------------------------------
    def grad_finite(self, i: int, now: bool = False) -> bool:
        """Exact finiteness of parameter i's gradient (a host read: only when the probe flagged it).

        The tensor backward() left (kept: users may set ``.grad`` to None before ``mon.step()``), or with
        ``now`` the gradient as it is.
        """
        if self.grads_gone:
            return False  # judged one step later (sync="async"): the probe's verdict stands
        seen = None if now else self.seen.get(i)
        g = local(seen if seen is not None else self.mon.params[i].grad)
        return g is None or bool(torch.isfinite(g).all())

    def grads_bad(self) -> bool:
        """This rank's verdict after the read: a non-finite loss or gradient (confirmed)."""
        t = self.mon.transfer
        return t.any_loss_bad() or t.micro_flagged() or bool(self.edit_bad)

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
        scale = mon.transfer.values.get("_scale")
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

    def check_gradients(self, *, at_optimizer: bool, opt: Any = None) -> None:
        """The step's verdict and the policy (may raise :class:`NonFiniteError`)."""
        mon = self.mon
        coord = mon._coord
        bad = self.grads_bad() if coord is None else coord.step_bad(mon)  # the same on every rank
        if self.step_anomaly is not None:
            if at_optimizer and opt is not None and self.grad_anomaly and mon.config.policy == "skip":
                self.drop_grads(opt)  # flagged at the end of backward(), before an optimizer turned up
            return
        if not bad or (self.skipped and not at_optimizer):
            return
        scaler_skip = (self.scaler_ran and self.scaler_skipped) or (
            at_optimizer and mon.driver is not None and self.scaler_will_skip(opt)
        )
        if scaler_skip and at_optimizer and self.scaler_cannot_fix() is None:
            # a driver announced the update after scaler.unscale_() found Inf/NaN: scaler.step() skips it
            self.mark_skipped("GradScaler found inf/NaN gradients (loss scale too high)", scaler=True)
            return
        if not at_optimizer:
            if scaler_skip:
                if self.scaler_cannot_fix() is None:
                    self.mark_skipped("GradScaler found inf/NaN gradients (loss scale too high)", scaler=True)
                    return
            elif (mon.optimizer is not None or mon._adopted) and not self.synced_at_backward:
                self.mark_skipped("non-finite gradients and the optimizer step was not called")
                return
        late = not at_optimizer and not scaler_skip and not self.synced_at_backward
        anomaly = self.build_anomaly(late=late) if coord is None else coord.anomaly(mon)
        self.grad_anomaly = True
        self.record(anomaly)
        policy = mon.config.policy
        if policy == "skip":
            if at_optimizer and opt is not None:
                self.drop_grads(opt)
            elif scaler_skip:
                self.mark_skipped(f"skipped by the GradScaler: {anomaly.summary()}", severity="info")
            else:
                mon._warn_once(
                    "skip-needs-opt", "policy='skip' needs the optimizer's step to skip it; recorded only"
                )
            return
        if policy == "warn":
            mon._warn_once("anomaly", f"torchdebug: {anomaly.summary()} (policy='warn': training goes on)")
            return
        mon._flush_store()
        raise NonFiniteError(anomaly)

    def drop_grads(self, opt: Any) -> None:
        if not self.update_held:  # sync="async": the device skipped the update already
            for g in unwrap_optimizer(opt).param_groups:
                for p in g["params"]:
                    p.grad = None  # the optimizer skips parameters without grads: no update, no state change
        self.mark_skipped(f"skipped by policy: {self.step_anomaly.summary()}", severity="info")  # type: ignore[union-attr]

    # -- anomalies ------------------------------------------------------------------------------------
    def optimizer_anomaly(
        self, bad: list[str], step: int | None, ranks: list[int] | None = None, since: int | None = None
    ) -> None:
        """The update made parameters non-finite from finite gradients. ``bad``: this rank's non-finite
        parameters (empty when only another rank's shards are, under FSDP2); ``ranks``: with several
        ranks, those whose parameters are non-finite (every rank takes the same decision)."""
        mon = self.mon
        op = type(mon.optimizer).__name__ + ".step" if mon.optimizer is not None else "optimizer.step"
        # several ranks: named when only some hold non-finite parameters (FSDP2 shards); under DDP
        # every rank holds the same parameters, so the update made them non-finite on every rank
        ranks = ranks or []
        some = 0 < len(ranks) < mon.world_size
        if not bad:  # another rank's shards: its own record names the parameters
            anomaly = Anomaly(
                phase=Phase.OPTIMIZER.value,
                module=None,
                op=op,
                location=None,
                kind="nan",
                step=step,
                rank=ranks[0] if ranks else mon.rank,
                world_size=mon.world_size,
                hint="the optimizer update made parameters non-finite on another rank: its record names them",
                symptom="non-finite parameters after the optimizer step",
                detected_by=f"rank {ranks[0]}" if ranks else "sentinel",
            )
            self._raise_or_warn(anomaly)
            return
        first = bad[0]
        owner = first.rpartition(".")[0]
        mod = mon.model.get_submodule(owner) if owner else mon.model
        stats = None
        with contextlib.suppress(Exception):
            from ..stats import analyze_tensor

            stats = analyze_tensor(local(dict(mon.model.named_parameters())[first].detach()), first)
        kind = (
            "nan"
            if stats is not None and stats.has_nan
            else ("inf" if stats is None or stats.posinf_count else "-inf")
        )
        more = f" (and {len(bad) - 1} more: {', '.join(bad[1:4])})" if len(bad) > 1 else ""
        anomaly = Anomaly(
            phase=Phase.OPTIMIZER.value,
            module=owner,
            op=op,
            location=None,
            kind=kind,
            step=step,
            rank=mon.rank,
            world_size=mon.world_size if some else 1,
            tensor=stats,
            module_type=type(mod).__name__,
            hint=f"the optimizer update made {first} non-finite{more}{window_hint(since, step)}: check lr, "
            "eps, weight decay and the update formula",
            symptom=f"{kind} in parameter {first} after the optimizer step",
            detected_by="sentinel",
            parameter=first,
        )
        self._raise_or_warn(anomaly)

    def _raise_or_warn(self, anomaly: Anomaly) -> None:
        mon = self.mon
        self.record(anomaly)
        if mon.config.policy == "raise":
            mon._flush_store()
            raise NonFiniteError(anomaly)
        mon._warn_once("anomaly", f"torchdebug: {anomaly.summary()}")

    def build_anomaly(self, late: bool = False) -> Anomaly:
        """The anomaly of this step's bad gradients or loss: replayed (the first one) to its origin.

        ``late``: checked at ``mon.step()`` after an update the session did not see start; when that
        update already made the parameters non-finite a replay would blame them, so it is not replayed.
        """
        mon = self.mon
        t = mon.transfer
        v = t.values
        bad_micro = next((i for i in range(len(t.micro_bad)) if v.get(f"_mbad#{i}", 0) > 0), None)
        losses_bad = t.losses_bad()
        idx = min([i for i in [bad_micro, losses_bad[0] if losses_bad else None] if i is not None], default=0)
        micro = idx if len(t.micro_bad) > 1 else None
        if self.edit_bad and not t.micro_flagged() and not losses_bad:
            # backward() made finite gradients (measured then); code before the update made them non-finite
            return self.gradient_edit_anomaly(micro)
        first_replay = mon.counters["replays"] == 0
        replayable = not (late and self.params_bad_now)
        if mon.config.replay and first_replay and replayable and idx < len(self.captures):
            mon.counters["replays"] += 1
            self.replaying = True
            try:
                # A fault that does not come back when the step is re-run is information (a one-off
                # fault, a nondeterministic kernel, state that changed): a second replay confirms it.
                for _ in range(2):
                    with mon._plain.eager():
                        tracer = replay_capture(
                            mon.model,
                            self.captures[idx],
                            names=mon.names,
                            frames=mon.config.frames,
                            uses_cuda=mon._uses_cuda,
                        )
                    a = tracer.anomaly(
                        step=mon.global_step, rank=mon.rank, micro_step=micro, detected_by="sentinel"
                    )
                    if a is not None:
                        return dataclasses.replace(a, reproducible=True)
                return self.symptom_anomaly(micro, losses_bad, reproduced=False)
            except Exception as exc:
                mon._warn_once(
                    "replay",
                    f"torchdebug: replay of the failing step failed ({exc!r}); reporting the symptom only",
                )
                return self.symptom_anomaly(micro, losses_bad, why="the replay failed")
            finally:
                self.replaying = False
        why = "only the first anomaly of a session is replayed"
        if not mon.config.replay:
            why = "replay is off (config.replay=False)"
        elif first_replay and not replayable:
            why = (
                "your update (no optimizer object) ran before the check and made the parameters non-finite; "
                "call mon.update_starting() before it"
            )
        elif first_replay:
            why = "the failing micro-step was not captured"
        return self.symptom_anomaly(micro, losses_bad, why=why)

    def gradient_edit_anomaly(self, micro: int | None, kind: str | None = None) -> Anomaly:
        mon = self.mon
        bad = [mon.param_names[i] for i in self.edit_bad]
        first = bad[0] if bad else None
        owner = first.rpartition(".")[0] if first else ""
        mod = mon.model.get_submodule(owner) if owner else mon.model
        g = mon.params[self.edit_bad[0]].grad if self.edit_bad else None
        if kind is None:
            kind = "nan" if g is not None and bool(torch.isnan(g).any()) else "inf"  # exact: rare path only
        more = f" (+{len(bad) - 1} more parameters)" if len(bad) > 1 else ""
        return Anomaly(
            phase=Phase.GRADIENT_EDIT.value,
            module=owner,
            op=None,
            location=None,
            kind=kind,
            step=mon.global_step,
            rank=mon.rank,
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

    def symptom_anomaly(
        self, micro: int | None, losses_bad: list[int], reproduced: bool | None = None, why: str = ""
    ) -> Anomaly:
        mon = self.mon
        per = mon.transfer.grad_norms or []
        bad = [mon.param_names[i] for i, x in enumerate(per) if not math.isfinite(x)]
        loss_bad = bool(losses_bad)
        kind = "nan" if any(math.isnan(x) for x in per) else "inf"
        if reproduced is False:
            # Say what was seen and what was compared; name no origin the replay could not confirm.
            v = mon.transfer.values
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
                step=mon.global_step,
                rank=mon.rank,
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
        mod = mon.model.get_submodule(owner) if owner else mon.model
        symptom = "non-finite loss" if loss_bad else f"non-finite gradient of {first}"
        return Anomaly(
            phase=Phase.FORWARD.value if loss_bad else Phase.BACKWARD.value,
            module=owner if not loss_bad else "",
            op=None,
            location=None,
            kind=kind,
            step=mon.global_step,
            rank=mon.rank,
            module_type=type(mod).__name__,
            micro_step=micro,
            symptom=symptom + (f" (+{len(bad) - 1} more parameters)" if len(bad) > 1 else ""),
            detected_by="sentinel (no replay)",
            hint=f"origin not traced: {why}; use td.locate_nonfinite(step_fn) for the exact op",
            parameter=first,
        )

    def record(self, anomaly: Anomaly) -> None:
        mon = self.mon
        self.step_anomaly = anomaly
        mon.counters["anomaly_steps"] += 1
        if len(mon.anomalies) < _MAX_ANOMALIES:
            mon.anomalies.append(anomaly)
        if mon.writer is not None:
            with contextlib.suppress(Exception):
                mon.writer.log_anomaly(anomaly.step, anomaly.to_dict())

    # -- skipped steps ----------------------------------------------------------------------------------
    def mark_skipped(self, reason: str, scaler: bool = False, severity: str = "warning") -> None:
        mon = self.mon
        self.skipped = True
        self.skip_reason = reason
        mon.counters["skipped_steps"] += 1
        if not scaler:
            mon.emit(RuleEvent("skipped_step", mon.global_step, reason, severity))

    def note_scaler_skip(self) -> None:
        """Step end: a step the GradScaler skipped is a skipped step (never an anomaly by itself)."""
        if self.scaler_ran and self.scaler_skipped and not self.skipped:
            self.mark_skipped("GradScaler found inf/NaN gradients (loss scale too high)", scaler=True)

    def say_skips(self, at_exit: bool = False) -> None:
        """policy="skip": say a run of skipped steps once when it starts and once, with its count, when it ends."""
        mon = self.mon
        run = self.skip_run
        if not at_exit and self.skipped and self.skip_reason.startswith("skipped by policy"):
            if run is not None:
                run[1] += 1
                return
            self.skip_run = [mon.global_step, 1]
            warn_at_user(
                TorchDebugWarning(
                    f"torchdebug: step {mon.global_step} {self.skip_reason}; the parameters and the "
                    "optimizer state are unchanged (policy='skip'). Skipped steps in a row are counted "
                    "and said once when they stop"
                )
            )
            return
        if run is None:
            return
        self.skip_run = None
        first, n = run
        span = f"step {first}" if n == 1 else f"steps {first}-{first + n - 1}"
        after = "when the run ended" if at_exit else f"training resumed at step {mon.global_step}"
        message = f"{n} step{'s' if n != 1 else ''} skipped by policy='skip' ({span}); {after}"
        mon.emit(
            RuleEvent(
                "skipped_steps", mon.global_step, message, "info", evidence={"first": first, "count": n}
            )
        )
        warn_at_user(TorchDebugWarning(f"torchdebug: {message}"))


class SeenGrads:
    """The gradient tensors backward() left and their ``_version`` s, by parameter index: the edit check
    compares them with the gradients as the update starts. Built with one C-level pass per backward."""

    __slots__ = ("grads", "idx", "versions", "whole")

    def __init__(self, idx: list[int] | None = None, grads: list[Any] | None = None, n: int = 0) -> None:
        self.idx: list[int] = idx or []
        self.whole = idx is not None and grads is not None and len(idx) == n  # every parameter, in order
        if self.whole:
            self.grads: list[Any] = grads  # type: ignore[assignment]
        else:
            self.grads = [None] * n
            for i, g in zip(self.idx, grads or ()):
                self.grads[i] = g
        self.versions: list[int] = (
            list(map(version_of, self.grads))
            if self.whole
            else [-1 if g is None else g._version for g in self.grads]
        )

    def get(self, i: int) -> Any:
        """The gradient parameter i had after backward(), or None."""
        return self.grads[i] if 0 <= i < len(self.grads) else None

    def same(self, i: int, g: Any) -> bool:
        """Parameter i's gradient is the tensor backward() left, unchanged since."""
        return 0 <= i < len(self.grads) and self.grads[i] is g and self.versions[i] == g._version

    def unchanged(self, grads: list[Any]) -> bool:
        """Every gradient (``grads``: all parameters, in order) is the one backward() left, unchanged."""
        return (
            self.whole
            and len(grads) == len(self.grads)
            and all(map(operator.is_, grads, self.grads))
            and list(map(version_of, grads)) == self.versions
        )

    def rebase(self, idx: list[int], params: list[Any]) -> None:
        """Those gradients changed in a way judged elsewhere (a clip's factor): take them as seen now."""
        if self.whole and idx is self.idx:  # the clip's fast path: every gradient
            self.grads = list(map(grad_of, params))
            if not any(map(operator.is_, self.grads, itertools.repeat(None))):  # a C loop
                self.versions = list(map(version_of, self.grads))
                return
            self.whole = False
            self.versions = [-1 if g is None else g._version for g in self.grads]
            return
        for i in idx:
            g = params[i].grad
            if g is not None and 0 <= i < len(self.grads):
                self.grads[i] = g
                self.versions[i] = g._version


def _factor_bad(total: float, max_norm: float) -> bool:
    """``clip_grad_norm_``'s factor ``min(max_norm / (total + 1e-6), 1)`` is non-finite (a NaN total or
    max_norm; an Inf total gives 0), worked out on the host as torch works it out on the device."""
    try:
        return not math.isfinite(min(max_norm / (total + 1e-6), 1.0))  # min keeps a NaN in first place
    except ZeroDivisionError:
        return False  # a norm is >= 0: total + 1e-6 > 0


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


def _store_grad(cap_ref: Any, i: int, grad: torch.Tensor) -> None:
    cap = cap_ref()
    if cap is not None:
        cap.out_grads[i] = grad

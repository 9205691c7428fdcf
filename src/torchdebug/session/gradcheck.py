"""When the session measures the gradients backward() left: right after it, or inside the user's clip.

After each backward the session reduces the gradients on the device (``Transfer.measure``): their
total says whether every one is finite and is the step's gradient norm. A loop that clips every step
(``clip_grad_norm_(model.parameters(), max_norm)`` right after backward(): nanoGPT, the HF Trainer's
``max_grad_norm``; not Lightning, which clips after ``on_before_optimizer_step``, where the session
has read the step) computes the same per-tensor norms a moment later, so the session lets the clip compute them once: the backward's measure is held back, and the
clip's own per-tensor norms (``torch._foreach_norm``, the call torch's clip makes) become the
micro-step's gradient numbers. The clip's result is torch's own: the same calls in the same order,
checked against ``torch.nn.utils.get_total_norm`` once per session (bitwise; any difference turns the
merge off). On the CPU proxy of a GPT-2 step this saves the measure's copy of every gradient
(docs/benchmarks.md).

The hold is a prediction: the last update's clip came right after its backward, over the session's
parameters, with no edit between. When something else comes first (the next backward, the update,
``zero_grad``, a read), the held measure runs there, on the gradients as they are then; the edit check
still compares them with what backward() left (the references and versions taken at backward()), so
an edit in between is still told apart. A member of the session's :class:`~torchdebug.session.step.Step`.
"""

from __future__ import annotations

from typing import Any

import torch

from .._step import Measure, StepPhase
from .._tensors import Reduced, all_present, grad_of, versions_of
from .protocol import Session


class GradientCheck:
    """Measuring the gradients after backward(), or holding it for the clip (see above); a member of
    the session's :class:`~torchdebug.session.step.Step` (``mon.stepper.grads``) with its own state."""

    def __init__(self, mon: Session) -> None:
        self.mon = mon
        # the held measure: None, or True/False (a finiteness probe / norms) until it runs
        self.held: bool | None = None
        # the micro-step (counted from the update's first) the last update's clip followed, 0: none
        self._clip_after = 0
        self._clip_checked = False  # the merged clip was compared with torch's once (bitwise)
        self._clip_off = False  # ... and differed, or failed: no merge for the rest of the session
        self._merged: Any = None  # the total of the clip running now, when the session ran it (merged)
        # sync="async": the first merged clip's comparison with torch's total, a device flag (1: they
        # differ) staged with the step's numbers (``staged_items``) and read with them (``read_check``):
        # no host read of its own. Until it is read, each merged clip hands torch's own total on.
        self._comparison: Any = None
        self.comparing = False

    def measure(self) -> None:
        """After a backward: reduce the gradients now, or hold the measure for the clip that follows."""
        if not (self.mon.sentinel.active or "gradients" in self.mon._enabled):
            return
        # one process, one model, at most one optimizer: the edit check may watch the calls
        self.mon.sentinel.edits.single = (
            self.mon._coord is None and self.mon.roots is None and len(self.mon.optimizers) <= 1
        )
        probe = "gradients" not in self.mon._enabled  # the sentinel alone needs finiteness only
        t = self.mon.transfer
        if (
            self._clip_after
            and len(t.micro_bad) - self.mon.state.micro_base + 1 == self._clip_after
            and self._may_hold()
        ):
            grads = list(map(grad_of, self.mon.params))  # a C loop
            s = self.mon.sentinel
            watched = (
                s.active
                and not (s.replaying or s.manual or s.check_each_backward)
                and s.edits.watches_edits()
            )
            versions = None if watched else versions_of(grads)  # None: a parameter has no gradient
            if all_present(grads) if watched else versions is not None:
                plan, every = t.plan(self.mon.params)
                if plan is not None:
                    self.held = probe
                    # what the edit check compares with (its versions, or the watch until the update)
                    self.mon.sentinel.saw_gradients(self.mon.state, every, grads, versions, watched)
                    return
        # (``_measure_now(probe, saw=True)``, inlined: every backward)
        mon = self.mon
        share = mon._coord.grad_share(mon) if mon._coord is not None else None  # DDP: this rank's
        s = mon.sentinel  # no versions when the watch tells edits apart (``Sentinel.watches_edits``)
        watched = (
            s.active and not (s.replaying or s.manual or s.check_each_backward) and s.edits.watches_edits()
        )
        idx, grads, versions = t.measure(mon.params, probe=probe, share=share, versions=not watched)
        if idx:
            s.saw_gradients(mon.state, idx, grads, versions, watched)

    def _may_hold(self) -> bool:
        """The loop may hand its gradient check to the clip: one process, no loss scaler, one model,
        the sentinel not checking each backward on its own. Read blocking or one step later alike:
        under ``sync="async"`` the merged total is staged with the step's numbers as the measure is."""
        s = self.mon.sentinel
        return (
            not self._clip_off
            and self.mon._coord is None
            and self.mon.scaler is None
            and self.mon.roots is None
            and not (s.manual or s.check_each_backward or s.replaying)
        )

    def _measure_now(self, probe: bool, saw: bool) -> None:
        # gradient health needs true norms; the sentinel alone only finiteness (a cheaper probe)
        share = (
            self.mon._coord.grad_share(self.mon) if self.mon._coord is not None else None
        )  # DDP: this rank's
        s = (
            self.mon.sentinel
        )  # no versions when the watch tells edits apart (``Sentinel.watches_edits``, inlined)
        watched = (
            saw
            and s.active
            and not (s.replaying or s.manual or s.check_each_backward)
            and s.edits.watches_edits()
        )
        idx, grads, versions = self.mon.transfer.measure(
            self.mon.params, probe=probe, share=share, versions=not watched
        )
        if idx and saw:
            self.mon.sentinel.saw_gradients(self.mon.state, idx, grads, versions, watched)

    def flush_measure(self) -> None:
        """The held measure runs now (something other than the clip came first): on the gradients as
        they are; the edit check still compares them with what backward() left. No clip is predicted
        until one follows a backward again."""
        probe = self.held
        if probe is None:
            return
        self.held = None
        self._clip_after = 0
        if not self.mon.state.seen.unedited(
            self.mon.params
        ):  # edited since backward() (a C pass, or the watch)
            self.mon.state.measure = Measure.AFTER_EDIT
        self._measure_now(probe, saw=False)

    # -- the clip ----------------------------------------------------------------------------------------
    def clip_starting(self, params: list[Any]) -> list[int]:
        """``torch.nn.utils.clip_grad_norm_`` is about to scale these parameters' gradients (the
        driver's patch): the ones the sentinel can judge by the clip factor alone."""
        st = self.mon.state
        self.mon.sentinel.edits.watch_edits_end(
            st
        )  # the clip is the session's to judge (the watch reopens after it)
        return self.mon.sentinel.before_clip(st, params)

    def clip_with_check(self, params: list[Any], idx: list[int], args: dict[str, Any]) -> Any:
        """The clip run by the session with the held measure merged into it: torch's total norm, or None
        when this clip cannot carry the check (then the held measure ran first and torch's clip runs).

        ``idx``: what :meth:`clip_starting` returned (every parameter when no gradient was edited)."""
        held = self.held
        seen = self.mon.state.seen
        # every parameter of the session, in its order (the per-tensor norms are read by index), unedited:
        # what the sentinel's check found before the clip (it returns the list of every index then)
        whole = idx is seen.idx and seen.whole and len(params) == len(self.mon.params)
        fits = (
            whole
            and args.get("norm_type") in (2, 2.0)
            and not args.get("error_if_nonfinite")
            and args.get("foreach") in (None, True)
            and "max_norm" in args
            and self._may_hold()
        )
        # this clip followed the update's last backward directly: the next update's may carry its check
        self._clip_after = (
            len(self.mon.transfer.micro_bad) - self.mon.state.micro_base + (held is not None)
            if fits and self.mon.state.phase is StepPhase.BACKWARD
            else 0
        )
        if held is None:
            return None
        plan, every = self.mon.transfer.plan(self.mon.params)
        total = per = None
        if fits:
            # torch groups the gradients by device and dtype; one group (a plan is one device; a
            # gradient has its parameter's dtype) is a norm of the same norms in the same order
            late = self.mon._async is not None
            try:
                if plan is not None and plan.one_dtype:
                    # the gradients are the ones backward() left (checked): no pass to read them again
                    total, per, differs = _clip_norms(
                        seen.grads, args, first=not self._clip_checked, late=late
                    )
                    if differs is not None:  # compared on the device: read with the step's numbers
                        self._comparison, self.comparing = differs, True
            except Exception:  # an odd gradient type: torch's clip, the measure before it
                total = None
            self._clip_off = total is None  # this session's clip cannot carry the check: not again
        if total is None:
            self.flush_measure()  # the held measure runs before torch's clip
            return None
        self.held, self._merged = None, total
        self._clip_checked = self._clip_checked or not self.comparing
        self.mon.transfer.take(Reduced(plan, True, None, [], total, per, root=True), every, held)  # type: ignore[arg-type]
        with torch.no_grad():  # torch's own scaling, with torch's total (what its clip would raise, raises)
            torch.nn.utils.clip_grads_with_norm_(params, args["max_norm"], total, args.get("foreach"))
        return total

    def staged_items(self) -> list[tuple[str, Any]]:
        """The merged clip's comparison with torch's total, for this step's read (``sync="async"``)."""
        got, self._comparison = self._comparison, None
        return [] if got is None else [("_clip_differs", got)]

    def read_check(self, values: dict[str, float]) -> None:
        """After a read that carried the comparison: the merge stays on when the totals were equal bit
        for bit, and is off for the rest of the session where they differed."""
        differs = values.pop("_clip_differs", None)
        if differs is None:
            return  # not this step's read (still in flight, or the step before the first merge)
        self.comparing = False
        if differs > 0:
            self._clip_off = True
        else:
            self._clip_checked = True

    def clip_done(self, idx: list[int], total: Any, max_norm: Any, norm_type: Any) -> None:
        """The clip returned its total norm: the sentinel reads the factor; ``on_clip`` for instruments."""
        merged, self._merged = self._merged is not None and total is self._merged, None
        self.mon.sentinel.edits.after_clip(
            self.mon.state, idx, total, max_norm, scaled_all=merged, reads_late=self.mon._async is not None
        )
        self.mon.stepper.each("on_clip", total, max_norm, norm_type)


def _clip_norms(
    grads: list[Any], args: dict[str, Any], first: bool, late: bool = False
) -> tuple[Any, Any, Any]:
    """The total 2-norm ``clip_grad_norm_(params, max_norm)`` computes, computed as torch computes it,
    and the per-tensor norms torch's clip makes and drops: ``(total, per-tensor norms, None)``.
    ``(None, None, None)`` where torch's clip would take another path (no foreach kernel for these
    tensors, a torch without ``clip_grads_with_norm_``); the caller checked that the gradients are one
    device and dtype. Nothing is scaled here.

    ``first``: compared with ``torch.nn.utils.get_total_norm``: blocking, with one host read (once per
    session), a difference giving ``(None, None, None)``; ``late`` (``sync="async"``, no host read):
    torch's total is the one returned, with a device flag (1.0: the two differ) as the third item,
    for the caller to read with the step's numbers."""
    utils = torch.nn.utils
    total_of = getattr(utils, "get_total_norm", None)
    if getattr(utils, "clip_grads_with_norm_", None) is None or total_of is None:
        return None, None, None
    from torch.utils._foreach_utils import _device_has_foreach_support, _has_foreach_support

    dev = grads[0].device
    foreach = args.get("foreach")
    # torch's test is by type, tensor by tensor (a Python loop): asked of one gradient of each type
    one_each = list(dict(zip(map(type, grads), grads)).values())
    if not (_has_foreach_support(one_each, dev) if foreach is None else _device_has_foreach_support(dev)):
        return None, None, None
    with torch.no_grad():
        per = torch.stack(torch._foreach_norm(grads, 2.0))
        total = torch.linalg.vector_norm(per, 2.0)
        if first:
            ref = total_of(grads, 2.0, False, foreach)
            if late:  # on the device: the flag travels with the step's staged numbers
                same = torch.eq(total, ref).logical_or_(torch.isnan(total).logical_and_(torch.isnan(ref)))
                return ref, per, same.logical_not_().float()
            # one host read per session: the merged clip must give torch's number bit for bit
            if not (torch.equal(total, ref) or bool(torch.isnan(total) & torch.isnan(ref))):
                return None, None, None
    return total, per, None

"""What changed the gradients between backward() and the update, and whether it made them non-finite.

After backward() the session measures the gradients (their total says whether every one is finite);
the sentinel keeps which tensors backward() left and their versions (:class:`~torchdebug._step.SeenGrads`).
Code between backward() and the update may change them: a clip, a normalisation, the GradScaler's
unscale, a hook. A clip is judged by its factor alone (finite gradients times a finite factor stay
finite: one number on the device); anything else has the gradients it changed probed as the update
starts, read with the step's one transfer. A member of :class:`~torchdebug.nonfinite.sentinel.Sentinel`
(``sentinel.edits``), handed the step's state with each call.
"""

from __future__ import annotations

import contextlib
import math
import operator
import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode

from .._step import SCALER_RAN, Readout, SeenGrads, StepState
from .._tensors import finite_probe, grad_of, in_functorch_transform, local

# a watch that saw more torch calls than this between one backward() and its update (a loop that
# reads every gradient there, ~2 us a call through the watch) is not opened again in the session:
# the versions' passes cost less there
WATCH_CALLS = 32
WATCH_BLIND = 3  # ... or could not tell which gradients were written this many updates in a row
# dunder methods that write to their tensor (``name_`` in-place methods and ``out=`` are told apart
# by their names and arguments)
_WRITING_DUNDERS = frozenset(
    {"__set__", "__delete__", "__setitem__", "__delitem__", "__setstate__"}
    | {f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul")}
    | {f"__i{op}__" for op in ("and", "or", "xor", "lshift", "rshift")}
)


def writes(func: Any, kwargs: dict[str, Any] | None) -> bool:
    """True for a torch call that may write to a tensor: an in-place method or function (``mul_``,
    ``_foreach_mul_``, ``copy_``), an ``out=`` argument, an item or property write (``p.grad = g``,
    ``g[...] = 0``, ``g += 1``)."""
    name = getattr(func, "__name__", "")
    if kwargs and "out" in kwargs:
        return True
    if name.startswith("__"):
        return name in _WRITING_DUNDERS
    return name.endswith("_") or not name  # (a callable without a name: counted as a write)


class EditWatch(TorchFunctionMode):
    """Watches the torch calls between backward() and the update, for the edit check: a call that may
    write to a tensor has its target kept (``seen.written``; the gradients it reaches are probed as the
    update starts), or, when the watch cannot follow it, sets ``seen.touched`` (every gradient probed).
    A Python edit of a gradient is such a call: an in-place op on it or an alias of it (``p.grad.mul_``,
    ``p.grad.data.zero_``), an ``out=``, a write of ``p.grad``. What the watch cannot see (another
    library's C++ code, another thread, memory written through NumPy) the gradients' versions did not
    tell apart either, except a distributed all-reduce: it is not used with several processes. Costs
    nothing when no torch call runs there (a plain loop's ``loss.backward(); opt.step()``)."""

    def __init__(self, seen: SeenGrads) -> None:
        super().__init__()
        self.seen = seen
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.calls += 1
        if not self.seen.touched and writes(func, kwargs):
            # the tensor written: ``out=``, else the first argument (``self`` of a method, the list of a
            # foreach call, the parameter of a ``.grad`` write)
            self.seen.wrote(kwargs["out"] if kwargs and "out" in kwargs else args[0] if args else None)
        return func(*args, **(kwargs or {}))


class EditCheck:
    """The sentinel's check of the gradients' edits (see above): its own state is the watch's."""

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self._index: dict[int, int] = {}  # id(parameter) -> its index
        self._sharded = False  # FSDP2 DTensor parameters
        self.thread = threading.current_thread()  # the training thread (a mode lives on its stack)
        self.single = False  # one process, one model, at most one optimizer (the session says, each backward)
        self.watch: EditWatch | None = None  # open between a backward() and its update
        self.watch_off = False  # a watch saw more than WATCH_CALLS calls once: the versions from then on
        self.watch_blind = 0  # updates in a row whose watch could not tell which gradients were written

    def reindex(self, params: list[torch.Tensor], index: dict[int, int], sharded: bool) -> None:
        self.params, self._index, self._sharded = params, index, sharded

    # -- the watch between backward() and the update ------------------------------------------------
    def watches_edits(self) -> bool:
        """After this backward, watch the torch calls until the update (:class:`EditWatch`) instead of
        reading every gradient's version now and again then: one process and thread, one model and
        optimizer (``single``: the session's, set as it measures), an update through an optimizer the
        session sees (checked as it starts)."""
        return (
            self.single
            and not (self.watch_off or self._sharded)
            and threading.current_thread() is self.thread
            and not in_functorch_transform()
            and not torch.compiler.is_compiling()
        )

    def watch_edits_begin(self, st: StepState) -> None:
        """The backward's bookkeeping is done: open the watch (the gradients were seen unwatched: none)."""
        seen = st.seen
        if not seen.watched or seen.touched or self.watch is not None:
            return
        try:
            watch = EditWatch(seen)
            watch.__enter__()
        except Exception:  # the watch cannot run here: the gradients count as edited
            seen.touched = True
            return
        self.watch = watch

    def watch_edits_end(self, st: StepState, judge: bool = True) -> None:
        """Close the watch (the session's own torch work follows). ``judge``: the edit check reads it
        now; otherwise what follows goes unwatched and the gradients count as edited."""
        watch = self.watch
        seen = st.seen
        if watch is not None:
            if threading.current_thread() is self.thread:  # a mode lives on its thread's stack
                self.watch = None
                if _get_current_function_mode() is watch:
                    watch.__exit__(None, None, None)
                else:  # another mode sits on top (the user's): taken out from under it, not trusted
                    lift_mode(watch)
                    seen.touched = True
                if watch.calls > WATCH_CALLS:
                    self.watch_off = True
            else:
                seen.touched = True
        if seen.watched and not judge:
            seen.touched = True

    def probe_edits(self, st: StepState, opt: Any = None, scaler: Any = None, first: Any = None) -> None:
        """Gradients changed since backward() measured them (clipping, normalisation, unscaling, a hook):
        a finiteness probe of those only, on the device, read with this step's transfer. The usual
        answer, nothing edited, costs nothing when the calls since backward() were watched (no write
        that reaches a gradient), else three C-level passes (the gradients, their identity, the sum of
        their versions)."""
        params = self.params
        # unscaled: every gradient changed (no version bump)
        unscaled = scaler is not None and self.scaler_unscaled(st, opt, scaler, first)
        seen = st.seen
        wrote: set[int] | None = set()
        if seen.watched:  # the gradients replaced, and those the watch saw written
            wrote = None if unscaled else seen.edited_by_writes()
            # a watch blind to what was written, update after update (a loop that writes to an alias
            # or an unrelated tensor there): every gradient probed each time, the versions cost less
            self.watch_blind = self.watch_blind + 1 if wrote is None and not unscaled else 0
            self.watch_off = self.watch_off or self.watch_blind >= WATCH_BLIND
            if wrote == set() and seen.whole:
                return  # the watch saw no write that reaches a gradient: nothing read
            grads = list(map(grad_of, params))
        else:
            grads = list(map(grad_of, params))
            if not unscaled and seen.unchanged(grads):
                return
        edited = [
            i
            for i, g in enumerate(grads)
            if g is not None and (unscaled or wrote is None or i in wrote or not seen.same(i, g))
        ]
        if edited:
            st.edit_index = edited
            if len(edited) == len(params):
                plan, _ = st.transfer.plan(params)
                if plan is not None:
                    with contextlib.suppress(RuntimeError, ValueError):
                        st.edit_probe = plan.sums(grads)
                        return
            st.edit_probe = finite_probe([grads[i] for i in edited])  # type: ignore[misc]

    def before_clip(self, st: StepState, params: list[Any]) -> list[int]:
        """``clip_grad_norm_`` is about to scale these parameters' gradients: the ones backward() left
        unedited (their after-backward check stands), else []."""
        if st.read_at is not None or st.transfer.synced:
            return []  # a manual-update loop, or after the step's transfer: the probe judges the clip
        seen = st.seen
        mine = self.params
        if (
            not self._sharded
            and len(params) == len(mine)
            and all(map(operator.is_, params, mine))
            and seen.unedited(mine)
        ):
            return seen.idx  # the usual call, clip_grad_norm_(model.parameters(), ...): C-level checks
        wrote = seen.edited_by_writes() if seen.watched else set()
        if wrote is None:
            return []  # watched, and something was written it cannot follow: the probe judges the clip
        idx: list[int] = []
        for p in params:
            i = self._index.get(id(p), -1)
            g = p.grad
            if g is not None and i not in wrote and seen.same(i, g) and local(g) is g:
                idx.append(i)
        return idx

    def after_clip(
        self,
        st: StepState,
        idx: list[int],
        total: Any,
        max_norm: Any,
        scaled_all: bool = False,
        reads_late: bool = False,
    ) -> None:
        """The clip multiplied those gradients by ``min(max_norm / (total + 1e-6), 1)`` (torch's formula):
        finite gradients stay finite iff that factor is finite, so a one-element flag on the device
        replaces a probe of every gradient (read with the step's transfer; confirmed exactly if up).

        ``scaled_all``: the session ran this clip itself over every gradient backward() left, each
        scaled in place once (session/gradcheck.py): the edit check expects one more version each,
        with no pass over the gradients. Watched gradients: the watch goes on after the clip, or, for a
        clip not judged by its factor, the gradients count as edited. ``reads_late``: the step is read
        one step later (``sync="async"``)."""
        judged = self._clip_judged(st, idx, total, max_norm, reads_late)
        seen = st.seen
        if seen.watched:
            if judged:
                self.watch_edits_begin(st)
            else:
                seen.touched = True
        elif not judged:
            return
        elif scaled_all and seen.whole and idx is seen.idx:
            seen.bump += 1
        else:
            seen.rebase(idx, self.params)  # scaled by that factor: judged by the flag

    def _clip_judged(
        self, st: StepState, idx: list[int], total: Any, max_norm: Any, reads_late: bool
    ) -> bool:
        """The clip's factor is kept for the read (True), or the clip cannot be judged by it."""
        if not idx or not isinstance(total, torch.Tensor) or local(total) is not total:
            return False
        try:
            m = float(max_norm)
        except (TypeError, ValueError):
            return False
        if st.transfer.lazy and not reads_late:
            st.clips.append((total, idx, m))  # the total: its factor is worked out on the host
        elif math.isfinite(m) and abs(m) < 1e30:
            # a norm is >= 0, so m / (total + 1e-6) is finite unless total is NaN (+inf gives 0): one
            # device op (the gradients an infinite total comes from are flagged by their own probe)
            st.clips.append((torch.isnan(total), idx, None))
        else:
            with torch.no_grad():
                coef = torch.clamp(m / (total.detach().float() + 1e-6), max=1.0)
                st.clips.append((torch.isfinite(coef).logical_not(), idx, None))
        return True

    def read_edits(self, st: StepState, readout: Readout) -> list[int]:
        """After the read: the edited gradients whose probe or clip factor read non-finite (the sentinel
        confirms them exactly)."""
        bad: list[int] = []
        if st.edit_probe is not None:
            ep = item_numbers(readout.edit, len(st.edit_index))
            if not all(map(math.isfinite, ep)):  # C loop: the usual answer
                bad = [i for j, i in enumerate(st.edit_index) if not math.isfinite(ep[j])]
            st.edit_probe = None
        flags = readout.clips
        for k, (_, idx, max_norm) in enumerate(st.clips):
            # a non-finite clip factor (a flag, or worked out from the read total): every gradient it scaled
            if k < len(flags) and (flags[k] > 0 if max_norm is None else _factor_bad(flags[k], max_norm)):
                bad += [i for i in idx if i not in bad]
        st.clips = []
        return bad

    def scaler_unscaled(self, st: StepState, opt: Any, scaler: Any, first: Any = None) -> bool:
        """True once the GradScaler unscaled this step's gradients (``unscale_`` bumps no ``_version``;
        ``first``: the session's first optimizer)."""
        if scaler is None or not getattr(scaler, "is_enabled", lambda: True)():
            return False
        if st.update in SCALER_RAN:
            return True  # scaler.step() unscales before it calls the optimizer or skips it
        states = getattr(scaler, "_per_optimizer_states", {})
        for o in (opt, first):
            ost = states.get(id(o)) if o is not None else None  # .get: the defaultdict must not grow
            if ost and int(getattr(ost.get("stage"), "value", 0)) != 0:  # OptState.READY = 0
                return True
        return False


def item_numbers(numbers: list[float], n: int) -> list[float]:
    """The ``n`` numbers an item gave (zeros when it was not read)."""
    return numbers if len(numbers) == n else [0.0] * n


def _factor_bad(total: float, max_norm: float) -> bool:
    """``clip_grad_norm_``'s factor ``min(max_norm / (total + 1e-6), 1)`` is non-finite (a NaN total or
    max_norm; an Inf total gives 0), worked out on the host as torch works it out on the device."""
    try:
        return not math.isfinite(min(max_norm / (total + 1e-6), 1.0))  # min keeps a NaN in first place
    except ZeroDivisionError:
        return False  # a norm is >= 0: total + 1e-6 > 0


def lift_mode(mode: Any) -> None:
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

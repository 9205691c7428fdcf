"""What changed the gradients between backward() and the update, and whether it made them non-finite.

After backward() the session measures the gradients (their total says whether every one is finite);
the sentinel keeps which tensors backward() left and their versions (:class:`~torchdebug._step.SeenGrads`).
Code between backward() and the update may change them: a clip, a normalisation, the GradScaler's
unscale, a hook. A clip is judged by its factor alone (finite gradients times a finite factor stay
finite: one number on the device); anything else has the gradients it changed probed as the update
starts, read with the step's one transfer. A base class of :class:`~torchdebug.nonfinite.sentinel.Sentinel`.
"""

from __future__ import annotations

import contextlib
import math
import operator
from typing import Any

import torch

from .._step import Readout, SessionView, StepState
from .._tensors import finite_probe, grad_of, local


class EditCheck:
    """The sentinel's check of the gradients' edits (see above)."""

    # the sentinel's attributes these methods use (set in Sentinel.__init__)
    mon: SessionView
    active: bool
    replaying: bool
    _sharded: bool
    _index: dict[int, int]

    @property
    def st(self) -> StepState:
        raise NotImplementedError

    def scaler_unscaled(self, opt: Any) -> bool:
        raise NotImplementedError

    def grad_finite(self, i: int, now: bool = False) -> bool:
        raise NotImplementedError

    def probe_edits(self, opt: Any = None) -> None:
        """Gradients changed since backward() measured them (clipping, normalisation, unscaling, a hook):
        a finiteness probe of those only, on the device, read with this step's transfer. The usual
        answer, nothing edited (the same tensors at the same ``_version``), costs three C-level passes
        (the gradients, their identity, the sum of their versions)."""
        params = self.mon.params
        unscaled = self.scaler_unscaled(opt)  # unscaled: every gradient changed (no version bump)
        grads = list(map(grad_of, params))
        seen = self.st.seen
        if not unscaled and seen.unchanged(grads):
            return
        edited = [i for i, g in enumerate(grads) if g is not None and (unscaled or not seen.same(i, g))]
        if edited:
            self.st.edit_index = edited
            if len(edited) == len(params):
                plan, _ = self.mon.transfer.plan(params)
                if plan is not None:
                    with contextlib.suppress(RuntimeError, ValueError):
                        self.st.edit_probe = plan.sums(grads)
                        return
            self.st.edit_probe = finite_probe([grads[i] for i in edited])  # type: ignore[misc]

    def before_clip(self, params: list[Any]) -> list[int]:
        """``clip_grad_norm_`` is about to scale these parameters' gradients: the ones backward() left
        unedited (their after-backward check stands), else []."""
        if not self.active or self.replaying or self.st.synced_at_backward or self.mon.transfer.synced:
            return []  # a manual-update loop, or after the step's transfer: the probe judges the clip
        seen = self.st.seen
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

    def after_clip(self, idx: list[int], total: Any, max_norm: Any, scaled_all: bool = False) -> None:
        """The clip multiplied those gradients by ``min(max_norm / (total + 1e-6), 1)`` (torch's formula):
        finite gradients stay finite iff that factor is finite, so a one-element flag on the device
        replaces a probe of every gradient (read with the step's transfer; confirmed exactly if up).

        ``scaled_all``: the session ran this clip itself over every gradient backward() left, each
        scaled in place once (session/gradcheck.py): the edit check expects one more version each,
        with no pass over the gradients."""
        if not idx or not isinstance(total, torch.Tensor) or local(total) is not total:
            return
        try:
            m = float(max_norm)
        except (TypeError, ValueError):
            return
        if self.mon.transfer.lazy and not self.mon.reads_late:
            self.st.clips.append((total, idx, m))  # the total: its factor is worked out on the host
        elif math.isfinite(m) and abs(m) < 1e30:
            # a norm is >= 0, so m / (total + 1e-6) is finite unless total is NaN (+inf gives 0): one
            # device op (the gradients an infinite total comes from are flagged by their own probe)
            self.st.clips.append((torch.isnan(total), idx, None))
        else:
            with torch.no_grad():
                coef = torch.clamp(m / (total.detach().float() + 1e-6), max=1.0)
                self.st.clips.append((torch.isfinite(coef).logical_not(), idx, None))
        seen = self.st.seen
        if scaled_all and seen.whole and idx is seen.idx:
            seen.bump += 1
        else:
            seen.rebase(idx, self.mon.params)  # scaled by that factor: judged by the flag

    def read_edits(self, readout: Readout) -> None:
        """After the read: which edited gradients are non-finite (confirmed exactly)."""
        bad: list[int] = []
        if self.st.edit_probe is not None:
            ep = item_numbers(readout.edit, len(self.st.edit_index))
            if not all(map(math.isfinite, ep)):  # C loop: the usual answer
                bad = [i for j, i in enumerate(self.st.edit_index) if not math.isfinite(ep[j])]
            self.st.edit_probe = None
        flags = readout.clips
        for k, (_, idx, max_norm) in enumerate(self.st.clips):
            # a non-finite clip factor (a flag, or worked out from the read total): every gradient it scaled
            if k < len(flags) and (flags[k] > 0 if max_norm is None else _factor_bad(flags[k], max_norm)):
                bad += [i for i in idx if i not in bad]
        self.st.clips = []
        if bad:
            self.st.edit_bad = [i for i in sorted(bad) if not self.grad_finite(i, now=True)]


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

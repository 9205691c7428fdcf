"""The step's one host transfer: the device numbers a training step produces, read together.

During the step only device work happens: the loss of each micro-step is kept (detached), and after
each backward the gradients are reduced to one float32 per tensor (a norm, or a cheaper finiteness
probe when no instrument needs norms) plus a per-micro-step "non-finite" flag. Once per step the
session stacks these, the sentinel's probes and every instrument's ``collect()`` into one tensor and
reads it with ONE host sync (:meth:`Transfer.read`). The session's own numbers come back typed, in a
:class:`Readout` (a list per kind of item, in the order they were added); the instruments' numbers
by their names in ``values``. :meth:`Transfer.decode` turns the readout into ``loss``, ``grad_norm``,
``grad_nonfinite`` and ``amp_scale``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from operator import itemgetter
from typing import Any

import torch

from .._step import SLOTS, Readout
from .._tensors import (
    Items,
    Plan,
    Reduced,
    all_present,
    entries,
    finite_probe,
    flat_items,
    foreach_norms,
    grad_of,
    local,
    versions_of,
)

# An instrument's items read as one list each (``Transfer.vectors``), not one ``values`` key per
# element: the update ratios and weight norms of detail steps. One list slice per item, whatever the
# parameter count.
VECTORS = frozenset({"health.ratio", "health.weight"})


def stack(items: Items) -> list[torch.Tensor]:
    """The items' numbers as flat float32 tensors (FSDP2 DTensors: this rank's shard), for one read."""
    flat: list[torch.Tensor] = []
    for _, t in items:
        t = local(t)  # FSDP2: this rank's shard; anything else as it is
        if t.requires_grad:
            t = t.detach()
        if t.dim() != 1:
            t = t.reshape(-1)  # (a 1-d item as it is: no dispatcher call; on a GPU each is host time)
        flat.append(t if t.dtype is torch.float32 else t.float())
    return flat


class Transfer:
    """One step's device numbers and what was read of them (``values``); reset at each step end.

    ``grad_norm`` / ``grad_norms`` (the last step's total and per-parameter gradient norms, host
    floats; per-parameter in the order of the session's ``params``) outlive the step: the gradient
    rules read them.
    """

    def __init__(self) -> None:
        self.grad_norm: float | None = None
        self._grad_norms: list[float] | None = None
        # the per-parameter numbers of the last decoded step, not read yet: (reduction, loss scale)
        self._later: tuple[Reduced, float | None] | None = None
        # ordinary steps read one number per micro-step for the gradients (``Plan.reduce``), the
        # per-parameter numbers only when asked; False (the distributed coordinator, whose vector
        # carries per-parameter numbers and flags): one number per parameter
        self.lazy = True
        # the session's parameter list and how to reduce it (built once; rebuilt if the list changes)
        self._plan_of: tuple[list[torch.Tensor], int, Plan | None, list[int]] | None = None
        self.reset()

    def plan(self, params: list[torch.Tensor]) -> tuple[Plan | None, list[int]]:
        """The cached :class:`Plan` of ``params`` (None: the general path) and ``range(len(params))``."""
        got = self._plan_of
        if got is None or got[0] is not params or got[1] != len(params):
            plan = Plan.build(params) if params else None
            got = self._plan_of = (params, len(params), plan, list(range(len(params))))
        return got[2], got[3]

    def reset(self) -> None:
        self.loss_vals: list[torch.Tensor] = []
        self.norms: torch.Tensor | None = None  # per gradient after the last backward: norms or probe sums
        self.norm_index: list[int] = []  # which parameters ``norms`` covers
        self.norms_probe = False  # ``norms`` holds probe sums (finiteness only), not norms
        self.reduced: Reduced | None = None  # lazy: the last backward's gradients, reduced (instead of norms)
        # per micro-step: ``micro_bad`` holds the gradients' total (read into ``Readout.micro_tot``:
        # finite = ok), not a flag
        self.micro_raw: list[bool] = []
        # under DDP: ``norms`` covers this rank's share only; every parameter with a gradient, and the
        # micro-step the share measured (the coordinator fills in the other ranks' shares after the read)
        self.shared: tuple[list[int], int] | None = None
        self.micro_bad: list[torch.Tensor] = []  # per micro-step: "a gradient is non-finite" (a probe)
        self.micro_bad_cleared = False  # every flagged gradient was confirmed finite exactly
        self.scale_used: torch.Tensor | None = None  # the loss scale this step's backward saw
        self.values: dict[str, float] = {}  # the instruments' numbers (and the decoded ones), by name
        self.vectors: dict[str, list[float]] = {}  # the VECTORS items the read gave (list order)
        self.readout = Readout()  # the session's own numbers, typed
        self.synced = False
        # losses and micro-step flags already handed to a read (a step with several updates reads
        # once before each: the later reads carry only what came after)
        self.read_losses = 0
        self.read_micro = 0

    # -- during the step (device work only) -------------------------------------------------------
    def add_loss(self, loss: torch.Tensor) -> None:
        self.loss_vals.append(loss.detach())  # reduced and cast in the step's read

    def measure(
        self, params: list[torch.Tensor], probe: bool, share: list[int] | None = None, versions: bool = True
    ) -> tuple[list[int], list[torch.Tensor], list[int] | None]:
        """After a backward: one float32 per gradient (``probe``: finiteness only, else norms).

        ``share``: the parameters this rank measures when every rank holds the same gradients (DDP,
        after its all-reduce); the others' numbers arrive with the step's all-reduce. Returns every
        parameter with a gradient, those gradients and, when that is every parameter, their versions
        (the sentinel's edit check compares them), else None. ``versions=False``: not read (the edit
        check watches instead); the list is then tested for a missing gradient alone.

        The common case (every parameter has a gradient, no share) costs a few torch calls and two
        C-level passes over the list, whatever its length (:class:`Plan`)."""
        grads_all = list(map(grad_of, params))  # a C loop
        vers: list[int] | None = None  # None: not read, or a parameter has no gradient
        if share is not None:
            every_grad = False
        elif versions:
            vers = versions_of(grads_all)
            every_grad = vers is not None
        else:
            every_grad = all_present(grads_all)  # a C loop of identity tests
        if every_grad:
            plan, every = self.plan(params)
            if plan is not None:
                try:
                    if self.lazy:  # one total (finite iff every gradient is), per-parameter numbers later
                        red = plan.reduce(grads_all, square=not probe)
                    else:
                        norms = plan.sums(grads_all) if probe else plan.norms(grads_all)
                except (RuntimeError, ValueError):  # a gradient unlike its parameter (sparse, resized)
                    pass
                else:
                    if self.lazy:
                        self.take(red, every, probe)
                    else:
                        self.shared = None
                        self.norm_index, self.norms_probe = every, probe
                        self.norms, self.reduced = norms, None
                        self.micro_bad.append(torch.isfinite(norms.sum()).logical_not())
                        self.micro_raw.append(False)
                    return every, grads_all, vers
        idx = [i for i, g in enumerate(grads_all) if g is not None]
        if not idx:
            return [], [], None
        grads: list[torch.Tensor] = [grads_all[i] for i in idx]
        mine, own = idx, grads
        self.shared = None
        if share is not None:
            has = set(idx)
            mine = [i for i in share if i in has]
            own = [params[i].grad for i in mine]  # type: ignore[misc]
            self.shared = (idx, len(self.micro_bad))
        if own:
            norms = finite_probe(own) if probe else foreach_norms(own)
        else:  # a share without gradients: nothing to measure here
            norms = torch.zeros(0, device=grads[0].device)
        self.norms, self.norm_index, self.norms_probe, self.reduced = norms, mine, probe, None
        self.micro_bad.append(torch.isfinite(norms.sum()).logical_not())
        self.micro_raw.append(False)
        return idx, grads, vers if len(idx) == len(params) else None

    def take(self, red: Reduced, every: list[int], probe: bool) -> None:
        """A micro-step's gradients reduced to one total (``red``, every parameter in order), by
        :meth:`measure` or by a clip that carried the check (its per-tensor norms and total)."""
        self.shared = None
        self.norm_index, self.norms_probe = every, probe
        self.norms, self.reduced = None, red
        self.micro_bad.append(red.total)
        self.micro_raw.append(True)

    def items(self, scaler: Any) -> Items:
        """The step's own numbers, for the read."""
        items: Items = []
        for lv in self.loss_vals[self.read_losses :]:
            items.append(("_loss", lv if lv.numel() == 1 else lv.float().mean()))  # non-scalar: its mean
        if self.norms is not None:
            items.append(("_gnorm", self.norms))
        raw = self.micro_raw
        n = len(raw)
        if n == self.read_micro + 1:  # one micro-step since the last read: no comprehension (every step)
            items.append(("_mtot" if raw[-1] else "_mbad", self.micro_bad[-1]))
        elif n > self.read_micro:
            items += [("_mtot" if raw[i] else "_mbad", self.micro_bad[i]) for i in range(self.read_micro, n)]
        self.read_losses, self.read_micro = len(self.loss_vals), len(self.micro_bad)
        scale_t = self.scale_used
        if scale_t is None and scaler is not None:
            scale_t = getattr(scaler, "_scale", None)
        if isinstance(scale_t, torch.Tensor):
            items.append(("_scale", scale_t))
        return items

    def per_tensor_items(self) -> Items:
        """The last backward's per-parameter numbers as an item for this step's read, when only their
        total was kept for it (detail steps: the gradient rules want every parameter's norm)."""
        red = self.reduced
        if red is None or self.norms is not None or red.total.is_meta:  # meta: no values (sync says so)
            return []
        return [("_gnorm", red.per())]

    @property
    def grad_norms(self) -> list[float] | None:
        """The last step's per-parameter gradient norms (probe sums under the sentinel alone), in the
        order of the session's ``params``; read from the device when first asked (a host read) where
        the step read only their total."""
        later = self._later
        if later is not None:
            self._later = None
            red, scale = later
            per = red.per().tolist()  # a host read, only when per-parameter numbers are wanted
            self._grad_norms = [x / scale for x in per] if scale else per
        return self._grad_norms

    @grad_norms.setter
    def grad_norms(self, value: list[float] | None) -> None:
        self._later = None
        self._grad_norms = value

    def keep_norms(self, other: Transfer) -> None:
        """The last norms of ``other`` (read or not yet) as this transfer's own."""
        self.grad_norm, self._grad_norms, self._later = other.grad_norm, other._grad_norms, other._later

    def norms_later(self) -> Callable[[], list[float] | None]:
        """``grad_norms`` as they are now, read only if the returned function is called."""
        later, now = self._later, self._grad_norms
        if later is None:
            return lambda: now
        box: list[list[float]] = []

        def get() -> list[float] | None:
            if not box:
                red, scale = later
                per: list[float] = red.per().tolist()  # a host read, when asked
                box.append([x / scale for x in per] if scale else per)
            return box[0]

        return get

    # -- the read ------------------------------------------------------------------------------
    def read(self, items: Items) -> None:
        """The host sync: every item's numbers into ``values`` (an n-element item as ``name#0..n-1``),
        those named in :data:`VECTORS` into ``vectors`` as one list each.

        Cost: a few small torch calls per item (there are a handful) and ONE device-to-host copy
        (``tolist``): on a GPU, the step's one blocking read."""
        if not items:
            return
        sizes, flat = flat_items(items)
        host = flat.tolist()  # the host sync
        self.unpack(list(zip(map(itemgetter(0), items), sizes)), host)  # (name, size) each, C-level

    def unpack(self, spec: list[tuple[str, int]], host: list[float]) -> None:
        """Numbers read on the host (``spec``: each item's name and size, in order) into the
        :class:`Readout` (the session's own items), ``vectors`` and ``values`` (also for
        ``sync="async"``, which reads them one step later)."""
        values, vectors, readout = self.values, self.vectors, self.readout
        # what each read gives anew (the step's losses and micro-step flags add up over its reads)
        readout.gnorm, readout.edit, readout.clips, readout.dist = [], [], [], []
        readout.param_probe, readout.late_edit = [], []
        off = 0
        for name, n in spec:
            slot = SLOTS.get(name)
            if name == "_mtot":  # a micro-step's gradient total: finite iff none of its gradients is bad
                x = host[off]
                readout.micro_tot.append(x)
                readout.micro_bad.append(0.0 if math.isfinite(x) else 1.0)
            elif slot is not None:
                getattr(readout, slot).extend(host[off : off + n])
            elif name == "_scale":
                readout.scale = host[off]
            elif name in VECTORS:
                vectors[name] = host[off : off + n]
            elif n == 1:
                values[name] = host[off]
            else:
                values.update({f"{name}#{i}": x for i, x in enumerate(host[off : off + n])})
            off += n

    def vector(self, name: str, n: int) -> list[float]:
        """The ``n`` numbers the instrument's item ``name`` gave (zeros for a missing item)."""
        got = self.vectors.get(name)
        if got is not None and len(got) == n:
            return got
        return entries(self.values, name, n)

    def fill_shares(self, whole: list[float]) -> None:
        """After the read, under a DDP share: every parameter's number from ``whole`` (the step's
        all-reduced entries, one per parameter of the session), as if this rank had measured them all;
        the shared micro-step's flag is raised when any rank's share holds a non-finite number."""
        if self.shared is None:
            return
        idx, micro = self.shared
        nums = [whole[i] for i in idx]
        r = self.readout
        r.gnorm = nums
        flag = 1.0 if any(not math.isfinite(x) for x in nums) else 0.0
        if micro < len(r.micro_bad):
            r.micro_bad[micro] = flag
        else:
            r.micro_bad.extend([0.0] * (micro - len(r.micro_bad)) + [flag])
        self.norm_index = idx

    def losses_bad(self) -> list[int]:
        """Micro-steps whose loss was non-finite (after the read)."""
        return [i for i, x in enumerate(self.readout.losses) if not math.isfinite(x)]

    def any_loss_bad(self) -> bool:
        """A non-finite loss in this step, this rank's or (the coordinator's exact round) another rank's."""
        return self.readout.any_loss_bad()

    def micro_flagged(self) -> bool:
        """A micro-step's gradients read as non-finite and the exact check did not clear them."""
        if self.micro_bad_cleared:  # the usual answer, without a pass over the values
            return False
        return any([x > 0 for x in self.readout.micro_bad])

    def unread(self) -> bool:
        """Losses or micro-steps came after the last read (a step with several updates)."""
        return len(self.micro_bad) > self.read_micro or len(self.loss_vals) > self.read_losses

    def first_bad_micro(self) -> int | None:
        """The first micro-step whose gradient flag is up (after the read), or None."""
        return next((i for i, x in enumerate(self.readout.micro_bad) if x > 0), None)

    def decode(
        self,
        params: list[torch.Tensor],
        grad_finite: Callable[[int], bool],
        scaled: bool,
        also_bad: Iterable[int] = (),
    ) -> None:
        """``loss``, per-parameter and total gradient norms, ``grad_nonfinite`` and ``amp_scale``.

        ``grad_finite(i)`` confirms parameter i's gradient exactly when its number read as non-finite
        (a float32 sum of finite values can overflow); ``scaled``: a GradScaler scaled the loss, so
        loss and norms are divided by the scale; ``also_bad``: parameters whose gradient an edit after
        backward() made non-finite (counted in ``grad_nonfinite``).
        """
        v, r = self.values, self.readout
        losses = r.losses
        scale = r.scale
        if losses:
            v["loss"] = sum(losses) / len(losses)
            if scale and scaled:
                v["loss"] = v["loss"] / scale  # the loss backward saw was scaled
        red = self.reduced
        if red is not None and self.norms is None and not r.gnorm:
            self.micro_bad_cleared = False  # judged anew with each read's gradient numbers
            last = r.micro_tot[-1] if r.micro_tot else math.nan  # the last backward's total
            if math.isfinite(last):
                # the usual answer: the last backward's gradients are all finite (one number said so);
                # the per-parameter numbers stay on the device until someone asks (``grad_norms``)
                self.micro_bad_cleared = True
                v["grad_nonfinite"] = float(len(set(also_bad)))
                div = scale if scale and scaled else None
                self._later, self._grad_norms = (red, div), None
                if not self.norms_probe:
                    total = last if red.root else math.sqrt(last)
                    total = total / div if div else total
                    v["grad_norm"] = total
                    self.grad_norm = total
                red = None
            else:  # rare: a non-finite total; the per-parameter numbers say which (a second host read)
                r.gnorm = red.per().tolist()
        if self.norms is not None or red is not None:
            self.micro_bad_cleared = False  # judged anew with each read's gradient numbers
            n_params = len(params)
            gn = r.gnorm if len(r.gnorm) == len(self.norm_index) else [0.0] * len(self.norm_index)
            whole = len(self.norm_index) == n_params  # every parameter measured (norm_index is 0..n-1)
            per = list(gn) if whole else [0.0] * n_params
            if not whole:
                for j, i in enumerate(self.norm_index):
                    per[i] = gn[j]
            # A float32 sum (probe) or sum of squares (norm) of finite values can overflow: confirm
            # every non-finite entry exactly before it counts (a host read, on this rare path only).
            all_finite = all(map(math.isfinite, per))  # C loop: the usual answer
            if not all_finite:
                for i in [i for i in self.norm_index if not math.isfinite(per[i])]:
                    if grad_finite(i):
                        g = params[i].grad
                        per[i] = (
                            0.0
                            if self.norms_probe or g is None
                            else float(torch.linalg.vector_norm(g.double()))
                        )
            if scale and scaled:  # measured after backward on the scaled gradients: report true norms
                per = [x / scale for x in per]
            gn = per if whole else [per[i] for i in self.norm_index]
            self.grad_norms = per
            bad_after_backward = (
                set() if all_finite else {i for i in self.norm_index if not math.isfinite(per[i])}
            )
            if not bad_after_backward:
                self.micro_bad_cleared = True
            # the parameters whose gradient was non-finite after backward() or when the update started
            also = set(also_bad)
            v["grad_nonfinite"] = float(len(bad_after_backward | also) if also or bad_after_backward else 0)
            if self.norms_probe:
                gn = []  # sums, not norms: nothing to report beyond finiteness
            if gn:
                total = (
                    math.sqrt(sum([x * x for x in gn]))
                    if all(map(math.isfinite, gn))
                    else (math.nan if any(map(math.isnan, gn)) else math.inf)
                )
                v["grad_norm"] = total
                self.grad_norm = total
        if scale is not None:
            v["amp_scale"] = scale

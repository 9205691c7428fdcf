"""Tensor helpers of the hot path, shared by the session and the sentinel (core: imports only torch).

FSDP2 DTensors are read through their local shard (no communication); gradients and parameters are
reduced on the device to one float32 per tensor (norms, or a cheaper finiteness probe) so the step's
one host transfer (``session.transfer.Transfer.read``) reads a handful of numbers.
"""

from __future__ import annotations

import itertools
import operator
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

Items = list[tuple[str, torch.Tensor]]  # named device numbers for the step's one host read


def dtensor_type() -> type | None:
    """The DTensor class once ``torch.distributed.tensor`` has been imported, else None.

    Importing that module costs ~0.5 s of CPU (it pulls in sympy), so torchdebug never imports it:
    a DTensor (an FSDP2 parameter) cannot exist before its module was imported by the user's code,
    so until then nothing can be one. One dict lookup per call.
    """
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def local(t: Any) -> Any:
    """A DTensor's local shard (FSDP2 parameters and gradients); anything else as it is. No copy."""
    dtensor = dtensor_type()
    if dtensor is not None and isinstance(t, dtensor):
        return t._local_tensor  # type: ignore[attr-defined]  # not to_local(): no autograd node, no communication
    return t


_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def stored_values(t: Any) -> Any:
    """A sparse tensor's stored values as a dense tensor (COO: ``_values()``; CSR/CSC/BSR/BSC:
    ``values()``; no copy), which hold every NaN/Inf it has (its implicit zeros are finite); anything
    else as it is. ``torch.isfinite`` and the sums below have no sparse kernels."""
    if isinstance(t, torch.Tensor) and t.layout is not torch.strided:
        if t.layout is torch.sparse_coo:
            return t._values()
        if t.layout in _COMPRESSED:
            return t.values()
    return t


def local_shards(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``local`` over a list; the list itself when it holds no DTensor (the common case, no copy)."""
    dtensor = dtensor_type()
    if dtensor is None or not any(isinstance(t, dtensor) for t in tensors):
        return tensors
    return [local(t) for t in tensors]


def foreach_norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Per-tensor L2 norms as one float32 device tensor; no host sync.

    Hot path: all dense float32 on one device (the common case): a BLAS dot per tensor on CPU,
    the fused ``torch._foreach_norm`` elsewhere; anything else through
    :func:`torchdebug.stats.foreach_norms`. Callers confirm non-finite entries exactly.
    """
    tensors = local_shards(tensors)  # FSDP2 DTensors: this rank's shard
    first = tensors[0]
    if all(
        t.dtype is torch.float32 and t.device == first.device and t.layout is torch.strided for t in tensors
    ):
        with torch.no_grad():
            if first.device.type == "cpu" and all(t.is_contiguous() for t in tensors):
                # CPU: a BLAS dot per tensor is ~1.6x faster than the foreach norm (which is not fused
                # there); its float32 sum of squares can overflow: callers confirm non-finite entries
                return torch.stack([torch.dot(t.view(-1), t.view(-1)) for t in tensors]).sqrt()
            return torch.stack(torch._foreach_norm(tensors))
    from .stats import foreach_norms as general

    return general(tensors)


def finite_probe(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One float32 per tensor that is finite iff the tensor is (a false alarm is possible: see below).

    CPU: a plain sum per tensor, one memory pass and about half the cost of a norm; a finite sum
    proves every element finite. A sum of finite values that overflows reads as non-finite: the
    caller confirms flagged tensors exactly. Accelerators: the fused foreach norm (one kernel).
    """
    if not tensors:  # no trainable parameters (none, or all frozen): nothing to check
        return torch.zeros(0)
    tensors = local_shards(tensors)  # FSDP2 DTensors: this rank's shard
    if tensors[0].device.type != "cpu":
        return foreach_norms(tensors)
    with torch.no_grad():
        return torch.stack([_probe_one(t) for t in tensors])


def _probe_one(t: torch.Tensor) -> torch.Tensor:
    t = stored_values(t)  # a sparse gradient (nn.Embedding(sparse=True)): its stored values
    if t.is_floating_point():
        return t.sum(dtype=torch.float32)
    if t.is_complex():  # real and imaginary parts: a NaN in either is a NaN gradient
        return torch.view_as_real(t).sum(dtype=torch.float32)
    return t.new_zeros((), dtype=torch.float32)  # integer tensors hold no NaN/Inf


SMALL = 1 << 15  # elements: tensors up to this size are reduced together on the CPU (see Plan)
STACKED = 16  # small tensors of one shape and dtype, at least this many: stacked, not flattened (Plan)
grad_of: Callable[[Any], Any] = operator.attrgetter("grad")  # map(grad_of, params): a C loop, no Python frame
version_of: Callable[[Any], int] = operator.attrgetter("_version")


def versions_of(tensors: list[Any]) -> list[int] | None:
    """Every tensor's ``_version`` (one C-level pass), or None when one of them is None (no gradient):
    the test for a missing gradient and the versions the edit check keeps, in one pass."""
    try:
        return list(map(version_of, tensors))
    except AttributeError:
        return None


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)  # not in every torch build: then never alone
_ALONE: list[int] = []  # a fresh tensor's storage use count, as alone() reads it (measured once)


def alone(t: Any) -> bool:
    """No other tensor shares ``t``'s memory: its storage's use count is a fresh tensor's (a view, a
    ``.detach()`` or ``.data`` alias, a tensor autograd saved, all raise it). False when unknown."""
    if _USE_COUNT is None or not isinstance(t, torch.Tensor):
        return False
    try:
        if not _ALONE:
            fresh = torch.empty(1)  # alive while its count is read
            _ALONE.append(_USE_COUNT(fresh.untyped_storage()._cdata))
        return bool(_USE_COUNT(t.untyped_storage()._cdata) <= _ALONE[0])
    except Exception:  # no storage (sparse, a subclass without one): unknown
        return False


def all_present(tensors: list[Any]) -> bool:
    """No None in the list (one C-level pass of identity tests: ``None in`` would compare tensors)."""
    return all(map(operator.is_not, tensors, itertools.repeat(None)))


# True inside a torch.func transform (grad, vmap): reads the thread's dispatch keys only. Not
# ``torch._C._functorch.maybe_current_level()``: asking for the level creates functorch's thread-local
# state, which every autograd node of every later backward then deep-copies (~1,000 instructions a
# node: +0.2% on the GPT-2 proxy's plain step, docs/benchmarks.md).
in_functorch_transform: Callable[[], bool] = torch._C._are_functorch_transforms_active


# ``torch._utils._flatten_dense_tensors`` without its Python frame (every step: the gradients' copy)
_flatten: Callable[..., torch.Tensor] = torch._C._nn.flatten_dense_tensors


def _inverse(order: list[int]) -> torch.Tensor | None:
    """The indices that put results laid out in ``order`` (a permutation of the list's positions)
    back in list order (``index_select``); None when ``order`` is the list's own."""
    if order == list(range(len(order))):
        return None
    inverse = [0] * len(order)
    for j, i in enumerate(order):
        inverse[i] = j
    return torch.tensor(inverse, dtype=torch.long)


def _getter(idx: list[int]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """``f(seq) -> tuple(seq[i] for i in idx)`` in C (``itemgetter`` returns a bare item for one index)."""
    if len(idx) == 1:
        i = idx[0]
        return lambda seq: (seq[i],)
    if not idx:
        return lambda seq: ()
    return operator.itemgetter(*idx)


class Plan:
    """How one fixed list of tensors (a session's parameters, or their gradients: the same shapes) is
    reduced per step with a handful of torch calls, whatever its length: built once, cached.

    On the CPU torch's foreach kernels are a loop of ordinary kernels (a dispatch, ~1-3 us, per
    tensor), so the small tensors are copied into few buffers and reduced at once: those sharing a
    shape and dtype with at least ``STACKED - 1`` others (a deep stack of equal layers) with one
    ``torch.stack`` per shape (~0.2 us per tensor: no view is made; per-tensor numbers with one
    row-wise ``sum``), the rest flattened into one buffer (``_flatten_dense_tensors``: one call, but
    a view per tensor, ~1 us each; per-tensor numbers with one ``segment_reduce``). Tensors over
    ``SMALL`` elements are reduced one by one without a copy (their kernels cost more than the launch). Elsewhere (CUDA ...) the fused
    ``torch._foreach_norm`` (one kernel per chunk of tensors). ``None`` from :meth:`build` when the
    list does not fit (mixed devices, complex, sparse, non-float, DTensor shards): callers then take
    the general path.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.n = len(tensors)
        self.device = tensors[0].device
        self.one_dtype = len({t.dtype for t in tensors}) == 1  # (a gradient has its parameter's dtype)
        self.cpu = self.device.type == "cpu"
        numel = [t.numel() for t in tensors]
        small = [i for i, k in enumerate(numel) if 0 < k <= SMALL]
        by_shape: dict[tuple[Any, ...], list[int]] = {}
        if self.cpu:
            for i in small:
                by_shape.setdefault((tuple(tensors[i].shape), tensors[i].dtype), []).append(i)
        # (getter, count) per shape stacked; the stacked tensors' indices in stacking order
        self.stacks = [(_getter(ix), len(ix)) for ix in by_shape.values() if len(ix) >= STACKED]
        stacked = [i for ix in by_shape.values() if len(ix) >= STACKED for i in ix]
        gone = set(stacked)
        self.small = [i for i in small if i not in gone]  # flattened
        self.big = [i for i, k in enumerate(numel) if k > SMALL]
        self.small_get = _getter(self.small)
        self.big_get = _getter(self.big)
        self.small_total = sum(numel[i] for i in self.small)
        self.lengths = torch.tensor([numel[i] for i in self.small], dtype=torch.long)
        # the per-tensor result in list order: [flattened..., stacked..., big..., zeros for empty
        # tensors] -> order
        order = self.small + stacked + self.big + [i for i, k in enumerate(numel) if k == 0]
        self.empty = self.n - len(self.small) - len(stacked) - len(self.big)
        self.inverse = _inverse(order)
        # the update ratio's snapshot (snapshot, update_norms): every tensor up to SMALL elements first,
        # in list order (one segment_reduce over them), then the big ones (a dot each)
        snap_small = [i for i, k in enumerate(numel) if k <= SMALL]
        self.snap_small = len(snap_small)
        self.snap_small_get = _getter(snap_small)
        self.snap_get = _getter(snap_small + self.big)
        self.snap_small_total = sum(numel[i] for i in snap_small)
        self.snap_lengths = torch.tensor([numel[i] for i in snap_small], dtype=torch.long)
        self.big_numel = [numel[i] for i in self.big]
        self.snap_inverse = _inverse(snap_small + self.big)

    @staticmethod
    def build(tensors: Sequence[torch.Tensor]) -> Plan | None:
        if not tensors:
            return None
        dev = tensors[0].device
        dtensor = dtensor_type()
        for t in tensors:
            if (
                (dtensor is not None and isinstance(t, dtensor))
                or t.layout is not torch.strided
                or not t.is_floating_point()
                or t.device != dev
            ):
                return None
        if dev.type != "cpu" and (
            len({t.dtype for t in tensors}) > 1
            or tensors[0].dtype not in (torch.float32, torch.float16, torch.bfloat16)
        ):
            return None  # the fused norm takes one dtype and a float32 result: else the general path
        return Plan(tensors)

    def _flat(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
        if not self.small:
            return None
        small = self.small_get(tensors)
        flat = _flatten(small)  # one copy (of several; one tensor: a view, read only)
        if flat.numel() != self.small_total:
            raise ValueError("tensor sizes changed since the plan was built")
        return flat

    def _stacked(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The stacked shapes' copies, float32, one row per tensor (one ``torch.stack`` per shape)."""
        out = []
        for get, k in self.stacks:
            s = torch.stack(get(tensors)).view(k, -1)  # a new tensor: the tensors may change later
            out.append(s if s.dtype is torch.float32 else s.float())
        return out

    def norms(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Per-tensor L2 norms, float32, in list order; no host sync. A float32 sum of squares can
        overflow for finite inputs: callers confirm non-finite entries exactly."""
        with torch.no_grad():
            if not self.cpu:
                return torch.stack(torch._foreach_norm(list(tensors), dtype=torch.float32))  # fused
            parts: list[torch.Tensor] = []
            flat = self._flat(tensors)
            if flat is not None:
                flat = flat.float()
                parts.append(torch.segment_reduce(flat * flat, "sum", lengths=self.lengths))
            for s in self._stacked(tensors):
                parts.append((s * s).sum(1))
            for t in self.big_get(tensors):
                v = t.reshape(-1).float()
                parts.append(torch.dot(v, v).reshape(1))  # BLAS, no copy for float32
            return self._order(parts).sqrt()

    def sums(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Per-tensor float32 sums in list order (a finiteness probe: a finite sum proves the tensor
        finite; a sum of finite values can overflow, so callers confirm non-finite entries exactly);
        no host sync."""
        with torch.no_grad():
            if not self.cpu:
                return self.norms(tensors)  # the fused norm: one kernel, the same finiteness
            parts: list[torch.Tensor] = []
            flat = self._flat(tensors)
            if flat is not None:
                parts.append(torch.segment_reduce(flat.float(), "sum", lengths=self.lengths))
            parts += [s.sum(1) for s in self._stacked(tensors)]
            parts += [t.sum(dtype=torch.float32).reshape(1) for t in self.big_get(tensors)]
            return self._order(parts)

    def total(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The sum of every element of the list, float32, shape ``(1,)``: finite iff every tensor is
        (or, rarely, a sum of finite values overflows: callers confirm exactly); no host sync."""
        return self.reduce(tensors, square=False).total.reshape(1)

    def snapshot(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Every tensor copied into one flat buffer (one call): the small ones first, then the big ones.
        The weights before an update, which :meth:`update_norms` turns into the update's norms."""
        with torch.no_grad():
            ts = self.snap_get(tensors)
            if len(ts) == 1:  # torch's flatten of one tensor is a view of it: update_norms writes here
                return torch.clone(ts[0], memory_format=torch.contiguous_format).view(-1)
            return _flatten(ts)

    def update_norms(
        self, snap: torch.Tensor, tensors: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-tensor L2 norms (float32, list order) of each tensor's change since :meth:`snapshot` took
        ``snap``, and of the tensors now; no host sync. ``snap`` is overwritten with the change: the
        update's norms cost one copy of the tensors in all, the snapshot's (and a copy of the small
        tensors, which one segment_reduce reads). Each big tensor: one in-place subtraction and two BLAS
        dots, no copy. A float32 sum of squares can overflow: non-finite entries are not proof."""
        with torch.no_grad():
            delta: list[torch.Tensor] = []
            weight: list[torch.Tensor] = []
            k = self.snap_small_total
            if self.snap_small:
                now = _flatten(self.snap_small_get(tensors))  # one copy, of the small tensors only
                if now.numel() != k:
                    raise ValueError("tensor sizes changed since the plan was built")
                d = snap.narrow(0, 0, k).sub_(now).float()
                now = now.float()
                delta.append(torch.segment_reduce(d * d, "sum", lengths=self.snap_lengths))
                weight.append(torch.segment_reduce(now * now, "sum", lengths=self.snap_lengths))
            if self.big:
                views = snap.narrow(0, k, snap.numel() - k).split(self.big_numel)
                for v, t in zip(views, self.big_get(tensors), strict=True):  # the big tensors: a few
                    v = v.sub_(t.reshape(-1)).float()
                    t = t.reshape(-1).float()
                    delta.append(torch.dot(v, v).reshape(1))
                    weight.append(torch.dot(t, t).reshape(1))
            d2 = torch.cat(delta) if len(delta) > 1 else delta[0]
            w2 = torch.cat(weight) if len(weight) > 1 else weight[0]
            if self.snap_inverse is not None:
                d2, w2 = d2.index_select(0, self.snap_inverse), w2.index_select(0, self.snap_inverse)
            return d2.sqrt(), w2.sqrt()

    def reduce(self, tensors: Sequence[torch.Tensor], square: bool) -> Reduced:
        """The list reduced for the step's read: one float32 total on the device now (the sum of every
        element, or with ``square`` of their squares), the per-tensor numbers only if asked
        (:meth:`Reduced.per`). No host sync.

        CPU: one flatten of the small tensors (a copy, kept for :meth:`Reduced.per`) and one BLAS call
        over it (``sum`` or ``dot``); the per-tensor ``segment_reduce`` (as slow as a few dozen
        small kernels: a scalar loop over every element) waits until someone needs the per-tensor
        numbers (detail steps, a non-finite total). Elsewhere the fused foreach norm (one kernel per
        chunk of tensors) gives the per-tensor numbers at once and the total from them."""
        with torch.no_grad():
            if not self.cpu:
                per = self.norms(tensors)
                return Reduced(self, square, None, [], per.square().sum() if square else per.sum(), per)
            flat = self._flat(tensors)
            stacked = self._stacked(tensors)
            big: list[torch.Tensor] = []
            for t in self.big_get(tensors):
                v = t.reshape(-1).float()
                big.append((torch.dot(v, v) if square else v.sum()).reshape(1))  # now: the tensor may change
            parts = []
            if flat is not None:
                flat = flat.float()
                parts.append(torch.dot(flat, flat) if square else flat.sum())
            for s in stacked:
                v = s.view(-1)
                parts.append(torch.dot(v, v) if square else v.sum())
            if not parts and not big:
                total = torch.zeros(())
            elif len(parts) == 1 and not big:
                total = parts[0]
            else:
                total = torch.cat([p.reshape(1) for p in parts] + big).sum()
            return Reduced(self, square, flat, big, total, None, stacked)

    def _order(self, parts: list[torch.Tensor]) -> torch.Tensor:
        if self.empty:
            parts.append(torch.zeros(self.empty))
        out = torch.cat(parts) if len(parts) > 1 else parts[0]
        return out if self.inverse is None else out.index_select(0, self.inverse)


class Reduced:
    """One list of tensors reduced by :meth:`Plan.reduce`: ``total`` (a float32 device scalar: the sum of
    every element, or of their squares, ``square``), and :meth:`per`, the per-tensor numbers in list
    order (sums, or L2 norms), worked out on the device when first asked. Holds the flat copy of the
    small tensors until then (the tensors themselves may have changed since)."""

    __slots__ = ("_per", "big", "flat", "plan", "root", "square", "stacked", "total")

    def __init__(
        self,
        plan: Plan,
        square: bool,
        flat: torch.Tensor | None,
        big: list[torch.Tensor],
        total: torch.Tensor,
        per: torch.Tensor | None,
        stacked: list[torch.Tensor] | None = None,
        root: bool = False,
    ) -> None:
        self.plan, self.square, self.flat, self.big, self.total, self._per = (
            plan,
            square,
            flat,
            big,
            total,
            per,
        )
        self.stacked = stacked or []  # the stacked shapes' copies (Plan._stacked)
        self.root = root  # ``total`` is the L2 norm itself, not the sum of squares (a clip's total)

    def per(self) -> torch.Tensor:
        """Per-tensor float32 sums (``square`` False) or L2 norms, in list order; no host sync."""
        if self._per is None:
            plan, flat = self.plan, self.flat
            with torch.no_grad():
                parts: list[torch.Tensor] = []
                if flat is not None:
                    parts.append(
                        torch.segment_reduce(
                            flat * flat if self.square else flat, "sum", lengths=plan.lengths
                        )
                    )
                parts += [(s * s).sum(1) if self.square else s.sum(1) for s in self.stacked]
                parts += self.big
                out = plan._order(parts) if parts else torch.zeros(plan.n)
                self._per = out.sqrt() if self.square else out
            self.flat, self.big, self.stacked = None, [], []
        return self._per


def flat_items(items: Items) -> tuple[list[int], torch.Tensor]:
    """The items' numbers as one flat float tensor on the first item's device (FSDP2 DTensors: this
    rank's shard) and each item's size: one torch call for an ordinary step's 0-d items (``stack``),
    two for a handful of 0-d and 1-d items."""
    dtensor = dtensor_type()  # (``local`` inlined: one lookup for the items, not one each)
    ts = [
        t if dtensor is None or not isinstance(t, dtensor) else t._local_tensor  # type: ignore[attr-defined]
        for _, t in items
    ]
    sizes = [t.numel() for t in ts]
    with torch.no_grad():  # the result never needs a graph (the items are read, not differentiated)
        dev = ts[0].device
        if any([t.dim() > 1 or t.device != dev for t in ts]):
            ts = [t.reshape(-1).to(dev) for t in ts]
        if len(ts) == 1:
            flat = ts[0].reshape(-1)
        elif not any([t.dim() for t in ts]):  # every item 0-d (an ordinary step): no view per item
            flat = torch.stack(ts)  # stack promotes dtypes as cat does
        else:
            flat = torch.cat(torch.atleast_1d(ts))  # cat promotes dtypes
        if not flat.is_floating_point():  # flags only (bool) or counts: read as floats
            flat = flat.float()
    return sizes, flat


def unwrap_optimizer(opt: Any) -> Any:
    """The torch optimizer inside a framework's wrapper (Lightning's ``LightningOptimizer._optimizer``,
    accelerate's ``AcceleratedOptimizer.optimizer``); anything else unchanged."""
    for _ in range(4):  # wrappers nest at most a few deep
        attrs = getattr(opt, "__dict__", None) or {}  # not getattr: LightningOptimizer forwards lookups
        inner = attrs.get("_optimizer", attrs.get("optimizer"))
        if not isinstance(inner, torch.optim.Optimizer):
            return opt
        opt = inner
    return opt


def optimizer_state_tensors(
    optimizers: Iterable[Any], names: dict[int, str]
) -> list[tuple[Any, str, str, torch.Tensor]]:
    """``(optimizer, parameter name, state key, tensor)`` of every floating, non-empty, non-meta state
    tensor of ``optimizers`` (framework wrappers unwrapped), in parameter-group order; ``names`` maps
    ``id(parameter)`` to its name (``"?"`` when absent). A Python walk of the state: not for a per-step
    path (callers cache it, or run it on a rare path)."""
    out: list[tuple[Any, str, str, torch.Tensor]] = []
    for opt in map(unwrap_optimizer, optimizers):
        for g in opt.param_groups:
            for p in g["params"]:
                for key, t in opt.state.get(p, {}).items():
                    if (
                        isinstance(t, torch.Tensor)
                        and t.is_floating_point()
                        and t.numel()
                        and local(t).device.type != "meta"
                    ):
                        out.append((opt, names.get(id(p), "?"), str(key), t))
    return out


def entries(values: dict[str, float], name: str, n: int) -> list[float]:
    """The ``n`` numbers an item called ``name`` gave (``name#i``, or ``name`` alone when n == 1)."""
    return [values[f"{name}#{i}"] if f"{name}#{i}" in values else values.get(name, 0.0) for i in range(n)]

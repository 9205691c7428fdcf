"""Exact op-level localisation of the first NaN/Inf: the tracer, ``locate_nonfinite`` and step replay.

The tracer stacks three instruments for the duration of one step:

* module forward hooks on every module of the model: which module is running, and a bounded ring
  of module frames (input/output magnitude ranges);
* a ``TorchFunctionMode``: the user's source line of each torch call, and which autograd nodes that
  call created (so a backward op can be traced to the forward line that made its node);
* a ``TorchDispatchMode``: every aten op's outputs are checked; an op that makes a non-finite value
  its inputs did not hold is an event. Non-finite storages are tainted with the event that produced
  them; an op whose output is finite (a ``where``, a mask, relu's backward) drops the taint. Only a
  symptom counts (README glossary): a non-finite loss, a non-finite gradient reaching a leaf (an
  ``AccumulateGrad`` pre-hook), a weight or buffer made NaN, the optimizer update; its storage's taint
  names the origin. Writing an explicit +-inf constant (masked_fill, where, full with inf) is not an
  origin; an Inf made by overflow (exp, a float16 cast or matmul) is, also when a later op turns it
  into NaN (that op is kept as ``Anomaly.noticed``).

Cost: every op's outputs are reduced and read on the host, so a traced step runs 2-4x a plain step
on CPU (more on GPU where each read is a sync). It runs only in ``locate_nonfinite`` and in the
sentinel's replay of a failing step.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import math
import sys
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from .._errors import TorchDebugWarning
from .._frames import format_frames, raw_user_frames, user_location, user_stack
from .._installs import optimizer_hooks
from .._tensors import stored_values
from .._trees import map_tensors, tensor_leaves
from ..events import Anomaly, ModuleFrame, Phase
from ..memory.analysis import storage_key
from ..stats import TensorStats, analyze_tensor
from .hints import Evidence, gather, make_hint
from .tied import label_tied, tied_labels

# Ops that never introduce values (views, copies of metadata): skipping them saves a reduction each.
_PASS_THROUGH = {
    "aten::detach",
    "aten::view",
    "aten::_unsafe_view",
    "aten::t",
    "aten::transpose",
    "aten::permute",
    "aten::expand",
    "aten::alias",
    "aten::unsqueeze",
    "aten::squeeze",
    "aten::reshape",
    "aten::slice",
    "aten::select",
    "aten::split",
    "aten::split_with_sizes",
    "aten::chunk",
    "aten::unbind",
    "aten::as_strided",
    "aten::lift_fresh",
    "aten::_to_copy",
    "aten::clone",
    "aten::copy_",
    "aten::contiguous",
    "aten::empty_like",
    "aten::empty",
    "aten::zeros_like",
    "aten::ones_like",
    "aten::new_empty_strided",
    "aten::empty_strided",
}


# Copies that may change dtype: a narrowing cast (float32 -> float16) overflows, so these are checked
# (not passed through) whenever the dtype changes.
_CASTS = {"aten::_to_copy", "aten::copy_"}


@dataclass
class _Flags:
    nan: int = 0
    posinf: int = 0
    neginf: int = 0

    @property
    def bad(self) -> bool:
        return bool(self.nan or self.posinf or self.neginf)

    @property
    def inf(self) -> bool:
        return bool(self.posinf or self.neginf)

    @property
    def kind(self) -> str:
        if self.nan:
            return "nan"
        return "inf" if self.posinf else "-inf"


_SPARSE = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def _checkable(t: Any) -> bool:
    """A floating tensor with values to check: strided, or sparse (its stored values are checked)."""
    return (
        isinstance(t, torch.Tensor)
        and (t.is_floating_point() or t.is_complex())
        and (t.layout == torch.strided or t.layout in _SPARSE)
        and t.device.type != "meta"
        and t.numel() > 0
    )


def _flags(t: torch.Tensor) -> _Flags:
    """Counts of NaN/+Inf/-Inf (a sparse tensor's: of its stored values); a single reduction when the
    tensor is finite (the common case)."""
    with torch._C.DisableTorchFunction():
        x = stored_values(t.detach())
        if x.is_complex():
            x = torch.view_as_real(x)
        # A finite sum proves every element finite (one pass, no mask); an overflowing sum of finite
        # values falls through to the exact count below. Host read: replay only.
        if math.isfinite(float(x.sum(dtype=torch.float64 if x.dtype == torch.float64 else torch.float32))):
            return _Flags()
        x = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        return _Flags(int(torch.isnan(x).sum()), int(torch.isposinf(x).sum()), int(torch.isneginf(x).sum()))


def _storage_key(t: torch.Tensor) -> Any:
    """The memory ``t`` lives in (device and address; views share it), or the tensor itself when it has none."""
    return storage_key(t) or ("id", id(t))


class _Taints:
    """Non-finite storages -> the event that made them, keyed by storage address.

    Each entry holds a weak reference to its storage: once that storage is freed the entry is void, so
    a tensor the allocator later places at the same address (made by code the trace does not see, such
    as the autograd engine's gradient accumulation) does not inherit a stale origin.
    """

    def __init__(self) -> None:
        self._d: dict[Any, tuple[_Event, Any]] = {}

    def _live(self, key: Any) -> _Event | None:
        item = self._d.get(key)
        if item is None:
            return None
        ev, ref = item
        if ref is not None and ref.expired():
            del self._d[key]
            return None
        return ev

    def put(self, t: torch.Tensor, key: Any, ev: _Event) -> None:
        self._d[key] = (ev, _weak_storage(t))

    def setdefault(self, t: torch.Tensor, key: Any, ev: _Event) -> None:
        if self._live(key) is None:
            self.put(t, key, ev)

    def get(self, key: Any, default: _Event | None = None) -> _Event | None:
        ev = self._live(key)
        return default if ev is None else ev

    def __contains__(self, key: Any) -> bool:
        return self._live(key) is not None

    def __getitem__(self, key: Any) -> _Event:
        ev = self._live(key)
        if ev is None:
            raise KeyError(key)
        return ev

    def pop(self, key: Any, default: _Event | None = None) -> _Event | None:
        item = self._d.pop(key, None)
        return default if item is None else item[0]

    def values(self) -> list[_Event]:
        return [ev for k in list(self._d) if (ev := self._live(k)) is not None]

    def __bool__(self) -> bool:
        return bool(self._d)


def _weak_storage(t: torch.Tensor) -> Any:
    """A weak reference to the storage ``t`` lives in (``expired()`` once it is freed), or None."""
    try:
        from torch.multiprocessing.reductions import StorageWeakRef

        return StorageWeakRef(t.untyped_storage())
    except Exception:  # no plain storage (wrapper subclasses): the entry is keyed by the tensor's id
        return None


@functools.lru_cache(maxsize=512)
def _write_positions(func: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments an op writes to (``Tensor(a!)`` in its schema)."""
    return tuple(
        (i, a.name)
        for i, a in enumerate(func._schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an in-place op wrote (a list's items for multi-tensor ops), in order."""
    out: list[torch.Tensor] = []
    for i, name in _write_positions(func):
        a = args[i] if i < len(args) else kwargs.get(name)
        out.extend(tensor_leaves(a))
    return out


def _foreach_item(args: tuple, i: int) -> list[torch.Tensor]:
    """The inputs of item ``i`` of a multi-tensor op: the i-th of each tensor list, and lone tensors."""
    out: list[torch.Tensor] = []
    for a in args:
        if isinstance(a, (list, tuple)) and len(a) > i and isinstance(a[i], torch.Tensor):
            out.append(a[i])
        elif isinstance(a, torch.Tensor):
            out.append(a)
    return [t for t in out if _checkable(t)]


def _more_inf(out: _Flags, t: torch.Tensor, ins: list[torch.Tensor], flags: list[_Flags]) -> bool:
    """The output holds a larger share of +-Inf than any input: the op wrote new ones (a share, not a
    count, so broadcasting a mask over a batch is not writing)."""
    share = (out.posinf + out.neginf) / max(1, t.numel())
    return all((f.posinf + f.neginf) / max(1, x.numel()) < share for x, f in zip(ins, flags))


def _has_inf_scalar(args: Iterable[Any]) -> bool:
    for a in args:
        if isinstance(a, float) and math.isinf(a):
            return True
        if isinstance(a, (list, tuple)) and _has_inf_scalar(a):
            return True
    return False


@dataclass
class _Event:
    """A place where a non-finite value was born (internal; turned into an Anomaly at the end)."""

    seq: int
    phase: str
    module: str
    module_type: str
    op: str
    location: str | None
    stack: tuple[str, ...]
    kind: str
    tensor: TensorStats | None
    inputs: tuple[TensorStats, ...]
    explicit: bool = False  # an explicit +-inf constant written on purpose (masks): never an origin
    related: _Event | None = None
    # A NaN made from an Inf that an overflow (not a mask) produced: that overflow is the origin and
    # this event is where the value became NaN (``Anomaly.noticed``).
    cause: _Event | None = None
    frames: tuple[ModuleFrame, ...] = ()
    parameter: str | None = None
    hint: str = ""
    evidence: Evidence | None = None  # what the hint is derived from (hints.py)
    said: str = ""  # the symptom's words when this event is the origin (an input's: which input, rows)


@dataclass
class _NodeInfo:
    module: str
    module_type: str
    location: str | None
    stack: tuple[str, ...]


class _FunctionLayer(TorchFunctionMode):
    """Source lines of torch calls, and which autograd nodes each call created."""

    def __init__(self, tracer: Tracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        tr = self.tracer
        if func in (torch.Tensor.backward, torch.autograd.backward):
            # The engine's own ops are backward ops: do not count them as inside a torch call.
            tr.backward_ran = True
            tr.on_backward_call(args[0] if args else kwargs.get("tensors"))
            saved, tr.fn_depth = tr.fn_depth, 0
            try:
                out = func(*args, **kwargs)
            finally:
                tr.fn_depth = saved
            if tr.after_backward is not None:
                tr.after_backward()  # may raise (a facade stops the step here, before any update)
            return out
        if tr.fn_depth == 0:
            if tr.location_override is not None:
                tr.call_location, tr.call_stack = tr.location_override
            else:
                # the full stack is taken only where an event is made (rare); here the line alone
                tr.call_location, tr.call_stack = user_location(sys._getframe(1)), ()
                tr.call_frame = sys._getframe(1)
        tr.fn_depth += 1
        try:
            out = func(*args, **kwargs)
        finally:
            tr.fn_depth -= 1
            if tr.fn_depth == 0:
                tr.call_frame = None  # do not keep frames alive
        if tr.fn_depth == 0 and torch.is_grad_enabled():
            tr.map_new_nodes(out, tr.call_location, tr.call_stack)
        return out


@contextlib.contextmanager
def _traced_function_apply(tracer: Tracer) -> Iterator[None]:
    """Custom ``autograd.Function.apply`` bypasses torch-function modes: wrap it to map its node."""
    fn_cls = torch.autograd.function.Function
    orig = fn_cls.__dict__["apply"]

    def apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
        if tracer.fn_depth > 0:
            return orig.__func__(cls, *args, **kwargs)
        loc, stack = tracer.location_override or user_stack(sys._getframe(1))
        out = orig.__func__(cls, *args, **kwargs)
        if torch.is_grad_enabled():
            tracer.map_new_nodes(out, loc, stack)
        return out

    fn_cls.apply = classmethod(apply)  # type: ignore[assignment,method-assign]
    try:
        yield
    finally:
        fn_cls.apply = orig  # type: ignore[method-assign]


class _DispatchLayer(TorchDispatchMode):
    """Checks every aten op's outputs; taints non-finite storages with their origin."""

    def __init__(self, tracer: Tracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        tr = self.tracer
        if tr.symptom is not None:
            return func(*args, **kwargs)
        name = func._schema.name
        if name in _CASTS and isinstance(args[0], torch.Tensor) and _checkable(args[0]):
            src = args[1] if name == "aten::copy_" else args[0]
            dst_dtype = args[0].dtype if name == "aten::copy_" else kwargs.get("dtype", args[0].dtype)
            if isinstance(src, torch.Tensor) and dst_dtype is not None and dst_dtype != src.dtype:
                tr.resolve_pending()
                tr.pre_inputs = None
                out = func(*args, **kwargs)
                try:  # the destination's old contents are not an input of the cast
                    tr.check_op(func, args, kwargs, [src] if _checkable(src) else [], None, out)
                except Exception as exc:  # the tracer must never break the traced step
                    tr.internal_errors.append(repr(exc))
                return out
        if name in _PASS_THROUGH:
            out = func(*args, **kwargs)
            if tr.taint:  # copies and views carry the taint of their input, no reduction needed
                tr.propagate(args, out)
            return out
        tr.resolve_pending()
        ins = [t for t in tensor_leaves((args, kwargs)) if _checkable(t)]
        pre = [_flags(t) for t in ins] if func._schema.is_mutable else None
        # An in-place op overwrites its input: keep a copy of it from before (the hint and the printed
        # inputs must describe what went in), analysed only if the op makes an event. A copy is one
        # memcpy; the optimizer's in-place ops (many, per parameter) are left out.
        tr.pre_inputs = None
        if (
            pre is not None
            and ins
            and name.endswith("_")
            and tr.phase_override is None
            and not any(f.bad for f in pre)
        ):
            with torch._C.DisableTorchFunction():
                tr.pre_inputs = [ins[0].detach().clone(), *ins[1:4]]
        out = func(*args, **kwargs)
        if tr.fn_depth == 0 and torch.is_grad_enabled():
            tr.note_recompute(out)
        try:
            tr.check_op(func, args, kwargs, ins, pre, out)
        except Exception as exc:  # the tracer must never break the traced step
            tr.internal_errors.append(repr(exc))
        return out


def _state_owners(opt: Any, param_names: dict[Any, str]) -> dict[Any, tuple[str, str]]:
    """Storage of each optimizer state tensor -> (its parameter's name, the state's key): read at an
    event (rare), when the state exists (Adam makes it inside its first step)."""
    out: dict[Any, tuple[str, str]] = {}
    if opt is None:
        return out
    with contextlib.suppress(Exception):
        for p, st in opt.state.items():
            name = param_names.get(_storage_key(p)) if isinstance(p, torch.Tensor) else None
            if name is None:
                continue
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.numel() > 1:  # not a shared scalar step count
                    out.setdefault(_storage_key(v), (name, str(k)))
    return out


class Tracer:
    """Op-level tracing of one step of ``model``; the first symptom and its origin land in ``.symptom``.

    Not re-entrant. Use as a context manager; every hook and mode is removed on exit, also on exceptions.
    """

    def __init__(
        self,
        model: nn.Module | None,
        *,
        frames: int = 16,
        optimizer: torch.optim.Optimizer | None = None,
        names: dict[nn.Module, str] | None = None,
        loss_ids: Iterable[int] = (),
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.names = (
            # "is not None": a compiled module's truth test calls its __len__, a TypeError for most models
            names
            if names is not None
            else ({m: n for n, m in model.named_modules()} if model is not None else {})
        )
        self.frames: collections.deque[ModuleFrame] = collections.deque(maxlen=max(1, frames))
        self.module_stack: list[tuple[str, str]] = []
        self.fn_depth = 0
        self.call_location: str | None = None
        self.call_stack: tuple[str, ...] = ()
        self.call_frame: Any = None
        self.location_override: tuple[str | None, tuple[str, ...]] | None = None
        self.nodes: dict[int, _NodeInfo] = {}
        self._node_refs: list[Any] = []  # keep nodes alive so their ids stay unique
        self._pending: list[tuple[torch.Tensor, _NodeInfo]] = []
        self.taint = _Taints()
        self.events: list[_Event] = []
        self.symptom: _Event | None = None
        self.symptom_text = ""
        self.noticed: _Event | None = None  # where the origin's Inf became NaN, when it did
        self.backward_ran = False
        self.pre_inputs: list[torch.Tensor] | None = None  # the running in-place op's inputs, before it
        self._root_outputs: Any = None  # the model's last forward result: a sink when no backward runs
        self.phase_override: str | None = None
        self.internal_errors: list[str] = []
        # called after each backward() the trace saw returns (the seed facades raise there, as
        # torch.autograd.detect_anomaly did); None: nothing
        self.after_backward: Callable[[], None] | None = None
        self._param_names: dict[Any, str] = {}
        if model is not None:
            for n, p in model.named_parameters(remove_duplicate=False):
                self._param_names.setdefault(_storage_key(p), n)
        self._handles: list[Any] = []
        self._stack = contextlib.ExitStack()

    # -- setup -------------------------------------------------------------------------------------
    def __enter__(self) -> Tracer:
        try:
            if self.model is not None:
                for mod in self.names:
                    self._handles.append(mod.register_forward_pre_hook(self._pre_hook))
                    self._handles.append(mod.register_forward_hook(self._post_hook))
            # through torchdebug's one pair of global hooks: a replay starts inside a session's
            # pre-hook, while torch iterates its table (_installs.py)
            self._handles.append(optimizer_hooks(self._opt_pre, self._opt_post))
            self._stack.enter_context(_traced_function_apply(self))
            self._stack.enter_context(_FunctionLayer(self))
            self._stack.enter_context(_DispatchLayer(self))
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.finish(error=exc[0] is not None)
        except Exception as err:  # the tracer must never break the traced step
            self.internal_errors.append(repr(err))
        try:
            self._stack.close()
        finally:
            for h in self._handles:
                h.remove()
            self._handles.clear()
            self.module_stack.clear()

    # -- module tracking ---------------------------------------------------------------------------
    def _pre_hook(self, mod: nn.Module, args: Any) -> None:
        self.module_stack.append((self.names.get(mod, ""), type(mod).__name__))

    def _post_hook(self, mod: nn.Module, args: Any, out: Any) -> None:
        if self.module_stack:
            self.module_stack.pop()
        if mod is self.model:
            self._root_outputs = out
        if self.symptom is None:
            try:
                with _disable_current_modes():  # our own reductions are not the model's ops
                    self.frames.append(self._frame(mod, args, out))
            except Exception as exc:
                self.internal_errors.append(repr(exc))

    def _frame(self, mod: nn.Module, args: Any, out: Any) -> ModuleFrame:
        def rng(obj: Any) -> tuple[float | None, float | None, bool]:
            ts = [t for t in tensor_leaves(obj) if _checkable(t)][:4]
            if not ts:
                return None, None, False
            with torch._C.DisableTorchFunction(), torch.no_grad():
                vals = []
                bad = False
                for t in ts:
                    a = stored_values(t.detach()).abs().float()
                    fin = torch.isfinite(a)
                    bad = bad or not bool(fin.all())
                    vals.append(torch.where(fin, a, 0).max())
                    vals.append(torch.where(fin & (a > 0), a, math.inf).min())
                v = torch.stack(vals).tolist()
            hi = max(v[0::2])
            lo = min(v[1::2])
            return (None if math.isinf(lo) else lo), hi, bad

        ilo, ihi, _ = rng(args)
        olo, ohi, obad = rng(out)
        return ModuleFrame(self.names.get(mod, ""), type(mod).__name__, "forward", ilo, ihi, olo, ohi, obad)

    def _opt_pre(self, opt: Any, args: Any, kwargs: Any) -> None:
        self.phase_override = Phase.OPTIMIZER.value
        if self.optimizer is None:
            self.optimizer = opt  # names the state tensors of the update
        if self.symptom is None:
            self._check_params("before the optimizer step")

    def _opt_post(self, opt: Any, args: Any, kwargs: Any) -> None:
        self.phase_override = None

    # -- autograd node map -------------------------------------------------------------------------
    def current_module(self) -> tuple[str, str]:
        if self.module_stack:
            return self.module_stack[-1]
        root = type(self.model).__name__ if self.model is not None else ""
        return "", root

    def map_new_nodes(self, out: Any, loc: str | None, stack: tuple[str, ...]) -> None:
        module, mtype = self.current_module()
        info = _NodeInfo(module, mtype, loc, stack)
        todo = [t.grad_fn for t in tensor_leaves(out) if t.grad_fn is not None]
        seen = 0
        while todo and seen < 10_000:
            node = todo.pop()
            if node is None or id(node) in self.nodes:
                continue
            seen += 1
            self.nodes[id(node)] = info
            self._node_refs.append(node)
            if type(node).__name__ == "AccumulateGrad":  # a gradient reaching a leaf is a symptom sink
                self._handles.append(node.register_prehook(functools.partial(self._grad_arrives, node)))
            todo.extend(nf for nf, _ in node.next_functions if nf is not None)

    def note_recompute(self, out: Any) -> None:
        """Ops replayed by a reentrant checkpoint run outside torch-function modes: the autograd layer
        attaches their nodes after this dispatch returns, so map them lazily at the next op."""
        node = torch._C._current_autograd_node()
        if node is None or "Checkpoint" not in type(node).__name__:
            return
        module, mtype = self.current_module()
        loc, stack = user_stack(sys._getframe(2))
        info = _NodeInfo(module, mtype, loc, stack)
        self._pending.extend((t, info) for t in tensor_leaves(out))

    def resolve_pending(self) -> None:
        if not self._pending:
            return
        for t, info in self._pending:
            fn = t.grad_fn
            if fn is not None and id(fn) not in self.nodes:
                self.nodes[id(fn)] = info
                self._node_refs.append(fn)
        self._pending.clear()

    # -- the check -------------------------------------------------------------------------------
    def _where(self) -> tuple[str, str, str, str | None, tuple[str, ...], Any]:
        """(phase, module, module_type, location, stack, autograd node) of the op now running."""
        self.resolve_pending()
        node = torch._C._current_autograd_node()
        recompute = False
        if node is not None:
            # Forward recompute of a checkpointed region runs while a node executes: inside the
            # reentrant CheckpointFunction's backward, or (non-reentrant) inside a torch call made by
            # an unpack hook. A custom autograd.Function's Python backward is a real backward op.
            if "Checkpoint" in type(node).__name__:
                recompute = True
            elif self.fn_depth > 0:
                recompute = not isinstance(node, torch.autograd.function.BackwardCFunction)
        if node is not None and not recompute:
            info = self.nodes.get(id(node))
            if info is not None:
                return Phase.BACKWARD.value, info.module, info.module_type, info.location, info.stack, node
            root = type(self.model).__name__ if self.model is not None else ""
            return Phase.BACKWARD.value, "", root, None, (), node
        phase = self.phase_override or Phase.FORWARD.value
        module, mtype = self.current_module()
        if self.fn_depth > 0:
            stack = self.call_stack
            if not stack and self.call_frame is not None:  # the call is still running: its frames exist
                stack = user_stack(self.call_frame)[1]
            return phase, module, mtype, self.call_location, stack, None
        loc, stack = self.location_override or user_stack(sys._getframe(3))
        return phase, module, mtype, loc, stack, None

    def check_op(
        self,
        func: Any,
        args: tuple,
        kwargs: dict,
        ins: list[torch.Tensor],
        pre: list[_Flags] | None,
        out: Any,
    ) -> None:
        outs = [t for t in tensor_leaves(out) if _checkable(t)]
        if (
            func._schema.is_mutable
        ):  # in-place multi-tensor ops (_foreach_add_) return nothing: check what they wrote
            known = {id(t) for t in outs}
            outs += [t for t in _written(func, args, kwargs) if id(t) not in known and _checkable(t)]
        if not outs:
            return
        out_flags = [_flags(t) for t in outs]
        if not any(f.bad for f in out_flags):
            for t in outs:  # an in-place op may have repaired a tainted storage (nan_to_num_)
                self.taint.pop(_storage_key(t), None)
            return
        in_flags = pre if pre is not None else [_flags(t) for t in ins]
        in_nan = any(f.nan for f in in_flags)
        in_inf = any(f.inf for f in in_flags)
        nan_root = self._root(ins, in_flags, nan=True)
        inf_root = self._root(ins, in_flags, nan=False)
        phase, module, mtype, loc, stack, node = self._where()
        op = type(node).__name__ if node is not None else f"aten.{func._schema.name.split('::')[-1]}"
        explicit = not ins or _has_inf_scalar(args) or _has_inf_scalar(kwargs.values())
        is_grad = phase == Phase.BACKWARD.value
        for idx, (t, f) in enumerate(zip(outs, out_flags)):
            key = _storage_key(t)
            if not f.bad:
                self.taint.pop(key, None)
                continue

            def make(kind: str, idx: int = idx, t: torch.Tensor = t, **kw: Any) -> _Event:
                return self._event(
                    phase,
                    module,
                    mtype,
                    op,
                    loc,
                    stack,
                    kind,
                    t,
                    ins,
                    func=func,
                    args=args,
                    out_idx=idx,
                    node=node,
                    inputs_finite=not (in_nan or in_inf),
                    **kw,
                )

            if f.nan and in_nan:  # carried on from a NaN input
                ev = nan_root or make("nan")
            elif f.nan and inf_root is not None and not inf_root.explicit:
                # an overflow's Inf became NaN here (inf-inf, inf*0): the overflow is the origin
                ev = make("nan", cause=inf_root)
            elif f.nan:  # born here; a mask's -inf (explicit) is named as related, never the origin
                ev = make("nan", related=inf_root)
            elif (
                in_inf
                and not in_nan
                and (inf_root is None or inf_root.explicit)
                and _more_inf(f, t, ins, in_flags)
            ):
                # a mask added to a mask (padding on top of causal): this op wrote -inf where its inputs
                # held none, so it is the mask that completed a fully masked row (named as related)
                ev = make(f.kind, explicit=True, related=inf_root)
            elif in_nan or in_inf:  # an Inf carried on; one the trace did not see made counts as a constant
                ev = inf_root or nan_root or make(f.kind, explicit=True)
            else:  # Inf from finite inputs: an overflow, or an explicit +-inf constant (a mask)
                ev = make(f.kind, explicit=explicit and not is_grad)
            self.taint.put(t, key, ev)
            if phase == Phase.OPTIMIZER.value:
                origin = ev if not ev.explicit else make(f.kind)
                st = origin.evidence.state if origin.evidence is not None else ""
                what = f" of {st + ' of ' if st else ''}{origin.parameter}" if origin.parameter else ""
                self._set_symptom(origin, f"{f.kind} in the optimizer update{what}, made by {op}")
                return

    def _root(self, ins: list[torch.Tensor], flags: list[_Flags], *, nan: bool) -> _Event | None:
        """The origin carried by the inputs holding NaN (``nan``) or Inf: an overflow before a mask."""
        found = [
            self.taint[k]
            for t, f in zip(ins, flags)
            if (f.nan if nan else f.inf) and (k := _storage_key(t)) in self.taint
        ]
        return min(found, key=lambda ev: (ev.explicit, ev.seq), default=None)

    def _event(
        self,
        phase: str,
        module: str,
        mtype: str,
        op: str,
        loc: str | None,
        stack: tuple[str, ...],
        kind: str,
        t: torch.Tensor,
        ins: list[torch.Tensor],
        *,
        explicit: bool = False,
        related: _Event | None = None,
        cause: _Event | None = None,
        func: Any = None,
        args: tuple = (),
        out_idx: int = 0,
        node: Any = None,
        inputs_finite: bool | None = None,
    ) -> _Event:
        if func is not None and func._schema.name.startswith("aten::_foreach_"):
            ins = _foreach_item(args, out_idx) or ins  # the failing item's inputs, not the lists' first
        with torch._C.DisableTorchFunction():
            tstats = analyze_tensor(t)
            before = self.pre_inputs if self.pre_inputs is not None and ins else ins
            istats = tuple(analyze_tensor(x) for x in before[:4])
        param = None
        state = ""
        if phase == Phase.OPTIMIZER.value:
            param, state = self._param_for(t, func, args, out_idx)
            if param is not None and self.model is not None:
                module = param.rpartition(".")[0]
                mtype = type(self.model.get_submodule(module) if module else self.model).__name__
        ev = _Event(
            seq=len(self.events),
            phase=phase,
            module=module,
            module_type=mtype,
            op=op,
            location=loc,
            stack=stack,
            kind=kind,
            tensor=tstats,
            inputs=istats,
            explicit=explicit,
            related=related,
            cause=cause,
            frames=tuple(self.frames),
            parameter=param,
        )
        if func is not None:
            try:
                ev.evidence = gather(func, args, node, inputs_finite=inputs_finite, state=state)
            except Exception as exc:  # the hint falls back to the statistics alone
                self.internal_errors.append(repr(exc))
        ev.hint = make_hint(ev)
        self.events.append(ev)
        return ev

    def _param_for(self, t: torch.Tensor, func: Any, args: tuple, out_idx: int) -> tuple[str | None, str]:
        """The parameter an optimizer op's output ``t`` belongs to, and which of its state it is (``""``:
        the parameter itself): by storage (the parameter, or a tensor of its optimizer state), else
        for a multi-tensor (``_foreach_*``) op by the list element at the same position."""
        owners = _state_owners(self.optimizer, self._param_names)
        cands = [t]
        lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
        if lists and out_idx < len(lists[0]):
            cands.append(lists[0][out_idx])  # a foreach op's i-th output comes from its lists' i-th items
        for c in cands:
            key = _storage_key(c)
            if key in self._param_names:
                return self._param_names[key], ""
            if key in owners:
                return owners[key]
        if self.optimizer is None:
            return None, ""
        # last resort: foreach ops work on the parameters that have gradients, in param-group order
        with_grad = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        if out_idx < len(with_grad):
            return self._param_names.get(_storage_key(with_grad[out_idx])), ""
        return None, ""

    def propagate(self, args: Any, out: Any) -> None:
        root = next(
            (self.taint[k] for k in (_storage_key(t) for t in tensor_leaves(args)) if k in self.taint), None
        )
        if root is not None:
            for t in tensor_leaves(out):
                self.taint.setdefault(t, _storage_key(t), root)

    def _set_symptom(self, ev: _Event, text: str) -> None:
        if self.symptom is None:
            if ev.cause is not None:  # the value became NaN here; the overflow before it is the origin
                self.noticed, ev = ev, ev.cause
            self.symptom = ev
            self.symptom_text = ev.said or text

    # -- symptoms outside ops ----------------------------------------------------------------------
    def on_backward_call(self, loss: Any) -> None:
        """``loss.backward()`` is about to run: an Inf in the loss is a symptom."""
        if self.symptom is not None:
            return
        with _disable_current_modes():  # called inside the function layer: keep our ops out of the trace
            self._check_loss(loss)

    def _check_loss(self, loss: Any) -> None:
        for t in tensor_leaves(loss):
            if not _checkable(t):
                continue
            f = _flags(t)
            if f.bad:
                root = self.taint.get(_storage_key(t))
                if root is None or root.explicit:
                    loc, stack = user_stack(sys._getframe(2))
                    cause = self._graph_origin(t)  # the loss was made before the trace: read its graph
                    root = self._event(
                        Phase.FORWARD.value, "", "", "loss", loc, stack, f.kind, t, [], cause=cause
                    )
                self._set_symptom(root, f"{f.kind} in the loss")
                return

    def _graph_origin(self, loss: torch.Tensor) -> _Event | None:
        """The op that made ``loss``'s NaN/Inf, from its autograd graph (module and line unknown)."""
        try:
            from .graph_origin import graph_origin

            found = graph_origin(loss)
            if found is None:
                return None
            kind = _flags(found.result).kind
            ev = self._event(
                Phase.FORWARD.value, "", "", found.op, None, (), kind, found.result, found.inputs
            )
            ev.module = None  # type: ignore[assignment]  # unknown (the forward was untraced), not the root
            ev.hint = (
                f"{found.op} made {kind} from finite inputs (read from the loss's autograd graph, "
                f"{found.node}); the forward ran before the traced block, so its module and line are "
                "unknown: put the forward inside the block to name them. " + ev.hint
            ).strip()
            return ev
        except Exception as exc:  # the tracer must never break the traced step
            self.internal_errors.append(repr(exc))
            return None

    def _grad_arrives(self, node: Any, grads: tuple) -> None:
        """AccumulateGrad pre-hook: a gradient about to land in a leaf's ``.grad`` (a symptom sink)."""
        if self.symptom is not None:
            return
        try:
            # our reductions are not the step's ops
            with _disable_current_modes(), torch._C.DisableTorchFunction():
                leaf = getattr(node, "variable", None)
                name = self._param_names.get(_storage_key(leaf)) if isinstance(leaf, torch.Tensor) else None
                for g in grads:
                    if isinstance(g, torch.Tensor) and _checkable(g) and (f := _flags(g)).bad:
                        self._sink(g, f, f"{f.kind} in the gradient of {name or 'a leaf tensor'}", name)
                        return
        except Exception as exc:  # the tracer must never break the traced step
            self.internal_errors.append(repr(exc))

    def _sink(self, t: torch.Tensor, f: _Flags, text: str, param: str | None = None) -> None:
        """A non-finite value reached a place that is a symptom: name the origin its storage carries."""
        root = self.taint.get(_storage_key(t))
        if root is None or root.explicit:  # made where the trace could not see (a hook, another thread)
            owner = (param or "").rpartition(".")[0]
            mod = self.model.get_submodule(owner) if self.model is not None and owner else self.model
            root = self._event(
                Phase.BACKWARD.value,
                owner,
                type(mod).__name__ if mod is not None else "",
                "",
                None,
                (),
                f.kind,
                t,
                [],
            )
            root.parameter = param
            root.hint = (
                f"{text}, but no traced op made it non-finite: it was written outside the traced ops "
                "(a tensor hook, an in-place edit under no_grad, another thread)"
            )
        self._set_symptom(root, text)

    def _made_bad(self, t: Any) -> bool:
        """``t`` holds a non-finite value that an op traced here made (not one it held before the trace)."""
        if not (isinstance(t, torch.Tensor) and _checkable(t)):
            return False
        root = self.taint.get(_storage_key(t))
        return root is not None and not root.explicit and _flags(t).bad

    def finish(self, *, error: bool = False) -> None:
        """The traced block ended: check what it leaves behind (gradients, weights, buffers, outputs).

        Called by ``__exit__``. With ``error`` (the block raised) and no symptom, the earliest
        non-finite value the block made (not a mask) is reported: it is the likelier cause.
        """
        if self.symptom is not None:
            return
        with _disable_current_modes(), torch._C.DisableTorchFunction():
            if self.model is not None:
                # only values made bad while tracing count: a stale NaN .grad of an earlier block does not
                named = self.model.named_parameters()
                grads = [(n, p.grad) for n, p in named if p.grad is not None] if self.backward_ran else []
                params = [(n, t) for n, t in self.model.named_parameters()]
                buffers = [(n, t) for n, t in self.model.named_buffers()]
                for name, t in grads + params + buffers:
                    if self.symptom is None and self._made_bad(t):
                        f = _flags(t)
                        if f.nan or not any(t is b for _, b in buffers):  # a buffer's +-Inf is a mask
                            what = "the gradient of " + name if any(t is g for _, g in grads) else name
                            self._sink(t, f, f"{f.kind} in {what} after the step", name)
            if self.symptom is None and not self.backward_ran and self._root_outputs is not None:
                for t in tensor_leaves(self._root_outputs):
                    if _checkable(t) and (f := _flags(t)).bad:
                        root = self.taint.get(_storage_key(t))
                        if root is not None and not root.explicit:
                            self._set_symptom(root, f"{f.kind} in the model's output")
                            break
            if self.symptom is None and error:
                live = [ev for ev in self.taint.values() if not ev.explicit]
                if live:
                    self._set_symptom(min(live, key=lambda ev: ev.seq), "non-finite value before the error")
        self._root_outputs = None
        self.pre_inputs = None

    def check_inputs(self, args: Any, kwargs: Any) -> None:
        """A NaN/Inf input gets an ``input`` origin: the anomaly if it reaches a symptom, nothing if the
        model replaces it before use (``torch.nan_to_num(x)``, a masked fill)."""
        for i, t in enumerate(tensor_leaves((args, kwargs))):
            if not (_checkable(t) and (f := _flags(t)).bad):
                continue
            root = type(self.model).__name__ if self.model is not None else ""  # "input of Net"
            ev = self._event(Phase.INPUT.value, "", root, "", None, (), f.kind, t, [])
            rows = bad_rows(t)
            at = f" in {rows}" if rows else ""
            ev.hint = (
                f"the batch already holds {_KIND_WORD[f.kind]}: input #{i} ({f.nan} NaN, {f.posinf} +Inf, "
                f"{f.neginf} -Inf){at}; check the data pipeline" + (" (those samples)" if rows else "")
            )
            ev.said = f"{f.kind} in input #{i}" + (f", {rows}" if rows else "")
            self.taint.put(t, _storage_key(t), ev)

    def _check_params(self, when: str) -> None:
        if self.model is None:
            return
        params = dict(self.model.named_parameters())
        for name, t in list(params.items()) + list(self.model.named_buffers()):
            if self.symptom is not None:
                return
            if not _checkable(t):
                continue
            f = _flags(t)
            if f.nan or (f.bad and name in params):  # a buffer's +-Inf is a mask, kept on purpose
                owner = name.rpartition(".")[0]
                mod = self.model.get_submodule(owner) if owner else self.model
                ev = self._event(
                    Phase.PARAMETER.value, owner, type(mod).__name__, "", None, (), f.kind, t, []
                )
                ev.parameter = name
                ev.hint = (
                    f"{name} already holds {f.nan} NaN / {f.posinf + f.neginf} Inf {when}: "
                    "loaded from a bad checkpoint or written by code outside the step"
                )
                self._set_symptom(ev, f"{f.kind} in {name} {when}")

    def check_parameters(self) -> None:
        self._check_params("before the step")

    # -- result ------------------------------------------------------------------------------------
    def anomaly(
        self,
        *,
        step: int | None = None,
        rank: int = 0,
        micro_step: int | None = None,
        detected_by: str = "locate",
    ) -> Anomaly | None:
        ev = self.symptom
        if ev is None:
            return None
        a = _to_anomaly(
            ev, self.symptom_text, step=step, rank=rank, micro_step=micro_step, detected_by=detected_by
        )
        nt = self.noticed
        if nt is not None and (nt.phase, nt.op, nt.location) != (ev.phase, ev.op, ev.location):
            noticed = _to_anomaly(
                nt,
                "",
                step=step,
                rank=rank,
                micro_step=micro_step,
                detected_by=detected_by,
                depth=1,
            )
            a = dataclasses.replace(a, noticed=noticed)
        return label_tied(a, tied_labels(self.model))  # tied weights by all their names


def _to_anomaly(
    ev: _Event,
    symptom: str,
    *,
    step: int | None,
    rank: int,
    micro_step: int | None,
    detected_by: str,
    depth: int = 0,
) -> Anomaly:
    related = None
    if ev.related is not None and depth < 3:
        related = _to_anomaly(
            ev.related,
            "",
            step=step,
            rank=rank,
            micro_step=micro_step,
            detected_by=detected_by,
            depth=depth + 1,
        )
    return Anomaly(
        phase=ev.phase,
        module=ev.module,
        op=ev.op or None,
        location=ev.location,
        kind=ev.kind,
        step=step,
        rank=rank,
        tensor=ev.tensor,
        inputs=ev.inputs,
        frames=ev.frames if depth == 0 else (),
        related=related,
        hint=ev.hint,
        module_type=ev.module_type,
        micro_step=micro_step,
        symptom=symptom,
        detected_by=detected_by,
        stack=ev.stack,
        parameter=ev.parameter,
    )


# -- public entry ----------------------------------------------------------------------------------
def locate_nonfinite(
    fn: Callable[..., Any],
    *args: Any,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    frames: int = 16,
    **kwargs: Any,
) -> Anomaly | None:
    """Run ``fn(*args, **kwargs)`` once under op-level tracing; return the origin of the first NaN/Inf.

    Typically ``fn`` does forward + loss + backward (+ ``optimizer.step()``). Inputs (the tensors in
    ``args``/``kwargs``) and the model's parameters and buffers are checked first (phases "input" and
    "parameter"). A symptom is a NaN/Inf in the loss (the tensor ``backward`` is called on, or ``fn``'s
    returned tensors), in a gradient reaching a leaf (a parameter's ``.grad``), in a weight or buffer
    (NaN) the step wrote, or made by the optimizer update; without a backward, in the model's output.
    A non-finite value that a ``where``/mask/relu drops before it reaches one is not an anomaly. The
    origin is the first op on the symptom's causal path that made a non-finite value from finite
    inputs; an explicit +-inf (a mask) never is.

    Args:
        fn: the step to run.
        model: the model, to name modules as in ``model.named_modules()`` (``""`` for the root).
        optimizer: to name the parameter an optimizer update made non-finite.
        frames: how many module frames before the origin to keep.

    Returns:
        The :class:`Anomaly`, or ``None`` when nothing went wrong.

    Raises:
        Whatever ``fn`` raises, unless a non-finite origin was found before the error (then the anomaly
        is returned: the NaN is the likelier cause).

    A compiled callable (``torch.compile``'d, or calling a compiled ``model``) is traced eagerly, whose
    numerics may differ: it is first run compiled, untraced, and what that run changed is undone (the
    weights, gradients, buffers, RNG and the state of every optimizer that stepped). When the compiled
    run is finite and the eager trace is not, a :class:`TorchDebugWarning` says that eager and compiled
    disagree and ``None`` is returned: the eager symptom is not what trains.

    Cost: every op's outputs are reduced and read on the host: 2-4x one plain step on CPU; a compiled
    callable runs once more, compiled.

    Example::

        a = td.locate_nonfinite(train_step, batch, model=model)
        if a is not None:
            print(a)   # nan born in forward of head (Linear): aten.log at train.py:41
    """
    if not callable(fn):
        raise TypeError(f"locate_nonfinite(fn, ...): fn must be callable, got {type(fn).__name__}")
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model= must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer= must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    tracer = Tracer(_uncompiled(model), frames=frames, optimizer=optimizer)
    tracer.check_inputs(args, kwargs)
    tracer.check_parameters()
    if tracer.symptom is not None:
        return tracer.anomaly()
    compiled_finite = None
    if _compiled(fn, model):  # the compiled run is what trains: judged first, then undone
        with _undone(_uncompiled(model)):
            compiled_finite = _finite_run(fn(*args, **kwargs), _uncompiled(model))
    try:
        with _eager(), tracer:
            result = fn(*args, **kwargs)
            if tracer.symptom is None:
                tracer.on_backward_call(result)
    except Exception:
        if tracer.symptom is None:
            raise
    found = tracer.anomaly()
    if found is not None and compiled_finite:
        warnings.warn(
            f"torchdebug: locate_nonfinite ran the compiled callable eagerly to trace it, and the eager "
            f"run made {found.kind} ({found.op or found.phase} at {found.location or 'an unknown line'}), "
            "but the compiled run is finite: eager and compiled numerics differ here, and the compiled "
            "run is the one that trains; nothing to locate",
            TorchDebugWarning,
            stacklevel=2,
        )
        return None
    return found


def _compiled(fn: Any, model: nn.Module | None) -> bool:
    """``fn`` is a ``torch.compile``'d function or module, or calls ``model``, which is compiled."""
    if hasattr(fn, "_torchdynamo_orig_callable") or type(fn).__name__ == "OptimizedModule":
        return True
    return model is not None and (
        _uncompiled(model) is not model or getattr(model, "_compiled_call_impl", None) is not None
    )


def _finite_run(result: Any, model: nn.Module | None) -> bool:
    """What a run left is finite: its returned tensors, and the model's weights and gradients."""
    ts = tensor_leaves(result)
    if model is not None:
        ps = list(model.parameters())
        ts += ps + [p.grad for p in ps if p.grad is not None]
    with torch.no_grad():
        return all(bool(torch.isfinite(stored_values(t.detach())).all()) for t in ts if _checkable(t))


@contextlib.contextmanager
def _undone(model: nn.Module | None) -> Iterator[None]:
    """Run a step, then put back what it changed: the model's weights, gradients and buffers, the RNG,
    and the state and weights of every optimizer that stepped (kept by a pre-hook as its step began).
    Cost: a copy of each; rare path (``locate_nonfinite`` of a compiled callable)."""
    params = list(model.parameters()) if model is not None else []
    with torch.no_grad():
        kept = [(p, p.detach().clone()) for p in params]
        grads = [(p, p.grad.detach().clone() if p.grad is not None else None) for p in params]
        buffers = [(b, b.clone()) for b in model.buffers()] if model is not None else []
    rng = torch.get_rng_state()
    rng_cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    opts: dict[int, tuple[Any, dict[str, Any]]] = {}

    def pre(opt: Any, args: Any, kwargs: Any) -> None:
        if id(opt) not in opts:
            opts[id(opt)] = (opt, copy.deepcopy(opt.state_dict()))
            with torch.no_grad():
                mine = {id(p) for p, _ in kept}
                kept.extend(
                    (p, p.detach().clone())
                    for g in opt.param_groups
                    for p in g["params"]
                    if id(p) not in mine
                )

    handle = optimizer_hooks(pre, lambda *a: None)
    try:
        yield
    finally:
        handle.remove()
        with torch.no_grad():
            for p, v in kept:
                p.copy_(v)
            for b, v in buffers:
                b.copy_(v)
        for p, g in grads:
            p.grad = g
        for opt, sd in opts.values():
            opt.load_state_dict(sd)
        torch.set_rng_state(rng)
        if rng_cuda is not None:
            torch.cuda.set_rng_state_all(rng_cuda)


def _uncompiled(model: nn.Module | None) -> nn.Module | None:
    """The module ``torch.compile`` wrapped (names without the ``_orig_mod.`` prefix), else ``model``."""
    orig = getattr(model, "_orig_mod", None) if model is not None else None
    if type(model).__name__ == "OptimizedModule" and isinstance(orig, nn.Module):
        return orig
    return model


def _eager() -> contextlib.AbstractContextManager[Any]:
    """Compiled code runs eagerly while traced: the tracer sees ops one by one, and nothing is compiled
    for the trace (``torch.compile``'d modules and functions, ``module.compile()``)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None or torch.compiler.is_compiling():  # torch < 2.6; or inside a compiled region
        return contextlib.nullcontext()
    return set_stance("force_eager")  # type: ignore[no-any-return]


# -- replay of a captured step (used by watch) -------------------------------------------------------
_any_autocast: Callable[[], bool] = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


@dataclass
class StepCapture:
    """What the sentinel keeps of one micro-step so it can be replayed exactly (references, no copies)."""

    args: tuple
    kwargs: dict
    rng_cpu: torch.Tensor
    rng_cuda: list[torch.Tensor] | None
    autocast: dict[str, tuple[bool, torch.dtype]]
    grad_enabled: bool
    outputs: Any = None
    out_grads: dict[int, torch.Tensor] = field(default_factory=dict)
    tape: list[tuple[Any, Any, tuple, dict, tuple[tuple[str, int, str], ...], Any]] = field(
        default_factory=list
    )
    tape_complete: bool = False
    loss: torch.Tensor | None = None
    loss_grad: torch.Tensor | None = None
    module: nn.Module | None = None  # the module whose forward was captured; None: the watched model
    batch: Any = None  # the whole batch as a framework driver saw it (names tensors the loss alone used)
    untaped: str = ""  # why the loss code was not recorded whole (tape_complete False), in words

    @staticmethod
    def take(args: tuple, kwargs: dict, uses_cuda: bool) -> StepCapture:
        autocast: dict[str, tuple[bool, torch.dtype]] = {}
        # no autocast region anywhere (one read of the thread's dispatch keys, every micro-step): the
        # replay enters none, as it would from every device's state read as disabled
        if _any_autocast():
            for dev in ("cpu", "cuda"):
                try:
                    autocast[dev] = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
                except Exception:  # older torch or no such backend
                    continue
        rng_cuda = None
        if uses_cuda and torch.cuda.is_available():
            rng_cuda = torch.cuda.get_rng_state_all()
        return StepCapture(args, kwargs, torch.get_rng_state(), rng_cuda, autocast, torch.is_grad_enabled())


@contextlib.contextmanager
def _autocast(state: dict[str, tuple[bool, torch.dtype]]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for dev, (enabled, dtype) in state.items():
            if enabled:
                stack.enter_context(torch.autocast(dev, dtype=dtype))
        yield


# torch-level calls that write into an argument: in-place methods (``add_``), in-place operators,
# ``out=``, and the norms that update running statistics (the positions of those statistics)
_INPLACE_OPERATORS = frozenset(
    f"__i{op}__"
    for op in (
        "add",
        "sub",
        "mul",
        "truediv",
        "floordiv",
        "mod",
        "pow",
        "matmul",
        "and",
        "or",
        "xor",
        "lshift",
        "rshift",
    )
) | {"__setitem__"}
_RUNNING_STATS = {"batch_norm": (1, 2, 3, 4), "instance_norm": (1, 2)}
_RUNNING_STAT_NAMES = ("running_mean", "running_var")


def _written_args(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors a recorded torch-level call writes into (approximately, by its name; ``[]``: none).
    ``torch.batch_norm`` takes its running statistics at 3 and 4, ``F.batch_norm`` at 1 and 2: both
    are copied (a weight or bias copied too costs a copy and changes nothing)."""
    name = getattr(func, "__name__", "")
    out: list[torch.Tensor] = []
    if (name.endswith("_") and not name.endswith("__")) or name in _INPLACE_OPERATORS:
        out += tensor_leaves(args[:1])
    if kwargs.get("out") is not None:
        out += tensor_leaves(kwargs["out"])
    if name in _RUNNING_STATS:
        out += [a for i, a in enumerate(args) if i in _RUNNING_STATS[name] and isinstance(a, torch.Tensor)]
        out += [kwargs[k] for k in _RUNNING_STAT_NAMES if isinstance(kwargs.get(k), torch.Tensor)]
    return out


def _storage_ptr(t: torch.Tensor) -> int | None:
    try:
        return int(t.untyped_storage().data_ptr())
    except Exception:  # no plain storage (wrapper subclasses, sparse): treated as the user's
        return None


def user_storages(caps: Iterable[StepCapture]) -> set[int | None]:
    """The storages of the user's tensors a replay reads: what the recorded calls and forwards took
    that no recorded call made (the batch, a label tensor, an unwatched module's buffers). A replayed
    view of one shares its storage."""
    made: set[int] = set()
    taken: list[torch.Tensor] = []
    for cap in caps:
        taken += tensor_leaves((cap.args, cap.kwargs))
        made |= {id(t) for t in tensor_leaves(cap.outputs)}
        for entry in cap.tape:
            taken += tensor_leaves((entry[2], entry[3]))
            made |= {id(t) for t in tensor_leaves(entry[5])}
    return {_storage_ptr(t) for t in taken if id(t) not in made}


def apart_from_user(tensors: Any, params: set[int], made: dict[int, torch.Tensor]) -> None:
    """Stand-ins, in ``made``, for the user's tensors in ``tensors`` that require grad and are not the
    watched parameters (an input with ``requires_grad``, an unwatched model's output or parameter):
    detached leaves of the replay's own. The replay's backward then stops there: it neither frees a
    graph of the user's still waiting for its backward nor adds to a ``.grad`` of the user's."""
    for t in tensor_leaves(tensors):
        if t.requires_grad and id(t) not in params and id(t) not in made:
            made[id(t)] = t.detach().requires_grad_()


def writes_apart(
    func: Any,
    args: tuple,
    kwargs: dict,
    made: dict[int, torch.Tensor],
    sub: Callable[[torch.Tensor], Any],
    user: set[int | None],
) -> None:
    """A recorded call that writes into a tensor of the user's (``label.fill_(0)``, an unwatched
    BatchNorm's running statistics, a replayed view of the batch) runs, in a replay, on a copy
    (entered in ``made``): the user's tensor keeps its values and its version. Known limitation: a
    write into a replayed view is not seen by its replayed base."""
    for t in _written_args(func, args, kwargs):
        cur = sub(t)
        if id(t) in made and _storage_ptr(cur) not in user:
            continue  # the replay's own tensor
        with torch.no_grad():
            copy = cur.detach().clone()
        made[id(t)] = copy.requires_grad_().clone() if cur.requires_grad else copy


@contextlib.contextmanager
def _preserved_state(
    model: nn.Module, uses_cuda: bool, start: Mapping[int, torch.Tensor] | None = None
) -> Iterator[None]:
    """Leave the user's grads, buffers and RNG exactly as they were after the replay.

    The replay runs on copies of the buffers (a BatchNorm's running statistics, its
    ``num_batches_tracked``): each module's buffer slot holds a clone while it runs and the user's
    tensor after, never written. A copy back into the user's tensor would bump its version, and a
    graph of the user's still waiting for its backward (a GAN's ``fake = G(z)``, used again after D's
    update) saved those tensors: its ``backward()`` would raise. Cost: one copy of the buffers.
    ``start``: id(buffer) -> its value as the step began (a buffer the step's forward wrote), copied
    instead of the buffer's value now.
    """
    params = list(model.parameters())
    grads = [p.grad for p in params]
    slots = [(m, k, b) for m in model.modules() for k, b in m._buffers.items() if b is not None]
    copies: dict[int, torch.Tensor] = {}  # a buffer two modules share gets one copy
    rng = torch.get_rng_state()
    rng_cuda = torch.cuda.get_rng_state_all() if uses_cuda and torch.cuda.is_available() else None
    for p in params:
        p.grad = None
    try:
        with torch.no_grad():
            for m, k, b in slots:
                if id(b) not in copies:
                    copies[id(b)] = (start or {}).get(id(b), b).clone()
                m._buffers[k] = copies[id(b)]
        yield
    finally:
        for p, g in zip(params, grads):
            p.grad = g
        for m, k, b in slots:
            m._buffers[k] = b
        torch.set_rng_state(rng)
        if rng_cuda is not None:
            torch.cuda.set_rng_state_all(rng_cuda)


def replay_capture(
    model: nn.Module,
    cap: StepCapture,
    *,
    names: dict[nn.Module, str],
    frames: int = 16,
    uses_cuda: bool = False,
    buffers: Mapping[int, torch.Tensor] | None = None,
) -> Tracer:
    """Re-run a captured micro-step (forward, loss, backward) under the tracer; returns the tracer.

    The user's parameters are untouched (the sentinel replays before the optimizer update); grads,
    buffers and RNG are restored afterwards. The loss is recomputed from the recorded tape of torch
    calls made between the model's forward and ``backward`` when complete, else the gradient that
    flowed into the model's outputs in the real step is fed back. ``buffers``: the values the buffers
    the step wrote held as it began (the replay starts from them).
    """
    tracer = Tracer(model, frames=frames, names=names)
    made: dict[int, torch.Tensor] = {}  # id(tensor of the real step) -> its replayed counterpart
    params = {id(p) for p in model.parameters()}
    apart_from_user((cap.args, cap.kwargs, [(e[2], e[3]) for e in cap.tape]), params, made)
    sub = lambda t: made.get(id(t), t)  # noqa: E731
    with _preserved_state(model, uses_cuda, buffers):
        # the batch of every forward the micro-step made (a second view's too), not what a forward
        # made; the weights and the buffers the replay starts from
        tracer.check_inputs(unmade_inputs([cap], set()) if cap.tape_complete else (cap.args, cap.kwargs), {})
        tracer.check_parameters()
        if tracer.symptom is not None:
            return tracer
        torch.set_rng_state(cap.rng_cpu)
        if cap.rng_cuda is not None:
            torch.cuda.set_rng_state_all(cap.rng_cuda)
        with _eager(), tracer, torch.set_grad_enabled(cap.grad_enabled), _autocast(cap.autocast):
            out = (cap.module if cap.module is not None else model)(
                *map_tensors(cap.args, sub), **map_tensors(cap.kwargs, sub)
            )
            if tracer.symptom is not None:
                return tracer
            loss = _rerun_tape(cap, out, tracer, made) if cap.tape_complete else None
            if loss is not None:
                loss.backward(gradient=cap.loss_grad)
                return tracer
            old = tensor_leaves(cap.outputs)
            new = tensor_leaves(out)
            pairs = [
                (n, cap.out_grads[i])
                for i, (o, n) in enumerate(zip(old, new))
                if i in cap.out_grads and n.requires_grad
            ]
            if pairs:
                taint_fed(tracer, cap, [g for _, g in pairs])
                torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
    return tracer


def taint_fed(tracer: Tracer, cap: StepCapture, grads: list[torch.Tensor]) -> None:
    """The replay feeds the gradients seen at the model's outputs (the loss code was not replayed). One
    already non-finite was made after that output: by the loss code or another forward the replay did
    not rebuild, or by the model's own backward from another of its outputs (a loss it returns). It is
    tainted with an origin that says so, ordered after every op the replay sees: a NaN the model's
    backward makes still names its op, and no op that merely carries the fed NaN is blamed."""
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        for g in grads:
            if not (_checkable(g) and (f := _flags(g)).bad):
                continue
            in_loss = cap.loss is not None and _checkable(cap.loss) and _flags(cap.loss).bad
            root = type(tracer.model).__name__ if tracer.model is not None else ""
            phase = Phase.FORWARD.value if in_loss else Phase.BACKWARD.value
            ev = tracer._event(phase, "", root, "", None, (), f.kind, g, [])
            tracer.events.remove(ev)
            ev.seq = sys.maxsize  # after every op of the replay (``_root`` takes the earliest)
            why = cap.untaped or "the loss code was not recorded"
            made = "the loss" if in_loss else "the gradient reaching the model's outputs"
            ev.hint = (
                f"{made} already held {_KIND_WORD[f.kind]} in the step, made after the model's forward (by "
                f"the loss code, another model or another call of this one), which the replay could not "
                f"rebuild: {why}"
            )
            tracer.taint.put(g, _storage_key(g), ev)


def _rerun_tape(
    cap: StepCapture, out: Any, tracer: Tracer, mapping: dict[int, torch.Tensor]
) -> torch.Tensor | None:
    if cap.loss is None:
        return None
    for o, n in zip(tensor_leaves(cap.outputs), tensor_leaves(out)):
        mapping[id(o)] = n
    sub = lambda t: mapping.get(id(t), t)  # noqa: E731
    user = user_storages([cap])
    try:
        for func, kind, args, kwargs, raw, res in cap.tape:
            if kind in (FORWARD, FORWARD_NO_GRAD):  # the model called again (a second view): its ops traced
                with torch.set_grad_enabled(kind == FORWARD and torch.is_grad_enabled()):
                    new = func(*map_tensors(args, sub), **map_tensors(kwargs, sub))
                for o, n in zip(tensor_leaves(res), tensor_leaves(new)):
                    mapping[id(o)] = n
                if tracer.symptom is not None:
                    break
                continue
            _check_loss_inputs(cap, args, kwargs, mapping, raw, tracer)
            if tracer.symptom is not None:
                break
            writes_apart(func, args, kwargs, mapping, sub, user)
            tracer.location_override = format_frames(raw)
            try:
                new = func(*map_tensors(args, sub), **map_tensors(kwargs, sub))
            finally:
                tracer.location_override = None
            for o, n in zip(tensor_leaves(res), tensor_leaves(new)):
                mapping[id(o)] = n
            if tracer.symptom is not None:
                break
    except Exception as exc:
        tracer.internal_errors.append(f"loss tape replay failed: {exc!r}")
        return None
    return mapping.get(id(cap.loss))  # None: the loss was not made by recorded calls


def unmade_inputs(caps: list[StepCapture], tape_only: set[int]) -> tuple[torch.Tensor, ...]:
    """The inputs of the recorded forwards (each capture's first, unless in ``tape_only``, and the
    forwards on its tape) that no earlier recorded call made: the batch, not G's output fed to D."""
    made: set[int] = set()
    keep: list[torch.Tensor] = []
    for j, cap in enumerate(caps):
        calls = [] if j in tape_only else [(True, cap.args, cap.kwargs, cap.outputs)]
        calls += [(e[1] in (FORWARD, FORWARD_NO_GRAD), e[2], e[3], e[5]) for e in cap.tape]
        for forward, args, kwargs, out in calls:  # in the order they ran: D(fake.detach()) after detach
            if forward:
                keep += [t for t in tensor_leaves((args, kwargs)) if id(t) not in made]
            made |= {id(t) for t in tensor_leaves(out)}
    return tuple(keep)


def _check_loss_inputs(
    cap: StepCapture, args: tuple, kwargs: dict, made: dict[int, torch.Tensor], raw: Any, tracer: Tracer
) -> None:
    """A NaN in a tensor the loss code used that neither the model nor the loss code made (a per-token
    weight from the batch) entered with the batch: phase ``input``, named by its place in the batch.
    Only NaN: an explicit +-Inf (a mask) is ordinary and left to the tracer."""
    for t in tensor_leaves((args, kwargs)):
        if id(t) in made or not _checkable(t) or t.requires_grad:
            continue  # made by the replay, not floating point, or a parameter (checked before the replay)
        f = _flags(t)
        if not f.nan:
            continue
        path = _batch_path(cap.batch, t)
        name = path or "a tensor the loss code used (not made by the model)"
        loc, stack = format_frames(raw)
        ev = tracer._event(Phase.INPUT.value, "", "", "", loc, stack, f.kind, t, [])
        with torch._C.DisableTorchFunction():
            ev.tensor = analyze_tensor(t, name)
            rows = bad_rows(t, nan_only=True)
        count = f"{f.nan} NaN" + (f" in {rows}" if rows else "")
        line = loc or "an unknown line"
        if path is not None:
            ev.hint = (
                f"the batch already holds NaN in {path}: {count}; used only by the loss code at {line}; "
                "check the data pipeline"
            )
        else:  # said once: which code used it, and that neither the model nor that code made it
            ev.hint = (
                f"the loss code at {line} used a tensor that already held NaN: {count}; neither the model "
                "nor the loss code made it, so it came with the batch: check the data pipeline"
            )
        tracer._set_symptom(ev, f"nan in {name}" + (f", {rows}" if rows else ""))
        return


_ROWS_SHOWN = 5
_KIND_WORD = {"nan": "NaN", "inf": "+Inf", "-inf": "-Inf"}


def bad_rows(t: torch.Tensor, nan_only: bool = False) -> str:
    """Which rows (indices along dim 0, the batch) of ``t`` hold NaN/Inf: ``"rows 2, 5 (2 of 8 rows)"``,
    the first few and the count; ``""`` for a scalar or a single row. The index is what finds the bad
    sample (file, line) in a dataset. Rare path: one reduction and a host read."""
    if t.dim() == 0 or t.shape[0] < 2 or t.layout != torch.strided:
        return ""  # (a sparse tensor: its stored values hold no rows)
    with torch._C.DisableTorchFunction(), torch.no_grad():
        x = t.detach()
        x = torch.view_as_real(x) if x.is_complex() else x
        bad = torch.isnan(x) if nan_only else ~torch.isfinite(x)
        idx = bad.reshape(x.shape[0], -1).any(dim=1).nonzero().flatten()
        n = int(idx.numel())
        first = idx[:_ROWS_SHOWN].tolist()
    if n == 0:
        return ""
    shown = ", ".join(map(str, first)) + (", ..." if n > _ROWS_SHOWN else "")
    return f"row{'s' if n > 1 else ''} {shown} ({n} of {t.shape[0]} rows)"


def _batch_path(batch: Any, t: torch.Tensor, path: str = "batch", depth: int = 0) -> str | None:
    """Where ``t`` sits in ``batch`` (``batch[3]``, ``batch['weight']``), by identity; None if absent."""
    if batch is t:
        return path
    if depth > 4:
        return None
    items: Iterable[tuple[Any, Any]] = ()
    if isinstance(batch, Mapping):
        items = batch.items()
    elif isinstance(batch, (list, tuple)):
        items = enumerate(batch)
    for k, v in items:
        found = _batch_path(v, t, f"{path}[{k!r}]", depth + 1)
        if found is not None:
            return found
    return None


_ACCESSORS = ("__get__", "__set__", "__delete__")
# tensor properties that are views of the tensor (``z @ z.T``): recorded, so a replay takes the view of
# its own tensor (``.grad`` and ``.data`` reads are not the loss's making)
_VIEW_PROPERTIES = frozenset({"T", "mT", "H", "mH", "real", "imag"})

# a tape entry that is a model's forward called again in the micro-step (a second view, a watched
# model of several), with or without grad: its own ops are traced when it is replayed
FORWARD = "forward"
FORWARD_NO_GRAD = "forward-no-grad"


def _view_property(func: Any) -> bool:
    """``func`` is the getter of a tensor property that is a view (``Tensor.T.__get__``)."""
    owner = getattr(func, "__self__", None)
    return getattr(owner, "__name__", None) in _VIEW_PROPERTIES and getattr(owner, "__objclass__", None) in (
        torch.Tensor,
        torch._C.TensorBase,
    )


class LossTape(TorchFunctionMode):
    """Records the torch calls made between the model's forward and ``backward`` (the loss code).

    Only calls that return tensors are kept (property reads and writes such as ``optimizer.zero_grad()``
    touching ``p.grad``, and ``.item()``, are not the loss's making). Bounded: at most ``limit`` calls;
    beyond that the tape is marked incomplete and replay falls back to the gradient captured at the
    model's outputs. Cost: the mode's dispatch plus one short frame walk per recorded call.
    """

    def __init__(self, cap: StepCapture, limit: int = 64) -> None:
        super().__init__()
        self.cap = weakref.ref(cap)
        self.limit = limit
        self.recording = True

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        res = func(*args, **(kwargs or {}))
        if not self.recording or (getattr(func, "__name__", "") in _ACCESSORS and not _view_property(func)):
            return res
        if not (isinstance(res, torch.Tensor) or (isinstance(res, (tuple, list)) and tensor_leaves(res))):
            return res
        if func in (torch.Tensor.backward, torch.autograd.backward):
            return res
        cap = self.cap()
        if cap is None:
            self.recording = False
        elif len(cap.tape) >= self.limit:
            cap.tape_complete = False
            cap.untaped = f"the loss code made more than {self.limit} torch calls (the tape's limit)"
            self.recording = False
        else:
            # the innermost user frame only, raw: formatting (relpath) waits for a replay that needs it
            cap.tape.append((func, types, args, kwargs or {}, raw_user_frames(sys._getframe(1), 1), res))
        return res

"""Memory measurement usable without watch(): samples, live-tensor census, per-module tables, seed facades."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import gc
import os
import sys
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch
from torch import nn

from .._frames import _OWN_DIR, _TORCH_DIR
from .._installs import Installs
from .._trees import tensor_leaves

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_STATM: tuple[int, int] | None = None  # (pid, fd of /proc/self/statm), reopened in a forked child


def _rss() -> int:
    """This process's resident set size in bytes: ``/proc/self/statm`` read through a kept-open file
    (about 1 µs; psutil takes ~7); psutil where there is no ``/proc``. The pid is checked on every
    call: a child forked after the first read opens its own file (an inherited one is the parent's)."""
    global _STATM
    pid = os.getpid()
    try:
        if _STATM is None or _STATM[0] != pid:
            if _STATM is not None:  # a forked child's copy of the parent's descriptor
                with contextlib.suppress(OSError):
                    os.close(_STATM[1])
            _STATM = (pid, os.open("/proc/self/statm", os.O_RDONLY))
        return int(os.pread(_STATM[1], 128, 0).split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return int(psutil.Process(pid).memory_info().rss)


def _fmt_bytes(n: float | None) -> str:
    """Render bytes with a binary unit (B, KiB, MiB, GiB)."""
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    x = float(abs(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if x < 1024 or unit == "TiB":
            return f"{sign}{x:.0f} {unit}" if unit == "B" else f"{sign}{x:.1f} {unit}"
        x /= 1024
    return f"{n} B"  # unreachable; keeps type checkers calm


def storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    """(device, storage address) identifying the memory ``t`` lives in; None for tensors without storage."""
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None  # sparse, nested or wrapper subclasses have no single storage
    if ptr == 0:
        return None
    return (str(t.device), ptr)


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the storage ``t`` views (a view of a big tensor holds the whole storage alive).

    Falls back to ``numel * element_size`` for tensors without a plain storage.
    """
    try:
        return int(t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError, TypeError):
        return int(t.numel() * t.element_size())


# --------------------------------------------------------------------------------------------------
# cheap samples


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _load_mallinfo2() -> Callable[[], int] | None:
    """glibc's ``mallinfo2`` (2.33+): bytes malloc has handed out and not taken back; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    fn.argtypes = []

    def heap_in_use() -> int:
        m = fn()
        return int(m.uordblks + m.hblkhd)  # in-use heap chunks + mmapped chunks

    return heap_in_use


_HEAP_IN_USE = _load_mallinfo2()


def memory_sample() -> dict[str, int]:
    """Process RSS and, on CUDA, allocated / reserved / peak bytes, allocation retries and OOM count.

    Keys: ``rss`` always; ``heap_in_use`` on Linux with glibc (bytes malloc has handed out and not
    taken back, via ``mallinfo2``: CPU tensors live there); with CUDA initialised, for the current
    device ``cuda_allocated``, ``cuda_reserved``, ``cuda_peak`` (since the last :func:`reset_peak`),
    ``cuda_alloc_retries``, ``cuda_ooms``, and for every other visible device the same keys prefixed
    ``cuda<i>_``. All values are int bytes/counts.

    Cost: one ``/proc/self/statm`` read (~1 µs), ``mallinfo2`` where glibc has it, plus, on CUDA,
    the caching allocator's host-side counters (no device sync, no kernel).

    Example:
        >>> memory_sample()["rss"] > 0
        True
    """
    out = {"rss": _rss()}
    if _HEAP_IN_USE is not None:
        # exact bytes in use by malloc (CPU tensors live there): unlike RSS it drops when memory is
        # freed and is not hidden by free chunks the allocator reuses, so a CPU leak shows byte-exact
        out["heap_in_use"] = _HEAP_IN_USE()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        current = torch.cuda.current_device()
        for dev in range(torch.cuda.device_count()):
            stats = torch.cuda.memory_stats(dev)
            prefix = "cuda_" if dev == current else f"cuda{dev}_"
            out[prefix + "allocated"] = int(stats.get("allocated_bytes.all.current", 0))
            out[prefix + "reserved"] = int(stats.get("reserved_bytes.all.current", 0))
            out[prefix + "peak"] = int(stats.get("allocated_bytes.all.peak", 0))
            out[prefix + "alloc_retries"] = int(stats.get("num_alloc_retries", 0))
            out[prefix + "ooms"] = int(stats.get("num_ooms", 0))
    return out


def reset_peak() -> None:
    """Reset the CUDA peak-allocated counters of every device (no-op without CUDA)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for dev in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(dev)


# --------------------------------------------------------------------------------------------------
# live tensors (the expensive path: a gc walk)


@dataclass(frozen=True)
class LiveTensor:
    """One live tensor found by a gc walk: what it is, how big its storage is, what it belongs to."""

    shape: tuple[int, ...]
    dtype: str
    device: str
    bytes: int
    has_history: bool  # has a grad_fn: keeps its autograd graph (and saved activations) alive
    grad_fn: str | None
    kind: str  # "parameter" | "gradient" | "optimizer_state" | "buffer" | "other"
    owner: str = ""  # parameter/buffer name for the first four kinds
    origin: str = ""  # module / source line that made it, when a creation capture saw it

    def __str__(self) -> str:
        what = self.kind if not self.owner else f"{self.kind} {self.owner}"
        hist = f" grad_fn={self.grad_fn}" if self.grad_fn else ""
        org = f" from {self.origin}" if self.origin else ""
        return f"{_fmt_bytes(self.bytes):>10}  tensor{list(self.shape)} {self.dtype} {self.device}  {what}{hist}{org}"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        return d


def owner_map(
    model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None
) -> dict[Any, tuple[str, str]]:
    """Map storage keys to (kind, name) for parameters, their gradients, buffers and optimizer state."""
    owners: dict[Any, tuple[str, str]] = {}
    names: dict[int, str] = {}
    if model is not None:
        for name, p in model.named_parameters(remove_duplicate=True):
            names[id(p)] = name
            k = storage_key(p)
            if k is not None:
                owners[k] = ("parameter", name)
            if p.grad is not None:
                kg = storage_key(p.grad)
                if kg is not None:
                    owners[kg] = ("gradient", name)
        for name, b in model.named_buffers():
            k = storage_key(b)
            if k is not None:
                owners.setdefault(k, ("buffer", name))
    if optimizer is not None:
        for param, state in optimizer.state.items():
            pname = names.get(id(param), f"param@{id(param):x}")
            if isinstance(state, Mapping):
                for sname, v in state.items():
                    if isinstance(v, torch.Tensor):
                        k = storage_key(v)
                        if k is not None:
                            owners.setdefault(k, ("optimizer_state", f"{pname}.{sname}"))
    return owners


def live_tensors(
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    top: int | None = None,
    device: str | None = None,
    since: Mapping[int, weakref.ref[torch.Tensor]] | None = None,
) -> list[LiveTensor]:
    """Every tensor reachable by Python's gc, one per storage, largest first.

    Args:
        model, optimizer: used to label parameters, gradients, buffers and optimizer state.
        top: keep only the ``top`` largest.
        device: keep only tensors on this device type (``"cpu"``, ``"cuda"``).
        since: a :func:`tensor_census` taken earlier: keep only tensors created after it.

    Returns:
        One :class:`LiveTensor` per storage (views of one storage count once, as their largest view).

    Cost: walks every gc-tracked object (tens of ms in a big process): a diagnosis tool, never
    per step. Tensors held only by C++ (activations saved for backward whose Python object died)
    are invisible to it.

    Example:
        >>> x = torch.zeros(1024)
        >>> any(t.bytes == 4096 for t in live_tensors(top=50))
        True
    """
    owners = owner_map(model, optimizer)
    best: dict[Any, LiveTensor] = {}
    anon = 0
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads __class__, which lazy/deprecated module proxies
        # answer with a warning (torch.distributed.reduce_op) and dead weakproxies with an error
        if not issubclass(type(obj), torch.Tensor) or issubclass(type(obj), _NO_MEMORY):
            continue
        if device is not None and obj.device.type != device:
            continue
        if since is not None:
            ref = since.get(id(obj))
            if ref is not None and ref() is obj:
                continue
        key = storage_key(obj)
        if key is None:
            anon += 1
            key = ("anon", anon)
        kind, owner = owners.get(key, ("other", ""))
        info = LiveTensor(
            shape=tuple(obj.shape),
            dtype=str(obj.dtype).replace("torch.", ""),
            device=str(obj.device),
            bytes=tensor_bytes(obj),
            has_history=obj.grad_fn is not None,
            grad_fn=type(obj.grad_fn).__name__ if obj.grad_fn is not None else None,
            kind=kind,
            owner=owner,
        )
        prev = best.get(key)
        if prev is None or (obj.numel() > _numel(prev.shape)) or (info.has_history and not prev.has_history):
            best[key] = info
    out = sorted(best.values(), key=lambda t: -t.bytes)
    return out[:top] if top is not None else out


def _no_memory_types() -> tuple[type, ...]:
    """Tensor types that hold no memory of their own: torch.compile's fake and functional tensors
    (Dynamo keeps some alive in its caches; their shapes may be symbolic)."""
    out: list[type] = []
    try:
        from torch._subclasses.fake_tensor import FakeTensor

        out.append(FakeTensor)
    except ImportError:
        pass
    try:
        from torch._subclasses.functional_tensor import FunctionalTensor

        out.append(FunctionalTensor)
    except ImportError:
        pass
    return tuple(out)


_NO_MEMORY = _no_memory_types()


def tensor_census() -> dict[int, weakref.ref[torch.Tensor]]:
    """Weak references to every gc-visible tensor, by id: a baseline for ``live_tensors(since=...)``.

    Cost: a gc walk (tens of ms); holds no tensor alive.
    """
    out: dict[int, weakref.ref[torch.Tensor]] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):
            try:
                out[id(obj)] = weakref.ref(obj)
            except TypeError:
                continue
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# --------------------------------------------------------------------------------------------------
# which module is running: hooks (exact) or the Python stack (after the fact)


def module_from_frames(frame: Any, modules: Mapping[int, str], limit: int = 200) -> str | None:
    """Qualified name of the innermost module whose method is on the stack starting at ``frame``.

    ``modules`` maps ``id(module)`` to its qualified name. Walks ``f_back`` (a frame) or ``tb_next``
    (a traceback, innermost last). Returns None when no model module is running.
    """
    frames: list[Any] = []
    if hasattr(frame, "tb_frame"):  # a traceback: collect frames outermost-first, answer innermost
        tb = frame
        while tb is not None and len(frames) < limit:
            frames.append(tb.tb_frame)
            tb = tb.tb_next
        frames.reverse()
    else:
        f = frame
        while f is not None and len(frames) < limit:
            frames.append(f)
            f = f.f_back
    for f in frames:
        obj = f.f_locals.get("self") if "self" in f.f_code.co_varnames else None
        if obj is not None and id(obj) in modules:
            return modules[id(obj)]
    return None


# torchdebug frames that only pass the user's call through (the backward wrapper, the loss tape)
_PASS_THROUGH = frozenset({"wrapper", "__torch_function__", "__torch_dispatch__"})


def called_by_torchdebug(frame: Any, allow: tuple[str, ...] = (), limit: int = 60) -> bool:
    """True when the innermost frame outside torch (and our pass-through wrappers) is torchdebug's own.

    Lets dispatch/function modes tell the model's ops from the monitor's bookkeeping (gradient
    norms, flags). ``allow``: file name endings inside torchdebug that count as user code.
    """
    f = frame
    depth = 0
    while f is not None and depth < limit:
        fn = f.f_code.co_filename
        if not fn.startswith(_TORCH_DIR) and not fn.startswith("<"):
            if not fn.startswith(_OWN_DIR) or fn.endswith(allow):
                return False
            if f.f_code.co_name not in _PASS_THROUGH:
                return True
        f = f.f_back
        depth += 1
    return False


# --------------------------------------------------------------------------------------------------
# per-module tables


@dataclass(frozen=True)
class ModuleMemoryRow:
    """Bytes attributed to one module: activations it saved for backward, its own parameters, grads, state."""

    module: str
    module_type: str
    activation_bytes: int = 0
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.activation_bytes + self.param_bytes + self.grad_bytes + self.optimizer_bytes

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["total_bytes"] = self.total_bytes
        return d


@dataclass(frozen=True)
class ModuleMemoryTable:
    """Per-module memory, ranked by total bytes; ``str()`` renders the table, ``to_dict()`` is JSON-ready.

    ``activation_bytes`` per module counts each storage saved for backward once (a tensor saved by
    two ops, or a view of a saved tensor, counts once, for the first module that saved it) and leaves
    out parameters and buffers (counted in ``param_bytes``). The rows' activation bytes add up to
    ``saved_total_bytes`` exactly: both come from the same saved-tensor hook. Parameter, gradient and
    optimizer-state bytes are each module's own (``recurse=False``), so rows add up without overlap.
    ``forward_peak_bytes`` / ``backward_peak_bytes`` are CUDA allocator peaks (None on CPU).
    """

    rows: tuple[ModuleMemoryRow, ...]
    saved_total_bytes: int = 0
    step: int | None = None
    forward_peak_bytes: int | None = None
    backward_peak_bytes: int | None = None
    unattributed_bytes: int = 0  # saved outside any module of the model (e.g. the loss)

    def row(self, module: str) -> ModuleMemoryRow:
        """The row of a module by qualified name (KeyError when absent)."""
        for r in self.rows:
            if r.module == module:
                return r
        raise KeyError(module)

    @property
    def total_bytes(self) -> int:
        return sum(r.total_bytes for r in self.rows)

    def __str__(self) -> str:
        head = f"{'module':<36} {'activations':>12} {'params':>11} {'grads':>11} {'optim':>11} {'total':>11}"
        lines = [
            f"per-module memory{'' if self.step is None else f' (step {self.step})'}",
            head,
            "-" * len(head),
        ]
        for r in self.rows:
            label = r.module or f"<root {r.module_type}>"
            lines.append(
                f"{label[:36]:<36} {_fmt_bytes(r.activation_bytes):>12} {_fmt_bytes(r.param_bytes):>11} "
                f"{_fmt_bytes(r.grad_bytes):>11} {_fmt_bytes(r.optimizer_bytes):>11} {_fmt_bytes(r.total_bytes):>11}"
            )
        lines.append(f"saved for backward: {_fmt_bytes(self.saved_total_bytes)}")
        if self.forward_peak_bytes is not None:
            lines.append(
                f"CUDA peak: forward {_fmt_bytes(self.forward_peak_bytes)}, backward {_fmt_bytes(self.backward_peak_bytes)}"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "saved_total_bytes": self.saved_total_bytes,
            "unattributed_bytes": self.unattributed_bytes,
            "forward_peak_bytes": self.forward_peak_bytes,
            "backward_peak_bytes": self.backward_peak_bytes,
            "rows": [r.to_dict() for r in self.rows],
        }


def _own_bytes(
    module: nn.Module, optimizer: torch.optim.Optimizer | None, seen: set[int]
) -> tuple[int, int, int]:
    """(param, grad, optimizer-state) bytes of ``module``'s own parameters; shared ones count once (``seen``)."""
    pb = gb = ob = 0
    for p in module.parameters(recurse=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        pb += p.numel() * p.element_size()
        if p.grad is not None:
            gb += p.grad.numel() * p.grad.element_size()
        if optimizer is not None:
            state = optimizer.state.get(p)
            if isinstance(state, Mapping):
                for v in state.values():
                    if isinstance(v, torch.Tensor):
                        ob += v.numel() * v.element_size()
    return pb, gb, ob


def module_memory_table(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    activation_bytes: Mapping[str, int] | None = None,
    *,
    saved_total_bytes: int | None = None,
    unattributed_bytes: int = 0,
    step: int | None = None,
    forward_peak_bytes: int | None = None,
    backward_peak_bytes: int | None = None,
) -> ModuleMemoryTable:
    """Build the ranked per-module table from the model's parameters, grads, optimizer state and activations.

    Args:
        model: its ``named_modules()`` give the rows.
        optimizer: its ``state`` gives optimizer bytes per parameter.
        activation_bytes: saved-for-backward bytes per module (from :class:`SavedTensorTracker`).

    Cost: metadata only (no device work), O(parameters).
    """
    acts = dict(activation_bytes or {})
    seen: set[int] = set()
    rows = []
    for name, mod in model.named_modules():
        pb, gb, ob = _own_bytes(mod, optimizer, seen)
        a = acts.get(name, 0)
        if pb or gb or ob or a:
            rows.append(ModuleMemoryRow(name, type(mod).__name__, a, pb, gb, ob))
    rows.sort(key=lambda r: (-r.total_bytes, r.module))
    total = sum(acts.values()) + unattributed_bytes if saved_total_bytes is None else saved_total_bytes
    return ModuleMemoryTable(
        rows=tuple(rows),
        saved_total_bytes=total,
        step=step,
        forward_peak_bytes=forward_peak_bytes,
        backward_peak_bytes=backward_peak_bytes,
        unattributed_bytes=unattributed_bytes,
    )


class SavedTensorTracker:
    """Attribute bytes saved for backward to the innermost running module of ``model``.

    While active, forward pre/post hooks on every module keep a stack of running modules and a
    ``saved_tensors_hooks`` pack hook records each saved tensor's storage once (keyed by device and
    storage address: a tensor saved twice, or two views of one storage, count once, for the first
    module that saved it). Parameters and buffers are not activations and are left out. The pack
    hook hands autograd a ``detach()``-ed alias (same storage, no copy): returning the tensor itself
    would make a reference cycle through ``grad_fn`` that frees the graph only at the next gc.

    Use as a context manager around forward passes (hooks installed on enter, removed on exit, also
    on exceptions). ``reset()`` forgets counts between micro-steps: storage addresses can be reused
    once a backward has freed the previous graph.

    Attributes:
        by_module: bytes per qualified module name (root is ``""``).
        outside: bytes saved while no model module was running.
        total: all bytes the pack hook saw (``sum(by_module) + outside``).

    Cost: a Python call per module call and per saved tensor; opt-in, for a few steps.

    Known limitations: tensors a custom ``autograd.Function`` keeps as ``ctx`` attributes (not
    through ``save_for_backward``) are invisible to the hook; activation-checkpointed regions save
    only their inputs (what they really keep).

    Example:
        >>> m = torch.nn.Linear(4, 2)
        >>> with SavedTensorTracker(m) as tr:
        ...     _ = m(torch.ones(3, 4))
        >>> tr.by_module[""]  # Linear saves its input: 3*4*4 bytes
        48
    """

    def __init__(self, model: nn.Module, installs: Installs | None = None) -> None:
        self.model = model
        self.installs = installs if installs is not None else Installs()
        self.names = {id(m): n for n, m in model.named_modules()}
        self.by_module: dict[str, int] = {}
        self.outside = 0
        self.total = 0
        self._stack: list[str] = []
        self._seen: set[Any] = set()
        self._skip: set[Any] = set()
        self._handles: list[Any] = []
        self._ctx: Any = None
        self.active = False

    # hooks
    def _pre(self, module: nn.Module, args: Any) -> None:
        self._stack.append(self.names.get(id(module), ""))

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._stack:
            self._stack.pop()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key is None:
            key = ("id", id(t))
        if key not in self._seen and key not in self._skip:
            self._seen.add(key)
            n = tensor_bytes(t)
            self.total += n
            if self._stack:
                name = self._stack[-1]
                self.by_module[name] = self.by_module.get(name, 0) + n
            else:
                self.outside += n
        return t.detach()

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def reset(self) -> None:
        """Forget counts and seen storages (call at the start of each micro-step)."""
        self.by_module.clear()
        self.outside = 0
        self.total = 0
        self._seen.clear()
        self._stack.clear()
        self._skip = {
            k for t in (*self.model.parameters(), *self.model.buffers()) if (k := storage_key(t)) is not None
        }

    def start(self) -> None:
        """Install hooks and enter the saved-tensor hook (idempotent)."""
        if self.active:
            return
        self.reset()
        # The context first: under torch.func.grad it refuses (saved-tensor hooks are disabled there),
        # and then no module hook may be left registered.
        ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self.installs.enter(ctx)
        self._ctx = ctx
        add = self.installs.hook
        for m in self.model.modules():
            self._handles.append(add(m.register_forward_pre_hook(self._pre)))
            self._handles.append(add(m.register_forward_hook(self._post, always_call=True)))
        self.active = True

    def stop(self) -> None:
        """Leave the saved-tensor hook and remove every module hook (idempotent)."""
        if not self.active:
            return
        self.active = False
        try:
            if self._ctx is not None:
                self.installs.leave(self._ctx)  # on its own thread; elsewhere it went with its thread
        finally:
            self._ctx = None
            for h in self._handles:
                self.installs.remove(h)
            self._handles.clear()
            self._stack.clear()

    def __enter__(self) -> SavedTensorTracker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def measure_module_memory(
    model: nn.Module,
    *args: Any,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    backward: bool = True,
    **kwargs: Any,
) -> ModuleMemoryTable:
    """Run one forward (and backward) of ``model(*args, **kwargs)`` and return the per-module memory table.

    Args:
        model: the model (its gradients are left as they were: saved and restored).
        optimizer: to count optimizer-state bytes per module.
        loss_fn: ``loss_fn(output) -> scalar``; default: sum of every floating output tensor.
        backward: run backward too (gives the CUDA backward peak).

    Returns:
        A :class:`ModuleMemoryTable`.

    Cost: one forward/backward with a Python hook per module call and per saved tensor.

    Example:
        >>> m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU())
        >>> table = measure_module_memory(m, torch.ones(2, 4))
        >>> table.row("1").activation_bytes  # ReLU saves its (2, 8) float output
        64
    """
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    old_grads = [(p, p.grad) for p in model.parameters()]
    fwd_peak = bwd_peak = None
    try:
        if cuda:
            reset_peak()
        with SavedTensorTracker(model) as tr:
            out = model(*args, **kwargs)
        if cuda:
            fwd_peak = int(torch.cuda.max_memory_allocated())
            reset_peak()
        if backward:
            if loss_fn is not None:
                loss = loss_fn(out)
            else:
                leaves = [t for t in tensor_leaves(out) if t.is_floating_point() and t.requires_grad]
                if not leaves:
                    raise ValueError(
                        "the model's output has no floating tensor that requires grad; pass loss_fn="
                    )
                loss = torch.stack([t.sum() for t in leaves]).sum()
            loss.backward()
            if cuda:
                bwd_peak = int(torch.cuda.max_memory_allocated())
        table = module_memory_table(
            model,
            optimizer,
            tr.by_module,
            saved_total_bytes=tr.total,
            unattributed_bytes=tr.outside,
            forward_peak_bytes=fwd_peak,
            backward_peak_bytes=bwd_peak,
        )
    finally:
        for p, g in old_grads:
            p.grad = g
    return table


# --------------------------------------------------------------------------------------------------
# seed-era names


def debug_memory_usage(
    *, rss_threshold_bytes: int | None = None, cuda_threshold_bytes: int | None = None
) -> dict[str, Any]:
    """Current host and CUDA memory, with warnings for thresholds you set (none by default).

    Args:
        rss_threshold_bytes: warn when the process RSS exceeds it.
        cuda_threshold_bytes: warn when CUDA allocated bytes (current device) exceed it.

    Returns:
        ``{"rss": int, "system_percent": float, "cuda_allocated": int, ..., "warnings": [str]}``
        (CUDA keys only with CUDA; see :func:`memory_sample`).

    Example:
        >>> debug_memory_usage(rss_threshold_bytes=1)["warnings"][0].startswith("process RSS")
        True
    """
    out: dict[str, Any] = dict(memory_sample())
    out["system_percent"] = float(psutil.virtual_memory().percent)
    warnings: list[str] = []
    if rss_threshold_bytes is not None and out["rss"] > rss_threshold_bytes:
        warnings.append(f"process RSS {_fmt_bytes(out['rss'])} exceeds {_fmt_bytes(rss_threshold_bytes)}")
    if cuda_threshold_bytes is not None and out.get("cuda_allocated", 0) > cuda_threshold_bytes:
        warnings.append(
            f"CUDA allocated {_fmt_bytes(out['cuda_allocated'])} exceeds {_fmt_bytes(cuda_threshold_bytes)}"
        )
    out["warnings"] = warnings
    return out


@dataclass
class MemoryProfile:
    """Memory before and after a block: ``delta`` per key (bytes), filled when the block ends."""

    label: str
    before: dict[str, int] = field(default_factory=dict)
    after: dict[str, int] = field(default_factory=dict)
    elapsed_s: float = 0.0

    @property
    def delta(self) -> dict[str, int]:
        return {k: self.after[k] - self.before.get(k, 0) for k in self.after}

    def __str__(self) -> str:
        parts = [
            f"{k} {'+' if v >= 0 else ''}{_fmt_bytes(v)}"
            for k, v in self.delta.items()
            if k in ("rss", "cuda_allocated", "cuda_peak")
        ]
        return f"{self.label}: " + (", ".join(parts) if parts else "no sample yet")

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "before": self.before,
            "after": self.after,
            "delta": self.delta,
            "elapsed_s": self.elapsed_s,
        }


@contextlib.contextmanager
def profile_memory(label: str = "block") -> Iterator[MemoryProfile]:
    """Measure memory before and after a block; on CUDA the block's peak is ``after["cuda_peak"]``.

    Example:
        >>> with profile_memory("alloc") as prof:
        ...     x = torch.zeros(1 << 20)
        >>> prof.delta["rss"] >= 0 or True
        True

    Cost: two samples; on CUDA it resets the peak counters (do not nest with your own peak tracking).
    """
    reset_peak()
    prof = MemoryProfile(label=label, before=memory_sample())
    t0 = time.perf_counter()
    try:
        yield prof
    finally:
        prof.elapsed_s = time.perf_counter() - t0
        prof.after = memory_sample()


class PyTorchMemoryDebugger:
    """Seed-era facade: track named tensors, take labelled snapshots, free cached memory.

    Tracked tensors are held by weak reference (tracking never keeps a tensor alive).

    Example:
        >>> dbg = PyTorchMemoryDebugger()
        >>> x = torch.zeros(256)
        >>> dbg.track_tensor(x, "x")
        >>> dbg.take_memory_snapshot("start")["tracked"]["x"]["bytes"]
        1024
    """

    def __init__(
        self,
        *,
        rss_threshold_bytes: int | None = None,
        cuda_threshold_bytes: int | None = None,
        leak_window: int = 50,
        history_size: int = 1000,
    ) -> None:
        from .instrument import LeakDetector

        self.rss_threshold_bytes = rss_threshold_bytes
        self.cuda_threshold_bytes = cuda_threshold_bytes
        self._tracked: dict[str, weakref.ref[torch.Tensor]] = {}
        self.snapshots: collections.deque[dict[str, Any]] = collections.deque(maxlen=history_size)
        # the engine's leak test over the snapshots (one sample each): a steady growth of at least
        # 64 KiB per snapshot over the last leak_window snapshots
        self._leaks = LeakDetector(window=max(3, leak_window), warmup=0)
        self._taken = 0
        self.memory_leaks: collections.deque[str] = collections.deque(maxlen=history_size)

    def track_tensor(self, tensor: torch.Tensor, name: str) -> None:
        """Remember ``tensor`` under ``name`` (weakly). Raises TypeError for a non-tensor."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"track_tensor expects a torch.Tensor, got {type(tensor).__name__}")
        self._tracked[name] = weakref.ref(tensor)

    def take_memory_snapshot(self, label: str = "") -> dict[str, Any]:
        """Sample memory now; returns (and keeps in ``snapshots``) a dict with the tracked tensors' sizes.

        Each snapshot feeds the engine's leak test (``LeakDetector``: Theil-Sen slope over the last
        ``leak_window`` snapshots, at least 64 KiB per snapshot, mostly increasing); a leak found is
        listed in the snapshot's ``memory_leaks`` and in ``self.memory_leaks`` and warned
        (``TorchDebugWarning``) once per window of growth.
        """
        tracked: dict[str, Any] = {}
        for name, ref in list(self._tracked.items()):
            t = ref()
            if t is None:
                tracked[name] = {"alive": False}
                continue
            tracked[name] = {
                "alive": True,
                "shape": list(t.shape),
                "dtype": str(t.dtype).replace("torch.", ""),
                "device": str(t.device),
                "bytes": t.numel() * t.element_size(),
                "has_history": t.grad_fn is not None,
            }
        snap = {
            "label": label,
            "time": time.time(),
            **debug_memory_usage(
                rss_threshold_bytes=self.rss_threshold_bytes, cuda_threshold_bytes=self.cuda_threshold_bytes
            ),
            "tracked": tracked,
        }
        found = self._leaks.add(self._taken, {k: v for k, v in snap.items() if isinstance(v, int)})
        self._taken += 1
        snap["memory_leaks"] = [
            f"{t.series} grew {t.growth / 2**20:.1f} MiB over the last {t.samples} snapshots "
            f"({t.slope / 2**10:.0f} KiB per snapshot, steadily)"
            for t in found
        ]
        if found:
            self._leaks.reset()  # one warning per window of growth
            self.memory_leaks.extend(snap["memory_leaks"])
            import warnings

            from .._errors import TorchDebugWarning

            warnings.warn(
                TorchDebugWarning(
                    f"torchdebug: possible memory leak at snapshot {label!r}: "
                    + "; ".join(snap["memory_leaks"])
                ),
                stacklevel=2,
            )
        self.snapshots.append(snap)
        return snap

    def clear_memory(self) -> dict[str, int]:
        """Run gc and release cached CUDA blocks; returns bytes freed per key (RSS, CUDA reserved)."""
        before = memory_sample()
        gc.collect()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        after = memory_sample()
        return {
            k: before[k] - after.get(k, 0) for k in before if k in ("rss", "cuda_reserved", "cuda_allocated")
        }


__all__ = [
    "LiveTensor",
    "MemoryProfile",
    "ModuleMemoryRow",
    "ModuleMemoryTable",
    "PyTorchMemoryDebugger",
    "SavedTensorTracker",
    "called_by_torchdebug",
    "debug_memory_usage",
    "live_tensors",
    "measure_module_memory",
    "memory_sample",
    "module_memory_table",
    "profile_memory",
    "reset_peak",
    "storage_key",
    "tensor_bytes",
    "tensor_census",
]

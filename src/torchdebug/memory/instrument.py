"""Memory instruments: samples every memory_every steps, leak trend test, OOM forensics, per-module memory."""

from __future__ import annotations

import itertools
import json
import math
import operator
import sys
import threading
import weakref
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode

from .._frames import user_location
from .._step import SessionView
from .._tensors import in_functorch_transform
from .._trees import tensor_leaves
from ..events import RuleEvent, module_label, not_under_compile
from .analysis import (
    LiveTensor,
    ModuleMemoryTable,
    SavedTensorTracker,
    _fmt_bytes,
    called_by_torchdebug,
    live_tensors,
    memory_sample,
    module_from_frames,
    module_memory_table,
    reset_peak,
    storage_key,
    tensor_bytes,
    tensor_census,
)
from .recovery import is_oom_error

# --------------------------------------------------------------------------------------------------
# robust trend test


def theil_sen_slope(xs: Iterable[float], ys: Iterable[float]) -> float:
    """Median of the pairwise slopes ``(y_j - y_i) / (x_j - x_i)`` (Theil–Sen); NaN with fewer than 2 points.

    Robust to a minority of outliers and to one-off jumps: a single step change moves fewer than half
    of the pairwise slopes. Cost: O(n²) pairs; n is the leak window (<= a few hundred). Finite
    floats and small ints (the leak test's steps and bytes) go through one vectorised float64 pass
    (``torch`` on the CPU, the same IEEE operations in the same order, so the same result bit for
    bit: about 5x faster than the Python loop at 50 points); anything else through the loop.

    Example:
        >>> theil_sen_slope([0, 1, 2, 3, 4, 5], [0, 2, 4, 6, 8, 1000])
        2.0
    """
    x = list(xs)
    y = list(ys)
    vectorised = len(x) == len(y) >= _VECTOR_MIN and _exact_in_float64(x) and _exact_in_float64(y)
    if vectorised and len(set(x)) == len(x):  # no pair to skip (the leak test's steps are distinct)
        return _theil_sen_float64(x, y)
    slopes = [
        (y[j] - y[i]) / (x[j] - x[i]) for i in range(len(x)) for j in range(i + 1, len(x)) if x[j] != x[i]
    ]
    if not slopes:
        return math.nan
    slopes.sort()
    n = len(slopes)
    return slopes[n // 2] if n % 2 else 0.5 * (slopes[n // 2 - 1] + slopes[n // 2])


_VECTOR_MIN = 8  # points: below this the Python loop is as fast
_EXACT_INT = 2**52  # ints up to here, and their differences, are exact in float64


def _exact_in_float64(vals: list[Any]) -> bool:
    """True when every value is a finite float or a small int: float64 arithmetic on them is exactly
    what Python does (float - float, int - int exact, int -> float exact, one correctly rounded
    division); NaN/Inf would order differently, big ints would round before the division."""
    for v in vals:
        t = type(v)
        if t is float:
            if not math.isfinite(v):
                return False
        elif t is not int or not -_EXACT_INT <= v <= _EXACT_INT:
            return False
    return True


_PAIRS: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # n -> (i, j) of every pair i < j, loop order
_DX: dict[tuple[int, int], torch.Tensor] = {}  # (n, spacing) -> x[j] - x[i] of evenly spaced int x


def _pairs(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    got = _PAIRS.get(n)
    if got is None:
        if len(_PAIRS) >= 8:
            _PAIRS.clear()  # bounded: the leak test uses two sizes
        ij = torch.triu_indices(n, n, offset=1, device="cpu")  # i ascending, then j ascending
        got = _PAIRS[n] = (ij[0], ij[1])
    return got


def _differences(x: list[Any], i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """``x[j] - x[i]`` per pair in float64. The leak test's steps are evenly spaced ints: their
    differences depend on the spacing only, so they are computed once per (count, spacing)."""
    n, key, x0 = len(x), None, x[0]
    d = x[1] - x0
    if type(x0) is int and type(d) is int and d and x == list(range(x0, x0 + d * n, d)):
        key = (n, d)
        got = _DX.get(key)
        if got is not None:
            return got
    xt = torch.tensor(x, dtype=torch.float64, device="cpu")
    dx = xt.take(j) - xt.take(i)
    if key is not None:
        if len(_DX) >= 8:
            _DX.clear()
        _DX[key] = dx
    return dx


def _theil_sen_float64(x: list[Any], y: list[Any]) -> float:
    """:func:`theil_sen_slope` for distinct ``x`` as float64 tensor operations on the CPU.

    The pairwise differences are the loop's (``a[j] - a[i]``, one IEEE subtraction each), the
    slopes its divisions; the median is read with ``kthvalue``, which returns the value of that
    rank: the same bits as the loop's sorted list, except that a zero median could be either
    signed zero, so that case is read from a stable sort in the loop's order.
    """
    i, j = _pairs(len(x))
    with torch.no_grad():
        dx = _differences(x, i, j)
        yt = torch.tensor(y, dtype=torch.float64, device="cpu")
        slopes = (yt.take(j) - yt.take(i)).div_(dx)
        m = slopes.numel()
        ranks = (m // 2,) if m % 2 else (m // 2 - 1, m // 2)  # 0-based, as in the loop
        got = [float(slopes.kthvalue(k + 1).values.item()) for k in ranks]
        if any(v == 0.0 for v in got):
            s = torch.sort(slopes, stable=True).values  # signed zeros in the loop's order
            got = [float(s[k].item()) for k in ranks]
    return got[0] if m % 2 else 0.5 * (got[0] + got[1])


@dataclass(frozen=True)
class Trend:
    """A series' trend over a window: Theil–Sen slope per step and the share of sample-to-sample increases."""

    series: str
    slope: float  # bytes per step, Theil–Sen over the window
    recent_slope: float  # the same over the window's newer half: the rate now, if the leak began inside it
    increasing_fraction: float
    growth: float  # last - first over the window (bytes)
    samples: int
    first_step: int
    last_step: int


def trend(series: str, steps: list[int], values: list[float]) -> Trend:
    """Theil–Sen slope (per step) and increasing fraction of ``values`` sampled at ``steps``."""
    return _trend(series, steps, values, theil_sen_slope(steps, values))


def _trend(series: str, steps: list[int], values: list[float], slope: float) -> Trend:
    inc = sum(1 for a, b in itertools.pairwise(values) if b > a)
    return Trend(
        series=series,
        slope=slope,
        recent_slope=theil_sen_slope(steps[len(steps) // 2 :], values[len(values) // 2 :]),
        increasing_fraction=inc / max(1, len(values) - 1),
        growth=float(values[-1] - values[0]) if values else 0.0,
        samples=len(values),
        first_step=steps[0] if steps else 0,
        last_step=steps[-1] if steps else 0,
    )


class LeakDetector:
    """Robust growth test over the last ``window`` memory samples of each series.

    Series: ``cuda_allocated`` (CUDA tensors), ``heap_in_use`` (malloc'd host bytes: CPU tensors,
    exact), ``rss`` (everything, but blind to reused free memory and page-granular).

    A series is suspected of leaking when, over a full window, its Theil–Sen slope is at least
    ``min_bytes_per_step``, at least ``min_increasing`` of the sample-to-sample changes are increases
    and it grew overall. The first ``warmup`` samples are ignored (allocator warm-up, optimizer state
    created at the first step). One-off jumps (a bigger batch, a cache filling) fail the increasing
    share; allocator noise fails the slope floor.

    Example:
        >>> d = LeakDetector(window=5, warmup=0, min_bytes_per_step=10)
        >>> [bool(d.add(s, {"rss": 1000 + 100 * s})) for s in range(6)][-1]
        True
    """

    SERIES = ("cuda_allocated", "heap_in_use", "rss")

    def __init__(
        self,
        window: int = 50,
        warmup: int = 5,
        min_bytes_per_step: float = 65536.0,
        min_increasing: float = 0.6,
    ) -> None:
        if window < 3:
            raise ValueError(f"leak window must be >= 3 samples, got {window}")
        self.window = window
        self.warmup = warmup
        self.min_bytes_per_step = float(min_bytes_per_step)
        self.min_increasing = float(min_increasing)
        self._seen = 0
        self._steps: deque[int] = deque(maxlen=window)
        self._values: dict[str, deque[float]] = {}
        self.checked: set[str] = set()  # the series judged at the last add (full window): ended episodes

    def reset(self) -> None:
        """Forget the window (after a report, so one leak alarms once per window)."""
        self._steps.clear()
        self._values.clear()

    def add(self, step: int, sample: Mapping[str, int]) -> list[Trend]:
        """Add one sample; returns the trends of the series suspected of leaking (empty when healthy)."""
        self._seen += 1
        self.checked = set()
        if self._seen <= self.warmup:
            return []
        self._steps.append(step)
        for name in self.SERIES:
            if name in sample:
                self._values.setdefault(name, deque(maxlen=self.window)).append(float(sample[name]))
        if len(self._steps) < self.window:
            return []
        steps = list(self._steps)
        out = []
        for name, vals in self._values.items():
            if len(vals) < self.window:
                continue
            v = list(vals)
            self.checked.add(name)
            # O(n) pre-check first: the O(n²) Theil–Sen slope only runs for a series that mostly grows
            inc = sum(map(operator.lt, v, v[1:])) / (len(v) - 1)  # increases (a < b), counted in C
            if inc < self.min_increasing or v[-1] <= v[0]:
                continue
            slope = theil_sen_slope(steps, v)
            if slope >= self.min_bytes_per_step:  # the rest of the trend only for a suspect
                out.append(_trend(name, steps, v, slope))
        return out


# --------------------------------------------------------------------------------------------------
# creation-site capture (only after a leak is suspected)


@dataclass
class _Created:
    ref: weakref.ref[torch.Tensor]
    key: Any
    bytes: int
    has_history: bool
    grad_fn: str | None
    shape: tuple[int, ...]
    dtype: str
    device: str
    module: str | None
    location: str | None
    seq: int


class CreationCapture(TorchFunctionMode):
    """Records, for every tensor an op returns, a weak reference plus the module and user line that made it.

    Cost: a frame walk per op (tens of µs): run it for one step only. Capped at ``limit`` records.
    """

    def __init__(
        self, model: nn.Module, names: Mapping[nn.Module, str] | None = None, limit: int = 50_000
    ) -> None:
        super().__init__()
        mapping = names if names is not None else {m: n for n, m in model.named_modules()}
        self._modules = {id(m): n for m, n in mapping.items()}
        self._types = {n: type(m).__name__ for m, n in mapping.items()}
        self.records: list[_Created] = []
        self.limit = limit
        self.recording = True
        # parameters, buffers and their gradients are not "created" by an op even when an in-place
        # op (the optimizer's foreach updates) returns them
        self._owned = {
            k
            for t in (*model.parameters(), *model.buffers())
            for k in (storage_key(t), storage_key(t.grad) if t.grad is not None else None)
            if k is not None
        }

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if (
            not self.recording
            or len(self.records) >= self.limit
            or getattr(func, "__name__", "") == "__get__"
        ):
            return out  # __get__: attribute reads (p.grad, x.T) return existing tensors or views of them
        inputs = {id(t) for t in tensor_leaves((args, kwargs))}
        leaves = [
            t
            for t in tensor_leaves(out)
            if (type(t) is torch.Tensor or isinstance(t, nn.Parameter))
            and id(t) not in inputs  # in-place: not new
        ]
        if not leaves:
            return out
        frame = sys._getframe(1)
        if called_by_torchdebug(frame):
            return out  # the monitor's own bookkeeping, not the user's tensors
        module = module_from_frames(frame, self._modules)
        loc = user_location(frame)
        for t in leaves:
            key = storage_key(t)
            if key in self._owned:
                continue
            try:
                ref = weakref.ref(t)
            except TypeError:
                continue
            self.records.append(
                _Created(
                    ref=ref,
                    key=key,
                    bytes=tensor_bytes(t),
                    has_history=t.grad_fn is not None,
                    grad_fn=type(t.grad_fn).__name__ if t.grad_fn is not None else None,
                    shape=tuple(t.shape),
                    dtype=str(t.dtype).replace("torch.", ""),
                    device=str(t.device),
                    module=module,
                    location=loc,
                    seq=len(self.records),
                )
            )
        return out

    def origin(self, rec: _Created) -> str:
        parts = []
        if rec.module is not None:
            parts.append(module_label(rec.module, self._types.get(rec.module)))
        if rec.location:
            parts.append(f"at {rec.location}")
        return " ".join(parts)


# --------------------------------------------------------------------------------------------------
# leak report


LEAK_CATEGORIES = ("autograd_history", "tensors", "host_only", "untracked")

_HINTS = {
    "autograd_history": (
        "tensors that keep their autograd graph (and every activation it saved) stay alive: the classic "
        "`total_loss += loss` or appending outputs to a list; store `loss.item()` or `.detach()` instead"
    ),
    "tensors": "plain tensors (no autograd history) accumulate: a growing list/dict/cache of tensors",
    "host_only": "process memory (RSS / malloc heap) grows but no live tensor does: Python objects, numpy arrays or native allocations",
    "untracked": "CUDA allocated memory grows but no Python-visible tensor does (C++-held tensors, custom kernels)",
}


@dataclass(frozen=True)
class LeakReport:
    """A confirmed memory leak: which series grows, by how much per step, what category, which tensors."""

    step: int
    series: str
    bytes_per_step: float
    increasing_fraction: float
    category: str
    survivors_bytes: int  # bytes per step of tensors created in one step still alive a step later
    tensors: tuple[LiveTensor, ...] = ()
    site: str = ""  # module/line of the leaked tensor made last in the step (the graph's head)
    hint: str = ""

    @property
    def message(self) -> str:
        s = f"{self.series} grows by {_fmt_bytes(self.bytes_per_step)}/step ({self.category})"
        if self.site:
            s += f"; leaked tensors made by {self.site}"
        return s

    def __str__(self) -> str:
        lines = [f"memory leak: {self.message}", f"  hint: {self.hint}"]
        if self.tensors:
            lines.append("  largest new live tensors:")
            lines.extend(f"    {t}" for t in self.tensors)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "series": self.series,
            "bytes_per_step": self.bytes_per_step,
            "increasing_fraction": self.increasing_fraction,
            "category": self.category,
            "survivors_bytes": self.survivors_bytes,
            "site": self.site,
            "hint": self.hint,
            "tensors": [t.to_dict() for t in self.tensors],
        }


# --------------------------------------------------------------------------------------------------
# OOM forensics


@dataclass(frozen=True)
class OomReport:
    """What was in memory when an out-of-memory error left a training step."""

    step: int | None
    error: str
    module: str | None
    module_type: str | None
    phase: str | None
    batch_shape: tuple[int, ...] | None
    memory: Mapping[str, int]
    top_tensors: tuple[LiveTensor, ...]
    modules: ModuleMemoryTable
    files: tuple[str, ...] = ()

    def __str__(self) -> str:
        where = (
            module_label(self.module, self.module_type) if self.module is not None else "outside the model"
        )
        lines = [
            f"out of memory at step {self.step} in {self.phase or 'unknown phase'} of {where}",
            f"  error: {self.error}",
        ]
        if self.batch_shape is not None:
            lines.append(f"  batch: {list(self.batch_shape)}")
        lines.append(
            "  memory: "
            + ", ".join(
                f"{k}={_fmt_bytes(v)}"
                for k, v in self.memory.items()
                if "ooms" not in k and "retries" not in k
            )
        )
        if self.top_tensors:
            lines.append("  largest live tensors:")
            lines.extend(f"    {t}" for t in self.top_tensors)
        lines.append("")
        lines.append(str(self.modules))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "error": self.error,
            "module": self.module,
            "module_type": self.module_type,
            "phase": self.phase,
            "batch_shape": list(self.batch_shape) if self.batch_shape is not None else None,
            "memory": dict(self.memory),
            "top_tensors": [t.to_dict() for t in self.top_tensors],
            "modules": self.modules.to_dict(),
            "files": list(self.files),
        }


def _phase_from_traceback(tb: Any) -> str | None:
    phase = None
    while tb is not None:
        fn = tb.tb_frame.f_code.co_filename.replace("\\", "/")
        if "/torch/autograd/" in fn:
            phase = "backward"
        elif "/torch/optim/" in fn:
            phase = "optimizer"
        tb = tb.tb_next
    return phase


def oom_report(
    exc: BaseException,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int | None = None,
    phase: str | None = None,
    batch_shape: tuple[int, ...] | None = None,
    names: Mapping[nn.Module, str] | None = None,
    top: int = 10,
) -> OomReport:
    """Summarise an out-of-memory error: running module, phase, largest live tensors, per-module table.

    The running module is the innermost frame of the exception's traceback whose ``self`` is a
    module of ``model``. The phase comes from the traceback (autograd -> backward, torch.optim ->
    optimizer), else ``phase``, else "forward" when a module was running.

    Cost: a gc walk over live objects (tens of ms); runs once, on the error path.

    Example:
        >>> try:
        ...     raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        ... except torch.OutOfMemoryError as e:
        ...     rep = oom_report(e, torch.nn.Linear(2, 2))
        >>> rep.module is None
        True
    """
    mapping = names if names is not None else {m: n for n, m in model.named_modules()}
    by_id = {id(m): n for m, n in mapping.items()}
    module = module_from_frames(exc.__traceback__, by_id) if exc.__traceback__ is not None else None
    types = {n: type(m).__name__ for m, n in mapping.items()}
    tb_phase = _phase_from_traceback(exc.__traceback__)
    final_phase = tb_phase or phase or ("forward" if module is not None else None)
    msg = str(exc).strip().splitlines()
    return OomReport(
        step=step,
        error=f"{type(exc).__name__}: {msg[0] if msg else ''}",
        module=module,
        module_type=types.get(module) if module is not None else None,
        phase=final_phase,
        batch_shape=batch_shape,
        memory=memory_sample(),
        top_tensors=tuple(live_tensors(model, optimizer, top=top)),
        modules=module_memory_table(model, optimizer, step=step),
    )


def write_oom_report(report: OomReport, run_dir: str | Path, *, snapshot: bool = True) -> OomReport:
    """Write ``oom-<step>.json`` and ``oom-<step>.txt`` (and on CUDA ``oom-<step>-snapshot.pickle``).

    The snapshot is ``torch.cuda.memory._dump_snapshot``'s pickle, which https://pytorch.org/memory_viz
    opens; it holds allocation stacks only when history recording was switched on before the error.

    Returns:
        The report with ``files`` filled in.
    """
    d = Path(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    tag = "x" if report.step is None else str(report.step)
    files = []
    if snapshot and torch.cuda.is_available() and torch.cuda.is_initialized():
        snap = d / f"oom-{tag}-snapshot.pickle"
        try:
            torch.cuda.memory._dump_snapshot(str(snap))
            files.append(str(snap))
        except Exception as e:  # the snapshot is a bonus: never hide the OOM behind a dump failure
            files.append(f"snapshot failed: {type(e).__name__}: {e}")
    jpath, tpath = d / f"oom-{tag}.json", d / f"oom-{tag}.txt"
    files[:0] = [str(jpath), str(tpath)]
    rep = OomReport(**{**report.__dict__, "files": tuple(files)})
    jpath.write_text(json.dumps(rep.to_dict(), indent=1, sort_keys=True))
    tpath.write_text(str(rep) + "\n")
    return rep


# --------------------------------------------------------------------------------------------------
# instruments


def _first_shape(args: Any, kwargs: Any) -> tuple[int, ...] | None:
    if type(args) is tuple and args and isinstance(args[0], torch.Tensor):
        return tuple(args[0].shape)  # every forward: the first leaf is the first argument, no walk
    for t in tensor_leaves((args, kwargs)):
        return tuple(t.shape)
    return None


@dataclass
class _LeakState:
    phase: str = "idle"  # idle -> armed -> capturing -> waiting -> idle
    suspects: list[Trend] = field(default_factory=list)
    baseline: dict[int, Any] = field(default_factory=dict)
    sample_at_suspect: dict[str, int] = field(default_factory=dict)
    capture: CreationCapture | None = None
    mode_entered: bool = False


class MemoryInstrument:
    """Samples memory every ``memory_every`` steps, tests for leaks, writes OOM forensics.

    Per due step (cheap, ~15 µs): ``rss``, ``heap_in_use`` (glibc) and CUDA allocated/reserved/
    peak/retries/OOMs (see :func:`~torchdebug.memory.analysis.memory_sample`) go to ``writer.log_memory``;
    CUDA peaks are reset every step, so ``cuda_peak`` is the step's peak.

    Leak test (see :class:`LeakDetector`) over the last ``leak_window`` samples, taken every
    ``leak_every`` steps (or every ``memory_every`` when that is smaller): the window is sized in
    steps (50 x 4 = 200 by default), so a leak of 64 KiB/step is reported about 140-170 steps
    after it starts (``benchmarks/memory_timing_overhead.py``), for ~5 µs a step. After a suspicion
    (the expensive path, once per suspicion): a gc census of live tensors; the next step's forward
    and loss run under a :class:`CreationCapture` (weak references + module + line for every tensor
    an op returns); one step later, the tensors made then that are still alive (what the user
    holds from a step dies when the next step replaces it) give the category (autograd history vs
    plain tensors vs host-only vs untracked), the bytes kept per step and the largest leaked
    tensors with the module and line that made them; one "memory_leak" event per leak episode
    and series (again only after a full window in which that series stopped growing). The steps
    the census and capture slow are reported by :meth:`costly_step`, so the timing rules skip them.

    On an out-of-memory error leaving the watch block, ``oom-<step>.json``/``.txt`` (and on CUDA a
    snapshot) are written to the run folder and an "oom" event is recorded (see :func:`oom_report`).

    Args:
        leak_min_bytes_per_step: slope floor of the leak test (default ``config.leak_min_bytes_per_step``
            or 64 KiB/step: RSS moves by pages and Python-object noise; malloc and CUDA counters are
            exact, but a floor keeps caches that grow slowly for a while from alarming).
        leak_warmup: leak-test samples ignored at the start.
        record_history: on CUDA, record allocation stacks for the OOM snapshot
            (``torch.cuda.memory._record_memory_history``; costs on every allocation: opt-in;
            default ``config.memory_history`` or off).

    Known limitations:
        - On CPU the exact signal is glibc's ``mallinfo2`` (Linux); elsewhere only RSS, which moves
          by pages and hides leaks that reuse freed memory. Leaks below the slope floor go unseen.
        - The first report needs one full window after the warm-up samples: with defaults no leak
          is reported before step 218, whenever it started.
        - The CUDA series (``cuda_allocated``) goes through the same test and schedule; it is
          tested on CPU only through the detector (no GPU in CI).
        - The creation capture sees tensors made through torch's Python API; tensors made inside C++
          (the autograd engine's ``.grad``, extensions) survive without a line. The gc census sees
          only tensors with a live Python object.
        - An OOM names a module only when its traceback passes through a module's ``forward``; in
          backward the phase is known, the module is not.
    """

    name = "memory"

    def __init__(
        self,
        *,
        leak_min_bytes_per_step: float | None = None,
        leak_warmup: int | None = None,
        record_history: bool | None = None,
        top: int = 10,
    ) -> None:
        self._min_bytes = leak_min_bytes_per_step
        self._warmup = leak_warmup
        self._record_history = record_history
        self.top = top
        self.detector: LeakDetector | None = None
        self.leaks: list[LeakReport] = []
        self.samples: list[tuple[int, dict[str, int]]] = []  # bounded to the leak window
        self.oom: OomReport | None = None
        self._leak = _LeakState()
        self._reported: set[str] = (
            set()
        )  # memories (host, cuda_allocated) whose leak was reported and still grows
        self._costly: deque[int] = deque(maxlen=16)  # steps slowed by the leak census/capture
        self._unpopped: list[CreationCapture] = []
        self._phase = "input"
        self._batch_shape: tuple[int, ...] | None = None
        self._history_on = False
        self._cuda = False

    # ---- protocol
    def install(self, mon: SessionView) -> None:
        cfg = mon.config
        self._cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        window = int(getattr(cfg, "leak_window", 50))
        min_bytes = (
            self._min_bytes if self._min_bytes is not None else getattr(cfg, "leak_min_bytes_per_step", 65536)
        )
        warmup = self._warmup if self._warmup is not None else getattr(cfg, "leak_warmup", 5)
        self.detector = LeakDetector(
            window=max(3, window), warmup=int(warmup), min_bytes_per_step=float(min_bytes)
        )
        hist = (
            self._record_history
            if self._record_history is not None
            else getattr(cfg, "memory_history", False)
        )
        if hist and torch.cuda.is_available():
            torch.cuda.memory._record_memory_history(max_entries=100_000)
            self._history_on = True
        if self._cuda:
            reset_peak()

    def remove(self, mon: SessionView) -> None:
        self._stop_capture()
        if self._history_on:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._history_on = False

    def on_forward_start(self, mon: SessionView, module: nn.Module, args: Any, kwargs: Any) -> None:
        self._phase = "forward"
        if type(args) is tuple and args and isinstance(args[0], torch.Tensor):  # (``_first_shape``, inlined)
            self._batch_shape = tuple(args[0].shape)
        else:
            self._batch_shape = _first_shape(args, kwargs)
        st = self._leak
        if st.phase == "idle" or st.phase == "waiting":
            return  # the usual answer: no leak capture under way
        here = threading.current_thread() is getattr(mon, "thread", threading.current_thread())
        # a function mode lives on the stack of the thread that enters it: only on the session's thread
        if here and st.phase in ("armed", "capturing") and st.capture is not None and not st.mode_entered:
            st.capture.__enter__()
            st.mode_entered = True
            st.phase = "capturing"

    def on_backward_start(self, mon: SessionView, loss: Any) -> None:
        # the capture runs on to the step's end: forward, the loss (where `losses.append(loss)`
        # lines live), Python code after backward (`grads.append(p.grad.clone())`), the optimizer
        self._phase = "backward"

    def before_optimizer_step(self, mon: SessionView) -> None:
        self._phase = "optimizer"

    def on_step_end(self, mon: SessionView, record: Any, values: Mapping[str, float]) -> None:
        self._phase = "input"
        if self._leak.capture is not None or self._unpopped:
            self._stop_capture()
        step = int(getattr(record, "step", getattr(mon, "global_step", 0)))
        cfg, gs = mon.config, mon.global_step
        every = int(getattr(cfg, "memory_every", 50))
        # (``mon.due``, inlined: every step) the leak test samples on its own, denser schedule: a
        # window sized in steps, not in memory_every-spaced samples, so a leak is found within
        # ~leak_window * leak_every steps
        log_due = every > 0 and gs % every == 0
        leak_every = min(every, int(getattr(cfg, "leak_every", 4)))
        leak_due = leak_every > 0 and gs % leak_every == 0
        if self._leak.phase != "idle":
            self._advance_leak(mon, step)
        if log_due or leak_due:
            sample = memory_sample()  # ~10-20 us: a /proc read, mallinfo2, the CUDA allocator's counters
            if log_due and mon.writer is not None:
                mon.writer.log_memory(step, sample)
        if leak_due:
            assert self.detector is not None
            self.samples.append((step, sample))
            del self.samples[: -self.detector.window]
            suspects = self.detector.add(step, sample)
            # one report per leak episode and memory (host: heap and RSS are two views of it; CUDA):
            # a memory already reported stays quiet until a full window shows none of its series grows
            growing = {_memory_of(t.series) for t in suspects}
            self._reported -= {_memory_of(c) for c in self.detector.checked} - growing
            suspects = [t for t in suspects if _memory_of(t.series) not in self._reported]
            if suspects and self._leak.phase == "idle":
                self._arm(mon, suspects, sample)
        if self._cuda:
            reset_peak()  # so the next sample's cuda_peak is that step's peak

    def on_exception(self, mon: SessionView, exc: BaseException) -> None:
        self._stop_capture()
        if not is_oom_error(exc):
            return
        step = mon.global_step  # an int (completed steps); never call it here: calling completes a step
        rep = oom_report(
            exc,
            mon.model,
            getattr(mon, "optimizer", None),
            step=step,
            phase=self._phase,
            batch_shape=self._batch_shape,
            names=getattr(mon, "names", None),
            top=self.top,
        )
        run_dir = getattr(mon, "run_dir", None)
        if run_dir is not None:
            rep = write_oom_report(rep, run_dir)
        self.oom = rep
        where = module_label(rep.module, rep.module_type) if rep.module is not None else "outside the model"
        mon.emit(
            RuleEvent(
                kind="oom",
                step=rep.step,
                message=f"out of memory in {rep.phase or 'unknown phase'} of {where}; summary in {rep.files[1] if len(rep.files) > 1 else 'the event data'}",
                severity="error",
                modules=(rep.module,) if rep.module is not None else (),
                evidence=rep.to_dict(),
            )
        )

    def on_exit(self, mon: SessionView) -> None:
        self._stop_capture()

    def costly_step(self, step: int) -> bool:
        """True for a step this instrument slowed on purpose (leak census, creation capture): the
        timing rules leave it out, so the debugger's own work never reads as the user's slowdown."""
        return step in self._costly

    # ---- leak state machine
    def _arm(self, mon: SessionView, suspects: list[Trend], sample: dict[str, int]) -> None:
        st = self._leak
        step = int(mon.global_step)
        # census at this step's end (counted in this step or the next one's wait, by hook order),
        # the capture over the next step, the verdict's census at the end of the one after
        self._costly.extend(range(step, step + 4))
        st.phase = "armed"
        st.suspects = suspects
        st.sample_at_suspect = dict(sample)
        # expensive: one gc walk now, one at the verdict (storage keys of everything alive)
        st.baseline = tensor_census()
        st.capture = CreationCapture(mon.model, getattr(mon, "names", None))
        st.mode_entered = False

    def _stop_capture(self) -> None:
        st = self._leak
        cap = st.capture
        if cap is not None and st.mode_entered:
            cap.recording = False
            st.mode_entered = False
            self._unpopped.append(cap)
        # a mode can only leave from the top of the stack: when another one (the monitor's loss
        # tape) sits above it, it stays as a pass-through and is popped at a later stop
        while self._unpopped and _get_current_function_mode() is self._unpopped[-1]:
            self._unpopped.pop().__exit__(None, None, None)

    def _advance_leak(self, mon: SessionView, step: int) -> None:
        st = self._leak
        if st.phase == "capturing":
            st.phase = "waiting"  # one more step: what the user still holds from this step dies then
        elif st.phase == "waiting":
            self._verdict(mon, step)

    def _verdict(self, mon: SessionView, step: int) -> None:
        st = self._leak
        assert st.capture is not None and self.detector is not None
        cap = st.capture
        survivors: dict[Any, _Created] = {}
        for rec in cap.records:
            if rec.ref() is not None:
                key = rec.key if rec.key is not None else ("rec", rec.seq)
                survivors.setdefault(key, rec)
        opt = getattr(mon, "optimizer", None)
        new = [t for t in live_tensors(mon.model, opt, since=st.baseline) if t.kind == "other"]
        surv = sorted(survivors.values(), key=lambda r: -r.bytes)
        surv_bytes = sum(r.bytes for r in surv)
        hist = [r for r in surv if r.has_history]
        category = "autograd_history" if hist else "tensors"
        main = st.suspects[0]  # the most exact series that grows (LeakDetector.SERIES order)
        now = memory_sample()
        grown = now.get(main.series, 0) - st.sample_at_suspect.get(main.series, 0)
        still_growing = grown >= self.detector.min_bytes_per_step
        # Nothing the capture saw survived: fall back on the census diff, which also holds what the
        # user legitimately keeps from the current step (batch, loss); it explains the growth only
        # when its bytes are of the growth's order.
        new_bytes = sum(t.bytes for t in new)
        if not surv and new and new_bytes >= 0.5 * max(grown, 0):
            category = "autograd_history" if any(t.has_history for t in new) else "tensors"
        elif not surv:
            new = []
            category = "untracked" if main.series == "cuda_allocated" else "host_only"
        # the newer half's rate: the whole window's slope mixes in steps before the leak began; where
        # it is not a growth (the growth stopped), the window's slope, which made the suspicion
        recent = main.recent_slope
        per_step = recent if math.isfinite(recent) and recent > 0 else main.slope
        slowed = math.isfinite(recent) and recent < self.detector.min_bytes_per_step
        tensors = tuple(
            LiveTensor(
                shape=r.shape,
                dtype=r.dtype,
                device=r.device,
                bytes=r.bytes,
                has_history=r.has_history,
                grad_fn=r.grad_fn,
                kind="other",
                origin=cap.origin(r),
            )
            for r in surv[: self.top]
        ) or tuple(new[: self.top])
        site_rec = (
            max(hist, key=lambda r: r.seq) if hist else (max(surv, key=lambda r: r.seq) if surv else None)
        )
        site = cap.origin(site_rec) if site_rec is not None else ""
        self._leak = _LeakState()
        self.detector.reset()
        if not surv and (not still_growing or slowed):
            # the growth stopped, or its newer half grew slower than the floor, and nothing survived:
            # allocator noise or a warm-up we did not skip, not a leak
            return
        rep = LeakReport(
            step=step,
            series=main.series,
            bytes_per_step=per_step,
            increasing_fraction=main.increasing_fraction,
            category=category,
            survivors_bytes=surv_bytes,
            tensors=tensors,
            site=site,
            hint=_HINTS[category],
        )
        self.leaks.append(rep)
        self._reported |= {_memory_of(t.series) for t in st.suspects}
        modules = tuple(sorted({r.module for r in surv if r.module is not None}))
        mon.emit(
            RuleEvent(
                kind="memory_leak",
                step=step,
                message=f"{rep.message}. {rep.hint}",
                severity="warning",
                modules=modules,
                evidence=rep.to_dict(),
            )
        )


def _memory_of(series: str) -> str:
    """The memory a leak series measures: heap and RSS are two views of one host memory."""
    return "host" if series in ("heap_in_use", "rss") else series


_saved_hooks_enabled = torch._C._autograd._saved_tensors_hooks_is_enabled  # type: ignore[attr-defined]


class ModuleMemoryInstrument:
    """Per-module memory on the first 3 due steps (``memory_every``): activations, params, grads, state.

    Activations: bytes saved for backward, attributed to the innermost running module
    (:class:`~torchdebug.memory.analysis.SavedTensorTracker`); with gradient accumulation the largest
    micro-step is kept. On CUDA the allocator's forward and backward peaks are recorded too. Each
    table is kept in ``tables`` and logged as a "module_memory" event (data: the table's dict).

    Cost: a Python hook per module call and per saved tensor on the measured steps only.
    """

    name = "module_memory"

    def __init__(self, steps: int = 3) -> None:
        self.steps = steps
        self.tables: list[ModuleMemoryTable] = []
        self._tracker: SavedTensorTracker | None = None
        self._measuring = False
        self._best: tuple[int, dict[str, int], int] | None = None  # (total, by_module, outside)
        self._fwd_peak: int | None = None
        self._bwd_peak: int | None = None
        self._cuda = False
        self._said_transform = False

    def install(self, mon: SessionView) -> None:
        self._tracker = SavedTensorTracker(mon.model, getattr(mon, "installs", None))
        self._cuda = torch.cuda.is_available() and torch.cuda.is_initialized()

    def remove(self, mon: SessionView) -> None:
        if self._tracker is not None:
            self._tracker.stop()

    def _keep_best(self) -> None:
        tr = self._tracker
        assert tr is not None
        if self._best is None or tr.total > self._best[0]:
            self._best = (tr.total, dict(tr.by_module), tr.outside)

    def on_forward_start(self, mon: SessionView, module: nn.Module, args: Any, kwargs: Any) -> None:
        if len(self.tables) >= self.steps or self._tracker is None:
            return
        if in_functorch_transform() or not _saved_hooks_enabled():
            # torch.func.grad refuses saved-tensor hooks, and what vmap saves is batched: not measured
            if not self._said_transform:
                self._said_transform = True
                mon.emit(
                    RuleEvent(
                        "module_memory_not_measured",
                        mon.global_step,
                        "per-module memory not measured: the forward runs inside a torch.func transform, "
                        "where saved-tensor hooks are off; use td.measure_module_memory on a plain forward",
                        "info",
                    )
                )
            return
        if not self._measuring:
            if not mon.due(int(getattr(mon.config, "memory_every", 50))):
                return
            if getattr(mon, "compiled", False):
                self._tracker = None  # stands down for the session, said once
                mon.emit(
                    not_under_compile(
                        "module_memory_not_measured",
                        mon.global_step,
                        "per-module memory",
                        "use td.measure_module_memory on the eager model",
                    )
                )
                return
            self._measuring = True
            self._best = None
            self._fwd_peak = self._bwd_peak = None
        else:
            self._keep_best()  # a later micro-step of the measured step
        if self._cuda:
            reset_peak()
        self._tracker.start()
        # the root's own pre-hook was registered during its call, too late to fire: mark it running
        self._tracker._pre(module, args)

    def on_forward_end(self, mon: SessionView, module: nn.Module, output: Any) -> None:
        if self._measuring and self._tracker is not None and self._tracker.active:
            self._tracker.stop()
            if self._cuda:
                self._fwd_peak = max(self._fwd_peak or 0, int(torch.cuda.max_memory_allocated()))
                reset_peak()

    def on_backward_end(self, mon: SessionView) -> None:
        if self._measuring and self._cuda:
            self._bwd_peak = max(self._bwd_peak or 0, int(torch.cuda.max_memory_allocated()))

    def on_step_end(self, mon: SessionView, record: Any, values: Mapping[str, float]) -> None:
        if not self._measuring or self._tracker is None:
            return
        self._measuring = False
        self._tracker.stop()
        self._keep_best()
        assert self._best is not None
        total, by_module, outside = self._best
        step = int(getattr(record, "step", 0))
        table = module_memory_table(
            mon.model,
            getattr(mon, "optimizer", None),
            by_module,
            saved_total_bytes=total,
            unattributed_bytes=outside,
            step=step,
            forward_peak_bytes=self._fwd_peak,
            backward_peak_bytes=self._bwd_peak,
        )
        self.tables.append(table)
        if mon.writer is not None:
            top = table.rows[0] if table.rows else None
            msg = f"saved for backward {_fmt_bytes(table.saved_total_bytes)}"
            if top is not None:
                msg += f"; largest module {module_label(top.module, top.module_type)} {_fmt_bytes(top.total_bytes)}"
            mon.writer.log_event(step, "module_memory", "info", msg, table.to_dict())

    def on_exception(self, mon: SessionView, exc: BaseException) -> None:
        if self._tracker is not None:
            self._tracker.stop()


__all__ = [
    "LEAK_CATEGORIES",
    "CreationCapture",
    "LeakDetector",
    "LeakReport",
    "MemoryInstrument",
    "ModuleMemoryInstrument",
    "OomReport",
    "Trend",
    "oom_report",
    "theil_sen_slope",
    "trend",
    "write_oom_report",
]

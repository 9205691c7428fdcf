"""Profiling: profile() over torch.profiler with a bounded trace and a summary, plus seed-era timing/resource helpers."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn
from torch.profiler import ProfilerActivity, schedule

from . import timing

_MODULE_PREFIX = "module::"
DEFAULT_TRACE_BUDGET = 50 * 1024 * 1024  # bytes on disk


@dataclass(frozen=True)
class OpTime:
    """One op (or annotated range) over the profiled steps: calls and self time (not counting children)."""

    name: str
    calls: int
    self_cpu_s: float
    self_device_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "calls": self.calls,
            "self_cpu_s": self.self_cpu_s,
            "self_device_s": self.self_device_s,
        }


@dataclass(frozen=True)
class ModuleTime:
    """One module's forward time over the profiled steps: self (minus child modules) and total."""

    module: str
    calls: int
    self_s: float
    total_s: float

    def to_dict(self) -> dict[str, Any]:
        return {"module": self.module, "calls": self.calls, "self_s": self.self_s, "total_s": self.total_s}


@dataclass(frozen=True)
class ProfileSummary:
    """What :func:`profile` found: top ops and modules by self time, idle shares, data-loading share, trace file.

    ``cpu_idle_fraction``: share of the profiled wall time in which the main thread ran no torch op
    (Python overhead, data loading, waiting). ``gpu_idle_fraction``: share with no kernel running
    (None without CUDA). ``data_fraction``: share spent in the batches iterator.
    """

    steps: int
    wall_s: float
    data_s: float
    data_fraction: float
    cpu_idle_fraction: float | None
    gpu_idle_fraction: float | None
    top_ops: tuple[OpTime, ...]
    top_modules: tuple[ModuleTime, ...]
    trace_path: str | None = None
    trace_bytes: int | None = None
    trace_note: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)
    # with_flops=True: floating-point operations of the ops torch counts (matmul, conv) over the
    # profiled steps; profile_memory=True: the most bytes one op allocated (CPU, and device with CUDA)
    flops: int | None = None
    peak_op_memory_bytes: int | None = None

    @property
    def step_s(self) -> float:
        return self.wall_s / self.steps if self.steps else 0.0

    def __str__(self) -> str:
        lines = [f"profiled {self.steps} steps, {self.step_s * 1e3:.2f} ms/step"]
        shares = [f"data loading {self.data_fraction:.0%}"]
        if self.cpu_idle_fraction is not None:
            shares.append(f"CPU idle {self.cpu_idle_fraction:.0%}")
        if self.gpu_idle_fraction is not None:
            shares.append(f"GPU idle {self.gpu_idle_fraction:.0%}")
        lines.append("  " + ", ".join(shares))
        if self.top_ops:
            lines.append(f"  {'op':<40} {'calls':>7} {'self CPU ms':>12} {'self GPU ms':>12}")
            lines.extend(
                f"  {o.name[:40]:<40} {o.calls:>7} {o.self_cpu_s * 1e3:>12.3f} {o.self_device_s * 1e3:>12.3f}"
                for o in self.top_ops
            )
        if self.top_modules:
            lines.append(f"  {'module (forward)':<40} {'calls':>7} {'self ms':>12} {'total ms':>12}")
            lines.extend(
                f"  {(m.module or '<root>')[:40]:<40} {m.calls:>7} {m.self_s * 1e3:>12.3f} {m.total_s * 1e3:>12.3f}"
                for m in self.top_modules
            )
        if self.trace_path:
            lines.append(
                f"  trace: {self.trace_path} ({self.trace_bytes} bytes){'; ' + self.trace_note if self.trace_note else ''}"
            )
        if self.flops is not None:
            lines.append(
                f"  FLOPs {self.flops:,} over the profiled steps ({self.flops / max(self.steps, 1):,.0f}/step)"
            )
        if self.peak_op_memory_bytes is not None:
            lines.append(f"  largest allocation by one op: {self.peak_op_memory_bytes:,} bytes")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "wall_s": self.wall_s,
            "step_s": self.step_s,
            "data_s": self.data_s,
            "data_fraction": self.data_fraction,
            "cpu_idle_fraction": self.cpu_idle_fraction,
            "gpu_idle_fraction": self.gpu_idle_fraction,
            "top_ops": [o.to_dict() for o in self.top_ops],
            "top_modules": [m.to_dict() for m in self.top_modules],
            "trace_path": self.trace_path,
            "trace_bytes": self.trace_bytes,
            "trace_note": self.trace_note,
            "notes": list(self.notes),
            "flops": self.flops,
            "peak_op_memory_bytes": self.peak_op_memory_bytes,
        }


class _ModuleRanges:
    """record_function ranges named ``module::<qualified name>`` around every module's forward."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.names = {id(m): n for n, m in model.named_modules()}
        self._open: dict[int, list[Any]] = {}
        self._handles: list[Any] = []

    def _pre(self, module: nn.Module, args: Any) -> None:
        rf = torch.autograd.profiler.record_function(_MODULE_PREFIX + self.names.get(id(module), ""))
        rf.__enter__()
        self._open.setdefault(id(module), []).append(rf)

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        stack = self._open.get(id(module))
        if stack:
            stack.pop().__exit__(None, None, None)

    def __enter__(self) -> _ModuleRanges:
        for m in self.model.modules():
            self._handles.append(m.register_forward_pre_hook(self._pre))
            self._handles.append(m.register_forward_hook(self._post, always_call=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._open.clear()


def _union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping intervals."""
    total = 0.0
    end = -float("inf")
    start = 0.0
    for a, b in sorted(intervals):
        if a > end:
            if end > -float("inf"):
                total += end - start
            start, end = a, b
        else:
            end = max(end, b)
    if end > -float("inf"):
        total += end - start
    return total


def _bound_trace(path: Path, budget: int) -> tuple[Path, str]:
    """Keep the trace under ``budget`` bytes: gzip it, then drop event args (shapes, stacks), then the shortest events."""
    size = path.stat().st_size
    if size <= budget:
        return path, ""
    raw = path.read_bytes()
    gz = path.with_name(path.name + ".gz")
    gz.write_bytes(gzip.compress(raw, compresslevel=6))
    path.unlink()
    if gz.stat().st_size <= budget:
        return gz, f"gzip-compressed ({size} bytes raw; Perfetto and chrome://tracing open .json.gz)"
    trace = json.loads(raw)
    events = trace.get("traceEvents", [])
    for ev in events:
        ev.pop("args", None)
    data = gzip.compress(json.dumps(trace).encode(), compresslevel=6)
    note = "gzip-compressed, event args (shapes, stacks) dropped"
    if len(data) > budget:
        # keep metadata events and the longest ranges; the ratio is re-estimated until it fits
        meta = [e for e in events if e.get("ph") == "M"]
        timed = sorted((e for e in events if e.get("ph") != "M"), key=lambda e: -float(e.get("dur", 0) or 0))
        keep = len(timed)
        while keep > 0 and len(data) > budget:
            keep = int(keep * budget / len(data) * 0.9)
            trace["traceEvents"] = meta + timed[:keep]
            data = gzip.compress(json.dumps(trace).encode(), compresslevel=6)
        note += f", truncated to the {keep} longest of {len(timed)} events"
    gz.write_bytes(data)
    return gz, note


def profile(
    model: nn.Module,
    step_fn: Callable[[Any], Any],
    batches: Iterable[Any],
    steps: int = 5,
    run_dir: str | os.PathLike[str] | None = None,
    wait: int = 1,
    warmup: int = 1,
    *,
    record_shapes: bool = True,
    with_stack: bool = False,
    profile_memory: bool = True,
    with_flops: bool = True,
    trace_budget_bytes: int = DEFAULT_TRACE_BUDGET,
    top: int = 15,
) -> ProfileSummary:
    """Profile ``steps`` training steps with ``torch.profiler`` and summarise them.

    Runs ``wait + warmup + steps`` iterations of ``step_fn(next(batches))`` under a profiler
    schedule (only the last ``steps`` are recorded), with every module's forward annotated as a
    ``module::<name>`` range. Writes a Chrome/Perfetto trace ``profile-trace.json`` to ``run_dir``
    (when given), kept under ``trace_budget_bytes``: first gzip-compressed (``.json.gz``), then
    without per-event args (shapes, stacks), then only the longest events.

    Args:
        model: the model (for module annotations and to know its device).
        step_fn: ``step_fn(batch)`` runs one training step.
        batches: an iterable of batches; the time spent in its iterator is the data-loading share.
        steps: profiled (active) steps.
        run_dir: folder for the trace (None: no trace written).
        wait, warmup: schedule steps skipped, then run under the profiler but discarded.
        profile_memory, with_flops: torch.profiler's options, on as seed 000 configured them: the
            trace holds each op's allocations (``[memory]`` events) and FLOPs, the summary the
            total FLOPs and the largest allocation.

    Returns:
        A :class:`ProfileSummary` (``str()`` for the table, ``to_dict()`` for JSON).

    Raises:
        ValueError: ``steps < 1`` or negative wait/warmup.

    Cost: the profiled steps run 1.2-3x slower (more with ``record_shapes``/``with_stack``).

    Example:
        >>> m = torch.nn.Linear(4, 1)
        >>> s = profile(m, lambda b: m(b).sum().backward(), [torch.ones(2, 4)] * 4, steps=2)
        >>> s.steps
        2
    """
    if steps < 1 or wait < 0 or warmup < 0:
        raise ValueError(
            f"need steps >= 1 and wait, warmup >= 0; got steps={steps}, wait={wait}, warmup={warmup}"
        )
    cuda = torch.cuda.is_available() and any(p.is_cuda for p in model.parameters())
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    out_dir = Path(run_dir) if run_dir is not None else None
    trace: dict[str, Any] = {}
    notes: list[str] = []

    def on_ready(prof: torch.profiler.profile) -> None:
        if out_dir is None:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        p = out_dir / "profile-trace.json"
        prof.export_chrome_trace(str(p))
        final, note = _bound_trace(p, trace_budget_bytes)
        trace.update(path=str(final), bytes=final.stat().st_size, note=note)

    it: Iterator[Any] = iter(batches)
    total = wait + warmup + steps
    data_s = 0.0
    active_start: float | None = None
    active_end = 0.0
    done_active = 0
    sched = schedule(wait=wait, warmup=warmup, active=steps, repeat=1)
    clock = timing.host_clock  # the data and wall times: perf/'s one host clock
    with (
        _ModuleRanges(model),
        torch.profiler.profile(
            activities=activities,
            schedule=sched,
            on_trace_ready=on_ready,
            record_shapes=record_shapes,
            with_stack=with_stack,
            profile_memory=profile_memory,
            with_flops=with_flops,
        ) as prof,
    ):
        for i in range(total):
            active = i >= wait + warmup
            t0 = clock()
            if active and active_start is None:
                active_start = t0
            try:
                batch = next(it)
            except StopIteration:
                notes.append(f"the batches ran out after {i} of {total} iterations")
                break
            t1 = clock()
            step_fn(batch)
            if cuda:
                torch.cuda.synchronize()  # profiled steps only: attribute GPU time to its own step
            if active:
                data_s += t1 - t0
                done_active += 1
                active_end = clock()
            with _warnings_not_errors():
                prof.step()
    wall = (active_end - active_start) if active_start is not None and done_active else 0.0
    if done_active == 0:
        return ProfileSummary(
            steps=0, wall_s=0.0, data_s=0.0, data_fraction=0.0, cpu_idle_fraction=None, gpu_idle_fraction=None,
            top_ops=(), top_modules=(), notes=tuple(notes) or ("no step was profiled",),
        )  # fmt: skip
    return _summarise(prof, done_active, wall, data_s, cuda, top, trace, notes)


def _summarise(
    prof: Any,
    steps: int,
    wall: float,
    data_s: float,
    cuda: bool,
    top: int,
    trace: dict[str, Any],
    notes: list[str],
) -> ProfileSummary:
    avgs = prof.key_averages()
    ops: list[OpTime] = []
    mods: dict[str, tuple[int, float]] = {}
    flops = 0
    peak_mem = 0
    for a in avgs:
        name = a.key
        flops += int(getattr(a, "flops", 0) or 0)
        peak_mem = max(
            peak_mem,
            int(getattr(a, "cpu_memory_usage", 0) or 0),
            int(getattr(a, "device_memory_usage", 0) or 0),
        )
        if name.startswith(_MODULE_PREFIX):
            mods[name[len(_MODULE_PREFIX) :]] = (int(a.count), float(a.cpu_time_total) / 1e6)
        elif not name.startswith("ProfilerStep"):
            dev = float(getattr(a, "self_device_time_total", 0.0) or 0.0) / 1e6
            ops.append(OpTime(name, int(a.count), float(a.self_cpu_time_total) / 1e6, dev))
    ops.sort(key=lambda o: -(o.self_cpu_s + o.self_device_s))
    # module self time = its range minus its direct child modules' ranges (qualified names nest)
    children: dict[str, float] = {}
    for name, (_, tot) in mods.items():
        if name:
            parent = name.rpartition(".")[0]
            children[parent] = children.get(parent, 0.0) + tot
    mtimes = [ModuleTime(n, c, max(0.0, tot - children.get(n, 0.0)), tot) for n, (c, tot) in mods.items()]
    mtimes.sort(key=lambda m: -m.self_s)
    cpu_busy: list[tuple[float, float]] = []
    gpu_busy: list[tuple[float, float]] = []
    for e in prof.events():
        tr = e.time_range
        if getattr(e, "device_type", None) is not None and e.device_type != torch.autograd.DeviceType.CPU:
            gpu_busy.append((tr.start, tr.end))
        elif not e.name.startswith(("ProfilerStep", _MODULE_PREFIX)):
            # every op, nested or not: the union counts nested ones once; the step and module
            # ranges are left out (they cover Python overhead and waiting too)
            cpu_busy.append((tr.start, tr.end))
    wall_us = wall * 1e6
    cpu_idle = max(0.0, 1.0 - _union_length(cpu_busy) / wall_us) if wall_us > 0 else None
    gpu_idle = (max(0.0, 1.0 - _union_length(gpu_busy) / wall_us) if wall_us > 0 else None) if cuda else None
    return ProfileSummary(
        steps=steps,
        wall_s=wall,
        data_s=data_s,
        data_fraction=data_s / wall if wall > 0 else 0.0,
        cpu_idle_fraction=cpu_idle,
        gpu_idle_fraction=gpu_idle,
        top_ops=tuple(ops[:top]),
        top_modules=tuple(mtimes[:top]),
        trace_path=trace.get("path"),
        trace_bytes=trace.get("bytes"),
        trace_note=trace.get("note", ""),
        notes=tuple(notes),
        flops=flops if getattr(prof, "with_flops", False) else None,
        peak_op_memory_bytes=peak_mem if getattr(prof, "profile_memory", False) else None,
    )


# --------------------------------------------------------------------------------------------------
# seed-era names


@dataclass
class PerformanceRecord:
    """Wall time of one block (``elapsed_s`` set when it ends) and whether it passed the slow threshold."""

    operation: str
    elapsed_s: float = 0.0
    slow: bool = False

    def __str__(self) -> str:
        return f"{self.operation}: {self.elapsed_s * 1e3:.2f} ms{' (slow)' if self.slow else ''}"

    def to_dict(self) -> dict[str, Any]:
        return {"operation": self.operation, "elapsed_s": self.elapsed_s, "slow": self.slow}


@contextlib.contextmanager
def debug_performance(
    operation: str, *, slow_threshold_s: float = 10.0, synchronize: bool = True
) -> Iterator[PerformanceRecord]:
    """Time a block; the yielded record gets ``elapsed_s`` and ``slow`` (> ``slow_threshold_s``) on exit.

    Args:
        operation: a label.
        slow_threshold_s: mark the block slow above this many seconds.
        synchronize: on CUDA, synchronize before and after so GPU work is inside the timing (costs a sync).

    Example:
        >>> with debug_performance("matmul") as rec:
        ...     _ = torch.ones(64, 64) @ torch.ones(64, 64)
        >>> rec.elapsed_s > 0
        True
    """
    sync = synchronize and torch.cuda.is_available() and torch.cuda.is_initialized()
    rec = PerformanceRecord(operation)
    if sync:
        torch.cuda.synchronize()
    clock = timing.host_clock
    t0 = clock()
    try:
        yield rec
    finally:
        if sync:
            torch.cuda.synchronize()
        rec.elapsed_s = clock() - t0
        rec.slow = rec.elapsed_s > slow_threshold_s


def profile_model_performance(
    model: nn.Module,
    dataloader: Iterable[Any],
    num_batches: int = 10,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    run_dir: str | os.PathLike[str] | None = None,
    with_stack: bool = True,
    record_shapes: bool = True,
) -> ProfileSummary:
    """Seed-era entry point: profile ``num_batches`` steps of ``model`` over ``dataloader``.

    Each batch is a tensor (``model(batch)``) or ``(inputs, targets, ...)`` (``model(inputs)``).
    With ``loss_fn`` the step is ``loss_fn(output, targets)`` + backward (+ ``optimizer`` step);
    without, forward only under ``torch.no_grad()``. One wait and one warm-up batch precede them.
    ``with_stack`` and ``record_shapes`` are on, as seed 000 configured its profiler: the trace
    carries Python stacks (``python_function`` events) and input shapes (the trace budget trims
    them first when the trace grows too large).

    Example:
        >>> m = torch.nn.Linear(4, 1)
        >>> profile_model_performance(m, [torch.ones(2, 4)] * 5, num_batches=3).steps
        3
    """

    def step_fn(batch: Any) -> None:
        if isinstance(batch, (tuple, list)) and batch:
            x, rest = batch[0], list(batch[1:])
        else:
            x, rest = batch, []
        if loss_fn is None:
            with torch.no_grad():
                model(x)
            return
        loss = loss_fn(model(x), *rest)
        loss.backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return profile(
        model,
        step_fn,
        dataloader,
        steps=num_batches,
        run_dir=run_dir,
        with_stack=with_stack,
        record_shapes=record_shapes,
    )


def monitor_resources(
    cpu_threshold: float = 90,
    memory_threshold: float = 90,
    gpu_memory_threshold_bytes: int | None = None,
    *,
    interval: float = 0.1,
) -> dict[str, Any]:
    """CPU %, system memory %, process RSS and per-GPU memory, with warnings listed (never printed).

    Args:
        cpu_threshold: warn above this system CPU percentage.
        memory_threshold: warn above this system memory percentage.
        gpu_memory_threshold_bytes: warn when a GPU's allocated bytes exceed it (None: no GPU warning).
        interval: seconds over which CPU use is measured (the call blocks that long).

    Returns:
        ``{"cpu_percent", "memory_percent", "rss", "gpus": [{"device", "allocated", "reserved",
        "total"}], "warnings": [str]}``.

    Example:
        >>> r = monitor_resources(cpu_threshold=101, interval=0.0)
        >>> r["warnings"] == [] or "memory" in r["warnings"][0]
        True
    """
    cpu = (
        float(psutil.cpu_percent(interval=interval))
        if interval > 0
        else float(psutil.cpu_percent(interval=None))
    )
    vm = psutil.virtual_memory()
    out: dict[str, Any] = {
        "cpu_percent": cpu,
        "memory_percent": float(vm.percent),
        "rss": int(psutil.Process(os.getpid()).memory_info().rss),
        "gpus": [],
        "warnings": [],
    }
    if cpu > cpu_threshold:
        out["warnings"].append(f"CPU use {cpu:.0f}% is above {cpu_threshold:g}%")
    if vm.percent > memory_threshold:
        out["warnings"].append(f"system memory use {vm.percent:.0f}% is above {memory_threshold:g}%")
    for g in _gpu_readings():
        out["gpus"].append(g)
        alloc = g["allocated"]
        if gpu_memory_threshold_bytes is not None and alloc > gpu_memory_threshold_bytes:
            out["warnings"].append(
                f"GPU {g['device']} allocated {alloc} bytes ({alloc / 2**20:.1f} MiB), "
                f"above {gpu_memory_threshold_bytes} bytes"
            )
    return out


def _gpu_readings() -> list[dict[str, int]]:
    """Per CUDA device: allocated, reserved and total bytes (allocator counters: no device sync)."""
    if not torch.cuda.is_available():
        return []
    return [
        {
            "device": dev,
            "allocated": int(torch.cuda.memory_allocated(dev)),
            "reserved": int(torch.cuda.memory_reserved(dev)),
            "total": int(torch.cuda.get_device_properties(dev).total_memory),
        }
        for dev in range(torch.cuda.device_count())
    ]


__all__ = [
    "DEFAULT_TRACE_BUDGET",
    "ModuleTime",
    "OpTime",
    "PerformanceRecord",
    "ProfileSummary",
    "debug_performance",
    "monitor_resources",
    "profile",
    "profile_model_performance",
]


@contextlib.contextmanager
def _warnings_not_errors() -> Iterator[None]:
    """torch.profiler's state changes (start, step, stop) with warnings shown, never raised: a warning
    that a ``-W error`` filter (pytest's ``filterwarnings = error``) turns into an exception halfway
    through the profiler's C++ start leaves it half-started, and the stop at exit then crashes the
    process (seen on an H100, torch 2.11, CUDA activity)."""
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        yield

"""An honest A/B harness for speed modes: AMP, torch.compile, activation checkpointing, against a plain baseline.

``compare_modes`` trains a copy of the model under each mode on the same batches with the same seeds
and reports step time (median and spread after warm-up, compile time apart), peak memory, throughput
and the numerics against the baseline (loss and gradient relative difference, the first step where
they diverge, NaN/Inf). Seed 004's ``OptimizationMode`` names the modes.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import functools
import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..health.inspection import call_model


class OptimizationMode(str, enum.Enum):
    """Seed 004's modes. ``FULL_OPTIMIZATION`` is AMP + COMPILATION + MEMORY_EFFICIENT together."""

    NONE = "none"
    AMP = "amp"
    COMPILATION = "compilation"
    MEMORY_EFFICIENT = "memory_efficient"
    FULL_OPTIMIZATION = "full_optimization"

    @classmethod
    def _missing_(cls, value: object) -> OptimizationMode | None:
        if isinstance(value, str):
            key = value.strip().lower().replace("-", "_")
            return next((m for m in cls if m.value == key), None)
        return None

    def __str__(self) -> str:
        return self.value


def _mode(mode: OptimizationMode | str) -> OptimizationMode:
    try:
        return OptimizationMode(mode)
    except ValueError:
        allowed = ", ".join(m.value for m in OptimizationMode)
        raise ValueError(f"unknown optimization mode {mode!r}; use one of {allowed}") from None


def _parts(mode: OptimizationMode) -> set[str]:
    if mode is OptimizationMode.FULL_OPTIMIZATION:
        return {"amp", "compile", "checkpoint"}
    return {
        OptimizationMode.NONE: set(),
        OptimizationMode.AMP: {"amp"},
        OptimizationMode.COMPILATION: {"compile"},
        OptimizationMode.MEMORY_EFFICIENT: {"checkpoint"},
    }[mode]


def _device_of(model: nn.Module) -> torch.device:
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


def amp_dtype(device: torch.device) -> torch.dtype:
    """The autocast dtype for ``device``: bfloat16 on CPU and on CUDA that supports it, else float16."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def repeated_blocks(model: nn.Module) -> list[str]:
    """Qualified names of repeated blocks: non-leaf children of a container that share their class.

    E.g. the layers of a ``ModuleList`` of transformer blocks. These are what activation checkpointing
    wraps (recomputing a block's forward in backward instead of keeping its activations).
    """
    found: list[str] = []
    for name, mod in model.named_modules():
        kids = [(n, c) for n, c in mod.named_children() if next(iter(c.children()), None) is not None]
        by_type: dict[type, list[str]] = {}
        for n, c in kids:
            by_type.setdefault(type(c), []).append(f"{name}.{n}" if name else n)
        for names in by_type.values():
            if len(names) >= 2:
                found.extend(names)
    return found


class _Checkpointed:
    """A block's forward replaced by ``torch.utils.checkpoint`` of the original (non-reentrant)."""

    def __init__(self, forward: Callable[..., Any]) -> None:
        self.forward = forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)


class _Autocast(nn.Module):
    """Runs the wrapped model under ``torch.autocast``; low-precision float outputs come back in float32."""

    def __init__(self, model: nn.Module, device_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.model = model
        self.device_type = device_type
        self.dtype = dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            out = self.model(*args, **kwargs)
        return _to_float32(out)


def _to_float32(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.float() if out.dtype in (torch.float16, torch.bfloat16) else out
    if isinstance(out, tuple):
        return tuple(_to_float32(o) for o in out)
    if isinstance(out, list):
        return [_to_float32(o) for o in out]
    if isinstance(out, dict):
        return {k: _to_float32(v) for k, v in out.items()}
    return out


@dataclass
class Prepared:
    """A model made ready for one mode: what to call, whether to scale the loss, what was applied."""

    model: nn.Module  # the (possibly wrapped or compiled) callable
    scaler: Any  # a GradScaler for fp16 AMP on CUDA, else None
    applied: list[str] = field(default_factory=list)
    compiled: bool = False


def prepare(
    model: nn.Module, mode: OptimizationMode | str, *, compile_options: dict[str, Any] | None = None
) -> Prepared:
    """Apply ``mode`` to ``model`` IN PLACE (checkpointing, channels_last) and wrap it (autocast, compile).

    - AMP: ``torch.autocast`` (bfloat16 on CPU and bf16-capable CUDA; float16 + ``GradScaler`` otherwise);
    - COMPILATION: ``torch.compile(model, **compile_options)``;
    - MEMORY_EFFICIENT: activation checkpointing of ``repeated_blocks(model)`` and ``channels_last``
      when the model has a ``Conv2d``;
    - FULL_OPTIMIZATION: all three.

    Raises:
        ValueError: unknown mode.
    """
    m = _mode(mode)
    parts = _parts(m)
    applied: list[str] = []
    device = _device_of(model)
    scaler = None
    out: nn.Module = model
    if "checkpoint" in parts:
        blocks = repeated_blocks(model)
        for name in blocks:
            block = model.get_submodule(name)
            block.forward = _Checkpointed(block.forward)  # type: ignore[method-assign]
        applied.append(
            f"activation checkpointing of {len(blocks)} repeated blocks"
            if blocks
            else "no repeated blocks: nothing checkpointed"
        )
        if any(isinstance(x, nn.Conv2d) for x in model.modules()):
            model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
            applied.append("channels_last")
    if "amp" in parts:
        dtype = amp_dtype(device)
        out = _Autocast(out, device.type, dtype)
        applied.append(f"autocast {str(dtype).removeprefix('torch.')} on {device.type}")
        if dtype is torch.float16:
            scaler = torch.amp.GradScaler(device.type)
            applied.append("GradScaler")
    compiled = False
    if "compile" in parts:
        out = torch.compile(out, **(compile_options or {}))  # type: ignore[assignment]
        compiled = True
        backend = (compile_options or {}).get("backend", "inductor")
        applied.append(f"torch.compile (backend {backend})")
    return Prepared(out, scaler, applied, compiled)


@dataclass
class ModeResult:
    """One mode's measurements (seconds, bytes, samples/s); ``error`` when the mode failed."""

    mode: str
    steps: int = 0
    warmup: int = 0
    step_times: list[float] = field(default_factory=list)
    median_s: float | None = None
    p25_s: float | None = None
    p75_s: float | None = None
    min_s: float | None = None
    max_s: float | None = None
    compile_s: float | None = None
    throughput: float | None = None
    peak_bytes: int | None = None
    memory_kind: str = ""
    speedup: float | None = None
    losses: list[float] = field(default_factory=list)
    loss_rel_diff: float | None = None
    grad_rel_diff: float | None = None
    grad_rel_steps: list[float] = field(default_factory=list)  # per step, vs the baseline
    first_divergence: int | None = None
    nonfinite_steps: list[int] = field(default_factory=list)
    applied: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def total_time(self) -> float:
        """Seconds over all steps, warm-up included."""
        return sum(self.step_times)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every field, ``total_time`` added; NaN/Inf as strings."""
        from ..events import plain

        d = {k: plain(v) for k, v in self.__dict__.items()}
        d["total_time"] = self.total_time
        return d


@dataclass
class ModeComparison:
    """``compare_modes``' result: ``results[mode]`` per mode, the first one is the baseline."""

    results: dict[str, ModeResult]
    baseline: str
    rtol: float
    device: str

    def __getitem__(self, mode: OptimizationMode | str) -> ModeResult:
        return self.results[_mode(mode).value]

    def to_dict(self) -> dict[str, Any]:
        return {
            "baseline": self.baseline,
            "rtol": self.rtol,
            "device": self.device,
            "results": {k: v.to_dict() for k, v in self.results.items()},
        }

    def __str__(self) -> str:
        def ms(x: float | None) -> str:
            return "-" if x is None else f"{x * 1e3:.2f}"

        def num(x: float | None, f: str = ".3g") -> str:
            return "-" if x is None else format(x, f)

        head = ["mode", "median ms", "p25-p75 ms", "compile s", "samples/s", "speedup", "peak MiB", "loss rel", "grad rel", "diverges", "NaN/Inf"]  # fmt: skip
        rows = [head]
        for r in self.results.values():
            if r.error is not None:
                rows.append([r.mode, f"error: {r.error}"] + [""] * (len(head) - 2))
                continue
            rows.append(
                [
                    r.mode,
                    ms(r.median_s),
                    f"{ms(r.p25_s)}-{ms(r.p75_s)}",
                    num(r.compile_s, ".2f"),
                    num(r.throughput, ".1f"),
                    num(r.speedup, ".2f") + ("x" if r.speedup is not None else ""),
                    "-" if r.peak_bytes is None else f"{r.peak_bytes / 2**20:.2f}",
                    num(r.loss_rel_diff, ".2e"),
                    num(r.grad_rel_diff, ".2e"),
                    "-" if r.first_divergence is None else f"step {r.first_divergence}",
                    ",".join(map(str, r.nonfinite_steps[:5])) or "none",
                ]
            )
        widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
        lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        kinds = {r.memory_kind for r in self.results.values() if r.memory_kind}
        note = f"peak memory: {', '.join(sorted(kinds))}; " if kinds else ""
        lines.append(
            f"baseline {self.baseline} on {self.device}; {note}diverges = first step with loss or gradient "
            f"relative difference > {self.rtol:g}"
        )
        return "\n".join(lines)


@contextlib.contextmanager
def _saved_bytes() -> Iterator[list[int]]:
    """Bytes of the distinct storages autograd saves for backward while the block runs (activation memory)."""
    seen: set[int] = set()
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        try:
            st = t.untyped_storage()
            key = st.data_ptr()
            if key not in seen:
                seen.add(key)
                total[0] += st.nbytes()
        except Exception:
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batch_size(x: Any) -> int:
    from .._trees import tensor_leaves

    leaves = tensor_leaves(x)
    return int(leaves[0].shape[0]) if leaves and leaves[0].dim() > 0 else 1


def _run(
    model0: nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    batches: Sequence[tuple[Any, Any]],
    mode: OptimizationMode,
    optimizer_fn: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    *,
    seed: int,
    warmup: int,
    compile_options: dict[str, Any] | None,
    base_grads: list[torch.Tensor] | None,
    keep_grads: bool,
) -> tuple[ModeResult, list[torch.Tensor]]:
    model = copy.deepcopy(model0)
    model.train()
    device = _device_of(model)
    prep = prepare(model, mode, compile_options=compile_options)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer_fn(params)
    res = ModeResult(mode=mode.value, steps=len(batches), warmup=warmup, applied=prep.applied)
    grads_kept: list[torch.Tensor] = []
    measure_saved = device.type != "cuda" and not prep.compiled
    peaks: list[int] = []
    for i, (x, y) in enumerate(batches):
        torch.manual_seed(seed + i)  # same dropout masks in every mode
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with _saved_bytes() if measure_saved else contextlib.nullcontext([0]) as saved:
            loss = loss_fn(call_model(prep.model, x), y)
        if prep.scaler is not None:
            prep.scaler.scale(loss).backward()
            prep.scaler.unscale_(opt)
        else:
            loss.backward()
        with torch.no_grad():  # the gradients the update sees, copied outside the timed region below
            flat = torch.cat([p.grad.detach().flatten().float() for p in params if p.grad is not None])
            g = flat.clone()
        if prep.scaler is not None:
            prep.scaler.step(opt)
            prep.scaler.update()
        else:
            opt.step()
        _sync(device)
        res.step_times.append(time.perf_counter() - t0)
        peaks.append(int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else int(saved[0]))
        g = g.cpu()
        loss_v = float(loss.detach().float())
        res.losses.append(loss_v)
        if not math.isfinite(loss_v) or not bool(torch.isfinite(g).all()):
            res.nonfinite_steps.append(i)
        if keep_grads:
            grads_kept.append(g)
        if base_grads is not None and i < len(base_grads):
            b = base_grads[i]
            rel = float(torch.linalg.vector_norm(g - b) / torch.linalg.vector_norm(b).clamp_min(1e-30))
            res.grad_rel_steps.append(rel)
            res.grad_rel_diff = rel if res.grad_rel_diff is None else max(res.grad_rel_diff, rel)
    timed = res.step_times[warmup:] or res.step_times
    res.median_s = statistics.median(timed)
    q = statistics.quantiles(timed, n=4) if len(timed) >= 2 else [timed[0]] * 3
    res.p25_s, res.p75_s = q[0], q[2]
    res.min_s, res.max_s = min(timed), max(timed)
    if prep.compiled and warmup > 0:
        res.compile_s = max(0.0, res.step_times[0] - res.median_s)  # the first call traces and compiles
    res.throughput = _batch_size(batches[0][0]) / res.median_s if res.median_s else None
    if device.type == "cuda":
        res.peak_bytes, res.memory_kind = max(peaks[warmup:] or peaks), "CUDA peak allocated"
    elif measure_saved:
        res.peak_bytes, res.memory_kind = max(peaks), "activations saved for backward (CPU)"
    return res, grads_kept


def compare_modes(
    model: nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    batches: Iterable[tuple[Any, Any]],
    modes: Sequence[OptimizationMode | str] = (
        OptimizationMode.NONE,
        OptimizationMode.AMP,
        OptimizationMode.COMPILATION,
        OptimizationMode.MEMORY_EFFICIENT,
    ),
    *,
    optimizer_fn: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    warmup: int = 1,
    seed: int = 0,
    rtol: float = 0.05,
    compile_options: dict[str, Any] | None = None,
) -> ModeComparison:
    """Train a copy of ``model`` under each mode on the same batches and seeds; compare speed, memory, numerics.

    The first mode is the baseline (put ``NONE`` first). Each mode starts from the same weights (a deep
    copy), gets a fresh optimizer from ``optimizer_fn`` and ``torch.manual_seed(seed + step)`` before
    each step. ``model`` itself is not touched. A mode that fails gets ``ModeResult.error`` (never an
    exception) and the others go on.

    Args:
        model: the model (its device is where everything runs).
        loss_fn: ``loss_fn(output, target) -> scalar``.
        batches: ``(inputs, target)`` pairs; inputs as ``call_model`` takes them (tensor, tuple, dict).
        modes: ``OptimizationMode`` values or names.
        optimizer_fn: builds the optimizer from parameters; default ``SGD(lr=0.01)``.
        warmup: steps left out of the timing statistics (the first call of a compiled model compiles:
            its excess over the median is ``compile_s``).
        seed: base of the per-step seeds.
        rtol: relative difference of loss or gradients to the baseline above which a step diverges.
        compile_options: keyword arguments of ``torch.compile`` (e.g. ``{"backend": "aot_eager"}``).

    Returns:
        ``ModeComparison``: ``str()`` a table, ``[mode]`` a ``ModeResult``, ``.to_dict()``.

    Raises:
        TypeError: ``model`` not an ``nn.Module`` or ``loss_fn`` not callable.
        ValueError: an unknown mode, no batches, or ``warmup`` not below the number of batches.

    Example::

        cmp = td.compare_modes(model, F.cross_entropy, batches[:20], modes=["none", "amp", "compilation"])
        print(cmp)   # median step time, spread, compile time, memory, speedup, numerics per mode

    Cost: ``len(modes)`` training runs over ``batches``, plus a CPU copy of the baseline's gradients
    per step (steps x parameters x 4 bytes) for the gradient comparison.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"compare_modes(model, ...): model must be a torch.nn.Module, got {type(model).__name__}"
        )
    if not callable(loss_fn):
        raise TypeError(
            f"compare_modes(model, loss_fn, ...): loss_fn must be callable (outputs, target) -> loss, "
            f"got {type(loss_fn).__name__}"
        )
    chosen = [_mode(m) for m in modes]
    data = list(batches)
    if not data:
        raise ValueError("compare_modes needs at least one (inputs, target) batch")
    if not 0 <= warmup < len(data):
        raise ValueError(f"warmup={warmup} must be >= 0 and below the number of batches ({len(data)})")
    opt_fn = optimizer_fn or functools.partial(torch.optim.SGD, lr=0.01)
    results: dict[str, ModeResult] = {}
    base: ModeResult | None = None
    base_grads: list[torch.Tensor] | None = None
    for i, mode in enumerate(chosen):
        try:
            res, grads = _run(
                model,
                loss_fn,
                data,
                mode,
                opt_fn,
                seed=seed,
                warmup=warmup,
                compile_options=compile_options,
                base_grads=base_grads,
                keep_grads=i == 0,
            )
        except Exception as exc:  # a failing mode is a result, not a crash of the comparison
            results[mode.value] = ModeResult(mode=mode.value, error=f"{type(exc).__name__}: {exc}")
            continue
        if i == 0:
            base, base_grads = res, grads
            res.loss_rel_diff, res.grad_rel_diff, res.speedup = 0.0, 0.0, 1.0
        elif base is not None:
            diffs = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(res.losses, base.losses)]
            res.loss_rel_diff = max(diffs) if diffs else None
            res.speedup = base.median_s / res.median_s if base.median_s and res.median_s else None
            res.first_divergence = _first_divergence(res, base, rtol)
        results[mode.value] = res
    device = str(_device_of(model))
    return ModeComparison(results, chosen[0].value, rtol, device)


def _first_divergence(res: ModeResult, base: ModeResult, rtol: float) -> int | None:
    """The first step whose loss or gradients differ from the baseline's by more than ``rtol`` (relative)."""
    for i, (a, b) in enumerate(zip(res.losses, base.losses)):
        grad = res.grad_rel_steps[i] if i < len(res.grad_rel_steps) else 0.0
        if not math.isfinite(a) or abs(a - b) > rtol * max(abs(b), 1e-30) or not grad <= rtol:
            return i
    return None


__all__ = [
    "ModeComparison",
    "ModeResult",
    "OptimizationMode",
    "Prepared",
    "amp_dtype",
    "compare_modes",
    "prepare",
    "repeated_blocks",
]

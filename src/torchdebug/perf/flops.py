"""FLOPs: count_flops / FlopReport (standalone) and the FlopsInstrument (one counted step, per module, uncounted ops, MFU)."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from .._installs import Installs
from .._step import SessionView
from .._tensors import in_functorch_transform
from .._trees import tensor_leaves
from ..events import RuleEvent, module_label, not_under_compile
from ..memory.analysis import called_by_torchdebug
from ._gradhooks import make_tracker_safe

# Ops that move or create memory and do no arithmetic: 0 FLOPs by definition, never "uncounted".
_NO_ARITHMETIC = frozenset(
    {
        "aten.detach",
        "aten.clone",
        "aten.copy_",
        "aten._to_copy",
        "aten.empty",
        "aten.empty_like",
        "aten.empty_strided",
        "aten.new_empty",
        "aten.new_empty_strided",
        "aten.new_zeros",
        "aten.new_ones",
        "aten.zeros",
        "aten.zeros_like",
        "aten.ones",
        "aten.ones_like",
        "aten.full",
        "aten.full_like",
        "aten.fill_",
        "aten.zero_",
        "aten.lift_fresh",
        "aten.scalar_tensor",
        "aten._local_scalar_dense",
        "aten.cat",
        "aten.stack",
        "aten.contiguous",
        "aten.set_",
        "aten.resize_",
        "aten.split_with_sizes_copy",
    }
)

# Dense bf16/fp16 tensor-core peak FLOP/s from vendor data sheets (no sparsity), matched against
# torch.cuda.get_device_name() in order (more specific names first). fp32 training reaches far
# less: pass config.peak_flops for your precision, or for any device not listed.
KNOWN_PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("V100", 125e12),
    ("T4", 65e12),
    ("MI300X", 1307e12),
)


def peak_flops_for(device_name: str) -> float | None:
    """Peak FLOP/s for a known GPU name from :data:`KNOWN_PEAK_FLOPS`; None when unknown.

    Example:
        >>> peak_flops_for("NVIDIA H100 80GB HBM3")
        989000000000000.0
    """
    for key, peak in KNOWN_PEAK_FLOPS:
        if key.lower() in device_name.lower():
            return peak
    return None


class _OpRecorder(TorchDispatchMode):
    """Counts every aten op that runs (by overload packet) and the elements of their outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = defaultdict(int)
        self.elements: dict[str, int] = defaultdict(int)
        self.views: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if called_by_torchdebug(sys._getframe(1), allow=("flops.py",)):
            return out  # our own bookkeeping (the monitor's norms and flags) is not the model's work
        name = str(func._overloadpacket)
        self.calls[name] += 1
        if getattr(func, "is_view", False):
            self.views.add(name)
        for t in tensor_leaves(out):
            self.elements[name] += t.numel()
        return out


def _qualify(tracker_name: str, root_type: str) -> str | None:
    """ModuleTracker names ("Net.blocks.0") -> qualified names ("blocks.0"); the root -> ""."""
    if tracker_name == root_type:
        return ""
    if tracker_name.startswith(root_type + "."):
        return tracker_name[len(root_type) + 1 :]
    return None


class _FlopSession:
    """One FlopCounterMode + op recorder over forward (+loss) + backward, split at the phase marks."""

    def __init__(self, model: nn.Module, installs: Installs | None = None) -> None:
        self.model = model
        self.installs = installs if installs is not None else Installs()
        self.root_type = type(model).__name__
        self.counter: flop_counter.FlopCounterMode | None = None
        self.recorder: _OpRecorder | None = None
        self.forward: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.backward: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.other: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.calls: dict[str, int] = defaultdict(int)
        self.elements: dict[str, int] = defaultdict(int)
        self.views: set[str] = set()
        self.registry = {str(k) for k in flop_counter.flop_registry}
        self._mark: dict[str, dict[str, int]] = {}
        self.thread = threading.current_thread()
        self.active = False

    def _counts(self) -> dict[str, dict[str, int]]:
        assert self.counter is not None
        return {k: {str(op): n for op, n in v.items()} for k, v in self.counter.get_flop_counts().items()}

    def _add_delta(self, into: dict[str, dict[str, int]]) -> None:
        now = self._counts()
        for mod, ops in now.items():
            before = self._mark.get(mod, {})
            for op, n in ops.items():
                d = n - before.get(op, 0)
                if d:
                    into[mod][op] += d
        self._mark = now

    def start(self) -> None:
        self.counter = flop_counter.FlopCounterMode(display=False, depth=1000)
        # Started from inside the root's forward, the tracker never sees the root enter and would
        # name its children by class only ("Linear"); naming the tree up front keeps "Net.fc1".
        # Private ModuleTracker API: without it the per-module split is lost, the totals are not.
        with contextlib.suppress(AttributeError):
            self.counter.mod_tracker._get_mod_name(self.model)
            make_tracker_safe(self.counter.mod_tracker)  # else it breaks torch.autograd.grad() penalties
        inst = self.installs
        inst.enter(self.counter)
        # the tracker's global module hooks: removable from any thread, even if this one ends first
        with contextlib.suppress(AttributeError):
            inst.hook(self.counter.mod_tracker._fw_pre_handle)
            inst.hook(self.counter.mod_tracker._fw_post_handle)
        self.recorder = _OpRecorder()
        try:
            inst.enter(self.recorder)
        except BaseException:
            inst.leave(self.counter)
            self.counter = None
            raise
        self._mark = {}
        self.thread = threading.current_thread()
        self.active = True

    def forward_end(self) -> None:
        if self.active:
            self._add_delta(self.forward)

    def backward_start(self) -> None:
        if self.active:
            self._add_delta(self.other)

    def stop(self, phase: str = "backward") -> None:
        """Close the window, crediting what ran since the last mark to ``phase``."""
        if not self.active:
            return
        self.active = False
        rec, cnt = self.recorder, self.counter
        assert rec is not None and cnt is not None
        if threading.current_thread() is not self.thread:
            # the modes are on the stack of the thread that started counting: unreachable from here
            # (its global hooks are removed with the session's installs)
            self.counter = self.recorder = None
            raise RuntimeError("FLOP counting began in another thread; the count was abandoned")
        if _get_current_dispatch_mode() is not rec:
            # another dispatch mode was entered above ours and is still open: leaving now would pop
            # it instead; give up on this count rather than corrupt the caller's mode stack
            raise RuntimeError("FLOP counting overlapped another dispatch mode; the count was abandoned")
        self.installs.leave(rec)
        try:
            self._add_delta({"backward": self.backward, "forward": self.forward, "other": self.other}[phase])
        finally:
            self.installs.leave(cnt)
        for k, v in rec.calls.items():
            self.calls[k] += v
        for k, v in rec.elements.items():
            self.elements[k] += v
        self.views |= rec.views
        self.counter = self.recorder = None

    def report(self) -> FlopReport:
        def per_module(src: Mapping[str, Mapping[str, int]]) -> dict[str, int]:
            out: dict[str, int] = {}
            for mod, ops in src.items():
                q = _qualify(mod, self.root_type)
                if q is not None and q != "":
                    out[q] = out.get(q, 0) + sum(ops.values())
            return out

        fwd_total = sum(self.forward.get("Global", {}).values())
        bwd_total = sum(self.backward.get("Global", {}).values())
        other_total = sum(self.other.get("Global", {}).values())
        fm, bm = per_module(self.forward), per_module(self.backward)
        modules = {
            name: {"forward": fm.get(name, 0), "backward": bm.get(name, 0)}
            for name in sorted(set(fm) | set(bm))
        }
        # the root is credited with everything inside it (its own pre-hook ran before counting began)
        modules[""] = {"forward": fwd_total, "backward": bwd_total}
        by_op: dict[str, int] = defaultdict(int)
        for src in (self.forward, self.backward, self.other):
            for op, n in src.get("Global", {}).items():
                by_op[op] += n
        uncounted = {
            op: {"calls": n, "output_elements": self.elements.get(op, 0)}
            for op, n in sorted(self.calls.items())
            if op not in self.registry and op not in _NO_ARITHMETIC and op not in self.views
        }
        return FlopReport(
            total=fwd_total + bwd_total + other_total,
            forward=fwd_total,
            backward=bwd_total,
            other=other_total,
            by_module=modules,
            by_op=dict(sorted(by_op.items(), key=lambda kv: -kv[1])),
            uncounted=uncounted,
        )


@dataclass(frozen=True)
class FlopReport:
    """FLOPs of one step (forward, backward, other = loss code between them) by module and op.

    ``by_module`` maps qualified module names to ``{"forward": n, "backward": n}`` inclusive of
    children (the root ``""`` holds everything). ``uncounted`` lists the aten ops that ran but have
    no FLOP formula in ``torch.utils.flop_counter`` (elementwise ops, reductions, norms, custom
    kernels ...) with their calls and output elements, so their cost is visible instead of silently
    0; ops that only move or create memory (views, copies, ``empty``) are left out of that list.
    """

    total: int
    forward: int
    backward: int
    other: int = 0
    by_module: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    by_op: Mapping[str, int] = field(default_factory=dict)
    uncounted: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    step: int | None = None
    step_time_s: float | None = None
    peak_flops: float | None = None

    @property
    def achieved_flops_per_s(self) -> float | None:
        return self.total / self.step_time_s if self.step_time_s else None

    @property
    def mfu(self) -> float | None:
        """Model FLOP utilisation: ``total / step_time_s / peak_flops`` (None without both)."""
        a = self.achieved_flops_per_s
        return a / self.peak_flops if a is not None and self.peak_flops else None

    def __str__(self) -> str:
        lines = [
            f"FLOPs per step: {self.total:,} (forward {self.forward:,}, backward {self.backward:,}"
            + (f", other {self.other:,}" if self.other else "")
            + ")"
        ]
        if self.mfu is not None and self.step_time_s is not None:
            lines.append(
                f"MFU {self.mfu:.1%} ({self.achieved_flops_per_s:.3g} FLOP/s at {self.step_time_s * 1e3:.1f} ms/step)"
            )
        mods = sorted(
            ((k, v) for k, v in self.by_module.items() if k),
            key=lambda kv: -(kv[1]["forward"] + kv[1]["backward"]),
        )
        if mods:
            lines.append(f"  {'module':<32} {'forward':>16} {'backward':>16}")
            lines.extend(f"  {k[:32]:<32} {v['forward']:>16,} {v['backward']:>16,}" for k, v in mods[:20])
        if self.by_op:
            lines.append("  by op: " + ", ".join(f"{k} {v:,}" for k, v in self.by_op.items()))
        if self.uncounted:
            lines.append(
                "  not counted (no FLOP formula): "
                + ", ".join(f"{k} x{v['calls']}" for k, v in self.uncounted.items())
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "total": self.total,
            "forward": self.forward,
            "backward": self.backward,
            "other": self.other,
            "by_module": {k: dict(v) for k, v in self.by_module.items()},
            "by_op": dict(self.by_op),
            "uncounted": {k: dict(v) for k, v in self.uncounted.items()},
            "step_time_s": self.step_time_s,
            "peak_flops": self.peak_flops,
            "achieved_flops_per_s": self.achieved_flops_per_s,
            "mfu": self.mfu,
        }


def count_flops(
    model: nn.Module,
    example_input: Any,
    backward: bool = True,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> FlopReport:
    """Count the FLOPs of one forward (and backward) of ``model`` with ``torch.utils.flop_counter``.

    Args:
        model: the model; its gradients are restored afterwards.
        example_input: a tensor, a tuple of positional arguments, or a dict of keyword arguments.
        backward: also run and count the backward of ``loss_fn(output)``.
        loss_fn: default: the sum of every floating output that requires grad.

    Returns:
        A :class:`FlopReport` (a matmul of (B, i) by (i, o) counts 2*B*i*o).

    Raises:
        ValueError: ``backward=True`` and no output requires grad.

    Cost: one forward/backward under two dispatch modes (a few x slower than plain).

    Example:
        >>> count_flops(torch.nn.Linear(64, 32), torch.randn(8, 64), backward=False).forward
        32768
    """
    session = _FlopSession(model)
    old_grads = [(p, p.grad) for p in model.parameters()]
    args: tuple[Any, ...]
    if isinstance(example_input, Mapping):
        args, kwargs = (), dict(example_input)
    elif isinstance(example_input, tuple):
        args, kwargs = example_input, {}
    else:
        args, kwargs = (example_input,), {}
    session.start()
    phase = "forward"
    try:
        out = model(*args, **kwargs)
        session.forward_end()
        phase = "other"
        if backward:
            if loss_fn is not None:
                loss = loss_fn(out)
            else:
                leaves = [t for t in tensor_leaves(out) if t.is_floating_point() and t.requires_grad]
                if not leaves:
                    raise ValueError("no floating output requires grad: pass backward=False or a loss_fn")
                loss = torch.stack([t.sum() for t in leaves]).sum()
            session.backward_start()
            phase = "backward"
            loss.backward()
    finally:
        session.stop(phase)
        for p, g in old_grads:
            p.grad = g
    return session.report()


class FlopsInstrument:
    """Counts the FLOPs of one step (the first after install) per module, lists uncounted ops, reports MFU.

    The counted step runs under ``FlopCounterMode`` and an op recorder (a few x slower: once). MFU
    uses the median host step time of the ``mfu_steps`` steps after it (the counted step itself is
    slowed by counting) and ``config.peak_flops`` or :data:`KNOWN_PEAK_FLOPS` for the CUDA device.
    The report is kept in ``report``, logged as a "flops" event, and the scalars ``flops/per_step``,
    ``flops/achieved_per_s`` and ``flops/mfu`` are logged once measured.

    Known limitations:
        - ``torch.utils.flop_counter`` has formulas for matmuls, convolutions and attention only:
          the rest is listed in ``report.uncounted``, not estimated.
        - The loss computed between forward and backward is counted under "other"; code that runs
          after backward (the optimizer) is not counted.
        - MFU uses host step time: exact in steady state, optimistic if the GPU queue is not full.
        - Inside ``torch.autograd.grad()`` over leaf inputs (a gradient penalty) a module's
          backward FLOPs may be credited to its parent: torch cannot tell there which leaf
          gradients the call computes (see ``_gradhooks.make_tracker_safe``).
    """

    name = "flops"

    def __init__(self, *, mfu_steps: int = 10) -> None:
        self.mfu_steps = mfu_steps
        self.report: FlopReport | None = None
        self._session: _FlopSession | None = None
        self._state = "waiting"  # waiting -> counting -> timing -> done
        self._times: list[float] = []
        self._last_end: float | None = None
        self._phase = "forward"

    def install(self, mon: SessionView) -> None:
        self._session = _FlopSession(mon.model, mon.installs)

    def remove(self, mon: SessionView) -> None:
        s = self._session
        if s is not None and s.active:
            s.stop(self._phase)

    def on_forward_start(self, mon: SessionView, module: nn.Module, args: Any, kwargs: Any) -> None:
        s = self._session
        if s is None or self._state not in ("waiting", "counting") or s.active:
            return
        if self._state == "waiting" and mon.compiled:
            # A forward that Dynamo first meets under a dispatch mode is marked "skip" for good: the
            # counted step would leave the model uncompiled for the whole run. Not counted, said once.
            self._state = "done"
            mon.emit(
                not_under_compile(
                    "flops_not_counted",
                    mon.global_step,
                    "FLOPs",
                    "count them on the eager model with td.count_flops",
                )
            )
            return
        elsewhere = threading.current_thread() is not mon.thread
        if (elsewhere or in_functorch_transform()) and self._state == "counting":
            return  # a later micro-step of the counted step: left out of the count
        if elsewhere or in_functorch_transform():
            # A dispatch mode belongs to the thread that enters it, and under torch.func it would sit
            # below the transform's own layers: count only a plain forward on the session's thread.
            self._state = "done"
            where = "in another thread" if elsewhere else "inside a torch.func transform"
            mon.emit(
                RuleEvent(
                    "flops_not_counted",
                    mon.global_step,
                    f"FLOPs not counted: the model's forward runs {where}; count them with "
                    "td.count_flops on a plain forward",
                    "info",
                )
            )
            return
        self._state = "counting"
        self._phase = "forward"
        s.start()

    def on_forward_end(self, mon: SessionView, module: nn.Module, output: Any) -> None:
        if self._session is not None and self._session.active:
            self._session.forward_end()
            self._phase = "other"

    def on_backward_start(self, mon: SessionView, loss: Any) -> None:
        if self._session is not None and self._session.active:
            self._session.backward_start()
            self._phase = "backward"

    def on_backward_end(self, mon: SessionView) -> None:
        s = self._session
        if s is not None and s.active:
            s.stop("backward")  # one window per micro-step; the next forward opens another

    def on_step_end(self, mon: SessionView, record: Any, values: Mapping[str, float]) -> None:
        now = time.perf_counter()
        s = self._session
        if s is None:
            return
        if self._state == "counting":
            if s.active:
                s.stop(self._phase)
            rep = s.report()
            self.report = FlopReport(**{**rep.__dict__, "step": int(record.step)})
            self._state = "timing"
        elif self._state == "timing" and self._last_end is not None:
            self._times.append(now - self._last_end)
            if len(self._times) >= self.mfu_steps:
                self._finish(mon, int(record.step))
        self._last_end = now

    def on_exit(self, mon: SessionView) -> None:
        if self._state == "timing":
            self._finish(mon, mon.global_step)

    def _finish(self, mon: SessionView, step: int) -> None:
        assert self.report is not None
        self._state = "done"
        times = sorted(self._times)
        st = times[len(times) // 2] if times else None
        peak = mon.config.peak_flops
        if peak is None and torch.cuda.is_available() and any(p.is_cuda for p in mon.model.parameters()):
            peak = peak_flops_for(torch.cuda.get_device_name())
        self.report = FlopReport(**{**self.report.__dict__, "step_time_s": st, "peak_flops": peak})
        rep = self.report
        if mon.writer is not None:
            sc = {"flops/per_step": float(rep.total)}
            if rep.achieved_flops_per_s is not None:
                sc["flops/achieved_per_s"] = rep.achieved_flops_per_s
            if rep.mfu is not None:
                sc["flops/mfu"] = rep.mfu
            mon.writer.log_scalars(step, sc)
            top = sorted(
                ((k, v) for k, v in rep.by_module.items() if k),
                key=lambda kv: -(kv[1]["forward"] + kv[1]["backward"]),
            )
            msg = f"{rep.total:,} FLOPs per step"
            if rep.mfu is not None:
                msg += f", MFU {rep.mfu:.1%}"
            if top:
                msg += f"; most in {module_label(top[0][0])}"
            if rep.uncounted:
                msg += f"; {len(rep.uncounted)} op kinds not counted"
            mon.writer.log_event(step, "flops", "info", msg, rep.to_dict())

    def on_exception(self, mon: SessionView, exc: BaseException) -> None:
        s = self._session
        if s is not None and s.active:
            try:
                s.stop(self._phase)
            except RuntimeError as e:
                mon.emit(RuleEvent("instrument_error", mon.global_step, str(e), "warning"))


__all__ = ["KNOWN_PEAK_FLOPS", "FlopReport", "FlopsInstrument", "count_flops", "peak_flops_for"]

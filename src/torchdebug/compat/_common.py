"""Shared pieces of the seed-era facades: config resolution, anomaly handling, DebugInfo, TensorInfo."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import torch
from torch import nn

from .._config import DebugConfig, DebugLevel, DebugMode, coerce_config
from .._errors import NonFiniteError, TorchDebugWarning
from .._trees import tensor_leaves
from ..events import Anomaly, Phase, RuleEvent, is_anomalous, plain
from ..nonfinite.locate import _preserved_state, locate_nonfinite
from ..stats import TensorStats, foreach_norms, nonfinite_count
from ._seedconfig import ANOMALY_MODES, PyTorchDebugConfig

# Bounded histories (the seeds kept unbounded lists: a long run grew them without limit).
HISTORY_SIZE = 1000
MAX_ANOMALIES = 1000


def call_accepting(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
    """Call a user's collaborator with the keyword arguments its signature accepts; False when it raised.

    A failing collaborator is warned about (``TorchDebugWarning``): the caller stops calling it.
    """
    import inspect

    try:
        params = inspect.signature(fn).parameters.values()
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            names = {p.name for p in params}
            kwargs = {k: v for k, v in kwargs.items() if k in names}
    except (TypeError, ValueError):  # no signature (a builtin): pass everything
        pass
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        name = getattr(fn, "__qualname__", repr(fn))
        warnings.warn(
            TorchDebugWarning(f"torchdebug: {name} raised {exc!r}; it is not called again"), stacklevel=4
        )
        return False
    return True


def check_mode(mode: str) -> str:
    """``mode`` lower-cased if it is one of ``ANOMALY_MODES``; ValueError naming them otherwise."""
    if not isinstance(mode, str) or mode.strip().lower() not in ANOMALY_MODES:
        raise ValueError(f"anomaly mode must be one of {', '.join(ANOMALY_MODES)}; got {mode!r}")
    return mode.strip().lower()


def resolve_config(config: Any, default_mode: str | None = None) -> tuple[DebugConfig, str]:
    """The ``DebugConfig`` and anomaly mode a facade runs with, from any shape the seeds passed.

    Accepted: None (``DebugConfig.load()``: the ``TORCHDEBUG_*`` environment applies), a
    ``DebugConfig``, a seed-003 ``PyTorchDebugConfig``, a ``DebugLevel`` or level name (seed 002),
    a ``DebugMode``, a mapping of options, or a path to a YAML/TOML/JSON file.

    The mode is the config's ``anomaly_detection_mode`` unless ``default_mode`` is given and the
    caller passed no config (the seed-003 detector raised by default, like torch's detect_anomaly).
    """
    if isinstance(config, PyTorchDebugConfig):
        return config.to_debug_config(), config.anomaly_detection_mode
    if isinstance(config, DebugLevel):
        cfg = coerce_config({"level": config})
    elif isinstance(config, DebugMode):
        cfg = coerce_config({"mode": config})
    elif isinstance(config, str) and _is_level(config):
        cfg = coerce_config({"level": DebugLevel(config)})
    else:
        cfg = coerce_config(config)
    if config is None and default_mode is not None:
        return cfg, check_mode(default_mode)
    return cfg, cfg.anomaly_detection_mode


def _is_level(text: str) -> bool:
    if os.sep in text or "." in text:
        return False  # a file path, not a level name
    try:
        DebugLevel(text)
    except ValueError:
        return False
    return True


def handle_anomaly(anomaly: Anomaly, mode: str, sink: list[Anomaly] | Any, *, stacklevel: int = 3) -> None:
    """Record ``anomaly`` in ``sink`` (bounded), then warn or raise as ``mode`` says.

    Raises:
        NonFiniteError: ``mode == "raise"``; ``.anomaly`` is the record.
    """
    if len(sink) < MAX_ANOMALIES:
        sink.append(anomaly)
    if mode == "raise":
        raise NonFiniteError(anomaly)
    if mode == "warn":
        noticed = f" ({anomaly.symptom})" if anomaly.symptom else ""
        warnings.warn(TorchDebugWarning(f"torchdebug: {anomaly.summary()}{noticed}"), stacklevel=stacklevel)


def symptom_anomaly(
    model: nn.Module | None,
    *,
    loss_bad: bool,
    bad_params: list[str],
    kind: str,
    step: int | None = None,
    where: str = "",
) -> Anomaly:
    """An anomaly naming only the symptom (non-finite loss or gradient) when no replay is possible."""
    first = bad_params[0] if bad_params else None
    owner = first.rpartition(".")[0] if first else ""
    mod = model.get_submodule(owner) if model is not None and owner and not loss_bad else model
    symptom = "non-finite loss" if loss_bad else f"non-finite gradient of {first}"
    if len(bad_params) > 1:
        symptom += f" (+{len(bad_params) - 1} more parameters)"
    return Anomaly(
        phase=Phase.FORWARD.value if loss_bad else Phase.BACKWARD.value,
        module="" if loss_bad else owner,
        op=None,
        location=None,
        kind=kind,
        step=step,
        module_type=type(mod).__name__ if mod is not None else "",
        symptom=symptom + (f" in {where}" if where else ""),
        detected_by="sentinel (no replay)",
        hint=(
            "origin not traced here; wrap the step in PyTorchDebugger().autograd_anomaly_detection(model) "
            "or call td.locate_nonfinite(step_fn, model=model) for the exact op and line"
        ),
        parameter=None if loss_bad else first,
    )


def rng_state(uses_cuda: bool) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """CPU (and CUDA) RNG state, taken before a step so a replay draws the same dropout masks."""
    cuda = torch.cuda.get_rng_state_all() if uses_cuda and torch.cuda.is_available() else None
    return torch.get_rng_state(), cuda


def replay_origin(
    model: nn.Module,
    fn: Callable[..., Any],
    *args: Any,
    rng: tuple[torch.Tensor, list[torch.Tensor] | None],
    step: int | None = None,
) -> Anomaly | None:
    """Re-run ``fn(*args)`` under the op-level tracer with the step's RNG; grads, buffers, RNG restored.

    Cost: every op's outputs are read on the host (about 20x a small CPU step, measured); runs only after
    a NaN/Inf was seen.
    """
    uses_cuda = any(p.is_cuda for p in model.parameters())
    with _preserved_state(model, uses_cuda):
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state_all(rng[1])
        try:
            found = locate_nonfinite(fn, *args, model=model)
        except Exception:  # the replay failing must not hide the original symptom
            return None
    if found is not None and step is not None:
        found = dataclasses.replace(found, step=step)
    return found


def nonfinite_flag(obj: Any) -> torch.Tensor | None:
    """0-dim int64 device tensor: NaN/Inf elements over every floating tensor in ``obj`` (no host sync)."""
    counts = [nonfinite_count(t) for t in tensor_leaves(obj) if t.is_floating_point() or t.is_complex()]
    if not counts:
        return None
    dev = counts[0].device
    return torch.stack([c.to(dev) for c in counts]).sum()


def grad_norms(params: Sequence[torch.Tensor]) -> tuple[list[int], torch.Tensor | None]:
    """Indices of parameters with a gradient and their fused L2 norms (float32 device tensor, no sync)."""
    idx = [i for i, p in enumerate(params) if p.grad is not None]
    if not idx:
        return idx, None
    return idx, foreach_norms([params[i].grad for i in idx])  # type: ignore[misc]


def nonfinite_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, str]]:
    """``(parameter name, state key)`` of the optimizer state tensors that hold a NaN/Inf, before an update.

    A NaN/Inf in Adam's ``exp_avg`` reaches the weights in the update whatever the gradients: the
    facades judge the state before ``optimizer.step()`` and skip the update. Cost: one fused max-|x|
    per (device, dtype) group over the floating state tensors and one host read; the names only
    after a NaN/Inf (a Python pass over the state, rare path).
    """
    tensors: list[torch.Tensor] = []
    owners: list[tuple[torch.Tensor, str]] = []
    for p, st in optimizer.state.items():
        for key, v in st.items():
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() > 0:
                tensors.append(v.detach())
                owners.append((p, key))
    if not tensors:
        return []
    # max |x| (ord inf) never overflows a finite tensor; NaN/Inf propagate into it
    if bool(torch.isfinite(foreach_norms(tensors, "inf")).all()):  # the one host read
        return []
    names = {id(p): n for n, p in model.named_parameters()}
    return [
        (names.get(id(p), "?"), key)
        for t, (p, key) in zip(tensors, owners)
        if not bool(torch.isfinite(t).all())  # rare path: after a NaN/Inf
    ]


def optimizer_state_anomaly(
    model: nn.Module, optimizer: torch.optim.Optimizer, bad: list[tuple[str, str]], step: int | None
) -> Anomaly:
    """The anomaly of an update skipped because its optimizer state held a NaN/Inf (``bad`` non-empty)."""
    name, key = bad[0]
    owner = name.rpartition(".")[0]
    mod = model.get_submodule(owner) if owner and name != "?" else model
    state = optimizer.state[dict(model.named_parameters())[name]][key] if name != "?" else None
    kind = "nan" if state is None or bool(torch.isnan(state).any()) else "inf"
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    return Anomaly(
        phase=Phase.OPTIMIZER.value,
        module=owner,
        op=f"{type(optimizer).__name__}.step",
        location=None,
        kind=kind,
        step=step,
        module_type=type(mod).__name__,
        symptom=f"{kind} in optimizer state {key!r} of {name}{more} before the update; update skipped",
        detected_by="state check before the update",
        hint=f"the optimizer state of {name} is non-finite: the update would write it into the weights; "
        "reset the state (optimizer.state.clear() or reload a checkpoint) and check lr, eps and the loss scale",
        parameter=name if name != "?" else None,
    )


@dataclass
class DebugInfo:
    """One debugged operation (seed 001's record), filled when its ``debug_context`` block ends.

    Units differ from the seed, as everywhere in torchdebug: ``execution_time`` in seconds (float),
    ``memory_usage`` and ``gpu_memory`` in bytes (int: the change of process RSS and of CUDA
    allocated bytes over the block; 0 without CUDA). ``gradient_norm`` is None when the
    operation computed none. ``anomaly`` is the engine's record when a NaN/Inf was found.
    ``details`` holds what ``log_activations`` / ``log_gradients`` / ``log_weights`` recorded.
    """

    timestamp: datetime
    mode: DebugMode
    level: DebugLevel
    operation: str
    model_name: str = "unknown"
    epoch: int = 0
    batch: int = 0
    execution_time: float = 0.0
    memory_usage: int = 0
    gpu_memory: int = 0
    anomaly_detected: bool = False
    memory_leak_detected: bool = False
    performance_issue_detected: bool = False
    gradient_norm: float | None = None
    rss: int = 0  # process RSS after the block (bytes), for plots
    anomaly: Anomaly | None = None
    events: list[RuleEvent] = field(default_factory=list)
    error: str | None = None
    # what the config's log_* switches asked for: "activations" {module: {mean, std, zero, ...}},
    # "gradients" {parameter: L2 norm}, "weights" {parameter: L2 norm}
    details: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def gradient_anomalies(self) -> list[str]:
        """Seed 004's list: a NaN/Inf gradient (the anomaly's summary) and gradient rule events, as text."""
        out = [self.anomaly.summary()] if self.anomaly is not None and self.anomaly.phase != "forward" else []
        out += [str(e) for e in self.events if e.kind in ("gradient_explosion", "vanishing_gradient")]
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (timestamp as ISO text, enums as strings, NaN/Inf as text)."""
        d = {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}
        d["timestamp"] = self.timestamp.isoformat()
        return d


@dataclass(frozen=True)
class TensorInfo(TensorStats):
    """``TensorStats`` plus the attribute names seed 002's users read (``mean_value``)."""

    @property
    def mean_value(self) -> float | None:
        """Seed-002 name of ``mean`` (over the finite values)."""
        return self.mean

    @classmethod
    def of(cls, stats: TensorStats) -> TensorInfo:
        """The same numbers as ``stats`` under this class."""
        return cls(**{f.name: getattr(stats, f.name) for f in dataclasses.fields(TensorStats)})


def anomaly_operations(history: Iterable[DebugInfo]) -> int:
    """Operations of a seed-era history that count as anomalies (``events.is_anomalous``, or a block
    that failed: seed 001 flagged those as ``anomaly_detected`` too)."""
    return sum(
        1 for i in history if i.anomaly_detected or is_anomalous(i.anomaly, [e.severity for e in i.events])
    )

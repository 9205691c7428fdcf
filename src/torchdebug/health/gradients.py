"""Gradient and parameter analysis: ``check_gradients``, ``analyze_gradient_flow``, ``analyze_model_parameters``."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..events import module_label, plain
from ..stats import TensorStats, analyze_tensor, foreach_norms, total_norm
from .inspection import call_model, traced_forward


def _norm_order(norm_type: float | str) -> float:
    """``norm_type`` as a float; ``"inf"`` accepted as in ``clip_grad_norm_``."""
    try:
        order = float(norm_type)
    except (TypeError, ValueError):
        order = math.nan
    if isinstance(norm_type, bool) or math.isnan(order):
        raise ValueError(f"norm_type must be a number or 'inf' (as in clip_grad_norm_), got {norm_type!r}")
    return order


def _norm_label(order: float) -> str:
    if order == math.inf:
        return "Linf"
    if order == -math.inf:
        return "L-inf"
    return f"L{order:g}"


def _num(x: float | None) -> str:
    if x is None:
        return "--"
    if x != x or x in (math.inf, -math.inf):
        return str(x)
    return f"{x:.4g}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def fmt(r: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
        ).rstrip()

    return [fmt(header), "-" * len(fmt(header)), *(fmt(r) for r in rows)]


def _grad_values(g: torch.Tensor) -> torch.Tensor:
    """Dense view of a gradient's stored values (sparse gradients: their coalesced values)."""
    if g.is_sparse:
        return g.coalesce().values()
    if g.layout != torch.strided:
        return g.to_dense()
    return g


def _max_abs(grads: Sequence[torch.Tensor], dev: torch.device) -> torch.Tensor:
    """max |g| of each tensor as a float32 ``[N]`` tensor on ``dev``; NaN when a tensor holds NaN.

    ``aminmax`` per tensor reads each gradient once without an ``abs()`` copy; on CPU it is several
    times faster than ``_foreach_norm(inf)``. Empty tensors give 0.
    """
    mins, maxs = [], []
    zero = torch.zeros((), dtype=torch.float32, device=dev)
    for g in grads:
        if g.numel() == 0:
            mins.append(zero)
            maxs.append(zero)
            continue
        if g.is_complex():
            g = g.abs()
        mn, mx = torch.aminmax(g)
        mins.append(mn.to(dev, torch.float32))
        maxs.append(mx.to(dev, torch.float32))
    return torch.maximum(torch.stack(mins).neg(), torch.stack(maxs))


# --------------------------------------------------------------------------- check_gradients


@dataclass(frozen=True)
class ParamGrad:
    """Gradient numbers of one parameter.

    ``status`` is ``"nonfinite" | "exploding" | "vanishing" | "ok" | "no grad" | "frozen"``; the
    numeric fields are None when the parameter has no gradient. ``norm`` uses the report's
    ``norm_type``; ``max_abs`` is over all elements (NaN when one is NaN, as in torch).
    """

    name: str
    shape: tuple[int, ...]
    numel: int
    dtype: str
    status: str
    norm: float | None = None
    max_abs: float | None = None
    nonfinite: int = 0
    zero_fraction: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class GradientReport:
    """What :func:`check_gradients` returns: per-parameter gradient numbers and the problems found.

    ``params`` is in ``named_parameters`` order; ``nonfinite``/``exploding``/``vanishing``/``no_grad``/
    ``frozen`` hold parameter names; ``thresholds`` the rules used. ``str()`` is a ranked table
    (NaN/Inf first, then largest norm first).
    """

    total_norm: float
    norm_type: float
    params: tuple[ParamGrad, ...]
    nonfinite: tuple[str, ...] = ()
    exploding: tuple[str, ...] = ()
    vanishing: tuple[str, ...] = ()
    no_grad: tuple[str, ...] = ()
    frozen: tuple[str, ...] = ()
    thresholds: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when no gradient is non-finite or exploding."""
        return not (self.nonfinite or self.exploding)

    @property
    def has_nonfinite(self) -> bool:
        return bool(self.nonfinite)

    def __getitem__(self, name: str) -> ParamGrad:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(f"no parameter named {name!r}; names are as in model.named_parameters()")

    def ranked(self) -> list[ParamGrad]:
        """Parameters with a gradient, NaN/Inf first, then by decreasing norm; those without last."""

        def key(p: ParamGrad) -> tuple[int, float]:
            if p.norm is None:
                return (2, 0.0)
            if p.nonfinite or not math.isfinite(p.norm):
                return (0, 0.0)
            return (1, -p.norm)

        return sorted(self.params, key=key)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def __str__(self) -> str:
        label = _norm_label(self.norm_type)
        with_grad = sum(p.norm is not None for p in self.params)
        head = f"gradients: total {label} norm {_num(self.total_norm)} over {with_grad} parameter(s)"
        missing = len(self.no_grad) + len(self.frozen)
        if missing:
            head += f" ({len(self.no_grad)} without grad, {len(self.frozen)} frozen)"
        rows = [
            (
                p.name,
                "x".join(str(d) for d in p.shape) or "scalar",
                _num(p.norm),
                _num(p.max_abs),
                str(p.nonfinite) if p.norm is not None else "--",
                f"{100 * p.zero_fraction:.1f}%" if p.zero_fraction is not None else "--",
                p.status,
            )
            for p in self.ranked()
        ]
        lines = [head]
        if rows:
            header = ("parameter", "shape", f"{label} norm", "max|g|", "nonfinite", "zeros", "status")
            lines += _table(header, rows, right={2, 3, 4, 5})
        for title, names in (
            ("NaN/Inf", self.nonfinite),
            ("exploding", self.exploding),
            ("vanishing", self.vanishing),
        ):
            if names:
                lines.append(f"{title}: {', '.join(names)}")
        return "\n".join(lines)


def check_gradients(
    model: nn.Module,
    *,
    norm_type: float | str = 2.0,
    explode_abs: float = 1e4,
    explode_rel: float = 1e3,
    vanish_abs: float = 1e-7,
    vanish_rel: float = 1e3,
) -> GradientReport:
    """Gradient health of ``model`` right now (after ``backward``): norms, NaN/Inf, exploding, vanishing.

    Args:
        model: the module whose ``.grad`` fields are read (nothing is modified).
        norm_type: p of the norms, as in ``clip_grad_norm_`` (2.0, 1.0, ``"inf"`` ...). The total
            equals what ``clip_grad_norm_(model.parameters(), max_norm, norm_type)`` returns.
        explode_abs: a parameter whose gradient norm exceeds this is exploding.
        explode_rel: ... also one whose size-normalised norm ``norm / numel**(1/p)`` (the RMS for
            p=2, the max for p=inf) exceeds ``explode_rel`` times the median size-normalised norm
            of all parameters (needs >= 3 parameters with finite gradients). Normalising by size
            keeps a large embedding from looking like an outlier next to a bias.
        vanish_abs: a parameter whose gradient norm is below this (0 included) is vanishing.
        vanish_rel: ... also one whose size-normalised norm is ``vanish_rel`` times below the median.

    Returns:
        A :class:`GradientReport`; parameters without ``.grad`` are listed in ``no_grad`` (or
        ``frozen`` when ``requires_grad`` is False), not analysed and not counted in the total.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: ``norm_type`` is not a number or ``"inf"``, or a threshold is not positive.

    Example:
        >>> net = nn.Linear(3, 1)
        >>> net(torch.ones(2, 3)).sum().backward()
        >>> check_gradients(net).total_norm  # |dW| = 2*sqrt(3), |db| = 2 -> sqrt(12 + 4)
        4.0

    Cost: fused reductions on the gradients' device (``torch._foreach_norm``) and one host
    transfer in total, whatever the number of parameters.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"check_gradients needs an nn.Module, got {type(model).__name__}")
    order = _norm_order(norm_type)
    for key, val in (
        ("explode_abs", explode_abs),
        ("explode_rel", explode_rel),
        ("vanish_abs", vanish_abs),
        ("vanish_rel", vanish_rel),
    ):
        if not (isinstance(val, (int, float)) and val > 0):
            raise ValueError(f"{key} must be a positive number, got {val!r}")

    named = list(model.named_parameters())
    with_grad = [(n, p) for n, p in named if p.grad is not None]
    grads = [_grad_values(p.grad) for _, p in with_grad]  # type: ignore[arg-type]
    host: list[float] = []
    total = 0.0
    k = len(grads)
    if grads:
        dev = grads[0].device
        # float64 keeps element counts exact beyond 2**24; MPS has no float64
        acc = torch.float32 if dev.type == "mps" else torch.float64
        with torch.no_grad():
            norms = foreach_norms(grads, order)
            maxabs = _max_abs(grads, dev)
            # x - x is 0 for a finite x and NaN for NaN/±Inf, and count_nonzero counts NaN: a
            # nonfinite count with one kernel per tensor (isfinite + sum is ~5x slower on CPU)
            nonfin = torch.stack([torch.count_nonzero(g - g).to(dev) for g in grads])
            # nonzeros counted on the stored values: a sparse gradient's implicit zeros are the rest
            nonzero = torch.stack([torch.count_nonzero(g).to(dev) for g in grads])
            tot = total_norm(norms, order)
            packed = torch.cat(
                [
                    tot.reshape(1).to(dev, acc),
                    norms.to(dev, acc),
                    maxabs.to(acc),
                    nonfin.to(acc),
                    nonzero.to(acc),
                ]
            )
        host = packed.tolist()  # the one host transfer
        total = host[0]

    def sized(norm: float, numel: int) -> float:
        if order == 0 or math.isinf(order):
            return norm
        return norm / max(numel, 1) ** (1.0 / order)

    scaled = [sized(host[1 + i], with_grad[i][1].numel()) for i in range(k)]
    finite_scaled = [s for s in scaled if math.isfinite(s)]
    median = statistics.median(finite_scaled) if len(finite_scaled) >= 3 else None

    params: list[ParamGrad] = []
    nonfinite: list[str] = []
    exploding: list[str] = []
    vanishing: list[str] = []
    no_grad: list[str] = []
    frozen: list[str] = []
    index = {id(p): i for i, (_, p) in enumerate(with_grad)}
    for name, p in named:
        shape, numel, dtype = tuple(p.shape), p.numel(), str(p.dtype).replace("torch.", "")
        i = index.get(id(p))
        if i is None:
            status = "no grad" if p.requires_grad else "frozen"
            (no_grad if p.requires_grad else frozen).append(name)
            params.append(ParamGrad(name, shape, numel, dtype, status))
            continue
        norm, mx = host[1 + i], host[1 + k + i]
        bad = int(host[1 + 2 * k + i])
        zero_fraction = (p.numel() - host[1 + 3 * k + i]) / p.numel() if p.numel() else 0.0
        s = scaled[i]
        if bad or not math.isfinite(norm):
            status = "nonfinite"
            nonfinite.append(name)
        elif norm > explode_abs or (median is not None and median > 0 and s > explode_rel * median):
            status = "exploding"
            exploding.append(name)
        elif norm < vanish_abs or (median is not None and s * vanish_rel < median):
            status = "vanishing"
            vanishing.append(name)
        else:
            status = "ok"
        params.append(ParamGrad(name, shape, numel, dtype, status, norm, mx, bad, zero_fraction))
    return GradientReport(
        total_norm=total,
        norm_type=order,
        params=tuple(params),
        nonfinite=tuple(nonfinite),
        exploding=tuple(exploding),
        vanishing=tuple(vanishing),
        no_grad=tuple(no_grad),
        frozen=tuple(frozen),
        thresholds={
            "explode_abs": float(explode_abs),
            "explode_rel": float(explode_rel),
            "vanish_abs": float(vanish_abs),
            "vanish_rel": float(vanish_rel),
        },
    )


# --------------------------------------------------------------------------- analyze_model_parameters


def analyze_model_parameters(model: nn.Module) -> dict[str, TensorStats]:
    """``TensorStats`` of every parameter and buffer of ``model``, keyed by qualified name.

    NaN/Inf in the weights show in each entry's ``nan_count``/``posinf_count``/``neginf_count``.
    Buffers (BatchNorm running statistics ...) are included under their own names.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.

    Example:
        >>> stats = analyze_model_parameters(nn.BatchNorm1d(4))
        >>> sorted(stats)[:3]
        ['bias', 'num_batches_tracked', 'running_mean']

    Cost: one host transfer per tensor. This is an on-demand analysis (call it when something
    looks wrong), not meant for every step; in a loop, prefer ``watch()``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"analyze_model_parameters needs an nn.Module, got {type(model).__name__}")
    out: dict[str, TensorStats] = {}
    for name, p in model.named_parameters():
        out[name] = analyze_tensor(p, name)
    for name, b in model.named_buffers():
        out[name] = analyze_tensor(b, name)
    return out


# --------------------------------------------------------------------------- analyze_gradient_flow


@dataclass(frozen=True)
class LayerFlow:
    """Gradient magnitude of one layer (a module owning parameters directly).

    ``mean_abs`` = sum |g| / numel over its parameters that have a gradient; ``max_abs`` the max.
    ``has_grad`` is False when none of its trainable parameters got a gradient.
    """

    name: str
    type: str
    numel: int
    has_grad: bool
    mean_abs: float | None = None
    max_abs: float | None = None
    called: bool | None = None  # in a traced forward; None when the order is not traced

    @property
    def label(self) -> str:
        return module_label(self.name, self.type)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class GradientFlow:
    """What :func:`analyze_gradient_flow` returns: per-layer |grad| in forward order.

    ``order`` is ``"execution"`` (traced with an example, or given) or ``"registration"``.
    """

    layers: tuple[LayerFlow, ...]
    order: str

    @property
    def no_gradient(self) -> list[str]:
        """Layers whose trainable parameters got no gradient at all."""
        return [lay.name for lay in self.layers if not lay.has_grad]

    @property
    def zero_gradient(self) -> list[str]:
        """Layers whose gradient exists but is exactly zero everywhere."""
        return [lay.name for lay in self.layers if lay.has_grad and lay.max_abs == 0.0]

    def __getitem__(self, name: str) -> LayerFlow:
        for lay in self.layers:
            if lay.name == name:
                return lay
        raise KeyError(f"no layer named {name!r}; names are as in model.named_modules()")

    def to_dict(self) -> dict[str, Any]:
        return {"order": self.order, "layers": [lay.to_dict() for lay in self.layers]}

    def __str__(self) -> str:
        finite = [
            lay.mean_abs
            for lay in self.layers
            if lay.mean_abs is not None and math.isfinite(lay.mean_abs) and lay.mean_abs > 0
        ]
        top = max(finite, default=0.0)
        lo = math.log10(min(finite)) if finite else 0.0
        span = max(math.log10(top) - lo, 1.0) if finite else 1.0
        rows = []
        for lay in self.layers:
            if not lay.has_grad:
                note, bar = "no gradient", ""
            elif lay.mean_abs is None or not math.isfinite(lay.mean_abs):
                note, bar = "non-finite", "!" * 20
            elif lay.mean_abs == 0:
                note, bar = "zero", ""
            else:
                note = "" if lay.called in (None, True) else "not called"
                # bar length on a log scale between the smallest and largest layer (1..20 chars)
                bar = "#" * (1 + round(19 * (math.log10(lay.mean_abs) - lo) / span))
            rows.append((lay.label, _num(lay.mean_abs), _num(lay.max_abs), bar, note))
        lines = [f"gradient flow ({self.order} order), mean |grad| per layer:"]
        if rows:
            lines += _table(("layer", "mean|g|", "max|g|", "log scale", "note"), rows, right={1, 2})
        return "\n".join(lines)


def _traced_order(model: nn.Module, example_input: Any) -> list[nn.Module]:
    seen: list[nn.Module] = []
    ids: set[int] = set()

    def pre(mod: nn.Module, args: tuple[Any, ...]) -> None:
        if id(mod) not in ids:
            ids.add(id(mod))
            seen.append(mod)

    with traced_forward(model, pre_hook=pre):
        call_model(model, example_input)
    return seen


def analyze_gradient_flow(
    model: nn.Module,
    example_input: Any = None,
    *,
    order: Sequence[str] | None = None,
) -> GradientFlow:
    """Per-layer mean and max |grad| of ``model`` in forward order, layers without gradient marked.

    Args:
        model: the module whose ``.grad`` fields are read (after ``backward``; nothing is modified).
        example_input: optional; when given, one forward runs in eval mode under ``no_grad`` with
            pre-hooks (removed afterwards, modes restored) to learn the real execution order. The
            gradients are not touched. Layers the forward did not call come last (``called=False``).
        order: optional explicit execution order (qualified module names, e.g. recorded by
            ``watch()`` during the last forward); names not owning parameters are ignored.
            Without ``order`` or ``example_input`` the registration order of ``named_modules``
            is used, which matches execution for ``nn.Sequential`` but not for every model.

    Returns:
        A :class:`GradientFlow`: ``str()`` is a table with a log-scale bar, ``.to_dict()`` JSON-ready.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: both ``example_input`` and ``order`` are given, or ``order`` names an unknown module.

    Examples:
        >>> net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
        >>> net(torch.ones(2, 3)).sum().backward()
        >>> [lay.name for lay in analyze_gradient_flow(net).layers]
        ['0', '2']

    Cost: two fused norm reductions over all gradients and one host transfer (plus the example
    forward when ``example_input`` is given).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"analyze_gradient_flow needs an nn.Module, got {type(model).__name__}")
    if example_input is not None and order is not None:
        raise ValueError("pass either example_input or order, not both")
    names = {m: n for n, m in model.named_modules()}
    layers = [m for m in names if any(p.requires_grad for p in m.parameters(recurse=False))]
    called: dict[nn.Module, bool] | None = None
    how = "registration"
    if example_input is not None or order is not None:
        how = "execution"
        if order is not None:
            by_name = {n: m for m, n in names.items()}
            unknown = [n for n in order if n not in by_name]
            if unknown:
                raise ValueError(
                    f"order names unknown modules {unknown[:3]}; use names from model.named_modules()"
                )
            seq = [by_name[n] for n in order]
        else:
            seq = _traced_order(model, example_input)
        in_layers = set(layers)
        ordered = list(dict.fromkeys(m for m in seq if m in in_layers))
        called = dict.fromkeys(ordered, True)
        rest = [m for m in layers if m not in called]
        called.update(dict.fromkeys(rest, False))
        layers = ordered + rest

    # (layer index, numel) for every parameter that has a gradient
    owners: list[tuple[int, int]] = []
    grads: list[torch.Tensor] = []
    for li, m in enumerate(layers):
        for p in m.parameters(recurse=False):
            if p.requires_grad and p.grad is not None:
                owners.append((li, p.numel()))
                grads.append(_grad_values(p.grad))
    host: list[float] = []
    if grads:
        with torch.no_grad():
            packed = torch.cat([foreach_norms(grads, 1.0), _max_abs(grads, grads[0].device)])
        host = packed.tolist()  # the one host transfer
    sums: dict[int, float] = {}
    maxes: dict[int, float] = {}
    counts: dict[int, int] = {}
    n = len(grads)
    for j, (li, numel) in enumerate(owners):
        sums[li] = sums.get(li, 0.0) + host[j]
        counts[li] = counts.get(li, 0) + numel
        mx = host[n + j]
        prev = maxes.get(li)
        maxes[li] = mx if prev is None or mx != mx or mx > prev else prev
    out = []
    for li, m in enumerate(layers):
        numel = sum(p.numel() for p in m.parameters(recurse=False) if p.requires_grad)
        has = li in sums
        out.append(
            LayerFlow(
                name=names[m],
                type=type(m).__name__,
                numel=numel,
                has_grad=has,
                mean_abs=sums[li] / counts[li] if has and counts[li] else (0.0 if has else None),
                max_abs=maxes.get(li),
                called=None if called is None else called[m],
            )
        )
    return GradientFlow(layers=tuple(out), order=how)


__all__ = [
    "GradientFlow",
    "GradientReport",
    "LayerFlow",
    "ParamGrad",
    "analyze_gradient_flow",
    "analyze_model_parameters",
    "check_gradients",
]

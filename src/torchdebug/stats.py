"""Pure tensor maths, no hooks and no state: TensorStats / analyze_tensor and fused reductions.

A leaf module: it imports only torch and the standard library, so every other part of torchdebug
(instruments, reports, the seed-era facades) can use it.

Known limitations:

- Integer statistics go through float64, so integers beyond 2**53 in magnitude are rounded.
- Devices without float64 (MPS) transfer the numbers as float32: counts above 2**24 are rounded.
- Sparse tensors are densified by ``analyze_tensor`` (cost: a dense copy) and coalesced by
  ``foreach_norms`` (a host sync on CUDA); other layouts (nested, quantized) are not supported.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TensorStats", "analyze_tensor", "foreach_norms", "nonfinite_count", "total_norm"]

# dtype name (as stored in TensorStats.dtype) -> the short spelling used by str(stats)
_DTYPE_SHORT = {
    "float64": "f64",
    "float32": "f32",
    "float16": "f16",
    "bfloat16": "bf16",
    "float8_e4m3fn": "f8e4m3",
    "float8_e4m3fnuz": "f8e4m3uz",
    "float8_e5m2": "f8e5m2",
    "float8_e5m2fnuz": "f8e5m2uz",
    "int64": "i64",
    "int32": "i32",
    "int16": "i16",
    "int8": "i8",
    "uint64": "u64",
    "uint32": "u32",
    "uint16": "u16",
    "uint8": "u8",
    "bool": "bool",
    "complex32": "c32",
    "complex64": "c64",
    "complex128": "c128",
}

# Device types whose tensors go through torch._foreach_norm; others take the per-tensor loop.
_FOREACH_DEVICE_TYPES = frozenset({"cpu", "cuda", "xpu"})


def _num(value: float) -> str:
    """Compact number: integers as written, floats with 3 significant digits (``0.012``, ``-3.1e+04``)."""
    if isinstance(value, int):
        return str(value) if abs(value) < 100_000 else f"{value:.3g}"
    text = f"{value:.3g}"
    return "0" if text == "-0" else text


@dataclass(frozen=True)
class TensorStats:
    """Statistics of one tensor; the float fields are over its finite values only.

    Attributes:
        name: the label given to ``analyze_tensor`` (or None).
        shape, dtype, device, numel, bytes: metadata; ``dtype`` is the torch name without the
            ``torch.`` prefix (``"bfloat16"``), ``device`` as ``str(tensor.device)`` (``"cuda:0"``).
        nan_count, posinf_count, neginf_count: non-finite elements (always 0 for integer and bool
            tensors; for complex tensors an element with a NaN real or imaginary part counts as NaN,
            one with an infinite part otherwise counts as +Inf).
        min, max, mean, std: over the finite values (complex: over their magnitudes). ``std`` is the
            sample standard deviation (Bessel-corrected, like ``torch.std``) and None below two
            finite values. All are None when there is no finite value or no value at all.
        abs_max: largest finite magnitude; abs_min: smallest NONZERO finite magnitude (None if every
            finite value is zero); zero_fraction: zeros / finite values.
        requires_grad, grad_fn: autograd state of the analysed tensor (``grad_fn`` is its class name).

    For integer and bool tensors, ``min``, ``max``, ``abs_max`` and ``abs_min`` are ints.
    ``str(stats)`` is one line; ``stats.to_dict()`` is JSON-ready.
    """

    name: str | None
    shape: tuple[int, ...]
    dtype: str
    device: str
    numel: int
    bytes: int
    nan_count: int = 0
    posinf_count: int = 0
    neginf_count: int = 0
    min: float | None = None
    max: float | None = None
    mean: float | None = None
    std: float | None = None
    abs_max: float | None = None
    abs_min: float | None = None
    zero_fraction: float | None = None
    requires_grad: bool = False
    grad_fn: str | None = None

    @property
    def has_nan(self) -> bool:
        """True when at least one element is NaN."""
        return self.nan_count > 0

    @property
    def has_inf(self) -> bool:
        """True when at least one element is +Inf or -Inf."""
        return (self.posinf_count + self.neginf_count) > 0

    @property
    def nonfinite_count(self) -> int:
        """Number of NaN, +Inf and -Inf elements."""
        return self.nan_count + self.posinf_count + self.neginf_count

    def __str__(self) -> str:
        """One line in the spirit of lovely-tensors.

        Example: ``tensor[32, 128] bf16 cuda:0 x∈[-3.1e+04, 6.2e+04] μ=0.012 σ=1.21 NaN!×3 +Inf!×1``.
        A single finite value reads ``x=1.5``, complex tensors ``|x|∈[...]`` (magnitudes); ``empty``
        marks a tensor without elements, ``all zeros`` one whose every element is zero, and meta
        tensors (shape only) show their device ``meta`` and nothing else.
        """
        text = f"tensor{list(self.shape)} {_DTYPE_SHORT.get(self.dtype, self.dtype)} {self.device}"
        if self.name:
            text = f"{self.name}: {text}"
        parts = [text]
        x = "|x|" if self.dtype.startswith("complex") else "x"
        if self.numel == 0:
            parts.append("empty")
        elif self.zero_fraction == 1.0 and self.nonfinite_count == 0:
            parts.append("all zeros")
        elif self.min is not None and self.max is not None:
            if self.numel == 1:
                parts.append(f"{x}={_num(self.min)}")
            else:
                parts.append(f"{x}∈[{_num(self.min)}, {_num(self.max)}]")
                if self.mean is not None:
                    parts.append(f"μ={_num(self.mean)}")
                if self.std is not None:
                    parts.append(f"σ={_num(self.std)}")
        if self.nan_count:
            parts.append(f"NaN!×{self.nan_count}")
        if self.posinf_count:
            parts.append(f"+Inf!×{self.posinf_count}")
        if self.neginf_count:
            parts.append(f"-Inf!×{self.neginf_count}")
        if self.grad_fn:
            parts.append(f"grad_fn={self.grad_fn}")
        elif self.requires_grad:
            parts.append("requires_grad")
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of every field plus ``has_nan``/``has_inf``.

        Shapes become lists. Every float is finite or None: ``analyze_tensor`` only reports
        statistics of finite values, and a non-finite float put in by hand is mapped to None, so
        ``json.dumps(stats.to_dict(), allow_nan=False)`` always works.
        """
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, float) and not math.isfinite(value):
                value = None
            out[f.name] = value
        out["has_nan"] = self.has_nan
        out["has_inf"] = self.has_inf
        return out


def _reductions(f: torch.Tensor, with_nonfinite: bool) -> list[torch.Tensor]:
    """0-dim device tensors ``[nan, posinf, n_finite, zeros, min, max, abs_max, abs_min, mean_s, std_s, scale]``.

    ``f`` is float32 or float64; ``with_nonfinite`` False means every element is known finite
    (integer input) and the masks are skipped. About 20 elementwise passes over ``f``; -Inf is
    counted on the host as what is left (numel - finite - NaN - +Inf).

    The mean and standard deviation are computed on ``values / scale`` where ``scale`` is the
    power of two just below ``abs_max``: the division is exact, and squares cannot overflow even
    for float32 values near 3e38 (the exploding tensors this library exists to explain). The host
    multiplies ``mean_s`` and ``std_s`` back by ``scale``.
    """
    # torch.full is a device fill; torch.tensor(...) would be a host-to-device copy
    inf = torch.full((), math.inf, dtype=f.dtype, device=f.device)
    zero_i = torch.zeros((), dtype=torch.int64, device=f.device)
    magnitude = f.abs()
    if with_nonfinite:
        finite = magnitude < inf  # False for NaN and ±Inf, reusing |f|
        # count_nonzero counts a bool mask without the int64 copy that .sum() makes
        n_finite = torch.count_nonzero(finite)
        nan = torch.count_nonzero(f != f)  # NaN is the only value unequal to itself
        posinf = torch.count_nonzero(f == inf)
        # non-finite -> 0: neutral for sums and |x| maxima (nan_to_num: one pass, no mask read)
        values = f.nan_to_num(0.0, 0.0, 0.0)
        magnitude = values.abs()
    else:
        n_finite = torch.full((), f.numel(), dtype=torch.int64, device=f.device)
        nan, posinf, values = zero_i, zero_i, f
    zeros = torch.count_nonzero(f == 0)  # real zeros only: NaN/Inf compare unequal to 0
    abs_max = magnitude.amax()
    abs_min = torch.where(magnitude > 0, magnitude, inf).amin()  # inf when no nonzero value
    lo, hi = torch.aminmax(values)
    if with_nonfinite:
        # A 0 from aminmax may be one put in for a non-finite element. If no finite element is
        # really 0 and lo == 0, every finite value is > 0 and the minimum is the smallest nonzero
        # magnitude; likewise hi == 0 means all are < 0 and the maximum is -abs_min.
        no_zero = zeros == 0
        lo = torch.where((lo == 0) & no_zero, abs_min, lo)
        hi = torch.where((hi == 0) & no_zero, -abs_min, hi)
    # abs_max = m * 2**e with m in [0.5, 1); scale = 2**(e-1) keeps |values / scale| < 2 and is
    # representable for every finite abs_max (2**127 at most); frexp(0) gives scale 2**-1.
    scale = torch.ldexp(torch.ones_like(abs_max), torch.frexp(abs_max).exponent - 1)
    count = n_finite.to(f.dtype)
    centered = values / scale
    mean_s = centered.sum() / count.clamp_min(1)
    centered.sub_(mean_s)
    if with_nonfinite:
        centered = torch.where(finite, centered, 0)  # the zeros put in for non-finite elements do not deviate
    # two-pass variance: sum of squared deviations from the mean, Bessel-corrected
    std_s = torch.linalg.vector_norm(centered) / (count - 1).clamp_min(1).sqrt()
    return [nan, posinf, n_finite, zeros, lo, hi, abs_max, abs_min, mean_s, std_s, scale]


def analyze_tensor(t: torch.Tensor, name: str | None = None) -> TensorStats:
    """Statistics of ``t`` (NaN/Inf counts, range, mean, std over finite values) in one host transfer.

    Args:
        t: any strided or sparse tensor: float (incl. float16/bfloat16/float8), integer, bool,
            complex (statistics over the magnitudes ``|z|``), 0-dim, empty, non-contiguous, meta
            (shape only), on any device. A tensor that requires grad is read without building a
            graph.
        name: optional label shown in ``str(stats)`` and kept in ``stats.name``.

    Returns:
        A frozen ``TensorStats``; see its docstring for the exact meaning of each field.

    Raises:
        TypeError: ``t`` is not a tensor.

    Example:
        >>> s = analyze_tensor(torch.tensor([1.0, float("nan"), 3.0]), "x")
        >>> str(s)
        'x: tensor[3] f32 cpu x∈[1, 3] μ=2 σ=1.41 NaN!×1'

    Cost: about 20 elementwise passes with a few temporaries the size of ``t`` in float32 (float64
    for float64, integer and complex128 input): ~5 ms per million float32 elements on one CPU
    core, bandwidth-bound on a GPU; then ONE device-to-host transfer for all numbers
    (a host sync on accelerators). Not meant for every parameter on every step: for hot paths use
    ``foreach_norms`` / ``nonfinite_count``, which never sync.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"analyze_tensor expects a torch.Tensor, got {type(t).__name__}")
    base: dict[str, Any] = {
        "name": name,
        "shape": tuple(t.shape),
        "dtype": str(t.dtype).removeprefix("torch."),
        "device": str(t.device),
        "numel": t.numel(),
        "bytes": t.numel() * t.element_size(),
        "requires_grad": bool(t.requires_grad),
        "grad_fn": type(t.grad_fn).__name__ if t.grad_fn is not None else None,
    }
    if t.device.type == "meta" or t.numel() == 0:
        return TensorStats(**base)
    # float64 keeps integers (< 2**53) and counts exact; MPS has no float64.
    wide = torch.float64 if t.device.type != "mps" else torch.float32
    with torch.no_grad():
        x = t.detach()
        if x.layout != torch.strided:
            x = x.to_dense()
        if x.is_complex():
            nan_mask = torch.isnan(x)  # NaN real or imaginary part
            acc = torch.float64 if x.dtype == torch.complex128 else torch.float32
            f = torch.where(nan_mask, math.nan, x.abs().to(acc))  # |inf + nan·j| would be inf
        elif x.is_floating_point():
            # low precision (f16/bf16/f8) accumulates in float32; float64 stays float64
            f = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
        else:
            f = x.to(wide)  # integer / bool: exact below 2**53
        floating = x.is_floating_point() or x.is_complex()
        numbers = torch.stack([v.to(wide) for v in _reductions(f, floating)])
        # The one host sync of analyze_tensor: every number crosses to the host together.
        (nan, posinf, n_finite, zeros, lo, hi, abs_max, abs_min, mean_s, std_s, scale) = numbers.tolist()
    n = int(n_finite)
    stats: dict[str, Any] = {
        "nan_count": int(nan),
        "posinf_count": int(posinf),
        "neginf_count": x.numel() - n - int(nan) - int(posinf),
    }
    if n > 0:
        exact = float if floating else int  # integer and bool tensors report exact ints
        stats.update(
            min=exact(lo),
            max=exact(hi),
            mean=mean_s * scale,
            std=std_s * scale if n > 1 else None,
            abs_max=exact(abs_max),
            abs_min=exact(abs_min) if math.isfinite(abs_min) else None,
            zero_fraction=zeros / n,
        )
    return TensorStats(**base, **stats)


def _norm_order(norm_type: float | str) -> float:
    """``norm_type`` as a float (``"inf"`` accepted like clip_grad_norm_); ValueError otherwise."""
    if isinstance(norm_type, bool):
        raise ValueError(f"norm_type must be a number or 'inf', got {norm_type!r}")
    try:
        order = float(norm_type)
    except (TypeError, ValueError):
        raise ValueError(f"norm_type must be a number or 'inf'/'-inf', got {norm_type!r}") from None
    if math.isnan(order):
        raise ValueError("norm_type must not be NaN; use 2.0 (Euclidean) or 'inf' (max)")
    return order


def _fallback_norm(t: torch.Tensor, order: float) -> torch.Tensor:
    """One tensor's norm in float32 (float64 inputs computed in float64) through vector_norm."""
    if t.is_sparse:
        # coalesce merges duplicate indices (an uncoalesced sparse grad repeats rows); zeros left
        # out of the values do not change a p-norm for p > 0. Cost: a host sync on CUDA.
        t = t.coalesce().values() if order > 0 else t.to_dense()
    elif t.layout != torch.strided:
        t = t.to_dense()
    if t.is_complex():
        t = t.abs()
    if t.dtype != torch.float64:
        t = t.to(torch.float32)  # integers, bool and low precision accumulate in float32
    return torch.linalg.vector_norm(t, order).to(torch.float32)


def foreach_norms(tensors: Sequence[torch.Tensor], norm_type: float | str = 2.0) -> torch.Tensor:
    """The p-norm of each tensor, fused: a float32 tensor of shape ``[len(tensors)]``, no host sync.

    Args:
        tensors: a sequence of tensors (typically ``[p.grad for p in params if p.grad is not None]``).
            Dense floating tensors on CPU/CUDA/XPU go through ``torch._foreach_norm``, one call per
            (device, dtype) group; anything else (integer, complex, sparse, other devices) through
            ``torch.linalg.vector_norm`` one by one. float16/bfloat16 accumulate in float32,
            float64 in float64.
        norm_type: the p of the norm, as in ``torch.nn.utils.clip_grad_norm_``: any float, or
            ``"inf"`` (max |x|) / ``"-inf"``. An empty tensor has norm 0 for every p (torch raises
            on empty tensors for ±inf).

    Returns:
        float32 tensor ``[N]`` on the first tensor's device (CPU when ``tensors`` is empty);
        NaN/Inf elements propagate into their tensor's norm, as in torch.

    Raises:
        TypeError: an element is not a tensor.
        ValueError: ``norm_type`` is not a number or ``"inf"``.

    Example:
        >>> foreach_norms([torch.tensor([3.0, 4.0]), torch.ones(4)])
        tensor([5., 2.])

    Cost: one fused kernel per group on CUDA. Tensors on other devices than the first are copied
    there (a device-to-device copy; a host sync when that crosses CPU and an accelerator).
    """
    order = _norm_order(norm_type)
    items = list(tensors)
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"foreach_norms expects tensors; item {i} is a {type(t).__name__}")
    if not items:
        return torch.zeros(0, dtype=torch.float32)
    out_device = items[0].device
    norms: list[torch.Tensor | None] = [None] * len(items)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    with torch.no_grad():  # parameters require grad; a norm must not build a graph
        for i, t in enumerate(items):
            if t.numel() == 0:
                norms[i] = torch.zeros((), dtype=torch.float32, device=out_device)
            elif (
                t.layout == torch.strided
                and t.is_floating_point()
                and t.device.type in _FOREACH_DEVICE_TYPES
                and hasattr(torch, "_foreach_norm")
            ):
                groups.setdefault((t.device, t.dtype), []).append(i)
            else:
                norms[i] = _fallback_norm(t.detach(), order)
        for (_, dtype), idx in groups.items():
            group = [items[i].detach() for i in idx]
            try:
                if dtype == torch.float64:
                    result = [n.to(torch.float32) for n in torch._foreach_norm(group, order)]
                else:
                    result = list(torch._foreach_norm(group, order, dtype=torch.float32))
            except (RuntimeError, NotImplementedError):
                # a dtype/device without a foreach kernel in this torch build: take the slow path
                result = [_fallback_norm(t, order) for t in group]
            for i, n in zip(idx, result):
                norms[i] = n
        return torch.stack([n.to(out_device) for n in norms if n is not None])


def total_norm(norms: torch.Tensor | Sequence[torch.Tensor], norm_type: float | str = 2.0) -> torch.Tensor:
    """Combine per-tensor norms into the total norm that ``clip_grad_norm_`` computes; no host sync.

    The total p-norm of several tensors equals the p-norm of the vector of their p-norms; for
    ``"inf"`` that is the maximum (NaN propagates).

    Args:
        norms: the ``[N]`` output of ``foreach_norms`` (or a sequence of 0-dim tensors, stacked
            on the first one's device).
        norm_type: the same p used for ``norms``.

    Returns:
        0-dim tensor on the norms' device, float32 for ``foreach_norms`` output; 0 when ``norms`` is
        empty (as ``clip_grad_norm_`` returns for no gradients).

    Raises:
        ValueError: ``norm_type`` is not a number or ``"inf"``; ``norms`` is not 1-D.

    Example:
        >>> total_norm(torch.tensor([3.0, 4.0]))
        tensor(5.)
    """
    order = _norm_order(norm_type)
    if not isinstance(norms, torch.Tensor):
        parts = list(norms)
        if not parts:
            return torch.zeros((), dtype=torch.float32)
        norms = torch.stack([p.reshape(()).to(parts[0].device) for p in parts])
    if norms.dim() != 1:
        raise ValueError(f"norms must be 1-D (one norm per tensor), got shape {list(norms.shape)}")
    if norms.numel() == 0:
        return torch.zeros((), dtype=norms.dtype, device=norms.device)
    return torch.linalg.vector_norm(norms, order)


def nonfinite_count(t: torch.Tensor) -> torch.Tensor:
    """Number of NaN/+Inf/-Inf elements of ``t`` as a 0-dim int64 device tensor; no host sync.

    Integer and bool tensors give 0 without reading the data; complex elements count when either
    part is non-finite; sparse tensors count their stored values.

    Raises:
        TypeError: ``t`` is not a tensor.

    Example:
        >>> nonfinite_count(torch.tensor([1.0, float("nan"), float("inf")]))
        tensor(2)
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"nonfinite_count expects a torch.Tensor, got {type(t).__name__}")
    if not (t.is_floating_point() or t.is_complex()):
        return torch.zeros((), dtype=torch.int64, device=t.device)
    with torch.no_grad():
        x = t.detach()
        if x.is_sparse:
            x = x._values()  # stored values; implicit zeros are finite
        elif x.layout != torch.strided:
            x = x.to_dense()
        if x.is_floating_point() and x.element_size() == 1:
            x = x.float()  # float8 has no isfinite kernel
        return torch.isfinite(x).logical_not_().sum()

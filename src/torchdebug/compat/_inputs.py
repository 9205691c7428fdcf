"""Seed 004's input and behaviour checks: ``validate_model_input``, prediction checks, ``detect_model_anomalies``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..health.inspection import call_model


class _Unset:
    """A keyword the caller did not pass: ``validate_model_input(data)`` is the seed's call shape."""

    def __repr__(self) -> str:
        return "<seed default>"


_UNSET: Any = _Unset()
# seed 004's documented checks, applied when a call passes no keyword (as the seed called them)
SEED_VALUE_RANGE = (-1000.0, 1000.0)
SEED_NDIM = 2
SEED_OUTPUT_RANGE = (0.0, 1.0)


def validate_model_input(
    data: torch.Tensor,
    *,
    value_range: tuple[float, float] | None = _UNSET,
    ndim: int | Sequence[int] | None = _UNSET,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    device: torch.device | str | None = None,
    name: str = "input",
) -> bool:
    """Seed 004's check of a model input: True, or a ``ValueError`` naming the problem.

    Called as the seed called it, ``validate_model_input(data)`` (no keyword), it runs the seed's
    documented checks: no NaN/Inf, every value within ``[-1000, 1000]``, 2-dimensional. Any
    keyword selects the checks instead (only those passed run, beside the NaN/Inf check).

    The metadata checks (ndim, dtype, device) run first, before any kernel; then one fused reduction
    finds NaN/Inf elements and the value range, read in one host transfer.

    Args:
        data: the input tensor.
        value_range: ``(low, high)`` bounds every finite value must lie in (the seed's
            ``abs(x) <= 1000`` is ``(-1000, 1000)``); None: no range check.
        ndim: the allowed number of dimensions (an int or several); None: any.
        dtype: the allowed dtype(s).
        device: the device the input must be on (``"cuda"`` matches any CUDA device).
        name: how the message calls the tensor.

    Returns:
        True when every check passes.

    Raises:
        ValueError: the first failing check, e.g. ``input has 2 NaN and 1 Inf values (first at
            index (0, 3))`` or ``input values reach 1.5e+03, above the allowed range [-1000, 1000]``.
        TypeError: ``data`` is not a tensor, or a bad ``value_range``.

    Example:
        >>> validate_model_input(torch.zeros(4, 8))  # the seed's checks: finite, |x| <= 1000, 2-D
        True
        >>> validate_model_input(torch.zeros(4, 8, 3), dtype=torch.float32)  # only the checks passed
        True

    Cost: metadata checks, then one reduction pass and one host transfer (skipped for integer inputs
    without a range).
    """
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"validate_model_input needs a tensor, got {type(data).__name__}")
    seed_call = value_range is _UNSET and ndim is _UNSET and dtype is None and device is None
    if value_range is _UNSET:
        value_range = SEED_VALUE_RANGE if seed_call else None
    if ndim is _UNSET:
        ndim = SEED_NDIM if seed_call else None
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if data.dim() not in allowed:
            want = " or ".join(str(n) for n in allowed)
            raise ValueError(
                f"{name} must be {want}-dimensional, got shape {tuple(data.shape)} ({data.dim()} dims)"
            )
    if dtype is not None:
        allowed_dt = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if data.dtype not in allowed_dt:
            want = ", ".join(str(d) for d in allowed_dt)
            raise ValueError(f"{name} has dtype {data.dtype}; expected {want}")
    if device is not None:
        want_dev = torch.device(device)
        if data.device.type != want_dev.type or (want_dev.index is not None and data.device != want_dev):
            raise ValueError(
                f"{name} is on {data.device}; expected {want_dev} (move it with .to({str(want_dev)!r}))"
            )
    if value_range is not None:
        if len(value_range) != 2 or not all(isinstance(v, (int, float)) for v in value_range):
            raise TypeError(f"value_range must be (low, high) numbers, got {value_range!r}")
        lo, hi = float(value_range[0]), float(value_range[1])
        if not lo <= hi:
            raise TypeError(f"value_range low must not exceed high, got {value_range!r}")
    floating = data.is_floating_point() or data.is_complex()
    if data.numel() == 0 or (not floating and value_range is None):
        return True
    with torch.no_grad():
        x = data.detach()
        if x.is_complex():
            x = torch.view_as_real(x)
        f = x.float() if floating else x.double()
        finite = torch.isfinite(f)
        nan = torch.isnan(f).sum()
        inf = (~finite).sum() - nan
        first_bad = (~finite).flatten().int().argmax()
        big = torch.finfo(torch.float64).max
        lo_v = torch.where(finite, f.double(), big).min()
        hi_v = torch.where(finite, f.double(), -big).max()
        host = torch.stack(
            [nan.double(), inf.double(), first_bad.double(), lo_v, hi_v]
        ).tolist()  # one transfer
    n_nan, n_inf, first, lo_seen, hi_seen = int(host[0]), int(host[1]), int(host[2]), host[3], host[4]
    if n_nan or n_inf:
        where = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), x.shape))
        raise ValueError(
            f"{name} has {n_nan} NaN and {n_inf} Inf values (first at index {where}); "
            "clean the data or check the preprocessing that produced it"
        )
    if value_range is not None:
        if hi_seen > hi:
            raise ValueError(f"{name} values reach {hi_seen:.4g}, above the allowed range [{lo:g}, {hi:g}]")
        if lo_seen < lo:
            raise ValueError(f"{name} values reach {lo_seen:.4g}, below the allowed range [{lo:g}, {hi:g}]")
    return True


def prediction_problems(output: Any, *, rtol: float = 1e-6) -> list[str]:
    """Plain-words problems of a batch of predictions: constant over the batch, uniform, one class always.

    - constant: every sample's output equals the first one's (within ``rtol`` of the output scale);
    - uniform: all values equal (the seed's ``std < 1e-6``, made relative to the scale);
    - one class always: for ``(N, C)`` outputs with ``C > 1``, the argmax is the same class for all N.

    Batches of one sample are not judged (nothing to compare). Cost: a few reductions, one transfer.
    """
    if not isinstance(output, torch.Tensor) or not output.is_floating_point() or output.numel() < 2:
        return []
    with torch.no_grad():
        y = output.detach().float()
        scale = y.abs().max()
        tol = rtol * torch.clamp(scale, min=1.0)
        parts = [scale, tol, y.std(), torch.zeros(()), torch.zeros(()), torch.zeros(())]
        n = y.shape[0] if y.dim() >= 1 else 1
        if n > 1:
            parts[3] = (y - y[:1]).abs().max()
        if y.dim() == 2 and y.shape[1] > 1 and n > 1:
            arg = y.argmax(dim=1)
            parts[4] = (arg == arg[0]).all().float()
            parts[5] = arg[0].float()
        host = torch.stack([p.to(y.device).float() for p in parts]).tolist()  # one transfer
    scale_h, tol_h, std_h, spread, same, cls = host
    if not math.isfinite(scale_h):
        return []  # NaN/Inf outputs are the NaN check's business
    problems = []
    if std_h <= tol_h:
        problems.append(
            f"uniform predictions: every output value is {y.flatten()[0].item():.4g} (std {std_h:.3g})"
        )
    elif n > 1 and spread <= tol_h:
        problems.append(
            f"constant predictions: all {n} samples get the same output (max difference {spread:.3g})"
        )
    if same == 1.0 and not problems:
        problems.append(f"one class always: the argmax is class {int(cls)} for all {n} samples")
    return problems


def detect_model_anomalies(
    model: nn.Module, data: Any, *, output_range: tuple[float, float] | None = _UNSET
) -> list[str]:
    """Seed 004's behaviour check: run ``model(data)`` without grad; problems in plain words.

    NaN/Inf outputs, values outside ``output_range``, and ``prediction_problems`` (constant,
    uniform, one class always). Called as the seed called it, ``detect_model_anomalies(model,
    data)``, the range is the seed's ``[0, 1]`` (probability outputs); pass ``output_range=None``
    for logits or regression outputs (no range check), or your own bounds. The model's
    train/eval mode is left as it was.

    Example:
        >>> detect_model_anomalies(nn.Sequential(nn.Linear(3, 2), nn.Softmax(dim=1)), torch.randn(4, 3))
        []
        >>> detect_model_anomalies(nn.Linear(3, 2), torch.randn(4, 3), output_range=None)
        []
    """
    if output_range is _UNSET:
        output_range = SEED_OUTPUT_RANGE
    with torch.no_grad():
        out = call_model(model, data)
    if not isinstance(out, torch.Tensor):
        return []
    found: list[str] = []
    f = out.detach().float()
    host = torch.stack(
        [torch.isnan(f).sum().float(), torch.isinf(f).sum().float(), f.min(), f.max()]
    ).tolist()
    if host[0]:
        found.append(f"Model output contains NaN values ({int(host[0])})")
    if host[1]:
        found.append(f"Model output contains infinite values ({int(host[1])})")
    if output_range is not None and not (host[0] or host[1]):
        lo, hi = output_range
        if host[2] < lo or host[3] > hi:
            found.append(
                f"Model output outside expected range [{lo:g}, {hi:g}]: [{host[2]:.4g}, {host[3]:.4g}]"
            )
    found += prediction_problems(out)
    return found


__all__ = ["detect_model_anomalies", "prediction_problems", "validate_model_input"]

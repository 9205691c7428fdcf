"""Pure tensor maths, no hooks and no state: TensorStats / analyze_tensor and fused reductions."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

_DTYPE_SHORT = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "bool",
    torch.complex64: "c64",
    torch.complex128: "c128",
}


@dataclass(frozen=True)
class TensorStats:
    """Statistics of one tensor; the float fields are over its finite values only."""

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
        return self.nan_count > 0

    @property
    def has_inf(self) -> bool:
        return (self.posinf_count + self.neginf_count) > 0

    @property
    def nonfinite_count(self) -> int:
        return self.nan_count + self.posinf_count + self.neginf_count

    def __str__(self) -> str:
        dt = _DTYPE_SHORT.get(getattr(torch, self.dtype.replace("torch.", ""), None), self.dtype)  # type: ignore[arg-type]
        s = f"tensor{list(self.shape)} {dt} {self.device}"
        if self.name:
            s = f"{self.name}: {s}"
        if self.min is not None and self.max is not None:
            s += f" x∈[{self.min:.3g}, {self.max:.3g}]"
        if self.mean is not None:
            s += f" μ={self.mean:.3g}"
        if self.std is not None and not math.isnan(self.std):
            s += f" σ={self.std:.3g}"
        if self.nan_count:
            s += f" NaN!×{self.nan_count}"
        if self.posinf_count:
            s += f" +Inf!×{self.posinf_count}"
        if self.neginf_count:
            s += f" -Inf!×{self.neginf_count}"
        if self.grad_fn:
            s += f" grad_fn={self.grad_fn}"
        return s

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            d[f.name] = list(v) if isinstance(v, tuple) else v
        d["has_nan"] = self.has_nan
        d["has_inf"] = self.has_inf
        return d


def analyze_tensor(t: torch.Tensor, name: str | None = None) -> TensorStats:
    """Statistics of ``t`` computed on its device with one host transfer (placeholder: refined in stats work)."""
    x = t.detach()
    base = dict(
        name=name,
        shape=tuple(x.shape),
        dtype=str(x.dtype).replace("torch.", ""),
        device=str(x.device),
        numel=x.numel(),
        bytes=x.numel() * x.element_size(),
        requires_grad=bool(t.requires_grad),
        grad_fn=type(t.grad_fn).__name__ if t.grad_fn is not None else None,
    )
    if x.device.type == "meta" or x.numel() == 0 or not x.is_floating_point():
        return TensorStats(**base)  # type: ignore[arg-type]
    f = x.float()
    fin = torch.isfinite(f)
    vals = torch.stack(
        [
            torch.isnan(f).sum().float(),
            torch.isposinf(f).sum().float(),
            torch.isneginf(f).sum().float(),
            torch.where(fin, f, torch.inf).min(),
            torch.where(fin, f, -torch.inf).max(),
        ]
    ).tolist()  # one host transfer
    return TensorStats(**base, nan_count=int(vals[0]), posinf_count=int(vals[1]), neginf_count=int(vals[2]),  # type: ignore[arg-type]
                       min=vals[3], max=vals[4])

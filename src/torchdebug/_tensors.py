"""Tensor helpers of the hot path, shared by the session and the sentinel (core: imports only torch).

FSDP2 DTensors are read through their local shard (no communication); gradients and parameters are
reduced on the device to one float32 per tensor (norms, or a cheaper finiteness probe) so the step's
one host transfer (:func:`read`) reads a handful of numbers.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

Items = list[tuple[str, torch.Tensor]]  # named device numbers for the step's one host read


def dtensor_type() -> type | None:
    """The DTensor class once ``torch.distributed.tensor`` has been imported, else None.

    Importing that module costs ~0.5 s of CPU (it pulls in sympy), so torchdebug never imports it:
    a DTensor (an FSDP2 parameter) cannot exist before its module was imported by the user's code,
    so until then nothing can be one. One dict lookup per call.
    """
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def local(t: Any) -> Any:
    """A DTensor's local shard (FSDP2 parameters and gradients); anything else as it is. No copy."""
    dtensor = dtensor_type()
    if dtensor is not None and isinstance(t, dtensor):
        return t._local_tensor  # type: ignore[attr-defined]  # not to_local(): no autograd node, no communication
    return t


def local_shards(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``local`` over a list; the list itself when it holds no DTensor (the common case, no copy)."""
    dtensor = dtensor_type()
    if dtensor is None or not any(isinstance(t, dtensor) for t in tensors):
        return tensors
    return [local(t) for t in tensors]


def foreach_norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Per-tensor L2 norms as one float32 device tensor; no host sync.

    Hot path: all dense float32 on one device (the common case): a BLAS dot per tensor on CPU,
    the fused ``torch._foreach_norm`` elsewhere; anything else through
    :func:`torchdebug.stats.foreach_norms`. Callers confirm non-finite entries exactly.
    """
    tensors = local_shards(tensors)  # FSDP2 DTensors: this rank's shard
    first = tensors[0]
    if all(
        t.dtype is torch.float32 and t.device == first.device and t.layout is torch.strided for t in tensors
    ):
        with torch.no_grad():
            if first.device.type == "cpu" and all(t.is_contiguous() for t in tensors):
                # CPU: a BLAS dot per tensor is ~1.6x faster than the foreach norm (which is not fused
                # there); its float32 sum of squares can overflow: callers confirm non-finite entries
                return torch.stack([torch.dot(t.view(-1), t.view(-1)) for t in tensors]).sqrt()
            return torch.stack(torch._foreach_norm(tensors))
    from .stats import foreach_norms as general

    return general(tensors)


def finite_probe(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One float32 per tensor that is finite iff the tensor is (a false alarm is possible: see below).

    CPU: a plain sum per tensor, one memory pass and about half the cost of a norm; a finite sum
    proves every element finite. A sum of finite values that overflows reads as non-finite: the
    caller confirms flagged tensors exactly. Accelerators: the fused foreach norm (one kernel).
    """
    if not tensors:  # no trainable parameters (none, or all frozen): nothing to check
        return torch.zeros(0)
    tensors = local_shards(tensors)  # FSDP2 DTensors: this rank's shard
    if tensors[0].device.type != "cpu":
        return foreach_norms(tensors)
    with torch.no_grad():
        return torch.stack([_probe_one(t) for t in tensors])


def _probe_one(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        return t.sum(dtype=torch.float32)
    if t.is_complex():  # real and imaginary parts: a NaN in either is a NaN gradient
        return torch.view_as_real(t).sum(dtype=torch.float32)
    return t.new_zeros((), dtype=torch.float32)  # integer tensors hold no NaN/Inf


def unwrap_optimizer(opt: Any) -> Any:
    """The torch optimizer inside a framework's wrapper (Lightning's ``LightningOptimizer._optimizer``,
    accelerate's ``AcceleratedOptimizer.optimizer``); anything else unchanged."""
    for _ in range(4):  # wrappers nest at most a few deep
        attrs = getattr(opt, "__dict__", None) or {}  # not getattr: LightningOptimizer forwards lookups
        inner = attrs.get("_optimizer", attrs.get("optimizer"))
        if not isinstance(inner, torch.optim.Optimizer):
            return opt
        opt = inner
    return opt


def read(items: Items) -> dict[str, float]:
    """Read named device numbers with ONE host transfer; an n-element tensor gives ``name#0..n-1``."""
    names: list[str] = []
    flat: list[torch.Tensor] = []
    for name, t in items:
        t = local(t).detach().reshape(-1).float()  # FSDP2 DTensor: this rank's shard
        names += [name] if t.numel() == 1 else [f"{name}#{i}" for i in range(t.numel())]
        flat.append(t)
    dev = flat[0].device
    return dict(zip(names, torch.cat([t.to(dev) for t in flat]).tolist()))


def entries(values: dict[str, float], name: str, n: int) -> list[float]:
    """The ``n`` numbers an item called ``name`` gave (``name#i``, or ``name`` alone when n == 1)."""
    return [values[f"{name}#{i}"] if f"{name}#{i}" in values else values.get(name, 0.0) for i in range(n)]

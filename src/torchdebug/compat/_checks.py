"""Seed 002's tensor and gradient anomaly checks, plain and async (``asyncio.to_thread``)."""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from torch import nn

from ..health.gradients import _grad_values
from ..stats import analyze_tensor, foreach_norms, total_norm


def check_tensor_anomalies(tensor: torch.Tensor, name: str | None = None) -> dict[str, Any]:
    """NaN/Inf counts and statistics of ``tensor`` as a JSON-ready dict (``TensorStats.to_dict()``).

    Keys include ``has_nan``, ``has_inf``, ``nan_count``, ``posinf_count``, ``neginf_count``,
    ``min``/``max``/``mean``/``std`` (over finite values), ``shape``, ``dtype``, ``name``.

    Raises:
        TypeError: not a tensor.

    Example:
        >>> check_tensor_anomalies(torch.tensor([1.0, float("nan")]), "loss")["nan_count"]
        1

    Cost: one host transfer (see ``td.analyze_tensor``).
    """
    return analyze_tensor(tensor, name).to_dict()


async def check_tensor_anomalies_async(tensor: torch.Tensor, name: str | None = None) -> dict[str, Any]:
    """``check_tensor_anomalies`` in a worker thread, so an event loop is not blocked by the host transfer."""
    return await asyncio.to_thread(check_tensor_anomalies, tensor, name)


def check_gradient_anomalies(model: nn.Module) -> dict[str, Any]:
    """Which parameters have NaN or Inf gradients, and the total L2 gradient norm, in one host transfer.

    Returns:
        ``{"params_with_nan_grad": int, "params_with_inf_grad": int, "nan_params": [names],
        "inf_params": [names], "params_with_grad": int, "total_norm": float}``; ``total_norm`` is
        what ``clip_grad_norm_`` would return (NaN/Inf when a gradient is). A gradient holding both
        NaN and Inf counts in both.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.

    Example:
        >>> net = nn.Linear(2, 1); net(torch.ones(1, 2)).sum().backward()
        >>> check_gradient_anomalies(net)["params_with_nan_grad"]
        0

    Cost: two fused flags per gradient, fused norms, one host transfer.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"check_gradient_anomalies needs an nn.Module, got {type(model).__name__}")
    named = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    if not named:
        return {
            "params_with_nan_grad": 0,
            "params_with_inf_grad": 0,
            "nan_params": [],
            "inf_params": [],
            "params_with_grad": 0,
            "total_norm": 0.0,
        }
    grads = [_grad_values(p.grad) for _, p in named]  # type: ignore[arg-type]
    dev = grads[0].device
    with torch.no_grad():
        nan = torch.stack([torch.isnan(g).any().to(dev) for g in grads])
        inf = torch.stack([torch.isinf(g).any().to(dev) for g in grads])
        tot = total_norm(foreach_norms(grads))
        host = torch.cat(
            [tot.reshape(1).to(dev, torch.float64), nan.double(), inf.double()]
        ).tolist()  # one transfer
    k = len(named)
    nan_params = [named[i][0] for i in range(k) if host[1 + i] > 0]
    inf_params = [named[i][0] for i in range(k) if host[1 + k + i] > 0]
    total = host[0]
    return {
        "params_with_nan_grad": len(nan_params),
        "params_with_inf_grad": len(inf_params),
        "nan_params": nan_params,
        "inf_params": inf_params,
        "params_with_grad": k,
        "total_norm": total,
    }


async def check_gradient_anomalies_async(model: nn.Module) -> dict[str, Any]:
    """``check_gradient_anomalies`` in a worker thread (``asyncio.to_thread``)."""
    return await asyncio.to_thread(check_gradient_anomalies, model)


__all__ = [
    "check_gradient_anomalies",
    "check_gradient_anomalies_async",
    "check_tensor_anomalies",
    "check_tensor_anomalies_async",
]

"""Per-row losses of a captured micro-step: the forward replayed once, the loss code per batch row.

The loss-spike forensics (``session/rollback.py``) ask which rows of the batch carry a spike. The
captured micro-step (:class:`~torchdebug.nonfinite.locate.StepCapture`: the batch, RNG, autocast
state, the recorded loss code) is replayed without gradients: the model's forward runs once on the
whole batch (so batch statistics and dropout are those of the real step), then the recorded loss code
runs once per row on the row's slice of the model's outputs and of every batch tensor it used (a
tensor whose first dimension is the batch size, not made by the model or the loss code, not a
parameter). The user's gradients, buffers and RNG are left as they were.

A loss the model computes itself and returns among its outputs (the Hugging Face idiom
``model(input_ids, labels=labels).loss``) has no loss code to slice: the forward runs once per part
instead, on the part's slice of every batch tensor of its inputs (the labels included), and the part's
loss is that output. Cost: one forward without gradients per part, at most ``MAX_FORWARDS`` parts;
batch statistics (BatchNorm) are then the part's own.

Known limitations: the batch dimension is the first one of the model's first input; loss code that
builds shapes from the batch size (``view(B * T, -1)``) cannot run on one row (the rows are then
unavailable, with the error); with more than ``MAX_PARTS`` rows (``MAX_FORWARDS`` when the model
computes the loss), contiguous groups of rows are replayed as parts and a part is named by its first
row.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .._trees import map_tensors, tensor_leaves
from .locate import StepCapture, _autocast, _preserved_state, user_storages, writes_apart

MAX_PARTS = 512
MAX_FORWARDS = 64  # parts when each is a forward of its own (the model computes the loss)


def row_losses(
    model: nn.Module, cap: StepCapture, *, uses_cuda: bool = False
) -> tuple[list[float] | None, list[int], str | None, str]:
    """``(losses per part, first row of each part, reduction, note)`` of one captured micro-step.

    ``reduction`` is ``"mean"`` or ``"sum"`` when the parts' losses give the replayed full loss that
    way (within 1e-4 relative), else None. ``losses`` is None when the step cannot be split; ``note``
    says why. Cost: one forward without gradients plus the loss code once per part (a loss the model
    computes: one forward per part).
    """
    if cap.loss is None:
        return None, [], None, "no backward() of the captured micro-step was seen"
    leaves = [t for t in tensor_leaves((cap.args, cap.kwargs)) if t.dim() >= 1]
    if not leaves:
        return None, [], None, "the model's inputs hold no batched tensor"
    n = int(leaves[0].shape[0])
    if n < 2:
        return None, [], None, "a batch of one row"
    inside = next((i for i, t in enumerate(tensor_leaves(cap.outputs)) if t is cap.loss), None)
    if inside is None and not cap.tape_complete:
        why = f": {cap.untaped}" if cap.untaped else ""
        return None, [], None, f"the loss code was not recorded{why}"
    if inside is None and not cap.tape:
        return (
            None,
            [],
            None,
            ("the loss is neither one of the model's outputs nor made by torch calls after its forward"),
        )
    step = max(1, math.ceil(n / (MAX_PARTS if inside is None else MAX_FORWARDS)))
    starts = list(range(0, n, step))
    params = {id(p) for p in model.parameters()} | {id(b) for b in model.buffers()}
    module = cap.module if cap.module is not None else model
    try:
        with _preserved_state(model, uses_cuda), torch.no_grad():
            torch.set_rng_state(cap.rng_cpu)
            if cap.rng_cuda is not None:
                torch.cuda.set_rng_state_all(cap.rng_cuda)
            with _autocast(cap.autocast):
                out = module(*cap.args, **cap.kwargs)
                if inside is not None:  # the model computes the loss: a forward per part
                    full = _value(tensor_leaves(out)[inside])
                    parts = [
                        _forward_loss(module, cap, slice(a, min(a + step, n)), n, inside) for a in starts
                    ]
                else:
                    user = user_storages([cap])
                    full = _loss(cap, out, None, n, params, user)
                    parts = [_loss(cap, out, slice(a, min(a + step, n)), n, params, user) for a in starts]
    except Exception as exc:  # the loss code does not run on a slice: no rows, and why
        what = "the model's forward" if inside is not None else "the loss code"
        return None, [], None, f"{what} failed on one row: {type(exc).__name__}: {exc}"
    sizes = [min(a + step, n) - a for a in starts]
    mean = sum(p * s for p, s in zip(parts, sizes)) / n
    total = sum(parts)
    reduction = None
    if _close(mean, full):
        reduction = "mean"
    elif _close(total, full):
        reduction = "sum"
    return parts, starts, reduction, ""


def _loss(
    cap: StepCapture, out: Any, rows: slice | None, n: int, params: set[int], user: set[int | None]
) -> float:
    """The recorded loss code on ``rows`` of the outputs and batch tensors (None: the whole batch); a
    call that writes into a tensor of the user's (``user``: their storages) writes into a copy."""
    mapping: dict[int, torch.Tensor] = {}
    for o, t in zip(tensor_leaves(cap.outputs), tensor_leaves(out)):
        mapping[id(o)] = t[rows] if rows is not None and t.dim() >= 1 and t.shape[0] == n else t

    def sub(t: torch.Tensor) -> torch.Tensor:
        got = mapping.get(id(t))
        if got is not None:
            return got
        if rows is not None and id(t) not in params and t.dim() >= 1 and t.shape[0] == n:
            return t[rows]  # a batch tensor only the loss code used (the labels)
        return t

    for func, _types, args, kwargs, _raw, res in cap.tape:
        writes_apart(func, args, kwargs, mapping, sub, user)
        new = func(*map_tensors(args, sub), **map_tensors(kwargs, sub))
        for o, t in zip(tensor_leaves(res), tensor_leaves(new)):
            mapping[id(o)] = t
    loss = mapping.get(id(cap.loss))
    if loss is None:
        raise RuntimeError("the loss was not made by the recorded calls")
    return _value(loss)


def _forward_loss(module: nn.Module, cap: StepCapture, rows: slice, n: int, inside: int) -> float:
    """The model's own loss (its output ``inside``) on ``rows`` of every batch tensor of its inputs."""
    cut = lambda t: t[rows] if t.dim() >= 1 and t.shape[0] == n else t  # noqa: E731
    out = module(*map_tensors(cap.args, cut), **map_tensors(cap.kwargs, cut))
    return _value(tensor_leaves(out)[inside])


def _value(loss: torch.Tensor) -> float:
    return float(loss.detach().float().sum())  # rare path (a spike): one read per part


def _close(a: float, b: float) -> bool:
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= 1e-4 * max(abs(a), abs(b), 1e-12)


__all__ = ["MAX_PARTS", "row_losses"]

"""Where a non-finite loss was made when its forward ran untraced: read back from its autograd graph.

Rare path: runs only when a traced block's ``backward()`` starts from a NaN/Inf loss that the trace
did not see being made (seed 003's ``with detector.detect_anomaly(): loss.backward()`` with the
forward outside the block). Each node of the loss's graph keeps what its backward needs: the op's
inputs (``_saved_self``, ``_saved_other``) and for some ops its result (``_saved_result``). A node
whose saved inputs are all finite while its result (saved, or recomputed from the inputs for the
elementwise ops below) is not is where the value was born; the earliest such node in creation
order is the origin. A node that saves only its result (sqrt) counts when no earlier node's inputs
held a NaN/Inf already. Module and source line are unknown: the forward ran before the trace.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# nodes visited at most: a graph walk must stay cheap next to the step it explains
_MAX_NODES = 20_000
_BACKWARD = re.compile(r"Backward\d*$")

# elementwise ops whose node saves only the input: the result recomputed from it
_UNARY: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "LogBackward0": torch.log,
    "Log2Backward0": torch.log2,
    "Log10Backward0": torch.log10,
    "Log1PBackward0": torch.log1p,
    "AcosBackward0": torch.acos,
    "AsinBackward0": torch.asin,
    "AtanhBackward0": torch.atanh,
    "AcoshBackward0": torch.acosh,
    "ExpBackward0": torch.exp,
    "Expm1Backward0": torch.expm1,
    "SinhBackward0": torch.sinh,
    "CoshBackward0": torch.cosh,
    "TanBackward0": torch.tan,
    "DigammaBackward0": torch.digamma,
    "LgammaBackward0": torch.lgamma,
    "ErfinvBackward0": torch.erfinv,
}


@dataclass
class GraphOrigin:
    """The node that made the first non-finite value: its aten op, result, and saved inputs."""

    op: str  # "aten.log"
    node: str  # "LogBackward0"
    result: torch.Tensor
    inputs: list[torch.Tensor]


def _op_name(node_name: str) -> str:
    base = _BACKWARD.sub("", node_name)
    return "aten." + re.sub(r"(?<!^)(?=[A-Z])", "_", base).lower() if base else node_name


def _saved(node: Any) -> dict[str, torch.Tensor]:
    out = {}
    for name in dir(node):
        if not name.startswith("_saved_"):
            continue
        try:
            v = getattr(node, name)
        except Exception:  # freed (after a backward) or not readable
            continue
        if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()):
            out[name] = v
    return out


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())  # rare path: one host read per saved tensor


def _result(node: Any, saved: dict[str, torch.Tensor]) -> torch.Tensor | None:
    if "_saved_result" in saved:
        return saved["_saved_result"]
    name = type(node).__name__
    x = saved.get("_saved_self")
    if x is None:
        return None
    if name in _UNARY:
        return _UNARY[name](x)
    if name == "DivBackward0" and "_saved_other" in saved:
        return x / saved["_saved_other"]
    if name == "PowBackward0":
        exponent = getattr(node, "_saved_exponent", None)
        return torch.pow(x, exponent) if isinstance(exponent, (int, float)) else None
    if name == "PowBackward1" and "_saved_exponent" in saved:
        return torch.pow(x, saved["_saved_exponent"])
    return None


def graph_origin(loss: torch.Tensor) -> GraphOrigin | None:
    """The earliest node of ``loss``'s graph that made a NaN/Inf from finite inputs (None: not found).

    Cost: a walk of the graph (at most 20 000 nodes) with a finiteness read of each saved tensor
    and an elementwise op recomputed per node of the table: after a NaN/Inf only.
    """
    root = loss.grad_fn
    if root is None:
        return None
    found: list[tuple[int, bool, GraphOrigin]] = []  # (creation order, inputs seen finite, origin)
    bad_inputs_at: int | None = None  # the earliest node whose saved inputs already held a NaN/Inf
    seen: set[int] = set()
    todo = [root]
    with torch.no_grad(), torch._C.DisableTorchFunction():
        while todo and len(seen) < _MAX_NODES:
            node = todo.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            todo.extend(n for n, _ in node.next_functions if n is not None)
            saved = _saved(node)
            inputs = [v for k, v in saved.items() if k != "_saved_result"]
            seq = node._sequence_nr()
            if inputs and not all(_finite(v) for v in inputs):
                bad_inputs_at = seq if bad_inputs_at is None else min(bad_inputs_at, seq)
                continue
            try:
                result = _result(node, saved)
            except Exception:
                continue
            if result is None or _finite(result):
                continue
            name = type(node).__name__
            found.append((seq, bool(inputs), GraphOrigin(_op_name(name), name, result, inputs)))
    # a node that saved only its result (sqrt, rsqrt, reciprocal) is an origin unless a NaN/Inf
    # already sat in an earlier node's inputs (then it only passed it on)
    valid = [(seq, o) for seq, checked, o in found if checked or bad_inputs_at is None or seq < bad_inputs_at]
    return min(valid, key=lambda x: x[0])[1] if valid else None

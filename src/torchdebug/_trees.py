"""Walk and rebuild nested outputs (tuples, lists, dicts, dataclasses, namedtuples, plain objects) to reach their tensors."""

from __future__ import annotations

import copy
import dataclasses
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

_MAX_DEPTH = 8  # outputs nest a few levels at most; the bound keeps cyclic objects safe


def tensor_leaves(obj: Any, _depth: int = 0) -> list[torch.Tensor]:
    """Every tensor inside ``obj``, in a deterministic order (dict insertion order, field order)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if _depth >= _MAX_DEPTH:
        return []
    out: list[torch.Tensor] = []
    if isinstance(obj, (list, tuple)):
        for v in obj:
            out.extend(tensor_leaves(v, _depth + 1))
    elif isinstance(obj, Mapping):
        for v in obj.values():
            out.extend(tensor_leaves(v, _depth + 1))
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            out.extend(tensor_leaves(getattr(obj, f.name, None), _depth + 1))
    elif _plain_object(obj):
        for v in list(vars(obj).values()):
            out.extend(tensor_leaves(v, _depth + 1))
    return out


def named_tensor_leaves(obj: Any, name: str = "", _depth: int = 0) -> list[tuple[str, torch.Tensor]]:
    """``tensor_leaves`` with a name for each: mapping keys and attribute names as they are
    (``input_ids``; nested ``batch.labels``), positions as ``name[i]``."""
    if isinstance(obj, torch.Tensor):
        return [(name or "tensor", obj)]
    if _depth >= _MAX_DEPTH:
        return []
    out: list[tuple[str, torch.Tensor]] = []
    join = (lambda k: f"{name}.{k}") if name else (lambda k: str(k))
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.extend(named_tensor_leaves(v, f"{name}[{i}]", _depth + 1))
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            out.extend(named_tensor_leaves(v, join(k), _depth + 1))
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            out.extend(named_tensor_leaves(getattr(obj, f.name, None), join(f.name), _depth + 1))
    elif _plain_object(obj):
        for k, v in list(vars(obj).items()):
            out.extend(named_tensor_leaves(v, join(k), _depth + 1))
    return out


def named_inputs(args: tuple, kwargs: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a call's arguments, named: ``input[0]`` by position, keywords by their name
    (``model(**batch)``: ``input_ids``, ``attention_mask``, ``labels``), a dict batch's keys likewise."""
    out: list[tuple[str, torch.Tensor]] = []
    for i, a in enumerate(args):
        if isinstance(a, Mapping) or (dataclasses.is_dataclass(a) and not isinstance(a, type)):
            out.extend(named_tensor_leaves(a))  # a batch dict passed whole: its keys are the names
        else:
            out.extend(named_tensor_leaves(a, f"input[{i}]"))
    for k, v in kwargs.items():
        out.extend(named_tensor_leaves(v, str(k)))
    return out


def _plain_object(obj: Any) -> bool:
    """A user's own result object (``outputs.loss``): instance attributes in ``__dict__``, and not a
    module, class, function or module object (whose attributes are not the call's outputs)."""
    return (
        hasattr(obj, "__dict__")
        and not isinstance(
            obj, (type, types.ModuleType, types.FunctionType, types.MethodType, torch.nn.Module)
        )
        and type(obj).__module__ != "builtins"
    )


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any], _depth: int = 0) -> Any:
    """Rebuild ``obj`` with ``fn`` applied to each tensor (containers are copied, not mutated)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if _depth >= _MAX_DEPTH:
        return obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(v, fn, _depth + 1) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn, _depth + 1) for v in obj)
    if isinstance(obj, dict):
        new = dict.fromkeys(obj)
        for k, v in obj.items():
            new[k] = map_tensors(v, fn, _depth + 1)
        try:
            return type(obj)(new)
        except Exception:
            return new
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {
            f.name: map_tensors(getattr(obj, f.name), fn, _depth + 1)
            for f in dataclasses.fields(obj)
            if f.init
        }
        return dataclasses.replace(obj, **changes)
    if _plain_object(obj):
        fields = vars(obj)
        if not any(tensor_leaves(v, _depth + 1) for v in fields.values()):
            return obj
        try:
            new = copy.copy(obj)  # a shallow copy with its tensor attributes replaced
            for k, v in list(fields.items()):
                setattr(new, k, map_tensors(v, fn, _depth + 1))
        except Exception:
            return obj  # an object that refuses copying or attributes: left as it was
        return new
    return obj

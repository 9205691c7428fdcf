"""Multi-tensor gradient hooks that never raise into the user's backward or torch.autograd.grad()."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd.graph import _get_grad_fn_or_grad_acc, _MultiHandle


def when_all_grads(tensors: Sequence[torch.Tensor], fn: Callable[[], None], *, unknown: str = "skip") -> Any:
    """Call ``fn()`` once the gradients of all ``tensors`` are computed in a backward graph task.

    Like ``torch.autograd.graph.register_multi_grad_hook(mode="all")``, whose hook raises inside
    ``torch.autograd.grad()`` when a tensor is a leaf ("A leaf node was passed to
    _will_engine_execute_node"): torch cannot tell there which leaf gradients the call computes,
    and the error breaks the user's gradient penalty. Here such a graph task is handled by
    ``unknown``: ``"skip"`` (``fn`` is not called for it) or ``"first"`` (``fn`` is called at the
    first gradient, as ``mode="any"`` would). ``fn`` runs inside the hook: it may read
    ``torch._C._current_graph_task_id()``. Returns a handle with ``remove()``.
    """
    nodes = [_get_grad_fn_or_grad_acc(t) for t in tensors]
    counts: dict[int, int] = {}
    expected: dict[int, int | None] = {}
    lock = threading.Lock()

    def hook(_grad: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        with lock:
            if task not in expected:
                try:
                    expected[task] = sum(map(torch._C._will_engine_execute_node, nodes))
                except RuntimeError:  # torch.autograd.grad() over a leaf
                    expected[task] = None
                    counts[task] = 0
            n = expected[task]
            counts[task] = counts.get(task, 0) + 1
            if n is None:
                call = unknown == "first" and counts[task] == 1
            else:
                call = counts[task] == n
                if call:
                    del counts[task], expected[task]
        if call:
            fn()

    return _MultiHandle(tuple(t.register_hook(hook) for t in tensors))


def make_tracker_safe(tracker: Any) -> None:
    """Route a ``torch.utils.module_tracker.ModuleTracker``'s gradient hooks through :func:`when_all_grads`.

    Its own hooks use ``register_multi_grad_hook`` and so break ``torch.autograd.grad()`` over leaf
    inputs (FlopCounterMode uses one). Under such a call a module is left at its first input
    gradient (``unknown="first"``): the FLOPs of that call may be credited to the parent module.
    Private API of the tracker (its hook methods): without them nothing is changed.
    """
    from torch.utils._pytree import tree_leaves

    if not all(hasattr(tracker, a) for a in ("_get_mod_name", "_get_append_fn", "_get_pop_fn", "_hooks")):
        return

    def grad_tensors(tree: Any) -> list[torch.Tensor]:
        return [a for a in tree_leaves(tree) if isinstance(a, torch.Tensor) and a.requires_grad]

    def fw_pre_hook(mod: Any, input: Any) -> None:
        name = tracker._get_mod_name(mod)
        tracker._get_append_fn(name, False)()
        tensors = grad_tensors(input)
        if tensors:
            tracker._hooks.append(when_all_grads(tensors, tracker._get_pop_fn(name, True), unknown="first"))

    def fw_post_hook(mod: Any, input: Any, output: Any) -> None:
        name = tracker._get_mod_name(mod)
        tracker._get_pop_fn(name, False)()
        tensors = grad_tensors(output)
        if tensors:
            tracker._hooks.append(
                when_all_grads(tensors, tracker._get_append_fn(name, True), unknown="first")
            )

    tracker._fw_pre_hook = fw_pre_hook
    tracker._fw_post_hook = fw_post_hook

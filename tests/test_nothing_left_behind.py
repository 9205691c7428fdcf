"""After ``watch`` exits nothing of torchdebug is left in torch or the model, at every level, whatever
thread ran the forward and whatever transform wrapped it; an unrelated model then compiles."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
import torch.nn.modules.module as module_globals
from torch import nn

import torchdebug as td

_LEVELS = ("basic", "intermediate", "advanced", "expert")
_MODULE_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _patchable() -> list[tuple[str, Any]]:
    """Every namespace an instrument may patch: a changed attribute of one of them is a patch left."""
    import torch.nn.utils as nn_utils
    import torch.nn.utils.clip_grad as clip_grad
    from torch.amp.grad_scaler import GradScaler

    return [
        ("torch", torch),
        ("torch.Tensor", torch.Tensor),
        ("torch.autograd", torch.autograd),
        ("torch.nn.Module", nn.Module),
        ("torch.nn.functional", nn.functional),
        ("torch.nn.utils", nn_utils),
        ("torch.nn.utils.clip_grad", clip_grad),
        ("torch.optim.Optimizer", torch.optim.Optimizer),
        ("GradScaler", GradScaler),
    ]


def _thread_state() -> dict[str, Any]:
    """The calling thread's mode stacks and saved-tensor hooks (all thread-local in torch)."""
    return {
        "dispatch_modes": torch._C._len_torch_dispatch_stack(),
        "function_modes": torch._C._len_torch_function_stack(),
        "saved_tensor_hooks": torch._C._autograd._top_saved_tensors_default_hooks(False),
        "grad_enabled": torch.is_grad_enabled(),
        "anomaly": torch.is_anomaly_enabled(),
    }


def _state(model: nn.Module) -> dict[str, Any]:
    from torch.optim import optimizer as optim_globals

    state: dict[str, Any] = {}
    for name in dir(module_globals):
        if name.startswith("_global_"):  # the hook dicts, and _global_is_full_backward_hook
            value = getattr(module_globals, name)
            state[name] = dict(value) if isinstance(value, dict) else value
    state["optimizer_pre"] = dict(optim_globals._global_optimizer_pre_hooks)
    state["optimizer_post"] = dict(optim_globals._global_optimizer_post_hooks)
    for name, mod in model.named_modules():
        for attr in _MODULE_DICTS:
            state[f"{name}.{attr}"] = dict(getattr(mod, attr, {}))
        state[f"{name}.compiled_call"] = mod.__dict__.get("_compiled_call_impl")
        state[f"{name}.train"] = mod.training
    for name, p in model.named_parameters():
        state[f"{name}.tensor_hooks"] = dict(p._backward_hooks or {})
        state[f"{name}.post_accumulate"] = dict(getattr(p, "_post_accumulate_grad_hooks", None) or {})
    for ns_name, ns in _patchable():
        state[ns_name] = {k: v for k, v in vars(ns).items() if not k.startswith("__")}
    state.update(_thread_state())
    return state


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def _plain(model: nn.Module, opt: Any, mon: Any, x: torch.Tensor, y: torch.Tensor, pool: Any) -> None:
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()


def _worker(model: nn.Module, opt: Any, mon: Any, x: torch.Tensor, y: torch.Tensor, pool: Any) -> None:
    # the probe: a forward run by a pool thread left FlopCounterMode's global hooks installed
    out = pool.submit(model, x).result()
    loss = nn.functional.mse_loss(out, y)
    opt.zero_grad()
    loss.backward()
    opt.step()


def _func_grad(model: nn.Module, opt: Any, mon: Any, x: torch.Tensor, y: torch.Tensor, pool: Any) -> None:
    # the probe: under torch.func.grad every module kept the per-module memory hooks
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_fn(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return nn.functional.mse_loss(torch.func.functional_call(model, p, (x,)), y)

    grads = torch.func.grad(loss_fn)(params)
    for k, p in model.named_parameters():
        p.grad = grads[k]
    opt.step()


def _vmap(model: nn.Module, opt: Any, mon: Any, x: torch.Tensor, y: torch.Tensor, pool: Any) -> None:
    out = torch.func.vmap(model)(x)
    loss = nn.functional.mse_loss(out, y)
    opt.zero_grad()
    loss.backward()
    opt.step()


def _functional_call(
    model: nn.Module, opt: Any, mon: Any, x: torch.Tensor, y: torch.Tensor, pool: Any
) -> None:
    params = dict(model.named_parameters())
    loss = nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)), y)
    opt.zero_grad()
    loss.backward()
    opt.step()


_LOOPS: dict[str, Callable[..., None]] = {
    "main-thread": _plain,
    "worker-thread": _worker,
    "func.grad": _func_grad,
    "vmap": _vmap,
    "functional_call": _functional_call,
}


def _compiles_cleanly() -> None:
    """An unrelated model compiles and runs (the probe: AssertionError 'UnspecializedNNModuleVariable(
    Sequential) is already tracked for mutation' while a leftover global hook was installed)."""
    torch._dynamo.reset()
    other = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
    compiled = torch.compile(other, backend="eager", fullgraph=True)
    x = torch.ones(2, 3)
    torch.testing.assert_close(compiled(x), other(x))


@pytest.mark.parametrize("loop", sorted(_LOOPS))
@pytest.mark.parametrize("level", _LEVELS)
def test_nothing_is_left_after_exit(tmp_path: Any, level: str, loop: str) -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    with ThreadPoolExecutor(1) as pool:
        before = _state(model)
        worker_before = pool.submit(_thread_state).result()
        with td.watch(model, opt, run=tmp_path, config={"level": level, "memory_every": 1}) as mon:
            for _ in range(3):
                _LOOPS[loop](model, opt, mon, x, y, pool)
                mon.step()
        after = _state(model)
        assert {k: v for k, v in after.items() if before.get(k) != v} == {}
        assert after.keys() == before.keys()
        # the pool thread's own stacks too: a mode it entered is still on its stack after exit
        assert pool.submit(_thread_state).result() == worker_before
    if loop in ("main-thread", "worker-thread") and level in ("advanced", "expert"):
        assert mon.instruments, "the session ran its instruments"
    _compiles_cleanly()


@pytest.mark.parametrize("level", ["basic", "expert"])
def test_nothing_is_left_after_a_compiled_model_exits(tmp_path: Any, level: str) -> None:
    model = _net()
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    before = _state(model)
    with td.watch(compiled, opt, run=tmp_path, config={"level": level}) as mon:
        for _ in range(2):
            loss = nn.functional.mse_loss(compiled(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step()
    after = _state(model)
    assert {k: v for k, v in after.items() if before.get(k) != v} == {}
    _compiles_cleanly()


def test_an_exception_in_a_worker_forward_leaves_nothing(tmp_path: Any) -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    before = _state(model)
    cfg = {"level": "expert", "memory_every": 1}
    with (
        ThreadPoolExecutor(1) as pool,
        pytest.raises(RuntimeError, match="boom"),
        td.watch(model, opt, run=tmp_path, config=cfg),
    ):
        pool.submit(model, torch.randn(2, 4)).result()
        raise RuntimeError("boom")
    assert {k: v for k, v in _state(model).items() if before.get(k) != v} == {}
    assert threading.active_count() >= 1

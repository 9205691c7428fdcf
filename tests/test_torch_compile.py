"""``model.compile()`` in place and ``torch.compile(model)`` under watch.

The graphs are counted with a backend that records each graph Dynamo hands it and runs it as is
(the same graphs and breaks as ``backend="eager"``, no codegen: a few seconds on CPU).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from torch import nn

import torchdebug as td
from tests.fixtures import models as fx
from tests.fixtures.dynamo import counting_backend, fresh_dynamo  # noqa: F401 (fresh_dynamo: autouse)
from tests.fixtures.models import origin_line


def _train(model: nn.Module, watched: bool, steps: int = 3, **watch_kw: object) -> td.Monitor | None:
    torch.manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx = td.watch(model, opt, **watch_kw) if watched else contextlib.nullcontext()  # type: ignore[arg-type]
    with ctx as mon:
        for _ in range(steps):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if mon is not None:
                mon.step()
    return mon


@pytest.mark.parametrize("level", ["basic", "intermediate"])
def test_model_compile_in_place_makes_the_same_graphs_under_watch(level: str) -> None:
    from torch._dynamo.utils import counters

    def graphs(watched: bool) -> tuple[list[int], int]:
        torch._dynamo.reset()
        counters.clear()
        seen: list[int] = []
        torch.manual_seed(0)
        model = fx.MLP()
        model.compile(backend=counting_backend(seen))
        _train(model, watched, run=False, config=td.DebugConfig(level=level))
        return seen, sum(counters["graph_break"].values())

    plain, watched = graphs(False), graphs(True)
    assert plain == ([9], 0)  # one graph: x, 4 params, linear, relu, linear, output
    assert watched == plain


@pytest.mark.parametrize("level", ["advanced", "expert"])
def test_deep_levels_leave_a_compiled_model_one_graph(level: str) -> None:
    # per-module instruments stand down for a compiled model: their hooks see nothing inside it, and
    # adding or removing them per step made Dynamo recompile (4 graphs in 4 steps at expert before)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    seen: list[int] = []
    torch.manual_seed(0)
    model = fx.MLP()
    model.compile(backend=counting_backend(seen))
    mon = _train(model, True, steps=12, run=False, config=td.DebugConfig(level=level))
    assert (seen, sum(counters["graph_break"].values())) == ([9], 0)
    assert mon is not None
    said = sorted((e.kind, e.step) for e in mon.events if e.kind.endswith(("_not_measured", "_not_counted")))
    expected = [("flops_not_counted", 0), ("module_memory_not_measured", 0)]
    if level == "expert":
        expected.append(("module_time_not_measured", 1))  # it measures steps 1-3 (step 0 is warm-up)
    assert said == sorted(expected)


def test_flop_counting_leaves_a_compiled_model_compiled() -> None:
    # counting the first step runs it under a dispatch mode, and a frame Dynamo first meets under one
    # is skipped for good: before the fix the model ran uncompiled for the whole run ([] graphs)
    from torch._dynamo.utils import counters

    def graphs(watched: bool) -> tuple[list[int], int, td.Monitor | None]:
        torch._dynamo.reset()
        counters.clear()
        seen: list[int] = []
        torch.manual_seed(0)
        model = fx.MLP()
        model.compile(backend=counting_backend(seen))
        mon = _train(model, watched, steps=4, run=False, config=td.DebugConfig(flops=True))
        return seen, sum(counters["graph_break"].values()), mon

    plain, watched = graphs(False), graphs(True)
    assert watched[:2] == plain[:2] == ([9], 0)
    mon = watched[2]
    assert mon is not None
    assert [(e.kind, e.step, e.severity) for e in mon.events if e.kind.startswith("flops")] == [
        ("flops_not_counted", 0, "info")
    ]


def test_model_compile_hooks_are_restored_and_the_copy_is_clean() -> None:
    model = fx.MLP()
    model.compile(backend="eager")
    impl = model._compiled_call_impl
    with td.watch(model, run=False):
        assert model._compiled_call_impl is not impl  # the root capture runs around the compiled call
    assert model._compiled_call_impl is impl
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


@pytest.mark.parametrize("how", ["in_place", "wrapper"])
def test_nan_under_a_compiled_model_is_caught_and_located(how: str) -> None:
    torch.manual_seed(0)
    model = fx.DeepLogNet()
    model.blocks[1].act.shift = -5.0  # log of a negative number in blocks.1.act from step 0
    if how == "in_place":
        model.compile(backend="aot_eager")
        watched: nn.Module = model
    else:
        watched = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(td.NonFiniteError) as ei, td.watch(watched, opt, run=False) as mon:
        for _ in range(2):
            loss = watched(torch.randn(6, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step()
    a = ei.value.anomaly
    assert (a.step, a.phase, a.module, a.op) == (0, "forward", "blocks.1.act", "aten.log")
    assert a.location == origin_line("log")
    assert all(torch.isfinite(p).all() for p in model.parameters())
    if how == "in_place":
        assert model._compiled_call_impl is not None  # the replay's eager bypass was undone


def test_torch_compile_wrapper_names_carry_no_orig_mod_prefix(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = fx.MLP()
    compiled = torch.compile(model, backend="eager")
    mon = _train(compiled, True, steps=2, run=tmp_path)
    assert mon is not None
    assert mon.param_names == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert sorted(mon.names.values()) == ["", "fc1", "fc2"]
    with td.open_run(mon.run_dir) as run:
        stored = run.metric_names() + [s["name"] for s in run.tensor_stats()]
    assert stored and not [n for n in stored if "_orig_mod" in n]
    assert any("fc1.weight" in n for n in stored)  # per-parameter metrics are named plainly


@pytest.mark.parametrize("compiled_first", [False, True], ids=["never-run", "compiled-and-run"])
def test_locate_nonfinite_on_a_torch_compiled_model(compiled_first: bool) -> None:
    # DeepLogNet is not Sized: a truth test of its compiled wrapper calls __len__ and raised TypeError
    torch.manual_seed(0)
    model = fx.DeepLogNet()
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(6, 8)
    if compiled_first:
        compiled(x).pow(2).mean().backward()  # a compiled graph exists before the fault
        model.zero_grad()
    model.blocks[1].act.shift = -5.0

    def step() -> torch.Tensor:
        loss = compiled(x).pow(2).mean()
        loss.backward()
        return loss

    a = td.locate_nonfinite(step, model=compiled)
    assert a is not None
    # traced eagerly and named as in the original model (no "_orig_mod." prefix)
    assert (a.phase, a.module, a.op, a.kind) == ("forward", "blocks.1.act", "aten.log", "nan"), str(a)
    assert a.location == origin_line("log")
    assert not [f for f in a.frames if "_orig_mod" in f.module]
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())

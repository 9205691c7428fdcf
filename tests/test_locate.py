"""locate_nonfinite and the watch sentinel on a fault-injection suite with known origins."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

import torchdebug as td
from tests.fixtures import models as fx
from tests.fixtures.models import origin_line


@dataclass
class Case:
    """A model, a way to break it, and the exact expected origin."""

    build: Callable[[], nn.Module]
    inputs: Callable[[], tuple]
    breaker: Callable[[nn.Module], None] | None  # None: broken from the start
    phase: str
    module: str
    op: str | None
    tag: str | None  # ORIGIN tag of the expected line; None: no line (input / parameter)
    kind: str
    loss: Callable[[Any, tuple], torch.Tensor] = lambda out, inp: (
        (out if isinstance(out, torch.Tensor) else out["aux"]).float().pow(2).mean()
    )
    hint: str = ""


def _x(*shape: int) -> Callable[[], tuple]:
    return lambda: (torch.randn(*shape),)


def _break_log(m: nn.Module) -> None:
    m.blocks[1].act.shift = -5.0  # relu(x) - 5 < 0 somewhere


def _nan_param(m: nn.Module) -> None:
    with torch.no_grad():
        m.fc2.weight[0, 0] = float("nan")


def _dict_loss(out: Any, inp: tuple) -> torch.Tensor:
    return out["logits"].sum() + out["aux"].sum()


def _dc_loss(out: Any, inp: tuple) -> torch.Tensor:
    return out.logits.sum() + out.aux.sum()


CASES: dict[str, Case] = {
    "forward-log-nested": Case(
        lambda: fx.DeepLogNet(),
        _x(6, 8),
        _break_log,
        "forward",
        "blocks.1.act",
        "aten.log",
        "log",
        "nan",
        hint="log of negative input",
    ),
    "forward-0/0": Case(
        lambda: fx.ZeroDivNet(),
        lambda: (torch.zeros(3, 4),),
        None,
        "forward",
        "",
        "aten.div",
        "div",
        "nan",
        hint="0/0",
    ),
    "backward-sqrt-at-0": Case(
        lambda: fx.SqrtNet(),
        _x(3, 4),
        None,
        "backward",
        "norm",
        "SqrtBackward0",
        "sqrt",
        "nan",
        hint="sqrt at 0 in backward",
    ),
    "input-nan": Case(
        lambda: fx.MLP(),
        lambda: (torch.tensor([[float("nan")] + [0.0] * 7]),),
        None,
        "input",
        "",
        None,
        None,
        "nan",
    ),
    "parameter-nan": Case(lambda: fx.MLP(), _x(2, 8), _nan_param, "parameter", "fc2", None, None, "nan"),
    "shared-module-second-call": Case(
        lambda: fx.SharedNet(),
        _x(3, 4),
        None,
        "forward",
        "proj",
        "aten.sqrt",
        "shared",
        "nan",
        hint="sqrt of negative input",
    ),
    "inplace-op": Case(lambda: fx.InplaceNet(), _x(3, 4), None, "forward", "", "aten.log_", "inplace", "nan"),
    "custom-autograd-function": Case(
        lambda: fx.CustomFnNet(), _x(3, 4), None, "backward", "", "BadGradBackward", "customfn", "inf"
    ),
    "checkpoint-nonreentrant-backward": Case(
        lambda: fx.CheckpointNet(False), _x(3, 4), None, "backward", "inner", "SqrtBackward0", "sqrt", "nan"
    ),
    "checkpoint-reentrant-backward": Case(
        lambda: fx.CheckpointNet(True), _x(3, 4), None, "backward", "inner", "SqrtBackward0", "sqrt", "nan"
    ),
    "checkpoint-reentrant-forward": Case(
        lambda: fx.CheckpointLogNet(True), _x(3, 4), None, "forward", "inner", "aten.log", "cklog", "nan"
    ),
    "checkpoint-nonreentrant-forward": Case(
        lambda: fx.CheckpointLogNet(False), _x(3, 4), None, "forward", "inner", "aten.log", "cklog", "nan"
    ),
    "dict-output": Case(
        lambda: fx.DictOutNet(),
        _x(3, 4),
        None,
        "forward",
        "",
        "aten.acos",
        "acos",
        "nan",
        loss=_dict_loss,
        hint="acos of input outside [-1, 1]",
    ),
    "dataclass-output": Case(
        lambda: fx.DictOutNet(as_dataclass=True),
        _x(3, 4),
        None,
        "forward",
        "",
        "aten.acos",
        "acos",
        "nan",
        loss=_dc_loss,
    ),
    "int-and-bool-inputs": Case(
        lambda: fx.EmbedNet(),
        lambda: (torch.tensor([[1, 2, 3]]), torch.tensor([[True, False, True]])),
        None,
        "forward",
        "",
        "aten.rsqrt",
        "rsqrt",
        "nan",
    ),
}


# sqrt cases: the loss is out**2, so the gradient reaching sqrt(0) is 2*0/n = 0 and its backward
# computes 0 / (2*sqrt(0)) = 0/0 = NaN.


def _expected_location(tag: str | None) -> str | None:
    return origin_line(tag) if tag else None


def _check(a: td.Anomaly | None, case: Case) -> None:
    assert a is not None, "no anomaly found"
    assert (a.phase, a.module, a.op, a.kind) == (case.phase, case.module, case.op, case.kind), str(a)
    assert a.location == _expected_location(case.tag), str(a)
    if case.hint:
        assert case.hint in a.hint, a.hint


@pytest.mark.parametrize("name", list(CASES))
def test_locate_names_the_origin(name: str) -> None:
    torch.manual_seed(0)
    case = CASES[name]
    model = case.build()
    if case.breaker:
        case.breaker(model)
    inp = case.inputs()

    def step(*batch: torch.Tensor) -> torch.Tensor:
        loss = case.loss(model(*batch), batch)
        loss.backward()
        return loss

    a = td.locate_nonfinite(step, *inp, model=model)
    _check(a, case)
    assert a.step is None and a.detected_by == "locate"


def test_handwritten_loss_outside_any_module() -> None:
    torch.manual_seed(0)
    model = fx.MLP()
    x = torch.randn(4, 8)
    a = td.locate_nonfinite(lambda: fx.handwritten_loss(model(x)).backward(), model=model)
    assert a is not None
    assert (a.phase, a.module, a.op, a.location) == ("forward", "", "aten.log", origin_line("loss"))
    assert a.hint.startswith("log of negative input (min ")


def test_backward_of_handwritten_loss() -> None:
    torch.manual_seed(0)
    model = fx.MLP()
    x = torch.randn(4, 8)
    a = td.locate_nonfinite(lambda: fx.distance_loss(model(x)).backward(), model=model)
    assert a is not None
    assert (a.phase, a.module, a.op, a.location) == ("backward", "", "SqrtBackward0", origin_line("lossbwd"))


def test_float16_overflow_under_autocast_is_named() -> None:
    model = fx.Half()
    x = torch.full((2, 4), 100.0)  # 4 * 100 * 300 = 120000 > 65504

    def step() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().mean()
        loss.backward()
        return loss

    a = td.locate_nonfinite(step, model=model)
    assert a is not None
    assert (a.phase, a.module, a.op, a.kind, a.location) == (
        "forward",
        "big",
        "aten.addmm",
        "inf",
        origin_line("f16"),
    )
    assert a.hint == (
        "float16 max is 65504: addmm overflowed (inputs up to 300); use bfloat16, scale down, "
        "or compute it in float32"
    )


def test_optimizer_update_that_makes_nan() -> None:
    # Adam with eps=0 on a parameter whose gradient is exactly zero: m/(sqrt(v)+0) = 0/0
    model = fx.MLP()
    with torch.no_grad():
        model.fc1.weight.zero_()
    model.fc1.weight.requires_grad_(True)
    opt = torch.optim.Adam(model.parameters(), lr=0.1, eps=0.0)
    x = torch.randn(4, 8)

    def step() -> None:
        opt.zero_grad()
        model.fc1.weight.register_hook(lambda g: torch.zeros_like(g))
        model(x).sum().backward()
        opt.step()

    a = td.locate_nonfinite(step, model=model, optimizer=opt)
    assert a is not None
    assert (a.phase, a.kind, a.parameter, a.module) == ("optimizer", "nan", "fc1.weight", "fc1")


def test_fully_masked_softmax_names_the_mask_as_related() -> None:
    def step() -> torch.Tensor:
        s = torch.randn(2, 3, 3, requires_grad=True)
        all_masked = torch.ones(3, 3, dtype=torch.bool)
        return s.masked_fill(all_masked, float("-inf")).softmax(-1).sum()

    a = td.locate_nonfinite(step)
    assert a is not None
    assert (a.op, a.kind) == ("aten._softmax", "nan")
    assert a.related is not None and a.related.op == "aten.masked_fill"
    assert a.hint == "softmax over a row whose entries are all -inf (a fully masked row)"


def test_healthy_step_returns_none_and_leaves_no_modes() -> None:
    torch.manual_seed(0)
    model = fx.TinyGPT()
    idx = torch.randint(0, 16, (2, 6))
    assert td.locate_nonfinite(lambda: model(idx).logsumexp(-1).mean().backward(), model=model) is None
    assert torch._C._len_torch_function_stack() == 0
    assert not model._forward_hooks and not model.blocks[0]._forward_pre_hooks


def test_locate_rejects_bad_arguments() -> None:
    with pytest.raises(TypeError, match="fn must be callable"):
        td.locate_nonfinite(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"model= must be a torch\.nn\.Module"):
        td.locate_nonfinite(lambda: None, model="m")  # type: ignore[arg-type]


def test_error_in_fn_without_nonfinite_propagates_and_cleans_up() -> None:
    model = fx.MLP()

    def boom() -> None:
        model(torch.randn(2, 8))
        raise KeyError("user bug")

    with pytest.raises(KeyError, match="user bug"):
        td.locate_nonfinite(boom, model=model)
    assert torch._C._len_torch_function_stack() == 0
    assert not model.fc1._forward_pre_hooks


def test_anomaly_report_and_json() -> None:
    case = CASES["forward-log-nested"]
    model = case.build()
    case.breaker(model)  # type: ignore[misc]
    x = torch.randn(6, 8)
    a = td.locate_nonfinite(lambda: model(x).sum().backward(), model=model)
    assert a is not None
    text = str(a)
    assert (
        text.splitlines()[0]
        == f"torchdebug: nan born in forward of blocks.1.act (LogAct): aten.log at {origin_line('log')}"
    )
    assert "last module calls before it:" in text
    assert [f.module for f in a.frames][-2:] == ["blocks.0", "blocks.1.fc"]
    import json

    d = json.loads(json.dumps(a.to_dict()))
    assert d["module"] == "blocks.1.act" and d["tensor"]["nan_count"] > 0


def test_a_taint_ends_with_its_storage_so_a_reused_address_inherits_no_origin() -> None:
    # the allocator may place a new tensor at the address of a freed one; a tensor made there by code
    # the trace does not see (the autograd engine's gradient accumulation) must not carry the old origin
    from torchdebug.nonfinite.locate import _storage_key, _Taints

    taints = _Taints()
    t = torch.full((8,), float("nan"))
    key = _storage_key(t)
    origin = object()
    taints.put(t, key, origin)  # type: ignore[arg-type]
    view = t[2:]  # a view keeps the storage, and its taint, alive
    del t
    assert key in taints and taints.get(key) is origin and taints.values() == [origin]
    del view  # the storage is freed: the entry is void
    assert key not in taints and taints.get(key) is None and taints.values() == []

"""Whose fault a NaN is: the model, the compiler, a kernel backend, or unknown (``Anomaly.cause``).

The compiler's fault is Inductor's CPU relu lowering made wrong on purpose
(``cpp.inject_relu_bug_TESTING_ONLY = "accuracy"``: relu(x) compiles to x + 1), a deterministic
compile-only NaN; a kernel backend's fault is the CPU flash-attention kernel replaced by one that
returns NaN. Compiles are counted and asserted (each Inductor compile costs seconds on a CPU).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import torchdebug as td
from tests.fixtures import cause_models as cm
from tests.fixtures.dynamo import fresh_dynamo  # noqa: F401  (autouse: a fresh Dynamo per test)

with warnings.catch_warnings():  # Inductor's own import warns about torch.jit (torch's, not ours)
    warnings.simplefilter("ignore", DeprecationWarning)
    import torch._inductor.compile_fx

SENTINEL_ONLY = {"mode": "anomaly_detection", "store": False, "announce": False}


def _train(model: nn.Module, called: Any = None, steps: int = 1, **config: Any) -> td.Anomaly:
    """Steps of SGD on a fixed batch under watch(policy="warn"); the first anomaly."""
    torch.manual_seed(0)
    x, y = torch.randn(16, 4) * 5, torch.randn(16, 1)  # (B, 4): some fc1 outputs below -1
    called = called if called is not None else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        pytest.warns(td.TorchDebugWarning),
        td.watch(called, opt, policy="warn", config={**SENTINEL_ONLY, **config}) as mon,
    ):
        for _ in range(steps):
            loss = (called(x) - y).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step()
    return mon.anomalies[0]


@pytest.fixture
def relu_bug() -> Iterator[None]:
    import torch._inductor.config as inductor_config

    with inductor_config.patch({"cpp.inject_relu_bug_TESTING_ONLY": "accuracy"}):
        yield


# -- model -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_nan_the_eager_replay_makes_is_the_models(compiled: bool) -> None:
    torch.manual_seed(0)
    model = cm.LogNet()
    called = torch.compile(model, backend="eager") if compiled else model
    a = _train(model, called)
    assert (a.module, a.op, a.location) == ("", "aten.log", cm.origin_line("log"))
    c = a.cause
    assert c is not None and c.verdict == "model"
    assert c.replays == 1 and c.compiles == 0
    assert c.evidence == (
        "the eager replay of the step (same batch, weights, buffers and RNG) made the same nan in "
        f"forward of LogNet: aten.log at {cm.origin_line('log')}"
    )
    assert "  cause     model: the eager replay of the step" in str(a)
    d = json.loads(json.dumps(a.to_dict()))
    assert d["cause"]["verdict"] == "model" and d["cause"]["replays"] == 1


# -- kernel backend --------------------------------------------------------------------------------
def test_a_nan_only_one_sdpa_backend_makes_names_that_backend() -> None:
    torch.manual_seed(0)
    model = cm.AttnNet()
    x = torch.randn(2, 5, 8)  # (B, T, C)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        cm.bad_flash_kernel(),
        pytest.warns(td.TorchDebugWarning),
        td.watch(model, opt, policy="warn", config=SENTINEL_ONLY) as mon,
    ):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        mon.step()
    (a,) = mon.anomalies
    assert (a.op, a.location) == ("aten._scaled_dot_product_flash_attention_for_cpu", cm.origin_line("sdpa"))
    c = a.cause
    assert c is not None and c.verdict == "kernel_backend" and c.backend == "FLASH_ATTENTION"
    # the eager replay (flash: nan), then the step again with MATH (finite): two replays
    assert c.replays == 2 and c.compiles == 0
    assert c.evidence.startswith("finite with MATH, nan only with FLASH_ATTENTION")
    assert c.tried == ("eager replay of the step with FLASH_ATTENTION: nan", "MATH: finite")
    assert "sdpa_kernel" in a.hint


def test_a_nan_every_sdpa_backend_makes_stays_the_models() -> None:
    torch.manual_seed(0)
    model = cm.AttnNet()
    x = torch.randn(2, 5, 8)
    x[0, 0, 0] = float("nan")  # NaN in the batch: every kernel makes NaN from it
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(td.TorchDebugWarning), td.watch(model, opt, policy="warn", config=SENTINEL_ONLY) as mon:
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        mon.step()
    (a,) = mon.anomalies
    assert a.phase == "input" and a.cause is not None and a.cause.verdict == "model"


# -- unknown ---------------------------------------------------------------------------------------
def test_a_nan_nothing_reproduces_says_what_was_tried_and_never_hardware() -> None:
    torch.manual_seed(0)
    model = cm.SqrtReluNet()
    calls = 0

    def once(mod: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        nonlocal calls
        calls += 1
        return out * float("nan") if calls == 1 else None  # the step's forward only, not its replays

    handle = model.fc1.register_forward_hook(once)
    try:
        a = _train(model)
    finally:
        handle.remove()
    c = a.cause
    assert a.reproducible is False and c is not None and c.verdict == "unknown"
    assert c.tried == ("two eager replays of the step (same batch, weights, buffers and RNG): finite",)
    assert (c.replays, c.compiles) == (2, 0)
    assert "hardware" not in a.hint and "hardware" not in str(a)
    assert "Nothing tried reproduced it" in a.hint


# -- compiler --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_compile_only_nan_is_the_compilers_named_by_module_and_line(relu_bug: None) -> None:
    torch.manual_seed(0)
    model = cm.SqrtReluNet()
    a = _train(model, torch.compile(model))
    c = a.cause
    assert c is not None and c.verdict == "compiler"
    assert (a.module, a.module_type, a.location) == ("act", "ReluAct", cm.origin_line("relu"))
    assert (c.module, c.location) == ("act", cm.origin_line("relu"))
    # the user's compiled graph replayed from its cache (0 compiles); then fc1, act, fc2 alone
    # (finite), then the root (NaN): 4 compiles. Replays: 2 eager, 1 compiled.
    assert (c.compiles, c.replays) == (4, 3)
    assert (
        "compiled alone from the step's eager inputs, SqrtReluNet made NaN/Inf while its eager output"
        in c.evidence
    )
    assert "inside it, act (ReluAct)'s compiled output differs from eager" in c.evidence
    assert c.evidence.endswith("(4 compiles)")
    assert a.summary() == f"nan born in forward of act (ReluAct) at {cm.origin_line('relu')} (step 0)"
    assert "hardware" not in str(a)


@pytest.mark.slow
def test_bisect_mode_names_the_relu_lowering(relu_bug: None) -> None:
    torch.manual_seed(0)
    model = cm.SqrtReluNet()
    a = _train(model, torch.compile(model), compiler_bisect=True)
    c = a.cause
    assert c is not None and c.verdict == "compiler"
    assert c.backend == "inductor / lowerings / relu"
    assert c.compiles > 4


def test_cause_options_are_checked() -> None:
    with pytest.raises(td.ConfigError, match="cause_budget=0"):
        td.DebugConfig(cause_budget=0)
    with pytest.raises(td.ConfigError, match="compiler_bisect"):
        td.DebugConfig(compiler_bisect="yes")

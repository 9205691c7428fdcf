"""Whose fault a NaN is when the model runs inside compiled code the session cannot hook: a compiled
step function (``step_fn = torch.compile(train_step)``, given as ``watch(step_fn=...)``), and a compiler
bug that shows only in the backward.

The compiler's fault is Inductor's CPU relu lowering made wrong on purpose
(``cpp.inject_relu_bug_TESTING_ONLY = "accuracy"``: relu(x) compiles to x + 1). Compiles are counted
and asserted (each Inductor compile costs seconds on a CPU).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import torchdebug as td
from tests.fixtures import cause_models as cm
from tests.fixtures.dynamo import fresh_dynamo  # noqa: F401  (autouse: a fresh Dynamo per test)
from tests.fixtures.hf_quiet import quiet_args
from tests.fixtures.lightning_quiet import quiet_fit, quiet_trainer

with warnings.catch_warnings():  # Inductor's own import warns about torch.jit (torch's, not ours)
    warnings.simplefilter("ignore", DeprecationWarning)
    import torch._inductor.compile_fx

SENTINEL_ONLY = {"mode": "anomaly_detection", "store": False, "announce": False, "cause_budget": 3600.0}
# Dynamo reads .grad of the loss as it resumes after a graph break at loss.backward() (torch's warning,
# with or without torchdebug)
NON_LEAF = r"The \.grad attribute of a Tensor that is not a leaf Tensor"


@pytest.fixture
def relu_bug() -> Iterator[None]:
    import torch._inductor.config as inductor_config

    with inductor_config.patch({"cpp.inject_relu_bug_TESTING_ONLY": "accuracy"}):
        yield


def _step_fn(model: nn.Module, backward: bool, **compile_args: Any) -> Callable[..., Any]:
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = (model(x) - y).pow(2).mean()
        if backward:
            loss.backward()
        return loss

    return torch.compile(train_step, **compile_args)


def _train(
    model: nn.Module,
    step_fn: Callable[..., Any],
    backward: bool,
    given: bool = True,
    steps: int = 1,
    policy: str = "warn",
) -> td.Monitor:
    """Steps of SGD through ``step_fn`` on a fixed batch under watch()."""
    torch.manual_seed(0)
    x, y = torch.randn(16, 4) * 5, torch.randn(16, 1)  # (B, 4): some fc1 outputs below -1
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        warnings.catch_warnings(),
        td.watch(model, opt, policy=policy, step_fn=step_fn if given else None, config=SENTINEL_ONLY) as mon,
    ):
        warnings.filterwarnings("ignore", message=NON_LEAF)
        warnings.simplefilter("ignore", td.TorchDebugWarning)  # policy="warn" says it once
        for _ in range(steps):
            opt.zero_grad()
            loss = step_fn(x, y)
            if not backward:
                loss.backward()
            opt.step()
            mon.step()
    return mon


# -- a compiled step function ------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("backward", [False, True], ids=["forward-and-loss", "with-backward"])
def test_a_compiled_step_function_given_is_replayed_and_the_compiler_named(
    relu_bug: None, backward: bool
) -> None:
    torch.manual_seed(0)
    model = cm.SqrtReluNet()
    mon = _train(model, _step_fn(model, backward), backward)
    (a,) = mon.anomalies
    c = a.cause
    assert c is not None and c.verdict == "compiler"
    assert (a.phase, a.module, a.module_type, a.location) == (
        "forward",
        "act",
        "ReluAct",
        cm.origin_line("relu"),
    )
    assert (c.module, c.location) == ("act", cm.origin_line("relu"))
    # the step function replayed from Dynamo's cache (0 compiles); then fc1, act, fc2 alone (finite),
    # then the root (NaN): 4 compiles. Replays: 2 eager, 1 compiled.
    assert (c.compiles, c.replays) == (4, 3)
    assert c.evidence.startswith(
        "replayed through the compiled step function, the loss went non-finite; the eager replays were "
        "finite; compiled alone from the step's eager inputs, SqrtReluNet made NaN/Inf while its eager "
        "output is finite; inside it, act (ReluAct)'s compiled output differs from eager"
    )
    assert c.evidence.endswith("(4 compiles)")
    assert "hardware" not in str(a) and "model:" not in str(a)
    assert mon.sentinel.step_fn is not None and mon.sentinel.step_fn.calls == []  # let go at exit


def test_without_step_fn_nothing_is_replayed_and_the_cause_says_so() -> None:
    from torch._dynamo.utils import counters

    counters.clear()  # Dynamo counts the graphs of the whole process (not reset with its caches)
    torch.manual_seed(0)
    model = cm.LogNet()  # NaN eagerly too: only a replay could say whose
    mon = _train(model, _step_fn(model, False, backend="eager"), False, given=False)
    (a,) = mon.anomalies
    c = a.cause
    assert c is not None and c.verdict == "unknown" and a.reproducible is None
    assert (c.replays, c.compiles) == (0, 0)
    assert c.evidence == (
        "nothing was replayed: the step's forward was not captured (torchdebug's hooks do not run "
        "inside compiled code, and Dynamo compiled 1 graph in this process), so neither an eager replay "
        "nor one through the compiled code was tried"
    )
    assert a.hint.endswith(
        "pass that function as td.watch(..., step_fn=step_fn) to replay the step through it"
    )
    assert "hardware" not in str(a)


@pytest.mark.parametrize("backward", [False, True], ids=["forward-and-loss", "with-backward"])
def test_a_nan_the_eager_step_function_makes_is_the_models(backward: bool) -> None:
    torch.manual_seed(0)
    model = cm.LogNet()
    before = [p.detach().clone() for p in model.parameters()]
    mon = _train(model, _step_fn(model, backward, backend="eager"), backward, policy="skip")
    (a,) = mon.anomalies
    assert (a.module, a.op, a.location) == ("", "aten.log", cm.origin_line("log"))
    c = a.cause
    assert c is not None and c.verdict == "model" and a.reproducible is True
    assert (c.replays, c.compiles) == (1, 0)
    # the replays put back what each run of the step function changed, and the update was skipped
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_a_step_function_replay_that_fails_reports_the_symptom_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import torchdebug.nonfinite.replay as replay  # the rare path: the replay of a failing step

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("replay machinery broke")

    monkeypatch.setattr(replay, "replay_eager", broken)
    torch.manual_seed(0)
    model = cm.LogNet()
    step_fn = _step_fn(model, False, backend="eager")
    x, y = torch.randn(16, 4) * 5, torch.randn(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with td.watch(model, opt, policy="warn", step_fn=step_fn, config=SENTINEL_ONLY) as mon:
            opt.zero_grad()
            step_fn(x, y).backward()
            opt.step()
            mon.step()
    said = [str(w.message) for w in caught if "replay of the failing step failed" in str(w.message)]
    assert said == [
        "torchdebug: replay of the failing step failed (RuntimeError('replay machinery broke')); "
        "reporting the symptom only"
    ]
    (a,) = mon.anomalies
    assert a.reproducible is None and "the replay failed" in a.hint
    assert mon.counters["replays"] == 1 and mon.sentinel.replaying is False


def test_with_accumulation_the_failing_micro_steps_call_is_replayed() -> None:
    torch.manual_seed(0)
    model = cm.SqrtReluNet()
    step_fn = _step_fn(model, True, backend="eager")
    x0, x1, y = torch.randn(4, 4), torch.randn(4, 4), torch.randn(4, 1)
    x1[2, 0] = float("nan")  # the second micro-batch's row 2
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        warnings.catch_warnings(),
        td.watch(model, opt, policy="warn", step_fn=step_fn, config=SENTINEL_ONLY) as mon,
    ):
        warnings.filterwarnings("ignore", message=NON_LEAF)
        warnings.simplefilter("ignore", td.TorchDebugWarning)
        opt.zero_grad()
        step_fn(x0, y)
        step_fn(x1, y)
        opt.step()
        mon.step()
    (a,) = mon.anomalies
    # the second call's batch, replayed: its input row named (the first call's replay is finite)
    assert (a.phase, a.micro_step, a.reproducible) == ("input", 1, True)
    assert a.hint == (
        "the batch already holds NaN: input #0 (1 NaN, 0 +Inf, 0 -Inf) in row 2 (1 of 4 rows); check the "
        "data pipeline (those samples)"
    )
    assert a.cause is not None and a.cause.verdict == "model"


def test_the_step_functions_hook_comes_off_at_exit_also_on_an_exception() -> None:
    torch.manual_seed(0)
    model = cm.SqrtReluNet()
    step_fn = _step_fn(model, False, backend="eager")
    hooks = next(
        c.cell_contents.enter_exit_hooks
        for c in step_fn.__closure__  # type: ignore[attr-defined]
        if hasattr(c.cell_contents, "enter_exit_hooks")
    )
    before = list(hooks)
    with td.watch(model, step_fn=step_fn, config=SENTINEL_ONLY) as mon:
        assert len(hooks) == len(before) + 1
        step_fn(torch.randn(2, 4), torch.randn(2, 1)).backward()
        (call,) = mon.sentinel.step_fn.calls  # type: ignore[union-attr]
        assert call.step == 0 and [t.shape for t in call.cap.args] == [(2, 4), (2, 1)]
        mon.step()
    assert hooks == before
    with pytest.raises(KeyError), td.watch(model, step_fn=step_fn, config=SENTINEL_ONLY):
        raise KeyError("boom")
    assert hooks == before


def test_a_healthy_compiled_step_with_its_backward_inside_warns_nothing() -> None:
    # loss.backward() inside the compiled function is a graph break; torchdebug's backward wrapper runs
    # as plain Python after it (Dynamo never traces it: no graph break in it, no warning)
    torch.manual_seed(0)
    model = cm.SqrtReluNet()
    graphs: list[int] = []
    from tests.fixtures.dynamo import counting_backend

    mon = _train(model, _step_fn(model, True, backend=counting_backend(graphs)), True, steps=3)
    assert mon.anomalies == [] and mon.global_step == 3
    assert len(graphs) == 1  # the forward and loss; nothing of torchdebug's compiled


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(lambda: lambda x: x, id="plain-function"),
        pytest.param(lambda: torch.compile(nn.Linear(2, 2)), id="compiled-module"),
    ],
)
def test_step_fn_must_be_what_torch_compile_made_of_a_function(bad: Callable[[], Any]) -> None:
    with pytest.raises(td.ConfigError, match=r"step_fn= takes the function torch.compile returned"):
        td.watch(nn.Linear(2, 2), step_fn=bad(), config=SENTINEL_ONLY)


# -- a compiler bug in the backward only ---------------------------------------------------------------
@pytest.mark.slow
def test_a_compile_only_nan_in_the_backward_names_the_module(relu_bug: None) -> None:
    torch.manual_seed(0)
    model = cm.BackwardReluNet()
    called = torch.compile(model)
    torch.manual_seed(0)
    x, y = torch.randn(16, 4) * 5, torch.randn(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        warnings.catch_warnings(),
        td.watch(called, opt, policy="warn", config=SENTINEL_ONLY) as mon,
    ):
        warnings.simplefilter("ignore", td.TorchDebugWarning)
        # Dynamo's own, as it traces an autograd.Function (torch's, with or without torchdebug)
        warnings.filterwarnings(
            "ignore", message=r".*should not be instantiated", category=DeprecationWarning
        )
        loss = (called(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        mon.step()
    (a,) = mon.anomalies
    c = a.cause
    assert c is not None and c.verdict == "compiler"
    assert (a.phase, a.module, a.location) == ("backward", "act", cm.origin_line("gradrelu"))
    # the user's compiled graphs replayed from the cache (0 compiles); then fc1 alone, forward and
    # backward (finite), then act (its backward NaN): 2 compiles
    assert (c.compiles, c.replays) == (2, 3)
    assert c.evidence.startswith(
        "replayed through the compiled model, the gradients of fc1.weight, fc1.bias went non-finite; the "
        "eager replays were finite; compiled alone from the step's eager inputs and the gradient its output "
        "received, act (GradAct)'s backward made NaN/Inf while its eager gradients are finite"
    )


# -- the frameworks ------------------------------------------------------------------------------------
COMPILER_SAID = (
    "compiler: replayed through the compiled model, the loss went non-finite; the eager replays were "
    "finite; compiled alone from the step's eager inputs, {root} made NaN/Inf while its eager output is "
    "finite; inside it, {act} (ReluAct)'s compiled output differs from eager"
)


@pytest.mark.slow
def test_torchdebug_run_names_the_compiler(relu_bug: None, tmp_path: Any, capsys: Any) -> None:
    from torchdebug.cli import main

    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "from tests.fixtures.cause_models import SqrtReluNet\n"
        "torch.manual_seed(0)\n"
        "model = torch.compile(SqrtReluNet())\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "x, y = torch.randn(16, 4) * 5, torch.randn(16, 1)\n"
        "loss = (model(x) - y).pow(2).mean()\n"
        "opt.zero_grad()\n"
        "loss.backward()\n"
        "opt.step()\n"
    )
    assert main(["run", "--run-dir", str(tmp_path / "runs"), str(script)]) == 3  # found a NaN/Inf
    err = capsys.readouterr().err
    assert f"  module    act (ReluAct)\n  line      {cm.origin_line('relu')}\n" in err
    assert "  cause     " + COMPILER_SAID.format(root="SqrtReluNet", act="act") in err
    assert "hardware" not in err


def _lightning_fit(net: nn.Module, loader: Any, **cb_kw: Any) -> td.Monitor:
    L = pytest.importorskip("lightning.pytorch")
    from torchdebug.integrations.lightning import TorchDebugCallback

    class Lit(L.LightningModule):  # type: ignore[name-defined,misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return (self.net(x) - y).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    cb = TorchDebugCallback(run=False, policy="warn", config=SENTINEL_ONLY, **cb_kw)
    trainer = quiet_trainer([cb], max_steps=1)
    with quiet_fit(), warnings.catch_warnings():
        warnings.simplefilter("ignore", td.TorchDebugWarning)  # policy="warn" says it once
        trainer.fit(Lit(), loader)
    assert cb.monitor is not None
    return cb.monitor


def _batch() -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    x, y = torch.randn(16, 4) * 5, torch.randn(16, 1)
    return list(zip(x, y))


@pytest.mark.slow
def test_lightning_with_a_compiled_submodule_names_the_compiler(relu_bug: None) -> None:
    torch.manual_seed(0)
    net = torch.compile(cm.SqrtReluNet())
    mon = _lightning_fit(net, torch.utils.data.DataLoader(_batch(), batch_size=16))
    (a,) = mon.anomalies
    c = a.cause
    assert c is not None and c.verdict == "compiler"
    # named as in the LightningModule's named_modules(): the compile wrapper's _orig_mod
    assert (a.module, a.location) == ("net._orig_mod.act", cm.origin_line("relu"))
    assert (c.compiles, c.replays) == (4, 3)
    assert str(c).startswith(
        COMPILER_SAID.format(root="net._orig_mod (SqrtReluNet)", act="net._orig_mod.act")
    )


class _Regression(nn.Module):
    """A model the HF Trainer calls with the batch's keys, returning its loss."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": (self.net(x) - y).pow(2).mean()}


def _hf_train(tmp_path: Any, net: nn.Module, **args_kw: Any) -> td.Monitor:
    transformers = pytest.importorskip("transformers")
    from torchdebug.integrations.transformers import TorchDebugCallback

    cb = TorchDebugCallback(run=False, policy="warn", config=SENTINEL_ONLY)
    args = quiet_args(
        tmp_path / "out",
        per_device_train_batch_size=16,
        max_steps=1,
        learning_rate=0.1,
        seed=0,
        torch_compile=True,  # accelerate wraps the model in torch.compile after on_train_begin
        **args_kw,
    )
    data = [{"x": x, "y": y} for x, y in _batch()]
    trainer = transformers.Trainer(model=_Regression(net), args=args, train_dataset=data, callbacks=[cb])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.TorchDebugWarning)  # policy="warn" says it once, and the rules
        trainer.train()
    assert type(trainer.model_wrapped).__name__ == "OptimizedModule"
    assert cb.monitor is not None
    return cb.monitor


def test_hf_trainer_torch_compile_is_replayed_through_its_wrapper(tmp_path: Any) -> None:
    torch.manual_seed(0)
    mon = _hf_train(tmp_path, cm.LogNet(), torch_compile_backend="eager")
    (a,) = mon.anomalies
    assert (a.module, a.op, a.location) == ("net", "aten.log", cm.origin_line("log"))
    assert a.cause is not None and a.cause.verdict == "model" and a.reproducible is True


@pytest.mark.slow
def test_hf_trainer_torch_compile_names_the_compiler(relu_bug: None, tmp_path: Any) -> None:
    torch.manual_seed(0)
    mon = _hf_train(tmp_path, cm.SqrtReluNet())
    (a,) = mon.anomalies
    c = a.cause
    assert c is not None and c.verdict == "compiler"
    assert (a.module, a.location) == ("net.act", cm.origin_line("relu"))
    assert (c.compiles, c.replays) == (4, 3)
    assert str(c).startswith(COMPILER_SAID.format(root="net (SqrtReluNet)", act="net.act"))

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
from tests.fixtures.lightning_quiet import quiet_fit, quiet_trainer

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
    a = _train(model, torch.compile(model), cause_budget=3600.0)  # never cut short on a loaded machine
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
    assert a.summary() == f"nan from compiled act (ReluAct) at {cm.origin_line('relu')} (step 0)"
    assert "hardware" not in str(a)


@pytest.mark.slow
def test_bisect_mode_names_the_relu_lowering(relu_bug: None) -> None:
    torch.manual_seed(0)
    model = cm.SqrtReluNet()
    a = _train(model, torch.compile(model), compiler_bisect=True, cause_budget=3600.0)
    c = a.cause
    assert c is not None and c.verdict == "compiler"
    assert c.backend == "inductor / lowerings / relu"
    # 4 to localise (see above), then 18 for the bisector on SqrtReluNet: 5 backends, 9 inductor
    # subsystems, the upper bound and 3 halvings of the lowerings' range [0, 6]
    assert c.compiles == 22 and c.evidence.endswith(
        "CompilerBisector: inductor / lowerings / relu (22 compiles)"
    )


def test_cause_options_are_checked() -> None:
    with pytest.raises(td.ConfigError, match="cause_budget=0"):
        td.DebugConfig(cause_budget=0)
    with pytest.raises(td.ConfigError, match="compiler_bisect"):
        td.DebugConfig(compiler_bisect="yes")


# -- a framework, and every view of the run --------------------------------------------------------
def test_lightning_run_names_the_kernel_and_every_view_shows_it(tmp_path: Any, capsys: Any) -> None:
    L = pytest.importorskip("lightning.pytorch")
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from torchdebug.integrations.lightning import TorchDebugCallback
    from torchdebug.sinks._records import run_records
    from torchdebug.store import open_run
    from torchdebug.views.report import build_report, collect_views, render_page, render_text
    from torchdebug.views.server import serve

    class Lit(L.LightningModule):  # type: ignore[name-defined,misc]
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = cm.AttnNet()

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.net(batch).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    cb = TorchDebugCallback(run=tmp_path, policy="warn")
    trainer = quiet_trainer([cb], max_steps=1)
    loader = torch.utils.data.DataLoader([torch.randn(5, 8) for _ in range(2)], batch_size=2)  # (2, 5, 8)
    with cm.bad_flash_kernel(), quiet_fit(), warnings.catch_warnings():
        warnings.simplefilter("ignore", td.TorchDebugWarning)  # policy="warn" says it once
        trainer.fit(Lit(), loader)
    (a,) = cb.monitor.anomalies
    assert (
        a.cause is not None and a.cause.verdict == "kernel_backend" and a.cause.backend == "FLASH_ATTENTION"
    )
    said = "kernel_backend: finite with MATH, nan only with FLASH_ATTENTION"
    run_dir = cb.monitor.run_dir
    from torchdebug.cli import main

    assert main(["show", str(run_dir)]) == 0
    assert f"    cause {said}" in capsys.readouterr().out
    with open_run(run_dir) as run:
        report = build_report(run)
        html = render_page(collect_views(run))
        (doc,) = run.anomalies()
        tracked = [r.text() for r in run_records(run) if getattr(r, "kind", None) == "anomaly"]
    assert doc["cause"]["verdict"] == "kernel_backend" and doc["cause"]["replays"] == 2
    assert f"      cause     {said}" in render_text(report)
    assert f"<dt>cause</dt><dd>{said}" in html
    assert len(tracked) == 1 and f"  cause     {said}" in tracked[0]  # what the trackers receive
    with serve(run_dir.parent, port=0) as h:
        page = httpx.get(f"{h.url}/runs/{doc.get('run_id') or run_dir.name}", timeout=30).text
    assert f"<dt>cause</dt><dd>{said}" in page


@pytest.mark.slow
def test_a_compiled_submodule_is_found_and_named_as_in_named_modules(relu_bug: None) -> None:
    torch.manual_seed(0)

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.compile(cm.SqrtReluNet())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    model = Outer()
    a = _train(model, cause_budget=3600.0)
    c = a.cause
    assert c is not None and c.verdict == "compiler"
    assert (c.module, c.location) == ("inner._orig_mod.act", cm.origin_line("relu"))
    # fc1, act, fc2 alone, then inner._orig_mod (NaN): 4 compiles (the wrapper is its twin, not tried)
    assert (c.compiles, c.replays) == (4, 3)


def test_torchdebug_run_names_the_kernel(tmp_path: Any, capsys: Any) -> None:
    from torchdebug.cli import main

    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "from tests.fixtures.cause_models import AttnNet, bad_flash_kernel\n"
        "torch.manual_seed(0)\n"
        "model = AttnNet()\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "with bad_flash_kernel():\n"
        "    loss = model(torch.randn(2, 5, 8)).pow(2).mean()\n"
        "    opt.zero_grad()\n"
        "    loss.backward()\n"
        "    opt.step()\n"
    )
    assert main(["run", "--run-dir", str(tmp_path / "runs"), str(script)]) == 3  # found a NaN/Inf
    err = capsys.readouterr().err
    assert "cause     kernel_backend: finite with MATH, nan only with FLASH_ATTENTION" in err

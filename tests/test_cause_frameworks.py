"""Whose fault a NaN is when a framework owns the loop, on one process: the ``model``, a
``kernel_backend`` and ``unknown`` verdicts under Lightning, the HF Trainer and ``torchdebug run``
(the ``compiler`` verdict there: tests/test_cause_compiled.py; ``hardware``, which needs ranks:
tests/test_cause_ranks_frameworks.py; Lightning's ``kernel_backend`` with every view of the run:
tests/test_cause.py).

Each framework hands the session the micro-step its own way (Lightning's ``training_step`` calling a
submodule, HF's ``compute_loss`` calling the model with the batch's keys, a script's first optimizer);
the replay and the verdict are the session's. The faults: ``log`` of a negative linear output (the
model's own), the CPU flash-attention kernel returning NaN (``cause_models.bad_flash_kernel``), and a
forward hook that makes ``fc1``'s output NaN in the first forward only (a one-off fault, not
reproducible)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import torchdebug as td
from tests.fixtures import cause_models as cm
from tests.fixtures.hf_quiet import quiet_args
from torchdebug.nonfinite.cause import EAGER_TRIED

SENTINEL_ONLY = {"mode": "anomaly_detection", "store": False, "announce": False}


@contextlib.contextmanager
def _one_off(net: nn.Module) -> Iterator[None]:
    """``net.fc1``'s output NaN in its first call only: the step's forward, not its replays."""
    calls = 0

    def once(mod: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        nonlocal calls
        calls += 1
        return out * float("nan") if calls == 1 else None

    handle = net.fc1.register_forward_hook(once)
    try:
        yield
    finally:
        handle.remove()


def _case(outcome: str) -> tuple[nn.Module, list[torch.Tensor], Callable[[nn.Module], Any]]:
    """(the net, its samples, the fault's context) for an outcome."""
    torch.manual_seed(0)
    if outcome == "kernel_backend":
        return cm.AttnNet(), list(torch.randn(2, 5, 8)), lambda net: cm.bad_flash_kernel()  # (T, C) each
    xs = list(torch.randn(16, 4) * 5)  # some rows give a negative fc output (log) / fc1 outputs below -1
    if outcome == "model":
        return cm.LogNet(), xs, lambda net: contextlib.nullcontext()
    return cm.SqrtReluNet(), xs, _one_off


def _lightning(net: nn.Module, xs: list[torch.Tensor]) -> td.Monitor:
    L = pytest.importorskip("lightning.pytorch")
    from tests.fixtures.lightning_quiet import quiet_fit, quiet_trainer
    from torchdebug.integrations.lightning import TorchDebugCallback

    class Lit(L.LightningModule):  # type: ignore[name-defined,misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.net(batch).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    cb = TorchDebugCallback(run=False, policy="warn", config=SENTINEL_ONLY)
    with quiet_fit():
        quiet_trainer([cb], max_steps=1).fit(Lit(), torch.utils.data.DataLoader(xs, batch_size=len(xs)))
    assert cb.monitor is not None
    return cb.monitor


class _Squared(nn.Module):
    """What the HF Trainer calls with the batch's keys, returning its loss."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.net(x).pow(2).mean()}


def _hf(net: nn.Module, xs: list[torch.Tensor], tmp_path: Any) -> td.Monitor:
    transformers = pytest.importorskip("transformers")
    from torchdebug.integrations.transformers import TorchDebugCallback

    cb = TorchDebugCallback(run=False, policy="warn", config=SENTINEL_ONLY)
    args = quiet_args(
        tmp_path / "out",
        per_device_train_batch_size=len(xs),
        max_steps=1,
        learning_rate=0.1,
        seed=0,
    )
    data = [{"x": x} for x in xs]
    trainer = transformers.Trainer(model=_Squared(net), args=args, train_dataset=data, callbacks=[cb])
    trainer.train()
    assert cb.monitor is not None
    return cb.monitor


def _check(a: td.Anomaly, outcome: str, module: str) -> None:
    c = a.cause
    assert c is not None and c.verdict == outcome and c.compiles == 0
    assert "hardware" not in str(a)
    if outcome == "model":
        assert (a.module, a.op, a.location) == (module, "aten.log", cm.origin_line("log"))
        assert c.replays == 1  # the eager replay reproduced it
    elif outcome == "kernel_backend":
        assert (a.op, a.location) == (
            "aten._scaled_dot_product_flash_attention_for_cpu",
            cm.origin_line("sdpa"),
        )
        assert c.backend == "FLASH_ATTENTION"
        # the eager replay (flash: nan), then the step again with MATH (finite): two replays
        assert c.replays == 2
        assert c.tried == ("eager replay of the step with FLASH_ATTENTION: nan", "MATH: finite")
    else:
        assert a.reproducible is False and c.replays == 2 and c.tried == (EAGER_TRIED,)


@pytest.mark.parametrize("outcome", ["model", "unknown"])
def test_lightning_gives_the_verdict(outcome: str) -> None:
    net, xs, fault = _case(outcome)
    with fault(net), warnings.catch_warnings():
        warnings.simplefilter("ignore", td.TorchDebugWarning)  # policy="warn" says it once
        mon = _lightning(net, xs)
    (a,) = mon.anomalies
    _check(a, outcome, "net")  # named as in the LightningModule: training_step calls self.net


@pytest.mark.parametrize("outcome", ["model", "kernel_backend", "unknown"])
def test_hf_trainer_gives_the_verdict(outcome: str, tmp_path: Any) -> None:
    net, xs, fault = _case(outcome)
    with fault(net), warnings.catch_warnings():
        warnings.simplefilter("ignore", td.TorchDebugWarning)  # policy="warn", and the rules' events
        mon = _hf(net, xs, tmp_path)
    (a,) = mon.anomalies
    _check(a, outcome, "net")  # named as in the model the Trainer holds


SCRIPT = """\
import torch
from tests.test_cause_frameworks import _case

net, xs, fault = _case({outcome!r})
opt = torch.optim.SGD(net.parameters(), lr=0.1)
with fault(net):
    loss = net(torch.stack(xs)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


@pytest.mark.parametrize("outcome", ["model", "unknown"])
def test_torchdebug_run_gives_the_verdict(outcome: str, tmp_path: Any, capsys: Any) -> None:
    from torchdebug.cli import main

    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(outcome=outcome))
    assert main(["run", "--run-dir", str(tmp_path / "runs"), str(script)]) == 3  # found a NaN/Inf
    err = capsys.readouterr().err
    said = {
        "model": "model: the eager replay of the step (same batch, weights, buffers and RNG) made the same nan",
        "unknown": f"unknown: nothing tried reproduced it: {EAGER_TRIED}",
    }[outcome]
    assert f"  cause     {said}" in err
    assert "hardware" not in err

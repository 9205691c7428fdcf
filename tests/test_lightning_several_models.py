"""A GAN as a LightningModule with manual optimization and two optimizers, under ``TorchDebugCallback``.

The module's generator ``G`` and discriminator ``D`` (tests/fixtures/gan_script.py) are each a model of
the step, named as in the LightningModule; each optimizer's update is checked before it runs. Faults
are injected at batch ``BAD``: batch k is step k (one ``on_train_batch_end`` per batch).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

L = pytest.importorskip("lightning.pytorch")

import torchdebug as td  # noqa: E402
from tests.fixtures import gan_script  # noqa: E402
from tests.fixtures.gan_script import Discriminator, Generator  # noqa: E402
from tests.fixtures.lightning_quiet import quiet_fit, quiet_trainer  # noqa: E402
from tests.fixtures.models import origin_line  # noqa: E402
from torchdebug.integrations.lightning import TorchDebugCallback  # noqa: E402
from torchdebug.store import open_run  # noqa: E402

BAD = 2
LR_G, LR_D = 1e-3, 2e-3


class GAN(L.LightningModule):
    """Manual optimization, as Lightning's docs write a GAN. ``order="D first"``: D's update on real and
    fake, then G's through D (the DCGAN loop); ``"G first"`` with ``toggle_optimizer`` (Lightning's GAN
    tutorial: G's update, then D's on a fresh fake)."""

    def __init__(self, fault: str = "", order: str = "D first") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.G, self.D = Generator(), Discriminator()
        self.fault, self.order = fault, order
        self.automatic_optimization = False
        self.before: dict[str, torch.Tensor] = {}
        self.after: dict[str, torch.Tensor] = {}

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.named_parameters()}

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, z = batch
        opt_g, opt_d = self.optimizers()
        self.before = self.snapshot()
        if batch_idx == BAD:
            if self.fault == "D.forward":
                self.D[1].mode = "forward"
            elif self.fault == "G.backward":
                self.G.main[1].mode = "backward"
            elif self.fault == "D.update":  # D's Adam state goes bad: its update makes D.0 NaN
                opt_d.optimizer.state[self.D[0].weight]["exp_avg_sq"].fill_(-1.0)
        if self.order == "D first":
            fake = self.G(z)
            loss_d = -(torch.log(self.D(x)) + torch.log(1 - self.D(fake.detach()))).mean()
            opt_d.zero_grad()
            self.manual_backward(loss_d)
            opt_d.step()
            loss_g = -torch.log(self.D(fake)).mean()
            opt_g.zero_grad()
            self.manual_backward(loss_g)
            opt_g.step()
        else:
            self.toggle_optimizer(opt_g)
            loss_g = -torch.log(self.D(self.G(z))).mean()
            self.manual_backward(loss_g)
            opt_g.step()
            opt_g.zero_grad()
            self.untoggle_optimizer(opt_g)
            self.toggle_optimizer(opt_d)
            loss_d = -(torch.log(self.D(x)) + torch.log(1 - self.D(self.G(z).detach()))).mean()
            self.manual_backward(loss_d)
            opt_d.step()
            opt_d.zero_grad()
            self.untoggle_optimizer(opt_d)
        self.after = self.snapshot()

    def configure_optimizers(self) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        return torch.optim.Adam(self.G.parameters(), lr=LR_G), torch.optim.Adam(self.D.parameters(), lr=LR_D)


def fit(gan: GAN, cb: TorchDebugCallback, n: int = 4) -> None:
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(5, 6, generator=gen), torch.randn(5, 4, generator=gen)) for _ in range(n)]
    trainer = quiet_trainer([cb], devices=1, max_epochs=1)
    with quiet_fit():
        trainer.fit(gan, torch.utils.data.DataLoader(data, batch_size=None))


def assert_clean_exit() -> None:
    assert td.session.driver._ACTIVE == [] and td.session.driver._ORIGINALS == {}
    assert not getattr(torch.Tensor.backward, "__torchdebug_wrapper__", False)


CASES = [
    # fault, phase, module, op, origin tag (tests/fixtures/gan_script.py)
    ("D.forward", "forward", "D.1", "aten.sqrt", "fault_forward"),
    ("G.backward", "backward", "G.main.1", "SqrtBackward0", "fault_backward"),
    ("D.update", "optimizer", "D.0", "Adam.step", None),
]


@pytest.mark.parametrize("order", ["D first", "G first"])
@pytest.mark.parametrize(("fault", "phase", "module", "op", "tag"), CASES, ids=[c[0] for c in CASES])
def test_a_fault_in_either_model_is_named_with_its_model(
    tmp_path: Path, fault: str, phase: str, module: str, op: str, tag: str | None, order: str
) -> None:
    cb = TorchDebugCallback(run=tmp_path)
    with pytest.raises(td.NonFiniteError) as info:
        fit(GAN(fault, order), cb)
    a = info.value.anomaly
    assert (a.phase, a.module, a.op, a.step) == (phase, module, op, BAD), str(a)
    assert a.location == (origin_line(tag, gan_script.__file__) if tag else None), str(a)
    assert a.micro_step is None  # each update accumulates one backward: no micro-step to name
    if fault == "D.update":
        assert a.parameter == "D.0.weight"
    mon = cb.monitor
    assert mon.roots is not None and list(mon.roots) == ["G", "D"] and len(mon.anomalies) == 1
    # named before the step's next update, except D's update when it is the step's last: its parameter
    # probe is read with the next transfer, as step 3's G update starts (G's weights still finite)
    assert [r.step for r in mon.records] == (
        [0, 1, 2] if (fault, order) == ("D.update", "G first") else [0, 1]
    )
    if (fault, order) == ("D.update", "G first"):
        assert all(torch.isfinite(p).all() for p in mon.roots["G"].parameters())
    assert_clean_exit()


@pytest.mark.parametrize("order", ["D first", "G first"])
def test_a_clean_gan_warns_nothing_and_has_each_optimizers_numbers(tmp_path: Path, order: str) -> None:
    gan = GAN(order=order)
    cb = TorchDebugCallback(run=tmp_path, config=td.DebugConfig(mode="gradient_checking", detail_every=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning of ours on a healthy run is a failure
        fit(gan, cb, n=3)
    mon = cb.monitor
    assert mon.anomalies == [] and [e for e in mon.events if e.severity != "info"] == []
    assert [(r.step, r.micro_steps, r.skipped) for r in mon.records] == [
        (0, 2, False),
        (1, 2, False),
        (2, 2, False),
    ]
    assert mon.run_dir is not None and mon.run_dir.name.startswith("gan-")  # the LightningModule's name
    run = open_run(mon.run_dir)
    # one learning-rate series per optimizer, named after the model it steps
    assert run.series("lr/G/0").values == [LR_G] * 3 and run.series("lr/D/0").values == [LR_D] * 3
    assert not any(n.startswith("lr/opt") for n in run.metric_names())
    before, after = gan.before, gan.after  # the last training_step's (step 2, a detail step)
    for name in ("G.main.0.weight", "G.main.2.bias", "D.0.weight", "D.2.weight"):
        # |w_after - w_before| / |w_after| over the step: each weight is stepped by its own optimizer
        expected = (
            torch.linalg.vector_norm(after[name] - before[name]) / torch.linalg.vector_norm(after[name])
        ).item()
        series = run.series(f"update_ratio/{name}")
        assert series.steps == [0, 2]
        assert series.values[-1] == pytest.approx(expected, rel=1e-5) and expected > 0
    assert open_run(mon.run_dir).meta["status"] == "finished"
    assert_clean_exit()


def test_one_optimizer_keeps_the_lightning_module_as_the_model(tmp_path: Path) -> None:
    # a LightningModule with two children and one optimizer is one model, as before: its entry is found
    class One(GAN):
        def configure_optimizers(self) -> torch.optim.Optimizer:  # type: ignore[override]
            return torch.optim.Adam(self.parameters(), lr=LR_G)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
            _, z = batch
            opt = self.optimizers()
            loss = -torch.log(self.D(self.G(z))).mean()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()

    cb = TorchDebugCallback(run=False)
    fit(One(), cb, n=2)
    mon = cb.monitor
    assert mon.roots is None and isinstance(mon.model, One) and [r.step for r in mon.records] == [0, 1]
    assert mon.lr_names() == ["lr/0"]

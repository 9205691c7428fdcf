"""The framework callbacks forward torchdebug's findings to the framework's own loggers, no report_to.

The faulty run of tests/test_trackers.py (gradient explosion at step 8, a NaN born in ``act`` at
step 10, ``policy="warn"``) under Lightning with a CSVLogger and a TensorBoardLogger, and under the
Hugging Face Trainer with ``report_to=["tensorboard"]``; read back with csv / yaml and EventAccumulator.
"""

from __future__ import annotations

import csv
import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.fixtures import health_models as hm
from tests.fixtures.hf_quiet import quiet_args
from tests.fixtures.lightning_quiet import quiet_fit, quiet_trainer
from tests.fixtures.models import origin_line
from tests.test_trackers import CFG, EXPLODE_AT, NAN_AT, STEPS, FaultyNet, finished_verdict
from torchdebug.store import open_run


def _events(logdir: Path) -> EventAccumulator:
    ea = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    return ea


def _texts(ea: EventAccumulator, tag: str) -> dict[int, str]:
    return {e.step: e.tensor_proto.string_val[0].decode() for e in ea.Tensors(f"{tag}/text_summary")}


def _same32(a: float, b: float) -> bool:
    b32 = float(np.float32(b))
    return (math.isnan(a) and math.isnan(b32)) or a == b32


def _check_block(text: str, headline: str) -> None:
    assert f"torchdebug: {headline}\n" in text
    for row in (
        "phase     forward",
        "module    net.act (LogAct)",
        "op        aten.log",
        f"line      {origin_line('log')}",
    ):
        assert row in text


# -- Lightning -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_lightning_loggers_get_scalars_findings_and_the_verdict(tmp_path: Path) -> None:
    L = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    from torchdebug.integrations.lightning import TorchDebugCallback

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = FaultyNet()

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            self.net.fault = batch_idx == EXPLODE_AT
            self.net.act.shift = -10.0 if batch_idx == NAN_AT else 1.0

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    cb = TorchDebugCallback(config=CFG, run=tmp_path / "runs")
    csv_logger = CSVLogger(tmp_path / "csv", name="", version=0)
    tb_logger = TensorBoardLogger(tmp_path / "tb", name="", version=0, default_hp_metric=False)
    trainer = quiet_trainer([cb], max_epochs=1, logger=[csv_logger, tb_logger], log_every_n_steps=2)
    with quiet_fit(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module="torchdebug")  # the run's own findings
        warnings.filterwarnings("ignore", message="torchdebug", category=Warning)
        trainer.fit(Lit(), torch.utils.data.DataLoader(list(hm.batches(STEPS)), batch_size=None))

    mon = cb.monitor
    assert mon is not None and mon.closed
    run = open_run(mon.run_dir)
    headline = run.anomalies()[0]["summary"]
    loss = dict(zip(run.series("loss").steps, run.series("loss").values))
    logged = [s for s in range(STEPS) if (s + 1) % 2 == 0]  # log_every_n_steps=2: steps 1, 3, 5, 7, 9

    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    got = {int(r["step"]): float(r["torchdebug/loss"]) for r in rows if r.get("torchdebug/loss")}
    assert got == {s: loss[s] for s in logged}  # CSV keeps the float64 text exactly
    marks = {(int(r["step"]), k) for r in rows for k in r if k.startswith("torchdebug/") and r[k] == "1.0"}
    assert (EXPLODE_AT, "torchdebug/events/gradient_explosion") in marks
    assert (NAN_AT, "torchdebug/anomaly") in marks
    import yaml

    hparams = yaml.safe_load((tmp_path / "csv" / "version_0" / "hparams.yaml").read_text())
    assert hparams["torchdebug/status"] == "finished"
    assert hparams["torchdebug/verdict"] == finished_verdict("net.act")  # relative to the LightningModule
    assert hparams["torchdebug/run_folder"] == str(run.path)
    assert hparams["torchdebug/first_anomaly/line"] == origin_line("log")
    assert hparams["torchdebug/first_anomaly/module"] == "net.act (LogAct)"  # relative to the LightningModule

    ea = _events(tmp_path / "tb" / "version_0")
    tb_loss = {e.step: e.value for e in ea.Scalars("torchdebug/loss")}
    assert sorted(tb_loss) == logged and all(_same32(tb_loss[s], loss[s]) for s in logged)
    (anomaly,) = _texts(ea, "torchdebug/anomalies").items()
    assert anomaly[0] == NAN_AT
    _check_block(anomaly[1], headline)
    assert list(_texts(ea, "torchdebug/events/gradient_explosion")) == [EXPLODE_AT]
    assert _texts(ea, "torchdebug/verdict") == {
        NAN_AT: f"**{finished_verdict('net.act')}**  \nrun folder: `{run.path}`"
    }


# -- Hugging Face --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_hugging_face_report_to_ships_the_findings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = pytest.importorskip("transformers")
    from torchdebug.integrations.transformers import TorchDebugCallback

    class HFNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = FaultyNet()

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": F.mse_loss(self.net(x), y)}

    class Faults(transformers.TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            model.net.fault = state.global_step == EXPLODE_AT  # global_step: the steps done before this one
            model.net.act.shift = -10.0 if state.global_step == NAN_AT else 1.0

    data = [{"x": x[i], "y": y[i]} for x, y in hm.batches(STEPS) for i in range(hm.BATCH)]
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    args = quiet_args(
        tmp_path / "out",
        report_to=["tensorboard"],
        per_device_train_batch_size=hm.BATCH,
        max_steps=STEPS,
        learning_rate=0.01,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,  # no clipping: the explosion reaches the update, as in the plain loop
        logging_strategy="steps",
        logging_steps=1,
        train_sampling_strategy="sequential",
        seed=0,
    )
    cb = TorchDebugCallback(config=CFG, run=tmp_path / "runs")
    trainer = transformers.Trainer(model=HFNet(), args=args, train_dataset=data, callbacks=[cb, Faults()])
    assert trainer.callback_handler.callbacks[0] is cb  # ahead of TensorBoardCallback, which reads logs
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torchdebug", category=Warning)
        trainer.train()

    run = open_run(cb.monitor.run_dir)
    headline = run.anomalies()[0]["summary"]
    loss = dict(zip(run.series("loss").steps, run.series("loss").values))
    ea = _events(tmp_path / "tb")
    # HF logs at state.global_step, the steps done: HF step s holds torchdebug step s - 1
    tb_loss = {e.step: e.value for e in ea.Scalars("train/torchdebug/loss")}
    assert sorted(tb_loss) == list(range(1, STEPS + 1))
    assert all(_same32(tb_loss[s], loss[s - 1]) for s in tb_loss)
    gn = dict(zip(run.series("grad_norm").steps, run.series("grad_norm").values))
    assert _same32(
        {e.step: e.value for e in ea.Scalars("train/torchdebug/grad_norm")}[EXPLODE_AT + 1], gn[EXPLODE_AT]
    )
    (anomaly,) = _texts(ea, "train/torchdebug/anomalies").items()
    assert anomaly[0] == NAN_AT + 1
    _check_block(anomaly[1], headline)
    # HF clips with clip_grad_norm_ to log its grad_norm: at the NaN step the clip is a rule event too
    assert [(e["kind"], e["step"]) for e in run.events()] == [
        ("gradient_explosion", EXPLODE_AT),
        ("clip_nonfinite", NAN_AT),
    ]
    events = _texts(ea, "train/torchdebug/events")
    assert sorted(events) == [EXPLODE_AT + 1, NAN_AT + 1]
    assert events[EXPLODE_AT + 1].startswith(
        f"torchdebug warning: step {EXPLODE_AT}: gradient_explosion [net.inp]: "
    )
    assert events[NAN_AT + 1].startswith(
        f"torchdebug error: step {NAN_AT}: clip_nonfinite [net.inp, net.out]: "
    )
    assert _texts(ea, "train/torchdebug/status") == {STEPS: "finished"}
    # the NaN outranks both rule events (the clip_nonfinite error is the same incident): it leads,
    # they are counted
    assert _texts(ea, "train/torchdebug/verdict") == {
        STEPS: finished_verdict("net.act").replace("also ", "also 1 clip_nonfinite, ")
    }
    assert _texts(ea, "train/torchdebug/run_folder") == {STEPS: str(run.path)}

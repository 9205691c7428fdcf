"""Seed 003's ``OptimizedTrainer`` / ``TrainingConfig``: its "Training Integration" snippet, run verbatim
(imports from ``torchdebug.compat``), and what ``train()`` returns."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchdebug as td
from torchdebug.compat import OptimizedTrainer, PyTorchDebugConfig, TrainingConfig


class Regressor(nn.Module):
    """Returns its own loss, as the seed's trainer is called without a loss function."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.net(x), y)


class Predictor(Regressor):
    """Takes the targets too, but returns predictions."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _data(n: int = 64, nan_row: int | None = None) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    y = x.sum(dim=1, keepdim=True)  # learnable: a linear target
    if nan_row is not None:
        x[nan_row, 0] = math.nan
    return TensorDataset(x, y)


def test_the_seeds_training_integration_snippet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the default run folder (runs/) lands here
    torch.manual_seed(0)
    model = Regressor()
    train_loader = DataLoader(_data(64), batch_size=32)  # 2 batches an epoch
    # seed 003, "Training Integration", verbatim from here
    config = TrainingConfig(
        epochs=100,
        batch_size=32,
        enable_pytorch_debugging=True,
        debug_config=PyTorchDebugConfig(
            enable_autograd_anomaly=True,
            enable_gradient_debugging=True,
            enable_memory_debugging=True,
            enable_training_debugging=True,
        ),
    )

    # Create trainer with debugging
    trainer = OptimizedTrainer(model=model, train_loader=train_loader, config=config)

    # Train with debugging
    results = trainer.train()

    # Access debug report
    debug_report = results.get("debug_report")
    # to here
    assert results["epochs"] == 100
    assert results["steps"] == 200  # 100 epochs x 2 batches
    assert len(results["train_loss"]) == 100
    assert results["train_loss"][-1] < 0.75 * results["train_loss"][0]  # it learns (AdamW, lr 1e-3)
    assert results["final_loss"] == results["train_loss"][-1]
    assert results["skipped_steps"] == 0 and results["anomalies"] == []
    run_dir = Path(results["run_dir"])
    assert run_dir.resolve().parent == tmp_path.resolve() / "runs"
    assert debug_report is not None
    assert debug_report["run"]["status"] == "finished"
    assert debug_report["summary"]["total_debug_operations"] == 200
    assert debug_report["summary"]["anomalies_detected"] == 0
    # memory snapshots every memory_snapshot_frequency (50) steps: 0, 50, 100, 150
    assert debug_report["memory_analysis"]["samples"] == 4
    # the gradient check after each backward: one norm a step
    assert debug_report["metrics"]["grad_norm"]["points"] == 200
    # Linear(4, 8) + Linear(8, 1): 4*8 + 8 + 8*1 + 1 = 49 parameters
    assert debug_report["model_info"]["parameters"] == 49
    assert debug_report["cuda"]["available"] == torch.cuda.is_available()
    assert td.open_run(run_dir).meta["status"] == "finished"


def test_memory_snapshot_frequency_sets_the_memory_schedule(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = TrainingConfig(
        epochs=15,
        batch_size=32,
        enable_pytorch_debugging=True,
        debug_config=PyTorchDebugConfig(enable_memory_debugging=True, memory_snapshot_frequency=10),
    )
    trainer = OptimizedTrainer(
        Regressor(), DataLoader(_data(64), batch_size=32), config, run_dir=str(tmp_path)
    )
    results = trainer.train()
    assert results["steps"] == 30
    assert results["debug_report"]["memory_analysis"]["samples"] == 3  # steps 0, 10, 20


@pytest.mark.parametrize("mode", ["warn", "detect"])
def test_a_nan_batch_is_skipped_and_training_goes_on(tmp_path: Path, mode: str) -> None:
    torch.manual_seed(0)
    model = Regressor()
    config = TrainingConfig(
        epochs=2,
        batch_size=16,
        enable_pytorch_debugging=True,
        debug_config=PyTorchDebugConfig(enable_autograd_anomaly=True, anomaly_detection_mode=mode),
    )
    # 4 batches an epoch; row 20 is in batch 1 of each epoch: steps 1 and 5
    trainer = OptimizedTrainer(
        model, DataLoader(_data(64, nan_row=20), batch_size=16), config, run_dir=str(tmp_path)
    )
    with pytest.warns(td.TorchDebugWarning, match="skipped by policy"):
        results = trainer.train()
    assert results["steps"] == 8
    assert results["skipped_steps"] == 2
    assert [a["step"] for a in results["anomalies"]] == [1, 5]
    assert results["anomalies"][0]["phase"] == "input"  # replayed: the batch holds the NaN
    # (the engine replays only a session's first anomaly; the second is the sentinel's symptom)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(math.isfinite(v) for v in results["train_loss"])  # the mean of the 3 finite batches
    assert results["debug_report"]["summary"]["anomalies_detected"] == 2


def test_raise_mode_stops_before_the_bad_update(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Regressor()
    config = TrainingConfig(
        epochs=1, batch_size=16, enable_pytorch_debugging=True, debug_config=PyTorchDebugConfig()
    )  # anomaly_detection_mode="raise", the default
    trainer = OptimizedTrainer(
        model, DataLoader(_data(64, nan_row=20), batch_size=16), config, run_dir=str(tmp_path)
    )
    with pytest.raises(td.NonFiniteError) as err:
        trainer.train()
    assert (err.value.anomaly.step, err.value.anomaly.phase) == (1, "input")
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert td.open_run(trainer.monitor.run_dir).meta["status"] == "failed"


def test_without_debugging_no_session_and_no_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 1))
    trainer = OptimizedTrainer(
        model, DataLoader(_data(64), batch_size=32), TrainingConfig(epochs=3), loss_fn=F.mse_loss
    )
    results = trainer.train()
    assert results["steps"] == 6
    assert results["debug_report"] is None and results["run_dir"] is None
    assert trainer.monitor is None
    assert not (tmp_path / "runs").exists()
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_bad_configuration_names_the_fix() -> None:
    with pytest.raises(td.ConfigError, match="build it with batch_size=32"):
        OptimizedTrainer(Regressor(), DataLoader(_data(64), batch_size=16), TrainingConfig(batch_size=32))
    with pytest.raises(td.ConfigError, match="epochs=0"):
        TrainingConfig(epochs=0)
    trainer = OptimizedTrainer(Predictor(), DataLoader(_data(64), batch_size=32), TrainingConfig(epochs=1))
    with pytest.raises(td.ConfigError, match="returned Tensor, not a loss; pass loss_fn="):
        trainer.train()  # (32, 1) predictions, not a loss

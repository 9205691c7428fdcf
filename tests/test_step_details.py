"""Seed 000's flags record what they promised: forward shapes/devices/loss, autocast and its dtype,
the DataLoader's sizes, validation forwards, the scheduler's type and the LR the step used."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchdebug as td
from torchdebug.store import open_run


def _setup() -> tuple[nn.Module, torch.optim.Optimizer, DataLoader]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(20, 6, generator=g), torch.randint(0, 2, (20,), generator=g))
    return model, opt, DataLoader(ds, batch_size=8, num_workers=0)


def _events(mon: td.Monitor, kind: str) -> list[td.RuleEvent]:
    return [e for e in mon.events if e.kind == kind]


def test_forward_mixed_precision_and_data_loading(tmp_path: Path) -> None:
    model, opt, loader = _setup()
    cfg = {
        "mode": "none",
        "debug_forward_pass": True,
        "debug_mixed_precision": True,
        "debug_data_loading": True,
        "detail_every": 2,
        "run_dir": str(tmp_path),
    }
    with td.watch(model, opt, config=cfg) as mon:
        for i, (x, y) in enumerate(loader):  # 20 samples / 8 = 3 batches (8, 8, 4)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=i == 2):
                loss = nn.functional.cross_entropy(model(x).float(), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step()
    (dl,) = _events(mon, "data_loader")
    assert dict(dl.evidence) == {
        "dataset": "TensorDataset",
        "dataset_size": 20,
        "batch_size": 8,
        "num_workers": 0,
        "batches_per_epoch": 3,
        "drop_last": False,
    }
    fwd = _events(mon, "forward_pass")
    assert [e.step for e in fwd] == [0, 2]  # the first step and every detail_every=2 steps
    first = fwd[0].evidence
    assert first["inputs"] == [{"shape": [8, 6], "dtype": "float32", "device": "cpu"}]
    assert first["outputs"] == [{"shape": [8, 2], "dtype": "float32", "device": "cpu"}]
    assert first["loss"] == pytest.approx(mon.records[0].loss)
    assert fwd[1].evidence["inputs"][0]["shape"] == [4, 6]  # the last, short batch
    amp = _events(mon, "mixed_precision")
    assert [(e.step, e.evidence["autocast"]["cpu"]) for e in amp] == [
        (0, {"enabled": False, "dtype": None}),
        (2, {"enabled": True, "dtype": "bfloat16"}),
    ]
    assert all(e.severity == "info" for e in mon.events)  # a healthy run stays silent
    with open_run(mon.run_dir) as run:
        kinds = {e["kind"] for e in run.events()}
    assert {"data_loader", "forward_pass", "mixed_precision"} <= kinds
    from torch.utils.data import DataLoader as DL

    assert "__torchdebug" not in repr(DL.__iter__) and DL.__iter__.__module__ == "torch.utils.data.dataloader"


def test_validation_forwards_and_the_scheduler(tmp_path: Path) -> None:
    model, opt, loader = _setup()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    cfg = {"mode": "none", "debug_validation": True, "debug_lr_scheduling": True, "run_dir": str(tmp_path)}
    with td.watch(model, opt, config=cfg) as mon:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()  # before mon.step(): the step must still record the LR it used
            mon.step()
        model.eval()
        with torch.no_grad():
            losses = [nn.functional.cross_entropy(model(x), y).item() for x, y in loader]
        mon.observe("val_loss", sum(losses) / len(losses))
        model.train()
    # lr 0.1 for step 0, halved after each: 0.1, 0.05, 0.025
    assert [r.lr for r in mon.records] == [(0.1,), (0.05,), (0.025,)]
    (sch,) = _events(mon, "lr_scheduler")
    assert dict(sch.evidence) == {"type": "StepLR", "lr_before": [0.1], "lr_after": [0.05]}
    (val,) = _events(mon, "validation")
    assert (val.evidence["forwards"], val.evidence["samples"]) == (3, 20)
    assert val.evidence["observed"] == {"val_loss": pytest.approx(sum(losses) / 3)}
    assert val.evidence["rss"] > 0
    assert torch.optim.lr_scheduler.LRScheduler.step.__module__ == "torch.optim.lr_scheduler"


def test_flags_start_step_details() -> None:
    for flag in ("debug_forward_pass", "debug_mixed_precision", "debug_data_loading"):
        assert "step_details" in td.DebugConfig(mode="none", **{flag: True}).instruments()
    assert "step_details" not in td.DebugConfig(mode="none").instruments()

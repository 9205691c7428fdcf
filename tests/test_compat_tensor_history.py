"""Seed 002's deepest level ("Extreme Level: full tensor history") writes ``tensor_stats`` rows, bounded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import torchdebug as td
from torchdebug.health.instrument import HISTORY_TENSORS


def _run(tmp_path: Path, model: nn.Module, level: str, steps: int = 5) -> tuple[Path, list[dict]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    cfg = td.DebugConfig(level=level, detail_every=2)
    with td.watch(model, opt, config=cfg, run=tmp_path) as mon:
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(8, 4, generator=g)).pow(2).mean().backward()
            opt.step()
            mon.step()
    with td.open_run(mon.run_dir) as run:
        return mon.run_dir, run.tensor_stats()


def test_extreme_level_records_weights_and_gradients_on_detail_steps(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    _, rows = _run(tmp_path, model, "extreme")  # seed 002's name of the expert level
    names = [
        "0.weight",
        "0.weight.grad",
        "0.bias",
        "0.bias.grad",
        "2.weight",
        "2.weight.grad",
        "2.bias",
        "2.bias.grad",
    ]
    # detail steps 0, 2, 4 (detail_every=2), 4 parameters x (weight, gradient)
    assert [(r["step"], r["name"]) for r in rows] == [(s, n) for s in (0, 2, 4) for n in names]
    last = {r["name"]: r["stats"] for r in rows if r["step"] == 4}
    for name, p in model.named_parameters():  # step 4 is the last: the weights and gradients now
        ref, ref_grad = td.analyze_tensor(p.detach()), td.analyze_tensor(p.grad)
        assert last[name]["mean"] == pytest.approx(ref.mean) and last[name]["shape"] == list(p.shape)
        assert last[f"{name}.grad"]["std"] == pytest.approx(ref_grad.std)
        assert last[f"{name}.grad"]["nan_count"] == 0


def test_lower_levels_write_no_tensor_history(tmp_path: Path) -> None:
    torch.manual_seed(0)
    _, rows = _run(tmp_path, nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), "advanced")
    assert rows == []


def test_the_history_is_bounded_per_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(20)], nn.Linear(4, 1))  # 42 parameters
    _, rows = _run(tmp_path, model, "expert", steps=1)
    assert len(rows) == 2 * HISTORY_TENSORS == 64
    assert rows[-1]["name"] == "15.bias.grad"  # the 32nd parameter: 16 layers x (weight, bias)

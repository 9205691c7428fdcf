"""Tests of TensorBoard export and the live TensorBoard sink, read back with EventAccumulator."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import torchdebug as td
from tests.fixtures.runs import MiB, TinyMLP, write_small_run
from torchdebug.cli import main as cli_main
from torchdebug.sinks import TensorBoardSink, export_tensorboard


def _load(logdir: Path) -> EventAccumulator:
    ea = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    ea.Reload()
    return ea


def _scalars(ea: EventAccumulator, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in ea.Scalars(tag)}


def _text(ea: EventAccumulator, tag: str) -> dict[int, str]:
    return {e.step: e.tensor_proto.string_val[0].decode() for e in ea.Tensors(f"{tag}/text_summary")}


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, int], EventAccumulator]:
    run = write_small_run(tmp_path_factory.mktemp("runs"))
    logdir = tmp_path_factory.mktemp("tb")
    counts = export_tensorboard(run, logdir)
    return counts, _load(logdir)


def test_export_counts(exported: tuple[dict[str, int], EventAccumulator]) -> None:
    counts, _ = exported
    # scalars: 9 metrics x 8 steps + 4 memory keys x 8 + 7 timing keys x 8 (data, forward, backward,
    # optimizer, other, total, samples_per_s) + 6 stats rows (steps 0, 4, 6 x 2 tensors) x 2 (nan, inf);
    # texts: 1 anomaly + 5 events (each the only record of its episode: no episode summary) + the
    # first anomaly alone under its own tag + the verdict
    assert counts == {"scalars": 72 + 32 + 56 + 12, "histograms": 6, "texts": 1 + 5 + 1 + 1}


def test_export_scalars_keep_nan_and_inf(exported: tuple[dict[str, int], EventAccumulator]) -> None:
    _, ea = exported
    loss = _scalars(ea, "torchdebug/loss")
    assert sorted(loss) == list(range(8))
    assert loss[5] == 8.0 and math.isnan(loss[6]) and loss[7] == 0.75
    assert _scalars(ea, "torchdebug/grad_norm")[6] == math.inf
    assert _scalars(ea, "torchdebug/params/grad_norm/fc1.weight")[5] == 60.0
    assert _scalars(ea, "torchdebug/lr/0")[0] == 0.125
    assert _scalars(ea, "torchdebug/memory/rss")[7] == 107 * MiB  # bytes (exact in float32: 107 * 2^20)
    assert _scalars(ea, "torchdebug/time/forward")[5] == pytest.approx(0.04)  # 0.16 / 4
    assert _scalars(ea, "torchdebug/time/total")[5] == pytest.approx(
        0.16
    )  # logged as "step", read back as "total"
    assert _scalars(ea, "torchdebug/throughput/samples_per_s")[5] == pytest.approx(200.0)  # 32 / 0.16


def test_export_histograms_and_nonfinite_counts(exported: tuple[dict[str, int], EventAccumulator]) -> None:
    _, ea = exported
    hist = {e.step: e.histogram_value for e in ea.Histograms("torchdebug/histograms/fc1.weight.grad")}
    assert sorted(hist) == [0, 4, 6]
    h0 = hist[0]
    # 16 finite values in [-3, 3], mean 0, std 1.5: sum 0, sum of squares (16 - 1) * 1.5^2 = 33.75
    assert (h0.min, h0.max, h0.num, h0.sum, h0.sum_squares) == (-3.0, 3.0, 16.0, 0.0, 33.75)
    assert list(h0.bucket_limit) == [3.0] and list(h0.bucket) == [16.0]
    assert hist[6].num == 13.0  # 3 of the 16 are NaN
    assert _scalars(ea, "torchdebug/nonfinite/fc1.weight.grad/nan") == {0: 0.0, 4: 0.0, 6: 3.0}
    assert _scalars(ea, "torchdebug/nonfinite/fc2.weight.grad/nan")[6] == 1.0
    assert _scalars(ea, "torchdebug/nonfinite/fc2.weight.grad/inf")[6] == 0.0


def test_export_texts(exported: tuple[dict[str, int], EventAccumulator]) -> None:
    _, ea = exported
    an = _text(ea, "torchdebug/anomalies")
    assert list(an) == [6]
    assert "nan born in forward of fc2 (Linear): aten.addmm at train.py:42 (step 6)" in an[6]
    assert "\n      hint      fc1 output reached 1.5e38" in an[6]
    assert _text(ea, "torchdebug/events/gradient_explosion") == {
        5: "**warning** `gradient_explosion` [fc1]: grad norm 64 is 32x its running median"
    }


def test_cli_export(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run = write_small_run(tmp_path / "runs")
    assert cli_main(["export", str(run), "--tensorboard", str(tmp_path / "tb")]) == 0
    assert "wrote 172 scalars, 6 histograms and 8 texts" in capsys.readouterr().err
    assert _scalars(_load(tmp_path / "tb"), "torchdebug/loss")[0] == 2.5
    assert cli_main(["export", str(tmp_path / "nope"), "--tensorboard", str(tmp_path / "tb2")]) == 1
    # --to tensorboard without --logdir: tensorboard/<run folder name>, never inside the run folder
    monkeypatch.chdir(tmp_path)
    assert cli_main(["export", str(run), "--to", "tensorboard"]) == 0
    assert f"to tensorboard/{run.name} " in capsys.readouterr().err
    assert _scalars(_load(tmp_path / "tensorboard" / run.name), "torchdebug/loss")[0] == 2.5
    assert not (run / "tensorboard").exists()
    assert cli_main(["export", str(run), "--to", "wandb", "--tensorboard", "x"]) == 1


def _train(mon: Any, model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> list[Any]:
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    records = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        records.append(mon.step())
    return records


def test_live_instrument_writes_each_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    tb = tmp_path / "tb"
    with td.watch(model, opt, run=tmp_path / "runs", tensorboard=str(tb)) as mon:
        assert [type(s) for s in mon.recording.hub.sinks] == [TensorBoardSink]
        records = _train(mon, model, opt, 4)
    ea = _load(tb)
    loss = _scalars(ea, "torchdebug/loss")
    assert sorted(loss) == [r.step for r in records]
    # float32 in the event file
    assert [loss[r.step] for r in records] == pytest.approx([r.loss for r in records], rel=1e-6)
    gn = _scalars(ea, "torchdebug/grad_norm")
    assert [gn[r.step] for r in records] == pytest.approx([r.grad_norm for r in records], rel=1e-6)
    assert _scalars(ea, "torchdebug/lr/0")[records[0].step] == pytest.approx(0.05)


def test_live_instrument_default_dir_is_inside_the_run(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with td.watch(model, opt, run=tmp_path, tensorboard=True) as mon:
        _train(mon, model, opt, 2)
        run_dir = mon.run_dir
    assert sorted(_scalars(_load(run_dir / "tensorboard"), "torchdebug/loss")) == [0, 1]

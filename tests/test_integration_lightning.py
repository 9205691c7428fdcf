"""The Lightning callback on a real ``lightning.pytorch.Trainer`` (CPU, tiny model, synthetic data).

Each fault is injected at batch index 2; expected steps are worked out from the batches: without
accumulation batch k is step k; with ``accumulate_grad_batches=2`` batches 2-3 are step 1.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

L = pytest.importorskip("lightning.pytorch")

import torchdebug as td  # noqa: E402
from tests.fixtures.lightning_quiet import quiet_fit, quiet_trainer  # noqa: E402
from tests.fixtures.models import origin_line  # noqa: E402
from torchdebug.integrations.lightning import TorchDebugCallback  # noqa: E402

THIS = __file__
VOCAB, D, T, B = 11, 8, 5, 3
BAD = 2  # the batch index that carries the fault


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # (B, T, D) each
        s = (q @ k.transpose(-2, -1)) / math.sqrt(D)  # (B, T, T)
        s = s.masked_fill(pad[:, None, :], float("-inf"))
        return torch.softmax(s, dim=-1) @ v  # ORIGIN:softmax


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.attn = Attn()
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(self.emb(ids), pad))


class Lit(L.LightningModule):
    def __init__(self, fault: str | None = None, call_self: bool = False, manual: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same weights in every test
        self.model = TinyLM()
        self.fault, self.call_self = fault, call_self
        self.automatic_optimization = not manual

    def forward(self, ids: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.model(ids, pad)

    def on_train_batch_start(self, batch: tuple, batch_idx: int) -> None:
        if self.fault == "weight" and batch_idx == BAD:
            with torch.no_grad():
                self.model.head.weight[0, 0] = float("nan")  # a bad write outside the step

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        ids, pad, tgt, w = batch
        logits = self(ids, pad) if self.call_self else self.model(ids, pad)
        per_tok = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), reduction="none")
        loss = (per_tok * w.flatten()).mean()  # ORIGIN:weighted
        if self.fault == "log" and batch_idx == BAD:
            loss = loss + torch.log(loss - loss)  # ORIGIN:log
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def batches(n: int, fault: str | None = None) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        ids = torch.randint(0, VOCAB, (B, T), generator=g)
        pad = torch.zeros(B, T, dtype=torch.bool)
        pad[0, -1] = True  # ordinary padding
        w = torch.ones(B, T)
        if i == BAD and fault == "mask":
            pad[1] = True  # an all-padding row: every attention score of that row is -inf
        if i == BAD and fault == "loss_weight":
            w[2, 3] = float("nan")  # a bad per-token weight in the batch, used only by the loss
        out.append((ids, pad, torch.randint(0, VOCAB, (B, T), generator=g), w))
    return out


def fit(lit: Lit, cb: TorchDebugCallback, n: int = 5, fault: str | None = None, **trainer_kw: object) -> None:
    torch.manual_seed(0)
    trainer = quiet_trainer([cb], devices=1, max_epochs=1, **trainer_kw)
    loader = torch.utils.data.DataLoader(batches(n, fault), batch_size=None)
    with quiet_fit():
        trainer.fit(lit, loader)


def assert_clean_exit() -> None:
    assert td.session.driver._ACTIVE == [] and td.session.driver._ORIGINALS == {}
    assert not getattr(torch.Tensor.backward, "__torchdebug_wrapper__", False)


def meta(cb: TorchDebugCallback) -> dict:
    return json.loads((cb.monitor.run_dir / "meta.json").read_text())


CASES = [
    # fault, phase, module, op, origin tag
    ("mask", "forward", "model.attn", "aten._softmax", "softmax"),
    ("log", "forward", "", "aten.log", "log"),
    ("loss_weight", "input", "", None, "weighted"),
    ("weight", "parameter", "model.head", None, None),
]


@pytest.mark.parametrize("call_self", [False, True], ids=["self.model(x)", "self(x)"])
@pytest.mark.parametrize(("fault", "phase", "module", "op", "tag"), CASES, ids=[c[0] for c in CASES])
def test_fault_is_named_and_raise_marks_run_failed(tmp_path, fault, phase, module, op, tag, call_self):
    cb = TorchDebugCallback(run=tmp_path)
    with pytest.raises(td.NonFiniteError) as ei:
        fit(Lit(fault, call_self=call_self), cb, fault=fault)
    a = ei.value.anomaly
    assert (a.step, a.phase, a.module, a.op) == (BAD, phase, module, op), str(a)
    assert a.location == (origin_line(tag, THIS) if tag else None), str(a)
    if fault == "loss_weight":
        assert a.tensor.name == "batch[3]" and a.tensor.nan_count == 1, str(a)
    if fault == "weight":
        assert a.parameter == "model.head.weight", str(a)
    assert meta(cb)["status"] == "failed"
    assert_clean_exit()


def test_clean_run_warns_nothing_and_records_every_step(tmp_path):
    cb = TorchDebugCallback(run=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning of ours on a healthy run is a failure
        fit(Lit(), cb)
    mon = cb.monitor
    assert [r.step for r in mon.records] == [0, 1, 2, 3, 4] and mon.anomalies == []
    assert all(r.micro_steps == 1 and not r.skipped and math.isfinite(r.loss) for r in mon.records)
    assert meta(cb)["status"] == "finished"
    assert_clean_exit()


def test_the_tensorboard_verdict_counts_the_steps_of_a_clean_run(tmp_path):
    # the TensorBoardLogger gets the scalars through log_metrics and the findings and verdict through
    # torchdebug's sink: the verdict's step count is the session's (30), not the sink's scalars (none)
    pytest.importorskip("tensorboard")
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cb = TorchDebugCallback(run=tmp_path / "runs")
    tb = TensorBoardLogger(tmp_path / "tb", name="", version=0, default_hp_metric=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning of ours on a healthy run is a failure
        fit(Lit(), cb, n=30, logger=tb, log_every_n_steps=10)
    ea = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"tensors": 0})
    ea.Reload()
    texts = {
        e.step: e.tensor_proto.string_val[0].decode() for e in ea.Tensors("torchdebug/verdict/text_summary")
    }
    run_dir = cb.monitor.run_dir
    assert texts == {29: f"**finished: 30 steps, no anomalies**  \nrun folder: `{run_dir}`"}
    assert_clean_exit()


def test_skip_policy_keeps_weights_finite_and_training_goes_on(tmp_path):
    lit, cb = Lit(), TorchDebugCallback(run=tmp_path, policy="skip")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always", td.TorchDebugWarning)
        fit(lit, cb, fault="mask")
    mon = cb.monitor
    # policy="skip" says a run of skipped steps once when it starts and once when it ends
    said = [str(w.message) for w in record if issubclass(w.category, td.TorchDebugWarning)]
    assert len(said) == 2 and said[0].startswith(f"torchdebug: step {BAD} skipped by policy: nan born in")
    assert (
        said[1]
        == f"torchdebug: 1 step skipped by policy='skip' (step {BAD}); training resumed at step {BAD + 1}"
    )
    assert [r.step for r in mon.records] == [0, 1, 2, 3, 4]
    assert [r.skipped for r in mon.records] == [False, False, True, False, False]
    assert [(a.step, a.module, a.op) for a in mon.anomalies] == [(BAD, "model.attn", "aten._softmax")]
    assert all(torch.isfinite(p).all() for p in lit.parameters())
    assert meta(cb)["status"] == "finished"
    assert_clean_exit()


def test_gradient_accumulation_counts_optimizer_steps(tmp_path):
    # 6 batches, 2 per step: steps 0,1,2; the fault in batch 2 is step 1, its first micro-step
    cb = TorchDebugCallback(run=tmp_path)
    with pytest.raises(td.NonFiniteError) as ei:
        fit(Lit("mask"), cb, n=6, fault="mask", accumulate_grad_batches=2)
    a = ei.value.anomaly
    assert (a.step, a.micro_step, a.module, a.op) == (1, 0, "model.attn", "aten._softmax"), str(a)
    assert a.location == origin_line("softmax", THIS)
    assert [(r.step, r.micro_steps) for r in cb.monitor.records] == [(0, 2)]
    assert_clean_exit()


def test_gradient_accumulation_clean(tmp_path):
    cb = TorchDebugCallback(run=tmp_path)
    fit(Lit(), cb, n=6, accumulate_grad_batches=2)
    assert [(r.step, r.micro_steps, r.skipped) for r in cb.monitor.records] == [
        (0, 2, False),
        (1, 2, False),
        (2, 2, False),
    ]
    assert meta(cb)["status"] == "finished"


@pytest.mark.parametrize("fault", ["log", "mask"])
def test_manual_optimization(tmp_path, fault):
    cb = TorchDebugCallback(run=tmp_path)
    with pytest.raises(td.NonFiniteError) as ei:
        fit(Lit(fault, manual=True), cb, fault=fault)
    a = ei.value.anomaly
    assert (a.step, a.location) == (BAD, origin_line("log" if fault == "log" else "softmax", THIS)), str(a)
    assert [r.step for r in cb.monitor.records] == [0, 1]
    assert meta(cb)["status"] == "failed"
    assert_clean_exit()


def test_bf16_mixed_precision_plugin(tmp_path):
    cb = TorchDebugCallback(run=tmp_path)
    with pytest.raises(td.NonFiniteError) as ei:
        fit(Lit("mask"), cb, fault="mask", precision="bf16-mixed")
    a = ei.value.anomaly
    assert (a.step, a.phase, a.module, a.op) == (BAD, "forward", "model.attn", "aten._softmax"), str(a)
    assert a.location == origin_line("softmax", THIS)
    assert_clean_exit()


def test_fp16_mixed_with_gradscaler(tmp_path):
    # Lightning turns precision="16-mixed" on CPU into bf16; the plugin given explicitly keeps fp16 and
    # its GradScaler: closure, unscale_, on_before_optimizer_step, scaler.step (amp.py:79-96)
    from lightning.pytorch.plugins.precision import MixedPrecision

    lit, cb = Lit(), TorchDebugCallback(run=tmp_path)
    fit(lit, cb, plugins=[MixedPrecision("16-mixed", "cpu")])
    mon = cb.monitor
    assert [r.step for r in mon.records] == [0, 1, 2, 3, 4] and mon.anomalies == []
    assert [r.skipped for r in mon.records] == [False] * 5  # the scaler stepped every time
    assert [r.scale for r in mon.records] == [65536.0] * 5
    # the true (unscaled) loss: the same run without the plugin gives the same first loss to fp16 precision
    plain = TorchDebugCallback(run=False)
    fit(Lit(), plain)
    assert mon.records[0].loss == pytest.approx(plain.monitor.records[0].loss, rel=1e-2)


def test_bad_options_fail_at_construction():
    with pytest.raises(ValueError, match="policy must be one of raise, warn, skip"):
        TorchDebugCallback(policy="ignore")
    with pytest.raises(TypeError, match="the trainer supplies the optimizer"):
        TorchDebugCallback(optimizer=None)
    with pytest.raises(TypeError, match="unknown option"):
        TorchDebugCallback(polcy="raise")


def test_missing_framework_names_the_extra(monkeypatch):
    import importlib
    import sys

    for mod in ("lightning.pytorch", "pytorch_lightning"):
        monkeypatch.setitem(sys.modules, mod, None)  # import of it raises ImportError
    monkeypatch.delitem(sys.modules, "torchdebug.integrations.lightning")
    with pytest.raises(ImportError, match=r"pip install 'torchdebug\[lightning\]'"):
        importlib.import_module("torchdebug.integrations.lightning")

"""The Hugging Face callback on a real ``transformers.Trainer`` (CPU, tiny models built here, no downloads).

Batches run in order (``train_sampling_strategy="sequential"``), 3 samples each; each fault sits in
batch 2. Without accumulation batch k is step k; with ``gradient_accumulation_steps=2`` batches 2-3
are step 1.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")

import torchdebug as td  # noqa: E402
from tests.fixtures.hf_quiet import quiet_args  # noqa: E402
from tests.fixtures.models import origin_line  # noqa: E402
from torchdebug.integrations.transformers import TorchDebugCallback  # noqa: E402

THIS = __file__
VOCAB, D, T, B = 11, 8, 5, 3
BAD = 2


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
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, D)
        self.attn = Attn()
        self.head = nn.Linear(D, VOCAB)

    def forward(self, input_ids: torch.Tensor, pad: torch.Tensor, labels: torch.Tensor) -> dict:
        logits = self.head(self.attn(self.emb(input_ids), pad))  # (B, T, V)
        per_tok = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        return {"loss": per_tok.mean(), "per_token_loss": per_tok, "logits": logits}


class WeightedTrainer(transformers.Trainer):
    """The usual customisation: a per-token weight from the batch, used only by the loss."""

    fault: str | None = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        w = inputs.pop("loss_weight")
        out = model(**inputs)
        loss = (out["per_token_loss"] * w.flatten()).mean()  # ORIGIN:weighted
        if self.fault == "log" and self.state.global_step == BAD:
            loss = loss + torch.log(loss - loss)  # ORIGIN:log
        return (loss, out) if return_outputs else loss


class BreakWeight(transformers.TrainerCallback):
    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == BAD:
            with torch.no_grad():
                model.head.weight[0, 0] = float("nan")  # a bad write outside the step


def samples(n_batches: int, fault: str | None) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n_batches * B):
        pad = torch.zeros(T, dtype=torch.bool)
        pad[-1] = i % B == 0  # ordinary padding
        w = torch.ones(T)
        if i // B == BAD and i % B == 1:
            if fault == "mask":
                pad[:] = True  # an all-padding row: every attention score of that row is -inf
            if fault == "loss_weight":
                w[3] = float("nan")  # batch 2, row 1, token 3
        out.append(
            {
                "input_ids": torch.randint(0, VOCAB, (T,), generator=g),
                "pad": pad,
                "labels": torch.randint(0, VOCAB, (T,), generator=g),
                "loss_weight": w,
            }
        )
    return out


def train(tmp_path, cb, fault=None, n=5, callbacks=(), model=None, data=None, **args_kw):
    args = quiet_args(
        tmp_path / "out",
        per_device_train_batch_size=B,
        max_steps=n // args_kw.get("gradient_accumulation_steps", 1),
        learning_rate=1e-3,
        train_sampling_strategy="sequential",
        remove_unused_columns=False,  # loss_weight is not a forward() argument: compute_loss pops it
        seed=0,
        **args_kw,
    )
    trainer = WeightedTrainer(
        model=model or TinyLM(),
        args=args,
        train_dataset=data if data is not None else samples(n, fault),
        callbacks=[cb, *callbacks],
    )
    trainer.fault = fault
    trainer.train()
    return trainer


def meta(cb) -> dict:
    return json.loads((cb.monitor.run_dir / "meta.json").read_text())


def assert_clean_exit(trainer=None) -> None:
    assert td.session.driver._ACTIVE == [] and td.session.driver._ORIGINALS == {}
    assert not getattr(torch.Tensor.backward, "__torchdebug_wrapper__", False)


CASES = [
    # fault, phase, module, op, origin tag
    ("mask", "forward", "attn", "aten._softmax", "softmax"),
    ("log", "forward", "", "aten.log", "log"),
    ("loss_weight", "input", "", None, "weighted"),
    ("weight", "parameter", "head", None, None),
]


@pytest.mark.parametrize(("fault", "phase", "module", "op", "tag"), CASES, ids=[c[0] for c in CASES])
def test_fault_is_named_and_raise_marks_run_failed(tmp_path, fault, phase, module, op, tag):
    cb = TorchDebugCallback(run=tmp_path)
    extra = [BreakWeight()] if fault == "weight" else []
    with pytest.raises(td.NonFiniteError) as ei:
        train(tmp_path, cb, fault=fault, callbacks=extra)
    a = ei.value.anomaly
    assert (a.step, a.phase, a.module, a.op) == (BAD, phase, module, op), str(a)
    assert a.location == (origin_line(tag, THIS) if tag else None), str(a)
    if fault == "loss_weight":
        assert a.tensor.name == "batch['loss_weight']" and a.tensor.nan_count == 1, str(a)
    if fault == "weight":
        assert a.parameter == "head.weight", str(a)
    assert meta(cb)["status"] == "failed"
    assert_clean_exit()


def test_clean_run_warns_nothing_and_records_every_step(tmp_path):
    cb = TorchDebugCallback(run=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning on a healthy run is a failure
        trainer = train(tmp_path, cb)
    mon = cb.monitor
    assert [r.step for r in mon.records] == [0, 1, 2, 3, 4] and mon.anomalies == []
    assert all(r.micro_steps == 1 and not r.skipped and math.isfinite(r.loss) for r in mon.records)
    assert mon.records[0].loss == pytest.approx(trainer.state.log_history[-1]["train_loss"], rel=0.2)
    assert meta(cb)["status"] == "finished"
    assert "training_step" not in vars(trainer) and "compute_loss" not in vars(trainer)  # unwrapped
    assert_clean_exit()


def test_clean_gpt2_run(tmp_path):
    # a real Hugging Face model from a config (no download): its own loss, attention and dropout
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(4 * B):
        ids = torch.randint(0, 50, (8,), generator=g)
        data.append({"input_ids": ids, "labels": ids, "loss_weight": torch.ones(8)})

    class Plain(WeightedTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            inputs.pop("loss_weight")
            return transformers.Trainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)

    cb = TorchDebugCallback(run=tmp_path)
    args = quiet_args(
        tmp_path / "out",
        per_device_train_batch_size=B,
        max_steps=4,
        learning_rate=1e-3,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Plain(model=model, args=args, train_dataset=data, callbacks=[cb]).train()
    mon = cb.monitor
    assert [r.step for r in mon.records] == [0, 1, 2, 3] and mon.anomalies == []
    # untrained: about log(vocab) per predicted token; HF divides the sum over 7 shifted predictions
    # per row by num_items_in_batch, which counts all 8 labels: log(50) * 7 / 8 = 3.42
    assert mon.records[0].loss == pytest.approx(math.log(50) * 7 / 8, rel=0.05)
    assert meta(cb)["status"] == "finished"
    assert_clean_exit()


def test_skip_policy_keeps_weights_finite_and_training_goes_on(tmp_path):
    cb = TorchDebugCallback(run=tmp_path, policy="skip")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always", td.TorchDebugWarning)
        trainer = train(tmp_path, cb, fault="mask")
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
    assert [(a.step, a.module, a.op) for a in mon.anomalies] == [(BAD, "attn", "aten._softmax")]
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert trainer.state.global_step == 5
    assert meta(cb)["status"] == "finished"
    assert_clean_exit()


def test_gradient_accumulation(tmp_path):
    # 6 batches, 2 per step: the fault in batch 2 is step 1, micro-step 0
    cb = TorchDebugCallback(run=tmp_path)
    with pytest.raises(td.NonFiniteError) as ei:
        train(tmp_path, cb, fault="mask", n=6, gradient_accumulation_steps=2)
    a = ei.value.anomaly
    assert (a.step, a.micro_step, a.module, a.op) == (1, 0, "attn", "aten._softmax"), str(a)
    assert a.location == origin_line("softmax", THIS)
    assert [(r.step, r.micro_steps) for r in cb.monitor.records] == [(0, 2)]
    assert meta(cb)["status"] == "failed"
    assert_clean_exit()


def test_gradient_accumulation_clean(tmp_path):
    cb = TorchDebugCallback(run=tmp_path)
    train(tmp_path, cb, n=6, gradient_accumulation_steps=2)
    assert [(r.step, r.micro_steps, r.skipped) for r in cb.monitor.records] == [
        (0, 2, False),
        (1, 2, False),
        (2, 2, False),
    ]


def test_any_exception_in_training_marks_run_failed(tmp_path):
    class Boom(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                raise RuntimeError("boom")

    cb = TorchDebugCallback(run=tmp_path)
    with pytest.raises(RuntimeError, match="boom"):
        train(tmp_path, cb, callbacks=[Boom()])
    assert meta(cb)["status"] == "failed"
    assert [r.step for r in cb.monitor.records] == [0, 1]
    assert_clean_exit()


def test_watch_accepts_accelerate_and_lightning_wrapped_optimizers():
    from accelerate.optimizer import AcceleratedOptimizer

    model = TinyLM()
    raw = torch.optim.SGD(model.parameters(), lr=0.1)
    with td.watch(model, AcceleratedOptimizer(raw, device_placement=False), run=False) as mon:
        assert mon.optimizer is raw
    L = pytest.importorskip("lightning.pytorch")
    lopt = L.core.optimizer.LightningOptimizer(raw)
    with td.watch(model, lopt, run=False) as mon:
        assert mon.optimizer is raw
    assert_clean_exit()


def test_bad_options_fail_at_construction():
    with pytest.raises(ValueError, match="policy must be one of raise, warn, skip"):
        TorchDebugCallback(policy="ignore")
    with pytest.raises(TypeError, match="the trainer supplies the model"):
        TorchDebugCallback(model=None)


def test_missing_framework_names_the_extra(monkeypatch):
    import importlib
    import sys

    for mod in ("transformers",):
        monkeypatch.setitem(sys.modules, mod, None)  # import of it raises ImportError
    monkeypatch.delitem(sys.modules, "torchdebug.integrations.transformers")
    with pytest.raises(ImportError, match=r"pip install 'torchdebug\[transformers\]'"):
        importlib.import_module("torchdebug.integrations.transformers")


def test_bf16_autocast_on_cpu_clean_and_fault_named(tmp_path):
    # accelerate's bf16 mixed precision (autocast on CPU): a clean run warns nothing and records every
    # step; the all-padding row is still named at the softmax (the replay restores the autocast state)
    model = TinyLM()
    dtypes = set()
    model.head.register_forward_hook(lambda mod, args, out: dtypes.add(out.dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cb = TorchDebugCallback(run=tmp_path / "runs")
        train(tmp_path / "clean", cb, model=model, bf16=True)
    assert dtypes == {torch.bfloat16}  # the forward really ran under bf16 autocast
    assert [r.step for r in cb.monitor.records] == [0, 1, 2, 3, 4]
    assert all(r.anomaly is None and math.isfinite(r.loss) for r in cb.monitor.records)
    cb = TorchDebugCallback(run=tmp_path / "runs")
    with pytest.raises(td.NonFiniteError) as ei:
        train(tmp_path / "fault", cb, fault="mask", bf16=True)
    a = ei.value.anomaly
    assert (a.step, a.phase, a.module, a.op) == (BAD, "forward", "attn", "aten._softmax")
    assert a.location == origin_line("softmax", __file__)
    assert_clean_exit()


def test_the_trainers_clip_carries_the_gradient_check_and_training_is_unchanged(tmp_path, copies):
    # the Trainer clips every step (max_grad_norm=1.0, its default) right after backward(), through
    # accelerate's clip_grad_norm_: from the second step on that clip measures the gradients (no copy of
    # them), and the weights end bit for bit where they end without torchdebug
    torch.manual_seed(0)
    plain_model = TinyLM()
    model = copy.deepcopy(plain_model)
    train(tmp_path / "plain", transformers.TrainerCallback(), model=plain_model)
    per_step: list[int] = []

    class Count(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            per_step.append(copies[0])

    cb = TorchDebugCallback(run=False, config=td.DebugConfig(mode="anomaly_detection"))
    train(tmp_path / "watched", cb, model=model, callbacks=[Count()])
    assert [b - a for a, b in itertools.pairwise(per_step)][1:] == [0, 0, 0]  # steps 1-3 (step 0 measures)
    assert cb.monitor.anomalies == [] and len(cb.monitor.records) == 5
    assert all(torch.equal(a, b) for a, b in zip(plain_model.parameters(), model.parameters(), strict=True))

"""The words around a located origin: the rows of the batch that hold a NaN, one phrase said once, tied
weights named by all their names, the padding mask that completed a fully masked row, and a NaN
checkpoint reported before the model is used."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import torchdebug as td
from tests.fixtures import models as fx

_THIS = os.path.abspath(__file__)
SENTINEL_ONLY = td.DebugConfig(mode="anomaly_detection")


def origin_line(tag: str) -> str:
    return fx.origin_line(tag, _THIS)


# -- the rows of the batch that hold the NaN ----------------------------------------------------------
def test_locate_names_the_rows_of_the_input_that_hold_nan() -> None:
    torch.manual_seed(0)
    model = fx.MLP(d_in=4)
    x = torch.randn(8, 4)
    x[2, 1] = x[5, 0] = x[5, 3] = float("nan")  # 3 NaN in rows 2 and 5

    def step(batch: torch.Tensor) -> torch.Tensor:
        loss = model(batch).pow(2).mean()
        loss.backward()
        return loss

    a = td.locate_nonfinite(step, x, model=model)
    assert a is not None and a.phase == "input"
    assert a.hint == (
        "the batch already holds NaN: input #0 (3 NaN, 0 +Inf, 0 -Inf) in rows 2, 5 (2 of 8 rows); check "
        "the data pipeline (those samples)"
    )
    assert a.symptom == "nan in input #0, rows 2, 5 (2 of 8 rows)"


def test_watch_names_the_first_rows_and_the_count() -> None:
    torch.manual_seed(0)
    model = fx.MLP(d_in=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(td.NonFiniteError) as ei, td.watch(model, opt, run=False, config=SENTINEL_ONLY) as mon:
        for i in range(3):
            x = torch.randn(16, 4)
            if i == 1:
                x[0:14:2, 2] = float("inf")  # rows 0, 2, 4, ..., 12: 7 rows hold +Inf
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step()
    a = ei.value.anomaly
    assert (a.step, a.phase) == (1, "input")
    # the first 5 of the 7 bad rows are shown, then the count
    assert a.symptom == "inf in input #0, rows 0, 2, 4, 6, 8, ... (7 of 16 rows)"
    assert "(0 NaN, 7 +Inf, 0 -Inf) in rows 0, 2, 4, 6, 8, ... (7 of 16 rows)" in a.hint


def test_a_nan_only_the_loss_code_used_names_its_rows_and_says_so_once() -> None:
    torch.manual_seed(0)
    model = fx.MLP(d_in=4, d_out=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(td.NonFiniteError) as ei, td.watch(model, opt, run=False, config=SENTINEL_ONLY) as mon:
        for i in range(3):
            x, w = torch.randn(8, 4), torch.ones(8)
            if i == 2:
                w[1] = w[3] = float("nan")  # a per-sample weight from the batch, used only by the loss
            out = model(x).squeeze(-1)
            loss = (out.pow(2) * w).mean()  # ORIGIN:weighted
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step()
    a = ei.value.anomaly
    assert (a.step, a.phase, a.location) == (2, "input", origin_line("weighted"))
    assert a.hint == (
        f"the loss code at {origin_line('weighted')} used a tensor that already held NaN: 2 NaN in rows "
        "1, 3 (2 of 8 rows); neither the model nor the loss code made it, so it came with the batch: "
        "check the data pipeline"
    )
    assert a.hint.count("loss code") == 2 and a.hint.count("used") == 1
    assert a.symptom == "nan in a tensor the loss code used (not made by the model), rows 1, 3 (2 of 8 rows)"


# -- tied weights by all their names --------------------------------------------------------------------
class TiedLM(nn.Module):
    """A tiny language model whose output head shares the embedding's weight (as nanoGPT's)."""

    def __init__(self, vocab: int = 8, d: int = 4) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.mid = nn.Linear(d, d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one tensor, two names

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.mid(self.wte(idx))))


def test_a_tied_weight_is_named_by_all_its_names_under_locate() -> None:
    torch.manual_seed(0)
    model = TiedLM()
    with torch.no_grad():
        model.lm_head.weight[3, 1] = float("nan")  # the same tensor as wte.weight

    def step(idx: torch.Tensor) -> torch.Tensor:
        loss = model(idx).logsumexp(-1).mean()
        loss.backward()
        return loss

    a = td.locate_nonfinite(step, torch.tensor([[1, 2, 3]]), model=model)
    assert a is not None
    assert (a.phase, a.module, a.parameter) == ("parameter", "wte", "wte.weight (= lm_head.weight)")
    assert a.summary() == "nan born in parameter of wte.weight (= lm_head.weight)"
    assert a.hint.startswith("wte.weight (= lm_head.weight) already holds 1 NaN / 0 Inf"), a.hint


def test_a_tied_weight_is_named_by_all_its_names_under_watch() -> None:
    torch.manual_seed(0)
    model = TiedLM()
    # SGD with lr 1e10 on gradients ~1e30 (the loss is scaled by 1e30, finite ~1e30): every update is
    # ~1e40 > 3.4e38, so the update makes every parameter +-Inf; wte.weight is the first of them
    opt = torch.optim.SGD(model.parameters(), lr=1e10)
    idx = torch.tensor([[1, 2, 3]])
    with pytest.raises(td.NonFiniteError) as ei, td.watch(model, opt, run=False, config=SENTINEL_ONLY) as mon:
        for _ in range(3):
            loss = model(idx).logsumexp(-1).mean() * 1e30
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step()
    a = ei.value.anomaly
    assert (a.phase, a.parameter) == ("optimizer", "wte.weight (= lm_head.weight)"), str(a)
    assert a.symptom.startswith("inf in parameter wte.weight (= lm_head.weight) after the optimizer step")
    assert a.hint.startswith("the optimizer update made wte.weight (= lm_head.weight) non-finite"), a.hint
    assert mon.anomalies[0] == a  # kept as raised


# -- the padding mask that completed a fully masked row ----------------------------------------------------
class PaddedCausal(nn.Module):
    """Causal self-attention with a key padding mask applied on top (``pad``: True = padding)."""

    def __init__(self, additive: bool = False) -> None:
        super().__init__()
        self.qkv = nn.Linear(4, 12)
        self.additive = additive

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        _, T, C = x.shape  # (B, T, C)
        q, k, v = self.qkv(x).split(C, dim=-1)
        att = q @ k.transpose(-2, -1) / C**0.5  # (B, T, T)
        causal = torch.ones(T, T, dtype=torch.bool).triu(1)
        att = att.masked_fill(causal, float("-inf"))  # ORIGIN:causal
        if self.additive:
            bias = torch.zeros(pad.shape).masked_fill(pad, float("-inf"))  # ORIGIN:padbias
            att = att + bias[:, None, :]  # ORIGIN:padadd
        else:
            att = att.masked_fill(pad[:, None, :], float("-inf"))  # ORIGIN:padding
        att = att.softmax(-1)  # ORIGIN:padsoftmax
        return att @ v


@pytest.mark.parametrize(
    ("additive", "tag", "op"), [(False, "padding", "aten.masked_fill"), (True, "padadd", "aten.add")]
)
def test_a_row_masked_by_padding_on_top_of_causal_names_the_padding_line(
    additive: bool, tag: str, op: str
) -> None:
    torch.manual_seed(0)
    model = PaddedCausal(additive)
    x = torch.randn(2, 3, 4)
    pad = torch.tensor([[False, False, False], [True, False, False]])  # sequence 1 starts with padding
    # query 0 of sequence 1 sees only key 0 (causal), and key 0 is padding: its row is all -inf

    def step(x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        loss = model(x, pad).sum()
        loss.backward()
        return loss

    a = td.locate_nonfinite(step, x, pad, model=model)
    assert a is not None
    assert (a.op, a.kind, a.location) == ("aten._softmax", "nan", origin_line("padsoftmax"))
    assert a.hint == "softmax over a row whose entries are all -inf (a fully masked row)"
    assert a.related is not None
    assert (a.related.op, a.related.kind, a.related.location) == (op, "-inf", origin_line(tag))


def test_a_mask_broadcast_over_the_batch_is_not_a_new_mask() -> None:
    # without padding no row is fully masked: nothing to report, whatever the masks' shares
    model = PaddedCausal()
    a = td.locate_nonfinite(
        lambda: model(torch.randn(2, 3, 4), torch.zeros(2, 3, dtype=torch.bool)).sum().backward(), model=model
    )
    assert a is None


# -- a NaN checkpoint: said when the session starts --------------------------------------------------------
def _nan_model() -> nn.Module:
    torch.manual_seed(0)
    model = fx.MLP(d_in=4)
    with torch.no_grad():
        model.fc2.bias[1] = float("nan")
    return model


def test_watch_raises_at_start_on_weights_that_are_already_nan() -> None:
    model = _nan_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(td.NonFiniteError) as ei, td.watch(model, opt, run=False, config=SENTINEL_ONLY):
        pytest.fail("the body must not run")  # the model is never used on NaN weights
    a = ei.value.anomaly
    assert (a.phase, a.module, a.parameter, a.kind, a.step) == ("parameter", "fc2", "fc2.bias", "nan", 0)
    assert a.symptom == "nan in fc2.bias when the session started"
    assert a.hint.startswith("fc2.bias already holds 1 NaN / 0 Inf when the session started, before any use")
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    assert not model._load_state_dict_post_hooks


def test_watch_checks_a_checkpoint_loaded_during_the_session_under_warn() -> None:
    torch.manual_seed(0)
    model = fx.MLP(d_in=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    bad = _nan_model().state_dict()
    warns = pytest.warns(td.TorchDebugWarning, match="nan born in parameter of fc2.bias")
    with warns, td.watch(model, opt, run=False, policy="warn", config=SENTINEL_ONLY) as mon:
        assert mon.anomalies == []  # healthy at the start
        model.load_state_dict(bad)
        symptoms = [a.symptom for a in mon.anomalies]
        assert symptoms == ["nan in fc2.bias when load_state_dict put it in the model"]
    assert not model._load_state_dict_post_hooks

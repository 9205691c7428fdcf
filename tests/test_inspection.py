"""Tests of inspect_model: per-module table, totals, output shapes, input validation, restored state."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from torchdebug.health.inspection import ModelSummary, inspect_model, validate_layer_input


class Tagger(nn.Module):
    """Embedding -> 2 blocks (Linear + ReLU) -> head -> BatchNorm over the mean of positions."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(2)])
        self.head = nn.Linear(4, 2)
        self.bn = nn.BatchNorm1d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)  # (B, T, 4)
        for block in self.blocks:
            h = block(h)
        return self.bn(self.head(h).mean(1))  # (B, 2)


def no_hooks(model: nn.Module) -> bool:
    return not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_rows_totals_and_output_shapes() -> None:
    torch.manual_seed(0)
    model = Tagger()
    s = inspect_model(model, torch.randint(0, 10, (3, 5)))
    assert isinstance(s, ModelSummary)
    assert [m.name for m in s.modules] == [n for n, _ in model.named_modules()]
    # params: emb 10*4=40, each block Linear 4*4+4=20, head 4*2+2=10, bn 2+2=4 -> 40+40+10+4 = 94
    assert s.total_params == 94 and s.trainable_params == 94
    assert s["blocks"].params == 40 and s["blocks.0.0"].own_params == 20
    # bytes: 94 float32 params = 376; buffers running_mean/var 2*4*2=16 + num_batches_tracked int64 8 = 24
    assert (s.param_bytes, s.buffer_bytes, s.total_bytes) == (376, 24, 400)
    assert s["bn"].bytes == 4 * 4 + 24
    assert s["emb"].output_shape == [3, 5, 4]
    assert s["head"].output_shape == [3, 5, 2]
    assert s[""].output_shape == [3, 2] and s.output_shape == [3, 2]
    assert s["blocks"].output_shape is None  # a ModuleList is never called
    assert s["blocks.0"].depth == 2 and s["blocks.0.1"].depth == 3
    assert s["emb"].dtype == "float32" and s["emb"].device == "cpu"
    assert s["blocks.0.1"].dtype is None  # ReLU has no parameters
    assert s.problems == () and s.ok and s.forward_error is None
    assert json.loads(json.dumps(s.to_dict()))["total_bytes"] == 400


def test_text_is_a_tree_with_totals() -> None:
    model = nn.Sequential(nn.Linear(10, 4), nn.ReLU(), nn.Linear(4, 2))
    text = str(inspect_model(model, torch.zeros(3, 10)))
    lines = text.splitlines()
    assert lines[1].split() == [
        "Layer",
        "(type)",
        "Output",
        "Shape",
        "Params",
        "Trainable",
        "Bytes",
        "dtype",
        "device",
    ]
    # 10*4+4 = 44 params, 4*2+2 = 10 -> 54 (216 bytes)
    assert lines[3].split() == ["Sequential", "[3,", "2]", "54", "54", "216", "B", "float32", "cpu"]
    assert lines[4].startswith("├─0 (Linear)") and "[3, 4]" in lines[4]
    assert lines[6].startswith("└─2 (Linear)")
    assert "Total params: 54" in lines
    assert "Trainable params: 54" in lines
    assert "Non-trainable params: 0" in lines
    assert "Params size (MiB): 0.00" in lines


def test_frozen_parameters_counted_as_non_trainable() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    model[0].requires_grad_(False)
    s = inspect_model(model)
    # frozen: 3*3+3 = 12; trainable 3+1 = 4
    assert (s.total_params, s.trainable_params, s.non_trainable_params) == (16, 4, 12)
    assert s[""].output_shape is None and s.input_shape is None


@pytest.mark.parametrize(
    ("make_model", "example", "expected"),
    [
        (
            lambda: nn.Sequential(nn.Linear(10, 4)),
            torch.zeros(2, 12),
            "0 (Linear) expects the last dimension to be in_features=10 but the input has shape [2, 12]",
        ),
        (
            lambda: nn.Sequential(nn.Conv2d(3, 8, 3)),
            torch.zeros(2, 1, 8, 8),
            "0 (Conv2d) expects in_channels=3 in the channel dimension but the input has shape [2, 1, 8, 8] (1 channels)",
        ),
        (
            lambda: nn.Sequential(nn.Embedding(10, 4)),
            torch.tensor([[0, 3, 10]]),
            "0 (Embedding) has num_embeddings=10 but the input indices range over [0, 10]; every index must be in [0, 9]",
        ),
        (
            lambda: nn.Sequential(nn.Embedding(10, 4)),
            torch.zeros(2, 3),
            "0 (Embedding) needs integer indices but the input has dtype torch.float32; pass a LongTensor (x.long())",
        ),
        (
            lambda: nn.Sequential(nn.Linear(3, 1)),
            torch.zeros(2, 3, dtype=torch.float64),
            "0 (Linear) has torch.float32 weights but the input is torch.float64; "
            "convert one of them (x.to(torch.float32) or model.to(torch.float64))",
        ),
        (
            lambda: nn.Sequential(nn.Linear(3, 1)),
            torch.zeros(2, 3, dtype=torch.long),
            "0 (Linear) needs a floating-point input but got dtype torch.int64; convert it (x.float())",
        ),
        (
            lambda: nn.Sequential(nn.LSTM(5, 4)),
            torch.zeros(2, 3, 6),
            "0 (LSTM) expects the last dimension to be input_size=5 but the input has shape [2, 3, 6]",
        ),
    ],
    ids=[
        "linear-width",
        "conv-channels",
        "embedding-range",
        "embedding-dtype",
        "dtype",
        "int-to-linear",
        "lstm",
    ],
)
def test_input_problems_in_plain_words(make_model, example, expected) -> None:  # type: ignore[no-untyped-def]
    model = make_model()
    s = inspect_model(model, example)
    assert s.problems[0] == expected
    assert not s.ok
    assert s.forward_error is not None
    assert no_hooks(model)


def test_first_layer_is_the_first_one_called_not_registered() -> None:
    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(4, 2)  # registered first, called second
            self.stem = nn.Conv1d(2, 1, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.stem(x).flatten(1))

    # (2, 2, 4) -> stem (2, 1, 4) -> flatten (2, 4) -> head (2, 2): valid though head wants width 4
    assert inspect_model(Flat(), torch.zeros(2, 2, 4)).problems == ()
    bad = inspect_model(Flat(), torch.zeros(2, 3, 4)).problems
    assert bad[0].startswith("stem (Conv1d) expects in_channels=2")


def test_failing_forward_names_the_module_and_restores_state() -> None:
    model = nn.Sequential(nn.Linear(10, 4), nn.ReLU(), nn.Linear(5, 2), nn.Dropout(0.5))
    model.train()
    model[3].eval()  # mixed modes must come back exactly
    s = inspect_model(model, torch.zeros(3, 10))
    assert s.forward_error is not None and s.forward_error.startswith("RuntimeError in 2 (Linear): ")
    assert s.problems == (f"the forward failed: {s.forward_error}",)
    assert s["0"].output_shape == [3, 4] and s["2"].output_shape is None
    assert [m.training for m in model] == [True, True, True, False] and model.training
    assert no_hooks(model)


def test_eval_mode_during_the_forward_keeps_batchnorm_statistics() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    before = model[1].running_mean.clone()
    inspect_model(model, torch.randn(4, 2) + 5.0)
    assert torch.equal(model[1].running_mean, before)
    assert model[1].num_batches_tracked.item() == 0
    assert model.training


def test_input_shape_builds_a_seeded_example() -> None:
    s = inspect_model(nn.Sequential(nn.Linear(10, 3)), input_shape=(32, 10))
    assert s.input_shape == [32, 10] and s.output_shape == [32, 3] and s.ok
    e = inspect_model(nn.Sequential(nn.Embedding(7, 2)), input_shape=(4, 5))  # integer zeros for an Embedding
    assert e.output_shape == [4, 5, 2] and e.ok
    with pytest.raises(TypeError, match="input_shape"):
        inspect_model(nn.Linear(1, 1), input_shape="32x10")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not both"):
        inspect_model(nn.Linear(1, 1), torch.zeros(1, 1), input_shape=(1, 1))
    with pytest.raises(TypeError, match=r"nn\.Module"):
        inspect_model("model")  # type: ignore[arg-type]


def test_tuple_and_dict_inputs_and_tuple_outputs() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.GRU(3, 4, batch_first=True)

        def forward(self, x: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
            out, h = self.rnn(x * scale)
            return out, h

    s = inspect_model(Two(), (torch.zeros(2, 5, 3), 2.0))
    assert s["rnn"].output_shape == [[2, 5, 4], [1, 2, 4]]
    assert "([2, 5, 4], [1, 2, 4])" in str(s)
    k = inspect_model(Two(), {"x": torch.zeros(2, 5, 3)})
    assert k.output_shape == [[2, 5, 4], [1, 2, 4]]


def test_device_mismatch_reported_without_running_a_kernel() -> None:
    layer = nn.Linear(3, 1, device="meta")
    assert validate_layer_input(layer, torch.zeros(2, 3), "fc") == [
        "fc (Linear) has its weights on meta but the input is on cpu; move the input (x.to('meta'))"
    ]
    assert validate_layer_input(nn.Linear(3, 1), [1, 2, 3], "fc") == [
        "fc (Linear) received a list, not a tensor"
    ]

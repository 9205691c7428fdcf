"""Two diagnosis rules the frameworks exposed: the user's source line is never a framework's, and a NaN
that enters through a batch tensor only the loss uses is phase ``input``."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import torchdebug as td
from tests.fixtures.models import origin_line
from torchdebug._frames import skip_frame

SP = os.sep.join(["", "venv", "lib", "python3.11", "site-packages", ""])


@pytest.mark.parametrize(
    ("path", "skipped"),
    [
        (SP + "lightning/pytorch/trainer/call.py", True),
        (SP + "pytorch_lightning/core/module.py", True),
        (SP + "lightning_fabric/utilities/apply_func.py", True),
        (SP + "transformers/trainer.py", True),
        (SP + "transformers/models/gpt2/modeling_gpt2.py", True),
        (SP + "accelerate/optimizer.py", True),
        (SP + "timm/models/vit.py", False),  # a model from another installed library is user code
        (SP + "lightning_extras_of_mine/x.py", False),  # only exact top-level package names
        ("/home/me/project/train.py", False),
        ("/home/me/lightning/train.py", False),  # a user folder named like a framework
    ],
)
def test_framework_frames_are_not_the_users(path, skipped):
    assert skip_frame(path.replace("/", os.sep)) is skipped


def test_nan_in_a_tensor_only_the_loss_uses_is_phase_input_in_a_plain_loop():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, w = torch.randn(3, 4), torch.ones(3, 2)
    w[1, 0] = float("nan")
    with pytest.raises(td.NonFiniteError) as ei, td.watch(model, opt, run=False) as mon:
        for step in range(3):
            weights = w if step == 1 else torch.ones(3, 2)
            loss = (model(x).square() * weights).mean()  # ORIGIN:plain_weight
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step()
    a = ei.value.anomaly
    assert (a.step, a.phase, a.module, a.op, a.kind) == (1, "input", "", None, "nan"), str(a)
    assert a.location == origin_line("plain_weight", __file__)
    # no framework driver handed over the batch: named by what it is, not by a place in a batch
    assert a.tensor.name == "a tensor the loss code used (not made by the model)"
    assert a.tensor.nan_count == 1


def test_an_explicit_inf_in_a_loss_only_tensor_is_not_an_input_fault():
    # only NaN counts as entering with the batch; an -inf mask used by the loss is ordinary
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(2, 4)
    mask = torch.zeros(2, 3)
    mask[:, 2] = float("-inf")
    with td.watch(model, opt, run=False) as mon:
        for _ in range(2):
            loss = torch.log_softmax(model(x) + mask, dim=-1)[:, 0].mean().neg()
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step()
    assert mon.anomalies == []

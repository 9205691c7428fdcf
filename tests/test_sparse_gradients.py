"""Sparse gradients (``nn.Embedding(sparse=True)``, ``SparseAdam``) are checked by their stored values
and traced like dense ones: a NaN/Inf in one is named at the backward op that made it, under every
policy, and no policy raises an error of torchdebug's own out of the loop."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import torchdebug as td
from tests.fixtures import gan_script
from tests.fixtures.gan_script import Fault
from tests.fixtures.models import origin_line
from torchdebug._tensors import finite_probe, stored_values

BACKWARD_LINE = origin_line("fault_backward", gan_script.__file__)  # sqrt at exact zeros: an Inf gradient
STEPS, BAD = 4, 2


class Tagger(nn.Module):
    """Token ids (B,) -> a score (B,): a sparse embedding table, an activation (``act``), a dense head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.act = Fault()
        self.head = nn.Linear(4, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.emb(idx))).squeeze(-1)


def _run(
    policy: str | None, skipping: bool = False
) -> tuple[td.Monitor | None, list[float], list[torch.Tensor]]:
    """The loop, under ``policy`` (None: without torchdebug; ``skipping``: it drops a non-finite step's
    gradients, as ``policy="skip"`` does). At step BAD ``act`` takes a sqrt at exact zeros: finite
    forward, an Inf gradient born in ``SqrtBackward0`` that reaches the embedding's sparse gradient."""
    torch.manual_seed(0)
    model = Tagger()
    opt_sparse = torch.optim.SparseAdam(list(model.emb.parameters()), lr=0.01)
    opt_dense = torch.optim.Adam(model.head.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    losses: list[float] = []
    mon = td.watch(model, [opt_sparse, opt_dense], policy=policy, run=False) if policy else None
    with mon if mon is not None else _plain():
        for step in range(STEPS):
            idx = torch.randint(0, 10, (5,), generator=g)
            model.act.mode = "backward" if step == BAD else ""
            opt_sparse.zero_grad()
            opt_dense.zero_grad()
            loss = model(idx).pow(2).mean()
            loss.backward()
            if skipping and step == BAD:
                assert not bool(torch.isfinite(model.emb.weight.grad._values()).all())
                for p in model.parameters():
                    p.grad = None
            opt_sparse.step()
            opt_dense.step()
            if mon is not None:
                mon.step()
            losses.append(loss.item())
    return mon, losses, [p.detach().clone() for p in model.parameters()]


class _plain:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _is_the_origin(a: td.Anomaly) -> None:
    # the Inf is born in the backward of `act` (sqrt at zeros), flows into emb.weight's sparse gradient
    assert (a.phase, a.module, a.op, a.step) == ("backward", "act", "SqrtBackward0", BAD)
    assert a.location == BACKWARD_LINE


def test_a_sparse_gradients_inf_raises_with_the_backward_op_that_made_it() -> None:
    with pytest.raises(td.NonFiniteError) as info:
        _run("raise")
    _is_the_origin(info.value.anomaly)


@pytest.mark.parametrize("policy", ["warn", "skip"])
def test_a_sparse_gradients_inf_under_a_go_on_policy_runs_to_the_end_as_without_torchdebug(
    policy: str,
) -> None:
    _, want, want_params = _run(None, skipping=policy == "skip")
    with pytest.warns(td.TorchDebugWarning):
        mon, got, params = _run(policy)
    assert mon is not None
    _is_the_origin(mon.anomalies[0])
    assert len(got) == STEPS
    assert all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(got, want)), (got, want)
    for p, q in zip(params, want_params):
        torch.testing.assert_close(p, q, rtol=0, atol=0, equal_nan=True)
    if policy == "skip":
        # the skipped update left the sparse table finite: the steps after it trained on
        assert bool(torch.isfinite(params[0]).all()) and all(map(math.isfinite, got))


def test_a_healthy_sparse_run_is_silent() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.manual_seed(0)
        model = Tagger()
        opt = torch.optim.SparseAdam(list(model.emb.parameters()), lr=0.01)
        with td.watch(model, opt, policy="raise", run=False) as mon:
            for _ in range(3):
                opt.zero_grad()
                model(torch.tensor([1, 2, 2, 7])).pow(2).mean().backward()
                opt.step()
                mon.step()
    assert mon.anomalies == [] and len(mon.records) == 3


def test_locate_names_the_backward_op_not_the_sparse_optimizers_values() -> None:
    torch.manual_seed(0)
    model = Tagger()
    opt = torch.optim.SparseAdam(list(model.emb.parameters()), lr=0.01)
    model.act.mode = "backward"

    def step() -> None:
        opt.zero_grad()
        model(torch.tensor([1, 2, 2, 7])).pow(2).mean().backward()
        opt.step()

    a = td.locate_nonfinite(step, model=model)
    assert a is not None
    assert (a.phase, a.module, a.op) == ("backward", "act", "SqrtBackward0")
    assert a.location == BACKWARD_LINE
    assert "gradient of emb.weight" in a.symptom


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_a_sparse_tensors_stored_values_carry_its_nan(layout: str) -> None:
    dense = torch.tensor([[0.0, 1.0, 0.0], [float("nan"), 0.0, 2.0]])
    t = dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()
    # stored: 1, nan, 2 (the zeros are implicit); a finite probe of the values reads NaN
    assert stored_values(t).tolist()[0] == 1.0 and math.isnan(stored_values(t).tolist()[1])
    probe = finite_probe([t, torch.ones(2)])
    assert math.isnan(probe[0].item()) and probe[1].item() == 2.0

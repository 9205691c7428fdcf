"""A model returning a plain result object (seed 002's ``outputs.loss``): a NaN born in backward replays.

The replay re-runs the step's forward and reads the loss where the user's code read it; for that the
output's tensors must be reachable in any object the loss code reads from, not only in tensors,
tuples, dicts and dataclasses.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import torchdebug as td
from tests.fixtures.models import origin_line
from torchdebug._trees import map_tensors, tensor_leaves
from torchdebug.compat import AsyncTrainingLogger, TrainingPhase
from torchdebug.store import open_run


class Output:
    """A plain result object (no dataclass, no mapping), as a model zoo's own output class."""

    def __init__(self, loss: torch.Tensor, logits: torch.Tensor) -> None:
        self.loss = loss
        self.logits = logits


class SqrtLossNet(nn.Module):
    """Computes its own loss; ``sqrt`` at exactly 0: finite loss, Inf in backward, then NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, batch: torch.Tensor) -> Output:
        logits = self.fc(batch)
        loss = torch.sqrt((logits * 0).pow(2).sum(-1)).mean()  # ORIGIN:objsqrt
        return Output(loss, logits)


def _setup() -> tuple[SqrtLossNet, torch.optim.Optimizer, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = SqrtLossNet()
    return model, torch.optim.SGD(model.parameters(), lr=0.1), [torch.randn(2, 4) for _ in range(2)]


def _assert_origin(a: td.Anomaly) -> None:
    assert (a.phase, a.op, a.kind, a.step) == ("backward", "SqrtBackward0", "inf", 0)
    assert a.location == origin_line("objsqrt", __file__)


def test_watch_replays_a_plain_result_objects_loss() -> None:
    model, optimizer, batches = _setup()
    before = [p.detach().clone() for p in model.parameters()]
    with td.watch(model, optimizer, run=False) as mon, pytest.raises(td.NonFiniteError) as err:
        for batch in batches:
            outputs = model(batch)
            loss = outputs.loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    _assert_origin(err.value.anomaly)
    assert [a.op for a in mon.anomalies] == ["SqrtBackward0"]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_async_logger_replays_a_plain_result_objects_loss(tmp_path: Path) -> None:
    model, optimizer, dataloader = _setup()
    num_epochs = 1

    async def debug_training_loop(model, dataloader, optimizer, logger):  # type: ignore[no-untyped-def]
        """Training loop with comprehensive debugging."""  # seed 002, verbatim

        for epoch in range(num_epochs):
            for step, batch in enumerate(dataloader):
                try:
                    # Forward pass
                    outputs = model(batch)
                    loss = outputs.loss

                    # Check loss tensor
                    loss_info = await logger.check_tensor_anomalies_async(loss, "loss")
                    if loss_info["has_nan"] or loss_info["has_inf"]:
                        logger.log_error(
                            ValueError("Loss contains NaN/Inf values"),
                            TrainingPhase.TRAINING,
                            {"epoch": epoch, "step": step, "loss_info": loss_info},
                        )
                        continue

                    # Backward pass
                    loss.backward()

                    # Check gradients
                    gradient_info = await logger.check_gradient_anomalies_async(model)
                    if gradient_info["params_with_nan_grad"] > 0:
                        logger.log_warning(
                            f"Gradient anomalies detected at step {step}", TrainingPhase.TRAINING
                        )

                    # Update progress
                    await logger.update_progress_async(
                        epoch=epoch,
                        step=step,
                        loss=loss.item(),
                        learning_rate=optimizer.param_groups[0]["lr"],
                    )

                    optimizer.step()
                    optimizer.zero_grad()

                except Exception as e:
                    logger.log_error(e, TrainingPhase.TRAINING, {"epoch": epoch, "step": step})
                    raise

    async def main() -> None:
        logger = AsyncTrainingLogger(
            user_id=123, model_name="sqrt-loss", enable_autograd_debug=True, run_dir=str(tmp_path)
        )
        logger.start_training(total_epochs=1, total_steps=2)
        try:
            await debug_training_loop(model, dataloader, optimizer, logger)
        finally:
            await asyncio.to_thread(logger.end_training)

    with pytest.raises(td.NonFiniteError) as err:
        asyncio.run(main())
    _assert_origin(err.value.anomaly)
    (run_path,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    with open_run(run_path) as run:
        (stored,) = run.anomalies()
        assert (stored["step"], stored["op"], stored["phase"]) == (0, "SqrtBackward0", "backward")


def test_tensor_leaves_and_map_tensors_reach_into_plain_objects() -> None:
    a, b = torch.ones(1), torch.zeros(2)
    out = Output(a, b)
    assert [t is x for t, x in zip(tensor_leaves(out), [a, b])] == [True, True]
    new = map_tensors(out, lambda t: t + 1)
    assert type(new) is Output and new is not out
    assert new.loss.tolist() == [2.0] and new.logits.tolist() == [1.0, 1.0]
    assert out.loss.tolist() == [1.0]  # the original is untouched
    assert tensor_leaves(nn.Linear(2, 2)) == []  # a module's parameters are not an output
    assert tensor_leaves(math) == []


def test_a_plain_object_without_tensors_is_returned_as_is() -> None:
    class Empty:
        def __init__(self) -> None:
            self.name = "x"

    e = Empty()
    assert map_tensors(e, lambda t: t) is e

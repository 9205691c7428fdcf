"""Seed 002's ``AsyncTrainingLogger(enable_autograd_debug=True)``: checking is on for the training, and
warnings and errors are filed under the step they belong to."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from torch import nn

import torchdebug as td
from torchdebug.compat import AsyncTrainingLogger, TrainingPhase
from torchdebug.store import open_run


class SqrtHead(nn.Module):
    """A finite loss whose gradient is NaN: d sqrt(scale * |x|)/d scale = |x| / (2 sqrt(scale |x|)) = 0/0
    on a batch row whose first feature is 0."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + torch.sqrt(self.scale * x[:, :1].abs())


def test_enable_autograd_debug_stops_a_bad_gradient_and_files_it(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = SqrtHead()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(8, 4, generator=g) for _ in range(3)]
    batches[2][5, 0] = 0.0  # step 2: the gradient of scale is NaN, the loss stays finite

    async def debug_training_loop() -> Path:  # the seed's "Custom Training Loop with Debugging"
        logger = AsyncTrainingLogger(
            user_id=1, model_name="sqrt", enable_autograd_debug=True, run_dir=str(tmp_path)
        )
        path = logger.start_training(total_epochs=1, total_steps=3)
        try:
            for step, batch in enumerate(batches):
                try:
                    loss = model(batch).mean()
                    loss_info = await logger.check_tensor_anomalies_async(loss, "loss")
                    if loss_info["has_nan"] or loss_info["has_inf"]:
                        continue
                    if step == 1:
                        logger.log_warning("before this step's progress report", TrainingPhase.TRAINING)
                    loss.backward()
                    await logger.update_progress_async(epoch=0, step=step, loss=loss.item())
                    optimizer.step()
                    optimizer.zero_grad()
                except Exception as e:
                    logger.log_error(e, TrainingPhase.TRAINING, {"epoch": 0, "step": step})
                    raise
        finally:
            await asyncio.to_thread(logger.end_training)
        return path

    before: list[torch.Tensor] = []

    def snapshot(opt: object, args: object, kwargs: object) -> None:
        before[:] = [p.detach().clone() for p in model.parameters()]

    from torch.optim.optimizer import register_optimizer_step_post_hook

    h = register_optimizer_step_post_hook(snapshot)
    try:
        with pytest.raises(td.NonFiniteError) as err:
            asyncio.run(debug_training_loop())
    finally:
        h.remove()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # step 2 never updated
    a = err.value.anomaly  # replayed to its origin: sqrt at 0 in backward (Inf, then 0 * Inf = NaN)
    assert (a.phase, a.op, a.kind, a.step) == ("backward", "SqrtBackward0", "inf", 2)
    (run_path,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    with open_run(run_path) as run:
        (stored,) = run.anomalies()
        assert (stored["step"], stored["op"]) == (2, "SqrtBackward0")
        steps = {e["kind"]: e["step"] for e in run.events()}
        assert steps["warning"] == 1  # raised in step 1, before its progress report
        assert steps["error"] == 2
        assert run.series("loss").steps == [0, 1]
    from torch.nn.modules.module import _global_forward_pre_hooks
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    assert (
        not _global_forward_pre_hooks and not _global_optimizer_pre_hooks and not _global_optimizer_post_hooks
    )
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert torch._C._len_torch_function_stack() == 0  # end_training ran in a worker thread

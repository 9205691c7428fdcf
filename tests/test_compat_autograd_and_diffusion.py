"""Seed 002 (PyTorch debugging guide: ads generation), from its own usage examples."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchdebug as td
from torchdebug import (
    AsyncTrainingLogger,
    DebugLevel,
    DiffusionModelDebugger,
    PyTorchDebugger,
    TrainingDebugger,
    TrainingPhase,
)
from torchdebug.compat import debug_context
from torchdebug.store import open_run


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def test_basic_autograd_debugging() -> None:
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs = torch.randn(3, 4)
    with debug_context(DebugLevel.BASIC) as debugger:
        loss = model(inputs).sum()
        loss.backward()
        optimizer.step()
    assert debugger.anomalies == []
    debugger = PyTorchDebugger(DebugLevel.ADVANCED)
    before = [p.detach().clone() for p in model.parameters()]
    # the seed's block ran under torch.autograd.detect_anomaly: backward() raises, the update never runs
    with pytest.raises(td.NonFiniteError, match=r"aten\.log"), debugger.autograd_anomaly_detection(model):
        torch.log(model(inputs) - 100.0).sum().backward()
        optimizer.step()
    assert debugger.anomalies[0].op == "aten.log"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_training_debugger_summary() -> None:
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    debugger = TrainingDebugger(DebugLevel.ADVANCED)
    g = torch.Generator().manual_seed(0)
    for step in range(10):
        x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        step_info = debugger.monitor_training_step(model, loss, step)
        assert step_info["loss"] == pytest.approx(loss.item())
        optimizer.step()
    summary = debugger.get_training_summary()
    assert summary["total_steps"] == 10 and summary["anomaly_rate"] == 0.0
    assert f"Anomaly rate: {summary['anomaly_rate']:.2%}" == "Anomaly rate: 0.00%"


def test_tensor_and_gradient_analysis() -> None:
    debugger = PyTorchDebugger()
    my_tensor = torch.tensor([1.0, 3.0, math.nan])
    tensor_info = debugger.analyze_tensor(my_tensor, "my_tensor")
    assert tensor_info.has_nan is True and tensor_info.mean_value == 2.0
    model = _mlp()
    with torch.no_grad():
        model[2].bias.fill_(math.nan)
    param_analysis = debugger.analyze_model_parameters(model)
    assert [name for name, info in param_analysis.items() if info.has_nan] == ["2.bias"]
    model = _mlp()
    model(torch.randn(2, 4)).sum().backward()
    with torch.no_grad():
        model[0].weight.grad.mul_(1e3)  # 0.weight's gradient far above 10
    assert debugger.check_gradient_explosion(model, threshold=10.0) == ["0.weight"]
    model[2].bias.grad.zero_()
    assert "2.bias" in debugger.check_gradient_vanishing(model, threshold=1e-6)
    assert debugger.profile_memory_usage(model)["total"] == 2 * 4 * sum(p.numel() for p in model.parameters())


# -- diffusion: a tiny denoiser written here ------------------------------------------------------------


class TinyUNet(nn.Module):
    """Predicts noise from latents (B, 4, 8, 8) and a timestep."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(4, 8, 3, padding=1)
        self.time = nn.Linear(1, 8)
        self.conv_out = nn.Conv2d(8, 4, 3, padding=1)

    def forward(
        self, latents: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor
    ) -> torch.Tensor:
        h = self.conv_in(latents) + self.time(timestep.float().reshape(1, 1) / 1000)[..., None, None]
        h = h + encoder_hidden_states.mean(dim=1)[..., None, None]
        return self.conv_out(F.silu(h))


class TinyScheduler:
    timesteps = torch.tensor([999, 749, 499, 249])

    def step(self, noise_pred: torch.Tensor, t: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        return latents - 0.1 * noise_pred


class TinyPipeline:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.unet = TinyUNet()
        self.vae = nn.Conv2d(4, 3, 1)
        self.text_encoder = nn.Embedding(10, 8)
        self.scheduler = TinyScheduler()


def _denoise(debugger: DiffusionModelDebugger, pipeline: TinyPipeline, poison: dict[int, float]) -> list[Any]:
    latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    encoder_hidden_states = pipeline.text_encoder(torch.tensor([[1, 2, 3]]))
    infos = []
    with torch.no_grad():
        for step, timestep in enumerate(pipeline.scheduler.timesteps):
            noise_pred = pipeline.unet(latents, timestep, encoder_hidden_states)
            latents = pipeline.scheduler.step(noise_pred, timestep, latents)
            if step in poison:
                latents = latents * poison[step]
            infos.append(
                debugger.monitor_diffusion_step(
                    pipeline, step, latents, timestep=timestep, noise_pred=noise_pred
                )
            )
    return infos


def test_analyze_diffusion_pipeline() -> None:
    debugger = DiffusionModelDebugger(DebugLevel.BASIC)
    pipeline = TinyPipeline()
    pipeline_analysis = debugger.analyze_diffusion_pipeline(pipeline)
    # unet: conv_in 4*8*9+8=296, time 8+8=16, conv_out 8*4*9+4=292 -> 604; vae 4*3+3=15; text 10*8=80
    assert pipeline_analysis["total_parameters"] == 604 + 15 + 80
    assert pipeline_analysis["components"]["unet"]["parameters"] == 604
    assert pipeline_analysis["components"]["scheduler"] == {
        "type": "TinyScheduler", "parameters": 0, "trainable": 0, "dtypes": [], "devices": []
    }  # fmt: skip
    assert pipeline_analysis["dtypes"] == ["float32"] and pipeline_analysis["devices"] == ["cpu"]


def test_monitor_diffusion_steps_healthy_then_nan_and_collapse() -> None:
    pipeline = TinyPipeline()
    debugger = DiffusionModelDebugger(DebugLevel.BASIC)
    infos = _denoise(debugger, pipeline, poison={})
    assert [i["anomaly"] for i in infos] == [None] * 4 and all(not i["events"] for i in infos)
    first = infos[0]
    assert first["timestep"] == 999.0 and first["latents"]["nan_count"] == 0
    assert debugger.get_debug_summary()["diffusion_steps"] == 4

    collapsing = DiffusionModelDebugger(DebugLevel.BASIC)
    infos = _denoise(collapsing, pipeline, poison={2: 1e-5})
    (event,) = infos[2]["events"]
    assert (event.kind, event.step, event.evidence["timestep"]) == ("latent_collapse", 2, 499.0)
    assert collapsing.diffusion_anomalies == 1  # step 3 adds the denoiser output back: std recovers

    nan = DiffusionModelDebugger(DebugLevel.BASIC)
    with pytest.warns(td.TorchDebugWarning, match="non-finite latents") as caught:
        infos = _denoise(nan, pipeline, poison={1: math.nan})
    assert "non-finite latents at denoising step 1 (timestep 749)" in str(caught[0].message)
    assert infos[1]["anomaly"].step == 1 and infos[1]["latents"]["nan_count"] == 256
    assert nan.get_debug_summary()["total_anomalies"] == 3  # steps 1..3 carry the NaN on


def test_the_served_summary_counts_the_diffusion_debugger() -> None:
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    training = TrainingDebugger(DebugLevel.BASIC)
    training.diffusion_debugger = DiffusionModelDebugger(DebugLevel.BASIC)
    _denoise(training.diffusion_debugger, TinyPipeline(), poison={2: 1e-5})
    with td.serve(training, port=0) as h:
        s = httpx.get(f"{h.url}/training-logs/debug/summary", timeout=30).json()
    assert s["diffusion_debugger"] == {"total_anomalies": 1, "debug_history_length": 4}


# -- the async training logger ------------------------------------------------------------------------


def test_async_training_logger_does_not_block_the_loop(tmp_path: Path) -> None:
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    async def main() -> tuple[int, Path, list[dict[str, Any]]]:
        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        logger = AsyncTrainingLogger(
            user_id=123,
            model_name="microsoft/DialoGPT-medium",
            enable_autograd_debug=True,
            run_dir=str(tmp_path),
        )
        path = logger.start_training(total_epochs=1, total_steps=3)
        g = torch.Generator().manual_seed(0)
        infos = []
        for step in range(3):
            x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
            loss = F.mse_loss(model(x), y)
            if step == 2:
                loss = loss * math.nan
            loss_info = await logger.check_tensor_anomalies_async(loss, "loss")
            infos.append(loss_info)
            if loss_info["has_nan"] or loss_info["has_inf"]:
                logger.log_error(
                    ValueError("Loss contains NaN/Inf values"),
                    TrainingPhase.TRAINING,
                    {"epoch": 0, "step": step, "loss_info": loss_info},
                )
                continue
            loss.backward()
            gradient_info = await logger.check_gradient_anomalies_async(model)
            if gradient_info["params_with_nan_grad"] > 0:
                logger.log_warning(f"Gradient anomalies detected at step {step}", TrainingPhase.TRAINING)
            await logger.update_progress_async(
                epoch=0, step=step, loss=loss.item(), learning_rate=optimizer.param_groups[0]["lr"]
            )
            optimizer.step()
            optimizer.zero_grad()
        logger.log_warning("Loss tensor contains NaN values")
        await asyncio.to_thread(logger.end_training)
        stop.set()
        await task
        return ticks, path, infos

    ticks, path, infos = asyncio.run(main())
    assert ticks > 0  # the loop kept running while the logger worked
    assert [i["has_nan"] for i in infos] == [False, False, True]
    with open_run(path) as run:
        assert run.meta["config"]["user_id"] == 123
        assert run.series("loss").steps == [0, 1]
        assert run.series("lr/0").values == [0.05, 0.05]
        kinds = [(e["kind"], e["severity"]) for e in run.events()]
        assert kinds == [
            ("training_started", "info"),
            ("tensor_anomaly", "warning"),
            ("error", "error"),
            ("warning", "warning"),
        ]
        err = run.events("error")[0]
        assert err["message"] == "ValueError: Loss contains NaN/Inf values"
        assert err["data"]["phase"] == "training" and err["data"]["context"]["step"] == 2

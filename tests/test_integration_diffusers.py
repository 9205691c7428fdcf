"""A real diffusers UNet2DModel + DDPMScheduler (tiny, random weights, CPU): training under watch the
way diffusers' train_unconditional example writes it, and seed 002's DiffusionModelDebugger on a real
DDPMPipeline."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

diffusers = pytest.importorskip("diffusers", reason="diffusers is in the dev extras")

import torchdebug as td  # noqa: E402
from torchdebug import DiffusionModelDebugger  # noqa: E402

BAD = 2


def tiny_unet() -> diffusers.UNet2DModel:
    torch.manual_seed(0)
    return diffusers.UNet2DModel(
        sample_size=8,
        in_channels=1,
        out_channels=1,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        norm_num_groups=4,
    )


def images(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x = torch.rand(4, 1, 8, 8, generator=g) * 2 - 1
    return x


def train(
    unet: diffusers.UNet2DModel, steps: int, bad_pixel_at: int | None = None, **watch_kw: object
) -> td.Monitor:
    scheduler = diffusers.DDPMScheduler(num_train_timesteps=50)
    opt = torch.optim.AdamW(unet.parameters(), lr=1e-4)
    with td.watch(unet, opt, **watch_kw) as mon:  # type: ignore[arg-type]
        for step in range(steps):
            clean = images(step)
            if step == bad_pixel_at:
                clean[1, 0, 3, 5] = float("nan")  # a corrupt image from the data pipeline
            noise = torch.randn(clean.shape)
            t = torch.randint(0, scheduler.config.num_train_timesteps, (clean.shape[0],))
            noisy = scheduler.add_noise(clean, noise, t)
            pred = unet(noisy, t, return_dict=False)[0]
            loss = F.mse_loss(pred, noise)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
            opt.step()
            mon.step()
    return mon


def test_clean_unet_training_records_every_step_and_warns_nothing(tmp_path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mon = train(tiny_unet(), 4, run=tmp_path)
    assert [(r.step, r.anomaly, r.skipped) for r in mon.records] == [(s, None, False) for s in range(4)]
    assert all(r.loss is not None and r.grad_norm is not None and r.grad_norm > 0 for r in mon.records)


def test_a_nan_pixel_in_the_batch_is_named_as_the_input(tmp_path) -> None:
    unet = tiny_unet()
    with pytest.raises(td.NonFiniteError) as ei:
        train(unet, 4, bad_pixel_at=BAD, run=tmp_path)
    a = ei.value.anomaly
    assert (a.step, a.phase, a.kind) == (BAD, "input", "nan")
    assert all(torch.isfinite(p).all() for p in unet.parameters())  # the update never ran


def test_diffusion_debugger_reads_a_real_pipeline_and_flags_nan_latents() -> None:
    unet = tiny_unet()
    scheduler = diffusers.DDPMScheduler(num_train_timesteps=50)
    pipe = diffusers.DDPMPipeline(unet=unet, scheduler=scheduler)
    dbg = DiffusionModelDebugger()
    info = dbg.analyze_diffusion_pipeline(pipe)
    assert sorted(info["components"]) == ["scheduler", "unet"]
    assert info["components"]["unet"]["parameters"] == sum(p.numel() for p in unet.parameters())
    assert info["total_parameters"] == info["components"]["unet"]["parameters"]

    scheduler.set_timesteps(5)
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 1, 8, 8, generator=g)
    seen = []
    with torch.no_grad():
        for step, t in enumerate(scheduler.timesteps[:3]):
            noise_pred = unet(latents, t).sample
            out = dbg.monitor_diffusion_step(pipe, step, latents, timestep=t, noise_pred=noise_pred)
            seen.append(out["anomaly"])
            latents = scheduler.step(noise_pred, t, latents, generator=g).prev_sample
        latents[0, 0, 0, 0] = float("nan")
        with pytest.warns(
            td.TorchDebugWarning, match=r"non-finite latents at denoising step 3 \(timestep 10\)"
        ):
            out = dbg.monitor_diffusion_step(pipe, 3, latents, timestep=scheduler.timesteps[3])
    assert seen == [None, None, None]
    assert out["anomaly"] is not None and out["anomaly"].kind == "nan"
    assert out["latents"]["nan_count"] == 1

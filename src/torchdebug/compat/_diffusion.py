"""Seed 002's ``DiffusionModelDebugger``: a pipeline's components, and latent/noise health per denoising step."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..events import Anomaly, Phase, RuleEvent
from ._common import HISTORY_SIZE
from ._debugger import PyTorchDebugger, log


def _components(pipeline: Any) -> dict[str, Any]:
    """name -> component: diffusers' ``pipeline.components``, else module attributes, else children."""
    comps = getattr(pipeline, "components", None)
    if isinstance(comps, Mapping):
        return {str(k): v for k, v in comps.items() if v is not None}
    found = {k: v for k, v in vars(pipeline).items() if isinstance(v, nn.Module) and not k.startswith("_")}
    if not found and isinstance(pipeline, nn.Module):
        found = dict(pipeline.named_children()) or {type(pipeline).__name__: pipeline}
    sched = getattr(pipeline, "scheduler", None)
    if sched is not None and "scheduler" not in found:
        found["scheduler"] = sched
    return found


class DiffusionModelDebugger(PyTorchDebugger):
    """Seed 002's diffusion debugger over the engine's statistics, with the seed's calls.

    ``analyze_diffusion_pipeline(pipeline)`` lists components (parameters, dtypes, devices);
    ``monitor_diffusion_step(pipeline, step, latents, timestep=, noise_pred=)`` reads latent and noise
    statistics in one host transfer per step and flags NaN/Inf (with step and timestep) and a
    collapse or explosion of the latent std relative to the first monitored step of the run
    (``collapse_ratio``, ``explode_ratio``). A pipeline is any object whose modules are attributes
    (``unet``, ``vae``, ``text_encoder`` ...), a ``diffusers`` pipeline (its ``components``), or
    an ``nn.Module``.

    Args:
        config: as ``PyTorchDebugger`` (a ``DebugLevel`` in the seed).
        collapse_ratio: latent std below this fraction of the first step's std is a collapse.
        explode_ratio: latent std above this multiple of the first step's std is an explosion.

    Example::

        debugger = DiffusionModelDebugger(DebugLevel.BASIC)
        print(debugger.analyze_diffusion_pipeline(pipeline)["total_parameters"])
        for step, t in enumerate(timesteps):
            noise_pred = pipeline.unet(latents, t)
            latents = scheduler_step(noise_pred, t, latents)
            info = debugger.monitor_diffusion_step(pipeline, step, latents, timestep=t, noise_pred=noise_pred)

    Cost per step: a few reductions over the latents (and noise prediction), one host transfer.
    """

    def __init__(
        self, config: Any = None, *, collapse_ratio: float = 1e-3, explode_ratio: float = 1e2, **kwargs: Any
    ) -> None:
        super().__init__(config, **kwargs)
        if not 0 < collapse_ratio < 1 < explode_ratio:
            raise ValueError(
                f"need 0 < collapse_ratio < 1 < explode_ratio, got {collapse_ratio}, {explode_ratio}"
            )
        self.collapse_ratio = collapse_ratio
        self.explode_ratio = explode_ratio
        self.diffusion_history: deque[dict[str, Any]] = deque(maxlen=HISTORY_SIZE)
        self.diffusion_events: deque[RuleEvent] = deque(maxlen=HISTORY_SIZE)
        self._first_std: float | None = None
        self.diffusion_steps = 0
        self.diffusion_anomalies = 0

    def analyze_diffusion_pipeline(self, pipeline: Any) -> dict[str, Any]:
        """Components with their parameter counts, dtypes and devices (shared parameters count once).

        Returns:
            ``{"components": {name: {"type", "parameters", "trainable", "dtypes", "devices"}},
            "total_parameters", "trainable_parameters", "dtypes", "devices", "pipeline_type"}``.
            Non-module components (a scheduler, a tokenizer) are listed with their type and 0 parameters.

        Cost: metadata only.
        """
        seen: set[int] = set()
        comps: dict[str, Any] = {}
        total = trainable = 0
        dtypes: set[str] = set()
        devices: set[str] = set()
        for name, comp in _components(pipeline).items():
            params = list(comp.parameters()) if isinstance(comp, nn.Module) else []
            own = [p for p in params if id(p) not in seen]
            seen.update(id(p) for p in own)
            n = sum(p.numel() for p in own)
            t = sum(p.numel() for p in own if p.requires_grad)
            d = sorted({str(p.dtype).removeprefix("torch.") for p in params})
            v = sorted({str(p.device) for p in params})
            comps[name] = {
                "type": type(comp).__name__,
                "parameters": n,
                "trainable": t,
                "dtypes": d,
                "devices": v,
            }
            total += n
            trainable += t
            dtypes.update(d)
            devices.update(v)
        return {
            "pipeline_type": type(pipeline).__name__,
            "components": comps,
            "total_parameters": total,
            "trainable_parameters": trainable,
            "dtypes": sorted(dtypes),
            "devices": sorted(devices),
        }

    def monitor_diffusion_step(
        self,
        pipeline: Any,
        step: int,
        latents: torch.Tensor,
        *,
        timestep: Any = None,
        noise_pred: torch.Tensor | None = None,
    ) -> dict[str, Any]:
        """Check one denoising step: latent (and noise prediction) statistics, NaN/Inf, std collapse/explosion.

        Returns:
            ``{"step", "timestep", "latents": {"mean", "std", "min", "max", "nan_count", "inf_count"},
            "noise_pred": {...} or None, "anomaly": Anomaly | None, "events": [RuleEvent]}``.

        Raises:
            NonFiniteError: ``anomaly_detection_mode="raise"`` and the latents or noise hold a NaN/Inf.
            TypeError: ``latents`` is not a floating tensor.
        """
        if not isinstance(latents, torch.Tensor) or not latents.is_floating_point():
            raise TypeError(f"latents must be a floating tensor, got {type(latents).__name__}")
        t = (
            float(timestep)
            if isinstance(timestep, (int, float))
            else (
                float(timestep.reshape(-1)[0])
                if isinstance(timestep, torch.Tensor) and timestep.numel()
                else None
            )
        )
        with self._context("diffusion_step", type(pipeline).__name__, batch=int(step)) as info:
            tensors = {"latents": latents} | ({"noise_pred": noise_pred} if noise_pred is not None else {})
            stats = _stats(tensors)  # one host transfer
            out: dict[str, Any] = {
                "step": step,
                "timestep": t,
                **stats,
                "anomaly": None,
                "events": info.events,
            }
            out.setdefault("noise_pred", None)
            self.diffusion_steps += 1
            bad = [k for k, s in stats.items() if s["nan_count"] or s["inf_count"]]
            if bad:
                self.diffusion_anomalies += 1
                kind = "nan" if any(stats[k]["nan_count"] for k in bad) else "inf"
                anomaly = Anomaly(
                    phase=Phase.FORWARD.value,
                    module="",
                    op=None,
                    location=None,
                    kind=kind,
                    step=int(step),
                    module_type=type(pipeline).__name__,
                    symptom=f"non-finite {' and '.join(bad)} at denoising step {step}"
                    + (f" (timestep {t:g})" if t is not None else ""),
                    detected_by="sentinel (no replay)",
                    hint="trace one denoiser call with debugger.autograd_anomaly_detection(pipeline.unet)",
                )
                out["anomaly"] = anomaly
                self._report(info, anomaly)
            else:
                std = stats["latents"]["std"]
                if self._first_std is None:
                    self._first_std = std
                elif self._first_std > 0:
                    ratio = std / self._first_std
                    trend: str | None = (
                        "latent_collapse"
                        if ratio < self.collapse_ratio
                        else ("latent_explosion" if ratio > self.explode_ratio else None)
                    )
                    if trend is not None:
                        self.diffusion_anomalies += 1
                        ev = RuleEvent(
                            trend,
                            int(step),
                            f"latent std {std:.3g} is {ratio:.3g}x the first step's {self._first_std:.3g}"
                            + (f" (timestep {t:g})" if t is not None else ""),
                            "warning",
                            evidence={
                                "std": std,
                                "first_std": self._first_std,
                                "ratio": ratio,
                                "timestep": t,
                            },
                        )
                        info.events.append(ev)
                        info.anomaly_detected = True
                        self.diffusion_events.append(ev)
                        log.warning("%s", ev)
            self.diffusion_history.append({k: v for k, v in out.items() if k not in ("anomaly", "events")})
        return out

    def get_debug_summary(self) -> dict[str, Any]:
        """``PyTorchDebugger.get_debug_summary()`` plus ``diffusion_steps`` and ``diffusion_anomalies``."""
        s = super().get_debug_summary()
        s.update(diffusion_steps=self.diffusion_steps, diffusion_anomalies=self.diffusion_anomalies)
        s["total_anomalies"] = self.diffusion_anomalies
        return s

    def clear_debug_history(self) -> None:
        """Also forget the diffusion history, counters and the first step's std."""
        super().clear_debug_history()
        self.diffusion_history.clear()
        self.diffusion_events.clear()
        self._first_std = None
        self.diffusion_steps = self.diffusion_anomalies = 0


def _stats(tensors: Mapping[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """mean/std/min/max over finite values and NaN/Inf counts of each tensor, in one host transfer."""
    rows = []
    for x in tensors.values():
        f = x.detach().float()
        fin = torch.isfinite(f)
        n = fin.sum().clamp_min(1)
        z = torch.where(fin, f, 0.0)
        mean = z.sum() / n
        var = (torch.where(fin, f - mean, 0.0) ** 2).sum() / (n - 1).clamp_min(1)
        big = torch.finfo(torch.float32).max
        rows.append(
            torch.stack(
                [
                    mean,
                    var.sqrt(),
                    torch.where(fin, f, big).min(),
                    torch.where(fin, f, -big).max(),
                    torch.isnan(f).sum().float(),
                    (torch.isinf(f)).sum().float(),
                ]
            ).to(next(iter(tensors.values())).device)
        )
    host = torch.stack(rows).tolist()  # one transfer
    out = {}
    for name, (mean, std, lo, hi, nan, inf) in zip(tensors, host):
        out[name] = {
            "mean": mean,
            "std": std,
            "min": lo if math.isfinite(lo) and abs(lo) < 3e38 else None,
            "max": hi if math.isfinite(hi) and abs(hi) < 3e38 else None,
            "nan_count": int(nan),
            "inf_count": int(inf),
        }
    return out


__all__ = ["DiffusionModelDebugger"]

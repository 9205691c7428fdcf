"""Device placement (seed 000's debug_device_placement): devices of parameters, buffers and inputs; a mix flagged."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from .._step import SessionView
from .._trees import named_inputs
from ..events import RuleEvent

_NAMES_PER_DEVICE = 5


def cuda_info() -> dict[str, Any] | None:
    """The current CUDA device's name, capability, total and allocated memory (bytes); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    idx = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(idx)
    return {
        "index": idx,
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "total_memory": int(props.total_memory),
        "allocated": int(torch.cuda.memory_allocated(idx)),
        "device_count": torch.cuda.device_count(),
    }


class DevicePlacementInstrument:
    """Records where the model's parameters and buffers live and where the first step's inputs are.

    One ``device_placement`` event (info) at the first forward with the counts per device, a few
    names per device, and ``cuda`` (name, capability, memory) when CUDA is present; a
    ``device_mix`` warning when parameters, buffers and inputs are not all on one device.
    Cost: metadata only, once per session.
    """

    name = "device_placement"

    def __init__(self) -> None:
        self.placement: dict[str, Any] = {}
        self._done = False

    def install(self, mon: SessionView) -> None:
        self._params = [(n, str(p.device)) for n, p in mon.model.named_parameters()]
        self._buffers = [(n, str(b.device)) for n, b in mon.model.named_buffers()]

    def on_forward_start(
        self, mon: SessionView, module: Any = None, args: Any = None, kwargs: Any = None
    ) -> None:
        if self._done:
            return
        self._done = True
        inputs = [(n, str(t.device)) for n, t in named_inputs(tuple(args or ()), kwargs or {})]
        groups = {"parameters": self._params, "buffers": self._buffers, "inputs": inputs}
        self.placement = {
            kind: {
                dev: {"count": n, "names": [name for name, d in items if d == dev][:_NAMES_PER_DEVICE]}
                for dev, n in sorted(Counter(d for _, d in items).items())
            }
            for kind, items in groups.items()
        }
        self.placement["cuda"] = cuda_info()
        devices = sorted({d for items in groups.values() for _, d in items})
        step = mon.global_step
        where = "; ".join(
            kind + " on " + ", ".join(f"{dev} ({v['count']})" for dev, v in by.items())
            for kind, by in self.placement.items()
            if kind != "cuda" and by
        )
        mon.emit(RuleEvent("device_placement", step, where, "info", evidence=dict(self.placement)))
        if len(devices) > 1:
            mon.emit(
                RuleEvent(
                    "device_mix",
                    step,
                    f"tensors on {len(devices)} devices ({', '.join(devices)}): {where}. Move the model and "
                    "its inputs to one device (model.to(device), x.to(device))",
                    "warning",
                    evidence={"devices": devices, **{k: v for k, v in self.placement.items() if k != "cuda"}},
                )
            )

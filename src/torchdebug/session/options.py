"""``watch()``'s arguments checked at once: each bad one raises an error that names the fix."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from .._config import DebugConfig, check_path, coerce_config
from .._errors import ConfigError
from .._tensors import unwrap_optimizer

POLICIES = ("raise", "warn", "skip")
SYNCS = ("blocking", "async")


def check_options(
    model: Any,
    optimizer: Any,
    policy: str | None,
    scaler: Any,
    run: Any,
    config: Any,
    tensorboard: bool | str | None,
    clip_on_spike: float | None,
    on_oom: str | None,
    report_to: Any,
    announce: bool | None,
    sync: str | None,
) -> tuple[DebugConfig, list[Any]]:
    """The session's config (``config`` with the keyword overrides) and the sink objects of
    ``report_to``. Raises TypeError / ValueError / ConfigError naming the fix, ImportError naming the
    extra of a missing tracker library."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"watch(model, ...): model must be a torch.nn.Module, got {type(model).__name__}")
    optimizer = unwrap_optimizer(optimizer)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"watch(..., optimizer=): expected a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    cfg = coerce_config(config)
    changes: dict[str, Any] = {}
    if policy is not None:
        if not isinstance(policy, str) or policy.lower() not in POLICIES:
            raise ValueError(f"watch(..., policy={policy!r}): policy must be one of {', '.join(POLICIES)}")
        changes["policy"] = policy.lower()
    if tensorboard is not None:
        changes["tensorboard"] = tensorboard
    if clip_on_spike is not None:
        changes["clip_on_spike"] = clip_on_spike
    if on_oom is not None:
        changes["on_oom"] = on_oom
    sink_objects: list[Any] = []  # Sink objects / SummaryWriters given in report_to
    if report_to is not None:
        items = [report_to] if isinstance(report_to, str) else report_to
        if not isinstance(items, (list, tuple)):
            items = [items]
        changes["report_to"] = [i for i in items if isinstance(i, str)]
        sink_objects = [i for i in items if not isinstance(i, str)]
    if announce is not None:
        changes["announce"] = announce
    if sync is not None:
        if not isinstance(sync, str) or sync.lower() not in SYNCS:
            raise ValueError(f"watch(..., sync={sync!r}): sync must be one of {', '.join(SYNCS)}")
        changes["sync"] = sync.lower()
    cfg_out: DebugConfig = cfg.replace(**changes) if changes else cfg
    if cfg_out.report_to or cfg_out.tensorboard or sink_objects:
        from ..sinks import as_sink, require, resolve_names

        if run is False or (run is None and not cfg_out.store):
            raise ConfigError(
                "report_to / tensorboard send the run's records as the run folder gets them, so they "
                "need the run store: drop run=False (or store=False), or drop report_to"
            )
        resolve_names(cfg_out.report_to)  # a missing library: ImportError naming the extra, now
        if cfg_out.tensorboard:
            require("tensorboard")
        for obj in sink_objects:
            as_sink(obj)  # a TypeError for anything else, now
    if scaler is not None and not all(hasattr(scaler, a) for a in ("scale", "step", "update")):
        raise TypeError(f"watch(..., scaler=): expected a torch.amp.GradScaler, got {type(scaler).__name__}")
    if isinstance(run, (str, bytes, os.PathLike)):
        check_path(os.fspath(run), "run")  # a NUL byte would only fail later, inside the user's `with`
    return cfg_out, sink_objects

"""``watch()``'s arguments checked at once: each bad one raises an error that names the fix."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .._config import DebugConfig, check_path, coerce_config
from .._errors import ConfigError
from .._tensors import unwrap_optimizer

POLICIES = ("raise", "warn", "skip")
SYNCS = ("blocking", "async", "auto")


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
    on_spike: str | None = None,
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
            raise ConfigError(f"watch(..., policy={policy!r}): policy must be one of {', '.join(POLICIES)}")
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
    if on_spike is not None:
        changes["on_spike"] = on_spike  # checked by DebugConfig (allowed values listed)
    if sync is not None:
        if not isinstance(sync, str) or sync.lower() not in SYNCS:
            raise ConfigError(f"watch(..., sync={sync!r}): sync must be one of {', '.join(SYNCS)}")
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


def gather_models(
    model: Any, optimizer: Any, caller: Any = None
) -> tuple[nn.Module, dict[str, nn.Module] | None, list[torch.optim.Optimizer]]:
    """What ``watch`` watches: the model the session names (one module, or an ``nn.ModuleDict`` of
    several), the models by name when there are several (their forwards are the step's roots), and
    the optimizers given (unwrapped; empty: every optimizer that steps the parameters is adopted).

    Several models: a list or tuple (named after the caller's variables holding them, else their
    class names), a dict or an ``nn.ModuleDict`` (named by its keys). One model in a list is one model.
    Raises TypeError / ValueError naming the fix; ConfigError for a TorchScript model (no hooks).
    """
    roots: dict[str, nn.Module] | None = None
    if isinstance(model, nn.ModuleDict):
        if len(model) == 0:
            raise ValueError("watch(nn.ModuleDict()): the ModuleDict holds no model; put the models in it")
        roots = dict(model.items())  # a ModuleDict's own forward never runs: its models are called
    elif isinstance(model, Mapping):
        bad = [k for k, m in model.items() if not isinstance(m, nn.Module) or not isinstance(k, str)]
        if bad or not model:
            raise TypeError(
                "watch({name: model, ...}): give a dict of str -> torch.nn.Module, e.g. {'G': G, 'D': D}"
            )
        roots = dict(model)
    elif isinstance(model, (list, tuple)):
        if not model or not all(isinstance(m, nn.Module) for m in model):
            got = ", ".join(type(m).__name__ for m in model) or "nothing"
            raise TypeError(f"watch([models], ...): expected torch.nn.Module objects, got {got}")
        if len(model) > 1:
            roots = dict(zip(_names(list(model), caller), model))
        else:
            model = model[0]
    elif not isinstance(model, nn.Module):
        raise TypeError(f"watch(model, ...): model must be a torch.nn.Module, got {type(model).__name__}")
    for name, m in (roots or {"": model}).items():
        if isinstance(m, torch.jit.ScriptModule):
            raise ConfigError(_scripted_message(name, m))
    if roots is not None:
        if len({id(m) for m in roots.values()}) < len(roots):
            raise ValueError("watch([models]): the same model is given twice; give each model once")
        model = model if isinstance(model, nn.ModuleDict) else nn.ModuleDict(roots)
    opts = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    optimizers = [unwrap_optimizer(o) for o in opts if o is not None]
    for o in optimizers:
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(
                f"watch(..., optimizer=): expected a torch.optim.Optimizer, got {type(o).__name__}"
            )
    if len({id(o) for o in optimizers}) < len(optimizers):
        raise ValueError("watch(..., [optimizers]): the same optimizer is given twice; give each once")
    return model, roots, optimizers


def _scripted_message(name: str, model: nn.Module) -> str:
    """Why a TorchScript model cannot be watched, and the three ways that work."""
    what = f"model {name!r}" if name else "the model"
    return (
        f"watch(): {what} is a TorchScript module ({type(model).__name__}, from torch.jit.script or "
        "torch.jit.trace), and torch allows no Python hooks on one, which watch needs. Watch the eager "
        "module instead: train the nn.Module under td.watch(model) and script it once training is done "
        "(a scripted copy shares its parameters); or use torch.compile(model), which watch supports; or "
        "trace a block op by op, which works on a scripted model: "
        "with td.PyTorchDebugger(debug_mode=td.DebugMode.FULL_DEBUG).debug_context('step'): ..."
    )


def _names(models: list[nn.Module], caller: Any) -> list[str]:
    """Names for several models: the caller's variables that hold them (``watch([G, D])`` -> G, D),
    else their class names (numbered when two share one)."""
    names: list[str | None] = [None] * len(models)
    if caller is not None:
        for scope in (caller.f_locals, caller.f_globals):
            for var, value in list(scope.items()):
                for i, m in enumerate(models):
                    if value is m and names[i] is None and not var.startswith("_") and var not in names:
                        names[i] = var
    out: list[str] = []
    for i, m in enumerate(models):
        name = names[i] or type(m).__name__
        base, k = name, 2
        while name in out or name in names[i + 1 :]:
            name, k = f"{base}_{k}", k + 1
        out.append(name)
    return out

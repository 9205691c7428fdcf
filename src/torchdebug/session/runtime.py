"""Runtime control of a live ``watch()`` session (seed 000's names): enable_debugging, disable_debugging, status."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from .._config import INSTRUMENTS_BY_SWITCH, DebugMode
from .control import Controls

# Seed 000's option names (``engine.enable_debugging(['memory_usage', 'gradient_norms'])``) and the
# DebugConfig switch each one is. ``enable_debugging()`` with no names turns on the debug_* ten.
DEBUG_OPTIONS: dict[str, str] = {
    name: f"debug_{name}"
    for name in (
        "memory_usage",
        "gradient_norms",
        "forward_pass",
        "backward_pass",
        "device_placement",
        "mixed_precision",
        "data_loading",
        "validation",
        "early_stopping",
        "lr_scheduling",
    )
}
EXTRA_OPTIONS: dict[str, str] = {
    "autograd_anomaly": "enable_autograd_anomaly",
    "autograd_profiler": "enable_autograd_profiler",
    "tensorboard_profiler": "enable_tensorboard_profiler",
}
_ALL = {**DEBUG_OPTIONS, **EXTRA_OPTIONS}


class Reconfigurable(Protocol):
    """What the runtime switches need of a session: its config and ``reconfigure``."""

    config: Any
    instruments: list[Any]
    controls: Controls  # the changes asked for and not yet applied

    def reconfigure(self, **changes: Any) -> Any: ...


def _fields(options: str | Iterable[str] | None) -> list[str]:
    if options is None:
        return list(DEBUG_OPTIONS.values())
    names = [options] if isinstance(options, str) else list(options)
    out = []
    for name in names:
        key = str(name).strip().lower().removeprefix("debug_").removeprefix("enable_")
        if key not in _ALL:
            raise ValueError(f"unknown debugging option {name!r}; allowed: {', '.join(_ALL)}")
        out.append(_ALL[key])
    return out


def enable_debugging(mon: Reconfigurable, options: str | Iterable[str] | None = None) -> dict[str, Any]:
    """Switch seed-000 debugging options on in a live session (all ten ``debug_*`` when ``options`` is None).

    The change is validated now and applied at the end of the next ``mon.step()`` on the training
    thread (instruments are rebuilt there), and recorded as a ``config_change`` event in the run.

    Args:
        mon: the ``Monitor`` of ``td.watch``.
        options: names as in the seed (``"memory_usage"``, ``"gradient_norms"``, ... also
            ``"autograd_anomaly"``, ``"autograd_profiler"``, ``"tensorboard_profiler"``); the
            ``debug_`` prefix is optional.

    Returns:
        ``get_debugging_status(mon)`` as it will be after the next step.

    Raises:
        ValueError: an unknown option name (lists the allowed ones).

    Example::

        with td.watch(model, opt) as mon:
            mon.enable_debugging(["memory_usage", "gradient_norms"])
    """
    mon.reconfigure(**dict.fromkeys(_fields(options), True))
    return get_debugging_status(mon)


def disable_debugging(mon: Reconfigurable, options: str | Iterable[str] | None = None) -> dict[str, Any]:
    """Switch options off at the next step boundary; with no ``options`` everything goes off.

    "Everything" is mode ``none`` and every instrument switch off: no instrument runs afterwards
    (the session still counts steps). Returns the status after the next step.
    """
    if options is None:
        changes: dict[str, Any] = dict.fromkeys(INSTRUMENTS_BY_SWITCH, False)
        changes["mode"] = DebugMode.NONE
    else:
        changes = dict.fromkeys(_fields(options), False)
    mon.reconfigure(**changes)
    return get_debugging_status(mon)


def get_debugging_status(mon: Reconfigurable) -> dict[str, Any]:
    """The seed-000 options on/off (as they will be after pending changes) and the instruments.

    Returns:
        ``{"memory_usage": bool, ..., "autograd_anomaly": bool, ..., "mode": str, "level": str,
        "instruments": [names the config runs], "running": [names running now], "pending": bool}``.
    """
    pending = dict(mon.controls.pending_changes)
    cfg = mon.config.replace(**pending) if pending else mon.config
    status: dict[str, Any] = {name: bool(getattr(cfg, field)) for name, field in _ALL.items()}
    status.update(
        mode=cfg.mode.value,
        level=cfg.level.value,
        instruments=sorted(cfg.instruments()),
        running=sorted(getattr(i, "name", type(i).__name__) for i in mon.instruments),
        pending=bool(pending),
    )
    return status


__all__ = ["DEBUG_OPTIONS", "disable_debugging", "enable_debugging", "get_debugging_status"]

"""What both framework callbacks share: checking watch() keyword arguments early, opening and closing a session."""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from ..session.monitor import Monitor, watch
from ..session.options import POLICIES
from ..session.wrappers import framework_ddp

_FRAMEWORK_OWNED = ("model", "optimizer")


def check_watch_kwargs(owner: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Reject what the framework supplies itself and unknown names at construction, not at fit start."""
    allowed = [n for n in inspect.signature(watch).parameters if n not in _FRAMEWORK_OWNED]
    for key in kwargs:
        if key in _FRAMEWORK_OWNED:
            raise TypeError(
                f"{owner}({key}=...): the trainer supplies the {key}; pass only watch() options: "
                + ", ".join(allowed)
            )
        if key not in allowed:
            raise TypeError(f"{owner}({key}=...): unknown option; allowed: {', '.join(allowed)}")
    policy = kwargs.get("policy")
    if policy is not None and (not isinstance(policy, str) or policy.lower() not in POLICIES):
        raise ValueError(f"{owner}(policy={policy!r}): policy must be one of {', '.join(POLICIES)}")
    return dict(kwargs)


def open_session(
    model: nn.Module | dict[str, nn.Module],
    driver: str,
    kwargs: dict[str, Any],
    name: str | None = None,
    wrapper: Any = None,
) -> Monitor:
    """Start watch() on ``model`` (or several models by name) with ``driver`` owning the step protocol;
    ``name``: the run's name unless the options give one (several models would be named "moduledict");
    ``wrapper``: what the framework calls, which may be a ``DistributedDataParallel`` around ``model``
    (:func:`~torchdebug.session.wrappers.framework_ddp`)."""
    mon = watch(model, **kwargs)
    if name is not None and mon.config.run_name is None:
        mon.config = mon.config.replace(run_name=name.lower())
    if mon._ddp is None and isinstance(model, nn.Module):
        # the coordinator (made at __enter__) takes it as if watch() had been given DDP(model)
        mon._ddp = framework_ddp(wrapper, mon.model)
    mon.driver = driver  # the plain-loop optimizer hooks stand down; the callback calls update_*()
    mon.__enter__()
    return mon


def close_session(mon: Monitor | None, exc: BaseException | None) -> None:
    """End the session: run status "finished", or "failed" with ``exc``; idempotent."""
    if mon is None or mon.closed:
        return
    mon.__exit__(type(exc) if exc is not None else None, exc, exc.__traceback__ if exc is not None else None)

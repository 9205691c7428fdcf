"""Weights, or optimizer state, that are already non-finite when a session starts (a NaN checkpoint):
said before the model is used, evaluated or saved again, not at the first training step (where a NaN
in a loaded ``exp_avg`` would already have written NaN into the weights).

The sentinel turns the anomaly into a verdict (:meth:`~torchdebug.nonfinite.sentinel.Sentinel.check_at_start`,
once per session); the session applies it as the session starts and from a ``load_state_dict``
post-hook on the model (``session/verdicts.py``: ``Verdicts.check_weights``).
"""

from __future__ import annotations

import math

import torch

from .._step import SessionView
from .._tensors import finite_probe, local, optimizer_state_tensors, stored_values
from ..events import Anomaly, Phase
from ..stats import analyze_tensor


def loaded_anomaly(mon: SessionView, when: str = "when the session started") -> Anomaly | None:
    """The anomaly of parameters that hold NaN/Inf as the session starts, or None; with finite
    parameters, the anomaly of the optimizers' loaded state (:func:`loaded_state_anomaly`).

    One finiteness probe of every parameter on the device and one host read, once per session; the
    exact counts are read only for the parameters it flags.
    """
    return _weights_anomaly(mon, when) or loaded_state_anomaly(mon, when)


def _weights_anomaly(mon: SessionView, when: str) -> Anomaly | None:
    # the parameters that hold data (not on the meta device: nothing to read, and nothing to use yet)
    index = [i for i, p in enumerate(mon.params) if local(p).device.type != "meta"]
    params = [mon.params[i] for i in index]
    if not params:
        return None
    with torch.no_grad():
        probe = finite_probe(params).tolist()  # one host read, at session start only
    if all(map(math.isfinite, probe)):
        return None
    # a probe is a sum (it overflows on huge finite weights): confirmed exactly for those it flags
    bad = [
        i
        for i, x in enumerate(probe)
        if not math.isfinite(x) and not bool(torch.isfinite(stored_values(local(params[i].detach()))).all())
    ]
    if not bad:
        return None
    names = [mon.param_names[index[i]] for i in bad]
    first = names[0]
    t = local(params[bad[0]].detach())
    nan = int(torch.isnan(t).sum())
    inf = int(torch.isinf(t).sum())
    kind = "nan" if nan else ("inf" if bool(torch.isposinf(t).any()) else "-inf")
    owner = first.rpartition(".")[0]
    mod = mon.model.get_submodule(owner) if owner else mon.model
    more = f" (+{len(names) - 1} more parameters: {', '.join(names[1:4])}{', ...' if len(names) > 4 else ''})"
    return Anomaly(
        phase=Phase.PARAMETER.value,
        module=owner,
        op=None,
        location=None,
        kind=kind,
        step=mon.global_step,
        rank=mon.rank,
        tensor=analyze_tensor(t, first),
        module_type=type(mod).__name__,
        symptom=f"{kind} in {first} {when}" + (more if len(names) > 1 else ""),
        detected_by="sentinel",
        hint=(
            f"{first} already holds {nan} NaN / {inf} Inf {when}, before any use: loaded from a bad "
            "checkpoint or written before watch(); the model's outputs, and any checkpoint saved from "
            "it, will be non-finite"
        ),
        parameter=first,
    )


def loaded_state_anomaly(mon: SessionView, when: str = "when the session started") -> Anomaly | None:
    """The anomaly of optimizer state that holds NaN/Inf (``exp_avg`` of a poisoned checkpoint), or None.

    At session start and after an optimizer's ``load_state_dict``: one probe over every floating state
    tensor and one host read (a Python walk of the state, once: not on the step's path). The first
    flagged entry, in parameter order, is named with its parameter and key.
    """
    names = {id(p): n for p, n in zip(mon.params, mon.param_names)}
    entries = optimizer_state_tensors(mon.optimizers, names)  # (optimizer, parameter, key, tensor)
    if not entries:
        return None
    with torch.no_grad():
        probe = finite_probe([local(t) for *_, t in entries]).tolist()  # one host read, rare path
    bad = [
        e
        for e, x in zip(entries, probe)
        if not math.isfinite(x) and not bool(torch.isfinite(local(e[3].detach())).all())
    ]
    if not bad:
        return None
    opt, first, key, t = bad[0]
    t = local(t.detach())
    nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
    kind = "nan" if nan else ("inf" if bool(torch.isposinf(t).any()) else "-inf")
    owner = first.rpartition(".")[0]
    mod = mon.model.get_submodule(owner) if owner and first != "?" else mon.model
    others = [f"{n} ({k})" for _, n, k, _ in bad[1:4]]
    more = f" (+{len(bad) - 1} more: {', '.join(others)}{', ...' if len(bad) > 4 else ''})" if others else ""
    cls = type(opt).__name__
    return Anomaly(
        phase=Phase.OPTIMIZER.value,
        module=owner,
        op=f"loaded optimizer state {key!r} ({cls})",
        location=None,
        kind=kind,
        step=mon.global_step,
        rank=mon.rank,
        tensor=analyze_tensor(t, f"{first}.{key}"),
        module_type=type(mod).__name__,
        symptom=f"{kind} in the loaded optimizer state of {first} ({key}) {when}{more}",
        detected_by="sentinel",
        hint=(
            f"the loaded optimizer state {key!r} of {first} holds {nan} NaN / {inf} Inf {when}, while the "
            f"weights are finite: loaded from a bad checkpoint (optimizer.load_state_dict); "
            f"{state_effect(cls + '.step', first, key, kind)}. Reset the optimizer state or load an "
            "earlier checkpoint"
        ),
        parameter=first,
    )


def state_effect(update: str, param: str, key: str, kind: str) -> str:
    """What a non-finite state entry does to the update of its parameter, in words."""
    if kind == "inf" and key.endswith("_sq"):  # a second moment at +Inf: m / (sqrt(inf) + eps) = 0
        return f"the update of {param} is 0 from here: its weights are frozen"
    return f"the next {update} writes non-finite values into {param}"

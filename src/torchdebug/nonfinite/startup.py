"""Weights that are already non-finite when a session starts (a NaN checkpoint): said before the model
is used, evaluated or saved again, not at the first training step.

The sentinel turns the anomaly into a verdict (:meth:`~torchdebug.nonfinite.sentinel.Sentinel.check_at_start`,
once per session); the session applies it as the session starts and from a ``load_state_dict``
post-hook on the model (``session/verdicts.py``: ``Verdicts.check_weights``).
"""

from __future__ import annotations

import math

import torch

from .._step import SessionView
from .._tensors import finite_probe, local, stored_values
from ..events import Anomaly, Phase
from ..stats import analyze_tensor


def loaded_anomaly(mon: SessionView, when: str = "when the session started") -> Anomaly | None:
    """The anomaly of parameters that hold NaN/Inf as the session starts, or None.

    One finiteness probe of every parameter on the device and one host read, once per session; the
    exact counts are read only for the parameters it flags.
    """
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

"""The sentinel's rare path: the anomaly of a bad step, replayed to its origin, or its symptom.

Runs only when a step's numbers read non-finite (once per session for the replay): re-runs the
failing micro-step under op-level tracing (:func:`torchdebug.nonfinite.locate.replay_capture`) with
the step's batch, weights, buffers and RNG state, and builds the :class:`~torchdebug.events.Anomaly`
the session records. The per-step path is :mod:`torchdebug.nonfinite.sentinel`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Protocol

import torch

from .._step import SessionView
from .._tensors import local
from ..events import Anomaly, Phase
from .locate import replay_capture


class Replaying(Protocol):
    """Who holds the "a replay is running" flag (the sentinel)."""

    replaying: bool


def optimizer_anomaly(
    mon: SessionView, bad: list[str], step: int | None, ranks: list[int] | None = None
) -> Anomaly:
    """The update made parameters non-finite from finite gradients. ``bad``: this rank's non-finite
    parameters (empty when only another rank's shards are, under FSDP2); ``ranks``: with several
    ranks, those whose parameters are non-finite (every rank takes the same decision)."""
    op = type(mon.optimizer).__name__ + ".step" if mon.optimizer is not None else "optimizer.step"
    # several ranks: named when only some hold non-finite parameters (FSDP2 shards); under DDP
    # every rank holds the same parameters, so the update made them non-finite on every rank
    ranks = ranks or []
    some = 0 < len(ranks) < mon.world_size
    if not bad:  # another rank's shards: its own record names the parameters
        anomaly = Anomaly(
            phase=Phase.OPTIMIZER.value,
            module=None,
            op=op,
            location=None,
            kind="nan",
            step=step,
            rank=ranks[0] if ranks else mon.rank,
            world_size=mon.world_size,
            hint="the optimizer update made parameters non-finite on another rank: its record names them",
            symptom="non-finite parameters after the optimizer step",
            detected_by=f"rank {ranks[0]}" if ranks else "sentinel",
        )
        return anomaly
    first = bad[0]
    owner = first.rpartition(".")[0]
    mod = mon.model.get_submodule(owner) if owner else mon.model
    stats = None
    with contextlib.suppress(Exception):
        from ..stats import analyze_tensor

        stats = analyze_tensor(local(dict(mon.model.named_parameters())[first].detach()), first)
    kind = (
        "nan"
        if stats is not None and stats.has_nan
        else ("inf" if stats is None or stats.posinf_count else "-inf")
    )
    more = f" (and {len(bad) - 1} more: {', '.join(bad[1:4])})" if len(bad) > 1 else ""
    anomaly = Anomaly(
        phase=Phase.OPTIMIZER.value,
        module=owner,
        op=op,
        location=None,
        kind=kind,
        step=step,
        rank=mon.rank,
        world_size=mon.world_size if some else 1,
        tensor=stats,
        module_type=type(mod).__name__,
        hint=f"the optimizer update made {first} non-finite{more}: check lr, eps, weight decay and the update formula",
        symptom=f"{kind} in parameter {first} after the optimizer step",
        detected_by="sentinel",
        parameter=first,
    )
    return anomaly


def step_anomaly(mon: SessionView, flag: Replaying, late: bool = False) -> Anomaly:
    """The anomaly of this step's bad gradients or loss: replayed (the first one) to its origin.

    ``flag.replaying`` is True while the replay runs (the session's boundaries ignore what it does).

    ``late``: checked at ``mon.step()`` after an update the session did not see start; when that
    update already made the parameters non-finite a replay would blame them, so it is not replayed.
    """
    t = mon.transfer
    bad_micro = t.first_bad_micro()
    losses_bad = t.losses_bad()
    idx = min([i for i in [bad_micro, losses_bad[0] if losses_bad else None] if i is not None], default=0)
    micro = idx if len(t.micro_bad) > 1 else None
    if mon.state.edit_bad and not t.micro_flagged() and not losses_bad:
        # backward() made finite gradients (measured then); code before the update made them non-finite
        return gradient_edit_anomaly(mon, micro)
    first_replay = mon.counters["replays"] == 0
    replayable = not (late and mon.state.params_bad_now)
    if mon.config.replay and first_replay and replayable and idx < len(mon.state.captures):
        mon.counters["replays"] += 1
        flag.replaying = True
        try:
            # A fault that does not come back when the step is re-run is information (a one-off
            # fault, a nondeterministic kernel, state that changed): a second replay confirms it.
            for _ in range(2):
                with mon.eager():
                    tracer = replay_capture(
                        mon.model,
                        mon.state.captures[idx],
                        names=mon.names,
                        frames=mon.config.frames,
                        uses_cuda=mon.uses_cuda,
                    )
                a = tracer.anomaly(
                    step=mon.global_step, rank=mon.rank, micro_step=micro, detected_by="sentinel"
                )
                if a is not None:
                    return dataclasses.replace(a, reproducible=True)
            return symptom_anomaly(mon, micro, losses_bad, reproduced=False)
        except Exception as exc:
            mon.warn_once(
                "replay",
                f"torchdebug: replay of the failing step failed ({exc!r}); reporting the symptom only",
            )
            return symptom_anomaly(mon, micro, losses_bad, why="the replay failed")
        finally:
            flag.replaying = False
    why = "only the first anomaly of a session is replayed"
    if not mon.config.replay:
        why = "replay is off (config.replay=False)"
    elif first_replay and not replayable:
        why = (
            "your update (no optimizer object) ran before the check and made the parameters non-finite; "
            "call mon.update_starting() before it"
        )
    elif first_replay:
        why = "the failing micro-step was not captured"
    return symptom_anomaly(mon, micro, losses_bad, why=why)


def gradient_edit_anomaly(mon: SessionView, micro: int | None, kind: str | None = None) -> Anomaly:
    """Gradients backward() left finite were made non-finite before the update (``mon.state.edit_bad``)."""
    bad = [mon.param_names[i] for i in mon.state.edit_bad]
    first = bad[0] if bad else None
    owner = first.rpartition(".")[0] if first else ""
    mod = mon.model.get_submodule(owner) if owner else mon.model
    g = mon.params[mon.state.edit_bad[0]].grad if mon.state.edit_bad else None
    if kind is None:
        kind = "nan" if g is not None and bool(torch.isnan(g).any()) else "inf"  # exact: rare path only
    more = f" (+{len(bad) - 1} more parameters)" if len(bad) > 1 else ""
    return Anomaly(
        phase=Phase.GRADIENT_EDIT.value,
        module=owner,
        op=None,
        location=None,
        kind=kind,
        step=mon.global_step,
        rank=mon.rank,
        module_type=type(mod).__name__,
        micro_step=micro,
        symptom=f"non-finite gradient of {first} when the update started{more}",
        detected_by="sentinel",
        hint=(
            "backward() made finite gradients (measured right after it); code between backward() and "
            "the update made them non-finite: gradient clipping (a NaN max_norm), a manual normalisation "
            "(0/0), GradScaler.unscale_ with a zero scale, or a gradient hook"
        ),
        parameter=first,
    )


def symptom_anomaly(
    mon: SessionView, micro: int | None, losses_bad: list[int], reproduced: bool | None = None, why: str = ""
) -> Anomaly:
    """What was seen, without an origin: the replay did not run, failed, or found everything finite."""
    per = mon.transfer.grad_norms or []
    bad = [mon.param_names[i] for i, x in enumerate(per) if not math.isfinite(x)]
    loss_bad = bool(losses_bad)
    kind = "nan" if any(math.isnan(x) for x in per) else "inf"
    if reproduced is False:
        # Say what was seen and what was compared; name no origin the replay could not confirm.
        losses = mon.transfer.readout.losses
        loss_kinds = sorted(
            {"nan" if math.isnan(losses[i]) else "inf" for i in losses_bad if i < len(losses)}
        )
        if loss_kinds == ["nan"] or (not per and loss_kinds):
            kind = loss_kinds[0]
        seen = []
        if loss_bad:
            seen.append(f"the loss ({'/'.join(loss_kinds) or 'non-finite'})")
        if bad:
            more = f" and {len(bad) - 4} more" if len(bad) > 4 else ""
            seen.append(f"the gradients of {', '.join(bad[:4])}{more}")
        observed = " and ".join(seen) or "a non-finite value"
        return Anomaly(
            phase=Phase.FORWARD.value if loss_bad else Phase.BACKWARD.value,
            module=None,
            op=None,
            location=None,
            kind=kind,
            step=mon.global_step,
            rank=mon.rank,
            micro_step=micro,
            symptom=f"{observed} held NaN/Inf in the step",
            detected_by="sentinel",
            hint=(
                f"not reproducible: in the step, {observed} held NaN/Inf; replayed twice with the same "
                "batch, weights, buffers and RNG state, the loss and every gradient came out finite. "
                "Likely a one-off fault: hardware or silent data corruption, a nondeterministic "
                "kernel or race, a hook or state that changed between the step and the replay, or "
                "loss code the replay did not capture"
            ),
            reproducible=False,
        )
    first = bad[0] if bad else None
    owner = first.rpartition(".")[0] if first else ""
    mod = mon.model.get_submodule(owner) if owner else mon.model
    symptom = "non-finite loss" if loss_bad else f"non-finite gradient of {first}"
    return Anomaly(
        phase=Phase.FORWARD.value if loss_bad else Phase.BACKWARD.value,
        module=owner if not loss_bad else "",
        op=None,
        location=None,
        kind=kind,
        step=mon.global_step,
        rank=mon.rank,
        module_type=type(mod).__name__,
        micro_step=micro,
        symptom=symptom + (f" (+{len(bad) - 1} more parameters)" if len(bad) > 1 else ""),
        detected_by="sentinel (no replay)",
        hint=f"origin not traced: {why}; use td.locate_nonfinite(step_fn) for the exact op",
        parameter=first,
    )

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
from collections.abc import Callable
from typing import Any, Protocol

import torch

from .._frames import format_frames
from .._step import Found, Measure, SessionView
from .._tensors import local
from .._trees import map_tensors, tensor_leaves
from ..events import Anomaly, Cause, Phase
from . import cause
from .buffers import WrittenBuffers
from .ledger import window_hint
from .locate import (
    FORWARD,
    FORWARD_NO_GRAD,
    StepCapture,
    Tracer,
    _autocast,
    _check_loss_inputs,
    _preserved_state,
    apart_from_user,
    replay_capture,
    taint_fed,
    unmade_inputs,
    user_storages,
    writes_apart,
)
from .stepfn import CompiledStep, compiled_code, replay_eager


class Replaying(Protocol):
    """Who holds the "a replay is running" flag (the sentinel), the buffers the step's forward
    writes as they were when it began, and the replay on another rank that the distributed
    coordinator gives it (None: one rank, or not given)."""

    replaying: bool
    buffers: WrittenBuffers
    replica: cause.ReplicaCheck | None
    step_fn: CompiledStep | None


def optimizer_anomaly(
    mon: SessionView,
    bad: list[str],
    step: int | None,
    ranks: list[int] | None = None,
    since: int | None = None,
) -> Anomaly:
    """The update made parameters non-finite from finite gradients. ``bad``: this rank's non-finite
    parameters (empty when only another rank's shards are, under FSDP2); ``ranks``: with several
    ranks, those whose parameters are non-finite (every rank takes the same decision)."""
    opt = _optimizer_of(mon, bad[0]) if bad else mon.optimizer
    op = type(opt).__name__ + ".step" if opt is not None else "optimizer.step"
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
        hint=f"the optimizer update made {first} non-finite{more}{window_hint(since, step)}: check lr, "
        "eps, weight decay and the update formula",
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
    # the micro-steps of the update now judged (several updates in a step: those since the last one)
    base = min(mon.state.micro_base, idx)
    micro = idx - base if len(t.micro_bad) - base > 1 else None
    if mon.state.edit_bad and not t.micro_flagged() and not losses_bad:
        # backward() made finite gradients (measured then); code before the update made them non-finite
        return gradient_edit_anomaly(mon, micro)
    first_replay = mon.counters["replays"] == 0
    replayable = not (late and mon.state.params is Found.PARAMETERS)
    if mon.config.replay and first_replay and replayable and idx < len(mon.state.captures):
        return _guarded(mon, flag, micro, losses_bad, lambda: _replay_step(mon, flag, idx, micro, losses_bad))
    why = "only the first anomaly of a session is replayed"
    if not mon.config.replay:
        why = "replay is off (config.replay=False)"
    elif first_replay and not replayable:
        why = (
            "your update (no optimizer object) ran before the check and made the parameters non-finite; "
            "call mon.update_starting() before it"
        )
    elif first_replay:
        call = flag.step_fn.call_at(mon.global_step, idx) if flag.step_fn is not None else None
        if call is not None:  # (replay on, and replayable: the branches above)
            return step_fn_anomaly(mon, flag, call, micro, losses_bad)
        why = "the failing micro-step was not captured"
        # no forward of the step seen, the model not compiled itself, and Dynamo compiled code: the
        # forward ran inside a compiled function (nothing was replayed, so nothing is claimed)
        uncaptured = not mon.state.captures and flag.step_fn is None and not mon.compiled
        if uncaptured and cause.dynamo_compiled():
            found = cause.uncaptured_cause()
            a = symptom_anomaly(mon, micro, losses_bad, why=why)
            return dataclasses.replace(a, cause=found, hint=f"{a.hint}; {cause.STEP_FN_HINT}")
    return symptom_anomaly(mon, micro, losses_bad, why=why)


def step_fn_anomaly(
    mon: SessionView, flag: Replaying, call: Any, micro: int | None, losses_bad: list[int]
) -> Anomaly:
    """The failing step ran inside the compiled step function given as ``watch(step_fn=...)``: its
    original replayed eagerly under the tracer (twice when finite), then through the compiled function
    (the compiler's fault, localised), else unknown with what was tried."""
    sf = flag.step_fn
    assert sf is not None
    return _guarded(mon, flag, micro, losses_bad, lambda: _replay_step_fn(mon, sf, call, micro, losses_bad))


def _guarded(
    mon: SessionView, flag: Replaying, micro: int | None, losses_bad: list[int], replay: Callable[[], Anomaly]
) -> Anomaly:
    """``replay()`` run as the session's replay: counted, with ``flag.replaying`` up while it runs
    (also when it raises); a replay that fails is said once and the step's symptom reported."""
    mon.counters["replays"] += 1
    flag.replaying = True
    try:
        return replay()
    except Exception as exc:
        mon.warn_once(
            "replay", f"torchdebug: replay of the failing step failed ({exc!r}); reporting the symptom only"
        )
        return symptom_anomaly(mon, micro, losses_bad, why="the replay failed")
    finally:
        flag.replaying = False


def _replay_step(
    mon: SessionView, flag: Replaying, idx: int, micro: int | None, losses_bad: list[int]
) -> Anomaly:
    """Micro-step ``idx`` replayed eagerly to its origin (:func:`step_anomaly`'s replay)."""
    # A fault that does not come back when the step is re-run is information (a one-off fault, a
    # nondeterministic kernel, compiled code, state that changed): a second replay confirms it.
    for replays in (1, 2):
        a, tracer = _replay_once(mon, flag, idx, micro)
        if a is not None and a.phase == Phase.PARAMETER.value and mon.anomalies:
            return consequence(mon, a, mon.anomalies[0])
        if a is not None:
            found = _reproduced_cause(mon, flag, idx, micro, a, replays)
            hint = a.hint
            if found.verdict == "kernel_backend":
                hint = f"{hint}; {cause.backend_remedy(found)}" if hint else cause.backend_remedy(found)
            return dataclasses.replace(a, reproducible=True, cause=found, hint=hint)
    if mon.state.measure is Measure.AFTER_EDIT and mon.state.edit_bad and not losses_bad:
        # measured after code changed the gradients, and backward() is clean when re-run: that code
        # made them non-finite
        return gradient_edit_anomaly(mon, micro)
    a = _unreproduced(mon, flag, idx, micro, losses_bad)
    gap = replay_gap(mon.state.captures[idx], tracer)
    return dataclasses.replace(a, hint=f"{a.hint}; {gap}") if gap else a


def _replay_step_fn(
    mon: SessionView, sf: CompiledStep, call: Any, micro: int | None, losses_bad: list[int]
) -> Anomaly:
    """The compiled step function's call replayed (:func:`step_fn_anomaly`'s replay)."""
    for replays in (1, 2):
        a, _ = replay_eager(mon, sf, call, micro)
        if a is not None and a.phase == Phase.PARAMETER.value and mon.anomalies:
            return consequence(mon, a, mon.anomalies[0])
        if a is not None:
            return dataclasses.replace(a, reproducible=True, cause=cause.model_cause(a, replays))
    tried = [cause.EAGER_TRIED]
    found: Cause | None = None
    try:
        found = cause.compiled_cause(mon, compiled_code(mon, sf, call), 2, tried)
    except Exception as exc:
        tried.append(f"a replay through the compiled step function failed ({exc!r})")
    if found is not None:
        return compiler_anomaly(mon, micro, losses_bad, found)
    found = cause.unknown_cause(tried, replays=3)
    return symptom_anomaly(mon, micro, losses_bad, reproduced=False, found=found)


def _replay_once(
    mon: SessionView, flag: Replaying, idx: int, micro: int | None
) -> tuple[Anomaly | None, Tracer]:
    """The eager replay of the failing micro-step under the tracer, from the buffers the step wrote as
    it began: its anomaly (None when finite) and the tracer."""
    start = flag.buffers.start_values()  # the buffers the step wrote, as it began
    with mon.eager():
        if mon.roots is not None:  # several models: the step's micro-steps, in order
            tracer = replay_in_order(mon, idx, start)
        else:
            tracer = replay_capture(
                mon.model,
                mon.state.captures[idx],
                names=mon.names,
                frames=mon.config.frames,
                uses_cuda=mon.uses_cuda,
                buffers=start if idx == 0 else None,
            )
    a = tracer.anomaly(step=mon.global_step, rank=mon.rank, micro_step=micro, detected_by="sentinel")
    return a, tracer


def _reproduced_cause(
    mon: SessionView, flag: Replaying, idx: int, micro: int | None, a: Anomaly, replays: int
) -> Cause:
    """The eager replay made ``a``: the model's fault, unless another kernel of its op is finite."""
    if mon.roots is not None:
        return cause.model_cause(a, replays)
    try:
        return cause.backend_cause(a, lambda: _replay_once(mon, flag, idx, micro)[0], mon.uses_cuda, replays)
    except Exception as exc:
        c = cause.model_cause(a, replays)
        return dataclasses.replace(c, tried=(*c.tried, f"other kernels of {a.op}: failed ({exc!r})"))


def _unreproduced(
    mon: SessionView, flag: Replaying, idx: int, micro: int | None, losses_bad: list[int]
) -> Anomaly:
    """Two eager replays were finite: the compiled model replayed (it made it: the compiler), then a
    replay on another rank (several ranks: the coordinator's), else unknown with what was tried."""
    tried = [cause.EAGER_TRIED]
    found: Cause | None = None
    compiled = mon.compiled or cause.compiled_inside(mon.model)
    if compiled and mon.roots is None:
        try:
            start = flag.buffers.start_values() if idx == 0 else None  # as the eager replays began
            found = cause.compiler_cause(mon, idx, 2, tried, start)
        except Exception as exc:
            tried.append(f"a replay through the compiled model failed ({exc!r})")
    elif compiled:
        tried.append("no replay through the compiled models (several models)")
    if found is None and mon.world_size > 1 and flag.replica is not None:
        found = flag.replica(mon, idx)
    if found is not None and found.verdict == "compiler":
        return compiler_anomaly(mon, micro, losses_bad, found)
    if found is None:
        # two eager replays, and one through the compiled model when it was tried
        found = cause.unknown_cause(tried, replays=2 + (compiled and mon.roots is None))
    return symptom_anomaly(mon, micro, losses_bad, reproduced=False, found=found)


def compiler_anomaly(mon: SessionView, micro: int | None, losses_bad: list[int], found: Cause) -> Anomaly:
    """The compiled model made it and the eager model does not: named by the module the compiler
    made it in (its forward) and that module's line, else the model."""
    per = mon.transfer.grad_norms or []
    losses = mon.transfer.readout.losses
    nan = any(math.isnan(losses[i]) for i in losses_bad if i < len(losses)) or any(math.isnan(x) for x in per)
    module = found.module if found.module is not None else ""
    mod = mon.model.get_submodule(module) if module else mon.model
    seen = "the loss" if losses_bad else "the gradients"
    return Anomaly(
        # the loss non-finite: the forward made it; only the gradients: the backward (searched as such)
        phase=Phase.FORWARD.value if losses_bad else Phase.BACKWARD.value,
        module=module,
        op=None,
        location=found.location,
        kind="nan" if nan else "inf",
        step=mon.global_step,
        rank=mon.rank,
        module_type=type(mod).__name__,
        micro_step=micro,
        symptom=f"{seen} held NaN/Inf in the step; the eager replays were finite",
        detected_by="sentinel",
        hint=(
            "torch.compile made it: eager code computes the same step finite. Keep this module out of "
            "the compiled region (torch.compiler.disable) to train on, and report it to PyTorch with "
            "its inputs"
            + (
                f"; the bisector names {found.backend}"
                if found.backend
                else ("" if mon.config.compiler_bisect else "; compiler_bisect=True names the compiler pass")
            )
        ),
        reproducible=True,
        cause=found,
    )


def consequence(mon: SessionView, a: Anomaly, first: Anomaly) -> Anomaly:
    """The replay found a weight (or buffer) already non-finite as the step began, after the session
    reported ``first``: the updates (or forwards) that ran since, as the policy let them, carried that
    anomaly's values in. Said as its consequence, not as a value loaded or written outside the step."""
    name = a.parameter or ""
    counts = ""
    if a.tensor is not None:
        counts = f" ({a.tensor.nan_count} NaN / {a.tensor.posinf_count + a.tensor.neginf_count} Inf)"
    since = f"the anomaly of step {first.step} ({first.symptom or first.kind})"
    if name in mon.param_names:
        opt = _optimizer_of(mon, name)
        op = type(opt).__name__ + ".step" if opt is not None else "optimizer.step"
        phase, writer = Phase.OPTIMIZER.value, f"the updates ({op}) that ran since {since}"
    else:  # a buffer: the forwards since wrote it
        op, phase, writer = None, Phase.FORWARD.value, f"the forwards that ran since {since}"
    return dataclasses.replace(
        a,
        phase=phase,
        op=op,
        hint=(
            f"{name} already holds non-finite values{counts} as this step began: {writer} carried them "
            "in; a consequence of that anomaly, not a new origin"
        ),
        detected_by="sentinel",
    )


def buffer_anomaly(mon: SessionView, flag: Replaying, bad: list[str]) -> Anomaly:
    """A buffer the forward writes (``bad``: those non-finite now) went non-finite in a step whose loss
    and gradients are finite: the step's micro-steps replayed in order from the buffers as the step
    began (the first replay of the session), to the op and line that wrote it."""
    name = bad[0]
    owner = name.rpartition(".")[0]
    t = dict(mon.model.named_buffers()).get(name)
    kind = "nan" if t is not None and bool(torch.isnan(t).any()) else "inf"  # exact: rare path
    caps = mon.state.captures
    why = ""
    if not mon.config.replay:
        why = "replay is off (config.replay=False)"
    elif mon.counters["replays"] > 0:
        why = "only the first anomaly of a session is replayed"
    elif not caps:
        why = "the step's forward was not captured"
    else:
        mon.counters["replays"] += 1
        flag.replaying = True
        try:
            with mon.eager():
                tracer = replay_in_order(mon, len(caps) - 1, flag.buffers.start_values())
            a = tracer.anomaly(step=mon.global_step, rank=mon.rank, detected_by="sentinel")
            if a is not None:
                return dataclasses.replace(a, reproducible=True, cause=cause.model_cause(a, 1))
            why = "replayed from the buffers as the step began, the step left every buffer finite"
        except Exception as exc:
            why = f"the replay failed ({exc!r})"
        finally:
            flag.replaying = False
    more = f" (and {len(bad) - 1} more: {', '.join(bad[1:4])})" if len(bad) > 1 else ""
    return _untraced(
        mon,
        Phase.FORWARD,
        None,
        kind=kind,
        micro=None,
        symptom=f"{kind} in the buffer {name}{more} after the step",
        hint=(
            f"the step's forward wrote {kind} into the buffer {name} (finite as the step began; its loss "
            f"and gradients are finite); origin not traced: {why}"
        ),
        module=owner,
    )


def replay_gap(cap: StepCapture, tracer: Tracer) -> str:
    """What of the micro-step the replay could not rebuild, in words (``""``: nothing it knows of): the
    loss code it did not record, or the recorded call it stopped at."""
    failed = next(
        (e for e in tracer.internal_errors if e.startswith(("loss tape", "replay of the step"))), ""
    )
    if failed:
        return f"the replay of the loss code stopped: {failed}"
    if cap.loss is not None and not cap.tape_complete:
        why = cap.untaped or "it was not recorded"
        return (
            f"the loss code was not replayed: {why}; the replay fed the gradient seen at the model's outputs"
        )
    return ""


def gradient_edit_anomaly(mon: SessionView, micro: int | None, kind: str | None = None) -> Anomaly:
    """Gradients backward() left finite were made non-finite before the update (``mon.state.edit_bad``)."""
    bad = [mon.param_names[i] for i in mon.state.edit_bad]
    first = bad[0] if bad else None
    g = mon.params[mon.state.edit_bad[0]].grad if mon.state.edit_bad else None
    if kind is None:
        kind = "nan" if g is not None and bool(torch.isnan(g).any()) else "inf"  # exact: rare path only
    more = f" (+{len(bad) - 1} more parameters)" if len(bad) > 1 else ""
    return _untraced(
        mon,
        Phase.GRADIENT_EDIT,
        first,
        kind=kind,
        micro=micro,
        symptom=f"non-finite gradient of {first} when the update started{more}",
        hint=(
            "backward() made finite gradients (measured right after it); code between backward() and "
            "the update made them non-finite: gradient clipping (a NaN max_norm), a manual normalisation "
            "(0/0), GradScaler.unscale_ with a zero scale, or a gradient hook"
        ),
    )


def symptom_anomaly(
    mon: SessionView,
    micro: int | None,
    losses_bad: list[int],
    reproduced: bool | None = None,
    why: str = "",
    found: Cause | None = None,
) -> Anomaly:
    """What was seen, without an origin: the replay did not run, failed, or found everything finite
    (``found``: whose fault it is then, unknown or a rank's hardware)."""
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
        if found is None:
            found = cause.unknown_cause([cause.EAGER_TRIED], replays=2)
        if found.verdict == "unknown":
            hint = (
                f"not reproducible: in the step, {observed} held NaN/Inf; replayed twice with the same "
                "batch, weights, buffers and RNG state, the loss and every gradient came out finite"
                + "".join(f"; {t}" for t in found.tried if t != cause.EAGER_TRIED)
                + ". Nothing tried reproduced it: a nondeterministic kernel or race, a hook or state "
                "that changed between the step and the replay, or loss code the replay did not capture"
                + (cause.OTHER_RANK_HINT if mon.world_size > 1 else "")
            )
        else:
            hint = f"not reproducible on this rank: in the step, {observed} held NaN/Inf; {found.evidence}"
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
            hint=hint,
            reproducible=False,
            cause=found,
        )
    first = bad[0] if bad else None
    symptom = "non-finite loss" if loss_bad else f"non-finite gradient of {first}"
    return _untraced(
        mon,
        Phase.FORWARD if loss_bad else Phase.BACKWARD,
        first,
        kind=kind,
        micro=micro,
        symptom=symptom + (f" (+{len(bad) - 1} more parameters)" if len(bad) > 1 else ""),
        hint=f"origin not traced: {why}; use td.locate_nonfinite(step_fn) for the exact op",
        detected_by="sentinel (no replay)",
        module="" if loss_bad else None,
    )


def _untraced(
    mon: SessionView,
    phase: Phase,
    parameter: str | None,
    *,
    kind: str,
    micro: int | None,
    symptom: str,
    hint: str,
    detected_by: str = "sentinel",
    module: str | None = None,
) -> Anomaly:
    """An anomaly of this step that the sentinel saw but no replay traced to an op (no op, no line):
    named by ``parameter``, the module that owns it (``module`` overrides the name: ``""`` for the loss)
    and that module's type."""
    owner = parameter.rpartition(".")[0] if parameter else (module or "")
    mod = mon.model.get_submodule(owner) if owner else mon.model
    return Anomaly(
        phase=phase.value,
        module=owner if module is None else module,
        op=None,
        location=None,
        kind=kind,
        step=mon.global_step,
        rank=mon.rank,
        module_type=type(mod).__name__,
        micro_step=micro,
        symptom=symptom,
        detected_by=detected_by,
        hint=hint,
        parameter=parameter,
    )


def _optimizer_of(mon: SessionView, name: str) -> Any:
    """The optimizer that steps the parameter ``name`` (several optimizers), else the session's first."""
    if name in mon.param_names:
        param = mon.params[mon.param_names.index(name)]
        for opt in mon.optimizers:
            if any(p is param for g in opt.param_groups for p in g["params"]):
                return opt
    return mon.optimizer


def replay_in_order(mon: SessionView, idx: int, buffers: dict[int, torch.Tensor] | None = None) -> Tracer:
    """Several models: re-run the step's micro-steps 0..``idx`` in order under the tracer, each from its
    RNG state, and the backward of micro-step ``idx``.

    Each micro-step is the first forward of a watched model (none when the micro-step began with loss
    code after a backward, or with a frozen model's forward), then its tape: the loss code's torch
    calls and the other watched models' forwards (a frozen one's under ``no_grad``), as they ran. A
    tensor an earlier call made (G's output fed to D, a critic's value used by the next loss) is
    replaced by its replayed counterpart, so a value born in D's forward called from G's loss is traced
    to ``D.<module>``. The user's grads, buffers and RNG are restored after; ``buffers``: the values
    the buffers the step wrote held as it began (the replay starts from them).
    """
    st = mon.state
    caps = st.captures[: idx + 1]
    tracer = Tracer(mon.model, frames=mon.config.frames, names=mon.names)
    made: dict[int, torch.Tensor] = {}  # id(tensor of the real step) -> its replayed counterpart
    params = {id(p) for p in mon.model.parameters()}
    apart_from_user([(c.args, c.kwargs, [(e[2], e[3]) for e in c.tape]) for c in caps], params, made)
    user = user_storages(caps)
    with _preserved_state(mon.model, mon.uses_cuda, buffers):
        tracer.check_inputs(unmade_inputs(caps, st.tape_only), {})  # the batch, not what a model made
        tracer.check_parameters()  # (and the buffers the replay starts from)
        if tracer.symptom is None:
            with tracer:
                _replay_micro_steps(mon, caps, idx, tracer, made, user)
    return tracer


def _replay_micro_steps(
    mon: SessionView,
    caps: list[StepCapture],
    idx: int,
    tracer: Tracer,
    made: dict[int, torch.Tensor],
    user: set[int | None],
) -> None:
    """``replay_in_order``'s loop: micro-steps 0..``idx`` forward in order, and the backward of ``idx``
    (it stops where the tracer found the symptom or the tape failed)."""
    st = mon.state
    sub = lambda t: made.get(id(t), t)  # noqa: E731
    for j, cap in enumerate(caps):
        torch.set_rng_state(cap.rng_cpu)
        if cap.rng_cuda is not None:
            torch.cuda.set_rng_state_all(cap.rng_cuda)
        with torch.set_grad_enabled(cap.grad_enabled), _autocast(cap.autocast):
            out = None
            if j not in st.tape_only:
                module = cap.module if cap.module is not None else mon.model
                out = module(*map_tensors(cap.args, sub), **map_tensors(cap.kwargs, sub))
                _pair(made, cap.outputs, out)
                if tracer.symptom is not None:
                    return
            if cap.tape_complete and not _rerun(cap, made, tracer, user):
                return
            if j < idx:
                continue
            loss = made.get(id(cap.loss)) if cap.loss is not None else None
            if loss is not None:
                loss.backward(gradient=cap.loss_grad)
            elif out is not None:
                pairs = [
                    (n, cap.out_grads[i])
                    for i, n in enumerate(tensor_leaves(out))
                    if i in cap.out_grads and n.requires_grad
                ]
                if pairs:
                    taint_fed(tracer, cap, [g for _, g in pairs])
                    torch.autograd.backward([a for a, _ in pairs], [g for _, g in pairs])


def _pair(made: dict[int, torch.Tensor], old: Any, new: Any) -> None:
    for o, n in zip(tensor_leaves(old), tensor_leaves(new)):
        made[id(o)] = n


def _rerun(cap: StepCapture, made: dict[int, torch.Tensor], tracer: Tracer, user: set[int | None]) -> bool:
    """The micro-step's tape, in order (False: stop, the tracer found the symptom or the tape failed).
    A call that writes into a tensor of the user's (``user``: their storages) writes into a copy."""
    sub = lambda t: made.get(id(t), t)  # noqa: E731
    try:
        for func, kind, args, kwargs, raw, res in cap.tape:
            if kind in (FORWARD, FORWARD_NO_GRAD):  # a watched model's forward: its own ops are traced
                with torch.set_grad_enabled(kind == FORWARD and torch.is_grad_enabled()):
                    new = func(*map_tensors(args, sub), **map_tensors(kwargs, sub))
            else:
                _check_loss_inputs(cap, args, kwargs, made, raw, tracer)
                if tracer.symptom is not None:
                    return False
                writes_apart(func, args, kwargs, made, sub, user)
                tracer.location_override = format_frames(raw)
                try:
                    new = func(*map_tensors(args, sub), **map_tensors(kwargs, sub))
                finally:
                    tracer.location_override = None
            _pair(made, res, new)
            if tracer.symptom is not None:
                return False
    except Exception as exc:
        tracer.internal_errors.append(f"replay of the step failed: {exc!r}")
        return False
    return True

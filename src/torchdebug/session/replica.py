"""Whose fault across ranks: the failing micro-step replayed on a neighbour rank (the ``hardware`` leg of
an anomaly's :class:`~torchdebug.events.Cause`), and the replicas' parameter hash every
``config.parameter_hash_every`` steps.

Both need replicated parameters (DistributedDataParallel: after its all-reduce and the update every rank
holds the same weights), and both run on every rank with their collectives in the same order, so every
rank reaches the same verdict and none is left waiting.

The cross-rank replay (rare path, once per session): when the anomaly's rank of birth is some ranks but
not all, and its local replay ran (reproduced or not), that rank sends the failing micro-step (its
batch, RNG states and loss code; one ``broadcast_object_list``) to the next rank that saw nothing, and
both replay it (the wrapped module under ``no_sync``: no DDP collective); one tiny all-reduce shares what
each saw. NaN on both: software (the model, its data or its loss code: the verdict the replay path gave
stands; a ``compiler`` or ``kernel_backend`` verdict, confirmed through that code, is kept without it). NaN on the rank of birth again and finite on its neighbour: a persistent fault of that rank's
device (``hardware``, naming rank, host and device). Finite on both: a transient fault no replay can
point at (``unknown``, saying what was tried). Cost: two replays and two collectives, once.

The parameter hash (opt-in, every N steps): each rank's ``torch.hash_tensor`` of every parameter (an
xor of their bits, folded to 24 bits so it travels exactly in the step's float32 all-reduce), and
whether the rank's weights changed since its last update (its hash right after that update against
this one): two numbers per rank in the all-reduce DDP's backward already hides. Ranks whose hash
differs are named: by majority with three ranks or more, else by the rank whose weights changed
outside the update; else the event says the ranks disagree without naming one.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import socket
from typing import Any

import torch

from ..events import Anomaly, Cause, RuleEvent
from ..nonfinite.cause import OTHER_RANK_HINT
from ..nonfinite.locate import StepCapture, replay_capture
from .protocol import Session

# -- the cross-rank replay ----------------------------------------------------------------------------


def cross_check(coord: Any, mon: Session, a: Anomaly, births: list[int], own: bool) -> Anomaly:
    """``a`` (this step's anomaly, the same on every rank) with the cause the ranks' replays give.

    ``births``: the ranks of birth; ``own``: every rank replayed its own micro-step (a NaN DDP's
    all-reduce spread to every rank's gradients). Called on every rank; the collectives run on every
    rank or on none (decided from what every rank already shares: ``births`` and ``a``)."""
    world = coord.world
    if a.reproducible is None or coord.crossed or not coord._ddp_fast:
        return a  # no replay ran (replay off, or not the session's first): nothing to compare
    if a.cause is not None and a.cause.verdict not in ("model", "unknown"):
        return a  # the compiler or a kernel backend, confirmed by a replay through it: software
    if own and len(births) == world and a.reproducible is False:
        # every rank replayed its own micro-step and none reproduced it: a transient fault whose rank
        # the all-reduce hides (no neighbour replay would say more)
        coord.crossed = True
        evidence = (
            f"transient: the step's gradients held NaN/Inf on every rank after DDP's all-reduce; each of "
            f"the {world} ranks replayed its own micro-step and every replay came out finite, so no rank "
            "can be named (a one-off fault: a device, a nondeterministic kernel or a race)"
        )
        tried = f"each of the {world} ranks replayed its own micro-step: finite"
        return _cause(a, "unknown", evidence, tried, replays=2 * world, collectives=0)
    if len(births) >= world:
        return a  # born on every rank: software, the replay path's verdict stands
    coord.crossed = True
    src = births[0]
    nb = next(r for r in ((src + k) % world for k in range(1, world)) if r not in births)
    dist = _dist()
    box: list[Any] = [None]
    if coord.rank == src:
        box[0] = _pack(mon)
    dist.broadcast_object_list(box, src=src)  # rare path: the micro-step travels once
    sent = box[0] or {"error": "nothing was sent"}
    outcome = torch.zeros(3, world, device=coord._dev)  # rows: replayed, non-finite, failed
    if coord.rank in (src, nb) and "error" not in sent:
        bad, failed = _replay_sent(coord, mon, sent)
        outcome[0, coord.rank] = 1.0
        outcome[1, coord.rank] = float(bad)
        outcome[2, coord.rank] = float(failed is not None)
    dist.all_reduce(outcome, op=dist.ReduceOp.MAX)  # rare path: what each replay saw
    ran, bad_row, failed_row = outcome.tolist()
    # the rank of birth's replays of its own step; with ``own`` every rank replayed its own (the other
    # ranks of birth once, as they reproduced it; the rest twice), then the sent micro-step's replays
    others = len(births) - 1 + 2 * (world - len(births)) if own else 0
    replays = _local_replays(a) + others + int(sum(ran))
    where = f"rank {src}'s micro-step (its batch, RNG state and loss code, the same weights)"
    if "error" in sent or any(failed_row):
        why = sent.get("error") or "a replay of the sent micro-step failed"
        return _cause(a, None, "", f"sending {where} to rank {nb}: {why}", replays=replays, collectives=2)
    kind = a.kind if a.kind in ("nan", "inf", "-inf") else "NaN/Inf"
    if bad_row[src] and bad_row[nb]:
        evidence = (
            f"rank {nb} replayed {where} and got {kind} too: the model, its data or its loss code, "
            f"not rank {src}'s device"
        )
        tried = f"replayed {where} on rank {src} and on rank {nb}: {kind} on both"
        return _cause(a, None, evidence, tried, replays=replays, collectives=2, software=True)
    if bad_row[src]:
        evidence = (
            f"persistent fault on rank {src} ({sent['device']} on {sent['host']}): {where} gave {kind} "
            f"on rank {src} again and came out finite on rank {nb}"
        )
        tried = f"replayed {where} on rank {src}: {kind}; on rank {nb}: finite"
        return _cause(
            a,
            "hardware",
            evidence,
            tried,
            replays=replays,
            collectives=2,
            rank=src,
            host=str(sent["host"]),
            device=str(sent["device"]),
        )
    if bad_row[nb]:
        evidence = (
            f"{where} came out finite on rank {src} and gave {kind} on rank {nb}: no rank keeps the "
            "fault, so none is named"
        )
        tried = f"replayed {where} on rank {src}: finite; on rank {nb}: {kind}"
        return _cause(a, "unknown", evidence, tried, replays=replays, collectives=2)
    evidence = (
        f"transient: the step held {kind} on rank {src} ({sent['device']} on {sent['host']}) only; "
        f"{where} came out finite when replayed on rank {src} and on rank {nb}, so no replay points "
        "at a rank (a one-off fault: a device, a nondeterministic kernel or a race)"
    )
    tried = f"replayed {where} on rank {src} and on rank {nb}: finite on both"
    return _cause(a, "unknown", evidence, tried, replays=replays, collectives=2)


def _cause(
    a: Anomaly,
    verdict: str | None,
    evidence: str,
    tried: str,
    *,
    replays: int,
    collectives: int,
    software: bool = False,
    **where: Any,
) -> Anomaly:
    """``a`` with its cause: ``verdict`` (None: keep the replay path's, adding what was tried here), and
    its hint saying what the replays across ranks found (they ran unless ``evidence`` is empty)."""
    if evidence:
        a = dataclasses.replace(a, hint=_hint(a.hint, verdict, tried, where))
    old = a.cause
    if verdict is None and old is not None:
        c = dataclasses.replace(
            old,
            tried=(*old.tried, tried),
            replays=max(old.replays, replays),
            collectives=old.collectives + collectives,
        )
        return dataclasses.replace(a, cause=c)
    if verdict is None:  # no verdict from the replay path: the local replay's own answer
        verdict = "model" if software and a.reproducible else "unknown"
        evidence = evidence or f"the cross-rank replay could not run ({tried})"
    tried_all = (*(old.tried if old is not None else ()), tried)
    c = Cause(
        verdict=verdict,
        evidence=evidence,
        tried=tried_all,
        compiles=old.compiles if old is not None else 0,
        replays=replays,
        collectives=collectives,
        **where,
    )
    return dataclasses.replace(a, cause=c)


def _hint(hint: str, verdict: str | None, tried: str, where: dict[str, Any]) -> str:
    """The anomaly's hint once the ranks' replays ran: no longer asking for a replay on another rank;
    a faulty rank's device named with what to do; a transient fault with what was replayed where."""
    if not hint.endswith(OTHER_RANK_HINT) and verdict != "hardware":
        return hint
    hint = hint.removesuffix(OTHER_RANK_HINT)
    if verdict == "hardware":
        said = (
            f"rank {where['rank']}'s device ({where['device']} on {where['host']}) is at fault, not the model: "
            "the same micro-step is finite on another rank; check that device (or leave it out) and "
            "resume from the last checkpoint"
        )
    else:
        said = tried
    return f"{hint}; {said}" if hint else said


def _local_replays(a: Anomaly) -> int:
    """The replays the rank of birth ran of its own step (the replay path's count when it gave one)."""
    if a.cause is not None and a.cause.replays:
        return int(a.cause.replays)
    return 1 if a.reproducible else 2  # the replay path stops at the first that reproduces, else two


def _failing(mon: Session) -> int:
    """The index of the failing micro-step's capture (as the replay path picks it)."""
    t = mon.transfer
    bad_micro = t.first_bad_micro()
    losses_bad = t.losses_bad()
    return min([i for i in [bad_micro, losses_bad[0] if losses_bad else None] if i is not None], default=0)


class _Out(pickle.Pickler):
    """Pickles a capture with its tensors apart (CPU copies, each once) and the model's parameters and
    modules by name (the receiving rank uses its own, equal under DDP)."""

    def __init__(self, f: Any, mon: Session) -> None:
        super().__init__(f, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self.seen: dict[int, int] = {}
        self.params = {id(p): n for n, p in mon.model.named_parameters()}
        self.modules = {id(m): n for n, m in mon.model.named_modules()}

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.nn.Module):
            name = self.modules.get(id(obj))
            if name is None:
                raise pickle.PicklingError(f"a module outside the model ({type(obj).__name__})")
            return ("m", name)
        if not isinstance(obj, torch.Tensor):
            return None
        if id(obj) in self.params:
            return ("p", self.params[id(obj)])
        if id(obj) not in self.seen:
            self.seen[id(obj)] = len(self.tensors)
            self.tensors.append(obj.detach().to("cpu", copy=True))
        return ("t", self.seen[id(obj)], obj.device.type != "cpu", obj.requires_grad and obj.is_leaf)


class _In(pickle.Unpickler):
    def __init__(self, f: Any, mon: Session, tensors: list[torch.Tensor], device: torch.device) -> None:
        super().__init__(f)
        self.mon, self.tensors, self.device = mon, tensors, device
        self.made: dict[int, torch.Tensor] = {}
        self.params = dict(mon.model.named_parameters())

    def persistent_load(self, pid: Any) -> Any:
        if pid[0] == "m":
            return self.mon.model.get_submodule(pid[1])
        if pid[0] == "p":
            return self.params[pid[1]]
        _, i, on_device, leaf_grad = pid
        if i not in self.made:
            t = self.tensors[i].to(self.device) if on_device else self.tensors[i]
            self.made[i] = t.requires_grad_(True) if leaf_grad else t
        return self.made[i]


def _pack(mon: Session) -> dict[str, Any]:
    """The failing micro-step as bytes and CPU tensors, with where this rank runs. Never raises (the
    other ranks wait in the broadcast): a failure travels as ``{"error": ...}``."""
    try:
        if mon.roots is not None:
            return {"error": "several models: their micro-steps replay in order, not sent"}
        caps = mon.state.captures
        idx = _failing(mon)
        if idx >= len(caps):
            return {"error": "the failing micro-step was not captured"}
        cap = caps[idx]
        fields = {
            "args": cap.args,
            "kwargs": cap.kwargs,
            "autocast": cap.autocast,
            "grad_enabled": cap.grad_enabled,
            "outputs": cap.outputs,
            "out_grads": cap.out_grads,
            "loss": cap.loss,
            "loss_grad": cap.loss_grad,
            "module": cap.module,
            "rng_cpu": cap.rng_cpu,
        }
        try:
            data, tensors = _dumps(mon, {**fields, "tape": cap.tape, "tape_complete": cap.tape_complete})
        except Exception:  # loss code the receiver cannot call: the gradient at the outputs instead
            data, tensors = _dumps(mon, {**fields, "tape": [], "tape_complete": False})
        cuda = cap.rng_cuda is not None and torch.cuda.is_available()
        return {
            "data": data,
            "tensors": tensors,
            "rng_cuda": cap.rng_cuda[torch.cuda.current_device()] if cuda else None,  # type: ignore[index]
            "host": socket.gethostname(),
            "device": _device_name(mon),
        }
    except Exception as exc:
        return {"error": f"it could not be packed ({exc!r})"[:300]}


def _dumps(mon: Session, obj: Any) -> tuple[bytes, list[torch.Tensor]]:
    f = io.BytesIO()
    p = _Out(f, mon)
    p.dump(obj)
    return f.getvalue(), p.tensors


def _device_name(mon: Session) -> str:
    """This rank's device as a person finds it: ``cuda:1 (NVIDIA H200)``, ``cpu``."""
    p = next(iter(mon.model.parameters()), None)
    dev = p.device if p is not None else torch.device("cpu")
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return str(dev)


def _replay_sent(coord: Any, mon: Session, sent: dict[str, Any]) -> tuple[bool, str | None]:
    """Replay the sent micro-step here: ``(non-finite, error or None)``. Never raises (the other ranks
    wait in the all-reduce that follows)."""
    import contextlib

    p = next(iter(mon.model.parameters()), None)
    device = p.device if p is not None else torch.device("cpu")
    try:
        f = _In(io.BytesIO(sent["data"]), mon, sent["tensors"], device)
        d = f.load()
        rng_cuda = None
        if sent.get("rng_cuda") is not None and torch.cuda.is_available():
            rng_cuda = torch.cuda.get_rng_state_all()  # this rank's device gets the sender's state
            rng_cuda[torch.cuda.current_device()] = sent["rng_cuda"]
        cap = StepCapture(
            d["args"],
            d["kwargs"],
            d["rng_cpu"],
            rng_cuda,
            d["autocast"],
            d["grad_enabled"],
            outputs=d["outputs"],
            out_grads=d["out_grads"],
            tape=d["tape"],
            tape_complete=d["tape_complete"],
            loss=d["loss"],
            loss_grad=d["loss_grad"],
            module=d["module"] if d["module"] is not mon.model else None,
        )
        ctx = coord.ddp.no_sync() if coord.ddp is not None else contextlib.nullcontext()
        mon.sentinel.replaying = True  # the session's boundaries ignore the replay's forward and backward
        try:
            with ctx, mon.eager():
                tracer = replay_capture(
                    mon.model, cap, names=mon.names, frames=mon.config.frames, uses_cuda=mon.uses_cuda
                )
        finally:
            mon.sentinel.replaying = False
        return tracer.symptom is not None, None
    except Exception as exc:
        return False, repr(exc)


def cause_from(d: Any) -> Cause | None:
    """A :class:`Cause` from its dict (an anomaly that travelled between ranks), or None."""
    if not isinstance(d, dict):
        return None
    names = {f.name for f in dataclasses.fields(Cause)}
    kw: dict[str, Any] = {k: (tuple(v) if k == "tried" else v) for k, v in d.items() if k in names}
    try:
        return Cause(**kw)
    except (TypeError, ValueError):
        return None


def _dist() -> Any:
    import torch.distributed as dist

    return dist


# -- the parameter hash -------------------------------------------------------------------------------


def parameter_hash(params: list[torch.Tensor]) -> torch.Tensor:
    """One int64 on the device: the xor of ``torch.hash_tensor`` (each tensor's elements' bits, xor-ed)
    of every parameter, folded to 24 bits so a float32 carries it exactly. No host sync. Cost: one
    small kernel per parameter tensor and four more (run every ``parameter_hash_every`` steps)."""
    hs = torch.stack([torch.hash_tensor(p.detach()).view(torch.int64) for p in params])
    x = torch.hash_tensor(hs).reshape(1).view(torch.int64)
    return (x ^ (x >> 24) ^ (x >> 48)) & 0xFFFFFF


class ReplicaHash:
    """The replicas' parameter hash every ``every`` steps: what rides in the step's all-reduce, and the
    check of what came back (the coordinator holds one when the option is on and DDP replicates)."""

    def __init__(self, every: int) -> None:
        self.every = every
        self._after: torch.Tensor | None = None  # this rank's hash right after its last update
        self._sent = -1  # the step whose all-reduce carries the hash
        self._tail: list[float] | None = None  # what that all-reduce brought back: hashes, changed flags
        self._diverged = False  # in an episode: one event until the hashes agree again
        self.checks = 0
        self.mismatches: list[tuple[int, list[int]]] = []  # (step, ranks named)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def entries(self, mon: Session, rank: int, world: int, dev: torch.device) -> torch.Tensor:
        """``(2, world)`` float32, this rank's column filled: its hash and whether its weights changed
        since its last update (1.0) or not (0.0)."""
        h = parameter_hash(mon.params).to(dev)
        out = torch.zeros(2, world, dtype=torch.float32, device=dev)
        out[0, rank] = h.to(torch.float32).reshape(())
        if self._after is not None:
            out[1, rank] = (h != self._after.to(dev)).to(torch.float32).reshape(())
        self._sent = mon.global_step
        return out.reshape(-1)

    def after_update(self, mon: Session, next_step: int) -> None:
        """At the step's end: this rank's hash when the next step is checked (its continuity)."""
        self._after = parameter_hash(mon.params) if self.due(next_step) else None

    def read(self, step: int, dist_values: list[float], world: int) -> None:
        """After the step's read (the all-reduced vector on the host): keep the hashes it carried (a
        later read of the same step, on a detail step, brings a vector without them)."""
        if self._sent == step and len(dist_values) >= 2 * world:
            self._tail = dist_values[-2 * world :]

    def check(self, mon: Session, step: int, world: int) -> list[int] | None:
        """The ranks whose weights diverged by this step's all-reduced hashes (an event the first time
        in an episode), [] when they agree, None when this step carried no hash."""
        tail, self._tail = self._tail, None
        if self._sent != step or tail is None:
            return None
        self._sent = -1
        self.checks += 1
        hashes, moved = [int(x) for x in tail[:world]], [x > 0 for x in tail[world:]]
        if len(set(hashes)) == 1:
            self._diverged = False
            return []
        named, how = _odd_ones(hashes, moved)
        self.mismatches.append((step, named))
        if not self._diverged:
            self._diverged = True
            groups = {h: [r for r in range(world) if hashes[r] == h] for h in dict.fromkeys(hashes)}
            ranks = ", ".join(str(r) for r in named)
            who = "the replicas' weights differ and no rank can be named"
            if named:
                whose = f"rank {ranks}'s weights" if len(named) == 1 else f"the weights of ranks {ranks}"
                who = f"{whose} diverged from the other replicas"
            mon.emit(
                RuleEvent(
                    "replica_divergence",
                    step,
                    f"{who} ({how}; parameter hash checked every {self.every} steps, "
                    f"{len(groups)} different values over {world} ranks)",
                    "error",
                    evidence={
                        "ranks": named,
                        "hashes": hashes,
                        "changed_outside_update": moved,
                        "every": self.every,
                    },
                )
            )
        return named


def _odd_ones(hashes: list[int], moved: list[bool]) -> tuple[list[int], str]:
    """The ranks to name and how they were told apart."""
    world = len(hashes)
    counts = {h: hashes.count(h) for h in hashes}
    top = max(counts.values())
    majority = [h for h, c in counts.items() if c == top]
    if len(majority) == 1 and top * 2 > world:
        return [r for r in range(world) if hashes[r] != majority[0]], f"{top} of {world} ranks agree"
    changed = [r for r in range(world) if moved[r]]
    if changed and len(changed) < world:
        return changed, "changed after the last update and before this check, on that rank only"
    return [], "no majority, and no rank's weights changed outside its update"

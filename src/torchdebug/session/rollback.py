"""Loss spikes in ``watch()``: forensics on every spike and, with ``on_spike="rollback"``, roll back and go on.

:class:`SpikeGuard` is an instrument on the step protocol. Per step it keeps a few host numbers it is
handed anyway (the loss, the learning rates, the gradient norms the step's one read gave: references,
no copy, no device work) and feeds the robust loss-spike rule (``health.instrument.LossSpikeRule``,
one event per episode) with the step's loss; under several ranks with the mean loss of the ranks from
the coordinator's all-reduce, so every rank takes the same decision at the same step. Nothing else
runs until a spike.

On a spike (the rare path) it gathers the evidence (the captured micro-step replayed for per-row
losses: ``nonfinite/rows.py``; the learning rates and per-layer gradient norms of the steps before;
the optimizer's state) and asks ``health.spikes.attribute`` for a :class:`SpikeReport`, kept in
``mon.spikes``, recorded as a ``spike_report`` event (warning) and then, by ``on_spike``:

- ``"warn"``: nothing more (the default);
- ``"raise"``: :class:`LossSpikeError` with the report, from the optimizer's pre-hook when the loss
  was read there (the spike's update is not applied), else from ``mon.step()``;
- ``"rollback"``: at the step's end the newest snapshot taken before the spike step is restored
  (parameters, buffers, optimizer state, GradScaler state, RNG states) and the loop goes on with its
  next batch, so the batches since the snapshot are skipped; optionally the learning rate is scaled
  by ``rollback_lr_scale`` for ``rollback_lr_steps`` updates. Each rollback is a ``rollback`` event
  (:class:`Rollback`: from which step to which, why, batches skipped, the loss before and after) and
  in ``mon.rollbacks``; a spike after ``max_rollbacks`` rollbacks raises :class:`LossSpikeError`.

Snapshots (``on_spike="rollback"`` only): every ``snapshot_every`` steps as the step's first forward
begins (the state before that step), a copy into
host buffers reused from the ring's oldest slot (``SNAPSHOT_SLOTS`` slots; pinned memory and a
non-blocking copy on CUDA, waited for only by a restore). Memory: ``SNAPSHOT_SLOTS`` times the
parameters, buffers and optimizer state. No snapshot is taken while the loss is inside a spike.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

from .._errors import LossSpikeError, TorchDebugWarning
from .._frames import warn_at_user
from ..events import RuleEvent
from ..health.instrument import LossSpikeRule, layer_norms, owner
from ..health.spikes import Evidence, SpikeReport, attribute
from . import distributed as _distributed
from .protocol import Session

ON_SPIKE = ("warn", "rollback", "raise", "off")
SNAPSHOT_SLOTS = 2
HISTORY = 32  # steps of host numbers kept for the forensics (references: the per-parameter norms
# stay on the device, as the step reduced them, until a spike asks for them)
MAX_REPLAYED = 4  # micro-steps replayed for per-row losses
RECOVERED_SIGMAS = 3.0  # the loss is back from a spike within this many sigmas of the median before it
RECOVERY = HISTORY  # steps after which a spike not recovered from no longer explains a new one


@dataclass(frozen=True)
class Rollback:
    """One rollback: the spike at ``step`` undone by restoring the state before step ``to_step``.

    ``batches_skipped`` = ``step - to_step + 1`` (their updates are undone and their batches not
    seen again); ``loss_before`` is the spike's loss, ``median_before`` the running median before it,
    ``loss_after`` the first loss after the restore (None until the next step ends).
    """

    step: int
    to_step: int
    reason: str
    cause: str
    batches_skipped: int
    loss_before: float
    median_before: float
    loss_after: float | None = None
    lr_scale: float = 1.0
    lr_steps: int = 0

    def __str__(self) -> str:
        after = "" if self.loss_after is None else f", loss after {self.loss_after:.4g}"
        return (
            f"rolled back from step {self.step} to the state before step {self.to_step} "
            f"({self.batches_skipped} batches skipped; loss {self.loss_before:.4g} vs median "
            f"{self.median_before:.4g}{after}); cause {self.cause}"
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class _Snapshot:
    """Host copies of the training state before step ``label``; ``tensors`` are reused buffers."""

    label: int
    tensors: list[torch.Tensor]
    n_model: int  # the first n_model tensors are the model's parameters and buffers
    layout: list[dict[str, tuple[str, Any, Any]] | None]  # per optimizer parameter: its state
    scaler: dict[str, Any] | None
    rng_cpu: torch.Tensor
    rng_cuda: list[torch.Tensor] | None
    event: Any = None  # CUDA event of the non-blocking copy
    # per optimizer of the session: it, and its param groups (each group's parameters, by identity)
    optimizers: list[tuple[Any, tuple[tuple[int, ...], ...]]] = dataclasses.field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


class RollbackRefused(RuntimeError):
    """A snapshot that cannot be put back whole (the message says why); nothing was restored."""


def _optimizers(mon: Session) -> list[Any]:
    """Every optimizer of the session (several models: each one's), in order."""
    opts = list(getattr(mon, "optimizers", None) or [])
    return opts or ([mon.optimizer] if mon.optimizer is not None else [])


def _groups(opt: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(id(p) for p in g["params"]) for g in opt.param_groups)


class SnapshotRing:
    """A bounded ring of host snapshots of the model, its optimizer, GradScaler and RNG states."""

    def __init__(self, slots: int = SNAPSHOT_SLOTS) -> None:
        self.slots: deque[_Snapshot] = deque(maxlen=slots)
        self.taken = 0

    def take(self, mon: Session, label: int) -> _Snapshot:
        """Copy the state before step ``label`` (a Python pass over the tensors: on the schedule only)."""
        model, opts = mon.model, _optimizers(mon)
        srcs = [p.detach() for p in model.parameters()] + [b.detach() for b in model.buffers()]
        n_model = len(srcs)
        layout: list[dict[str, tuple[str, Any, Any]] | None] = []
        for opt, p in [(o, p) for o in opts for p in _opt_params(o)]:
            st = opt.state.get(p)
            if not st:
                layout.append(None)
                continue
            entry: dict[str, tuple[str, Any, Any]] = {}
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    entry[k] = ("t", len(srcs), v.device)
                    srcs.append(v.detach())
                else:
                    entry[k] = ("v", copy.deepcopy(v), None)
            layout.append(entry)
        cuda = any(t.is_cuda for t in srcs)
        reuse = self.slots[0] if len(self.slots) == self.slots.maxlen else None
        host = reuse.tensors if reuse is not None and _fits(reuse.tensors, srcs) else None
        if host is None:
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda and t.is_cuda) for t in srcs]
        with torch.no_grad():
            if cuda:
                for h, t in zip(host, srcs):
                    h.copy_(t, non_blocking=True)  # pinned: returns at once; a restore waits for it
            else:
                torch._foreach_copy_(host, srcs)  # one multi-tensor call
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        scaler = mon.scaler
        snap = _Snapshot(
            label=label,
            tensors=host,
            n_model=n_model,
            layout=layout,
            scaler=scaler.state_dict() if scaler is not None and _enabled(scaler) else None,
            rng_cpu=torch.get_rng_state(),
            rng_cuda=torch.cuda.get_rng_state_all()
            if _uses_cuda(mon) and torch.cuda.is_available()
            else None,
            event=event,
            optimizers=[(o, _groups(o)) for o in opts],
        )
        self.slots.append(snap)
        self.taken += 1
        return snap

    def before(self, step: int) -> _Snapshot | None:
        """The newest snapshot taken before step ``step - 1`` began, else one taken before ``step``."""
        older = [s for s in self.slots if s.label < step]
        if older:
            return max(older, key=lambda s: s.label)
        same = [s for s in self.slots if s.label == step]
        return same[0] if same else None

    @staticmethod
    def check(mon: Session, snap: _Snapshot, live: list[torch.Tensor]) -> None:
        """RollbackRefused when the snapshot cannot be put back whole: the model's tensors, every
        optimizer of the session with the same param groups, and the GradScaler it uses."""
        at = f"the snapshot before step {snap.label}"
        if len(live) != snap.n_model or not _fits(snap.tensors[: snap.n_model], live):
            raise RollbackRefused(f"the model's parameters or buffers changed shape since {at}")
        opts = _optimizers(mon)
        saved = [o for o, _ in snap.optimizers]
        for k, o in enumerate(opts):
            label = f"optimizer {k + 1} of {len(opts)} ({type(o).__name__})"
            if not any(o is x for x in saved):
                raise RollbackRefused(f"{label} was not watched when {at} was taken")
            groups = next(g for x, g in snap.optimizers if x is o)
            now = _groups(o)
            if len(now) != len(groups):
                raise RollbackRefused(
                    f"{label} has {len(now)} param groups where {at} had {len(groups)}: a param "
                    f"group {'added' if len(now) > len(groups) else 'removed'} since cannot be rolled "
                    "back with the rest"
                )
            if now != groups:
                raise RollbackRefused(f"{label}'s param groups hold other parameters than at {at}")
        scaler = getattr(mon, "scaler", None)
        if snap.scaler is None and scaler is not None and _enabled(scaler):
            raise RollbackRefused(
                f"the GradScaler was not known when {at} was taken (it is adopted at its first step): "
                "pass scaler= to watch() so every snapshot holds its state"
            )

    def restore(self, mon: Session, snap: _Snapshot) -> None:
        """Put the snapshot back, bitwise: copies into the live tensors (the optimizer keeps its objects)."""
        if snap.event is not None:
            snap.event.synchronize()
        model = mon.model
        live = [p.detach() for p in model.parameters()] + [b.detach() for b in model.buffers()]
        self.check(mon, snap, live)  # everything, or nothing: never a partial restore
        with torch.no_grad():
            for t, h in zip(live, snap.tensors):
                t.copy_(h)
            pairs = [(o, p) for o, _ in snap.optimizers for p in _opt_params(o)]
            for (opt, p), entry in zip(pairs, snap.layout):
                if entry is None:
                    opt.state.pop(p, None)
                    continue
                cur = opt.state[p]
                new: dict[str, Any] = {}
                for k, (kind, v, dev) in entry.items():
                    if kind == "v":
                        new[k] = copy.deepcopy(v)
                        continue
                    h, t = snap.tensors[v], cur.get(k)
                    if isinstance(t, torch.Tensor) and t.shape == h.shape and t.dtype == h.dtype:
                        new[k] = t.copy_(h)
                    else:
                        new[k] = h.to(dev, copy=True)
                cur.clear()
                cur.update(new)
        if snap.scaler is not None and mon.scaler is not None:
            mon.scaler.load_state_dict(snap.scaler)
        torch.set_rng_state(snap.rng_cpu)
        if snap.rng_cuda is not None:
            torch.cuda.set_rng_state_all(snap.rng_cuda)


class SpikeGuard:
    """The ``spikes`` instrument: forensics on every loss spike and ``on_spike`` (module docstring)."""

    name = "spikes"

    def __init__(self) -> None:
        # per step: (step, lrs, grad_norm, its per-parameter norms when asked: read from the device
        # only if a spike's forensics run)
        self.history: deque[tuple[int, tuple[float, ...], float | None, Callable[[], list[float] | None]]] = (
            deque(maxlen=HISTORY)
        )
        self.ring = SnapshotRing()
        self.ratios: deque[tuple[int, Any, Any]] = deque(maxlen=8)
        self.count = 0
        self._judged: int | None = None
        self._pending: tuple[SpikeReport, bool] | None = None  # (report, judged before the update)
        self._open: int | None = None  # index in mon.rollbacks waiting for its loss after
        self._lr_left = 0
        self._lr_saved: list[float] | None = None
        self._snapped: int | None = None  # the step whose snapshot was taken
        self._said = False  # the snapshot's cost was said
        # the last spike until the loss comes back near its median before it (or RECOVERY steps pass):
        # a spike meanwhile is the same incident, not a new batch (step, cause, median, sigma)
        self._incident: tuple[int, str, float, float] | None = None

    def install(self, mon: Session) -> None:
        cfg = mon.config
        self.mode = cfg.on_spike
        self.rule = LossSpikeRule(cfg.loss_spike_mads, cfg.explode_warmup)
        self.every = int(cfg.snapshot_every)
        if self.mode == "rollback" and mon.optimizer is None:
            warn_at_user(
                TorchDebugWarning(
                    'torchdebug: on_spike="rollback" needs the optimizer passed to watch(); '
                    "spikes are reported but not rolled back"
                )
            )
            self.mode = "warn"
        # the snapshot (at a step's first forward) and the lowered lr (around the update) serve the
        # rollback alone: without it those boundaries call nothing here (the session's dispatch skips a
        # method set to None)
        for method in ("on_forward_start", "after_optimizer_step"):
            if self.mode == "rollback":
                self.__dict__.pop(method, None)
            else:
                self.__dict__[method] = None

    def on_forward_start(
        self, mon: Session, module: Any = None, args: Any = None, kwargs: Any = None
    ) -> None:
        # the state before step s, taken as its first forward begins (also under sync="async", where
        # step ends are judged a step late); not while the loss is inside a spike
        step = mon.global_step
        if (
            self.mode == "rollback"
            and step % self.every == 0
            and self._snapped != step
            and not self.rule.active
        ):
            self._snapped = step
            t0 = time.perf_counter()
            snap = self.ring.take(mon, step)
            if not self._said and (any(snap.layout) or self.ring.taken > 1):
                # the cost, measured and said once (an info event), once the optimizer's state is in it
                self._said = True
                self._say_cost(mon, snap, time.perf_counter() - t0)

    # ----------------------------------------------------------------- the step

    def before_optimizer_step(self, mon: Session) -> None:
        step = mon.global_step
        values = mon.transfer.values
        if self._judged != step and "loss" in values and not mon.state.skip_reason:  # (``sentinel.skipped``)
            self._judged = step
            self._judge(mon, step, before_update=True)
        if self._lr_left > 0 and mon.optimizer is not None:  # after a rollback: a lower lr for a while
            groups = mon.optimizer.param_groups
            self._lr_saved = [g["lr"] for g in groups]
            for g in groups:
                g["lr"] = g["lr"] * mon.config.rollback_lr_scale

    def after_optimizer_step(self, mon: Session) -> None:
        saved, self._lr_saved = self._lr_saved, None
        if saved is not None:
            for g, lr in zip(cast(Any, mon.optimizer).param_groups, saved):
                g["lr"] = lr  # the scheduler sees the lr it set
            self._lr_left -= 1

    def on_step_end(self, mon: Session, record: Any, values: Any) -> None:
        step = int(record.step)
        if self._open is not None and record.loss is not None and not record.skipped:
            self._close_rollback(mon, float(record.loss))
        if self._judged != step and not record.skipped and values.get("loss") is not None:
            self._judged = step
            self._judge(mon, step, before_update=False)
        lrs = tuple(map(float, record.lr)) if record.lr else ()
        self.history.append((step, lrs, values.get("grad_norm"), mon.transfer.norms_later()))
        vectors = mon.transfer.vectors
        ratio = vectors.get("health.ratio")
        if ratio is not None and not (self.ratios and self.ratios[-1][1] is ratio):
            # a detail step's update/weight ratios (references, no copy)
            self.ratios.append((step, vectors["health.ratio"], vectors.get("health.weight")))
        pending, self._pending = self._pending, None
        if pending is not None:
            self._rollback(mon, step, pending[0])

    def on_exit(self, mon: Session) -> None:
        if self._open is not None:
            self._close_rollback(mon, None)

    def remove(self, mon: Session) -> None:
        self.ring.slots.clear()  # the host copies go with the session (mon outlives it)
        self.history.clear()
        self.ratios.clear()

    # ----------------------------------------------------------------- the rare path

    def _loss(self, mon: Session) -> float | None:
        coord = mon.coordinator
        if isinstance(coord, _distributed.Coordinator):
            shared = _distributed.mean_loss(coord, mon)  # the same float on every rank: the same decision
            if shared is not None:
                return float(shared)
        loss = mon.transfer.values.get("loss")
        return None if loss is None else float(loss)

    def _judge(self, mon: Session, step: int, before_update: bool) -> None:
        if mon.coordinator is None:  # (``_loss``, inlined: every step)
            got = mon.transfer.values.get("loss")
            loss = None if got is None else float(got)
        else:
            loss = self._loss(mon)
        if loss is None or not math.isfinite(loss):
            return
        inc = self._incident
        if inc is not None and (loss <= inc[2] + RECOVERED_SIGMAS * inc[3] or step - inc[0] > RECOVERY):
            inc = self._incident = None  # recovered (or long enough ago to be a new incident)
        if self.rule.update(step, loss) is None:
            return
        med, sigma = self.rule.fired_at  # the window's median and sigma before this loss joined it
        report = self._forensics(mon, step, loss, med, sigma, before_update, inc)
        if inc is None:
            self._incident = (step, report.cause, med, sigma)
        mon.spikes.append(report)
        mon.emit(
            RuleEvent(
                "spike_report",
                step,
                f"cause {report.cause}: {report.message}",
                "warning",
                modules=report.modules,
                evidence=report.to_dict(),
            )
        )
        if self.mode == "raise":
            raise LossSpikeError(f"torchdebug: {report.summary()} (on_spike='raise')", report)
        if self.mode == "rollback":
            if self.count >= mon.config.max_rollbacks:
                done = ", ".join(str(r.step) for r in mon.rollbacks) or "none"
                raise LossSpikeError(
                    f"torchdebug: the loss spiked again at step {step} after {self.count} rollbacks "
                    f"(max_rollbacks={mon.config.max_rollbacks}; rolled back at steps {done}): "
                    f"{report.summary()}. Rolling back does not cure it: lower the learning rate, "
                    "fix the data named in the reports, or raise max_rollbacks",
                    report,
                )
            self._pending = (report, before_update)

    def _forensics(
        self,
        mon: Session,
        step: int,
        loss: float,
        med: float,
        sigma: float,
        before_update: bool,
        incident: tuple[int, str, float, float] | None = None,
    ) -> SpikeReport:
        ev = Evidence(step=step, loss=loss, median=med, sigma=sigma, mads=float(mon.config.loss_spike_mads))
        ev.notes["weights"] = "as in the step's forward" if before_update else "after the step's update"
        if incident is not None:
            ev.notes["unrecovered"] = {"step": incident[0], "cause": incident[1], "median": incident[2]}
        try:
            self._rows(mon, ev)
        except Exception as exc:  # the forensics never break training
            ev.rows, ev.rows_note = None, f"per-row replay failed: {exc!r}"
        names = mon.param_names
        ev.lrs = [(s, lrs) for s, lrs, _, _ in self.history]
        history = [(s, total, later()) for s, _, total, later in self.history]  # host reads: rare path
        ev.grads = [
            (s, float(total) if total is not None else math.nan, layer_norms(names, norms))
            for s, total, norms in history
            if norms is not None and len(norms) == len(names)
        ]
        ev.ratios = [(s, _layer_ratios(names, r, w)) for s, r, w in self.ratios if w is not None]
        opt = mon.optimizer
        if opt is not None:
            index = {id(p): n for p, n in zip(mon.params, names)}
            for g in opt.param_groups:
                ps = [p for p in g["params"] if p.requires_grad]
                ev.group_sizes.append(sum(p.numel() for p in ps))
                ev.group_modules.append([owner(index[id(p)]) for p in ps if id(p) in index])
            try:
                ev.adaptive, ev.updates = _optimizer_numbers(opt, index)
            except Exception as exc:
                ev.notes["optimizer_note"] = f"state not read: {exc!r}"
        return attribute(ev)

    def _rows(self, mon: Session, ev: Evidence) -> None:
        from ..nonfinite.rows import row_losses

        caps = mon.sentinel.captures[:MAX_REPLAYED]
        if not caps:
            ev.rows_note = "no captured micro-step (the sentinel is off, or replay=False)"
            return
        best: tuple[float, Any] | None = None
        # the session ignores the replay's forwards (a watched model's forward hooks would capture them
        # and open a loss tape that outlives the session), as it does the sentinel's replay
        sentinel, was = mon.sentinel, mon.sentinel.replaying
        sentinel.replaying = True
        try:
            got_all = [row_losses(mon.model, cap, uses_cuda=_uses_cuda(mon)) for cap in caps]
        finally:
            sentinel.replaying = was
        for i, got in enumerate(got_all):
            if got[0] is None:
                ev.rows_note = got[3]
                continue
            level = max(got[0])
            if best is None or level > best[0]:
                best = (level, (i, got))
        if best is None:
            return
        micro, (parts, starts, reduction, _) = best[1]
        ev.rows, ev.row_index, ev.reduction = parts, starts, reduction
        if len(caps) > 1:
            ev.notes["micro_step"] = micro

    def _say_cost(self, mon: Session, snap: _Snapshot, seconds: float) -> None:
        mib = snap.nbytes / 2**20
        slots = self.ring.slots.maxlen or SNAPSHOT_SLOTS
        mon.emit(
            RuleEvent(
                "snapshot_cost",
                mon.global_step,
                f"rollback snapshots: {mib:.1f} MiB each, {slots} kept ({slots * mib:.1f} MiB of host memory); "
                f"{seconds * 1e3:.2f} ms to take one"
                + (" (a non-blocking copy: its launch)" if snap.event is not None else "")
                + f", every {self.every} steps",
                "info",
                evidence={"bytes": snap.nbytes, "slots": slots, "seconds": seconds, "every": self.every},
            )
        )

    def _rollback(self, mon: Session, step: int, report: SpikeReport) -> None:
        snap = self.ring.before(step)
        if snap is None:
            mon.emit(RuleEvent("rollback_unavailable", step, "no snapshot before the spike", "warning"))
            return
        try:
            self.ring.restore(mon, snap)
        except RollbackRefused as why:
            mon.emit(RuleEvent("rollback_unavailable", step, f"rollback refused: {why}", "warning"))
            return
        self.count += 1
        cfg = mon.config
        if cfg.rollback_lr_steps and cfg.rollback_lr_scale != 1.0:
            self._lr_left = int(cfg.rollback_lr_steps)
        rb = Rollback(
            step=step,
            to_step=snap.label,
            reason=report.summary(),
            cause=report.cause,
            batches_skipped=step - snap.label + 1,
            loss_before=report.loss,
            median_before=report.median,
            lr_scale=float(cfg.rollback_lr_scale),
            lr_steps=int(cfg.rollback_lr_steps),
        )
        mon.rollbacks.append(rb)
        self._open = len(mon.rollbacks) - 1
        # the slots newer than the restored state hold the spike's build-up: drop them
        for s in [s for s in self.ring.slots if s.label > snap.label]:
            self.ring.slots.remove(s)

    def _close_rollback(self, mon: Session, loss_after: float | None) -> None:
        i, self._open = self._open, None
        if i is None or i >= len(mon.rollbacks):
            return
        rb = mon.rollbacks[i] = dataclasses.replace(mon.rollbacks[i], loss_after=loss_after)
        mon.emit(RuleEvent("rollback", rb.step, str(rb), "warning", evidence=rb.to_dict()))


def _layer_ratios(names: list[str], ratio: Any, weight: Any) -> dict[str, float]:
    """Per-layer update/weight ratio from per-parameter ratios and weight norms: |dW| / |W| over the
    layer's parameters (rare path: a loop over parameters)."""
    upd: dict[str, float] = {}
    w2: dict[str, float] = {}
    for n, r, w in zip(names, ratio, weight):
        key = owner(n)
        upd[key] = upd.get(key, 0.0) + (r * w) ** 2
        w2[key] = w2.get(key, 0.0) + w * w
    return {k: math.sqrt(upd[k] / w2[k]) for k in upd if w2[k] > 0}


def _uses_cuda(mon: Session) -> bool:
    return bool(getattr(mon, "uses_cuda", getattr(mon, "_uses_cuda", False)))


def _opt_params(opt: Any) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]] if opt is not None else []


def _fits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(a, b))


def _enabled(scaler: Any) -> bool:
    fn = getattr(scaler, "is_enabled", None)
    return bool(fn()) if callable(fn) else True


def _optimizer_numbers(
    opt: Any, names: dict[int, str]
) -> tuple[list[tuple[str, float, float]], dict[str, float]]:
    """Per parameter of an Adam-like optimizer ``(name, RMS of m_hat / (sqrt(v_hat) + eps), update/weight
    ratio of the last update)``, and per module the last update/weight ratio where the state tells it
    (Adam-like: ``lr |m_hat / (sqrt(v_hat) + eps)|``; SGD with momentum: ``lr |buf|``). Rare path."""
    adaptive: list[tuple[str, float, float]] = []
    upd_sq: dict[str, float] = {}
    w_sq: dict[str, float] = {}
    with torch.no_grad():
        for g in opt.param_groups:
            lr = float(g.get("lr", math.nan))
            for p in g["params"]:
                name = names.get(id(p))
                st = opt.state.get(p)
                if name is None or not st:
                    continue
                if "exp_avg" in st and "exp_avg_sq" in st and "betas" in g:
                    b1, b2 = g["betas"]
                    t = float(st.get("step", 1))
                    m = st["exp_avg"].float() / (1 - b1**t)
                    v = st["exp_avg_sq"].float() / (1 - b2**t)
                    u = m / (v.sqrt() + float(g.get("eps", 1e-8)))
                    norm_u = float(torch.linalg.vector_norm(u))
                    rms = norm_u / math.sqrt(max(u.numel(), 1))
                    upd = lr * norm_u
                    w = float(torch.linalg.vector_norm(p.detach().float()))
                    adaptive.append((name, rms, upd / w if w > 0 else math.inf))
                elif isinstance(st.get("momentum_buffer"), torch.Tensor):
                    upd = lr * float(torch.linalg.vector_norm(st["momentum_buffer"].float()))
                    w = float(torch.linalg.vector_norm(p.detach().float()))
                else:
                    continue
                key = owner(name)
                upd_sq[key] = upd_sq.get(key, 0.0) + upd * upd
                w_sq[key] = w_sq.get(key, 0.0) + w * w
    updates = {k: math.sqrt(upd_sq[k] / w_sq[k]) if w_sq[k] > 0 else math.inf for k in upd_sq}
    return adaptive, updates


__all__ = ["ON_SPIKE", "Rollback", "SnapshotRing", "SpikeGuard"]

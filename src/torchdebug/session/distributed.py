"""Several ranks under watch(): rank and world size, the shared run folder, ranks that agree on a
non-finite step, the rank where it was born, the hang watchdog and the straggler rule.

Per step the coordinator adds ONE small collective: a ``(4, world)`` float32 tensor all-reduced with
SUM, in which each rank fills its own column (the sum of its losses and probes, non-finite iff one of
them is; busy time; data wait; the sum of its probe of the last update's parameters); it is read with
the step's one host transfer, so every rank sees every rank's flags and times.

Under DistributedDataParallel it is launched without waiting (``async_op=True``) at the end of the
backward whose gradients DDP all-reduced (the forward ran through DDP with
``require_backward_grad_sync``) and waited for at the step's transfer. DDP keeps its built-in C++
all-reduce (no communication hook). After DDP's all-reduce every rank holds the same gradients, and
after the update the same parameters, so each rank measures only its share of them
(:meth:`Coordinator.param_share`, whole tensors, about 1/world of the elements): the gradient norms
(or finiteness probes) of the share after that backward, and the parameter probe of the share after
the update. The shares travel in the same all-reduce (one entry per parameter, zeros outside the
share; the SUM is every parameter's number), so every rank reads every parameter's number and
takes the same verdict. The losses (and the timings) differ per rank and travel there as well, so a
NaN loss on one rank stops every rank even when its gradients stay finite.

A step whose gradients did not all come out of DDP's all-reduce (FSDP2's shards, a process group
without DDP, ``no_sync`` on the last micro-step, a loss whose backward began after the launch)
instead all-reduces every local flag at the transfer, blocking, as the verdicts may differ per
rank. Which path a step takes follows from the training code, so it is the same on every rank.

Only when a flag is up (the rare path) do the ranks exchange more: a tiny blocking all-reduce of the
exact verdicts (loss, gradients that never left the rank, gradients), then the rank of birth replays
the failing micro-step locally (no collectives: the wrapped module under ``no_sync``) and broadcasts
the anomaly it found. A NaN born in the backward of a micro-step DDP all-reduced is on every rank by
then: every rank replays its own micro-step, and the ranks whose replay finds the origin (one more
tiny all-reduce) are the ranks of birth.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._step import Readout
from .._tensors import dtensor_type, finite_probe, foreach_norms
from ..events import Anomaly
from ..health.stragglers import StragglerRule
from . import replica
from .protocol import Session
from .steptimes import FIELDS, StepClock, straggler_event

_HANG_MIN_S = 300.0  # default hang_timeout floor: 5 minutes
_HANG_STEPS = 20.0  # ... or 20 x the median step time, whichever is longer
_MAX_STACK = 40  # frames kept per thread in a hang record
# the step's vector, (rows, world): row 0 the losses and flags; the straggler rule's times (seconds,
# each rank its column, see health.stragglers): forward, data wait, backward, the wait in the backward,
# the previous step's wall time, the training thread's time on a CPU and waiting for one
_ROWS = {"forward": 1, "data": 2, "backward": 4, "wait": 5, "step": 6, "cpu": 7, "cpu_wait": 8}
_TIME_ROWS = tuple(_ROWS[f] for f in FIELDS)  # in the order of StepClock.times()
_ROW_PARAM = 3  # each rank's parameter probe of the last update (its share under DDP), summed
_ROW_GRAD = 9  # FSDP2 only, a 10th row: each rank's weighted norm of its gradient shards (-1: none)


def _dist() -> Any:
    """``torch.distributed`` when it is built and a default process group is initialised, else None."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    if dist.is_available() and dist.is_initialized():
        return dist
    return None


def detect(config: Any = None) -> tuple[int, int, bool]:
    """This process's ``(rank, world_size, has_process_group)``.

    From the initialised default process group, else the torchrun environment (``RANK``,
    ``WORLD_SIZE``); ``config.rank`` overrides the rank. Without either: ``(0, 1, False)``.
    """
    fixed = getattr(config, "rank", None) if config is not None else None
    dist = _dist()
    if dist is not None:
        rank, world = int(dist.get_rank()), int(dist.get_world_size())
    else:
        rank = _env_int("RANK", 0) if fixed is None else 0
        world = _env_int("WORLD_SIZE", 1)
    if fixed is not None:
        rank = int(fixed)
    return rank, max(world, rank + 1), dist is not None


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        from .._errors import ConfigError

        raise ConfigError(
            f"environment variable {name}={raw[:40]!r} is not an integer (launchers set it): fix or unset "
            f"{name}, or pass config={{'rank': N}}"
        ) from None


def is_sharded(model: nn.Module) -> bool:
    """True for a model with FSDP2 (``fully_shard``) sharded parameters."""
    dtensor = dtensor_type()
    return dtensor is not None and any(isinstance(p, dtensor) for p in model.parameters())


def split_ddp(model: nn.Module) -> tuple[Any, nn.Module]:
    """``(ddp_wrapper_or_None, module_to_watch)``: a DistributedDataParallel model is watched through
    its wrapped ``.module`` (names without the ``module.`` prefix; the replay runs there, without
    collectives)."""
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # pragma: no cover
        return None, model
    if isinstance(model, DistributedDataParallel):
        return model, model.module
    return None, model


def create_run_for(
    create_run: Callable[..., Any],
    root: str,
    name: str,
    config: dict[str, Any],
    rank: int,
    world: int,
    pg: bool,
) -> Any:
    """Open this rank's writer of the run all ranks share.

    One process: a new run folder, as always. With an initialised process group: rank 0 creates the
    folder and its path is broadcast (``broadcast_object_list``) to the other ranks, which join it
    (each writes ``rank<k>.sqlite``). Every rank takes part in the broadcast, also when rank 0 could
    not create the folder (the others then raise the same error). Without a process group but
    ``WORLD_SIZE > 1`` the ranks cannot talk: each rank records its own one-rank run folder
    ``<name>-rank<k>-<time>`` (deterministic and race-free; initialise the process group before
    ``watch`` to get one folder).
    """
    if world <= 1:
        return create_run(root=root, name=name, config=config, rank=rank)
    if not pg:
        return create_run(root=root, name=f"{name}-rank{rank}", config=config)
    dist = _dist()
    writer, err = None, None
    if rank == 0:
        try:
            writer = create_run(root=root, name=name, config=config, rank=0, world_size=world)
        except Exception as exc:  # shared below so the other ranks do not wait for a path forever
            err = exc
    box: list[Any] = [str(writer.path) if writer is not None else f"error: {err}"]
    dist.broadcast_object_list(box, src=0)
    if rank == 0:
        if err is not None:
            raise err
        return writer
    shared = str(box[0])
    if shared.startswith("error: "):
        from .._errors import RunStoreError

        raise RunStoreError(f"rank 0 could not create the run ({shared[7:]})")
    return create_run(root=root, name=name, config=config, rank=rank, world_size=world, path=shared)


def _ddp_syncs_now(ddp: Any) -> bool:
    """True inside a forward of ``ddp`` whose backward will all-reduce the gradients.

    Read from the wrapped module's forward pre-hook: DDP's own forward sets
    ``DistributedDataParallel._active_ddp_module`` around its call of the module, and
    ``require_backward_grad_sync`` is False under ``no_sync()``. A call of the wrapped module that
    bypasses DDP, DDP's Python reducer (compiled DDP) or a forward under ``no_sync`` answer False.
    Several models (``ddp_models.DDPGroup``): a forward through any of their wrappers.
    """
    if hasattr(ddp, "syncs_now"):
        return bool(ddp.syncs_now())
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel._active_ddp_module is ddp and bool(
        getattr(ddp, "require_backward_grad_sync", False)
    )


class Coordinator:
    """The ranks' agreement, rank of birth, hang watchdog and straggler rule for one watch session.

    Lives in ``mon.instruments`` (so it gets the step protocol's calls) but is not an instrument of
    the config: the monitor creates it when ``world_size > 1`` or ``config.hang_timeout`` is set.

    Reads of the session's per-step state (the whole list): ``mon.transfer`` (``loss_vals``,
    ``micro_bad``, ``values``; under FSDP2 ``norms``, ``norm_index``, ``norms_probe``). What it needs of
    the sentinel is handed in: the dict of its parameter probes (``deferred``, at construction), this
    rank's verdict (:meth:`agree`) and the local replay (:meth:`anomaly`); it never calls the sentinel,
    and the sentinel never calls it for a step's verdict.
    """

    name = "distributed"

    def __init__(
        self, mon: Session, rank: int, world: int, pg: bool, ddp: Any, deferred: dict[str, torch.Tensor]
    ) -> None:
        self.rank, self.world, self.pg, self.ddp = rank, world, pg, ddp
        # the sentinel's probes of the last update, read with the next step (name -> device tensor): they
        # ride in this step's vector; handed over once (the sentinel fills and clears this dict)
        self.deferred = deferred
        mon.transfer.lazy = False  # the step's vector carries per-parameter numbers and flags
        self.collective = pg and world > 1
        self.sharded = is_sharded(mon.model)  # FSDP2: gradient norms are reduced across ranks
        self._rows = _ROW_GRAD + 1 if self.sharded else _ROW_GRAD
        self._grad_weights: tuple[tuple[int, ...], torch.Tensor] | None = None
        self._dev = self._device() if self.collective else torch.device("cpu")  # where the vector lives
        # DDP over replicated parameters: after DDP's all-reduce every rank holds the same gradients,
        # and after the update the same parameters, so their verdicts agree without a collective
        self._ddp_fast = (
            self.collective
            and ddp is not None
            and not self.sharded
            and not getattr(ddp, "parameters_to_ignore", None)  # ignored parameters keep local gradients
        )
        self.collectives = {"hidden": 0, "blocking": 0, "rare": 0}  # counts, for tests and benchmarks
        self._share: tuple[int, list[int]] | None = None  # (len(params), this rank's parameter indices)
        self._index_dev: tuple[tuple[int, ...], torch.Tensor] | None = None  # see _per_param
        self._sync_pending = False  # a forward through DDP that will all-reduce its backward
        self._micro_sync: list[
            bool
        ] = []  # per micro-step (aligned with mon.transfer.micro_bad): all-reduced?
        self._cur_sync = False
        self._work: Any = None  # this step's hidden all-reduce, launched at the synced backward's start
        self._vec: torch.Tensor | None = None
        self._launched = (0, 0)  # (losses, micro-steps) known when it was launched
        self._fast = False  # this step's vector came from the hidden all-reduce (DDP's agreement holds)
        self._reduced = False  # this step's vector went out (a second collect in the same step is empty)
        self._verdict: tuple[int, bool] | None = None  # (step, decision) of the exact round
        self._exact: list[list[float]] = []
        self._phase = "data"
        # the straggler rule's times: only when there are ranks to compare (FSDP2: runnable times)
        first = next((p for p in mon.params if p.requires_grad), None)
        self.clock = StepClock(first, self.collective, mon.model if self.sharded else None)
        self._last_done = time.monotonic()
        self._last_step: int | None = None
        self._durations: deque[float] = deque(maxlen=200)
        self._stragglers = StragglerRule(world, float(mon.config.slowdown_factor))
        self._main = threading.get_ident()
        self._stop = threading.Event()
        self._hung = False
        self._flight_hang = False  # a hang's flight record was written (see session.hangs)
        self._thread: threading.Thread | None = None
        self.crossed = False  # the cross-rank replay ran (once per session, as replays do)
        self.hashes: replica.ReplicaHash | None = None  # the replicas' parameter hash (opt-in)
        every = mon.config.parameter_hash_every
        if every is not None and self.collective:
            if self._ddp_fast:
                self.hashes = replica.ReplicaHash(int(every))
            else:
                mon.warn_once(
                    "parameter_hash",
                    "torchdebug: parameter_hash_every compares replicated parameters "
                    "(DistributedDataParallel without ignored parameters); this model's ranks hold "
                    "different ones (FSDP2 shards, no DDP), so no hash is compared",
                )
        if self.sharded and mon.config.replay:
            # a replay re-runs the forward, whose all-gathers the other ranks would not join
            mon.config = mon.config.replace(replay=False)
        self._signal: Any = None  # SIGUSR1: this rank's flight record now (session.hangs.FlightSignal)
        if world > 1 or mon.config.hang_timeout is not None:
            from .hangs import FlightSignal

            self._signal = FlightSignal(listen=self.collective)  # a record needs collectives to compare
            self._thread = threading.Thread(
                target=self._watchdog, args=(mon,), name="torchdebug-hang", daemon=True
            )
            self._thread.start()

    # -- the step protocol ----------------------------------------------------------------------
    def on_forward_start(self, mon: Session, module: Any, args: Any, kwargs: Any) -> None:
        if self._phase != "forward":  # a micro-step's first forward
            self.clock.forward_start()
        self._phase = "forward"
        if self._ddp_fast and _ddp_syncs_now(self.ddp):
            self._sync_pending = True

    def on_backward_start(self, mon: Session, loss: Any) -> None:
        self.clock.backward_start(self._phase == "forward")
        self._phase = "backward"
        self._cur_sync, self._sync_pending = self._sync_pending, False
        if self._reduced and (mon.roots is not None or len(mon.optimizers) > 1):  # another update's read
            self._reduced = self._fast = False  # comes: its own all-reduce and verdict, on every rank
            self._verdict, self._exact = None, []

    def on_backward_end(self, mon: Session) -> None:
        self.clock.backward_end(self._phase == "backward")
        while len(self._micro_sync) < len(mon.transfer.micro_bad):
            self._micro_sync.append(self._cur_sync)
        if self._cur_sync and self._work is None and not self._reduced and self._live():
            self._launch(mon, time.perf_counter())
        self._cur_sync = False

    def before_optimizer_step(self, mon: Session) -> None:
        self._phase = "optimizer"

    def _vector(self, mon: Session, now: float, probes: bool = True) -> torch.Tensor:
        """``(4, world)`` float32 for a SUM all-reduce, this rank's column filled: the sum of the
        losses, the micro-steps' gradient flags and (``probes``) the other deferred probes known now
        (non-finite iff one of them is, or, rarely, a float32 sum of finite values overflows: the
        exact round then clears it), busy seconds, data wait seconds, the sum of the last update's
        parameter probe (:meth:`param_share`); under FSDP2 a 5th row, the weighted norm of the rank's
        gradient shards. A few small ops: it runs on every step."""
        times = zip(_TIME_ROWS, self.clock.times(now))
        vals = [lv.detach().reshape(-1) for lv in mon.transfer.loss_vals]
        deferred = self.deferred
        if probes:
            vals += [d.reshape(-1) for k, d in deferred.items() if k != "param_norms"]
        vals += [
            torch.where(b, math.inf, 0.0).reshape(1) for b in mon.transfer.micro_bad
        ]  # flags: True -> Inf
        dev = self._dev
        if dev.type == "cpu":
            rows = [[0.0] * self.world for _ in range(self._rows)]
            for row, x in times:
                rows[row][self.rank] = x
            vec = torch.tensor(rows, dtype=torch.float32)  # one op
        else:  # fills on the device: no host-to-device copy that would wait for the queued work
            vec = torch.zeros(self._rows, self.world, dtype=torch.float32, device=dev)
            for row, x in times:  # a host scalar is a kernel argument: no copy, no sync
                vec[row, self.rank] = x
        if len(vals) == 1 and vals[0].numel() == 1:
            vec[0, self.rank] = vals[0].reshape(())  # the common case: one scalar loss (one op)
        elif vals:
            vec[0, self.rank] = torch.cat([v.to(dev, torch.float32) for v in vals]).sum()
        probe = deferred.get("param_norms")
        if probe is not None and probe.numel():
            vec[_ROW_PARAM, self.rank] = probe.to(dev, torch.float32).sum()  # non-finite iff an entry is
        t = mon.transfer
        if t.shared is not None:
            # DDP: this rank's share of the gradient numbers; the shares are disjoint, so the SUM over
            # the ranks is every parameter's number
            vec = self._per_param(mon, vec, t.norm_index, t.norms)
        elif self.sharded:
            shard = self._shard_norm(mon)
            vec[_ROW_GRAD, self.rank] = (
                -1.0 if shard is None else shard.to(dev)
            )  # SUM keeps a NaN in its column
            # per parameter: this rank's weighted squared shard norm; the SUM over the ranks is that
            # parameter's squared global norm
            if shard is not None and self._grad_weights is not None:
                idx, w = self._grad_weights
                vec = self._per_param(mon, vec, idx, (t.norms.float() * w).square())  # type: ignore[union-attr]
            else:
                vec = self._per_param(mon, vec, (), None)  # zeros: the same length on every rank
        hashes = self.hashes
        if hashes is not None and hashes.due(mon.global_step):  # every N steps: two numbers per rank
            vec = torch.cat([vec.reshape(-1), hashes.entries(mon, self.rank, self.world, dev)])
        return vec

    def _per_param(
        self, mon: Session, vec: torch.Tensor, idx: Any, nums: torch.Tensor | None
    ) -> torch.Tensor:
        """``vec`` flattened, then one entry per parameter of the session (the same length on every
        rank): ``nums`` at the parameters ``idx``, zeros elsewhere. The index goes to the device once
        per distinct ``idx``, not with every step's vector (no host-to-device copy per step on GPUs)."""
        dev = vec.device
        per = torch.zeros(len(mon.params), dtype=torch.float32, device=dev)
        key = tuple(idx)
        if key and nums is not None:
            if self._index_dev is None or self._index_dev[0] != key:
                self._index_dev = (key, torch.tensor(key, dtype=torch.long, device=dev))
            per[self._index_dev[1]] = nums.to(dev, torch.float32)
        return torch.cat([vec.reshape(-1), per])

    def _shard_norm(self, mon: Session) -> torch.Tensor | None:
        """This rank's share of the FSDP2 gradient norm, on the device: ``sqrt(sum_i w_i * n_i**2)``
        over the per-parameter norms of the local shards the session already computed (no new pass
        over the gradients), ``w_i`` = 1 / (ranks holding a copy of each element of parameter i), so
        that summing the squares over all ranks gives the squared norm of the whole gradient, as
        ``clip_grad_norm_`` computes it for DTensors. None when the step has no norms (sentinel-only
        mode measures finiteness, not norms)."""
        t = mon.transfer
        norms = t.norms
        if norms is None or t.norms_probe:
            return None
        idx = tuple(t.norm_index)
        if self._grad_weights is None or self._grad_weights[0] != idx:
            w = [_copies(mon.params[i], self.world) ** -0.5 for i in idx]
            self._grad_weights = (idx, torch.tensor(w, dtype=torch.float32, device=norms.device))
        weighted: torch.Tensor = torch.linalg.vector_norm(norms.float() * self._grad_weights[1])
        return weighted

    def global_grad_norm(self, mon: Session, local: float, scale: float = 1.0) -> float:
        """FSDP2: the norm of the whole gradient, from every rank's shard norm in this step's vector.

        ``local`` is the session's norm of this rank's shards (returned as it is without sharding, on
        one rank, or when a rank sent none); ``scale`` the loss scale the gradients carry (GradScaler).
        Read from the step's all-reduced vector: no extra collective and no extra host sync. NaN when
        any rank's shards hold a NaN, Inf when any holds an Inf.
        """
        if not (self.sharded and self._live()) or len(mon.transfer.readout.dist) <= _ROW_GRAD * self.world:
            return local
        row = self._row(mon, _ROW_GRAD)
        if any(x == -1.0 for x in row):
            return local
        if any(math.isnan(x) for x in row):
            return math.nan
        return math.sqrt(sum(x * x for x in row)) / (scale or 1.0)  # float64 on the host: no overflow

    def global_grad_norms(
        self, mon: Session, local: list[float] | None, scale: float = 1.0
    ) -> list[float] | None:
        """FSDP2: each parameter's gradient norm over the whole parameter, not this rank's shard, from
        the per-parameter entries of this step's vector (no extra collective or host sync); ``local``
        (in the order of ``mon.params``) as it is when the step sent none."""
        base = self._rows * self.world
        v = mon.transfer.readout.dist
        if local is None or not (self.sharded and self._live()) or len(v) <= base:
            return local
        if any(x == -1.0 for x in self._row(mon, _ROW_GRAD)):
            return local
        out = list(local)
        for i in mon.transfer.norm_index:
            sq = v[base + i] if base + i < len(v) else math.nan
            out[i] = math.sqrt(sq) / (scale or 1.0) if sq >= 0 or math.isnan(sq) else math.nan
        return out

    # -- the parameter probe ------------------------------------------------------------------------
    def param_share(self, mon: Session) -> list[int] | None:
        """The parameters this rank probes after an update, or None for all of them.

        Under DDP every rank holds the same parameters after the update, so each rank probes about
        1/world of their elements (whole tensors, balanced by size; the same split on every rank) and
        the probes travel in the step's all-reduced vector (:data:`_ROW_PARAM`): the pass over the
        parameters costs each rank 1/world of it. Elsewhere (FSDP2's local shards, no DDP) every rank
        probes its own parameters."""
        if not (self._ddp_fast and self._live()):
            return None
        params = mon.params
        if self._share is None or self._share[0] != len(params):
            load = [0] * self.world
            mine: list[int] = []
            for i in sorted(range(len(params)), key=lambda i: (-params[i].numel(), i)):
                r = min(range(self.world), key=lambda r: (load[r], r))
                load[r] += params[i].numel()
                if r == self.rank:
                    mine.append(i)
            self._share = (len(params), sorted(mine))
        return self._share[1]

    def grad_share(self, mon: Session) -> list[int] | None:
        """The gradients this rank measures after the backward now ending, or None for all of them:
        its :meth:`param_share` when DDP all-reduced them (every rank holds the same gradients)."""
        return self.param_share(mon) if self._cur_sync else None

    def fill_shares(self, mon: Session) -> None:
        """After the step's read, under a DDP share: the other ranks' gradient numbers from the
        all-reduced vector, so the verdict, the norms and the records cover every parameter on every
        rank. Without the vector (the coordinator went off mid-step) this rank measures the rest now."""
        t = mon.transfer
        if t.shared is None:
            return
        base = self._rows * self.world
        v = t.readout.dist
        n = len(mon.params)
        if len(v) >= base + n:
            whole = v[base : base + n]
        else:  # rare: measured here, with a host read
            idx = t.shared[0]
            grads = [mon.params[i].grad for i in idx]
            nums = (finite_probe if t.norms_probe else foreach_norms)(grads).tolist()  # type: ignore[arg-type]
            whole = [0.0] * n
            for j, i in enumerate(idx):
                whole[i] = nums[j]
        t.fill_shares(whole)

    def params_flagged(self, mon: Session) -> bool | None:
        """Whether any rank's probe of the last update's parameters read non-finite (from this step's
        all-reduced vector), or None when the vector carried none (a single rank, the check at exit)."""
        if not self._live() or len(mon.transfer.readout.dist) <= _ROW_PARAM * self.world:
            return None
        return any(not math.isfinite(x) for x in self._row(mon, _ROW_PARAM))

    def params_agree(self, mine: bool) -> list[int]:
        """Rare path, once a probe flagged: the ranks whose parameters are non-finite by the exact check.

        Under DDP every rank checked the same parameters (no collective); FSDP2 shards and ranks
        without DDP hold different ones, so the ranks exchange their answers (one tiny all-reduce)."""
        if self._ddp_fast:
            return list(range(self.world)) if mine else []
        flags = torch.zeros(self.world, device=self._dev)
        flags[self.rank] = float(mine)
        _dist().all_reduce(flags, op=_dist().ReduceOp.MAX)
        self.collectives["rare"] += 1
        return [r for r, x in enumerate(flags.tolist()) if x > 0]

    def _all_reduce(self, vec: torch.Tensor, async_op: bool) -> Any:
        """SUM all-reduce on the default group; with ``async_op`` the work handle, else after it ran.
        The process group's own call: ``dist.all_reduce``'s checks cost more than the tiny collective."""
        dist = _dist()
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        opts.asyncOp = async_op
        work = dist.group.WORLD.allreduce([vec], opts)
        if not async_op:
            work.wait()
        return work

    def _launch(self, mon: Session, now: float) -> None:
        """Start this step's all-reduce without waiting: at the end of the backward whose gradients
        DDP all-reduced, carrying the losses and the micro-steps' flags, this rank's share of the
        gradient numbers and its share of the last update's parameter probe. The step's transfer
        waits for it when the update starts."""
        vec = self._vector(mon, now, probes=False)
        self._work = self._all_reduce(vec, async_op=True)
        self._vec = vec
        self._launched = (len(mon.transfer.loss_vals), len(mon.transfer.micro_bad))
        self.collectives["hidden"] += 1

    def collect(self, mon: Session) -> dict[str, torch.Tensor]:
        """This step's all-reduced vector, read with the step's one transfer.

        Under DDP it is the one launched at the synced backward's end (waited for here). A blocking all-reduce of every local flag instead when the step's gradients did
        not all come out of DDP's all-reduce, or a loss came after the launch (FSDP, a process group
        without DDP, ``no_sync`` on the last micro-step, a second backward): the same on every rank.
        """
        if self._reduced or not self.collective:
            return {}
        self._reduced = True
        self._phase = "optimizer"  # the step's check point: the optimizer's step pre-hook (or mon.step())
        work, self._work = self._work, None
        if work is not None:
            work.wait()  # launched during backward: DDP's all-reduce, queued after it, has finished
            n_loss, n_micro = self._launched
            if len(mon.transfer.loss_vals) == n_loss and all(self._micro_sync[n_micro:]):
                self._fast = True
                return {"_dist": self._vec}  # type: ignore[dict-item]
        self._fast = False
        if (
            self._ddp_fast
            and self.clock.t_forward is None
            and not mon.transfer.loss_vals
            and not mon.transfer.micro_bad
        ):
            return {}  # no step ran (the check at exit): only the parameter probe, the same on every rank
        vec = self._vector(mon, time.perf_counter())
        self._all_reduce(vec, async_op=False)  # blocking: the verdicts may differ per rank
        self.collectives["blocking"] += 1
        return {"_dist": vec}

    def _live(self) -> bool:
        """Still taking part in the collectives (a coordinator switched off by an error is not)."""
        return self.collective and not self._stop.is_set()

    def _device(self) -> torch.device:
        dist = _dist()
        if dist is not None and dist.get_backend() == "nccl" and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _row(self, mon: Session, r: int) -> list[float]:
        v = mon.transfer.readout.dist
        return [v[r * self.world + k] if r * self.world + k < len(v) else 0.0 for k in range(self.world)]

    def on_step_end(self, mon: Session, record: Any, values: Any) -> None:
        now = time.perf_counter()
        if self.collective and len(mon.transfer.readout.dist) > max(_TIME_ROWS) * self.world:
            # on every rank: the same numbers, the same decision
            row = lambda f: self._row(mon, _ROWS[f])  # noqa: E731
            ev = straggler_event(self._stragglers, row, int(record.step), self.clock.timed_by)
            if ev is not None:
                mon.emit(ev)
        hashes = self.hashes
        if hashes is not None and self._live():
            hashes.check(mon, int(record.step), self.world)
            hashes.after_update(mon, int(record.step) + 1)
        self._last_step = int(record.step)
        self._last_done = time.monotonic()
        self._hung = False
        self._phase = "data"
        self._reduced = self._fast = self._sync_pending = self._cur_sync = False
        self._work = self._vec = None  # a launch no transfer waited for (both ranks made it) completes alone
        self._micro_sync = []
        self._verdict = None
        self._exact = []
        self._durations.append(self.clock.step_end(now))

    def on_exit(self, mon: Session) -> None:
        self.remove(mon)

    def remove(self, mon: Session) -> None:
        self._stop.set()
        self.clock.remove()
        if self.collective and not self._flight_hang and mon.run_dir is not None:
            self._flight(mon, "exit")  # where this rank left: a rank still waiting names it
        self._work = self._vec = None  # never waited for at exit: the other rank may have left
        t = self._thread
        if self._signal is not None:
            self._signal.stop()
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5.0)
        if self._signal is not None and (t is None or not t.is_alive()):
            self._signal.close()  # the user's SIGUSR1 handler back
            self._signal = None

    # -- agreement -------------------------------------------------------------------------------
    def agree(self, mon: Session, readout: Readout, mine: bool) -> Readout:
        """After the read, before the verdict: the decision every rank takes for this step goes into
        ``readout.agreed`` (``mine``: this rank's own verdict, the sentinel's ``grads_bad``).

        The fast path reads the all-reduced flags (every rank's loss) and, under DDP, this rank's
        own gradient verdict (DDP made the gradients identical on every rank). When either is up,
        the ranks exchange their exact verdicts in a second small all-reduce (the rare path), so a
        probe's false alarm on one rank cannot split them; a non-finite loss on any rank then counts
        as one on every rank (the GradScaler's "non-finite loss" rule sees the same answer).
        """
        readout.agreed = _decide(self, mon, readout, mine)
        if self.hashes is not None:
            self.hashes.read(mon.global_step, readout.dist, self.world)
        return readout

    def births(self) -> list[int]:
        """Ranks where the value was born: a non-finite loss (forward), else non-finite gradients that
        never left the rank (a micro-step under ``no_sync``), else every rank whose gradients are bad.
        :meth:`anomaly` narrows the last case down by replaying on every rank."""
        loss, local, grads = self._exact or [[0.0] * self.world] * 3
        for row in (loss, local, grads):
            found = [r for r, x in enumerate(row) if x > 0]
            if found:
                return found
        return [self.rank]

    def anomaly(self, mon: Session, build: Callable[[], Anomaly]) -> Anomaly:
        """Build this step's anomaly on every rank: the first rank of birth replays (locally, without
        collectives) and broadcasts what it found; the others record that rank k found the origin.

        A NaN born in the backward of a micro-step whose gradients DDP all-reduced is on every rank by
        now: then every rank replays its own micro-step (in parallel, locally) and the ranks whose
        replay finds the origin are the ranks of birth (one more tiny all-reduce). Cost, once per
        session: one replay on each rank (two on a rank that finds nothing). ``build``: this rank's
        anomaly, replayed locally (the step's, handed in).
        """
        if not self._live() or not self._exact:
            return build()
        births = self.births()
        loss, local, grads = self._exact
        mine: Anomaly | None = None
        own = self._ddp_fast and not any(loss) and not any(local) and any(grads)
        if own:
            mine = self._replay(mon, build)
            found = torch.zeros(self.world, device=self._dev)
            found[self.rank] = float(mine.reproducible is True)
            _dist().all_reduce(found, op=_dist().ReduceOp.MAX)  # rare path: whose replay found it
            self.collectives["rare"] += 1
            births = [r for r, x in enumerate(found.tolist()) if x > 0] or births
        src = births[0]
        payload: list[Any] = [None]
        if self.rank == src:
            a = mine if mine is not None else self._replay(mon, build)
            payload[0] = a.to_dict()
        _dist().broadcast_object_list(payload, src=src)  # rare path: the anomaly travels once
        d = payload[0] or {}
        where = "rank " + ", ".join(str(r) for r in births)
        born = f"born on {where} of {self.world}"
        if self.rank == src:
            a = _with(a, rank=src, world_size=self.world, symptom=_join(a.symptom, born))
        else:
            a = self._received(mon, d, src, born)
        return replica.cross_check(self, mon, a, births, own)  # whose fault: the hardware leg

    def _received(self, mon: Session, d: dict[str, Any], src: int, born: str) -> Anomaly:
        """The anomaly rank ``src`` built and broadcast, as this rank records it."""
        return Anomaly(
            phase=str(d.get("phase", "forward")),
            module=d.get("module"),  # None: no origin traced
            op=d.get("op"),
            location=d.get("location"),
            kind=str(d.get("kind", "nan")),
            step=mon.global_step,
            rank=src,
            world_size=self.world,
            module_type=str(d.get("module_type", "")),
            micro_step=d.get("micro_step"),
            symptom=_join(str(d.get("symptom", "")), born),
            hint=str(d.get("hint", "")),
            detected_by=(
                f"rank {src} (its replay found the origin)"
                if d.get("detected_by") == "sentinel"
                else f"rank {src}: {d.get('detected_by')}"
            ),
            stack=tuple(d.get("stack") or ()),
            parameter=d.get("parameter"),
            reproducible=d.get("reproducible"),
            cause=replica.cause_from(d.get("cause")),
        )

    def _replay(self, mon: Session, build: Callable[[], Anomaly]) -> Anomaly:
        """This rank's anomaly, replayed locally: the wrapped module under ``no_sync`` (no collective).

        Never raises: the other ranks wait in the collective that follows, so an error becomes the
        anomaly's symptom instead."""
        ctx = self.ddp.no_sync() if self.ddp is not None else contextlib.nullcontext()
        try:
            with ctx:
                return build()
        except Exception as exc:
            return Anomaly(
                phase="backward",
                module=None,
                op=None,
                location=None,
                kind="nan",
                step=mon.global_step,
                rank=self.rank,
                symptom=f"non-finite values in the step (building the anomaly failed: {exc!r})"[:300],
                detected_by="sentinel",
            )

    # -- stragglers -------------------------------------------------------------------------------
    # -- hang watchdog ------------------------------------------------------------------------
    def hang_timeout(self, mon: Session) -> float:
        """``config.hang_timeout``, else max(5 min, 20 x the median step time)."""
        fixed = mon.config.hang_timeout
        if fixed is not None:
            return float(fixed)
        durations = list(self._durations)  # one C-level copy: the training thread appends meanwhile
        med = statistics.median(durations) if durations else 0.0
        return max(_HANG_MIN_S, _HANG_STEPS * med)

    def _watchdog(self, mon: Session) -> None:
        while not self._stop.is_set():
            timeout = self.hang_timeout(mon)
            asked, stop = self._signal.wait(min(1.0, timeout / 4))
            if stop or self._stop.is_set():
                return
            if asked and self.collective and mon.run_dir is not None and not mon.closed:
                self._flight(mon, "signal")  # SIGUSR1: where this rank is now; training goes on
                print(
                    f"torchdebug: rank {self.rank} wrote its flight record on SIGUSR1 to {mon.run_dir}",
                    file=sys.stderr,
                    flush=True,
                )
            stuck = time.monotonic() - self._last_done
            if not self._hung and stuck > timeout and not mon.closed:
                self._hung = True  # one record per episode: re-armed when a step completes
                try:
                    self._record_hang(mon, stuck, timeout)
                except Exception as exc:  # the watchdog must never take the job down
                    print(f"torchdebug: the hang watchdog could not record ({exc!r})", file=sys.stderr)

    def _record_hang(self, mon: Session, stuck: float, timeout: float) -> None:
        stacks, where = _thread_stacks(self._main)
        after = (
            "no step completed yet" if self._last_step is None else f"last completed step {self._last_step}"
        )
        msg = f"rank {self.rank} stuck in {self._phase} for {stuck:.1f} s ({after}) at {where}"
        step = mon.global_step
        evidence = {
            "rank": self.rank,
            "phase": self._phase,
            "last_step": self._last_step,
            "stuck_s": stuck,
            "hang_timeout": timeout,
            "where": where,
            "stacks": stacks,
        }
        if self.collective and mon.run_dir is not None:
            self._flight_hang = True  # kept at exit: the hang's record, not the exit's
            self._flight(mon, "hang")
            from . import hangs

            verdict = hangs.verdict_across_ranks(mon.run_dir, self.world, timeout, self._stop)
            if verdict is not None:  # the event (and every tracker) carries the line across ranks
                msg += f"\nhang verdict: {verdict}"
                evidence["verdict"] = verdict.to_dict()
        if mon.writer is not None:
            mon.writer.log_event(step, "hang", "error", msg, evidence)
            mon.writer.flush()
        print(f"torchdebug: {msg}", file=sys.stderr, flush=True)  # the job is never killed

    def _flight(self, mon: Session, reason: str) -> None:
        """This rank's flight record into the run folder (``session.hangs``); never raises."""
        from . import hangs

        hangs.write_flight(mon.run_dir, self.rank, reason, self._phase, self._last_step, self._main)


def _thread_stacks(main: int | None) -> tuple[dict[str, list[str]], str]:
    """Every thread's stack but this one's (the watchdog's), and where the thread ``main`` is now."""
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    stacks = {}
    for ident, frame in frames.items():
        if ident == threading.get_ident():
            continue  # this watchdog
        fs = traceback.extract_stack(frame)[-_MAX_STACK:]
        stacks[f"{names.get(ident, 'thread')} ({ident})"] = [
            f"{Path(f.filename).name}:{f.lineno} in {f.name}: {(f.line or '').strip()}" for f in fs
        ]
    top = frames.get(main) if main is not None else None
    where = ""
    if top is not None:
        inner = traceback.extract_stack(top)[-1]
        where = f"{inner.filename}:{inner.lineno} in {inner.name}"
    return stacks, where


def _copies(p: Any, world: int) -> float:
    """How many ranks hold each element of parameter ``p``: 1 for an FSDP2 parameter sharded over all
    ranks (1-D mesh), R for HSDP's R replicas of a shard, ``world`` for a plain tensor (replicated,
    as outside any ``fully_shard``)."""
    dtensor = dtensor_type()
    if dtensor is None or not isinstance(p, dtensor):
        return float(world)
    mesh, placements = p.device_mesh, p.placements  # type: ignore[attr-defined]
    shards = math.prod(mesh.size(d) for d, pl in enumerate(placements) if pl.is_shard())
    return max(world / float(shards), 1.0)


def _decide(c: Coordinator, mon: Session, readout: Readout, mine: bool) -> bool | None:
    """:meth:`Coordinator.agree`'s decision (None: no all-reduce this step, this rank's own verdict)."""
    if not c._live() or not readout.dist:
        return None  # no all-reduce this step: this rank's own verdict
    if c._verdict is not None and c._verdict[0] == mon.global_step:
        return c._verdict[1]
    suspect = any(not math.isfinite(x) for x in c._row(mon, 0)) or (c._fast and mine)
    if not suspect:
        return False
    loss_bad = readout.any_loss_bad()
    # gradients that never left this rank (micro-steps under no_sync): non-finite ones were born here
    flags = readout.micro_bad
    local = c.ddp is not None and any(
        i < len(flags) and flags[i] > 0 for i, synced in enumerate(c._micro_sync) if not synced
    )
    votes = torch.zeros(3, c.world, device=c._dev)  # NCCL reduces device tensors only
    votes[0, c.rank] = float(loss_bad)
    votes[1, c.rank] = float(local)
    votes[2, c.rank] = float(mine)
    _dist().all_reduce(votes, op=_dist().ReduceOp.MAX)  # rare path: a flag is up somewhere
    c.collectives["rare"] += 1
    c._exact = votes.tolist()
    decision = any(x > 0 for row in c._exact for x in row)
    c._verdict = (mon.global_step, decision)
    if decision and not loss_bad and any(x > 0 for x in c._exact[0]):
        readout.other_rank_loss_bad = True  # a rank's loss was non-finite: this rank's checks see it
    return decision


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a else b


def _with(a: Anomaly, **changes: Any) -> Anomaly:
    import dataclasses

    return dataclasses.replace(a, **changes)


def mean_loss(coord: Coordinator, mon: Session) -> float | None:
    """The ranks' mean loss this step from row 0 of the step's all-reduce (the sum of each rank's
    micro-step losses): the same float on every rank, so a loss-spike decision taken on it is the
    same everywhere. None without that all-reduce, or when other probes ride in row 0."""
    dist = mon.transfer.readout.dist
    if not coord._live() or not dist or set(coord.deferred) - {"param_norms"}:
        return None
    return sum(coord._row(mon, 0)) / (coord.world * max(len(mon.transfer.loss_vals), 1))

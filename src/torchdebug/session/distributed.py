"""Several ranks under watch(): rank and world size, the shared run folder, ranks that agree on a
non-finite step, the rank where it was born, the hang watchdog and the straggler rule.

Per step the coordinator adds ONE small collective to the step's existing transfer: a ``(5, world)``
float32 tensor all-reduced with MAX, in which each rank fills its own column (non-finite flag,
non-finite local gradients before DDP's all-reduce, busy time, data wait, and under FSDP2 the norm
of the rank's gradient shards, from which every rank gets the global gradient norm). It rides in
the same host read as the sentinel's numbers, so every rank sees every rank's flags and times. Only when a
flag is up (the rare path) do the ranks exchange more: a second tiny all-reduce of the exact
verdicts, then the rank of birth replays the failing micro-step locally (no collectives: the wrapped
module under ``no_sync``) and broadcasts the anomaly it found to the others.
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

from .._tensors import DTENSOR
from ..events import Anomaly, RuleEvent

_HANG_MIN_S = 300.0  # default hang_timeout floor: 5 minutes
_HANG_STEPS = 20.0  # ... or 20 x the median step time, whichever is longer
_STRAGGLER_WINDOW = 20  # steps in the straggler rule's window
_STRAGGLER_MIN = 5  # steps in the window before the rule may fire
_STRAGGLER_PATIENCE = 5  # consecutive steps above (below) the factor that start (end) an episode
_MAX_STACK = 40  # frames kept per thread in a hang record
_ROWS = 5  # rows of the per-step vector: flag, pre-all-reduce flag, busy s, data wait s, shard grad norm
_ROW_GRAD = 4  # FSDP2: each rank's weighted norm of its gradient shards (-inf: none; -1: NaN)


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
    return DTENSOR is not None and any(isinstance(p, DTENSOR) for p in model.parameters())


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


class _CommHook:
    """A DDP communication hook: flags a bucket's local gradients before they are averaged.

    Registered once per DDP model (DDP has no way to remove one); between sessions it only forwards
    to the default all-reduce. Cost per bucket: one float32 sum (a memory pass) on the device.
    """

    def __init__(self) -> None:
        self.coord: Coordinator | None = None
        self.fn = _hook_function(self)


def _hook_function(box: _CommHook) -> Callable[..., Any]:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    # a plain function without annotations: DDP checks a hook's name and its annotations' types
    def torchdebug_comm_hook(state, bucket):  # type: ignore[no-untyped-def]
        coord = box.coord
        if coord is not None:
            with contextlib.suppress(Exception):
                # finite iff the bucket is (a float32 sum of finite values may overflow: rare false alarm)
                coord._bucket_sums.append(bucket.buffer().sum(dtype=torch.float32))
                coord._last_bucket = time.perf_counter()
        return allreduce_hook(state, bucket)

    return torchdebug_comm_hook


class Coordinator:
    """The ranks' agreement, rank of birth, hang watchdog and straggler rule for one watch session.

    Lives in ``mon.instruments`` (so it gets the step protocol's calls) but is not an instrument of
    the config: the monitor creates it when ``world_size > 1`` or ``config.hang_timeout`` is set.
    """

    name = "distributed"

    def __init__(self, mon: Any, rank: int, world: int, pg: bool, ddp: Any) -> None:
        self.rank, self.world, self.pg, self.ddp = rank, world, pg, ddp
        self.collective = pg and world > 1
        self.sharded = is_sharded(mon.model)  # FSDP2: gradient norms are reduced across ranks
        self._grad_weights: tuple[tuple[int, ...], torch.Tensor] | None = None
        self._bucket_sums: list[torch.Tensor] = []
        self._last_bucket: float | None = None
        self._reduced = False  # this step's vector went out (a second collect in the same step is empty)
        self._verdict: tuple[int, bool] | None = None  # (step, decision) of the exact round
        self._exact: list[list[float]] = []
        self._phase = "data"
        self._step_start = time.perf_counter()
        self._t_forward: float | None = None
        self._t_backward: float | None = None
        self._last_done = time.monotonic()
        self._last_step: int | None = None
        self._durations: deque[float] = deque(maxlen=200)
        self._busy: deque[list[float]] = deque(maxlen=_STRAGGLER_WINDOW)
        self._above = 0
        self._below = 0
        self._straggling: int | None = None
        self._hook: _CommHook | None = None
        self._main = threading.get_ident()
        self._stop = threading.Event()
        self._hung = False
        self._thread: threading.Thread | None = None
        if self.collective and ddp is not None:
            self._install_comm_hook(mon, ddp)
        if self.sharded and mon.config.replay:
            # a replay re-runs the forward, whose all-gathers the other ranks would not join
            mon.config = mon.config.replace(replay=False)
        if world > 1 or mon.config.hang_timeout is not None:
            self._thread = threading.Thread(
                target=self._watchdog, args=(mon,), name="torchdebug-hang", daemon=True
            )
            self._thread.start()

    # -- comm hook -----------------------------------------------------------------------------
    def _install_comm_hook(self, mon: Any, ddp: Any) -> None:
        hook = getattr(ddp, "_torchdebug_comm_hook", None)
        if hook is None:
            if getattr(ddp, "_comm_hooks", None):
                mon._warn_once(
                    "comm-hook",
                    "torchdebug: this DDP model has its own communication hook; a NaN born in backward is "
                    "named by the ranks whose gradients are non-finite after the all-reduce (all of them)",
                )
                return
            hook = _CommHook()
            try:
                ddp.register_comm_hook(ddp.process_group, hook.fn)
            except Exception as exc:
                mon._warn_once(
                    "comm-hook", f"torchdebug: cannot register the DDP communication hook ({exc!r})"
                )
                return
            ddp._torchdebug_comm_hook = hook
        hook.coord = self
        self._hook = hook

    # -- the step protocol ----------------------------------------------------------------------
    def on_forward_start(self, mon: Any, module: Any, args: Any, kwargs: Any) -> None:
        if self._t_forward is None:
            self._t_forward = time.perf_counter()
        self._phase = "forward"

    def on_backward_start(self, mon: Any, loss: Any) -> None:
        if self._t_backward is None:
            self._t_backward = time.perf_counter()
        self._phase = "backward"

    def before_optimizer_step(self, mon: Any) -> None:
        self._phase = "optimizer"

    def collect(self, mon: Any) -> dict[str, torch.Tensor]:
        """This step's vector, all-reduced (MAX): one collective, read with the step's one transfer."""
        if self._reduced or not self.collective:
            return {}
        self._reduced = True
        self._phase = "optimizer"  # the step's check point: the optimizer's step pre-hook (or mon.step())
        now = time.perf_counter()
        t_fwd = self._t_forward if self._t_forward is not None else now
        # busy: local work before waiting on the other ranks (until the last bucket was handed to the
        # all-reduce, else until backward began); host clock, so on GPUs it is launch time
        end = self._last_bucket or self._t_backward or now
        busy = max(end - self._step_start, 0.0)
        data = max(t_fwd - self._step_start, 0.0)
        dev = self._device(mon)
        flags = [torch.isfinite(lv.float().sum()).logical_not() for lv in mon.transfer.loss_vals]
        flags += [b.reshape(()) for b in mon.transfer.micro_bad]
        flags += [torch.isfinite(d.float().sum()).logical_not() for d in mon.sentinel.deferred.values()]
        vec = torch.zeros(_ROWS, self.world, dtype=torch.float32, device=dev)
        if flags:
            vec[0, self.rank] = torch.stack([f.to(dev) for f in flags]).any().float()
        if self._bucket_sums:
            pre = torch.stack([s.to(dev) for s in self._bucket_sums]).sum()
            vec[1, self.rank] = torch.isfinite(pre).logical_not().float()
        self._bucket_sums = []
        vec[2, self.rank] = busy
        vec[3, self.rank] = data
        vec[_ROW_GRAD] = -math.inf  # MAX keeps each rank's own entry
        shard = self._shard_norm(mon) if self.sharded else None
        if shard is not None:
            vec[_ROW_GRAD, self.rank] = torch.where(torch.isnan(shard), -1.0, shard).to(dev)  # NaN: -1
        _dist().all_reduce(vec, op=_dist().ReduceOp.MAX)  # the step's one collective
        return {"_dist": vec}

    def _shard_norm(self, mon: Any) -> torch.Tensor | None:
        """This rank's share of the FSDP2 gradient norm, on the device: ``sqrt(sum_i w_i * n_i**2)``
        over the per-parameter norms of the local shards the monitor already computed (no new pass over
        the gradients), ``w_i`` = 1 / (ranks holding a copy of each element of parameter i), so that
        summing the squares over all ranks gives the squared norm of the whole gradient, as
        ``clip_grad_norm_`` computes it for DTensors. None when the step has no norms (sentinel-only
        mode measures finiteness, not norms)."""
        norms = mon.transfer.norms
        if norms is None or mon.transfer.norms_probe:
            return None
        idx = tuple(mon.transfer.norm_index)
        if self._grad_weights is None or self._grad_weights[0] != idx:
            w = [_copies(mon.params[i], self.world) ** -0.5 for i in idx]
            self._grad_weights = (idx, torch.tensor(w, dtype=torch.float32, device=norms.device))
        return torch.linalg.vector_norm(norms.float() * self._grad_weights[1])

    def global_grad_norm(self, mon: Any, local: float, scale: float = 1.0) -> float:
        """FSDP2: the norm of the whole gradient, from every rank's shard norm in this step's vector.

        ``local`` is the monitor's norm of this rank's shards (returned as it is without sharding, on
        one rank, or when a rank sent none); ``scale`` the loss scale the gradients carry (GradScaler).
        Read from the step's all-reduced vector: no extra collective and no extra host sync. NaN when
        any rank's shards hold a NaN, Inf when any holds an Inf.
        """
        if (
            not (self.sharded and self._live())
            or f"_dist#{_ROW_GRAD * self.world}" not in mon.transfer.values
        ):
            return local
        row = self._row(mon, _ROW_GRAD)
        if any(x == -math.inf for x in row):
            return local
        if any(x == -1.0 for x in row):
            return math.nan
        return math.sqrt(sum(x * x for x in row)) / (scale or 1.0)  # float64 on the host: no overflow

    def _live(self) -> bool:
        """Still taking part in the collectives (a coordinator switched off by an error is not)."""
        return self.collective and not self._stop.is_set()

    def _device(self, mon: Any) -> torch.device:
        dist = _dist()
        if dist is not None and dist.get_backend() == "nccl" and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _row(self, mon: Any, r: int) -> list[float]:
        v = mon.transfer.values
        return [v.get(f"_dist#{r * self.world + k}", 0.0) for k in range(self.world)]

    def on_step_end(self, mon: Any, record: Any, values: Any) -> None:
        now = time.perf_counter()
        self._durations.append(now - self._step_start)
        if self.collective and self.rank == 0 and f"_dist#{2 * self.world}" in mon.transfer.values:
            self._straggler_rule(mon, int(record.step), self._row(mon, 2))
        self._last_step = int(record.step)
        self._last_done = time.monotonic()
        self._hung = False
        self._phase = "data"
        self._reduced = False
        self._verdict = None
        self._exact = []
        self._step_start = now
        self._t_forward = self._t_backward = self._last_bucket = None
        self._bucket_sums = []

    def on_exit(self, mon: Any) -> None:
        self.remove(mon)

    def remove(self, mon: Any) -> None:
        self._stop.set()
        if self._hook is not None and self._hook.coord is self:
            self._hook.coord = None
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5.0)

    # -- agreement -------------------------------------------------------------------------------
    def step_bad(self, mon: Any) -> bool:
        """The decision every rank takes for this step (the same on every rank).

        The fast path reads only the all-reduced vector. When any rank raised a flag, the ranks
        exchange their exact verdicts (loss, gradients confirmed, local gradients before DDP's
        all-reduce) in a second small all-reduce, so a probe's false alarm on one rank cannot split them.
        """
        if not self._live() or "_dist#0" not in mon.transfer.values:
            return bool(mon.sentinel.grads_bad())
        if self._verdict is not None and self._verdict[0] == mon.global_step:
            return self._verdict[1]
        suspect = any(x > 0 for x in self._row(mon, 0) + self._row(mon, 1))
        if not suspect:
            return False
        v = mon.transfer.values
        loss_bad = any(not math.isfinite(v[k]) for k in v if k.startswith("_loss#"))
        mine = torch.zeros(3, self.world)
        mine[0, self.rank] = float(loss_bad)
        mine[1, self.rank] = float(self._row(mon, 1)[self.rank] > 0)
        mine[2, self.rank] = float(mon.sentinel.grads_bad())
        _dist().all_reduce(mine, op=_dist().ReduceOp.MAX)  # rare path: a flag is up somewhere
        self._exact = mine.tolist()
        decision = any(x > 0 for row in self._exact for x in row)
        self._verdict = (mon.global_step, decision)
        return decision

    def births(self) -> list[int]:
        """Ranks where the value was born: a non-finite loss (forward), else non-finite local
        gradients before the all-reduce (backward), else every rank whose gradients are bad."""
        loss, pre, grads = self._exact or [[0.0] * self.world] * 3
        for row in (loss, pre, grads):
            found = [r for r, x in enumerate(row) if x > 0]
            if found:
                return found
        return [self.rank]

    def anomaly(self, mon: Any) -> Anomaly:
        """Build this step's anomaly on every rank: the first rank of birth replays (locally, without
        collectives) and broadcasts what it found; the others record that rank k found the origin."""
        if not self._live() or not self._exact:
            return mon.sentinel.build_anomaly()
        births = self.births()
        src = births[0]
        payload: list[Any] = [None]
        if self.rank == src:
            ctx = self.ddp.no_sync() if self.ddp is not None else contextlib.nullcontext()
            with ctx:
                a = mon.sentinel.build_anomaly()
            payload[0] = a.to_dict()
        _dist().broadcast_object_list(payload, src=src)  # rare path: the anomaly travels once
        d = payload[0] or {}
        where = "rank " + ", ".join(str(r) for r in births)
        born = f"born on {where} of {self.world}"
        if self.rank == src:
            return _with(a, rank=src, world_size=self.world, symptom=_join(a.symptom, born))
        return Anomaly(
            phase=str(d.get("phase", "forward")),
            module=None if "module" in d and d["module"] is None else str(d.get("module", "")),
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
            reproducible=d.get("reproducible"),  # the summary is the same on every rank
        )

    # -- stragglers -------------------------------------------------------------------------------
    def _straggler_rule(self, mon: Any, step: int, busy: list[float]) -> None:
        """One event per episode when one rank's busy time is consistently above the others'.

        Robust: per-rank medians over the last 20 steps; the slowest rank's median against the
        median of the other ranks' medians; ``config.slowdown_factor`` (1.5x) for 5 steps in a row
        starts an episode, 5 steps below it ends one.
        """
        self._busy.append(busy)
        if len(self._busy) < _STRAGGLER_MIN:
            return
        med = [statistics.median(b[r] for b in self._busy) for r in range(self.world)]
        slow = max(range(self.world), key=lambda r: med[r])
        others = statistics.median(med[r] for r in range(self.world) if r != slow)
        ratio = med[slow] / others if others > 0 else math.inf
        factor = float(mon.config.slowdown_factor)
        if ratio >= factor:
            self._above, self._below = self._above + 1, 0
        else:
            self._above, self._below = 0, self._below + 1
        if self._straggling is None and self._above >= _STRAGGLER_PATIENCE:
            self._straggling = slow
            ratio_s = f"{ratio:.1f}x" if math.isfinite(ratio) else "far more than"
            mon.emit(
                RuleEvent(
                    "straggler",
                    step,
                    f"rank {slow} is the straggler: its step work takes {ratio_s} the other ranks' median "
                    f"({med[slow] * 1e3:.1f} ms vs {others * 1e3:.1f} ms over the last {len(self._busy)} steps)",
                    "warning",
                    evidence={
                        "rank": slow,
                        "ratio": ratio,
                        "busy_s": med[slow],
                        "others_busy_s": others,
                        "busy_s_by_rank": med,
                        "window": len(self._busy),
                    },
                )
            )
        elif self._straggling is not None and self._below >= _STRAGGLER_PATIENCE:
            self._straggling = None  # episode over: the next one is a new event

    # -- hang watchdog ------------------------------------------------------------------------
    def hang_timeout(self, mon: Any) -> float:
        """``config.hang_timeout``, else max(5 min, 20 x the median step time)."""
        fixed = mon.config.hang_timeout
        if fixed is not None:
            return float(fixed)
        durations = list(self._durations)  # one C-level copy: the training thread appends meanwhile
        med = statistics.median(durations) if durations else 0.0
        return max(_HANG_MIN_S, _HANG_STEPS * med)

    def _watchdog(self, mon: Any) -> None:
        while not self._stop.is_set():
            timeout = self.hang_timeout(mon)
            if self._stop.wait(min(1.0, timeout / 4)):
                return
            stuck = time.monotonic() - self._last_done
            if not self._hung and stuck > timeout and not mon.closed:
                self._hung = True  # one record per episode: re-armed when a step completes
                try:
                    self._record_hang(mon, stuck, timeout)
                except Exception as exc:  # the watchdog must never take the job down
                    print(f"torchdebug: the hang watchdog could not record ({exc!r})", file=sys.stderr)

    def _record_hang(self, mon: Any, stuck: float, timeout: float) -> None:
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
        main = frames.get(self._main)
        where = ""
        if main is not None:
            inner = traceback.extract_stack(main)[-1]
            where = f"{inner.filename}:{inner.lineno} in {inner.name}"
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
        if mon.writer is not None:
            mon.writer.log_event(step, "hang", "error", msg, evidence)
            mon.writer.flush()
        print(f"torchdebug: {msg}", file=sys.stderr, flush=True)  # one line; the job is never killed


def _copies(p: Any, world: int) -> float:
    """How many ranks hold each element of parameter ``p``: 1 for an FSDP2 parameter sharded over all
    ranks (1-D mesh), R for HSDP's R replicas of a shard, ``world`` for a plain tensor (replicated,
    as outside any ``fully_shard``)."""
    if DTENSOR is None or not isinstance(p, DTENSOR):
        return float(world)
    mesh, placements = p.device_mesh, p.placements  # type: ignore[attr-defined]
    shards = math.prod(mesh.size(d) for d, pl in enumerate(placements) if pl.is_shard())
    return max(world / shards, 1.0)


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a else b


def _with(a: Anomaly, **changes: Any) -> Anomaly:
    import dataclasses

    return dataclasses.replace(a, **changes)

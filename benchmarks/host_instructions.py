"""torchdebug's host cost counted in CPU instructions, the run store included: the launch-bound
proxy without the noise.

``benchmarks/host_cost.py`` times the launch-bound workloads in CPU time; on a shared machine those
times move by 5-10% between identical blocks, more than the overhead targets (1.05x) they check.
Instructions executed do not move: this script runs each workload and variant in a fresh process
under valgrind's ``callgrind`` with instrumentation off, and counts only a window of steps
``[N1, N2)``, switched on and off by valgrind client requests from a tiny C shim compiled on first
use (``gcc`` and valgrind's headers, ``apt-get install valgrind``). Every figure is per step: the
window's count over its steps, on every thread (the training thread and the run store's writer
thread, each shown apart).

The window is what a user on a real host pays for the store. The default, ``[16, 48)``, is warm and
exactly ``commit_steps`` (32) steps long: it holds three detail steps (20, 30, 40; 3.2 per 32 steps
in the long run) and eight leak-test samples (every 4th step). The writer is flushed just before it
opens, so earlier steps' records are not counted, and at its end, so every record of its steps is
written and committed inside it: one commit per 32 steps, as the writer's step count wakes it on a
host whose steps are fast (at most once per 32 steps; less often when 32 steps take under 0.25 s).
Its ``flush_interval`` clock (2 s) is switched off in the child: under valgrind a step takes
seconds, so that clock would commit nearly every step, which no real host of these models does
(there it only bounds how late a slow loop's records land). A window of ``k * 32`` steps gets its
inner commits from the writer's own step-count wake-up, aligned with the window; a window that is
not a multiple of 32 (``--steps 20,21``: a detail step alone) still closes with one commit, shared
by fewer steps than on a host, so its store figure is an upper bound (the report says so).

Variants: ``plain`` (no torchdebug), ``watch`` (the default ``torchdebug.watch``, run store on, as
users get it), ``sentinel`` (mode="anomaly_detection", store on), ``watch_norun`` (the default with
``run=False``: the store left out, a labelled extra), ``watch_steps`` (kept for scripts that name
it: ``watch`` itself now commits by the step count alone, so it is counted once and shown under both
names), ``hash`` (the plain loop plus the work
``parameter_hash_every=1`` adds to each DDP rank's step, ``session.replica.ReplicaHash``: the hash of
every parameter for the step's all-reduce, its check, and the hash after the update; one process, so
the all-reduce itself, which it rides in, is not counted), ``straggler`` and ``straggler_runnable``
(the plain loop plus the straggler timing each rank of a multi-rank run adds to its step,
``session.steptimes``: the clock's marks and hook, its times for the step's vector, the rule over two
equal columns; ``straggler`` as under DDP, host wall times and the first parameter's
post-accumulate-grad hook; ``straggler_runnable`` as under FSDP2, the root's forward pre-hook and a
schedstat read at each boundary. In one process ``watch()`` has no coordinator, so no timing: these
count what it adds to a rank, without the all-reduce it rides in). Workloads: ``tests/fixtures/launch_models.py``
plus ``many2000`` (2,000 parameter tensors; ``--steps 20,21`` counts its detail step alone) and
``mlp_heavy`` (MLP 784-1024-1024-10, batch 128, from ``benchmarks/store_cost.py``: compute-heavier).

Instructions are not time (a memory-bound copy costs more per instruction than Python does), but
torchdebug's host work on these proxies is mostly Python and small kernels, where they track each
other; the ratio to plain is the figure to compare between trees.

    python benchmarks/host_instructions.py [--only gpt2,deep_mlp,mlp4] [--variants plain,watch,watch_norun]
                                           [--steps 16,48] [--jobs 2]
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import shutil
import sys
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import _callgrind

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = (
    "plain",
    "watch",
    "sentinel",
    "watch_norun",
    "watch_steps",
    "hash",
    "straggler",
    "straggler_runnable",
    "straggler_only",
    "straggler_runnable_only",
)
#: Variants counted as another: the name kept for scripts, the count shared.
ALIASES = {"watch_steps": "watch"}


def child(workload: str, variant: str, n1: int, n2: int, shim: str) -> None:
    """Run ``n2`` steps of one workload and variant, instrumenting steps ``[n1, n2)`` only."""
    sys.path.insert(0, str(ROOT))
    import torch

    torch.set_num_threads(1)
    from tests.fixtures.launch_models import WORKLOADS, many_tensors, train_step

    import torchdebug as td

    warnings.simplefilter("ignore")
    lib = ctypes.CDLL(shim)
    if workload == "many2000":
        w = dataclasses.replace(WORKLOADS["many5000"], build=lambda: many_tensors(2000))
    elif workload == "mlp_heavy":  # MLP 784-1024-1024-10, batch 128: compute-heavier (store_cost.py)
        from store_cost import EXTRA

        w = EXTRA["mlp_heavy"]
    else:
        w = WORKLOADS[workload]
    g = torch.Generator().manual_seed(0)
    batches = [w.batch(g) for _ in range(4)]
    torch.manual_seed(0)
    model = w.build()
    opt = w.optimizer(model)
    if variant == "plain":
        for i in range(n2):
            if i == n1:
                lib.td_window_start()
            train_step(w, model, opt, batches[i % 4])
        lib.td_window_stop()
        return
    if variant == "hash":
        _hash_child(w, model, opt, batches, n1, n2, lib)
        return
    if variant.startswith("straggler"):
        runnable, only = "runnable" in variant, variant.endswith("_only")
        _straggler_child(w, model, opt, batches, n1, n2, lib, runnable, only)
        return
    config = td.DebugConfig(mode="anomaly_detection") if variant == "sentinel" else td.DebugConfig()  # type: ignore[arg-type]
    run = False if variant.endswith("_norun") else tempfile.mkdtemp(prefix="td-instr-")
    with td.watch(model, opt, run=run, config=config) as mon:
        writer = getattr(mon, "writer", None)
        if writer is not None:
            # the clock bound off: under valgrind a step takes seconds, so the 2 s clock would commit
            # nearly every step where a real host commits once per commit_steps (see the docstring)
            writer._core.flush_interval = 3600.0
        for i in range(n2):
            if i == n1:
                if writer is not None:
                    writer.flush()  # the steps before the window are written before it opens
                    # the writer's own step-count wake-ups, aligned with the window: its first at
                    # step n1 + commit_steps (a window of exactly commit_steps steps has none inside)
                    writer._wake_step = n1 + writer._core.commit_steps
                lib.td_window_start()
            train_step(w, model, opt, batches[i % 4])
            mon.step()
        if writer is not None:
            writer.flush()  # the window's last records written and committed inside it
        lib.td_window_stop()
    if isinstance(run, str):
        shutil.rmtree(run, ignore_errors=True)


def _hash_child(w: Any, model: Any, opt: Any, batches: list, n1: int, n2: int, lib: Any) -> None:
    """The plain loop plus what ``parameter_hash_every=1`` adds to a DDP rank's step (rank 0 of 2)."""
    from types import SimpleNamespace

    import torch
    from tests.fixtures.launch_models import train_step

    from torchdebug.session.replica import ReplicaHash

    hashes = ReplicaHash(1)
    view = SimpleNamespace(params=list(model.parameters()), global_step=0)  # what ReplicaHash reads
    for i in range(n2):
        if i == n1:
            lib.td_window_start()
        train_step(w, model, opt, batches[i % 4])
        view.global_step = i
        vec = hashes.entries(view, 0, 2, torch.device("cpu"))  # type: ignore[arg-type]
        got = vec.tolist()  # in the session: part of the step's one host read
        got[1], got[3] = got[0], got[2]  # rank 1's column: the same weights (a healthy run)
        hashes.read(i, got, 2)
        hashes.check(view, i, 2)  # type: ignore[arg-type]
        hashes.after_update(view, i + 1)  # type: ignore[arg-type]
    lib.td_window_stop()


def _straggler_child(
    w: Any, model: Any, opt: Any, batches: list, n1: int, n2: int, lib: Any, runnable: bool, only: bool
) -> None:
    """The plain loop plus the straggler timing of a rank of two (``runnable``: as under FSDP2).
    ``only``: counted only inside the timing's calls (the hook's call from inside the forward or the
    backward is not), so the whole step's process-to-process noise does not hide them."""
    import time

    import torch

    from torchdebug.health.stragglers import StragglerRule
    from torchdebug.session.steptimes import FIELDS, StepClock, straggler_event

    first = next(p for p in model.parameters() if p.requires_grad)
    clock = StepClock(first, True, root=model if runnable else None)
    rule = StragglerRule(2)
    for i in range(n2):
        if i == n1 and not only:
            lib.td_window_start()
        # ``only``: the window opens around each of the timing's calls (int: a no-op elsewhere)
        on, off = (lib.td_window_start, lib.td_window_stop) if only and i >= n1 else (int, int)
        x, y = batches[i % 4]
        on()
        clock.forward_start()  # the coordinator's call (under FSDP2 after the clock's own pre-hook)
        off()
        loss = w.loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        on()
        clock.backward_start(True)
        off()
        loss.backward()
        on()
        clock.backward_end(True)
        off()
        if w.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        on()
        t = clock.times(time.perf_counter())  # this rank's column of the step's vector
        # the all-reduced rows: rank 1's column the same as rank 0's (a healthy run, no episode)
        straggler_event(rule, lambda f, t=t: [t[FIELDS.index(f)]] * 2, i, clock.timed_by)
        clock.step_end(time.perf_counter())
        off()
    lib.td_window_stop()
    clock.remove()


def count(workload: str, variant: str, n1: int, n2: int, shim: Path, keep: str = "") -> dict[str, int]:
    """Instructions executed in the window, per thread (``total``, ``main``, ``others``); ``keep``: a
    folder to copy callgrind's files into (``WORKLOAD-VARIANT.cg.out*``) for ``callgrind_annotate``."""
    dumps = _callgrind.run(
        __file__,
        ["--child", workload, variant, str(n1), str(n2), str(shim)],
        f"{workload}/{variant}",
        Path(keep) / f"{workload}-{variant}" if keep else None,
    )
    per_thread = [(d.thread, d.instructions) for d in dumps]
    main = sum(n for t, n in per_thread if t == 1)
    total = sum(n for _, n in per_thread)
    return {"total": total, "main": main, "others": total - main}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--only", default="gpt2", help="workloads, comma-separated (launch_models.py, many2000, mlp_heavy)"
    )
    ap.add_argument("--variants", default="plain,watch,watch_norun")
    ap.add_argument(
        "--steps",
        default="16,48",
        help="N1,N2: the window [N1, N2) of steps counted (a multiple of commit_steps, 32, as a host commits)",
    )
    ap.add_argument("--jobs", type=int, default=2, help="valgrind processes at once")
    ap.add_argument(
        "--keep", default="", help="a folder to keep callgrind's files in, for callgrind_annotate"
    )
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        c = args.child
        child(c[0], c[1], int(c[2]), int(c[3]), c[4])
        return
    _callgrind.require_valgrind()
    shim = _callgrind.shim()
    n1, n2 = (int(x) for x in args.steps.split(","))
    workloads = [w for w in args.only.split(",") if w]
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        sys.exit(f"unknown variants {unknown}; choose from {VARIANTS}")
    if "plain" not in variants:
        variants.insert(0, "plain")
    counted = list(dict.fromkeys(ALIASES.get(v, v) for v in variants))  # an alias counted once
    jobs = [(w, v) for w in workloads for v in counted]
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
    n = n2 - n1
    got: dict[tuple[str, str], dict[str, int]] = {}
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(count, *j, n1, n2, shim, args.keep): j for j in jobs}
        for f in as_completed(futures):  # each count as it lands: a gpt2 job takes minutes
            j = futures[f]
            got[j] = f.result()
            print(f"# {j[0]} {j[1]}: {got[j]['total'] / n:,.0f} instructions/step", flush=True)
    for (w, v), c in list(got.items()):
        for alias, real in ALIASES.items():
            if v == real:
                got[(w, alias)] = c
    commit_steps = 32  # the writer's default (create_run's commit_steps)
    commits = -(-n // commit_steps)
    note = (
        f"{commits} commit(s) in {n} steps, one per {commit_steps} as on a host"
        if n % commit_steps == 0
        else f"{commits} commit(s) in {n} steps: more per step than a host's one per {commit_steps}, "
        "so the store's share is an upper bound"
    )
    print(
        f"instructions per step over steps [{n1}, {n2}), writer flushed at both ends ({note}); "
        "callgrind, 1 torch thread"
    )
    for w in workloads:
        plain = got[(w, "plain")]["total"] / n
        print(
            f"\n{w}\n| variant | instructions/step | ratio | added/step | training thread | other threads |"
            "\n|---|---|---|---|---|---|"
        )
        for v in variants:
            c = got[(w, v)]
            per = c["total"] / n
            added = "-" if v == "plain" else f"{per - plain:+,.0f}"
            print(
                f"| {v} | {per:,.0f} | {per / plain:.3f}x | {added} | {c['main'] / n:,.0f} | "
                f"{c['others'] / n:,.0f} ({c['others'] / n / plain:.1%}) |"
            )


if __name__ == "__main__":
    main()

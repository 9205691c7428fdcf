"""torchdebug's host cost counted in CPU instructions, the run store included: the launch-bound
proxy without the noise.

``benchmarks/host_cost.py`` times the launch-bound workloads in CPU time; on a shared machine those
times move by 5-10% between identical blocks, more than the overhead targets (1.05x) they check.
Instructions executed do not move: this script runs each workload and variant in a fresh process
under valgrind's ``callgrind`` with instrumentation off, and counts only a window of steps
``[N1, N2)`` (default ``[16, 26)``: warm, and one detail step, step 20, inside). At both ends of the
window the run store's writer is flushed (its queue written and committed), so everything the store
does for the window's steps is counted, on every thread: the training thread and the writer
thread, each shown apart. The window is switched on and off by valgrind client requests from a
tiny C shim compiled on first use (``gcc`` and valgrind's headers, ``apt-get install valgrind``).

Variants: ``plain`` (no torchdebug), ``watch`` (the default ``torchdebug.watch``, run store on, as
users get it), ``sentinel`` (mode="anomaly_detection", store on), ``watch_norun`` (the default with
``run=False``: the store left out, a labelled extra), ``watch_steps`` (``watch`` with the writer
committing by the step count alone: under valgrind a step takes seconds, so the store's 2 s clock
commits nearly every step where a real host commits once per 32 steps; the window's closing flush
still commits once, so this is an upper bound of a fast host's writer cost), ``hash`` (the plain loop plus the work
``parameter_hash_every=1`` adds to each DDP rank's step, ``session.replica.ReplicaHash``: the hash of
every parameter for the step's all-reduce, its check, and the hash after the update; one process, so
the all-reduce itself, which it rides in, is not counted), ``straggler`` and ``straggler_runnable``
(the plain loop plus the straggler timing each rank of a multi-rank run adds to its step,
``session.steptimes``: the clock's marks and hook, its times for the step's vector, the rule over two
equal columns; ``straggler`` as under DDP, host wall times and the first parameter's
post-accumulate-grad hook; ``straggler_runnable`` as under FSDP2, the root's forward pre-hook and a
schedstat read at each boundary. In one process ``watch()`` has no coordinator, so no timing: these
count what it adds to a rank, without the all-reduce it rides in). Workloads: ``tests/fixtures/launch_models.py``
plus ``many2000`` (2,000 parameter tensors; ``--steps 20,21`` counts its detail step alone).

Instructions are not time (a memory-bound copy costs more per instruction than Python does), but
torchdebug's host work on these proxies is mostly Python and small kernels, where they track each
other; the ratio to plain is the figure to compare between trees.

    python benchmarks/host_instructions.py [--only gpt2,deep_mlp,mlp4] [--variants plain,watch,watch_norun]
                                           [--steps 16,26] [--jobs 2]
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

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
_SHIM = r"""
#include <valgrind/callgrind.h>
void td_window_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void td_window_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; }
"""


def _shim() -> Path:
    """The client-request shim (built once into the system temp folder)."""
    so = Path(tempfile.gettempdir()) / f"torchdebug-callgrind-window-{os.getuid()}.so"
    if not so.exists():
        src = so.with_suffix(".c")
        src.write_text(_SHIM)
        tmp = so.with_name(f"{so.name}.{os.getpid()}")
        subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", str(tmp), str(src)], check=True)
        os.replace(tmp, so)
    return so


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
        if variant == "watch_steps" and writer is not None:
            # commits by the step count alone (every 32 steps), as on a host where 32 steps take less
            # than the 2 s clock: under valgrind a step takes seconds, so the clock would commit
            # nearly every step. The window's closing flush still commits once per window.
            writer._core.flush_interval = 3600.0
        for i in range(n2):
            if i == n1:
                if writer is not None:
                    writer.flush()  # the steps before the window are written before it opens
                lib.td_window_start()
            train_step(w, model, opt, batches[i % 4])
            mon.step()
        if writer is not None:
            writer.flush()  # the window's records written and committed inside it
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
    with tempfile.TemporaryDirectory(prefix="td-cg-") as tmp:
        out_file = Path(tmp) / "cg.out"
        cmd = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            "--separate-threads=yes",
            f"--callgrind-out-file={out_file}",
            sys.executable,
            __file__,
            "--child",
            workload,
            variant,
            str(n1),
            str(n2),
            str(shim),
        ]
        # a fixed hash seed: string hashing decides how often dict lookups collide, which moves a
        # process's count by ~0.5 M instructions per step between seeds
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0", PYTHONPATH=str(ROOT / "src"))
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp)
        if out.returncode != 0:
            raise RuntimeError(f"{workload}/{variant} failed under valgrind:\n{out.stderr[-3000:]}")
        per_thread = []
        for f in sorted(Path(tmp).glob("cg.out*")):
            text = f.read_text(errors="replace")
            m = re.search(r"^totals:\s+(\d+)", text, re.M)
            thread = re.search(r"^thread:\s+(\d+)", text, re.M)
            per_thread.append((int(thread.group(1)) if thread else 1, int(m.group(1)) if m else 0))
            if keep:
                shutil.copy(f, Path(keep) / f"{workload}-{variant}.{f.name}")
    main = sum(n for t, n in per_thread if t == 1)
    total = sum(n for _, n in per_thread)
    return {"total": total, "main": main, "others": total - main}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="gpt2", help="workloads, comma-separated (launch_models.py, many2000)")
    ap.add_argument("--variants", default="plain,watch,watch_norun")
    ap.add_argument("--steps", default="16,26", help="N1,N2: the window [N1, N2) of steps counted")
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
    if shutil.which("valgrind") is None or not Path("/usr/include/valgrind/callgrind.h").exists():
        sys.exit("valgrind is not installed: apt-get install valgrind")
    shim = _shim()
    n1, n2 = (int(x) for x in args.steps.split(","))
    workloads = [w for w in args.only.split(",") if w]
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        sys.exit(f"unknown variants {unknown}; choose from {VARIANTS}")
    if "plain" not in variants:
        variants.insert(0, "plain")
    jobs = [(w, v) for w in workloads for v in variants]
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
    print(
        f"instructions per step over steps [{n1}, {n2}), writer flushed at both ends; callgrind, 1 torch thread"
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

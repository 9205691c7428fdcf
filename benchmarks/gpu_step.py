"""Step time of a GPT-2-small-shaped model: plain loop vs ``watch`` blocking vs ``watch(sync="async")``.

CUDA (the default when a GPU is present): GPT-2 small (12 blocks, d=768, 12 heads, vocab 50257,
tied embeddings, seq 1024, batch 8) under ``torch.autocast(bfloat16)``, fused AdamW, gradient
clipping. Variants share one model and optimizer and run interleaved in chunks of ``--chunk`` steps
(``torch.cuda.synchronize()`` at each chunk's ends only, so a chunk's wall time is what the GPU and
host together took); the median per-step time over ``--repeats`` chunks is printed with its ratio to
plain. With ``sync="async"`` an ordinary step makes no blocking device-to-host read, so the host
can keep queueing while the GPU works; the blocking mode waits once per step.

CPU (``--device cpu``): the launch-bound proxy of the same shapes (12 blocks, width 32, 4 heads,
vocab 256, seq 16, batch 2: host work bounds the step as it does on a GPU), measured as process CPU
time with one thread (``time.process_time``), interleaved chunks, medians.

Variants: ``plain``; ``sentinel`` (``mode="anomaly_detection"``) and ``default`` (the default
instruments, no run folder), each with ``sync="blocking"`` and ``sync="async"``; ``default/auto``:
the default ``sync="auto"`` (async on CUDA here, blocking on a CPU) without the run store;
``default/auto+store``: ``td.watch(model, opt)`` as a user gets it, the run store on (a run folder
under a temporary root). Also printed per
async variant: the staged reads (one per step, no wait) and the waits (queue full or exit).

    python benchmarks/gpu_step.py [--device cuda|cpu] [--repeats 7] [--chunk 20] [--warmup 5]
                                  [--variants sentinel/blocking,sentinel/async] [--count] [--boundaries]
                                  [--batch B] [--seq T]

``--count``: per ordinary step, the aten ops run (about one kernel launch each on a GPU), the Python
function calls and the host reads (``Tensor.item/tolist/cpu/numpy/__bool__/__float__``) of each
variant; deterministic, so it does not depend on the machine's load. ``--boundaries``: torchdebug's
own CPU time per step, inside each step-protocol method of the session (medians of interleaved
sessions), which the load of a shared machine blurs far less than a whole step's time.

Without a GPU and without ``--device cpu`` it says so and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import torchdebug as td


class Block(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape  # (B, T, C)
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, C/H)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, d: int, n_layer: int, n_head: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList([Block(d, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as GPT-2

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))  # (B, T, vocab)


SHAPES = {
    "cuda": {"vocab": 50257, "seq": 1024, "d": 768, "n_layer": 12, "n_head": 12, "batch": 8},
    "cpu": {"vocab": 256, "seq": 16, "d": 32, "n_layer": 12, "n_head": 4, "batch": 2},
}


def shape_of(args: argparse.Namespace) -> dict[str, int]:
    """The device's shapes, with ``--batch``/``--seq`` applied (``--batch 1 --seq 64`` on a GPU: the same
    GPT-2 small, launch-bound, as small-batch fine-tuning is)."""
    shape = dict(SHAPES[args.device])
    shape.update({k: v for k, v in (("batch", args.batch), ("seq", args.seq)) if v is not None})
    return shape


def variants(device: str) -> dict[str, Callable[[nn.Module, Any], contextlib.AbstractContextManager]]:
    sentinel = td.DebugConfig(mode="anomaly_detection", store=False)
    default = td.DebugConfig(store=False)
    out: dict[str, Callable[[nn.Module, Any], contextlib.AbstractContextManager]] = {
        "plain": lambda m, o: contextlib.nullcontext()
    }
    for name, cfg in (("sentinel", sentinel), ("default", default)):
        for sync in ("blocking", "async"):
            out[f"{name}/{sync}"] = lambda m, o, c=cfg, s=sync: td.watch(m, o, config=c, sync=s, run=False)
    # the default as users get it: sync="auto" (async on CUDA with this fused AdamW, blocking on a CPU)
    out["default/auto"] = lambda m, o: td.watch(m, o, config=default, run=False)
    # ... and with the run store every default watch opens (a new run folder under a temporary root):
    # its writer thread shares the GIL with the training loop, so this is the figure users pay
    out["default/auto+store"] = lambda m, o: td.watch(m, o, run=_store_root())
    return out


_STORE_ROOT: list[str] = []


def _store_root() -> str:
    """One temporary runs root for the benchmark (a new run folder per session inside it)."""
    if not _STORE_ROOT:
        import tempfile

        _STORE_ROOT.append(tempfile.mkdtemp(prefix="torchdebug-bench-runs-"))
    return _STORE_ROOT[0]


def run(args: argparse.Namespace) -> None:
    device = args.device
    shape = shape_of(args)
    torch.manual_seed(0)
    model = GPT(shape["vocab"], shape["seq"], shape["d"], shape["n_layer"], shape["n_head"]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    B, T, V = shape["batch"], shape["seq"], shape["vocab"]
    data = torch.randint(0, V, (16, B, T + 1), device=device)
    cuda = device == "cuda"
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    counter = [0]

    def step() -> None:
        batch = data[counter[0] % len(data)]
        counter[0] += 1
        x, y = batch[:, :-1], batch[:, 1:]
        opt.zero_grad(set_to_none=True)
        with amp:
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, V).float(), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    def clock() -> float:
        if cuda:
            torch.cuda.synchronize()
            return time.perf_counter()
        return time.process_time()

    vs = {
        k: v for k, v in variants(device).items() if k == "plain" or not args.variants or k in args.variants
    }
    times: dict[str, list[float]] = {k: [] for k in vs}
    reads: dict[str, list[tuple[int, int, int]]] = {k: [] for k in vs}
    for _ in range(args.warmup):
        step()
    for rep in range(args.repeats + 1):  # repeat 0 warms each variant up (not counted)
        order = list(vs) if rep % 2 == 0 else list(reversed(vs))  # interleaved, both orders
        for name in order:
            with vs[name](model, opt) as mon:
                mon_step = getattr(mon, "step", lambda: None)
                for _ in range(2):  # the optimizer's first update under a session, and its own warm-up
                    step()
                    mon_step()
                t0 = clock()
                for _ in range(args.chunk):
                    step()
                    mon_step()
                t1 = clock()
            a = getattr(mon, "_async", None)
            if a is not None:  # after exit: the last step's numbers are read there
                reads[name].append((args.chunk + 2, a.host_reads, a.blocking_reads))
            if rep > 0:
                times[name].append((t1 - t0) / args.chunk)
    unit = "wall ms/step (CUDA, synchronised per chunk)" if cuda else "CPU ms/step (1 thread, process_time)"
    params = sum(p.numel() for p in model.parameters())
    print(
        f"GPT-2-shaped: {shape['n_layer']} blocks, d={shape['d']}, vocab {V}, seq {T}, batch {B}, "
        f"{params / 1e6:.1f}M parameters, {len(list(model.parameters()))} tensors; {device}; "
        f"torch {torch.__version__}; {args.repeats} x {args.chunk} steps per variant"
    )
    plain = statistics.median(times["plain"])
    print(f"{'variant':<20} {unit:>44} {'ratio':>8}")
    for name, ts in times.items():
        med = statistics.median(ts)
        extra = ""
        if reads[name]:
            steps, staged, waits = reads[name][-1]
            extra = f"   staged reads {staged}/{steps} steps, waits {waits}"
        print(f"{name:<20} {med * 1e3:>44.3f} {med / plain:>8.3f}{extra}")
    for name, ts in times.items():
        if name != "plain":
            print(f"added per step, {name:<18}: {(statistics.median(ts) - plain) * 1e6:8.0f} us")
    if not all(math.isfinite(x) for ts in times.values() for x in ts):
        raise SystemExit("non-finite timing")


class _OpCount(TorchDispatchMode):
    """Counts the aten ops run under it (on a GPU, about one kernel launch each)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.n += 1
        return func(*args, **(kwargs or {}))


def count(args: argparse.Namespace) -> None:
    """Per ordinary step: aten ops, Python function calls and host reads, plain and each variant.

    Deterministic (no clock): what a launch-bound GPU step pays for is roughly the ops launched and
    the Python run, plus each blocking read's wait."""
    import cProfile
    import pstats

    device = args.device
    shape = shape_of(args)
    torch.manual_seed(0)
    model = GPT(shape["vocab"], shape["seq"], shape["d"], shape["n_layer"], shape["n_head"]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    V = shape["vocab"]
    batch = torch.randint(0, V, (shape["batch"], shape["seq"] + 1), device=device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(batch[:, :-1]).reshape(-1, V), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    from torchdebug.session import deferred

    reads = {"n": 0, "staged": 0, "inside": 0}
    originals = {
        m: getattr(torch.Tensor, m) for m in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__")
    }

    def counting(orig: Any) -> Any:
        def read(t: Any, *a: Any, **k: Any) -> Any:
            if not reads["inside"]:
                reads["n"] += 1
            return orig(t, *a, **k)

        return read

    host_values = deferred.host_values

    def staged(buf: torch.Tensor) -> list[float]:  # the async read of a buffer a step old: apart
        reads["staged"] += 1
        reads["inside"] = 1
        try:
            return host_values(buf)
        finally:
            reads["inside"] = 0

    print(
        f"{'variant':<20} {'aten ops/step':>14} {'python calls/step':>18} {'blocking reads/step':>20} "
        f"{'staged reads/step':>18}"
    )
    for name, make in {
        k: v for k, v in variants(device).items() if not args.variants or k in args.variants or k == "plain"
    }.items():
        with make(model, opt) as mon:
            mon_step = getattr(mon, "step", lambda: None)
            for _ in range(3):  # the first update under the session is read blocking (no state check)
                step()
                mon_step()
            ops, prof = _OpCount(), cProfile.Profile()
            n = 5
            try:
                deferred.host_values = staged  # type: ignore[assignment]
                for m, orig in originals.items():
                    setattr(torch.Tensor, m, counting(orig))
                with ops:
                    prof.enable()
                    for _ in range(n):
                        step()
                        mon_step()
                    prof.disable()
            finally:
                deferred.host_values = host_values  # type: ignore[assignment]
                for m, orig in originals.items():
                    setattr(torch.Tensor, m, orig)
            calls = pstats.Stats(prof).total_calls  # type: ignore[attr-defined]
            print(
                f"{name:<20} {ops.n / n:>14.1f} {calls / n:>18.1f} {reads['n'] / n:>20.1f} "
                f"{reads['staged'] / n:>18.1f}"
            )
            reads["n"] = reads["staged"] = 0


def boundaries(args: argparse.Namespace) -> None:
    """torchdebug's own host time per step, boundary by boundary (CPU time spent inside each
    ``Monitor`` step-protocol method, the sentinel and instruments they call included), medians over
    interleaved sessions; plus each variant's whole step."""
    import collections

    from torchdebug.session import monitor

    acc: collections.Counter[str] = collections.Counter()
    names = ("forward_started", "forward_done", "backward_started", "backward_done", "clip_starting")
    names += ("clip_done", "update_starting", "update_done", "step")
    originals = {n: getattr(monitor.Monitor, n) for n in names}

    def timed(name: str, orig: Any) -> Any:
        def method(*a: Any, **k: Any) -> Any:
            t = time.process_time()
            try:
                return orig(*a, **k)
            finally:
                acc[name] += time.process_time() - t

        return method

    device = args.device
    shape = shape_of(args)
    torch.manual_seed(0)
    model = GPT(shape["vocab"], shape["seq"], shape["d"], shape["n_layer"], shape["n_head"]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    V = shape["vocab"]
    data = torch.randint(0, V, (16, shape["batch"], shape["seq"] + 1), device=device)

    def step(i: int) -> None:
        b = data[i % len(data)]
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(b[:, :-1]).reshape(-1, V), b[:, 1:].reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    per: dict[str, list[dict[str, float]]] = collections.defaultdict(list)
    whole: dict[str, list[float]] = collections.defaultdict(list)
    vs = {
        k: v
        for k, v in variants(device).items()
        if k != "plain" and (not args.variants or k in args.variants)
    }
    try:
        for n, orig in originals.items():
            setattr(monitor.Monitor, n, timed(n, orig))
        for rep in range(args.repeats):
            for name in list(vs) if rep % 2 == 0 else list(reversed(vs)):
                with vs[name](model, opt) as mon:
                    for i in range(2):
                        step(i)
                        mon.step()
                    acc.clear()
                    t0 = time.process_time()
                    for i in range(args.chunk):
                        step(i)
                        mon.step()
                    whole[name].append((time.process_time() - t0) / args.chunk)
                    per[name].append({k: v / args.chunk for k, v in acc.items()})
    finally:
        for n, orig in originals.items():
            setattr(monitor.Monitor, n, orig)
    print(f"{'variant':<20} {'step ms':>8} {'torchdebug us':>14}  per boundary (us)")
    for name in vs:
        parts = {n: statistics.median([r.get(n, 0.0) for r in per[name]]) * 1e6 for n in names}
        own = sum(parts.values())
        detail = ", ".join(f"{n} {x:.0f}" for n, x in parts.items() if x >= 1)
        print(f"{name:<20} {statistics.median(whole[name]) * 1e3:>8.2f} {own:>14.0f}  {detail}")


@contextlib.contextmanager
def _one_thread(device: str) -> Iterator[None]:
    before = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)  # CPU time of one thread: what the host adds, not the BLAS pool's
    try:
        yield
    finally:
        torch.set_num_threads(before)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--chunk", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=None, help="batch size (default: the device's shape)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: the device's shape)")
    ap.add_argument("--count", action="store_true", help="ops, Python calls and reads per step (no clock)")
    ap.add_argument(
        "--boundaries", action="store_true", help="torchdebug's CPU time per step protocol boundary"
    )
    ap.add_argument(
        "--variants", type=lambda v: v.split(","), default=None, help="e.g. sentinel/blocking,sentinel/async"
    )
    args = ap.parse_args(argv)
    if args.device is None:
        if not torch.cuda.is_available():
            print(
                "no CUDA GPU here: nothing to measure. Run on a GPU machine, or with --device cpu for the "
                "launch-bound CPU proxy of the same shapes"
            )
            return 0
        args.device = "cuda"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA GPU here")
        return 0
    warnings.simplefilter("ignore", td.TorchDebugWarning)  # random tokens: the health rules speak up
    with _one_thread(args.device):
        (count if args.count else boundaries if args.boundaries else run)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

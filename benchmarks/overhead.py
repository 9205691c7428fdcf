"""Overhead of torchdebug.watch against a plain training loop measured in the same run.

Workloads (CPU by default; ``--device cuda`` for a GPU): MLP 784-1024-1024-10 batch 256; GPT-style
4 blocks d=256 seq 128 batch 8; small CNN on 3x32x32 batch 64. Variants share one model and
optimizer and are interleaved in chunks, so machine noise and memory layout hit them alike: plain, watch with the default instruments (sentinel, gradient health,
memory, timing, run store), watch with the sentinel only, and ``torch.autograd.detect_anomaly()``.
Printed: median step time per variant and its ratio to plain; the watch variant split into ordinary
steps and detail steps (every ``detail_every``); and the cost of one replay under op-level tracing
(what the sentinel pays once, when something went wrong) against one plain step.

With ``--lightning`` / ``--transformers``: the GPT workload under that framework's own loop, the
framework alone against the same loop with ``TorchDebugCallback()`` (default watch), interleaved.

    python benchmarks/overhead.py [--repeats 7] [--chunk 20] [--device cpu|cuda] [--only mlp,gpt,cnn]
                                  [--lightning] [--transformers] [--ddp N] [--fsdp N]

``--ddp N``: the same workloads under DistributedDataParallel on N CPU processes (gloo, 127.0.0.1),
each rank with its own batches and ``cpu_count // N`` threads. Variants, interleaved on ONE DDP model
(a session leaves nothing on it, so there is no copy bias): plain DDP, the default watch and the
sentinel alone. Rank 0's median step times are printed (DDP synchronises the ranks every step).
``collectives/step``: the coordinator's all-reduces per watched step on rank 0, hidden (launched
as the synced backward ends, waited for at the update) + blocking. ``cpu``: rank 0's median CPU
time per step (all threads of the process: ``time.process_time``), plain, and watch (ordinary steps)
and the sentinel against it: the work torchdebug adds, which other processes' load and the ranks'
waiting for each other do not inflate (on a shared 2-core machine the wall-clock ratios move by
several percent between identical runs).

``--fsdp N``: the same under FSDP2 (``fully_shard`` on each GPT block, else each Linear/Conv2d, then
the root; gloo on N CPU processes), the variants interleaved on one sharded model as for DDP.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import torchdebug as td
from torchdebug.nonfinite.locate import replay_capture
from torchdebug.store import create_run


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Block(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape  # (B, T, C)
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = att.masked_fill(
            torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1), float("-inf")
        ).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(
        self, vocab: int = 512, d: int = 256, n_layer: int = 4, n_head: int = 4, block: int = 128
    ) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.ModuleList([Block(d, n_head) for _ in range(n_layer)])
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        )  # fmt: skip
        self.head = nn.Linear(64 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def workloads(
    device: str,
) -> dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple[torch.Tensor, torch.Tensor]], Callable]]:
    g = torch.Generator().manual_seed(0)

    def mlp_batch() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(256, 784, generator=g).to(device), torch.randint(0, 10, (256,), generator=g).to(
            device
        )

    def gpt_batch() -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, 512, (8, 129), generator=g).to(device)
        return idx[:, :-1], idx[:, 1:]

    def cnn_batch() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(64, 3, 32, 32, generator=g).to(device), torch.randint(
            0, 10, (64,), generator=g
        ).to(device)

    ce = lambda out, y: F.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))  # noqa: E731
    return {"mlp": (MLP, mlp_batch, ce), "gpt": (GPT, gpt_batch, ce), "cnn": (CNN, cnn_batch, ce)}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_chunk(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batches: list,
    loss_fn: Callable,
    steps: int,
    device: str,
    mon: Any = None,
    anomaly: bool = False,
    cpu: list[float] | None = None,
) -> list[float]:
    """Per-step wall times; with ``cpu``, each step's CPU time of this process (all its threads) is
    appended to it: work done, which other processes' load does not inflate."""
    times = []
    ctx = torch.autograd.detect_anomaly(check_nan=True) if anomaly else contextlib.nullcontext()
    with ctx:
        for i in range(steps):
            x, y = batches[i % len(batches)]
            _sync(device)
            c0 = time.process_time()
            t0 = time.perf_counter()
            loss = loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if mon is not None:
                mon.step()
            _sync(device)
            times.append(time.perf_counter() - t0)
            if cpu is not None:
                cpu.append(time.process_time() - c0)
    return times


def bench(name: str, spec: tuple, args: argparse.Namespace, writer: Any) -> dict[str, Any]:
    build, make_batch, loss_fn = spec
    device = args.device
    batches = [make_batch() for _ in range(4)]
    variants = ["plain", "watch", "sentinel", "detect_anomaly"]
    # One model and optimizer for every variant: separate copies put the weights at different
    # addresses, and the GEMMs' speed then differs by alignment, which is not what is measured here.
    torch.manual_seed(0)
    shared = build().to(device)
    shared_opt = torch.optim.AdamW(shared.parameters(), lr=1e-4)
    models: dict[str, nn.Module] = dict.fromkeys(variants, shared)
    opts: dict[str, torch.optim.Optimizer] = dict.fromkeys(variants, shared_opt)
    cfgs = {"watch": td.DebugConfig(), "sentinel": td.DebugConfig(mode="anomaly_detection")}
    times: dict[str, list[float]] = {v: [] for v in variants}
    detail_times: list[float] = []
    ordinary_times: list[float] = []
    with warnings_quiet():
        for v in variants:  # warm-up
            run_chunk(models[v], opts[v], batches, loss_fn, 3, device, anomaly=v == "detect_anomaly")
        for _ in range(args.repeats):
            for v in variants:
                if v in cfgs:
                    with td.watch(models[v], opts[v], run=writer, config=cfgs[v]) as mon:
                        start = mon.global_step
                        t = run_chunk(models[v], opts[v], batches, loss_fn, args.chunk, device, mon=mon)
                    if v == "watch":
                        every = cfgs[v].detail_every
                        for j, x in enumerate(t):
                            (detail_times if (start + j) % every == 0 else ordinary_times).append(x)
                else:
                    t = run_chunk(
                        models[v],
                        opts[v],
                        batches,
                        loss_fn,
                        args.chunk,
                        device,
                        anomaly=v == "detect_anomaly",
                    )
                times[v].extend(t)
        # replay: one traced re-run of a captured step (forward + loss + backward)
        model, opt = models["sentinel"], opts["sentinel"]
        replay_times = []
        with td.watch(model, opt, run=False, config=cfgs["sentinel"]) as mon:
            x, y = batches[0]
            loss = loss_fn(model(x), y)
            opt.zero_grad()
            loss.backward()
            cap = mon.sentinel.captures[-1]
            names = mon.names
            mon.sentinel.replaying = True
            for _ in range(3):
                _sync(device)
                t0 = time.perf_counter()
                replay_capture(model, cap, names=names, uses_cuda=device == "cuda")
                _sync(device)
                replay_times.append(time.perf_counter() - t0)
            mon.sentinel.replaying = False
            opt.step()
            mon.step()
    med = {v: statistics.median(times[v]) for v in variants}
    out = {
        "workload": name,
        "plain_ms": med["plain"] * 1e3,
        "ratio": {v: med[v] / med["plain"] for v in variants},
        "watch_ordinary_ratio": statistics.median(ordinary_times) / med["plain"]
        if ordinary_times
        else math.nan,
        "watch_detail_ratio": statistics.median(detail_times) / med["plain"] if detail_times else math.nan,
        "replay_ratio": statistics.median(replay_times) / med["plain"],
    }
    return out


# -- framework loops: the same trainer with and without the torchdebug callback ----------------------
class _StepTimer:
    """Times each optimizer step between two framework hooks (start first, end last in the callbacks)."""

    def __init__(self) -> None:
        self.t0 = 0.0
        self.times: list[float] = []

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def stop(self) -> None:
        self.times.append(time.perf_counter() - self.t0)


def _lightning_chunk(model: nn.Module, batches: list, steps: int, cb: Any, timer: _StepTimer) -> None:
    import lightning.pytorch as L

    class Start(L.Callback):
        def on_train_batch_start(self, *a: Any) -> None:
            timer.start()

    class Stop(L.Callback):
        def on_train_batch_end(self, *a: Any) -> None:
            timer.stop()

    callbacks = [Start(), *([cb] if cb is not None else []), Stop()]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    loader = torch.utils.data.DataLoader(batches * (steps // len(batches) + 1), batch_size=None)
    trainer.fit(model, loader)


def _transformers_chunk(
    model: nn.Module, data: list, batch_size: int, steps: int, cb: Any, timer: _StepTimer, tmp: str
) -> None:
    import transformers

    class Start(transformers.TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            timer.start()

    class Stop(transformers.TrainerCallback):
        def on_step_end(self, *a: Any, **k: Any) -> None:
            timer.stop()

    args = transformers.TrainingArguments(
        output_dir=tmp,
        use_cpu=True,
        report_to=[],
        per_device_train_batch_size=batch_size,
        max_steps=steps,
        learning_rate=1e-4,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_pin_memory=False,
    )
    callbacks = [Start(), *([cb] if cb is not None else []), Stop()]
    transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks).train()


def bench_framework(kind: str, args: argparse.Namespace, writer: Any, tmp: str) -> dict[str, Any]:
    """A workload under Lightning's or HF's own loop: the framework alone vs with TorchDebugCallback.

    One model shared by both variants, chunks interleaved; each step timed from the framework's
    step-begin hook (first callback) to its step-end hook (last callback, after ours).
    """
    build, make_batch, loss_fn = workloads("cpu")[args.framework_workload]
    batches = [make_batch() for _ in range(4)]
    torch.manual_seed(0)
    gpt = build()
    if kind == "lightning":
        import lightning.pytorch as L

        from torchdebug.integrations.lightning import TorchDebugCallback

        class Lit(L.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.model = gpt

            def training_step(self, batch: Any, idx: int) -> torch.Tensor:
                x, y = batch
                return loss_fn(self.model(x), y)

            def configure_optimizers(self) -> torch.optim.Optimizer:
                return torch.optim.AdamW(self.parameters(), lr=1e-4)

        lit = Lit()
        run = lambda cb, timer: _lightning_chunk(lit, batches, args.chunk, cb, timer)  # noqa: E731
    else:
        from torchdebug.integrations.transformers import TorchDebugCallback

        class HFGPT(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = gpt

            def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
                return {"loss": loss_fn(self.model(input_ids), labels)}

        hf = HFGPT()
        data = [{"input_ids": x[i], "labels": y[i]} for x, y in batches for i in range(x.size(0))]
        bs = batches[0][0].size(0)
        run = lambda cb, timer: _transformers_chunk(hf, data, bs, args.chunk, cb, timer, tmp)  # noqa: E731
    plain, with_cb = _StepTimer(), _StepTimer()
    ordinary: list[float] = []
    every = td.DebugConfig().detail_every
    with warnings_quiet():
        run(None, _StepTimer())  # warm-up
        for _ in range(args.repeats):
            run(None, plain)
            cb = TorchDebugCallback(run=writer)
            n0 = len(with_cb.times)
            run(cb, with_cb)
            ordinary += [t for j, t in enumerate(with_cb.times[n0:]) if j % every]
    med = statistics.median(plain.times)
    return {
        "workload": f"{kind}-{args.framework_workload}",
        "plain_ms": med * 1e3,
        "ratio": statistics.median(with_cb.times) / med,
        "ordinary_ratio": statistics.median(ordinary) / med,
    }


@contextlib.contextmanager
def warnings_quiet() -> Any:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.TorchDebugWarning)
        warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
        # the frameworks' own advice for toy data loaders and deprecations (not torchdebug's)
        warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
        warnings.filterwarnings("ignore", category=FutureWarning)
        yield


def _dist_worker(rank: int, world: int, port: int, args: argparse.Namespace, kind: str) -> None:
    """One rank of ``--ddp N`` (``kind`` "ddp") or ``--fsdp N`` ("fsdp"): every variant interleaved on
    ONE wrapped model (a session leaves nothing on it); rank 0 prints."""
    import os

    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)

    def wrap(model: nn.Module) -> nn.Module:
        if kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            return DDP(model)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        units = [m for m in model.modules() if isinstance(m, Block)] or [
            m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))
        ]
        for m in [*units, model]:
            fully_shard(m, mesh=mesh)
        return model

    try:
        if rank == 0:
            print(
                f"torch {torch.__version__}, {'DDP' if kind == 'ddp' else 'FSDP2'} over gloo, {world} CPU "
                f"processes x {torch.get_num_threads()} threads, repeats {args.repeats} x {args.chunk} steps "
                "per variant, interleaved"
            )
            print(
                f"{'workload':<8} {kind + ' ms':>8} {'watch':>7} {'(ordinary':>10} {'detail)':>8} {'sentinel':>9} "
                f"{'collectives/step':>17}   {'cpu ms':>7} {'watch cpu':>10} {'sentinel cpu':>13}"
            )
        with tempfile.TemporaryDirectory() as tmp, warnings_quiet():
            writer = create_run(root=tmp, name=f"bench-rank{rank}")
            wl = workloads("cpu")
            for name in args.only.split(","):
                build, make_batch, loss_fn = wl[name]
                torch.manual_seed(1000 + rank)
                batches = [make_batch() for _ in range(4)]
                torch.manual_seed(0)
                model = wrap(build())
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
                cfgs = {"watch": td.DebugConfig(), "sentinel": td.DebugConfig(mode="anomaly_detection")}
                variants = ["plain", "watch", "sentinel"]
                times: dict[str, list[float]] = {v: [] for v in variants}
                cpus: dict[str, list[float]] = {v: [] for v in variants}
                ordinary: list[float] = []
                ordinary_cpu: list[float] = []
                detail: list[float] = []
                hidden = blocking = watched = 0
                run_chunk(model, opt, batches, loss_fn, 3, "cpu")
                with td.watch(model, opt, run=writer, config=cfgs["sentinel"]) as mon:  # first-use costs
                    run_chunk(model, opt, batches, loss_fn, 3, "cpu", mon=mon)
                for _ in range(args.repeats):
                    for v in variants:
                        if v == "plain":
                            times[v] += run_chunk(
                                model, opt, batches, loss_fn, args.chunk, "cpu", cpu=cpus[v]
                            )
                            continue
                        c: list[float] = []
                        with td.watch(model, opt, run=writer, config=cfgs[v]) as mon:
                            start = mon.global_step
                            t = run_chunk(model, opt, batches, loss_fn, args.chunk, "cpu", mon=mon, cpu=c)
                        times[v] += t
                        cpus[v] += c
                        coord = next(
                            (i for i in mon.instruments if getattr(i, "name", "") == "distributed"), None
                        )
                        n = getattr(coord, "collectives", {})
                        hidden += n.get("hidden", 0)
                        blocking += n.get("blocking", 0) + n.get("rare", 0)
                        watched += len(t)
                        if v == "watch":
                            every = cfgs[v].detail_every
                            for j, x in enumerate(t):
                                (detail if (start + j) % every == 0 else ordinary).append(x)
                                if (start + j) % every:
                                    ordinary_cpu.append(c[j])
                med = {v: statistics.median(times[v]) for v in variants}
                base_s = med["plain"]
                base_c = statistics.median(cpus["plain"])
                if rank == 0:
                    print(
                        f"{name:<8} {base_s * 1e3:>8.2f} {med['watch'] / base_s:>6.3f}x "
                        f"{statistics.median(ordinary) / base_s:>9.3f}x {statistics.median(detail) / base_s:>7.3f}x "
                        f"{med['sentinel'] / base_s:>8.3f}x {hidden / watched:>8.2f} + {blocking / watched:.2f}   "
                        f"{base_c * 1e3:>7.2f} {statistics.median(ordinary_cpu) / base_c:>9.3f}x "
                        f"{statistics.median(cpus['sentinel']) / base_c:>12.3f}x",
                        flush=True,
                    )
            writer.close()
    finally:
        dist.destroy_process_group()


def ddp_main(args: argparse.Namespace) -> int:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kind, n = ("fsdp", args.fsdp) if args.fsdp else ("ddp", args.ddp)
    mp.spawn(_dist_worker, args=(n, port, args, kind), nprocs=n, join=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--chunk", type=int, default=20, help="steps per variant per repeat")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--only", default="mlp,gpt,cnn", help="workloads; '' for none (with a framework flag)")
    ap.add_argument(
        "--lightning",
        action="store_true",
        help="--framework-workload under lightning.Trainer, with/without the callback",
    )
    ap.add_argument(
        "--transformers",
        action="store_true",
        help="--framework-workload under transformers.Trainer, with/without the callback",
    )
    ap.add_argument("--framework-workload", default="gpt", choices=["mlp", "gpt"])
    ap.add_argument("--ddp", type=int, default=0, metavar="N", help="DDP over gloo on N CPU processes")
    ap.add_argument("--fsdp", type=int, default=0, metavar="N", help="FSDP2 over gloo on N CPU processes")
    args = ap.parse_args(argv)
    if args.ddp or args.fsdp:
        return ddp_main(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    print(
        f"torch {torch.__version__}, device {args.device}, threads {torch.get_num_threads()}, "
        f"repeats {args.repeats} x {args.chunk} steps per variant, interleaved"
    )
    print(
        f"{'workload':<8} {'plain ms':>9} {'watch':>7} {'(ordinary':>10} {'detail)':>8} {'sentinel':>9} {'detect_anomaly':>15} {'replay/step':>12}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        writer = create_run(root=tmp, name="bench")
        wl = workloads(args.device)
        for name in [n for n in args.only.split(",") if n]:
            r = bench(name, wl[name], args, writer)
            ra = r["ratio"]
            print(
                f"{name:<8} {r['plain_ms']:>9.2f} {ra['watch']:>6.3f}x {r['watch_ordinary_ratio']:>9.3f}x "
                f"{r['watch_detail_ratio']:>7.3f}x {ra['sentinel']:>8.3f}x {ra['detect_anomaly']:>14.3f}x "
                f"{r['replay_ratio']:>11.2f}x",
                flush=True,
            )
        frameworks = [k for k in ("lightning", "transformers") if getattr(args, k)]
        if frameworks:
            print(f"{'framework loop':<18} {'plain ms':>9} {'callback':>9} {'(ordinary)':>11}")
        for kind in frameworks:
            r = bench_framework(kind, args, writer, tmp)
            print(
                f"{r['workload']:<18} {r['plain_ms']:>9.2f} {r['ratio']:>8.3f}x {r['ordinary_ratio']:>10.3f}x",
                flush=True,
            )
        writer.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Whose fault across ranks when a framework owns the loop: Lightning's DDP strategy, the HF Trainer
under several processes, and ``torchdebug run`` of a DDP script, each on 2 CPU processes over gloo,
launched as ``torchrun --nproc_per_node 2`` would (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` in the environment; the framework initialises the process group:
Lightning's ``_init_dist_connection`` and accelerate's ``PartialState`` both use one that is already
up, so the runs share one pair of processes).

Rank 1's device is the dispatch mode of ``tests/test_distributed_replica.py`` flipping a bit of
``aten.mm`` outputs from step 1: on every call (persistent) or once (transient). The neighbour-rank
replay is the coordinator's code whatever drives the step; a persistent and a transient run under
Lightning and under HF, and a persistent run under ``torchdebug run``, cover each framework's way of
handing the session its DDP wrapper; the verdict's branches are pinned by the plain-loop tests there.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import traceback
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

import torchdebug as td
from tests.fixtures.hf_quiet import quiet_args
from tests.test_distributed import _free_port
from tests.test_distributed_replica import Flip, Mlp

FAULT_STEP = 1  # rank 1's device goes bad from this step; the run stops after it (2 steps)
STEPS = 2
# the replays and collectives of the hardware leg, worked out in tests/test_distributed_replica.py:
# persistent: rank 1 replays its step once (it reproduces), then rank 1 and rank 0 the sent micro-step;
# transient: rank 1 replays its step twice (finite), then the same two. Two collectives each.
PERSISTENT = {"verdict": "hardware", "rank": 1, "device": "cpu", "replays": 3, "collectives": 2}
TRANSIENT = {"verdict": "unknown", "rank": None, "device": None, "replays": 4, "collectives": 2}


def _samples(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` samples of (4,) in (0.1, 1.1) and (1,): ``x @ w`` with w = 0.5 has elements in [1, 2),
    whose bit 30 the fault flips (see ``Flip``)."""
    g = torch.Generator().manual_seed(7)
    return [(torch.rand(4, generator=g) + 0.1, torch.rand(1, generator=g)) for _ in range(n)]


def _lightning(rank: int, out: Path, own_forward: bool = False, once: bool = False) -> dict[str, Any]:
    """``own_forward``: ``training_step`` calls ``self(x)`` (the LightningModule's forward), else
    ``self.net(x)``: under DDP both run inside the strategy's call of ``training_step`` through the
    wrapper's forward. ``once``: rank 1's device bad in one matrix product (transient), else in
    every one from FAULT_STEP on (persistent)."""
    import lightning.pytorch as L
    from lightning.pytorch.strategies import DDPStrategy

    from tests.fixtures.lightning_quiet import quiet_fit, quiet_trainer
    from torchdebug.integrations.lightning import TorchDebugCallback

    class Lit(L.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = Mlp()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self(x) if own_forward else self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Fault(L.Callback):  # type: ignore[misc,name-defined]
        """Rank 1's device bad from FAULT_STEP, for the whole batch: its step, check and replays
        (``once``: in the first matrix product only)."""

        def __init__(self) -> None:
            self.flip = Flip(once=once)
            self.on = False

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_rank == 1 and batch_idx >= FAULT_STEP:
                self.flip.__enter__()
                self.on = True

        def on_train_batch_end(self, *args: Any) -> None:
            if self.on:
                self.flip.__exit__(None, None, None)
                self.on = False

    name = f"lightning{'_self' * own_forward}{'_once' * once}"
    cb = TorchDebugCallback(run=out / "runs" / name, policy="warn")
    fault = Fault()
    trainer = quiet_trainer(
        [cb, fault],
        devices=2,
        strategy=DDPStrategy(process_group_backend="gloo"),
        max_steps=STEPS,
    )
    with quiet_fit():
        trainer.fit(Lit(), torch.utils.data.DataLoader(_samples(2 * 8 * STEPS), batch_size=8))
    assert cb.monitor is not None
    return {**_result(cb.monitor), "flips": fault.flip.flips}


def _hf(rank: int, out: Path, once: bool = True) -> dict[str, Any]:
    """``once``: rank 1's device bad in one matrix product (transient), else in every one from
    FAULT_STEP on (persistent)."""
    import transformers

    from torchdebug.integrations.transformers import TorchDebugCallback

    class Reg(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = Mlp()

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": nn.functional.mse_loss(self.net(x), y)}

    class Fault(transformers.TrainerCallback):  # type: ignore[misc]
        """Rank 1's device bad from FAULT_STEP's first matrix product: once, or on every call."""

        def __init__(self) -> None:
            self.flip = Flip(once=once)
            self.on = False

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if args.process_index == 1 and state.global_step >= FAULT_STEP:
                self.flip.__enter__()
                self.on = True

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if self.on:
                self.flip.__exit__(None, None, None)
                self.on = False

    cb = TorchDebugCallback(run=out / "runs" / ("hf" if once else "hf_persistent"), policy="warn")
    fault = Fault()
    args = quiet_args(
        out / ("hf" if once else "hf_persistent"),
        ddp_backend="gloo",
        per_device_train_batch_size=8,
        max_steps=STEPS,
        learning_rate=0.01,
        optim="sgd",
        seed=0,
    )
    data = [{"x": x, "y": y} for x, y in _samples(2 * 8 * STEPS)]
    trainer = transformers.Trainer(model=Reg(), args=args, train_dataset=data, callbacks=[cb, fault])
    assert args.world_size == 2
    trainer.train()
    assert cb.monitor is not None
    assert type(trainer.model_wrapped).__name__ == "DistributedDataParallel"
    return {**_result(cb.monitor), "flips": fault.flip.flips}


SCRIPT = """\
import contextlib
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from tests.test_distributed_replica import Flip, Mlp, _batch

if not dist.is_initialized():
    dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(Mlp())
opt = torch.optim.SGD(model.parameters(), lr=0.01)
flip = Flip(once=False)  # rank 1's bad device
for step in range({steps}):
    x, y = _batch(rank, step)
    with flip if rank == 1 and step >= {fault} else contextlib.nullcontext():
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
"""


def _script(rank: int, out: Path) -> dict[str, Any]:
    from torchdebug.cli import main

    script = out / f"train_rank{rank}.py"
    script.write_text(SCRIPT.format(steps=STEPS, fault=FAULT_STEP))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["run", "--run-dir", str(out / "runs" / "script"), str(script)])
    return {"code": code, "err": err.getvalue()}


def _result(mon: td.Monitor) -> dict[str, Any]:
    coord = mon.coordinator
    return {
        "anomalies": [a.to_dict() for a in mon.anomalies],
        "block": str(mon.anomalies[0]) if mon.anomalies else "",
        "collectives": dict(coord.collectives) if coord is not None else None,
        "step": mon.global_step,
    }


RUNS = {
    "lightning": _lightning,
    "lightning_self": lambda rank, out: _lightning(rank, out, own_forward=True),
    "lightning_once": lambda rank, out: _lightning(rank, out, once=True),
    "hf": _hf,
    "hf_persistent": lambda rank, out: _hf(rank, out, once=False),
    "script": _script,
}


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(  # what torchrun --nproc_per_node 2 sets
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
        GROUP_RANK="0",
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    results: dict[str, Any] = {"host": socket.gethostname()}
    try:
        for name, run in RUNS.items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                results[name] = run(rank, Path(out))
            results[name]["warnings"] = [
                str(w.message) for w in caught if issubclass(w.category, td.TorchDebugWarning)
            ]
    except BaseException:
        results["crash"] = traceback.format_exc()
    finally:
        Path(out, f"result{rank}.json").write_text(json.dumps(results))
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    pytest.importorskip("lightning.pytorch")
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("ranks_frameworks")
    mp.spawn(_worker, args=(_free_port(), str(out)), nprocs=2, join=True)
    res = [json.loads((out / f"result{r}.json").read_text()) for r in range(2)]
    for r in res:
        assert "crash" not in r, r["crash"]
    return res


def _check(cause: dict[str, Any], want: dict[str, Any], host: str) -> None:
    got = {k: cause.get(k) for k in want}
    assert got == want
    assert cause.get("host") == (host if want["rank"] is not None else None)


# HF's Trainer clips the gradients by default: at the fault step its clip_grad_norm_ rule speaks too
CLIP = "torchdebug: error: step 1: clip_nonfinite [net]"


def _warned(r: dict[str, Any], run: str, anomaly_end: str) -> None:
    """The healthy step 0 warned about nothing; the fault step once for the anomaly (policy="warn"),
    and under HF once more for the Trainer's clip."""
    if run.startswith("hf"):
        anomaly, clip = r["warnings"]
        assert clip.startswith(CLIP), clip
    else:
        (anomaly,) = r["warnings"]
    assert anomaly.endswith(anomaly_end), anomaly


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "run",
    ["lightning", "lightning_self", "hf_persistent"],
    ids=["lightning-self.net(x)", "lightning-self(x)", "hf-trainer"],
)
def test_framework_ddp_names_rank1s_persistent_fault_as_hardware(
    runs: list[dict[str, Any]], run: str
) -> None:
    r0, r1 = (r[run] for r in runs)
    host = runs[1]["host"]
    assert r1["flips"] > 0 and r0["flips"] == 0
    for r in (r0, r1):
        (a,) = r["anomalies"]  # the fault step is the last one
        assert (a["step"], a["rank"], a["reproducible"]) == (FAULT_STEP, 1, True)
        # the origin the replay traced (the first matrix product), named as in the user's module
        assert (a["module"], a["op"]) == ("net", "aten.mm")
        _check(a["cause"], PERSISTENT, host)
        assert a["cause"]["evidence"].startswith(f"persistent fault on rank 1 (cpu on {host})")
        assert f"  cause     hardware: persistent fault on rank 1 (cpu on {host})" in r["block"]
        assert a["hint"].endswith(
            f"; rank 1's device (cpu on {host}) is at fault, not the model: the same micro-step "
            "is finite on another rank; check that device (or leave it out) and resume from the last checkpoint"
        )
        # one hidden all-reduce per step (the DDP path: the session knew the framework's wrapper), and
        # on the rare path the exact verdicts' all-reduce; the cross-rank replay's two are the cause's
        assert r["collectives"] == {"hidden": STEPS, "blocking": 0, "rare": 1}
        _warned(r, run, "(step 1, born on rank 1 of 2) (policy='warn': training goes on)")
    assert r0["anomalies"][0]["cause"] == r1["anomalies"][0]["cause"]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("run", ["lightning_once", "hf"], ids=["lightning", "hf-trainer"])
def test_framework_ddp_calls_rank1s_one_off_fault_transient(runs: list[dict[str, Any]], run: str) -> None:
    r0, r1 = (r[run] for r in runs)
    assert (r0["flips"], r1["flips"]) == (0, 1)
    for r in (r0, r1):
        (a,) = r["anomalies"]
        assert (a["step"], a["rank"], a["reproducible"]) == (FAULT_STEP, 1, False)
        _check(a["cause"], TRANSIENT, runs[1]["host"])
        assert a["cause"]["evidence"].startswith("transient: the step held nan on rank 1 (cpu on ")
        assert "hardware" not in r["block"]
        # the hint says what the replays across ranks found, no longer asking for one
        assert a["hint"].endswith(
            "or loss code the replay did not capture; replayed rank 1's micro-step (its batch, RNG state "
            "and loss code, the same weights) on rank 1 and on rank 0: finite on both"
        )
        assert r["collectives"] == {"hidden": STEPS, "blocking": 0, "rare": 1}
        _warned(r, run, "finite on replay (step 1, on rank 1 of 2) (policy='warn': training goes on)")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_torchdebug_run_of_a_ddp_script_names_rank1s_persistent_fault(runs: list[dict[str, Any]]) -> None:
    host = runs[1]["host"]
    for r in (r["script"] for r in runs):
        assert r["code"] == 3  # found a NaN/Inf
        assert f"  cause     hardware: persistent fault on rank 1 (cpu on {host})" in r["err"]

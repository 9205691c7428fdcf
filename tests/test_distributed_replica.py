"""Whose fault across ranks: the failing micro-step replayed on a neighbour rank (a bad device named, a
transient fault said to be one), and the replicas' parameter hash. 2 CPU processes over gloo (DDP), a
dispatch mode on rank 1 standing in for a faulty device; each test under a timeout so a hang fails."""

from __future__ import annotations

import dataclasses
import socket
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

import torchdebug as td
from tests.test_distributed import run_pairs
from torchdebug.session import replica
from torchdebug.store import open_run

# a hang fails a test; the first one pays for starting 2 processes (minutes on a loaded machine)
TIMEOUT = pytest.mark.timeout(600)
FAULT_STEP = 3  # rank 1's device goes bad from this step's forward
STEPS = 6


class Flip(TorchDispatchMode):
    """A faulty device: flips bit 30 (the exponent's top bit) of one element of every ``aten.mm`` output
    (``once``: of the first only). The element is the first whose exponent is 127 (|x| in [1, 2)), so
    the flip sets the exponent to 255: NaN (Inf when the mantissa is zero)."""

    def __init__(self, once: bool) -> None:
        super().__init__()
        self.once = once
        self.flips = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.mm.default and not (self.once and self.flips):
            bits = out.view(torch.int32).reshape(-1)
            at = ((bits >> 23) & 0xFF).eq(127).nonzero()
            if len(at):
                bits[at[0, 0]] ^= 1 << 30
                self.flips += 1
        return out


class Mlp(nn.Module):
    """Two matrix products (``aten.mm`` in forward and backward) on (8, 4) batches in (0.1, 1.1):
    ``x @ w`` with w = 0.5 is in (0.2, 2.2), so the first product holds elements in [1, 2)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((4, 8), 0.5))
        self.v = nn.Parameter(torch.full((8, 1), 0.1))

    def forward(self, x):
        return torch.relu(x @ self.w) @ self.v


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.rand(8, 4, generator=g) + 0.1, torch.rand(8, 1, generator=g)


def _scenario(rank: int, out: Path, name: str, sc: dict) -> dict:
    result: dict = {"rank": rank, "host": socket.gethostname()}
    torch.manual_seed(0)
    net = Mlp()
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = {"run_dir": str(out / "runs" / name), **sc.get("config", {})}
    fault = sc.get("fault")
    flip = Flip(once=fault == "transient") if fault and rank == 1 else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with td.watch(model, opt, config=td.DebugConfig(**cfg)) as mon:
                result["run_dir"] = str(mon.run_dir)
                for step in range(sc.get("steps", STEPS)):
                    x, y = _batch(rank, step)
                    mode = flip if flip is not None and step >= FAULT_STEP else None
                    if mode is not None:
                        mode.__enter__()
                    try:
                        loss = nn.functional.mse_loss(model(x), y)
                        opt.zero_grad()
                        loss.backward()
                        opt.step()
                        mon.step()
                    finally:
                        if mode is not None:
                            mode.__exit__(None, None, None)
                    if rank == 1 and step == sc.get("corrupt_after"):
                        with torch.no_grad():
                            net.w[0, 0] += 0.25  # finite: only the hash can tell
        except td.NonFiniteError as e:
            result["error"] = str(e)
            result["anomaly"] = e.anomaly.to_dict()
            result["summary"] = e.anomaly.summary()
            result["block"] = str(e.anomaly)
    coord = mon.coordinator
    hashes = coord.hashes
    result["step"] = mon.global_step
    result["flips"] = flip.flips if flip is not None else 0
    result["collectives"] = dict(coord.collectives)
    result["checks"] = hashes.checks if hashes is not None else None
    result["mismatches"] = hashes.mismatches if hashes is not None else None
    result["events"] = [e.to_dict() for e in mon.events if e.kind == "replica_divergence"]
    result["warnings"] = [str(w.message) for w in caught if issubclass(w.category, td.TorchDebugWarning)]
    return result


SCENARIOS = {
    "persistent": {"fault": "persistent"},
    "transient": {"fault": "transient"},
    # rank 1's weights moved by a finite 0.25 after step 3 (outside the update): checks at steps 0, 2, 4
    "diverged": {"corrupt_after": 3, "config": {"parameter_hash_every": 2}},
    "healthy": {"config": {"parameter_hash_every": 1}},
    "hash_off": {},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    return run_pairs(_scenario, SCENARIOS, tmp_path_factory.mktemp("replica"))


@TIMEOUT
def test_a_persistent_fault_on_rank1_is_named_hardware_with_its_host_and_device(runs):
    r0, r1 = runs["persistent"]
    assert r1["flips"] > 0
    for r in (r0, r1):
        assert r["step"] == FAULT_STEP and "error" in r
        a = r["anomaly"]
        assert a["rank"] == 1 and a["reproducible"] is True  # rank 1's own replay made it again
        c = a["cause"]
        assert (c["verdict"], c["rank"], c["host"], c["device"]) == ("hardware", 1, r1["host"], "cpu")
        # rank 1 replayed its step once (it reproduced), then rank 1 and rank 0 the sent micro-step
        assert (c["replays"], c["collectives"]) == (3, 2)
        assert c["evidence"].startswith(f"persistent fault on rank 1 (cpu on {r1['host']})")
        assert "came out finite on rank 0" in c["evidence"]
        assert c["tried"][-1].endswith("on rank 1: nan; on rank 0: finite")
        assert "  cause     hardware: persistent fault on rank 1" in r["block"]
        assert f"; rank 1's device (cpu on {r1['host']}) is at fault, not the model" in a["hint"]
    assert r0["anomaly"]["cause"] == r1["anomaly"]["cause"]  # every rank reached the same verdict
    with open_run(r0["run_dir"], rank=0) as rec:  # stored with its cause
        (stored,) = rec.anomalies()
        assert stored["cause"]["verdict"] == "hardware" and stored["cause"]["rank"] == 1


@TIMEOUT
def test_a_one_off_fault_is_transient_and_names_no_hardware(runs):
    r0, r1 = runs["transient"]
    assert r1["flips"] == 1
    for r in (r0, r1):
        assert r["step"] == FAULT_STEP
        a = r["anomaly"]
        assert a["rank"] == 1 and a["reproducible"] is False
        c = a["cause"]
        assert c["verdict"] == "unknown" and c.get("rank") is None
        # rank 1 replayed its step twice (finite), then rank 1 and rank 0 the sent micro-step
        assert (c["replays"], c["collectives"]) == (4, 2)
        assert c["evidence"].startswith("transient: the step held nan on rank 1 (cpu on ")
        assert "finite when replayed on rank 1 and on rank 0" in c["evidence"]
        assert c["tried"][-1].endswith("on rank 1 and on rank 0: finite on both")
        assert "hardware" not in c["evidence"] and "hardware" not in a["hint"]
        assert a["hint"].endswith("on rank 1 and on rank 0: finite on both")  # not "a replay ... tells"
    assert r0["anomaly"]["cause"] == r1["anomaly"]["cause"]


@TIMEOUT
def test_the_parameter_hash_names_rank1_one_check_after_its_weights_moved(runs):
    r0, r1 = runs["diverged"]
    for r in (r0, r1):
        assert r["step"] == STEPS and "error" not in r  # finite: training goes on
        # checks at steps 0, 2, 4; the corruption after step 3 is seen at step 4, the next check
        assert r["checks"] == 3 and r["mismatches"] == [[4, [1]]]
        (ev,) = r["events"]
        assert ev["step"] == 4 and ev["severity"] == "error" and ev["evidence"]["ranks"] == [1]
        assert ev["evidence"]["changed_outside_update"] == [False, True]
        assert ev["message"].startswith("rank 1's weights diverged from the other replicas")
        assert [w for w in r["warnings"] if "replica_divergence" in w or "diverged" in w]
    with open_run(r0["run_dir"], rank=0) as rec:
        (stored,) = rec.events("replica_divergence")
        assert stored["step"] == 4 and stored["data"]["evidence"]["ranks"] == [1]


@TIMEOUT
def test_a_healthy_ddp_run_never_reports_a_hash_mismatch(runs):
    for r in runs["healthy"]:
        assert r["step"] == STEPS and "error" not in r and r["warnings"] == []
        assert r["checks"] == STEPS and r["mismatches"] == [] and r["events"] == []
        # the hashes ride in the step's one all-reduce: no collective added
        assert r["collectives"] == {"hidden": STEPS, "blocking": 0, "rare": 0}


@TIMEOUT
def test_the_hash_is_off_by_default(runs):
    for r in runs["hash_off"]:
        assert r["checks"] is None and r["events"] == [] and r["warnings"] == []
        assert r["collectives"] == {"hidden": STEPS, "blocking": 0, "rare": 0}


# -- the pure parts, in one process ---------------------------------------------------------------------


def test_the_parameter_hash_is_equal_for_equal_weights_and_moves_with_one_element():
    a = [torch.full((4, 8), 0.5), torch.arange(6.0)]
    b = [t.clone() for t in a]
    assert int(replica.parameter_hash(a)) == int(replica.parameter_hash(b))
    b[1][2] += 0.25  # 2.0 -> 2.25: one element's bits
    assert int(replica.parameter_hash(a)) != int(replica.parameter_hash(b))
    assert 0 <= int(replica.parameter_hash(b)) < 2**24  # 24 bits: exact in the float32 all-reduce


@pytest.mark.parametrize(
    ("hashes", "moved", "named", "how"),
    [
        ([7, 7, 9], [False, False, False], [2], "2 of 3 ranks agree"),
        ([7, 9], [False, True], [1], "changed after the last update"),
        ([7, 9], [False, False], [], "no majority"),
        ([7, 9], [True, True], [], "no majority"),
    ],
    ids=["majority-of-3", "two-ranks-moved", "two-ranks-unknown", "both-moved"],
)
def test_the_diverged_rank_is_named_by_majority_else_by_a_write_outside_its_update(hashes, moved, named, how):
    got, why = replica._odd_ones(hashes, moved)
    assert got == named and why.startswith(how)


@pytest.mark.parametrize(
    ("hint", "verdict", "said"),
    [
        (
            "not reproducible: ...; a replay on another rank tells a faulty rank apart",
            "unknown",
            "not reproducible: ...; T",
        ),
        (
            "mm produced NaN",
            "hardware",
            "mm produced NaN; rank 1's device (cpu on h) is at fault, not the model",
        ),
        ("log of negative input", None, "log of negative input"),  # software: the origin's hint stands
    ],
    ids=["transient", "hardware", "software"],
)
def test_the_hint_says_what_the_replays_across_ranks_found(hint, verdict, said):
    got = replica._hint(hint, verdict, "T", {"rank": 1, "device": "cpu", "host": "h"})
    assert got.startswith(said) and "tells a faulty rank apart" not in got


def test_a_cause_travels_between_ranks_as_a_dict():
    c = td.Anomaly(phase="forward", module="m", op="aten.mm", location=None, kind="nan", step=3, rank=1)
    cause = replica.Cause("hardware", "persistent fault", ("a", "b"), replays=3, rank=1, collectives=2)
    d = dataclasses.replace(c, cause=cause).to_dict()
    assert replica.cause_from(d["cause"]) == cause
    assert replica.cause_from(None) is None and replica.cause_from({"verdict": "bogus"}) is None

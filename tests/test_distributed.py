"""watch() on several ranks: 2 CPU processes over gloo (DDP), each test under a timeout so a hang fails."""

from __future__ import annotations

import json
import socket
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import torchdebug as td
from torchdebug.store import open_run

BAD_STEP = 7
# a hang fails the test; the first test also pays for the shared 2-process fixture (45 s on 2 busy cores)
TIMEOUT = pytest.mark.timeout(120)
SRC = Path(__file__).read_text().splitlines()
SQRT_LINE = next(i for i, s in enumerate(SRC, 1) if s.strip().startswith("return torch.cat"))
SLEEP_LINE = next(i for i, s in enumerate(SRC, 1) if s.strip().startswith("time.sleep(self.hang_s)"))


class Feat(nn.Module):
    """Appends sqrt(w * first feature): NaN in forward for a negative one, Inf in backward at 0."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return torch.cat([x, torch.sqrt(x[:, :1] * self.w)], dim=1)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.feat = Feat()
        self.fc1 = nn.Linear(5, 8)
        self.fc2 = nn.Linear(8, 1)
        self.delay_s = 0.0  # every forward (stragglers)
        self.hang_s = 0.0  # once, at the next forward (hang watchdog)

    def forward(self, x):
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.hang_s:
            time.sleep(self.hang_s)  # the hang
            self.hang_s = 0.0
        return self.fc2(torch.relu(self.fc1(self.feat(x))))


def _batch(rank: int, step: int, poison: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    x = torch.rand(8, 4, generator=g) + 0.1  # first feature > 0: sqrt finite, its gradient too
    y = torch.rand(8, 1, generator=g)
    if poison and rank == 1 and step == BAD_STEP:
        x[3, 0] = -1.0 if poison == "forward" else 0.0  # sqrt(-1) = nan; d sqrt(0) = inf
    return x, y


def wrapped_net(fsdp: bool) -> tuple[Net, nn.Module]:
    """``(net, model)``: a seeded Net, wrapped in DDP, or with FSDP2's ``fully_shard`` on fc1, fc2 and
    the root (then ``model`` is ``net``)."""
    torch.manual_seed(0)
    net = Net()
    if not fsdp:
        return net, DDP(net)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    for m in (net.fc1, net.fc2, net):
        fully_shard(m, mesh=mesh)
    return net, net


def _scenario(rank: int, out: Path, name: str, scenario: dict) -> dict:
    result: dict = {"rank": rank}
    net, model = wrapped_net(bool(scenario.get("fsdp")))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if scenario.get("nan_shard_rank") == rank:
        # an update that writes a NaN into this rank's shard of fc1.weight only (FSDP2: the other
        # rank's shard stays finite); registered before watch(), so it runs before the session's hook
        def corrupt(o: object, args: object, kwargs: object) -> None:
            if corrupt.calls == BAD_STEP:  # type: ignore[attr-defined]
                with torch.no_grad():
                    _local(net.fc1.weight)[0, 0] = float("nan")
            corrupt.calls += 1  # type: ignore[attr-defined]

        corrupt.calls = 0  # type: ignore[attr-defined]
        opt.register_step_post_hook(corrupt)
    cfg = dict(scenario.get("config", {}))
    cfg.setdefault("run_dir", str(out / "runs" / name))
    steps = scenario.get("steps", 10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with td.watch(model, opt, config=td.DebugConfig(**cfg)) as mon:
                result["run_dir"] = str(mon.run_dir)
                for step in range(steps):
                    net.delay_s = scenario.get(f"delay_rank{rank}", 0.0)
                    if rank == 1 and step == scenario.get("hang_step"):
                        net.hang_s = scenario["hang_s"]
                    x, y = _batch(rank, step, scenario.get("poison"))
                    loss = nn.functional.mse_loss(model(x), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    mon.step()
                    if step == BAD_STEP:
                        result["params_after_bad"] = [_local(p).tolist() for p in model.parameters()]
        except td.NonFiniteError as e:
            result["error"] = "NonFiniteError"
            result["anomaly"] = e.anomaly.to_dict()
    result["warnings"] = [str(w.message) for w in caught if issubclass(w.category, td.TorchDebugWarning)]
    result["step"] = mon.global_step
    result["anomalies"] = [a.to_dict() for a in mon.anomalies]
    result["params"] = [_local(p).tolist() for p in model.parameters()]
    result["skipped"] = mon.counters["skipped_steps"]
    return result


def _local(p: torch.Tensor) -> torch.Tensor:
    return (p.to_local() if hasattr(p, "to_local") else p).detach()


def _worker(rank: int, port: int, out: str, scenario: Callable[..., dict], scenarios: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results: dict = {}
    try:
        for name, sc in scenarios.items():
            t0 = time.perf_counter()
            results[name] = scenario(rank, Path(out), name, sc)
            results[name]["seconds"] = time.perf_counter() - t0
    except BaseException:
        results["crash"] = traceback.format_exc()
    finally:
        Path(out, f"result{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


def run_pairs(scenario: Callable[..., dict], scenarios: dict, out: Path) -> dict[str, list[dict]]:
    """Every scenario in one pair of gloo processes (one process-group start per test file):
    ``scenario(rank, out, name, sc)`` on both ranks, then ``{name: [rank 0's result, rank 1's]}``."""
    mp.spawn(_worker, args=(_free_port(), str(out), scenario, scenarios), nprocs=2, join=True)
    res = [json.loads((out / f"result{r}.json").read_text()) for r in range(2)]
    for r in res:
        assert "crash" not in r, r["crash"]
    return {name: [res[0][name], res[1][name]] for name in scenarios}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SCENARIOS = {
    "forward": {"poison": "forward"},
    "backward": {"poison": "backward"},
    "skip": {"poison": "forward", "config": {"policy": "skip"}},
    "warn": {"poison": "forward", "config": {"policy": "warn"}},
    # rank 1 sleeps 2.5 s in the forward of step 2; the watchdog looks every 0.25 s
    "hang": {"steps": 4, "hang_step": 2, "hang_s": 2.5, "config": {"hang_timeout": 1.0}},
    "fsdp": {"poison": "forward", "fsdp": True},
    "fsdp_optimizer": {"fsdp": True, "nan_shard_rank": 1},
    # rank 1's forward takes 30 ms, rank 0's 10 ms: 3x
    "straggler": {"steps": 15, "delay_rank0": 0.01, "delay_rank1": 0.03},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    """Every scenario, in one pair of processes (one process-group start for the whole file)."""
    return run_pairs(_scenario, SCENARIOS, tmp_path_factory.mktemp("dist"))


@TIMEOUT
def test_forward_nan_on_rank1_stops_both_ranks_at_step_7_naming_rank1(runs):
    r0, r1 = runs["forward"]
    for r in (r0, r1):
        assert r["error"] == "NonFiniteError" and r["step"] == BAD_STEP
        a = r["anomaly"]
        assert (a["rank"], a["phase"], a["module"], a["op"]) == (1, "forward", "feat", "aten.sqrt")
        assert a["location"].endswith(f"test_distributed.py:{SQRT_LINE}")
        assert a["step"] == BAD_STEP
        assert "born on rank 1 of 2" in a["symptom"]
    assert r0["anomaly"]["detected_by"] == "rank 1 (its replay found the origin)"
    assert r1["anomaly"]["detected_by"] == "sentinel"
    assert r0["run_dir"] == r1["run_dir"]
    run = Path(r0["run_dir"])
    assert sorted(p.name for p in run.glob("rank*.sqlite")) == ["rank0.sqlite", "rank1.sqlite"]
    with open_run(run, rank=0) as rec:  # rank 0's store says rank 1 found it
        (stored,) = rec.anomalies()
        assert (stored["step"], stored["rank"], stored["module"]) == (BAD_STEP, 1, "feat")
        assert stored["detected_by"] == "rank 1 (its replay found the origin)"


@TIMEOUT
def test_backward_nan_on_rank1_is_named_rank1(runs):
    # x[3, 0] = 0 on rank 1 only: sqrt(0) = 0 is finite, its gradient 1 / (2 sqrt(0)) = inf is born in
    # backward on rank 1; DDP's all-reduce then spreads it to rank 0's gradients in the same backward,
    # so both ranks replay their own step and only rank 1's replay finds it
    r0, r1 = runs["backward"]
    for r in (r0, r1):
        assert r["error"] == "NonFiniteError" and r["step"] == BAD_STEP
        a = r["anomaly"]
        assert (a["rank"], a["phase"], a["module"], a["op"]) == (1, "backward", "feat", "SqrtBackward0")
        assert a["location"].endswith(f"test_distributed.py:{SQRT_LINE}")
        assert "born on rank 1 of 2" in a["symptom"]


@TIMEOUT
def test_skip_skips_on_every_rank_and_parameters_stay_bitwise_equal(runs):
    r0, r1 = runs["skip"]
    for r in (r0, r1):
        assert "error" not in r and r["step"] == 10 and r["skipped"] == 1
        assert [a["rank"] for a in r["anomalies"]] == [1]
    assert r0["params_after_bad"] == r1["params_after_bad"]
    assert r0["params"] == r1["params"]
    flat = [x for p in r0["params"] for x in torch.tensor(p).reshape(-1).tolist()]
    assert all(x == x for x in flat)  # finite: the poisoned update never reached the weights


@TIMEOUT
def test_warn_goes_on_on_every_rank_and_warns_once(runs):
    for r in runs["warn"]:
        assert "error" not in r and r["step"] == 10
        assert r["anomalies"][0]["rank"] == 1 and r["anomalies"][0]["step"] == BAD_STEP
        # the NaN reached the weights (warn applies the update): steps 7, 8, 9 are anomalous on both ranks
        assert [a["step"] for a in r["anomalies"]] == [7, 8, 9]
        assert len([w for w in r["warnings"] if "policy='warn'" in w]) == 1


@TIMEOUT
def test_hang_watchdog_records_the_sleeping_line_and_the_phase(runs):
    r0, r1 = runs["hang"]
    assert r1["step"] == 4 and r0["step"] == 4  # never kills the job
    with open_run(r1["run_dir"], rank=1) as rec:
        (hang,) = rec.events("hang")
    d = hang["data"]
    assert (d["rank"], d["phase"], d["last_step"]) == (1, "forward", 1)
    assert d["where"].endswith(f"test_distributed.py:{SLEEP_LINE} in forward")
    main = next(v for k, v in d["stacks"].items() if k.startswith("MainThread"))
    assert main[-1].startswith(f"test_distributed.py:{SLEEP_LINE} in forward: time.sleep(self.hang_s)")
    assert hang["message"].startswith("rank 1 stuck in forward for ")
    with open_run(r0["run_dir"], rank=0) as rec:
        (hang0,) = rec.events("hang")  # rank 0 waits for rank 1 in a collective
    assert hang0["data"]["phase"] in ("backward", "optimizer") and hang0["data"]["last_step"] == 1


@TIMEOUT
def test_a_3x_slower_rank_is_named_as_the_straggler_once(runs):
    r0, _ = runs["straggler"]
    with open_run(r0["run_dir"], rank=0) as rec:
        (ev,) = rec.events("straggler")
    assert ev["data"]["evidence"]["rank"] == 1
    assert (
        2.0 <= ev["data"]["evidence"]["ratio"] <= 4.5
    )  # 30 ms vs 10 ms of sleep, plus a little compute each
    assert ev["message"].startswith("rank 1 is the straggler: its step work takes ")


@TIMEOUT
def test_show_reads_every_rank(runs, capsys):
    from torchdebug.cli import main

    assert main(["show", runs["forward"][0]["run_dir"]]) == 0
    out = capsys.readouterr().out
    assert "ranks      0, 1 (world size 2), showing rank 0" in out
    assert "ranks (2 of world size 2)" in out
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines() if ln.startswith(("  0 ", "  1 "))}
    # both ranks raised at step 7: "failed", with steps 0..6 recorded
    assert rows["0"][1:3] == ["failed", "7"] and rows["1"][1:3] == ["failed", "7"]
    assert (
        f"  nan born in forward of feat (Feat): aten.sqrt at tests/test_distributed.py:{SQRT_LINE} "
        "(step 7, born on rank 1 of 2)  (recorded by rank 0, 1)"
    ) in out

    assert main(["show", runs["straggler"][0]["run_dir"], "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    ov = doc["all_ranks"]
    assert [r["rank"] for r in ov["per_rank"]] == [0, 1] and [r["steps"] for r in ov["per_rank"]] == [15, 15]
    assert all(r["step_time_s"] > 0.01 and r["rss_max"] > 0 for r in ov["per_rank"])
    assert [s["rank"] for s in ov["stragglers"]] == [1]

    assert main(["report", runs["straggler"][0]["run_dir"]]) == 0
    text = capsys.readouterr().out
    assert "ranks (2 of world size 2)" in text and "rank 1 is the straggler" in text


@TIMEOUT
def test_dashboard_api_serves_both_ranks(runs):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from torchdebug.views.server import serve

    run_dir = Path(runs["straggler"][0]["run_dir"])
    handle = serve(run_dir.parent, port=0)
    try:
        with httpx.Client(base_url=handle.url, timeout=30) as c:
            rid = run_dir.name
            assert c.get(f"/api/runs/{rid}").json()["summary"]["ranks"] == [0, 1]
            ov = c.get(f"/api/runs/{rid}/ranks").json()
            assert [r["rank"] for r in ov["per_rank"]] == [0, 1]
            assert [s["rank"] for s in ov["stragglers"]] == [1]
            loss = {
                k: c.get(f"/api/runs/{rid}/metrics", params={"names": "loss", "rank": k}).json()["metrics"][
                    "loss"
                ]
                for k in (0, 1)
            }
            assert loss[0]["steps"] == loss[1]["steps"] == list(range(15))
            assert loss[0]["values"] != loss[1]["values"]  # each rank's own batches
            assert runs["straggler"][1]["run_dir"] == str(run_dir)
            assert [
                e["kind"] for e in c.get(f"/api/runs/{rid}/events", params={"rank": 0}).json()["events"]
            ] == ["straggler"]
            # every rank takes the same decision and records it
            assert [
                e["kind"] for e in c.get(f"/api/runs/{rid}/events", params={"rank": 1}).json()["events"]
            ] == ["straggler"]
            assert c.get(f"/api/runs/{rid}/report.json", params={"rank": 1}).json()["run"]["rank"] == 0
            page = c.get(f"/runs/{rid}", params={"rank": 1})
            assert page.status_code == 200 and f"/api/runs/{rid}/views?rank=1" in page.text
            views = c.get(f"/api/runs/{rid}/views", params={"rank": 1}).json()
            assert views["status"] == "finished" and views["figures"]
            bad = c.get(f"/api/runs/{rid}/anomalies", params={"rank": 5})
            assert bad.status_code == 422 and "ranks present: [0, 1]" in bad.json()["error"]
    finally:
        handle.stop()


@TIMEOUT
def test_fsdp2_fully_shard_forward_nan_on_rank1_stops_both_ranks_naming_rank1(runs):
    # FSDP2 on CPU/gloo: the sentinel reads each rank's local shards; no replay (its forward would
    # all-gather alone), so the anomaly is the symptom on the rank of birth: rank 1's loss
    r0, r1 = runs["fsdp"]
    assert r0["anomaly"]["detected_by"] == "rank 1: sentinel (no replay)"
    assert r1["anomaly"]["detected_by"] == "sentinel (no replay)"
    for r in (r0, r1):
        assert r["error"] == "NonFiniteError" and r["step"] == BAD_STEP
        a = r["anomaly"]
        assert (a["rank"], a["phase"]) == (1, "forward")
        assert a["symptom"].startswith("non-finite loss") and "born on rank 1 of 2" in a["symptom"]
        assert r["warnings"] == []


@TIMEOUT
def test_fsdp2_an_update_that_makes_one_ranks_shard_nan_stops_both_ranks(runs):
    # the update of step 7 wrote a NaN into rank 1's shard of fc1.weight only: each rank probes its own
    # shards, the probes travel in step 8's all-reduce, every rank checks its shards exactly and one
    # more tiny all-reduce says which ranks hold non-finite ones; both stop at step 8, none waits
    r0, r1 = runs["fsdp_optimizer"]
    for r in (r0, r1):
        assert r["error"] == "NonFiniteError" and r["step"] == BAD_STEP + 1 and r["warnings"] == []
        a = r["anomaly"]
        assert (a["phase"], a["step"], a["rank"], a["world_size"], a["op"]) == (
            "optimizer",
            BAD_STEP,
            1,
            2,
            "SGD.step",
        )
    assert (r1["anomaly"]["parameter"], r1["anomaly"]["module"]) == ("fc1.weight", "fc1")
    assert r1["anomaly"]["detected_by"] == "sentinel"
    assert (r0["anomaly"]["parameter"], r0["anomaly"]["module"]) == (None, None)  # not in rank 0's shards
    assert r0["anomaly"]["detected_by"] == "rank 1" and "another rank" in r0["anomaly"]["hint"]


@TIMEOUT
def test_hang_watchdog_in_one_process_records_once_and_stops_on_exit(tmp_path, capsys):
    import threading

    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    # a timeout well above what an ordinary phase takes on a busy 2-core machine (0.3 s gave an extra
    # record there), and a hang well above the timeout
    cfg = td.DebugConfig(mode="anomaly_detection", hang_timeout=1.0, run_dir=str(tmp_path))
    with td.watch(net, opt, config=cfg) as mon:
        assert [t.name for t in threading.enumerate()].count("torchdebug-hang") == 1
        for step in range(3):
            net.hang_s = 2.5 if step == 1 else 0.0  # one episode: a single record
            x, y = _batch(0, step, None)
            loss = nn.functional.mse_loss(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step()
    assert "torchdebug-hang" not in [t.name for t in threading.enumerate()]
    with open_run(mon.run_dir) as rec:
        (hang,) = rec.events("hang")
    assert (hang["data"]["phase"], hang["data"]["last_step"], hang["step"]) == ("forward", 0, 1)
    assert hang["data"]["where"].endswith(f"test_distributed.py:{SLEEP_LINE} in forward")
    # the hang line comes first, after watch's own "recording to <run folder>" line
    err = [
        ln for ln in capsys.readouterr().err.splitlines() if not ln.startswith("torchdebug: recording to ")
    ]
    assert [ln for ln in err if ln.startswith("torchdebug: rank 0 stuck in forward for ")] == err[:1]


@TIMEOUT
@pytest.mark.parametrize(
    "env", [{"RANK": "1"}, {"RANK": "1", "WORLD_SIZE": "2"}], ids=["rank-only", "torchrun-env"]
)
def test_rank_from_the_environment_without_a_process_group_records_its_own_run(tmp_path, monkeypatch, env):
    # issue 11: RANK=1 alone made create_run raise "rank must be in [0, 1), got 1"
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    with td.watch(net, opt, config=td.DebugConfig(mode="anomaly_detection", run_dir=str(tmp_path))) as mon:
        for step in range(2):
            x, y = _batch(0, step, None)
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            opt.zero_grad()
            mon.step()
    assert (mon.rank, mon.world_size) == (1, 2)
    assert mon.run_dir.name.startswith("net-rank1-")  # no process group: one run per rank
    with open_run(mon.run_dir) as rec:
        assert rec.steps() == 2

"""Several ranks, one view: the rank of birth in every rank's error, the dashboard's per-rank table
and rank selector, FSDP2's global gradient norm. 2 CPU processes over gloo, each test under a timeout."""

from __future__ import annotations

import json
import time
import traceback
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import torchdebug as td
from tests.test_distributed import BAD_STEP, SQRT_LINE, Net, _batch, _free_port
from torchdebug.store import open_run

TIMEOUT = pytest.mark.timeout(120)  # a hang fails the test; the first test pays for the 2-process fixture
SITE = f"nan born in forward of feat (Feat): aten.sqrt at tests/test_distributed.py:{SQRT_LINE}"


def _scenario(rank: int, out: Path, name: str, sc: dict) -> dict:
    result: dict = {"rank": rank}
    torch.manual_seed(0)
    net = Net()
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"run_dir": str(out / "runs" / name), **sc.get("config", {})}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with td.watch(model, opt, config=td.DebugConfig(**cfg)) as mon:
                result["run_dir"] = str(mon.run_dir)
                for step in range(sc.get("steps", 10)):
                    x, y = _batch(rank, step, sc.get("poison"))
                    loss = nn.functional.mse_loss(model(x), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    mon.step()
        except td.NonFiniteError as e:
            result["error"] = str(e)
            result["summary"] = e.anomaly.summary()
    result["warnings"] = [str(w.message) for w in caught if issubclass(w.category, td.TorchDebugWarning)]
    result["step"] = mon.global_step
    return result


def _worker(rank: int, port: int, out: str, scenarios: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results: dict = {}
    try:
        for name, sc in scenarios.items():
            results[name] = _scenario(rank, Path(out), name, sc)
    except BaseException:
        results["crash"] = traceback.format_exc()
    finally:
        Path(out, f"result{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


SCENARIOS = {
    "raise": {"poison": "forward"},  # rank 1's batch of step 7 holds a -1: sqrt makes a NaN there only
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    """Every scenario in one pair of processes (one process-group start for the whole file)."""
    out = tmp_path_factory.mktemp("ranks")
    t0 = time.perf_counter()
    mp.spawn(_worker, args=(_free_port(), str(out), SCENARIOS), nprocs=2, join=True)
    res = [json.loads((out / f"result{r}.json").read_text()) for r in range(2)]
    for r in res:
        assert "crash" not in r, r["crash"]
    print(f"2-rank fixture: {time.perf_counter() - t0:.1f} s")
    return {name: [res[0][name], res[1][name]] for name in SCENARIOS}


@TIMEOUT
def test_every_rank_raises_an_error_naming_the_rank_of_birth(runs):
    summary = f"{SITE} (step {BAD_STEP}, born on rank 1 of 2)"
    for r in runs["raise"]:
        assert r["step"] == BAD_STEP and r["warnings"] == []
        assert r["summary"] == summary
        # the same head on both ranks (rank 0 did not replay: rank 1 sent what it found; rank 1's
        # error goes on with the tensors its replay saw)
        assert r["error"].splitlines()[:9] == [
            f"torchdebug: {summary}",
            "  phase     forward",
            "  module    feat (Feat)",
            "  op        aten.sqrt",
            f"  line      tests/test_distributed.py:{SQRT_LINE}",
            f"  step      {BAD_STEP}",
            "  rank      1 of 2",
            "  noticed   nan in the loss; born on rank 1 of 2",
            "  hint      sqrt of negative input (min -0.993)",  # x[3, 0] = -1 times w after 7 updates
        ]
    run = Path(runs["raise"][0]["run_dir"])
    for k in (0, 1):  # each rank's store keeps the rank of birth and the world size
        with open_run(run, rank=k) as rec:
            (a,) = rec.anomalies()
        assert (a["rank"], a["world_size"], a["summary"]) == (1, 2, summary)


@TIMEOUT
def test_show_and_reports_name_the_rank_of_birth_once(runs, capsys):
    from torchdebug.cli import main
    from torchdebug.views.report import render_report

    run = runs["raise"][0]["run_dir"]
    summary = f"{SITE} (step {BAD_STEP}, born on rank 1 of 2)"
    assert main(["show", run]) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"  {summary}  (recorded by rank 0, 1)" in out  # no "rank 1:" prefix: the summary names it
    assert main(["report", run]) == 0
    text = capsys.readouterr().out.splitlines()
    card = text.index(f"  * {summary}")
    assert "      rank      1 of 2" in text[card : card + 8]
    html = render_report(run, "html")
    assert "<dt>rank</dt><dd>1 of 2</dd>" in html


def test_one_process_anomaly_says_nothing_about_ranks():
    a = td.Anomaly(phase="forward", module="fc", op="aten.log", location="m.py:3", kind="nan", step=4)
    assert a.summary() == "nan born in forward of fc: aten.log at m.py:3 (step 4)"
    assert "rank" not in str(a) and "world_size" not in a.to_dict()
    moved = td.Anomaly(phase="forward", module="fc", op=None, location=None, kind="inf", rank=1, world_size=2)
    assert moved.summary() == "inf born in forward of fc (born on rank 1 of 2)"
    assert moved.to_dict()["world_size"] == 2

"""on_spike="rollback" under DDP: the decision rides in the coordinator's all-reduce (the ranks' mean
loss), so both ranks roll back at the same step to the same snapshot and stay bitwise equal.
2 CPU processes over gloo, under a timeout so a hang fails."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import torchdebug as td
from tests.test_distributed import run_pairs
from tests.test_spikes import Net, data

SPIKE = 30
STEPS = 36


def _scenario(rank: int, out: Path, name: str, sc: dict) -> dict:
    torch.manual_seed(0)
    net = Net()
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    corrupt = {SPIKE: {3: 300.0, 17: 300.0}} if rank == 1 else None  # only rank 1's batch is bad
    batches = data(STEPS, corrupt, seed=10 + rank)
    cfg = {"run_dir": str(out / "runs" / name), "on_spike": "rollback", "snapshot_every": 10}
    cfg |= {"log_performance": False, "log_memory": False}
    result: dict = {"rank": rank}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with td.watch(model, opt, config=cfg) as mon:
            for step, (x, y) in enumerate(batches):
                loss = F.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                mon.step()
                if step == SPIKE:
                    result["after_restore"] = [p.detach().flatten().tolist() for p in net.parameters()]
    result["warnings"] = [str(w.message) for w in caught if issubclass(w.category, td.TorchDebugWarning)]
    result["rollbacks"] = [r.to_dict() for r in mon.rollbacks]
    result["spikes"] = [r.to_dict() for r in mon.spikes]
    result["params"] = [p.detach().flatten().tolist() for p in net.parameters()]
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    return run_pairs(_scenario, {"rollback": {}}, tmp_path_factory.mktemp("spikes_ddp"))


@pytest.mark.timeout(180)
def test_both_ranks_roll_back_at_the_same_step_and_stay_bitwise_equal(runs) -> None:  # type: ignore[no-untyped-def]
    r0, r1 = runs["rollback"]
    for r in (r0, r1):
        # snapshots before steps 0, 10, 20, 30; the newest before step SPIKE - 1 is the one before 20
        assert [(b["step"], b["to_step"], b["batches_skipped"]) for b in r["rollbacks"]] == [(SPIKE, 20, 11)]
        assert [s["step"] for s in r["spikes"]] == [SPIKE]
    # rank 1's own batch carried it: its rows 3 and 17
    assert r1["spikes"][0]["cause"] == "batch"
    assert [row["index"] for row in r1["spikes"][0]["rows"]] == [3, 17]
    assert r0["after_restore"] == r1["after_restore"]  # bitwise: floats compared exactly
    assert r0["params"] == r1["params"]

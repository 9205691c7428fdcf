"""Several models under DDP: a GAN whose G and D are each wrapped in DistributedDataParallel, with two
optimizers, on 2 CPU processes over gloo (every test under a timeout so a hang fails).

A NaN born in D's forward (the step's first update) or an Inf born in G's backward (its second) on
rank 1 only is named on both ranks with its model-qualified module and its rank; the clean run warns
nothing and both ranks agree on every number. A rank that hangs dumps its stack and exits after 60 s.
"""

from __future__ import annotations

import faulthandler
import warnings
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import torchdebug as td
from tests.fixtures import gan_script
from tests.fixtures.gan_script import Discriminator, Generator, gan_step
from tests.fixtures.models import origin_line
from tests.test_distributed import run_pairs
from torchdebug.store import open_run

BAD_STEP = 2
STEPS = 4
TIMEOUT = pytest.mark.timeout(180)


def _scenario(rank: int, out: Path, name: str, sc: dict) -> dict:
    faulthandler.dump_traceback_later(60, exit=True)  # a hang (a collective one rank never joins) fails
    torch.manual_seed(0)  # the same weights on both ranks
    g_net, d_net = Generator(), Discriminator()
    G, D = DDP(g_net), DDP(d_net)
    opt_g = torch.optim.Adam(G.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(D.parameters(), lr=2e-3)
    gen = torch.Generator().manual_seed(10 + rank)  # each rank its own batches
    cfg = {"run_dir": str(out / "runs" / name), "log_performance": False, "log_memory": False}
    result: dict = {"rank": rank}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with td.watch([G, D], [opt_g, opt_d], config=cfg) as mon:
                coord = next(i for i in mon.instruments if i.name == "distributed")
                result["run_dir"] = str(mon.run_dir)
                result["param_names"] = list(mon.param_names)
                for step in range(STEPS):
                    x, z = torch.randn(5, 6, generator=gen), torch.randn(5, 4, generator=gen)
                    bad = rank == 1 and step == BAD_STEP
                    d_net[1].mode = "forward" if bad and sc.get("fault") == "D.forward" else ""
                    g_net.main[1].mode = "backward" if bad and sc.get("fault") == "G.backward" else ""
                    gan_step(G, D, opt_g, opt_d, x, z)
                    mon.step()
        except td.NonFiniteError as e:
            result["error"] = "NonFiniteError"
            result["anomaly"] = e.anomaly.to_dict()
    result["warnings"] = [str(w.message) for w in caught]
    result["collectives"] = dict(coord.collectives)
    result["records"] = [(r.step, r.micro_steps, r.grad_norm, r.lr) for r in mon.records]
    result["lr_names"] = mon.lr_names()
    result["events"] = [(e.kind, e.severity) for e in mon.events]
    result["params"] = [p.detach().flatten().tolist() for p in [*g_net.parameters(), *d_net.parameters()]]
    faulthandler.cancel_dump_traceback_later()
    return result


SCENARIOS = {"D.forward": {"fault": "D.forward"}, "G.backward": {"fault": "G.backward"}, "clean": {}}
NAMES = [f"G.main.{k}.{w}" for k in (0, 2) for w in ("weight", "bias")]
NAMES += [f"D.{k}.{w}" for k in (0, 2) for w in ("weight", "bias")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    return run_pairs(_scenario, SCENARIOS, tmp_path_factory.mktemp("gan_ddp"))


@pytest.mark.slow
@TIMEOUT
def test_a_nan_born_in_the_discriminators_forward_on_rank_1_is_named_on_both_ranks(runs: dict) -> None:
    r0, r1 = runs["D.forward"]
    for r in (r0, r1):
        a = r["anomaly"]
        assert (a["rank"], a["phase"], a["module"], a["op"], a["step"]) == (
            1,
            "forward",
            "D.1",
            "aten.sqrt",
            2,
        )
        assert a["location"] == origin_line("fault_forward", gan_script.__file__)
        assert a["summary"].endswith("(step 2, born on rank 1 of 2)")
        assert [rec[0] for rec in r["records"]] == [0, 1] and r["warnings"] == []
        # steps 0-1: one all-reduce per update (2 a step), each launched when its backward ended; step 2:
        # D's update's, then the rare round of exact verdicts (the loss row names rank 1: no replay round)
        assert r["collectives"] == {"hidden": 5, "blocking": 0, "rare": 1}
    assert r0["anomaly"]["detected_by"] == "rank 1 (its replay found the origin)"
    assert r1["anomaly"]["detected_by"] == "sentinel"
    assert r0["run_dir"] == r1["run_dir"]
    with open_run(Path(r0["run_dir"]), rank=0) as run:
        (stored,) = run.anomalies()
        assert (stored["step"], stored["rank"], stored["module"]) == (2, 1, "D.1")


@pytest.mark.slow
@TIMEOUT
def test_an_inf_born_in_the_generators_backward_on_rank_1_is_found_by_its_own_update(runs: dict) -> None:
    # G's backward runs in the step's second backward (G's loss); DDP spreads the Inf to rank 0's
    # gradients, the losses stay finite: G's update has its own all-reduce, both ranks replay their
    # own micro-step and rank 1's replay finds the origin
    r0, r1 = runs["G.backward"]
    for r in (r0, r1):
        a = r["anomaly"]
        assert (a["rank"], a["phase"], a["module"], a["op"], a["step"]) == (
            1,
            "backward",
            "G.main.1",
            "SqrtBackward0",
            2,
        )
        assert a["location"] == origin_line("fault_backward", gan_script.__file__)
        # steps 0-1: 2 each; step 2: D's update's and G's update's, then the exact verdicts and whose
        # replay found it
        assert r["collectives"] == {"hidden": 6, "blocking": 0, "rare": 2}
        assert r["warnings"] == []
    assert r0["anomaly"]["detected_by"] == "rank 1 (its replay found the origin)"
    assert r1["anomaly"]["detected_by"] == "sentinel"


@pytest.mark.slow
@TIMEOUT
def test_a_clean_gan_under_ddp_warns_nothing_and_every_rank_agrees(runs: dict) -> None:
    r0, r1 = runs["clean"]
    for r in (r0, r1):
        assert "error" not in r and r["warnings"] == [] and r["events"] == []
        assert r["param_names"] == NAMES  # model-qualified, without DDP's "module."
        assert r["lr_names"] == ["lr/G/0", "lr/D/0"]
        assert [(rec[0], rec[1], rec[3]) for rec in r["records"]] == [
            (s, 2, [1e-3, 2e-3]) for s in range(STEPS)
        ]
        assert r["collectives"] == {"hidden": 2 * STEPS, "blocking": 0, "rare": 0}
    # the gradient norms each rank recorded and the weights after training: the same on both ranks
    assert [rec[2] for rec in r0["records"]] == [rec[2] for rec in r1["records"]]
    assert r0["params"] == r1["params"]

"""watch() under DDP with one small collective per step (issue 11's overhead): the all-reduce launched
without waiting at the end of the backward DDP all-reduced (counted as "hidden"), each rank's share of
the gradient and parameter checks riding in it, the rank of birth found on the rare path (gradient accumulation, a NaN loss with finite gradients,
GradScaler, a process group without DDP, a DDP model with its own comm hook). 2 CPU processes over
gloo; every test under a timeout so a hang fails."""

from __future__ import annotations

import contextlib
import math
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import torchdebug as td
from tests.test_distributed import SQRT_LINE, Net, run_pairs  # the same model: its sqrt is the origin

BAD_STEP = 7
STEPS = 10
TIMEOUT = pytest.mark.timeout(180)  # one pair of processes runs every scenario (first test pays)
SRC = Path(__file__).read_text().splitlines()
NAN_LOSS_LINE = next(i for i, s in enumerate(SRC, 1) if s.strip().startswith("loss = loss + nan"))


def _batch(rank: int, step: int, micro: int, sc: dict) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    x = torch.rand(8, 4, generator=g) + 0.1  # first feature > 0: sqrt finite, its gradient too
    y = torch.rand(8, 1, generator=g)
    poison = sc.get("poison")
    if (
        poison in ("forward", "backward")
        and rank == 1
        and step == BAD_STEP
        and micro == sc.get("bad_micro", 0)
    ):
        x[3, 0] = -1.0 if poison == "forward" else 0.0  # sqrt(-1) = nan; d sqrt(0) = inf
    return x, y


class OverflowingSGD(torch.optim.SGD):
    """SGD whose update of param group 1 overflows once ``bad`` is set: an update-formula bug (finite
    gradients, finite hyperparameters, non-finite weights) that only the parameter probe can see."""

    bad = False

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        out = super().step(closure)
        if self.bad:
            for p in self.param_groups[1]["params"]:
                p.mul_(float("inf"))
        return out


def _scenario(rank: int, out: Path, name: str, sc: dict) -> dict:
    result: dict = {"rank": rank}
    torch.manual_seed(0)
    net = Net()
    model = net if sc.get("no_ddp") else DDP(net)
    if sc.get("own_hook"):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

        model.register_comm_hook(None, fp16_compress_hook)
    if sc.get("bad_fc2"):  # fc2 in a group of its own, whose lr turns inf (or update overflows) at BAD_STEP
        fc2 = list(net.fc2.parameters())
        rest = [p for p in net.parameters() if all(p is not q for q in fc2)]
        opt = OverflowingSGD([{"params": rest}, {"params": fc2}], lr=0.1)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu") if sc.get("scaler") else None
    micro_steps = sc.get("micro_steps", 1)
    cfg = dict(sc.get("config", {}))
    cfg.setdefault("run_dir", str(out / "runs" / name))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with td.watch(model, opt, scaler=scaler, config=td.DebugConfig(**cfg)) as mon:
                coord = next(i for i in mon.instruments if i.name == "distributed")
                if rank == sc.get("break_replay_rank"):
                    mon.sentinel.build_anomaly = _replay_breaks  # fault injection: this rank's replay raises
                result["share"] = coord.param_share(mon)
                shares: list = []  # what each backward's gradient pass measured on this rank
                measure = mon.transfer.measure

                def spy(params: list, probe: bool, share: list | None = None, **kw: bool) -> tuple:
                    shares.append(share)
                    return measure(params, probe, share, **kw)

                mon.transfer.measure = spy
                for step in range(STEPS):
                    if sc.get("bad_fc2") == "inf_lr" and step == BAD_STEP:
                        opt.param_groups[1]["lr"] = float("inf")  # named before the update
                    if sc.get("bad_fc2") == "overflow" and step == BAD_STEP:
                        opt.bad = True  # finite gradients and lr, fc2 becomes +-inf/NaN
                    opt.zero_grad()
                    for micro in range(micro_steps):
                        # gradient accumulation: every micro-step but one (the last) keeps its gradients local
                        synced = micro == sc.get("synced_micro", micro_steps - 1)
                        ctx = (
                            model.no_sync()
                            if not synced and isinstance(model, DDP)
                            else contextlib.nullcontext()
                        )
                        with ctx:
                            x, y = _batch(rank, step, micro, sc)
                            loss = nn.functional.mse_loss(model(x), y)
                            if sc.get("poison") == "loss" and rank == 1 and step == BAD_STEP:
                                nan = torch.tensor(float("nan"))  # not from the model: gradients stay finite
                                loss = loss + nan
                            if scaler is not None:
                                scaler.scale(loss).backward()
                            else:
                                loss.backward()
                    if scaler is not None:
                        scaler.step(opt)
                        scaler.update()
                    else:
                        opt.step()
                    mon.step()
                    if step == BAD_STEP:
                        result["params_after_bad"] = [p.detach().tolist() for p in model.parameters()]
        except td.NonFiniteError as e:
            result["error"] = "NonFiniteError"
            result["anomaly"] = e.anomaly.to_dict()
    result["warnings"] = [str(w.message) for w in caught if issubclass(w.category, td.TorchDebugWarning)]
    result["measured"] = shares
    result["grad_norms"] = mon.grad_norms_host
    result["grad_norm"] = mon.records[-1].grad_norm if mon.records else None
    result["exact_norms"] = [
        float(p.grad.double().norm()) if p.grad is not None else 0.0 for p in net.parameters()
    ]
    result["step"] = mon.global_step
    result["anomalies"] = [a.to_dict() for a in mon.anomalies]
    result["params"] = [p.detach().tolist() for p in model.parameters()]
    result["skipped"] = mon.counters["skipped_steps"]
    result["collectives"] = dict(coord.collectives)
    result["comm_hooks"] = len(getattr(model, "_comm_hooks", []))
    return result


def _replay_breaks(*args: object, **kwargs: object) -> None:
    raise RuntimeError("replay broke")


SCENARIOS = {
    "clean": {"micro_steps": 2},
    # rank 1's NaN is born in the backward of the micro-step DDP all-reduces (the last of 2)
    "accum_synced": {"micro_steps": 2, "poison": "backward", "bad_micro": 1},
    "accum_synced_skip": {
        "micro_steps": 2,
        "poison": "backward",
        "bad_micro": 1,
        "config": {"policy": "skip"},
    },
    # ... or in a micro-step under no_sync, whose gradients never left rank 1
    "accum_local": {"micro_steps": 2, "poison": "backward", "bad_micro": 0},
    # DDP all-reduces micro-step 0 and not micro-step 1 (its gradients stay local): the verdicts may
    # differ, so every step falls back to the blocking all-reduce; rank 1's NaN is in micro-step 1
    "last_local": {"micro_steps": 2, "synced_micro": 0, "poison": "backward", "bad_micro": 1},
    "loss_only": {"poison": "loss"},
    "loss_only_skip": {"poison": "loss", "config": {"policy": "skip"}},
    "scaler": {"poison": "forward", "scaler": True},
    "no_ddp": {"poison": "backward", "no_ddp": True},
    "own_hook": {"poison": "backward", "own_hook": True},
    "replay_breaks_on_rank0": {"poison": "backward", "break_replay_rank": 0},
    "optimizer": {"bad_fc2": "overflow"},
    "inf_lr": {"bad_fc2": "inf_lr"},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    return run_pairs(_scenario, SCENARIOS, tmp_path_factory.mktemp("distfast"))


def _stopped_at_7_naming_rank1(pair: list[dict], phase: str, op: str, line: int, micro: int | None) -> None:
    r0, r1 = pair
    for r in (r0, r1):
        assert r["error"] == "NonFiniteError" and r["step"] == BAD_STEP
        a = r["anomaly"]
        assert (a["rank"], a["step"], a["phase"], a["module"], a["op"]) == (1, BAD_STEP, phase, "feat", op)
        assert a["location"].endswith(f"test_distributed.py:{line}")  # Net's Feat.forward
        assert a["micro_step"] == micro
        assert "born on rank 1 of 2" in a["symptom"]
    assert r0["anomaly"]["detected_by"] == "rank 1 (its replay found the origin)"
    assert r1["anomaly"]["detected_by"] == "sentinel"


@TIMEOUT
def test_ordinary_ddp_steps_use_one_hidden_all_reduce_and_no_comm_hook(runs):
    for r in runs["clean"]:
        assert "error" not in r and r["step"] == STEPS and r["anomalies"] == [] and r["warnings"] == []
        # one all-reduce per step, launched as the backward ends and waited for at the update: no blocking one
        assert r["collectives"] == {"hidden": STEPS, "blocking": 0, "rare": 0}
        assert r["comm_hooks"] == 0  # DDP keeps its built-in C++ all-reduce
    assert runs["clean"][0]["params"] == runs["clean"][1]["params"]


@TIMEOUT
def test_each_ddp_rank_measures_its_share_of_the_gradients_and_reads_every_norm(runs):
    r0, r1 = runs["clean"]
    # micro-step 0 runs under no_sync (local gradients: every one measured), micro-step 1 is
    # all-reduced by DDP: each rank measures its share only (fc1.weight on rank 0, the rest on rank 1)
    assert r0["measured"] == [None, [1]] * STEPS and r1["measured"] == [None, [0, 2, 3, 4]] * STEPS
    for r in (r0, r1):
        # yet every rank reads every parameter's norm of the last step (the shares travel in the
        # step's all-reduce), equal to the exact norms of the gradients left after it
        assert r["grad_norms"] == pytest.approx(r["exact_norms"], rel=1e-6)
        assert r["grad_norm"] == pytest.approx(sum(x * x for x in r["exact_norms"]) ** 0.5, rel=1e-6)
        assert all(x > 0 for x in r["exact_norms"])
    assert r0["grad_norms"] == r1["grad_norms"]


@TIMEOUT
def test_backward_nan_in_the_synced_micro_step_on_rank1_is_named_rank1(runs):
    # micro-step 1 is all-reduced: rank 0's gradients hold rank 1's Inf by the check, so every rank
    # replays its own micro-step 1 and only rank 1's replay finds it
    _stopped_at_7_naming_rank1(runs["accum_synced"], "backward", "SqrtBackward0", SQRT_LINE, 1)
    for r in runs["accum_synced"]:
        # steps 0-7 hidden; the rare path: the exact verdicts, then whose replay found the origin
        assert r["collectives"] == {"hidden": BAD_STEP + 1, "blocking": 0, "rare": 2}


@TIMEOUT
def test_skip_after_every_rank_replayed_leaves_the_parameters_bitwise_equal(runs):
    # the replays (one per rank, of different batches) restore each rank's gradients, then the
    # update is dropped on both: the parameters after step 7 are bitwise equal and finite
    r0, r1 = runs["accum_synced_skip"]
    for r in (r0, r1):
        assert "error" not in r and r["step"] == STEPS and r["skipped"] == 1
        assert [(a["rank"], a["step"], a["op"]) for a in r["anomalies"]] == [(1, BAD_STEP, "SqrtBackward0")]
    assert r0["params_after_bad"] == r1["params_after_bad"]
    assert r0["params"] == r1["params"]
    flat = [x for p in r0["params"] for x in torch.tensor(p).reshape(-1).tolist()]
    assert all(abs(x) < 1e6 for x in flat)  # finite: the poisoned update never reached the weights


@TIMEOUT
def test_backward_nan_in_a_no_sync_micro_step_on_rank1_is_named_without_replaying_everywhere(runs):
    # micro-step 0 runs under no_sync: its Inf stayed on rank 1, which the hidden all-reduce of
    # micro-step 1 carries; the exact verdicts name rank 1 and only rank 1 replays
    _stopped_at_7_naming_rank1(runs["accum_local"], "backward", "SqrtBackward0", SQRT_LINE, 0)
    for r in runs["accum_local"]:
        assert r["collectives"] == {"hidden": BAD_STEP + 1, "blocking": 0, "rare": 1}


@TIMEOUT
def test_a_last_micro_step_under_no_sync_takes_the_blocking_all_reduce_and_names_rank1(runs):
    _stopped_at_7_naming_rank1(runs["last_local"], "backward", "SqrtBackward0", SQRT_LINE, 1)
    for r in runs["last_local"]:
        # launched at micro-step 0 on every step, then not trusted: micro-step 1 never left the rank
        assert r["collectives"] == {"hidden": BAD_STEP + 1, "blocking": BAD_STEP + 1, "rare": 1}


@TIMEOUT
def test_nan_loss_with_finite_gradients_on_rank1_stops_both_ranks(runs):
    # rank 1's loss is NaN, every gradient finite (the NaN is detached): rank 0 has nothing of its own
    # to see, yet stops at the same step, from the hidden all-reduce's loss flags
    r0, r1 = runs["loss_only"]
    for r in (r0, r1):
        assert r["error"] == "NonFiniteError" and r["step"] == BAD_STEP
        a = r["anomaly"]
        # rank 1's replay: the loss code's add of the NaN (the root's forward, as the tracer names it)
        assert (a["rank"], a["step"], a["phase"], a["module"], a["op"]) == (
            1,
            BAD_STEP,
            "forward",
            "",
            "aten.add",
        )
        assert a["location"].endswith(f"test_distributed_fast.py:{NAN_LOSS_LINE}")
        assert "born on rank 1 of 2" in a["symptom"]
    assert r0["anomaly"]["hint"] == r1["anomaly"]["hint"]
    for r in (r0, r1):  # rank 0's own loss was finite: only the exact round and rank 1's replay
        assert r["collectives"] == {"hidden": BAD_STEP + 1, "blocking": 0, "rare": 1}


@TIMEOUT
def test_nan_loss_with_finite_gradients_under_skip_skips_on_both_ranks(runs):
    r0, r1 = runs["loss_only_skip"]
    for r in (r0, r1):
        assert "error" not in r and r["step"] == STEPS and r["skipped"] == 1
        assert [(a["rank"], a["step"]) for a in r["anomalies"]] == [(1, BAD_STEP)]
    assert r0["params_after_bad"] == r1["params_after_bad"]
    assert r0["params"] == r1["params"]


@TIMEOUT
def test_gradscaler_nan_loss_on_rank1_stops_both_ranks(runs):
    # the scaler skips the update on both ranks (the all-reduced gradients hold the NaN); rank 1's
    # loss is non-finite, rank 0's finite: the loss verdict is shared, so rank 0 does not take the
    # step for an ordinary overflow skip while rank 1 raises (that left rank 1 alone in a broadcast)
    _stopped_at_7_naming_rank1(runs["scaler"], "forward", "aten.sqrt", SQRT_LINE, None)
    for r in runs["scaler"]:
        assert r["skipped"] == 0  # an anomaly, not an ordinary overflow skip


@TIMEOUT
def test_process_group_without_ddp_keeps_the_blocking_collective_and_names_rank1(runs):
    # no DDP: each rank's gradients are its own, so the verdicts differ and travel every step
    _stopped_at_7_naming_rank1(runs["no_ddp"], "backward", "SqrtBackward0", SQRT_LINE, None)
    for r in runs["no_ddp"]:
        assert r["collectives"] == {"hidden": 0, "blocking": BAD_STEP + 1, "rare": 1}


@TIMEOUT
def test_ddp_with_its_own_comm_hook_names_the_rank_of_birth_without_a_warning(runs):
    _stopped_at_7_naming_rank1(runs["own_hook"], "backward", "SqrtBackward0", SQRT_LINE, None)
    for r in runs["own_hook"]:
        assert r["warnings"] == [] and r["comm_hooks"] == 1  # the user's hook only
        assert r["collectives"] == {"hidden": BAD_STEP + 1, "blocking": 0, "rare": 2}


@TIMEOUT
def test_a_replay_that_raises_on_one_rank_leaves_no_rank_waiting(runs):
    # every rank replays a backward NaN DDP all-reduced; rank 0's replay raises: it still joins the
    # all-reduce that says whose replay found the origin, and both ranks stop at step 7 naming rank 1
    _stopped_at_7_naming_rank1(runs["replay_breaks_on_rank0"], "backward", "SqrtBackward0", SQRT_LINE, None)
    for r in runs["replay_breaks_on_rank0"]:
        assert r["collectives"] == {"hidden": BAD_STEP + 1, "blocking": 0, "rare": 2}


@TIMEOUT
def test_each_ddp_rank_probes_its_share_of_the_parameters_and_both_name_the_update(runs):
    # Net's parameters by size: fc1.weight 40, fc1.bias 8, fc2.weight 8, feat.w 1, fc2.bias 1 elements;
    # the largest first to the least-loaded rank: rank 0 probes fc1.weight (index 1), rank 1 the rest
    r0, r1 = runs["optimizer"]
    assert (r0["share"], r1["share"]) == ([1], [0, 2, 3, 4])
    assert runs["clean"][0]["share"] == [1] and runs["clean"][1]["share"] == [0, 2, 3, 4]
    for r in (r0, r1):
        # the update of step 7 made fc2 non-finite: only rank 1's share covers fc2, its probe travels
        # in step 8's hidden all-reduce, and both ranks stop at step 8's transfer naming the update
        assert r["error"] == "NonFiniteError" and r["step"] == BAD_STEP + 1
        a = r["anomaly"]
        assert (a["phase"], a["step"], a["parameter"], a["module"], a["op"]) == (
            "optimizer",
            BAD_STEP,
            "fc2.weight",
            "fc2",
            "OverflowingSGD.step",
        )
        assert a["rank"] == r["rank"] and "world_size" not in a  # the same update made it on every rank
        assert len(r["anomalies"]) == 1
        assert r["warnings"] == []
        # steps 0-8 each launched one hidden all-reduce; DDP's ranks need no exchange to agree
        assert r["collectives"] == {"hidden": BAD_STEP + 2, "blocking": 0, "rare": 0}


@TIMEOUT
def test_an_inf_lr_is_named_on_every_ddp_rank_before_the_update(runs):
    # every rank holds the same param groups: each names lr = inf at step 7's pre-hook, after the
    # step's hidden all-reduce and before the update, with no collective of its own
    for r in runs["inf_lr"]:
        assert r["error"] == "NonFiniteError" and r["step"] == BAD_STEP
        a = r["anomaly"]
        assert (a["phase"], a["step"], a["module_type"], a["symptom"]) == (
            "optimizer",
            BAD_STEP,
            "OverflowingSGD",
            "lr = inf in param group 1 of OverflowingSGD (since step 7)",
        )
        assert all(math.isfinite(x) for p in r["params"] for x in _flat(p))
        assert r["collectives"] == {"hidden": BAD_STEP + 1, "blocking": 0, "rare": 0}


def _flat(x: object) -> list[float]:
    return [y for e in x for y in _flat(e)] if isinstance(x, list) else [float(x)]  # type: ignore[arg-type]

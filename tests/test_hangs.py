"""The hang verdict across ranks: 2 gloo processes on CPU hang for real (a skipped all_reduce, one
batch fewer on rank 1, a rank-divergent branch calling broadcast), the watchdog (1 s) writes each
rank's flight record, gloo's own timeout (6 s) ends the wait; the verdict names rank, collective,
sequence number and line. Then the matcher alone on the records those runs wrote."""

from __future__ import annotations

import datetime
import html
import json
import os
import pickle
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import torchdebug as td
from torchdebug.session import hangs as records
from torchdebug.store import open_run
from torchdebug.views import hangs

TIMEOUT = pytest.mark.timeout(180)
SRC = Path(__file__).read_text().splitlines()


def _line(text: str) -> int:
    return next(i for i, s in enumerate(SRC, 1) if s.strip().startswith(text))


METRIC_LINE = _line("dist.all_reduce(metric)")
BROADCAST_LINE = _line("dist.broadcast(metric, 0)")
BACKWARD_LINE = _line("loss.backward()")
EVAL_LINE = _line("time.sleep(4.0)")
WITH_LINE = _line("with td.watch(")
STEPS = 3


def _last_seq() -> int:
    """The sequence number of this process's latest collective (the ring also holds the entries of
    the groups of the kinds before, whose numbers restarted)."""
    d = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    entries = [e for e in d["entries"] if not e["is_p2p"]]
    return max(entries, key=lambda e: e["record_id"])["collective_seq_id"] if entries else 0


def _train(rank: int, out: Path, kind: str) -> dict:
    """3 steps of DDP on each rank, plus a metric all_reduce after each update; ``kind`` breaks one."""
    result: dict = {"rank": rank}
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = STEPS - 1 if (kind == "uneven" and rank == 1) else STEPS
    cfg = td.DebugConfig(run_dir=str(out / "runs"), hang_timeout=1.0)
    try:
        with td.watch(model, opt, config=cfg) as mon:
            result["run_dir"] = str(mon.run_dir)
            for step in range(steps):
                g = torch.Generator().manual_seed(10 * rank + step)
                x, y = torch.rand(8, 4, generator=g), torch.rand(8, 1, generator=g)
                loss = nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                if step == STEPS - 1:
                    result["seq_before_last_backward"] = _last_seq()
                loss.backward()
                opt.step()
                mon.step()
                metric = loss.detach().reshape(1)
                last = step == STEPS - 1
                if last:
                    result["seq_before_metric"] = _last_seq()
                if kind == "skip" and rank == 1 and last:
                    time.sleep(4.0)  # evaluates instead: never enters the metric all_reduce
                elif kind == "branch" and rank == 1 and last:
                    dist.broadcast(metric, 0)
                else:
                    dist.all_reduce(metric)
    except RuntimeError as e:  # gloo's timeout ends the wait
        result["error"] = str(e)[:200]
    return result


def _worker(rank: int, ports: list[int], out: str) -> None:
    """Every hang in one pair of processes, each in a process group of its own (gloo's timeout
    leaves a group unusable): both ranks go on once both wrote their result."""
    for kind, port in zip(KINDS, ports):
        d = Path(out, kind)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=2,
            timeout=datetime.timedelta(seconds=6),
        )
        try:
            res = _train(rank, d, kind)
        except BaseException:
            res = {"crash": traceback.format_exc()}
        (d / f"result{rank}.json").write_text(json.dumps(res))
        while not all((d / f"result{r}.json").exists() for r in range(2)):
            time.sleep(0.05)  # rank 1 stays until rank 0 timed out: a closed connection would end it sooner
        dist.destroy_process_group()


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]  # held open together: n different ports
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


KINDS = ("skip", "uneven", "branch")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[list[dict], Path]]:
    """``{kind: ([rank 0's result, rank 1's], run folder)}``."""
    out = tmp_path_factory.mktemp("hangs")
    for kind in KINDS:
        (out / kind).mkdir()
    mp.spawn(_worker, args=(_free_ports(len(KINDS)), str(out)), nprocs=2, join=True)
    runs = {}
    for kind in KINDS:
        res = [json.loads((out / kind / f"result{r}.json").read_text()) for r in range(2)]
        for r in res:
            assert "crash" not in r, r["crash"]
        runs[kind] = (res, Path(res[0]["run_dir"]))
    return runs


@TIMEOUT
def test_a_skipped_all_reduce_names_the_rank_that_never_entered_it(runs):
    (r0, r1), run = runs["skip"]
    v = hangs.verdict_of_run(run, 2)
    assert v is not None and v.kind == "missing"
    seq = r0["seq_before_metric"] + 1
    assert (v.ranks, v.waiting, v.op, v.seq, v.group) == ([1], [0], "all_reduce", seq, "default")
    assert v.calls == {0: f"all_reduce [[1]] Float at test_hangs.py:{METRIC_LINE} in _train"}
    assert str(v) == (
        f"rank 1 never entered all_reduce #{seq} of the default group: it is at "
        f"test_hangs.py:{EVAL_LINE} in _train (after step {STEPS - 1}); rank 0 waits after step {STEPS - 1} at "
        f"test_hangs.py:{METRIC_LINE} in _train"
    )
    assert "error" in r0 and "error" not in r1


@TIMEOUT
def test_one_batch_fewer_on_rank1_names_its_exit_and_the_backward_rank0_waits_in(runs):
    (r0, _), run = runs["uneven"]
    v = hangs.verdict_of_run(run, 2)
    assert v is not None and v.kind == "missing"
    seq = r0["seq_before_last_backward"] + 1  # the first collective of rank 0's last backward
    assert (v.ranks, v.waiting, v.op, v.seq) == ([1], [0], "all_reduce", seq)
    assert str(v).startswith(
        f"rank 1 never entered all_reduce #{seq} of the default group: it left watch() after step "
        f"{STEPS - 2} at test_hangs.py:{WITH_LINE} in _train; rank 0 waits in backward at "
        f"test_hangs.py:{BACKWARD_LINE} in _train"
    )
    records = hangs.read_records(run)
    assert (records[0]["reason"], records[1]["reason"]) == ("hang", "exit")


@TIMEOUT
def test_a_rank_divergent_broadcast_is_a_mismatch_naming_both_calls(runs):
    (r0, r1), run = runs["branch"]
    v = hangs.verdict_of_run(run, 2)
    assert v is not None and v.kind == "mismatch"
    seq = r0["seq_before_metric"] + 1
    assert r1["seq_before_metric"] + 1 == seq
    assert (v.seq, v.op, v.ranks) == (seq, "all_reduce/broadcast", [0, 1])
    assert str(v) == (
        f"ranks disagree at collective #{seq} of the default group: "
        f"rank 0 calls all_reduce [[1]] Float at test_hangs.py:{METRIC_LINE} in _train; "
        f"rank 1 calls broadcast [[1]] Float at test_hangs.py:{BROADCAST_LINE} in _train"
    )


@TIMEOUT
def test_show_prints_the_hang_verdict_first_from_the_files_alone(runs):
    _, run = runs["skip"]
    v = hangs.verdict_of_run(run, 2)
    cmd = [sys.executable, "-m", "torchdebug", "show", str(run)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert proc.stdout.splitlines()[0] == f"hang: {v}"
    js = json.loads(subprocess.run([*cmd, "--json"], capture_output=True, text=True, check=True).stdout)
    assert js["hang_verdict"] == v.to_dict()


@TIMEOUT
def test_the_report_carries_the_hang_verdict_in_json_and_text(runs):
    _, run = runs["uneven"]
    v = hangs.verdict_of_run(run, 2)
    assert v is not None
    assert json.loads(td.render_report(run, "json"))["hang_verdict"] == v.to_dict()
    assert f"hang verdict: {v}" in td.render_report(run, "text").splitlines()


@TIMEOUT
def test_each_ranks_hang_event_carries_the_verdict_line(runs):
    _, run = runs["skip"]
    v = hangs.verdict_of_run(run, 2)
    for rank in (0, 1):  # each watchdog waited for the other's record, then matched both
        with open_run(run, rank=rank) as rec:
            (ev,) = rec.events("hang")
        head, line = ev["message"].split("\n")
        assert head.startswith(f"rank {rank} stuck in ")
        assert line == f"hang verdict: {v}"
        assert ev["data"]["verdict"] == v.to_dict()


@TIMEOUT
def test_the_dashboard_serves_the_hang_verdict_in_the_api_and_the_run_page(runs):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from torchdebug.views.server import serve

    _, run = runs["skip"]
    v = hangs.verdict_of_run(run, 2)
    handle = serve(run.parent, port=0)
    try:
        with httpx.Client(base_url=handle.url, timeout=30) as c:
            ov = c.get(f"/api/runs/{run.name}/ranks").json()
            assert ov["hang_verdict"] == v.to_dict()
            assert [h["rank"] for h in ov["hangs"]] == [0, 1]
            page = c.get(f"/runs/{run.name}").text
    finally:
        handle.stop()
    text = html.escape(str(v), quote=True)
    assert f'<p id="rank-hang-verdict"><strong>hang verdict:</strong> {text}</p>' in page


@TIMEOUT
def test_tensorboard_shows_the_hang_verdict_in_the_hang_event(runs, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from torchdebug.sinks import export_tensorboard

    _, run = runs["skip"]
    v = hangs.verdict_of_run(run, 2)
    with open_run(run, rank=0) as rec:
        export_tensorboard(rec, tmp_path)
    ea = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    ea.Reload()
    (text,) = [
        e.tensor_proto.string_val[0].decode() for e in ea.Tensors("torchdebug/events/hang/text_summary")
    ]
    assert f"hang verdict: {v}" in text


# -- the matcher alone, on the records the runs above wrote ----------------------------------------


@TIMEOUT
def test_matching_the_recorded_skip_without_rank1s_record_says_it_wrote_none(runs):
    _, run = runs["skip"]
    records = hangs.read_records(run)
    v = hangs.match({0: records[0]}, 2)
    assert str(v) == "no hang verdict: only rank 0 wrote a flight record with collectives"
    assert (v.kind, v.ranks) == ("unknown", [1])


@TIMEOUT
def test_four_ranks_from_the_recorded_skip_name_the_missing_the_waiting_and_the_silent(runs):
    _, run = runs["skip"]
    rec = hangs.read_records(run)
    blind = {"rank": 3, "reason": "hang", "phase": "forward", "last_step": 2, "where": "x.py:1 in f"}
    records = {
        **rec,
        2: {**rec[0], "rank": 2},
        3: {**blind, "entries": [], "error": "no Flight Recorder dump"},
    }
    v = hangs.match(records, 5)
    assert (v.kind, v.ranks, v.waiting, v.op) == ("missing", [1], [0, 2], "all_reduce")
    assert str(v).startswith(f"rank 1 never entered all_reduce #{v.seq} of the default group: it is at ")
    assert (
        f"; rank 0 waits after step {STEPS - 1} at test_hangs.py:{METRIC_LINE} in _train, rank 2 waits"
        in str(v)
    )
    assert str(v).endswith(
        "; rank 4 wrote no flight record; rank 3 recorded no collectives (no Flight Recorder dump)"
    )


@TIMEOUT
def test_the_ranks_of_a_recorded_run_agree_up_to_the_common_collectives(runs):
    _, run = runs["branch"]
    records = hangs.read_records(run)
    seq = hangs.match(records, 2).seq
    assert seq is not None
    cut = {r: {**rec, "entries": [e for e in rec["entries"] if e["seq"] < seq]} for r, rec in records.items()}
    v = hangs.match(cut, 2)
    assert v.kind == "agree" and v.seq is None
    assert str(v).startswith(
        "the ranks' collectives match in every group: the hang is outside them (rank 0: it is at "
    )


def test_a_gloo_dump_with_an_empty_default_group_key_normalizes_without_error():
    # the shape torch 2.13 writes for gloo (pg_config keyed '', the stock analyzer's KeyError)
    dump = {
        "version": "2.10",
        "pg_config": {"": {"name": "", "desc": "", "ranks": "[0, 1]"}},
        "entries": [
            {
                "collective_seq_id": 3,
                "frames": [
                    {
                        "filename": "/x/site-packages/torch/distributed/distributed_c10d.py",
                        "line": 3245,
                        "name": "all_reduce",
                    },
                    {"filename": "/job/train.py", "line": 88, "name": "main"},
                ],
                "input_dtypes": ["Float"],
                "input_sizes": [[3]],
                "is_p2p": False,
                "process_group": ("0", "default_pg"),
                "profiling_name": "gloo:all_reduce",
                "state": "scheduled",
            },
            {"process_group": ("1", "tp"), "profiling_name": "nccl:all_gather", "collective_seq_id": 1},
        ],
    }
    assert records.normalize(dump) == [
        {
            "group": "default",
            "seq": 3,
            "op": "all_reduce",
            "sizes": [[3]],
            "dtypes": ["Float"],
            "p2p": False,
            "where": "train.py:88 in main",
        },
        {
            "group": "tp",
            "seq": 1,
            "op": "all_gather",
            "sizes": [],
            "dtypes": [],
            "p2p": False,
            "where": "an unknown line",
        },
    ]


@TIMEOUT
def test_one_process_without_a_group_writes_its_hang_but_no_flight_record(tmp_path):
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = td.DebugConfig(run_dir=str(tmp_path), hang_timeout=0.3)
    with td.watch(model, opt, config=cfg) as mon:
        coord = next(i for i in mon.instruments if getattr(i, "name", "") == "distributed")
        model(torch.ones(1, 2)).sum().backward()
        deadline = time.monotonic() + 60.0
        while not coord._hung:  # the watchdog looks every 0.075 s
            assert time.monotonic() < deadline
            time.sleep(0.05)
        opt.step()
        mon.step()
    with open_run(mon.run_dir) as rec:
        assert len(rec.events("hang")) == 1
    assert list(mon.run_dir.glob("flight_rank*.json")) == []
    assert hangs.verdict_of_run(mon.run_dir) is None


# -- SIGUSR1: a flight record now, training goes on --------------------------------------------------

SIGNAL_STEP = 1  # rank 0 signals rank 1 after this step


def _signal_worker(rank: int, port: int, out: str) -> None:
    """Rank 0 sends SIGUSR1 to rank 1 once rank 1 finished step 1 and waits for its record; then both
    finish."""
    import signal

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    pids: list = [None, None]
    dist.all_gather_object(pids, os.getpid())
    calls: list[int] = []
    users = lambda signum, frame: calls.append(signum)  # noqa: E731 - the user's own handler
    signal.signal(signal.SIGUSR1, users)
    res: dict = {"rank": rank}
    try:
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with td.watch(model, opt, config=td.DebugConfig(run_dir=str(Path(out, "runs")))) as mon:
            res["run_dir"] = str(mon.run_dir)
            res["handler_inside_is_users"] = signal.getsignal(signal.SIGUSR1) is users
            flight = mon.run_dir / "flight_rank1.json"
            flight_path = str(flight)
            for step in range(STEPS):
                g = torch.Generator().manual_seed(10 * rank + step)
                x, y = torch.rand(8, 4, generator=g), torch.rand(8, 1, generator=g)
                loss = nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()  # signalled
                opt.step()
                mon.step()
                ready = Path(out, "rank1_after_step")
                if step == SIGNAL_STEP and rank == 0:
                    while not ready.exists():  # rank 1 finished the step: it waits in the loop below
                        time.sleep(0.05)
                    os.kill(pids[1], signal.SIGUSR1)
                if step == SIGNAL_STEP and rank == 1:
                    deadline = time.monotonic() + 60.0
                    # created in this frame (no library frame around it): the signal may land from here on
                    os.close(os.open(ready, os.O_CREAT | os.O_WRONLY))  # ready for the signal
                    # polled by C calls alone (pathlib's exists() is a Python frame the signal can land in)
                    while not os.access(flight_path, os.F_OK):  # the watchdog thread writes it
                        assert time.monotonic() < deadline  # in time
                        time.sleep(0.05)  # polled
                    res["record"] = json.loads(flight.read_text())
                    res["others"] = sorted(p.name for p in mon.run_dir.glob("flight_rank*.json"))
            res["steps"] = mon.global_step
            # rank 0 blocked inside a collective (C++ waits, Python runs no handler): rank 1 signals it
            # and joins only once rank 0's record is there, so the record must come from the watchdog
            blocked = mon.run_dir / "flight_rank0.json"
            entering = mon.run_dir / "rank0_enters_all_reduce"
            if rank == 1:
                while not entering.exists():
                    time.sleep(0.05)
                time.sleep(1.0)  # rank 0 is inside the all_reduce's C++ wait by then
                os.kill(pids[0], signal.SIGUSR1)
                deadline = time.monotonic() + 30.0
                while not blocked.exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                res["blocked_record"] = json.loads(blocked.read_text()) if blocked.exists() else None
            else:
                entering.touch()
            dist.all_reduce(torch.ones(1))  # blocked on rank 0
        res["handler_after_is_users"] = signal.getsignal(signal.SIGUSR1) is users
        res["wakeup_fd_after"] = signal.set_wakeup_fd(-1)
        res["user_handler_calls"] = list(calls)
    except BaseException:
        res["crash"] = traceback.format_exc()
    Path(out, f"result{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


@TIMEOUT
def test_sigusr1_writes_the_flight_record_now_and_training_finishes(tmp_path):
    import signal

    mp.spawn(_signal_worker, args=(_free_ports(1)[0], str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"result{r}.json").read_text()) for r in range(2))
    for r in (r0, r1):
        assert "crash" not in r, r["crash"]
        assert r["steps"] == STEPS  # training went on to the end
        assert r["handler_inside_is_users"] is False  # ours, inside watch()
        assert r["handler_after_is_users"] is True  # the user's back after exit
        assert r["wakeup_fd_after"] == -1  # the wakeup fd put back too
    rec = r1["record"]
    assert (rec["rank"], rec["reason"], rec["last_step"]) == (1, "signal", SIGNAL_STEP)
    assert rec["error"] is None
    # DDP's all-reduce of each step's gradients (one bucket) and torchdebug's all-reduce of the step's
    # numbers: both in the default group, all_reduce, each with its calling line
    # steps 0 and 1 in the ring: DDP's one bucket of 49 gradients (4*8+8 + 8*1+1) and torchdebug's
    # vector of the step's numbers (22), both all-reduced from the backward
    backward = f"test_hangs.py:{_line('loss.backward()  # signalled')} in _signal_worker"
    reduces = [(e["op"], e["sizes"], e["where"]) for e in rec["entries"] if e["op"] == "all_reduce"]
    assert reduces == [("all_reduce", [[49]], backward), ("all_reduce", [[22]], backward)] * 2
    polling = {
        _line("os.close(os.open(ready"),  # the signal can land as soon as the file exists
        _line("while not os.access(flight_path"),
        _line("assert time.monotonic() < deadline  # in time"),
        _line("time.sleep(0.05)  # polled"),
    }
    assert rec["where"] in {f"test_hangs.py:{n} in _signal_worker" for n in polling}  # rank 1 waits there
    assert r1["others"] == ["flight_rank1.json"]  # only the signalled rank wrote one
    assert r1["user_handler_calls"] == [signal.SIGUSR1]  # chained: the user's handler ran too
    assert r0["user_handler_calls"] == [signal.SIGUSR1]  # once its all_reduce returned
    blocked = r1["blocked_record"]
    assert blocked is not None, "rank 0 wrote no record while blocked in all_reduce"
    line = f"test_hangs.py:{_line('dist.all_reduce(torch.ones(1))  # blocked')} in _signal_worker"
    assert (blocked["reason"], blocked["last_step"], blocked["where"]) == ("signal", STEPS - 1, line)
    assert blocked["entries"][-1]["sizes"] == [[1]] and blocked["entries"][-1]["where"] == line
    run = Path(r0["run_dir"])
    recs = hangs.read_records(run)  # at exit every rank wrote its exit record over any earlier one
    assert (recs[0]["reason"], recs[1]["reason"]) == ("exit", "exit")
    assert hangs.verdict_of_run(run, 2) is None  # a finished run has no hang verdict

"""Memory: saved-for-backward bytes per module, leak detection, OOM forensics, OOM retry, seed facades."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from torch import nn
from torch.overrides import _get_current_function_mode

import torchdebug.session.monitor as tdm
from tests.fixtures.memory_models import LeakyMLP, OomNet, known_saves_model, leak_site_line
from torchdebug._errors import TorchDebugWarning
from torchdebug.memory.analysis import (
    PyTorchMemoryDebugger,
    SavedTensorTracker,
    debug_memory_usage,
    live_tensors,
    measure_module_memory,
    memory_sample,
    module_memory_table,
    profile_memory,
    storage_key,
)
from torchdebug.memory.instrument import LeakDetector, oom_report, theil_sen_slope, write_oom_report
from torchdebug.memory.recovery import is_oom_error, run_step_with_oom_retry, split_batch
from torchdebug.store import open_run


def _no_global_hooks_left() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def _global_saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Reference count: one saved_tensors_hooks around the whole forward, deduplicated by storage."""
    params = {storage_key(p) for p in model.parameters()}
    seen: set = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        k = storage_key(t)
        if k not in seen and k not in params:
            seen.add(k)
            total += t.untyped_storage().nbytes()
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return total


# ---------------------------------------------------------------------------------------------- saved bytes
def test_saved_bytes_per_module_exact_and_add_up():
    model = known_saves_model()
    x = torch.randn(8, 64)
    table = measure_module_memory(model, x)
    # fc "0" saves its input: 8*64*4 = 2048; ReLU "1" saves its output: 8*32*4 = 1024;
    # fc "2" saves the same ReLU output (deduplicated) and its weight's transpose (a parameter)
    assert table.row("0").activation_bytes == 2048
    assert table.row("1").activation_bytes == 1024
    assert table.row("2").activation_bytes == 0
    assert table.saved_total_bytes == 3072
    assert sum(r.activation_bytes for r in table.rows) == table.saved_total_bytes
    assert _global_saved_bytes(model, x) == 3072
    # own parameters: Linear(64, 32) = (64*32 + 32) * 4 = 8320 bytes; gradients the same after backward
    assert table.row("0").param_bytes == 8320
    assert table.row("0").grad_bytes == 8320
    assert table.rows[0].module == "0"  # ranked by total bytes
    assert model[0].weight.grad is None  # measure_module_memory leaves the model's grads as they were
    assert _no_global_hooks_left()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    text = str(table)
    assert "saved for backward: 3.0 KiB" in text
    assert json.loads(json.dumps(table.to_dict()))["saved_total_bytes"] == 3072


def test_tensor_saved_twice_counts_once():
    class Square(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * x  # mul saves both operands: the same storage twice

    x = torch.randn(5, 7, requires_grad=True)
    with SavedTensorTracker(Square()) as tr:
        Square()(x)  # a different instance: outside the tracked model
        m = tr.model
        m(x)
    # outside the model: 5*7*4 = 140 bytes; inside: the same storage again, already seen -> 0
    assert tr.outside == 140
    assert tr.by_module.get("", 0) == 0
    assert tr.total == 140
    tr.reset()
    with tr:
        m(x)
    assert tr.by_module[""] == 140


def test_optimizer_state_bytes_per_module():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    table = module_memory_table(model, opt)
    row = table.row("0")
    # exp_avg + exp_avg_sq: 2 * 8320; plus one float32 "step" scalar per parameter (weight, bias): 8
    assert row.optimizer_bytes == 2 * 8320 + 8
    assert row.total_bytes == 8320 + 8320 + 16648


def test_module_memory_instrument_first_three_due_steps(tmp_path):
    model = known_saves_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {
        "mode": "memory_profiling",
        "level": "basic",
        "per_module_memory": True,
        "memory_every": 2,
        "run_dir": str(tmp_path),
    }
    with tdm.watch(model, opt, config=cfg) as mon:
        for _ in range(9):
            x = torch.randn(8, 64)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step()
        inst = next(i for i in mon.instruments if i.name == "module_memory")
        run_path = mon.run_dir
    # due steps 0, 2, 4 (every 2): the first three; later due steps (6, 8) are not measured
    assert [t.step for t in inst.tables] == [0, 2, 4]
    for t in inst.tables:
        assert t.row("0").activation_bytes == 2048
        assert t.row("1").activation_bytes == 1024
        assert t.saved_total_bytes == 3072 + t.unattributed_bytes
    # the loss (pow + mean outside the model) saves the model output (8, 4): 8*4*4 = 128 bytes,
    # but it is computed after the forward ends, when the tracker is off
    assert inst.tables[0].unattributed_bytes == 0
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert _no_global_hooks_left()
    events = open_run(run_path).events(kind="module_memory")
    assert [e["step"] for e in events] == [0, 2, 4]
    assert events[0]["data"]["saved_total_bytes"] == 3072


# ---------------------------------------------------------------------------------------------- leak test
def test_theil_sen_ignores_an_outlier():
    # 15 pairwise slopes: the 10 among the five clean points are 2; the 5 with the outlier (5, 1000)
    # are 200, 249.5, 332, 497, 992 -> sorted, the 8th of 15 (the median) is 2
    assert theil_sen_slope([0, 1, 2, 3, 4, 5], [0, 2, 4, 6, 8, 1000]) == 2.0
    assert math.isnan(theil_sen_slope([1], [1]))


def test_leak_detector_linear_growth_vs_jump_vs_noise():
    growth = LeakDetector(window=10, warmup=2, min_bytes_per_step=1000)
    hits = [growth.add(s, {"rss": 10_000_000 + 5000 * s}) for s in range(12)]
    assert not any(hits[:11]) and hits[11][0].series == "rss"
    assert hits[11][0].slope == pytest.approx(5000.0)
    jump = LeakDetector(window=10, warmup=0, min_bytes_per_step=1000)
    # one 1 MiB jump (a cache filling once): one increase in nine changes
    assert not any(jump.add(s, {"rss": 10_000_000 + (1 << 20) * (s >= 5)}) for s in range(30))
    noise = LeakDetector(window=10, warmup=0, min_bytes_per_step=1000)
    wiggle = [0, 4096, -4096, 8192, 0, -4096, 4096, 0, 8192, -8192]
    assert not any(noise.add(s, {"rss": 10_000_000 + wiggle[s % 10]}) for s in range(40))


def _train(model, steps, cfg, leak_at=None, batch=64):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    with tdm.watch(model, opt, config=cfg) as mon:
        for step in range(steps):
            if leak_at is not None and step == leak_at:
                model.leak = True
            x = torch.randn(batch, 16, generator=g)
            y = torch.randn(batch, 1, generator=g)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step()
        inst = next(i for i in mon.instruments if i.name == "memory")
        events = [e for e in mon.events if e.kind == "memory_leak"]
    return inst, events


@pytest.mark.parametrize("kind, category", [("history", "autograd_history"), ("plain", "tensors")])
def test_leak_injected_is_found_with_category_and_line(tmp_path, kind, category):
    torch.manual_seed(0)
    model = LeakyMLP(kind=kind)
    cfg = {
        "mode": "memory_profiling",
        "level": "basic",
        "memory_every": 1,
        "leak_window": 10,
        "run_dir": str(tmp_path),
    }
    with pytest.warns(TorchDebugWarning, match="memory_leak"):
        inst, events = _train(model, 30, cfg, leak_at=8)
    assert events, "the leak was not reported"
    rep = inst.leaks[0]
    assert rep.step > 8
    assert _get_current_function_mode() is None  # the creation capture left the mode stack
    assert rep.category == category
    # one kept (64, 1024) float32 tensor per step: 64*1024*4 = 262144 bytes survive each step
    assert rep.survivors_bytes == 262144
    assert rep.tensors[0].shape == (64, 1024)
    assert rep.tensors[0].has_history is (kind == "history")
    if kind == "history":
        assert rep.site.endswith(f"memory_models.py:{leak_site_line()}")
        assert rep.site.startswith("LeakyMLP")  # the root module's own forward made it
    # malloc's in-use bytes grow by the kept tensor (+ for "history" the (64, 16) input its graph
    # saved, 4 KiB, and small autograd nodes): between 256 KiB and 110% of it per step
    assert rep.series == "heap_in_use"
    assert 262144 <= rep.bytes_per_step <= 1.1 * 262144
    assert events[0].evidence["category"] == category


def test_leak_after_backward_is_found_at_the_users_line(tmp_path):
    torch.manual_seed(0)
    model = LeakyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    cfg = {
        "mode": "memory_profiling",
        "level": "basic",
        "memory_every": 1,
        "leak_window": 10,
        "run_dir": str(tmp_path),
    }
    kept = []
    with pytest.warns(TorchDebugWarning, match="memory_leak"), tdm.watch(model, opt, config=cfg) as mon:
        for step in range(30):
            loss = nn.functional.mse_loss(model(torch.randn(64, 16, generator=g)), torch.zeros(64, 1))
            opt.zero_grad()
            loss.backward()
            if step >= 8:
                kept.append(model.fc1.weight.grad.repeat(4, 1))  # (4096, 16) f32 = 256 KiB per step
                line = sys._getframe().f_lineno - 1
            opt.step()
            mon.step()
        rep = next(i for i in mon.instruments if i.name == "memory").leaks[0]
    assert rep.category == "tensors"
    assert rep.survivors_bytes == 4096 * 16 * 4
    assert rep.site == f"tests/test_memory.py:{line}" or rep.site.endswith(f"test_memory.py:{line}")


def test_healthy_200_step_loop_raises_no_leak_alarm(tmp_path):
    torch.manual_seed(0)
    model = LeakyMLP(hidden=32)
    cfg = {
        "mode": "memory_profiling",
        "level": "basic",
        "memory_every": 1,
        "leak_window": 10,
        "run_dir": str(tmp_path),
    }
    inst, events = _train(model, 200, cfg, batch=8)
    assert events == []
    assert inst.leaks == []
    assert len(inst.samples) == 10  # the window is bounded


# ---------------------------------------------------------------------------------------------- OOM
def test_oom_in_watched_step_writes_summary_and_reraises(tmp_path):
    model = OomNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"mode": "memory_profiling", "level": "basic", "run_dir": str(tmp_path)}
    with (
        pytest.raises(torch.OutOfMemoryError) as info,
        pytest.warns(TorchDebugWarning, match="oom"),
        tdm.watch(model, opt, config=cfg) as mon,
    ):
        for step in range(5):
            model.body[1].armed = step == 2
            loss = model(torch.randn(4, 8)).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step()
    err = info.value
    assert "simulated" in str(err)  # the original error, unchanged
    run_dir = mon.run_dir
    data = json.loads((run_dir / "oom-2.json").read_text())
    assert data["module"] == "body.1"
    assert data["module_type"] == "Explode"
    assert data["phase"] == "forward"
    assert data["batch_shape"] == [4, 8]
    assert data["step"] == 2
    assert {r["module"] for r in data["modules"]["rows"]} == {"body.0", "head"}
    text = (run_dir / "oom-2.txt").read_text()
    assert "out of memory at step 2 in forward of body.1 (Explode)" in text
    events = open_run(run_dir).events(kind="oom")
    assert len(events) == 1 and events[0]["severity"] == "error"
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_oom_report_standalone_names_module(tmp_path):
    model = OomNet()
    model.body[1].armed = True
    with pytest.raises(torch.OutOfMemoryError) as info:
        model(torch.randn(3, 8))
    rep = oom_report(info.value, model, step=7)
    assert rep.module == "body.1" and rep.phase == "forward"
    rep = write_oom_report(rep, tmp_path)
    assert (tmp_path / "oom-7.json").exists() and (tmp_path / "oom-7.txt").exists()
    assert rep.files[0].endswith("oom-7.json")


def test_is_oom_error():
    assert is_oom_error(torch.OutOfMemoryError("x"))
    assert is_oom_error(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1"))
    assert not is_oom_error(RuntimeError("shape mismatch"))
    assert not is_oom_error(ValueError("out of memory"))


# ---------------------------------------------------------------------------------------------- retry
def _reg_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 1))


@pytest.mark.parametrize("n", [16, 10, 7])
def test_retry_half_gradients_equal_full_batch(n):
    g = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(n, 6, generator=g), "y": (torch.randn(n, 1, generator=g),)}
    ref = _reg_model()
    nn.functional.mse_loss(ref(batch["x"]), batch["y"][0]).backward()
    model = _reg_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sizes_run: list[int] = []

    def step_fn(b):
        bs = b["x"].shape[0]
        out = model(b["x"])  # part of the graph exists when the OOM hits
        if bs > 4:
            raise torch.OutOfMemoryError(f"simulated: batch {bs} does not fit")
        sizes_run.append(bs)
        loss = nn.functional.mse_loss(out, b["y"][0])
        loss.backward()
        return loss

    retries = []
    attempts = []
    loss = run_step_with_oom_retry(
        step_fn,
        batch,
        on_oom="retry_half",
        optimizer=opt,
        on_retry=retries.append,
        before_attempt=lambda piece: attempts.append(piece["x"].shape[0]),
    )
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    full = nn.functional.mse_loss(ref(batch["x"]), batch["y"][0]).detach()
    torch.testing.assert_close(loss, full, rtol=1e-5, atol=1e-7)
    assert sum(retries[0].piece_sizes) == n and max(retries[0].piece_sizes) <= 4
    assert retries[0].batch_size == n
    # before_attempt sees every piece of every retry level; the last level's pieces all ran
    assert attempts[-len(retries[0].piece_sizes) :] == list(retries[0].piece_sizes)
    assert sizes_run == list(retries[0].piece_sizes)


def test_retry_raise_and_errors():
    model = _reg_model()

    def boom(b):
        raise torch.OutOfMemoryError("simulated")

    with pytest.raises(torch.OutOfMemoryError):
        run_step_with_oom_retry(boom, torch.randn(4, 6), on_oom="raise")
    with pytest.raises(ValueError, match="on_oom must be one of"):
        run_step_with_oom_retry(boom, torch.randn(4, 6), on_oom="halve")
    with pytest.raises(ValueError, match="optimizer= or params="):
        run_step_with_oom_retry(boom, torch.randn(4, 6), on_oom="retry_half")
    with pytest.raises(torch.OutOfMemoryError, match="still out of memory"):
        run_step_with_oom_retry(boom, torch.randn(4, 6), params=model.parameters(), max_halvings=1)
    assert all(p.grad is None for p in model.parameters())


def test_split_batch_shapes_and_errors():
    a, b = split_batch((torch.zeros(5, 3), [torch.ones(5)], "meta"))
    assert a[0].shape == (3, 3) and b[0].shape == (2, 3) and a[1][0].shape == (3,) and a[2] == "meta"
    with pytest.raises(ValueError, match="disagree"):
        split_batch((torch.zeros(4), torch.zeros(3)))
    with pytest.raises(ValueError, match="one sample"):
        split_batch(torch.zeros(1, 2))


# ---------------------------------------------------------------------------------------------- facades
def test_seed_facades():
    s = memory_sample()
    assert isinstance(s["rss"], int) and s["rss"] > 0
    d = debug_memory_usage(rss_threshold_bytes=1)
    assert d["warnings"] and d["warnings"][0].startswith("process RSS")
    assert debug_memory_usage()["warnings"] == []
    dbg = PyTorchMemoryDebugger()
    x = torch.zeros(256)
    dbg.track_tensor(x, "x")
    snap = dbg.take_memory_snapshot("start")
    assert snap["tracked"]["x"]["bytes"] == 1024 and snap["label"] == "start"
    del x
    assert dbg.take_memory_snapshot("end")["tracked"]["x"] == {"alive": False}
    assert set(dbg.clear_memory()) >= {"rss"}
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        dbg.track_tensor([1, 2], "list")
    with profile_memory("alloc") as prof:
        keep = torch.ones(1 << 20)  # 4 MiB
    assert prof.after and prof.before and "rss" in prof.delta and keep.numel() == 1 << 20


def test_live_tensors_labels_parameters_and_grads():
    model = nn.Linear(300, 200)
    model(torch.randn(2, 300)).sum().backward()
    live = live_tensors(model)
    kinds = {(t.kind, t.owner) for t in live}
    assert ("parameter", "weight") in kinds and ("gradient", "weight") in kinds
    w = next(t for t in live if t.kind == "parameter" and t.owner == "weight")
    assert w.bytes == 300 * 200 * 4


def test_memory_samples_logged_on_due_steps(tmp_path):
    model = known_saves_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    cfg = {"mode": "memory_profiling", "level": "basic", "memory_every": 3, "run_dir": str(tmp_path)}
    with tdm.watch(model, opt, config=cfg) as mon:
        for _ in range(7):
            model(torch.randn(8, 64)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
    rows = open_run(mon.run_dir).memory()
    assert [r["step"] for r in rows] == [0, 3, 6]  # due steps: 0, every, 2*every
    assert all(isinstance(r["rss"], int) and r["rss"] > 0 for r in rows)


class _OomBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated in backward)")


def test_oom_in_backward_is_attributed_to_backward(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    cfg = {"mode": "memory_profiling", "level": "basic", "run_dir": str(tmp_path)}
    with (
        pytest.raises(torch.OutOfMemoryError, match="in backward"),
        pytest.warns(TorchDebugWarning, match="oom"),
        tdm.watch(model, opt, config=cfg) as mon,
    ):
        _OomBackward.apply(model(torch.randn(3, 4))).sum().backward()
    data = json.loads((mon.run_dir / "oom-0.json").read_text())
    assert data["phase"] == "backward"
    assert data["module"] is None  # no module's forward is on the stack during backward
    assert data["batch_shape"] == [3, 4]


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
def test_cuda_sample_and_module_peaks():
    x = torch.empty(1 << 20, device="cuda")  # 4 MiB
    s = memory_sample()
    assert s["cuda_allocated"] >= 4 << 20 and s["cuda_reserved"] >= s["cuda_allocated"]
    model = known_saves_model().cuda()
    table = measure_module_memory(model, torch.randn(8, 64, device="cuda"))
    assert table.row("0").activation_bytes == 2048  # same storages as on CPU
    assert table.forward_peak_bytes is not None and table.forward_peak_bytes >= x.numel() * 4
    assert table.backward_peak_bytes is not None


@pytest.mark.gpu
@cuda
def test_cuda_oom_writes_snapshot(tmp_path):
    model = OomNet().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"mode": "memory_profiling", "level": "basic", "run_dir": str(tmp_path)}
    with (
        pytest.raises(torch.OutOfMemoryError),
        pytest.warns(TorchDebugWarning, match="oom"),
        tdm.watch(model, opt, config=cfg) as mon,
    ):
        model.body[1].armed = True
        model(torch.randn(4, 8, device="cuda")).sum().backward()
    assert (mon.run_dir / "oom-0-snapshot.pickle").stat().st_size > 0


@pytest.mark.skipif(
    not hasattr(__import__("os"), "fork") or sys.platform != "linux", reason="needs fork and /proc"
)
def test_rss_is_the_calling_process_s_also_in_a_child_forked_after_the_first_read():
    import os

    import psutil

    from torchdebug.memory.analysis import _rss

    first = _rss()  # opens /proc/self/statm in this process
    assert abs(first - psutil.Process().memory_info().rss) < 64 * 2**20
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its RSS, 256 MiB more (touched), its RSS again by both readers
        try:
            before = _rss()
            blob = b"x" * (256 * 2**20)
            after = _rss()
            os.write(w, json.dumps([before, after, psutil.Process().memory_info().rss, len(blob)]).encode())
        finally:
            os._exit(0)
    os.close(w)
    got = json.loads(os.read(r, 4096).decode())
    os.waitpid(pid, 0)
    os.close(r)
    before, after, child_psutil, _ = got
    assert abs(after - child_psutil) < 2**20  # the child's own statm, not the file the parent opened
    assert after - before >= 255 * 2**20  # and it sees its own 256 MiB

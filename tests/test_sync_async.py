"""watch(sync="async"): no blocking read on ordinary steps, the device skips a bad update, same origin."""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import torchdebug as td
from tests.fixtures import models as fx
from tests.fixtures.models import origin_line
from torchdebug.session import deferred

SENTINEL_ONLY = td.DebugConfig(mode="anomaly_detection")
FALLBACK = "sync='async' falls back to the blocking read"


@pytest.fixture(autouse=True)
def _global_state_restored() -> Iterator[None]:
    from torch.amp.grad_scaler import GradScaler
    from torch.optim import optimizer as optim_mod

    def patched() -> tuple[Any, ...]:
        return (
            torch.Tensor.backward,
            torch.autograd.backward,
            GradScaler.step,
            nn.Module.__getstate__,
            nn.Module.zero_grad,
            torch.optim.Optimizer.zero_grad,
            torch.nn.utils.clip_grad_norm_,
        )

    before = patched()
    yield
    assert patched() == before
    assert not optim_mod._global_optimizer_pre_hooks and not optim_mod._global_optimizer_post_hooks
    assert torch._C._len_torch_function_stack() == 0


_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


@contextlib.contextmanager
def count_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Count the reads of tensor values on the host, split into blocking reads and staged reads.

    A blocking read is any call of ``Tensor.item/tolist/cpu/numpy/__bool__/__float__/__int__/__index__``
    (what turns a device value into a host one; on CUDA each waits for the device). The async mode's
    one read per step goes through ``deferred.host_values``, which reads a host buffer the previous
    step filled: on CUDA a pinned buffer whose event reported the copy complete (no wait), on CPU the
    previous step's numbers. Reads inside it are counted apart, with the session's step at the time.
    """
    counts: dict[str, Any] = {"blocking": 0, "where": [], "staged_at": [], "inside": False, "off": False}
    for name in _READS:
        orig = getattr(torch.Tensor, name)

        def wrapper(self: torch.Tensor, *a: Any, _orig: Any = orig, _name: str = name, **k: Any) -> Any:
            if not counts["inside"] and not counts["off"]:
                counts["blocking"] += 1
                counts["where"].append(_name)
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, wrapper)
    orig_host = deferred.host_values

    def host_values(buf: torch.Tensor) -> list[float]:
        counts["staged_at"].append(counts.get("step"))
        counts["inside"] = True
        try:
            return orig_host(buf)
        finally:
            counts["inside"] = False

    monkeypatch.setattr(deferred, "host_values", host_values)
    try:
        yield counts
    finally:
        monkeypatch.undo()


def _fused(model: nn.Module, kind: str = "adamw") -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=True)
    return torch.optim.Adagrad(model.parameters(), lr=0.05, fused=True)


def _loop(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batches: Callable[[int], torch.Tensor],
    steps: int,
    each: Callable[[int, Any], None] = lambda i, mon: None,
    **watch_kw: Any,
) -> td.Monitor:
    watch_kw.setdefault("config", SENTINEL_ONLY)
    watch_kw.setdefault("run", False)
    with td.watch(model, opt, **watch_kw) as mon:
        for i in range(steps):
            x = batches(i)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            mon.step()
            each(i, mon)
    return mon


def test_sync_option_is_validated() -> None:
    model = fx.MLP()
    with pytest.raises(td.ConfigError, match="sync must be one of blocking, async") as ei:
        td.watch(model, sync="eventually")
    assert isinstance(ei.value, ValueError)  # ``except ValueError`` still catches it
    with pytest.raises(td.ConfigError, match="policy must be one of"):
        td.watch(model, policy="ignore")
    with pytest.raises(td.ConfigError, match="expected one of 'blocking', 'async'"):
        td.DebugConfig(sync="later")  # type: ignore[arg-type]
    assert td.watch(model, sync="ASYNC", run=False).config.sync == "async"
    assert td.DebugConfig.from_env({"TORCHDEBUG_SYNC": "async"}).sync == "async"


@pytest.mark.parametrize("config", [SENTINEL_ONLY, td.DebugConfig()], ids=["sentinel", "default"])
def test_ordinary_steps_make_no_blocking_read(monkeypatch: pytest.MonkeyPatch, config: Any) -> None:
    torch.manual_seed(0)
    model = fx.MLP()
    opt = _fused(model)
    steps = 6
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # psutil-free memory sampling notes, if any
        with count_reads(monkeypatch) as counts:

            def each(i: int, mon: Any) -> None:
                counts["step"] = mon.global_step
                if i == 0:
                    counts["blocking"], counts["where"] = 0, []  # step 0 is read blocking (no state yet)
                counts["off"] = i == steps - 1  # the exit reads the last update's parameter probe

            counts["step"] = 0
            mon = _loop(model, opt, lambda i: torch.randn(4, 8), steps, each, config=config, sync="async")
    # steps 1..5 are ordinary: not one read of a value on the training thread (the exit's own reads are
    # not counted); their staged numbers
    # are read once each, one step later: step j's at step j+1's first forward (global_step j+1, the
    # counter's step updated after mon.step()), the last one at exit (global_step 6)
    assert counts["where"] == [] and counts["blocking"] == 0
    assert counts["staged_at"] == [2, 3, 4, 5, 6]
    assert [r.step for r in mon.records] == list(range(steps))
    assert all(r.loss is not None for r in mon.records)
    assert mon._async is not None and (mon._async.host_reads, mon._async.blocking_reads) == (5, 0)


def test_the_counter_sees_the_blocking_read(monkeypatch: pytest.MonkeyPatch) -> None:
    # the same loop in the default mode: exactly one read per ordinary step (the step's tolist), so the
    # counter above can fail
    torch.manual_seed(0)
    model = fx.MLP()
    opt = _fused(model)
    with count_reads(monkeypatch) as counts:
        _loop(model, opt, lambda i: torch.randn(4, 8), 6)
    # the start's parameter probe (weights already NaN?), 6 steps, and the exit's (the last update's
    # parameter probe)
    assert counts["where"] == ["tolist"] * 8


def test_numbers_arrive_one_step_later_and_equal_the_blocking_ones(tmp_path: Any) -> None:
    def run(sync: str) -> tuple[list[td.StepRecord], list[td.StepRecord], Any]:
        torch.manual_seed(0)
        model = fx.MLP()
        opt = _fused(model)
        returned: list[td.StepRecord] = []
        mon = _loop(
            model,
            opt,
            lambda i: torch.randn(4, 8),
            5,
            lambda i, mon: returned.append(mon.records[-1] if mon.records else None),
            sync=sync,
            run=tmp_path / sync,
        )
        return returned, list(mon.records), mon.run_dir

    blocking, blocking_all, _ = run("blocking")
    returned, records, run_dir = run("async")
    # blocking: mon.records[-1] after mon.step() is that step's; async: the one before (step 0 is
    # blocking, so after step 1 the last full record is step 0's, ...)
    assert [r.step for r in blocking] == [0, 1, 2, 3, 4]
    assert [r.step for r in returned] == [0, 0, 1, 2, 3]
    assert [(r.step, r.loss, r.grad_norm) for r in records] == [
        (r.step, r.loss, r.grad_norm) for r in blocking_all
    ]
    with td.open_run(run_dir) as run:
        assert run.series("loss").steps == [0, 1, 2, 3, 4]
        assert run.series("loss").values == [r.loss for r in blocking_all]


@pytest.mark.parametrize("kind", ["adamw", "adam", "sgd", "adagrad"])
def test_nan_at_step_k_leaves_weights_and_state_bitwise_equal(kind: str) -> None:
    torch.manual_seed(0)
    model = fx.ZeroDivNet()
    opt = _fused(model, kind)
    k = 3
    snap: dict[str, Any] = {}
    with (
        pytest.raises(td.NonFiniteError) as ei,
        td.watch(model, opt, run=False, config=SENTINEL_ONLY, sync="async") as mon,
    ):
        for i in range(6):
            x = torch.zeros(3, 4) if i == k else torch.randn(3, 4)  # all-zero input: 0/0 in the forward
            if i == k:
                snap = copy.deepcopy({"params": model.state_dict(), "opt": opt.state_dict()})
            opt.zero_grad()
            model(x).pow(2).mean().backward()  # at i = k + 1 the forward's first boundary raises
            opt.step()
            if i == k:
                # the update ran on the device with found_inf = 1: nothing changed, step counters included
                assert "found_inf" not in vars(opt)
                now = {"params": model.state_dict(), "opt": opt.state_dict()}
                assert all(torch.equal(snap["params"][n], t) for n, t in now["params"].items())
                for p, state in snap["opt"]["state"].items():
                    assert state.keys() == now["opt"]["state"][p].keys()
                    assert all(torch.equal(v, now["opt"]["state"][p][name]) for name, v in state.items())
            mon.step()
    assert i == k + 1  # raised at the next step boundary
    assert ei.value.anomaly.step == k
    assert ei.value.anomaly.location == origin_line("div")
    assert all(torch.equal(snap["params"][n], t) for n, t in model.state_dict().items())
    assert "found_inf" not in vars(opt) and mon.closed


def _anomaly_of(sync: str, fault: str) -> td.Anomaly:
    torch.manual_seed(0)
    model = fx.ZeroDivNet()
    opt = _fused(model)

    def batch(i: int) -> torch.Tensor:
        x = torch.randn(3, 4)
        if i == 2 and fault == "div":
            x = torch.zeros(3, 4)
        if i == 2 and fault == "input":
            x[1, 2] = float("nan")
        return x

    with pytest.raises(td.NonFiniteError) as ei:
        _loop(model, opt, batch, 5, sync=sync)
    return ei.value.anomaly


@pytest.mark.parametrize(("fault", "phase"), [("div", "forward"), ("input", "input")])
def test_the_anomaly_names_the_same_origin_as_the_blocking_mode(fault: str, phase: str) -> None:
    blocking, late = _anomaly_of("blocking", fault), _anomaly_of("async", fault)
    fields = ("phase", "module", "op", "location", "kind", "step", "micro_step", "reproducible")
    assert [getattr(late, f) for f in fields] == [getattr(blocking, f) for f in fields]
    assert (late.phase, late.step) == (phase, 2)
    if fault == "div":
        assert (late.op, late.location) == ("aten.div", origin_line("div"))


def test_raise_at_exit_names_the_last_step() -> None:
    torch.manual_seed(0)
    model = fx.ZeroDivNet()
    opt = _fused(model)
    with pytest.raises(td.NonFiniteError) as ei:
        _loop(model, opt, lambda i: torch.zeros(3, 4) if i == 3 else torch.randn(3, 4), 4, sync="async")
    assert ei.value.anomaly.step == 3 and ei.value.anomaly.location == origin_line("div")
    assert "found_inf" not in vars(opt) and all(not m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize("policy", ["skip", "warn"])
def test_skip_and_warn_go_on_from_the_unchanged_weights(policy: str) -> None:
    torch.manual_seed(0)
    model = fx.ZeroDivNet()
    opt = _fused(model)
    with pytest.warns(td.TorchDebugWarning) as said:
        mon = _loop(
            model,
            opt,
            lambda i: torch.zeros(3, 4) if i == 2 else torch.randn(3, 4),
            5,
            policy=policy,
            sync="async",
        )
    expected = {
        "skip": [
            "torchdebug: step 2 skipped by policy: nan born in forward of ZeroDivNet: aten.div",
            "torchdebug: 1 step skipped by policy='skip' (step 2); training resumed at step 3",
        ],
        # warn: said once; the step is recorded as skipped (info): its update never ran on the device
        "warn": ["torchdebug: nan born in forward of ZeroDivNet: aten.div"],
    }[policy]
    assert [str(w.message)[: len(e)] for w, e in zip(said, expected)] == expected and len(said) == len(
        expected
    )
    assert [r.skipped for r in mon.records] == [False, False, True, False, False]
    # step 2 is the one anomalous step (its NaN), counted when its record arrives one step later
    assert mon.counters == {"anomaly_steps": 1, "skipped_steps": 1, "replays": 1, "anomalous_steps": 1}
    assert mon.anomalies[0].location == origin_line("div") and mon.anomalies[0].step == 2
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # the step after the bad one trained again: 4 updates of 5 (AdamW's step counter)
    assert {float(s["step"]) for s in opt.state.values()} == {4.0}


def test_a_non_fused_optimizer_falls_back_once_and_is_still_protected() -> None:
    torch.manual_seed(0)
    model = fx.ZeroDivNet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)  # foreach, not fused: no found_inf
    with pytest.warns(td.TorchDebugWarning) as said:
        mon = _loop(
            model,
            opt,
            lambda i: torch.zeros(3, 4) if i == 3 else torch.randn(3, 4),
            5,
            policy="skip",
            sync="async",
        )
    fallback = [str(w.message) for w in said if FALLBACK in str(w.message)]
    assert fallback == [
        "torchdebug: sync='async' falls back to the blocking read (one host sync per step): AdamW cannot "
        "skip its update on the device (only fused optimizers take found_inf, e.g. "
        "torch.optim.AdamW(..., fused=True))"
    ]
    assert [r.skipped for r in mon.records] == [False, False, False, True, False]
    assert mon.anomalies[0].location == origin_line("div")
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not hasattr(opt, "found_inf")


def test_gradscaler_and_updates_by_hand_fall_back() -> None:
    torch.manual_seed(0)
    model = fx.MLP()
    opt = _fused(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    with (
        pytest.warns(td.TorchDebugWarning, match="a GradScaler owns the optimizer's found_inf"),
        td.watch(model, opt, run=False, config=SENTINEL_ONLY, sync="async", scaler=scaler) as mon,
    ):
        for _ in range(3):
            opt.zero_grad()
            scaler.scale(model(torch.randn(4, 8)).pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
            mon.step()
    assert [r.loss is not None for r in mon.records] == [True] * 3  # read blocking, at each step

    model = fx.MLP()
    with (
        pytest.warns(td.TorchDebugWarning, match=r"no optimizer object \(an update by hand\)"),
        td.watch(model, run=False, config=SENTINEL_ONLY, sync="async") as mon,
    ):
        for _ in range(3):
            model.zero_grad()
            model(torch.randn(4, 8)).pow(2).mean().backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.01 * p.grad
            mon.step()
    assert len(mon.records) == 3


def test_found_inf_and_hooks_come_off_on_an_exception() -> None:
    torch.manual_seed(0)
    model = fx.MLP()
    opt = _fused(model)
    theirs = torch.zeros(())
    opt.found_inf = theirs  # type: ignore[attr-defined]  # someone else's flag (0: update): kept as it was

    def fail(o: Any, args: Any, kwargs: Any) -> None:
        raise RuntimeError("boom in the user's pre-hook")

    with (
        pytest.raises(RuntimeError, match="boom"),
        td.watch(model, opt, run=False, config=SENTINEL_ONLY, sync="async") as mon,
    ):
        for i in range(3):
            opt.zero_grad()
            model(torch.randn(4, 8)).pow(2).mean().backward()
            if i == 2:
                opt.register_step_pre_hook(fail)  # after ours: found_inf is set, the post-hook never runs
            opt.step()
            mon.step()
    assert opt.found_inf is theirs  # type: ignore[attr-defined]
    assert mon.closed and mon._async is not None and not mon._async.pending
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: torch.cuda.set_sync_debug_mode")
def test_cuda_ordinary_steps_do_not_synchronize() -> None:
    torch.manual_seed(0)
    model = fx.MLP().cuda()
    opt = _fused(model)
    with td.watch(model, opt, run=False, config=SENTINEL_ONLY, sync="async") as mon:
        for i in range(6):
            x = torch.randn(4, 8, device="cuda")
            if i == 1:
                torch.cuda.set_sync_debug_mode("error")  # step 0 (no optimizer state yet) is blocking
            try:
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                opt.step()
                mon.step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
    assert [r.step for r in mon.records] == list(range(6))


def test_a_late_read_holds_the_next_update_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # On CUDA the copy of step k may still be in flight when step k+1's update starts: the sticky flag
    # then skips step k+1's update too, so step k's replay still sees the weights it saw. Simulated on
    # CPU: step k's numbers report "not copied yet" until step k+2 begins.
    torch.manual_seed(0)
    model = fx.ZeroDivNet()
    opt = _fused(model)
    k = 2
    box: dict[str, Any] = {}
    real_ready = deferred._Pending.ready
    monkeypatch.setattr(
        deferred._Pending,
        "ready",
        lambda self: real_ready(self) and not (self.step == k and box["mon"].global_step < k + 2),
    )

    def each(i: int, mon: Any) -> None:
        if i == k - 1:
            box["before"] = copy.deepcopy({"params": model.state_dict(), "opt": opt.state_dict()})
        if i == k + 1:  # steps k and k+1 both ran their update with found_inf = 1: nothing changed
            assert len(mon.records) == k  # neither is read yet
            assert all(torch.equal(box["before"]["params"][n], t) for n, t in model.state_dict().items())
            assert all(
                torch.equal(v, opt.state_dict()["state"][p][name])
                for p, st in box["before"]["opt"]["state"].items()
                for name, v in st.items()
            )

    with (
        pytest.warns(td.TorchDebugWarning) as said,
        td.watch(model, opt, run=False, config=SENTINEL_ONLY, sync="async", policy="skip") as mon,
    ):
        box["mon"] = mon
        for i in range(5):
            x = torch.zeros(3, 4) if i == k else torch.randn(3, 4)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            mon.step()
            each(i, mon)
    assert [r.skipped for r in mon.records] == [False, False, True, True, False]
    assert mon.records[k].anomaly is not None and mon.records[k].anomaly.location == origin_line("div")
    assert mon.records[k + 1].anomaly is None
    assert mon.records[k + 1].skip_reason.startswith("skipped by policy: held on the device")
    assert [str(w.message)[:34] for w in said] == [
        "torchdebug: step 2 skipped by poli",
        "torchdebug: 2 steps skipped by pol",
    ]
    assert str(said[1].message).endswith("(steps 2-3); training resumed at step 4")
    assert mon.counters["anomaly_steps"] == 1 and mon.counters["skipped_steps"] == 2
    assert {float(s["step"]) for s in opt.state.values()} == {3.0}  # updates 0, 1 and 4 ran


def test_sync_can_be_switched_on_a_live_session() -> None:
    torch.manual_seed(0)
    model = fx.MLP()
    opt = _fused(model)
    seen: list[bool] = []

    def each(i: int, mon: Any) -> None:
        seen.append(mon._async is not None)
        if i == 1:
            mon.reconfigure(sync="async")  # applied at the end of the next mon.step()
        if i == 4:
            mon.reconfigure(sync="blocking")

    mon = _loop(model, opt, lambda i: torch.randn(4, 8), 7, each)
    assert seen == [False, False, True, True, True, False, False]
    assert [r.step for r in mon.records] == list(range(7)) and all(r.loss is not None for r in mon.records)


def test_gradient_health_judges_each_step_with_its_own_norm() -> None:
    # the explosion rule sees the same (step, norm) series in both modes: in async mode the step's norm
    # arrives one step later, and before the update an instrument sees no norm rather than the last one
    def norms(sync: str) -> list[tuple[int, float]]:
        from torchdebug.health.instrument import GradientHealth

        seen: list[tuple[int, float]] = []
        orig = GradientHealth.on_step_end

        def spy(self: Any, mon: Any, record: Any, values: Any) -> None:
            seen.append((record.step, values.get("grad_norm")))
            orig(self, mon, record, values)

        torch.manual_seed(0)
        model = fx.MLP()
        opt = _fused(model)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(GradientHealth, "on_step_end", spy)
            mp.setattr(
                GradientHealth,
                "before_optimizer_step",
                lambda self, mon: seen.append((-1, mon.grad_norm_host)) if sync == "async" else None,
            )
            _loop(model, opt, lambda i: torch.randn(4, 8), 4, config=td.DebugConfig(store=False), sync=sync)
        return seen

    blocking, late = norms("blocking"), norms("async")
    assert [s for s, _ in blocking] == [0, 1, 2, 3]
    # async: step 0 blocking (its norm read before its update), then no norm before each update
    assert [x for x in late if x[0] == -1][1:] == [(-1, None)] * 3
    assert [x for x in late if x[0] != -1] == blocking


def test_a_failure_of_the_async_read_switches_it_off_not_the_training(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    model = fx.ZeroDivNet()
    opt = _fused(model)
    real = deferred.host_values
    calls = {"n": 0}

    def broken(buf: torch.Tensor) -> list[float]:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("a broken read")
        return real(buf)

    monkeypatch.setattr(deferred, "host_values", broken)
    with pytest.warns(td.TorchDebugWarning) as said, pytest.raises(td.NonFiniteError) as ei:
        # step 1 is read at step 2's forward, step 2's read fails at step 3's forward: blocking from
        # then on, so the NaN of step 4 is caught as the update starts, as without sync="async"
        _loop(model, opt, lambda i: torch.zeros(3, 4) if i == 4 else torch.randn(3, 4), 6, sync="async")
    assert [str(w.message) for w in said] == [
        "torchdebug: sync='async' failed (RuntimeError('a broken read')) and was switched off: the "
        "session reads each step blocking from now on"
    ]
    assert ei.value.anomaly.step == 4 and ei.value.anomaly.location == origin_line("div")
    assert "found_inf" not in vars(opt)


# ------------------------------------------------------------ the parameters, probed on the schedule


def _gate_anomaly(sync: str, fault: str, k: int) -> td.Anomaly:
    """A gate parameter that turns NaN at step k: by its first update (Adam, eps 0, a gradient of
    exactly 0: 0/0), or by a hand edit before the step."""
    from tests.test_locate_optimizer import Gated

    torch.manual_seed(0)
    model = Gated(gate_scale=0.0)
    opt = torch.optim.Adam([p for n, p in model.named_parameters() if n != "gate"], lr=0.01, fused=True)
    with pytest.raises(td.NonFiniteError) as ei, warnings.catch_warnings():
        warnings.simplefilter("ignore", td.TorchDebugWarning)
        with td.watch(model, opt, run=False, sync=sync, config={"log_performance": False}) as mon:
            for i in range(k + 3):
                if i == k and fault == "update":
                    opt.add_param_group({"params": [model.gate], "eps": 0.0})  # unfrozen at step k
                if i == k and fault == "edit":
                    with torch.no_grad():
                        model.gate[1] = float("nan")
                loss = model(torch.randn(2, 4)).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                mon.step()
    return ei.value.anomaly


@pytest.mark.parametrize("k", [3, 9, 10])  # off the detail schedule, its last step, on it (every 10)
@pytest.mark.parametrize("fault", ["update", "edit"])
def test_a_parameter_gone_bad_is_blamed_as_the_blocking_mode_blames_it(fault: str, k: int) -> None:
    # async probes the parameters on the detail schedule only; a step judged a step late uses the
    # ledger as its numbers were staged, before its own update (which on the device only skipped)
    fields = ("phase", "parameter", "module", "op", "kind", "step", "symptom")
    blocking, late = _gate_anomaly("blocking", fault, k), _gate_anomaly("async", fault, k)
    assert [getattr(late, f) for f in fields] == [getattr(blocking, f) for f in fields]
    if fault == "update":
        assert (late.phase, late.parameter, late.step) == ("optimizer", "gate", k)
        assert late.symptom == "nan in parameter gate after the optimizer step"
    else:
        assert (late.phase, late.parameter, late.step) == ("parameter", "gate", k)


def test_async_probes_the_parameters_on_the_detail_schedule_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchdebug.nonfinite.sentinel import Sentinel

    probed: list[int] = []
    real = Sentinel._param_probe

    def counted(self: Any, mon: Any, share: Any = None) -> Any:
        probed.append(mon.global_step)
        return real(self, mon, share)

    monkeypatch.setattr(Sentinel, "_param_probe", counted)
    torch.manual_seed(0)
    model = fx.MLP()
    opt = _fused(model)
    with td.watch(model, opt, run=False, config=SENTINEL_ONLY, sync="async") as mon:
        for _ in range(12):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
    # after updates 0 and 10 (detail_every 10), and at exit (12 steps done) the last update's, once
    assert probed == [0, 10, 12]


# ----------------------------------------------------------------------- the record mon.step() returns


def _late_records(
    sync: str, read: bool, policy: str = "raise", bad: int | None = None
) -> tuple[Any, list[Any]]:
    """5 steps of the MLP (a NaN batch at step ``bad``); mon.step()'s records, read at once or not."""
    torch.manual_seed(0)
    model = fx.MLP()
    opt = _fused(model)
    out: list[Any] = []
    with td.watch(model, opt, run=False, config=SENTINEL_ONLY, sync=sync, policy=policy) as mon:
        for i in range(5):
            x = torch.randn(4, 8)
            if i == bad:
                x[0, 0] = float("nan")
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            rec = mon.step()
            out.append((rec, len(mon.records), rec.loss if read else None, len(mon.records)))
    return mon, out


def test_the_returned_record_gets_its_numbers_when_first_read() -> None:
    _, blocking = _late_records("blocking", read=True)
    mon, late = _late_records("async", read=True)
    assert [(r.step, r.loss, r.grad_norm, r.skipped) for r, *_ in late] == [
        (r.step, r.loss, r.grad_norm, r.skipped) for r, *_ in blocking
    ]
    # step 0 is read blocking (the optimizer has no state yet); from step 1 on mon.step() returns with
    # the step not read yet (mon.records one behind) and reading rec.loss judges it there
    assert [(before, after) for _, before, _, after in late] == [(1, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    assert all(rec == mon.records[rec.step] for rec, *_ in late)
    assert mon._async is not None and mon._async.host_reads == 4  # each step's numbers read once


def test_an_unread_record_waits_for_nothing_and_keeps_no_step_state() -> None:
    mon, late = _late_records("async", read=False)
    assert [(before, after) for _, before, _, after in late] == [(1, 1), (1, 1), (2, 2), (3, 3), (4, 4)]
    kept = [rec._late[1] for rec, *_ in late[1:]]  # the pending steps behind the unread records
    assert all(p.state is None and p.buffers == [] for p in kept)  # judged (at exit at the latest)
    # read after the session ended: the numbers are there, equal to mon.records
    assert [rec.loss for rec, *_ in late] == [r.loss for r in mon.records]


def test_reading_the_record_of_a_nan_step_raises_there() -> None:
    with pytest.raises(td.NonFiniteError) as ei:
        _late_records("async", read=True, bad=3)
    assert (ei.value.anomaly.step, ei.value.anomaly.phase) == (3, "input")
    for policy in ("warn", "skip"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", td.TorchDebugWarning)
            _, late = _late_records("async", read=True, policy=policy, bad=3)
        rec = late[3][0]
        assert rec.skipped and rec.anomaly is not None and rec.anomaly.step == 3


# -------------------------------------------------------------------------------- sync="auto"


def _auto_session(
    monkeypatch: pytest.MonkeyPatch, opts: str = "fused", gpu: bool = True, **kw: Any
) -> tuple[td.Monitor, list[str]]:
    """6 steps under the default sync ("auto") with the device test answering ``gpu``: (the session,
    torchdebug's warnings)."""
    monkeypatch.setattr(deferred, "on_cuda", lambda params: gpu)
    torch.manual_seed(0)
    model = fx.MLP()
    opt = _fused(model) if opts == "fused" else torch.optim.AdamW(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        mon = _loop(model, opt, lambda i: torch.randn(4, 8), 6, **kw)
    return mon, [str(w.message) for w in said if issubclass(w.category, td.TorchDebugWarning)]


def test_auto_reads_late_on_a_gpu_with_a_fused_optimizer_and_says_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mon, said = _auto_session(monkeypatch)
    assert mon.config.sync == "auto" and said == []
    assert mon._async is not None and mon._async.auto
    assert (mon._async.host_reads, mon._async.blocking_reads) == (5, 0)  # steps 1-5 read late
    assert [r.step for r in mon.records] == list(range(6))


def test_auto_stays_blocking_where_reading_late_does_not_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    mon, said = _auto_session(monkeypatch, gpu=False)  # a CPU: nothing to wait for
    assert mon._async is None and said == []
    mon, said = _auto_session(monkeypatch, clip_on_spike=1.0)  # needs the norm before the update
    assert mon._async is None and said == []
    # an optimizer that cannot skip on the device: found at its first update, blocking from then on,
    # said nowhere ("async" says it once)
    mon, said = _auto_session(monkeypatch, opts="plain")
    assert mon._async is None and said == []
    assert [r.step for r in mon.records] == list(range(6)) and all(r.loss is not None for r in mon.records)
    mon, said = _auto_session(monkeypatch, opts="plain", sync="async")
    assert len(said) == 1 and "falls back to the blocking read" in said[0]


def test_auto_names_the_same_origin_as_blocking(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deferred, "on_cuda", lambda params: True)
    auto = _anomaly_of("auto", "div")
    blocking = _anomaly_of("blocking", "div")
    fields = ("phase", "module", "op", "location", "kind", "step", "micro_step")
    assert [getattr(auto, f) for f in fields] == [getattr(blocking, f) for f in fields]
    assert auto.step == 2


def test_auto_goes_blocking_when_a_second_optimizer_is_adopted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deferred, "on_cuda", lambda params: True)
    torch.manual_seed(0)
    model = fx.MLP()
    first, second = list(model.parameters())[:2], list(model.parameters())[2:]
    opt_a = torch.optim.AdamW(first, lr=0.01, fused=True)
    opt_b = torch.optim.AdamW(second, lr=0.01, fused=True)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with td.watch(model, run=False, config=SENTINEL_ONLY) as mon:  # both adopted as they step
            for _ in range(4):
                model(torch.randn(4, 8)).pow(2).mean().backward()
                opt_a.step()
                opt_b.step()
                opt_a.zero_grad()
                opt_b.zero_grad()
                mon.step()
    assert [w for w in said if issubclass(w.category, td.TorchDebugWarning)] == []
    assert mon._async is None and len(mon.optimizers) == 2
    assert [r.step for r in mon.records] == [0, 1, 2, 3] and all(r.loss is not None for r in mon.records)


def test_a_late_record_copies_and_pickles_as_a_plain_record() -> None:
    import pickle

    mon, late = _late_records("async", read=False)
    rec = late[2][0]  # unread: copying it reads it, and the copy holds no session
    for twin in (copy.copy(rec), copy.deepcopy(rec), pickle.loads(pickle.dumps(rec))):
        assert type(twin) is td.StepRecord
        assert (twin.step, twin.loss, twin.grad_norm) == (2, mon.records[2].loss, mon.records[2].grad_norm)
        assert twin == rec == mon.records[2]


def test_auto_reading_late_can_be_switched_to_blocking_live(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deferred, "on_cuda", lambda params: True)
    torch.manual_seed(0)
    model = fx.MLP()
    seen: list[tuple[bool, bool]] = []

    def each(i: int, mon: Any) -> None:
        seen.append((mon._async is not None, mon._async is not None and mon._async.auto))
        if i == 1:
            mon.reconfigure(sync="blocking")  # applied at the end of the next mon.step()
        if i == 3:
            mon.reconfigure(sync="async")  # asked for now: no longer "auto" (it says when it falls back)

    mon = _loop(model, _fused(model), lambda i: torch.randn(4, 8), 6, each)
    assert seen == [(True, True), (True, True), (False, False), (False, False), (True, False), (True, False)]
    assert [r.step for r in mon.records] == list(range(6)) and all(r.loss is not None for r in mon.records)


@pytest.mark.parametrize("policy", ["warn", "raise"])
@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_exception_after_the_step_still_judges_and_records_it(
    tmp_path: Any, policy: str, error: type[BaseException]
) -> None:
    # Ctrl-C (or a crash) right after mon.step() of a NaN step: that step is staged, unread; the exit
    # judges it, so the run folder holds its anomaly and its numbers
    torch.manual_seed(0)
    model = fx.ZeroDivNet()
    opt = _fused(model)
    k = 3
    said = (
        pytest.warns(td.TorchDebugWarning, match="nan born") if policy == "warn" else contextlib.nullcontext()
    )
    with (
        said,
        pytest.raises(error) as ei,
        td.watch(model, opt, config=SENTINEL_ONLY, sync="async", run=tmp_path, policy=policy) as mon,
    ):
        for i in range(6):
            x = torch.zeros(3, 4) if i == k else torch.randn(3, 4)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            mon.step()
            if i == k:
                raise error("stopped by the user")
    assert [a.step for a in mon.anomalies] == [k]
    assert mon.anomalies[0].location == origin_line("div")
    assert [r.step for r in mon.records] == ([0, 1, 2, 3] if policy == "warn" else [0, 1, 2])
    # the user's exception is the one that propagates; under "raise" it carries the diagnosis as a note
    assert str(ei.value) == "stopped by the user"
    notes = getattr(ei.value, "__notes__", [])
    if policy == "raise":
        assert len(notes) == 1
        assert notes[0].startswith("torchdebug: nan born in forward of ZeroDivNet: aten.div at ")
        assert f"(step {k})" in notes[0].splitlines()[0]
    else:
        assert notes == []
    assert "found_inf" not in vars(opt) and mon.closed and not mon._async.pending
    with td.open_run(mon.run_dir) as run:
        assert run.status == "failed"
        assert [a["step"] for a in run.anomalies()] == [k]
        steps = run.series("loss").steps
        assert steps == ([0, 1, 2, 3] if policy == "warn" else [0, 1, 2])


def test_two_fused_optimizers_skip_only_the_bad_step() -> None:
    # watch([G, D], [og, od]) under async: a NaN in D's forward at step k skips both updates of step k
    # on the device; step k + 1 (healthy) trains both models again
    from tests.fixtures.gan_script import Discriminator, Generator, gan_step

    torch.manual_seed(0)
    G, D = Generator(), Discriminator()
    og = torch.optim.AdamW(G.parameters(), lr=1e-3, fused=True)
    od = torch.optim.AdamW(D.parameters(), lr=1e-3, fused=True)
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(5, 6, generator=gen), torch.randn(5, 4, generator=gen)) for _ in range(6)]
    k = 3
    counters: list[tuple[float, float]] = []
    with (
        pytest.warns(td.TorchDebugWarning) as said,
        td.watch([G, D], [og, od], run=False, config=SENTINEL_ONLY, sync="async", policy="skip") as mon,
    ):
        for step, (x, z) in enumerate(data):
            D[1].mode = "forward" if step == k else ""
            gan_step(G, D, og, od, x, z)
            mon.step()
            counters.append((float(og.state[G.main[0].weight]["step"]), float(od.state[D[0].weight]["step"])))
    # AdamW's step counters: +1 per update that ran; step k's two updates were skipped on the device
    assert counters == [(1, 1), (2, 2), (3, 3), (3, 3), (4, 4), (5, 5)]
    assert [r.skipped for r in mon.records] == [i == k for i in range(6)]
    assert [a.step for a in mon.anomalies] == [k]
    skips = [str(w.message) for w in said if "skipped" in str(w.message)]
    assert skips[-1].startswith(f"torchdebug: 1 step skipped by policy='skip' (step {k})")


def test_warn_says_the_update_was_skipped_on_the_device() -> None:
    # blocking warn applies the bad update (the weights take the NaN); async warn cannot stop the
    # fused kernel's skip: the warning says which happened
    torch.manual_seed(0)
    model = fx.ZeroDivNet()
    opt = _fused(model)
    with pytest.warns(td.TorchDebugWarning) as said:
        _loop(
            model,
            opt,
            lambda i: torch.zeros(3, 4) if i == 2 else torch.randn(3, 4),
            4,
            policy="warn",
            sync="async",
        )
    [message] = [str(w.message) for w in said if "nan born" in str(w.message)]
    assert message.endswith(
        "(policy='warn': training goes on; under sync='async' the step's update was skipped on the "
        "device, where the blocking read applies it)"
    )
    assert all(torch.isfinite(p).all() for p in model.parameters())

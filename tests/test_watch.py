"""watch(): the always-on sentinel trips at the right step, replays, applies policies and cleans up."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

import torchdebug as td
from tests.fixtures import models as fx
from tests.fixtures.models import origin_line
from tests.test_locate import CASES as LOCATE_CASES

SENTINEL_ONLY = td.DebugConfig(mode="anomaly_detection")  # isolate the sentinel from health rules


@pytest.fixture(autouse=True)
def _assert_global_state_restored() -> Iterator[None]:
    from torch.amp.grad_scaler import GradScaler
    from torch.optim import optimizer as optim_mod

    before = (
        torch.Tensor.backward,
        torch.autograd.backward,
        GradScaler.step,
        torch.autograd.function.Function.__dict__["apply"],
    )
    yield
    after = (
        torch.Tensor.backward,
        torch.autograd.backward,
        GradScaler.step,
        torch.autograd.function.Function.__dict__["apply"],
    )
    assert after == before, "a global patch was left behind"
    assert not optim_mod._global_optimizer_pre_hooks and not optim_mod._global_optimizer_post_hooks
    assert torch._C._len_torch_function_stack() == 0


def _no_hooks(model: nn.Module) -> bool:
    return all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def _train(
    model: nn.Module,
    batches: Callable[[int], tuple],
    *,
    steps: int,
    before: Callable[[int], None] = lambda i: None,
    loss_fn: Callable = lambda out: out.float().pow(2).mean(),
    **watch_kw: object,
) -> td.Monitor:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watch_kw.setdefault("config", SENTINEL_ONLY)
    with td.watch(model, opt, run=False, **watch_kw) as mon:  # type: ignore[arg-type]
        for i in range(steps):
            before(i)
            out = model(*batches(i))
            loss = loss_fn(out)
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step()
    return mon


def test_forward_nan_at_known_step_names_module_op_and_line() -> None:
    torch.manual_seed(0)
    model = fx.DeepLogNet()

    def before(i: int) -> None:
        if i == 3:
            model.blocks[1].act.shift = -5.0

    with pytest.raises(td.NonFiniteError) as ei:
        _train(model, lambda i: (torch.randn(6, 8),), steps=6, before=before)
    a = ei.value.anomaly
    assert (a.step, a.phase, a.module, a.op, a.location) == (
        3,
        "forward",
        "blocks.1.act",
        "aten.log",
        origin_line("log"),
    )
    assert a.detected_by == "sentinel" and a.hint.startswith("log of negative input")
    assert a.reproducible is True  # the replay made the same NaN
    assert isinstance(ei.value, RuntimeError)
    assert _no_hooks(model)
    # raised in the optimizer's pre-hook: the corrupted gradients never reached the weights
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize(
    ("build", "phase", "module", "op", "tag"),
    [
        pytest.param(fx.SqrtNet, "backward", "norm", "SqrtBackward0", "sqrt", id="backward-sqrt"),
        pytest.param(fx.SharedNet, "forward", "proj", "aten.sqrt", "shared", id="shared-module"),
        pytest.param(fx.InplaceNet, "forward", "", "aten.log_", "inplace", id="inplace"),
        pytest.param(fx.CustomFnNet, "backward", "", "BadGradBackward", "customfn", id="custom-function"),
        pytest.param(
            lambda: fx.CheckpointNet(False), "backward", "inner", "SqrtBackward0", "sqrt", id="checkpoint"
        ),
        pytest.param(
            lambda: fx.CheckpointLogNet(True),
            "forward",
            "inner",
            "aten.log",
            "cklog",
            id="checkpoint-reentrant",
        ),
    ],
)
def test_sentinel_replays_to_the_exact_origin(
    build: Callable[[], nn.Module], phase: str, module: str, op: str, tag: str
) -> None:
    torch.manual_seed(0)
    model = build()
    with pytest.raises(td.NonFiniteError) as ei:
        _train(model, lambda i: (torch.randn(3, 4),), steps=3)
    a = ei.value.anomaly
    assert (a.step, a.phase, a.module, a.op, a.location) == (0, phase, module, op, origin_line(tag))
    assert a.reproducible is True


def test_handwritten_loss_outside_module_is_traced_through_the_loss_tape() -> None:
    torch.manual_seed(0)
    model = fx.MLP()
    with pytest.raises(td.NonFiniteError) as ei:
        _train(model, lambda i: (torch.randn(4, 8),), steps=2, loss_fn=fx.handwritten_loss)
    a = ei.value.anomaly
    assert (a.phase, a.module, a.op, a.location) == ("forward", "", "aten.log", origin_line("loss"))


def test_loss_backward_outside_module_without_tape_uses_output_gradient() -> None:
    torch.manual_seed(0)
    model = fx.SqrtNet()
    cfg = SENTINEL_ONLY.replace(trace_loss=False)
    with pytest.raises(td.NonFiniteError) as ei:
        _train(model, lambda i: (torch.randn(3, 4),), steps=1, config=cfg)
    assert (ei.value.anomaly.phase, ei.value.anomaly.op) == ("backward", "SqrtBackward0")


def test_bad_batch_is_phase_input_and_bad_weight_is_phase_parameter() -> None:
    torch.manual_seed(0)

    def batches(i: int) -> tuple:
        x = torch.randn(2, 8)
        if i == 2:
            x[1, 3] = float("inf")
        return (x,)

    with pytest.raises(td.NonFiniteError) as ei:
        _train(fx.MLP(), batches, steps=4)
    assert (ei.value.anomaly.step, ei.value.anomaly.phase, ei.value.anomaly.kind) == (2, "input", "inf")

    model = fx.MLP()

    def corrupt(i: int) -> None:
        if i == 1:
            with torch.no_grad():
                model.fc1.bias[2] = float("nan")

    with pytest.raises(td.NonFiniteError) as ei:
        _train(model, lambda i: (torch.randn(2, 8),), steps=3, before=corrupt)
    a = ei.value.anomaly
    assert (a.step, a.phase, a.module, a.parameter) == (1, "parameter", "fc1", "fc1.bias")


def test_gradient_accumulation_names_the_micro_step() -> None:
    torch.manual_seed(0)
    model = fx.ZeroDivNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(td.NonFiniteError) as ei, td.watch(model, opt, run=False, config=SENTINEL_ONLY) as mon:
        for step in range(3):
            for micro in range(4):
                x = torch.zeros(2, 4) if (step, micro) == (1, 2) else torch.randn(2, 4)
                (model(x).pow(2).mean() / 4).backward()
            opt.step()
            opt.zero_grad()
            mon.step()
    a = ei.value.anomaly
    assert (a.step, a.micro_step, a.op, a.location) == (1, 2, "aten.div", origin_line("div"))


def test_optimizer_update_that_makes_nan_is_phase_optimizer() -> None:
    model = fx.MLP()
    with torch.no_grad():
        model.fc1.weight.zero_()
    model.fc1.weight.register_hook(lambda g: torch.zeros_like(g))  # Adam with eps=0: 0/(sqrt(0)+0)
    opt = torch.optim.Adam(model.parameters(), lr=0.1, eps=0.0)
    with pytest.raises(td.NonFiniteError) as ei, td.watch(model, opt, run=False, config=SENTINEL_ONLY) as mon:
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
    a = ei.value.anomaly
    assert (a.step, a.phase, a.parameter, a.module) == (0, "optimizer", "fc1.weight", "fc1")


def test_policy_warn_records_and_continues() -> None:
    torch.manual_seed(0)
    model = fx.DeepLogNet()
    model.blocks[0].act.shift = -5.0
    with pytest.warns(td.TorchDebugWarning, match="nan born in forward of blocks.0.act"):
        mon = _train(model, lambda i: (torch.randn(6, 8),), steps=4, policy="warn")
    assert mon.global_step == 4
    assert mon.counters["anomaly_steps"] == 4
    assert mon.anomalies[0].op == "aten.log" and mon.anomalies[0].detected_by == "sentinel"
    assert mon.anomalies[1].detected_by == "sentinel (no replay)"  # only the first is replayed


def test_policy_skip_leaves_parameters_and_optimizer_state_unchanged() -> None:
    torch.manual_seed(0)
    model = fx.MLP()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    records = []
    with (
        pytest.warns(td.TorchDebugWarning, match="skipped by policy") as said,
        td.watch(model, opt, run=False, policy="skip", config=SENTINEL_ONLY) as mon,
    ):
        for i in range(5):
            x = torch.randn(4, 8)
            if i == 2:
                x[0, 0] = float("nan")
                snap = [p.detach().clone() for p in model.parameters()]
                state = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
                steps_before = [int(opt.state[p]["step"]) for p in model.parameters()]
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            if i == 2:
                assert all(torch.equal(a, b) for a, b in zip(snap, model.parameters()))
                assert all(torch.equal(a, opt.state[p]["exp_avg"]) for a, p in zip(state, model.parameters()))
                assert [int(opt.state[p]["step"]) for p in model.parameters()] == steps_before
            records.append(mon.step())
    assert [r.skipped for r in records] == [False, False, True, False, False]
    assert records[2].anomaly is not None and records[2].anomaly.phase == "input"
    assert mon.counters["skipped_steps"] == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # said once when the run of skips starts and once, with its count, when it ends (issue 12.5)
    assert [str(w.message)[:37] for w in said] == [
        "torchdebug: step 2 skipped by policy:",
        "torchdebug: 1 step skipped by policy=",
    ]
    assert str(said[1].message).endswith("(step 2); training resumed at step 3")


def test_gradscaler_overflow_is_a_skipped_step_not_an_anomaly() -> None:
    torch.manual_seed(0)
    model = fx.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler(
        "cpu", init_scale=2.0**30
    )  # the fp16 backward overflows until the scale has halved enough
    records = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with td.watch(model, opt, run=False, config=SENTINEL_ONLY) as mon:  # scaler detected via scaler.step
            for _ in range(20):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(torch.randn(4, 8)).float().pow(2).mean()
                opt.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                records.append(mon.step())
    assert mon.scaler is scaler
    assert not mon.anomalies
    assert records[0].skipped and "GradScaler" in records[0].skip_reason
    assert records[0].scale == 2.0**30 and records[1].scale == 2.0**29  # backoff factor 0.5
    assert not records[-1].skipped
    assert records[-1].loss is not None and abs(records[-1].loss) < 10  # unscaled loss


def test_healthy_runs_raise_nothing() -> None:
    torch.manual_seed(0)
    model = fx.TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with td.watch(model, opt, run=False) as mon:
            for i in range(4):
                idx = torch.randint(0, 16, (2, 6))
                ctx = (
                    torch.autocast("cpu", dtype=torch.bfloat16)
                    if i % 2
                    else torch.autocast("cpu", enabled=False)
                )
                with ctx:
                    logits = model(idx)
                loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), idx.flatten())
                opt.zero_grad()
                loss.backward()
                opt.step()
                rec = mon.step()
    assert not mon.anomalies and rec.loss is not None and rec.grad_norm is not None and rec.grad_norm > 0
    assert _no_hooks(model)


def test_hooks_and_patches_removed_on_user_exception() -> None:
    model = fx.MLP()
    with pytest.raises(KeyError), td.watch(model, run=False):
        model(torch.randn(2, 8)).sum().backward()
        raise KeyError("user bug")
    assert _no_hooks(model)


def test_anomaly_is_recorded_in_the_run_store(tmp_path: object) -> None:
    torch.manual_seed(0)
    model = fx.ZeroDivNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(td.NonFiniteError), td.watch(model, opt, run=tmp_path) as mon:
        for i in range(3):
            x = torch.zeros(2, 4) if i == 1 else torch.randn(2, 4)
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
    run = td.open_run(mon.run_dir)
    (a,) = run.anomalies()
    assert (a["step"], a["op"], a["location"]) == (1, "aten.div", origin_line("div"))
    assert run.status == "failed"
    assert [s for s in run.series("loss").steps] == [0]


def test_bad_arguments_are_rejected_with_the_fix() -> None:
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
        td.watch("model")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="raise, warn, skip"):
        td.watch(fx.MLP(), policy="explode")
    with pytest.raises(TypeError, match="optimizer"):
        td.watch(fx.MLP(), optimizer=[1])  # type: ignore[arg-type]
    mon = td.watch(fx.MLP(), run=False)
    with pytest.raises(RuntimeError, match="outside its"):
        mon.step()


def test_failing_instrument_is_switched_off_with_a_warning() -> None:
    class Broken:
        name = "broken"

        def on_backward_end(self, mon: td.Monitor) -> None:
            raise ZeroDivisionError("oops")

    model = fx.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = td.watch(model, opt, run=False, config=SENTINEL_ONLY)
    mon.instruments.append(Broken())
    with pytest.warns(td.TorchDebugWarning, match="instrument 'broken' failed and was switched off"), mon:
        for _ in range(3):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
    assert mon.global_step == 3 and not any(isinstance(i, Broken) for i in mon.instruments)


def test_run_step_retry_half_equals_full_batch_gradients() -> None:
    torch.manual_seed(0)
    model = fx.MLP()
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    torch.nn.functional.mse_loss(model(x), y).backward()
    full = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()

    def step_fn(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        bx, by = batch
        if bx.shape[0] > 4:  # pretend 8 samples do not fit
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        loss = torch.nn.functional.mse_loss(model(bx), by)
        loss.backward()
        return loss

    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with (
        pytest.warns(td.TorchDebugWarning, match="oom_retry"),
        td.watch(model, opt, run=False, on_oom="retry_half", config=SENTINEL_ONLY) as mon,
    ):
        mon.run_step(step_fn, (x, y))
        for p, g in zip(model.parameters(), full):
            torch.testing.assert_close(p.grad, g)
        opt.step()
        rec = mon.step()
    assert [e.kind for e in mon.events] == ["oom_retry"] and rec.micro_steps == 2


@pytest.mark.parametrize("name", list(LOCATE_CASES))
def test_watch_finds_every_fault_case_at_its_step(name: str) -> None:
    # cases with a breaker are healthy at step 0 and broken from step 1; the others from step 0
    torch.manual_seed(0)
    case = LOCATE_CASES[name]
    model = case.build()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the weights stay as built
    expected_step = 1 if case.breaker else 0
    with pytest.raises(td.NonFiniteError) as ei, td.watch(model, opt, run=False, config=SENTINEL_ONLY) as mon:
        for i in range(3):
            if i == 1 and case.breaker:
                case.breaker(model)
            inp = case.inputs()
            loss = case.loss(model(*inp), inp)
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step()
    a = ei.value.anomaly
    expected = (expected_step, case.phase, case.module, case.op, case.kind)
    assert (a.step, a.phase, a.module, a.op, a.kind) == expected, str(a)
    assert a.location == (origin_line(case.tag) if case.tag else None)


def test_two_optimizers_share_one_transfer_and_both_are_guarded() -> None:
    torch.manual_seed(0)
    model = fx.MLP()
    opt1 = torch.optim.SGD(model.fc1.parameters(), lr=0.01)
    opt2 = torch.optim.SGD(model.fc2.parameters(), lr=0.01)
    with pytest.raises(td.NonFiniteError) as ei, td.watch(model, run=False, config=SENTINEL_ONLY) as mon:
        for i in range(3):
            x = torch.randn(2, 8)
            if i == 2:
                x[0, 0] = float("nan")
            model(x).sum().backward()
            opt1.step()  # both optimizers are adopted: they step this model's parameters
            opt2.step()
            opt1.zero_grad()
            opt2.zero_grad()
            mon.step()
    assert (ei.value.anomaly.step, ei.value.anomaly.phase) == (2, "input")
    assert all(torch.isfinite(p).all() for p in model.parameters())  # raised before opt1 updated anything


def test_parameter_whose_sum_overflows_is_not_an_anomaly() -> None:
    # The CPU probe after the update is a float32 sum per parameter: 2 x 3e38 overflows to inf although
    # every element is finite. The exact check on flagged parameters clears it.
    model = fx.MLP()
    with torch.no_grad():
        model.fc1.weight[0, :2] = 3e38
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # fc1 is watched but unused by the forward below
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with td.watch(model, opt, run=False, config=SENTINEL_ONLY) as mon:
            for _ in range(3):
                model.fc2(torch.randn(2, 16)).sum().backward()
                opt.step()
                opt.zero_grad()
                mon.step()
    assert not mon.anomalies
    from torchdebug._tensors import finite_probe as _finite_probe

    assert (
        _finite_probe([model.fc1.weight]).isinf().all()
    )  # the probe did flag it: the exact check cleared it


def test_sentinel_only_gradient_probe_overflow_is_not_an_anomaly() -> None:
    # sentinel-only mode probes gradients with a float32 sum: 8 gradients of 1e38 sum to inf (8e38 >
    # 3.4e38) although each is finite; the exact check clears it, and no grad_norm is reported
    class Scale(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = torch.nn.Parameter(torch.ones(8))

        def forward(self, c: torch.Tensor) -> torch.Tensor:
            return ((self.p - 1.0) * c).sum()  # 0 at p = 1, while each gradient is c = 1e38

    model = Scale()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with td.watch(model, opt, run=False, config=SENTINEL_ONLY) as mon:
            for _ in range(2):
                model(torch.full((8,), 1e38)).backward()
                opt.step()
                opt.zero_grad()
                rec = mon.step()
    assert not mon.anomalies and rec.grad_norm is None and rec.values["grad_nonfinite"] == 0.0


def test_unwritable_run_folder_warns_and_training_goes_on(tmp_path: object) -> None:
    import pathlib

    blocker = pathlib.Path(str(tmp_path)) / "not-a-folder"
    blocker.write_text("a file where the runs folder should be")
    model = fx.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with (
        pytest.warns(td.TorchDebugWarning, match="recording is off for this session"),
        td.watch(model, opt, run=blocker, config=SENTINEL_ONLY) as mon,
    ):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        mon.step()
    assert mon.writer is None and mon.run_dir is None and mon.global_step == 1


def test_instrument_whose_constructor_fails_is_the_only_one_switched_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torchdebug.perf import timing

    def boom(self: object) -> None:
        raise RuntimeError("cannot build")

    monkeypatch.setattr(timing.TimingInstrument, "__init__", boom)
    model = fx.MLP()
    cfg = td.DebugConfig(mode="full_debug", level="basic")
    with (
        pytest.warns(td.TorchDebugWarning, match="instrument 'timing' failed and was switched off"),
        td.watch(model, run=False, config=cfg) as mon,
    ):
        names = sorted(type(i).__name__ for i in mon.instruments)
    assert names == ["GradientHealth", "MemoryInstrument", "SpikeGuard"]  # the loss-spike guard (on_spike)


def test_loss_tape_under_a_user_mode_is_lifted_out_at_exit() -> None:
    from torch.overrides import TorchFunctionMode

    class UserMode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    model = fx.MLP()
    user = UserMode()
    with td.watch(model, run=False, config=SENTINEL_ONLY):
        model(torch.randn(2, 8))  # the loss tape is pushed after the forward
        user.__enter__()  # the user pushes a mode on top and keeps it past the session
    assert torch._C._len_torch_function_stack() == 1
    from torch.overrides import _get_current_function_mode

    assert _get_current_function_mode() is user
    user.__exit__(None, None, None)


def test_gradient_norm_overflow_is_confirmed_and_reported_exactly() -> None:
    # 8 gradients of 1e20: their float32 squares (1e40) overflow, so the fast norm reads inf. The
    # exact check finds them finite and the norm is recomputed in float64: 1e20 * sqrt(8).
    class Scale(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = torch.nn.Parameter(torch.ones(8))

        def forward(self, c: torch.Tensor) -> torch.Tensor:
            return ((self.p - 1.0) * c).sum()

    model = Scale()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    cfg = td.DebugConfig(mode="gradient_checking", level="basic", explode_abs=1e30)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with td.watch(model, opt, run=False, config=cfg) as mon:
            model(torch.full((8,), 1e20)).backward()
            expected = float(torch.linalg.vector_norm(model.p.grad.double()))  # type: ignore[union-attr]
            opt.step()
            opt.zero_grad()
            rec = mon.step()
    assert not mon.anomalies and rec.values["grad_nonfinite"] == 0.0
    assert rec.grad_norm == pytest.approx(expected, rel=1e-12) and expected == pytest.approx(
        1e20 * 8**0.5, rel=1e-6
    )


def test_numbers_collected_after_the_update_are_read_like_the_first_transfer() -> None:
    # an instrument collecting after the optimizer step (a detail step) hands a 2-element tensor and a
    # plain float: the second transfer names them like the first one does (name#0, name#1)
    class AfterUpdate:
        name = "after"

        def __init__(self) -> None:
            self.pending: dict[str, object] = {}

        def after_optimizer_step(self, mon: td.Monitor) -> None:
            self.pending = {"pair": torch.tensor([1.5, 2.5]), "plain": 3}

        def collect(self, mon: td.Monitor) -> dict[str, object]:
            out, self.pending = self.pending, {}
            return out

    model = fx.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = td.watch(model, opt, run=False, config=SENTINEL_ONLY)
    mon.instruments.append(AfterUpdate())
    with mon:
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        rec = mon.step()
    assert (rec.values["pair#0"], rec.values["pair#1"], rec.values["plain"]) == (1.5, 2.5, 3.0)


def test_exit_restores_everything_when_a_warning_at_exit_is_an_error(tmp_path) -> None:
    # policy="skip" says a run of skipped steps when it ends; here the run ends at exit, and the user's
    # filter turns that warning into an error: the session must still take everything off
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the episode's start is said during the step
        mon = td.watch(model, opt, policy="skip", run=tmp_path)
        mon.__enter__()
        x = torch.randn(2, 4)
        x[0, 0] = float("nan")
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        mon.step()
    assert mon.counters["skipped_steps"] == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", td.TorchDebugWarning)
        with pytest.raises(td.TorchDebugWarning, match=r"1 step skipped by policy='skip' \(step 0\)"):
            mon.__exit__(None, None, None)
    assert _no_hooks(model)  # the module hooks; the autouse fixture checks the global patches and hooks
    assert nn.Module.__getstate__ is not None and not getattr(
        nn.Module.__getstate__, "__torchdebug_wrapper__", False
    )


def test_a_later_nan_that_is_not_replayed_names_no_birthplace() -> None:
    # a NaN in the batch at steps 2 and 5 under skip: the first is replayed and named as the input;
    # the second is not replayed, so the summary must not say where it was born
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.TorchDebugWarning)
        with td.watch(m, opt, policy="skip", run=False) as mon:
            for step in range(7):
                x, y = torch.randn(16, 4), torch.randn(16, 1)
                if step in (2, 5):
                    x[3, 1] = float("nan")
                loss = nn.functional.mse_loss(m(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                mon.step()
    first, second = mon.anomalies
    assert first.summary() == "nan born in input of Sequential (step 2)"
    assert second.detected_by == "sentinel (no replay)"
    assert (
        second.summary()
        == "nan in the forward, origin not traced: non-finite loss (+3 more parameters) (step 5)"
    )

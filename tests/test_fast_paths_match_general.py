"""The per-step fast paths give exactly what the general paths they skip would give."""

from __future__ import annotations

import math
import types

import pytest
import torch

from torchdebug.perf.timing import SlowdownRule, StepTiming, batch_size_and_tokens
from torchdebug.store import create_run, open_run
from torchdebug.store.writer import _numbers_dict, _plain_floats

RESERVED = ("wall_time", "total")


@pytest.mark.parametrize(
    "values",
    [
        {"data": 0.0, "forward": 0.25, "backward": 0.5, "optimizer": 0.125, "other": 1e-9, "step": 1.0},
        {"step": math.inf, "x": math.nan, "y": -0.0},
        {},
    ],
    ids=["phases", "nonfinite", "empty"],
)
def test_plain_floats_is_numbers_dict_on_plain_dicts(values: dict[str, float]) -> None:
    fast = _plain_floats(values, RESERVED)
    assert fast is not None
    slow = _numbers_dict(values, "seconds", ints=False, reserved=RESERVED)
    assert [(k, repr(v), type(v)) for k, v in fast] == [(k, repr(v), type(v)) for k, v in slow]


@pytest.mark.parametrize(
    "values",
    [
        {"step": 1},  # an int: converted by the general path
        {"step": True},
        {"total": 1.0},  # reserved: the general path raises
        {1: 1.0},  # a non-str key: the general path raises
        {"step": torch.tensor(1.0)},  # a tensor: the general path raises naming .item()
        types.MappingProxyType({"step": 1.0}),  # a Mapping that is not a dict
    ],
    ids=["int", "bool", "reserved", "int-key", "tensor", "mappingproxy"],
)
def test_plain_floats_leaves_everything_else_to_numbers_dict(values: object) -> None:
    assert _plain_floats(values, RESERVED) is None


def test_log_timing_fast_and_general_paths_store_the_same(tmp_path: object) -> None:
    w = create_run(str(tmp_path), "t", {})
    w.log_timing(0, {"forward": 0.25, "backward": 0.5, "step": 1.0})  # fast path
    w.log_timing(1, {"forward": 0.25, "backward": 0.5, "step": 1})  # an int: general path
    w.log_timing(2, types.MappingProxyType({"forward": 0.25, "step": 1.0}))
    with pytest.raises(ValueError, match="may not have a key 'total'"):
        w.log_timing(3, {"step": 1.0, "total": 2.0})
    w.close()
    with open_run(w.path) as run:
        got = [{k: v for k, v in t.items() if k != "wall_time"} for t in run.timings()]
    assert got == [
        {"step": 0, "forward": 0.25, "backward": 0.5, "total": 1.0},
        {"step": 1, "forward": 0.25, "backward": 0.5, "total": 1.0},
        {"step": 2, "forward": 0.25, "total": 1.0},
    ]


def _batch_size_and_tokens_walk(args: object, kwargs: object = None) -> tuple[int | None, int | None]:
    """The general path (every tensor leaf walked) that the first-argument fast path skips."""
    from torchdebug._trees import tensor_leaves

    for t in tensor_leaves((args, kwargs or {})):
        if t.dim() == 0:
            continue
        b = int(t.shape[0])
        tok = (
            b * int(t.shape[1]) if t.dim() == 2 and not t.is_floating_point() and not t.is_complex() else None
        )
        return b, tok
    return None, None


@pytest.mark.parametrize(
    ("args", "kwargs", "expected"),
    [
        ((torch.zeros(4, 7, dtype=torch.long),), {}, (4, 28)),  # tokens: 4 * 7
        ((torch.zeros(4, 7),), {}, (4, None)),  # float: no tokens
        ((torch.zeros(4, 7, dtype=torch.complex64),), {}, (4, None)),
        ((torch.zeros(3, 2, 5),), {}, (3, None)),
        ((torch.tensor(1.0), torch.zeros(5, 2, dtype=torch.int32)), {}, (5, 10)),  # a 0-dim first argument
        (([torch.zeros(6, 1)],), {}, (6, None)),  # nested
        ((), {"x": torch.zeros(2, 3, dtype=torch.long)}, (2, 6)),  # keyword only
        ((1, torch.zeros(8, 2)), {}, (8, None)),  # a non-tensor first argument
        ((), {}, (None, None)),
    ],
    ids=["tokens", "float", "complex", "3d", "scalar-first", "nested", "kwargs", "int-first", "none"],
)
def test_batch_size_and_tokens_fast_path(args: tuple, kwargs: dict, expected: tuple) -> None:
    assert batch_size_and_tokens(args, kwargs) == expected == _batch_size_and_tokens_walk(args, kwargs)


def _fast(s: int, forward: float = 0.010) -> StepTiming:
    # data 0 (an int, kept as a float), forward, backward 20 ms, optimizer 4 ms, other 1 ms; total 35 ms
    return StepTiming(s, 0, forward, 0.020, 0.004, 0.001, 0.035)


def _slow(s: int) -> StepTiming:
    return StepTiming(s, 0, 0.050, 0.020, 0.004, 0.001, 0.075)  # forward 10 -> 50 ms: total 75 ms


@pytest.mark.parametrize(
    ("min_duration_s", "fires_at"),
    [(0.0, 9), (0.1, 10)],  # 0.1 s: step 9 gives 75 ms of slow steps, step 10 brings it to 150 ms
    ids=["at-once", "sustained-0.1s"],
)
def test_slowdown_rule_names_the_phase_against_its_finite_baseline(
    min_duration_s: float, fires_at: int
) -> None:
    """recent=3, min_baseline=5: a step joins the baseline when it leaves the recent window, so after
    step s (>= 3) the baseline holds steps 0..s-3. Steps 0..7 are fast (step 1's forward NaN: the phase
    baseline drops it), steps 8..11 slow, 12.. fast again."""
    rule = SlowdownRule(recent=3, min_baseline=5, min_duration_s=min_duration_s)
    steps = [_fast(0), _fast(1, forward=math.nan), *(_fast(s) for s in range(2, 8))]
    steps += [_slow(s) for s in range(8, 12)] + [_fast(s) for s in range(12, 16)]
    events = {t.step: rule.update(t) for t in steps}
    assert {s: [e.kind for e in ev] for s, ev in events.items() if ev} == {
        fires_at: ["slowdown"],
        13: ["slowdown_end"],  # recent (11, 12, 13): two fast steps, median 35 ms
    }
    (start,) = events[fires_at]
    # the median of (7, 8, 9) or (8, 9, 10) is 75 ms; the baseline (steps 0..6, all 35 ms) has MAD 0, so
    # slow = 75 > 1.5 x 35 = 52.5 and 75 - 35 = 40 ms >= max(2 ms, 5 x 0); the median turned at step 9,
    # about recent // 2 = 1 step after it started: since step 8
    assert start.message == (
        "steps got slower since about step 8: median step time 75.0 ms over the last 3 steps, 2.1x the "
        "median 35.0 ms before; forward grew most (10.0 -> 50.0 ms)"
    )
    grown = {k: start.evidence[f"{k}_grown_s"] for k in ("data", "forward", "backward", "optimizer", "other")}
    # forward: the recent median 50 ms minus the median of the six finite baseline forwards, 10 ms
    assert grown == {
        "data": 0.0,
        "forward": pytest.approx(0.040, abs=1e-15),
        "backward": 0.0,
        "optimizer": 0.0,
        "other": 0.0,
    }
    assert (start.evidence["step_s"], start.evidence["median_s"], start.evidence["since"]) == (
        0.075,
        0.035,
        8,
    )
    (end,) = events[13]
    # the baseline stays frozen through the episode: still 35 ms; 13 - 8 = 5 steps
    assert end.message == "step time back to 35.0 ms (median 35.0 ms before) after a slowdown of 5 steps"
    assert end.evidence == {"since": 8, "steps": 5, "step_s": 0.035, "median_s": 0.035}
    assert (rule.count, rule.start, len(rule.baseline)) == (1, None, 7 + 2)  # steps 0..6, then 11 and 12


# -- the monitor's per-step plumbing ---------------------------------------------------------------


def test_each_switches_a_failing_instrument_off_once_and_keeps_the_others() -> None:
    import warnings

    import torchdebug as td
    from tests.fixtures import models as fx

    calls: list[str] = []

    class Broken:
        name = "broken"

        def on_backward_end(self, mon: td.Monitor) -> None:
            calls.append("broken")
            raise ZeroDivisionError("oops")

    class Fine:
        name = "fine"
        on_forward_end = None  # an attribute set to None is "no such method", as before

        def on_backward_end(self, mon: td.Monitor) -> None:
            calls.append("fine")

    model = fx.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = td.watch(model, opt, run=False, config=td.DebugConfig(mode="anomaly_detection"))
    mon.instruments += [Broken(), Fine()]
    with warnings.catch_warnings(record=True) as record, mon:
        warnings.simplefilter("always")
        for _ in range(3):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
    off = [w for w in record if "switched off" in str(w.message)]
    assert [str(w.message) for w in off] == [
        "torchdebug: instrument 'broken' failed and was switched off: ZeroDivisionError('oops')"
    ]
    assert off[0].filename == __file__  # the user's line (the mon.step() call), not the monitor's
    assert calls == ["broken", "fine", "fine", "fine"]  # after it: the others still run, in order


def test_owns_optimizer_shortcut_and_wrapped_optimizers() -> None:
    import torchdebug as td
    from tests.fixtures import models as fx

    model = fx.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD(fx.MLP().parameters(), lr=0.1)
    wrapper = types.SimpleNamespace(_optimizer=opt)  # LightningOptimizer keeps the optimizer here
    mon = td.watch(model, opt, run=False)
    assert mon.owns_optimizer(opt) and mon.owns_optimizer(wrapper)
    assert not mon.owns_optimizer(other) and not mon.owns_optimizer(None)
    adopted = td.watch(model, None, run=False)  # no optimizer: the first one of its parameters
    assert adopted.owns_optimizer(opt) and not adopted.owns_optimizer(other)
    assert not adopted.owns_optimizer(None)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((torch.zeros(4, 7),), {}),
        ((torch.tensor(1.0), torch.zeros(2)), {}),  # a 0-dim first argument is the first leaf too
        (([torch.zeros(6, 1)],), {}),
        ((), {"x": torch.zeros(2, 3)}),
        ((1, torch.zeros(8, 2)), {}),
        ((), {}),
    ],
    ids=["tensor", "scalar-first", "nested", "kwargs", "int-first", "none"],
)
def test_memory_first_shape_fast_path(args: tuple, kwargs: dict) -> None:
    from torchdebug._trees import tensor_leaves
    from torchdebug.memory.instrument import _first_shape

    leaves = tensor_leaves((args, kwargs))
    assert _first_shape(args, kwargs) == (tuple(leaves[0].shape) if leaves else None)

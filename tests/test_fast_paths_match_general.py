"""The per-step fast paths give exactly what the general paths they skip would give."""

from __future__ import annotations

import math
import random
import types
from typing import Any

import pytest
import torch

from torchdebug._robust import RunningMedian
from torchdebug.events import RuleEvent
from torchdebug.perf.timing import _RULE_PHASES, SlowdownRule, StepTiming, _median, batch_size_and_tokens
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


class _OldSlowdownRule(SlowdownRule):
    """The rule as it was: a RunningMedian per phase, pushed every step (the reference)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._phases = {k: RunningMedian(100) for k in _RULE_PHASES}  # type: ignore[misc]

    def update(self, t: StepTiming) -> list[RuleEvent]:
        """Feed one step's timing; the episode's start or end event, or nothing."""
        if len(self.recent) == self.recent.maxlen and self.start is None and self._pending is None:
            old = self.recent[0]  # leaves the recent window: part of the normal from now on
            self.baseline.push(old.total)
            for k, m in self._phases.items():
                m.push(getattr(old, k))
        self.recent.append(t)
        if len(self.recent) < (self.recent.maxlen or 1) or len(self.baseline) < self.min_baseline:
            return []
        med = _median([r.total for r in self.recent])
        base = self.baseline.median()
        sigma = self.baseline.sigma()
        slow = med > self.factor * base and med - base >= max(self.min_s, self.mads * sigma)
        if slow and self.start is None:
            turned, slow_s = self._pending or (t.step, 0.0)
            slow_s += t.total
            if slow_s < self.min_duration_s:  # sustained in time too: a burst of machine load is not
                self._pending = (turned, slow_s)
                return []
            self._pending = None
            self.start = turned - len(self.recent) // 2  # the median turned: about half the window ago
            self.count += 1
            grown = {
                k: _median([getattr(r, k) for r in self.recent]) - m.median() for k, m in self._phases.items()
            }
            phase = max(grown, key=lambda k: grown[k])
            now = _median([getattr(r, phase) for r in self.recent])
            return [
                RuleEvent(
                    kind="slowdown",
                    step=t.step,
                    message=(
                        f"steps got slower since about step {self.start}: median step time "
                        f"{med * 1e3:.1f} ms over the last {len(self.recent)} steps, {med / base:.1f}x the "
                        f"median {base * 1e3:.1f} ms before; {phase} grew most "
                        f"({(now - grown[phase]) * 1e3:.1f} -> {now * 1e3:.1f} ms)"
                    ),
                    evidence={
                        "step_s": med,
                        "median_s": base,
                        "factor": self.factor,
                        "phase": phase,
                        "since": self.start,
                        **{f"{k}_grown_s": v for k, v in grown.items()},
                        **t.as_log(),
                    },
                )
            ]
        if not slow:
            self._pending = None
        if not slow and self.start is not None:
            start, self.start = self.start, None
            return [
                RuleEvent(
                    kind="slowdown_end",
                    step=t.step,
                    message=f"step time back to normal ({med * 1e3:.1f} ms) after a slowdown of {t.step - start} steps",
                    severity="info",
                    evidence={"since": start, "steps": t.step - start, "step_s": med, "median_s": base},
                )
            ]
        return []


def _timings(rng: random.Random, n: int) -> list[StepTiming]:
    """Jittery steps with one slowdown episode (forward 4x for 20-80 steps) and now and then a
    non-finite or int phase value (the phase windows drop NaN/Inf and keep floats)."""
    out = []
    slow_from = rng.randint(40, n - 100)
    slow_to = slow_from + rng.randint(20, 80)
    for s in range(n):
        k = 4.0 if slow_from <= s < slow_to else 1.0
        ph: list[Any] = [
            rng.choice([0, 0.0, 0.002 * rng.random()]),
            0.02 * (0.5 + 0.5 * rng.random()) * k,
            0.03 * (0.5 + 0.5 * rng.random()),
            0.004,
            0.001 * rng.random(),
        ]
        if rng.random() < 0.03:
            ph[rng.randrange(5)] = rng.choice([math.nan, math.inf])
        total = sum(x for x in ph if math.isfinite(x)) + 0.001 * rng.random()
        out.append(StepTiming(s, *ph, total))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_slowdown_rule_events_equal_the_running_median_version(seed: int) -> None:
    rng = random.Random(seed)
    kw = {
        "recent": rng.choice([1, 3, 9]),
        "min_baseline": rng.choice([0, 5, 10]),
        "min_duration_s": rng.choice([0.0, 0.05]),
    }
    new, old = SlowdownRule(**kw), _OldSlowdownRule(**kw)
    fired = 0
    for t in _timings(rng, 400):
        a, b = new.update(t), old.update(t)
        assert [repr(e) for e in a] == [repr(e) for e in b]
        fired += len(a)
    assert (new.count, new.start) == (old.count, old.start)
    assert fired >= 1  # the episode was seen (its start, and its end unless it runs to the last step)


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

"""The leak test's Theil–Sen slope in float64 tensor operations: the same bits as the Python loop."""

from __future__ import annotations

import itertools
import math
import random
import struct

import pytest

from torchdebug.memory import instrument as mi
from torchdebug.memory.instrument import LeakDetector, Trend, theil_sen_slope


def _loop(xs: list, ys: list) -> float:
    """The Python loop (the reference): the median of the pairwise slopes after list.sort()."""
    x, y = list(xs), list(ys)
    slopes = [
        (y[j] - y[i]) / (x[j] - x[i]) for i in range(len(x)) for j in range(i + 1, len(x)) if x[j] != x[i]
    ]
    if not slopes:
        return math.nan
    slopes.sort()
    n = len(slopes)
    return slopes[n // 2] if n % 2 else 0.5 * (slopes[n // 2 - 1] + slopes[n // 2])


def _bits(v: float) -> bytes:
    return struct.pack("<d", v)


def _case(rng: random.Random, kind: str) -> tuple[list, list]:
    n = rng.randint(8, 60)
    x: list = list(range(0, 4 * n, 4))  # the leak test's steps
    if kind == "leak":  # bytes growing by ~64 KiB a step with allocator noise, as floats
        y: list = [float(1e9 + 65536 * s + rng.randint(-4096, 4096) * 16) for s in x]
    elif kind == "flat":  # mostly equal: many zero slopes
        y = [float(rng.choice([1e9, 1e9, 1e9 + 4096])) for _ in x]
    elif kind == "ints":  # ints, as a caller may pass them
        y = [rng.randint(0, 2**40) for _ in x]
    elif kind == "shuffled":  # x not increasing: negative differences, 0 / -dx = -0.0
        rng.shuffle(x)
        y = [float(rng.choice([5.0, 5.0, 7.0])) for _ in x]
    elif kind == "floats":
        x = [rng.uniform(-1e3, 1e3) for _ in range(n)]
        y = [rng.gauss(0, 1) * 10 ** rng.randint(-300, 300) for _ in range(n)]
    elif kind == "jump":  # a one-off jump: the slope stays the trend's
        y = [float(1e6 + 10 * s + (1e9 if s > x[n // 2] else 0)) for s in x]
    else:
        raise AssertionError(kind)
    return x, y


KINDS = ["leak", "flat", "ints", "shuffled", "floats", "jump"]


@pytest.mark.parametrize("kind", KINDS)
def test_theil_sen_float64_equals_the_loop(kind: str) -> None:
    rng = random.Random(kind)
    for _ in range(80):
        x, y = _case(rng, kind)
        assert mi._exact_in_float64(x) and mi._exact_in_float64(y) and len(set(x)) == len(x)
        got = mi._theil_sen_float64(x, y)  # the vectorised path itself
        assert _bits(got) == _bits(_loop(x, y)), (x, y)
        assert _bits(theil_sen_slope(x, y)) == _bits(got)


@pytest.mark.parametrize(
    ("x", "y"),
    [
        (list(range(10)), [0.0] * 5 + [math.nan] * 5),  # NaN: the loop
        (list(range(10)), [0.0] * 9 + [math.inf]),
        ([0, 1, 1, 2, 3, 4, 5, 6, 7, 8], [float(v) for v in range(10)]),  # a repeated x: pairs skipped
        (list(range(10)), [2**60 + v for v in range(10)]),  # ints beyond float64's exact range
        (list(range(5)), [0.0, 2.0, 4.0, 6.0, 1000.0]),  # few points
    ],
    ids=["nan", "inf", "repeated-x", "big-ints", "short"],
)
def test_theil_sen_other_inputs_take_the_loop(x: list, y: list) -> None:
    assert _bits(theil_sen_slope(x, y)) == _bits(_loop(x, y))


def test_signed_zero_median_keeps_the_loops_sign() -> None:
    # x decreasing: every dy = 0 slope is 0 / negative = -0.0; mixed with +0.0 from increasing pairs
    for seed in range(50):
        rng = random.Random(seed)
        x = list(range(12))
        rng.shuffle(x)
        y = [1.0] * 12
        assert _bits(theil_sen_slope(x, y)) == _bits(_loop(x, y))


class _LoopDetector(LeakDetector):
    """The detector as it was: the full trend (both slopes by the loop) for every candidate series."""

    def add(self, step: int, sample: dict) -> list[Trend]:
        self._seen += 1
        self.checked = set()
        if self._seen <= self.warmup:
            return []
        self._steps.append(step)
        for name in self.SERIES:
            if name in sample:
                self._values.setdefault(name, __import__("collections").deque(maxlen=self.window)).append(
                    float(sample[name])
                )
        if len(self._steps) < self.window:
            return []
        steps = list(self._steps)
        out = []
        for name, vals in self._values.items():
            if len(vals) < self.window:
                continue
            v = list(vals)
            self.checked.add(name)
            inc = sum(1 for a, b in itertools.pairwise(v) if b > a) / (len(v) - 1)
            if inc < self.min_increasing or v[-1] <= v[0]:
                continue
            slope = _loop(steps, v)
            if slope >= self.min_bytes_per_step:
                half = len(steps) // 2
                out.append(
                    Trend(
                        series=name,
                        slope=slope,
                        recent_slope=_loop(steps[half:], v[half:]),
                        increasing_fraction=inc,
                        growth=float(v[-1] - v[0]),
                        samples=len(v),
                        first_step=steps[0],
                        last_step=steps[-1],
                    )
                )
        return out


@pytest.mark.parametrize("seed", range(6))
def test_leak_detector_suspects_equal_the_loop_version(seed: int) -> None:
    rng = random.Random(seed)
    new, old = LeakDetector(window=50, warmup=5), _LoopDetector(window=50, warmup=5)
    heap, rss, found = 1e9, 2e9, 0
    leak_from = rng.randint(100, 300)
    for s in range(0, 4 * 600, 4):
        heap += rng.randint(-200_000, 210_000) + (300_000 if s >= 4 * leak_from else 0)
        rss += rng.choice([0, 0, 4096, -4096, 65536])
        sample = {"heap_in_use": int(heap), "rss": int(rss)}
        a, b = new.add(s, sample), old.add(s, sample)
        assert [repr(t) for t in a] == [repr(t) for t in b]
        assert new.checked == old.checked
        found += len(a)
    assert found > 0  # the leak was seen

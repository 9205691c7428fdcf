"""The leak test's Theil–Sen slope in float64 tensor operations gives the same bits as the textbook
loop over the pairwise slopes; the detector's verdicts on short series, worked out by hand."""

from __future__ import annotations

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


def _detector_on(heap: list[int]) -> tuple[LeakDetector, list[list[Trend]]]:
    d = LeakDetector(window=5, warmup=1, min_bytes_per_step=100)
    # step 0 is the warm-up sample; steps 4..20 fill the window; rss stays flat (never an increase)
    samples = [{"heap_in_use": 0, "rss": 5000}] + [{"heap_in_use": h, "rss": 5000} for h in heap]
    return d, [d.add(4 * k, sample) for k, sample in enumerate(samples)]


def test_leak_detector_suspects_a_growing_series_by_hand() -> None:
    d, found = _detector_on([1000, 1500, 1400, 2300, 2900])
    assert found[:5] == [[]] * 5 and d.checked == {"heap_in_use", "rss"}
    # steps 4, 8, 12, 16, 20; the ten pairwise slopes (bytes a step), sorted:
    # -25 (8,12), 50 (4,12), 100 (8,16), 108.33 (4,16), 116.67 (8,20), 118.75 (4,20), 125 (4,8),
    # 150 (16,20), 187.5 (12,20), 225 (12,16): median (116.67 + 118.75) / 2 = 117.71 >= 100;
    # increases 3 of 4 (1500 -> 1400 falls) = 0.75 >= 0.6
    # newer half (steps 12, 16, 20): slopes 225, 187.5, 150 -> 187.5
    assert found[5] == [
        Trend(
            series="heap_in_use",
            slope=0.5 * (1400 / 12 + 1900 / 16),
            recent_slope=187.5,
            increasing_fraction=0.75,
            growth=1900.0,
            samples=5,
            first_step=4,
            last_step=20,
        )
    ]


@pytest.mark.parametrize(
    "heap",
    [
        [1000, 1000, 1000, 5000, 5000],  # a one-off jump: 1 increase of 4 (0.25 < 0.6)
        [
            1000,
            1010,
            1005,
            1020,
            1030,
        ],  # noise: 3 of 4 increase, but the median pairwise slope is (20/12 + 30/16) / 2 = 1.77 < 100
        [2000, 2100, 2200, 2300, 1900],  # grew most of the window, but ends below where it began
    ],
    ids=["jump", "noise", "ends-lower"],
)
def test_leak_detector_passes_what_is_no_leak(heap: list[int]) -> None:
    d, found = _detector_on(heap)
    assert found == [[]] * 6 and d.checked == {"heap_in_use", "rss"}

"""RunningMedian.mad selects its ranks by binary search: bit-identical to the merge walk it replaced."""

from __future__ import annotations

import bisect
import math
import random
import struct

import pytest

from torchdebug._robust import RunningMedian


def _walk_mad(m: RunningMedian) -> float:
    """The previous implementation: a merge walk over the deviations up to the middle rank."""
    s = m._sorted
    n = len(s)
    if n == 0:
        return math.nan
    med = m.median()
    split = bisect.bisect_left(s, med)
    i, j = split - 1, split
    need = (n // 2, n // 2) if n % 2 else (n // 2 - 1, n // 2)
    got: list[float] = []
    rank = 0
    while rank <= need[1]:
        left = med - s[i] if i >= 0 else math.inf
        right = s[j] - med if j < n else math.inf
        if left <= right:
            d, i = left, i - 1
        else:
            d, j = right, j + 1
        if rank >= need[0]:
            got.append(d)
        rank += 1
    return 0.5 * (got[0] + got[-1])


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)  # tells -0.0 from 0.0 and compares NaN with itself


def _series(rng: random.Random, kind: str, n: int) -> list[float]:
    if kind == "normal":
        return [rng.gauss(0.0, 1.0) for _ in range(n)]
    if kind == "ties":  # few distinct values: many equal deviations on both sides
        return [float(rng.randint(-3, 3)) for _ in range(n)]
    if kind == "zeros":  # signed zeros compare equal: the tie order decides the sign
        return [rng.choice((0.0, -0.0, 1.0, -1.0)) for _ in range(n)]
    if kind == "nonfinite":  # push() drops them: the window holds the finite ones only
        return [rng.choice((math.nan, math.inf, -math.inf, rng.random())) for _ in range(n)]
    if kind == "huge":  # the median and the deviations overflow to +-inf
        return [rng.choice((1.7e308, -1.7e308, 1e308, -1e308, 0.0)) for _ in range(n)]
    if kind == "tiny":  # subnormal deviations
        return [rng.choice((5e-324, -5e-324, 1e-320, 0.0)) for _ in range(n)]
    if kind == "trend":  # a drifting series with an outlier now and then
        return [0.01 * k + (1e3 if rng.random() < 0.05 else rng.random()) for k in range(n)]
    if kind == "loglike":  # what the explosion rule keeps: log10 of gradient norms
        return [math.log10(abs(rng.gauss(1.0, 0.3)) + 1e-12) for _ in range(n)]
    raise AssertionError(kind)


KINDS = ["normal", "ties", "zeros", "nonfinite", "huge", "tiny", "trend", "loglike"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("window", [1, 2, 3, 4, 7, 20, 100, 200])
def test_mad_equals_the_merge_walk_after_every_push(kind: str, window: int) -> None:
    rng = random.Random(f"{kind}-{window}")
    m = RunningMedian(window)
    assert math.isnan(m.mad())  # empty
    checked = 0
    for x in _series(rng, kind, 3 * window + 50):  # the window rolls over more than twice
        m.push(x)
        if len(m):
            assert _bits(m.mad()) == _bits(_walk_mad(m)), (kind, window, m.values())
            checked += 1
    assert checked >= 3 * window  # every push after the first finite value was compared


def test_mad_equals_the_merge_walk_on_random_windows() -> None:
    rng = random.Random(0)
    for trial in range(600):
        n = rng.randint(1, 60)
        kind = KINDS[trial % len(KINDS)]
        m = RunningMedian(n)
        for x in _series(rng, kind, n):
            m.push(x)
        if len(m):
            assert _bits(m.mad()) == _bits(_walk_mad(m)), (kind, m.values())


@pytest.mark.parametrize(
    ("values", "mad"),
    [
        ([1.0, 2.0, 3.0, 4.0, 100.0], 1.0),  # median 3, |x - 3| = 2 1 0 1 97 -> sorted 0 1 1 2 97 -> 1
        ([1.0, 1.0, 1.0, 1.0], 0.0),
        ([0.0, 10.0], 5.0),  # median 5, deviations 5 5
        ([1.0, 2.0, 4.0, 8.0], 1.5),  # median 3, deviations 2 1 1 5 -> sorted 1 1 2 5 -> (1 + 2) / 2
    ],
    ids=["odd", "constant", "two", "even"],
)
def test_mad_by_hand(values: list[float], mad: float) -> None:
    m = RunningMedian(len(values))
    for x in values:
        m.push(x)
    assert m.mad() == mad


def test_signed_zeros() -> None:
    # -0.0 == 0.0: the sorted window mixes them; a right deviation -0.0 - 0.0 is -0.0
    for values in ([-0.0, -0.0, 0.0], [0.0, -0.0, -0.0], [-0.0, 0.0, -0.0, 0.0], [0.0, 0.0, -0.0]):
        m = RunningMedian(len(values))
        for x in values:
            m.push(x)
        assert m.mad() == 0.0
        assert _bits(m.mad()) == _bits(_walk_mad(m))

"""RunningMedian's median and MAD (median absolute deviation) over a rolling window, checked against
values worked out by hand and, on random windows, against the definition written out directly."""

from __future__ import annotations

import math
import random

import pytest

from torchdebug._robust import RunningMedian


def _filled(window: int, values: list[float]) -> RunningMedian:
    m = RunningMedian(window)
    for x in values:
        m.push(x)
    return m


@pytest.mark.parametrize(
    ("window", "values", "kept", "median", "mad"),
    [
        # median 3, |x - 3| = 2 1 0 1 97 -> sorted 0 1 1 2 97 -> the middle one: 1
        (5, [1.0, 2.0, 3.0, 4.0, 100.0], [1.0, 2.0, 3.0, 4.0, 100.0], 3.0, 1.0),
        (4, [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], 1.0, 0.0),
        (2, [0.0, 10.0], [0.0, 10.0], 5.0, 5.0),  # median (0 + 10) / 2 = 5, deviations 5 5
        # median (2 + 4) / 2 = 3, deviations 2 1 1 5 -> sorted 1 1 2 5 -> (1 + 2) / 2
        (4, [1.0, 2.0, 4.0, 8.0], [1.0, 2.0, 4.0, 8.0], 3.0, 1.5),
        # ties on both sides of the median: median 2, deviations 1 0 0 1 -> sorted 0 0 1 1 -> (0 + 1) / 2
        (4, [1.0, 2.0, 2.0, 3.0], [1.0, 2.0, 2.0, 3.0], 2.0, 0.5),
        (4, [-3.0, -3.0, 3.0, 3.0], [-3.0, -3.0, 3.0, 3.0], 0.0, 3.0),  # median 0, every deviation 3
        # the window rolls over: 1 and 2 leave; median 4 of 3 4 100, deviations 1 0 96 -> 1
        (3, [1.0, 2.0, 3.0, 4.0, 100.0], [3.0, 4.0, 100.0], 4.0, 1.0),
        # NaN and +-inf are dropped: the window holds 1 2 4 8 (the "1 2 4 8" case above)
        (4, [1.0, math.nan, 2.0, math.inf, 4.0, -math.inf, 8.0], [1.0, 2.0, 4.0, 8.0], 3.0, 1.5),
        (1, [7.0], [7.0], 7.0, 0.0),  # one value: it is its own median, deviation 0
        # median 1e308; deviations 1.7e308 - 1e308, |-1.7e308 - 1e308| = inf (overflow), 0 -> the middle one
        (3, [1.7e308, -1.7e308, 1e308], [1.7e308, -1.7e308, 1e308], 1e308, 1.7e308 - 1e308),
        # subnormals: median 5e-324; deviations 5e-324 0 (1e-320 - 5e-324) -> sorted: the middle is 5e-324
        (3, [5e-324, 0.0, 1e-320], [5e-324, 0.0, 1e-320], 5e-324, 5e-324),
        # median 0; deviations 0 0 0 1 1 -> 0
        (5, [0.0, 0.0, 0.0, 1.0, -1.0], [0.0, 0.0, 0.0, 1.0, -1.0], 0.0, 0.0),
    ],
    ids=[
        "odd",
        "constant",
        "two",
        "even",
        "ties",
        "two-sided",
        "rolled",
        "nonfinite",
        "one",
        "huge",
        "tiny",
        "zeros",
    ],
)
def test_median_and_mad_by_hand(
    window: int, values: list[float], kept: list[float], median: float, mad: float
) -> None:
    m = _filled(window, values)
    assert m.values() == kept and len(m) == len(kept)
    assert m.median() == median
    assert m.mad() == mad


def test_empty_and_nonfinite_pushes() -> None:
    m = RunningMedian(3)
    assert math.isnan(m.median()) and math.isnan(m.mad())  # empty
    assert [m.push(x) for x in (math.nan, math.inf, 2.0)] == [False, False, True]
    assert m.values() == [2.0] and m.mad() == 0.0
    m.clear()
    assert len(m) == 0 and math.isnan(m.mad())


def test_signed_zeros() -> None:
    # -0.0 == 0.0: the sorted window mixes them; every deviation is a zero, so the MAD is zero
    for values in ([-0.0, -0.0, 0.0], [0.0, -0.0, -0.0], [-0.0, 0.0, -0.0, 0.0], [0.0, 0.0, -0.0]):
        m = _filled(len(values), values)
        assert m.median() == 0.0 and m.mad() == 0.0


def _mad_by_definition(values: list[float]) -> float:
    """The MAD as it is defined: the median of ``|x - median|``, each median the mean of the middle
    value(s) of the sorted list (one for an odd count, two for an even one)."""

    def middle(xs: list[float]) -> float:
        s, n = sorted(xs), len(xs)
        return 0.5 * (s[(n - 1) // 2] + s[n // 2])

    med = middle(values)
    return middle([abs(x - med) for x in values])


def _series(rng: random.Random, kind: str, n: int) -> list[float]:
    if kind == "normal":
        return [rng.gauss(0.0, 1.0) for _ in range(n)]
    if kind == "ties":  # few distinct values: many equal deviations on both sides
        return [float(rng.randint(-3, 3)) for _ in range(n)]
    if kind == "nonfinite":  # push() drops them: the window holds the finite ones only
        return [rng.choice((math.nan, math.inf, -math.inf, rng.random())) for _ in range(n)]
    if kind == "tiny":  # subnormal deviations
        return [rng.choice((5e-324, -5e-324, 1e-320, 0.0)) for _ in range(n)]
    if kind == "trend":  # a drifting series with an outlier now and then
        return [0.01 * k + (1e3 if rng.random() < 0.05 else rng.random()) for k in range(n)]
    raise AssertionError(kind)


KINDS = ["normal", "ties", "nonfinite", "tiny", "trend"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("window", [1, 2, 3, 4, 7, 20, 100])
def test_mad_is_the_median_of_the_deviations_after_every_push(kind: str, window: int) -> None:
    rng = random.Random(f"{kind}-{window}")
    m = RunningMedian(window)
    kept: list[float] = []
    checked = 0
    for x in _series(rng, kind, 3 * window + 50):  # the window rolls over more than twice
        if m.push(x):
            kept = [*kept, x][-window:]
        if kept:
            assert m.values() == kept
            assert m.mad() == _mad_by_definition(kept), (kind, window, kept)
            checked += 1
    assert checked >= 3 * window  # every push after the first finite value was checked

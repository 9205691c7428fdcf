"""Robust running statistics over a bounded window: running median, MAD and robust z-scores (host side)."""

from __future__ import annotations

import bisect
import math
from collections import deque

# 1.4826 * MAD estimates the standard deviation of normally distributed data (1 / Phi^-1(3/4)).
MAD_TO_SIGMA = 1.482602218505602


class RunningMedian:
    """Median and median absolute deviation (MAD) of the last ``window`` finite values.

    Args:
        window: how many recent values to keep (>= 1). Memory is O(window).

    Non-finite values are ignored by :meth:`push` (they would poison the window): the caller
    decides what a NaN/Inf means. Cost: ``push`` is O(window) (sorted insert/remove in a list),
    ``median`` O(1), ``mad`` O(log window) (a rank selection in the sorted window, no sort).

    Example:
        >>> m = RunningMedian(5)
        >>> for x in [1.0, 2.0, 3.0, 4.0, 100.0]:
        ...     _ = m.push(x)
        >>> m.median(), m.mad()
        (3.0, 1.0)
    """

    __slots__ = ("_order", "_sorted", "n", "window")

    def __init__(self, window: int) -> None:
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ValueError(f"window must be an int >= 1, got {window!r}")
        self.window = window
        self._order: deque[float] = deque()  # arrival order, to know what leaves the window
        self._sorted: list[float] = []  # same values, kept sorted
        self.n = 0  # len(self), kept by hand: the rules read it every step without a Python call

    def __len__(self) -> int:
        return len(self._order)

    def push(self, value: float) -> bool:
        """Add ``value``; drop the oldest one when the window is full. Returns False if it was not finite."""
        x = float(value)
        if not math.isfinite(x):
            return False
        if self.n == self.window:
            old = self._order.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        else:
            self.n += 1
        self._order.append(x)
        bisect.insort(self._sorted, x)
        return True

    def clear(self) -> None:
        """Forget every value."""
        self._order.clear()
        self._sorted.clear()
        self.n = 0

    def values(self) -> list[float]:
        """The kept values, oldest first."""
        return list(self._order)

    def median(self) -> float:
        """Median of the window (mean of the two middle values for an even count); NaN when empty."""
        s = self._sorted
        n = len(s)
        if n == 0:
            return math.nan
        mid = n // 2
        return s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])

    def mad(self) -> float:
        """Median absolute deviation from the median; NaN when empty.

        The deviations left of the median grow leftwards and those right of it grow rightwards,
        so both are already sorted: the median of the deviations is found by selecting its rank(s)
        in the merge of the two runs with a binary search, O(log window), no list built and the
        same result, bit for bit, as walking the merge (see :func:`_merged_rank`).
        """
        return self._mad_at(self.median())

    def _mad_at(self, med: float) -> float:
        """``mad()`` given the window's median (``median()``, computed once by the caller)."""
        s = self._sorted
        n = len(s)
        if n == 0:
            return math.nan
        split = bisect.bisect_left(s, med)
        half = n // 2
        if n % 2:
            d = _merged_rank(s, med, split, half)[0]
            return 0.5 * (d + d)
        lo, hi = _merged_rank(s, med, split, half - 1)  # the two middle ranks, one search
        return 0.5 * (lo + hi)

    def sigma(self, rel_floor: float = 0.0, abs_floor: float = 0.0) -> float:
        """Robust standard deviation ``1.4826 * MAD``, floored at ``rel_floor*|median|`` and ``abs_floor``.

        The floors keep a (nearly) constant series from turning every tiny wiggle into a huge z-score.
        """
        return self._sigma_at(self.median(), rel_floor, abs_floor)

    def _sigma_at(self, med: float, rel_floor: float = 0.0, abs_floor: float = 0.0) -> float:
        """``sigma()`` given the window's median (the rules that also read the median compute it once)."""
        if math.isnan(med):
            return math.nan
        return max(MAD_TO_SIGMA * self._mad_at(med), rel_floor * abs(med), abs_floor)

    def zscore(self, value: float, rel_floor: float = 0.0, abs_floor: float = 0.0) -> float:
        """How many robust sigmas ``value`` lies above the median (negative below); NaN when empty.

        A zero sigma (constant window, no floor) gives +/-inf for any different value and 0 for the median.
        """
        return self._zscore_at(self.median(), value, rel_floor, abs_floor)

    def _zscore_at(self, med: float, value: float, rel_floor: float = 0.0, abs_floor: float = 0.0) -> float:
        """``zscore()`` given the window's median."""
        if math.isnan(med):
            return math.nan
        sig = self._sigma_at(med, rel_floor, abs_floor)
        diff = float(value) - med
        if sig > 0:
            return diff / sig
        if diff == 0:
            return 0.0
        return math.copysign(math.inf, diff)


def _merged_rank(s: list[float], med: float, split: int, k: int) -> tuple[float, float]:
    """The deviations of 0-based ranks ``k`` and ``k + 1`` (``inf`` past the end) in the merge of the
    left run ``med - s[split-1-a]`` (a = 0, 1, ...) and the right run ``s[split+b] - med``
    (b = 0, 1, ...); both are non-decreasing.

    Binary search on how many of the ``k + 1`` smallest come from the left run: O(log n). Ties go to
    the left run first, as in a merge walk that takes the left deviation when ``left <= right``
    (the left deviations are > 0, so tied values are equal bit for bit: no signed-zero case). The
    next rank is the smaller of the two runs' next deviations.
    """
    nl, nr = split, len(s) - split
    m = k + 1  # how many deviations are taken
    lo, hi = max(0, m - nr), min(m, nl)
    while lo < hi:  # the smallest ``a`` whose next left deviation comes after the last right one taken
        a = (lo + hi) // 2
        if med - s[split - 1 - a] <= s[split + m - a - 1] - med:
            lo = a + 1
        else:
            hi = a
    a = lo
    left = med - s[split - a] if a > 0 else -math.inf  # the a-th left deviation (1-based)
    right = s[split + m - a - 1] - med if m - a > 0 else -math.inf
    nxt_left = med - s[split - 1 - a] if a < nl else math.inf
    nxt_right = s[split + m - a] - med if m - a < nr else math.inf
    # the later of the two in the walk; then the walk's next pick
    return (left if left > right else right), (nxt_left if nxt_left <= nxt_right else nxt_right)


class Streak:
    """Counts consecutive True updates; ``fired`` once per run of ``patience`` Trues (episode semantics).

    Example:
        >>> s = Streak(2)
        >>> [s.update(x) for x in (True, True, True, False, True, True)]
        [False, True, False, False, False, True]
    """

    __slots__ = ("count", "patience")

    def __init__(self, patience: int) -> None:
        if not isinstance(patience, int) or isinstance(patience, bool) or patience < 1:
            raise ValueError(f"patience must be an int >= 1, got {patience!r}")
        self.patience = patience
        self.count = 0

    def update(self, condition: bool) -> bool:
        """Record one observation; True exactly when the streak reaches ``patience``."""
        self.count = self.count + 1 if condition else 0
        return self.count == self.patience


__all__ = ["MAD_TO_SIGMA", "RunningMedian", "Streak"]

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
    ``median`` O(1), ``mad`` O(window) (a merge walk over the sorted window, no sort).

    Example:
        >>> m = RunningMedian(5)
        >>> for x in [1.0, 2.0, 3.0, 4.0, 100.0]:
        ...     _ = m.push(x)
        >>> m.median(), m.mad()
        (3.0, 1.0)
    """

    __slots__ = ("_order", "_sorted", "window")

    def __init__(self, window: int) -> None:
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ValueError(f"window must be an int >= 1, got {window!r}")
        self.window = window
        self._order: deque[float] = deque()  # arrival order, to know what leaves the window
        self._sorted: list[float] = []  # same values, kept sorted

    def __len__(self) -> int:
        return len(self._order)

    def push(self, value: float) -> bool:
        """Add ``value``; drop the oldest one when the window is full. Returns False if it was not finite."""
        x = float(value)
        if not math.isfinite(x):
            return False
        if len(self._order) == self.window:
            old = self._order.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._order.append(x)
        bisect.insort(self._sorted, x)
        return True

    def clear(self) -> None:
        """Forget every value."""
        self._order.clear()
        self._sorted.clear()

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
        so both are already sorted: merging them up to the middle rank finds the median of the
        deviations in O(window) without sorting.
        """
        s = self._sorted
        n = len(s)
        if n == 0:
            return math.nan
        med = self.median()
        split = bisect.bisect_left(s, med)
        i, j = split - 1, split  # i walks left (deviation med - s[i]), j walks right (s[j] - med)
        need = (n // 2, n // 2) if n % 2 else (n // 2 - 1, n // 2)  # 0-based ranks to average
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

    def sigma(self, rel_floor: float = 0.0, abs_floor: float = 0.0) -> float:
        """Robust standard deviation ``1.4826 * MAD``, floored at ``rel_floor*|median|`` and ``abs_floor``.

        The floors keep a (nearly) constant series from turning every tiny wiggle into a huge z-score.
        """
        med = self.median()
        if math.isnan(med):
            return math.nan
        return max(MAD_TO_SIGMA * self.mad(), rel_floor * abs(med), abs_floor)

    def zscore(self, value: float, rel_floor: float = 0.0, abs_floor: float = 0.0) -> float:
        """How many robust sigmas ``value`` lies above the median (negative below); NaN when empty.

        A zero sigma (constant window, no floor) gives +/-inf for any different value and 0 for the median.
        """
        med = self.median()
        if math.isnan(med):
            return math.nan
        sig = self.sigma(rel_floor, abs_floor)
        diff = float(value) - med
        if sig > 0:
            return diff / sig
        if diff == 0:
            return 0.0
        return math.copysign(math.inf, diff)


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

"""Statistics shared by the time-to-target suites: censored times, ratios over pairs, a bootstrap interval.

A run that misses the target stays in the statistics: its time is the time at
which it was stopped (the step or time cap), a lower bound on its true time.
"""
from __future__ import annotations

import random
import statistics
from typing import Sequence


def censored_time(run: dict, key: str = "time_to_target_s", end_key: str = "end_s") -> float:
    """The run's time to target, or (missed) the time at which it stopped: censored at the cap.

    >>> censored_time({"reached": True, "time_to_target_s": 5.0, "end_s": 9.0})
    5.0
    >>> censored_time({"reached": False, "time_to_target_s": None, "end_s": 9.0})
    9.0
    """
    return float(run[key]) if run["reached"] else float(run[end_key])


def ratios(pairs: Sequence[tuple[float, float]]) -> list[float]:
    """a / b for each pair.

    >>> ratios([(1.0, 2.0), (3.0, 3.0)])
    [0.5, 1.0]
    """
    return [a / b for a, b in pairs]


def bootstrap_median_ci(values: Sequence[float], *, n: int = 10000, level: float = 0.95,
                        seed: int = 0) -> list[float]:
    """Percentile bootstrap interval of the median of `values` (resampled with replacement).

    With 3 values the interval can only span their min..max; it says how little 3 pairs pin down.

    >>> bootstrap_median_ci([1.0, 1.0, 1.0])
    [1.0, 1.0]
    >>> lo, hi = bootstrap_median_ci([0.4, 0.5, 0.6]); 0.4 <= lo <= 0.5 <= hi <= 0.6
    True
    """
    if not values:
        return [None, None]
    rng = random.Random(seed)
    vals = list(values)
    meds = sorted(statistics.median(rng.choices(vals, k=len(vals))) for _ in range(n))
    lo_i = int(round((1 - level) / 2 * (n - 1)))
    hi_i = int(round((1 + level) / 2 * (n - 1)))
    return [round(meds[lo_i], 3), round(meds[hi_i], 3)]


def median_ratio(pairs: Sequence[tuple[float, float]]) -> tuple[float | None, list]:
    """(median of a/b over pairs, its bootstrap 95 % interval), rounded to 3 places.

    >>> median_ratio([(1.0, 2.0), (2.0, 2.0), (3.0, 2.0)])[0]
    1.0
    """
    rs = ratios(pairs)
    if not rs:
        return None, [None, None]
    return round(statistics.median(rs), 3), bootstrap_median_ci(rs)

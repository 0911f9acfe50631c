"""Trends of the soak's figures: a robust slope through a series of samples, and when it is growing.

Rules: pure arithmetic on (seconds, value) pairs, no processes. The slope is Theil-Sen's (the median of
the slopes between every two samples), which a few outliers (a burst of buffers live at one sample) do not
move; its confidence interval is Sen's (from the distribution of Kendall's S). A series is growing only
when the whole interval lies above the allowed rate: noise widens the interval, it never fails a run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Two-sided 95 %: the interval's lower end is a one-sided 97.5 % bound on the rate.
Z_95 = 1.959964
# Theil-Sen takes every pair: beyond this many samples, every k-th sample is taken (still minutes apart).
MAX_TREND_SAMPLES = 720
# Fewer samples than this after the warm-up give no slope at all.
MIN_TREND_SAMPLES = 10


@dataclass(frozen=True)
class Slope:
    """Theil-Sen slope of a series, per second, with its 95 % confidence interval."""

    per_s: float
    low_per_s: float
    high_per_s: float
    samples: int
    window_s: float

    @property
    def per_h(self) -> float:
        return self.per_s * 3600.0


def theil_sen(times_s: Sequence[float], values: Sequence[float]) -> Slope:
    """The median pairwise slope of the samples and Sen's 95 % interval around it. Needs two samples at
    different times; ties in value are kept as they are (which only widens the interval)."""
    t = np.asarray(times_s, dtype=np.float64)
    y = np.asarray(values, dtype=np.float64)
    if t.shape != y.shape or t.ndim != 1:
        raise ValueError("times and values must be two sequences of one length")
    if len(t) > MAX_TREND_SAMPLES:
        keep = np.linspace(0, len(t) - 1, MAX_TREND_SAMPLES).round().astype(np.int64)
        t, y = t[keep], y[keep]
    n = len(t)
    first, second = np.triu_indices(n, 1)
    dt = t[second] - t[first]
    usable = dt > 0
    if not usable.any():
        raise ValueError("a slope needs two samples at different times")
    slopes = np.sort((y[second] - y[first])[usable] / dt[usable])
    pairs = len(slopes)
    median = float(np.median(slopes))
    # Sen (1968): the interval's ends are the slopes ranked (N -/+ C) / 2, C = z * sd(Kendall's S).
    spread = Z_95 * math.sqrt(n * (n - 1) * (2 * n + 5) / 18.0)
    low_rank = max(0, math.floor((pairs - spread) / 2))
    high_rank = min(pairs - 1, math.ceil((pairs + spread) / 2))
    return Slope(median, float(slopes[low_rank]), float(slopes[high_rank]), n, float(t[-1] - t[0]))


@dataclass(frozen=True)
class TrendRule:
    """A figure may grow no faster than `max_per_h` (its unit per hour), judged over the samples taken
    from `skip_fraction` of the churn on (at least `min_skip_s` in), once that window spans `min_window_s`."""

    max_per_h: float
    min_window_s: float
    skip_fraction: float
    min_skip_s: float


@dataclass(frozen=True)
class Trend:
    slope: Slope | None  # None: too few samples for any slope
    judged: bool  # False: the window is shorter than the rule's minimum (the final excess still counts)
    growing: bool  # judged, and the whole interval lies above the allowed rate


def judge(rule: TrendRule, times_s: Sequence[float], values: Sequence[float], churn_s: float) -> Trend:
    """The trend of a figure sampled at `times_s` (seconds since the churn began) over a churn of
    `churn_s` seconds: the samples before the skip are warm-up (caches and the allocator's heap fill up
    first) and left out. Judged when the rest of the churn spans the rule's minimum window."""
    skip_s = max(rule.min_skip_s, rule.skip_fraction * churn_s)
    kept = [(t, v) for t, v in zip(times_s, values, strict=True) if skip_s <= t <= churn_s]
    if len(kept) < MIN_TREND_SAMPLES or kept[-1][0] - kept[0][0] <= 0:
        return Trend(None, False, False)
    slope = theil_sen([t for t, _ in kept], [v for _, v in kept])
    judged = churn_s - skip_s >= rule.min_window_s
    growing = judged and slope.low_per_s * 3600.0 > rule.max_per_h
    return Trend(slope, judged, growing)

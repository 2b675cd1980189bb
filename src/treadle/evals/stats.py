"""The statistics of an evaluation: intervals, pass@k and percentiles, in the standard library.

- `wilson_interval`: the Wilson score interval of a proportion (binary scores; with several
  samples per item, of the per-item pass rates over the items). Unlike the normal ("Wald")
  interval it stays inside [0, 1] and is sound at 0 or n successes.
- `t_interval`: mean +/- t(1 - alpha/2, n - 1) * s / sqrt(n), for continuous scores (per-item
  means when an item has several samples: its samples are not independent), clipped to [0, 1].
- `pass_at_k`: the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models
  Trained on Code"): for an item with n samples of which c passed,
  1 - C(n - c, k) / C(n, k), computed as a product so it never overflows.
- `percentile`: linear interpolation between closest ranks (numpy's default method).

Pure functions of numbers; no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

__all__ = [
    "Interval",
    "pass_at_k",
    "percentile",
    "t_interval",
    "t_quantile",
    "wilson_interval",
]


@dataclass(frozen=True, slots=True)
class Interval:
    """A confidence interval around an estimate."""

    estimate: float
    low: float
    high: float
    level: float
    """Confidence level, e.g. 0.95."""
    method: str
    """`"wilson"` or `"t"`."""
    n: int
    """Observations the interval is computed from."""


def _check_level(level: float) -> None:
    if not 0.0 < level < 1.0:
        raise ValueError(f"the confidence level must be between 0 and 1, got {level!r}.")


def wilson_interval(successes: float, n: int, level: float = 0.95) -> Interval:
    """The Wilson score interval of `successes` out of `n` at confidence `level`.

    `successes` may be fractional: the sum of per-item pass rates when items have several
    samples (the item is then the unit, as samples of one item are not independent).
    """
    _check_level(level)
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n and n >= 1, got {successes} of {n}.")
    z = NormalDist().inv_cdf(0.5 + level / 2)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # At 0 or n successes the bound is exactly 0 or 1; rounding would leave it a hair inside.
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == n else min(1.0, centre + half)
    return Interval(p, low, high, level, "wilson", n)


def t_interval(
    values: Sequence[float], level: float = 0.95, bounds: tuple[float, float] | None = None
) -> Interval:
    """Mean of `values` +/- Student's t quantile times the standard error (n - 1 d.o.f.),
    clipped to `bounds` when given (scores live in [0, 1], so their mean does too).

    With one value the interval is that value on both sides (there is no spread to measure).
    """
    _check_level(level)
    n = len(values)
    if n < 1:
        raise ValueError("a t interval needs at least one value.")
    mean = math.fsum(values) / n
    if n == 1:
        return Interval(mean, mean, mean, level, "t", 1)
    variance = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    half = t_quantile(0.5 + level / 2, n - 1) * math.sqrt(variance / n)
    low, high = mean - half, mean + half
    if bounds is not None:
        low, high = max(bounds[0], low), min(bounds[1], high)
    return Interval(mean, low, high, level, "t", n)


def t_quantile(p: float, df: int) -> float:
    """The `p` quantile of Student's t distribution with `df` degrees of freedom (p > 0.5).

    Found by bisection on the CDF, which is the regularised incomplete beta function; accurate
    to about 1e-10, plenty for an interval.
    """
    if not 0.5 <= p < 1.0 or df < 1:
        raise ValueError(f"need 0.5 <= p < 1 and df >= 1, got p={p}, df={df}.")
    low, high = 0.0, 1.0
    while _t_cdf(high, df) < p:
        high *= 2
    for _ in range(200):
        mid = (low + high) / 2
        if _t_cdf(mid, df) < p:
            low = mid
        else:
            high = mid
        if high - low < 1e-12:
            break
    return (low + high) / 2


def _t_cdf(t: float, df: int) -> float:
    x = df / (df + t * t)
    tail = 0.5 * _betainc(df / 2, 0.5, x)
    return 1 - tail if t >= 0 else tail


def _betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b) (continued fraction, Lentz)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
    front = math.exp(log_front + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _betacf(a, b, x) / a
    return 1 - front * _betacf(b, a, 1 - x) / b


def _betacf(a: float, b: float, x: float) -> float:
    tiny = 1e-300
    c, d = 1.0, 1 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        for num in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1 + num * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return h


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one item with `n` samples, `c` of them passing (needs k <= n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}.")
    if n - c < k:
        return 1.0
    # 1 - C(n-c, k) / C(n, k) = 1 - prod_{i = n-c+1}^{n} (1 - k / i)
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1 - k / i
    return 1 - product


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0-100) of `values`, interpolating linearly between ranks."""
    if not values:
        raise ValueError("a percentile needs at least one value.")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}.")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)

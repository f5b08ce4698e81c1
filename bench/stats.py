"""Statistics of the benchmarks: paired, counterbalanced rounds and a bootstrap interval.

A ratio is measured side by side: each round runs the two arms (A, B) back to back,
in the order A B in even rounds and B A in odd ones (counterbalanced, so drift of the
shared host over a round weighs on both arms alike), and gives one ratio A / B. The
reported figure is the median of the rounds' ratios with a 95 % bootstrap confidence
interval of that median (percentile bootstrap, Efron & Tibshirani 1993, via
``scipy.stats.bootstrap``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from scipy import stats as scipy_stats

CONFIDENCE = 0.95
RESAMPLES = 2000


def median_ci(values: Sequence[float], seed: int = 0) -> tuple[float, float, float]:
    """``(median, low, high)``: the median of ``values`` and its 95 % bootstrap interval.

    With one value the interval is that value; raises ValueError for none.
    """
    if not values:
        raise ValueError("median_ci needs at least one value")
    median = float(statistics.median(values))
    if len(values) < 2 or len(set(values)) == 1:
        return median, median, median
    result = scipy_stats.bootstrap(
        (np.asarray(values, dtype=float),),
        np.median,
        confidence_level=CONFIDENCE,
        n_resamples=RESAMPLES,
        method="percentile",
        rng=np.random.default_rng(seed),
    )
    interval = result.confidence_interval
    return median, float(interval.low), float(interval.high)


def summary(values: Sequence[float], digits: int = 4) -> dict[str, Any]:
    """``{"median", "ci95": [low, high], "rounds", "values"}`` of ``values``, rounded."""
    median, low, high = median_ci(values)
    return {
        "median": round(median, digits),
        "ci95": [round(low, digits), round(high, digits)],
        "rounds": len(values),
        "values": [round(v, digits) for v in values],
    }


def paired_rounds(arms: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Run every arm once per round, the order reversed in every other round.

    ``arms`` maps a name to a measurement (e.g. seconds per step); returns each arm's
    values in round order, so ``values[a][i] / values[b][i]`` is round i's paired ratio.
    """
    names = list(arms)
    values: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        for name in names if index % 2 == 0 else reversed(names):
            values[name].append(arms[name]())
    return values


def paired_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    """Round-by-round ratios ``numerator[i] / denominator[i]``; raises ValueError on a
    length mismatch or a zero denominator."""
    if len(numerator) != len(denominator):
        raise ValueError(f"{len(numerator)} values against {len(denominator)}")
    if any(d == 0 for d in denominator):
        raise ValueError("a denominator is zero")
    return [n / d for n, d in zip(numerator, denominator, strict=True)]

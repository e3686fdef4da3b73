"""Bootstrap confidence intervals and the regression rule.

Regression (the suite's alarm): the score dropped, versus the previous successful night or the
stored baseline, by more than the suite's ``max_drop`` threshold AND by more than the noise —
the reference score lies above the upper end of tonight's bootstrap interval. Both, so neither
a tiny suite's noise nor a statistically-significant-but-negligible drop pages anyone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float
    n: int
    confidence: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def bootstrap_ci(scores: Sequence[float] | np.ndarray, *, confidence: float = 0.95,
                 resamples: int = 2000, seed: int = 0) -> Interval:
    """Percentile bootstrap of the mean. For 0/1 scores the resampled sum is exactly
    Binomial(n, p), drawn directly (O(resamples), not O(n·resamples)); other scores resample in
    chunks so memory stays bounded for 100k items."""
    x = np.asarray(scores, dtype=np.float64)
    n = x.size
    if n == 0:
        return Interval(0.0, 0.0, 0.0, 0, confidence)
    rng = np.random.default_rng(seed)
    mean = float(x.mean())
    if np.all((x == 0.0) | (x == 1.0)):
        means = rng.binomial(n, mean, size=resamples) / n
    else:
        means = np.empty(resamples)
        chunk = max(1, 4_000_000 // n)
        for start in range(0, resamples, chunk):
            k = min(chunk, resamples - start)
            means[start:start + k] = x[rng.integers(0, n, size=(k, n))].mean(axis=1)
    tail = (1.0 - confidence) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return Interval(mean, float(low), float(high), n, confidence)


@dataclass(frozen=True)
class Comparison:
    against: str  # "previous" or "baseline"
    reference_score: float
    reference_date: str | None
    delta: float
    regression: bool
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare(current: Interval, reference_score: float | None, *, against: str, max_drop: float,
            reference_date: str | None = None) -> Comparison | None:
    if reference_score is None:
        return None
    delta = current.mean - reference_score
    beyond_threshold = -delta > max_drop
    beyond_ci = reference_score > current.high
    regression = beyond_threshold and beyond_ci
    if regression:
        reason = (f"dropped {-delta:.3f} vs {against} ({reference_score:.3f}): more than max_drop "
                  f"{max_drop:.3f} and above tonight's {current.confidence:.0%} interval "
                  f"[{current.low:.3f}, {current.high:.3f}]")
    elif beyond_threshold:
        reason = f"dropped {-delta:.3f} vs {against}, within tonight's interval: noise"
    elif beyond_ci:
        reason = f"dropped {-delta:.3f} vs {against}: significant but within max_drop {max_drop:.3f}"
    else:
        reason = "ok"
    return Comparison(against, reference_score, reference_date, delta, regression, reason)

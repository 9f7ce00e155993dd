"""What an operator sees of a listing lag: nearest-rank percentiles of its samples. Pure: no I/O, no store.

``replyd.lag`` measures the lag and picks the delay; this module only summarises samples, so the CLI's
read commands show them without importing the store's engine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# How many of the newest samples a percentile is taken over (``sweep.listing_lag_window``'s default).
LISTING_LAG_WINDOW = 500


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 < q <= 100) of ``values``; 0.0 when there are none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


@dataclass(frozen=True)
class LagSummary:
    """What the operator sees of one platform instance's listing lag."""

    platform: str
    samples: int
    p50_s: float
    p99_s: float
    upper_p99_s: float

    @classmethod
    def of(cls, platform: str, samples: Sequence[tuple[float, float]]) -> LagSummary:
        """Summarise (lower_s, upper_s) samples."""
        lower = [lo for lo, _ in samples]
        return cls(platform, len(samples), round(percentile(lower, 50), 3), round(percentile(lower, 99), 3),
                   round(percentile([hi for _, hi in samples], 99), 3))

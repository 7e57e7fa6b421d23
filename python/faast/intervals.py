"""Confidence intervals shared by the classifier evaluation (faast.classify) and the LM experiments (faast.hf)."""

from __future__ import annotations

import math

Z95 = 1.959963984540054  # the two-sided 95% normal quantile


def wilson_interval(successes: int, trials: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval (low, high) of a binomial proportion, 95% by default; trials must be independent
    (distinct queries)."""
    if trials < 1 or not 0 <= successes <= trials:
        raise ValueError(
            f"successes, trials: expected 0 <= successes <= trials and trials >= 1, got {successes}, {trials}"
        )
    p = successes / trials
    denom = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denom
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denom
    # The bounds are exactly 0 and 1 at the extremes; rounding would leave 1 - 1e-16.
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == trials else min(1.0, centre + half)
    return low, high

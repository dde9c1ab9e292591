"""The timing detector's line: TTFT against prompt length, read from the fast side.

Siegel's repeated-medians line (`scipy.stats.siegelslopes`, 50% breakdown), its slope clamped
at >= 0 and its 99 % lower bound from Theil-Sen; the intercept and the noise scale from the
low quantiles of the residuals, because contention only ever delays a first token
(`harness.detectors.timing` explains the whole rule). A pure function of the samples.
"""

from __future__ import annotations

import numpy as np
from scipy.stats import siegelslopes, theilslopes

from kvcanary.harness.record.ttft_model import TtftModel

_Z25 = 0.6745
"""-z of the 25th percentile of a normal distribution."""
_Z25_MINUS_Z05 = 1.6449 - 0.6745


def fit_ttft(
    x: np.ndarray,
    y: np.ndarray,
    *,
    num_sigmas: float,
    fraction: float,
    min_prefill_ms: float,
    min_scale_ms: float,
    contention_quantile: float,
) -> tuple[TtftModel, float]:
    """The model of TTFT `y` (ms) against prompt tokens `x` (two lengths at least), and the
    largest delay of a sample above its uncontended line."""
    result = siegelslopes(y, x)
    slope = max(float(result.slope), 0.0)
    low = float(theilslopes(y, x, alpha=0.99).low_slope)
    intercept, scale = _uncontended_center_and_scale(y - slope * x)
    delays = y - slope * x - intercept
    model = TtftModel(
        ms_per_token_low=max(0.0, min(low, slope)),
        intercept_ms=intercept,
        ms_per_token=slope,
        scale_ms=max(scale, min_scale_ms),
        num_samples=int(x.size),
        num_sigmas=num_sigmas,
        fraction=fraction,
        min_prefill_ms=min_prefill_ms,
        contention_ms=max(float(np.quantile(delays, contention_quantile)), 0.0),
        contention_quantile=contention_quantile,
    )
    return model, max(float(delays.max()), 0.0)


def _uncontended_center_and_scale(residuals: np.ndarray) -> tuple[float, float]:
    """Center and spread of the fastest responses, read from the residuals' low quantiles.

    Contention adds delay to some responses and never removes any, so the low quantiles
    belong to the undelayed population. Scale: (Q25 - Q05) / (z25 - z05); center: Q25 plus
    0.6745 scales. For noise without contention they equal the median and the usual sigma;
    with a fraction u >= 1/4 of responses undelayed they overstate the spread (by at most
    ~1.5x at u = 0.4), which only makes the rule more conservative.
    """
    q05, q25 = np.quantile(residuals, [0.05, 0.25])
    scale = float(q25 - q05) / _Z25_MINUS_Z05
    return float(q25) + _Z25 * scale, scale

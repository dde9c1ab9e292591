"""The two-sample tests the cache probe decides with, and Holm's correction.

One contrast (a candidate arm's TTFTs against its baseline's): upper outliers (> Q3 + 1.5
IQR) are trimmed from each arm; a one-sided two-sample Kolmogorov-Smirnov test and a
one-sided Mann-Whitney U test (exact when there are no ties) are run, and the contrast's
p-value is the larger of the two (an intersection-union test). Effect sizes travel with it.
`harness.cache_probe.stats` turns contrasts into the probe's verdict.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from scipy import stats

MIN_SAMPLES = 5
"""Fewer valid TTFTs in an arm than this and its contrast is not tested (p = 1)."""
_EXACT_MWU_MAX = 100

Floats = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class ArmTest:
    """Whether `candidate` TTFTs are stochastically smaller than `baseline` TTFTs."""

    num_candidate: int
    num_baseline: int
    num_candidate_trimmed: int
    num_baseline_trimmed: int
    ks_statistic: float
    ks_p: float
    mwu_statistic: float
    mwu_p: float
    p_value: float
    """max(ks_p, mwu_p): both tests must reject."""
    median_candidate_ms: float
    median_baseline_ms: float
    median_ratio: float
    fraction_below_fastest_baseline: float
    prob_faster: float
    """P(a candidate TTFT < a baseline TTFT), the Mann-Whitney effect size (AUC)."""
    tested: bool = True
    """False when an arm had fewer than `MIN_SAMPLES` TTFTs; then every p is 1."""


def trim_upper_outliers(values: Sequence[float]) -> Floats:
    """`values` without those above Q3 + 1.5 IQR (slow outliers: queueing, GC, jitter)."""
    data = np.asarray(values, dtype=np.float64)
    if data.size < 4:
        return data
    q1, q3 = np.percentile(data, [25, 75])
    kept: Floats = data[data <= q3 + 1.5 * (q3 - q1)]
    return kept


def compare_arms(
    candidate_ms: Sequence[float], baseline_ms: Sequence[float], *, trim_outliers: bool = True
) -> ArmTest:
    """Test whether `candidate_ms` is stochastically smaller than `baseline_ms`."""
    candidate = trim_upper_outliers(candidate_ms) if trim_outliers else np.asarray(candidate_ms)
    baseline = trim_upper_outliers(baseline_ms) if trim_outliers else np.asarray(baseline_ms)
    candidate = candidate.astype(np.float64)
    baseline = baseline.astype(np.float64)
    sizes: dict[str, Any] = dict(
        num_candidate=len(candidate_ms),
        num_baseline=len(baseline_ms),
        num_candidate_trimmed=len(candidate_ms) - candidate.size,
        num_baseline_trimmed=len(baseline_ms) - baseline.size,
    )
    if candidate.size < MIN_SAMPLES or baseline.size < MIN_SAMPLES:
        nan = float("nan")
        return ArmTest(
            **sizes,
            ks_statistic=nan,
            ks_p=1.0,
            mwu_statistic=nan,
            mwu_p=1.0,
            p_value=1.0,
            median_candidate_ms=_median(candidate),
            median_baseline_ms=_median(baseline),
            median_ratio=nan,
            fraction_below_fastest_baseline=nan,
            prob_faster=nan,
            tested=False,
        )
    ks = stats.ks_2samp(candidate, baseline, alternative="greater")
    mwu = stats.mannwhitneyu(
        candidate, baseline, alternative="less", method=_mwu_method(candidate, baseline)
    )
    median_candidate = float(np.median(candidate))
    median_baseline = float(np.median(baseline))
    return ArmTest(
        **sizes,
        ks_statistic=float(ks.statistic),
        ks_p=float(ks.pvalue),
        mwu_statistic=float(mwu.statistic),
        mwu_p=float(mwu.pvalue),
        p_value=max(float(ks.pvalue), float(mwu.pvalue)),
        median_candidate_ms=median_candidate,
        median_baseline_ms=median_baseline,
        median_ratio=median_candidate / median_baseline if median_baseline > 0 else math.inf,
        fraction_below_fastest_baseline=float(np.mean(candidate < baseline.min())),
        prob_faster=1.0 - float(mwu.statistic) / (candidate.size * baseline.size),
    )


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input's order.

    Sorted ascending, p_(i) becomes max over j <= i of min(1, (m - j + 1) p_(j)); rejecting
    every hypothesis whose adjusted p is below alpha controls the family-wise error at alpha.
    """
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[index]))
        adjusted[index] = running
    return adjusted


def _median(values: Floats) -> float:
    return float(np.median(values)) if values.size else float("nan")


def _mwu_method(a: Floats, b: Floats) -> str:
    no_ties = np.unique(np.concatenate([a, b])).size == a.size + b.size
    return "exact" if no_ties and max(a.size, b.size) <= _EXACT_MWU_MAX else "asymptotic"

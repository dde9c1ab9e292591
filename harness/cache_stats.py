"""Statistics of the prefix-cache timing probe: which arms were served from a cache.

The probe (`harness.cache_probe`) measures time-to-first-token (TTFT) in arms of trials: a
*miss* arm (fresh prefixes, the negative control) and arms that may be cache hits: the
*same-tenant* arm (the positive control: a tenant re-sends its own prefix, which a working
cache must serve), *cross-tenant* arms (tenant B sends tenant A's prefix) and *spoofed-salt*
arms (B sends A's prefix with A's `cache_salt`). This module decides, per arm, whether it is
faster than its miss baseline, and turns that into a verdict.

One contrast (a candidate arm against its baseline):

- upper outliers (> Q3 + 1.5 IQR) are trimmed from each arm (queueing spikes; CacheProbe);
- one-sided two-sample Kolmogorov-Smirnov (`alternative="greater"`: the candidate's CDF lies
  above the baseline's, as Gu et al.) and one-sided Mann-Whitney U (`alternative="less"`,
  power against a location shift; exact when there are no ties);
- the contrast's p-value is the larger of the two (an intersection-union test: it rejects
  only when both do, and is a level-alpha test without further correction);
- effect sizes: the median ratio (candidate / baseline), the fraction of candidate TTFTs
  below the fastest baseline TTFT, and P(candidate < baseline) = 1 - U / (n1 n2).

The cross-tenant and spoofed-salt contrasts form one family: Holm's step-down correction
controls the family-wise error at `alpha` across tenant pairs. The positive control is a
single test at `alpha`.

Ground truth: where the target reports `usage.prompt_tokens_details.cached_tokens`, a trial
is a *reported hit* when it reports at least half of the shared prefix as cached, and an arm
*says hit* when most of its reporting trials do. An arm is served from cache when timing
says so or the target's own count does; `agreement` compares the two.

Verdict: `found` when any cross-tenant or spoofed-salt arm is served from cache; otherwise
`not_found` when the positive control is (the cache works and the probe can see it), and
`unverifiable` when it is not (cache off, or its effect too small to see): a probe that
cannot see a tenant's own hits proves nothing about isolation.

It deliberately knows nothing about HTTP, prompts or trial order (that is the probe).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from scipy import stats

from harness.finding import Finding, FindingKind, Severity

DEFAULT_ALPHA = 1e-3
"""Family-wise error rate across tenant pairs (Holm); the positive control uses it as is."""
MIN_SAMPLES = 5
"""Fewer valid TTFTs in an arm than this and its contrast is not tested (p = 1)."""
REPORTED_HIT_FRACTION = 0.5
"""A trial is a reported hit when `cached_tokens` covers at least this share of the prefix."""
_EXACT_MWU_MAX = 100

Verdict = Literal["found", "not_found", "unverifiable"]
ArmKind = Literal["same_tenant", "cross_tenant", "spoofed_salt"]

Floats = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class ArmSample:
    """One arm's successful trials: TTFT in milliseconds and the cached tokens reported."""

    ttft_ms: tuple[float, ...]
    cached_tokens: tuple[int | None, ...] = ()

    def __post_init__(self) -> None:
        assert not self.cached_tokens or len(self.cached_tokens) == len(self.ttft_ms)
        assert all(math.isfinite(t) for t in self.ttft_ms), "TTFTs must be finite"


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


@dataclass(frozen=True, slots=True)
class GroundTruth:
    """What the target itself reported as cached for one arm's trials."""

    num_trials: int
    num_reporting: int
    """Trials whose response carried `cached_tokens` at all."""
    num_reported_hits: int
    threshold_tokens: int
    median_cached_tokens: float | None

    @property
    def says_hit(self) -> bool | None:
        """Most reporting trials were hits; None when the target reports nothing."""
        if self.num_reporting == 0:
            return None
        return self.num_reported_hits * 2 > self.num_reporting


@dataclass(frozen=True, slots=True)
class Contrast:
    """One candidate arm against its miss baseline, with its decision."""

    kind: ArmKind
    owner: str
    """The tenant whose prefix was cached first."""
    prober: str
    """The tenant whose timing was measured."""
    test: ArmTest
    p_adjusted: float
    alpha: float
    reported: GroundTruth
    baseline_reported: GroundTruth

    @property
    def timing_hit(self) -> bool:
        return self.test.tested and self.p_adjusted < self.alpha

    @property
    def cache_hit(self) -> bool:
        """Served from cache, by timing or by the target's own count."""
        return self.timing_hit or self.reported.says_hit is True

    @property
    def agreement(self) -> bool | None:
        """Timing and the reported count agree; None where the target reports nothing."""
        says_hit = self.reported.says_hit
        return None if says_hit is None else says_hit == self.timing_hit

    def to_details(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "owner": self.owner,
            "prober": self.prober,
            "timing_hit": self.timing_hit,
            "cache_hit": self.cache_hit,
            "p_adjusted": self.p_adjusted,
            "test": _rounded(self.test),
            "reported": _truth_details(self.reported),
            "baseline_reported": _truth_details(self.baseline_reported),
            "agreement": self.agreement,
        }


@dataclass(frozen=True, slots=True)
class Assessment:
    """The probe's statistical outcome: the verdict, its reasons, every contrast."""

    verdict: Verdict
    alpha: float
    positive_control: Contrast
    contrasts: tuple[Contrast, ...]
    """Cross-tenant and spoofed-salt contrasts (one Holm family)."""
    reasons: tuple[str, ...]

    @property
    def found(self) -> tuple[Contrast, ...]:
        return tuple(c for c in self.contrasts if c.cache_hit)

    @property
    def agreement(self) -> bool | None:
        """Every contrast's timing agrees with the target's count (None: nothing reported)."""
        votes = [c.agreement for c in (self.positive_control, *self.contrasts)]
        known = [v for v in votes if v is not None]
        return all(known) if known else None

    def to_details(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "alpha": self.alpha,
            "correction": f"holm over {len(self.contrasts)} contrasts",
            "test": "one-sided KS and Mann-Whitney U, p = max of the two",
            "reasons": list(self.reasons),
            "positive_control": self.positive_control.to_details(),
            "contrasts": [c.to_details() for c in self.contrasts],
            "agreement": self.agreement,
        }


# -- the tests -------------------------------------------------------------------------


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


def reported_truth(cached_tokens: Sequence[int | None], shared_tokens: int) -> GroundTruth:
    """The target's own count for one arm: hits cover >= half of `shared_tokens`."""
    threshold = max(1, math.ceil(REPORTED_HIT_FRACTION * shared_tokens))
    reported = [c for c in cached_tokens if c is not None]
    return GroundTruth(
        num_trials=len(cached_tokens),
        num_reporting=len(reported),
        num_reported_hits=sum(c >= threshold for c in reported),
        threshold_tokens=threshold,
        median_cached_tokens=float(np.median(reported)) if reported else None,
    )


# -- the verdict -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ArmPair:
    """A candidate arm and its baseline, before testing."""

    kind: ArmKind
    owner: str
    prober: str
    candidate: ArmSample
    baseline: ArmSample


def assess(
    positive_control: ArmPair,
    family: Sequence[ArmPair],
    *,
    shared_tokens: int,
    alpha: float = DEFAULT_ALPHA,
    trim_outliers: bool = True,
) -> Assessment:
    """Test every arm, correct the cross-tenant family with Holm, decide the verdict."""
    assert 0 < alpha < 1, alpha
    assert positive_control.kind == "same_tenant"
    assert all(p.kind != "same_tenant" for p in family)
    tests = [
        compare_arms(p.candidate.ttft_ms, p.baseline.ttft_ms, trim_outliers=trim_outliers)
        for p in (positive_control, *family)
    ]
    adjusted = holm([t.p_value for t in tests[1:]])
    positive = _contrast(positive_control, tests[0], tests[0].p_value, alpha, shared_tokens)
    contrasts = tuple(
        _contrast(pair, test, p, alpha, shared_tokens)
        for pair, test, p in zip(family, tests[1:], adjusted, strict=True)
    )
    verdict, reasons = _verdict(positive, contrasts)
    return Assessment(verdict, alpha, positive, contrasts, reasons)


def _contrast(
    pair: ArmPair, test: ArmTest, p_adjusted: float, alpha: float, shared_tokens: int
) -> Contrast:
    return Contrast(
        kind=pair.kind,
        owner=pair.owner,
        prober=pair.prober,
        test=test,
        p_adjusted=p_adjusted,
        alpha=alpha,
        reported=reported_truth(pair.candidate.cached_tokens, shared_tokens),
        baseline_reported=reported_truth(pair.baseline.cached_tokens, shared_tokens),
    )


def _verdict(positive: Contrast, contrasts: Sequence[Contrast]) -> tuple[Verdict, tuple[str, ...]]:
    reasons = [_describe(c) for c in contrasts if c.cache_hit]
    if reasons:
        if not positive.cache_hit:
            reasons.append("(the positive control did not show the cache, yet these arms did)")
        return "found", tuple(reasons)
    if positive.cache_hit:
        how = "timing" if positive.timing_hit else "the target's cached_tokens"
        return "not_found", (
            f"the positive control shows a working cache ({how}: {_effect(positive)}), and no "
            f"cross-tenant arm was served from it ({len(contrasts)} contrasts, Holm at "
            f"alpha {positive.alpha:g})",
        )
    if not positive.test.tested:
        why = "too few successful requests to test the positive control"
    else:
        why = (
            f"the positive control failed: a tenant re-sending its own prefix was not faster "
            f"({_effect(positive)}, p={positive.p_adjusted:.2g} >= alpha {positive.alpha:g})"
        )
        if positive.reported.says_hit is False:
            why += " and the target reports no cached tokens"
    return "unverifiable", (why + ": the cache is off or its effect is invisible here",)


def _describe(c: Contrast) -> str:
    arm = {
        "cross_tenant": f"{c.prober} re-sending {c.owner}'s prefix",
        "spoofed_salt": f"{c.prober} re-sending {c.owner}'s prefix with {c.owner}'s cache_salt",
        "same_tenant": f"{c.owner} re-sending its own prefix",
    }[c.kind]
    evidence = []
    if c.timing_hit:
        evidence.append(f"timing {_effect(c)}, p={c.p_adjusted:.2g} < alpha {c.alpha:g}")
    if c.reported.says_hit:
        evidence.append(
            f"the target reports {c.reported.num_reported_hits}/{c.reported.num_reporting} "
            "trials as cached"
        )
    return f"{arm} was served from cache: {'; '.join(evidence)}"


def _effect(c: Contrast) -> str:
    t = c.test
    if not t.tested:
        return "not tested"
    return (
        f"median TTFT {t.median_candidate_ms:.1f} ms vs {t.median_baseline_ms:.1f} ms "
        f"(ratio {t.median_ratio:.2f})"
    )


def findings_of(assessment: Assessment, design: dict[str, Any]) -> list[Finding]:
    """One `shared_prefix_cache` finding per arm served from another tenant's cache."""
    findings = []
    for contrast in assessment.found:
        findings.append(
            Finding(
                kind=FindingKind.SHARED_PREFIX_CACHE,
                severity=Severity.HIGH,
                detector="cache_probe",
                request_id=None,
                tenant=contrast.prober,
                victim_tenant=contrast.owner,
                summary=_describe(contrast),
                details={
                    "contrast": contrast.to_details(),
                    "assessment": assessment.to_details(),
                    "design": design,
                },
            )
        )
    return findings


def _median(values: Floats) -> float:
    return float(np.median(values)) if values.size else float("nan")


def _mwu_method(a: Floats, b: Floats) -> str:
    no_ties = np.unique(np.concatenate([a, b])).size == a.size + b.size
    return "exact" if no_ties and max(a.size, b.size) <= _EXACT_MWU_MAX else "asymptotic"


def _rounded(test: ArmTest) -> dict[str, Any]:
    """JSON-ready: floats kept as they are (p-values can be tiny), NaN and inf as None."""
    return {
        name: (None if isinstance(value, float) and not math.isfinite(value) else value)
        for name, value in dataclasses.asdict(test).items()
    }


def _truth_details(truth: GroundTruth) -> dict[str, Any]:
    return {
        "num_trials": truth.num_trials,
        "num_reporting": truth.num_reporting,
        "num_reported_hits": truth.num_reported_hits,
        "threshold_tokens": truth.threshold_tokens,
        "median_cached_tokens": truth.median_cached_tokens,
        "says_hit": truth.says_hit,
    }

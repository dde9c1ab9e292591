"""The probe's statistics on synthetic TTFT distributions, Holm by hand, and the verdicts."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats

from kvcanary.harness.cache_probe.stats import (
    ArmPair,
    ArmSample,
    assess,
    compare_arms,
    findings_of,
    holm,
    reported_truth,
    trim_upper_outliers,
)
from kvcanary.harness.record.finding import FindingKind, Severity

RNG_SEED = 20260


def ttfts(median_ms: float, n: int, rng: np.random.Generator, cv: float = 0.2) -> list[float]:
    """Lognormal TTFTs: the right-skewed shape real TTFTs have."""
    return list(median_ms * np.exp(rng.normal(0.0, cv, n)))


def test_holm_matches_a_hand_computation() -> None:
    # sorted: 0.005 x4 = 0.02; 0.01 x3 = 0.03; 0.03 x2 = 0.06; 0.04 x1 = 0.04 -> max(0.06, 0.04)
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])  # capped at 1
    assert holm([0.001]) == [0.001]
    assert holm([]) == []


@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=12))
def test_holm_is_monotone_bounded_and_never_below_the_raw_p(p_values: list[float]) -> None:
    adjusted = holm(p_values)
    m = len(p_values)
    assert all(p <= a <= 1.0 for p, a in zip(p_values, adjusted, strict=True))
    assert all(a <= min(1.0, m * p) for p, a in zip(p_values, adjusted, strict=True))
    ranked = sorted(range(m), key=lambda i: p_values[i])
    assert all(adjusted[i] <= adjusted[j] for i, j in itertools.pairwise(ranked))


def test_a_clear_speedup_is_significant_with_its_effect_sizes() -> None:
    rng = np.random.default_rng(RNG_SEED)
    hit, miss = ttfts(20.0, 20, rng), ttfts(100.0, 20, rng)

    test = compare_arms(hit, miss, trim_outliers=False)

    assert test.tested
    assert test.p_value < 1e-8
    assert test.p_value == max(test.ks_p, test.mwu_p)
    assert test.median_ratio == pytest.approx(np.median(hit) / np.median(miss))
    assert test.median_ratio < 0.3
    assert test.fraction_below_fastest_baseline == 1.0
    assert test.prob_faster == 1.0


def test_the_tests_are_scipys_one_sided_tests() -> None:
    rng = np.random.default_rng(RNG_SEED + 1)
    hit, miss = ttfts(80.0, 15, rng), ttfts(100.0, 15, rng)

    test = compare_arms(hit, miss, trim_outliers=False)

    assert test.ks_p == pytest.approx(stats.ks_2samp(hit, miss, alternative="greater").pvalue)
    expected = stats.mannwhitneyu(hit, miss, alternative="less", method="exact")
    assert test.mwu_p == pytest.approx(expected.pvalue)
    fraction_faster = np.mean([h < m for h in hit for m in miss])
    assert test.prob_faster == pytest.approx(fraction_faster)


def test_a_slower_arm_is_not_significant_one_sided() -> None:
    rng = np.random.default_rng(RNG_SEED + 2)
    test = compare_arms(ttfts(100.0, 20, rng), ttfts(20.0, 20, rng))
    assert test.p_value > 0.5


def test_identical_distributions_rarely_reject() -> None:
    rng = np.random.default_rng(RNG_SEED + 3)
    alpha = 0.05
    p_values = [compare_arms(ttfts(50, 20, rng), ttfts(50, 20, rng)).p_value for _ in range(300)]
    rejections = sum(p < alpha for p in p_values)
    # a level-0.05 test: at most ~15 of 300 by chance (binomial upper tail ~1e-3 above 25)
    assert rejections <= 25


def test_slow_outliers_are_trimmed_from_each_arm() -> None:
    values = [10.0, 11.0, 12.0, 10.5, 11.5, 500.0]
    assert list(trim_upper_outliers(values)) == [10.0, 11.0, 12.0, 10.5, 11.5]
    assert list(trim_upper_outliers([1.0, 2.0, 900.0])) == [1.0, 2.0, 900.0]  # too few

    rng = np.random.default_rng(RNG_SEED + 4)
    hit, miss = ttfts(20, 20, rng), ttfts(100, 20, rng)
    test = compare_arms([*hit, 5000.0], miss)
    assert test.num_candidate_trimmed == 1
    assert test.fraction_below_fastest_baseline == 1.0


def test_too_few_samples_are_not_tested() -> None:
    test = compare_arms([1.0, 2.0, 3.0], [10.0] * 20)
    assert not test.tested
    assert test.p_value == 1.0


def test_reported_cached_tokens_count_hits_at_half_the_shared_prefix() -> None:
    truth = reported_truth([896, 448, 447, 0, None], 896)
    assert truth.threshold_tokens == 448
    assert truth.num_reporting == 4
    assert truth.num_reported_hits == 2
    assert truth.says_hit is False  # 2 of 4 is not a majority
    assert reported_truth([None, None], 896).says_hit is None
    assert reported_truth([896, 896, 0], 896).says_hit is True


def test_a_reported_count_is_evidence_only_beyond_the_miss_arms() -> None:
    """A disaggregated decode reports what it loaded from prefill as cached on every request,
    and a shared chat template is cached for everyone: only the excess counts."""
    loaded = reported_truth([1008, 1008, 1000], 896, control=[1008, 992, 1008])
    assert loaded.control_median == 1008
    assert loaded.num_reported_hits == 0
    assert loaded.says_hit is False
    beyond = reported_truth([912, 912, 16], 896, control=[16, 16, 0])
    assert beyond.num_reported_hits == 2  # 896 beyond the template's 16
    assert beyond.says_hit is True
    assert reported_truth([1008], 896, control=[None, None]).says_hit is None  # a silent control


def test_a_pd_count_on_every_arm_makes_no_finding() -> None:
    rng = np.random.default_rng(RNG_SEED + 10)
    miss = arm(100, rng, 1008)
    positive = ArmPair("same_tenant", "*", "*", arm(20, rng, 1008), miss)
    cross = ArmPair("cross_tenant", "a", "b", arm(100, rng, 1008), miss)

    result = assess(positive, [cross], shared_tokens=896)

    assert result.verdict == "clean"
    assert findings_of(result, {}) == []
    assert result.contrasts[0].baseline_reported.says_hit is True  # alone it looks cached


def arm(median_ms: float, rng: np.random.Generator, cached: int | None, n: int = 20) -> ArmSample:
    return ArmSample(tuple(ttfts(median_ms, n, rng)), (cached,) * n)


def test_verdicts_found_not_found_unverifiable() -> None:
    rng = np.random.default_rng(RNG_SEED + 5)
    miss = arm(100, rng, 0)
    fast, slow = arm(20, rng, None), arm(100, rng, None)
    positive = ArmPair("same_tenant", "*", "*", fast, miss)
    no_cache = ArmPair("same_tenant", "*", "*", slow, miss)
    isolated = [ArmPair("cross_tenant", "a", "b", arm(100, rng, None), miss)]
    shared = [*isolated, ArmPair("cross_tenant", "b", "a", arm(20, rng, None), miss)]

    found = assess(positive, shared, shared_tokens=896)
    assert found.verdict == "leak"
    assert [(c.owner, c.prober) for c in found.found] == [("b", "a")]
    assert found.contrasts[1].p_adjusted == pytest.approx(
        min(1.0, 2 * found.contrasts[1].test.p_value)
    )

    clean = assess(positive, isolated, shared_tokens=896)
    assert clean.verdict == "clean"
    assert "positive control shows a working cache" in clean.reasons[0]

    blind = assess(no_cache, isolated, shared_tokens=896)
    assert blind.verdict == "inconclusive"
    assert blind.found == ()


def test_identical_arms_never_make_a_finding() -> None:
    rng = np.random.default_rng(RNG_SEED + 6)
    for _ in range(20):
        miss = arm(50, rng, None)
        family = [ArmPair("cross_tenant", "a", "b", arm(50, rng, None), miss)]
        result = assess(
            ArmPair("same_tenant", "*", "*", arm(50, rng, None), miss), family, shared_tokens=64
        )
        assert result.verdict == "inconclusive"
        assert findings_of(result, {}) == []


def test_a_significant_sliver_of_speed_is_no_cache_hit() -> None:
    """On a target with almost no jitter a re-sent text's incidental warmth (0.2 % here) is
    significant to the rank tests; without the minimum saving it would be a leak."""
    rng = np.random.default_rng(RNG_SEED + 9)
    miss = ArmSample(tuple(ttfts(100.0, 20, rng, cv=1e-4)))
    warm = ArmSample(tuple(ttfts(99.8, 20, rng, cv=1e-4)))
    cross = ArmPair("cross_tenant", "a", "b", warm, miss)
    positive = ArmPair("same_tenant", "*", "*", warm, miss)

    result = assess(positive, [cross], shared_tokens=896)

    assert result.positive_control.significant  # the rank tests see it ...
    assert result.contrasts[0].significant
    assert not result.contrasts[0].timing_hit  # ... but it is no cache
    assert result.verdict == "inconclusive"
    assert "saving under 5% of the miss median" in result.reasons[0]
    assert findings_of(result, {}) == []


def test_ground_truth_alone_can_show_the_cache_and_agreement_is_reported() -> None:
    rng = np.random.default_rng(RNG_SEED + 7)
    miss = arm(100, rng, 0)
    positive = ArmPair("same_tenant", "*", "*", arm(100, rng, 896), miss)  # cached, not faster
    cross = ArmPair("cross_tenant", "a", "b", arm(100, rng, 0), miss)

    result = assess(positive, [cross], shared_tokens=896)

    assert result.verdict == "clean"
    assert "cached_tokens" in result.reasons[0]
    assert result.positive_control.agreement is False
    assert result.contrasts[0].agreement is True
    assert result.agreement is False


def test_findings_carry_the_statistics() -> None:
    rng = np.random.default_rng(RNG_SEED + 8)
    miss = arm(100, rng, 0)
    positive = ArmPair("same_tenant", "*", "*", arm(20, rng, 896), miss)
    cross = ArmPair("spoofed_salt", "alice", "bob", arm(20, rng, 896), miss)
    result = assess(positive, [cross], shared_tokens=896, alpha=1e-3)

    (finding,) = findings_of(result, {"num_trials": 20})

    # only the borrowed salt let bob in (no plain cross-tenant arm was served)
    assert finding.kind == FindingKind.CACHE_SALT_NOT_BOUND
    assert result.verdict == "unsafe"
    assert finding.severity == Severity.HIGH
    assert (finding.tenant, finding.victim_tenant) == ("bob", "alice")
    assert "with alice's cache_salt" in finding.summary
    contrast = finding.details["contrast"]
    assert contrast["test"]["p_value"] < 1e-3
    assert contrast["agreement"] is True
    assert finding.details["assessment"]["alpha"] == 1e-3
    assert finding.details["design"] == {"num_trials": 20}

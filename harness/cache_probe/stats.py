"""Statistics of the prefix-cache timing probe: which arms were served from a cache.

The probe (`harness.cache_probe.probe`) measures time-to-first-token (TTFT) in arms of trials: a
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
  below the fastest baseline TTFT, and P(candidate < baseline) = 1 - U / (n1 n2);
- an arm is a *timing hit* only when it is both significant and worth the name: its median
  TTFT at least `MIN_SAVING` below the baseline's. A prefix-cache hit skips most of a
  prefill; a re-sent text is also a little faster for reasons that are no cache of KV (a
  tokenizer's word cache, warm CPU caches), and on a target with little jitter the rank
  tests find that systematic sliver significant.

The cross-tenant and spoofed-salt contrasts form one family: Holm's step-down correction
controls the family-wise error at `alpha` across tenant pairs. The positive control is a
single test at `alpha`.

The target's own witnesses: `usage.prompt_tokens_details.cached_tokens` per request, and
where the engine exposes them, its prefix-cache counters (`harness.cache_probe.counters`),
read around each timed request. A count is evidence only by how much it exceeds the miss
arm's: a disaggregated engine's decode reports the KV it loaded from prefill as cached on
every request, the miss arm included, and a chat template's common prefix is cached for
everyone. A trial is a *witnessed hit* when its count exceeds the miss arm's median by at
least half of the shared prefix, and a witness *says hit* for an arm when most of the arm's
reporting trials are. An arm is served from cache when timing says so or a witness does;
`agreement` compares them.

Verdict (`harness.record.verdict.Verdict`): `leak` when a cross-tenant arm is served from
cache (a `shared_prefix_cache` finding; a spoofed-salt arm of the same pair counts as the
same sharing); `unsafe` when only spoofed-salt arms are (`cache_salt_not_bound`: the cache is
keyed by a salt the client chooses, not by its credential, so anyone who learns a tenant's
salt reads its cache); otherwise `clean` when the positive control is served from cache (the
cache works and the probe can see it), and `inconclusive` when it is not (cache off, or its
effect too small to see): a probe that cannot see a tenant's own hits proves nothing about
isolation.

It deliberately knows nothing about HTTP, prompts or trial order (that is the probe).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvcanary.harness.cache_probe.significance import (
    MIN_SAMPLES,
    ArmTest,
    compare_arms,
    holm,
    trim_upper_outliers,
)
from kvcanary.harness.cache_probe.witness import GroundTruth, reported_truth
from kvcanary.harness.record.finding import Finding, FindingKind
from kvcanary.harness.record.verdict import Verdict

DEFAULT_ALPHA = 1e-3
"""Family-wise error rate across tenant pairs (Holm); the positive control uses it as is."""
MIN_SAVING = 0.05
"""A timing hit's median TTFT is at least this fraction below its miss baseline's. A cache
hit on the default 87.5 % prefix skips most of a prefill; a re-sent text's incidental warmth
(a tokenizer's cache, warm CPU caches) saves well under 1 %."""

ArmKind = Literal["same_tenant", "cross_tenant", "spoofed_salt"]


@dataclass(frozen=True, slots=True)
class ArmSample:
    """One arm's successful trials: TTFT in milliseconds and what the target counted."""

    ttft_ms: tuple[float, ...]
    cached_tokens: tuple[int | None, ...] = ()
    counted_hits: tuple[float | None, ...] = ()
    """The engine's prefix-cache hit counter's increase over each timed request (None: not
    read); empty where the target has no counters."""

    def __post_init__(self) -> None:
        assert not self.cached_tokens or len(self.cached_tokens) == len(self.ttft_ms)
        assert not self.counted_hits or len(self.counted_hits) == len(self.ttft_ms)
        assert all(math.isfinite(t) for t in self.ttft_ms), "TTFTs must be finite"


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
    """`cached_tokens`, against the miss arm's."""
    baseline_reported: GroundTruth
    """The miss arm's own `cached_tokens`, as reported."""
    counted: GroundTruth
    """The engine's prefix-cache counters, against the miss arm's."""

    @property
    def significant(self) -> bool:
        return self.test.tested and self.p_adjusted < self.alpha

    @property
    def timing_hit(self) -> bool:
        """Significantly faster than the baseline, and by at least `MIN_SAVING`."""
        return self.significant and self.test.median_ratio <= 1.0 - MIN_SAVING

    @property
    def witnessed_by(self) -> tuple[str, ...]:
        """The target's own counts that say this arm was served from cache."""
        said = (("cached_tokens", self.reported), ("prefix-cache counters", self.counted))
        return tuple(name for name, truth in said if truth.says_hit is True)

    @property
    def cache_hit(self) -> bool:
        """Served from cache, by timing or by one of the target's own counts."""
        return self.timing_hit or bool(self.witnessed_by)

    @property
    def agreement(self) -> bool | None:
        """Timing and every count the target reported agree; None where it reports none."""
        votes = [t.says_hit for t in (self.reported, self.counted) if t.says_hit is not None]
        return None if not votes else all(v == self.timing_hit for v in votes)

    def to_details(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "owner": self.owner,
            "prober": self.prober,
            "timing_hit": self.timing_hit,
            "cache_hit": self.cache_hit,
            "p_adjusted": self.p_adjusted,
            "test": _rounded(self.test),
            "reported": self.reported.to_details(),
            "baseline_reported": self.baseline_reported.to_details(),
            "counted": self.counted.to_details(),
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
        """Every contrast's timing agrees with the target's counts (None: nothing reported)."""
        votes = [c.agreement for c in (self.positive_control, *self.contrasts)]
        known = [v for v in votes if v is not None]
        return all(known) if known else None

    def kind_of(self, contrast: Contrast) -> FindingKind:
        """What an arm served from another tenant's cache shows (`finding_kind`)."""
        return finding_kind(contrast, self.contrasts)

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


def finding_kind(contrast: Contrast, contrasts: Sequence[Contrast]) -> FindingKind:
    """`cache_salt_not_bound` for a spoofed-salt arm served from cache while the same pair's
    plain cross-tenant arm was not: the borrowed salt, not a cache shared by everyone, let the
    prober in. Every other hit is `shared_prefix_cache`."""
    if contrast.kind != "spoofed_salt":
        return FindingKind.SHARED_PREFIX_CACHE
    pair = (contrast.owner, contrast.prober)
    shared = any(
        c.kind == "cross_tenant" and (c.owner, c.prober) == pair and c.cache_hit for c in contrasts
    )
    return FindingKind.SHARED_PREFIX_CACHE if shared else FindingKind.CACHE_SALT_NOT_BOUND


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
    candidate, baseline = pair.candidate, pair.baseline
    return Contrast(
        kind=pair.kind,
        owner=pair.owner,
        prober=pair.prober,
        test=test,
        p_adjusted=p_adjusted,
        alpha=alpha,
        reported=reported_truth(candidate.cached_tokens, shared_tokens, baseline.cached_tokens),
        baseline_reported=reported_truth(baseline.cached_tokens, shared_tokens),
        counted=reported_truth(candidate.counted_hits, shared_tokens, baseline.counted_hits),
    )


def _verdict(positive: Contrast, contrasts: Sequence[Contrast]) -> tuple[Verdict, tuple[str, ...]]:
    found = [c for c in contrasts if c.cache_hit]
    if found:
        reasons = [_describe(c, finding_kind(c, contrasts)) for c in found]
        if not positive.cache_hit:
            reasons.append("(the positive control did not show the cache, yet these arms did)")
        shared = any(finding_kind(c, contrasts) == FindingKind.SHARED_PREFIX_CACHE for c in found)
        return (Verdict.LEAK if shared else Verdict.UNSAFE), tuple(reasons)
    if positive.cache_hit:
        how = "timing" if positive.timing_hit else f"the target's {positive.witnessed_by[0]}"
        return Verdict.CLEAN, (
            f"the positive control shows a working cache ({how}: {_effect(positive)}), and no "
            f"cross-tenant arm was served from it ({len(contrasts)} contrasts, Holm at "
            f"alpha {positive.alpha:g})",
        )
    if not positive.test.tested:
        why = "too few successful requests to test the positive control"
    else:
        test = (
            f"saving under {MIN_SAVING:.0%} of the miss median"
            if positive.significant
            else f"p={positive.p_adjusted:.2g} >= alpha {positive.alpha:g}"
        )
        why = (
            f"the positive control failed: a tenant re-sending its own prefix was not faster "
            f"({_effect(positive)}, {test})"
        )
        if positive.reported.says_hit is False:
            why += " and the target reports no more cached tokens than for a miss"
    return Verdict.INCONCLUSIVE, (why + ": the cache is off or its effect is invisible here",)


def _describe(c: Contrast, kind: FindingKind = FindingKind.SHARED_PREFIX_CACHE) -> str:
    arm = {
        "cross_tenant": f"{c.prober} re-sending {c.owner}'s prefix",
        "spoofed_salt": f"{c.prober} re-sending {c.owner}'s prefix with {c.owner}'s cache_salt",
        "same_tenant": f"{c.owner} re-sending its own prefix",
    }[c.kind]
    evidence = []
    if c.timing_hit:
        evidence.append(f"timing {_effect(c)}, p={c.p_adjusted:.2g} < alpha {c.alpha:g}")
    for name, truth in (("cached_tokens", c.reported), ("prefix-cache counters", c.counted)):
        if truth.says_hit:
            evidence.append(
                f"the target's {name} show {truth.num_reported_hits}/{truth.num_reporting} "
                f"trials as cached beyond the miss arm's {truth.control_median:g} tokens"
            )
    meaning = ""
    if kind == FindingKind.CACHE_SALT_NOT_BOUND:
        meaning = (
            f" (the salt is not bound to the credential: anyone who learns {c.owner}'s "
            "cache_salt reads its cache)"
        )
    return f"{arm} was served from cache{meaning}: {'; '.join(evidence)}"


def _effect(c: Contrast) -> str:
    t = c.test
    if not t.tested:
        return "not tested"
    return (
        f"median TTFT {t.median_candidate_ms:.1f} ms vs {t.median_baseline_ms:.1f} ms "
        f"(ratio {t.median_ratio:.2f})"
    )


def findings_of(assessment: Assessment, design: dict[str, Any]) -> list[Finding]:
    """One finding per arm served from another tenant's cache: `shared_prefix_cache`, or
    `cache_salt_not_bound` where only a borrowed salt let the prober in."""
    findings = []
    for contrast in assessment.found:
        kind = assessment.kind_of(contrast)
        findings.append(
            Finding(
                kind=kind,
                severity=kind.severity,
                detector="cache_probe",
                request_id=None,
                tenant=contrast.prober,
                victim_tenant=contrast.owner,
                summary=_describe(contrast, kind),
                details={
                    "contrast": contrast.to_details(),
                    "assessment": assessment.to_details(),
                    "design": design,
                },
            )
        )
    return findings


def _rounded(test: ArmTest) -> dict[str, Any]:
    """JSON-ready: floats kept as they are (p-values can be tiny), NaN and inf as None."""
    return {
        name: (None if isinstance(value, float) and not math.isfinite(value) else value)
        for name, value in dataclasses.asdict(test).items()
    }


__all__ = [
    "DEFAULT_ALPHA",
    "MIN_SAMPLES",
    "MIN_SAVING",
    "ArmKind",
    "ArmPair",
    "ArmSample",
    "ArmTest",
    "Assessment",
    "Contrast",
    "GroundTruth",
    "assess",
    "compare_arms",
    "finding_kind",
    "findings_of",
    "holm",
    "reported_truth",
    "trim_upper_outliers",
]

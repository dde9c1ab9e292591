"""The timing detector on synthetic TTFTs with realistic noise."""

from __future__ import annotations

import random

import pytest
from detector_factories import make_obs, make_plan

from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.detectors import TimingDetector, TtftModel
from kvcanary.harness.record.finding import Finding, FindingKind, Severity

INTERCEPT_MS = 12.0
MS_PER_TOKEN = 0.06
SIZES = (64, 128, 256, 512, 1024, 1536, 2000, 2048)


def honest_ttft(rng: random.Random, num_tokens: int) -> float:
    """Prefill time plus client jitter, plus a heavy queueing tail on some requests."""
    ttft = INTERCEPT_MS + MS_PER_TOKEN * num_tokens
    ttft *= rng.lognormvariate(0.0, 0.05)
    ttft += abs(rng.gauss(0.0, 1.5))
    if rng.random() < 0.15:
        ttft += rng.expovariate(1 / 150.0)  # queued behind other prefills
    return ttft


class Traffic:
    """Feeds a detector numbered requests and collects every finding it returns."""

    def __init__(self, detector: TimingDetector, seed: int = 0) -> None:
        self.detector = detector
        self.rng = random.Random(seed)
        self.count = 0
        self.findings: list[Finding] = []

    def send(
        self,
        num_tokens: int,
        ttft_ms: float | None = None,
        *,
        expected: str = "accept",
        prompt_tokens: int | None = -1,
        status: int = 200,
    ) -> str:
        self.count += 1
        request_id = f"t{self.count % 4}-r{self.count:06d}"
        plan = make_plan(
            request_id,
            tenant=f"tenant-{self.count % 4}",
            num_prompt_tokens=num_tokens,
            expected=expected,
        )
        if ttft_ms is None:
            ttft_ms = honest_ttft(self.rng, num_tokens)
        obs = make_obs(plan, status=status, ttft_ms=ttft_ms, prompt_tokens=prompt_tokens)
        self.findings += self.detector.observe(plan, obs)
        return request_id

    def honest(self, n: int) -> None:
        for _ in range(n):
            self.send(self.rng.choice(SIZES))

    def finish(self) -> list[Finding]:
        final = self.detector.finish()
        self.findings += final
        return final


def flagged(findings: list[Finding]) -> set[str]:
    return {f.request_id for f in findings if f.request_id is not None}


def test_clean_run_of_2000_requests_gives_no_findings() -> None:
    traffic = Traffic(TimingDetector(), seed=1)
    for i in range(2000):
        if i % 10 == 0:  # over-limit probes that a safe target rejects
            traffic.send(3000, expected="reject", status=400, prompt_tokens=None)
        else:
            traffic.send(traffic.rng.choice(SIZES))
    traffic.finish()
    assert traffic.findings == []
    model = traffic.detector.model
    assert model is not None
    assert model.ms_per_token == pytest.approx(MS_PER_TOKEN, rel=0.15)


def test_fast_answers_to_long_prompts_are_flagged_and_slow_ones_are_not() -> None:
    traffic = Traffic(TimingDetector(), seed=2)
    traffic.honest(200)
    fast_long = traffic.send(2000, ttft_ms=INTERCEPT_MS + 1.0)
    slow_long = traffic.send(2000, ttft_ms=5 * (INTERCEPT_MS + MS_PER_TOKEN * 2000))
    fast_short = traffic.send(64, ttft_ms=1.0)  # short prompts cannot be "too fast"
    assert flagged(traffic.findings) == {fast_long}
    traffic.finish()
    assert flagged(traffic.findings) == {fast_long}
    assert slow_long not in flagged(traffic.findings)
    assert fast_short not in flagged(traffic.findings)


def test_finding_explains_itself() -> None:
    traffic = Traffic(TimingDetector(), seed=3)
    traffic.honest(100)
    traffic.send(2048, ttft_ms=10.0)
    [finding] = traffic.findings
    assert finding.kind is FindingKind.FAST_PREFILL
    assert finding.severity is Severity.HIGH
    assert finding.detector == "timing"
    details = finding.details
    assert details["ttft_ms"] == pytest.approx(10.0)
    assert details["num_prompt_tokens"] == 2048
    assert details["predicted_ms"] == pytest.approx(INTERCEPT_MS + MS_PER_TOKEN * 2048, rel=0.2)
    assert details["threshold_ms"] < details["lower_bound_ms"] < details["predicted_ms"]
    assert details["ttft_ms"] < details["threshold_ms"]
    assert details["evaluated"] == "online"
    assert "rule" in details["model"]
    assert "2048-token prompt" in finding.summary
    assert "10.0 ms" in finding.summary


def test_fast_over_limit_probes_are_flagged_without_poisoning_the_fit() -> None:
    """A vulnerable target answers over-limit probes fast with usage 1; 40% of traffic."""
    traffic = Traffic(TimingDetector(), seed=4)
    probes = set()
    for i in range(500):
        if i % 5 < 2:
            probes.add(traffic.send(3000, ttft_ms=13.0, expected="reject", prompt_tokens=1))
        else:
            traffic.send(traffic.rng.choice(SIZES))
    traffic.finish()
    assert flagged(traffic.findings) == probes
    model = traffic.detector.model
    assert model is not None
    assert model.ms_per_token == pytest.approx(MS_PER_TOKEN, rel=0.15)


def test_accepted_plans_with_inconsistent_usage_stay_out_of_the_fit() -> None:
    traffic = Traffic(TimingDetector(), seed=5)
    traffic.honest(50)
    for _ in range(200):  # under-limit prompts the target did not really prefill
        traffic.send(2048, ttft_ms=12.0, prompt_tokens=1)
    model = traffic.detector.model
    assert model is not None
    assert model.ms_per_token == pytest.approx(MS_PER_TOKEN, rel=0.2)
    assert len(flagged(traffic.findings)) == 200


def test_responses_before_the_first_fit_are_judged_once_at_finish() -> None:
    traffic = Traffic(TimingDetector(min_samples=20), seed=6)
    early = traffic.send(2000, ttft_ms=12.0, prompt_tokens=None, expected="reject")
    traffic.honest(100)
    late = traffic.send(2000, ttft_ms=12.0, prompt_tokens=None, expected="reject")
    assert flagged(traffic.findings) == {late}
    final = traffic.finish()
    assert flagged(final) == {early}
    assert final[0].details["evaluated"] == "final"
    assert traffic.finish() == []  # finishing again never repeats a finding


def test_no_model_without_two_prompt_lengths() -> None:
    detector = TimingDetector()
    traffic = Traffic(detector)
    for _ in range(50):
        traffic.send(1024)
    traffic.send(1024, ttft_ms=0.5)
    assert detector.finish() == []
    assert detector.model is None


def test_no_model_below_min_samples() -> None:
    traffic = Traffic(TimingDetector(min_samples=8))
    traffic.honest(7)
    assert traffic.finish() == []
    assert traffic.detector.model is None


def test_retention_cap_keeps_the_suspicious_candidates() -> None:
    traffic = Traffic(TimingDetector(min_samples=20, max_retained=40), seed=7)
    early = {traffic.send(2000, ttft_ms=12.0, expected="reject", prompt_tokens=1) for _ in range(3)}
    traffic.honest(1000)
    traffic.finish()
    assert flagged(traffic.findings) == early


def test_model_rule_arithmetic() -> None:
    model = TtftModel(
        intercept_ms=10.0,
        ms_per_token=0.1,
        scale_ms=2.0,
        num_samples=100,
        num_sigmas=4.0,
        fraction=0.5,
        min_prefill_ms=5.0,
    )
    assert model.predict(1000) == pytest.approx(110.0)
    assert model.lower_bound(1000) == pytest.approx(102.0)
    assert model.threshold(1000) == pytest.approx(55.0)  # half of 10 + 0.1 * 1000
    # eligible from max(prefill 5 / 0.1 = 50, bar above the intercept 10 * 0.5 / 0.05 = 100,
    # real prefill 4 scales above the bar (8 - 5) / 0.05 = 60) = 100 tokens
    assert model.min_eligible_tokens == pytest.approx(100.0)
    assert not model.eligible(99)
    assert model.eligible(100)
    assert model.is_fast(1000, 54.9)
    assert not model.is_fast(1000, 55.1)
    low = TtftModel.from_dict({**model.to_dict(), "ms_per_token_low": 0.05})
    assert low.threshold(1000) == pytest.approx(30.0)  # the slope's lower bound is used
    assert model.to_dict()["num_samples"] == 100


@pytest.mark.parametrize(
    "kwargs", [{"min_samples": 2}, {"fraction": 1.0}, {"num_sigmas": 0}, {"max_fit_samples": 4}]
)
def test_bad_parameters_are_config_errors(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        TimingDetector(**kwargs)  # type: ignore[arg-type]


def test_one_sided_contention_delays_do_not_disable_the_check() -> None:
    """CPU contention only ever slows a first token; it must not hide a skipped prefill."""
    rng = random.Random(7)
    traffic = Traffic(TimingDetector(), seed=7)
    for _ in range(120):
        num_tokens = rng.choice(SIZES)
        ttft = INTERCEPT_MS + MS_PER_TOKEN * num_tokens + abs(rng.gauss(0.0, 1.0))
        if rng.random() < 0.6:  # a loaded machine: most requests wait a little
            ttft += rng.expovariate(1 / 30.0)
        traffic.send(num_tokens, ttft)
    skipped = traffic.send(2048, ttft_ms=INTERCEPT_MS + 1.0, expected="reject")
    traffic.finish()
    assert flagged(traffic.findings) == {skipped}


def hogged_ttft(rng: random.Random, num_tokens: int) -> float:
    """Both cores busy: every first token waits, by a lot and by varying amounts."""
    ttft = (INTERCEPT_MS + MS_PER_TOKEN * num_tokens) * rng.uniform(1.2, 2.0)
    return ttft + rng.expovariate(1 / 20.0)


HOG_SIZES = (*SIZES, 3072, 4096)


def test_under_a_cpu_hog_skipped_prefills_within_the_context_are_still_flagged() -> None:
    """The spread of a loaded machine must not push the bar below zero or past the context.

    (The rule before this one, `intercept + f * slope * n - k * scale`, judged such a fit only
    from about 5,000 tokens on: above a 4,096-token context, so it passed vacuously.)
    """
    for seed in range(3):
        rng = random.Random(seed)
        traffic = Traffic(TimingDetector(), seed=seed)
        for _ in range(200):
            num_tokens = rng.choice(HOG_SIZES)
            traffic.send(num_tokens, hogged_ttft(rng, num_tokens))
        skipped = {
            traffic.send(4096, ttft_ms=hogged_ttft(rng, 1), expected="reject", prompt_tokens=1)
            for _ in range(6)
        }
        traffic.finish()
        model = traffic.detector.model
        assert model is not None
        assert model.threshold(4096) > 0
        assert model.min_eligible_tokens < 4096
        assert flagged(traffic.findings) == skipped, seed
        assert traffic.detector.not_judged is None


def test_real_prefills_under_a_cpu_hog_are_never_flagged() -> None:
    for seed in range(5):
        rng = random.Random(seed)
        traffic = Traffic(TimingDetector(), seed=seed)
        for i in range(300):
            num_tokens = rng.choice(HOG_SIZES)
            hog = i % 50 < 25  # the hog comes and goes
            ttft = hogged_ttft(rng, num_tokens) if hog else honest_ttft(rng, num_tokens)
            traffic.send(num_tokens, ttft)
        traffic.finish()
        assert traffic.findings == [], seed


def test_no_online_judgement_from_a_fit_of_the_first_few_answers() -> None:
    """The first batch, all slowed by contention, fits a line far above the real one; an
    honest answer judged against it online would be a false alarm. It waits for the end."""
    traffic = Traffic(TimingDetector(min_samples=8, min_online_samples=32), seed=3)
    for num_tokens in SIZES * 2:  # 16 answers, all five times slower than they will be
        traffic.send(num_tokens, 5 * (INTERCEPT_MS + MS_PER_TOKEN * num_tokens))
    early = traffic.send(2048, INTERCEPT_MS + MS_PER_TOKEN * 2048)  # a real, unslowed prefill
    assert traffic.findings == []
    traffic.honest(400)
    traffic.finish()
    assert early not in flagged(traffic.findings)


def test_not_judged_says_why() -> None:
    detector = TimingDetector()
    assert detector.not_judged is not None
    assert "no TTFT fit" in detector.not_judged
    traffic = Traffic(detector, seed=5)
    for _ in range(100):
        traffic.send(traffic.rng.choice((16, 24, 32)))  # prompts far too short to time
    traffic.finish()
    reason = detector.not_judged
    assert reason is not None
    assert "the longest answered prompt had 32" in reason


def test_over_limit_answers_too_short_for_the_rule_are_not_judged() -> None:
    """An answered over-limit prompt the rule cannot judge must be said, not passed."""
    traffic = Traffic(TimingDetector(), seed=9)
    traffic.honest(200)
    traffic.send(32, ttft_ms=INTERCEPT_MS, expected="reject", prompt_tokens=1)
    traffic.finish()
    reason = traffic.detector.not_judged
    assert reason is not None
    assert reason.startswith("1 of 1 answered over-limit prompt(s) are too short")


def test_answers_before_the_online_minimum_are_deferred_until_finish() -> None:
    """`is_deferred`: judged only at the end because the fit was too small online; an answer
    seen once the fit can judge, or flagged already, is not."""
    traffic = Traffic(TimingDetector(min_samples=8, min_online_samples=32), seed=5)
    first = traffic.send(2048, 1.0)  # no fit at all yet
    traffic.honest(10)
    early = traffic.send(2048, 1.0)  # a fit of 10 samples: too small to judge online
    assert traffic.findings == []
    assert traffic.detector.is_deferred(first)
    assert traffic.detector.is_deferred(early)
    traffic.honest(60)
    late = traffic.send(2048, 1.0)  # judged online, flagged at once
    assert late in flagged(traffic.findings)
    assert not traffic.detector.is_deferred(late)
    honest = traffic.send(1024)  # judged online, not flagged: not deferred either
    assert not traffic.detector.is_deferred(honest)
    final = traffic.finish()
    assert {first, early} <= flagged(final)
    assert {f.details["evaluated"] for f in final} == {"final"}
    assert not traffic.detector.is_deferred(first)
    assert not traffic.detector.is_deferred(early)


def test_a_deferred_answer_dropped_from_retention_is_no_longer_deferred() -> None:
    traffic = Traffic(TimingDetector(min_samples=8, max_retained=4), seed=6)
    sent = [traffic.send(2048, 1.0) for _ in range(9)]  # no fit: every one deferred, kept
    kept = [request for request in sent if traffic.detector.is_deferred(request)]
    assert 0 < len(kept) <= 4
    assert kept == sent[-len(kept) :]  # the newest are kept, the oldest dropped

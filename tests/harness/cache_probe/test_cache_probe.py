"""The cache probe end to end against a fake target with a real prefix cache, in virtual time.

Every test here runs under a `VirtualClock` (autouse): the fake target charges its delays to
the clock the client's timestamps come from instead of sleeping them, so the timing
assertions hold on a loaded machine (`assert 0.5009 < 0.5` failed at load 4-8 when the
delays were slept) and the delays cost no wall time."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from typing import Any

import httpx
import pytest
from fake_cache_target import FakeCacheTarget, VirtualClock

from kvcanary.canaries import Tokenizer, load_tokenizer
from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.cache_probe.counters import MetricsCounters
from kvcanary.harness.cache_probe.probe import (
    CacheProbe,
    CacheProbeResult,
    ProbeSettings,
    design_trials,
    probe_tenants,
    run_cache_probe,
    settings_for,
    shares_credentials,
)
from kvcanary.harness.record.events import (
    Event,
    FindingRecorded,
    Limits,
    ObservationRecorded,
    PhaseStarted,
    PlanRecorded,
    ProbeFinished,
    from_record,
    to_record,
)
from kvcanary.harness.record.finding import FindingKind
from kvcanary.harness.record.observation import Observation
from kvcanary.harness.target.client import TargetClient
from kvcanary.tenants.plan import RequestPlan
from kvcanary.tenants.tenant import Tenant

SETTINGS = ProbeSettings(num_trials=10, num_prompt_tokens=256, alpha=1e-3, seed=7)
"""A 224-token (14-page) shared prefix and a 32-token suffix."""


@pytest.fixture(autouse=True)
def virtual_clock(monkeypatch: pytest.MonkeyPatch) -> VirtualClock:
    clock = VirtualClock()
    monkeypatch.setattr(time, "perf_counter_ns", clock)
    return clock


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer("cl100k_base")


@pytest.fixture
def tenants(monkeypatch: pytest.MonkeyPatch) -> list[Tenant]:
    monkeypatch.setenv("KEY_A", "key-a")
    monkeypatch.setenv("KEY_B", "key-b")
    return [
        Tenant("alice", api_key_env="KEY_A", cache_salt="salt-alice"),
        Tenant("bob", api_key_env="KEY_B", cache_salt="salt-bob"),
    ]


async def probe(
    target: FakeCacheTarget,
    tenants: list[Tenant],
    tokenizer: Tokenizer,
    settings: ProbeSettings = SETTINGS,
    events: list[Event] | None = None,
    *,
    counters: bool = False,
) -> CacheProbeResult:
    emit = events.append if events is not None else None
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=target)) as http:
        client = TargetClient(http, "http://target", model="fake")
        source = MetricsCounters(http, "http://target") if counters else None
        return await run_cache_probe(
            client, tenants, tokenizer, settings, emit=emit, counters=source
        )


async def test_a_shared_cache_is_found_with_agreeing_cached_tokens(
    tenants: list[Tenant], tokenizer: Tokenizer
) -> None:
    result = await probe(FakeCacheTarget("shared"), tenants, tokenizer)

    assert result.verdict == "leak"
    assert result.assessment.positive_control.timing_hit
    cross = [c for c in result.assessment.contrasts if c.kind == "cross_tenant"]
    assert {(c.owner, c.prober) for c in cross} == {("alice", "bob"), ("bob", "alice")}
    for contrast in cross:
        assert contrast.timing_hit
        assert contrast.p_adjusted < SETTINGS.alpha
        assert contrast.test.median_ratio < 0.5
        assert contrast.reported.num_reported_hits == contrast.reported.num_reporting == 10
        assert contrast.baseline_reported.num_reported_hits == 0
        assert contrast.agreement is True
    assert result.assessment.agreement is True
    found = [f for f in result.findings if f.details["contrast"]["kind"] == "cross_tenant"]
    assert {(f.victim_tenant, f.tenant) for f in found} == {("alice", "bob"), ("bob", "alice")}
    assert all(f.kind == FindingKind.SHARED_PREFIX_CACHE for f in result.findings)
    assert found[0].details["design"]["num_prefix_tokens"] == 224


async def test_a_salted_cache_isolates_tenants_but_trusts_a_spoofed_salt(
    tenants: list[Tenant], tokenizer: Tokenizer
) -> None:
    result = await probe(FakeCacheTarget("salted"), tenants, tokenizer)

    assert result.assessment.positive_control.cache_hit
    by_kind = Counter((c.kind, c.cache_hit) for c in result.assessment.contrasts)
    assert by_kind == {("cross_tenant", False): 2, ("spoofed_salt", True): 2}
    # a salt the client chooses opens another tenant's cache: unsafe, not a cache shared by all
    assert result.verdict == "unsafe"
    assert {f.details["contrast"]["kind"] for f in result.findings} == {"spoofed_salt"}
    assert {f.kind for f in result.findings} == {FindingKind.CACHE_SALT_NOT_BOUND}
    assert "cache_salt" in result.findings[0].summary
    assert "not bound to the credential" in result.findings[0].summary


async def test_a_salt_derived_from_the_credential_is_not_found(
    tenants: list[Tenant], tokenizer: Tokenizer
) -> None:
    result = await probe(FakeCacheTarget("derived"), tenants, tokenizer)

    assert result.verdict == "clean"
    assert result.findings == ()
    assert result.assessment.positive_control.timing_hit
    assert len(result.assessment.contrasts) == 4
    for contrast in result.assessment.contrasts:
        assert not contrast.cache_hit
        assert contrast.reported.num_reported_hits == 0
        assert contrast.agreement is True


async def test_no_cache_is_unverifiable_not_clean(
    tenants: list[Tenant], tokenizer: Tokenizer
) -> None:
    result = await probe(FakeCacheTarget("off"), tenants, tokenizer)

    assert result.verdict == "inconclusive"
    assert result.findings == ()
    assert not result.assessment.positive_control.cache_hit
    assert "positive control failed" in result.assessment.reasons[0]


async def test_the_targets_cached_tokens_find_what_timing_cannot_see(
    tenants: list[Tenant], tokenizer: Tokenizer
) -> None:
    result = await probe(FakeCacheTarget("constant"), tenants, tokenizer)

    assert result.verdict == "leak"
    cross = [c for c in result.assessment.contrasts if c.kind == "cross_tenant"]
    assert all(c.cache_hit and not c.timing_hit for c in cross)
    assert all(c.agreement is False for c in cross)
    assert result.assessment.agreement is False


async def test_without_cached_tokens_timing_alone_decides(
    tenants: list[Tenant], tokenizer: Tokenizer
) -> None:
    target = FakeCacheTarget("shared", report_cached=False)
    result = await probe(target, tenants, tokenizer)

    assert result.verdict == "leak"
    assert result.assessment.agreement is None
    assert all(c.reported.num_reporting == 0 for c in result.assessment.contrasts)


async def test_cached_tokens_reported_on_every_request_count_only_beyond_the_miss_arm(
    tenants: list[Tenant], tokenizer: Tokenizer
) -> None:
    """A disaggregated vLLM's decode reports the KV it loaded from prefill as cached on every
    request, misses included: that count is no cross-tenant hit."""
    target = FakeCacheTarget("derived", loaded_as_cached=True)
    result = await probe(target, tenants, tokenizer)

    assert result.verdict == "clean"
    assert result.findings == ()
    assert result.assessment.positive_control.timing_hit
    for contrast in result.assessment.contrasts:
        assert contrast.baseline_reported.says_hit is True  # taken alone, every miss is "cached"
        assert contrast.reported.control_median == 255  # the miss arm's median, subtracted
        assert contrast.reported.num_reported_hits == 0
        assert not contrast.cache_hit


async def test_a_spoofed_salt_under_a_disaggregated_count_is_a_salt_finding_only(
    tenants: list[Tenant], tokenizer: Tokenizer
) -> None:
    target = FakeCacheTarget("salted", loaded_as_cached=True)
    result = await probe(target, tenants, tokenizer)

    assert result.verdict == "unsafe"
    assert {f.kind for f in result.findings} == {FindingKind.CACHE_SALT_NOT_BOUND}
    assert {(f.victim_tenant, f.tenant) for f in result.findings} == {
        ("alice", "bob"),
        ("bob", "alice"),
    }


async def test_the_engines_prefix_cache_counters_are_a_second_witness(
    tenants: list[Tenant], tokenizer: Tokenizer
) -> None:
    """Timing shows nothing and no cached_tokens come back: the counters alone find it."""
    target = FakeCacheTarget("constant", report_cached=False)
    events: list[Event] = []
    result = await probe(target, tenants, tokenizer, events=events, counters=True)

    assert result.counters == "vllm:prefix_cache_hits"
    assert result.verdict == "leak"
    cross = [c for c in result.assessment.contrasts if c.kind == "cross_tenant"]
    for contrast in cross:
        assert not contrast.timing_hit
        assert contrast.witnessed_by == ("prefix-cache counters",)
        assert contrast.counted.control_median == 0
        assert contrast.counted.num_reported_hits == contrast.counted.num_reporting == 10
        assert contrast.reported.says_hit is None  # no cached_tokens at all
    finished = events[-1]
    assert isinstance(finished, ProbeFinished)
    assert finished.details["counters"] == "vllm:prefix_cache_hits"
    journaled = finished.details["assessment"]["contrasts"][0]["counted"]
    assert journaled["says_hit"] is not None
    assert "prefix-cache counters" in result.findings[0].summary


async def test_counters_count_relative_to_the_miss_arm_and_agree_with_timing(
    tenants: list[Tenant], tokenizer: Tokenizer
) -> None:
    target = FakeCacheTarget("derived", loaded_as_cached=True)
    result = await probe(target, tenants, tokenizer, counters=True)

    assert result.verdict == "clean"
    positive = result.assessment.positive_control
    assert positive.timing_hit
    assert positive.counted.says_hit is True  # the counters see the tenant's own hit ...
    assert positive.reported.says_hit is False  # ... which decode's cached_tokens hide
    assert positive.agreement is False
    for contrast in result.assessment.contrasts:
        assert contrast.counted.says_hit is False
        assert contrast.agreement is True


async def test_a_target_without_counters_is_asked_once(
    tenants: list[Tenant], tokenizer: Tokenizer
) -> None:
    target = FakeCacheTarget("shared", serve_metrics=False)
    result = await probe(target, tenants, tokenizer, counters=True)

    assert result.counters is None
    assert target.num_gets == 1
    assert all(c.counted.num_reporting == 0 for c in result.assessment.contrasts)
    assert result.verdict == "leak"


def test_prompts_are_exact_with_a_page_aligned_shared_prefix(
    tenants: list[Tenant], tokenizer: Tokenizer
) -> None:
    settings = ProbeSettings(num_trials=6, num_prompt_tokens=300, page_size=16, seed=3)
    design = design_trials(tenants, tokenizer, settings)

    assert settings.num_prefix_tokens == 256  # 16 whole pages of 0.875 * 300
    ids = {
        send.plan.request_id: tokenizer.encode(send.plan.prompt)
        for trial in design.trials
        for send in trial.sends
    }
    assert all(len(v) == 300 for v in ids.values())
    num_misses = sum(t.arm == "miss" for t in design.trials)
    # one first page per trial, plus the unrelated prompt each miss sends before its timed one
    assert len({tuple(v[:16]) for v in ids.values()}) == len(design.trials) + num_misses
    for trial in design.trials:
        assert [s.role for s in trial.sends] == ["seed", "timed"]  # every timed send follows one
        if trial.arm == "miss":
            other, timed = (ids[s.plan.request_id] for s in trial.sends)
            assert other[:16] != timed[:16]
            assert trial.num_shared_tokens == 0
            continue
        seed, timed = (ids[s.plan.request_id] for s in trial.sends)
        assert seed[:256] == timed[:256]
        assert 256 <= trial.num_shared_tokens < 256 + 16  # the suffix diverges within a page
        assert seed[trial.num_shared_tokens] != timed[trial.num_shared_tokens]
        assert all(s.plan.max_tokens == 1 for s in trial.sends)


def test_arms_are_interleaved_in_a_seeded_order(
    tenants: list[Tenant], tokenizer: Tokenizer
) -> None:
    first = design_trials(tenants, tokenizer, SETTINGS)
    again = design_trials(tenants, tokenizer, SETTINGS)
    other = design_trials(tenants, tokenizer, ProbeSettings(num_trials=10, num_prompt_tokens=256))

    arms = [t.arm for t in first.trials]
    assert arms == [t.arm for t in again.trials]
    assert arms != [t.arm for t in other.trials]
    assert Counter(arms) == {"same_tenant": 10, "cross_tenant": 20, "miss": 20, "spoofed_salt": 20}
    # interleaved: no arm comes as one block
    runs = sum(1 for a, b in itertools.pairwise(arms) if a != b)
    assert runs > 20
    spoofed = [t for t in first.trials if t.arm == "spoofed_salt" and t.owner == "alice"]
    assert all(t.timed.tenant.cache_salt == "salt-alice" for t in spoofed)
    assert all(t.timed.tenant.api_key_env == "KEY_B" for t in spoofed)


def test_spoofed_salt_arms_need_an_owner_salt(tokenizer: Tokenizer) -> None:
    design = design_trials([Tenant("a"), Tenant("b"), Tenant("c")], tokenizer, SETTINGS)

    assert design.pairs == (("a", "b"), ("b", "c"), ("c", "a"))
    assert {t.arm for t in design.trials} == {"same_tenant", "cross_tenant", "miss"}


async def test_everything_is_journaled_and_round_trips(
    tenants: list[Tenant], tokenizer: Tokenizer
) -> None:
    events: list[Event] = []
    result = await probe(FakeCacheTarget("shared"), tenants, tokenizer, events=events)

    kinds = Counter(type(e).__name__ for e in events)
    assert isinstance(events[0], PhaseStarted)
    assert events[0].phase == "cache_probe"
    assert kinds["PlanRecorded"] == kinds["ObservationRecorded"] == result.design.num_requests
    assert kinds["FindingRecorded"] == len(result.findings) > 0
    for event in events:
        assert to_record(from_record(to_record(event))) == to_record(event)
        if isinstance(event, ObservationRecorded):
            assert event.observation.text == ""
            assert event.observation.text_redacted
        if isinstance(event, PlanRecorded):
            assert event.plan.phase == "cache_probe"
            assert event.plan.intent == "control"
    finding = next(e for e in events if isinstance(e, FindingRecorded)).finding
    assert finding.details["assessment"]["verdict"] == "leak"
    last = events[-1]
    assert isinstance(last, ProbeFinished)
    assert last.probe == "cache_probe"
    assert last.verdict == "leak"
    assert last.details["design"]["num_requests"] == result.design.num_requests


async def test_failed_requests_are_dropped_not_timed(
    tenants: list[Tenant], tokenizer: Tokenizer
) -> None:
    target = FakeCacheTarget("shared")
    design = design_trials(tenants, tokenizer, SETTINGS)

    class FailingEvery7th(httpx.AsyncBaseTransport):
        def __init__(self) -> None:
            self.inner = httpx.ASGITransport(app=target)
            self.count = 0

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            self.count += 1
            if self.count % 7 == 0:
                return httpx.Response(503, json={"error": "busy"})
            return await self.inner.handle_async_request(request)

    async with httpx.AsyncClient(transport=FailingEvery7th()) as http:
        result = await CacheProbe(TargetClient(http, "http://t", model="m"), design).run()

    failed = [o for o in result.outcomes if o.ttft_ms is None]
    assert failed
    assert all("503" in (o.error or "") for o in failed)
    assert result.verdict == "leak"


def test_unusable_settings_are_config_errors(tokenizer: Tokenizer) -> None:
    with pytest.raises(ConfigError, match="two tenants"):
        design_trials([Tenant("solo")], tokenizer, SETTINGS)
    with pytest.raises(ConfigError, match="no whole 64-token page"):
        ProbeSettings(num_prompt_tokens=64, page_size=64)
    with pytest.raises(ConfigError, match="at least 5 trials"):
        ProbeSettings(num_trials=2)
    with pytest.raises(ConfigError, match="alpha"):
        ProbeSettings(alpha=0.7)


def test_settings_fit_the_targets_limits() -> None:
    roomy = Limits(pool_tokens=8192, context_tokens=4096, page_size=64, source="test")
    tight = Limits(
        pool_tokens=656, context_tokens=1024, page_size=16, source="t", max_input_tokens=650
    )

    assert settings_for(roomy).num_prompt_tokens == 1024
    assert settings_for(roomy).num_prefix_tokens == 896  # 14 pages of 64
    assert settings_for(tight).num_prompt_tokens == 640
    assert settings_for(tight, num_prompt_tokens=300).num_prompt_tokens == 300


def test_anonymous_tenants_get_distinct_tokens_and_salts_on_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SHARED_KEY", "k")
    anonymous = probe_tenants([Tenant("a"), Tenant("b")], salts=True)
    keyed = probe_tenants(
        [Tenant("a", api_key_env="SHARED_KEY"), Tenant("b", api_key_env="SHARED_KEY")]
    )

    tokens = {t.auth_headers()["Authorization"] for t in anonymous}
    assert tokens == {"Bearer kvcanary-anon-a", "Bearer kvcanary-anon-b"}
    assert len({t.cache_salt for t in anonymous}) == 2
    assert all(len(t.cache_salt or "") >= 43 for t in anonymous)  # 256 bits, urlsafe base64
    assert not shares_credentials(anonymous)
    assert shares_credentials(keyed)
    # what is sent decides, not the variables' names: two variables holding one key share it
    monkeypatch.setenv("COPY_OF_SHARED_KEY", "k")
    copied = [Tenant("a", api_key_env="SHARED_KEY"), Tenant("b", api_key_env="COPY_OF_SHARED_KEY")]
    assert shares_credentials(probe_tenants(copied))
    assert all(t.cache_salt is None and not t.headers for t in keyed)


class StopAfter:
    """A sender that asks the probe to stop (or cancels it, hanging) after `n` requests."""

    def __init__(self, inner: TargetClient, n: int, *, cancel: bool = False) -> None:
        self.inner, self.n, self.cancel = inner, n, cancel
        self.probe: CacheProbe | None = None
        self.num_sent = 0

    async def send(self, plan: RequestPlan, tenant: Tenant, **kwargs: Any) -> Observation:
        self.num_sent += 1
        assert self.probe is not None
        if self.num_sent == self.n:
            if self.cancel:
                asyncio.get_running_loop().call_later(0.05, self.probe.cancel)
                await asyncio.sleep(30)  # a request that hangs until cancelled
            self.probe.stop()
        return await self.inner.send(plan, tenant, **kwargs)


@pytest.mark.parametrize("cancel", [False, True])
async def test_stop_and_cancel_end_the_probe_with_a_verdict_on_what_was_measured(
    tenants: list[Tenant], tokenizer: Tokenizer, cancel: bool
) -> None:
    events: list[Event] = []
    design = design_trials(tenants, tokenizer, SETTINGS)
    target = FakeCacheTarget("off")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=target)) as http:
        sender = StopAfter(TargetClient(http, "http://t", model="m"), 9, cancel=cancel)
        probe = CacheProbe(sender, design, emit=events.append)
        sender.probe = probe
        result = await asyncio.wait_for(probe.run(), timeout=10)

    assert probe.stopping
    # a stop lets the trial in flight send its timed request; a cancel sends nothing more
    assert sender.num_sent == 9 if cancel else 9 <= sender.num_sent <= 10
    assert len(result.outcomes) < len(design.trials)
    assert result.verdict == "inconclusive"
    assert not result.assessment.positive_control.test.tested  # far too few trials
    assert isinstance(events[-1], ProbeFinished)
    observations = [e.observation for e in events if isinstance(e, ObservationRecorded)]
    assert (observations[-1].error_kind == "cancelled") is cancel

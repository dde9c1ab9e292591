"""The cache probe against the bundled reference engine: the three verdicts, for real.

The engine runs in this process behind its HTTP app; its prefill really skips the cached
pages, so the TTFTs the probe measures are the engine's own. Each run uses 10 trials per
arm (the documented default is 20) at the default alpha: the bundled engine's cache hit is
several times faster than a miss, far above what that sample size needs.
"""

from __future__ import annotations

from collections.abc import Sequence

import httpx
import pytest
import torch

from kvcanary.canaries import load_tokenizer
from kvcanary.harness.cache_probe.counters import MetricsCounters
from kvcanary.harness.cache_probe.probe import (
    DEFAULT_NUM_TRIALS,
    CacheProbeResult,
    ProbeSettings,
    run_cache_probe,
)
from kvcanary.harness.cache_probe.stats import DEFAULT_ALPHA
from kvcanary.harness.record.finding import FindingKind
from kvcanary.harness.target.client import TargetClient
from kvcanary.reference_engine.server.app import build_app
from kvcanary.reference_engine.server.asgi_transport import StreamingASGITransport
from kvcanary.reference_engine.server.launch import make_config
from kvcanary.tenants.tenant import Tenant

pytestmark = pytest.mark.slow

SETTINGS = ProbeSettings(num_trials=10, num_prompt_tokens=512, seed=11)


@pytest.fixture(autouse=True)
def one_torch_thread() -> None:
    torch.set_num_threads(1)  # 2 shared cores: intra-op threads only add noise to TTFTs


@pytest.fixture
def tenants(monkeypatch: pytest.MonkeyPatch) -> list[Tenant]:
    monkeypatch.setenv("PROBE_KEY_A", "sk-probe-a")
    monkeypatch.setenv("PROBE_KEY_B", "sk-probe-b")
    return [
        Tenant("tenant-a", api_key_env="PROBE_KEY_A", cache_salt="salt-a"),
        Tenant("tenant-b", api_key_env="PROBE_KEY_B", cache_salt="salt-b"),
    ]


async def probe_engine(
    tenants: list[Tenant], fixes: Sequence[str] = (), *, prefix_cache: bool = True
) -> CacheProbeResult:
    config = make_config("vulnerable", fixes, context_length=1024, prefix_cache=prefix_cache)
    app = build_app(config)
    transport = StreamingASGITransport(app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport) as http:
        client = TargetClient(http, "http://engine", model="kvcanary-reference")
        counters = MetricsCounters(http, "http://engine")
        return await run_cache_probe(
            client, tenants, load_tokenizer("cl100k_base"), SETTINGS, counters=counters
        )


@pytest.mark.timing
async def test_an_unsalted_cache_is_found_below_alpha_within_the_default_sample_size(
    tenants: list[Tenant],
) -> None:
    result = await probe_engine(tenants)

    assert SETTINGS.num_trials <= DEFAULT_NUM_TRIALS
    assert SETTINGS.alpha == DEFAULT_ALPHA
    assert result.verdict == "leak"
    cross = [c for c in result.assessment.contrasts if c.kind == "cross_tenant"]
    assert len(cross) == 2
    for contrast in cross:
        assert contrast.p_adjusted < DEFAULT_ALPHA
        assert contrast.reported.says_hit is True  # the engine's own cached_tokens
        assert contrast.agreement is True
    assert len(result.findings) == 4  # both pairs, unsalted and with the owner's salt


@pytest.mark.timing
async def test_a_credential_derived_salt_is_not_found_and_the_positive_control_passes(
    tenants: list[Tenant],
) -> None:
    result = await probe_engine(tenants, ("cache_salt", "derive_cache_salt"))

    assert result.verdict == "clean"
    assert result.findings == ()
    positive = result.assessment.positive_control
    assert positive.timing_hit
    assert positive.reported.says_hit is True
    kinds = sorted(c.kind for c in result.assessment.contrasts)
    assert kinds == ["cross_tenant", "cross_tenant", "spoofed_salt", "spoofed_salt"]
    assert all(c.reported.num_reported_hits == 0 for c in result.assessment.contrasts)


@pytest.mark.timing
async def test_a_salt_taken_from_the_client_is_not_bound_to_its_credential(
    tenants: list[Tenant],
) -> None:
    """The engine's `cache_salt` fix keys its cache by the salt the client sends: tenants
    are isolated, but one that sends another's salt is served from that tenant's cache."""
    result = await probe_engine(tenants, ("cache_salt",))

    assert result.verdict == "unsafe"
    assert result.counters == "sglang:cached_tokens"  # the engine's own counters, too
    assert result.assessment.positive_control.counted.says_hit is True
    by_kind = {(c.kind, c.cache_hit) for c in result.assessment.contrasts}
    assert by_kind == {("cross_tenant", False), ("spoofed_salt", True)}
    assert [f.kind for f in result.findings] == [FindingKind.CACHE_SALT_NOT_BOUND] * 2
    assert all("not bound to the credential" in f.summary for f in result.findings)


async def test_no_cache_is_unverifiable(tenants: list[Tenant]) -> None:
    result = await probe_engine(tenants, prefix_cache=False)

    assert result.verdict == "inconclusive"
    assert result.findings == ()
    assert result.assessment.positive_control.reported.num_reported_hits == 0

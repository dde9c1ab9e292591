"""Limits discovery: flags first, then the target's smallest pool, else a clear error."""

from __future__ import annotations

import httpx
import pytest
from recorded_targets import (
    RecordedTarget,
    fixture_json,
    json_reply,
    mini_lb_routes,
    mock_client,
    sglang_routes,
    vllm_routes,
)

from kvcanary.canaries.errors import ConfigError, RunIncomplete
from kvcanary.harness.record.events import Limits
from kvcanary.harness.target.limits import DEFAULT_PAGE_SIZE, discover_limits

BASE = "http://target"


async def discover(target: RecordedTarget, **flags: int | None) -> Limits:
    flags = {"pool_tokens": None, "context_tokens": None, "page_size": None, **flags}
    async with mock_client({"target": target}) as client:
        return await discover_limits(client, BASE, **flags)


async def test_flags_alone_make_no_request() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise AssertionError(f"unexpected request {request.url}")

    async with httpx.AsyncClient(transport=httpx.MockTransport(refuse)) as client:
        limits = await discover_limits(
            client, BASE, pool_tokens=4096, context_tokens=8192, page_size=None
        )
    assert limits == Limits(4096, 8192, DEFAULT_PAGE_SIZE, "flags")
    assert DEFAULT_PAGE_SIZE == 16


async def test_flag_page_size_is_kept() -> None:
    target = RecordedTarget({})
    limits = await discover(target, pool_tokens=4096, context_tokens=8192, page_size=64)
    assert limits.page_size == 64
    assert target.seen == []


async def test_disaggregated_target_is_sized_against_its_smallest_pool() -> None:
    limits = await discover(RecordedTarget(mini_lb_routes()))
    assert limits.pool_tokens == 131072  # prefill's, not decode's 1048576
    assert limits.context_tokens == 202752
    assert limits.page_size == 64
    assert limits.max_input_tokens == 131066
    assert "prefill side" in limits.source
    assert "smallest pool of 2 sides: prefill 131072, decode 1048576" in limits.source
    assert "context: openai:/v1/models" in limits.source


async def test_single_sglang_server_with_one_token_pages_is_laced_for_sixteen() -> None:
    limits = await discover(RecordedTarget(sglang_routes()))
    assert (limits.pool_tokens, limits.context_tokens, limits.page_size) == (65536, 131072, 16)
    assert limits.source == (
        "pool: sglang:/get_server_info unified side; context: openai:/v1/models; "
        "page size: target reports 1, laced for 16"
    )


async def test_a_page_size_flag_is_used_as_given() -> None:
    limits = await discover(RecordedTarget(sglang_routes()), page_size=8)
    assert limits.page_size == 8


async def test_vllm_target() -> None:
    limits = await discover(RecordedTarget(vllm_routes()))
    assert (limits.pool_tokens, limits.context_tokens, limits.page_size) == (432000, 131072, 16)
    assert limits.max_input_tokens is None
    assert "vllm:/metrics" in limits.source


async def test_one_flag_fills_what_the_target_does_not_say() -> None:
    target = RecordedTarget({"GET /v1/models": json_reply(fixture_json("vllm_models.json"))})
    limits = await discover(target, pool_tokens=20000)
    assert (limits.pool_tokens, limits.context_tokens) == (20000, 131072)
    assert limits.page_size == DEFAULT_PAGE_SIZE
    assert limits.source == (
        f"pool: flags; context: openai:/v1/models; page size: default {DEFAULT_PAGE_SIZE}"
    )


async def test_flags_override_what_the_target_says() -> None:
    limits = await discover(RecordedTarget(mini_lb_routes()), context_tokens=1000, page_size=32)
    assert (limits.pool_tokens, limits.context_tokens, limits.page_size) == (131072, 1000, 32)
    assert "context: flags" in limits.source


async def test_a_target_that_says_nothing_is_a_config_error_naming_both_flags() -> None:
    with pytest.raises(ConfigError) as caught:
        await discover(RecordedTarget({}))
    message = str(caught.value)
    assert "--pool-tokens N and --context-tokens N" in message
    assert f"GET {BASE}/get_server_info: HTTP 404" in message
    assert f"GET {BASE}/metrics: HTTP 404" in message
    assert "\n" not in message


async def test_a_known_context_without_a_pool_names_only_the_pool_flag() -> None:
    target = RecordedTarget({"GET /v1/models": json_reply(fixture_json("vllm_models.json"))})
    with pytest.raises(ConfigError, match="KV pool size") as caught:
        await discover(target)
    assert "--pool-tokens N" in str(caught.value)
    assert "--context-tokens" not in str(caught.value)


async def test_an_unreachable_target_is_an_incomplete_run() -> None:
    async with mock_client({}) as client:
        with pytest.raises(RunIncomplete, match="unreachable"):
            await discover_limits(
                client, BASE, pool_tokens=None, context_tokens=None, page_size=None
            )


@pytest.mark.parametrize("flag", ["pool_tokens", "context_tokens", "page_size"])
async def test_non_positive_flags_are_rejected(flag: str) -> None:
    with pytest.raises(ConfigError, match="must be a positive"):
        await discover(RecordedTarget({}), **{flag: 0})

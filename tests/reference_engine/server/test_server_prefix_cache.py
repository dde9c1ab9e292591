"""The prefix cache over HTTP: `cached_tokens` in usage, and who may select whose cache.

Tenants are bearer tokens (the server derives `tenant_key` from them); prompts share a
prefix of whole pages and differ after it. The last case is the trust-boundary test of
vLLM PR #53347: with `derive_cache_salt`, a tenant that sends another tenant's
`cache_salt` still gets its own cache.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from kvcanary.canaries import CanaryMinter, build_prompt, load_tokenizer
from kvcanary.reference_engine.server.app import build_app
from kvcanary.reference_engine.server.asgi_transport import StreamingASGITransport
from kvcanary.reference_engine.server.launch import make_config

MINTER = CanaryMinter(b"kvcanary-prefix-cache-tests-key-0")
PREFIX_TOKENS = 192  # 12 pages of 16


def text(request: int, num_tokens: int) -> str:
    tokenizer = load_tokenizer("cl100k_base")
    built = build_prompt(tokenizer, MINTER, tenant=0, request=request, num_tokens=num_tokens)
    return built.text


PREFIX = text(1, PREFIX_TOKENS)


@asynccontextmanager
async def engine(*fixes: str, prefix_cache: bool = True) -> AsyncIterator[httpx.AsyncClient]:
    config = make_config("vulnerable", fixes, context_length=1024, prefix_cache=prefix_cache)
    app = build_app(config)
    async with app.router.lifespan_context(app):
        transport = StreamingASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            yield client


async def cached_tokens(
    client: httpx.AsyncClient, tenant: str, suffix: int, *, stream: bool = False, **body: Any
) -> int:
    payload = {"prompt": PREFIX + text(100 + suffix, 40), "max_tokens": 1, "stream": stream}
    if stream:
        payload["stream_options"] = {"include_usage": True}
    headers = {"authorization": f"Bearer sk-{tenant}"}
    response = await client.post("/v1/completions", json={**payload, **body}, headers=headers)
    assert response.status_code == 200, response.text
    if stream:
        usage_line = [line for line in response.text.splitlines() if '"usage"' in line][-1]
        usage = httpx.Response(200, content=usage_line.removeprefix("data: ")).json()["usage"]
    else:
        usage = response.json()["usage"]
    assert usage["prompt_tokens"] == PREFIX_TOKENS + 40
    return int(usage["prompt_tokens_details"]["cached_tokens"])


@pytest.mark.parametrize("stream", [False, True])
async def test_without_a_salt_fix_one_tenant_is_served_from_anothers_cache(stream: bool) -> None:
    async with engine() as client:
        assert await cached_tokens(client, "alice", 1, stream=stream) == 0
        assert await cached_tokens(client, "bob", 2, stream=stream) == PREFIX_TOKENS


async def test_the_cache_off_reports_no_cached_tokens() -> None:
    async with engine(prefix_cache=False) as client:
        await cached_tokens(client, "alice", 1)
        assert await cached_tokens(client, "alice", 2) == 0


async def test_a_client_supplied_salt_selects_another_tenants_cache_unless_derived() -> None:
    async with engine("cache_salt") as client:
        await cached_tokens(client, "alice", 1, cache_salt="salt-alice")
        assert await cached_tokens(client, "bob", 2, cache_salt="salt-bob") == 0
        assert await cached_tokens(client, "bob", 3, cache_salt="salt-alice") == PREFIX_TOKENS

    async with engine("cache_salt", "derive_cache_salt") as client:
        await cached_tokens(client, "alice", 1, cache_salt="salt-alice")
        assert await cached_tokens(client, "bob", 3, cache_salt="salt-alice") == 0
        assert await cached_tokens(client, "bob", 4) == 0
        assert await cached_tokens(client, "alice", 5, cache_salt="salt-alice") == PREFIX_TOKENS

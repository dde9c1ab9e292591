"""The `--tokenizer server` start-up check (`harness.target.tokenizer.remote_tokenizer`)."""

from __future__ import annotations

import json

import httpx
import pytest

from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.target.tokenizer import remote_tokenizer
from kvcanary.tenants.tenant import Tenant


def tenant() -> Tenant:
    return Tenant(name="tenant-0")


async def test_a_route_that_counts_zero_is_refused_at_start_naming_the_endpoints() -> None:
    # llama.cpp's answer to the SGLang/vLLM body {"prompt": ...}: 200, no tokens
    def empty(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"tokens": []})

    async with httpx.AsyncClient(transport=httpx.MockTransport(empty)) as http:
        with pytest.raises(ConfigError) as caught:
            await remote_tokenizer(http, "http://target.test", "m", tenant())
    message = str(caught.value)
    assert "counted 0 tokens" in message
    assert "http://target.test/v1/tokenize" in message
    assert "http://target.test/tokenize" in message
    assert "\n" not in message


async def test_llamacpp_convention_is_detected_at_start() -> None:
    def llamacpp(request: httpx.Request) -> httpx.Response:
        if request.url.path != "/tokenize":
            return httpx.Response(404)
        text = json.loads(request.content).get("content", "")
        return httpx.Response(200, json={"tokens": list(range(len(text.split())))})

    async with httpx.AsyncClient(transport=httpx.MockTransport(llamacpp)) as http:
        remote = await remote_tokenizer(http, "http://target.test", "m", tenant())
        assert remote.style == "llamacpp"
        assert await remote.count("three word text") == 3

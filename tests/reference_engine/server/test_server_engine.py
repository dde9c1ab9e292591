"""The HTTP layer over the real engine core: the incident end to end, fixes, streams, aborts.

Prompts are built with the canaries package (every page of a prompt holds one of its
canaries), one tenant per bearer token. A leak is a victim's canary in another tenant's
response. Most tests reach the in-process app through `StreamingASGITransport`; the
disconnect tests use real sockets (uvicorn in a thread, and separate processes with KV
pages crossing TCP).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from httpx_sse import aconnect_sse

from kvcanary.canaries import (
    BuiltPrompt,
    CanaryIndex,
    CanaryMinter,
    Owner,
    build_prompt,
    load_tokenizer,
)
from kvcanary.reference_engine.server.app import build_app
from kvcanary.reference_engine.server.asgi_transport import StreamingASGITransport
from kvcanary.reference_engine.server.launch import (
    EngineHandle,
    make_config,
    running_engine,
    running_engine_async,
)

CONTEXT = 1024  # vulnerable: prefill pool 656 (max input 650), decode pool 2048
MINTER = CanaryMinter(b"kvcanary-server-tests-key-000000")


def prompt(tenant: int, num_tokens: int, request: int = 0) -> BuiltPrompt:
    tokenizer = load_tokenizer("cl100k_base")
    return build_prompt(tokenizer, MINTER, tenant=tenant, request=request, num_tokens=num_tokens)


def auth(tenant: int) -> dict[str, str]:
    return {"authorization": f"Bearer sk-tenant-{tenant}"}


def canaries_in(text: str, built: BuiltPrompt) -> int:
    """How many of `built`'s canaries `text` holds, found as kvcanary's detector finds them:
    verbatim, normalised or by a run of their words (the recall model copies noisily)."""
    index = CanaryIndex(MINTER)
    index.add_many((span.text, Owner("tenant", "request")) for span in built.canaries)
    return len({hit.canary for hit in index.scan(text) if hit.owner is not None})


@asynccontextmanager
async def engine(preset: str = "vulnerable", **overrides: Any) -> AsyncIterator[httpx.AsyncClient]:
    app = build_app(make_config(preset, context_length=CONTEXT, **overrides))
    async with app.router.lifespan_context(app):
        transport = StreamingASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            yield client


async def complete(
    client: httpx.AsyncClient, built: BuiltPrompt, tenant: int, max_tokens: int, **body: Any
) -> httpx.Response:
    payload = {"prompt": built.text, "max_tokens": max_tokens, **body}
    return await client.post("/v1/completions", json=payload, headers=auth(tenant), timeout=120)


async def run_victims(client: httpx.AsyncClient) -> list[BuiltPrompt]:
    """Four tenants' prompts: together they cycle decode's sorted free list."""
    victims = [prompt(tenant, 600) for tenant in (1, 2, 3, 4)]
    for tenant, victim in enumerate(victims, start=1):
        r = await complete(client, victim, tenant, 64)
        assert r.status_code == 200
        assert r.json()["usage"]["prompt_tokens"] == 600
    return victims


async def assert_drained(client: httpx.AsyncClient) -> dict[str, Any]:
    for _ in range(500):
        state: dict[str, Any] = (await client.get("/kvcanary/state")).json()
        sides = [*state["prefill"], *state["decode"]]
        busy = any(s["num_allocated_pages"] or s["num_running_requests"] for s in sides)
        if not busy and not state["num_pending_prefill_exchanges"]:
            return state
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine did not drain: {state}")


async def test_vulnerable_answers_an_over_pool_prompt_with_other_tenants_canaries() -> None:
    async with engine() as client:
        victims = await run_victims(client)
        attacker = prompt(0, 900)
        r = await complete(client, attacker, 0, 96)
        assert r.status_code == 200
        body = r.json()
        text = body["choices"][0]["text"]
        assert body["usage"]["prompt_tokens"] == 900  # decode's count, as SGLang's routers relay
        assert body["usage"]["completion_tokens"] == 96
        assert sum(canaries_in(text, v) for v in victims) >= 1
        assert canaries_in(text, attacker) == 0  # its own prompt was never prefilled
        await assert_drained(client)
        metrics = (await client.get("/metrics")).text
    assert 'sglang:num_requests_total{code="200",disaggregation_mode="decode"' in metrics
    assert 'sglang:token_usage{disaggregation_mode="decode",model_name=' in metrics


async def test_the_leak_streams_too_as_valid_sse() -> None:
    async with engine() as client:
        victims = await run_victims(client)
        body = {
            "messages": [{"role": "user", "content": prompt(0, 900).text}],
            "max_tokens": 64,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with aconnect_sse(
            client, "POST", "/v1/chat/completions", json=body, headers=auth(0), timeout=120
        ) as source:
            assert source.response.status_code == 200
            events = [event.data async for event in source.aiter_sse()]
        await assert_drained(client)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert sum(canaries_in(text, v) for v in victims) >= 1
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["prompt_tokens"] > 900  # the rendered chat prompt, decode's count
    assert chunks[-1]["usage"]["completion_tokens"] == 64


async def test_prefill_queried_directly_reports_the_placeholders_one_token() -> None:
    """What the router drops: prefill's own answer to an over-pool prompt (SGLang #33507)."""
    app = build_app(make_config("vulnerable", context_length=CONTEXT))
    async with app.router.lifespan_context(app):
        balancer = app.state.balancer
        prefill, decode = balancer.prefills[0].client, balancer.decodes[0].client
        body = {"prompt": prompt(0, 900).text, "max_tokens": 8, "bootstrap_room": 12345}
        answers = await asyncio.gather(
            prefill.post("/v1/completions", json=body, timeout=120),
            decode.post("/v1/completions", json=body, timeout=120),
        )
    prefill_answer, decode_answer = (r.json() for r in answers)
    assert [r.status_code for r in answers] == [200, 200]
    assert prefill_answer["usage"]["prompt_tokens"] == 1
    assert decode_answer["usage"]["prompt_tokens"] == 900


async def test_a_merging_gateway_shows_the_client_prefills_count() -> None:
    async with engine(merge_prefill_usage=True) as client:
        r = await complete(client, prompt(0, 900), 0, 8)
        assert r.status_code == 200
        assert r.json()["usage"]["prompt_tokens"] == 1
        assert r.json()["usage"]["completion_tokens"] == 8
        await assert_drained(client)


async def test_hardened_serves_the_prompt_honestly_and_refuses_over_context_with_400() -> None:
    async with engine("hardened") as client:
        victims = await run_victims(client)
        attacker = prompt(0, 900)
        r = await complete(client, attacker, 0, 96)
        assert r.status_code == 200
        text = r.json()["choices"][0]["text"]
        assert r.json()["usage"]["prompt_tokens"] == 900
        assert sum(canaries_in(text, v) for v in victims) == 0
        assert canaries_in(text, attacker) >= 1
        for stream in (False, True):
            r = await complete(client, prompt(0, 1100, request=1), 0, 8, stream=stream)
            assert r.status_code == 400
            assert r.headers["content-type"] == "application/json"
            assert r.json() == {
                "object": "error",
                "message": "The input (1100 tokens) is longer than the model's context length "
                "(1024 tokens).",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            }
        await assert_drained(client)


async def test_admission_retire_turns_the_over_pool_leak_into_an_error() -> None:
    async with engine(fixes=("admission_retire",)) as client:
        victims = await run_victims(client)
        r = await complete(client, prompt(0, 900), 0, 96)
        assert r.status_code == 400  # prefill's admission rejection reaches the client
        error = r.json()
        assert error["object"] == "error"
        assert error["code"] == r.status_code
        assert sum(canaries_in(r.text, v) for v in victims) == 0
        await assert_drained(client)


async def test_coverage_check_answers_400_which_a_router_does_not_retry() -> None:
    async with engine(fixes=("coverage_check",)) as client:
        r = await complete(client, prompt(0, 900), 0, 8)
        assert r.status_code == 400
        assert "KV coverage mismatch" in r.json()["message"]
        await assert_drained(client)


async def test_patched_keeps_the_incident_pools_and_refuses_over_pool_prompts() -> None:
    async with engine("patched") as client:
        info = (await client.get("/get_server_info")).json()
        assert info["prefill"][0]["max_total_num_tokens"] == 656  # still below the context
        victims = await run_victims(client)
        for stream in (False, True):
            r = await complete(client, prompt(0, 900, request=int(stream)), 0, 96, stream=stream)
            assert r.status_code == 400
            assert r.json()["type"] == "BadRequestError"
            assert sum(canaries_in(r.text, v) for v in victims) == 0
        await assert_drained(client)


async def test_model_tokenizer_and_server_info_routes_over_the_real_engine() -> None:
    async with engine() as client:
        models = (await client.get("/v1/models")).json()
        assert models["data"][0]["max_model_len"] == CONTEXT
        built = prompt(5, 40)
        tokens = (await client.post("/v1/tokenize", json={"prompt": built.text})).json()
        assert tokens["count"] == 40
        assert tokens["max_model_len"] == CONTEXT
        text = (await client.post("/v1/detokenize", json={"tokens": tokens["tokens"]})).json()
        assert text == {"text": built.text}
        info = (await client.get("/get_server_info")).json()
    prefill, decode = info["prefill"][0], info["decode"][0]
    assert (prefill["max_total_num_tokens"], prefill["max_req_input_len"]) == (656, 650)
    assert decode["max_total_num_tokens"] == 2048
    assert prefill["disaggregation_mode"] == "prefill"
    assert decode["context_length"] == prefill["context_length"] == CONTEXT
    assert decode["page_size"] == 16
    assert info["internal_states"] == decode["internal_states"]


def disconnect_mid_stream(handle: EngineHandle) -> dict[str, int]:
    """Stream a long answer, read its first event, hang up; the decode pages held then."""
    body = {"prompt": prompt(7, 600).text, "max_tokens": 400, "stream": True}
    with (
        httpx.Client(base_url=handle.base_url, timeout=120) as client,
        client.stream("POST", "/v1/completions", json=body, headers=auth(7)) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return handle.num_allocated_pages()  # then the client hangs up
    raise AssertionError("no event streamed")


def test_a_client_that_disconnects_mid_stream_leaves_no_page_allocated() -> None:
    with running_engine("vulnerable", context_length=CONTEXT) as handle:
        held = disconnect_mid_stream(handle)
        assert held["decode"] >= 600 // 16  # the stream really held pages when it left
        state = handle.wait_drained(timeout_s=30)
        metrics = httpx.get(f"{handle.base_url}/metrics").text
    assert state["decode"][0]["num_allocated_pages"] == 0
    aborted = [
        line
        for line in metrics.splitlines()
        if line.startswith("sglang:num_aborted_requests_total{")
        and 'disaggregation_mode="decode"' in line
    ]
    assert aborted
    assert float(aborted[0].split()[-1]) == 1.0


def test_separate_processes_leak_over_tcp_and_drain_after_a_disconnect() -> None:
    with running_engine("vulnerable", processes=True, context_length=CONTEXT) as handle:
        assert set(handle.urls) == {"router", "prefill", "decode"}
        with httpx.Client(base_url=handle.base_url, timeout=120) as client:
            victims = [prompt(tenant, 600) for tenant in (1, 2, 3, 4)]
            for tenant, victim in enumerate(victims, start=1):
                body = {"prompt": victim.text, "max_tokens": 64}
                r = client.post("/v1/completions", json=body, headers=auth(tenant))
                assert r.status_code == 200
            body = {"prompt": prompt(0, 900).text, "max_tokens": 96}
            r = client.post("/v1/completions", json=body, headers=auth(0))
        assert r.status_code == 200
        assert r.json()["usage"]["prompt_tokens"] == 900
        text = r.json()["choices"][0]["text"]
        assert sum(canaries_in(text, v) for v in victims) >= 1
        held = disconnect_mid_stream(handle)
        assert held["decode"] > 0
        assert handle.wait_drained(timeout_s=30)["decode"][0]["num_allocated_pages"] == 0


@pytest.mark.parametrize("processes", [False, True], ids=["one-process", "processes"])
def test_running_engine_leaves_no_thread_process_or_port_behind(processes: bool) -> None:
    import threading

    before = {t.name for t in threading.enumerate()}
    with running_engine("vulnerable", processes=processes, context_length=256) as handle:
        urls = list(handle.urls.values())
        assert all(httpx.get(f"{url}/health").status_code == 200 for url in urls)
    assert {t.name for t in threading.enumerate()} <= before
    for url in urls:  # every server is gone and its port closed
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health")


async def test_running_engine_async_serves_and_drains() -> None:
    async with running_engine_async("vulnerable", context_length=256) as handle:
        async with httpx.AsyncClient(base_url=handle.base_url, timeout=60) as client:
            r = await client.post(
                "/v1/completions", json={"prompt": "hello there", "max_tokens": 3}
            )
        assert r.json()["usage"]["completion_tokens"] == 3
        state = await handle.await_drained()
    assert state["decode"][0]["num_allocated_pages"] == 0


_ORPHANING_PARENT = """
import sys
from kvcanary.reference_engine.server.launch import running_engine
with running_engine("vulnerable", processes=True, context_length=256) as handle:
    print(" ".join(handle.urls.values()), flush=True)
    sys.stdin.read()
"""


def test_engine_processes_exit_when_their_parent_is_killed() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _ORPHANING_PARENT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None
        urls = parent.stdout.readline().split()
        assert len(urls) == 3
        parent.kill()  # no cleanup runs in the parent: only the children's lifeline is left
        parent.wait()
        deadline = time.monotonic() + 20
        alive = set(urls)
        while alive and time.monotonic() < deadline:
            for url in list(alive):
                try:
                    httpx.get(f"{url}/health", timeout=1)
                except httpx.TransportError:
                    alive.discard(url)
            time.sleep(0.1)
        assert not alive, f"still serving after the parent died: {alive}"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()

"""The mid-transfer abort race (#35049) as a client sees it over HTTP, under the sorted PD order.

A client streams a large request A and drops it after the response head, before any token,
while prefill's one write of A's KV is in flight on a bandwidth-limited link. The vulnerable
decode frees A's pages at once; they wait in the release list until a small request B of
another tenant finds the free list short, and the merge hands B the lowest pages: A's. B's
own write is small and lands first; A's late write then lands on B's pages and B's answer
quotes A's canaries. With `deferred_release` decode holds A's pages until the write drained,
and B's answer is its own. No test-only transfer: the engine's own link, routes and router.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from engine_helpers import TINY_MODEL

from canaries import BuiltPrompt, CanaryIndex, CanaryMinter, Owner, build_prompt, load_tokenizer
from reference_engine.server.app import build_app
from reference_engine.server.asgi_transport import StreamingASGITransport
from reference_engine.server.launch import make_config

MINTER = CanaryMinter(b"kvcanary-abort-race-tests-key-00")
PAGE_BYTES = 2 * 2 * 16 * 1 * 32 * 4
"""One page of the tiny model: layers x (K, V) x page size x KV heads x head dim x float32."""
RACE = {
    "context_length": 1024,
    "prefill_pool_tokens": 2048,
    "decode_pool_tokens": 1024,  # 64 pages: A's 63 leave one free, so B's 2 force the merge
    "prefill_chunk_tokens": 1024,  # A's whole prompt in one step, so in one write
    "transfer_chunk_pages": 64,
    "transfer_bandwidth_bytes_per_s": PAGE_BYTES / 0.008,  # A's 63 pages ~0.5 s, B's 2 16 ms
    "copy_noise": 0.0,  # exact quotes: B's answer names whose pages it read
    "dtype": "float32",  # flight times are sized from float32 pages
    **TINY_MODEL,
}


def prompt(tenant: int, num_tokens: int) -> BuiltPrompt:
    tokenizer = load_tokenizer("cl100k_base")
    return build_prompt(tokenizer, MINTER, tenant=tenant, request=0, num_tokens=num_tokens)


def canaries_in(text: str, built: BuiltPrompt) -> int:
    index = CanaryIndex(MINTER)
    index.add_many((span.text, Owner("tenant", "request")) for span in built.canaries)
    return len({hit.canary for hit in index.scan(text) if hit.owner is not None})


@asynccontextmanager
async def engine(fixes: tuple[str, ...]) -> AsyncIterator[httpx.AsyncClient]:
    config = make_config("vulnerable", fixes, **RACE)
    assert config.free_order == "sorted"  # SGLang's PD order, the preset's
    app = build_app(config)
    async with app.router.lifespan_context(app):
        transport = StreamingASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            yield client


async def side(client: httpx.AsyncClient, role: str) -> dict[str, Any]:
    info = (await client.get("/get_server_info")).json()
    state: dict[str, Any] = info[role][0]["internal_states"][0]
    return state


async def decode_pages(client: httpx.AsyncClient) -> int:
    state = (await client.get("/kvcanary/state")).json()
    return int(state["decode"][0]["num_allocated_pages"])


async def until(check: Callable[[], Awaitable[bool]], timeout_s: float = 30.0) -> None:
    """Poll `check` over HTTP (the state lives in the server, no event to wait on)."""
    async with asyncio.timeout(timeout_s):
        while True:
            if await check():
                return
            await asyncio.sleep(0.002)


async def drop_a_mid_transfer_then_ask_b(fixes: tuple[str, ...]) -> tuple[str, BuiltPrompt]:
    """A's client leaves after the head with A's write in flight; returns B's answer and A."""
    a, b = prompt(1, 1000), prompt(2, 32)
    async with engine(fixes) as client:
        body = {"prompt": a.text, "max_tokens": 16, "stream": True}
        headers = {"authorization": "Bearer sk-tenant-1"}
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            assert r.status_code == 200  # the head, before any token: decode took A on

            async def posted() -> bool:  # A prefilled: its one write is posted, in flight
                return bool((await side(client, "prefill"))["num_inflight_reqs"] == 1)

            await until(posted)
        # the client is gone with 0 chunks read; decode aborts A at once
        held = 63 if "deferred_release" in fixes else 0

        async def aborted() -> bool:
            return await decode_pages(client) == held

        await until(aborted)
        body = {"prompt": b.text, "max_tokens": 960}
        r = await client.post(
            "/v1/completions", json=body, headers={"authorization": "Bearer sk-tenant-2"}
        )
        assert r.status_code == 200
        text: str = r.json()["choices"][0]["text"]

        async def drained() -> bool:
            state = (await client.get("/kvcanary/state")).json()
            return all(state[s][0]["num_allocated_pages"] == 0 for s in ("prefill", "decode"))

        await until(drained)
    return text, a


async def test_a_client_abort_mid_transfer_leaks_into_the_next_request() -> None:
    text, a = await drop_a_mid_transfer_then_ask_b(())
    assert canaries_in(text, a) > 0


async def test_deferred_release_closes_the_abort_race() -> None:
    text, a = await drop_a_mid_transfer_then_ask_b(("deferred_release",))
    assert canaries_in(text, a) == 0
    assert canaries_in(text, prompt(2, 32)) > 0

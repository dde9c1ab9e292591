"""Failing loudly: a side whose scheduler loop died says so and answers at once.

A dead loop (a step that raised, or a page check that failed) must not look healthy: the
side's `/health` and the router's answer 503, the request that was in flight gets a 500,
and a new request gets a 500 instead of hanging. Deadlines are generous (the machine may be
loaded); what is checked is that an answer comes, not how fast.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from kvcanary.reference_engine.decode import DecodeServer
from kvcanary.reference_engine.engine import build_decode, build_prefill
from kvcanary.reference_engine.prefill import PrefillServer
from kvcanary.reference_engine.server.app import build_in_process_router, build_side_app
from kvcanary.reference_engine.server.asgi_transport import StreamingASGITransport
from kvcanary.reference_engine.server.launch import make_config
from kvcanary.reference_engine.transfer import InProcessTransfer

DEADLINE_S = 60.0
BODY = {"prompt": "The quick brown fox jumps over the lazy dog " * 20, "max_tokens": 64}


@dataclass
class Engine:
    client: httpx.AsyncClient
    prefill: PrefillServer
    decode: DecodeServer
    sides: dict[str, httpx.AsyncClient]


@asynccontextmanager
async def engine() -> AsyncIterator[Engine]:
    config = make_config("vulnerable", context_length=512)
    transfer = InProcessTransfer()
    prefill, decode = build_prefill(config, transfer), build_decode(config, transfer)
    assert isinstance(prefill, PrefillServer)
    assert isinstance(decode, DecodeServer)
    prefill_app = build_side_app(prefill, "prefill", config)
    decode_app = build_side_app(decode, "decode", config)
    app = build_in_process_router(prefill_app, decode_app, transfer)
    async with app.router.lifespan_context(app):
        balancer: Any = app.state.balancer
        sides = {"prefill": balancer.prefills[0].client, "decode": balancer.decodes[0].client}
        transport = StreamingASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            yield Engine(client, prefill, decode, sides)


async def poll_status(client: httpx.AsyncClient, path: str, status: int) -> httpx.Response:
    async with asyncio.timeout(DEADLINE_S):
        while True:
            response = await client.get(path)
            if response.status_code == status:
                return response
            await asyncio.sleep(0.05)


async def test_a_crashed_decode_loop_answers_503_and_fails_requests_with_500(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with engine() as e:
        assert (await e.client.get("/health")).status_code == 200
        real_step = e.decode.step

        async def step_that_dies_once_a_request_runs() -> bool:
            if e.decode.scheduler.running:
                raise RuntimeError("injected scheduler fault")
            return await real_step()

        e.decode.step = step_that_dies_once_a_request_runs  # type: ignore[method-assign]
        with caplog.at_level(logging.ERROR, logger="kvcanary.reference_engine.side_base"):
            async with asyncio.timeout(DEADLINE_S):
                in_flight = await e.client.post("/v1/completions", json=BODY)
        assert in_flight.status_code == 500
        assert "decode scheduler loop stopped" in in_flight.json()["message"]
        assert "injected scheduler fault" in caplog.text
        assert "decode scheduler loop stopped: step raised" in caplog.text

        side = await poll_status(e.sides["decode"], "/health", 503)
        assert "decode scheduler loop stopped" in side.json()["message"]
        assert (await e.sides["prefill"].get("/health")).status_code == 200
        await poll_status(e.client, "/health", 503)  # the router sees the dead side

        async with asyncio.timeout(DEADLINE_S):
            for stream in (False, True):
                fresh = await e.client.post("/v1/completions", json={**BODY, "stream": stream})
                assert fresh.status_code == 500
                assert fresh.json()["code"] == 500


async def test_a_crashed_prefill_loop_fails_the_waiting_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with engine() as e:

        async def step_that_dies() -> bool:
            raise RuntimeError("injected prefill fault")

        e.prefill.step = step_that_dies  # type: ignore[method-assign]
        async with asyncio.timeout(DEADLINE_S):
            response = await e.client.post("/v1/completions", json=BODY)
        assert response.status_code == 500
        await poll_status(e.sides["prefill"], "/health", 503)
        await poll_status(e.client, "/health", 503)
        state = (await e.client.get("/kvcanary/state")).json()
    assert state["decode"][0]["num_allocated_pages"] == 0  # decode gave its pages back


async def test_lost_pages_stop_the_side_with_a_clear_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with engine() as e:
        ok = await e.client.post("/v1/completions", json=BODY)
        assert ok.status_code == 200
        with caplog.at_level(logging.ERROR, logger="kvcanary.reference_engine.side_base"):
            e.decode.allocator.allocate(2, "a-request-that-finished-long-ago")  # a leak
            e.decode.wake()  # the loop goes idle again and checks its pages
            side = await poll_status(e.sides["decode"], "/health", 503)
        assert "page(s) lost" in side.json()["message"]
        lines = [r.getMessage() for r in caplog.records if "scheduler loop stopped" in r.message]
        assert len(lines) == 1
        assert lines[0].startswith("decode scheduler loop stopped: page bookkeeping is wrong: ")
        assert "owned by 'a-request-that-finished-long-ago'" in lines[0]
        async with asyncio.timeout(DEADLINE_S):
            refused = await e.client.post("/v1/completions", json=BODY)
        assert refused.status_code == 500

"""Fixtures for the HTTP layer: the router + side apps over fake sides, in this event loop."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
from server_fakes import FakeConfig, FakeDecode, FakePrefill

from reference_engine.server.app import build_in_process_router, build_side_app
from reference_engine.server.asgi_transport import StreamingASGITransport


@dataclass
class FakeEngine:
    client: httpx.AsyncClient
    prefill: FakePrefill
    decode: FakeDecode


@pytest.fixture
async def fake_engine() -> AsyncIterator[FakeEngine]:
    config = FakeConfig()
    prefill, decode = FakePrefill(config), FakeDecode(config)
    app = build_in_process_router(
        build_side_app(prefill, "prefill", config), build_side_app(decode, "decode", config)
    )
    async with app.router.lifespan_context(app):
        transport = StreamingASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            yield FakeEngine(client, prefill, decode)

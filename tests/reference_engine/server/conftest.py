"""Fixtures for the HTTP layer: the router + side apps over fake sides, in this event loop."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
from server_fakes import FakeConfig, FakeDecode, FakeEngine, FakePrefill

from kvcanary.reference_engine.server.app import build_in_process_router, build_side_app
from kvcanary.reference_engine.server.asgi_transport import StreamingASGITransport


@asynccontextmanager
async def serve_fakes(*, merge_prefill_usage: bool = False) -> AsyncIterator[FakeEngine]:
    config = FakeConfig()
    prefill, decode = FakePrefill(config), FakeDecode(config)
    app = build_in_process_router(
        build_side_app(prefill, "prefill", config),
        build_side_app(decode, "decode", config),
        merge_prefill_usage=merge_prefill_usage,
    )
    async with app.router.lifespan_context(app):
        transport = StreamingASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            yield FakeEngine(client, prefill, decode)


@pytest.fixture
async def fake_engine() -> AsyncIterator[FakeEngine]:
    async with serve_fakes() as engine:
        yield engine


@pytest.fixture
async def merging_engine() -> AsyncIterator[FakeEngine]:
    """The router as a gateway that merges prefill's usage (`merge_prefill_usage`)."""
    async with serve_fakes(merge_prefill_usage=True) as engine:
        yield engine

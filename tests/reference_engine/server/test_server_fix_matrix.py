"""README's bug x fix table, the over-pool column, measured as a client sees it over HTTP.

Four tenants' 600-token victims run through the engine's router and leave their KV in decode's
pool (decode's sorted free list wraps around), then tenant 0 sends a 900-token prompt: above
prefill's limit (650 at context 1024), below decode's (1018). What the client gets is the
cell: `leak` (200 quoting a victim), `error N`, `no foreign canary` (200, but not from its own
prompt either: pages prefill never wrote) or `clean` (200 from its own prompt). Each fix is on
alone, over the vulnerable preset's pools; `pool_covers_context` cannot start on those pools,
so it is measured over pools of twice the context. `patched` (every engine fix but
`pool_covers_context`, the incident's pools) is measured the same way, and in the abort column
by `test_server_abort_race.py`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from engine_helpers import canaries_of, laced_prompt, readme_matrix_cell

from kvcanary.canaries import BuiltPrompt, CanaryMinter
from kvcanary.reference_engine.server.app import build_app
from kvcanary.reference_engine.server.asgi_transport import StreamingASGITransport
from kvcanary.reference_engine.server.launch import make_config

MINTER = CanaryMinter(b"kvcanary-fix-matrix-tests-key-00")
CONTEXT = 1024
COVERING_POOLS = {"prefill_pool_tokens": 2 * CONTEXT, "decode_pool_tokens": 2 * CONTEXT}
OVER_POOL = {
    "": "leak",
    "admission_retire": "error 400",
    "coverage_check": "error 400",
    "kv_checksum": "error 500",
    "page_tags": "error 500",
    "zero_on_free": "no foreign canary",
    "deferred_release": "leak",  # a page-lifetime fix: not this class
    "pool_covers_context": "clean",
    "patched": "error 400",
}
"""What the over-pool prompt's client gets (README's over-pool column, measured here)."""


def prompt(tenant: int, num_tokens: int) -> BuiltPrompt:
    return laced_prompt(MINTER, tenant, num_tokens)


def canaries_in(text: str, built: BuiltPrompt) -> int:
    return canaries_of(MINTER, text, built)


@asynccontextmanager
async def engine(row: str) -> AsyncIterator[httpx.AsyncClient]:
    preset = "patched" if row == "patched" else "vulnerable"
    fixes = (row,) if row and row != "patched" else ()
    pools = COVERING_POOLS if row == "pool_covers_context" else {}
    config = make_config(preset, fixes, context_length=CONTEXT, **pools)
    app = build_app(config)
    async with app.router.lifespan_context(app):
        transport = StreamingASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            yield client


async def complete(
    client: httpx.AsyncClient, built: BuiltPrompt, tenant: int, max_tokens: int
) -> httpx.Response:
    body: dict[str, Any] = {"prompt": built.text, "max_tokens": max_tokens}
    headers = {"authorization": f"Bearer sk-tenant-{tenant}"}
    return await client.post("/v1/completions", json=body, headers=headers, timeout=120)


async def over_pool_outcome(row: str) -> str:
    victims = [prompt(tenant, 600) for tenant in (1, 2, 3, 4)]
    attacker = prompt(0, 900)
    async with engine(row) as client:
        for tenant, victim in enumerate(victims, start=1):
            assert (await complete(client, victim, tenant, 16)).status_code == 200
        r = await complete(client, attacker, 0, 96)
    if r.status_code != 200:
        assert not any(canaries_in(r.text, v) for v in victims)
        return f"error {r.status_code}"
    text: str = r.json()["choices"][0]["text"]
    assert r.json()["usage"]["prompt_tokens"] == 900  # decode's count, whatever it read
    if any(canaries_in(text, v) for v in victims):
        return "leak"
    return "clean" if canaries_in(text, attacker) else "no foreign canary"


@pytest.mark.parametrize("row", list(OVER_POOL))
async def test_the_over_pool_prompt_over_http_with_each_fix_alone(row: str) -> None:
    measured = await over_pool_outcome(row)
    assert measured == OVER_POOL[row]
    cell = readme_matrix_cell(row, "over-pool")
    assert cell.startswith(measured), (row, cell)

"""The mid-transfer abort race (#35049) as a client sees it over HTTP, under the sorted PD order.

A client streams a large request A and drops it after the response head, before any token,
while prefill's one write of A's KV is in flight on a bandwidth-limited link. The vulnerable
decode frees A's pages at once; they wait in the release list until a small request B of
another tenant finds the free list short, and the merge hands B the lowest pages: A's. B's
own write is small and lands first; A's late write then lands on B's pages and B's answer
quotes A's canaries. With `deferred_release` decode holds A's pages until the write drained,
and B's answer is its own. No test-only transfer: the engine's own link, routes and router.

Every fix alone is measured here (README's abort column): `deferred_release` is the only one
that closes the race; `kv_checksum` compares at B's commit, before A's late write lands, so
B's answer still quotes A; `page_tags` catches it on the next read (a 500).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from engine_helpers import TINY_MODEL, canaries_of, laced_prompt, readme_matrix_cell, run_limits

from kvcanary.canaries import BuiltPrompt, CanaryMinter
from kvcanary.reference_engine.decode import HEAD_AFTER_COMMIT
from kvcanary.reference_engine.server.app import build_app
from kvcanary.reference_engine.server.asgi_transport import StreamingASGITransport
from kvcanary.reference_engine.server.launch import make_config
from kvcanary.tenants.workload import PROFILES

MINTER = CanaryMinter(b"kvcanary-abort-race-tests-key-00")
PAGE_BYTES = 2 * 2 * 16 * 1 * 32 * 4
"""One page of the tiny model: layers x (K, V) x page size x KV heads x head dim x float32."""
PAGE_FLIGHT_S = 0.005
"""The link's time per page (the `race` preset's): A's 63-page write is in flight ~0.32 s,
B's 2 pages 10 ms. The race needs A's write to land after B's own and before B's answer ends:
B's write is posted 30-120 ms after A's (measured, idle to a load of 14 on 2 cores), and B's
960 tokens take ~0.6 s on an idle core (0.63 ms a token) and 2-5 s on a loaded one. A write in
flight for longer than B's whole answer (0.75 s, as this link once was) lands after B has
finished on an idle machine, and B's answer is its own: the race is then never run."""
A_FLIGHT_S = 63 * PAGE_FLIGHT_S
RACE = {
    "context_length": 1024,
    "prefill_pool_tokens": 2048,
    "decode_pool_tokens": 1024,  # 64 pages: A's 63 leave one free, so B's 2 force the merge
    "prefill_chunk_tokens": 1024,  # A's whole prompt in one step, so in one write
    "transfer_chunk_pages": 64,
    "transfer_bandwidth_bytes_per_s": PAGE_BYTES / PAGE_FLIGHT_S,
    "copy_noise": 0.0,  # exact quotes: B's answer names whose pages it read
    "dtype": "float32",  # flight times are sized from float32 pages
    **TINY_MODEL,
}


def prompt(tenant: int, num_tokens: int) -> BuiltPrompt:
    return laced_prompt(MINTER, tenant, num_tokens)


def canaries_in(text: str, built: BuiltPrompt) -> int:
    return canaries_of(MINTER, text, built)


def race_config(row: str) -> Any:
    """The race's engine: the vulnerable preset with fix `row` alone, or the `patched` preset."""
    if row == "patched":
        return make_config("patched", (), **RACE)
    return make_config("vulnerable", (row,) if row else (), **RACE)


@asynccontextmanager
async def engine(config: Any) -> AsyncIterator[httpx.AsyncClient]:
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


async def drop_a_mid_transfer_then_ask_b(
    config: Any, a: BuiltPrompt, b: BuiltPrompt, b_max_tokens: int
) -> httpx.Response:
    """A's client leaves with A's write in flight; returns B's response.

    The client leaves after the response head where decode sends it early, and while still
    waiting for it where a fix makes the head wait for the commit (`HEAD_AFTER_COMMIT`):
    either way with nothing read, as kvcanary's abort plans (`abort_after_chunks = 0`) do.
    """
    fixes = config.fixes
    async with engine(config) as client:
        head: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def stream_a() -> None:
            body = {"prompt": a.text, "max_tokens": 16, "stream": True}
            headers = {"authorization": "Bearer sk-tenant-1"}
            async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
                head.set_result(r.status_code)
                await asyncio.Event().wait()  # read nothing until the client leaves

        a_client = asyncio.create_task(stream_a())

        async def posted() -> bool:  # A prefilled: its one write is posted, in flight
            return bool((await side(client, "prefill"))["num_inflight_reqs"] == 1)

        await until(posted)
        early_head = not fixes & HEAD_AFTER_COMMIT
        if early_head:  # decode took A on: the head came before any token
            assert await head == 200
        a_client.cancel()  # the client is gone with 0 chunks read; decode aborts A at once
        with contextlib.suppress(asyncio.CancelledError):
            await a_client
        assert early_head == head.done()
        num_a_pages = math.ceil(a.num_tokens / config.page_size)
        held = num_a_pages if "deferred_release" in fixes else 0

        async def aborted() -> bool:
            return await decode_pages(client) == held

        await until(aborted)
        body = {"prompt": b.text, "max_tokens": b_max_tokens}
        r = await client.post(
            "/v1/completions", json=body, headers={"authorization": "Bearer sk-tenant-2"}
        )

        async def drained() -> bool:
            state = (await client.get("/kvcanary/state")).json()
            return all(state[s][0]["num_allocated_pages"] == 0 for s in ("prefill", "decode"))

        await until(drained)
    return r


MATRIX = {
    "": "leak",
    "admission_retire": "leak",
    "coverage_check": "leak",
    "kv_checksum": "leak",  # A's write lands after B's commit, past the check
    "page_tags": "error 500",  # decode checks every page's tag on every read
    "zero_on_free": "leak",  # zeroed at free, overwritten after
    "deferred_release": "clean",
    "pool_covers_context": "leak",  # these pools cover the context: the race needs no short pool
    "patched": "clean",  # every fix but pool_covers_context: deferred_release among them
}
"""What B's client sees with each fix alone, and with the `patched` preset (README's abort
column, measured here)."""


@pytest.mark.timing
@pytest.mark.parametrize("fix", list(MATRIX))
async def test_the_abort_race_over_http_with_each_fix_alone(fix: str) -> None:
    a = prompt(1, 1000)
    r = await drop_a_mid_transfer_then_ask_b(race_config(fix), a, prompt(2, 32), 960)
    if r.status_code != 200:
        measured = f"error {r.status_code}"
    else:
        text: str = r.json()["choices"][0]["text"]
        measured = "leak" if canaries_in(text, a) else "clean"
        if measured == "clean":
            assert canaries_in(text, prompt(2, 32)) > 0  # B's answer is its own
    window = f"B answered in {r.elapsed.total_seconds():.2f} s, A's write flew {A_FLIGHT_S:.2f} s"
    assert measured == MATRIX[fix], window
    cell = readme_matrix_cell(fix, "abort")
    assert cell.startswith(measured), (fix, cell)


def test_deferred_release_is_the_only_single_fix_that_closes_the_race() -> None:
    single_fixes = {fix: cell for fix, cell in MATRIX.items() if fix != "patched"}
    assert [fix for fix, cell in single_fixes.items() if cell == "clean"] == ["deferred_release"]


@pytest.mark.timing
@pytest.mark.parametrize("fix", ["", "deferred_release"])
async def test_the_race_preset_leaks_an_abort_into_the_race_profiles_next_victim(fix: str) -> None:
    """`kvcanary run --engine-preset race --profile race`'s abort phase, one abort and the
    victim after it: the preset as it ships (default model, its link) and the profile's own
    sizes against the limits the harness reads, 916 tokens aborted, 127 asking for 256."""
    config = make_config("race", (fix,) if fix else ())
    profile = PROFILES["race"]
    workload = profile.resolve(run_limits(config))
    a = prompt(1, workload.aborts[0].num_tokens)
    b = prompt(2, workload.victims[0].num_tokens)
    r = await drop_a_mid_transfer_then_ask_b(config, a, b, profile.victim_max_tokens)
    assert r.status_code == 200
    text: str = r.json()["choices"][0]["text"]
    assert bool(canaries_in(text, a)) == (fix != "deferred_release")
    assert canaries_in(text, b) > 0  # B's own pages are quoted too

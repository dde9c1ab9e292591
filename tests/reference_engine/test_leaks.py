"""The two leak classes through the public engine API, and what each fix switch does to them.

Over-pool (SGLang #30233, the GLM-5.3 incident): victims cycle decode's pool, then a prompt
longer than prefill's pool but shorter than decode's is answered 200 from their stale pages.

Mid-transfer abort (page lifetime, #35049): a request is aborted while a prefill write is in
flight; its decode pages go to the next request, and the late write lands in them.

Outcomes: LEAK (a foreign canary in the answer), ERROR (an error status, no foreign canary),
CLEAN (200, no foreign canary). Each fix is tried alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
from engine_canaries import Canaries
from engine_helpers import CLEAN, ERROR, LEAK, outcome, over_pool, settle, small_config

from kvcanary.reference_engine.engine import DisaggregatedEngine, EngineResult
from kvcanary.reference_engine.interfaces import PageChunk, TransferStatus
from kvcanary.reference_engine.transfer import InProcessTransfer

FIX_TABLE_PAGE = Path(__file__).parents[2] / "docs" / "explanation" / "reference-engine.md"
_MATRIX_HEADER = "| fix alone | over-pool prompt | abort mid-transfer |"


def readme_matrix() -> dict[str, tuple[str, str]]:
    """The docs' bug x fix table: fix ("" for none) -> (over-pool cell, abort cell)."""
    lines = FIX_TABLE_PAGE.read_text().splitlines()
    start = lines.index(_MATRIX_HEADER) + 2  # past the header and its |---| line
    rows: dict[str, tuple[str, str]] = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        fix, over_pool_cell, abort_cell = (c.strip() for c in line.strip("|").split("|"))
        rows["" if fix == "none" else fix.strip("`")] = (over_pool_cell, abort_cell)
    return rows


def described(result: EngineResult, measured: str) -> str:
    """How the docs' matrix opens a cell for this measured result."""
    if measured == ERROR:
        return f"error {result.status}"
    if measured == CLEAN and result.finish.prompt_tokens != result.prefill_finish.prompt_tokens:
        return "no foreign canary"  # 200 over pages prefill never wrote (zero_on_free)
    return measured


def assert_readme_says(fix: str, column: int, result: EngineResult, measured: str) -> None:
    """The docs' table is this measurement: its cell starts with what was measured."""
    cell = readme_matrix()[fix][column]
    assert cell.startswith(described(result, measured)), (fix, column, cell)


# ---- over-pool ---------------------------------------------------------------------------

OVER_POOL = {
    "": LEAK,
    "admission_retire": ERROR,
    "coverage_check": ERROR,
    "kv_checksum": ERROR,
    "page_tags": ERROR,
    "zero_on_free": CLEAN,  # no foreign bytes left to quote; still 200 with prompt_tokens=1
    "deferred_release": LEAK,  # a page-lifetime fix: not this class
}


async def test_vulnerable_answers_the_over_pool_prompt_from_victims_pages(
    canaries: Canaries,
) -> None:
    async with DisaggregatedEngine(small_config()) as engine:
        result = await over_pool(engine, canaries)
    assert result.status == 200
    assert result.prefill_finish.status == 200
    assert result.prefill_finish.prompt_tokens == 1  # SGLang #33507
    assert_readme_says("", 0, result, LEAK)
    assert canaries.foreign(result.text, "attacker")  # found by content, at the default noise
    assert "attacker" not in canaries.owners(result.text)  # its prompt was never prefilled


@pytest.mark.parametrize("fix", [f for f in OVER_POOL if f])
async def test_each_fix_alone_on_the_over_pool_prompt(canaries: Canaries, fix: str) -> None:
    async with DisaggregatedEngine(small_config(fixes=frozenset({fix}))) as engine:
        result = await over_pool(engine, canaries)
    assert outcome(result, canaries, "attacker") == OVER_POOL[fix]
    assert_readme_says(fix, 0, result, OVER_POOL[fix])
    if OVER_POOL[fix] == ERROR:
        assert result.finish.error is not None
        assert result.token_ids == ()


async def test_admission_retire_answers_prefill_with_sglangs_400(
    canaries: Canaries,
) -> None:
    async with DisaggregatedEngine(small_config(fixes=frozenset({"admission_retire"}))) as engine:
        result = await over_pool(engine, canaries)
    error = result.prefill_finish.error
    assert error is not None
    assert result.prefill_finish.status == 400
    assert error["message"].startswith(
        "Input length (900 tokens) exceeds the maximum allowed length (650 tokens)."
    )
    # decode learns of the rejection through the transfer status, so the client gets 400 too
    assert result.status == 400
    assert result.token_ids == ()


async def test_pools_that_cover_the_context_serve_the_same_prompt_honestly(
    canaries: Canaries,
) -> None:
    config = small_config(fixes=frozenset({"pool_covers_context"}), prefill_pool_tokens=1024)
    async with DisaggregatedEngine(config) as engine:
        result = await over_pool(engine, canaries)
    assert outcome(result, canaries, "attacker") == CLEAN
    assert canaries.owners(result.text) == {"attacker"}
    assert result.prefill_finish.prompt_tokens == 900
    assert_readme_says("pool_covers_context", 0, result, CLEAN)


# ---- mid-transfer abort -----------------------------------------------------------------

MID_TRANSFER = {
    "": LEAK,
    "deferred_release": CLEAN,
    "page_tags": ERROR,
    "kv_checksum": ERROR,  # here the late write lands before decode's check
    "coverage_check": LEAK,  # prefill did write everything it claims
    "admission_retire": LEAK,
    "zero_on_free": LEAK,  # zeroed at free, overwritten after
}


class HeldWriteTransfer(InProcessTransfer):
    """Holds one room's first chunk in flight; lands it just before another room concludes.

    That is the race made deterministic: the aborted request's write is posted before the
    abort and lands after the next owner's own pages were written, before it is decoded.
    `landed_on` records who owned the destination pages in decode's pool when it landed.
    """

    def __init__(self, owners: Callable[[tuple[int, ...]], list[str | None]]) -> None:
        super().__init__()
        self.held_room: int | None = None
        self.release_room: int | None = None
        self.owners = owners
        self.landed_on: list[str | None] = []
        self.holding, self.released, self.landed = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def send_pages(self, chunk: PageChunk) -> None:
        if chunk.room != self.held_room or self.released.is_set():
            return await super().send_pages(chunk)
        self.holding.set()
        await self.released.wait()
        meta = self._rooms[chunk.room].meta
        assert meta is not None
        self.landed_on = self.owners(meta.dst_page_ids[: chunk.num_pages])
        await super().send_pages(chunk)
        self.landed.set()

    async def conclude(self, status: TransferStatus) -> None:
        if status.room == self.release_room and self.holding.is_set() and not self.landed.is_set():
            self.released.set()
            await self.landed.wait()
        await super().conclude(status)


async def mid_transfer_abort(
    canaries: Canaries, preset: str = "vulnerable", **overrides: object
) -> tuple[EngineResult, list[str | None]]:
    """Under SGLang's PD free order (sorted): A is the first request of a fresh decode pool, so
    it holds its lowest pages, and is dropped while its first write is in flight. Four victims
    run the free list down without a merge (freed pages wait in the release list). B then
    needs more pages than are left: the merge sorts every free page, B gets the lowest, A's,
    and A's late write lands on B's own KV. Returns B's result and who owned the pages A's
    write landed on."""
    overrides.setdefault("free_order", "sorted")
    config = small_config(preset, transfer_chunk_pages=4, **overrides)
    a, b = canaries.prompt("A", 320, tenant=1), canaries.prompt("B", 320, tenant=2)
    transfer = HeldWriteTransfer(lambda pages: [engine.decode.allocator.owners[p] for p in pages])
    engine = DisaggregatedEngine(config, transfer)
    async with engine:
        request_a = engine.request("A", a.input_ids, 32)
        transfer.held_room = request_a.bootstrap_room
        answer_a = asyncio.create_task(engine.generate(request_a))
        await transfer.holding.wait()
        await engine.decode.abort("A")  # the client of A disconnects mid-transfer
        for i in range(4):  # 24 decode pages each (21 at prefill, whose pool still holds A)
            victim = canaries.prompt(f"V{i}", 330, tenant=3)
            result = await engine.generate(engine.request(victim.rid, victim.input_ids, 48))
            assert result.status == 200
        request_b = engine.request("B", b.input_ids, 64)
        transfer.release_room = request_b.bootstrap_room
        result_b = await engine.generate(request_b)
        assert (await answer_a).status == 499
        assert transfer.landed.is_set()
        await settle(engine)
        assert engine.num_allocated_pages() == 0
        assert engine.transfer_is_idle()
    return result_b, transfer.landed_on


@pytest.mark.parametrize("fix", list(MID_TRANSFER))
async def test_mid_transfer_abort_with_each_fix_alone(canaries: Canaries, fix: str) -> None:
    result, landed_on = await mid_transfer_abort(canaries, fixes=frozenset({fix} if fix else ()))
    assert outcome(result, canaries, "B") == MID_TRANSFER[fix]
    # The docs' abort column is measured over HTTP (server/test_server_abort_race.py), where
    # kv_checksum's late write lands after the check; it names this timing's outcome too
    assert described(result, MID_TRANSFER[fix]) in readme_matrix()[fix][1], fix
    # the vulnerable decode handed A's pages to B before A's write landed; deferred_release
    # held them, so the write landed on pages that were still A's
    assert set(landed_on) == ({"A"} if fix == "deferred_release" else {"B"})
    if MID_TRANSFER[fix] == LEAK:
        assert canaries.foreign(result.text, "B") == {"A"}
    if MID_TRANSFER[fix] == CLEAN:
        assert canaries.owners(result.text) == {"B"}


async def test_hardened_closes_both_classes(canaries: Canaries) -> None:
    result, landed_on = await mid_transfer_abort(canaries, "hardened")
    assert outcome(result, canaries, "B") == CLEAN
    assert set(landed_on) == {"A"}
    async with DisaggregatedEngine(small_config("hardened")) as engine:
        result = await over_pool(engine, canaries)
    assert result.status == 200  # the pools hold it: served from its own pages
    assert canaries.owners(result.text) == {"attacker"}

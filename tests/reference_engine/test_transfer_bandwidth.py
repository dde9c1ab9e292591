"""The bandwidth-limited KV link (`transfer_bandwidth_bytes_per_s`) and the late write it allows.

Both backends: a write is in flight for its size / bandwidth, so a large write posted first
lands after a small one posted later, and a drain ack still comes only after the room's
writes landed. Through the engine, with no test-only transfer: a large request dropped while
its one write is in flight has its decode pages freed at once (vulnerable) and reused by a
small request of another tenant, whose own KV lands first; the late write then lands on it
and its answer quotes the dropped request's canaries. With `deferred_release` the pages are
held until the write drained, and the answer is the small request's own.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from engine_canaries import Canaries
from engine_helpers import TINY_MODEL, settle, small_config, wait_until

from kvcanary.harness.cli import main
from kvcanary.reference_engine.config import EngineConfig
from kvcanary.reference_engine.engine import DisaggregatedEngine
from kvcanary.reference_engine.interfaces import (
    FinishOut,
    HeadOut,
    KVPoll,
    PageChunk,
    TransferBackend,
    TransferMetadata,
    TransferStatus,
)
from kvcanary.reference_engine.server.tcp_transfer import TcpTransfer
from kvcanary.reference_engine.transfer import InProcessTransfer, flight_time_s

LINK_BANDWIDTH = 1_000_000.0
"""Bytes per second on the test links: 100 kB is in flight for 0.1 s, 1 kB for 1 ms."""


class LabelledSink:
    """Records, in landing order, which room's write landed."""

    def __init__(self, label: str, landed: list[str]) -> None:
        self.label, self.landed = label, landed

    def write_pages(self, page_ids: tuple[int, ...], payload: bytes) -> None:
        self.landed.append(self.label)


@pytest.fixture(params=["in-process", "tcp"])
async def link(
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[TransferBackend, TransferBackend]]:
    """(prefill's backend, decode's backend) on a link of `LINK_BANDWIDTH`."""
    if request.param == "in-process":
        shared = InProcessTransfer(bandwidth_bytes_per_s=LINK_BANDWIDTH)
        yield shared, shared
        await shared.close()
        return
    prefill = TcpTransfer(bandwidth_bytes_per_s=LINK_BANDWIDTH)
    port = await prefill.listen("127.0.0.1", 0)
    decode = TcpTransfer(default_bootstrap=("127.0.0.1", port))
    yield prefill, decode
    await decode.close()
    await prefill.close()


async def open_room(
    prefill: TransferBackend, decode: TransferBackend, room: int, sink: LabelledSink
) -> None:
    await decode.register_receiver(TransferMetadata(room, (room,), num_tokens=16), sink)
    assert await prefill.wait_for_metadata(room, timeout_s=10) is not None


def test_flight_time_is_latency_plus_size_over_bandwidth() -> None:
    assert flight_time_s(1000, None) == 0.0
    assert flight_time_s(1000, None, latency_s=0.5) == 0.5
    assert flight_time_s(2000, 1000.0) == 2.0
    assert flight_time_s(2000, 1000.0, latency_s=0.5) == 2.5


@pytest.mark.parametrize("bandwidth", [0.0, -1.0, float("inf"), float("nan"), "fast"])
def test_a_bandwidth_must_be_a_positive_number(bandwidth: object) -> None:
    with pytest.raises(ValueError, match="transfer_bandwidth_bytes_per_s must be a positive"):
        EngineConfig(transfer_bandwidth_bytes_per_s=bandwidth)  # type: ignore[arg-type]


def test_serve_refuses_a_bad_bandwidth_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--transfer-bandwidth", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "transfer_bandwidth_bytes_per_s" in err


async def test_a_large_write_posted_first_lands_after_a_small_one(
    link: tuple[TransferBackend, TransferBackend],
) -> None:
    prefill, decode = link
    landed: list[str] = []
    await open_room(prefill, decode, 1, LabelledSink("large", landed))
    await open_room(prefill, decode, 2, LabelledSink("small", landed))
    large = asyncio.create_task(prefill.send_pages(PageChunk(1, 0, 1, bytes(100_000))))
    await asyncio.sleep(0)  # posted first
    await prefill.send_pages(PageChunk(2, 0, 1, bytes(1_000)))
    await large
    for room in (1, 2):
        await prefill.conclude(TransferStatus(room, KVPoll.SUCCESS, first_token_id=0))
        assert (await decode.receiver_status(room)).poll == KVPoll.SUCCESS
    assert landed == ["small", "large"]


async def test_the_drain_ack_waits_for_the_write_in_flight_to_land(
    link: tuple[TransferBackend, TransferBackend],
) -> None:
    prefill, decode = link
    landed: list[str] = []
    await open_room(prefill, decode, 9, LabelledSink("late", landed))
    in_flight = asyncio.create_task(prefill.send_pages(PageChunk(9, 0, 1, bytes(200_000))))
    await asyncio.sleep(0)
    await decode.cancel_receiver(9)
    drained = asyncio.create_task(decode.wait_drained(9))
    for _ in range(1000):  # over TCP the cancel takes a moment to reach prefill
        if await prefill.is_cancelled(9):
            break
        await asyncio.sleep(0.001)
    else:
        raise AssertionError("the cancel never reached prefill")
    await asyncio.sleep(0.02)  # time enough for a premature ack to arrive
    assert not drained.done()
    assert landed == []
    await in_flight  # lands although decode cancelled: the stale-writer hazard
    await prefill.conclude(TransferStatus(9, KVPoll.FAILED, aborted=True))  # the sender's ack
    await drained
    assert landed == ["late"]


# ---- through the engine ------------------------------------------------------------------

PAGE_BYTES = 2 * 2 * 16 * 1 * 32 * 4
"""One page of the tiny model: layers x (K, V) x page size x KV heads x head dim x float32."""
ENGINE_BANDWIDTH = PAGE_BYTES / 0.03
"""A page every 30 ms: the dropped request's 33 pages are in flight for about a second, the
next request's 2 pages for 60 ms. The next request's own write must land before the late
one: its admission, prefill and write have to fit in the difference, which a loaded machine
stretches (at 8 ms a page, a quarter of a second, it did not fit under a load of 17 on two
cores). Its answer may run to the end of a 4096-token context, so it is still decoding when
the late write lands, however fast the machine."""
RACE_CONTEXT = 4096


async def drop_a_large_request_mid_write(canaries: Canaries, fixes: frozenset[str]) -> str:
    """A (520 tokens, one write) is dropped once its write is posted; B (32 tokens, another
    tenant) follows at once. Returns what B said once A's write had landed."""
    config = small_config(
        context_length=RACE_CONTEXT,
        free_order="lifo",
        prefill_chunk_tokens=1024,  # A's whole prompt in one step, so in one write
        transfer_chunk_pages=64,
        transfer_bandwidth_bytes_per_s=ENGINE_BANDWIDTH,
        fixes=fixes,
        dtype="float32",  # flight times are sized from float32 pages (PAGE_BYTES)
        copy_noise=0.0,  # exact quotes: 64 tokens name whose pages B read
        **TINY_MODEL,
    )
    a, b = canaries.prompt("A", 520, tenant=1), canaries.prompt("B", 32, tenant=2)
    async with DisaggregatedEngine(config) as engine:
        answer_a = asyncio.create_task(engine.generate(engine.request("A", a.input_ids, 16)))

        def posted() -> bool:
            req = engine.prefill.scheduler.find("A")
            return req is not None and req.poll == KVPoll.TRANSFERRING

        await wait_until(posted)
        await engine.abort("A")  # the client of A disconnects with A's write in flight
        held = engine.decode.num_allocated_pages()
        assert held == (33 if "deferred_release" in fixes else 0)
        # B is read through the side interfaces, so that the test can stop it once A's
        # write has landed instead of depending on how fast decode runs
        request_b = engine.request("B", b.input_ids, RACE_CONTEXT - 32)
        prefill_b = asyncio.create_task(engine.prefill.generate(request_b))
        stream = engine.decode.generate(request_b)
        text, num_after_landing = [], 0
        async for event in stream:
            assert not isinstance(event, FinishOut), f"B ended before A's write landed: {event}"
            if isinstance(event, HeadOut):
                continue
            text.append(event.text)
            num_after_landing += answer_a.done()  # A's answer waits for its write to drain
            if num_after_landing > 4 * config.page_size:
                break
        await stream.aclose()  # B's client disconnects
        assert (await answer_a).status == 499
        assert (await prefill_b).status == 200
        await settle(engine)
        assert engine.num_allocated_pages() == 0
        assert engine.transfer_is_idle()
    return "".join(text)


@pytest.mark.timing
async def test_a_late_write_lands_in_the_next_owners_pages(canaries: Canaries) -> None:
    text = await drop_a_large_request_mid_write(canaries, frozenset())
    assert canaries.foreign(text, "B") == {"A"}


async def test_deferred_release_holds_the_pages_until_the_write_drained(
    canaries: Canaries,
) -> None:
    text = await drop_a_large_request_mid_write(canaries, frozenset({"deferred_release"}))
    assert canaries.owners(text) == {"B"}

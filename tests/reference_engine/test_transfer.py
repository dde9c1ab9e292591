"""InProcessTransfer: the room state machine, in-flight writes, drain acknowledgement."""

from __future__ import annotations

import asyncio

from kvcanary.reference_engine.interfaces import KVPoll, PageChunk, TransferMetadata, TransferStatus
from kvcanary.reference_engine.transfer import InProcessTransfer


class RecordingSink:
    def __init__(self) -> None:
        self.writes: list[tuple[tuple[int, ...], bytes]] = []

    def write_pages(self, page_ids: tuple[int, ...], payload: bytes) -> None:
        self.writes.append((page_ids, payload))


async def test_metadata_reaches_prefill_and_pages_land_at_the_named_destinations() -> None:
    transfer, sink = InProcessTransfer(), RecordingSink()
    waiting = asyncio.create_task(transfer.wait_for_metadata(5, timeout_s=5))
    await asyncio.sleep(0)
    meta = TransferMetadata(5, (40, 41, 42), num_tokens=40)
    await transfer.register_receiver(meta, sink)
    assert await waiting == meta
    await transfer.send_pages(PageChunk(5, first_page=1, num_pages=2, payload=b"xy"))
    assert sink.writes == [((41, 42), b"xy")]
    status = TransferStatus(5, KVPoll.SUCCESS, first_token_id=3)
    await transfer.conclude(status)
    assert await transfer.receiver_status(5) == status
    assert transfer.num_open_rooms == 0


async def test_waiting_for_metadata_times_out_or_sees_the_cancel() -> None:
    transfer = InProcessTransfer()
    assert await transfer.wait_for_metadata(1, timeout_s=0.01) is None
    waiting = asyncio.create_task(transfer.wait_for_metadata(2, timeout_s=5))
    await asyncio.sleep(0)
    await transfer.cancel_receiver(2)
    assert await waiting is None
    assert await transfer.is_cancelled(2)


async def test_a_posted_write_lands_after_cancel_and_drain_waits_for_the_ack() -> None:
    transfer, sink = InProcessTransfer(latency_s=0.01), RecordingSink()
    await transfer.register_receiver(TransferMetadata(9, (7,), 16), sink)
    in_flight = asyncio.create_task(transfer.send_pages(PageChunk(9, 0, 1, b"late")))
    await asyncio.sleep(0)
    await transfer.cancel_receiver(9)
    drained = asyncio.create_task(transfer.wait_drained(9))
    await in_flight
    assert sink.writes == [((7,), b"late")]  # the stale-writer hazard
    await asyncio.sleep(0)
    assert not drained.done()  # no ack yet
    await transfer.conclude(TransferStatus(9, KVPoll.FAILED, aborted=True))
    await drained
    assert transfer.num_open_rooms == 0


async def test_a_conclusion_before_registration_is_kept_for_decode() -> None:
    transfer = InProcessTransfer()
    await transfer.conclude(TransferStatus(3, KVPoll.FAILED))
    assert (await transfer.receiver_status(3)).poll == KVPoll.FAILED
    assert transfer.num_open_rooms == 0

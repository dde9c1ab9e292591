"""TcpTransfer: the frame codec, and the TransferBackend contract over a loopback socket."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcanary.reference_engine.interfaces import (
    KVPoll,
    PageChunk,
    TransferBackend,
    TransferMetadata,
    TransferStatus,
)
from kvcanary.reference_engine.server.tcp_frames import (
    Frame,
    decode_bootstrap,
    decode_status,
    encode_bootstrap,
    encode_status,
)
from kvcanary.reference_engine.server.tcp_transfer import TcpTransfer
from kvcanary.reference_engine.transfer import InProcessTransfer

PAGE_BYTES = 8


class RecordingSink:
    def __init__(self) -> None:
        self.writes: list[tuple[tuple[int, ...], bytes]] = []

    def write_pages(self, page_ids: tuple[int, ...], payload: bytes) -> None:
        assert len(payload) == PAGE_BYTES * len(page_ids)
        self.writes.append((page_ids, payload))


def split(frame: bytes) -> tuple[int, int, bytes]:
    return frame[0], int.from_bytes(frame[1:9], "big"), frame[13:]


@given(
    room=st.integers(0, 2**63 - 1),
    pages=st.lists(st.integers(0, 2**32 - 1), max_size=50),
    num_tokens=st.integers(0, 2**32 - 1),
)
def test_bootstrap_frames_round_trip(room: int, pages: list[int], num_tokens: int) -> None:
    meta = TransferMetadata(room, tuple(pages), num_tokens)
    kind, frame_room, body = split(encode_bootstrap(meta))
    assert (kind, frame_room) == (Frame.BOOTSTRAP, room)
    assert decode_bootstrap(room, body) == meta


@given(
    room=st.integers(0, 2**63 - 1),
    poll=st.sampled_from(KVPoll),
    first_token=st.none() | st.integers(0, 200_000),
    written=st.none() | st.integers(0, 2**40),
    checksum=st.none() | st.integers(0, 2**64 - 1),
    aborted=st.booleans(),
    cached=st.integers(0, 2**32 - 1),
)
def test_status_frames_round_trip(
    room: int,
    poll: KVPoll,
    first_token: int | None,
    written: int | None,
    checksum: int | None,
    aborted: bool,
    cached: int,
) -> None:
    status = TransferStatus(
        room, poll, first_token, written, checksum, aborted, num_cached_tokens=cached
    )
    kind, _, body = split(encode_status(status))
    assert kind == Frame.STATUS
    assert decode_status(room, body) == status


@pytest.fixture
async def pair() -> AsyncIterator[tuple[TcpTransfer, TcpTransfer]]:
    prefill = TcpTransfer()
    port = await prefill.listen("127.0.0.1", 0)
    decode = TcpTransfer(default_bootstrap=("127.0.0.1", port))
    yield prefill, decode
    await decode.close()
    await prefill.close()


@pytest.fixture(params=["tcp", "in-process"])
async def backends(
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[TransferBackend, TransferBackend]]:
    """The contract both backends keep: (prefill's backend, decode's backend)."""
    if request.param == "in-process":
        shared = InProcessTransfer()
        yield shared, shared
        await shared.close()
        return
    prefill = TcpTransfer()
    port = await prefill.listen("127.0.0.1", 0)
    decode = TcpTransfer(default_bootstrap=("127.0.0.1", port))
    yield prefill, decode
    await decode.close()
    await prefill.close()


def chunk(room: int, first: int, num: int, fill: int) -> PageChunk:
    return PageChunk(room, first, num, bytes([fill]) * (PAGE_BYTES * num))


async def test_pages_land_in_the_announced_destination_pages(
    backends: tuple[TransferBackend, TransferBackend],
) -> None:
    prefill, decode = backends
    sink = RecordingSink()
    meta = TransferMetadata(room=7, dst_page_ids=(40, 41, 42, 43), num_tokens=60)
    await decode.register_receiver(meta, sink)
    assert await prefill.wait_for_metadata(7, timeout_s=5) == meta
    await prefill.send_pages(chunk(7, 0, 2, 1))
    await prefill.send_pages(chunk(7, 2, 1, 2))
    status = TransferStatus(7, KVPoll.SUCCESS, first_token_id=99, num_tokens_written=48)
    await prefill.conclude(status)
    assert await decode.receiver_status(7) == status
    await decode.wait_drained(7)
    assert sink.writes == [((40, 41), b"\x01" * 16), ((42,), b"\x02" * 8)]


async def test_metadata_wait_times_out_without_decode(
    backends: tuple[TransferBackend, TransferBackend],
) -> None:
    prefill, _ = backends
    assert await prefill.wait_for_metadata(8, timeout_s=0.05) is None


async def test_decode_cancelling_a_room_it_never_registered_stops_prefills_wait(
    backends: tuple[TransferBackend, TransferBackend],
) -> None:
    prefill, decode = backends
    waiting = asyncio.create_task(prefill.wait_for_metadata(20, timeout_s=30))
    await asyncio.sleep(0.01)
    await decode.cancel_receiver(20)
    assert await asyncio.wait_for(waiting, 5) is None
    assert await prefill.is_cancelled(20)
    await prefill.conclude(TransferStatus(20, KVPoll.FAILED, aborted=True))


async def test_prefill_concluding_before_decode_registers_still_reaches_decode(
    backends: tuple[TransferBackend, TransferBackend],
) -> None:
    prefill, decode = backends
    await prefill.conclude(TransferStatus(21, KVPoll.FAILED))  # prefill rejected the request
    await decode.register_receiver(TransferMetadata(21, (1, 2), 30), RecordingSink())
    status = await asyncio.wait_for(decode.receiver_status(21), 5)
    assert status.poll == KVPoll.FAILED
    await asyncio.wait_for(decode.wait_drained(21), 5)


async def test_cancel_before_sending_is_acknowledged_at_once_and_later_pages_dropped(
    pair: tuple[TcpTransfer, TcpTransfer],
) -> None:
    prefill, decode = pair
    sink = RecordingSink()
    await decode.register_receiver(TransferMetadata(9, (5, 6), 20), sink)
    await prefill.wait_for_metadata(9, timeout_s=5)
    await decode.cancel_receiver(9)
    await asyncio.wait_for(decode.wait_drained(9), 5)
    assert await prefill.is_cancelled(9)
    await prefill.send_pages(chunk(9, 0, 2, 3))
    await prefill.conclude(TransferStatus(9, KVPoll.FAILED, aborted=True))
    await asyncio.sleep(0.05)
    assert sink.writes == []
    assert (await decode.receiver_status(9)).poll == KVPoll.FAILED


async def test_writes_in_flight_at_cancel_still_land_until_prefill_concludes(
    backends: tuple[TransferBackend, TransferBackend],
) -> None:
    prefill, decode = backends
    sink = RecordingSink()
    await decode.register_receiver(TransferMetadata(10, (1, 2, 3), 40), sink)
    await prefill.wait_for_metadata(10, timeout_s=5)
    await prefill.send_pages(chunk(10, 0, 1, 4))
    await decode.cancel_receiver(10)
    for _ in range(100):
        if await prefill.is_cancelled(10):
            break
        await asyncio.sleep(0.01)
    assert await prefill.is_cancelled(10)
    drained = asyncio.create_task(decode.wait_drained(10))
    await prefill.send_pages(chunk(10, 1, 1, 5))  # prefill has not looked yet: it lands
    await asyncio.sleep(0.05)
    assert not drained.done()
    await prefill.conclude(TransferStatus(10, KVPoll.FAILED, aborted=True))
    await asyncio.wait_for(drained, 5)
    assert [ids for ids, _ in sink.writes] == [(1,), (2,)]


async def test_rooms_are_routed_to_their_bootstrap_address() -> None:
    prefills = [TcpTransfer(), TcpTransfer()]
    ports = [await p.listen("127.0.0.1", 0) for p in prefills]
    decode = TcpTransfer()  # no default: every room must be routed
    try:
        for room, port in ((1, ports[0]), (2, ports[1])):
            decode.route_room(room, "127.0.0.1", port)
            await decode.register_receiver(TransferMetadata(room, (room,), 1), RecordingSink())
        assert await prefills[0].wait_for_metadata(1, 5) is not None
        assert await prefills[1].wait_for_metadata(2, 5) is not None
        assert await prefills[0].wait_for_metadata(2, 0.05) is None
        with pytest.raises(ConnectionError):
            await decode.register_receiver(TransferMetadata(3, (3,), 1), RecordingSink())
    finally:
        await decode.close()
        for p in prefills:
            await p.close()


async def test_a_lost_prefill_fails_the_rooms_waiting_on_it(
    pair: tuple[TcpTransfer, TcpTransfer],
) -> None:
    prefill, decode = pair
    await decode.register_receiver(TransferMetadata(11, (1,), 5), RecordingSink())
    await prefill.wait_for_metadata(11, timeout_s=5)
    await prefill.close()
    status = await asyncio.wait_for(decode.receiver_status(11), 5)
    assert status.poll == KVPoll.FAILED


async def test_a_lost_decode_cancels_its_rooms_on_prefill(
    pair: tuple[TcpTransfer, TcpTransfer],
) -> None:
    prefill, decode = pair
    await decode.register_receiver(TransferMetadata(12, (1,), 5), RecordingSink())
    await prefill.wait_for_metadata(12, timeout_s=5)
    assert not await prefill.is_cancelled(12)
    await decode.close()
    for _ in range(100):
        if await prefill.is_cancelled(12):
            break
        await asyncio.sleep(0.01)
    assert await prefill.is_cancelled(12)


async def test_a_peer_that_does_not_speak_the_protocol_is_dropped(
    pair: tuple[TcpTransfer, TcpTransfer],
) -> None:
    _, decode = pair
    address = decode._default_bootstrap
    assert address is not None
    reader, writer = await asyncio.open_connection(*address)
    writer.write(b"GET / HTTP/1.1\r\n\r\n")
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()

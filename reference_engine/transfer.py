"""The in-process TransferBackend: prefill writes straight into decode's pool, by room.

What it models, per bootstrap room (SGLang's Mooncake sender/receiver pair, minus RDMA):

    decode   register_receiver(meta, sink)  -> prefill's wait_for_metadata returns (WaitingForInput)
    prefill  send_pages(chunk)              -> the chunk lands in decode's sink after its flight
    prefill  conclude(status)               -> decode's receiver_status returns; also the drain ack
    decode   cancel_receiver(room)          -> prefill's is_cancelled turns True

A chunk's flight time is `latency_s + len(payload) / bandwidth_bytes_per_s` (`flight_time_s`):
a posted write occupies a bandwidth-limited link for a time proportional to its size, as an
RDMA write does (Mooncake, NIXL), and writes of different rooms are in flight concurrently,
each at the full bandwidth (a link per write, no contention). So a large write posted before
a small one can land after it. A chunk that was posted lands even if decode cancels the room
while it is in flight: the stale-writer hazard. `wait_drained` returns only once prefill has
concluded the room, which it does after its last posted write has landed (SGLang's ABORT_ACK
after drain, #35049).

A room's record is dropped once prefill has concluded it and decode is done with it (read the
status, or cancelled). What it does not do: check lengths. The sender decides how many pages
to send; this backend writes what it is given to the destination pages the chunk names.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from kvcanary.reference_engine.interfaces import (
    PageChunk,
    PageSink,
    TransferBackend,
    TransferMetadata,
    TransferStatus,
)


@dataclass(slots=True, eq=False)
class SenderRoom:
    """What prefill waits on for one room, in every backend: decode's metadata or its cancel."""

    meta: TransferMetadata | None = None
    cancelled: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def notify(self) -> None:
        """Wake everything waiting on this room (each waiter then waits on a fresh event)."""
        self.changed.set()
        self.changed = asyncio.Event()

    async def wait_for_metadata(self, timeout_s: float) -> TransferMetadata | None:
        """Decode's metadata; None if the room was cancelled or nothing came in time."""
        try:
            async with asyncio.timeout(timeout_s):
                while self.meta is None and not self.cancelled:
                    await self.changed.wait()
        except TimeoutError:
            return None
        return None if self.cancelled else self.meta


@dataclass(slots=True, eq=False)
class _Room(SenderRoom):
    sink: PageSink | None = None
    status: TransferStatus | None = None
    decode_done: bool = False
    num_in_flight: int = 0


def flight_time_s(
    num_bytes: int, bandwidth_bytes_per_s: float | None, latency_s: float = 0.0
) -> float:
    """How long a write of `num_bytes` is in flight on a link (None: infinite bandwidth)."""
    assert num_bytes >= 0
    assert latency_s >= 0
    assert bandwidth_bytes_per_s is None or bandwidth_bytes_per_s > 0
    if bandwidth_bytes_per_s is None:
        return latency_s
    return latency_s + num_bytes / bandwidth_bytes_per_s


class InProcessTransfer(TransferBackend):
    """Both sides in one event loop; a posted chunk is in flight for `flight_time_s`."""

    def __init__(self, latency_s: float = 0.0, bandwidth_bytes_per_s: float | None = None) -> None:
        assert latency_s >= 0
        assert bandwidth_bytes_per_s is None or bandwidth_bytes_per_s > 0
        self.latency_s = latency_s
        self.bandwidth_bytes_per_s = bandwidth_bytes_per_s
        self._rooms: dict[int, _Room] = {}

    def _room(self, room: int) -> _Room:
        return self._rooms.setdefault(room, _Room())

    def _maybe_forget(self, room: int) -> None:
        record = self._rooms.get(room)
        if record and record.status is not None and record.decode_done:
            del self._rooms[room]

    @property
    def num_open_rooms(self) -> int:
        return len(self._rooms)

    # decode side

    async def register_receiver(self, meta: TransferMetadata, sink: PageSink) -> None:
        record = self._room(meta.room)
        assert record.meta is None, f"room {meta.room} registered twice"
        record.meta, record.sink = meta, sink
        record.notify()

    async def receiver_status(self, room: int) -> TransferStatus:
        record = self._room(room)
        while record.status is None:
            await record.changed.wait()
        record.decode_done = True
        status = record.status
        self._maybe_forget(room)
        return status

    async def cancel_receiver(self, room: int) -> None:
        record = self._room(room)
        record.cancelled = True
        record.decode_done = True
        record.notify()
        self._maybe_forget(room)

    async def wait_drained(self, room: int) -> None:
        record = self._rooms.get(room)
        if record is None:  # already concluded and forgotten
            return
        while record.status is None:
            await record.changed.wait()

    # prefill side

    async def wait_for_metadata(self, room: int, timeout_s: float) -> TransferMetadata | None:
        return await self._room(room).wait_for_metadata(timeout_s)

    async def send_pages(self, chunk: PageChunk) -> None:
        record = self._rooms[chunk.room]
        assert record.meta is not None, "send before metadata"
        assert record.sink is not None
        dst = record.meta.dst_page_ids[chunk.first_page : chunk.first_page + chunk.num_pages]
        assert len(dst) == chunk.num_pages, "chunk runs past the destination pages"
        flight_s = flight_time_s(len(chunk.payload), self.bandwidth_bytes_per_s, self.latency_s)
        record.num_in_flight += 1
        try:
            await asyncio.sleep(flight_s)  # in flight: decode may cancel, even free, meanwhile
            record.sink.write_pages(dst, chunk.payload)
        finally:
            record.num_in_flight -= 1

    async def conclude(self, status: TransferStatus) -> None:
        record = self._room(status.room)
        assert record.num_in_flight == 0, "concluded with a write still in flight"
        assert record.status is None, f"room {status.room} concluded twice"
        record.status = status
        record.notify()
        self._maybe_forget(status.room)

    async def is_cancelled(self, room: int) -> bool:
        record = self._rooms.get(room)
        return record is not None and record.cancelled

    async def close(self) -> None:
        for record in self._rooms.values():
            record.notify()
        self._rooms.clear()

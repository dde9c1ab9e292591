"""A `TransferBackend` over asyncio TCP streams: KV pages cross a real socket.

The prefill process listens on its bootstrap port (`listen`); the decode process connects
to the `bootstrap_host:bootstrap_port` its requests name (`route_room`), one connection per
prefill, multiplexed by bootstrap room. Every frame is a fixed header, `!BQI` (frame type,
room, body length), then the body:

    HELLO      both, once  b"KVCT" + version (u16); the server echoes it back
    BOOTSTRAP  decode ->   num_tokens, num_pages (u32 each), then num_pages page ids (u32)
    PAGES      -> decode   first_page, num_pages (u32 each), then PageChunk.payload bytes
    STATUS     -> decode   poll, flags (u8 each), first_token_id, num_tokens_written (i64),
                           checksum (u64); flags say which optional fields are present
    CANCEL     decode ->   empty: decode gave up on the room (client disconnect)
    DRAIN_ACK  -> decode   empty: nothing more will be written for the room

Decode writes each PAGES frame through the room's `PageSink`, page ids taken from the
destination list it announced at bootstrap. Frames on one connection are ordered, so a
STATUS frame (conclude) also means the room has drained. A CANCEL for a room with no page
sent yet is answered by DRAIN_ACK at once (and later pages for it are dropped); one for a
room being sent is answered when prefill concludes it. Decode may cancel a room it never
bootstrapped (it rejected the request), and prefill may conclude a room decode has not
bootstrapped yet (prefill rejected it): each side remembers that, so the other's later
frame gets its answer at once instead of a timeout. Pages written before prefill
notices a cancel still land in decode's pages: that is the page-lifetime hazard the
`deferred_release` fix guards, and this backend reproduces it rather than hiding it. A lost
connection fails every room on it (decode sees Failed, prefill sees cancelled).

With a bandwidth (`transfer_bandwidth_bytes_per_s`), prefill holds each PAGES frame for its
flight time (`transfer.flight_time_s`) before writing it, without holding other rooms' frames:
a large write posted before a small one lands after it, as on an RDMA link. The room's STATUS
and DRAIN_ACK still follow its last PAGES frame, so a drain ack still means "landed".

It knows frames and rooms, not pools, models or HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import IntEnum

from reference_engine.interfaces import (
    KVPoll,
    PageChunk,
    PageSink,
    TransferBackend,
    TransferMetadata,
    TransferStatus,
)
from reference_engine.transfer import flight_time_s

_MAGIC = b"KVCT"
_VERSION = 2
_HELLO = struct.Struct("!4sH")
_HEADER = struct.Struct("!BQI")
_COUNTS = struct.Struct("!II")
_STATUS = struct.Struct("!BBqqQI")
_MAX_BODY = 1 << 30
_NUM_CONCLUDED_KEPT = 4096


class Frame(IntEnum):
    BOOTSTRAP = 1
    PAGES = 2
    STATUS = 3
    CANCEL = 4
    DRAIN_ACK = 5


class _Flag:
    FIRST_TOKEN = 1
    NUM_WRITTEN = 2
    CHECKSUM = 4
    ABORTED = 8
    REJECTED = 16


class ProtocolError(Exception):
    """The peer sent something this protocol does not allow."""


def encode_frame(kind: Frame, room: int, body: bytes = b"") -> bytes:
    assert 0 <= room < 2**64, f"room out of range: {room}"
    return _HEADER.pack(kind, room, len(body)) + body


def encode_bootstrap(meta: TransferMetadata) -> bytes:
    num_pages = len(meta.dst_page_ids)
    ids = struct.pack(f"!{num_pages}I", *meta.dst_page_ids)
    return encode_frame(Frame.BOOTSTRAP, meta.room, _COUNTS.pack(meta.num_tokens, num_pages) + ids)


def decode_bootstrap(room: int, body: bytes) -> TransferMetadata:
    num_tokens, num_pages = _COUNTS.unpack_from(body)
    if len(body) != _COUNTS.size + 4 * num_pages:
        raise ProtocolError(f"bootstrap for room {room}: {num_pages} pages, {len(body)} bytes")
    ids = struct.unpack_from(f"!{num_pages}I", body, _COUNTS.size)
    return TransferMetadata(room=room, dst_page_ids=tuple(ids), num_tokens=num_tokens)


def encode_status(status: TransferStatus) -> bytes:
    flags = (
        (_Flag.FIRST_TOKEN if status.first_token_id is not None else 0)
        | (_Flag.NUM_WRITTEN if status.num_tokens_written is not None else 0)
        | (_Flag.CHECKSUM if status.checksum is not None else 0)
        | (_Flag.ABORTED if status.aborted else 0)
        | (_Flag.REJECTED if status.rejected else 0)
    )
    body = _STATUS.pack(
        int(status.poll),
        flags,
        status.first_token_id or 0,
        status.num_tokens_written or 0,
        status.checksum or 0,
        status.num_cached_tokens,
    )
    return encode_frame(Frame.STATUS, status.room, body)


def decode_status(room: int, body: bytes) -> TransferStatus:
    if len(body) != _STATUS.size:
        raise ProtocolError(f"status for room {room}: {len(body)} bytes")
    poll, flags, first_token, num_written, checksum, num_cached = _STATUS.unpack(body)
    return TransferStatus(
        room=room,
        poll=KVPoll(poll),
        first_token_id=first_token if flags & _Flag.FIRST_TOKEN else None,
        num_tokens_written=num_written if flags & _Flag.NUM_WRITTEN else None,
        checksum=checksum if flags & _Flag.CHECKSUM else None,
        aborted=bool(flags & _Flag.ABORTED),
        rejected=bool(flags & _Flag.REJECTED),
        num_cached_tokens=num_cached,
    )


async def read_frame(reader: asyncio.StreamReader) -> tuple[Frame, int, bytes]:
    kind, room, length = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if length > _MAX_BODY:
        raise ProtocolError(f"frame of {length} bytes")
    try:
        frame = Frame(kind)
    except ValueError:
        raise ProtocolError(f"unknown frame type {kind}") from None
    return frame, room, await reader.readexactly(length)


class _Connection:
    """One TCP stream; whole frames are written atomically, drains are serialised."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self._drain_lock = asyncio.Lock()
        self.closed = False

    async def send(self, frame: bytes) -> None:
        if self.closed:
            raise ConnectionError("transfer connection closed")
        self.writer.write(frame)
        async with self._drain_lock:
            await self.writer.drain()

    async def close(self) -> None:
        self.closed = True
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()


@dataclass
class _Receiver:
    """Decode's view of one room."""

    meta: TransferMetadata
    sink: PageSink
    conn: _Connection
    status: asyncio.Future[TransferStatus]
    drained: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class _Sender:
    """Prefill's view of one room."""

    meta: TransferMetadata | None = None
    conn: _Connection | None = None
    cancelled: bool = False
    sending: bool = False
    drain_acked: bool = False
    """Decode was told nothing more will land: later pages for the room are dropped."""
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class TcpTransfer(TransferBackend):
    """Both halves of the protocol: call `listen` in the prefill process; decode connects."""

    def __init__(
        self,
        default_bootstrap: tuple[str, int] | None = None,
        *,
        bandwidth_bytes_per_s: float | None = None,
    ) -> None:
        assert bandwidth_bytes_per_s is None or bandwidth_bytes_per_s > 0
        self._default_bootstrap = default_bootstrap
        self.bandwidth_bytes_per_s = bandwidth_bytes_per_s
        self._routes: OrderedDict[int, tuple[str, int]] = OrderedDict()
        self._connections: dict[tuple[str, int], _Connection] = {}
        self._connecting: dict[tuple[str, int], asyncio.Lock] = {}
        self._receivers: dict[int, _Receiver] = {}
        self._concluded: OrderedDict[int, TransferStatus] = OrderedDict()
        self._senders: dict[int, _Sender] = {}
        self._concluded_early: OrderedDict[int, TransferStatus] = OrderedDict()
        """Rooms prefill concluded before decode bootstrapped them (an intake rejection)."""
        self._server: asyncio.Server | None = None
        self._accepted: set[_Connection] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ prefill: listening
    async def listen(
        self, host: str = "127.0.0.1", port: int = 0, *, sock: socket.socket | None = None
    ) -> int:
        """Serve bootstrap connections; returns the bound port."""
        assert self._server is None, "already listening"
        if sock is not None:
            self._server = await asyncio.start_server(self._accept, sock=sock)
        else:
            self._server = await asyncio.start_server(self._accept, host, port)
        bound: int = self._server.sockets[0].getsockname()[1]
        return bound

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Connection(reader, writer)
        self._accepted.add(conn)
        try:
            magic, version = _HELLO.unpack(await reader.readexactly(_HELLO.size))
            if magic != _MAGIC or version != _VERSION:
                raise ProtocolError(f"bad hello {magic!r} v{version}")
            await conn.send(_HELLO.pack(_MAGIC, _VERSION))
            while True:
                kind, room, body = await read_frame(reader)
                if kind == Frame.BOOTSTRAP:
                    await self._on_bootstrap(conn, decode_bootstrap(room, body))
                elif kind == Frame.CANCEL:
                    await self._on_cancel(conn, room)
                else:
                    raise ProtocolError(f"prefill got a {kind.name} frame")
        except (asyncio.IncompleteReadError, ConnectionError, ProtocolError):
            pass
        finally:
            self._accepted.discard(conn)
            for sender in self._senders.values():
                if sender.conn is conn:  # decode is gone: nothing to send to
                    sender.cancelled = True
                    sender.notify()
            await conn.close()

    def _sender(self, room: int) -> _Sender:
        if room not in self._senders:
            self._senders[room] = _Sender()
        return self._senders[room]

    async def _on_bootstrap(self, conn: _Connection, meta: TransferMetadata) -> None:
        early = self._concluded_early.pop(meta.room, None)
        if early is not None:  # prefill already gave up on the room: say so at once
            await conn.send(encode_status(early))
            return
        sender = self._sender(meta.room)
        if sender.meta is not None:
            raise ProtocolError(f"room {meta.room} bootstrapped twice")
        sender.meta, sender.conn = meta, conn
        sender.notify()

    async def _on_cancel(self, conn: _Connection, room: int) -> None:
        if room in self._concluded_early:
            await conn.send(encode_frame(Frame.DRAIN_ACK, room))
            return
        sender = self._sender(room)  # may be new: decode gave up before bootstrapping
        sender.cancelled = True
        sender.notify()
        if not sender.sending:
            # nothing in flight: acknowledge now, and write nothing more for the room
            sender.drain_acked = True
            await conn.send(encode_frame(Frame.DRAIN_ACK, room))

    # ------------------------------------------------------------------ prefill side
    async def wait_for_metadata(self, room: int, timeout_s: float) -> TransferMetadata | None:
        sender = self._sender(room)
        try:
            async with asyncio.timeout(timeout_s):
                while sender.meta is None and not sender.cancelled:
                    await sender.changed.wait()
        except TimeoutError:
            return None
        return None if sender.cancelled else sender.meta

    async def send_pages(self, chunk: PageChunk) -> None:
        sender = self._senders.get(chunk.room)
        if sender is None or sender.conn is None or sender.drain_acked:
            return  # never bootstrapped, or cancelled before anything was sent
        sender.sending = True
        body = _COUNTS.pack(chunk.first_page, chunk.num_pages) + chunk.payload
        if self.bandwidth_bytes_per_s is not None:  # posted: in flight, a cancel or not
            await asyncio.sleep(flight_time_s(len(chunk.payload), self.bandwidth_bytes_per_s))
        with contextlib.suppress(ConnectionError):
            await sender.conn.send(encode_frame(Frame.PAGES, chunk.room, body))

    async def conclude(self, status: TransferStatus) -> None:
        sender = self._senders.pop(status.room, None)
        if sender is None or sender.conn is None:
            if sender is None or not sender.cancelled:  # decode may still bootstrap the room
                self._concluded_early[status.room] = status
                while len(self._concluded_early) > _NUM_CONCLUDED_KEPT:
                    self._concluded_early.popitem(last=False)
            return
        with contextlib.suppress(ConnectionError):
            await sender.conn.send(encode_status(status))
            if sender.cancelled and not sender.drain_acked:
                await sender.conn.send(encode_frame(Frame.DRAIN_ACK, status.room))

    async def is_cancelled(self, room: int) -> bool:
        sender = self._senders.get(room)
        return sender is not None and sender.cancelled

    # ------------------------------------------------------------------ decode side
    def route_room(self, room: int, host: str, port: int) -> None:
        """Where the room's prefill listens (the request's bootstrap_host/port)."""
        if port:
            self._routes[room] = (host, port)
            while len(self._routes) > _NUM_CONCLUDED_KEPT:  # rooms decode never registered
                self._routes.popitem(last=False)

    async def _connection(self, address: tuple[str, int]) -> _Connection:
        lock = self._connecting.setdefault(address, asyncio.Lock())
        async with lock:
            conn = self._connections.get(address)
            if conn is not None and not conn.closed:
                return conn
            reader, writer = await asyncio.open_connection(*address)
            conn = _Connection(reader, writer)
            await conn.send(_HELLO.pack(_MAGIC, _VERSION))
            magic, version = _HELLO.unpack(await reader.readexactly(_HELLO.size))
            if magic != _MAGIC or version != _VERSION:
                await conn.close()
                raise ProtocolError(f"bad hello from {address}: {magic!r} v{version}")
            self._connections[address] = conn
            task = asyncio.create_task(self._read_decode_frames(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return conn

    async def _read_decode_frames(self, conn: _Connection) -> None:
        try:
            while True:
                kind, room, body = await read_frame(conn.reader)
                receiver = self._receivers.get(room)
                if receiver is None:
                    continue  # a room decode already forgot
                if kind == Frame.PAGES:
                    first, num_pages = _COUNTS.unpack_from(body)
                    page_ids = receiver.meta.dst_page_ids[first : first + num_pages]
                    receiver.sink.write_pages(page_ids, body[_COUNTS.size :])
                elif kind == Frame.STATUS:
                    self._finish_room(room, decode_status(room, body))
                elif kind == Frame.DRAIN_ACK:
                    self._finish_room(room, TransferStatus(room, KVPoll.FAILED, aborted=True))
                else:
                    raise ProtocolError(f"decode got a {kind.name} frame")
        except (asyncio.IncompleteReadError, ConnectionError, ProtocolError):
            pass
        finally:
            await conn.close()
            for room, receiver in list(self._receivers.items()):
                if receiver.conn is conn:
                    self._finish_room(room, TransferStatus(room, KVPoll.FAILED))

    def _finish_room(self, room: int, status: TransferStatus) -> None:
        receiver = self._receivers.pop(room, None)
        if receiver is None:
            return
        if not receiver.status.done():
            receiver.status.set_result(status)
        receiver.drained.set()
        self._concluded[room] = receiver.status.result()
        while len(self._concluded) > _NUM_CONCLUDED_KEPT:
            self._concluded.popitem(last=False)

    async def register_receiver(self, meta: TransferMetadata, sink: PageSink) -> None:
        address = self._routes.pop(meta.room, None) or self._default_bootstrap
        if address is None:
            raise ConnectionError(f"no bootstrap address for room {meta.room}")
        conn = await self._connection(address)
        status: asyncio.Future[TransferStatus] = asyncio.get_running_loop().create_future()
        self._receivers[meta.room] = _Receiver(meta, sink, conn, status)
        try:
            await conn.send(encode_bootstrap(meta))
        except ConnectionError:
            self._finish_room(meta.room, TransferStatus(meta.room, KVPoll.FAILED))

    async def receiver_status(self, room: int) -> TransferStatus:
        receiver = self._receivers.get(room)
        if receiver is not None:
            return await asyncio.shield(receiver.status)
        return self._concluded.get(room) or TransferStatus(room, KVPoll.FAILED)

    async def cancel_receiver(self, room: int) -> None:
        receiver = self._receivers.get(room)
        with contextlib.suppress(ConnectionError, OSError):
            if receiver is not None:
                await receiver.conn.send(encode_frame(Frame.CANCEL, room))
                return
            # never registered (decode rejected the request): prefill must stop waiting
            address = self._routes.pop(room, None) or self._default_bootstrap
            if address is not None and room not in self._concluded:
                conn = await self._connection(address)
                await conn.send(encode_frame(Frame.CANCEL, room))

    async def wait_drained(self, room: int) -> None:
        receiver = self._receivers.get(room)
        if receiver is not None:
            await receiver.drained.wait()

    # ------------------------------------------------------------------ both
    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in [*self._connections.values(), *self._accepted]:
            await conn.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
        for sender in self._senders.values():
            sender.cancelled = True
            sender.notify()

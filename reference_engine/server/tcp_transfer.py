"""A `TransferBackend` over asyncio TCP streams: KV pages cross a real socket.

The prefill process listens on its bootstrap port (`listen`); the decode process connects
to the `bootstrap_host:bootstrap_port` its requests name (`route_room`), one connection per
prefill, multiplexed by bootstrap room. Every frame is a fixed header, `!BQI` (frame type,
room, body length), then the body; the frames and their layout are in `tcp_frames`.

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
from collections import OrderedDict
from dataclasses import dataclass, field

from kvcanary.reference_engine.interfaces import (
    KVPoll,
    PageChunk,
    PageSink,
    TransferBackend,
    TransferMetadata,
    TransferStatus,
)
from kvcanary.reference_engine.server.tcp_frames import (
    COUNTS,
    HELLO,
    Connection,
    Frame,
    ProtocolError,
    check_hello,
    decode_bootstrap,
    decode_status,
    encode_bootstrap,
    encode_frame,
    encode_status,
    hello,
    read_frame,
)
from kvcanary.reference_engine.transfer import SenderRoom, flight_time_s

_NUM_CONCLUDED_KEPT = 4096


@dataclass
class _Receiver:
    """Decode's view of one room."""

    meta: TransferMetadata
    sink: PageSink
    conn: Connection
    status: asyncio.Future[TransferStatus]
    drained: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(eq=False)
class _Sender(SenderRoom):
    """Prefill's view of one room."""

    conn: Connection | None = None
    sending: bool = False
    drain_acked: bool = False
    """Decode was told nothing more will land: later pages for the room are dropped."""


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
        self._connections: dict[tuple[str, int], Connection] = {}
        self._connecting: dict[tuple[str, int], asyncio.Lock] = {}
        self._receivers: dict[int, _Receiver] = {}
        self._concluded: OrderedDict[int, TransferStatus] = OrderedDict()
        self._senders: dict[int, _Sender] = {}
        self._concluded_early: OrderedDict[int, TransferStatus] = OrderedDict()
        """Rooms prefill concluded before decode bootstrapped them (an intake rejection)."""
        self._server: asyncio.Server | None = None
        self._accepted: set[Connection] = set()
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
        conn = Connection(reader, writer)
        self._accepted.add(conn)
        try:
            check_hello(await reader.readexactly(HELLO.size), "decode")
            await conn.send(hello())
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

    async def _on_bootstrap(self, conn: Connection, meta: TransferMetadata) -> None:
        early = self._concluded_early.pop(meta.room, None)
        if early is not None:  # prefill already gave up on the room: say so at once
            await conn.send(encode_status(early))
            return
        sender = self._sender(meta.room)
        if sender.meta is not None:
            raise ProtocolError(f"room {meta.room} bootstrapped twice")
        sender.meta, sender.conn = meta, conn
        sender.notify()

    async def _on_cancel(self, conn: Connection, room: int) -> None:
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
        return await self._sender(room).wait_for_metadata(timeout_s)

    async def send_pages(self, chunk: PageChunk) -> None:
        sender = self._senders.get(chunk.room)
        if sender is None or sender.conn is None or sender.drain_acked:
            return  # never bootstrapped, or cancelled before anything was sent
        sender.sending = True
        body = COUNTS.pack(chunk.first_page, chunk.num_pages) + chunk.payload
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

    async def _connection(self, address: tuple[str, int]) -> Connection:
        lock = self._connecting.setdefault(address, asyncio.Lock())
        async with lock:
            conn = self._connections.get(address)
            if conn is not None and not conn.closed:
                return conn
            reader, writer = await asyncio.open_connection(*address)
            conn = Connection(reader, writer)
            await conn.send(hello())
            try:
                check_hello(await reader.readexactly(HELLO.size), f"{address}")
            except ProtocolError:
                await conn.close()
                raise
            self._connections[address] = conn
            task = asyncio.create_task(self._read_decode_frames(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return conn

    async def _read_decode_frames(self, conn: Connection) -> None:
        try:
            while True:
                kind, room, body = await read_frame(conn.reader)
                receiver = self._receivers.get(room)
                if receiver is None:
                    continue  # a room decode already forgot
                if kind == Frame.PAGES:
                    first, num_pages = COUNTS.unpack_from(body)
                    page_ids = receiver.meta.dst_page_ids[first : first + num_pages]
                    receiver.sink.write_pages(page_ids, body[COUNTS.size :])
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

"""The wire format of the TCP KV-transfer protocol, and one framed connection.

Every frame is a fixed header, `!BQI` (frame type, room, body length), then the body:

    HELLO      both, once  b"KVCT" + version (u16); the server echoes it back
    BOOTSTRAP  decode ->   num_tokens, num_pages (u32 each), then num_pages page ids (u32)
    PAGES      -> decode   first_page, num_pages (u32 each), then PageChunk.payload bytes
    STATUS     -> decode   poll, flags (u8 each), first_token_id, num_tokens_written (i64),
                           checksum (u64); flags say which optional fields are present
    CANCEL     decode ->   empty: decode gave up on the room (client disconnect)
    DRAIN_ACK  -> decode   empty: nothing more will be written for the room

It knows bytes and frames, not rooms' lifetimes (`tcp_transfer`), pools, models or HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from enum import IntEnum

from kvcanary.reference_engine.interfaces import KVPoll, TransferMetadata, TransferStatus

MAGIC = b"KVCT"
VERSION = 2
HELLO = struct.Struct("!4sH")
_HEADER = struct.Struct("!BQI")
COUNTS = struct.Struct("!II")
_STATUS = struct.Struct("!BBqqQI")
_MAX_BODY = 1 << 30


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
    return encode_frame(Frame.BOOTSTRAP, meta.room, COUNTS.pack(meta.num_tokens, num_pages) + ids)


def decode_bootstrap(room: int, body: bytes) -> TransferMetadata:
    num_tokens, num_pages = COUNTS.unpack_from(body)
    if len(body) != COUNTS.size + 4 * num_pages:
        raise ProtocolError(f"bootstrap for room {room}: {num_pages} pages, {len(body)} bytes")
    ids = struct.unpack_from(f"!{num_pages}I", body, COUNTS.size)
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


class Connection:
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


def check_hello(data: bytes, peer: str) -> None:
    """Raise ProtocolError unless `data` is this protocol's HELLO at this version."""
    magic, version = HELLO.unpack(data)
    if magic != MAGIC or version != VERSION:
        raise ProtocolError(f"bad hello from {peer}: {magic!r} v{version}")


def hello() -> bytes:
    return HELLO.pack(MAGIC, VERSION)

"""The seams of the reference engine: what the HTTP layer and the transfer backends rely on.

The engine core (scheduler, pools, model) implements `PrefillSide` and `DecodeSide`; the
HTTP layer (`reference_engine.server`) serves them, in one process or as separate
processes. KV pages move from prefill to decode through a `TransferBackend`: in-process
for tests, over a TCP socket when prefill and decode are separate processes.

This module imports no torch: page payloads cross it as `bytes` so that a socket backend
can carry them unchanged. Names follow SGLang's PD code (bootstrap room, KVPoll, sender,
receiver) because the engine exists to reproduce that code path.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Protocol


class KVPoll(IntEnum):
    """State of one request's KV transfer, as SGLang's KVPoll (reduced with MIN across ranks)."""

    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One generation request as both sides receive it (the router sends both the same)."""

    rid: str
    input_ids: tuple[int, ...]
    max_new_tokens: int
    bootstrap_room: int
    bootstrap_host: str = "127.0.0.1"
    bootstrap_port: int = 0
    cache_salt: str | None = None
    tenant_key: str | None = None
    """Opaque per-credential identity the server derives (for server-derived cache salts)."""


@dataclass(frozen=True, slots=True)
class TokenOut:
    """One generated token, with the text it adds to the response."""

    token_id: int
    text: str


@dataclass(frozen=True, slots=True)
class HeadOut:
    """Decode has taken the request on and nothing but a failed transfer can refuse it now:
    a stream's response head may go out before the first token (see `decode.py`)."""


@dataclass(frozen=True, slots=True)
class FinishOut:
    """How a request ended, from one side's point of view.

    `status` is the HTTP status this side would answer with; `error` is the OpenAI/SGLang
    error object (`{"object": "error", "message": ..., "type": ..., "param": None,
    "code": status}`) when the request failed.
    """

    reason: str  # "stop" | "length" | "abort"
    status: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    error: dict[str, Any] | None = None


SideEvent = HeadOut | TokenOut | FinishOut
"""What a side answers with: decode yields at most one HeadOut, tokens, then one FinishOut;
prefill answers with one FinishOut."""


class Side(Protocol):
    """What both servers share: a background scheduler loop, introspection and metrics."""

    async def start(self) -> None:
        """Start the scheduler loop (call once, inside the event loop that will serve)."""
        ...

    async def stop(self) -> None:
        """Stop the loop; requests still running finish with an abort."""
        ...

    def server_info(self) -> dict[str, Any]:
        """SGLang `/get_server_info` fields for this side (max_total_num_tokens, ...)."""
        ...

    def metrics_snapshot(self) -> dict[str, float]:
        """Gauges and counters for `/metrics` (token usage, queues, transfer failures)."""
        ...

    def num_allocated_pages(self) -> int:
        """Pages currently owned by a request (0 once the side has drained)."""
        ...


class PrefillSide(Side, Protocol):
    """The prefill server: admits, prefills and sends KV; answers with its own view."""

    async def generate(self, req: GenerateRequest) -> FinishOut: ...

    async def abort(self, rid: str) -> None: ...


class DecodeSide(Side, Protocol):
    """The decode server: preallocates, receives KV, decodes; its answer reaches the client."""

    def generate(self, req: GenerateRequest) -> AsyncIterator[SideEvent]:
        """Yield at most one HeadOut, then tokens, then exactly one FinishOut. A FinishOut
        first means no token was made."""
        ...

    async def abort(self, rid: str) -> None: ...


AnySide = PrefillSide | DecodeSide
"""The side one server runs (its `Role` says which)."""


@dataclass(frozen=True, slots=True)
class TransferMetadata:
    """What decode tells prefill at bootstrap: where to write (SGLang's send_metadata)."""

    room: int
    dst_page_ids: tuple[int, ...]
    num_tokens: int
    """Decode's own view of the prompt length (what it reserved pages for)."""


@dataclass(frozen=True, slots=True)
class PageChunk:
    """A run of KV pages for one request: `payload` is the pages of every layer, serialised.

    `first_page` indexes into the destination page list (`TransferMetadata.dst_page_ids`).
    """

    room: int
    first_page: int
    num_pages: int
    payload: bytes = field(repr=False)


@dataclass(frozen=True, slots=True)
class TransferStatus:
    """Prefill's final word on a transfer (SGLang's aux/metadata row plus the status message)."""

    room: int
    poll: KVPoll
    first_token_id: int | None = None
    num_tokens_written: int | None = None
    """Published only with the `coverage_check` fix (SGLang #38704)."""
    checksum: int | None = None
    """Published only with the `kv_checksum` fix (SGLang #39500)."""
    aborted: bool = False
    rejected: bool = False
    """Prefill retired the request at admission with a 400 (the `admission_retire` fix):
    decode answers 400 too, so the client sees the rejection rather than a transfer error."""
    num_cached_tokens: int = 0
    """Prompt tokens prefill served from its prefix cache (SGLang's metadata buffers carry
    `cached_tokens` the same way), so decode's usage can report them."""


class PageSink(Protocol):
    """Decode's pool as a transfer backend sees it: pages written by page id."""

    def write_pages(self, page_ids: tuple[int, ...], payload: bytes) -> None: ...


class TransferBackend(abc.ABC):
    """Moves KV pages and status between prefill and decode, keyed by bootstrap room."""

    # decode side
    @abc.abstractmethod
    async def register_receiver(self, meta: TransferMetadata, sink: PageSink) -> None:
        """Decode announces its destination pages for a room (prefill: -> WaitingForInput)."""

    @abc.abstractmethod
    async def receiver_status(self, room: int) -> TransferStatus:
        """Wait until prefill concludes the room (Success or Failed) and return its status."""

    @abc.abstractmethod
    async def cancel_receiver(self, room: int) -> None:
        """Decode gives up on a room (client disconnect) and tells prefill to stop sending.

        Writes already in flight still land in the room's destination pages: that is the
        page-lifetime hazard. Decode must not free those pages before `wait_drained` returns
        unless it models the vulnerable behaviour (the `deferred_release` fix, SGLang #35049).
        """

    @abc.abstractmethod
    async def wait_drained(self, room: int) -> None:
        """Return once prefill acknowledges that no write for the room is in flight (ABORT_ACK)."""

    # prefill side
    @abc.abstractmethod
    async def wait_for_metadata(self, room: int, timeout_s: float) -> TransferMetadata | None:
        """Prefill waits for decode's metadata (Bootstrapping -> WaitingForInput).

        Returns None on timeout.
        """

    @abc.abstractmethod
    async def send_pages(self, chunk: PageChunk) -> None:
        """Write pages into decode's destination pages for the room."""

    @abc.abstractmethod
    async def conclude(self, status: TransferStatus) -> None:
        """Report the room's final status to decode (also the drain acknowledgement)."""

    @abc.abstractmethod
    async def is_cancelled(self, room: int) -> bool:
        """Whether decode has cancelled the room (prefill checks between chunks)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release sockets and background tasks."""

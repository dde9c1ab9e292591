"""Telling a keep-alive race from a target's failure, for the client's one retry.

A server may close an idle keep-alive connection at the moment the client reuses it:
llama.cpp's server does so 1-6 % of the time, half a millisecond after the previous response
(`Keep-Alive: timeout=5, max=100`), and httpx fails the request with `RemoteProtocolError:
Server disconnected without sending a response`. The target never saw that request, so it
is sent once more on a fresh connection. Anything else is the target's doing and is never
retried: a request on a new connection, or one that received even one byte in reply.

`AttemptTrace` is an httpcore `trace` extension for one attempt. It records whether the
attempt opened its own TCP connection and meters every connection it opens, counting each
read into the attempt running in the current task (a context variable): a later attempt that
reuses the connection is metered too. A connection opened without a trace (another caller's
request on the same client) is not metered, so a failure on it is never taken for a race.
httpcore's message alone cannot say "no byte arrived": it also fires when a partial status
line was buffered before the close.

On the aiohttp backend `aiohttp_trace_config` fills the same record from aiohttp's own
connection events (reused or created, headers sent); there the "no byte" evidence is
aiohttp's, which names a partial response head in its error (`harness.target.http_client`
maps that to a different message), so a reused connection counts as metered.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx

_CURRENT: contextvars.ContextVar[AttemptTrace | None] = contextvars.ContextVar(
    "kvcanary_attempt", default=None
)
_NO_RESPONSE = "without sending a response"


@dataclass(slots=True)
class AttemptTrace:
    """What one request attempt did at the connection level (an httpcore trace callback)."""

    opened_connection: bool = False
    """A TCP connection was opened for this attempt (it did not reuse one)."""
    sent_request: bool = False
    """The request's headers started going out (on some connection)."""
    metered: bool = False
    """At least one read of this attempt went through a metered connection."""
    num_bytes_received: int = 0

    async def __call__(self, event: str, info: dict[str, Any]) -> None:
        if event == "connection.connect_tcp.started":
            self.opened_connection = True
        elif event in ("connection.connect_tcp.complete", "connection.start_tls.complete"):
            _meter(info.get("return_value"))
        elif event.endswith(".send_request_headers.started"):
            self.sent_request = True

    def activate(self) -> contextvars.Token[AttemptTrace | None]:
        """Count this task's reads into this attempt from now on (`reset` the token after)."""
        return _CURRENT.set(self)

    @staticmethod
    def reset(token: contextvars.Token[AttemptTrace | None]) -> None:
        _CURRENT.reset(token)

    def keepalive_race(self, failure: Exception | None, got_head: bool) -> bool:
        """Whether `failure` is a reused connection closed before any byte of the answer."""
        return (
            isinstance(failure, httpx.RemoteProtocolError)
            and _NO_RESPONSE in str(failure)
            and not got_head
            and self.sent_request
            and not self.opened_connection
            and self.metered
            and self.num_bytes_received == 0
        )


def aiohttp_trace_config() -> aiohttp.TraceConfig:
    """aiohttp's connection events, recorded into the attempt running in the current task."""
    config = aiohttp.TraceConfig()

    async def created(*_: Any) -> None:
        if (attempt := _CURRENT.get()) is not None:
            attempt.opened_connection = True

    async def reused(*_: Any) -> None:
        if (attempt := _CURRENT.get()) is not None:
            attempt.metered = True

    async def sent(*_: Any) -> None:
        if (attempt := _CURRENT.get()) is not None:
            attempt.sent_request = True

    config.on_connection_create_start.append(created)
    config.on_connection_reuseconn.append(reused)
    config.on_request_headers_sent.append(sent)
    return config


def _meter(stream: Any) -> None:
    """Wrap a new connection's `read` so each read counts into the current attempt."""
    read: Callable[..., Awaitable[bytes]] | None = getattr(stream, "read", None)
    if read is None or getattr(read, "_kvcanary_metered", False):
        return

    async def metered_read(*args: Any, **kwargs: Any) -> bytes:
        data = await read(*args, **kwargs)
        attempt = _CURRENT.get()
        if attempt is not None:
            attempt.metered = True
            attempt.num_bytes_received += len(data)
        return data

    metered_read._kvcanary_metered = True  # type: ignore[attr-defined]
    with contextlib.suppress(AttributeError):  # a stream that refuses it stays unmetered
        stream.read = metered_read

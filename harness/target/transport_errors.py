"""Failures in words and kinds: the one place a low-level error becomes an `ErrorKind` and
the line a person reads.

An exception raised while a request was sent (`failure_of`) has its kind by this tree:

    BaseException
    ├── asyncio.CancelledError ........................ propagates (never swallowed)
    └── Exception
        ├── canaries.errors.ConfigError ................ propagates (tenant credential unset)
        ├── TimeoutError (our per-request deadline) ... timeout
        ├── bounded.ResponseTooLarge .................. too_large  (decoded bytes past the bound)
        ├── bounded.ErrorInSuccess .................... error_in_success  an error object
        │                                                          ({"object": "error"},
        │                                                          {"error": ...}) or SSE error
        │                                                          event after a 2xx status
        ├── bounded.StreamViolation ................... protocol   bad or too deep JSON, wrong
        │                                                          content type or encoding,
        │                                                          usage counts out of range
        └── httpx.HTTPError
            ├── ConnectTimeout, ConnectError,
            │   UnsupportedProtocol, ProxyError ....... connect
            ├── TimeoutException (read/write/pool) .... timeout
            ├── NetworkError, RemoteProtocolError ..... truncated after the response head,
            │                                           connect / protocol before it
            └── anything else (DecodingError,
                LocalProtocolError, ...) ............... protocol

and its line by `describe_transport_error`.

The two HTTP backends (`harness.target.http_client`) name the same failure differently:
httpx-aiohttp reports a refused connection as `ConnectTimeout: Cannot connect to host ...
ssl:default [Connect call failed ...]`, httpcore as `ConnectError: All connection attempts
failed`. Both chain the operating system's own exception, which says what happened, so the
chain is read instead of the wrapper's name:

    ConnectionRefusedError ........ connection refused (nothing listens on HOST:PORT)
    ssl.SSLError .................. TLS error: <the TLS library's reason>
    socket.gaierror ............... host name not found
    ConnectionResetError .......... connection reset by the server
    TimeoutError under a connect .. timeout while connecting
    anything else ................. `<Type>: <message>` as the exception says it

(`HOST:PORT` follows where the error knows its request.)

It quotes no response body; answers that are no success without an exception (a non-2xx
status, a stream that ended early) are `harness.target.client`'s.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator

import httpx

from kvcanary.harness.record.observation import ErrorKind
from kvcanary.harness.target.bounded import ErrorInSuccess, ResponseTooLarge, StreamViolation

MAX_MESSAGE_CHARS = 2000


def failure_of(
    failure: Exception, *, got_head: bool, deadline_s: float | None
) -> tuple[ErrorKind, str]:
    """The error kind and one-line message of an exception raised while a request was sent
    (`got_head`: its response head had arrived)."""
    message = describe_transport_error(failure)[:MAX_MESSAGE_CHARS]
    kind: ErrorKind
    match failure:
        case TimeoutError():
            kind, message = "timeout", f"no complete response within the {deadline_s} s deadline"
        case ResponseTooLarge():
            kind = "too_large"
        case ErrorInSuccess():
            kind = "error_in_success"
        case StreamViolation():
            kind = "protocol"
        case httpx.ConnectTimeout() | httpx.ConnectError() | httpx.UnsupportedProtocol():
            kind = "connect"
        case httpx.ProxyError():
            kind = "connect"
        case httpx.TimeoutException():
            kind = "timeout"
        case httpx.NetworkError() | httpx.RemoteProtocolError() if got_head:
            kind = "truncated"
        case httpx.NetworkError():
            kind = "connect"
        case _:
            kind = "protocol"
    return kind, message


def describe_transport_error(exc: BaseException) -> str:
    """One line naming what went wrong (see the module docstring)."""
    for cause in _chain(exc):
        if isinstance(cause, ssl.SSLError):
            # aiohttp's own TLS errors subclass SSLError without its attributes
            said = [getattr(cause, name, None) for name in ("verify_message", "reason")]
            if not any(said):
                continue  # the SSLError it was raised from is further down the chain
            return f"TLS error{_where(exc)}: {next(s for s in said if s)}"
        if isinstance(cause, ConnectionRefusedError):
            return f"connection refused{_where(exc)}"
        if isinstance(cause, socket.gaierror):
            return f"host name not found{_where(exc)} ({cause.strerror or cause})"
        if isinstance(cause, ConnectionResetError):
            return "connection reset by the server"
    if isinstance(exc, httpx.ConnectTimeout):  # httpx-aiohttp's name for every connect failure
        causes = list(_chain(exc))[1:]
        os_error = next((c for c in causes if isinstance(c, OSError)), None)
        if os_error is None or isinstance(os_error, TimeoutError):
            return f"timeout while connecting{_where(exc)}"
        return f"connection failed{_where(exc)}: {os_error.strerror or os_error}"
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and what it was raised from, innermost last (a cycle is cut)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _where(exc: BaseException) -> str:
    """` by HOST:PORT` for an httpx error that knows its request; else nothing."""
    try:
        url = exc.request.url if isinstance(exc, httpx.RequestError) else None
    except RuntimeError:  # an httpx error built without a request
        return ""
    if url is None:
        return ""
    port = url.port or {"http": 80, "https": 443}.get(url.scheme)
    return f" ({url.host}:{port})"

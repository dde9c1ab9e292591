"""Failures said for what they are, on both HTTP backends: a refused connection is
"connection refused" (httpx-aiohttp calls it a ConnectTimeout), a TLS handshake with a plain
HTTP server is a TLS error, a timeout says timeout."""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterator

import httpx
import pytest
from raw_listener import raw_listener

from kvcanary.harness.target.http_client import Backend, make_http_client
from kvcanary.harness.target.transport_errors import describe_transport_error, failure_of


@pytest.fixture
def plain_http_port() -> Iterator[int]:
    """A loopback port that answers every connection with a plain HTTP response."""

    def answer(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")

    with raw_listener(answer) as port:
        yield port


async def failure(backend: Backend, url: str) -> httpx.HTTPError:
    async with make_http_client(backend=backend, timeout=httpx.Timeout(5.0)) as http:
        with pytest.raises(httpx.HTTPError) as caught:
            await http.get(url)
    return caught.value


async def test_a_refused_connection_is_said_so(backend: Backend) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    exc = await failure(backend, f"http://127.0.0.1:{port}/v1/models")
    assert describe_transport_error(exc) == f"connection refused (127.0.0.1:{port})"
    assert failure_of(exc, got_head=False, deadline_s=None)[0] == "connect"


async def test_tls_to_a_plain_http_server_is_a_tls_error(
    backend: Backend, plain_http_port: int
) -> None:
    exc = await failure(backend, f"https://127.0.0.1:{plain_http_port}/v1/models")
    said = describe_transport_error(exc)
    assert said.startswith(f"TLS error (127.0.0.1:{plain_http_port}): "), said
    assert failure_of(exc, got_head=False, deadline_s=None)[0] == "connect"


def chained(outer: httpx.HTTPError, inner: BaseException) -> httpx.HTTPError:
    outer.__cause__ = inner
    return outer


@pytest.mark.parametrize(
    ("exc", "said"),
    [
        (chained(httpx.ConnectTimeout("x"), TimeoutError()), "timeout while connecting"),
        (httpx.ConnectTimeout("Cannot connect"), "timeout while connecting"),
        (
            chained(httpx.ConnectTimeout("x"), OSError(errno.EHOSTUNREACH, "No route to host")),
            "connection failed: No route to host",
        ),
        (chained(httpx.ReadError("x"), ConnectionResetError()), "connection reset by the server"),
        (httpx.ReadTimeout("timed out"), "ReadTimeout: timed out"),
        (httpx.RemoteProtocolError(""), "RemoteProtocolError: RemoteProtocolError"),
    ],
)
def test_what_the_chain_says_is_what_is_said(exc: httpx.HTTPError, said: str) -> None:
    assert describe_transport_error(exc) == said

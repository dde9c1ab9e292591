"""Bounded GETs of a target's introspection endpoints, each recorded as an `Attempt`.

Every discovery read is bounded three ways, whatever the client's own limits are:

    time      `timeout_s` per endpoint (or the client's read timeout, if shorter), for each
              operation and for the whole exchange, so a server that hangs, or trickles a
              byte a second, costs at most that long
    size      `max_bytes` of *decoded* body (`harness.target.bounded.MeteredStream`): a huge
              or gzip-bombed `/v1/models` or `/metrics` is cut as it streams
    shape     JSON depth and size limits (`harness.target.bounded.loads`)

Target misbehaviour (refused connections, timeouts, 404s, HTML where JSON was expected,
bodies past the bound) is recorded, never raised. A host that refuses connections, or lets
a connect time out, is not asked again: every further path is recorded as "not tried".
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from kvcanary.harness.target.bounded import (
    MeteredStream,
    ResponseTooLarge,
    StreamViolation,
    loads,
    take_over_decoding,
)
from kvcanary.harness.target.server_facts import Attempt, describe_error

DISCOVERY_TIMEOUT_S = 10.0
"""The default time one introspection endpoint gets (callers pass min(--timeout, this))."""
DISCOVERY_BODY_BYTES = 1024 * 1024
"""No server-info, model list or metrics page a serving engine sends is anywhere near this."""


@dataclass(frozen=True, slots=True)
class Fetched:
    """One response: its status and, for a 200, its decoded body (else empty)."""

    url: str
    status: int
    body: bytes


class Fetcher:
    """GETs paths under one base URL with bounds; collects the attempts it made."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        base_url: str,
        headers: Mapping[str, str] | None,
        *,
        timeout_s: float = DISCOVERY_TIMEOUT_S,
        max_bytes: int = DISCOVERY_BODY_BYTES,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"the discovery timeout must be positive, got {timeout_s}")
        self.client = client
        self.base_url = base_url
        self.headers = dict(headers or {})
        client_read = client.timeout.read
        # never longer than the client would wait for a read (an audit's --timeout)
        self.timeout_s = min(timeout_s, client_read) if client_read else timeout_s
        self.max_bytes = max_bytes
        self.attempts: list[Attempt] = []
        self.unreachable: str | None = None
        self.timed_out = 0

    def fork(self) -> Fetcher:
        """A fetcher for the same target with its own attempts (for requests in parallel)."""
        other = Fetcher(
            self.client,
            self.base_url,
            self.headers,
            timeout_s=self.timeout_s,
            max_bytes=self.max_bytes,
        )
        other.unreachable = self.unreachable
        return other

    def join(self, *others: Fetcher) -> None:
        """Take the attempts and what was learned about the host from forks, in order."""
        for other in others:
            self.attempts += other.attempts
            self.unreachable = self.unreachable or other.unreachable
            self.timed_out += other.timed_out

    @property
    def answered(self) -> bool:
        return any(a.status is not None for a in self.attempts)

    async def get(self, path: str) -> Fetched | None:
        """GET one path; None when no usable response came back (the attempt is recorded;
        a non-200 status is the caller's to record)."""
        url = self.base_url + path
        if self.unreachable is not None:
            self.attempts.append(Attempt(url, None, self.unreachable, "not tried"))
            return None
        status: int | None = None
        try:
            async with asyncio.timeout(self.timeout_s):
                request = self.client.build_request(
                    "GET", url, headers=self.headers, timeout=httpx.Timeout(self.timeout_s)
                )
                response = await self.client.send(request, stream=True)
                try:
                    status = response.status_code
                    if status != 200:
                        return Fetched(url, status, b"")
                    return Fetched(url, status, await _read_bounded(response, self.max_bytes))
                finally:
                    await response.aclose()
        except TimeoutError:
            self.timed_out += 1
            error = f"no complete answer within {self.timeout_s:g} s"
            self.attempts.append(Attempt(url, status, error, "nothing"))
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            # the host is not there; every further path would wait out the same timeout
            self.unreachable = f"unreachable: {describe_error(exc)}"
            self.attempts.append(Attempt(url, None, self.unreachable, "nothing"))
        except httpx.TimeoutException as exc:
            self.timed_out += 1
            self.attempts.append(Attempt(url, status, describe_error(exc), "nothing"))
        except ResponseTooLarge:
            error = f"body larger than {self.max_bytes} bytes; not read further"
            self.attempts.append(Attempt(url, status, error, "nothing"))
        except StreamViolation as exc:
            self.attempts.append(Attempt(url, status, describe_error(exc), "nothing"))
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            self.attempts.append(Attempt(url, status, describe_error(exc), "nothing"))
        return None

    async def get_json(self, path: str) -> tuple[str, Any] | None:
        """(url, decoded body) of a 200 JSON response; None, with the attempt recorded, else."""
        fetched = await self.get(path)
        if fetched is None:
            return None
        if fetched.status != 200:
            self.attempts.append(Attempt(fetched.url, fetched.status, None, "nothing"))
            return None
        try:
            return fetched.url, loads(fetched.body)
        except StreamViolation as exc:
            why = "not JSON" if str(exc).startswith("malformed JSON") else str(exc)
            self.attempts.append(Attempt(fetched.url, 200, why, "nothing"))
            return None


async def post_bounded(
    client: httpx.AsyncClient,
    url: str,
    *,
    json_body: Any,
    headers: Mapping[str, str] | None = None,
    max_bytes: int = DISCOVERY_BODY_BYTES,
) -> tuple[int, bytes]:
    """POST `json_body`; (status, decoded body of at most `max_bytes`). A one-off request
    (calibration, a probe) reads its answer through this, so a huge or inflating answer
    costs bounded memory. Raises httpx errors, `ResponseTooLarge`, `StreamViolation`."""
    request = client.build_request("POST", url, json=json_body, headers=dict(headers or {}))
    response = await client.send(request, stream=True)
    try:
        return response.status_code, await _read_bounded(response, max_bytes)
    finally:
        await response.aclose()


async def _read_bounded(response: httpx.Response, max_bytes: int) -> bytes:
    """The body, decoded by the meter (not by httpx), cut past `max_bytes`."""
    if response.is_stream_consumed:  # built in memory (a mock transport): already whole
        if len(response.content) > max_bytes:
            raise ResponseTooLarge(f"response exceeded {max_bytes} bytes")
        return response.content
    assert isinstance(response.stream, httpx.AsyncByteStream)
    response.stream = MeteredStream(response.stream, max_bytes, take_over_decoding(response))
    body = bytearray()
    async for chunk in response.aiter_raw():
        body += chunk
    return bytes(body)

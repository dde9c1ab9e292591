"""Bounded reading of what a target sends: decoded bytes metered as they stream, JSON parsed
with depth and size limits, lone surrogates made harmless.

`MeteredStream` sits between httpx and whoever reads the body (the SSE decoder, `aread`). It
undoes the response's content-encoding itself, a bounded piece at a time, so the byte bound
counts *decoded* bytes and a gzip body that inflates to gigabytes is cut at the bound after
at most one step of inflation past it (`INFLATE_STEP`); the caller removes the
`content-encoding` header (`take_over_decoding`) so httpx does not decode a second time.

`loads` is `json.loads` for hostile input: it refuses text longer than its bound, and a
document nested deeper than `MAX_JSON_DEPTH` (a run of openers before parsing; otherwise the
parser's own recursion guard, then a linear scan of the parsed text), so nothing downstream
recurses into it; and it replaces lone surrogate code points (`"\\ud800"`), which no UTF-8
encoder accepts, with U+FFFD.

Both raise only the two exceptions defined here, for the target's misbehaviour.
"""

from __future__ import annotations

import json
import re
import time
import zlib
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from typing import Any

import httpx

MAX_JSON_DEPTH = 64
"""No OpenAI-compatible answer or server-info document nests anywhere near this deep."""
INFLATE_STEP = 64 * 1024
"""The most one decompression call may produce: what a body can overshoot its bound by."""
_DECODABLE = ("gzip", "x-gzip", "deflate")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_PARENS = bytes.maketrans(b"[{]}", b"(())")
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


class StreamViolation(Exception):
    """The target sent something an OpenAI-compatible server must not (maps to `protocol`)."""


class ErrorInSuccess(StreamViolation):
    """A 2xx response that carries an error instead of an answer: vLLM's `{"object": "error",
    ...}`, an `{"error": ...}` object, or an SSE `error` event (maps to `error_in_success`)."""


class ResponseTooLarge(Exception):
    """The response passed the per-response byte bound (maps to `too_large`)."""


def take_over_decoding(response: httpx.Response) -> tuple[str, ...]:
    """The response's content-codings, outermost last, removed from its headers so that httpx
    passes the body through as it came; `MeteredStream` undoes them instead."""
    codings = tuple(
        value.strip().lower()
        for value in response.headers.get_list("content-encoding", split_commas=True)
        if value.strip().lower() not in ("", "identity")
    )
    if "content-encoding" in response.headers:
        del response.headers["content-encoding"]
    return codings


class MeteredStream(httpx.AsyncByteStream):
    """Wraps a response body: stamps network reads, decodes, and bounds the decoded bytes."""

    def __init__(
        self, inner: httpx.AsyncByteStream, max_bytes: int, codings: Sequence[str] = ()
    ) -> None:
        self._inner = inner
        self._max_bytes = max_bytes
        self._codings = tuple(codings)
        self.num_bytes = 0
        """Decoded bytes seen so far (past the bound: the bound plus at most one step)."""
        self.t_first_read_ns: int | None = None
        self.t_last_read_ns: int | None = None
        """When the read that completed the most recently decoded event arrived: the
        decoders pull lazily, so every event is yielded before the next read happens."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        unknown = [c for c in self._codings if c not in _DECODABLE]
        if unknown:
            raise StreamViolation(f"unsupported content-encoding {', '.join(unknown)!r}")
        # codings are listed in the order they were applied: undo the last one first
        stages = [_Inflater(coding) for coding in reversed(self._codings)]
        async for chunk in self._inner:
            now = time.perf_counter_ns()
            if self.t_first_read_ns is None:
                self.t_first_read_ns = now
            self.t_last_read_ns = now
            for piece in self._bounded(_through(stages, chunk)):
                yield piece
        for index, stage in enumerate(stages):
            for piece in self._bounded(_through(stages[index + 1 :], stage.flush())):
                yield piece

    def _bounded(self, pieces: Iterable[bytes]) -> Iterator[bytes]:
        for piece in pieces:
            room = self._max_bytes - self.num_bytes
            self.num_bytes += len(piece)
            if len(piece) > room:
                if room > 0:  # what fits is still read, so a bounded response keeps its text
                    yield piece[:room]
                raise ResponseTooLarge(f"response exceeded {self._max_bytes} bytes; rest dropped")
            yield piece

    async def aclose(self) -> None:
        await self._inner.aclose()


class _Inflater:
    """One content-coding undone incrementally, at most `INFLATE_STEP` bytes per call."""

    def __init__(self, coding: str) -> None:
        self._coding = coding
        self._z: Any = None
        self._head = b""  # deflate: the first bytes, until it is clear whether zlib-wrapped
        if coding in ("gzip", "x-gzip"):
            self._z = zlib.decompressobj(16 + zlib.MAX_WBITS)

    def feed(self, data: bytes) -> Iterator[bytes]:
        if self._z is None:  # deflate: RFC 9110 says zlib-wrapped; some servers send it raw
            self._head += data
            if len(self._head) < 2:
                return
            head, self._head = self._head, b""
            wrapped = head[0] & 0x0F == 8 and (head[0] << 8 | head[1]) % 31 == 0
            self._z = zlib.decompressobj(zlib.MAX_WBITS if wrapped else -zlib.MAX_WBITS)
            data = head
        try:
            while data and not self._z.eof:
                out = self._z.decompress(data, INFLATE_STEP)
                data = self._z.unconsumed_tail
                if out:
                    yield out
        except zlib.error as exc:
            raise StreamViolation(f"undecodable {self._coding} body: {exc}") from None

    def flush(self) -> bytes:
        if self._z is None:
            if self._head:
                raise StreamViolation(f"undecodable {self._coding} body: too short")
            return b""
        try:
            return bytes(self._z.flush(INFLATE_STEP))
        except zlib.error as exc:
            raise StreamViolation(f"undecodable {self._coding} body: {exc}") from None


def _through(stages: Sequence[_Inflater], data: bytes) -> Iterator[bytes]:
    if not stages:
        if data:
            yield data
        return
    for piece in stages[0].feed(data):
        yield from _through(stages[1:], piece)


def loads(text: str | bytes, *, max_chars: int | None = None) -> Any:
    """`json.loads` with limits; `StreamViolation` for malformed, oversized or too deep JSON."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    if max_chars is not None and len(text) > max_chars:
        raise StreamViolation(f"JSON of {len(text)} characters (more than {max_chars})")
    too_deep = StreamViolation(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    if "[" * (MAX_JSON_DEPTH + 1) in text or "{" * (MAX_JSON_DEPTH + 1) in text:
        raise too_deep  # the usual bomb, refused before any parsing
    try:
        # the C parser guards its own recursion (RecursionError well before the C stack
        # runs out), and a valid document's strings all end, so the depth scan is linear
        value = json.loads(text)
    except RecursionError:
        raise too_deep from None
    except ValueError:
        raise StreamViolation(f"malformed JSON: {excerpt(text)}") from None
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and _deeper_than(text, MAX_JSON_DEPTH):
        raise too_deep
    if _SURROGATE_ESCAPE.search(text):
        value = _without_surrogates(value)
    return value


def excerpt(text: str, limit: int = 200) -> str:
    """At most `limit` characters of `text`, saying how long it was."""
    text = _SURROGATE.sub("\ufffd", text)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def _deeper_than(text: str, limit: int) -> bool:
    """Whether a valid JSON document nests brackets deeper than `limit` outside its strings.

    Each pass deletes the innermost bracket pairs (in C), so a document `d` deep is empty
    after `d` passes: at most `limit` linear passes, a few for any real answer."""
    outside = _STRING.sub('""', text).encode("ascii", errors="ignore")
    brackets = outside.translate(_PARENS, delete=_NOT_BRACKETS)
    for _ in range(limit):
        if not brackets:
            return False
        brackets = brackets.replace(b"()", b"")
    return bool(brackets)


def _without_surrogates(value: Any) -> Any:
    """`value` with every lone surrogate in its strings (keys too) replaced by U+FFFD; the
    nesting is already bounded, so the recursion is."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [_without_surrogates(v) for v in value]
    if isinstance(value, dict):
        return {_without_surrogates(k): _without_surrogates(v) for k, v in value.items()}
    return value

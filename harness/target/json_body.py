"""A JSON request body sent in pieces, so a million-token prompt is never copied whole.

`JsonBody(obj, big=...)` encodes `obj` as httpx's `json=` would (UTF-8, compact separators,
no NaN, non-ASCII kept), except that the string `big` names (the prompt or the one
message's content) is escaped and encoded `CHUNK_CHARS` characters at a time as the body is
sent: the request holds the prompt (which its plan holds anyway) and one chunk, not a
second full copy of it as bytes. Its length is known up front, so the request has a
`Content-Length` (no chunked upload, which some servers refuse): for the usual prompt, ASCII
with nothing to escape, that is a scan; otherwise one chunked escaping pass more.

The body can be iterated again (a retry sends it anew). It is an async iterable only: httpx
takes it as `content=` for an `AsyncClient`. `json_content` picks between it and plain bytes:
a prompt up to `CHUNK_CHARS` characters is encoded whole (one write, no async iteration), a
longer one streamed. This module knows nothing about plans or HTTP.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Iterator
from typing import Any, Final

CHUNK_CHARS: Final = 64 * 1024
_NEEDS_ESCAPE = re.compile(r'["\\\x00-\x1f]')
_PLACEHOLDER = "\x00kvcanary-body\x00"
"""Stands for the big string while the rest is encoded (escaped as `\\u0000`, so no real
value of a request body can contain its encoded form)."""


class JsonBody:
    """`obj` as JSON bytes, the string at `big` (a path of keys and indices) streamed."""

    def __init__(self, obj: Any, big: tuple[str | int, ...]) -> None:
        holder = obj_copy = _copy_path(obj, big)
        for key in big[:-1]:
            holder = holder[key]
        text = holder[big[-1]]
        assert isinstance(text, str), type(text)
        holder[big[-1]] = _PLACEHOLDER
        encoded = _dumps(obj_copy).encode()
        marker = _dumps(_PLACEHOLDER)[1:-1].encode()
        assert encoded.count(marker) == 1
        head, tail = encoded.split(marker)
        self._head, self._tail, self._text = head, tail, text
        if text.isascii() and _NEEDS_ESCAPE.search(text) is None:
            num_text_bytes = len(text)  # escaping and encoding leave it as it is
        else:
            num_text_bytes = sum(map(len, self._text_chunks()))
        self.num_bytes: Final = len(head) + num_text_bytes + len(tail)

    def __len__(self) -> int:
        return self.num_bytes

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self._head
        for chunk in self._text_chunks():
            yield chunk
        yield self._tail

    def _text_chunks(self) -> Iterator[bytes]:
        text = self._text
        for start in range(0, len(text), CHUNK_CHARS):
            # escaping is per character, so slices escape to the slices of the escape
            yield _dumps(text[start : start + CHUNK_CHARS])[1:-1].encode()


def json_content(obj: Any, big: tuple[str | int, ...]) -> bytes | JsonBody:
    """`obj` as request content: whole bytes if the string at `big` is short (a copy of a
    few KiB costs less than sending it in pieces), else a `JsonBody` that streams it."""
    holder = obj
    for key in big:
        holder = holder[key]
    assert isinstance(holder, str), type(holder)
    if len(holder) <= CHUNK_CHARS:
        return _dumps(obj).encode()
    return JsonBody(obj, big)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _copy_path(obj: Any, path: tuple[str | int, ...]) -> Any:
    """`obj` with the containers along `path` copied, so the caller's object is untouched."""
    top = copy = _shallow(obj)
    for key in path[:-1]:
        copy[key] = _shallow(copy[key])
        copy = copy[key]
    return top


def _shallow(value: Any) -> Any:
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, list):
        return list(value)
    raise TypeError(f"cannot descend into {type(value).__name__}")

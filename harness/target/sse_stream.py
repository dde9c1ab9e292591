"""Reading one OpenAI-style completion response: byte metering and chunk interpretation.

`MeteredStream` (`harness.target.bounded`) sits between httpx and the SSE decoder
(`httpx-sse`): it stamps when each network read arrived, undoes the content-encoding and
stops a response whose decoded bytes grow past its byte bound, so a huge, never-ending or
inflating body costs bounded memory. `Transcript` turns decoded events (or one
non-streaming JSON body) into text, usage, finish reason and the first-token time; JSON is
parsed with depth limits and lone surrogates replaced (`harness.target.bounded.loads`), and a
usage count that is negative or above `MAX_TOKEN_COUNT` is a violation.

Both raise only the two exceptions of `harness.target.bounded`, for the target's
misbehaviour; the mapping of every error to an `ErrorKind` lives in one place,
`harness.target.client`. This module knows nothing about plans, tenants or HTTP status codes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from harness.record.observation import Usage
from harness.target.bounded import MeteredStream, ResponseTooLarge, StreamViolation, excerpt, loads

DONE_SENTINEL = "[DONE]"
MAX_TOKEN_COUNT = 10**12
"""A usage count above this is not a count (no context or output is a trillion tokens)."""
_TEXT_FIELDS = ("reasoning_content", "reasoning", "content")
"""Delta fields scanned as response text. Reasoning comes first in a stream and may quote
stale pages as readily as the answer does, so it is part of the text the detectors see."""


@dataclass(slots=True)
class Transcript:
    """What one completion response said, accumulated event by event."""

    on_text: Callable[[str], None] | None = None
    parts: list[str] = field(default_factory=list)
    num_chunks: int = 0
    """Events (or bodies) that carried non-empty text."""
    finish_reason: str | None = None
    usage: Usage = field(default_factory=Usage)
    saw_done: bool = False
    t_first_token_ns: int | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def complete(self) -> bool:
        """The target said it was finished ([DONE] or a finish_reason)."""
        return self.saw_done or self.finish_reason is not None

    def take_event(self, event: str, data: str, t_arrived_ns: int) -> None:
        """One SSE event of a streamed response."""
        if self.saw_done:
            return  # nothing after [DONE] is part of the response
        if data.strip() == DONE_SENTINEL:
            self.saw_done = True
            return
        if event == "error":
            raise StreamViolation(f"error event in stream: {excerpt(data)}")
        if not data:
            return  # an event with no data field (e.g. a bare `event:` or `id:`)
        self._take_object(_parse_json(data), "delta", t_arrived_ns)

    def take_body(self, body: bytes, t_arrived_ns: int) -> None:
        """The whole body of a non-streaming response (complete once it parses)."""
        self._take_object(
            _parse_json(body.decode("utf-8", errors="replace")), "message", t_arrived_ns
        )
        self.saw_done = True

    def _take_object(self, obj: Any, text_holder: str, t_arrived_ns: int) -> None:
        if not isinstance(obj, dict):
            raise StreamViolation(f"expected a JSON object, got {type(obj).__name__}")
        if obj.get("error"):
            raise StreamViolation(
                f"error object after HTTP 200: {excerpt(json.dumps(obj['error']))}"
            )
        choices = obj.get("choices") or []
        if not isinstance(choices, list):
            raise StreamViolation("`choices` is not a list")
        delta = "".join(self._take_choice(choice, text_holder) for choice in choices)
        if delta:
            self.num_chunks += 1
            if self.t_first_token_ns is None:
                self.t_first_token_ns = t_arrived_ns
            self.parts.append(delta)
            if self.on_text is not None:
                self.on_text(delta)
        if "usage" in obj and obj["usage"] is not None:  # after the text, which is kept
            self.usage = _parse_usage(obj["usage"])

    def _take_choice(self, choice: Any, text_holder: str) -> str:
        if not isinstance(choice, dict):
            raise StreamViolation("a choice is not a JSON object")
        reason = choice.get("finish_reason")
        if reason is not None:
            if not isinstance(reason, str):
                raise StreamViolation("`finish_reason` is not a string")
            self.finish_reason = reason
        holder = choice.get(text_holder)
        if holder is None:  # completions: the text sits on the choice itself
            return _text_of(choice.get("text"), "text")
        if not isinstance(holder, dict):
            raise StreamViolation(f"`{text_holder}` is not a JSON object")
        return "".join(_text_of(holder.get(name), name) for name in _TEXT_FIELDS)


def _text_of(value: Any, name: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise StreamViolation(f"`{name}` is not a string")
    return value


def _parse_json(data: str) -> Any:
    return loads(data)


def _parse_usage(raw: Any) -> Usage:
    if not isinstance(raw, dict):
        raise StreamViolation("`usage` is not a JSON object")
    details = raw.get("prompt_tokens_details") or {}
    if not isinstance(details, dict):
        raise StreamViolation("`usage.prompt_tokens_details` is not a JSON object")
    return Usage(
        prompt_tokens=_count(raw.get("prompt_tokens"), "prompt_tokens"),
        completion_tokens=_count(raw.get("completion_tokens"), "completion_tokens"),
        cached_tokens=_count(details.get("cached_tokens"), "cached_tokens"),
    )


def _count(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise StreamViolation(f"`usage.{name}` is not an integer")
    if not 0 <= value <= MAX_TOKEN_COUNT:
        shown = str(value) if abs(value) < 10**20 else f"a {len(str(abs(value)))}-digit number"
        raise StreamViolation(f"`usage.{name}` is out of range ({shown})")
    return value


__all__ = [
    "DONE_SENTINEL",
    "MAX_TOKEN_COUNT",
    "MeteredStream",
    "ResponseTooLarge",
    "StreamViolation",
    "Transcript",
]

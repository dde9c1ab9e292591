"""Reading one OpenAI-style completion response: byte metering, SSE decoding and chunk
interpretation.

`MeteredStream` (`harness.target.bounded`) sits between httpx and the SSE decoder
(`EventDecoder`): it stamps when each network read arrived, undoes the content-encoding and
stops a response whose decoded bytes grow past its byte bound, so a huge, never-ending or
inflating body costs bounded memory. `EventDecoder` turns each decoded chunk into the events
it completes, in one call per chunk (no generator per line or per event: at hundreds of
streams the per-event Python cost is what the client's first-token stamps queue behind).
`Transcript` turns decoded events (or one non-streaming JSON body) into text, usage, finish
reason and the first-token time; JSON is parsed with depth limits and lone surrogates
replaced (`harness.target.bounded.loads`), and a usage count that is negative or above
`MAX_TOKEN_COUNT` is a violation.

**Every text field is read**, each delivered to `on_text(delta, field)` under its own name, so
a finding can say where a canary was: the answer fields (`LIVE_FIELDS`, and completions'
`text`) as they arrive; the structured ones (`tool_calls[i].function.name` / `.arguments`,
legacy `function_call.name` / `.arguments`, the chosen tokens of `logprobs.content`,
`logprobs.refusal` and completions' `logprobs.tokens`) held per field and delivered whole by
`flush()` when the response is over, because their deltas interleave with the answer's and a
canary must not be cut in two by another field's text. Wherever the field changes, the
delivered text starts with `FIELD_SEPARATOR`, so the last word of one field is never glued
to the first of the next. `Transcript.text` is exactly what was delivered (the detectors'
offsets index it). Logprobs' `top_logprobs` alternatives are not read: each is one token,
and no canary fits in one token.

Both raise only the two exceptions of `harness.target.bounded`, for the target's
misbehaviour; the mapping of every error to an `ErrorKind` lives in one place,
`harness.target.client`. This module knows nothing about plans, tenants or HTTP status codes.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvcanary.harness.record.observation import TextSink, Usage
from kvcanary.harness.target.bounded import (
    MAX_JSON_DEPTH,
    ErrorInSuccess,
    MeteredStream,
    ResponseTooLarge,
    StreamViolation,
    excerpt,
    loads,
)

DONE_SENTINEL = "[DONE]"
MAX_TOKEN_COUNT = 10**12
"""A usage count above this is not a count (no context or output is a trillion tokens)."""
LIVE_FIELDS = ("reasoning_content", "reasoning", "content", "refusal")
"""Message / delta fields delivered as they arrive. Reasoning comes first in a stream and may
quote stale pages as readily as the answer does; a refusal is the answer of a model that
declines, and may quote them too."""
COMPLETION_FIELD = "text"
"""The completions API's answer field, on the choice itself."""
FIELD_SEPARATOR = "\n"
"""Starts the text delivered for a field other than the previous one (a word boundary)."""


class EventDecoder:
    """A `text/event-stream` body decoded chunk by chunk into `(event, data)` pairs.

    As the SSE specification reads it (and `httpx-sse` decodes it): UTF-8 (invalid bytes
    replaced), lines ending in CRLF, LF or CR (a CR at the end of a chunk waits for the next
    one, which may start with its LF), `:` comments skipped, a space after the colon dropped,
    `data` lines joined by LF, `id` and `retry` ignored, and an event dispatched at the blank
    line that ends it if it had an `event` or a `data` line. An event the body ends inside is
    incomplete and never dispatched. A line split over any number of chunks costs linear
    time (its pieces are joined once, when it ends)."""

    __slots__ = ("_data", "_event", "_held_cr", "_line", "_utf8")

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._line: list[str] = []
        """Pieces of the line not yet ended."""
        self._held_cr = False
        self._event = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[tuple[str, str]]:
        """The events that `chunk` completes, in order."""
        return self._text(self._utf8.decode(chunk))

    def flush(self) -> list[tuple[str, str]]:
        """The events the end of the body completes (a final CR ends a line)."""
        text = self._utf8.decode(b"", True)
        if self._held_cr:
            self._held_cr = False
            text = "\r" + text
        return self._text(text + "\n" if text.endswith("\r") else text)

    def _text(self, text: str) -> list[tuple[str, str]]:
        if self._held_cr:
            self._held_cr = False
            text = "\r" + text
        if "\r" in text:
            if text.endswith("\r"):  # maybe the first half of a CRLF
                self._held_cr = True
                text = text[:-1]
            text = text.replace("\r\n", "\n").replace("\r", "\n")
        if "\n" not in text:
            if text:
                self._line.append(text)
            return []
        lines = text.split("\n")
        if self._line:
            self._line.append(lines[0])
            lines[0] = "".join(self._line)
            self._line = []
        last = lines.pop()
        if last:
            self._line.append(last)
        events: list[tuple[str, str]] = []
        for line in lines:
            if not line:
                if self._data or self._event:
                    events.append((self._event, "\n".join(self._data)))
                    self._event, self._data = "", []
                continue
            name, _, value = line.partition(":")
            if value[:1] == " ":
                value = value[1:]
            if name == "data":
                self._data.append(value)
            elif name == "event":
                self._event = value
            # a comment (empty name), `id`, `retry` and unknown fields: nothing to keep
        return events


@dataclass(slots=True)
class Transcript:
    """What one completion response said, accumulated event by event."""

    on_text: TextSink | None = None
    parts: list[str] = field(default_factory=list)
    num_chunks: int = 0
    """Events (or bodies) that carried non-empty text in any field."""
    finish_reason: str | None = None
    usage: Usage = field(default_factory=Usage)
    saw_done: bool = False
    t_first_token_ns: int | None = None
    _last_field: str | None = None
    _held: dict[str, list[str]] = field(default_factory=dict)
    """Structured fields' text, by field name in order of first appearance, until `flush`."""
    _num_held: int = 0
    """Pieces ever added to `_held` (an event that adds one carried text)."""

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
        if data[:1] != "{" and data.strip() == DONE_SENTINEL:  # (an object is never it)
            self.saw_done = True
            return
        if event == "error":
            raise ErrorInSuccess(f"error event in stream: {excerpt(data)}")
        if not data:
            return  # an event with no data field (e.g. a bare `event:` or `id:`)
        self._take_object(_parse_json(data), "delta", t_arrived_ns)

    def flush(self) -> None:
        """Deliver the held structured fields, the response being over (however it ended: a
        tool call cut off by a truncated stream is still text the target sent)."""
        held, self._held = self._held, {}
        for name, pieces in held.items():
            self._deliver("".join(pieces), name)

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
            raise ErrorInSuccess(
                f"error object after HTTP 200: {excerpt(json.dumps(obj['error']))}"
            )
        if obj.get("object") == "error":  # vLLM's ErrorResponse, sent with a success status
            raise ErrorInSuccess(f"error object after HTTP 200: {excerpt(json.dumps(obj))}")
        choices = obj.get("choices") or []
        if not isinstance(choices, list):
            raise StreamViolation("`choices` is not a list")
        live: list[tuple[str, str]] = []  # the non-empty answer texts, in order
        num_held = self._num_held
        for position, choice in enumerate(choices):
            self._take_choice(choice, text_holder, position, live)
        if live or self._num_held > num_held:
            self.num_chunks += 1
            if self.t_first_token_ns is None:
                self.t_first_token_ns = t_arrived_ns
        for name, text in live:
            self._deliver(text, name)
        usage = obj.get("usage")
        if usage is not None:  # after the text, which is kept
            self.usage = _parse_usage(usage)

    def _deliver(self, text: str, name: str) -> None:
        if not text:
            return
        if self._last_field is not None and self._last_field != name:
            text = FIELD_SEPARATOR + text
        self._last_field = name
        self.parts.append(text)
        if self.on_text is not None:
            self.on_text(text, name)

    def _hold(self, name: str, value: Any) -> None:
        text = _text_of(value, name)
        if text:
            self._held.setdefault(name, []).append(text)
            self._num_held += 1

    def _take_choice(
        self, choice: Any, text_holder: str, position: int, live: list[tuple[str, str]]
    ) -> None:
        """The choice's answer text by field onto `live`; its structured fields to `_held`."""
        if not isinstance(choice, dict):
            raise StreamViolation("a choice is not a JSON object")
        reason = choice.get("finish_reason")
        if reason is not None:
            if not isinstance(reason, str):
                raise StreamViolation("`finish_reason` is not a string")
            self.finish_reason = reason
        logprobs = choice.get("logprobs")
        if logprobs is not None:
            self._hold_logprobs(logprobs, _prefix(choice, position))
        holder = choice.get(text_holder)
        if holder is None:  # completions: the text sits on the choice itself
            if text := _text_of(choice.get("text"), COMPLETION_FIELD):
                live.append((COMPLETION_FIELD, text))
            return
        if not isinstance(holder, dict):
            raise StreamViolation(f"`{text_holder}` is not a JSON object")
        calls = holder.get("tool_calls")
        if calls is not None:
            self._hold_tool_calls(calls, _prefix(choice, position))
        call = holder.get("function_call")
        if call is not None:
            self._hold_function(call, f"{_prefix(choice, position)}function_call")
        for name in LIVE_FIELDS:
            value = holder.get(name)
            if value is not None:
                if not isinstance(value, str):
                    raise StreamViolation(f"`{name}` is not a string")
                if value:
                    live.append((name, value))

    def _hold_tool_calls(self, calls: Any, prefix: str) -> None:
        if calls is None:
            return
        if not isinstance(calls, list):
            raise StreamViolation("`tool_calls` is not a list")
        for position, call in enumerate(calls):
            if not isinstance(call, dict):
                raise StreamViolation("a tool call is not a JSON object")
            # streamed deltas say which call they continue; a whole message lists them
            index = call.get("index", position)
            if isinstance(index, bool) or not isinstance(index, int):
                raise StreamViolation("a tool call's `index` is not an integer")
            function = call.get("function")
            if function is not None:
                self._hold_function(function, f"{prefix}tool_calls[{index}].function")

    def _hold_function(self, function: Any, name: str) -> None:
        if not isinstance(function, dict):
            raise StreamViolation(f"`{name}` is not a JSON object")
        self._hold(f"{name}.name", function.get("name"))
        self._hold(f"{name}.arguments", function.get("arguments"))

    def _hold_logprobs(self, logprobs: Any, prefix: str) -> None:
        """The chosen tokens' strings. Engines disagree on the shape of `logprobs` (and we
        never ask for them), so a shape this does not know is skipped, not a violation."""
        if not isinstance(logprobs, dict):
            return
        for key in ("content", "refusal"):  # chat: lists of {"token": ...}
            entries = logprobs.get(key)
            if isinstance(entries, list):
                tokens = (e.get("token") for e in entries if isinstance(e, dict))
                text = "".join(t for t in tokens if isinstance(t, str))
                self._hold(f"{prefix}logprobs.{key}", text)
        strings = logprobs.get("tokens")  # completions: a list of strings
        if isinstance(strings, list):
            text = "".join(t for t in strings if isinstance(t, str))
            self._hold(f"{prefix}logprobs.tokens", text)


def _prefix(choice: dict[str, Any], position: int) -> str:
    """What a choice's structured field names start with: a second choice's structured text
    must not run on from the first's."""
    index = choice.get("index", position)
    return f"choices[{index}]." if index not in (0, None) else ""


def _text_of(value: Any, name: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise StreamViolation(f"`{name}` is not a string")
    return value


_scan_once: Callable[[str, int], tuple[Any, int]]
_scan_once = json.JSONDecoder().scan_once  # type: ignore[attr-defined]
"""The C scanner `json.loads` ends in, called directly: what `loads` returns for a document
with no whitespace around it (as every engine writes a `data:` line), without its two Python
layers and two whitespace matches, about 0.9 µs of its 2 µs per event. A document it does
not take whole (whitespace, extra data, an error) goes to `loads` for the verdict."""


def _parse_json(data: str) -> Any:
    """`bounded.loads(data)`, with its checks skipped where they cannot fire: a document with
    at most `MAX_JSON_DEPTH` brackets cannot nest deeper, and one without `\\u` has no
    surrogate escape (text decoded from UTF-8 holds no lone surrogate itself). Anything it
    refuses goes to `loads` for the verdict."""
    if "\\u" not in data and data.count("{") + data.count("[") <= MAX_JSON_DEPTH:
        try:
            value, end = _scan_once(data, 0)
        except (StopIteration, ValueError):
            pass
        else:
            if end == len(data):
                return value
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
    "FIELD_SEPARATOR",
    "LIVE_FIELDS",
    "MAX_TOKEN_COUNT",
    "MeteredStream",
    "ResponseTooLarge",
    "StreamViolation",
    "Transcript",
]

"""What the harness saw for one request: status, timestamps, streamed text, usage, error.

Timestamps are `time.perf_counter_ns()` readings from one process, so differences between
them are exact; `t_wall` anchors the observation to wall-clock time for reports. Client-side
queueing (waiting for a concurrency slot) is kept apart from TTFT.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from kvcanary.canaries.redact import scrub_secrets

ErrorKind = Literal[
    "http_status",  # a non-2xx status with an error body
    "timeout",
    "connect",
    "protocol",  # malformed SSE / JSON, wrong content type, usage out of range after a 2xx
    "error_in_success",  # a 2xx status carrying an error: {"object": "error"}, {"error": ...},
    # or an SSE `error` event (`harness.target.bounded.ErrorInSuccess`)
    "truncated",  # the stream ended without [DONE] / finish_reason
    "too_large",  # response exceeded the per-response byte bound; the rest was dropped
    "disconnected",  # the harness dropped the connection on purpose (abort plans)
    "cancelled",  # interrupted by the user (Ctrl-C)
    "worker_lost",  # the process sending it died (a Ray actor, `--ray`)
]


class TextSink(Protocol):
    """Receives a response's text as it arrives: a delta and the response field it is part
    of (`content`, `reasoning_content`, `tool_calls[0].function.arguments`, `logprobs.content`,
    ...; `harness.target.sse_stream`). A sink that is called with the text alone takes it as
    `content`."""

    def __call__(self, delta: str, field: str = "content", /) -> None: ...


@dataclass(frozen=True, slots=True)
class Usage:
    """`usage` as the target reported it; None where the target did not say."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Observation:
    """The outcome of one planned request, as seen from the client."""

    request_id: str
    tenant: str
    status: int | None
    t_wall: float
    t_scheduled_ns: int
    t_sent_ns: int
    t_first_byte_ns: int | None = None
    t_first_token_ns: int | None = None
    t_done_ns: int | None = None
    text: str = field(default="", repr=False)
    text_redacted: bool = False
    text_sha256: str = ""
    num_text_chars: int = 0
    num_chunks: int = 0
    usage: Usage = field(default_factory=Usage)
    finish_reason: str | None = None
    error_kind: ErrorKind | None = None
    error: str | None = None
    retry: str | None = None
    """Set when the first attempt failed on a reused keep-alive connection before any byte of
    the answer arrived: what it failed with. Everything above is the second attempt's, sent
    on a fresh connection (`harness.target.keepalive`)."""

    def without_secrets(self, secrets: Sequence[str]) -> Observation:
        """This observation with every secret scrubbed from the text and the error (a target
        may quote the Authorization header back in an error body)."""
        if not secrets:
            return self
        text = scrub_secrets(self.text, secrets)
        error = scrub_secrets(self.error, secrets) if self.error else self.error
        if text == self.text and error == self.error:
            return self
        return dataclasses.replace(self, text=text, error=error)

    @property
    def ok(self) -> bool:
        """A success status and no transport or protocol error."""
        return self.status is not None and 200 <= self.status < 300 and self.error_kind is None

    @property
    def ttft_ns(self) -> int | None:
        """Time from sending to the first content token (the TTFT the timing detector uses)."""
        if self.t_first_token_ns is None:
            return None
        return self.t_first_token_ns - self.t_sent_ns

    @property
    def queue_ns(self) -> int:
        """Client-side wait between the scheduled time and the actual send."""
        return self.t_sent_ns - self.t_scheduled_ns

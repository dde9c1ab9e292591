"""Response shapes for completions, chat and SGLang's native `/generate`, streamed and not.

A `ResponseFormat` turns engine events into `text_completion` / `chat.completion` bodies
and their streaming chunks, or `/generate`'s `{"text", "meta_info"}` (streamed as SGLang
does by default: every chunk carries the text so far, the last one the finish reason).
Usage always reports what the engine said in its `FinishOut` (`prompt_tokens`,
`completion_tokens`, `cached_tokens`), never a count the HTTP layer made itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from kvcanary.reference_engine.interfaces import FinishOut

Kind = Literal["completion", "chat", "generate"]


def usage(finish: FinishOut) -> dict[str, Any]:
    return {
        "prompt_tokens": finish.prompt_tokens,
        "completion_tokens": finish.completion_tokens,
        "total_tokens": finish.prompt_tokens + finish.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": finish.cached_tokens},
    }


@dataclass(slots=True)
class ResponseFormat:
    """Bodies and chunks for one request."""

    kind: Kind
    rid: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    _text_so_far: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{'chatcmpl' if self.kind == 'chat' else 'cmpl'}-{self.rid}"

    def _envelope(self, *, chunk: bool) -> dict[str, Any]:
        if self.kind == "chat":
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _choice(
        self, text: str | None, finish_reason: str | None, *, chunk: bool
    ) -> dict[str, Any]:
        if self.kind == "completion":
            return {
                "index": 0,
                "text": text or "",
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        if chunk:
            delta = {} if text is None else {"content": text}
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        message = {"role": "assistant", "content": text or ""}
        return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}

    def body(self, text: str, finish: FinishOut) -> dict[str, Any]:
        """The whole non-streaming response."""
        if self.kind == "generate":
            return {"text": text, "meta_info": self._meta_info(finish)}
        choice = self._choice(text, finish.reason, chunk=False)
        return {**self._envelope(chunk=False), "choices": [choice], "usage": usage(finish)}

    def first_chunk(self) -> dict[str, Any] | None:
        """Chat opens its stream with the assistant role; completions send nothing first."""
        if self.kind != "chat":
            return None  # completions and /generate send nothing first
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return {**self._envelope(chunk=True), "choices": [choice]}

    def token_chunk(self, text: str) -> dict[str, Any]:
        if self.kind == "generate":
            self._text_so_far.append(text)
            return {"text": "".join(self._text_so_far), "meta_info": self._meta_info(None)}
        return {**self._envelope(chunk=True), "choices": [self._choice(text, None, chunk=True)]}

    def finish_chunk(self, finish: FinishOut) -> dict[str, Any]:
        if self.kind == "generate":
            return {"text": "".join(self._text_so_far), "meta_info": self._meta_info(finish)}
        empty = "" if self.kind == "completion" else None
        choice = self._choice(empty, finish.reason, chunk=True)
        return {**self._envelope(chunk=True), "choices": [choice]}

    def usage_chunk(self, finish: FinishOut) -> dict[str, Any]:
        """`stream_options.include_usage`: a last chunk with no choices and the usage."""
        return {**self._envelope(chunk=True), "choices": [], "usage": usage(finish)}

    def _meta_info(self, finish: FinishOut | None) -> dict[str, Any]:
        """`/generate`'s meta_info: SGLang's field names; counts as the engine reported them."""
        if finish is None:
            num_tokens = len(self._text_so_far)
            return {"id": self.rid, "finish_reason": None, "completion_tokens": num_tokens}
        if finish.reason == "length":
            reason: dict[str, Any] = {"type": "length", "length": finish.completion_tokens}
        else:
            reason = {"type": finish.reason, "matched": None}
        return {
            "id": self.rid,
            "finish_reason": reason,
            "prompt_tokens": finish.prompt_tokens,
            "completion_tokens": finish.completion_tokens,
            "cached_tokens": finish.cached_tokens,
        }

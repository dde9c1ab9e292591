"""How a request ends: SGLang's FINISH_ABORT, its error messages, and the FinishOut a side sends.

What it knows: the message strings and status codes SGLang uses for each rejection (the
harness and its users match on them), and the OpenAI/SGLang error object shape. What it does
not know: when a request is rejected; the limits live in `limits.py`, the decisions in the
schedulers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvcanary.reference_engine.interfaces import FinishOut

BAD_REQUEST = "BadRequestError"
INTERNAL_ERROR = "InternalServerError"
CLIENT_CLOSED = 499
"""No SGLang equivalent is visible to a client (it has gone); nginx's 'client closed request'."""


@dataclass(frozen=True, slots=True)
class FinishAbort:
    """SGLang's FINISH_ABORT(message, status_code, err_type)."""

    message: str
    status: int
    err_type: str

    def error(self) -> dict[str, Any]:
        """The OpenAI/SGLang error object."""
        return {
            "object": "error",
            "message": self.message,
            "type": self.err_type,
            "param": None,
            "code": self.status,
        }

    def finish_out(self, prompt_tokens: int, completion_tokens: int = 0) -> FinishOut:
        return FinishOut(
            reason="abort",
            status=self.status,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            error=self.error(),
        )


def finished_length(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
) -> FinishOut:
    """FINISH_LENGTH: the request generated what it asked for (HTTP 200)."""
    return FinishOut(
        reason="length",
        status=200,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cached_tokens=cached_tokens,
    )


def bad_request(message: str) -> FinishAbort:
    return FinishAbort(message, 400, BAD_REQUEST)


def internal_error(message: str) -> FinishAbort:
    return FinishAbort(message, 500, INTERNAL_ERROR)


def input_longer_than_context(num_input: int, context_length: int) -> FinishAbort:
    """TokenizerManager: the input alone does not fit the context (immediate 400)."""
    return bad_request(
        f"The input ({num_input} tokens) is longer than the model's context length "
        f"({context_length} tokens)."
    )


def total_longer_than_context(num_input: int, max_new: int, context_length: int) -> FinishAbort:
    """TokenizerManager: input plus max_new_tokens does not fit the context (immediate 400)."""
    return bad_request(
        f"Requested token count exceeds the model's maximum context length of {context_length} "
        f"tokens. You requested a total of {num_input + max_new} tokens: {num_input} tokens "
        f"from the input messages and {max_new} tokens for the completion. Please reduce the "
        "number of tokens in the input messages or the completion to fit within the limit."
    )


def input_length_exceeds(num_input: int, max_req_input_len: int) -> FinishAbort:
    """Scheduler `validate_input_length`: the pool-limited input limit (the incident's path)."""
    return bad_request(
        f"Input length ({num_input} tokens) exceeds the maximum allowed length "
        f"({max_req_input_len} tokens). Use a shorter input or enable --allow-auto-truncate."
    )


def exceeds_kv_capacity(rid: str, num_tokens: int, max_total_num_tokens: int) -> FinishAbort:
    """PD queues' `_check_if_req_exceed_kv_capacity`."""
    return bad_request(
        f"Request {rid} exceeds the maximum number of tokens: {num_tokens} > {max_total_num_tokens}"
    )


def duplicate_rid(rid: str) -> FinishAbort:
    return bad_request(f"Duplicate request id {rid!r}: a request with this id is still running")


def transfer_failed(rid: str, room: int) -> FinishAbort:
    return internal_error(f"KV transfer failed for request rid={rid} bootstrap_room={room}")


def rejected_by_prefill(rid: str) -> FinishAbort:
    """Decode's answer when prefill retired the request at admission (`admission_retire`)."""
    return bad_request(
        f"Request {rid} was rejected at admission by the prefill server: "
        "the input exceeds its maximum allowed length"
    )


def bootstrap_timeout(rid: str, room: int) -> FinishAbort:
    return internal_error(f"Bootstrap timed out for request rid={rid} bootstrap_room={room}")


def room_mismatch() -> FinishAbort:
    return internal_error("Metadata corruption detected - bootstrap_room mismatch")


def coverage_mismatch(rid: str, num_written: int | None, num_reserved: int) -> FinishAbort:
    """A 400, not SGLang's 500: prefill wrote less than the prompt because the prompt does
    not fit it, which every retry repeats; a router must not retry it (sglang-router retries
    5xx)."""
    return bad_request(
        f"KV coverage mismatch for request {rid}: prefill wrote {num_written} tokens, "
        f"decode reserved {num_reserved}; the input exceeds what the prefill server can hold"
    )


def checksum_mismatch(rid: str) -> FinishAbort:
    return internal_error(f"KV transfer checksum mismatch for request {rid}")


def page_tag_mismatch(rid: str, page_id: int) -> FinishAbort:
    return internal_error(f"KV page {page_id} of request {rid} is owned by another writer")


def client_aborted(rid: str) -> FinishAbort:
    return FinishAbort(f"Request {rid} was aborted by the client", CLIENT_CLOSED, "AbortError")


def engine_stopped(rid: str) -> FinishAbort:
    return internal_error(f"Request {rid} was aborted: the engine is stopping")

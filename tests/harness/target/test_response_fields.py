"""Every text field a response carries reaches the detectors, under its own name.

A target that puts another tenant's canary only in a tool call's arguments, a refusal, a
legacy `function_call` or the logprobs' token strings (chat and completions, streamed and
not) must be found, and the finding must say which field the canary was in.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from kvcanary.canaries import CanaryIndex, CanaryMinter, Owner
from kvcanary.harness.detectors import ContentDetector
from kvcanary.harness.record.finding import Finding, FindingKind
from kvcanary.harness.target.client import TargetClient
from kvcanary.harness.target.sse_stream import FIELD_SEPARATOR, Transcript
from kvcanary.tenants.plan import ApiStyle, RequestPlan
from kvcanary.tenants.tenant import Tenant

READER = Tenant(name="tenant-1")


def make_plan(api: ApiStyle) -> RequestPlan:
    return RequestPlan(
        request_id="t1-r000001",
        tenant="tenant-1",
        phase="fill",
        intent="victim",
        size_label="fill",
        num_prompt_tokens=3,
        expected="accept",
        api=api,
        prompt="hello world",
        max_tokens=8,
    )


def victim_canary(index: CanaryIndex, minter: CanaryMinter) -> str:
    canary = minter.mint_many(0, 7, range(1))[0]
    index.add(canary, Owner("tenant-0", "t0-r000007"))
    return canary


def sse(*objects: Any) -> bytes:
    events = [b"data: " + json.dumps(obj).encode() + b"\n\n" for obj in objects]
    return b"".join(events) + b"data: [DONE]\n\n"


def words(text: str, size: int = 7) -> list[str]:
    """`text` cut into pieces (streamed deltas split a field anywhere)."""
    return [text[i : i + size] for i in range(0, len(text), size)]


def chat_delta(finish: str | None = None, **delta: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def tool_call_stream(canary: str) -> list[dict[str, Any]]:
    """Content interleaved with a streamed tool call whose arguments hold the canary."""
    arguments = json.dumps({"query": canary})
    head = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "search"}}
    objects = [chat_delta(content="Let me look ", tool_calls=[head])]
    for piece in words(arguments):
        objects.append(
            chat_delta(content="up. ", tool_calls=[{"index": 0, "function": {"arguments": piece}}])
        )
    return [*objects, chat_delta(finish="tool_calls")]


def refusal_stream(canary: str) -> list[dict[str, Any]]:
    return [
        *(chat_delta(refusal=piece) for piece in words(f"I can't repeat {canary} here.")),
        chat_delta(finish="stop"),
    ]


def chat_logprobs_stream(canary: str) -> list[dict[str, Any]]:
    """Content that says nothing, logprobs whose chosen tokens spell the canary."""
    objects = []
    for piece in words(canary, 3):
        entry = {"token": piece, "logprob": -0.1, "top_logprobs": [{"token": "x", "logprob": -3}]}
        objects.append(
            {
                "choices": [
                    {
                        "index": 0,
                        "delta": {"content": "."},
                        "logprobs": {"content": [entry]},
                        "finish_reason": None,
                    }
                ]
            }
        )
    return [*objects, chat_delta(finish="stop")]


def completion_logprobs_stream(canary: str) -> list[dict[str, Any]]:
    objects = [
        {
            "choices": [
                {
                    "index": 0,
                    "text": "-",
                    "logprobs": {"tokens": [piece], "top_logprobs": [{piece: -0.1}]},
                    "finish_reason": None,
                }
            ]
        }
        for piece in words(canary, 3)
    ]
    return [*objects, {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}]


def function_call_body(canary: str) -> dict[str, Any]:
    """A whole (non-streamed) chat answer: legacy function_call, no content."""
    call = {"name": "lookup", "arguments": json.dumps({"q": canary})}
    message = {"role": "assistant", "content": None, "function_call": call}
    return {"choices": [{"index": 0, "message": message, "finish_reason": "function_call"}]}


def tool_call_body(canary: str) -> dict[str, Any]:
    calls = [
        {"id": "a", "type": "function", "function": {"name": "noop", "arguments": "{}"}},
        {"id": "b", "type": "function", "function": {"name": "save", "arguments": canary}},
    ]
    message = {"role": "assistant", "content": "Done.", "tool_calls": calls}
    return {"choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}]}


def completion_logprobs_body(canary: str) -> dict[str, Any]:
    tokens = words(canary, 4)
    choice = {"index": 0, "text": "-", "logprobs": {"tokens": tokens}, "finish_reason": "length"}
    return {"choices": [choice]}


Leak = Callable[[str], Any]
CASES: list[tuple[ApiStyle, bool, Leak, str]] = [
    ("chat", True, tool_call_stream, "tool_calls[0].function.arguments"),
    ("chat", True, refusal_stream, "refusal"),
    ("chat", True, chat_logprobs_stream, "logprobs.content"),
    ("completions", True, completion_logprobs_stream, "logprobs.tokens"),
    ("chat", False, function_call_body, "function_call.arguments"),
    ("chat", False, tool_call_body, "tool_calls[1].function.arguments"),
    ("completions", False, completion_logprobs_body, "logprobs.tokens"),
]


class Body(httpx.AsyncByteStream):
    """A response body read from the network (the client meters real reads)."""

    def __init__(self, body: bytes) -> None:
        self.body = body

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for i in range(0, len(self.body), 64):
            yield self.body[i : i + 64]


def respond(streamed: bool, payload: Any) -> httpx.Response:
    if streamed:
        body, content_type = sse(*payload), "text/event-stream"
    else:
        body, content_type = json.dumps(payload).encode(), "application/json"
    return httpx.Response(200, headers={"content-type": content_type}, stream=Body(body))


@pytest.mark.parametrize(("api", "streamed", "leak", "field"), CASES)
async def test_a_canary_only_in_one_field_is_found_and_named(
    api: ApiStyle, streamed: bool, leak: Leak, field: str
) -> None:
    minter = CanaryMinter.from_seed(3, "run")
    index = CanaryIndex(minter)
    canary = victim_canary(index, minter)
    payload = leak(canary)
    client = TargetClient(
        httpx.AsyncClient(transport=httpx.MockTransport(lambda _: respond(streamed, payload))),
        "http://target:8000",
        model="m",
        stream=streamed,
    )
    plan = make_plan(api)
    scan = ContentDetector(index).start(plan)
    findings: list[Finding] = []
    fields_seen: list[str] = []

    def on_text(delta: str, name: str = "content") -> None:
        fields_seen.append(name)
        findings.extend(scan.feed(delta, name))

    observation = await client.send(
        plan, READER, t_scheduled_ns=time.perf_counter_ns(), on_text=on_text
    )
    findings += scan.finish(observation)
    assert observation.error_kind is None, observation.error
    assert field in fields_seen
    [finding] = findings
    assert finding.kind is FindingKind.CROSS_TENANT_CANARY
    assert finding.victim_request_id == "t0-r000007"
    assert finding.details["field"] == field
    assert f"in `{field}`" in finding.summary
    assert observation.t_first_token_ns is not None  # the answer started, in some field


def test_fields_are_separated_and_structured_ones_are_delivered_whole() -> None:
    delivered: list[tuple[str, str]] = []
    transcript = Transcript(on_text=lambda *delta: delivered.append(delta))
    for obj in tool_call_stream("alpha beta gamma"):
        transcript.take_event("", json.dumps(obj), 1)
    assert all(name == "content" for _, name in delivered)  # the call is held until the end
    transcript.flush()
    by_field: dict[str, str] = {}
    for text, name in delivered:
        by_field[name] = by_field.get(name, "") + text
    assert by_field == {
        "content": "Let me look " + "up. " * (len(delivered) - 3),
        "tool_calls[0].function.name": FIELD_SEPARATOR + "search",
        "tool_calls[0].function.arguments": FIELD_SEPARATOR + '{"query": "alpha beta gamma"}',
    }
    assert transcript.text == "".join(text for text, _ in delivered)
    # every event carried text in some field, the finishing one none
    assert transcript.num_chunks == len(tool_call_stream("alpha beta gamma")) - 1


def test_a_second_choice_keeps_its_structured_fields_apart() -> None:
    transcript = Transcript()
    calls = [{"index": 0, "function": {"arguments": "one"}}]
    obj = {
        "choices": [
            {"index": 0, "delta": {"tool_calls": calls}},
            {"index": 1, "delta": {"tool_calls": calls}},
        ]
    }
    transcript.take_event("", json.dumps(obj), 1)
    transcript.flush()
    assert transcript.text == "one\none"


@pytest.mark.parametrize(
    "delta",
    [
        {"tool_calls": {"index": 0}},
        {"tool_calls": ["call"]},
        {"tool_calls": [{"index": "0", "function": {"arguments": "x"}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": 5}}]},
        {"function_call": "lookup"},
        {"refusal": ["no"]},
    ],
)
def test_malformed_structured_fields_are_violations(delta: dict[str, Any]) -> None:
    from kvcanary.harness.target.sse_stream import StreamViolation

    with pytest.raises(StreamViolation):
        Transcript().take_event("", json.dumps(chat_delta(**delta)), 1)


def test_logprobs_in_shapes_it_does_not_know_are_skipped() -> None:
    transcript = Transcript()
    choice = {"index": 0, "text": "ok", "logprobs": {"content": "odd", "tokens": 3}}
    transcript.take_event("", json.dumps({"choices": [choice]}), 1)
    transcript.flush()
    assert transcript.text == "ok"

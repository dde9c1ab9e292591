"""A side's OpenAI-compatible and SGLang-native routes: completions, chat, `/generate`,
tokenize/detokenize, models and model info.

Both the prefill and the decode server expose these routes; the router sends each
generation request to both. A side tokenizes the prompt, builds a `GenerateRequest` and
hands it to its side. Every limit (context length, pool limits, the placeholder swap,
transfers) is the engine core's; this module only turns the side's events into HTTP: a
`FinishOut` with an error status before any token is a JSON error with that status; one
after a stream started is an SSE `{"error": ...}` event and `data: [DONE]`. A stream starts
at decode's `HeadOut` when it sends one (before the first token, so a client can drop a
request whose KV is still in transfer), else at the first token. A client that
disconnects before its answer is complete aborts the request in the side
(`Generation.abort`).

`tenant_key` is derived from the Authorization bearer token by hashing it; the token itself
is never kept.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from kvcanary.reference_engine.finish import CLIENT_CLOSED
from kvcanary.reference_engine.interfaces import (
    AnySide,
    FinishOut,
    GenerateRequest,
    HeadOut,
    TokenOut,
)
from kvcanary.reference_engine.server.errors import error_body, error_response
from kvcanary.reference_engine.server.generation import (
    ClientGone,
    DisconnectWatcher,
    Generation,
    Role,
)
from kvcanary.reference_engine.server.metrics import SideMetrics
from kvcanary.reference_engine.server.responses import Kind, ResponseFormat
from kvcanary.reference_engine.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequestBody,
    TokenizeRequest,
    render_chat,
)
from kvcanary.reference_engine.server.sse import SSE_DONE, DisconnectAwareStream, sse_event
from kvcanary.reference_engine.tokenizer import Tokenizer


class ServedConfig(Protocol):
    """The engine settings the HTTP layer reads."""

    @property
    def context_length(self) -> int: ...

    @property
    def page_size(self) -> int: ...


@dataclass(slots=True)
class SideContext:
    """Everything one side app's handlers share."""

    side: AnySide
    role: Role
    config: ServedConfig
    tokenizer: Tokenizer
    metrics: SideMetrics
    model_name: str
    on_request: Callable[[GenerateRequest], None] | None = None
    """Called before a request reaches the side (the TCP transfer learns its room's route)."""
    running: set[Generation] = field(default_factory=set)


def tenant_key(request: Request) -> str | None:
    """A stable, non-reversible identity for the request's bearer credential."""
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return hashlib.sha256(b"kvcanary-tenant-key\0" + token.strip().encode()).hexdigest()[:32]


def _generate_request(
    ctx: SideContext,
    request: Request,
    body: CompletionRequest | ChatCompletionRequest | GenerateRequestBody,
    input_ids: list[int],
) -> GenerateRequest | str:
    if not input_ids:
        return "The prompt is empty."
    if body.bootstrap_room is None:
        return (
            f"This is the {ctx.role} server of a disaggregated engine: the request has no "
            "bootstrap_room. Send requests through the router."
        )
    return GenerateRequest(
        rid=body.rid or uuid.uuid4().hex,
        input_ids=tuple(input_ids),
        max_new_tokens=body.max_new_tokens,
        bootstrap_room=body.bootstrap_room,
        bootstrap_host=body.bootstrap_host or "127.0.0.1",
        bootstrap_port=body.bootstrap_port or 0,
        cache_salt=body.cache_salt,
        tenant_key=tenant_key(request),
    )


async def _serve(
    ctx: SideContext,
    request: Request,
    body: CompletionRequest | ChatCompletionRequest | GenerateRequestBody,
    input_ids: list[int],
    kind: Kind,
) -> Response:
    req = _generate_request(ctx, request, body, input_ids)
    if isinstance(req, str):
        return error_response(error_body(req, 400))
    if ctx.on_request is not None:
        ctx.on_request(req)
    started = time.perf_counter()
    fmt = ResponseFormat(kind, req.rid, body.model or ctx.model_name)
    gen = Generation(ctx.side, ctx.role, req)
    ctx.running.add(gen)
    watcher = DisconnectWatcher(request.receive)
    handed_to_stream = False
    try:
        first = await watcher.race(gen.next_event())
        if isinstance(first, HeadOut) and not body.stream:
            first = await watcher.race(gen.next_event())  # a whole body has no early head
        if isinstance(first, FinishOut) and first.status >= 400:
            _finish(ctx, first, started)
            return error_response(first.error or error_body("request failed", first.status))
        if not isinstance(first, HeadOut):
            ctx.metrics.ttft.observe(time.perf_counter() - started)
        if not body.stream:
            return await _collect(ctx, gen, watcher, first, fmt, started)
        await watcher.stop()
        chunks = _stream(ctx, gen, first, fmt, body.include_usage, started)
        handed_to_stream = True
        return DisconnectAwareStream(chunks, on_incomplete=_aborter(ctx, gen))
    except ClientGone:
        await _aborter(ctx, gen)()
        return Response(status_code=CLIENT_CLOSED)
    except asyncio.CancelledError:  # the server is cancelling this handler: still abort
        await asyncio.shield(_aborter(ctx, gen)())
        raise
    except Exception as exc:  # a side that raises is an engine bug: answer 500, abort
        await _aborter(ctx, gen)()
        return error_response(error_body(f"engine error: {exc!r}", 500))
    finally:
        await watcher.stop()
        if not handed_to_stream:
            ctx.running.discard(gen)
            await gen.close()


def _aborter(ctx: SideContext, gen: Generation) -> Callable[[], Any]:
    async def abort() -> None:
        if not gen.finished:
            ctx.metrics.aborted.inc()
        ctx.running.discard(gen)
        await gen.abort()

    return abort


def _finish(ctx: SideContext, finish: FinishOut, started: float) -> None:
    ctx.metrics.observe_finish(finish, time.perf_counter() - started)


async def _collect(
    ctx: SideContext,
    gen: Generation,
    watcher: DisconnectWatcher,
    event: Any,
    fmt: ResponseFormat,
    started: float,
) -> Response:
    texts: list[str] = []
    while not isinstance(event, FinishOut):
        texts.append(event.text)
        event = await watcher.race(gen.next_event())
    _finish(ctx, event, started)
    if event.status >= 400:
        return error_response(event.error or error_body("request failed", event.status))
    return JSONResponse(fmt.body("".join(texts), event))


async def _stream(
    ctx: SideContext,
    gen: Generation,
    event: Any,
    fmt: ResponseFormat,
    include_usage: bool,
    started: float,
) -> AsyncIterator[bytes]:
    first_token = isinstance(event, HeadOut)  # TTFT not yet observed: at the first token
    try:
        opening = fmt.first_chunk()
        if opening is not None:
            yield sse_event(opening)
        while not isinstance(event, FinishOut):
            if isinstance(event, TokenOut):  # not the HeadOut a stream may open with
                if first_token:
                    ctx.metrics.ttft.observe(time.perf_counter() - started)
                first_token = False
                yield sse_event(fmt.token_chunk(event.text))
            try:
                event = await gen.next_event()
            except Exception as exc:  # after a 200 the error travels in the stream
                yield sse_event({"error": error_body(f"engine error: {exc!r}", 500)})
                yield SSE_DONE
                return
        _finish(ctx, event, started)
        if event.status >= 400:
            yield sse_event({"error": event.error or error_body("request failed", event.status)})
        else:
            yield sse_event(fmt.finish_chunk(event))
            if include_usage:
                yield sse_event(fmt.usage_chunk(event))
        yield SSE_DONE
    finally:
        if gen.finished:
            ctx.running.discard(gen)
            await gen.close()


def _prompt_ids(tokenizer: Tokenizer, prompt: str | list[int]) -> list[int]:
    return tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)


def openai_routes(ctx: SideContext) -> APIRouter:
    """The side's OpenAI-compatible and SGLang tokenizer routes."""
    routes = APIRouter()

    @routes.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        input_ids = _prompt_ids(ctx.tokenizer, body.prompt)
        return await _serve(ctx, request, body, input_ids, "completion")

    @routes.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        input_ids = ctx.tokenizer.encode(render_chat(body.messages))
        return await _serve(ctx, request, body, input_ids, "chat")

    @routes.post("/generate")
    async def generate(body: GenerateRequestBody, request: Request) -> Response:
        prompt = body.input_ids if body.input_ids is not None else body.text or ""
        return await _serve(ctx, request, body, _prompt_ids(ctx.tokenizer, prompt), "generate")

    _add_model_routes(routes, ctx)
    _add_tokenizer_routes(routes, ctx)
    return routes


def _add_model_routes(routes: APIRouter, ctx: SideContext) -> None:
    """What the side says about its model: SGLang's model info and OpenAI's model list."""

    @routes.get("/get_model_info")
    @routes.get("/model_info")
    async def model_info() -> dict[str, Any]:
        return {
            "model_path": ctx.model_name,
            "tokenizer_path": ctx.model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "kvcanary-reference",
            "architectures": ["KvcanaryReferenceForCausalLM"],
            "max_model_len": ctx.config.context_length,
        }

    @routes.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": ctx.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "kvcanary",
            "root": ctx.model_name,
            "max_model_len": ctx.config.context_length,
        }
        return {"object": "list", "data": [card]}


def _add_tokenizer_routes(routes: APIRouter, ctx: SideContext) -> None:
    """SGLang's and vLLM's tokenize and detokenize routes, with the side's tokenizer."""

    @routes.post("/v1/tokenize")
    @routes.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        max_model_len = ctx.config.context_length
        if isinstance(body.prompt, str):
            tokens = ctx.tokenizer.encode(body.prompt)
            return {"tokens": tokens, "count": len(tokens), "max_model_len": max_model_len}
        batch = [ctx.tokenizer.encode(p) for p in body.prompt]
        return {"tokens": batch, "count": [len(t) for t in batch], "max_model_len": max_model_len}

    @routes.post("/v1/detokenize")
    @routes.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        batch = [t for t in body.tokens if isinstance(t, list)]
        if batch:
            return {"text": [ctx.tokenizer.decode(t) for t in batch]}
        return {"text": ctx.tokenizer.decode([t for t in body.tokens if isinstance(t, int)])}

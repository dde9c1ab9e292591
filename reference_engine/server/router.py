"""The router, with SGLang mini_lb semantics: the client gets decode's status and body.

For each generation request the router picks a prefill and a decode server, adds
`bootstrap_host`, `bootstrap_port` (the prefill's bootstrap address) and `bootstrap_room`
(random 63-bit) to the JSON body, and POSTs the same body to both at once. It answers with
decode's status and body, streaming included, untouched, as SGLang's mini_lb and the Rust
sglang-router do. That is how the incident's HTTP 200 reached clients, with a correct
`usage.prompt_tokens` (decode's count): prefill's view of a rejected prompt (its 400, or the
vulnerable engine's `prompt_tokens=1`) never reaches them. Prefill's exchange finishes in
the background (`/kvcanary/state` counts it).

`merge_prefill_usage=True` models a different gateway, one that replaces decode's
`usage.prompt_tokens` with prefill's (`usage_merge`); it is off unless the engine config
asks for it, and then a client is held for prefill's answer only as long as that field
needs it.

If the client disconnects, both upstream exchanges are closed, so both sides see the
disconnect and abort the request. The sides are reached through `httpx.AsyncClient`s: over
HTTP for separate processes, through `StreamingASGITransport` in one process.

Other routes: `/v1/models`, `/get_model_info`, `/model_info` and the tokenizer routes go to
the first prefill server (as in mini_lb); `/generate` is routed like the OpenAI routes;
`/get_server_info` returns `{"internal_states": [...decode...], "prefill": [infos],
"decode": [infos]}`; `/metrics` merges every server's families; `/health` is 200 when every
server is.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from kvcanary.reference_engine.finish import CLIENT_CLOSED
from kvcanary.reference_engine.server.errors import error_body, error_response
from kvcanary.reference_engine.server.generation import ClientGone, DisconnectWatcher
from kvcanary.reference_engine.server.metrics import CONTENT_TYPE, RouterMetrics
from kvcanary.reference_engine.server.sse import DisconnectAwareStream
from kvcanary.reference_engine.server.usage_merge import (
    PromptTokens,
    UsageRewriter,
    merge_json,
    prefill_prompt_tokens,
)

_FORWARDED_HEADERS = ("authorization",)
_PREFILL_WAIT_S = 10.0


@dataclass(frozen=True, slots=True)
class SideEndpoint:
    """A prefill or decode server as the router reaches it."""

    url: str
    client: httpx.AsyncClient
    bootstrap_host: str = "127.0.0.1"
    bootstrap_port: int = 0
    """The prefill's KV bootstrap port (0: an in-process transfer needs no address)."""


def side_client(
    base_url: str, transport: httpx.AsyncBaseTransport | None = None
) -> httpx.AsyncClient:
    """A client for one side: no read timeout (a long prefill is not an error)."""
    return httpx.AsyncClient(
        base_url=base_url,
        transport=transport,
        timeout=httpx.Timeout(connect=10.0, read=None, write=None, pool=None),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
    )


def new_bootstrap_room() -> int:
    return random.randint(0, 2**63 - 1)


class MiniLoadBalancer:
    """mini_lb: a random (prefill, decode) pair per request."""

    def __init__(
        self,
        prefills: Sequence[SideEndpoint],
        decodes: Sequence[SideEndpoint],
        *,
        merge_prefill_usage: bool = False,
    ) -> None:
        assert prefills, "the router needs a prefill server"
        assert decodes, "the router needs a decode server"
        self.merge_prefill_usage = merge_prefill_usage
        self.prefills = list(prefills)
        self.decodes = list(decodes)
        self.metrics = RouterMetrics()
        self.pending: set[asyncio.Task[Any]] = set()
        """Prefill exchanges still running after their client was answered."""

    def select_pair(self) -> tuple[SideEndpoint, SideEndpoint]:
        return random.choice(self.prefills), random.choice(self.decodes)

    async def aclose(self) -> None:
        for task in list(self.pending):
            task.cancel()
        await asyncio.gather(*self.pending, return_exceptions=True)
        for endpoint in (*self.prefills, *self.decodes):
            await endpoint.client.aclose()

    def _track(self, task: asyncio.Task[Any]) -> None:
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def generate(self, request: Request, path: str) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError:
            return error_response(error_body("The request body is not valid JSON.", 400))
        if not isinstance(body, dict):
            return error_response(error_body("The request body must be a JSON object.", 400))
        prefill, decode = self.select_pair()
        body.update(
            bootstrap_host=prefill.bootstrap_host,
            bootstrap_port=prefill.bootstrap_port,
            bootstrap_room=new_bootstrap_room(),
        )
        headers = {k: v for k, v in request.headers.items() if k in _FORWARDED_HEADERS}
        started = time.perf_counter()
        prefill_exchange = asyncio.create_task(_post_and_read(prefill.client, path, body, headers))
        watcher = DisconnectWatcher(request.receive)
        decode_request = decode.client.build_request("POST", path, json=body, headers=headers)
        try:
            upstream = await watcher.race(decode.client.send(decode_request, stream=True))
        except ClientGone:
            await _cancel(prefill_exchange)
            return Response(status_code=CLIENT_CLOSED)
        except httpx.HTTPError as exc:
            await watcher.stop()
            await _cancel(prefill_exchange)
            return error_response(error_body(f"decode server unreachable: {exc!r}", 502), 502)
        self.metrics.requests.labels(code=str(upstream.status_code)).inc()
        media_type = upstream.headers.get("content-type", "application/json")
        if not media_type.startswith("text/event-stream"):
            try:
                content = await watcher.race(upstream.aread())
            except ClientGone:
                await upstream.aclose()
                await _cancel(prefill_exchange)
                return Response(status_code=CLIENT_CLOSED)
            finally:
                await watcher.stop()
            self._track(prefill_exchange)
            if upstream.status_code == 200 and self.merge_prefill_usage:
                content = await merge_json(content, _prompt_tokens_of(prefill_exchange))
            return Response(content, status_code=upstream.status_code, media_type=media_type)
        await watcher.stop()

        async def on_incomplete() -> None:
            await upstream.aclose()
            await _cancel(prefill_exchange)

        self._track(prefill_exchange)
        rewriter = None
        if upstream.status_code == 200 and self.merge_prefill_usage:
            rewriter = UsageRewriter(_prompt_tokens_of(prefill_exchange))
        return DisconnectAwareStream(
            self._relay(upstream, started, rewriter),
            status_code=upstream.status_code,
            media_type=media_type,
            on_incomplete=on_incomplete,
        )

    async def _relay(
        self, upstream: httpx.Response, started: float, rewriter: UsageRewriter | None
    ) -> AsyncIterator[bytes]:
        first = True
        try:
            async for chunk in upstream.aiter_raw():
                if first:
                    self.metrics.ttft.observe(time.perf_counter() - started)
                    first = False
                out = chunk if rewriter is None else await rewriter.feed(chunk)
                if out:
                    yield out
            if rewriter is not None and (rest := rewriter.flush()):
                yield rest
        finally:
            await upstream.aclose()

    async def side_json(self, endpoint: SideEndpoint, path: str) -> Any:
        response = await endpoint.client.get(path)
        response.raise_for_status()
        return response.json()

    async def server_info(self) -> dict[str, Any]:
        prefill_infos = [await self.side_json(p, "/get_server_info") for p in self.prefills]
        decode_infos = [await self.side_json(d, "/get_server_info") for d in self.decodes]
        states = [s for info in decode_infos for s in info.get("internal_states", [])]
        return {"internal_states": states, "prefill": prefill_infos, "decode": decode_infos}

    async def state(self) -> dict[str, Any]:
        return {
            "prefill": [await self.side_json(p, "/kvcanary/state") for p in self.prefills],
            "decode": [await self.side_json(d, "/kvcanary/state") for d in self.decodes],
            "num_pending_prefill_exchanges": len(self.pending),
        }

    async def metrics_text(self) -> bytes:
        texts = []
        for endpoint in (*self.prefills, *self.decodes):
            response = await endpoint.client.get("/metrics")
            response.raise_for_status()
            texts.append(response.text)
        return self.metrics.render(texts)

    async def healthy(self) -> bool:
        for endpoint in (*self.prefills, *self.decodes):
            try:
                response = await endpoint.client.get("/health")
            except httpx.HTTPError:
                return False
            if response.status_code != 200:
                return False
        return True

    async def proxy_to_prefill(self, request: Request, path: str) -> Response:
        """mini_lb sends model and tokenizer queries to the first prefill server."""
        upstream = await self.prefills[0].client.request(
            request.method, path, content=await request.body(),
            headers={"content-type": request.headers.get("content-type", "application/json")},
        )  # fmt: skip
        media_type = upstream.headers.get("content-type", "application/json")
        return Response(upstream.content, status_code=upstream.status_code, media_type=media_type)


async def _post_and_read(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[int, bytes]:
    """Prefill's status and whole body."""
    async with client.stream("POST", path, json=body, headers=headers) as response:
        return response.status_code, await response.aread()


def _prompt_tokens_of(exchange: asyncio.Task[tuple[int, bytes]]) -> PromptTokens:
    """Prefill's prompt count, once its answer is in (bounded: never hold decode's forever)."""

    async def prompt_tokens() -> int | None:
        try:
            status, content = await asyncio.wait_for(asyncio.shield(exchange), _PREFILL_WAIT_S)
        except (TimeoutError, asyncio.CancelledError, httpx.HTTPError):
            return None
        return prefill_prompt_tokens(status, content)

    return prompt_tokens


async def _cancel(task: asyncio.Task[Any]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
        await task


Lifespan = Callable[[], AbstractAsyncContextManager[Any]]


def build_router_app(balancer: MiniLoadBalancer, *, lifespans: Sequence[Lifespan] = ()) -> FastAPI:
    """The router app; `lifespans` run around it (the side apps, in one process)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            for enter in lifespans:
                await stack.enter_async_context(enter())
            try:
                yield
            finally:
                await balancer.aclose()

    app = FastAPI(title="kvcanary reference engine (router)", lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await balancer.generate(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await balancer.generate(request, "/v1/chat/completions")

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await balancer.generate(request, "/generate")

    for path in ("/v1/tokenize", "/tokenize", "/v1/detokenize", "/detokenize"):
        app.add_api_route(path, _prefill_proxy(balancer, path), methods=["POST"])
    for path in ("/v1/models", "/get_model_info", "/model_info"):
        app.add_api_route(path, _prefill_proxy(balancer, path), methods=["GET"])

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        return await balancer.server_info()

    @app.get("/kvcanary/state")
    async def state() -> dict[str, Any]:
        return await balancer.state()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await balancer.metrics_text(), media_type=CONTENT_TYPE)

    @app.get("/health")
    async def health() -> Response:
        if await balancer.healthy():
            return Response(status_code=200)
        return JSONResponse(error_body("a server is unhealthy", 503), status_code=503)

    return app


def _prefill_proxy(balancer: MiniLoadBalancer, path: str) -> Callable[[Request], Any]:
    async def proxy(request: Request) -> Response:
        return await balancer.proxy_to_prefill(request, path)

    return proxy

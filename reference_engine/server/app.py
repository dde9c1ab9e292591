"""The FastAPI apps: one per side, and the whole engine in one process (`build_app`).

A side app serves one `PrefillSide` or `DecodeSide`: the OpenAI routes (`openai_api`),
`/get_server_info` and `/server_info` (SGLang's flattened server info: server args,
`max_total_num_tokens`, `max_req_input_len`, `internal_states`), `/metrics` (its own
registry), `/health` (503 with the reason once the side's scheduler loop has died), and
`/kvcanary/state`, a debug endpoint with the side's allocated
pages and running requests (what drain checks read). Its lifespan starts and stops the
side's scheduler loop.

`build_app(config)` assembles the in-process engine: prefill and decode built by the core
around one `InProcessTransfer`, each behind its own side app, and a mini_lb router that
reaches them through `StreamingASGITransport`, so both sides really receive every request
over (in-memory) HTTP. Separate processes use the same side and router apps (`worker`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.responses import Response

from kvcanary.reference_engine.interfaces import AnySide, GenerateRequest, TransferBackend
from kvcanary.reference_engine.server.asgi_transport import StreamingASGITransport
from kvcanary.reference_engine.server.errors import error_body, install_error_handlers
from kvcanary.reference_engine.server.generation import Role
from kvcanary.reference_engine.server.metrics import CONTENT_TYPE, SideMetrics
from kvcanary.reference_engine.server.openai_api import ServedConfig, SideContext, openai_routes
from kvcanary.reference_engine.server.router import (
    MiniLoadBalancer,
    SideEndpoint,
    build_router_app,
    side_client,
)
from kvcanary.reference_engine.tokenizer import Tokenizer, load_tokenizer

MODEL_NAME = "kvcanary-reference"
"""The model id the engine serves (`/v1/models`); requests may name any model."""


def server_info(ctx: SideContext) -> dict[str, Any]:
    """SGLang's `/get_server_info` for one side: the HTTP layer's fields, then the core's."""
    args: dict[str, Any] = {}
    if dataclasses.is_dataclass(ctx.config):
        for f in dataclasses.fields(ctx.config):
            value = getattr(ctx.config, f.name)
            args[f.name] = sorted(value) if isinstance(value, frozenset) else value
    info: dict[str, Any] = {
        **args,
        "model_path": ctx.model_name,
        "served_model_name": ctx.model_name,
        "context_length": ctx.config.context_length,
        "page_size": ctx.config.page_size,
        "disaggregation_mode": ctx.role,
        **ctx.side.server_info(),
    }
    info.setdefault("internal_states", [{"num_allocated_pages": ctx.side.num_allocated_pages()}])
    info["version"] = f"kvcanary-reference-{_version()}"
    return info


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("kvcanary")
    except Exception:  # running from a tree that is not installed
        return "0"


def side_health_problem(ctx: SideContext) -> str | None:
    """Why the side cannot serve (its scheduler loop died), or None."""
    check = getattr(ctx.side, "health_problem", None)
    problem = check() if callable(check) else None
    return str(problem) if problem is not None else None


def side_state(ctx: SideContext) -> dict[str, Any]:
    """`/kvcanary/state`: what a drain check needs to see that nothing is left behind."""
    return {
        "disaggregation_mode": ctx.role,
        "num_allocated_pages": ctx.side.num_allocated_pages(),
        "num_running_requests": len(ctx.running),
    }


def build_side_app(
    side: AnySide,
    role: Role,
    config: ServedConfig,
    *,
    tokenizer: Tokenizer | None = None,
    model_name: str = MODEL_NAME,
    on_request: Callable[[GenerateRequest], None] | None = None,
) -> FastAPI:
    """One side's app; its lifespan runs the side's scheduler loop."""
    ctx = SideContext(
        side=side,
        role=role,
        config=config,
        tokenizer=tokenizer or load_tokenizer(getattr(config, "tokenizer", "cl100k_base")),
        metrics=SideMetrics(role, model_name, side.metrics_snapshot),
        model_name=model_name,
        on_request=on_request,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await side.start()
        try:
            yield
        finally:
            await side.stop()

    app = FastAPI(title=f"kvcanary reference engine ({role})", lifespan=lifespan)
    app.state.side_context = ctx
    install_error_handlers(app)
    app.include_router(openai_routes(ctx))

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def get_server_info() -> dict[str, Any]:
        return server_info(ctx)

    @app.get("/kvcanary/state")
    async def state() -> dict[str, Any]:
        return side_state(ctx)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/health")
    async def health() -> Response:
        problem = side_health_problem(ctx)
        if problem is not None:
            return JSONResponse(error_body(problem, 503), status_code=503)
        return Response(status_code=200)

    return app


def lifespan_of(app: FastAPI) -> Callable[[], contextlib.AbstractAsyncContextManager[Any]]:
    """A callable entering `app`'s lifespan (for apps served without their own server)."""
    return lambda: app.router.lifespan_context(app)


def build_app(config: Any, *, transfer: TransferBackend | None = None) -> FastAPI:
    """The whole engine in this process: router + prefill app + decode app.

    The returned app's lifespan starts both sides; serve it with uvicorn, or enter
    `app.router.lifespan_context(app)` and use `StreamingASGITransport(app)` in tests.
    """
    from kvcanary.reference_engine.engine import build_decode, build_prefill
    from kvcanary.reference_engine.transfer import InProcessTransfer

    if transfer is None:
        bandwidth = getattr(config, "transfer_bandwidth_bytes_per_s", None)
        transfer = InProcessTransfer(bandwidth_bytes_per_s=bandwidth)
    prefill_app = build_side_app(build_prefill(config, transfer), "prefill", config)
    decode_app = build_side_app(build_decode(config, transfer), "decode", config)
    merge = bool(getattr(config, "merge_prefill_usage", False))
    return build_in_process_router(prefill_app, decode_app, transfer, merge_prefill_usage=merge)


def build_in_process_router(
    prefill_app: FastAPI,
    decode_app: FastAPI,
    transfer: TransferBackend | None = None,
    *,
    merge_prefill_usage: bool = False,
) -> FastAPI:
    """A router reaching two side apps in this process; their lifespans run inside its own."""
    prefill = SideEndpoint(
        "http://prefill.local",
        side_client("http://prefill.local", StreamingASGITransport(prefill_app)),
    )
    decode = SideEndpoint(
        "http://decode.local",
        side_client("http://decode.local", StreamingASGITransport(decode_app)),
    )

    @contextlib.asynccontextmanager
    async def closing_transfer() -> AsyncIterator[None]:
        try:
            yield
        finally:
            if transfer is not None:
                await transfer.close()

    balancer = MiniLoadBalancer([prefill], [decode], merge_prefill_usage=merge_prefill_usage)
    lifespans = (closing_transfer, lifespan_of(prefill_app), lifespan_of(decode_app))
    app = build_router_app(balancer, lifespans=lifespans)
    app.state.balancer = balancer
    return app

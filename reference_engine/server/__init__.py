"""The reference engine's HTTP layer: per-side OpenAI-compatible apps, a mini_lb router,
a TCP KV-transfer backend, launchers and the `kvcanary serve` command.

Modules, one concept each:

    schemas        request bodies (pydantic) and the documented chat template
    responses      OpenAI response bodies and stream chunks
    errors         OpenAI/SGLang error bodies
    generation     one request's bridge to a side: events, disconnect -> abort
    sse            server-sent events framing and a disconnect-aware streaming response
    openai_api     the side's OpenAI and SGLang routes (completions, chat, /generate,
                   tokenize, models, model info)
    metrics        per-app Prometheus registries with SGLang metric names
    app            per-side FastAPI apps and the all-in-one-process app (`build_app`)
    router         mini_lb: both sides get the request; the client gets decode's answer
    usage_merge    the opt-in gateway edit: prefill's usage.prompt_tokens in decode's body
    asgi_transport an httpx transport that streams to an in-process ASGI app
    tcp_frames     the TCP transfer's wire format: frames, codec, connections
    tcp_transfer   a TransferBackend over asyncio TCP streams (separate processes)
    worker         the entry point of one separate process (prefill, decode or router)
    launch         `running_engine`: start on a free loopback port, stop cleanly
    command        `kvcanary serve`

Importing this package is cheap: nothing here imports fastapi, uvicorn or torch at
package level; `command` stays light so `kvcanary --help` is instant.
"""

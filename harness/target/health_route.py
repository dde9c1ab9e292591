"""The target's own health route (`GET /health`), polled while a run goes.

SGLang, vLLM, llama.cpp's server, transformers serve and the bundled engine answer
`GET /health` with 200 while they can serve and 5xx when they cannot (SGLang and the bundled
engine: 503 once a scheduler loop died). A target whose worker died between two requests is
seen there before the next request fails, and a target that fails only some requests says
so there too.

The route is used only if it answered 2xx when the run started: a target without one (404,
a gateway that does not pass it through) is never polled, and its health is judged from the
requests alone (`harness.run.health`). Only the status is read, never the body, so nothing
the target writes there reaches the journal.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping

import httpx

HEALTH_PATH = "/health"
HEALTH_TIMEOUT_S = 5.0
"""One poll's whole exchange: a health route slower than this counts as failing."""

HealthProbe = Callable[[], Awaitable[str | None]]
"""One poll: None when the route answered 2xx, else what went wrong in a few words."""


async def health_probe(
    client: httpx.AsyncClient, base_url: str, headers: Mapping[str, str]
) -> HealthProbe | None:
    """A poll of `base_url`'s health route, or None when the route does not answer 2xx now
    (then it is not polled at all)."""
    url = base_url.rstrip("/") + HEALTH_PATH

    async def poll() -> str | None:
        try:
            async with asyncio.timeout(HEALTH_TIMEOUT_S):
                request = client.build_request("GET", url, headers=dict(headers))
                response = await client.send(request, stream=True)
                await response.aclose()  # the status is all that is read
        except TimeoutError:
            return f"GET {HEALTH_PATH}: no answer within {HEALTH_TIMEOUT_S:g} s"
        except httpx.HTTPError as exc:
            return f"GET {HEALTH_PATH}: {type(exc).__name__}"
        if 200 <= response.status_code < 300:
            return None
        return f"GET {HEALTH_PATH}: HTTP {response.status_code}"

    return poll if await poll() is None else None


__all__ = ["HEALTH_PATH", "HEALTH_TIMEOUT_S", "HealthProbe", "health_probe"]

"""The target's own health route (`GET /health`), polled while a run goes.

SGLang, vLLM, llama.cpp's server, transformers serve and the bundled engine answer
`GET /health` with 200 while they can serve and 5xx when they cannot (SGLang and the bundled
engine: 503 once a scheduler loop died). A target whose worker died between two requests is
seen there before the next request fails, and a target that fails only some requests says
so there too.

The route is used only if it answered 2xx when the run started: a target without one (404,
a gateway that does not pass it through) is never polled. What it says is a witness, never
the judge (`harness.run.health`): whether the target serves is decided from its requests,
because a route can be slow while they complete (llama.cpp answers it only between the
batches its slots compute). Only the status is read, never the body, so nothing the target
writes there reaches the journal.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping

import httpx

from kvcanary.harness.target.transport_errors import describe_transport_error

HEALTH_PATH = "/health"
HEALTH_TIMEOUT_S = 10.0
"""One poll's whole exchange by default (`--health-timeout`): a route slower than this
counts as failing that poll."""

HealthProbe = Callable[[], Awaitable[str | None]]
"""One poll: None when the route answered 2xx, else what went wrong in a few words."""


async def health_probe(
    client: httpx.AsyncClient,
    base_url: str,
    headers: Mapping[str, str],
    *,
    timeout_s: float = HEALTH_TIMEOUT_S,
) -> HealthProbe | None:
    """A poll of `base_url`'s health route, each bounded by `timeout_s`, or None when the
    route does not answer 2xx now (then it is not polled at all)."""
    assert timeout_s > 0, timeout_s
    url = base_url.rstrip("/") + HEALTH_PATH

    async def poll() -> str | None:
        try:
            async with asyncio.timeout(timeout_s):
                request = client.build_request("GET", url, headers=dict(headers))
                response = await client.send(request, stream=True)
                await response.aclose()  # the status is all that is read
        except TimeoutError:
            return f"GET {HEALTH_PATH}: no answer within {timeout_s:g} s"
        except httpx.HTTPError as exc:
            return f"GET {HEALTH_PATH}: {describe_transport_error(exc)}"
        if 200 <= response.status_code < 300:
            return None
        return f"GET {HEALTH_PATH}: HTTP {response.status_code}"

    return poll if await poll() is None else None


__all__ = ["HEALTH_PATH", "HEALTH_TIMEOUT_S", "HealthProbe", "health_probe"]

"""llama.cpp server facts: the per-slot context `n_ctx`, from wherever the server says it.

    GET /props       `default_generation_settings.n_ctx` (per slot), `total_slots`
    GET /slots       `[{"id": 0, "n_ctx": N, ...}, ...]` (off with `--no-slots`)
    GET /v1/models   `data[].meta.n_ctx` (and `owned_by: "llamacpp"`), read with the model

llama.cpp gives each slot a KV cache of exactly `n_ctx` cells (`kv_unified` shares one cache
of that size among the slots), so `n_ctx` is both the context a request may use and the KV
pool it is served from: the side's `pool_tokens` and `context_tokens` are the same figure,
with the endpoint that said it as the source. llama.cpp has no pages (a cell per token), so
the page size stays unknown.

What it does not do: guess. A figure no endpoint gave stays `None`, and every request made
is an `Attempt` (`harness.target.server_facts`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from kvcanary.harness.target.server_facts import Attempt, SideFacts, as_int

GetJson = Callable[[str], Awaitable[tuple[str, Any] | None]]
"""GET a path; (url, decoded JSON) of a 200 answer, or None with the attempt recorded."""


def is_llamacpp_card(card: Mapping[str, Any]) -> bool:
    """Whether a `/v1/models` card is llama.cpp's (it carries `meta` or says who owns it)."""
    return card.get("owned_by") == "llamacpp" or isinstance(card.get("meta"), dict)


def card_n_ctx(card: Mapping[str, Any]) -> int | None:
    """`meta.n_ctx` of a llama.cpp `/v1/models` card."""
    meta = card.get("meta")
    return as_int(meta.get("n_ctx")) if isinstance(meta, dict) else None


async def read_llamacpp_side(
    get_json: GetJson,
    attempts: list[Attempt],
    base_url: str,
    *,
    models_n_ctx: int | None,
) -> SideFacts | None:
    """The llama.cpp server's side: `n_ctx` from /props, else /slots, else /v1/models meta."""
    for path, read in (("/props", _props_n_ctx), ("/slots", _slots_n_ctx)):
        got = await get_json(path)
        if got is None:
            continue
        url, body = got
        n_ctx, fields = read(body)
        if n_ctx is None:
            attempts.append(Attempt(url, 200, "no n_ctx", "nothing"))
            continue
        attempts.append(Attempt(url, 200, None, f"n_ctx={n_ctx} (pool and context per slot)"))
        return _side(base_url, n_ctx, f"llamacpp:{path}", fields)
    if models_n_ctx is not None:
        fields = {"meta.n_ctx": models_n_ctx}
        return _side(base_url, models_n_ctx, "llamacpp:/v1/models meta.n_ctx", fields)
    return None


def _side(base_url: str, n_ctx: int, source: str, fields: dict[str, Any]) -> SideFacts:
    return SideFacts(
        role="unified",
        url=base_url,
        pool_tokens=n_ctx,
        max_input_tokens=None,
        context_tokens=n_ctx,
        page_size=None,
        source=source,
        fields=fields,
    )


def _props_n_ctx(body: Any) -> tuple[int | None, dict[str, Any]]:
    if not isinstance(body, dict):
        return None, {}
    settings = body.get("default_generation_settings")
    n_ctx = as_int(settings.get("n_ctx")) if isinstance(settings, dict) else None
    fields: dict[str, Any] = {"default_generation_settings.n_ctx": n_ctx}
    if as_int(body.get("total_slots")) is not None:
        fields["total_slots"] = body["total_slots"]
    return n_ctx, fields


def _slots_n_ctx(body: Any) -> tuple[int | None, dict[str, Any]]:
    if not isinstance(body, list):
        return None, {}
    sizes = [as_int(s.get("n_ctx")) for s in body if isinstance(s, dict)]
    known = [n for n in sizes if n is not None]
    # the smallest slot is where an over-long prompt fails first
    return (min(known) if known else None), {"slots.n_ctx": sizes}

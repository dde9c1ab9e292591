"""Engine facts read from a running target: KV pool sizes, context length, page size, PD sides.

What it knows: the shapes a serving engine uses to say how big its KV pool is.

    SGLang      GET /get_server_info (alias /server_info): `max_total_num_tokens` (pool),
                `max_req_input_len`, `context_length`, `page_size`, `disaggregation_mode`,
                per-DP-rank `internal_states[]`; through mini_lb the same dicts arrive as
                `{"internal_states": [...], "prefill": [info, ...], "decode": [info, ...]}`.
    vLLM        GET /metrics, `vllm:cache_config_info{num_gpu_blocks="N", block_size="B"}`:
                pool tokens = N * B, per engine (data-parallel engines carry an `engine` label).
    llama.cpp   GET /props, /slots, /v1/models `meta.n_ctx`: the per-slot context, which is
                also the slot's KV cache (`harness.target.llamacpp_info`).
    OpenAI API  GET /v1/models `max_model_len`: the advertised context, never the pool.

Every request made is kept as an `Attempt` (URL, status or error, what it yielded), so that
"the pool size is unknown" always comes with the list of what was tried. Target misbehaviour
(refused connections, timeouts, 404s, HTML where JSON was expected, huge or inflating bodies,
JSON nested too deep) is recorded, never raised: every GET is bounded in time, decoded size
and JSON depth (`harness.target.discovery_fetch`). The server info and the model list are
asked at once; what the caller already knows (flags) is not asked for at all, and a caller
may be told what each round of requests waits on.

What it deliberately does not know: what the figures mean for safety (that is
`harness.target.audit`) or which figure a run should be sized against (that is
`harness.target.limits`). It does not guess a pool from the context length or from memory
sizes: a figure it did not read stays `None`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import httpx

from kvcanary.harness.target.discovery_fetch import DISCOVERY_TIMEOUT_S, Fetcher
from kvcanary.harness.target.engine_shapes import (
    REFERENCE_ENGINE_VERSION,
    has_sglang_fields,
    is_reference_engine,
    mini_lb_sides,
    sglang_side,
    vllm_pools,
    yield_of_sides,
)
from kvcanary.harness.target.llamacpp_info import card_n_ctx, is_llamacpp_card, read_llamacpp_side
from kvcanary.harness.target.server_facts import (
    Attempt,
    EngineFacts,
    Role,
    SideFacts,
    as_int,
    describe_error,
    min_known,
)

_SGLANG_INFO_PATHS = ("/get_server_info", "/server_info")
SKIPPED_ALL = "not asked: the model, pool and context were all given"
SKIPPED_LIMITS = "pool and context not asked for: both were given"


async def read_engine_facts(
    client: httpx.AsyncClient,
    base_url: str,
    *,
    headers: Mapping[str, str] | None = None,
    model_known: bool = False,
    limits_known: bool = False,
    timeout_s: float = DISCOVERY_TIMEOUT_S,
    on_wait: Callable[[str], None] | None = None,
) -> EngineFacts:
    """Ask the target at `base_url` everything it will say about its limits.

    `model_known` / `limits_known`: the caller already has the model name / the pool and
    context (from flags), so the endpoints that would only supply those are not asked; with
    both, nothing is. `timeout_s` bounds each endpoint; `on_wait` is told, before each
    round of requests, what is being waited for (one line the caller may show)."""
    fetcher = Fetcher(client, base_url.rstrip("/"), headers, timeout_s=timeout_s)
    reader = _Reader(fetcher, on_wait)
    if model_known and limits_known:
        return reader.facts_of("unknown", [], None, None, None, skipped=SKIPPED_ALL)
    return await reader.read(limits_known=limits_known)


async def read_deployment_facts(
    client: httpx.AsyncClient,
    *,
    target: str | None,
    prefill_urls: Sequence[str] = (),
    decode_urls: Sequence[str] = (),
    headers: Mapping[str, str] | None = None,
    timeout_s: float = DISCOVERY_TIMEOUT_S,
    on_wait: Callable[[str], None] | None = None,
) -> EngineFacts:
    """Facts for a deployment whose sides may be named explicitly (all read in parallel).

    Sides named with `prefill_urls` / `decode_urls` replace any the target reports about
    itself (an operator's list is authoritative; a router's may be partial). The target, if
    given, still supplies the advertised context and the model name.
    """
    assert target or prefill_urls or decode_urls, "nothing to read"
    named: list[tuple[Role, str]] = [("prefill", u) for u in prefill_urls]
    named += [("decode", u) for u in decode_urls]
    urls = ([target] if target else []) + [url for _, url in named]
    everything = await asyncio.gather(
        *(
            read_engine_facts(client, url, headers=headers, timeout_s=timeout_s, on_wait=on_wait)
            for url in urls
        )
    )
    base = everything[0] if target else None
    if not named:
        assert base is not None
        return base
    read = [
        (role, url, one) for (role, url), one in zip(named, everything[-len(named) :], strict=True)
    ]
    sides = [side for role, url, one in read for side in _as_role(one, role, url)]
    advertised = base.context_tokens if base else None
    if advertised is not None:
        sides = [s if s.context_tokens else replace(s, context_tokens=advertised) for s in sides]
    engines = sorted({one.engine for _, _, one in read} - {"unknown"})
    return EngineFacts(
        engine=base.engine if base and base.engine != "unknown" else "+".join(engines) or "unknown",
        base_url=(target or named[0][1]).rstrip("/"),
        sides=tuple(sides),
        context_tokens=advertised or min_known([s.context_tokens for s in sides]),
        page_size=min_known([s.page_size for s in sides]) or (base.page_size if base else None),
        attempts=(base.attempts if base else ())
        + tuple(a for _, _, one in read for a in one.attempts),
        model=base.model if base else None,
        context_source=(
            base.context_source
            if base and advertised
            else next((one.context_source for _, _, one in read if one.context_tokens), None)
        ),
    )


def _as_role(facts: EngineFacts, role: Role, url: str) -> list[SideFacts]:
    """The sides read from one explicitly named server, relabelled with the role it was given."""
    if not facts.sides:
        return [SideFacts(role, url.rstrip("/"), None, None, facts.context_tokens, None)]
    return [
        replace(
            s,
            role=role,
            url=url.rstrip("/"),
            context_tokens=s.context_tokens or facts.context_tokens,
        )
        for s in facts.sides
    ]


class _Reader:
    """One pass over a target's introspection endpoints; collects attempts as it goes."""

    def __init__(self, fetcher: Fetcher, on_wait: Callable[[str], None] | None) -> None:
        self.fetcher = fetcher
        self.base_url = fetcher.base_url
        self.on_wait = on_wait

    def _waiting_for(self, paths: Sequence[str]) -> None:
        if self.on_wait is not None and self.fetcher.unreachable is None:
            self.on_wait(
                f"waiting for {self.base_url} to answer {', '.join(paths)} "
                f"(up to {self.fetcher.timeout_s:g} s)"
            )

    async def read(self, *, limits_known: bool) -> EngineFacts:
        if limits_known:  # only the model name is wanted
            self._waiting_for(["/v1/models"])
            model, _, _ = await self._read_models(self.fetcher)
            return self.facts_of("unknown", [], None, model, None, skipped=SKIPPED_LIMITS)
        # the server info and the model list are independent: ask both at once
        self._waiting_for([_SGLANG_INFO_PATHS[0], "/v1/models"])
        sglang_fetcher, models_fetcher = self.fetcher.fork(), self.fetcher.fork()
        (engine, sides), (model, advertised, card) = await asyncio.gather(
            self._read_sglang(sglang_fetcher), self._read_models(models_fetcher)
        )
        self.fetcher.join(sglang_fetcher, models_fetcher)
        if not self.fetcher.answered and self.fetcher.timed_out:
            # a target that answers nothing in time answers nothing else in time either
            self.fetcher.unreachable = f"not answering within {self.fetcher.timeout_s:g} s"
        context_source = "openai:/v1/models" if advertised is not None else None
        if card is not None and is_llamacpp_card(card):
            engine = "llamacpp"
            if advertised is None and card_n_ctx(card) is not None:
                advertised, context_source = card_n_ctx(card), "llamacpp:/v1/models meta.n_ctx"
        if engine == "llamacpp" and not any(s.pool_tokens is not None for s in sides):
            self._waiting_for(["/props", "/slots"])
            side = await read_llamacpp_side(
                self.fetcher.get_json,
                self.fetcher.attempts,
                self.base_url,
                models_n_ctx=card_n_ctx(card or {}),
            )
            sides = [side] if side is not None else sides
        elif not any(s.pool_tokens is not None for s in sides):
            self._waiting_for(["/metrics"])
            vllm_sides = await self._read_vllm_metrics(advertised)
            if vllm_sides:
                engine, sides = "vllm", vllm_sides
        if engine == "unknown" and advertised is not None:
            engine = "openai"
        if not sides and advertised is not None:
            sides = [SideFacts("unified", self.base_url, None, None, advertised, None)]
        # a side that does not say its context has the one the target advertises
        sides = [
            s if s.context_tokens is not None else replace(s, context_tokens=advertised)
            for s in sides
        ]
        return self.facts_of(engine, sides, advertised, model, context_source)

    def facts_of(
        self,
        engine: str,
        sides: Sequence[SideFacts],
        advertised: int | None,
        model: str | None,
        context_source: str | None,
        *,
        skipped: str | None = None,
    ) -> EngineFacts:
        return EngineFacts(
            engine=engine,
            base_url=self.base_url,
            sides=tuple(sides),
            context_tokens=advertised or min_known([s.context_tokens for s in sides]),
            page_size=min_known([s.page_size for s in sides]),
            attempts=tuple(self.fetcher.attempts),
            model=model,
            context_source=context_source or _context_source(sides),
            skipped=skipped,
        )

    async def _read_sglang(self, fetcher: Fetcher) -> tuple[str, list[SideFacts]]:
        for path in _SGLANG_INFO_PATHS:
            got = await fetcher.get_json(path)
            if got is None:
                if fetcher.attempts[-1].status is None:
                    break  # no answer at all (a timeout): the alias would wait as long
                continue
            url, body = got
            if not isinstance(body, dict):
                fetcher.attempts.append(Attempt(url, 200, "not a JSON object", "nothing"))
                continue
            source = f"sglang:{path}"
            if isinstance(body.get("prefill"), list) or isinstance(body.get("decode"), list):
                sides = mini_lb_sides(body, self.base_url, source)
                engine = "sglang-pd"
            elif has_sglang_fields(body):
                sides = [sglang_side(body, self.base_url, source, role=None)]
                engine = "sglang"
            else:
                fetcher.attempts.append(Attempt(url, 200, "no SGLang fields", "nothing"))
                continue
            if is_reference_engine(body):
                engine = "kvcanary-reference"
            fetcher.attempts.append(Attempt(url, 200, None, yield_of_sides(sides)))
            return engine, sides
        return "unknown", []

    async def _read_models(
        self, fetcher: Fetcher
    ) -> tuple[str | None, int | None, dict[str, Any] | None]:
        """(model id, advertised context, the first model card) from /v1/models."""
        got = await fetcher.get_json("/v1/models")
        if got is None:
            return None, None, None
        url, body = got
        cards = body.get("data") if isinstance(body, dict) else None
        if not isinstance(cards, list) or not cards or not isinstance(cards[0], dict):
            fetcher.attempts.append(Attempt(url, 200, "no model cards", "nothing"))
            return None, None, None
        card = cards[0]
        model = card.get("id")
        unusable = model is not None and not _usable_model_id(model)
        model = model if _usable_model_id(model) else None
        context = as_int(card.get("max_model_len"))
        said = f"model={model}, context_tokens={context}"
        if unusable:
            said += " (its id is not a usable model name)"
        if card_n_ctx(card) is not None:
            said += f", meta.n_ctx={card_n_ctx(card)}"
        fetcher.attempts.append(Attempt(url, 200, None, said))
        return model, context, card

    async def _read_vllm_metrics(self, advertised: int | None) -> list[SideFacts]:
        fetched = await self.fetcher.get("/metrics")
        if fetched is None:
            return []
        url = fetched.url
        if fetched.status != 200:
            self.fetcher.attempts.append(Attempt(url, fetched.status, None, "nothing"))
            return []
        pools = vllm_pools(fetched.body.decode("utf-8", errors="replace"))
        if pools is None:
            self.fetcher.attempts.append(Attempt(url, 200, "no vllm:cache_config_info", "nothing"))
            return []
        sides = [
            SideFacts(
                role="unified",
                url=self.base_url if len(pools) == 1 else f"{self.base_url}#engine={engine}",
                pool_tokens=pool,
                max_input_tokens=None,
                context_tokens=advertised,
                page_size=block_size,
                source="vllm:/metrics",
                fields=labels,
            )
            for engine, pool, block_size, labels in pools
        ]
        self.fetcher.attempts.append(Attempt(url, 200, None, yield_of_sides(sides)))
        return sides


MAX_MODEL_ID_CHARS = 512


def _usable_model_id(model: Any) -> bool:
    """A model name kvcanary may send in every request and show on one line."""
    if not isinstance(model, str) or not model.strip() or len(model) > MAX_MODEL_ID_CHARS:
        return False
    return model.isprintable()


def _context_source(sides: Sequence[SideFacts]) -> str | None:
    return next((s.source for s in sides if s.context_tokens is not None), None)


__all__ = [
    "REFERENCE_ENGINE_VERSION",
    "Attempt",
    "EngineFacts",
    "Role",
    "SideFacts",
    "describe_error",
    "read_deployment_facts",
    "read_engine_facts",
]

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
(refused connections, timeouts, 404s, HTML where JSON was expected) is recorded, never raised.

What it deliberately does not know: what the figures mean for safety (that is
`harness.target.audit`) or which figure a run should be sized against (that is
`harness.target.limits`). It does not guess a pool from the context length or from memory
sizes: a figure it did not read stays `None`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import httpx

from harness.target.llamacpp_info import card_n_ctx, is_llamacpp_card, read_llamacpp_side
from harness.target.server_facts import (
    Attempt,
    EngineFacts,
    Role,
    SideFacts,
    as_int,
    describe_error,
    min_known,
)

REFERENCE_ENGINE_VERSION = "kvcanary-reference"
"""How the bundled reference engine's SGLang-shaped server info begins its `version` field."""

_SGLANG_INFO_PATHS = ("/get_server_info", "/server_info")


async def read_engine_facts(
    client: httpx.AsyncClient,
    base_url: str,
    *,
    headers: Mapping[str, str] | None = None,
) -> EngineFacts:
    """Ask the target at `base_url` everything it will say about its limits."""
    reader = _Reader(client, base_url.rstrip("/"), headers)
    return await reader.read()


async def read_deployment_facts(
    client: httpx.AsyncClient,
    *,
    target: str | None,
    prefill_urls: Sequence[str] = (),
    decode_urls: Sequence[str] = (),
    headers: Mapping[str, str] | None = None,
) -> EngineFacts:
    """Facts for a deployment whose sides may be named explicitly.

    Sides named with `prefill_urls` / `decode_urls` replace any the target reports about
    itself (an operator's list is authoritative; a router's may be partial). The target, if
    given, still supplies the advertised context and the model name.
    """
    assert target or prefill_urls or decode_urls, "nothing to read"
    base = await read_engine_facts(client, target, headers=headers) if target else None
    named: list[tuple[Role, str]] = [("prefill", u) for u in prefill_urls]
    named += [("decode", u) for u in decode_urls]
    if not named:
        assert base is not None
        return base
    read = [
        (role, url, await read_engine_facts(client, url, headers=headers)) for role, url in named
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

    def __init__(
        self, client: httpx.AsyncClient, base_url: str, headers: Mapping[str, str] | None
    ) -> None:
        self.client = client
        self.base_url = base_url
        self.headers = dict(headers or {})
        self.attempts: list[Attempt] = []
        self.unreachable: str | None = None

    async def read(self) -> EngineFacts:
        engine, sides = await self._read_sglang()
        model, advertised, card = await self._read_models()
        context_source = "openai:/v1/models" if advertised is not None else None
        if card is not None and is_llamacpp_card(card):
            engine = "llamacpp"
            if advertised is None and card_n_ctx(card) is not None:
                advertised, context_source = card_n_ctx(card), "llamacpp:/v1/models meta.n_ctx"
        if engine == "llamacpp" and not any(s.pool_tokens is not None for s in sides):
            side = await read_llamacpp_side(
                self._get_json, self.attempts, self.base_url, models_n_ctx=card_n_ctx(card or {})
            )
            sides = [side] if side is not None else sides
        elif not any(s.pool_tokens is not None for s in sides):
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
        return EngineFacts(
            engine=engine,
            base_url=self.base_url,
            sides=tuple(sides),
            context_tokens=advertised or min_known([s.context_tokens for s in sides]),
            page_size=min_known([s.page_size for s in sides]),
            attempts=tuple(self.attempts),
            model=model,
            context_source=context_source or _context_source(sides),
        )

    async def _get(self, path: str) -> httpx.Response | None:
        """GET one path; None when no response came back (that attempt is recorded here)."""
        url = self.base_url + path
        if self.unreachable is not None:
            self.attempts.append(Attempt(url, None, self.unreachable, "not tried"))
            return None
        try:
            return await self.client.get(url, headers=self.headers)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            # the host is not there; every further path would wait out the same timeout
            self.unreachable = f"unreachable: {describe_error(exc)}"
            self.attempts.append(Attempt(url, None, self.unreachable, "nothing"))
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            self.attempts.append(Attempt(url, None, describe_error(exc), "nothing"))
        return None

    async def _get_json(self, path: str) -> tuple[str, Any] | None:
        """(url, decoded body) of a 200 JSON response; None, with the attempt recorded, else."""
        url = self.base_url + path
        response = await self._get(path)
        if response is None:
            return None
        if response.status_code != 200:
            self.attempts.append(Attempt(url, response.status_code, None, "nothing"))
            return None
        try:
            return url, response.json()
        except ValueError:
            self.attempts.append(Attempt(url, 200, "not JSON", "nothing"))
            return None

    async def _read_sglang(self) -> tuple[str, list[SideFacts]]:
        for path in _SGLANG_INFO_PATHS:
            got = await self._get_json(path)
            if got is None:
                continue
            url, body = got
            if not isinstance(body, dict):
                self.attempts.append(Attempt(url, 200, "not a JSON object", "nothing"))
                continue
            source = f"sglang:{path}"
            if isinstance(body.get("prefill"), list) or isinstance(body.get("decode"), list):
                sides = _mini_lb_sides(body, self.base_url, source)
                engine = "sglang-pd"
            elif _has_sglang_fields(body):
                sides = [_sglang_side(body, self.base_url, source, role=None)]
                engine = "sglang"
            else:
                self.attempts.append(Attempt(url, 200, "no SGLang fields", "nothing"))
                continue
            if _is_reference_engine(body):
                engine = "kvcanary-reference"
            self.attempts.append(Attempt(url, 200, None, _yield_of_sides(sides)))
            return engine, sides
        return "unknown", []

    async def _read_models(self) -> tuple[str | None, int | None, dict[str, Any] | None]:
        """(model id, advertised context, the first model card) from /v1/models."""
        got = await self._get_json("/v1/models")
        if got is None:
            return None, None, None
        url, body = got
        cards = body.get("data") if isinstance(body, dict) else None
        if not isinstance(cards, list) or not cards or not isinstance(cards[0], dict):
            self.attempts.append(Attempt(url, 200, "no model cards", "nothing"))
            return None, None, None
        card = cards[0]
        model = card.get("id")
        model = model if isinstance(model, str) else None
        context = as_int(card.get("max_model_len"))
        said = f"model={model}, context_tokens={context}"
        if card_n_ctx(card) is not None:
            said += f", meta.n_ctx={card_n_ctx(card)}"
        self.attempts.append(Attempt(url, 200, None, said))
        return model, context, card

    async def _read_vllm_metrics(self, advertised: int | None) -> list[SideFacts]:
        url = self.base_url + "/metrics"
        response = await self._get("/metrics")
        if response is None:
            return []
        if response.status_code != 200:
            self.attempts.append(Attempt(url, response.status_code, None, "nothing"))
            return []
        pools = _vllm_pools(response.text)
        if pools is None:
            self.attempts.append(Attempt(url, 200, "no vllm:cache_config_info", "nothing"))
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
        self.attempts.append(Attempt(url, 200, None, _yield_of_sides(sides)))
        return sides


def _context_source(sides: Sequence[SideFacts]) -> str | None:
    return next((s.source for s in sides if s.context_tokens is not None), None)


def _is_reference_engine(body: Mapping[str, Any]) -> bool:
    infos = [body] + [
        i for r in ("prefill", "decode") for i in body.get(r) or () if isinstance(i, dict)
    ]
    return any(str(info.get("version", "")).startswith(REFERENCE_ENGINE_VERSION) for info in infos)


def _has_sglang_fields(info: Mapping[str, Any]) -> bool:
    keys = ("max_total_num_tokens", "max_req_input_len", "context_length", "page_size")
    return any(k in info for k in keys) or isinstance(info.get("internal_states"), list)


def _mini_lb_sides(body: Mapping[str, Any], base_url: str, source: str) -> list[SideFacts]:
    sides: list[SideFacts] = []
    for role in ("prefill", "decode"):
        infos = body.get(role)
        if not isinstance(infos, list):
            continue
        for index, info in enumerate(infos):
            if isinstance(info, dict):
                sides.append(_sglang_side(info, f"{base_url}#{role}[{index}]", source, role))
    return sides


_SGLANG_FIELDS = (
    "max_total_num_tokens",
    "max_req_input_len",
    "context_length",
    "page_size",
    "disaggregation_mode",
    "max_total_tokens",
    "host",
    "port",
    "version",
)


def _sglang_side(info: Mapping[str, Any], url: str, source: str, role: Role | None) -> SideFacts:
    """One SGLang server's facts; per-DP-rank figures in `internal_states` count too."""
    ranks = [r for r in info.get("internal_states") or () if isinstance(r, dict)]
    pool = min_known(
        [as_int(info.get("max_total_num_tokens"))]
        + [as_int(r.get("max_total_num_tokens")) for r in ranks]
    )
    max_input = min_known(
        [as_int(info.get("max_req_input_len"))]
        + [as_int(r.get("max_req_input_len")) for r in ranks]
    )
    mode = info.get("disaggregation_mode")
    if role is None:
        role = mode if mode in ("prefill", "decode") else "unified"
    host, port = info.get("host"), as_int(info.get("port"))
    if "#" in url and isinstance(host, str) and port is not None:
        url = f"{url} ({host}:{port})"  # where the server says it listens, as it says it
    fields = {k: info[k] for k in _SGLANG_FIELDS if k in info}
    if ranks:
        fields["internal_states"] = [
            {k: r[k] for k in ("dp_rank", "max_total_num_tokens", "max_req_input_len") if k in r}
            for r in ranks
        ]
    return SideFacts(
        role=role,
        url=url,
        pool_tokens=pool,
        max_input_tokens=max_input,
        context_tokens=as_int(info.get("context_length")),
        page_size=as_int(info.get("page_size")),
        source=source,
        fields=fields,
    )


def _vllm_pools(text: str) -> list[tuple[str, int | None, int | None, dict[str, str]]] | None:
    """(engine, pool tokens, block size, labels) per `vllm:cache_config_info` sample."""
    from prometheus_client.parser import text_string_to_metric_families

    found: list[tuple[str, int | None, int | None, dict[str, str]]] = []
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if not sample.name.endswith("cache_config_info"):
                    continue
                labels = dict(sample.labels)
                blocks = as_int(labels.get("num_gpu_blocks"))
                block_size = as_int(labels.get("block_size"))
                pool = blocks * block_size if blocks and block_size else None
                found.append((labels.get("engine", "0"), pool, block_size, labels))
    except ValueError:
        return None  # not Prometheus text (an HTML page, a proxy's error body)
    return found or None


def _yield_of_sides(sides: Sequence[SideFacts]) -> str:
    if not sides:
        return "no sides"
    return "; ".join(
        f"{s.role}: pool_tokens={s.pool_tokens}, max_input_tokens={s.max_input_tokens}, "
        f"context_tokens={s.context_tokens}, page_size={s.page_size}"
        for s in sides
    )


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

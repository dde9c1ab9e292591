"""The response shapes of SGLang's server info and vLLM's metrics, turned into `SideFacts`
(`harness.target.server_info` fetches them), and each engine's documented answer to a
prompt that fits the context while prompt + max_tokens does not (`max_tokens_policy`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvcanary.harness.target.server_facts import Role, SideFacts, as_int, min_known

REFERENCE_ENGINE_VERSION = "kvcanary-reference"
"""How the bundled reference engine's SGLang-shaped server info begins its `version` field."""

MAX_TOKENS_POLICIES: Mapping[str, str] = {
    # vLLM 0.32 caps max_tokens at the context minus the prompt and answers (finish_reason
    # "length"; `get_max_tokens` in its serving utils); only a prompt that alone reaches the
    # context is a 400. Measured against the real server: tests/harness/target/vllm
    "vllm": "stop",
    # "maximum context length is N tokens. However, you requested M tokens": HTTP 400
    "openai": "reject",
    # TokenizerManager: input + max_new_tokens above context_len is a 400 (so the bundled
    # engine's `SideLimits.check_context`)
    "sglang": "reject",
    "sglang-pd": "reject",
    "kvcanary-reference": "reject",
    # the slot generates until its context is full, then stops (finish_reason "length")
    "llamacpp": "stop",
}
"""What each engine does with a prompt whose prompt + max_tokens exceeds the context while
the prompt alone does not; an engine not listed (or not identified) is unknown."""


def max_tokens_policy(engine: str) -> str | None:
    """`reject`, `stop`, or None where the engine's convention is unknown."""
    return MAX_TOKENS_POLICIES.get(engine)


def is_reference_engine(body: Mapping[str, Any]) -> bool:
    infos = [body] + [
        i for r in ("prefill", "decode") for i in body.get(r) or () if isinstance(i, dict)
    ]
    return any(str(info.get("version", "")).startswith(REFERENCE_ENGINE_VERSION) for info in infos)


def has_sglang_fields(info: Mapping[str, Any]) -> bool:
    keys = ("max_total_num_tokens", "max_req_input_len", "context_length", "page_size")
    return any(k in info for k in keys) or isinstance(info.get("internal_states"), list)


def mini_lb_sides(body: Mapping[str, Any], base_url: str, source: str) -> list[SideFacts]:
    sides: list[SideFacts] = []
    for role in ("prefill", "decode"):
        infos = body.get(role)
        if not isinstance(infos, list):
            continue
        for index, info in enumerate(infos):
            if isinstance(info, dict):
                sides.append(sglang_side(info, f"{base_url}#{role}[{index}]", source, role))
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


def sglang_side(info: Mapping[str, Any], url: str, source: str, role: Role | None) -> SideFacts:
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


def vllm_pools(text: str) -> list[tuple[str, int | None, int | None, dict[str, str]]] | None:
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


def yield_of_sides(sides: Sequence[SideFacts]) -> str:
    if not sides:
        return "no sides"
    return "; ".join(
        f"{s.role}: pool_tokens={s.pool_tokens}, max_input_tokens={s.max_input_tokens}, "
        f"context_tokens={s.context_tokens}, page_size={s.page_size}"
        for s in sides
    )

"""Engine configuration: limits, pool sizes, page size, fix switches, model size, presets.

What it knows: every knob of the reference engine, which combinations are invalid (a clear
`ValueError` from `__post_init__`), the presets, and the fix switches with the upstream SGLang
issue or PR each one models. `PRESETS` and `FIXES` are the text `kvcanary serve --help` shows.

What it deliberately does not know: how a fix is implemented. Schedulers ask `config.has(fix)`;
a fix name that is not in `FIXES` is an error, never silently off.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

PRESETS: dict[str, str] = {
    "vulnerable": (
        "the GLM-5.3 incident scaled down: prefill pool 0.65x the context length, decode pool "
        "2x, PD free order, no fixes (SGLang #30233)"
    ),
    "patched": (
        "the incident's undersized pools (prefill 0.65x the context, decode 2x) with every "
        "engine fix on except pool_covers_context, which would refuse to start them: "
        "over-pool prompts get 400, nothing leaks"
    ),
    "hardened": "every fix switch on, both pools 2x the context length",
    "race": (
        "the page-lifetime race (SGLang #35049): context 1024, a decode pool of one context "
        "(the smallest pool, so an abort plan sized from the limit nearly fills it), prefill "
        "2x, each prompt prefilled and sent in one write over a 5 ms-per-64-KiB-page link, PD "
        "free order, no fixes; run it with `--profile race`"
    ),
}

FIXES: dict[str, str] = {
    "admission_retire": (
        "retire intake-rejected requests at admission, before bootstrap, allocation or "
        "transfer; the client gets the 400 (SGLang #38935, #36988)"
    ),
    "coverage_check": (
        "prefill publishes how many tokens it wrote; decode compares that with its "
        "reservation before commit and answers a mismatch with 400 (SGLang #38704)"
    ),
    "kv_checksum": (
        "Adler-32 over the expected KV range on both sides, compared by decode before commit "
        "(SGLang #39500)"
    ),
    "deferred_release": (
        "an aborted request's decode pages are held until prefill acknowledges that its "
        "in-flight writes drained (SGLang #35049)"
    ),
    "page_tags": (
        "every page carries an owner tag that changes on reallocation, checked by decode on "
        "every read (SGLang tags request slots, req_generation, not pages)"
    ),
    "zero_on_free": (
        "freed pages are zeroed, so a stale read sees zeros instead of another request's KV "
        "(SGLang #39945, open)"
    ),
    "cache_salt": (
        "the prefix cache is keyed by (cache_salt, tokens): requests that send different "
        "salts never share a cached page (vLLM #17045, SGLang #10317; without it the body's "
        "salt is ignored, as in SGLang #23300)"
    ),
    "derive_cache_salt": (
        "the prefix cache is keyed by the tenant's credential, derived by the server from the "
        "bearer token, so a client cannot select another tenant's cache by sending its salt "
        "(vLLM PR #53347); a body cache_salt only subdivides the tenant's own cache"
    ),
    "pool_covers_context": (
        "refuse to start when a KV pool cannot hold one context-length request, as vLLM "
        "does; SGLang instead lowers max_req_input_len below the advertised context"
    ),
}

FREE_ORDERS: dict[str, str] = {
    "lifo": "freed pages are reused first, most recent first (SGLang without PD)",
    "sorted": "freed pages wait in a release list, merged and sorted when free pages run "
    "short (SGLang PD mode: need_sort)",
}

ATTENTION_PATHS: dict[str, str] = {
    "auto": "the Triton paged kernel on CUDA when triton is installed (kvcanary[gpu]), else the "
    "torch path, saying why in one line; the environment variable KVCANARY_ATTENTION "
    "(auto, torch or triton) stands in for auto",
    "torch": "the torch paged path (gathers pages, then SDPA): the oracle the kernel is tested "
    "against",
    "triton": "the Triton paged kernel, reading K/V through the block table; an error where it "
    "cannot run (on CPU it needs Triton's interpreter, TRITON_INTERPRET=1: slow, for tests)",
}

KV_DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_CONTEXT_LENGTH = 4096
DEFAULT_PAGE_SIZE = 16
RACE_CONTEXT_LENGTH = 1024
"""The `race` preset's own default context: small prompts keep its slow link's runs short."""
RACE_PAGE_FLIGHT_S = 0.005
"""The `race` preset's link: one page of the default model (64 KiB in float32) per 5 ms, so
an abort plan's 58-page write is in flight ~0.3 s and a 127-token follower's 8 pages 40 ms."""
_LIMIT_MARGIN = 5
"""SGLang: max_req_input_len = min(context_len - 1, max_total_num_tokens - 1) - 5."""


@dataclass(slots=True)
class EngineConfig:
    """Everything both sides of the engine are built from (prefill and decode share one)."""

    context_length: int = DEFAULT_CONTEXT_LENGTH
    """Advertised context (`/v1/models` max_model_len)."""
    prefill_pool_tokens: int = 8192
    decode_pool_tokens: int = 8192
    page_size: int = DEFAULT_PAGE_SIZE
    fixes: frozenset[str] = frozenset()
    free_order: str = "sorted"
    device: str = "cpu"
    dtype: str = "float32"
    """The KV pools' element type: float32, bfloat16 or float16 (pages on the wire too)."""
    attention: str = "auto"
    """Which paged attention the sides run (`ATTENTION_PATHS`; model/attention_path.py)."""
    seed: int = 0
    copy_noise: float = 0.3
    """The recall model's copying, 0 (exact page-aligned quotes) .. 1 (noisy): content-dependent
    slips, substitutions and drift, seeded by `seed` (model/recall.py, recall_schedule.py)."""
    # model size (model/transformer.py); the last layer is the recall layer
    num_layers: int = 4
    hidden_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    # scheduling and transfer
    prefill_chunk_tokens: int = 512
    transfer_chunk_pages: int = 16
    transfer_bandwidth_bytes_per_s: float | None = None
    """Each KV write is in flight for `bytes / bandwidth` (RDMA writes on a bandwidth-limited
    link; writes of different requests concurrently). None: writes land at once."""
    max_running_requests: int = 32
    bootstrap_timeout_s: float = 60.0
    """Prefill waiting for decode's metadata (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT)."""
    release_timeout_s: float = 30.0
    """`deferred_release`: free an aborted request's pages anyway after this long."""
    prefix_cache: bool = False
    """A radix prefix cache on the prefill side (SGLang's default; off here as with
    --disable-radix-cache): finished prompts' full pages are kept and reused."""
    merge_prefill_usage: bool = False
    """A gateway that is not SGLang's: the router replaces `usage.prompt_tokens` in decode's
    answer with prefill's count (the vulnerable prefill's placeholder says 1). SGLang's
    routers return decode's body untouched; off in every preset."""
    preset: str = "custom"
    tokenizer: str = "cl100k_base"

    def __post_init__(self) -> None:
        self.fixes = frozenset(self.fixes)
        for check in _CHECKS:
            problem = check(self)
            if problem:
                raise ValueError(f"invalid engine config: {problem}")

    def has(self, fix: str) -> bool:
        """Whether the fix switch `fix` is on."""
        assert fix in FIXES, f"unknown fix {fix!r}"
        return fix in self.fixes

    def max_req_input_len(self, pool_tokens: int) -> int:
        """A side's own input limit: the pool can lower it below the context (SGLang)."""
        return min(self.context_length - 1, pool_tokens - 1) - _LIMIT_MARGIN

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> EngineConfig:
        """A preset, with fields overridden; pools follow an overridden context length."""
        if name not in _PRESET_BUILDERS:
            raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
        default_context = RACE_CONTEXT_LENGTH if name == "race" else DEFAULT_CONTEXT_LENGTH
        context_length = int(overrides.get("context_length", default_context))
        page_size = int(overrides.get("page_size", DEFAULT_PAGE_SIZE))
        fields = _PRESET_BUILDERS[name](context_length, page_size)
        fields.update(overrides)
        fields["preset"] = name
        unknown = set(fields) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown engine config field(s): {', '.join(sorted(unknown))}")
        return cls(**fields)


def _round_to_pages(num_tokens: float, page_size: int) -> int:
    return max(page_size, int(num_tokens) // page_size * page_size)


def _vulnerable(context_length: int, page_size: int) -> dict[str, Any]:
    return {
        "prefill_pool_tokens": _round_to_pages(0.65 * context_length, page_size),
        "decode_pool_tokens": _round_to_pages(2 * context_length, page_size),
        "fixes": frozenset(),
        "free_order": "sorted",
    }


def _patched(context_length: int, page_size: int) -> dict[str, Any]:
    return {
        **_vulnerable(context_length, page_size),
        "fixes": frozenset(FIXES) - {"pool_covers_context"},
    }


def _hardened(context_length: int, page_size: int) -> dict[str, Any]:
    return {
        "prefill_pool_tokens": _round_to_pages(2 * context_length, page_size),
        "decode_pool_tokens": _round_to_pages(2 * context_length, page_size),
        "fixes": frozenset(FIXES),
        "free_order": "sorted",
    }


def _race(context_length: int, page_size: int) -> dict[str, Any]:
    """Decode's pool is the smallest, so a run's limit comes from it: an abort plan of 0.9x
    the limit leaves decode a few free pages, and the next request's allocation merges the
    release list and gets the aborted pages, lowest first (the sorted PD order). Prefill's
    pool is larger, so no prompt takes the over-pool path: the abort race is the only leak.
    One write per prompt makes the aborted request's write the longest in flight."""
    default_page_bytes = 4 * 2 * page_size * 2 * 64 * 4  # the default model, float32
    return {
        "context_length": context_length,
        "prefill_pool_tokens": _round_to_pages(2 * context_length, page_size),
        "decode_pool_tokens": _round_to_pages(context_length, page_size),
        "prefill_chunk_tokens": context_length,
        "transfer_chunk_pages": max(1, context_length // page_size),
        "transfer_bandwidth_bytes_per_s": default_page_bytes / RACE_PAGE_FLIGHT_S,
        "fixes": frozenset(),
        "free_order": "sorted",
    }


_PRESET_BUILDERS: dict[str, Callable[[int, int], dict[str, Any]]] = {
    "vulnerable": _vulnerable,
    "patched": _patched,
    "hardened": _hardened,
    "race": _race,
}
assert set(_PRESET_BUILDERS) == set(PRESETS)


def _check_fixes(c: EngineConfig) -> str | None:
    unknown = sorted(c.fixes - set(FIXES))
    if unknown:
        return f"unknown fix(es) {', '.join(unknown)}; known: {', '.join(FIXES)}"
    return None


def _check_limits(c: EngineConfig) -> str | None:
    if c.page_size < 1 or c.page_size > 1024:
        return f"page_size must be in 1..1024, got {c.page_size}"
    if c.context_length < 2 * c.page_size:
        return f"context_length ({c.context_length}) must be at least two pages"
    for name in ("prefill_pool_tokens", "decode_pool_tokens"):
        tokens = getattr(c, name)
        if tokens % c.page_size or tokens < 2 * c.page_size:
            return f"{name} ({tokens}) must be a multiple of page_size ({c.page_size}), >= 2 pages"
        if c.max_req_input_len(tokens) < 1:
            return f"{name} ({tokens}) leaves no room for any input (max_req_input_len < 1)"
        if "pool_covers_context" in c.fixes and tokens < c.context_length:
            return (
                f"{name} ({tokens}) cannot hold one context_length ({c.context_length}) "
                "request (fix pool_covers_context); raise the pool or lower the context"
            )
    return None


def _check_model(c: EngineConfig) -> str | None:
    if c.num_layers < 2:
        return f"num_layers must be >= 2 (ordinary layers + the recall layer), got {c.num_layers}"
    if c.head_dim % 2 or c.head_dim < 32:
        return f"head_dim must be even and >= 32 (the recall head's rotary), got {c.head_dim}"
    if c.num_heads < 1 or c.num_kv_heads < 1 or c.num_heads % c.num_kv_heads:
        return f"num_heads ({c.num_heads}) must be a multiple of num_kv_heads ({c.num_kv_heads})"
    if c.hidden_size < 64 or c.intermediate_size < 1:
        return f"hidden_size must be >= 64, got {c.hidden_size}"
    return None


def _check_runtime(c: EngineConfig) -> str | None:
    if c.free_order not in FREE_ORDERS:
        return f"free_order must be one of {', '.join(FREE_ORDERS)}, got {c.free_order!r}"
    if c.device != "cpu" and not c.device.startswith("cuda"):
        return f"device must be 'cpu' or 'cuda[:N]', got {c.device!r}"
    if c.dtype not in KV_DTYPES:
        return f"dtype must be one of {', '.join(KV_DTYPES)}, got {c.dtype!r}"
    if c.attention not in ATTENTION_PATHS:
        return f"attention must be one of {', '.join(ATTENTION_PATHS)}, got {c.attention!r}"
    positive = ("prefill_chunk_tokens", "transfer_chunk_pages", "max_running_requests")
    for name in positive:
        if getattr(c, name) < 1:
            return f"{name} must be >= 1, got {getattr(c, name)}"
    for name in ("bootstrap_timeout_s", "release_timeout_s"):
        value = getattr(c, name)
        if not (value > 0 and math.isfinite(value)):
            return f"{name} must be a positive number of seconds, got {value}"
    if not 0.0 <= c.copy_noise <= 1.0:
        return f"copy_noise must be in 0..1, got {c.copy_noise}"
    bandwidth = c.transfer_bandwidth_bytes_per_s
    if bandwidth is not None and not (
        isinstance(bandwidth, int | float) and bandwidth > 0 and math.isfinite(bandwidth)
    ):
        return f"transfer_bandwidth_bytes_per_s must be a positive number, got {bandwidth!r}"
    return None


_CHECKS: tuple[Callable[[EngineConfig], str | None], ...] = (
    _check_fixes,
    _check_limits,
    _check_model,
    _check_runtime,
)

__all__ = ["FIXES", "FREE_ORDERS", "PRESETS", "EngineConfig"]

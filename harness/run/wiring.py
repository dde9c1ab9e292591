"""The pieces a run is put together from, which `harness.run.assembly` composes once for
`run`, `soak`, `repro` and the plugin: the bundled engine on a free loopback port, the HTTP
client, first contact (facts, limits, model), the calibration, the canary alphabet and
minter, the detectors, the target client (a Ray actor builds its own with it), the
`run_started` record. Heavy or optional imports (the engine) happen inside functions; the
render is `harness.run.rendering`.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx

from kvcanary.canaries import (
    CanaryError,
    CanaryIndex,
    CanaryMinter,
    CanaryOrigin,
    Owner,
    Tokenizer,
    load_tokenizer,
)
from kvcanary.canaries.alphabet import DEFAULT_ALPHABET, Alphabet, alphabet_for
from kvcanary.canaries.errors import ConfigError, RunIncomplete
from kvcanary.canaries.guarantee import PageGuarantee, page_guarantee
from kvcanary.harness.detectors.content import ContentDetector
from kvcanary.harness.detectors.protocol import ProtocolDetector
from kvcanary.harness.detectors.timing import TimingDetector
from kvcanary.harness.record.events import Limits, RunStarted
from kvcanary.harness.run.keyring import EarlierRuns, KeyEntry, Keyring, run_key
from kvcanary.harness.run.progress import ProgressDisplay
from kvcanary.harness.run.seams import Detectors, TimingChecker
from kvcanary.harness.target import calibration
from kvcanary.harness.target.calibration import PromptTokenOffset
from kvcanary.harness.target.client import TargetClient, make_http_client
from kvcanary.harness.target.http_client import DEFAULT_BACKEND, Backend
from kvcanary.harness.target.limits import limits_from_facts
from kvcanary.harness.target.server_info import EngineFacts, read_engine_facts
from kvcanary.harness.target.urls import server_root
from kvcanary.tenants.plan import ApiStyle
from kvcanary.tenants.planner import request_id
from kvcanary.tenants.size import input_limit
from kvcanary.tenants.tenant import Tenant

MAX_RESPONSE_BYTES = 1024 * 1024
"""Per-response bound: far more than any answer a run asks for (at most tens of tokens)."""
CONNECT_TIMEOUT_S = 10.0
WRITE_TIMEOUT_S = 60.0
_YOUNG_OBJECTS = 50_000
"""During a run, the garbage collector's first threshold (`frozen_heap`; the default is 700)."""


# -- before the target -----------------------------------------------------------------


def local_tokenizer(spec: str, where: str) -> Tokenizer:
    """A tokenizer by name or path; `where` names the setting in the error (`--tokenizer`)."""
    try:
        return load_tokenizer(spec)
    except CanaryError as exc:
        raise ConfigError(f"{where} {spec}: {exc}") from None


def lacing(tokenizer: Tokenizer, page_size: int, *, strict: bool) -> tuple[Alphabet, PageGuarantee]:
    """The tokenizer's canary alphabet and what `page_size` guarantees with it; with
    `strict` (`--strict-page-size`), a `ConfigError` when pages cannot each hold a canary.
    Counts tokens: with a server tokenizer, call it from a worker thread."""
    alphabet = alphabet_for(tokenizer)
    num_tokens = CanaryMinter.random(alphabet=alphabet).num_tokens(tokenizer)
    try:
        return alphabet, page_guarantee(num_tokens, page_size, strict=strict)
    except CanaryError as exc:
        raise ConfigError(f"--page-size {page_size}: {exc} (--strict-page-size)") from None


def check_credentials(tenants: Sequence[Tenant]) -> None:
    """A missing credential variable is a usage error, raised before any I/O."""
    for tenant in tenants:
        tenant.auth_headers()


@contextlib.contextmanager
def bundled_engine(
    preset: str,
    *,
    fixes: Sequence[str] = (),
    overrides: Mapping[str, Any] | None = None,
    processes: bool = True,
    display: ProgressDisplay | None = None,
) -> Iterator[str]:
    """The bundled reference engine on a free loopback port; yields its base URL.

    Separate processes by default: the engine's Python never competes with the harness for
    one GIL, which keeps its TTFT honest, and KV pages cross a real socket between the sides.
    """
    from kvcanary.reference_engine.availability import require_engine

    require_engine(
        "a run without --target", alternative="test a running deployment with --target URL"
    )
    from kvcanary.reference_engine.server.launch import running_engine

    settings = dict(overrides or {})
    described = [f"fix {fix}" for fix in fixes]
    described += [_describe_setting(k, v) for k, v in settings.items()]
    note = display.note if display is not None else _silent
    note(f"starting the bundled reference engine ({', '.join([preset, *described])})")
    with running_engine(preset, fixes=tuple(fixes), processes=processes, **settings) as engine:
        note(f"engine listening at {engine.base_url}; {engine.attention}")
        yield str(engine.base_url)
    note("engine stopped")


def _describe_setting(name: str, value: Any) -> str:
    if value is True:
        return f"{name.replace('_', ' ')} on"
    return f"{name}={value}"


def _silent(_: str) -> None:
    pass


# -- first contact ---------------------------------------------------------------------


def http_client(
    max_in_flight: int,
    read_timeout_s: float,
    transport: httpx.AsyncBaseTransport | None = None,
    backend: Backend = DEFAULT_BACKEND,
) -> httpx.AsyncClient:
    """The run's HTTP client (`transport` replaces the network, for tests)."""
    timeout = httpx.Timeout(
        connect=CONNECT_TIMEOUT_S, read=read_timeout_s, write=WRITE_TIMEOUT_S, pool=None
    )
    if transport is not None:
        return httpx.AsyncClient(transport=transport, timeout=timeout)
    return make_http_client(max_concurrency=max_in_flight, timeout=timeout, backend=backend)


@dataclass(frozen=True, slots=True)
class Contact:
    """What the target said about itself, merged with what the user declared."""

    base_url: str
    facts: EngineFacts
    limits: Limits
    model: str


async def contact(
    http: httpx.AsyncClient,
    base_url: str,
    tenant: Tenant,
    *,
    pool_tokens: int | None,
    context_tokens: int | None,
    page_size: int | None,
    model: str | None,
    how_to_name_model: str,
    display: ProgressDisplay,
) -> Contact:
    """Read the target's facts; raises `RunIncomplete` when it cannot be reached and
    `ConfigError` when its limits or model are unknown and were not given. A base URL given
    as OpenAI clients take it (`.../v1`) is read as the server's root, said once."""
    base_url = server_root(base_url, display.note)
    facts = await read_engine_facts(
        http,
        base_url,
        headers=tenant.auth_headers(),
        model_known=model is not None,
        limits_known=pool_tokens is not None and context_tokens is not None,
        on_wait=display.note,
    )
    if not facts.reachable:
        errors = [a.error for a in facts.attempts if a.error]
        why = errors[0] if errors else "no response"
        raise RunIncomplete(f"cannot reach the target at {base_url}: {why}")
    limits = limits_from_facts(
        facts, pool_tokens=pool_tokens, context_tokens=context_tokens, page_size=page_size
    )
    name = model or facts.model
    if name is None:
        # kvcanary's own words about the read (`discovery_fetch`), never the target's text
        read = [a.error for a in facts.attempts if a.url.endswith("/v1/models") and a.error]
        lists = f"lists no model ({read[0]})" if read else "lists no model"
        raise ConfigError(f"{base_url}/v1/models {lists}; {how_to_name_model}")
    display.note(
        f"target {base_url} ({facts.engine}), model {name}: pool {limits.pool_tokens} "
        f"tokens, context {limits.context_tokens}, page {limits.page_size} [{limits.source}]"
    )
    return Contact(base_url, facts, limits, name)


async def calibrate(
    http: httpx.AsyncClient,
    target: Contact,
    api: ApiStyle,
    tokenizer: Tokenizer,
    tenant: Tenant,
    *,
    chat_overhead_tokens: int,
    display: ProgressDisplay,
) -> PromptTokenOffset | None:
    """The tokens the server adds to every prompt (BOS, ...), measured at two lengths
    (`harness.target.calibration`); None where nothing was measured. Raises
    `TokenizerMismatch` (exit 2) when the tokenizer does not count like the target."""
    requests = calibration.Calibrator(
        http, target.base_url, target.model, api, tokenizer, tenant, chat_overhead_tokens
    )
    return await calibration.calibrate(
        requests, limit_tokens=input_limit(target.limits), note=display.note
    )


def target_client(
    http: httpx.AsyncClient, base_url: str, model: str, deadline_s: float
) -> TargetClient:
    """The client every request of a run is sent through (in a Ray actor too)."""
    return TargetClient(
        http, base_url, model=model, max_response_bytes=MAX_RESPONSE_BYTES, deadline_s=deadline_s
    )


# -- canaries, detectors, journal ------------------------------------------------------


def canary_minter(
    seed: int,
    run_id: str,
    *,
    seeded: bool,
    keyring: Keyring | None = None,
    tenants: Sequence[Tenant] = (),
    alphabet: Alphabet = DEFAULT_ALPHABET,
    key: bytes | None = None,
) -> CanaryMinter:
    """A given seed makes the whole run reproducible, canary key included; without one the
    key is random and never leaves this process (but as a call argument to the run's Ray
    actors, `--ray`), unless a `keyring` (`--keyring`) is given: then the key is stored
    there, with the run id and the tenants' names, before any canary is sent. The
    `alphabet` is the tokenizer's (`canaries.alphabet.alphabet_for`); `key`: the run's key
    (`keyring.run_key`), where the caller keeps it."""
    key = run_key(seed, run_id, seeded=seeded) if key is None else key
    minter = CanaryMinter(key, alphabet=alphabet)
    if keyring is not None:
        entry = KeyEntry.of(key, minter, run_id, [t.name for t in tenants])
        keyring.remember(minter.key_id, entry)
    return minter


def owner_of(tenants: Sequence[Tenant]) -> Callable[[CanaryOrigin], Owner | None]:
    """Attribute a canary that left the live index, from its decoded origin."""

    def owner(origin: CanaryOrigin) -> Owner | None:
        if not 0 <= origin.tenant < len(tenants):
            return None
        return Owner(tenants[origin.tenant].name, request_id(origin.tenant, origin.request))

    return owner


def detectors(
    index: CanaryIndex,
    limits: Limits,
    *,
    keep_raw_evidence: bool,
    timing: TimingChecker | None = None,
    calibration: PromptTokenOffset | None = None,
    earlier_runs: EarlierRuns | None = None,
) -> Detectors:
    """Content (other tenants' canaries; earlier runs' too, with `earlier_runs`), protocol
    (what was accepted) and timing."""
    offsets: dict[str, int] | None = None
    if calibration is not None:
        offsets = {calibration.api: calibration.offset}
    return Detectors(
        ContentDetector(index, redact_excerpts=not keep_raw_evidence, earlier_runs=earlier_runs),
        ProtocolDetector(limits, prompt_token_offsets=offsets),
        timing if timing is not None else TimingDetector(),
    )


def run_started(
    contact: Contact,
    *,
    run_id: str,
    api: str,
    tenants: Sequence[Tenant],
    seed: int,
    minter: CanaryMinter,
    settings: dict[str, Any],
    guarantee: PageGuarantee | None = None,
) -> RunStarted:
    """The journal's first record: who ran what against which target, with which versions."""
    from importlib import metadata

    return RunStarted(
        run_id=run_id,
        target=contact.base_url,
        model=contact.model,
        api=api,
        limits=contact.limits,
        tenants=tuple(t.to_record() for t in tenants),
        seed=seed,
        canary_key_id=minter.key_id,
        canaries={
            **minter.alphabet.describe(),
            "num_words": minter.num_words,
            **(guarantee.to_dict() if guarantee is not None else {}),
        },
        settings=settings,
        versions={"kvcanary": metadata.version("kvcanary"), "httpx": httpx.__version__},
        t_wall=datetime.now(UTC).timestamp(),
    )


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Keep the garbage collector from walking everything built so far during the run.

    A full collection over a large heap pauses the event loop for tens of milliseconds, and
    a pause while a response is streaming lands in its time to first token. Freezing moves
    the objects that exist now out of the collector's reach (vLLM's bench does the same).
    The young generation is collected after `_YOUNG_OBJECTS` new objects instead of 700:
    each request allocates hundreds of short-lived containers (parsed SSE events, records)
    and at the default the collector walked them ~100 times a second, ~28 µs a request
    (`benchmarks/bench_run.py`); what a run keeps grows by a few dozen objects a request,
    so cyclic garbage is still collected every few thousand requests.
    """
    gc.collect()
    gc.freeze()
    thresholds = gc.get_threshold()
    gc.set_threshold(_YOUNG_OBJECTS, *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()

"""Counting tokens the way the target does: its own tokenize route, and its chat template.

`choose_tokenizer` decides what counts a run's prompts. `--tokenizer server` is the target's
tokenize route; a name or a path is that tokenizer; `auto` (the default) is the target's
own where it serves a tokenize route (vLLM, SGLang, llama.cpp) and `FALLBACK_TOKENIZER`
elsewhere. Where the fallback gives the very token ids the route gives on calibration-shaped
text (the bundled engine counts in cl100k_base), it counts locally, without a request per
prompt. Whatever is chosen, calibration (`harness.target.calibration`) then checks that it
counts like the target's usage does.

`--tokenizer server` builds prompts in the target's tokenizer. `canaries.RemoteTokenizer`
speaks the tokenize routes (SGLang `/v1/tokenize`, vLLM `/tokenize`, llama.cpp `/tokenize`
with `content`) asynchronously and checks at start that the counts are plausible, while
the planner counts synchronously; `ServerTokenizer` bridges the two by running each call on
the session's event loop and blocking a worker thread on it, which is why the runner builds
plans in a worker thread. The canary pieces are measured once per process (a few thousand
tokenize requests); after that a prompt costs one request.

`chat_overhead` measures how many tokens the target's chat template adds around a user
message, so chat prompts can be built to an exact total as well.

This module knows nothing about plans, runs or detectors.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

import httpx

from kvcanary.canaries import TAG, CanaryError, RemoteTokenizer, Tokenizer
from kvcanary.canaries.errors import ConfigError, RunIncomplete
from kvcanary.canaries.remote_tokenizer import Post
from kvcanary.harness.target.bounded import ResponseTooLarge, StreamViolation, loads
from kvcanary.harness.target.calibration import CALIBRATION_TEXT, calibration_text
from kvcanary.harness.target.discovery_fetch import post_bounded
from kvcanary.harness.target.server_facts import as_int
from kvcanary.harness.target.sse_stream import MAX_TOKEN_COUNT
from kvcanary.tenants.planner import CHAT_INSTRUCTION
from kvcanary.tenants.tenant import Tenant

T = TypeVar("T")

AUTO = "auto"
"""The `--tokenizer` default: the target's own where it serves a tokenize route."""
FALLBACK_TOKENIZER = "cl100k_base"
"""What `auto` counts with against a target without a tokenize route."""
SERVER = "server"
AUTO_DETECT_TIMEOUT_S = 10.0
"""Each exchange of `auto`'s look for a tokenize route (a missing route answers at once)."""


def local_tokenizer_name(setting: str) -> str | None:
    """The tokenizer to load before the target is contacted: `--tokenizer` itself, the
    fallback for `auto`, None for `server`."""
    if setting == SERVER:
        return None
    return FALLBACK_TOKENIZER if setting == AUTO else setting


async def choose_tokenizer(
    http: httpx.AsyncClient,
    base_url: str,
    model: str,
    tenant: Tenant,
    *,
    local: Tokenizer | None,
    auto: bool,
    note: Callable[[str], None],
) -> tuple[Tokenizer, RemoteTokenizer | None]:
    """The tokenizer a run counts with, and the target's tokenize route where one is used
    (the chat template is measured through it). `local` is the `--tokenizer` loaded
    (`local_tokenizer_name`), None for `server`; with `auto`, the target's own is preferred.
    `note` hears one line of what was chosen. Call it on the session's loop."""
    loop = asyncio.get_running_loop()
    if local is None:
        named = await remote_tokenizer(http, base_url, model, tenant)
        note(_SERVER_NOTE)
        return ServerTokenizer(named, loop, base_url), named
    if not auto:
        return local, None
    remote = await _served_tokenizer(http, base_url, model, tenant)
    if remote is None:
        note(
            f"tokenizer: {local.name} (the target serves no tokenize route; calibration "
            "checks that it counts like the target; --tokenizer names the model's)"
        )
        return local, None
    route = f"{remote.endpoint} ({remote.style})"
    if await _counts_alike(remote, local):
        note(f"tokenizer: {local.name}, which counts as the target's own {route} does")
        return local, remote
    note(f"tokenizer: the target's own, {route}; {_SERVER_NOTE.removeprefix('tokenizer: ')}")
    return ServerTokenizer(remote, loop, base_url), remote


_SERVER_NOTE = (
    "tokenizer: the target's own; the first plan waits for a few thousand tokenize "
    "requests that measure the canary pieces once"
)


async def _served_tokenizer(
    http: httpx.AsyncClient, base_url: str, model: str, tenant: Tenant
) -> RemoteTokenizer | None:
    """The target's tokenize route if it serves one whose counts are plausible, else None."""
    remote = RemoteTokenizer(
        http,
        base_url,
        headers=tenant.auth_headers(),
        model=model,
        post=bounded_post(http),
        timeout_s=AUTO_DETECT_TIMEOUT_S,
    )
    try:
        await remote.detect()
    except (CanaryError, httpx.HTTPError):
        return None
    return remote


async def _counts_alike(remote: RemoteTokenizer, local: Tokenizer) -> bool:
    """Whether `local` gives the route's token ids on calibration-shaped text (canary
    words, digits, accents): then it is the same tokenizer, and counts without requests."""
    for text in (CALIBRATION_TEXT, calibration_text(8)):
        try:
            if await remote.encode(text) != local.encode(text):
                return False
        except (CanaryError, httpx.HTTPError):
            return False
    return True


async def remote_tokenizer(
    http: httpx.AsyncClient, base_url: str, model: str, tenant: Tenant
) -> RemoteTokenizer:
    """The target's tokenize route, its convention detected and its counts checked now
    (ConfigError naming every endpoint tried when none counts plausibly: 0 tokens for
    non-empty text, or a count that does not grow with the text)."""
    remote = RemoteTokenizer(
        http, base_url, headers=tenant.auth_headers(), model=model, post=bounded_post(http)
    )
    try:
        await remote.detect()
    except (CanaryError, httpx.HTTPError) as exc:
        raise ConfigError(
            f"--tokenizer server: {base_url} has no usable tokenize route ({exc}); give a "
            "tokenizer name or a tokenizer.json path"
        ) from None
    return remote


KEEPALIVE_RACE = "without sending a response"
"""httpx's words for a connection closed before one byte of an answer arrived."""


def bounded_post(http: httpx.AsyncClient) -> Post:
    """`RemoteTokenizer`'s reads bounded as every other read of a target's answer is: a
    compressed answer inflated within the byte bound (`post_bounded`), a bound passed or a
    broken encoding a `CanaryError`."""

    async def post(
        url: str, body: Mapping[str, Any], headers: Mapping[str, str], max_bytes: int
    ) -> tuple[int, bytes]:
        try:
            try:
                return await post_bounded(
                    http, url, json_body=body, headers=headers, max_bytes=max_bytes
                )
            except httpx.RemoteProtocolError as exc:
                if KEEPALIVE_RACE not in str(exc):
                    raise
                # a kept-alive connection the server closed as it was reused (llama.cpp does,
                # `harness.target.keepalive`): tokenizing changes nothing, so once more
                return await post_bounded(
                    http, url, json_body=body, headers=headers, max_bytes=max_bytes
                )
        except ResponseTooLarge:
            raise CanaryError(
                f"{url} answered with more than {max_bytes} bytes; not read"
            ) from None
        except StreamViolation as exc:
            raise CanaryError(f"{url}: {exc}") from None

    return post


class ServerTokenizer:
    """The target's tokenizer (`canaries.RemoteTokenizer`) behind the planner's synchronous
    `Tokenizer` interface.

    Each call blocks its thread on a coroutine run by the session's event loop, so calls
    must come from another thread: the runner builds plans in a worker thread. Counting is
    all prompt building needs; `decode` is not offered by a tokenize route.
    """

    vocab_size = 0
    """Unknown over HTTP; with `name` it only keys the per-tokenizer cost cache."""

    def __init__(
        self, remote: RemoteTokenizer, loop: asyncio.AbstractEventLoop, base_url: str
    ) -> None:
        self.name = f"server:{base_url}"
        self._remote = remote
        self._loop = loop
        self._loop_thread = threading.get_ident()

    def encode(self, text: str) -> list[int]:
        return self._wait(self._remote.encode, text)

    def count(self, text: str) -> int:
        return self._wait(self._remote.count, text)

    def decode(self, ids: Sequence[int]) -> str:
        raise CanaryError("the target's tokenize route counts tokens; it cannot decode them")

    def _wait(self, call: Callable[[str], Coroutine[Any, Any, T]], text: str) -> T:
        assert threading.get_ident() != self._loop_thread, "would block the loop it waits on"
        try:
            return asyncio.run_coroutine_threadsafe(call(text), self._loop).result()
        except httpx.HTTPError as exc:
            raise RunIncomplete(f"the target's tokenize route failed: {exc!r}") from None
        except CanaryError as exc:
            raise RunIncomplete(f"the target's tokenize route failed: {exc}") from None


_NO_USAGE = (httpx.HTTPError, ResponseTooLarge, StreamViolation, ValueError, LookupError, TypeError)
"""What a chat answer without a usable `usage.prompt_tokens` raises while it is read."""


async def chat_overhead(
    http: httpx.AsyncClient,
    base_url: str,
    model: str,
    tokenizer: Tokenizer,
    remote: RemoteTokenizer | None,
    tenant: Tenant,
) -> int:
    """Tokens the target's chat template adds around a planned message.

    vLLM's tokenize route renders the template itself. Otherwise one tiny chat request is
    sent and its `usage.prompt_tokens` compared with the message's own count; the message
    starts and ends like every planned chat prompt (a canary tag, then the planner's
    instruction), so the template's boundary tokens are the same.
    """
    if remote is not None:
        with contextlib.suppress(CanaryError, httpx.HTTPError):
            return await remote.chat_overhead(model)
    message = f" {TAG}{CHAT_INSTRUCTION}"
    body = {
        "model": model,
        "messages": [{"role": "user", "content": message}],
        "max_tokens": 1,
        "stream": False,
    }
    url = f"{base_url.rstrip('/')}/v1/chat/completions"
    try:
        _, content = await post_bounded(http, url, json_body=body, headers=tenant.auth_headers())
        prompt_tokens = as_int(loads(content)["usage"]["prompt_tokens"])
        if prompt_tokens is None or prompt_tokens > MAX_TOKEN_COUNT:
            raise ValueError("usage.prompt_tokens is not a token count")
    except _NO_USAGE as exc:
        raise ConfigError(
            f"cannot measure the chat template's size at {url} ({type(exc).__name__}: no "
            "usage in its answer); use --api completions"
        ) from None
    overhead = prompt_tokens - await asyncio.to_thread(tokenizer.count, message)
    if overhead < 0:
        raise ConfigError(
            f"{url} counts fewer tokens than --tokenizer {tokenizer.name} does; "
            "give the model's tokenizer (--tokenizer PATH/tokenizer.json)"
        )
    return overhead

"""Calibration: the tokens a target adds to every prompt of one API, measured at start, and
the check that the run's tokenizer counts like the target at all.

A server counts more than the prompt's own tokens: llama.cpp (and most Llama-family
deployments) prepend a BOS token to every completions prompt, so `usage.prompt_tokens` is
`sent + 1` on every answer; a chat template adds its own tokens around the message. Short
requests per API, shaped like the planned prompts (a leading space and the canary tag first,
the chat instruction last), give the offset:

    offset = usage.prompt_tokens (as the server reports it) - tokens counted for that request

where the count is the tokenizer's, plus the chat template's overhead for chat prompts when
the planner already counts it (`chat_overhead_tokens`). `calibrate` measures it at two
lengths (a short prompt and one of a few hundred tokens, canary-shaped words, digits and
accents in it). A constant offset is what a server adds (BOS, a template) and is corrected:
the protocol detector compares each answer's usage net of it
(`ProtocolDetector(prompt_token_offsets=...)`) and names it in a `prompt_tokens_mismatch`.
An offset that changes with the length, or a server count below the tokenizer's, is the
wrong tokenizer: every answer of the run would be a false mismatch, so the run stops before
it starts with one line naming `--tokenizer` (`TokenizerMismatch`, exit 2). Both prompts
are far below any limit, so a target that misreports usage only for over-long prompts (the
incident) calibrates normally.

What it does not do: decide sizes (the planner) or choose the tokenizer
(`harness.target.tokenizer`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from kvcanary.canaries import TAG, Tokenizer
from kvcanary.canaries.errors import ConfigError
from kvcanary.canaries.redact import redact_quote, scrub_secrets
from kvcanary.canaries.shape import WORDS
from kvcanary.harness.record.events import Limits
from kvcanary.harness.target.bounded import ResponseTooLarge, StreamViolation, loads
from kvcanary.harness.target.discovery_fetch import post_bounded
from kvcanary.harness.target.sse_stream import MAX_TOKEN_COUNT
from kvcanary.tenants.plan import ApiStyle
from kvcanary.tenants.planner import CHAT_INSTRUCTION
from kvcanary.tenants.tenant import Tenant

_OPENING = f" {TAG} The river was quiet."
_CLOSING = f"\n\n{CHAT_INSTRUCTION}"
CALIBRATION_TEXT = _OPENING + _CLOSING
"""Starts like every planned prompt (its canary tag) and ends like a chat prompt (the
planner's instruction), so the tokens a server or template adds at each end are the same."""
_SENTENCES = (
    "The road ran on past the mill, and nobody stopped.",
    "Figures like 4096, 1.5e3 and 2,048 appear in logs.",
    "A naïve café-owner wrote “déjà vu” on the board — twice!",
    "def f(x): return x**2  # squares, 100% of the time",
)
LONG_TOKENS = 384
"""The longer calibration prompt's size (at most half the limit): long enough that a
tokenizer off by a few percent is off by more than any constant a server adds."""
MIN_GROUPS = 2
"""The fewest groups a longer calibration prompt has (some 40 tokens past the short one)."""
CALIBRATION_TIMEOUT_S = 30.0
"""For each calibration request; a target slower than this is run without the correction."""
MAX_UNCONFIRMED_OFFSET = 16
"""A server adds a BOS token, maybe a few more: an offset measured at one length only
(the longer prompt could not be sent) is corrected only up to this."""
_PATHS: dict[ApiStyle, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class TokenizerMismatch(ConfigError):
    """The target counts prompts differently from the run's tokenizer, by more than a
    constant: no offset corrects it, every answer would read as a mismatch (exit 2)."""


def calibration_text(num_groups: int = 0) -> str:
    """A calibration prompt: `CALIBRATION_TEXT` with `num_groups` canary-shaped groups and
    sentences between its opening and its closing (each some 20-25 tokens)."""
    groups = []
    for group in range(num_groups):
        words = " ".join(WORDS[(group * 61 + i * 389) % len(WORDS)] for i in range(6))
        groups.append(f" {TAG} {words}. {_SENTENCES[group % len(_SENTENCES)]}")
    return _OPENING + "".join(groups) + _CLOSING


@dataclass(frozen=True, slots=True)
class PromptTokenOffset:
    """What one calibration request measured for one API."""

    api: ApiStyle
    url: str
    num_counted: int
    """The request's prompt tokens as kvcanary counts them (chat: template overhead included)."""
    num_reported: int | None
    """`usage.prompt_tokens` of the answer; None when it carried none."""
    longer: tuple[int, int] | None = None
    """(counted, reported) of the longer prompt that confirmed the offset is constant."""

    @property
    def offset(self) -> int:
        """Tokens the server adds to every prompt of this API (0 when nothing was reported)."""
        return 0 if self.num_reported is None else self.num_reported - self.num_counted

    def describe(self) -> str:
        if self.num_reported is None:
            return f"{self.api}: {self.url} reported no usage; no offset applied"
        sizes = f"{self.num_reported} reported for {self.num_counted} sent"
        if self.longer is not None:
            sizes += f", {self.longer[1]} for {self.longer[0]}"
        return (
            f"{self.api}: the server counts {self.offset:+d} token(s) on every prompt "
            f"({sizes}, {self.url})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "offset": self.offset}


async def measure_prompt_token_offset(
    http: httpx.AsyncClient,
    base_url: str,
    model: str,
    api: ApiStyle,
    tokenizer: Tokenizer,
    tenant: Tenant,
    *,
    chat_overhead_tokens: int = 0,
    text: str = CALIBRATION_TEXT,
) -> PromptTokenOffset:
    """Send one `api` request of `text` and compare its `usage.prompt_tokens` with the count.

    `chat_overhead_tokens` is what the planner adds for the chat template (0 for
    completions). A request that fails or answers without JSON is a `ConfigError` (the target
    cannot serve the run's API); an answer without usage measures nothing (offset 0); a
    server count below the tokenizer's is a `TokenizerMismatch`.
    """
    if api not in _PATHS:
        raise ConfigError(f"calibration: unknown API {api!r}")
    url = base_url.rstrip("/") + _PATHS[api]
    body: dict[str, Any] = {"model": model, "max_tokens": 1, "temperature": 0, "stream": False}
    if api == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    # a server tokenizer blocks its thread on this loop, so count from another thread
    counted = await asyncio.to_thread(tokenizer.count, text)
    counted += chat_overhead_tokens if api == "chat" else 0
    try:
        status, content = await post_bounded(
            http, url, json_body=body, headers=tenant.auth_headers()
        )
    except (httpx.HTTPError, ResponseTooLarge, StreamViolation) as exc:
        raise ConfigError(f"calibration request to {url} failed ({exc!r})") from None
    # the body is the target's text (perhaps another customer's): a length and a hash of it
    text = content[:200].decode("utf-8", errors="replace")
    if status != 200:
        raise ConfigError(
            redact_quote(f"calibration request to {url} answered HTTP {status}: {text!r}")
        )
    try:
        answer = loads(content)
    except StreamViolation:
        raise ConfigError(
            redact_quote(f"calibration request to {url} answered 200 without JSON: {text!r}")
        ) from None
    result = PromptTokenOffset(api, url, counted, _prompt_tokens(answer))
    if result.offset < 0:
        raise TokenizerMismatch(
            f"{url} counts {result.num_reported} prompt tokens where --tokenizer "
            f"{tokenizer.name} counts {counted}: {_NAME_IT}"
        )
    return result


_NAME_IT = (
    "give the model's tokenizer (--tokenizer PATH/tokenizer.json, or --tokenizer server "
    "where the target serves a tokenize route)"
)


async def calibrate(
    measure: Calibrator, *, limit_tokens: int, note: Callable[[str], None]
) -> PromptTokenOffset | None:
    """The tokens the server adds to every prompt of `measure`'s API, measured at two
    lengths below `limit_tokens`; None where nothing could be measured (then nothing is
    corrected; the run itself shows what the target does). `TokenizerMismatch` when the
    counts disagree by more than a constant. `note` hears one line of what was found."""
    tokenizer = measure.tokenizer
    try:
        short = await measure(CALIBRATION_TEXT)
    except (ConfigError, TimeoutError) as exc:
        if isinstance(exc, TokenizerMismatch):
            raise
        note(f"calibration: not measured ({measure.why(exc)}); no offset applied")
        return None
    if short.num_reported is None:
        note(f"calibration: {short.describe()}")
        return short
    longer, why_not = await _longer(measure, short, limit_tokens)
    if longer is None:
        if abs(short.offset) > MAX_UNCONFIRMED_OFFSET:
            note(
                f"calibration: {short.describe()}; not confirmed at a second length "
                f"({why_not}), and more than {MAX_UNCONFIRMED_OFFSET} tokens is no tokenizer "
                "convention, so nothing is corrected"
            )
            return None
        note(f"calibration: {short.describe()} (one length only: {why_not})")
        return short
    if longer.offset != short.offset:
        raise TokenizerMismatch(
            f"{short.url} counts prompts differently from --tokenizer {tokenizer.name}: "
            f"{short.num_reported} tokens for {short.num_counted} counted, "
            f"{longer.num_reported} for {longer.num_counted} (the difference changes with "
            f"the length, so no offset corrects it); {_NAME_IT}"
        )
    confirmed = dataclasses.replace(
        short, longer=(longer.num_counted, longer.num_counted + longer.offset)
    )
    note(f"calibration: {confirmed.describe()}")
    return confirmed


async def _longer(
    measure: Calibrator, short: PromptTokenOffset, limit_tokens: int
) -> tuple[PromptTokenOffset | None, str]:
    """The longer prompt's measurement, or None and why there is none.

    Sized to about half the limit as the *server* counts (the short prompt's reported count
    says how much more than the tokenizer it counts), and halved when the target refuses
    it: a wrong tokenizer undercounts, and a prompt over the limit measures nothing."""
    assert short.num_reported is not None
    wanted = min(LONG_TOKENS, limit_tokens // 2)
    wanted = wanted * short.num_counted // max(short.num_reported, short.num_counted)
    group = await measure.count(calibration_text(1)) - await measure.count(CALIBRATION_TEXT)
    num_groups = (wanted - short.num_counted) // max(group, 1)
    why = f"a limit of {limit_tokens} tokens leaves no room for a longer prompt"
    while num_groups >= MIN_GROUPS:
        try:
            longer = await measure(calibration_text(num_groups))
        except TokenizerMismatch:
            raise
        except TimeoutError as exc:
            return None, measure.why(exc)
        except ConfigError as exc:
            why, num_groups = measure.why(exc), num_groups // 2
            continue
        if longer.num_reported is None:
            return None, "its answer carried no usage"
        return longer, ""
    return None, why


@dataclasses.dataclass(frozen=True, slots=True)
class Calibrator:
    """Calibration requests to one target's API, counted with one tokenizer: one at a
    time, each bounded by `CALIBRATION_TIMEOUT_S` (`chat_overhead_tokens` as in
    `measure_prompt_token_offset`)."""

    http: httpx.AsyncClient
    base_url: str
    model: str
    api: ApiStyle
    tokenizer: Tokenizer
    tenant: Tenant
    chat_overhead_tokens: int

    async def __call__(self, text: str) -> PromptTokenOffset:
        async with asyncio.timeout(CALIBRATION_TIMEOUT_S):
            return await measure_prompt_token_offset(
                self.http,
                self.base_url,
                self.model,
                self.api,
                self.tokenizer,
                self.tenant,
                chat_overhead_tokens=self.chat_overhead_tokens,
                text=text,
            )

    async def count(self, text: str) -> int:
        return await asyncio.to_thread(self.tokenizer.count, text)

    def why(self, exc: Exception) -> str:
        """What failed, in one line without the tenant's credentials."""
        said = scrub_secrets(str(exc), list(self.tenant.secrets()))
        return said or f"no answer within {CALIBRATION_TIMEOUT_S:g} s"


def _prompt_tokens(answer: Any) -> int | None:
    usage = answer.get("usage") if isinstance(answer, dict) else None
    value = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    return value if 0 <= value <= MAX_TOKEN_COUNT else None


def planning_limits(limits: Limits, calibration: PromptTokenOffset | None) -> Limits:
    """The limits in kvcanary's own token count: a `limit-1` victim is then `limit-1` tokens
    as the server counts them (its added tokens included)."""
    offset = calibration.offset if calibration is not None else 0
    if offset == 0:
        return limits
    return dataclasses.replace(
        limits,
        pool_tokens=limits.pool_tokens - offset,
        context_tokens=limits.context_tokens - offset,
    )

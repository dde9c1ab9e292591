"""Counting tokens with the target server's own tokenizer, over HTTP.

Each engine has its own tokenize convention (`Convention`), all answering with the text's
token ids, none of them with the special tokens a request adds (BOS, chat template):

    sglang     POST /v1/tokenize  {"prompt": text, "add_special_tokens": false}
               -> {"tokens": [...], "count": N, "max_model_len": M}
    vllm       POST /tokenize     the same body and answer (also SGLang's native route);
               also takes {"messages": [...]} and renders the chat template
    llamacpp   POST /tokenize     {"content": text, "add_special": false,
               "with_pieces": false} -> {"tokens": [...]} (ids, or {"id", "piece"} objects)

`style="auto"` tries them in that order and keeps the first whose counts are *plausible*:
more than 0 tokens for non-empty text, and more for a longer text (llama.cpp answers the
others' body `{"prompt": ...}` with `200 {"tokens": []}`, which must not pass for a count).
An implausible count from a fixed style is a `CanaryError` naming the endpoint.

`chat_overhead` measures what vLLM's chat template adds around a user message; the other
routes have no chat form (the harness measures it from a calibration request instead).
The caller owns the `httpx.AsyncClient`; transport errors are httpx's, left to the caller;
a missing route, a malformed answer or an implausible count is a `CanaryError`.

A target's answer is hostile input, so every exchange is bounded: at most `max_bytes` of
body (`MAX_ANSWER_BYTES`), at most `timeout_s` for the whole exchange (a server that drips a
byte a second resets httpx's per-read timeout forever), JSON parsed without recursing into a
nesting bomb. Either bound passed is a `CanaryError` saying which. The body is read by a
`Post`: by default one that asks for `identity` and refuses a compressed answer rather than
inflate it; the harness passes its own (`harness.target.tokenizer.bounded_post`), which
inflates a compressed answer within the same byte bound, as the rest of its client does.
The target's error bodies are not quoted in messages: they are the target's text, and these
messages are printed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from kvcanary.canaries.errors import CanaryError
from kvcanary.canaries.shape import TAG, WORDS

Style = Literal["auto", "sglang", "vllm", "llamacpp"]
STYLES: tuple[Style, ...] = ("sglang", "vllm", "llamacpp")
# a user message shaped like kvcanary prompts: a leading space and the tag first
_PROBE = " ".join(["", TAG, *WORDS[:6], "The river was quiet."])
_SHORT = " The river was quiet."
_LONG = _SHORT * 4

MAX_ANSWER_BYTES = 1024 * 1024
"""A tokenize answer lists one id per token: 1 MiB is about 150,000 tokens of ids."""
TOKENIZE_TIMEOUT_S = 30.0
"""The most one tokenize exchange may take, whatever the client's per-read timeout."""

Post = Callable[[str, Mapping[str, Any], Mapping[str, str], int], Awaitable[tuple[int, bytes]]]
"""`post(url, json_body, headers, max_bytes) -> (status, body)`: one exchange, the body read
to at most `max_bytes` (else `CanaryError`); transport errors are httpx's."""


@dataclass(frozen=True, slots=True)
class Convention:
    """How one engine's tokenize route is called."""

    route: str
    text_field: str
    flags: Mapping[str, bool]


CONVENTIONS: dict[str, Convention] = {
    "sglang": Convention("/v1/tokenize", "prompt", {"add_special_tokens": False}),
    "vllm": Convention("/tokenize", "prompt", {"add_special_tokens": False}),
    "llamacpp": Convention("/tokenize", "content", {"add_special": False, "with_pieces": False}),
}


class RemoteTokenizer:
    """The token counts a server will see, from its tokenize route."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        base_url: str,
        *,
        style: Style = "auto",
        headers: Mapping[str, str] | None = None,
        model: str | None = None,
        post: Post | None = None,
        max_bytes: int = MAX_ANSWER_BYTES,
        timeout_s: float = TOKENIZE_TIMEOUT_S,
    ) -> None:
        if style != "auto" and style not in CONVENTIONS:
            raise CanaryError(f"tokenizer style must be auto, {', '.join(STYLES)}, got {style!r}")
        if not (max_bytes > 0 and timeout_s > 0):
            raise CanaryError(f"tokenize bounds must be positive, got {max_bytes} B, {timeout_s} s")
        self._client = client
        self._post_body = post if post is not None else identity_post(client)
        self._max_bytes = max_bytes
        client_read = client.timeout.read
        # never longer than the client would wait for one read
        self._timeout_s = min(timeout_s, client_read) if client_read else timeout_s
        self._base_url = base_url.rstrip("/")
        self._style: Style = style
        self._headers = dict(headers or {})
        self._model = model
        self._validated = False
        self._detecting = asyncio.Lock()
        self.max_model_len: int | None = None
        """The server's context length, as its last tokenize answer gave it."""

    @property
    def style(self) -> Style:
        """The convention in use once known; "auto" before the first answer."""
        return self._style

    @property
    def endpoint(self) -> str:
        """The tokenize URL in use (or the first to try, before detection)."""
        style = self._style if self._style != "auto" else STYLES[0]
        return self._base_url + CONVENTIONS[style].route

    async def detect(self) -> Style:
        """Find (or, for a fixed style, validate) the convention whose counts are plausible.

        The start-up check: a CanaryError naming every endpoint tried and what was wrong.
        """
        async with self._detecting:  # concurrent first calls detect once
            if self._validated:
                return self._style
            styles = STYLES if self._style == "auto" else (self._style,)
            problems: list[str] = []
            for style in styles:
                problem = await self._validate(style)
                if problem is None:
                    self._style, self._validated = style, True
                    return style
                problems.append(problem)
        raise CanaryError("no usable tokenize route: " + "; ".join(problems))

    async def encode(self, text: str) -> list[int]:
        """The server's token ids for `text`, without special tokens."""
        return await self._tokenize(text)

    async def count(self, text: str) -> int:
        """How many tokens the server makes of `text`, without special tokens."""
        tokens = await self._tokenize(text)
        if text and not tokens:
            raise CanaryError(f"{self.endpoint} counted 0 tokens for {len(text)} characters")
        return len(tokens)

    async def chat_overhead(self, model: str) -> int:
        """Tokens the chat template adds around one user message (with the generation
        prompt), measured as tokens(messages) - tokens(bare content). vLLM only."""
        if self._style == "auto":
            await self.detect()
        if self._style != "vllm":
            raise CanaryError(
                f"{self.endpoint} ({self._style}) does not render chat templates; measure "
                "the chat overhead from a request instead"
            )
        body = {
            "model": model,
            "messages": [{"role": "user", "content": _PROBE}],
            "add_generation_prompt": True,
        }
        status, answer = await self._post("/tokenize", body)
        if status >= 400:
            raise CanaryError(
                f"{self._base_url}/tokenize cannot tokenize chat messages "
                f"(HTTP {status}); declare the chat overhead in tokens instead"
            )
        with_template = len(self._parse("/tokenize", answer))
        bare = await self.count(_PROBE)
        overhead = with_template - bare
        if overhead < 0:
            raise CanaryError(f"chat template overhead came out negative ({overhead})")
        return overhead

    async def _validate(self, style: Style) -> str | None:
        """None if `style`'s route gives plausible counts; else what was wrong, in words."""
        url = self._base_url + CONVENTIONS[style].route
        try:
            short = len(await self._tokenize_as(style, _SHORT))
            long = len(await self._tokenize_as(style, _LONG))
        except CanaryError as exc:
            return f"{style}: {exc}"  # the message names the URL
        if short == 0:
            return f"{style}: {url} counted 0 tokens for non-empty text {_SHORT!r}"
        if long <= short:
            return (
                f"{style}: {url} counted {long} tokens for a text 4x as long as one of "
                f"{short} tokens (the count does not grow with the text)"
            )
        return None

    async def _tokenize(self, text: str) -> list[int]:
        if self._style == "auto":
            await self.detect()
        assert self._style != "auto"
        return await self._tokenize_as(self._style, text)

    async def _tokenize_as(self, style: Style, text: str) -> list[int]:
        convention = CONVENTIONS[style]
        body: dict[str, Any] = {convention.text_field: text, **convention.flags}
        if self._model is not None and style != "llamacpp":
            body = {"model": self._model, **body}
        status, answer = await self._post(convention.route, body)
        if status >= 400:
            raise CanaryError(
                f"{self._base_url}{convention.route} answered HTTP {status} "
                f"({len(answer)} bytes of error body)"
            )
        return self._parse(convention.route, answer)

    async def _post(self, route: str, body: dict[str, Any]) -> tuple[int, bytes]:
        url = self._base_url + route
        try:
            async with asyncio.timeout(self._timeout_s):
                return await self._post_body(url, body, self._headers, self._max_bytes)
        except TimeoutError:
            raise CanaryError(
                f"{url} sent no complete answer within {self._timeout_s:g} s"
            ) from None

    def _parse(self, route: str, answer: bytes) -> list[int]:
        url = self._base_url + route
        try:
            payload = json.loads(answer)
            tokens = [_token_id(t) for t in payload["tokens"]]
            count = int(payload.get("count", len(tokens)))
        except RecursionError:  # the C parser's own guard: a nesting bomb, refused
            raise CanaryError(f"{url} answered with JSON nested too deeply") from None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CanaryError(
                f"malformed tokenize answer from {url} ({len(answer)} bytes)"
            ) from exc
        if count != len(tokens):
            raise CanaryError(f"{url} counts {count} but lists {len(tokens)} tokens")
        if isinstance(payload.get("max_model_len"), int):
            self.max_model_len = payload["max_model_len"]
        return tokens


def identity_post(client: httpx.AsyncClient) -> Post:
    """The default `Post`: asks for the body uncompressed and reads at most `max_bytes` of it
    as it streams; a compressed answer is refused, not inflated (so no bomb can grow)."""

    async def post(
        url: str, body: Mapping[str, Any], headers: Mapping[str, str], max_bytes: int
    ) -> tuple[int, bytes]:
        request = client.build_request(
            "POST", url, json=body, headers={**headers, "Accept-Encoding": "identity"}
        )
        response = await client.send(request, stream=True)
        try:
            coding = response.headers.get("content-encoding", "identity").strip().lower()
            if coding not in ("", "identity"):
                raise CanaryError(f"{url} answered {coding}-compressed though asked not to")
            if response.is_stream_consumed:  # built in memory (a mock transport): whole
                answer = response.content
            else:
                buffer = bytearray()
                async for chunk in response.aiter_raw():
                    buffer += chunk
                    if len(buffer) > max_bytes:
                        break
                answer = bytes(buffer)
            if len(answer) > max_bytes:
                raise CanaryError(f"{url} answered with more than {max_bytes} bytes; not read")
            return response.status_code, answer
        finally:
            await response.aclose()

    return post


def _token_id(token: Any) -> int:
    """A token id as listed: an int, or llama.cpp's `{"id": ..., "piece": ...}`."""
    if isinstance(token, dict):
        return int(token["id"])
    if isinstance(token, bool):
        raise TypeError("a boolean is not a token id")
    return int(token)

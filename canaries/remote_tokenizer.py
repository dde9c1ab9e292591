"""Counting tokens with the target server's own tokenizer, over HTTP.

SGLang serves `POST /v1/tokenize` and vLLM `POST /tokenize`; both take
`{"prompt": text, "add_special_tokens": false}` and answer
`{"tokens": [...], "count": N, "max_model_len": M}`. vLLM's route also takes
`{"messages": [...]}` and renders the chat template, which is how `chat_overhead`
measures what a chat request adds around the user's text; SGLang's route has no chat
form, so there `chat_overhead` is a `CanaryError` and the caller declares the overhead.

`style="auto"` tries SGLang's route first and falls back to vLLM's on 404/405, then
remembers which one answered. The caller owns the `httpx.AsyncClient` (timeouts, limits,
transport: tests pass `httpx.MockTransport`). Transport errors are httpx's, left to the
caller; a missing route or a malformed answer is a `CanaryError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import httpx

from canaries.errors import CanaryError
from canaries.shape import TAG, WORDS

Style = Literal["auto", "sglang", "vllm"]
_ROUTES: dict[str, str] = {"sglang": "/v1/tokenize", "vllm": "/tokenize"}
# a user message shaped like kvcanary prompts: a leading space and the tag first
_PROBE = " ".join(["", TAG, *WORDS[:6], "The river was quiet."])


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
    ) -> None:
        if style not in ("auto", "sglang", "vllm"):
            raise CanaryError(f"tokenizer style must be auto, sglang or vllm, got {style!r}")
        self._client = client
        self._base_url = base_url.rstrip("/")
        self._style: Style = style
        self._headers = dict(headers or {})
        self._model = model
        self.max_model_len: int | None = None
        """The server's context length, as its last tokenize answer gave it."""

    @property
    def style(self) -> Style:
        """ "sglang" or "vllm" once known; "auto" before the first answer."""
        return self._style

    async def encode(self, text: str) -> list[int]:
        """The server's token ids for `text`, without special tokens."""
        tokens, _ = await self._tokenize({"prompt": text, "add_special_tokens": False})
        return tokens

    async def count(self, text: str) -> int:
        """How many tokens the server makes of `text`, without special tokens."""
        _, count = await self._tokenize({"prompt": text, "add_special_tokens": False})
        return count

    async def chat_overhead(self, model: str) -> int:
        """Tokens the chat template adds around one user message (with the generation
        prompt), measured as tokens(messages) - tokens(bare content). vLLM only."""
        if self._style == "sglang":
            raise CanaryError(
                "SGLang's /v1/tokenize does not render chat templates; declare the chat "
                "overhead in tokens instead"
            )
        body = {
            "model": model,
            "messages": [{"role": "user", "content": _PROBE}],
            "add_generation_prompt": True,
        }
        response = await self._post("/tokenize", body)
        if response.status_code >= 400:
            raise CanaryError(
                f"{self._base_url}/tokenize cannot tokenize chat messages "
                f"(HTTP {response.status_code}); declare the chat overhead in tokens instead"
            )
        _, with_template = self._parse(response)
        bare = await self.count(_PROBE)
        overhead = with_template - bare
        if overhead < 0:
            raise CanaryError(f"chat template overhead came out negative ({overhead})")
        return overhead

    async def _tokenize(self, body: dict[str, Any]) -> tuple[list[int], int]:
        if self._model is not None:
            body = {"model": self._model, **body}
        styles = ("sglang", "vllm") if self._style == "auto" else (self._style,)
        for style in styles:
            response = await self._post(_ROUTES[style], body)
            if response.status_code in (404, 405) and style != styles[-1]:
                continue
            if response.status_code >= 400:
                raise CanaryError(
                    f"{self._base_url}{_ROUTES[style]} answered HTTP {response.status_code}: "
                    f"{response.text[:200]}"
                )
            self._style = style  # type: ignore[assignment]
            return self._parse(response)
        raise AssertionError("unreachable: the last style either answers or raises")

    async def _post(self, route: str, body: dict[str, Any]) -> httpx.Response:
        return await self._client.post(self._base_url + route, json=body, headers=self._headers)

    def _parse(self, response: httpx.Response) -> tuple[list[int], int]:
        try:
            payload = response.json()
            tokens = [int(t) for t in payload["tokens"]]
            count = int(payload.get("count", len(tokens)))
        except (ValueError, KeyError, TypeError) as exc:
            raise CanaryError(
                f"malformed tokenize answer from {response.request.url}: {response.text[:200]}"
            ) from exc
        if count != len(tokens):
            raise CanaryError(f"tokenize answer counts {count} but lists {len(tokens)} tokens")
        if isinstance(payload.get("max_model_len"), int):
            self.max_model_len = payload["max_model_len"]
        return tokens, count

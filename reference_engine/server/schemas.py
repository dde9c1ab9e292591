"""Request bodies of the OpenAI-compatible API, and the chat template.

Bodies are permissive the way SGLang's are: unknown fields (temperature, top_p, seed, ...)
are accepted and ignored, because the reference model is deterministic. What the engine
needs is typed: the prompt, `max_tokens`, streaming options, `cache_salt`, and the router's
`bootstrap_host` / `bootstrap_port` / `bootstrap_room`. SGLang's native `/generate` body
(`text` or `input_ids`, `sampling_params.max_new_tokens`) shares the same fields.

The chat template is deliberately plain text, so that a client can count a chat prompt's
tokens exactly without the server: every message renders as `"{role}: {content}\\n"`, in
order, followed by the generation prompt `"assistant:"`. A message whose content is a list
of parts contributes the concatenation of its `text` parts.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEFAULT_MAX_TOKENS = 16
"""`max_tokens` when a request gives none (OpenAI's completions default)."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False


class _GenerationBody(_Body):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1, description="only n=1 is served")
    cache_salt: str | None = None
    rid: str | None = None
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = Field(default=None, ge=0, lt=2**63)

    @field_validator("cache_salt")
    @classmethod
    def _salt_not_empty(cls, salt: str | None) -> str | None:
        # vLLM's rule: a salt that is present must be non-empty, or it salts nothing.
        if salt is not None and not salt:
            raise ValueError("cache_salt must be a non-empty string when given")
        return salt

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_GenerationBody):
    """`POST /v1/completions`: `prompt` is text or token ids (one prompt per request)."""

    prompt: str | list[int]
    max_tokens: int | None = Field(default=None, ge=1)

    @property
    def max_new_tokens(self) -> int:
        return self.max_tokens if self.max_tokens is not None else DEFAULT_MAX_TOKENS


SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
"""SGLang's `sampling_params.max_new_tokens` default for `/generate`."""


class SamplingParams(_Body):
    max_new_tokens: int = Field(default=SGLANG_DEFAULT_MAX_NEW_TOKENS, ge=1)


class GenerateRequestBody(_GenerationBody):
    """SGLang's native `POST /generate`: `text` or `input_ids` (one prompt per request)."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequestBody:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        return self

    @property
    def max_new_tokens(self) -> int:
        return self.sampling_params.max_new_tokens


class ContentPart(_Body):
    type: str = "text"
    text: str = ""


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if part.type == "text")


class ChatCompletionRequest(_GenerationBody):
    """`POST /v1/chat/completions`: messages are rendered with `render_chat` first."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @property
    def max_new_tokens(self) -> int:
        for value in (self.max_completion_tokens, self.max_tokens):
            if value is not None:
                return value
        return DEFAULT_MAX_TOKENS


class TokenizeRequest(_Body):
    """SGLang `/v1/tokenize`: no chat template is applied."""

    model: str | None = None
    prompt: str | list[str]
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    """SGLang `/v1/detokenize`."""

    model: str | None = None
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = True


GENERATION_PROMPT = "assistant:"


def render_chat(messages: list[ChatMessage]) -> str:
    """The prompt text a chat request is tokenized from (see the module docstring)."""
    return "".join(f"{m.role}: {m.text}\n" for m in messages) + GENERATION_PROMPT

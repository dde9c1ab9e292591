"""What kvcanary learned about a deployment: per-side figures, the advertised context, and
every request made to learn them (`Attempt`), so an unknown figure always comes with what
was tried. `harness.target.server_info` reads these from a running target."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvcanary.harness.target.transport_errors import describe_transport_error

Role = Literal["prefill", "decode", "unified"]

_MAX_ERROR_CHARS = 200


@dataclass(frozen=True, slots=True)
class Attempt:
    """One request made to learn a fact, and what came of it."""

    url: str
    status: int | None
    """HTTP status, or None when no response arrived."""
    error: str | None
    """Why nothing useful came back (transport error, not JSON, unexpected shape), if so."""
    yielded: str
    """What the response told us, in words (`pool_tokens=8192, context_tokens=32768`)."""

    def describe(self) -> str:
        outcome = f"HTTP {self.status}" if self.status is not None else "no response"
        if self.error:
            outcome += f" ({self.error})"
        return f"GET {self.url}: {outcome}: {self.yielded}"


@dataclass(frozen=True, slots=True)
class SideFacts:
    """What one serving side (a prefill or decode server, or a unified one) reports."""

    role: Role
    url: str
    pool_tokens: int | None
    max_input_tokens: int | None
    context_tokens: int | None
    page_size: int | None
    source: str = ""
    """Where the pool figure came from (`sglang:/get_server_info`, `vllm:/metrics`, ...)."""
    fields: dict[str, Any] = field(default_factory=dict)
    """The raw source fields the figures were read from, for evidence."""


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """Everything learned about one deployment, and every attempt made to learn it."""

    engine: str
    """`sglang`, `sglang-pd` (a mini_lb router), `vllm`, `llamacpp`, `openai`, `kvcanary-reference`,
    or `unknown` when nothing engine-specific answered."""
    base_url: str
    sides: tuple[SideFacts, ...]
    context_tokens: int | None
    """The context the target advertises to clients (/v1/models, else the sides' own)."""
    page_size: int | None
    attempts: tuple[Attempt, ...]
    model: str | None = None
    context_source: str | None = None
    """Where `context_tokens` came from (`openai:/v1/models`, `sglang:/get_server_info`)."""
    skipped: str | None = None
    """What was not asked because the caller already had it (flags), in words; None when
    every endpoint was asked."""

    @property
    def reachable(self) -> bool:
        """Whether any request got an HTTP response at all; also true when none was made
        because the caller needed none (nothing says the target is unreachable then)."""
        if not self.attempts and self.skipped is not None:
            return True
        return any(a.status is not None for a in self.attempts)

    def smallest_pool_side(self) -> SideFacts | None:
        """The side with the smallest known pool: where an over-pool prompt fails first."""
        known = [s for s in self.sides if s.pool_tokens is not None]
        return min(known, key=lambda s: s.pool_tokens or 0) if known else None


def as_int(value: Any) -> int | None:
    """A positive integer from JSON or a label (`"573"`, `573`, `573.0`); None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return None
    if isinstance(value, int):
        return value if value > 0 else None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer() and value > 0:
        return int(value)
    return None


def min_known(values: Sequence[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return min(known) if known else None


def describe_error(exc: Exception) -> str:
    """One short line naming what went wrong (`harness.target.transport_errors`)."""
    return describe_transport_error(exc)[:_MAX_ERROR_CHARS]

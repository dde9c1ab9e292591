"""A request plan: what one simulated tenant will send, decided before anything is sent.

A plan knows the prompt (already laced with canaries and built to an exact token count),
why it is sent (its intent and the limit it is sized against) and what a safe target must
do with it (accept, reject, or either at a boundary). It knows nothing about transport or
timing; that is the harness's business.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvcanary.canaries.span import CanarySpan

Intent = Literal["victim", "probe", "abort", "control"]
Expected = Literal["accept", "boundary", "reject"]
"""What a safe target must do: `accept` a prompt below every limit, `reject` one above a limit;
a `boundary` prompt is exactly at the tightest limit, where either answer is defensible (it is
recorded as boundary behaviour, never a finding by itself)."""
ApiStyle = Literal["chat", "completions"]


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """One request to send, with its canaries and the outcome a safe target must produce."""

    request_id: str
    tenant: str
    phase: str
    intent: Intent
    size_label: str
    num_prompt_tokens: int
    expected: Expected
    api: ApiStyle
    prompt: str = field(repr=False)
    canaries: tuple[CanarySpan, ...] = field(default=(), repr=False)
    max_tokens: int = 64
    disconnect_after_chunks: int | None = None
    """For `abort` plans: drop the connection after this many streamed chunks."""
    prompt_sha256: str = ""

"""Where one canary sits in a prompt."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CanarySpan:
    """One canary laced into a prompt: its text and where it sits, in characters and tokens."""

    text: str
    char_offset: int
    token_offset: int
    index: int

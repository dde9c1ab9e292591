"""Where one canary sits in a prompt."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvcanary.canaries.records import records_from_columns


@dataclass(frozen=True, slots=True)
class CanarySpan:
    """One canary laced into a prompt: its text and where it sits, in characters and tokens."""

    text: str
    char_offset: int
    token_offset: int
    index: int


_FIELDS = ("text", "char_offset", "token_offset", "index")
assert CanarySpan.__slots__ == _FIELDS


def spans_from_columns(
    texts: list[str],
    char_offsets: Iterable[int],
    token_offsets: Iterable[int],
    indices: Iterable[int],
) -> tuple[CanarySpan, ...]:
    """Many spans at once, equal to `CanarySpan(*row)` for each row: a 1,048,576-token
    prompt holds ~105k canaries (`canaries.records`: one C loop where it was built)."""
    return records_from_columns(CanarySpan, _FIELDS, texts, char_offsets, token_offsets, indices)

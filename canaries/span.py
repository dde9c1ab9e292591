"""Where one canary sits in a prompt."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import repeat
from typing import Any


@dataclass(frozen=True, slots=True)
class CanarySpan:
    """One canary laced into a prompt: its text and where it sits, in characters and tokens."""

    text: str
    char_offset: int
    token_offset: int
    index: int


_FIELDS = ("text", "char_offset", "token_offset", "index")
assert CanarySpan.__slots__ == _FIELDS

FromColumns = Callable[..., tuple[Any, ...]]


def _load_core() -> FromColumns | None:
    try:
        from kvcanary.canaries._columns import from_columns
    except ImportError:  # installed without a C compiler: the C-level map loops below
        return None
    return from_columns


CORE: FromColumns | None = _load_core()
"""`canaries._columns.from_columns` (one C loop for all the spans, ~10x faster than the
map loops), or None when it was not built; `spans_from_columns` gives equal spans either
way."""


def spans_from_columns(
    texts: list[str],
    char_offsets: Iterable[int],
    token_offsets: Iterable[int],
    indices: Iterable[int],
) -> tuple[CanarySpan, ...]:
    """Many spans at once, equal to `CanarySpan(*row)` for each row.

    A 1,048,576-token prompt holds ~105k canaries, and a frozen dataclass's `__init__`
    costs about as much per instance as tokenizing the canary. So the spans are made with
    C-level loops: `object.__new__`, then each field's slot descriptor; the instances are
    frozen as usual from then on. The cyclic garbage collector is paused meanwhile: this
    burst of tracked objects would otherwise trigger collections that cost more than it.
    With the compiled core (`CORE`) the same is one C loop, the spans (of str and ints
    only) left untracked by the collector, as CPython leaves a tuple of atoms.
    """
    if CORE is not None:
        columns = (texts, char_offsets, token_offsets, indices)
        lists = [c if isinstance(c, list | tuple) else list(c) for c in columns]
        return CORE(CanarySpan, _FIELDS, *lists)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        spans = list(map(object.__new__, repeat(CanarySpan, len(texts))))
        columns = (texts, char_offsets, token_offsets, indices)
        for name, column in zip(_FIELDS, columns, strict=True):
            any(map(getattr(CanarySpan, name).__set__, spans, column))  # any(): run it
    finally:
        if was_enabled:
            gc.enable()
    return tuple(spans)

"""Folding text so that disguised canaries read like plain ones, with a way back.

`fold(text)` maps every character to the alphabet `[a-z0-9 ]`:

- ASCII letters to lower case, digits unchanged, everything else (whitespace, hyphens,
  underscores, punctuation, controls) to a space;
- other characters through Unicode compatibility decomposition (NFKD, which covers
  NFKC's compatibility mappings) and lower-casing, so full-width `ｙｄｋ`, styled letters
  and accented `ýdk` become `ydk`, then the same rule; zero-width and other format
  characters (Cf) and combining marks (Mn, Me) are deleted, so `y`, U+200B, `dk` folds to `ydk`.

Spaces are not collapsed: folded ASCII text has exactly the length of the original, so
offsets carry over unchanged (the fast path, one `str.translate`). Only text with
non-ASCII characters pays for an offset map, and only per non-ASCII run. Each character
folds on its own, never together with its neighbours, so the folding of a window of text
does not depend on where the window starts. This module knows nothing about canaries.
"""

from __future__ import annotations

import re
import unicodedata
from bisect import bisect_right
from dataclasses import dataclass

_KEEP = frozenset("abcdefghijklmnopqrstuvwxyz0123456789")
_DELETED = frozenset(("Cf", "Mn", "Me"))
_DELETE, _EXPAND = "\x00", "\x01"  # markers in the one-character table below
_NON_ASCII_RUN = re.compile(r"[^\x00-\x7f]+")


def _fold_ascii(code: int) -> str:
    char = chr(code).lower()
    return char if char in _KEEP else " "


_ASCII_TABLE = str.maketrans({code: _fold_ascii(code) for code in range(128)})


def _fold_char(char: str) -> str:
    """The folding of one non-ASCII character: "", one character, or several."""
    if unicodedata.category(char) in _DELETED:
        return ""
    out = [
        c if c in _KEEP else ("" if unicodedata.category(c) in _DELETED else " ")
        for c in unicodedata.normalize("NFKD", char).lower()
    ]
    folded = "".join(out)
    return folded if folded.strip() else (" " if folded else "")


class _OneCharTable(dict[int, str]):
    """str.translate table: each non-ASCII character to its one-character folding, or to
    a marker when it folds to nothing or to several characters (kept in `expansions`)."""

    def __init__(self) -> None:
        super().__init__()
        self.expansions: dict[int, str] = {}

    def __missing__(self, code: int) -> str:
        folded = _fold_char(chr(code))
        if len(folded) == 1:
            value = folded
        elif folded:
            self.expansions[code] = folded
            value = _EXPAND
        else:
            value = _DELETE
        self[code] = value
        return value


_NON_ASCII_TABLE = _OneCharTable()


@dataclass(frozen=True, slots=True)
class Folded:
    """Folded text and the map from its offsets back to the original's."""

    text: str
    _folded_starts: tuple[int, ...] = ()
    _original_starts: tuple[int, ...] = ()
    _collapsed: tuple[bool, ...] = ()

    def original_span(self, start: int, end: int) -> tuple[int, int]:
        """The original span that folded to `text[start:end]` (end > start)."""
        assert 0 <= start < end <= len(self.text)
        if not self._folded_starts:
            return start, end
        return self._original(start), self._original(end - 1) + 1

    def _original(self, position: int) -> int:
        segment = bisect_right(self._folded_starts, position) - 1
        if self._collapsed[segment]:  # several folded characters from one original
            return self._original_starts[segment]
        return self._original_starts[segment] + position - self._folded_starts[segment]


def fold(text: str) -> Folded:
    """`text` folded to `[a-z0-9 ]` (see the module docstring)."""
    if text.isascii():
        return Folded(text.translate(_ASCII_TABLE))
    pieces: list[str] = []
    folded_starts: list[int] = []
    original_starts: list[int] = []
    collapsed: list[bool] = []
    length = 0

    def segment(piece: str, original_start: int, is_collapsed: bool = False) -> None:
        nonlocal length
        if piece:
            pieces.append(piece)
            folded_starts.append(length)
            original_starts.append(original_start)
            collapsed.append(is_collapsed)
            length += len(piece)

    position = 0
    for run in _NON_ASCII_RUN.finditer(text):
        segment(text[position : run.start()].translate(_ASCII_TABLE), position)
        folded = run.group().translate(_NON_ASCII_TABLE)
        if _DELETE not in folded and _EXPAND not in folded:
            segment(folded, run.start())
        else:
            for offset, char in enumerate(folded):
                original = run.start() + offset
                if char == _EXPAND:
                    expansion = _NON_ASCII_TABLE.expansions[ord(text[original])]
                    segment(expansion, original, is_collapsed=True)
                elif char != _DELETE:
                    segment(char, original)
        position = run.end()
    segment(text[position:].translate(_ASCII_TABLE), position)
    return Folded("".join(pieces), tuple(folded_starts), tuple(original_starts), tuple(collapsed))

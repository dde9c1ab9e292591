"""Folding text so that disguised canaries read like plain ones, with a way back.

`fold(text)` maps every character to the alphabet `[a-z0-9 ]`:

- ASCII letters to lower case, digits unchanged, everything else (whitespace, hyphens,
  underscores, punctuation, controls) to a space;
- other characters through Unicode compatibility decomposition (NFKD, which covers
  NFKC's compatibility mappings) and lower-casing, so full-width `ｙｄｋ`, styled letters
  and accented `ýdk` become `ydk`, then the same rule; combining marks (Mn, Me) are
  deleted; tokenizer markers for whitespace read as spaces: SentencePiece `▁` (U+2581) and
  byte-level BPE `Ġ` (U+0120, a space), `Ċ` (U+010A, a newline) and `ĉ` (U+0109, a tab);
- invisible (format, Cf) characters such as U+200B, U+2060, U+00AD and U+FEFF have two
  readings, and `fold_readings` gives both: deleted (`y`, U+200B, `dk` folds to `ydk`) and
  as a space (`settle`, U+200B, `bishop` folds to `settle bishop`). `fold` is the first.

Spaces are not collapsed: folded ASCII text has exactly the length of the original, so
offsets carry over unchanged (the fast path, one `str.translate`). Text with non-ASCII
characters is encoded to ASCII through a codec error handler that folds each run of them
(C-speed copying in between), and pays for an offset map only where a run deletes or
expands characters. Each character folds on its own, never together with its neighbours,
so the folding of a window of text does not depend on where the window starts. This
module knows nothing about canaries.
"""

from __future__ import annotations

import codecs
import threading
import unicodedata
from bisect import bisect_right
from dataclasses import dataclass

_KEEP = frozenset("abcdefghijklmnopqrstuvwxyz0123456789")
_DELETED = frozenset(("Cf", "Mn", "Me"))
_INVISIBLE = "Cf"
_WHITESPACE_MARKERS = frozenset("\u2581\u0120\u010a\u0109")  # ▁ Ġ Ċ ĉ
_DELETE, _EXPAND = "\x00", "\x01"  # markers in the one-character table below


def _fold_ascii(code: int) -> str:
    char = chr(code).lower()
    return char if char in _KEEP else " "


_ASCII_TABLE = str.maketrans({code: _fold_ascii(code) for code in range(128)})
_ASCII_BYTES_TABLE = bytes(ord(_fold_ascii(code)) if code < 128 else code for code in range(256))


def _fold_char(char: str, *, invisible_as_space: bool = False) -> str:
    """The folding of one non-ASCII character: "", one character, or several."""
    if char in _WHITESPACE_MARKERS:
        return " "
    category = unicodedata.category(char)
    if category == _INVISIBLE and invisible_as_space:
        return " "
    if category in _DELETED:
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

    def __init__(self, *, invisible_as_space: bool = False) -> None:
        super().__init__()
        self.expansions: dict[int, str] = {}
        self.invisible_as_space = invisible_as_space

    def __missing__(self, code: int) -> str:
        folded = _fold_char(chr(code), invisible_as_space=self.invisible_as_space)
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
_SPACED_TABLE = _OneCharTable(invisible_as_space=True)


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


class _FoldState(threading.local):
    """What the encoder's error handler records while one `fold` call runs (per thread)."""

    active = False
    table = _NON_ASCII_TABLE
    saw_invisible = False  # a run held a character the other reading folds differently
    delta = 0  # folded offset minus original offset, after the runs seen so far
    folded_starts: list[int]
    original_starts: list[int]
    collapsed: list[bool]


_STATE = _FoldState()


def _fold_run(error: UnicodeError) -> tuple[str, int]:
    """Codec error handler: the folding of one maximal run of non-ASCII characters.

    `fold` encodes text to ASCII with this handler, so CPython's encoder copies the ASCII
    stretches at C speed and calls here once per run. Runs that fold one character to one
    character keep offsets aligned; others record segments of the offset map.
    """
    if not isinstance(error, UnicodeEncodeError) or not _STATE.active:
        raise error
    state = _STATE
    table = state.table
    run = error.object[error.start : error.end]
    folded = run.translate(table)
    if table is _NON_ASCII_TABLE and not state.saw_invisible and _DELETE in folded:
        state.saw_invisible = any(unicodedata.category(c) == _INVISIBLE for c in run)
    if _DELETE not in folded and _EXPAND not in folded:
        return folded, error.end
    pieces = []
    for offset, char in enumerate(folded):
        original = error.start + offset
        if char == _DELETE:
            state.delta -= 1
            continue
        piece = table.expansions[ord(run[offset])] if char == _EXPAND else char
        state.folded_starts.append(original + state.delta)
        state.original_starts.append(original)
        state.collapsed.append(len(piece) > 1)
        state.delta += len(piece) - 1
        pieces.append(piece)
    # back to one-to-one after the run, with the new offset difference
    state.folded_starts.append(error.end + state.delta)
    state.original_starts.append(error.end)
    state.collapsed.append(False)
    return "".join(pieces), error.end


codecs.register_error("kvcanary-fold", _fold_run)


def fold(text: str) -> Folded:
    """`text` folded to `[a-z0-9 ]`, invisible characters deleted (the module docstring)."""
    return _fold(text, _NON_ASCII_TABLE)[0]


def fold_readings(text: str) -> tuple[Folded, ...]:
    """Both readings of `text`: invisible characters deleted, then (only when `text` holds
    any) invisible characters as spaces."""
    deleted, saw_invisible = _fold(text, _NON_ASCII_TABLE)
    if not saw_invisible:
        return (deleted,)
    return deleted, _fold(text, _SPACED_TABLE)[0]


def _fold(text: str, table: _OneCharTable) -> tuple[Folded, bool]:
    if text.isascii():
        return Folded(text.translate(_ASCII_TABLE)), False
    state = _STATE
    state.active, state.delta, state.table, state.saw_invisible = True, 0, table, False
    state.folded_starts, state.original_starts, state.collapsed = [0], [0], [False]
    try:
        encoded = text.encode("ascii", "kvcanary-fold")
    finally:
        state.active = False
    folded = encoded.translate(_ASCII_BYTES_TABLE).decode("ascii")
    saw_invisible = state.saw_invisible
    if len(state.folded_starts) == 1:  # every run folded one to one: offsets carry over
        return Folded(folded), saw_invisible
    starts = tuple(state.folded_starts), tuple(state.original_starts), tuple(state.collapsed)
    return Folded(folded, *starts), saw_invisible

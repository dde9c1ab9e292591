"""The scanner's fast path: the pure-Python layers run only where a canary could be.

`CanaryIndex._find_oracle` (the reference) folds a whole block to `[a-z0-9 ]` with
`str.translate` and a codec error handler, and searches both readings. This module gives
the same hits for far less work, in three steps:

1. **One-to-one folding in bytes.** When every character of the block folds to exactly one
   character, the same in both readings (ASCII; BMP text without invisible, combining or
   expanding characters), the folding is a byte string aligned with the text: an ASCII
   encode, lower-cased (enough to find the tag), whose codec error handler replaces each
   run of non-ASCII characters by their foldings (`str.translate` with a table filled on
   first sight), so the ASCII stretches between runs are copied at C speed. Anything else
   (a zero-width space, a ligature, an astral character) sends the whole block to the
   oracle.
2. **Seeds.** Every match of any layer starts at a tag (`ydk` in the folding) or at a
   fragment window (" aaaaaa" * k + " " in the shape of the folding), both found with
   `bytes.find` at memory speed. Benign text has almost none.
3. **Resolution.** A seed that is a live canary verbatim (the tag preceded by a separator,
   the canonical text, then a separator) is an exact hit: no other candidate can win
   against it (the oracle drops fragments that overlap a live tag match, and tag matches
   never overlap), so the fragment windows inside it are skipped; one that reaches past
   its end is a seed like any other. Every other seed is resolved by the oracle on the window
   `[seed - MAX_MATCH, seed + MAX_MATCH]` (overlapping windows merged), and only hits that
   start at least MAX_MATCH from a cut window edge are kept: each of them starts at a seed,
   and a match shorter than MAX_MATCH around it is seen whole, with the same neighbours,
   as in the whole block. Matches of MAX_MATCH characters or more are outside what the
   stream scanner promises anyway (`canaries.index`).

The tests compare this path with the oracle on random texts and chunkings.
"""

from __future__ import annotations

import codecs
from itertools import compress, repeat
from typing import TYPE_CHECKING

import numpy as np

from canaries.hit import Hit, Owner, hits_from_columns
from canaries.normalize import _ASCII_BYTES_TABLE, _fold_char
from canaries.shape import TAG, WORD_LENGTH

if TYPE_CHECKING:
    from canaries.index import CanaryIndex

MAX_MATCH = 512
"""Window half-width around a seed the oracle resolves (= `canaries.index.MAX_MATCH`)."""

_HARMFUL = "\x7f"
"""What a character that does not fold one-to-one becomes (a literal DEL in the text also
sends its block to the oracle: correct, only slower)."""
_HARMFUL_BYTE = _HARMFUL.encode()
_TAG = TAG.encode()
_SPACE, _LETTER, _DIGIT = 32, 97, 48
_SHAPE = bytes(
    _LETTER if 97 <= c <= 122 or 65 <= c <= 90 else _DIGIT if 48 <= c <= 57 else _SPACE
    for c in range(256)
)
"""Shape of a byte of ASCII text or of a folding: letters `a`, digits `0`, the rest space
(ASCII letters in either case: fold them or not, the shape is the same)."""


class _RunTable(dict[int, str]):
    """str.translate table: a non-ASCII character to its one-character folding when it has
    one, the same in both readings, else to `_HARMFUL` (astral characters and surrogates
    too: a block holding one goes to the oracle whole)."""

    def __missing__(self, code: int) -> str:
        value = _HARMFUL
        if code <= 0xFFFF and not 0xD800 <= code < 0xE000:
            char = chr(code)
            deleted = _fold_char(char)
            if len(deleted) == 1 and deleted == _fold_char(char, invisible_as_space=True):
                value = deleted
        self[code] = value
        return value


_RUNS = _RunTable()


def _fold_run(error: UnicodeError) -> tuple[str, int]:
    """Codec error handler: the one-to-one folding of one run of non-ASCII characters."""
    if not isinstance(error, UnicodeEncodeError):
        raise error
    return error.object[error.start : error.end].translate(_RUNS), error.end


codecs.register_error("kvcanary-fold-bytes", _fold_run)


def fold_bytes(text: str) -> bytes | None:
    """A byte string aligned with `text` whose letters, and their positions, are those of
    its folding (ASCII characters only lower-cased: that is all the seeds need); None when
    some character does not fold one-to-one, the same in both readings."""
    if text.isascii():
        return text.encode("ascii").lower()
    folded = text.encode("ascii", "kvcanary-fold-bytes").lower()
    return None if folded.find(_HARMFUL_BYTE) >= 0 else folded


def find(index: CanaryIndex, buffer: str, base: int, after: int, until: int) -> list[Hit]:
    """`index._find_oracle(buffer, base, after, until)`, fast (the module docstring)."""
    lowered = fold_bytes(buffer)
    if lowered is None:
        return index._find_oracle(buffer, base, after, until)
    shape = lowered.translate(_SHAPE)
    num_words = index.minter.num_words
    length = len(TAG) + (WORD_LENGTH + 1) * num_words  # an exact canary
    starts, canaries, seeds = _tags(lowered, shape, buffer, index._live, length)
    k = index.fragment_words
    if k is not None and index._fragments:
        if starts:  # blank the exact canaries: a fragment starting inside one is moot
            blanked = np.frombuffer(shape, np.uint8).copy()
            blanked[(np.array(starts)[:, None] + np.arange(length)).ravel()] = 0
            shape = blanked.tobytes()
        pattern = b" " + b" ".join([b"a" * WORD_LENGTH] * k) + b" "
        fragments, stride, width = index._fragments, WORD_LENGTH + 1, len(pattern)
        position = shape.find(pattern)
        while position >= 0:  # not a live k-gram: no fragment candidate, none in the oracle
            key = lowered[position + 1 : position + width - 1]
            if key.translate(_ASCII_BYTES_TABLE).decode() in fragments:
                seeds.append(position)
            position = shape.find(pattern, position + stride)
    hits = _exact_hits(index, base, after, until, starts, canaries, length) if starts else []
    if seeds:
        hits = _merge(hits, _window_hits(index, buffer, base, after, until, sorted(seeds)))
    return hits


def _tags(
    lowered: bytes, shape: bytes, buffer: str, live: dict[str, Owner], length: int
) -> tuple[list[int], list[str], list[int]]:
    """Where the tag occurs: the starts and texts of verbatim live canaries, and the other
    occurrences (seeds). Vectorised: an echo holds a canary every ~60 characters."""
    pieces = lowered.split(_TAG)  # the tag cannot overlap itself: split finds them all
    if len(pieces) == 1:
        return [], [], []
    sizes = np.fromiter(map(len, pieces), np.int64, len(pieces))
    positions = np.cumsum(sizes[:-1] + len(TAG)) - len(TAG)
    ends = positions + length
    cells = np.frombuffer(shape, np.uint8)
    framed = (positions > 0) & (cells[np.maximum(positions - 1, 0)] == _SPACE)
    framed &= (ends < len(shape)) & (cells[np.minimum(ends, len(shape) - 1)] == _SPACE)
    chosen = np.flatnonzero(framed)
    texts = list(
        map(buffer.__getitem__, map(slice, positions[chosen].tolist(), ends[chosen].tolist()))
    )
    known = np.fromiter(map(live.__contains__, texts), bool, len(texts))
    exact = np.zeros(len(positions), bool)
    exact[chosen[known]] = True
    return (
        positions[exact].tolist(),
        list(compress(texts, known.tolist())),
        positions[~exact].tolist(),
    )


def _exact_hits(
    index: CanaryIndex,
    base: int,
    after: int,
    until: int,
    starts: list[int],
    canaries: list[str],
    length: int,
) -> list[Hit]:
    if not (after < base + starts[0] + length and base + starts[-1] + length <= until):
        kept = [i for i, start in enumerate(starts) if after < base + start + length <= until]
        starts, canaries = [starts[i] for i in kept], [canaries[i] for i in kept]
    begin = [base + start for start in starts]
    return hits_from_columns(
        canaries,
        begin,
        [start + length for start in begin],
        repeat("exact"),
        canaries,
        index._live_origins(canaries),
        map(index._live.__getitem__, canaries),
    )


def _window_hits(
    index: CanaryIndex, buffer: str, base: int, after: int, until: int, seeds: list[int]
) -> list[Hit]:
    """The oracle's hits around each seed (module docstring, step 3)."""
    windows: list[list[int]] = []
    for seed in seeds:
        lo, hi = max(0, seed - MAX_MATCH), min(len(buffer), seed + MAX_MATCH)
        if windows and lo <= windows[-1][1]:
            windows[-1][1] = hi
        else:
            windows.append([lo, hi])
    hits: list[Hit] = []
    for lo, hi in windows:
        first = base + lo + MAX_MATCH if lo > 0 else base
        last = base + hi - MAX_MATCH + 1 if hi < len(buffer) else base + hi
        hits += [
            hit
            for hit in index._find_oracle(buffer[lo:hi], base + lo, after, until)
            if first <= hit.start <= last
        ]
    return hits


def _merge(exact: list[Hit], found: list[Hit]) -> list[Hit]:
    """Both lists' hits in text order, once each (a window may hold an exact hit too)."""
    if not exact:
        return found
    seen = {(hit.start, hit.end) for hit in found}
    merged = found + [hit for hit in exact if (hit.start, hit.end) not in seen]
    merged.sort(key=lambda hit: hit.start)
    return merged

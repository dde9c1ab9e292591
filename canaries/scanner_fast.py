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

Steps 1 and 2 have two implementations giving the same bytes and windows: the compiled
core `canaries._foldscan` (`CORE`; C over the str's own buffer, one pass that folds
through a 64 Ki-entry table of this module's foldings and finds the fragment windows
with a small state machine) and the pure-Python steps above (`fold_bytes`,
`fragment_windows`), used when the core was not built (no C compiler at install). The
tests compare both with the oracle on random texts and chunkings, and the core with the
pure-Python steps.
"""

from __future__ import annotations

import codecs
from bisect import bisect_right
from collections.abc import Callable
from itertools import compress, repeat
from operator import is_not
from typing import TYPE_CHECKING, cast

import numpy as np

from kvcanary.canaries.hit import Hit, Owner, hits_from_columns
from kvcanary.canaries.normalize import _ASCII_BYTES_TABLE, _fold_char
from kvcanary.canaries.shape import TAG, WORD_LENGTH

if TYPE_CHECKING:
    from kvcanary.canaries.index import CanaryIndex

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
_SHAPE_CELLS = np.frombuffer(_SHAPE, np.uint8)


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


def _fold_code(code: int) -> int:
    """The one-byte folding of a non-ASCII code point, for the compiled core."""
    return ord(_RUNS[code])


FoldScan = Callable[[str, int, Callable[[int], int]], "tuple[bytes, bytes, bytes] | None"]
"""(folding, windows, tags), the positions packed (`canaries/_foldscan.c`), or None."""


def _load_core() -> FoldScan | None:
    try:
        from kvcanary.canaries._foldscan import fold_scan
    except ImportError:  # installed without a C compiler: the pure-Python steps
        return None
    return fold_scan


CORE: FoldScan | None = _load_core()
"""The compiled core (`canaries/_foldscan.c`: steps 1 and 2 in one pass over the str's own
buffer, and the resolution of tags and making of exact hits), or None when it was not
built; `find` and `find_exact` give the same hits either way."""

if CORE is not None:
    from kvcanary.canaries._foldscan import exact_scan as _c_exact_scan


def find(index: CanaryIndex, buffer: str, base: int, after: int, until: int) -> list[Hit]:
    """`index._find_oracle(buffer, base, after, until)`, fast (the module docstring)."""
    k = index.fragment_words if index._fragments else None
    length = len(TAG) + (WORD_LENGTH + 1) * index.minter.num_words  # an exact canary
    width = 0 if k is None else (WORD_LENGTH + 1) * k + 1
    windows: list[int] | None
    if CORE is not None:
        folded = CORE(buffer, k or 0, _fold_code)
        if folded is None:
            return index._find_oracle(buffer, base, after, until)
        lowered, found, tags = folded
        # a window touching an exact canary is moot: the core drops those
        scan = (buffer, tags, lowered, None if k is None else found, width)
        hits, seeds, windows = _compiled_exact(index, scan, length, base, after, until)
    else:
        plain = fold_bytes(buffer)
        if plain is None:
            return index._find_oracle(buffer, base, after, until)
        lowered = plain
        starts, canaries, owners, seeds = _tags(
            lowered, tag_starts(lowered), buffer, index._live, length
        )
        windows = None if k is None else fragment_windows(lowered, k)
        if starts and windows:  # a window touching an exact canary is moot
            windows = _outside(windows, starts, length, width)
        hits = _exact_hits(index, base, after, until, starts, canaries, owners, length)
    if windows:
        fragments = index._fragments
        for position in windows:  # not a live k-gram: no fragment candidate in the oracle
            key = lowered[position + 1 : position + width - 1]
            if key.translate(_ASCII_BYTES_TABLE).decode() in fragments:
                seeds.append(position)
    if seeds:
        hits = _merge(hits, _window_hits(index, buffer, base, after, until, sorted(seeds)))
    return hits


def _compiled_exact(
    index: CanaryIndex,
    scan: tuple[str, bytes | None, bytes | None, bytes | None, int],
    length: int,
    base: int,
    after: int,
    until: int,
) -> tuple[list[Hit], list[int], list[int] | None]:
    """The compiled core's exact hits, seeds and fragment windows outside exact canaries
    (`canaries/_foldscan.c`, `exact_scan`) for `scan` = (buffer, tags or None for the raw
    search, folding or None, windows or None, window width; positions packed, as the
    core's `fold_scan` gives them). Live canaries not yet recorded in the index are
    decoded (once while they are live) and the buffer scanned again."""
    buffer, tags, lowered, windows, width = scan
    args = (buffer, tags, length, index._live, index._resolved, lowered, _RAW_TAG, Hit)
    found = _c_exact_scan(*args, base, after, until, windows, width)
    if found[1]:
        index._resolve(found[1])
        found = _c_exact_scan(*args, base, after, until, windows, width)
        assert not found[1], "every live canary is resolved now"
    hits, _, seeds, kept = found
    return hits, seeds, kept


_RAW_TAG = TAG + " "
_ASCII_SEPARATORS = frozenset(chr(code) for code in range(128) if not chr(code).isalnum())
"""ASCII characters that fold to a space (`canaries.normalize`): all but letters and digits."""


def find_exact(index: CanaryIndex, buffer: str, base: int, after: int, until: int) -> list[Hit]:
    """The exact layer alone, on the raw text (no folding): the hits of
    `index._find_oracle(buffer, base, after, until)` whose layer is "exact".

    An exact hit is a canary verbatim, so its text starts with `ydk ` (`str.find` over the
    str's own buffer, at memory speed). A candidate whose `length` characters are a live
    canary, between ASCII characters other than letters and digits, is one: such
    characters fold to a space in both readings, so the oracle sees the tag as a word and
    the canary's words as a run, and no other tag match can overlap it (its words hold no
    `ydk` word) nor a fragment beat it. Any other candidate (not live, another run's
    canary, a non-ASCII or missing neighbour) is resolved by the oracle in a window around
    it, as `find` resolves seeds."""
    length = len(TAG) + (WORD_LENGTH + 1) * index.minter.num_words
    if CORE is not None:
        scan = (buffer, None, None, None, 0)
        hits, seeds, _ = _compiled_exact(index, scan, length, base, after, until)
    else:
        starts, canaries, owners, seeds = _raw_tags(buffer, index._live, length)
        hits = _exact_hits(index, base, after, until, starts, canaries, owners, length)
    if seeds:
        at = set(seeds)
        found = [
            hit
            for hit in _window_hits(index, buffer, base, after, until, seeds)
            if hit.layer == "exact" and hit.start - base in at
        ]
        if found:
            hits = sorted(hits + found, key=lambda hit: hit.start)
    return hits


def _raw_tags(
    buffer: str, live: dict[str, Owner], length: int
) -> tuple[list[int], list[str], list[Owner], list[int]]:
    """`find_exact`'s candidates: the starts, texts and owners of the live canaries
    verbatim between ASCII separators, and the other occurrences of `ydk ` (seeds)."""
    separators, size, search = _ASCII_SEPARATORS, len(buffer), buffer.find
    starts: list[int] = []
    canaries: list[str] = []
    seeds: list[int] = []
    position = search(_RAW_TAG)
    while position >= 0:
        end = position + length
        text = buffer[position:end]
        if (
            text in live
            and position > 0
            and end < size
            and buffer[position - 1] in separators
            and buffer[end] in separators
        ):
            starts.append(position)
            canaries.append(text)
            position = search(_RAW_TAG, end)  # no exact hit starts inside a canary
        else:
            seeds.append(position)
            position = search(_RAW_TAG, position + 1)
    return starts, canaries, list(map(live.__getitem__, canaries)), seeds


def fragment_windows(lowered: bytes, k: int) -> list[int]:
    """Where a fragment window of `k` words starts in a folding (`fold_bytes`): a
    separator, then k times six letters and a separator (the pure-Python search; the
    compiled core finds the same windows while it folds)."""
    shape = lowered.translate(_SHAPE)
    pattern = b" " + b" ".join([b"a" * WORD_LENGTH] * k) + b" "
    stride = WORD_LENGTH + 1  # windows overlap by whole words only
    windows = []
    position = shape.find(pattern)
    while position >= 0:
        windows.append(position)
        position = shape.find(pattern, position + stride)
    return windows


def _outside(windows: list[int], starts: list[int], length: int, width: int) -> list[int]:
    """The windows `[p, p + width)` that overlap no exact canary `[s, s + length)` (the
    canaries do not overlap each other, so the last one starting before a window's end
    is the only one to check)."""
    begin, canary = np.array(windows), np.array(starts)
    last = np.searchsorted(canary, begin + width) - 1
    clear = (last < 0) | (canary[np.maximum(last, 0)] + length <= begin)
    kept: list[int] = begin[clear].tolist()
    return kept


def tag_starts(lowered: bytes) -> list[int]:
    """Where the tag starts in a folding (the pure-Python search; the compiled core finds
    the same starts while it folds)."""
    pieces = lowered.split(_TAG)  # the tag cannot overlap itself: split finds them all
    if len(pieces) == 1:
        return []
    sizes = np.fromiter(map(len, pieces), np.int64, len(pieces))
    starts: list[int] = (np.cumsum(sizes[:-1] + len(TAG)) - len(TAG)).tolist()
    return starts


def _tags(
    lowered: bytes, tags: list[int], buffer: str, live: dict[str, Owner], length: int
) -> tuple[list[int], list[str], list[Owner], list[int]]:
    """Of the tags, the starts, texts and owners of verbatim live canaries, and the other
    occurrences (seeds). Vectorised: an echo holds a canary every ~60 characters (the
    compiled core's `exact_scan` does the same in one C loop)."""
    if not tags:
        return [], [], [], []
    positions = np.array(tags, np.int64)
    ends = positions + length
    cells = np.frombuffer(lowered, np.uint8)
    before = _SHAPE_CELLS[cells[np.maximum(positions - 1, 0)]]
    after = _SHAPE_CELLS[cells[np.minimum(ends, len(lowered) - 1)]]
    framed = (positions > 0) & (before == _SPACE) & (ends < len(lowered)) & (after == _SPACE)
    chosen = np.flatnonzero(framed)
    texts = list(
        map(buffer.__getitem__, map(slice, positions[chosen].tolist(), ends[chosen].tolist()))
    )
    owners = list(map(live.get, texts))
    known = np.fromiter(map(is_not, owners, repeat(None)), bool, len(texts))
    exact = np.zeros(len(positions), bool)
    exact[chosen[known]] = True
    if known.all():
        starts: list[int] = positions[exact].tolist()
        return starts, texts, cast("list[Owner]", owners), positions[~exact].tolist()
    chosen_known = known.tolist()
    return (
        positions[exact].tolist(),
        list(compress(texts, chosen_known)),
        cast("list[Owner]", list(compress(owners, chosen_known))),  # the known ones
        positions[~exact].tolist(),
    )


def _exact_hits(
    index: CanaryIndex,
    base: int,
    after: int,
    until: int,
    starts: list[int],
    canaries: list[str],
    owners: list[Owner],
    length: int,
) -> list[Hit]:
    """The exact hits of live canaries at `starts` (in order) that end in (after, until]."""
    first = bisect_right(starts, after - base - length)  # ends grow with starts
    last = bisect_right(starts, until - base - length)
    if first or last < len(starts):
        starts, canaries, owners = starts[first:last], canaries[first:last], owners[first:last]
    if not starts:
        return []
    begin = np.array(starts, np.int64) + base
    index._resolve(canaries)
    return hits_from_columns(
        canaries,
        begin.tolist(),
        (begin + length).tolist(),
        repeat("exact"),
        canaries,
        [index._resolved[canary][2] for canary in canaries],
        owners,
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

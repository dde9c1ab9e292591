"""Finding canaries in streamed responses: the live-canary index and its stream scanner.

`CanaryIndex` holds the live canaries (canonical text -> `Owner`); `scanner()` gives a
`StreamScanner` for one response. Chunks go in as they arrive; hits come out with offsets
into the whole response text, each exactly once, however the chunks split it.

Layers, all run on the folded text (`canaries.normalize.fold`):

- exact / normalized: every occurrence of the tag `ydk` as a word (`str.find`), followed
  by six-letter words. If the first `num_words` are canary words it is a canary: live ->
  its owner; not live but decrypting under the run key -> origin, and the owner
  `owner_of(origin)` gives; neither -> unknown origin (another run's canary, or one this
  index forgot). A tag with 6..num_words-1 canary words after it (a shorter canary of
  another run) is unknown origin too. "exact" when the response holds the canonical
  text verbatim, "normalized" when it was disguised (case, separators, zero-width or
  compatibility characters).
- fragment: a run of `fragment_words` (k) consecutive words of a live canary without its
  tag, separated by single non-alphanumeric characters. Every canary word has six
  letters, so after mapping letters to `a` a candidate is the fixed string
  " aaaaaa aaaaaa ... " (`str.find` again), checked against a dict of live k-grams.
  Overlapping k-grams of one canary merge into one hit; fragments inside a tag hit are
  not reported twice.

Fragment false positives. The words of a canary are pseudorandom, independent of any
benign text, so a benign k-word window equals a given window of a given live canary with
probability at most p(k) = max(r, 1 + r/B) * B**-k, where B = 3,480 words and
r = B**w / 2**D in [1, 4) corrects for the cipher's D-bit range not filling all B**w
spellings (p(w) = 2**-D exactly). Over a response of L characters (at most L/7 word
starts, a canary word and its separator take 7) and V live canaries of w words:

    P(any benign fragment hit per response) <= (L / 7) * V * (w - k + 1) * p(k)

and k is the smallest value that keeps this at or below 1e-9 for the index's design
limits, V <= max_live = 2**20 and L <= max_response_chars = 2**22 (4 MiB). That gives
k = 6 for w = 6 or 7 (6 words: all six, 5.3e-10), k = 7 for w = 8..10. Longer canaries
thus tolerate more lost words (3 of 10 at w = 10, plus the tag). An index holding more
than max_live canaries refuses more (CanaryError) rather than silently weaken the bound;
a response longer than max_response_chars gets the bound per max_response_chars.

Speed: for ASCII text, a scan is two `str.translate` and two `str.find` passes, so it does
not depend on the number of live canaries; lookups happen only at candidates. Memory is
bounded: the scanner keeps a tail of HOLDBACK + MAX_MATCH characters and scans once
`scan_block` new characters have arrived (SCAN_BLOCK, 32 KiB, by default), so hits arrive
once enough text follows them, or at `finish()`. A disguised canary spanning more than
MAX_MATCH original characters, or followed by more than HOLDBACK deleted characters, may
be missed.
"""

from __future__ import annotations

import math
import re
from bisect import bisect_left
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from canaries.errors import CanaryError
from canaries.hit import Hit, Layer, Owner, Relation, classify
from canaries.mint import CanaryMinter, CanaryOrigin
from canaries.normalize import fold
from canaries.shape import MAX_WORDS, MIN_WORDS, TAG, WORD_INDEX, WORD_LENGTH, WORDS, canonical

__all__ = ["CanaryIndex", "Hit", "Owner", "Relation", "StreamScanner", "classify"]

FALSE_POSITIVE_RATE = 1e-9
MAX_LIVE = 1 << 20
MAX_RESPONSE_CHARS = 1 << 22
HOLDBACK = 512
MAX_MATCH = 512
CONTEXT = 16
SCAN_BLOCK = 1 << 15

_SHAPE_TABLE = str.maketrans(
    {**{c: "a" for c in range(ord("a"), ord("z") + 1)}, **{c: "0" for c in b"0123456789"}}
)
_TAG_RUN = re.compile(rf"(?: +[a-z]{{{WORD_LENGTH}}}(?![a-z0-9]))+")
_CANONICAL = {
    w: re.compile(rf"{TAG}(?: [a-z]{{{WORD_LENGTH}}}){{{w}}}")
    for w in range(MIN_WORDS, MAX_WORDS + 1)
}


def min_fragment_words(
    minter: CanaryMinter,
    *,
    max_live: int = MAX_LIVE,
    max_response_chars: int = MAX_RESPONSE_CHARS,
    false_positive_rate: float = FALSE_POSITIVE_RATE,
) -> int | None:
    """The shortest fragment (in words) that keeps benign hits below the rate, or None
    when even a whole tagless canary would not (see the module docstring)."""
    num_words, base = minter.num_words, len(WORDS)
    log_r = num_words * math.log2(base) - minter.num_bits
    positions = max_response_chars / (WORD_LENGTH + 1)
    for k in range(1, num_words + 1):
        log_p = (
            -minter.num_bits
            if k == num_words
            else max(log_r, math.log2(1 + 2**log_r / base)) - k * math.log2(base)
        )
        log_bound = math.log2(positions * max_live * (num_words - k + 1)) + log_p
        if log_bound <= math.log2(false_positive_rate):
            return k
    return None


class CanaryIndex:
    """The live canaries of a run, and scanners that find them (and others) in responses."""

    def __init__(
        self,
        minter: CanaryMinter,
        owner_of: Callable[[CanaryOrigin], Owner | None] | None = None,
        *,
        max_live: int = MAX_LIVE,
        max_response_chars: int = MAX_RESPONSE_CHARS,
    ) -> None:
        self.minter = minter
        self.owner_of = owner_of
        self.max_live = max_live
        self.fragment_words = min_fragment_words(
            minter, max_live=max_live, max_response_chars=max_response_chars
        )
        self._live: dict[str, Owner] = {}
        # k words -> the canary they open, or (canary, word offset) when they start later
        self._fragments: dict[str, str | tuple[str, int]] = {}

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, canary: object) -> bool:
        return isinstance(canary, str) and canary.strip() in self._live

    def owner(self, canary: str) -> Owner | None:
        """The owner of a live canary."""
        return self._live.get(canary.strip())

    def add(self, canary: str, owner: Owner) -> None:
        """Registers a live canary (a `mint` result or a `CanarySpan.text`)."""
        self.add_many([(canary, owner)])

    def add_many(self, items: Iterable[tuple[str, Owner]]) -> None:
        """Registers many live canaries."""
        num_words, k = self.minter.num_words, self.fragment_words
        exact = _CANONICAL[num_words].fullmatch
        for text, owner in items:
            canary = text if exact(text) else canonical(text, num_words)
            words = canary.split(" ")[1:]
            if not all(map(WORD_INDEX.__contains__, words)):
                canary = canonical(text, num_words)  # raises, naming the problem
            if canary not in self._live and len(self._live) >= self.max_live:
                raise CanaryError(
                    f"more than {self.max_live} live canaries: discard old ones or raise "
                    f"max_live (which lengthens the minimum fragment)"
                )
            self._live[canary] = owner
            if k is not None:
                self._fragments[" ".join(words[:k])] = canary  # no tuple: saves memory
                for offset in range(1, num_words - k + 1):
                    self._fragments[" ".join(words[offset : offset + k])] = (canary, offset)

    def discard(self, canary: str) -> None:
        """Forgets a live canary (its hits become attributed-or-unknown)."""
        canary = canary.strip()
        if self._live.pop(canary, None) is None or self.fragment_words is None:
            return
        words, k = canary.split(" ")[1:], self.fragment_words
        for offset in range(len(words) - k + 1):
            key = " ".join(words[offset : offset + k])
            if _fragment_entry(self._fragments.get(key))[0] == canary:
                del self._fragments[key]

    def scanner(self, *, scan_block: int = SCAN_BLOCK) -> StreamScanner:
        """A scanner for one response. It scans once `scan_block` new characters have
        arrived: smaller blocks report hits sooner, larger ones scan faster."""
        return StreamScanner(self, scan_block=scan_block)

    def scan(self, text: str) -> list[Hit]:
        """All hits in a complete text."""
        scanner = self.scanner()
        return scanner.feed(text) + scanner.finish()

    def _find(self, buffer: str, base: int, after: int, until: int) -> list[Hit]:
        """Hits in `buffer` (whose first character is at absolute offset `base`) that end
        in (after, until], absolute offsets."""
        folded = fold(buffer)
        tags = self._tag_matches(folded.text)
        fragments = self._fragment_matches(folded.text, tags)
        found: list[tuple[int, int, _Match]] = []
        for match in tags + fragments:
            start, end = folded.original_span(match.start, match.end)
            if after < base + end <= until:
                found.append((start, end, match))
        if not found:
            return []
        complete = [m.canary for _, _, m in found if m.complete]
        origins = dict(zip(complete, self.minter.attribute_canonical(complete), strict=True))
        hits = []
        for start, end, match in sorted(found, key=lambda item: item[:2]):
            text = buffer[start:end]
            origin = origins.get(match.canary)
            owner = self._live.get(match.canary)
            if owner is None and origin is not None and self.owner_of is not None:
                owner = self.owner_of(origin)
            layer: Layer = match.layer
            if layer == "normalized" and text == match.canary:
                layer = "exact"
            hits.append(Hit(text, base + start, base + end, layer, match.canary, origin, owner))
        return hits

    def _tag_matches(self, folded: str) -> list[_Match]:
        matches = []
        position = folded.find(TAG)
        while position >= 0:
            run = _TAG_RUN.match(folded, position + len(TAG))
            if position > 0 and folded[position - 1] == " " and run is not None:
                match = self._tag_match(folded, position, run)
                if match is not None:
                    matches.append(match)
            position = folded.find(TAG, position + 1)
        return matches

    def _tag_match(self, folded: str, position: int, run: re.Match[str]) -> _Match | None:
        words = run.group().split()
        num_words = self.minter.num_words
        if all(map(WORD_INDEX.__contains__, words)):
            num_known = len(words)
        else:
            num_known = next(i for i, w in enumerate(words) if w not in WORD_INDEX)
        num_used = min(num_known, num_words)
        if num_used < MIN_WORDS:
            return None
        if num_used == len(words):
            end = run.end()
        else:  # the canary stops before the run does; only spaces separate its words
            end = position + len(TAG)
            for word in words[:num_used]:
                end = folded.index(word, end) + WORD_LENGTH
        canary = " ".join([TAG, *words[:num_used]])
        return _Match(position, end, "normalized", canary, num_used == num_words)

    def _fragment_matches(self, folded: str, tags: list[_Match]) -> list[_Match]:
        k = self.fragment_words
        if k is None or not self._fragments:
            return []
        shape = folded.translate(_SHAPE_TABLE)
        pattern = " " + " ".join(["a" * WORD_LENGTH] * k) + " "
        stride, width = WORD_LENGTH + 1, len(pattern) - 2
        groups: list[tuple[int, int, str, int]] = []  # start, end, canary, last word offset
        position = shape.find(pattern)
        while position >= 0:
            start = position + 1
            canary, offset = _fragment_entry(self._fragments.get(folded[start : start + width]))
            if canary:
                if groups and groups[-1][1:] == (start + width - stride, canary, offset - 1):
                    groups[-1] = (groups[-1][0], start + width, canary, offset)  # next k-gram
                else:
                    groups.append((start, start + width, canary, offset))
            position = shape.find(pattern, position + stride)
        tag_starts = [t.start for t in tags]  # in order; tag matches never overlap

        def inside_a_tag_match(start: int, end: int) -> bool:
            last = bisect_left(tag_starts, end) - 1  # the last tag match starting before end
            return last >= 0 and tags[last].end > start

        return [
            _Match(start, end, "fragment", canary, True)
            for start, end, canary, _ in groups
            if not inside_a_tag_match(start, end)
        ]


def _fragment_entry(entry: str | tuple[str, int] | None) -> tuple[str, int]:
    """(canary, word offset) of a fragment-dict entry; ("", 0) for none."""
    if entry is None:
        return "", 0
    return (entry, 0) if isinstance(entry, str) else entry


@dataclass(frozen=True, slots=True)
class _Match:
    """A candidate in folded coordinates; `complete` when `canary` has num_words words."""

    start: int
    end: int
    layer: Layer
    canary: str
    complete: bool


class StreamScanner:
    """Scans one streamed response; `feed` chunks as they arrive, then `finish`."""

    def __init__(self, index: CanaryIndex, *, scan_block: int = SCAN_BLOCK) -> None:
        if scan_block < 1:
            raise CanaryError(f"scan_block must be positive, got {scan_block}")
        self._index = index
        self._scan_block = scan_block
        self._tail = " "  # a separator before the response's first character
        self._base = -1  # absolute offset of _tail[0]
        self._pending: list[str] = []
        self._num_pending = 0
        self._decided = -1  # hits ending at or before this offset have been reported
        self._finished = False
        self.num_chars = 0

    @property
    def num_buffered(self) -> int:
        """Characters held back for matches that may still complete (bounded)."""
        return len(self._tail) + self._num_pending

    def feed(self, chunk: str) -> list[Hit]:
        """Hits that this chunk completed (possibly of earlier chunks' text)."""
        if self._finished:
            raise CanaryError("feed() after finish()")
        if chunk:
            self._pending.append(chunk)
            self._num_pending += len(chunk)
            self.num_chars += len(chunk)
        if self._num_pending < self._scan_block:
            return []
        return self._scan(final=False)

    def finish(self) -> list[Hit]:
        """The remaining hits, at the end of the response."""
        if self._finished:
            return []
        self._finished = True
        self._pending.append(" ")  # a separator after the last character
        return self._scan(final=True)

    def _scan(self, *, final: bool) -> list[Hit]:
        buffer = self._tail + "".join(self._pending)
        self._pending, self._num_pending = [], 0
        end = self._base + len(buffer)
        until = end - 1 if final else end - HOLDBACK  # final: all but the added separator
        hits = self._index._find(buffer, self._base, self._decided, until)
        self._decided = max(self._decided, until)
        keep = HOLDBACK + MAX_MATCH + CONTEXT
        if len(buffer) > keep:
            self._tail, self._base = buffer[-keep:], end - keep
        else:
            self._tail = buffer
        return hits

"""Finding canaries in streamed responses: the live-canary index and its stream scanner.

`CanaryIndex` holds the live canaries (canonical text -> `Owner`); `scanner()` gives a
`StreamScanner` for one response. Chunks go in as they arrive; hits come out with offsets
into the whole response text, each exactly once, however the chunks split it.

Layers, all run on each reading of the folded text (`canaries.normalize.fold_readings`:
invisible characters deleted, and, where the text holds any, as spaces):

- exact / normalized: every occurrence of the tag `ydk` as a word (`str.find`), followed
  by six-letter words. If the first `num_words` are canary words it is a canary: live ->
  its owner; not live but decrypting under the run key -> origin, and the owner
  `owner_of(origin)` gives; neither -> unknown origin (another run's canary, or one this
  index forgot). A tag with 6..num_words-1 canary words after it (a shorter canary of
  another run) is unknown origin too. "exact" when the response holds the canonical
  text verbatim, "normalized" when it was disguised (case, separators, zero-width or
  compatibility characters).
- fragment: a run of at least k consecutive words of a live canary, with or without its
  tag, from any position of the canary, separated by single non-alphanumeric characters.
  Every canary word has six letters, so after mapping letters to `a` a candidate is the
  fixed string " aaaaaa aaaaaa ... " (`str.find` again), checked against a dict of live
  k-grams (k = `fragment_words`, the shortest length the bound allows anywhere).
  Overlapping k-grams of one canary merge into one hit, which must then be as long as
  `canaries.fragments.FragmentRule` requires where it starts: 5 words of a 6-word canary
  in a response's first characters (413 of them with 2**20 live canaries, far more with
  fewer), 6 beyond, for at most 1e-9 benign hits per response up to `max_response_chars`
  (1 MiB, the harness's per-response bound) with up to `max_live` (2**20) live canaries.
  An index holding more than max_live canaries refuses more (CanaryError) rather than
  silently weaken the bound.

Where matches overlap, one wins: a tag match that resolves (live or decrypting) beats a
fragment, which beats a tag match of unknown origin. So a foreign fragment after a stray
tag (`ydk settle <6 words of tenant B's canary>`) is B's fragment, not an unknown canary,
and the same canary found in both readings is one hit.

Speed: for ASCII text, a scan is two `str.translate` and two `str.find` passes, so it does
not depend on the number of live canaries; lookups happen only at candidates. Memory is
bounded: the scanner keeps a tail of HOLDBACK + MAX_MATCH characters and scans once
`scan_block` new characters have arrived (SCAN_BLOCK, 32 KiB, by default), so hits arrive
once enough text follows them, or at `finish()`. A disguised canary spanning more than
MAX_MATCH original characters, or followed by more than HOLDBACK deleted characters, may
be missed.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import filterfalse

from kvcanary.canaries import scanner_fast
from kvcanary.canaries.errors import CanaryError
from kvcanary.canaries.fragments import MAX_LIVE, MAX_RESPONSE_CHARS, FragmentRule, fragment_rule
from kvcanary.canaries.fragments import min_fragment_words as min_fragment_words
from kvcanary.canaries.hit import Hit, Layer, Owner, Relation, classify, gc_paused
from kvcanary.canaries.mint import CanaryMinter, CanaryOrigin
from kvcanary.canaries.normalize import fold_readings
from kvcanary.canaries.shape import MAX_WORDS, MIN_WORDS, TAG, WORD_INDEX, WORD_LENGTH, canonical

__all__ = ["CanaryIndex", "Hit", "Owner", "Relation", "StreamScanner", "classify"]

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
        self.fragment_rule: FragmentRule | None = fragment_rule(
            minter, max_live=max_live, max_response_chars=max_response_chars
        )
        """Fragment lengths by position; None when no fragment is long enough."""
        self.fragment_words: int | None = (
            None if self.fragment_rule is None else self.fragment_rule.near_words
        )
        """The shortest fragment accepted anywhere (at the start of a response)."""
        self._peak_live = 0  # the most canaries live at once: the V of the near zone
        self._live: dict[str, Owner] = {}
        # k words -> the canary they open, or (canary, word offset) when they start later
        self._fragments: dict[str, str | tuple[str, int]] = {}
        # live canary -> (canary, owner, decoded origin), filled on its first hit (the
        # minter's own cache is smaller than a 1M-token prompt's canaries): what an exact
        # hit needs, in one lookup (the compiled core reads it); at most one per live canary
        self._resolved: dict[str, tuple[str, Owner, CanaryOrigin | None]] = {}

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
            if canary in self._live:
                self._resolved.pop(canary, None)  # its owner may change
            elif len(self._live) >= self.max_live:
                raise CanaryError(
                    f"more than {self.max_live} live canaries: discard old ones or raise "
                    f"max_live (which lengthens the minimum fragment)"
                )
            self._live[canary] = owner
            self._peak_live = max(self._peak_live, len(self._live))
            if k is not None:
                self._fragments[" ".join(words[:k])] = canary  # no tuple: saves memory
                for offset in range(1, num_words - k + 1):
                    self._fragments[" ".join(words[offset : offset + k])] = (canary, offset)

    def discard(self, canary: str) -> None:
        """Forgets a live canary (its hits become attributed-or-unknown)."""
        canary = canary.strip()
        self._resolved.pop(canary, None)
        if self._live.pop(canary, None) is None or self.fragment_words is None:
            return
        words, k = canary.split(" ")[1:], self.fragment_words
        for offset in range(len(words) - k + 1):
            key = " ".join(words[offset : offset + k])
            if _fragment_entry(self._fragments.get(key))[0] == canary:
                del self._fragments[key]

    def _resolve(self, canaries: list[str]) -> None:
        """Records (canary, owner, origin) for the live canaries not yet recorded, their
        origins decoded (`minter.attribute_canonical`)."""
        known = self._resolved
        todo = list(dict.fromkeys(filterfalse(known.__contains__, canaries)))
        if todo:
            origins = self.minter.attribute_canonical(todo)
            with gc_paused():
                records = zip(todo, map(self._live.__getitem__, todo), origins, strict=True)
                known.update(zip(todo, records, strict=True))

    def fragment_words_at(self, offset: int) -> int | None:
        """The fragment length required at response `offset` now (None: no fragments)."""
        if self.fragment_rule is None:
            return None
        return self.fragment_rule.words_at(offset, self._peak_live)

    def scanner(
        self, *, scan_block: int = SCAN_BLOCK, reference: bool = False, exact_only: bool = False
    ) -> StreamScanner:
        """A scanner for one response. It scans once `scan_block` new characters have
        arrived: smaller blocks report hits sooner, larger ones scan faster. `reference`
        runs the pure-Python layers on every block (the oracle the fast path,
        `canaries.scanner_fast`, is tested against), not only where a canary could be.
        `exact_only` reports the exact layer's hits alone (canaries verbatim), found on
        the raw text without folding it (`scanner_fast.find_exact`): the same hits as the
        full scan's exact ones, at `str.find` speed."""
        return StreamScanner(
            self, scan_block=scan_block, reference=reference, exact_only=exact_only
        )

    def scan(self, text: str) -> list[Hit]:
        """All hits in a complete text."""
        scanner = self.scanner()
        return scanner.feed(text) + scanner.finish()

    def _find(self, buffer: str, base: int, after: int, until: int) -> list[Hit]:
        """Hits in `buffer` (whose first character is at absolute offset `base`) that end
        in (after, until], absolute offsets: the fast path, `_find_oracle`'s hits."""
        return scanner_fast.find(self, buffer, base, after, until)

    def _find_exact(self, buffer: str, base: int, after: int, until: int) -> list[Hit]:
        """`_find`'s exact hits alone, fast (`scanner_fast.find_exact`)."""
        return scanner_fast.find_exact(self, buffer, base, after, until)

    def _find_oracle_exact(self, buffer: str, base: int, after: int, until: int) -> list[Hit]:
        """`_find_oracle`'s exact hits alone (the reference for `_find_exact`)."""
        return [h for h in self._find_oracle(buffer, base, after, until) if h.layer == "exact"]

    def _find_oracle(self, buffer: str, base: int, after: int, until: int) -> list[Hit]:
        """`_find` by the pure-Python layers over the whole buffer (the reference)."""
        candidates: list[tuple[int, int, _Match]] = []
        for folded in fold_readings(buffer):
            tags = self._tag_matches(folded.text)
            fragments = _outside_live_tags(self._fragment_matches(folded.text), tags, self._live)
            for match in tags + fragments:
                start, end = folded.original_span(match.start, match.end)
                if match.layer == "fragment" and match.num_words < self._words_at(base + start):
                    continue
                candidates.append((start, end, match))
        if not candidates:
            return []
        complete = list({m.canary: None for _, _, m in candidates if m.complete})
        origins = dict(zip(complete, self.minter.attribute_canonical(complete), strict=True))
        hits = []
        for start, end, match in _winners(candidates, origins, self._live):
            if not after < base + end <= until:
                continue
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

    def _words_at(self, offset: int) -> int:
        rule = self.fragment_rule
        assert rule is not None, "fragment matches without a fragment rule"
        return rule.words_at(offset, self._peak_live)

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
        return _Match(position, end, "normalized", canary, num_used == num_words, num_used)

    def _fragment_matches(self, folded: str) -> list[_Match]:
        k = self.fragment_words
        if k is None or not self._fragments:
            return []
        shape = folded.translate(_SHAPE_TABLE)
        pattern = " " + " ".join(["a" * WORD_LENGTH] * k) + " "
        stride, width = WORD_LENGTH + 1, len(pattern) - 2
        groups: list[tuple[int, int, str, int, int]] = []  # start, end, canary, offsets
        position = shape.find(pattern)
        while position >= 0:
            start = position + 1
            canary, offset = _fragment_entry(self._fragments.get(folded[start : start + width]))
            if canary:
                last = groups[-1] if groups else None
                if (
                    last is not None
                    and last[1:3] == (start + width - stride, canary)
                    and (last[4] == offset - 1)
                ):
                    groups[-1] = (last[0], start + width, canary, last[3], offset)  # next k-gram
                else:
                    groups.append((start, start + width, canary, offset, offset))
            position = shape.find(pattern, position + stride)
        return [
            _Match(start, end, "fragment", canary, True, k + last - first)
            for start, end, canary, first, last in groups
        ]


def _outside_live_tags(
    fragments: list[_Match], tags: list[_Match], live: dict[str, Owner]
) -> list[_Match]:
    """The fragments that overlap no tag match of a live canary (which would win anyway:
    dropping them here saves resolving them, in the common case of an echoed canary)."""
    if not fragments:
        return fragments
    live_tags = [t for t in tags if t.canary in live]  # in order; tag matches never overlap
    starts = [t.start for t in live_tags]

    def overlaps_a_live_tag(fragment: _Match) -> bool:
        last = bisect_left(starts, fragment.end) - 1  # the last live tag starting before end
        return last >= 0 and live_tags[last].end > fragment.start

    return [f for f in fragments if not overlaps_a_live_tag(f)]


def _winners(
    candidates: list[tuple[int, int, _Match]],
    origins: dict[str, CanaryOrigin | None],
    live: dict[str, Owner],
) -> list[tuple[int, int, _Match]]:
    """Candidates that overlap no better one, in text order. Better: a tag match that
    resolves (live or decrypting), then a fragment, then a tag match of unknown origin;
    between equals, the longer, then the earlier. Overlaps are local, so candidates are
    resolved per cluster of overlapping spans (one sort, then small clusters)."""

    def rank(item: tuple[int, int, _Match]) -> tuple[int, int, int]:
        start, end, match = item
        if match.layer == "fragment":
            tier = 1
        elif match.canary in live or origins.get(match.canary) is not None:
            tier = 0
        else:
            tier = 2
        return tier, start - end, start

    def resolve(cluster: list[tuple[int, int, _Match]]) -> list[tuple[int, int, _Match]]:
        if len(cluster) == 1:
            return cluster
        if len(cluster) == 2:  # the common case: a tag match and the fragment inside it
            return [min(cluster, key=rank)]  # members of a cluster of two overlap
        chosen: list[tuple[int, int, _Match]] = []
        for item in sorted(cluster, key=rank):
            if all(item[1] <= other[0] or other[1] <= item[0] for other in chosen):
                chosen.append(item)
        return sorted(chosen, key=lambda item: item[0])

    kept: list[tuple[int, int, _Match]] = []
    cluster: list[tuple[int, int, _Match]] = []
    cluster_end = 0
    for item in sorted(candidates, key=lambda item: item[:2]):
        if cluster and item[0] >= cluster_end:
            kept += resolve(cluster)
            cluster = []
        cluster_end = max(cluster_end, item[1]) if cluster else item[1]
        cluster.append(item)
    return kept + resolve(cluster) if cluster else kept


def _fragment_entry(entry: str | tuple[str, int] | None) -> tuple[str, int]:
    """(canary, word offset) of a fragment-dict entry; ("", 0) for none."""
    if entry is None:
        return "", 0
    return (entry, 0) if isinstance(entry, str) else entry


@dataclass(frozen=True, slots=True)
class _Match:
    """A candidate in folded coordinates; `complete` when `canary` has num_words words
    (always, for a fragment); `num_words` of them were matched (a fragment's length)."""

    start: int
    end: int
    layer: Layer
    canary: str
    complete: bool
    num_words: int


class StreamScanner:
    """Scans one streamed response; `feed` chunks as they arrive, then `finish`."""

    def __init__(
        self,
        index: CanaryIndex,
        *,
        scan_block: int = SCAN_BLOCK,
        reference: bool = False,
        exact_only: bool = False,
    ) -> None:
        if scan_block < 1:
            raise CanaryError(f"scan_block must be positive, got {scan_block}")
        self._index = index
        if exact_only:
            self._find = index._find_oracle_exact if reference else index._find_exact
        else:
            self._find = index._find_oracle if reference else index._find
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
        hits = self._find(buffer, self._base, self._decided, until)
        self._decided = max(self._decided, until)
        keep = HOLDBACK + MAX_MATCH + CONTEXT
        if len(buffer) > keep:
            self._tail, self._base = buffer[-keep:], end - keep
        else:
            self._tail = buffer
        return hits

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
from collections.abc import Callable, Iterable
from itertools import filterfalse, repeat

from kvcanary.canaries import scanner_fast
from kvcanary.canaries.errors import CanaryError
from kvcanary.canaries.fragments import MAX_LIVE, MAX_RESPONSE_CHARS, FragmentRule, fragment_rule
from kvcanary.canaries.fragments import min_fragment_words as min_fragment_words
from kvcanary.canaries.hit import Hit, Layer, Owner, Relation, classify, gc_paused
from kvcanary.canaries.matches import Match, fragment_entry, outside_live_tags, winners
from kvcanary.canaries.mint import CanaryMinter, CanaryOrigin
from kvcanary.canaries.normalize import fold_readings
from kvcanary.canaries.shape import MAX_WORDS, MIN_WORDS, TAG, WORD_INDEX, WORD_LENGTH, canonical
from kvcanary.canaries.stream_scan import CONTEXT as CONTEXT
from kvcanary.canaries.stream_scan import HOLDBACK as HOLDBACK
from kvcanary.canaries.stream_scan import MAX_MATCH as MAX_MATCH
from kvcanary.canaries.stream_scan import SCAN_BLOCK as SCAN_BLOCK
from kvcanary.canaries.stream_scan import StreamScanner

__all__ = ["CanaryIndex", "Hit", "Owner", "Relation", "StreamScanner", "classify"]

_SHAPE_TABLE = str.maketrans(
    {**{c: "a" for c in range(ord("a"), ord("z") + 1)}, **{c: "0" for c in b"0123456789"}}
)
_TAG_RUN = re.compile(rf"(?: +[a-z]{{{WORD_LENGTH}}}(?![a-z0-9]))+")
_CANONICAL = {
    w: re.compile(rf"{TAG}(?: [a-z]{{{WORD_LENGTH}}}){{{w}}}")
    for w in range(MIN_WORDS, MAX_WORDS + 1)
}
_CANONICAL_LINES = {
    w: re.compile(rf"(?:{TAG}(?: [a-z]{{{WORD_LENGTH}}}){{{w}}}\n)*") for w in _CANONICAL
}
"""Canonical canaries of `w` words, one per line: a batch checked in one pass."""
_WORD_SET = frozenset(WORD_INDEX)
_STEP = WORD_LENGTH + 1


class CanaryIndex:
    """The live canaries of a run, and scanners that find them (and others) in responses."""

    def __init__(
        self,
        minter: CanaryMinter,
        owner_of: Callable[[CanaryOrigin], Owner | None] | None = None,
        *,
        max_live: int = MAX_LIVE,
        max_response_chars: int = MAX_RESPONSE_CHARS,
        keep_live: int | None = None,
    ) -> None:
        self.minter = minter
        self.owner_of = owner_of
        self.max_live = max_live if keep_live is None else min(keep_live, max_live)
        """How many canaries may be live at once: more is a `CanaryError` (a run forgets
        its oldest plans' canaries before). `keep_live` lowers it below the `max_live` the
        fragment rule is bounded for: fewer live canaries only lower the false positives,
        so the rule (and what it finds) stays that of `max_live`."""
        self.fragment_rule: FragmentRule | None = fragment_rule(
            minter, max_live=max_live, max_response_chars=max_response_chars
        )
        """Fragment lengths by position; None when no fragment is long enough."""
        self.fragment_words: int | None = (
            None if self.fragment_rule is None else self.fragment_rule.near_words
        )
        """The shortest fragment accepted anywhere (at the start of a response)."""
        self._peak_live = 0  # the most canaries live at once: the V of the near zone
        self._elsewhere = 0  # live in the run's other indexes (`live_elsewhere`)
        self._live: dict[str, Owner] = {}
        # k words -> the canary they open, or (canary, word offset) when they start later
        self._fragments: dict[str, str | tuple[str, int]] = {}
        # live canary -> (canary, owner, decoded origin), filled on its first hit (the
        # minter's own cache is smaller than a 1M-token prompt's canaries): what an exact
        # hit needs, in one lookup (the compiled core reads it); at most one per live canary
        self._resolved: dict[str, tuple[str, Owner, CanaryOrigin | None]] = {}
        num_words, k = minter.num_words, self.fragment_words
        # where each k-gram of a canonical canary starts: its words have a fixed width
        self._kgram_starts = (
            []
            if k is None
            else [len(TAG) + 1 + _STEP * offset for offset in range(num_words - k + 1)]
        )
        self._kgram_width = 0 if k is None else _STEP * k - 1

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
        """Registers many live canaries. Canonical texts (what a minter spells, as a prompt's
        canaries are) are checked in one pass for the batch; others are canonicalised."""
        pairs = list(items)
        texts = [text for text, _ in pairs]
        if not self._all_canonical(texts):
            texts = [self._canonical(text) for text in texts]
        live, owners = self._live, [owner for _, owner in pairs]
        if len(live) + len(texts) <= self.max_live and live.keys().isdisjoint(texts):
            live.update(zip(texts, owners, strict=True))  # the common case: new ones, with room
        else:
            self._add_one_by_one(texts, owners)
        self._peak_live = max(self._peak_live, len(live) + self._elsewhere)
        if self.fragment_words is None:
            return
        fragments, width = self._fragments, self._kgram_width
        first, *later = self._kgram_starts
        keys = [canary[first : first + width] for canary in texts]
        fragments.update(zip(keys, texts, strict=True))
        for offset, start in enumerate(later, 1):
            keys = [canary[start : start + width] for canary in texts]
            fragments.update(zip(keys, zip(texts, repeat(offset)), strict=True))  # (canary, offset)

    def live_elsewhere(self, num_live: int) -> None:
        """Count `num_live` canaries live in the run's other indexes (a `--ray` run's other
        actors, `canaries.elsewhere`) toward the fragment rule's V, so the near zone is what
        one index of them all would allow."""
        self._elsewhere = num_live
        self._peak_live = max(self._peak_live, len(self._live) + num_live)

    def _add_one_by_one(self, texts: list[str], owners: list[Owner]) -> None:
        live, resolved, limit = self._live, self._resolved, self.max_live
        for canary, owner in zip(texts, owners, strict=True):
            if canary in live:
                resolved.pop(canary, None)  # its owner may change
            elif len(live) >= limit:
                raise CanaryError(
                    f"more than {limit} live canaries: discard old ones or raise "
                    f"max_live (which lengthens the minimum fragment)"
                )
            live[canary] = owner

    def _all_canonical(self, texts: list[str]) -> bool:
        """Whether every text is a canonical canary of this minter's length made of
        canary words (one regex pass and one set check for the batch)."""
        joined = "\n".join(texts) + "\n"
        if not _CANONICAL_LINES[self.minter.num_words].fullmatch(joined):
            return False
        return _WORD_SET.issuperset(joined.replace(TAG + " ", "").split())

    def _canonical(self, text: str) -> str:
        num_words = self.minter.num_words
        canary = text if _CANONICAL[num_words].fullmatch(text) else canonical(text, num_words)
        if not all(map(WORD_INDEX.__contains__, canary.split(" ")[1:])):
            canary = canonical(text, num_words)  # raises, naming the problem
        return canary

    def discard(self, canary: str) -> None:
        """Forgets a live canary (its hits become attributed-or-unknown)."""
        canary = canary.strip()
        self._resolved.pop(canary, None)
        if self._live.pop(canary, None) is None or self.fragment_words is None:
            return
        fragments, width = self._fragments, self._kgram_width
        for start in self._kgram_starts:
            key = canary[start : start + width]
            entry = fragments.get(key)
            if (entry[0] if type(entry) is tuple else entry) == canary:
                del fragments[key]

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
        candidates: list[tuple[int, int, Match]] = []
        for folded in fold_readings(buffer):
            tags = self._tag_matches(folded.text)
            fragments = outside_live_tags(self._fragment_matches(folded.text), tags, self._live)
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
        for start, end, match in winners(candidates, origins, self._live):
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

    def _tag_matches(self, folded: str) -> list[Match]:
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

    def _tag_match(self, folded: str, position: int, run: re.Match[str]) -> Match | None:
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
        return Match(position, end, "normalized", canary, num_used == num_words, num_used)

    def _fragment_matches(self, folded: str) -> list[Match]:
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
            canary, offset = fragment_entry(self._fragments.get(folded[start : start + width]))
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
            Match(start, end, "fragment", canary, True, k + last - first)
            for start, end, canary, first, last in groups
        ]

"""Canaries live in another index of the same run: what a response may hold of them, and
what an index answers when asked.

A run whose tenants are scanned in several processes (`--ray`: one actor per tenant) keeps
one index per process, each holding its own tenants' live canaries. A whole canary needs no
index (the run key attributes it), but a fragment (k words without the tag) is found only
through the k-grams of the live canaries, and another tenant's are in another index. So a
scan asks the others about the k-word runs its own index cannot place:

- `foreign_kgrams(index, text, hits)`: the runs of k canary words (k = the index's
  `fragment_words`), in either reading of `text` (`canaries.normalize.fold_readings`), that
  are not k-grams of a canary live in `index` and overlap no hit already found in `text`.
  A run overlapping a hit can only belong to another canary if both share a word at the
  same place, which random words almost never do; the windows that straddle an echoed
  canary and the filler after it are all of this kind, so an echo asks nothing.
- `live_holding(index, kgrams)`: the canaries live in `index` (with their owners) holding
  any of `kgrams`: what an index answers. The asker adds them to its own index (they are
  live, as a single index of the whole run would hold them) and scans the text again, so
  its hits are those one index of every live canary gives.

The fragment rule's V (how many canaries are live) counts the other indexes' canaries too
(`CanaryIndex.live_elsewhere`), so the near zone is the single index's.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from itertools import accumulate
from typing import TYPE_CHECKING

from kvcanary.canaries.hit import Hit, Owner
from kvcanary.canaries.matches import fragment_entry
from kvcanary.canaries.normalize import fold_readings
from kvcanary.canaries.shape import WORD_INDEX, WORD_LENGTH

if TYPE_CHECKING:
    from kvcanary.canaries.index import CanaryIndex

_LETTERS = str.maketrans(
    {**{c: "a" for c in range(ord("a"), ord("z") + 1)}, **{c: "0" for c in b"0123456789"}}
)
_STEP = WORD_LENGTH + 1


def foreign_kgrams(index: CanaryIndex, text: str, hits: Sequence[Hit]) -> set[str]:
    """The k-word runs of canary words in `text` that `index` cannot place (see the module
    docstring); empty when the index accepts no fragments."""
    k = index.fragment_words
    if k is None:
        return set()
    pattern = " " + " ".join(["a" * WORD_LENGTH] * k) + " "
    width = len(pattern) - 2
    spans = sorted((hit.start, hit.end) for hit in hits)
    starts = [start for start, _ in spans]
    reach = list(accumulate((end for _, end in spans), max))  # the furthest end so far
    live = index._fragments
    found: set[str] = set()
    # separators around the text, as the stream scanner reads it: offsets shift by one
    for folded in fold_readings(f" {text} "):
        shape = folded.text.translate(_LETTERS)
        position = shape.find(pattern)
        while position >= 0:
            start = position + 1
            kgram = folded.text[start : start + width]
            if kgram not in live and all(map(WORD_INDEX.__contains__, kgram.split(" "))):
                lo, hi = folded.original_span(start, start + width)
                if not _overlaps(starts, reach, lo - 1, hi - 1):
                    found.add(kgram)
            position = shape.find(pattern, position + _STEP)
    return found


def _overlaps(starts: list[int], reach: list[int], lo: int, hi: int) -> bool:
    """Whether [lo, hi) overlaps a span of those starting at `starts` (sorted), `reach[i]`
    the furthest end of the first i + 1."""
    at = bisect_left(starts, hi) - 1  # the last span starting before hi
    return at >= 0 and reach[at] > lo


def live_holding(index: CanaryIndex, kgrams: Iterable[str]) -> list[tuple[str, Owner]]:
    """The canaries live in `index` holding any of `kgrams`, with their owners."""
    holding: dict[str, Owner] = {}
    for kgram in kgrams:
        canary, _ = fragment_entry(index._fragments.get(kgram))
        owner = index.owner(canary) if canary else None
        if owner is not None:
            holding[canary] = owner
    return list(holding.items())

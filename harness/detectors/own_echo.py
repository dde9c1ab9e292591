"""Own echoes: canary-shaped markers recombined from the request's own prompt text.

A model asked to repeat its prompt, or an engine quoting page-sized excerpts, can splice
pieces of the prompt at token boundaries and reorder them. Where pieces meet, the tag of
one own canary can be followed by words of others or of the filler: a canary-shaped marker
that no key decodes. `OwnText.explains(words)` says whether a marker's words (tag first)
can be read as such a recombination of one prompt.

How loose the reading may be is set by a budget, not a guess. A canary of another run is
the tag and w words drawn uniformly from the B-word list, independently of this prompt,
so the chance that one passes as an echo can be bounded, and must stay at or below
`ECHO_HIDE_BOUND` per marker:

- **any order, any mixture** (every word occurs somewhere in the prompt): exactly
  (u/B)^w, with u the prompt's distinct list words. Used when that is within budget
  (prompts up to about 2,200 tokens);
- **at most m contiguous pieces**: the marker splits into m runs, each a run of
  consecutive words of the prompt. By the union bound over the splits, a split into
  pieces of lengths l_1 (holding the tag) .. l_k passes with probability at most
  P_tag(l_1) * prod P(l_i), where P_tag(1) = 1, P_tag(l) = min(1, C / B^(l-1)) for C tags,
  P(1) = u / B and P(l) = min(1, M / B^l) for M prompt words. m is the largest count whose
  sum over all splits of at most m pieces stays within budget: e.g. 5 for a 4,096-token
  prompt, 4 from 16k to 128k tokens, 3 for 1M tokens.

It knows nothing about scanning or findings.
"""

from __future__ import annotations

import itertools
from functools import cache

from canaries import TAG, WORDS, fold
from canaries.shape import WORD_INDEX
from canaries.span import CanarySpan

ECHO_HIDE_BOUND = 1e-3
"""The most probability a marker of another run may have of being taken for an own echo."""


class OwnText:
    """The words of one prompt, and which canary-shaped markers they explain."""

    def __init__(self, prompt: str, canaries: tuple[CanarySpan, ...] = ()) -> None:
        if prompt:
            words = fold(prompt).text.split()
        else:  # re-analysis of a journal, whose plans carry no prompt: the canaries only
            words = [word for span in canaries for word in fold(span.text).text.split()]
        self.words = words
        self.vocabulary = frozenset(words)
        self.num_list_words = sum(1 for word in self.vocabulary if word in WORD_INDEX)
        self.num_tags = words.count(TAG)
        self._positions: dict[str, list[int]] | None = None

    def max_pieces(self, num_marker_words: int) -> int:
        """The most contiguous pieces a marker of this many words (tag included) may be
        split into and still count as an echo; `num_marker_words` means any order."""
        return _max_pieces(num_marker_words, self.num_list_words, len(self.words), self.num_tags)

    def explains(self, marker: list[str]) -> bool:
        """Whether `marker` (folded words, tag first) is a recombination of this prompt."""
        if not marker or not all(word in self.vocabulary for word in marker):
            return False
        allowed = self.max_pieces(len(marker))
        return allowed >= len(marker) or self.min_pieces(marker) <= allowed

    def min_pieces(self, marker: list[str]) -> int:
        """The fewest runs of consecutive prompt words that `marker` splits into."""
        if self._positions is None:
            self._positions = {}
            for position, word in enumerate(self.words):
                self._positions.setdefault(word, []).append(position)
        words, num = self.words, len(marker)
        reach = []  # reach[i]: the longest run of the marker from i found in the prompt
        for i, first in enumerate(marker):
            best = 0
            for position in self._positions.get(first, ()):
                length = 1
                while (
                    i + length < num
                    and position + length < len(words)
                    and words[position + length] == marker[i + length]
                ):
                    length += 1
                best = max(best, length)
                if i + best == num:
                    break
            reach.append(best)
        fewest = [0] + [num + 1] * num  # fewest[j]: pieces covering marker[:j]
        for i in range(num):
            for j in range(i + 1, i + reach[i] + 1):
                fewest[j] = min(fewest[j], fewest[i] + 1)
        return fewest[num]


@cache
def _max_pieces(num_marker_words: int, num_list_words: int, num_words: int, num_tags: int) -> int:
    base = len(WORDS)
    if (num_list_words / base) ** (num_marker_words - 1) <= ECHO_HIDE_BOUND:
        return num_marker_words  # any order

    def chance(length: int, *, first: bool) -> float:
        if first:
            return 1.0 if length == 1 else min(1.0, num_tags / base ** (length - 1))
        return num_list_words / base if length == 1 else min(1.0, num_words / base**length)

    by_count = [0.0] * (num_marker_words + 1)  # summed chance of the splits into k pieces
    cut_points = range(1, num_marker_words)
    for num_cuts in range(num_marker_words):
        for cuts in itertools.combinations(cut_points, num_cuts):
            bounds = (0, *cuts, num_marker_words)
            product = 1.0
            for index, (start, end) in enumerate(itertools.pairwise(bounds)):
                product *= chance(end - start, first=index == 0)
            by_count[num_cuts + 1] += product
    allowed, total = 0, 0.0
    for count in range(1, num_marker_words):
        total += by_count[count]
        if total > ECHO_HIDE_BOUND:
            break
        allowed = count
    return allowed

"""Own echoes: canary-shaped markers recombined from the request's own prompt text.

A model asked to repeat its prompt, or an engine quoting page-sized excerpts, can splice
pieces of the prompt at token boundaries and reorder them. Where pieces meet, the tag of
one own canary can be followed by words of others or of the filler: a canary-shaped marker
that no key decodes. A dropped or repeated token inside a word can also glue two pieces of
prompt words into a list word the prompt never held (`" col" + "ony"`): one substituted
word. `OwnText.explains(words)` says whether a marker's words (tag first) can be read as
such a recombination of one prompt.

How loose the reading may be is set by a budget, not a guess. A canary of another run is
the tag and w words drawn uniformly from the B-word list, independently of this prompt,
so the chance that one passes as an echo can be bounded, and must stay at or below
`ECHO_HIDE_BOUND` per marker and per reading. With u the prompt's distinct list words and
p = u / B, there are two readings:

**1. Every word occurs in the prompt** (no substitution):

- **any order, any mixture**: exactly p^w. Used when that is within budget (prompts up to
  about 2,200 tokens);
- **at most m contiguous pieces**: the marker splits into m runs, each a run of
  consecutive words of the prompt. By the union bound over the splits, a split into
  pieces of lengths l_1 (holding the tag) .. l_k passes with probability at most
  P_tag(l_1) * prod P(l_i), where P_tag(1) = 1, P_tag(l) = min(1, C / B^(l-1)) for C tags,
  P(1) = p and P(l) = min(1, M / B^l) for M prompt words. m is the largest count whose
  sum over all splits of at most m pieces stays within budget: e.g. 5 for a 4,096-token
  prompt, 4 from 16k to 128k tokens, 3 for 1M tokens.

**2. Exactly one word (not the tag) occurs nowhere in the prompt** (a substitution):

- **any order**: a foreign marker has at least w - 1 of its w words in the prompt with
  probability p^w + w p^(w-1) (1 - p) <= w p^(w-1), so any order with one substitution is
  used when w (u/B)^(w-1) <= ECHO_HIDE_BOUND (u <= 610 for w = 6: prompts up to about
  1,100 tokens). That event contains reading 1's "any order", so for these prompts the
  two readings together stay within one budget;
- **at most m' pieces, one of them the substituted word**: as above, with the substituted
  word a one-word piece (not the tag's) that matches with probability 1. The union bound
  sums, over every split of at most m' pieces, the product of its pieces' chances plus,
  for each one-word piece but the tag's, that product with the piece's chance p replaced
  by 1 (it is the substitution). m' is the largest count within budget: 6 (of 7) from
  about 1,100 to 1,650 tokens, 5 from about 1,700 to 4,096 tokens, 4 from 16k to 128k
  tokens, 3 for 1M tokens.

A marker with two or more words from outside the prompt is never an echo, and neither is
one made of words from no prompt at all. So for longer prompts an own echo hides a given
canary of another run with probability at most 2 x ECHO_HIDE_BOUND (the two readings'
budgets), and at most ECHO_HIDE_BOUND for prompts up to about 1,100 tokens; a leaked page
carries several markers, each an independent chance, so a real cross-run leak goes unseen
only if every one of them is hidden. Canaries of this run are never read as echoes (they
decode under the run key, `harness.detectors.content`), and a fragment of another live
canary wins over the marker it overlaps in the scanner (`canaries.index`), so neither
rule ever hides a live canary of another tenant or request.

It knows nothing about scanning or findings.
"""

from __future__ import annotations

import itertools
import math
from functools import cache

from kvcanary.canaries import TAG, WORDS, fold
from kvcanary.canaries.shape import WORD_INDEX
from kvcanary.canaries.span import CanarySpan

ECHO_HIDE_BOUND = 1e-3
"""The most probability a marker of another run may have of being taken for an own echo, per
reading (every word in the prompt; one substituted word)."""


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

    def max_pieces(self, num_marker_words: int, *, substituted: bool = False) -> int:
        """The most contiguous pieces a marker of this many words (tag included) may be
        split into and still count as an echo; `num_marker_words` means any order. With
        `substituted`, for the reading where one word (a piece of its own) is not the
        prompt's."""
        return _max_pieces(
            num_marker_words, self.num_list_words, len(self.words), self.num_tags, substituted
        )

    def explains(self, marker: list[str]) -> bool:
        """Whether `marker` (folded words, tag first) is a recombination of this prompt,
        with at most one word (not the tag) substituted."""
        if not marker or marker[0] not in self.vocabulary:
            return False
        outside = [i for i, word in enumerate(marker) if word not in self.vocabulary]
        if len(outside) > 1:
            return False
        num = len(marker)
        if not outside:
            allowed = self.max_pieces(num)
            if allowed >= num or self.min_pieces(marker) <= allowed:
                return True
        allowed = self.max_pieces(num, substituted=True)
        if allowed >= num:
            return True
        candidates = outside or range(1, num)  # the substituted word, or any word but the tag
        return any(
            self.min_pieces(marker[:at]) + 1 + self.min_pieces(marker[at + 1 :]) <= allowed
            for at in candidates
        )

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
def _max_pieces(
    num_marker_words: int, num_list_words: int, num_words: int, num_tags: int, substituted: bool
) -> int:
    base = len(WORDS)
    share, num_free = num_list_words / base, num_marker_words - 1  # p, and w (all but the tag)
    # any order: at least w - 1 of the w words in the prompt (substituted), or all w
    any_order = num_free * share ** (num_free - 1) if substituted else share**num_free
    if any_order <= ECHO_HIDE_BOUND:
        return num_marker_words

    def chance(length: int, *, first: bool) -> float:
        if first:
            return 1.0 if length == 1 else min(1.0, num_tags / base ** (length - 1))
        return num_list_words / base if length == 1 else min(1.0, num_words / base**length)

    by_count = [0.0] * (num_marker_words + 1)  # summed chance of the splits into k pieces
    cut_points = range(1, num_marker_words)
    for num_cuts in range(num_marker_words):
        for cuts in itertools.combinations(cut_points, num_cuts):
            bounds = (0, *cuts, num_marker_words)
            chances = [
                chance(end - start, first=index == 0)
                for index, (start, end) in enumerate(itertools.pairwise(bounds))
            ]
            by_count[num_cuts + 1] += math.prod(chances)
            if substituted:  # any one-word piece but the tag's may be the substitution
                by_count[num_cuts + 1] += sum(
                    math.prod(chances[:index] + chances[index + 1 :])
                    for index in range(1, len(chances))
                    if bounds[index + 1] - bounds[index] == 1
                )
    allowed, total = 0, 0.0
    for count in range(1, num_marker_words):
        total += by_count[count]
        if total > ECHO_HIDE_BOUND:
            break
        allowed = count
    return allowed

"""How many consecutive words of a live canary make a fragment hit: the false-positive bound.

A fragment is k consecutive words of a live canary without its tag. A canary's words are
pseudorandom, independent of any benign text, so a benign k-word window equals a given
window of a given live canary with probability at most p(k) = max(r, 1 + r/B) * B**-k, with
B the minter's alphabet size (3,445 words by default) and r = B**w / 2**D in [1, 4)
correcting for the cipher's D-bit range not filling all B**w spellings (p(w) = 2**-D
exactly). Each character position is read twice (`canaries.normalize.fold_readings`:
invisible characters deleted, and as spaces), a word and its separator take at least 7
characters, so a response of L characters has at most R * L / 7 word starts, R = 2
readings, and with V live canaries of w words

    P(any benign fragment hit in a response) <= sum over word starts of V * c(k),
    c(k) = (w - k + 1) * p(k),

where k is the fragment length required at that word start. The budget is 1e-9 per
response, spent in two zones:

- **far**: `far_words`, the smallest k with R * (L / 7) * max_live * c(k) <= 1e-9, is
  enough anywhere in a response up to L characters long (L = max_response_chars, the
  harness's per-response byte bound; a character is at least one byte);
- **near**: the rest of the budget buys one word less (`near_words`) over the first
  `near_chars(V)` characters: n = floor(rest / (R * V * (c(near) - c(far)))) word starts
  per reading, 7 * n characters, with V the most canaries the index has held live so far
  (a high-water mark, so a response scanned in several blocks never sees V fall and its
  near zone never grow, which keeps the sum within the rest).

At the defaults (6-word canaries, max_live 2**20, L = 2**20) that is 6 words anywhere and
5 words in the first 413 characters with 2**20 live canaries, 3,353 with 2**17, 4,396
with 100,000 and 44,016 with 10,000. Characters that fold to several letters (ligatures
such as U+FB03) could pack word starts more densely than one per 7 characters; benign
text does not use them for that, and the bound does not cover text crafted to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvcanary.canaries.mint import CanaryMinter
from kvcanary.canaries.shape import WORD_LENGTH

FALSE_POSITIVE_RATE = 1e-9
MAX_LIVE = 1 << 20
MAX_RESPONSE_CHARS = 1 << 20
"""The harness's per-response bound (`harness.run.wiring.MAX_RESPONSE_BYTES`, 1 MiB): a
response of that many bytes has at most that many characters."""
READINGS = 2
"""Readings per character position: invisible characters deleted, and as spaces."""


def _log2_cost(minter: CanaryMinter, k: int) -> float:
    """log2 of c(k) = (w - k + 1) * p(k) for one canary and one word start."""
    num_words, base = minter.num_words, minter.alphabet.size
    log_r = num_words * math.log2(base) - minter.num_bits
    log_p = (
        -minter.num_bits
        if k == num_words
        else max(log_r, math.log2(1 + 2**log_r / base)) - k * math.log2(base)
    )
    return math.log2(num_words - k + 1) + log_p


def min_fragment_words(
    minter: CanaryMinter,
    *,
    max_live: int = MAX_LIVE,
    max_response_chars: int = MAX_RESPONSE_CHARS,
    false_positive_rate: float = FALSE_POSITIVE_RATE,
) -> int | None:
    """The shortest fragment (in words) that keeps benign hits within the rate anywhere in
    a response, or None when even a whole tagless canary would not (the far zone)."""
    positions = READINGS * max_response_chars / (WORD_LENGTH + 1)
    for k in range(1, minter.num_words + 1):
        log_bound = math.log2(positions * max_live) + _log2_cost(minter, k)
        if log_bound <= math.log2(false_positive_rate):
            return k
    return None


@dataclass(frozen=True, slots=True)
class FragmentRule:
    """The fragment lengths an index accepts, by where a fragment starts in a response."""

    far_words: int
    near_words: int
    near_budget: float
    """What is left of the false-positive budget once the far zone is paid for."""
    near_cost: float
    """R * (c(near_words) - c(far_words)): the extra cost of one near word start per
    live canary."""

    def near_chars(self, num_live: int) -> int:
        """How many leading characters of a response accept `near_words`-word fragments."""
        if self.near_words == self.far_words or self.near_cost <= 0:
            return 0
        word_starts = math.floor(self.near_budget / (max(num_live, 1) * self.near_cost))
        return word_starts * (WORD_LENGTH + 1)

    def words_at(self, offset: int, num_live: int) -> int:
        """The fragment length required of a fragment starting at response `offset`."""
        return self.near_words if offset < self.near_chars(num_live) else self.far_words


def fragment_rule(
    minter: CanaryMinter,
    *,
    max_live: int,
    max_response_chars: int,
    false_positive_rate: float = FALSE_POSITIVE_RATE,
) -> FragmentRule | None:
    """The two-zone rule for an index of these limits (see the module docstring)."""
    far = min_fragment_words(
        minter,
        max_live=max_live,
        max_response_chars=max_response_chars,
        false_positive_rate=false_positive_rate,
    )
    if far is None:
        return None
    positions = READINGS * max_response_chars / (WORD_LENGTH + 1)
    far_total = positions * max_live * 2 ** _log2_cost(minter, far)
    if far == 1:
        return FragmentRule(far, far, 0.0, 0.0)
    near = far - 1
    near_cost = READINGS * (2 ** _log2_cost(minter, near) - 2 ** _log2_cost(minter, far))
    return FragmentRule(far, near, false_positive_rate - far_total, near_cost)

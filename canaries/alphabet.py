"""The canary alphabet: which words of the word list a run's canaries are spelled with.

The word list (`canaries.shape.WORDS`, six-letter words that are one token each in
cl100k_base) is the universe every scanner knows. A run spells its canaries with a subset
of it, chosen deterministically for the target's tokenizer:

1. words a content filter might refuse or rewrite (`MODERATION_BLOCKLIST`) are never
   canary words, in any tokenizer: a canary that a moderation layer rewrites is a canary
   that cannot leak visibly;
2. of the rest, the words that cost the fewest tokens after a space in that tokenizer:
   the smallest cost k such that at least `MIN_LETTERS` words cost k or less, and then
   every word that does. In cl100k_base every word is one token (k = 1, 3,445 letters);
   in DeepSeek V3's tokenizer 2,853 words are one token (k = 1; 68 bits in 6 words); in a byte-level
   vocabulary every word is 7 tokens and the alphabet is the whole filtered list.

So canaries stay as short as the vocabulary allows, and a vocabulary without enough
one-token words falls back to the cheapest multi-token words (longer canaries, a larger
page size guaranteed; see `canaries.guarantee`). `MIN_LETTERS` keeps at least 66 bits in
6 words (18 check bits; see `canaries.mint`).

An alphabet is named by `alphabet_id`, 8 hex characters of a hash of its words in order,
which the journal records; the same tokenizer always gives the same alphabet, so whoever
holds a run's key and its tokenizer can attribute its canaries from the journal alone.
This module knows nothing about keys, prompts or scanning.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvcanary.canaries.costs import canary_costs
from kvcanary.canaries.shape import WORD_INDEX, WORDS
from kvcanary.canaries.tokenizer import Tokenizer

MIN_LETTERS = 2048
"""The fewest words an alphabet may have: 11 bits per word, 66 bits in 6 words."""

MODERATION_BLOCKLIST = frozenset(
    {
        "raping", "hentai", "nudity", "cialis", "opioid", "herpes", "bikini", "thighs",
        "lovers", "kissed", "kisses", "chicks", "virgin", "sinful", "adults", "adulte",
        "adulti", "pistol", "rifles", "bullet", "shoots", "poison", "victim", "zombie",
        "demons", "stupid", "idiots", "losers", "insult", "racial", "ethnic", "mosque",
        "cigars", "whisky", "liquor",
    }
)  # fmt: skip
"""Words of the list that are sexual, violent, insulting, religious, drug or otherwise
loaded: a content filter may refuse or rewrite text holding them. (`canaries.make_words`
already drops words with blocked substrings; these are whole words that slipped through.)
At most 35, so the default alphabet keeps 3,445 words and 94 bits in 8 words."""


@dataclass(frozen=True, slots=True, eq=False)
class Alphabet:
    """The letters (words) canaries are spelled with, and what a word costs in tokens."""

    digits: npt.NDArray[np.int64]
    """The word-list digit (index into WORDS) of each letter, in word-list order."""
    word_tokens: int
    """Tokens of the costliest letter with its leading space, in the tokenizer it was
    chosen for (1 for the default alphabet, which assumes cl100k_base)."""
    alphabet_id: str
    position: npt.NDArray[np.int64]
    """For each word-list digit, its letter index in this alphabet, or -1."""

    @property
    def size(self) -> int:
        return len(self.digits)

    @property
    def words(self) -> tuple[str, ...]:
        return tuple(WORDS[d] for d in self.digits.tolist())

    def letter_of(self, word: str) -> int:
        """The letter index of `word`, or -1 when it is not in this alphabet."""
        digit = WORD_INDEX.get(word)
        return -1 if digit is None else int(self.position[digit])

    def describe(self) -> dict[str, object]:
        """What the journal records about the alphabet."""
        return {"alphabet_id": self.alphabet_id, "size": self.size, "word_tokens": self.word_tokens}


def make_alphabet(digits: npt.NDArray[np.int64], word_tokens: int) -> Alphabet:
    """The alphabet of these word-list digits (kept in word-list order)."""
    digits = np.sort(np.asarray(digits, dtype=np.int64))
    text = " ".join(WORDS[d] for d in digits.tolist()).encode("ascii")
    alphabet_id = hashlib.blake2b(text, digest_size=4, person=b"kvcanary-abc").hexdigest()
    position = np.full(len(WORDS), -1, dtype=np.int64)
    position[digits] = np.arange(len(digits), dtype=np.int64)
    return Alphabet(digits, word_tokens, alphabet_id, position)


_ALLOWED = np.array([word not in MODERATION_BLOCKLIST for word in WORDS], dtype=np.bool_)
assert _ALLOWED.sum() >= MIN_LETTERS

DEFAULT_ALPHABET = make_alphabet(np.flatnonzero(_ALLOWED), 1)
"""Every word of the list that passes the moderation blocklist: the cl100k_base alphabet."""

_CACHE: dict[tuple[str, int], Alphabet] = {}


def alphabet_for(tokenizer: Tokenizer) -> Alphabet:
    """The alphabet chosen for `tokenizer` (module docstring), measured once per tokenizer."""
    key = (tokenizer.name, tokenizer.vocab_size)
    alphabet = _CACHE.get(key)
    if alphabet is None:
        costs = canary_costs(tokenizer).words
        allowed_costs = np.sort(costs[_ALLOWED])
        word_tokens = int(allowed_costs[MIN_LETTERS - 1])
        chosen = np.flatnonzero(_ALLOWED & (costs <= word_tokens))
        alphabet = _CACHE[key] = make_alphabet(chosen, word_tokens)
    return alphabet

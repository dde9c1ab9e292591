"""Deterministic English filler of an exact token count, for the gaps between canaries.

A small grammar of everyday sentences ("The farmer carried the old lantern across the
bridge.") is expanded by a seeded `random.Random`, then cut to exactly the requested
number of tokens at a word boundary; a word that would overshoot is replaced by a
one-token connective (" and", " then", ...), or, in a vocabulary without one (byte-level),
by the costliest piece of a connective (" an", " a") or a full stop that fits. Every
snippet starts with a space and a capital letter and ends with a letter or punctuation,
so in cl100k_base (and any tokenizer that splits before spaces) its count adds exactly to
its neighbours'.

`Prose(tokenizer, seed).snippets(n)` is a fixed pool of variants per length, built on
first use; prompts draw from the pool. This module knows nothing about canaries.
"""

from __future__ import annotations

import random

from kvcanary.canaries.costs import count_in_context
from kvcanary.canaries.errors import CanaryError
from kvcanary.canaries.tokenizer import Tokenizer

NUM_VARIANTS = 16

# fmt: off
_WORDS = {
    "adj": [
        "quiet", "old", "narrow", "bright", "small", "distant", "gentle", "early", "patient",
        "careful", "northern", "western", "busy", "steady", "simple", "warm", "cold", "green",
        "silver", "wooden",
    ],
    "noun": [
        "river", "harbor", "garden", "village", "bridge", "lantern", "market", "station",
        "valley", "orchard", "library", "meadow", "window", "road", "forest", "kitchen",
        "tower", "island", "field", "letter",
    ],
    "who": [
        "the farmer", "the teacher", "the baker", "the sailor", "the gardener", "the traveler",
        "the clerk", "the painter", "my neighbor", "her brother", "our guide", "the old man",
    ],
    "did": [
        "carried", "painted", "repaired", "visited", "watched", "opened", "cleaned", "followed",
        "measured", "described",
    ],
    "went": ["waited", "rested", "wandered", "arrived", "listened", "returned", "paused", "worked"],
    "prep": ["near", "beside", "behind", "across", "along", "beyond", "under", "above", "toward"],
    "when": [
        "in the morning", "after the rain", "before noon", "every spring", "at dusk",
        "on Sunday", "later that week", "during the winter",
    ],
    "how": ["slowly", "quietly", "carefully", "happily", "often", "rarely", "gladly", "patiently"],
}
# fmt: on
_TEMPLATES = (
    "{who} {did} the {adj} {noun} {prep} the {noun}.",
    "{when}, {who} {went} {prep} the {adj} {noun}.",
    "The {noun} {prep} the {noun} was {adj} and {adj}.",
    "{who} {how} {did} a {adj} {noun}.",
    "We {went} by the {noun} until the {noun} looked {adj}.",
    "Nobody {did} the {noun} {when}.",
    "There was a {adj} {noun} {prep} the {noun}, and {who} {went} there.",
    "{who} said that the {noun} seemed {adj} {when}.",
)
_CONNECTIVES = (" and", " then", " so", " still", " now", " also", " there", " again")


class Prose:
    """Filler snippets of exact token counts in one tokenizer, from one seed."""

    def __init__(self, tokenizer: Tokenizer, seed: int) -> None:
        self._tokenizer = tokenizer
        self._seed = seed
        self._counts: dict[str, int] = {}
        self._pools: dict[int, list[str]] = {}
        self._connectives = [c for c in _CONNECTIVES if self._count(c) == 1]
        # a coarse vocabulary (byte-level) has no one-token word: pieces of words then fill
        # what is left, the costliest that fits first, so every remainder is reachable
        self._pads = sorted(
            {(self._count(p), p) for c in _CONNECTIVES for p in _prefixes(c)}, reverse=True
        )
        if not self._connectives and not any(cost == 1 for cost, _ in self._pads):
            raise CanaryError(f"tokenizer {tokenizer.name} has no one-token filler pieces")

    def _count(self, piece: str) -> int:
        count = self._counts.get(piece)
        if count is None:
            count = self._counts[piece] = count_in_context(self._tokenizer, piece)
        return count

    def snippets(self, num_tokens: int) -> list[str]:
        """NUM_VARIANTS snippets of exactly `num_tokens` tokens each ("" for 0)."""
        pool = self._pools.get(num_tokens)
        if pool is None:
            pool = self._pools[num_tokens] = [
                self._snippet(num_tokens, variant) for variant in range(NUM_VARIANTS)
            ]
        return pool

    def _snippet(self, num_tokens: int, variant: int) -> str:
        rng = random.Random(f"kvcanary-prose/{self._seed}/{num_tokens}/{variant}")
        pieces: list[str] = []
        remaining = num_tokens
        while remaining > 0:
            for piece in _sentence(rng):
                cost = self._count(piece)
                if cost > remaining and self._connectives:
                    piece, cost = rng.choice(self._connectives), 1
                elif cost > remaining:
                    cost, piece = next((c, p) for c, p in self._pads if c <= remaining)
                pieces.append(piece)
                remaining -= cost
                if remaining == 0:
                    break
        return "".join(pieces)


def _prefixes(connective: str) -> list[str]:
    """` a`, ` an`, ` and` for ` and`, and a full stop: the pads of a coarse vocabulary."""
    return [".", *(connective[:i] for i in range(2, len(connective) + 1))]


def _sentence(rng: random.Random) -> list[str]:
    """One sentence as space-led pieces: [" The", " farmer", ..., " bridge."]."""
    template = rng.choice(_TEMPLATES)
    text = template.format_map(_Slots(rng))
    text = text[0].upper() + text[1:]
    return [" " + word for word in text.split()]


class _Slots(dict[str, str]):
    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self._rng = rng

    def __missing__(self, slot: str) -> str:
        return self._rng.choice(_WORDS[slot])

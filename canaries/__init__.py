"""kvcanary: canaries — minting, tokenizers, exact-length prompts, streaming detection.

The public API, re-exported here: tokenizers (`Tokenizer`, `load_tokenizer`,
`RemoteTokenizer`), minting (`CanaryMinter`, `CanaryOrigin`), the canary shape
(`CANARY_PATTERN`), prompts (`build_prompt`, `BuiltPrompt`, `CanarySpan`), detection
(`CanaryIndex`, `StreamScanner`, `Hit`, `Owner`, `Relation`, `classify`, `redact`,
`fold`) and the one error type, `CanaryError`. Nothing here imports torch, the engine,
the harness or the tenants.

The names load on first use (PEP 562), so importing one light submodule, such as
`canaries.errors` (the exception tree every package imports), costs nothing more.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from canaries.errors import CanaryError as CanaryError
    from canaries.hit import Hit as Hit
    from canaries.hit import Owner as Owner
    from canaries.hit import Relation as Relation
    from canaries.hit import classify as classify
    from canaries.index import CanaryIndex as CanaryIndex
    from canaries.index import StreamScanner as StreamScanner
    from canaries.index import min_fragment_words as min_fragment_words
    from canaries.mint import CanaryMinter as CanaryMinter
    from canaries.mint import CanaryOrigin as CanaryOrigin
    from canaries.normalize import Folded as Folded
    from canaries.normalize import fold as fold
    from canaries.prompt import BuiltPrompt as BuiltPrompt
    from canaries.prompt import build_prompt as build_prompt
    from canaries.remote_tokenizer import RemoteTokenizer as RemoteTokenizer
    from canaries.shape import CANARY_PATTERN as CANARY_PATTERN
    from canaries.shape import TAG as TAG
    from canaries.shape import WORDS as WORDS
    from canaries.span import CanarySpan as CanarySpan
    from canaries.tokenizer import Tokenizer as Tokenizer
    from canaries.tokenizer import load_tokenizer as load_tokenizer

# Eager, and light (hashlib): a lazy `redact` would be shadowed by the submodule of the same
# name as soon as anything imports `canaries.redact` directly.
from canaries.redact import redact

_EXPORTS: dict[str, str] = {
    "CanaryError": "canaries.errors",
    "Hit": "canaries.hit",
    "Owner": "canaries.hit",
    "Relation": "canaries.hit",
    "classify": "canaries.hit",
    "CanaryIndex": "canaries.index",
    "StreamScanner": "canaries.index",
    "min_fragment_words": "canaries.index",
    "CanaryMinter": "canaries.mint",
    "CanaryOrigin": "canaries.mint",
    "Folded": "canaries.normalize",
    "fold": "canaries.normalize",
    "BuiltPrompt": "canaries.prompt",
    "build_prompt": "canaries.prompt",
    "RemoteTokenizer": "canaries.remote_tokenizer",
    "CANARY_PATTERN": "canaries.shape",
    "TAG": "canaries.shape",
    "WORDS": "canaries.shape",
    "CanarySpan": "canaries.span",
    "Tokenizer": "canaries.tokenizer",
    "load_tokenizer": "canaries.tokenizer",
}

__all__ = [
    "CANARY_PATTERN",
    "TAG",
    "WORDS",
    "BuiltPrompt",
    "CanaryError",
    "CanaryIndex",
    "CanaryMinter",
    "CanaryOrigin",
    "CanarySpan",
    "Folded",
    "Hit",
    "Owner",
    "Relation",
    "RemoteTokenizer",
    "StreamScanner",
    "Tokenizer",
    "build_prompt",
    "classify",
    "fold",
    "load_tokenizer",
    "min_fragment_words",
    "redact",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'canaries' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

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
    from kvcanary.canaries.errors import CanaryError as CanaryError
    from kvcanary.canaries.hit import Hit as Hit
    from kvcanary.canaries.hit import Owner as Owner
    from kvcanary.canaries.hit import Relation as Relation
    from kvcanary.canaries.hit import classify as classify
    from kvcanary.canaries.index import CanaryIndex as CanaryIndex
    from kvcanary.canaries.index import StreamScanner as StreamScanner
    from kvcanary.canaries.index import min_fragment_words as min_fragment_words
    from kvcanary.canaries.mint import CanaryMinter as CanaryMinter
    from kvcanary.canaries.mint import CanaryOrigin as CanaryOrigin
    from kvcanary.canaries.normalize import Folded as Folded
    from kvcanary.canaries.normalize import fold as fold
    from kvcanary.canaries.prompt import BuiltPrompt as BuiltPrompt
    from kvcanary.canaries.prompt import build_prompt as build_prompt
    from kvcanary.canaries.remote_tokenizer import RemoteTokenizer as RemoteTokenizer
    from kvcanary.canaries.shape import CANARY_PATTERN as CANARY_PATTERN
    from kvcanary.canaries.shape import TAG as TAG
    from kvcanary.canaries.shape import WORDS as WORDS
    from kvcanary.canaries.span import CanarySpan as CanarySpan
    from kvcanary.canaries.tokenizer import Tokenizer as Tokenizer
    from kvcanary.canaries.tokenizer import load_tokenizer as load_tokenizer

# Eager, and light (hashlib): a lazy `redact` would be shadowed by the submodule of the same
# name as soon as anything imports `canaries.redact` directly.
from kvcanary.canaries.redact import redact

_EXPORTS: dict[str, str] = {
    "CanaryError": "kvcanary.canaries.errors",
    "Hit": "kvcanary.canaries.hit",
    "Owner": "kvcanary.canaries.hit",
    "Relation": "kvcanary.canaries.hit",
    "classify": "kvcanary.canaries.hit",
    "CanaryIndex": "kvcanary.canaries.index",
    "StreamScanner": "kvcanary.canaries.index",
    "min_fragment_words": "kvcanary.canaries.index",
    "CanaryMinter": "kvcanary.canaries.mint",
    "CanaryOrigin": "kvcanary.canaries.mint",
    "Folded": "kvcanary.canaries.normalize",
    "fold": "kvcanary.canaries.normalize",
    "BuiltPrompt": "kvcanary.canaries.prompt",
    "build_prompt": "kvcanary.canaries.prompt",
    "RemoteTokenizer": "kvcanary.canaries.remote_tokenizer",
    "CANARY_PATTERN": "kvcanary.canaries.shape",
    "TAG": "kvcanary.canaries.shape",
    "WORDS": "kvcanary.canaries.shape",
    "CanarySpan": "kvcanary.canaries.span",
    "Tokenizer": "kvcanary.canaries.tokenizer",
    "load_tokenizer": "kvcanary.canaries.tokenizer",
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

"""kvcanary: canaries — minting, tokenizers, exact-length prompts, streaming detection.

The public API, re-exported here: tokenizers (`Tokenizer`, `load_tokenizer`,
`RemoteTokenizer`), minting (`CanaryMinter`, `CanaryOrigin`), the canary shape
(`CANARY_PATTERN`), prompts (`build_prompt`, `BuiltPrompt`, `CanarySpan`), detection
(`CanaryIndex`, `StreamScanner`, `Hit`, `Owner`, `Relation`, `classify`, `redact`,
`fold`) and the one error type, `CanaryError`. Nothing here imports torch, the engine,
the harness or the tenants.
"""

from canaries.errors import CanaryError
from canaries.hit import Hit, Owner, Relation, classify
from canaries.index import CanaryIndex, StreamScanner, min_fragment_words
from canaries.mint import CanaryMinter, CanaryOrigin
from canaries.normalize import Folded, fold
from canaries.prompt import BuiltPrompt, build_prompt
from canaries.redact import redact
from canaries.remote_tokenizer import RemoteTokenizer
from canaries.shape import CANARY_PATTERN, TAG, WORDS
from canaries.span import CanarySpan
from canaries.tokenizer import Tokenizer, load_tokenizer

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
